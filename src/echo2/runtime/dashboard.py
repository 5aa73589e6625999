"""The learner's read-only view for people: a live web dashboard and a Prometheus endpoint.

    GET /              the dashboard page (``static/dashboard.html``: no external assets, works offline)
    GET /api/state     NodeStatus.state() as JSON: what the page draws, polled every second
    GET /metrics       Prometheus text format (prometheus-client), from the same snapshot

It is served on its own port (``runtime.dashboard_port``; 0 = any free port; ``runtime.dashboard =
false`` turns it off), bound to loopback by default (``runtime.dashboard_host``). Bound anywhere
else it asks for the run's view credential (``<run_dir>/view_token``, owner-only), as
``Authorization: Bearer <token>`` or ``?token=``.
A view token only reads: nothing here changes the run, and the worker API's credentials are not
accepted (a worker cannot read the pool, nor a viewer act as a worker).
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable, Iterator
from importlib import resources
from typing import Any

from aiohttp import web

from echo2.runtime.status import NodeStatus

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "::1", "localhost")
PAGE = "dashboard.html"


def needs_token(host: str) -> bool:
    """A dashboard bound beyond loopback is not open to whoever reaches the port."""
    return host not in LOOPBACK


class Dashboard:
    def __init__(self, status: NodeStatus, view_token: str | None) -> None:
        self.status = status
        self.view_token = view_token  # None: loopback only, no credential asked
        self.page = resources.files("echo2.runtime").joinpath("static", PAGE).read_text(encoding="utf-8")
        self.registry = _prometheus_registry(status)

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
        return web.Response(
            text=json.dumps(self.status.state(), allow_nan=False), content_type="application/json"
        )

    async def metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import generate_latest
        from prometheus_client.exposition import CONTENT_TYPE_LATEST

        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _prometheus_registry(status: NodeStatus) -> Any:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(status))
    return registry


class _Collector:
    """prometheus-client custom collector: every sample comes from one ``NodeStatus.state()`` taken at
    scrape time, so a scrape and the dashboard never disagree and nothing is counted per step."""

    def __init__(self, status: NodeStatus) -> None:
        self.status = status

    def collect(self) -> Iterator[Any]:
        st = self.status.state()
        yield from _learner_metrics(st, self.status)
        yield from _store_metrics(st)
        yield from _pool_metrics(st)
        yield from _broadcast_metrics(st)


def _gauge(name: str, doc: str, value: Any, labels: dict[str, str] | None = None) -> Any:
    from prometheus_client.core import GaugeMetricFamily

    g = GaugeMetricFamily(name, doc, labels=list(labels or {}))
    if value is not None:
        g.add_metric(list((labels or {}).values()), float(value))
    return g


def _learner_metrics(st: dict[str, Any], status: NodeStatus) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    ln = st["learner"]
    yield _gauge("echo2_learner_version", "policy version v_t", ln["version"])
    yield _gauge("echo2_learner_step_seconds", "wall seconds of the last learner step", ln["step_s"])
    yield _gauge("echo2_learner_train_seconds", "seconds of the last update (T_train)", ln["t_train_s"])
    yield _gauge(
        "echo2_learner_bubble_ratio", "1 - update seconds / wall seconds of the loop", ln["bubble_ratio"]
    )
    c = CounterMetricFamily("echo2_learner_update_seconds", "seconds inside updates")
    c.add_metric([], ln["update_s"])
    yield c
    idle = CounterMetricFamily(
        "echo2_learner_idle_seconds", "seconds not updating, by cause", labels=["cause"]
    )
    for cause, s in ln["idle_s"].items():
        idle.add_metric([cause], s)
    yield idle
    buckets, cum = [], 0
    for le, n in enumerate(status.staleness_counts):
        cum += n
        buckets.append((str(le), cum))
    buckets.append(("+Inf", cum))
    yield HistogramMetricFamily(
        "echo2_staleness",
        "max staleness Delta(t) of each step's batch",
        buckets=buckets,
        sum_value=status.staleness_sum,
    )


def _store_metrics(st: dict[str, Any]) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily

    store = st["store"]
    yield _gauge("echo2_store_size", "buffered admissible trajectories", store.get("size"))
    for key in ("admitted", "dropped_stale"):
        c = CounterMetricFamily(f"echo2_store_{key}", f"trajectories {key.replace('_', ' ')}")
        c.add_metric([], float(store.get(key, 0)))
        yield c
    rej = CounterMetricFamily("echo2_store_rejected", "requests refused, by reason", labels=["reason"])
    for key, n in store.items():
        if key.startswith("rejected/"):
            rej.add_metric([key.split("/", 1)[1]], float(n))
    yield rej


def _pool_metrics(st: dict[str, Any]) -> Iterator[Any]:
    from prometheus_client.core import GaugeMetricFamily

    pool = st["pool"]
    yield _gauge("echo2_pool_active_workers", "workers the controller has active", pool["active"])
    yield _gauge("echo2_pool_mu_pool", "measured rollouts/s of the active pool", pool["mu_pool"])
    yield _gauge("echo2_pool_mu_target", "gamma * mu_min (rollouts/s)", pool["mu_target"])
    yield _gauge("echo2_planner_n_min", "N_min = ceil(mu_min / mean mu_i)", pool["n_min"])
    yield _gauge("echo2_cost_usd_per_hour", "learner + active workers, $/h", st["cost"]["usd_per_hour"])
    yield _gauge("echo2_cost_usd", "dollars spent so far", st["cost"]["usd_total"])
    per_worker = {  # state key -> (metric, help)
        "active": ("echo2_worker_active", "1 if the controller has the worker active"),
        "installed_version": ("echo2_worker_installed_version", "newest installed snapshot"),
        "install_s": ("echo2_worker_install_seconds", "seconds the worker's last install took"),
        "mu": ("echo2_worker_rollouts_per_second", "measured mu_i"),
        "usd_per_hour": ("echo2_worker_usd_per_hour", "price c_i"),
        "rollouts": ("echo2_worker_rollouts_admitted", "trajectories admitted"),
    }
    labels = ["worker", "name", "hardware"]
    families = {k: GaugeMetricFamily(name, doc, labels=labels) for k, (name, doc) in per_worker.items()}
    for w in pool["workers"]:
        values = {**w, "active": 1.0 if w["state"] == "active" else 0.0}
        for key, fam in families.items():
            fam.add_metric([w["worker_id"], w["name"], w["hardware"]], float(values[key]))
    yield from families.values()


def _broadcast_metrics(st: dict[str, Any]) -> Iterator[Any]:
    b = st["broadcast"]
    yield _gauge("echo2_broadcast_version", "newest published snapshot version", b["version"])
    yield _gauge("echo2_broadcast_installed_workers", "workers that installed it so far", b.get("installed"))
    yield _gauge(
        "echo2_broadcast_bytes", "bytes of the newest publication (an anchor or a patch)", b.get("bytes")
    )
    yield _gauge(
        "echo2_broadcast_full_bytes", "bytes of a full snapshot in the publication dtype", b.get("full_bytes")
    )
    yield _gauge("echo2_broadcast_learner_bytes", "bytes the learner uploaded for it", b.get("learner_bytes"))
    yield _gauge("echo2_broadcast_t_bcast_seconds", "last measured T_bcast", b.get("t_bcast_s"))
