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
  silence 403 ``retired`` (``runtime/registry.py``: registration slots);
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
  is streamed (a new version brings a new budget; retrying the same one does not);
- a LoRA run's base (``GET /v1/base``): at most ``SERVE_BUDGET`` times per identity (429 ``over_budget``),
  404 ``not_lora`` in a run that publishes whole weights;
- aiohttp's own refusals: a body over the limit 413 ``oversized``, an unknown route 404 ``not_found``,
  a method 405 ``method``, and what its HTTP parser refuses before any handler runs (a NUL byte or an
  over-long line in a header, Content-Length with Transfer-Encoding, a bad request line or chunk size)
  400 ``bad_http``, all in the same JSON shape (the parser's through :class:`_JsonRefusals`).

Every peer string that reaches a log line goes through ``%r`` and every one that reaches a reply is
escaped (:func:`_clean`), so neither a lone surrogate nor a control character can break either.
"""

from __future__ import annotations

import asyncio
import logging
import math
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pydantic_core
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from pydantic import BaseModel

from echo2.broadcast.access import BUDGET_SLACK_CHUNKS, SERVE_BUDGET, ByteBudget
from echo2.config import SecurityConfig
from echo2.data.store import TrajectoryStore
from echo2.data.submission import M, Rejected, parse_model
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
from echo2.runtime.intake import Intake
from echo2.runtime.leases import LeaseBroker
from echo2.runtime.pool import Pool
from echo2.runtime.registry import WorkerRecord, WorkerRegistry
from echo2.runtime.snapshots import Snapshots
from echo2.weights.chain import Blob, chain_parts
from echo2.weights.publication import Link

log = logging.getLogger(__name__)

BASE_PIECE = 4 << 20  # bytes of a LoRA base written to the response at a time
BURST_S = 2.0  # a token bucket holds this many seconds of security.max_requests_per_s (bursts of twice it)
MAX_DETAIL_CHARS = 300  # the longest detail of aiohttp's own refusals echoed back (they quote the peer)


@dataclass(frozen=True)
class Identity:
    """What the learner tells a worker about itself at registration."""

    settings: WorkerSettings  # the part of the run's config a worker needs
    public_key: str  # manifest verification key, ``key_from_text`` form
    broadcast: tuple[str, int]  # where the broadcast plane listens
    skeleton: dict[str, str]  # model config + tokenizer files (no weights)
    base: Blob | None = None  # a LoRA run's frozen base (encode_full bytes; settings.lora has its digest)


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
    ) -> None:
        self.registry, self.pool, self.broker, self.intake = registry, pool, broker, intake
        self.snapshots, self.store, self.identity = snapshots, store, identity
        self.max_request_bytes = max_request_bytes
        self.security = sec = security or SecurityConfig()
        self.rate = RequestRate(sec.max_requests_per_s, BURST_S * sec.max_requests_per_s, clock)
        self.budget = ByteBudget()  # snapshot-chain bytes sent per (identity, link version)
        self.base_sent: dict[str, int] = {}  # identity -> times it was sent a LoRA run's base

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_request_bytes, middlewares=[self._count_errors])
        app.add_routes(
            [
                web.post(f"{API}/register", self.register),
                web.post(f"{API}/heartbeat", self.heartbeat),
                web.post(f"{API}/lease", self.lease),
                web.post(f"{API}/submit", self.submit),
                web.get(f"{API}/version", self.version),
                web.get(f"{API}/snapshot", self.snapshot),
                web.get(f"{API}/model", self.model),
                web.get(f"{API}/base", self.base),
            ]
        )
        return app

    async def serve(
        self, host: str, port: int, ssl_context: ssl.SSLContext | None = None
    ) -> tuple[web.AppRunner, int]:
        """Serve on ``host:port`` (0 = any free port), over TLS with ``ssl_context`` (the run's
        certificate, ``echo2.transport``; None = plain HTTP); returns the runner (``cleanup()`` stops
        it) and the bound port."""
        runner = _Runner(self.app(), self.store.record_rejection, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
        await site.start()
        return runner, int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    # ---- handlers ----------------------------------------------------------------------------------
    async def register(self, request: web.Request) -> web.Response:
        body = _json_object(await self._body(request))
        token = body.get("token")  # checked first, so a stranger learns nothing of the schema
        if not isinstance(token, str) or not token:
            raise _error(web.HTTPUnauthorized, "auth", "register needs the run's join token")
        if not self.registry.token_ok(token):
            raise _error(web.HTTPForbidden, "auth", "wrong join token")
        if self.registry.full:
            raise _error(
                web.HTTPForbidden,
                "registration_cap",
                f"all {self.registry.max_workers} registration slots of the join token are held "
                "(security.max_workers; a silent identity frees its slot after security.slot_idle_s)",
            )
        if self.registry.spent:
            raise _error(
                web.HTTPForbidden,
                "identity_budget",
                f"the join token has registered all {self.registry.max_identities} identities it may over "
                "this run (security.max_identities: re-registrations and quarantined identities count)",
            )
        req = _parse(RegisterRequest, body)
        sec = self.security
        if not sec.min_usd_per_hour <= req.usd_per_hour <= sec.max_usd_per_hour:
            raise _error(
                web.HTTPUnprocessableEntity,
                "invalid_price",
                f"usd_per_hour: {req.usd_per_hour} outside this run's range [{sec.min_usd_per_hour}, "
                f"{sec.max_usd_per_hour}] (security.min_usd_per_hour, security.max_usd_per_hour)",
            )
        if req.rollouts_per_s is not None and req.rollouts_per_s > sec.max_rollouts_per_s:
            raise _error(
                web.HTTPUnprocessableEntity,
                "invalid_rate",
                f"rollouts_per_s: {req.rollouts_per_s} above this run's limit {sec.max_rollouts_per_s} "
                "(security.max_rollouts_per_s)",
            )
        rec, credential = self.registry.register(req)
        self.pool.enroll(rec)
        ident = self.identity
        reply = RegisterReply(
            worker_id=rec.worker_id,
            credential=credential,
            public_key=ident.public_key,
            broadcast=ident.broadcast,
            settings=ident.settings,
        )
        return _reply(reply)

    async def heartbeat(self, request: web.Request) -> web.Response:
        rec = self._auth(request)
        hb = _parse(HeartbeatRequest, await self._body(request))
        if hb.installed_version > self.snapshots.version:
            raise _error(
                web.HTTPUnprocessableEntity,
                "future_version",
                f"installed_version: {hb.installed_version} was never published",
            )
        self.registry.installed(rec.worker_id, hb.installed_version, hb.install_s, holds_now=True)
        self.pool.observe(rec, hb)
        self.pool.tick()
        reply = HeartbeatReply(
            active=self.pool.is_active(rec.worker_id),
            version=self.broker.version(),
            min_version=self.broker.min_version,
            finished=self.broker.finished,
        )
        return _reply(reply)

    async def lease(self, request: web.Request) -> web.Response:
        rec = self._auth(request)
        return _reply(self._grant(rec, _parse(LeaseRequest, await self._body(request))))

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
        body = _parse(SubmitRequest, await self._body(request))
        try:
            result = await self.intake.accept(rec, body)
        except Rejected as exc:  # counted by the intake
            return _reply(ErrorReply(error=exc.reason, detail=_clean(exc.detail)), status=exc.http_status)
        reply = SubmitReply(
            admitted=result.admitted, dropped_stale=result.dropped_stale, pending_check=result.held
        )
        if body.next_lease is not None:  # the submission stands even if this part is bad
            try:
                reply.next_lease = self._grant(rec, parse_model(LeaseRequest, body.next_lease))
            except Rejected as exc:
                self.store.record_rejection(exc.reason)
                reply.next_lease_error = ErrorReply(
                    error=exc.reason, detail=_clean(f"next_lease: {exc.detail}")
                )
        return _reply(reply)

    async def version(self, request: web.Request) -> web.Response:
        self._auth(request)
        latest = self.snapshots.latest
        if latest is None:
            return _reply(VersionReply(version=None, manifest=None))
        return _reply(VersionReply(version=latest[0], manifest=latest[1]))

    async def snapshot(self, request: web.Request) -> web.StreamResponse:
        """The links that take the caller's installed version (``?have=V``, default -1) to the newest:
        the patches after V if the learner still holds them, else the latest anchor and its patches.
        Each link's bytes are booked to (caller, link version) first; a chain that does not fit the
        budget is refused whole (429 ``over_budget``) before anything is streamed. Streamed piece by
        piece: the learner never copies an anchor to answer."""
        rec = self._auth(request)
        if self.snapshots.latest is None:
            raise _error(web.HTTPServiceUnavailable, "not_ready", "no snapshot published yet")
        try:
            have = int(request.query.get("have", "-1"))
        except ValueError:
            raise _error(web.HTTPBadRequest, "invalid", "have must be an integer version") from None
        links = self.snapshots.chain_from(have)
        self._book(rec.worker_id, links)
        parts = chain_parts([(link.manifest, link.blob) for link in links])
        headers = {VERSION_HEADER: str(self.snapshots.version)}
        return await _stream(request, parts, f"snapshot chain to {rec.worker_id}", headers)

    def _book(self, member: str, links: list[Link]) -> None:
        """Book every link of a chain to ``member``'s byte budget of its version, or none of them
        (429 ``over_budget``, counted); old versions' entries are forgotten."""
        for link in links:
            size, chunk = len(link.blob), int(link.manifest["chunk_size"])
            if not self.budget.fits(member, link.version, size, size, chunk):
                raise _error(
                    web.HTTPTooManyRequests,
                    "over_budget",
                    f"v{link.version}: {self.budget.sent(member, link.version) + size} bytes would pass "
                    f"this identity's budget of {self.budget.limit(size, chunk):.0f} for the version "
                    f"({SERVE_BUDGET:g} x its {size} bytes + {BUDGET_SLACK_CHUNKS} chunks of {chunk}); a "
                    "newer version has a budget of its own",
                )
        for link in links:
            size = len(link.blob)
            self.budget.book(member, link.version, size, size, int(link.manifest["chunk_size"]))
        if links:
            self.budget.forget_before(self.snapshots.chain_from(-1)[0].version)  # the oldest still served

    async def model(self, request: web.Request) -> web.Response:
        self._auth(request)
        return _reply(ModelReply(files=self.identity.skeleton))

    async def base(self, request: web.Request) -> web.StreamResponse:
        """A LoRA run's frozen base (404 ``not_lora`` in any other run), at most ``SERVE_BUDGET`` times
        per identity (then 429 ``over_budget``): a worker fetches it once and checks its digest."""
        rec = self._auth(request)
        blob = self.identity.base
        if blob is None:
            raise _error(web.HTTPNotFound, "not_lora", "this run publishes whole weights: it has no base")
        sent = self.base_sent.get(rec.worker_id, 0)
        if sent >= SERVE_BUDGET:
            raise _error(
                web.HTTPTooManyRequests,
                "over_budget",
                f"the base was sent to this identity {sent} times already (at most {SERVE_BUDGET:g})",
            )
        self.base_sent[rec.worker_id] = sent + 1
        view = memoryview(blob)
        parts = [view[lo : lo + BASE_PIECE] for lo in range(0, len(view), BASE_PIECE)]
        return await _stream(request, parts, f"base to {rec.worker_id}")

    # ---- helpers -----------------------------------------------------------------------------------
    def _auth(self, request: web.Request) -> WorkerRecord:
        """The trusted identity a request's bearer credential names, within its request rate; else the
        refusal (401/403/429, counted by the middleware)."""
        header = request.headers.get("Authorization", "")
        if not header.startswith("Bearer ") or not header[7:].strip():
            raise _error(web.HTTPUnauthorized, "auth", "missing bearer credential")
        rec = self.registry.authenticate(header[7:].strip())
        if rec is None:
            raise _error(web.HTTPForbidden, "auth", "unknown credential")
        if rec.quarantined:
            self.rate.forget(rec.worker_id)
            raise _error(web.HTTPForbidden, "quarantined", f"credential revoked: {rec.quarantined}")
        if rec.retired_s is not None:
            self.rate.forget(rec.worker_id)
            raise _error(
                web.HTTPForbidden,
                "retired",
                f"credential retired: silent for more than {self.registry.slot_idle_s:g} s "
                "(security.slot_idle_s); register again",
            )
        wait = self.rate.take(rec.worker_id)
        if wait > 0:
            raise _error(
                web.HTTPTooManyRequests,
                "rate_limited",
                f"more than {self.rate.rate:g} requests/s (bursts of {self.rate.burst:g}) from this identity "
                f"(security.max_requests_per_s); retry in {wait:.3f} s",
                headers={"Retry-After": str(max(1, math.ceil(wait)))},
            )
        return rec

    async def _body(self, request: web.Request) -> bytes:
        """The whole body, within ``security.body_timeout_s`` (408 ``slow_body`` and the connection
        closed, else); 400 ``bad_http`` if its framing breaks; ``dropped`` if the peer left first."""
        timeout = self.security.body_timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await request.read()
        except TimeoutError:
            exc = _error(
                web.HTTPRequestTimeout,
                "slow_body",
                f"the body did not arrive within {timeout:g} s (security.body_timeout_s)",
            )
            exc.echo2_close = True  # type: ignore[attr-defined]  # the rest of that body is not waited for
            raise exc from None
        except web.RequestPayloadError as exc:
            raise _error(web.HTTPBadRequest, "bad_http", f"body: {_clean(str(exc))}") from None
        except ConnectionError:  # nobody left to answer: counted, and the reply goes nowhere
            raise _error(
                web.HTTPBadRequest, "dropped", "the connection closed before the body arrived"
            ) from None

    @web.middleware
    async def _count_errors(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            ours = getattr(exc, "echo2_reason", None)
            reason = ours or _REASON_BY_STATUS.get(exc.status, f"http_{exc.status}")
            self.store.record_rejection(reason)
            level = logging.DEBUG if reason == "rate_limited" else logging.WARNING  # a flood: counted only
            where = f"{request.method} {request.path!r} from {request.remote}"
            log.log(level, "%s: %d %s", where, exc.status, exc.text)
            if getattr(exc, "echo2_close", False):
                return await _answer_and_close(request, exc)
            if ours is not None:
                raise
            # raised by aiohttp itself (body too large, no such route, ...): the same JSON shape as ours
            keep = {k: v for k, v in exc.headers.items() if k.lower() not in _BODY_HEADERS}
            reply = ErrorReply(error=reason, detail=_clean(exc.text or ""))
            return _reply(reply, status=exc.status, headers=keep)


class RequestRate:
    """Token buckets, one per identity: each holds up to ``burst`` tokens, refilled at ``rate`` a
    second; a request takes one. :meth:`take` says 0 (taken) or the seconds until one is there. A
    bucket refilled to ``burst`` holds nothing an absent one does not: every ``SWEEP_EVERY`` takes they
    are dropped, so the table holds the identities heard from in the last ``burst / rate`` seconds."""

    SWEEP_EVERY = 1024

    def __init__(self, rate: float, burst: float, clock: Callable[[], float]) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # identity -> (tokens, at clock time)
        self._takes = 0

    def take(self, key: str) -> float:
        now = self.clock()
        self._takes += 1
        if self._takes % self.SWEEP_EVERY == 0:
            self._buckets = {k: b for k, b in self._buckets.items() if self._level(b, now) < self.burst}
        tokens = self._level(self._buckets.get(key, (self.burst, now)), now)
        if tokens >= 1.0:
            self._buckets[key] = (tokens - 1.0, now)
            return 0.0
        self._buckets[key] = (tokens, now)
        return (1.0 - tokens) / self.rate

    def _level(self, bucket: tuple[float, float], now: float) -> float:
        tokens, at = bucket
        return min(self.burst, tokens + (now - at) * self.rate)

    def forget(self, key: str) -> None:
        """Drop an identity's bucket (it opens nothing any more)."""
        self._buckets.pop(key, None)

    def __len__(self) -> int:
        return len(self._buckets)


class _JsonRefusals(RequestHandler):
    """aiohttp's HTTP/1 protocol, answering what its parser refuses before any handler or middleware
    runs (a NUL byte or an over-long line in a header, Content-Length with Transfer-Encoding, a bad
    request line or chunk size, ...) in the :class:`ErrorReply` JSON shape, counted ``bad_http`` and
    logged as one line, not a traceback. aiohttp 3.14 has no hook for these responses (its issue
    aio-libs/aiohttp#3287 asks for one): ``handle_error`` is the method its protocol makes them with,
    so this subclass overrides that one method and nothing else. A 5xx is a bug of ours, never a
    peer's bytes: it keeps aiohttp's traceback in the log, counted ``internal``, in the same shape."""

    def __init__(self, manager: web.Server, *, on_refusal: Callable[[str], None], **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.on_refusal = on_refusal  # counts a refusal by reason (the store's record_rejection)

    def data_received(self, data: bytes) -> None:
        """aiohttp drops every byte that arrives once a graceful shutdown has begun (``AppRunner.cleanup``
        marks every connection closing, then waits for the handlers in progress), the rest of a body
        such a handler is still reading included: the handler then waits out ``security.body_timeout_s``
        and its peer for an answer that comes only then. Here the bytes keep reaching the request in
        progress until its handler is done and the transport closes; aiohttp starts no new request on a
        closing connection either way."""
        flags = self._close, self._force_close
        if not any(flags) or not self._request_in_progress:
            super().data_received(data)
            return
        self._close = self._force_close = False
        try:
            super().data_received(data)
        finally:
            self._close, self._force_close = flags

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if isinstance(exc, ConnectionError):  # the peer went away mid-request: nobody to answer
            self.on_refusal("dropped")
            raise ConnectionError(f"connection lost: {exc}")
        if status >= 500:
            reason, detail = "internal", "the learner failed on this request (its log says why)"
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        else:
            reason, detail = (
                "bad_http",
                _clean(message or str(exc) or "malformed HTTP request")[:MAX_DETAIL_CHARS],
            )
            log.warning("refused a malformed HTTP request from %s: %d %r", request.remote, status, detail)
        self.on_refusal(reason)
        if request.writer.output_size > 0:  # a response is under way: only the connection can end
            raise ConnectionError(f"{reason} after the response started: {detail}")
        resp = _reply(ErrorReply(error=reason, detail=detail), status=status)
        resp.force_close()
        return resp


class _Server(web.Server):
    """The application's low-level server, making :class:`_JsonRefusals` protocols."""

    def __init__(self, *args: Any, on_refusal: Callable[[str], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_refusal = on_refusal

    def __call__(self) -> RequestHandler:
        return _JsonRefusals(self, loop=self._loop, on_refusal=self.on_refusal, **self._kwargs)


class _Runner(web.AppRunner):
    """``web.AppRunner`` serving the application through :class:`_Server`, built from the server the
    application makes (the same handler, request factory and protocol settings)."""

    def __init__(self, app: web.Application, on_refusal: Callable[[str], None], **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._on_refusal = on_refusal

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()
        return _Server(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            loop=made._loop,
            on_refusal=self._on_refusal,
            **made._kwargs,
        )


_BODY_HEADERS = ("content-type", "content-length")
_REASON_BY_STATUS = {
    400: "malformed",
    401: "auth",
    403: "auth",
    404: "not_found",
    405: "method",
    413: "oversized",
}
_HTTP: dict[int, type[web.HTTPException]] = {  # the status of a Rejected -> aiohttp's exception
    400: web.HTTPBadRequest,
    401: web.HTTPUnauthorized,
    403: web.HTTPForbidden,
    404: web.HTTPNotFound,
    409: web.HTTPConflict,
    413: web.HTTPRequestEntityTooLarge,
    422: web.HTTPUnprocessableEntity,
}


async def _stream(
    request: web.Request, parts: Sequence[Any], what: str, headers: dict[str, str] | None = None
) -> web.StreamResponse:
    """``parts`` (bytes or views) written one after the other as one octet-stream body: the learner
    never joins them into one copy. A peer that goes away mid-body (killed, restarted) is routine."""
    resp = web.StreamResponse(headers=headers)
    resp.content_type = "application/octet-stream"
    resp.content_length = sum(len(p) for p in parts)
    try:
        await resp.prepare(request)
        for part in parts:
            await resp.write(part)
        await resp.write_eof()
    except ConnectionError as exc:
        log.info("%s cut: %s", what, exc)
    return resp


def _reply(model: BaseModel, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        text=model.model_dump_json(), status=status, content_type="application/json", headers=headers
    )


def _parse(model: type[M], body: bytes | dict[str, Any]) -> M:
    try:
        return parse_model(model, body)
    except Rejected as exc:
        raise _error(_HTTP[exc.http_status], exc.reason, exc.detail) from None


def _json_object(raw: bytes) -> dict[str, Any]:
    """A body that must be a JSON object, parsed by pydantic's parser (the one every request model
    uses: bounded nesting, no lone surrogates, no integer too long to convert), or 400 ``malformed``."""
    try:
        body = pydantic_core.from_json(raw)
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, too deep, a lone surrogate, ...
        raise _error(web.HTTPBadRequest, "malformed", f"body is not JSON: {_clean(str(exc))}") from None
    if not isinstance(body, dict):
        raise _error(web.HTTPBadRequest, "malformed", "body must be a JSON object")
    return body


async def _answer_and_close(request: web.Request, exc: web.HTTPException) -> web.StreamResponse:
    """Send ``exc``'s reply and close the connection at once (aiohttp would otherwise linger, reading
    what is left of the body, for up to ``lingering_time``: a slow sender's grip on the connection)."""
    resp = web.Response(body=exc.body, status=exc.status, content_type="application/json")
    resp.force_close()
    await resp.prepare(request)
    await resp.write_eof()
    if request.transport is not None:
        request.transport.close()  # after the reply is flushed
    return resp


def _clean(text: str) -> str:
    """``text`` with what cannot be UTF-8 (lone surrogates from a peer's escapes or undecodable header
    bytes) written as ``\\uXXXX`` escapes: safe in a JSON reply and a log line."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _error(
    cls: type[web.HTTPException], reason: str, detail: str, headers: dict[str, str] | None = None
) -> web.HTTPException:
    body = ErrorReply(error=reason, detail=_clean(detail)).model_dump_json()
    exc = cls(text=body, content_type="application/json", headers=headers)
    exc.echo2_reason = reason  # type: ignore[attr-defined]  # the counted rejection reason
    return exc
