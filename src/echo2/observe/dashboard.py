"""The learner's read-only view for people: a live web dashboard and a Prometheus endpoint.

    GET /              the dashboard page (``static/dashboard.html``: no external assets, works offline)
    GET /api/state     NodeStatus.state() as JSON: what the page draws, polled every 1.5 s
    GET /metrics       Prometheus text format (prometheus-client), from the same snapshot

Every viewer and every scrape is served from one snapshot taken at most once a second
(``STATE_MAX_AGE_S``, under the page's polling period): building it reads every member on the thread
that serves the fleet, so what viewers cost that thread stays one snapshot a second however many pages
are open or scrapers poll, and it is built in slices with the thread free between them. The scrape's
text, megabytes at 10,000 members, is written once a snapshot on a thread of its own
(``benchmarks/fleet.py --study viewers``).

It is served on its own port (``runtime.dashboard_port``; 0 = any free port; ``runtime.dashboard =
false`` turns it off), bound to loopback by default (``runtime.dashboard_host``). Bound anywhere
else it asks for the run's view credential (``<run_dir>/view_token``, owner-only), as
``Authorization: Bearer <token>`` or ``?token=``.
A view token only reads: nothing here changes the run, and the worker API's credentials are not
accepted (a worker cannot read the pool, nor a viewer act as a worker).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from importlib import resources
from typing import Any, Protocol, TypeVar

import orjson
from aiohttp import web

from echo2.observe import catalog
from echo2.observe.catalog import Prom

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "::1", "localhost")
PAGE = "dashboard.html"
T = TypeVar("T")
STATE_MAX_AGE_S = 1.0  # a snapshot serves every request this long (the page polls every 1.5 s)


class StatusSource(Protocol):
    """What the dashboard reads: the node's status snapshot (``runtime/status.py: NodeStatus``)."""

    staleness_counts: list[int]  # steps by their max staleness 0..S
    staleness_sum: int  # sum of every step's max staleness

    async def state_sliced(self) -> dict[str, Any]: ...  # its state(), the event loop free between slices


def needs_token(host: str) -> bool:
    """A dashboard bound beyond loopback is not open to whoever reaches the port."""
    return host not in LOOPBACK


@dataclass(frozen=True)
class Taken:
    """One snapshot: the state, its JSON, and the staleness histogram as they were when it was taken
    (nothing in it is the node's live structures: a thread may read it while the node goes on)."""

    state: dict[str, Any]
    json: bytes
    staleness_counts: tuple[int, ...]
    staleness_sum: int
    build: int
    at: float  # the snapshot clock's reading when it was begun


class Snapshot:
    """The newest state of ``status`` and its JSON, taken again only once ``max_age_s`` has passed since
    the last (0: at every request), so requests in between cost no member's read; taken in slices
    (``state_sliced``), so the thread that serves the fleet is free between them, and shared by the
    requests that arrive while it is taken. And that snapshot's Prometheus exposition, written once for
    every scrape of it, on a thread of its own (at 10,000 members it is megabytes of text)."""

    def __init__(
        self, status: StatusSource, max_age_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.status, self.max_age_s, self.clock = status, max_age_s, clock
        self.builds = 0  # snapshots taken (the test and the benchmark read it)
        self.expositions = 0  # expositions written
        self._taken: Taken | None = None
        self._taking: asyncio.Future[Taken] | None = None
        self._exposition: tuple[int, asyncio.Future[bytes]] | None = None

    async def get(self) -> Taken:
        now = self.clock()
        if self._taken is not None and now - self._taken.at < self.max_age_s:
            return self._taken
        if self._taking is None:
            self._taking = _shared(self._take(now))
        taking = self._taking
        return await asyncio.shield(taking)  # a request that goes away leaves it to the others

    async def _take(self, now: float) -> Taken:
        try:
            state = await self.status.state_sliced()
            self.builds += 1
            self._taken = Taken(
                state,
                orjson.dumps(state, option=orjson.OPT_NON_STR_KEYS),  # NaN and inf as null: valid JSON
                tuple(self.status.staleness_counts),
                self.status.staleness_sum,
                self.builds,
                now,
            )
            return self._taken
        finally:
            self._taking = None

    async def exposition(self) -> bytes:
        """The newest snapshot's ``/metrics`` text; scrapes of one snapshot share one writing."""
        taken = await self.get()
        if self._exposition is None or self._exposition[0] != taken.build:
            self.expositions += 1
            self._exposition = (taken.build, _shared(asyncio.to_thread(_exposition, taken)))
        return await asyncio.shield(self._exposition[1])


class Dashboard:
    def __init__(
        self,
        status: StatusSource,
        view_token: str | None,
        max_age_s: float = STATE_MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.status = status
        self.view_token = view_token  # None: loopback only, no credential asked
        self.page = resources.files("echo2.observe").joinpath("static", PAGE).read_text(encoding="utf-8")
        self.snapshot = Snapshot(status, max_age_s, clock)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.add_routes(
            [
                web.get("/", self.index),
                web.get("/api/state", self.state),
                web.get("/metrics", self.metrics),
            ]
        )
        return app

    async def serve(self, host: str, port: int) -> tuple[web.AppRunner, int]:
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        return runner, int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        if self.view_token is not None:
            header = request.headers.get("Authorization", "")
            given = header[7:].strip() if header.startswith("Bearer ") else request.query.get("token", "")
            if not hmac.compare_digest(given.encode(), self.view_token.encode()):
                raise web.HTTPUnauthorized(text="the dashboard needs the run's view token (view_token)")
        return await handler(request)

    async def index(self, request: web.Request) -> web.Response:
        return web.Response(text=self.page, content_type="text/html")

    async def state(self, request: web.Request) -> web.Response:
        return web.Response(body=(await self.snapshot.get()).json, content_type="application/json")

    async def metrics(self, request: web.Request) -> web.Response:
        from prometheus_client.exposition import CONTENT_TYPE_LATEST

        body = await self.snapshot.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _shared(work: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
    """``work`` as a task several requests may await; a failure nobody waited for is not reported as
    never retrieved (each request that waits gets it)."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


def _exposition(taken: Taken) -> bytes:
    """``taken`` in the Prometheus text format (prometheus-client)."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(taken))
    return generate_latest(registry)


class _Collector:
    """prometheus-client custom collector over one snapshot (the one the page reads too), so a scrape
    and the dashboard never disagree and nothing is counted per step. Every family's name, kind, help
    and labels come from the metrics catalog (``catalog.py``)."""

    def __init__(self, taken: Taken) -> None:
        self.taken = taken

    def collect(self) -> Iterator[Any]:
        st = self.taken.state
        yield from _learner_metrics(st, self.taken)
        yield from _store_metrics(st)
        yield from _pool_metrics(st)
        yield from _broadcast_metrics(st)


def _family(p: Prom, **kw: Any) -> Any:
    """An empty metric family for ``p`` (a histogram takes its ``buckets`` and ``sum_value`` here)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    kind = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily, "histogram": HistogramMetricFamily}
    return kind[p.kind](p.name, p.help, labels=list(p.labels) if p.labels else None, **kw)


def _gauge(p: Prom, value: Any) -> Any:
    g = _family(p)
    if value is not None:
        g.add_metric([], float(value))
    return g


def _counter(p: Prom, value: Any) -> Any:
    c = _family(p)
    c.add_metric([], float(value))
    return c


def _learner_metrics(st: dict[str, Any], taken: Taken) -> Iterator[Any]:
    ln = st["learner"]
    yield _gauge(catalog.LEARNER_VERSION.exported, ln["version"])
    yield _gauge(catalog.LEARNER_STEP_WALL_S.exported, ln["step_s"])
    yield _gauge(catalog.LEARNER_T_TRAIN_S.exported, ln["t_train_s"])
    yield _gauge(catalog.LEARNER_BUBBLE_RATIO.exported, ln["bubble_ratio"])
    yield _counter(catalog.LEARNER_UPDATE_S.exported, ln["update_s"])
    idle = _family(catalog.LEARNER_IDLE_S.exported)
    for cause, s in ln["idle_s"].items():
        idle.add_metric([cause], s)
    yield idle
    buckets, cum = [], 0
    for le, n in enumerate(taken.staleness_counts):
        cum += n
        buckets.append((str(le), cum))
    buckets.append(("+Inf", cum))
    yield _family(catalog.STORE_STALENESS_MAX.exported, buckets=buckets, sum_value=taken.staleness_sum)


def _store_metrics(st: dict[str, Any]) -> Iterator[Any]:
    store = st["store"]  # the last record's store/ keys, without the prefix
    yield _gauge(catalog.STORE_SIZE.exported, store.get("size"))
    yield _gauge(catalog.STORE_HELD.exported, store.get("held"))
    yield _gauge(catalog.SECURITY_CHECK_BACKLOG.exported, st.get("security", {}).get("check_backlog"))
    for m in (catalog.STORE_ADMITTED, catalog.STORE_DROPPED_STALE):
        yield _counter(m.exported, store.get(m.key.split("/", 1)[1], 0))
    rejected = catalog.STORE_REJECTED_BY
    prefix = rejected.prefix.split("/", 1)[1]  # rejected/
    rej = _family(rejected.exported)
    for key, n in store.items():
        if key.startswith(prefix):
            rej.add_metric([key.removeprefix(prefix)], float(n))
    yield rej


def _pool_metrics(st: dict[str, Any]) -> Iterator[Any]:
    pool = st["pool"]
    yield _gauge(catalog.POOL_ACTIVE_WORKERS.exported, pool["active"])
    yield _gauge(catalog.POOL_MU_POOL.exported, pool["mu_pool"])
    yield _gauge(catalog.POOL_MU_TARGET.exported, pool["mu_target"])
    yield _gauge(catalog.PLANNER_N_MIN.prom, pool[catalog.PLANNER_N_MIN.field])
    yield _gauge(catalog.COST_USD_PER_HOUR.exported, st["cost"]["usd_per_hour"])
    yield _gauge(catalog.COST_USD_TOTAL.exported, st["cost"]["usd_total"])
    families = {x.field: _family(x.prom) for x in catalog.WORKER_GAUGES}  # state field -> family
    for w in pool["workers"]:
        values = {**w, "active": 1.0 if w["state"] == "active" else 0.0}
        for key, fam in families.items():
            value = values[key]
            fam.add_metric(
                [w["worker_id"], w["name"], w["hardware"]], math.nan if value is None else float(value)
            )
    yield from families.values()


def _broadcast_metrics(st: dict[str, Any]) -> Iterator[Any]:
    b = st["broadcast"]
    yield _gauge(catalog.BROADCAST_VERSION.prom, b[catalog.BROADCAST_VERSION.field])
    yield _gauge(catalog.BROADCAST_INSTALLED.prom, b.get(catalog.BROADCAST_INSTALLED.field))
    yield _gauge(catalog.BROADCAST_PUBLICATION_BYTES.exported, b.get("bytes"))
    yield _gauge(catalog.BROADCAST_FULL_BYTES.exported, b.get("full_bytes"))
    yield _gauge(catalog.BROADCAST_BYTES.exported, b.get("learner_bytes"))
    yield _gauge(catalog.BROADCAST_T_BCAST_S.exported, b.get("t_bcast_s"))
