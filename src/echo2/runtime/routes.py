"""The learner node's HTTP API (aiohttp): thin adapters from ``echo2.protocol`` requests to the parts.

Each handler authenticates (the registry), parses its request model, asks one part (registry, pool,
lease broker, intake, snapshots) and returns its reply model. What a worker says it has installed (a
heartbeat's version; the version a granted lease was asked for) goes to the registry's one writer,
``WorkerRegistry.installed``. The handlers run on the learner's event loop thread, the only thread
that touches the store.

The rule for a peer's bytes: never a 500. Every refusal is a 4xx in the :class:`~echo2.protocol.ErrorReply`
JSON shape (or, where no answer can reach the peer, a dropped connection), counted by reason
(``store/rejected/<reason>``), and a hostile identity costs only its own work:

- credential: missing 401 ``auth``; unknown 403 ``auth``; revoked 403 ``quarantined``; retired for
  silence 403 ``retired`` (``runtime/members.py``: registration slots);
- requests: each identity's authenticated requests pass a token bucket of ``security.max_requests_per_s``
  refilled per second, holding ``BURST_S`` seconds of it (bursts of twice the rate); past it 429
  ``rate_limited`` with a ``Retry-After`` header (whole seconds, at least 1);
- bodies: read within ``security.body_timeout_s`` (else 408 ``slow_body``, and the connection closes);
  at most ``runtime.max_request_mb`` (413 ``oversized``); JSON through one parser (pydantic's, for every
  endpoint: a nesting deeper than its recursion limit, a lone surrogate, an integer too long to convert
  are 400 ``malformed``); a model's broken field 422 naming it; a body whose framing breaks mid-way
  400 ``bad_http``; a connection lost before its body arrived is counted ``dropped``;
- registration: a join token (401/403 ``auth``), a free slot (403 ``registration_cap``) and an identity
  left of the token's budget (403 ``identity_budget``) first, then a
  price within ``[security.min_usd_per_hour, security.max_usd_per_hour]`` (422 ``invalid_price``) and a
  claimed rate at most ``security.max_rollouts_per_s`` (422 ``invalid_rate``);
- snapshot chains (``GET /v1/snapshot``): each link's bytes are booked to (identity, link version) under
  the broadcast port's byte budget (``broadcast.access.ByteBudget``: ``SERVE_BUDGET`` x the version's
  size + ``BUDGET_SLACK_CHUNKS`` chunks); a chain that does not fit is 429 ``over_budget`` before a byte
  is streamed (a new version brings a new budget; retrying the same one does not); a LoRA run's base is
  the first link of that chain (``?base=0``), booked like any link;
- aiohttp's own refusals: a body over the limit 413 ``oversized``, an unknown route 404 ``not_found``,
  a method 405 ``method``, and what its HTTP parser refuses before any handler runs (a NUL byte or an
  over-long line in a header, Content-Length with Transfer-Encoding, a bad request line or chunk size)
  400 ``bad_http``, all in the same JSON shape (the parser's through :class:`JsonRefusals`).

Every peer string that reaches a log line goes through ``%r`` and every one that reaches a reply is
escaped (:func:`http.clean`), so neither a lone surrogate nor a control character can break either.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from echo2.broadcast.access import BUDGET_SLACK_CHUNKS, SERVE_BUDGET, ByteBudget
from echo2.config import SecurityConfig
from echo2.data.store import TrajectoryStore
from echo2.data.submission import M, Rejected, parse_model
from echo2.logs import SampledLog
from echo2.perimeter import Limits, Perimeter, RequestRate, port_limits
from echo2.protocol import (
    API,
    VERSION_HEADER,
    ErrorReply,
    HeartbeatReply,
    HeartbeatRequest,
    LeaseGrant,
    LeaseRefusal,
    LeaseRequest,
    ModelReply,
    RegisterReply,
    RegisterRequest,
    SubmitReply,
    SubmitRequest,
    VersionReply,
    WorkerSettings,
)
from echo2.resources import descriptor_limits
from echo2.runtime import http
from echo2.runtime.intake import Intake
from echo2.runtime.leases import LeaseBroker
from echo2.runtime.members import WorkerRecord, WorkerRegistry
from echo2.runtime.pool import Pool
from echo2.runtime.snapshots import Snapshots
from echo2.weights.chain import chain_parts
from echo2.weights.publication import Link

log = logging.getLogger(__name__)

BURST_S = 2.0  # a token bucket holds this many seconds of security.max_requests_per_s (bursts of twice it)
REGISTER_MAX_BYTES = 4 << 10  # a registration's body (a name, a price, a description) is read up to this
FRONT_KEEPALIVE_S = 300.0  # a front's idle link to this process stays open this long (its pool reuses it)
FRONT_BACKLOG = 1024  # the unix socket's listen backlog (a front holds at most 132 connections to it)
FRONT_BATCH_BYTES = 8 << 20  # the most a front's batch may hold (512 requests of 4 KiB: under 3 MiB)
MAX_FRONT_COUNT = 1_000_000  # refusals of one reason a front may report in one batch
_BAD_BATCH = (orjson.JSONDecodeError, KeyError, TypeError, ValueError)  # a front's batch it cannot read
OFF_LOOP_BYTES = 64 << 10  # a request body past this is parsed in a worker thread, off the event loop
# a request's key for the record its bearer credential named (the middleware's lookup; None: none)
RECORD = web.RequestKey("echo2_record", WorkerRecord | None)
VOUCHED = web.RequestKey("echo2_vouched", bool)  # a fronted request authenticated (http.VOUCH_HEADER)


@dataclass(frozen=True)
class Identity:
    """What the learner tells a worker about itself at registration."""

    settings: WorkerSettings  # the part of the run's config a worker needs
    public_key: str  # manifest verification key, ``key_from_text`` form
    broadcast: tuple[str, int]  # where the broadcast plane listens
    skeleton: dict[str, str]  # model config + tokenizer files (no weights)


class Routes:
    def __init__(
        self,
        registry: WorkerRegistry,
        pool: Pool,
        broker: LeaseBroker,
        intake: Intake,
        snapshots: Snapshots,
        store: TrajectoryStore,
        identity: Identity,
        max_request_bytes: int,
        security: SecurityConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        perimeter: Limits | None = None,
    ) -> None:
        self.registry, self.pool, self.broker, self.intake = registry, pool, broker, intake
        self.snapshots, self.store, self.identity = snapshots, store, identity
        self.max_request_bytes = max_request_bytes
        self.security = sec = security or SecurityConfig()
        self.rate = RequestRate(sec.max_requests_per_s, BURST_S * sec.max_requests_per_s, clock)
        # the API port's connections, deadlines and per-address rates before anyone is known
        limits = perimeter or port_limits(sec.perimeter, descriptor_limits()[0])
        self.perimeter = Perimeter("api", limits, clock)
        self.budget = ByteBudget()  # snapshot-chain bytes sent per (identity, link version)
        # copies of each served object per (object, identity[, version]); the join token's, together
        self.copies: dict[tuple[str, ...], int] = {}
        self.token_budget = http.CopyBudget(sec.max_workers, sec.token_copies_per_hour, clock)
        self._model_reply = ModelReply(files=identity.skeleton).model_dump_json().encode()
        self._sampled = SampledLog(log, http.LOG_EVERY_S, clock)  # refusals a stranger can repeat at will
        self.fronted = False  # served by fronts (runtime/front.py) on a unix socket: serve_internal
        self._fronts: dict[str, dict[str, float]] = {}  # front -> its perimeter's metrics, as last told

    def app(self, max_bytes: int | None = None) -> web.Application:
        """The API's application (its largest body ``max_bytes``, else ``max_request_bytes``)."""
        app = web.Application(
            client_max_size=max_bytes or self.max_request_bytes, middlewares=[self._count_errors, self._gate]
        )
        app.add_routes(
            [
                web.post(f"{API}/register", self.register),
                web.post(f"{API}/heartbeat", self.heartbeat),
                web.post(f"{API}/lease", self.lease),
                web.post(f"{API}/submit", self.submit),
                web.get(f"{API}/version", self.version),
                web.get(f"{API}/snapshot", self.snapshot),
                web.get(f"{API}/model", self.model),
            ]
        )
        return app

    async def serve(
        self, host: str, port: int, ssl_context: ssl.SSLContext | None = None
    ) -> tuple[web.AppRunner, int]:
        """Serve on ``host:port`` (0 = any free port), over TLS with ``ssl_context`` (the run's
        certificate, ``echo2.transport``; None = plain HTTP), every connection through the port's
        perimeter (``echo2/perimeter.py``); returns the runner (``cleanup()`` stops it) and the bound
        port."""
        runner = http.Runner(
            self.app(),
            self.store.record_rejection,
            access_log=None,
            keepalive_timeout=self.security.perimeter.idle_s,
            max_field_size=http.MAX_HEADER_FIELD,
            max_headers=http.MAX_HEADERS,
        )
        await runner.setup()
        site = http.PerimeterSite(runner, host, port, ssl_context, self.perimeter)
        await site.start()
        return runner, site.port

    async def serve_internal(self, path: str) -> web.AppRunner:
        """Serve the API to its fronts (``runtime/front.py``: the processes that hold the public port,
        its TLS, its perimeter and its HTTP parsing) on the unix socket ``path``, in a directory only
        this user may enter: the same handlers, the peer's address and the perimeter's vouching passed
        by header (``http.PEER_HEADER``, ``VOUCH_HEADER``, ``CLOSE_HEADER``), and the fronts' batches of
        heartbeats and lease requests (:meth:`batch`). Returns the runner (``cleanup()`` stops it)."""
        self.fronted = True
        app = self.app(max(self.max_request_bytes, FRONT_BATCH_BYTES))  # a front reads a peer's limit
        app.router.add_post(http.FRONT_BATCH, self.batch)
        app.router.add_get(http.FRONT_AUTH, self.credential)
        app.on_response_prepare.append(_mark_vouched)
        runner = http.Runner(
            app, self.store.record_rejection, access_log=None, keepalive_timeout=FRONT_KEEPALIVE_S
        )
        await runner.setup()
        await web.UnixSite(runner, path, backlog=FRONT_BACKLOG).start()
        os.chmod(path, 0o600)
        return runner

    def perimeter_metrics(self) -> dict[str, float]:
        """``perimeter/api/``: this process's perimeter, or the sum of its fronts' as they last told."""
        total = self.perimeter.metrics()  # fronted: the requests it refused by address alone
        if not self.fronted:
            return total
        for metrics in self._fronts.values():
            for key, value in metrics.items():
                total[key] = total.get(key, 0.0) + value
        return total

    async def batch(self, request: web.Request) -> web.Response:
        """``POST /internal/batch`` from a front: ``{"front", "items": [[kind, credential or null, peer
        address, body (base64)], ...], "refused": {reason: count}, "perimeter": {metric: value}}``, each
        item a peer's ``POST /v1/heartbeat`` or ``POST /v1/lease`` (``kind``) answered as the route would
        (``_gate``, ``_auth``, the handler; refusals counted here by reason), in order: ``{"items":
        [[status, body, Retry-After or null, vouch, close], ...]}``. The front's own refusals (malformed
        HTTP, slow bodies, ...) are counted here too, and its perimeter's metrics kept for
        ``perimeter_metrics``."""
        try:
            batch = orjson.loads(await request.read())
            front, items = str(batch["front"]), batch["items"]
            refused, metrics = dict(batch.get("refused", {})), dict(batch.get("perimeter", {}))
        except _BAD_BATCH as exc:  # a front's bug, never a peer's
            return http.reply(ErrorReply(error="malformed", detail=f"front batch: {exc}"), 400)
        for reason, count in refused.items():
            self.store.record_rejection(str(reason), min(int(count), MAX_FRONT_COUNT))
        self._fronts[front] = {str(k): float(v) for k, v in metrics.items()}
        out = [self._item(*item) for item in items]
        return web.Response(body=orjson.dumps({"items": out}), content_type="application/json")

    async def credential(self, request: web.Request) -> web.Response:
        """``GET /internal/auth`` from a front: 204 if the request's credential may ask now (``_auth``),
        before the front reads a large body for it; else the refusal."""
        self._auth(request)
        return web.Response(status=204)

    def _item(self, kind: str, credential: str | None, peer: str, body: str) -> list[Any]:
        """One request of a front's batch: ``[status, body, Retry-After or None, vouch, close]``."""
        vouch = False
        try:
            rec = self._admit(credential, peer)
            vouch = rec is not None and rec.trusted
            rec = self._authorized(rec, credential is not None)
            raw = base64.b64decode(body)
            reply: HeartbeatReply | LeaseGrant | LeaseRefusal
            if kind == "heartbeat":
                reply = self._beat(rec, _parse(HeartbeatRequest, raw))
            elif kind == "lease":
                reply = self._grant(rec, _parse(LeaseRequest, raw))
            else:  # a front's bug
                raise http.error(web.HTTPNotFound, "not_found", f"no batched request {kind!r}")
            return [200, reply.model_dump_json(), None, vouch, False]
        except web.HTTPException as exc:
            self._count(exc, f"POST {API}/{kind!r} from {peer}")
            close = bool(getattr(exc, "echo2_close", False))
            return [exc.status, exc.text, exc.headers.get("Retry-After"), vouch, close]

    # ---- handlers ----------------------------------------------------------------------------------
    async def register(self, request: web.Request) -> web.Response:
        """Enrol a worker: the join token (``Authorization: Bearer <token>``) is checked before a byte of
        the body is read, and the body (a name, a price) is read only up to ``REGISTER_MAX_BYTES``. A
        registration sent again (its ``attempt`` seen: the reply was late or lost) gets its identity back
        before the slots and the identity budget are asked, since it spends neither."""
        token = http.bearer(request)
        if token is None:
            raise http.error(
                web.HTTPUnauthorized,
                "auth",
                "register needs the run's join token (Authorization: Bearer <join token>)",
                close=True,
            )
        if not self.registry.token_ok(token):
            raise http.error(web.HTTPForbidden, "auth", "wrong join token", close=True)
        self._vouch(request)
        req = _parse(RegisterRequest, await self._body(request, REGISTER_MAX_BYTES))
        again = self.registry.retried(req)  # sent again after a late or lost reply: the same identity
        if again is not None:
            return http.reply(self._registered(*again))
        if self.registry.full:
            raise http.error(
                web.HTTPForbidden,
                "registration_cap",
                f"all {self.registry.max_workers} registration slots of the join token are held "
                "(security.max_workers; a silent identity frees its slot after security.slot_idle_s)",
            )
        if self.registry.spent:
            raise http.error(
                web.HTTPForbidden,
                "identity_budget",
                f"the join token has registered all {self.registry.max_identities} identities it may over "
                "this run (security.max_identities: re-registrations and quarantined identities count)",
            )
        sec = self.security
        if not sec.min_usd_per_hour <= req.usd_per_hour <= sec.max_usd_per_hour:
            raise http.error(
                web.HTTPUnprocessableEntity,
                "invalid_price",
                f"usd_per_hour: {req.usd_per_hour} outside this run's range [{sec.min_usd_per_hour}, "
                f"{sec.max_usd_per_hour}] (security.min_usd_per_hour, security.max_usd_per_hour)",
            )
        if req.rollouts_per_s is not None and req.rollouts_per_s > sec.max_rollouts_per_s:
            raise http.error(
                web.HTTPUnprocessableEntity,
                "invalid_rate",
                f"rollouts_per_s: {req.rollouts_per_s} above this run's limit {sec.max_rollouts_per_s} "
                "(security.max_rollouts_per_s)",
            )
        rec, credential = self.registry.register(req)
        self.pool.enroll(rec)
        return http.reply(self._registered(rec, credential))

    def _registered(self, rec: WorkerRecord, credential: str) -> RegisterReply:
        ident = self.identity
        return RegisterReply(
            worker_id=rec.worker_id,
            credential=credential,
            public_key=ident.public_key,
            broadcast=ident.broadcast,
            settings=ident.settings,
        )

    async def heartbeat(self, request: web.Request) -> web.Response:
        rec = self._auth(request)
        return http.reply(self._beat(rec, _parse(HeartbeatRequest, await self._body(request))))

    def _beat(self, rec: WorkerRecord, hb: HeartbeatRequest) -> HeartbeatReply:
        if hb.installed_version > self.snapshots.version:
            raise http.error(
                web.HTTPUnprocessableEntity,
                "future_version",
                f"installed_version: {hb.installed_version} was never published",
            )
        self.registry.installed(rec.worker_id, hb.installed_version, hb.install_s, holds_now=True)
        self.pool.observe(rec, hb)
        self.pool.tick_due()
        return HeartbeatReply(
            active=self.pool.is_active(rec.worker_id),
            version=self.broker.version(),
            min_version=self.broker.min_version,
            finished=self.broker.finished,
            heartbeat_s=self.pool.cadence.heartbeat(),
        )

    async def lease(self, request: web.Request) -> web.Response:
        rec = self._auth(request)
        return http.reply(self._grant(rec, _parse(LeaseRequest, await self._body(request))))

    def _grant(self, rec: WorkerRecord, req: LeaseRequest) -> LeaseGrant | LeaseRefusal:
        """The broker's answer to ``req``; a grant also records the version it was asked for (one the
        broker admitted: not stale, not newer than ``v_t``, published by this process) as ``rec``'s
        installed version."""
        reply = self.broker.grant(rec.worker_id, req)
        if isinstance(reply, LeaseGrant):
            self.registry.installed(rec.worker_id, req.installed_version)
        return reply

    async def submit(self, request: web.Request) -> web.Response:
        """A submission, optionally carrying ``next_lease`` (a lease request answered in the same round
        trip: over a WAN link that halves the requests a worker makes per generation)."""
        rec = self._auth(request)
        body = await _parse_off_loop(SubmitRequest, await self._body(request))
        try:
            result = await self.intake.accept(rec, body)
        except Rejected as exc:  # counted by the intake
            return http.reply(
                ErrorReply(error=exc.reason, detail=http.clean(exc.detail)), status=exc.http_status
            )
        reply = SubmitReply(
            admitted=result.admitted, dropped_stale=result.dropped_stale, pending_check=result.held
        )
        if body.next_lease is not None:  # the submission stands even if this part is bad
            try:
                reply.next_lease = self._grant(rec, parse_model(LeaseRequest, body.next_lease))
            except Rejected as exc:
                self.store.record_rejection(exc.reason)
                reply.next_lease_error = ErrorReply(
                    error=exc.reason, detail=http.clean(f"next_lease: {exc.detail}")
                )
        return http.reply(reply)

    async def version(self, request: web.Request) -> web.Response:
        """The newest version and its signed manifest: at most ``SERVE_BUDGET`` copies of each version per
        identity, within the join token's budget."""
        rec = self._auth(request)
        latest = self.snapshots.latest
        if latest is None:
            return http.reply(VersionReply(version=None, manifest=None))
        body = VersionReply(version=latest[0], manifest=latest[1]).model_dump_json().encode()
        self._charge(("version", rec.worker_id, str(latest[0])), "the newest manifest", len(body), len(body))
        return web.Response(body=body, content_type="application/json")

    async def snapshot(self, request: web.Request) -> web.StreamResponse:
        """The links that take the caller's installed version (``?have=V``, default -1) to the newest:
        the patches after V if the learner still holds them, else the latest anchor and its patches;
        in a LoRA run, led by the link that carries the base unless the caller holds it (``?base=1``).
        Each link's bytes are booked to (caller, link version) first; a chain that does not fit the
        budget is refused whole (429 ``over_budget``) before anything is streamed. Streamed piece by
        piece: the learner never copies an anchor to answer."""
        rec = self._auth(request)
        if self.snapshots.latest is None:
            raise http.error(web.HTTPServiceUnavailable, "not_ready", "no snapshot published yet")
        try:
            have = int(request.query.get("have", "-1"))
        except ValueError:
            raise http.error(web.HTTPBadRequest, "invalid", "have must be an integer version") from None
        held = request.query.get("base", "0")
        if held not in ("0", "1"):
            raise http.error(
                web.HTTPBadRequest, "invalid", "base must be 0 or 1 (whether the caller holds it)"
            )
        links = self.snapshots.chain_from(have, held == "1")
        self._book(rec.worker_id, links)
        full = sum(len(link.blob) for link in self.snapshots.chain_from(-1))  # what a copy of the chain is
        self._take_token("snapshot", "snapshot chains", sum(len(link.blob) for link in links), full)
        parts = chain_parts([(link.manifest, link.blob) for link in links])
        headers = {VERSION_HEADER: str(self.snapshots.version)}
        return await http.stream_parts(request, parts, f"snapshot chain to {rec.worker_id}", headers)

    def _book(self, member: str, links: list[Link]) -> None:
        """Book every link of a chain to ``member``'s byte budget of its version, or none of them
        (429 ``over_budget``, counted); old versions' entries are forgotten."""
        chain = self.snapshots.published_chain
        for link in links:
            size, chunk = len(link.blob), int(link.manifest["chunk_size"])
            if not self.budget.fits(member, link.version, size, chain.budget_size(link), chunk):
                raise http.error(
                    web.HTTPTooManyRequests,
                    "over_budget",
                    f"v{link.version}: {self.budget.sent(member, link.version) + size} bytes would pass "
                    f"this identity's budget of {self.budget.limit(chain.budget_size(link), chunk):.0f} "
                    f"for the version ({SERVE_BUDGET:g} x its {chain.budget_size(link)} bytes + "
                    f"{BUDGET_SLACK_CHUNKS} chunks of {chunk}); a "
                    "newer version has a budget of its own",
                )
        for link in links:
            size = len(link.blob)
            self.budget.book(
                member, link.version, size, chain.budget_size(link), int(link.manifest["chunk_size"])
            )
        if links:
            self.budget.forget_before(self.snapshots.chain_from(-1)[0].version)  # the oldest still served

    async def model(self, request: web.Request) -> web.Response:
        """The model's configuration and tokenizer files (no weights): at most ``SERVE_BUDGET`` copies
        per identity, within the join token's budget."""
        rec = self._auth(request)
        body = self._model_reply
        self._charge(("model", rec.worker_id), "the model files", len(body), len(body))
        return web.Response(body=body, content_type="application/json")

    # ---- helpers -----------------------------------------------------------------------------------
    def _auth(self, request: web.Request) -> WorkerRecord:
        """The trusted identity a request's http.bearer credential names (the middleware looked it up),
        within its request rate; else the refusal (401/403/429, counted by the middleware)."""
        return self._authorized(request.get(RECORD), http.bearer(request) is not None)

    def _authorized(self, rec: WorkerRecord | None, has_credential: bool) -> WorkerRecord:
        """``rec`` (what a credential named, None: nothing) if it may ask now: 401/403 ``auth`` for a
        missing or unknown credential, 403 ``quarantined`` / ``retired``, 429 ``rate_limited`` past the
        identity's request rate."""
        if rec is None:
            if not has_credential:
                raise http.error(web.HTTPUnauthorized, "auth", "missing http.bearer credential", close=True)
            raise http.error(web.HTTPForbidden, "auth", "unknown credential", close=True)
        if rec.quarantined:
            self.rate.forget(rec.worker_id)
            raise http.error(
                web.HTTPForbidden, "quarantined", f"credential revoked: {rec.quarantined}", close=True
            )
        if rec.retired_s is not None:
            self.rate.forget(rec.worker_id)
            raise http.error(
                web.HTTPForbidden,
                "retired",
                f"credential retired: silent for more than {self.registry.slot_idle_s:g} s "
                "(security.slot_idle_s); register again",
                close=True,
            )
        wait = self.rate.take(rec.worker_id)
        if wait > 0:
            raise http.error(
                web.HTTPTooManyRequests,
                "rate_limited",
                f"more than {self.rate.rate:g} requests/s (bursts of {self.rate.burst:g}) from this identity "
                f"(security.max_requests_per_s); retry in {wait:.3f} s",
                retry_after_s=wait,
            )
        return rec

    def _charge(self, key: tuple[str, ...], what: str, nbytes: int, copy_bytes: int) -> None:
        """One copy of ``what`` (``key``: object, identity[, version]) to an identity: at most
        ``SERVE_BUDGET`` per key (429 ``over_budget``, which stands), then the join token's budget."""
        sent = self.copies.get(key, 0)
        if sent >= SERVE_BUDGET:
            raise http.error(
                web.HTTPTooManyRequests,
                "over_budget",
                f"{what} was sent to this identity {sent} times already (at most {SERVE_BUDGET:g})",
            )
        self._take_token(key[0], what, nbytes, copy_bytes)
        self.copies[key] = sent + 1

    def _take_token(self, kind: str, what: str, nbytes: int, copy_bytes: int) -> None:
        """``nbytes`` of ``kind`` (``copy_bytes`` a whole copy) from the join token's budget (one token
        per run: every identity shares it), or 429 ``token_budget`` with the seconds until it fits."""
        wait = self.token_budget.take(kind, nbytes, copy_bytes)
        if wait > 0:
            budget = self.token_budget
            raise http.error(
                web.HTTPTooManyRequests,
                "token_budget",
                f"the join token's identities together have had their copies of {what} for now (a burst "
                f"of {budget.burst:g}, then {budget.per_hour:g} an hour: security.max_workers, "
                f"security.token_copies_per_hour); retry in {wait:.0f} s",
                retry_after_s=wait,
            )

    async def _body(self, request: web.Request, limit: int | None = None) -> bytes:
        """The whole body within ``security.body_timeout_s`` and ``limit`` (:func:`http.read_body`)."""
        return await http.read_body(request, limit, self.security.body_timeout_s)

    @web.middleware
    async def _gate(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        """Before any handler: the record a http.bearer credential names (kept for ``_auth``), through
        :meth:`_admit`; a trusted one's connection is vouched for (the perimeter's deadline ends)."""
        if not (self.fronted and request.path == http.FRONT_BATCH):  # a batch: each request is admitted
            # a registration's bearer is the join token, not a credential: its address pays
            credential = http.bearer(request) if request.path != f"{API}/register" else None
            rec = request[RECORD] = self._admit(credential, self._peer(request))
            if rec is not None and rec.trusted:
                self._vouch(request)
        return await handler(request)

    def _admit(self, credential: str | None, peer: str | None) -> WorkerRecord | None:
        """The record ``credential`` names (None: none). A request no trusted identity vouches for (a
        missing or bad credential) passes its address's bucket first (``security.perimeter.requests_per_s``;
        429 ``rate_limited`` and the connection closed past it), so a stranger's requests cost at most
        that rate's header parsing."""
        rec = self.registry.authenticate(credential) if credential is not None else None
        if rec is not None and rec.trusted:
            return rec
        wait = self.perimeter.charge(peer)
        if wait > 0:
            raise http.error(
                web.HTTPTooManyRequests,
                "rate_limited",
                f"more than {self.perimeter.limits.requests_per_s:g} requests/s from this address "
                "without a trusted credential (security.perimeter.requests_per_s)",
                retry_after_s=wait,
                close=True,
            )
        return rec

    def _peer(self, request: web.Request) -> str | None:
        """The peer's address: the one its front saw (``http.PEER_HEADER``, set by the front alone:
        ``runtime/front.py``) when the API is served by fronts, else the connection's."""
        return request.headers.get(http.PEER_HEADER) if self.fronted else request.remote

    def _vouch(self, request: web.Request) -> None:
        """``request``'s connection is a member's: the perimeter's, or its front's when fronted (told by
        ``http.VOUCH_HEADER`` on the reply: ``_mark_vouched``)."""
        if self.fronted:
            request[VOUCHED] = True
        else:
            self.perimeter.vouch(request.transport)

    @web.middleware
    async def _count_errors(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return await self._refused(request, exc)

    async def _refused(self, request: web.Request, exc: web.HTTPException) -> web.StreamResponse:
        """``exc``'s refusal counted, logged (a floodable one now and then) and answered in the
        :class:`ErrorReply` shape, closing the connection if it says so (a front's: told by
        ``http.CLOSE_HEADER``, the front's link to this process stays open)."""
        self._count(exc, f"{request.method} {request.path!r} from {self._peer(request)}")
        resp = http.refusal(exc)
        if getattr(exc, "echo2_close", False):
            if not self.fronted:
                return await http.send_and_close(request, resp)
            resp.headers[http.CLOSE_HEADER] = "1"
        return resp

    def _count(self, exc: web.HTTPException, where: str) -> None:
        """Count and log the refusal ``exc`` (aiohttp's own by their status)."""
        reason = http.reason_of(exc)
        self.store.record_rejection(reason)
        if reason in http.FLOODABLE:  # a stranger can make these at will: counted, logged now and then
            self._sampled.log(reason, "%s: %d %s", where, exc.status, exc.text)
        else:
            log.warning("%s: %d %s", where, exc.status, exc.text)


_HTTP: dict[int, type[web.HTTPException]] = {  # the status of a Rejected -> aiohttp's exception
    400: web.HTTPBadRequest,
    401: web.HTTPUnauthorized,
    403: web.HTTPForbidden,
    404: web.HTTPNotFound,
    409: web.HTTPConflict,
    413: web.HTTPRequestEntityTooLarge,
    422: web.HTTPUnprocessableEntity,
}


async def _mark_vouched(request: web.Request, resp: web.StreamResponse) -> None:
    """A fronted reply to a request that authenticated says so (streamed replies too)."""
    if request.get(VOUCHED):
        resp.headers[http.VOUCH_HEADER] = "1"


def _parse(model: type[M], body: bytes | dict[str, Any]) -> M:
    try:
        return parse_model(model, body)
    except Rejected as exc:
        raise http.error(_HTTP[exc.http_status], exc.reason, exc.detail) from None


async def _parse_off_loop(model: type[M], body: bytes) -> M:
    """``_parse`` of ``body``, in a worker thread when it is longer than ``OFF_LOOP_BYTES`` (a lease of
    long completions: tens of ms of validation), so the event loop serves the fleet meanwhile."""
    if len(body) <= OFF_LOOP_BYTES:
        return _parse(model, body)
    return await asyncio.to_thread(_parse, model, body)
