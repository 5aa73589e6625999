"""The learner node's HTTP API (aiohttp): thin adapters from ``echo2.protocol`` requests to the parts.

Each handler authenticates (the registry), parses its request model, asks one part (registry, pool,
lease broker, intake, snapshots) and returns its reply model. A missing credential gets 401, a wrong
one 403; a body that is not JSON 400, one that breaks its model 422 naming the field; aiohttp's own
refusals (a body over ``runtime.max_request_mb``: 413, an unknown route: 404) get the same
:class:`~echo2.protocol.ErrorReply` JSON. Every refusal is counted by reason (``store/rejected/*``).
The handlers run on the learner's event loop thread, the only thread that touches the store.
"""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from echo2.config import SecurityConfig
from echo2.data.store import TrajectoryStore
from echo2.data.submission import M, Rejected, parse_model
from echo2.protocol import (
    API,
    VERSION_HEADER,
    ErrorReply,
    HeartbeatReply,
    HeartbeatRequest,
    LeaseRequest,
    ModelReply,
    RegisterReply,
    RegisterRequest,
    SubmitReply,
    SubmitRequest,
    VersionReply,
    WorkerSettings,
    chain_parts,
)
from echo2.runtime.intake import Intake
from echo2.runtime.leases import LeaseBroker
from echo2.runtime.pool import Pool
from echo2.runtime.registry import WorkerRecord, WorkerRegistry
from echo2.runtime.snapshots import Snapshots

log = logging.getLogger(__name__)


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
    ) -> None:
        self.registry, self.pool, self.broker, self.intake = registry, pool, broker, intake
        self.snapshots, self.store, self.identity = snapshots, store, identity
        self.max_request_bytes = max_request_bytes
        self.security = security or SecurityConfig()

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
            ]
        )
        return app

    async def serve(
        self, host: str, port: int, ssl_context: ssl.SSLContext | None = None
    ) -> tuple[web.AppRunner, int]:
        """Serve on ``host:port`` (0 = any free port), over TLS with ``ssl_context`` (the run's
        certificate, ``echo2.transport``; None = plain HTTP); returns the runner (``cleanup()`` stops
        it) and the bound port."""
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
        await site.start()
        return runner, int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    # ---- handlers ----------------------------------------------------------------------------------
    async def register(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        token = body.get("token")  # checked first, so a stranger learns nothing of the schema
        if not isinstance(token, str) or not token:
            raise _error(web.HTTPUnauthorized, "auth", "register needs the run's join token")
        if not self.registry.token_ok(token):
            raise _error(web.HTTPForbidden, "auth", "wrong join token")
        if self.registry.full:
            raise _error(
                web.HTTPForbidden,
                "registration_cap",
                f"the join token has made its {self.registry.max_workers} registrations "
                "(security.max_workers)",
            )
        req = _parse(RegisterRequest, body)
        sec = self.security
        if not req.usd_per_hour <= sec.max_usd_per_hour:
            raise _error(
                web.HTTPUnprocessableEntity,
                "invalid_price",
                f"usd_per_hour: {req.usd_per_hour} above this run's limit {sec.max_usd_per_hour} "
                "(security.max_usd_per_hour)",
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
        hb = _parse(HeartbeatRequest, await request.read())
        if hb.installed_version > self.snapshots.version:
            raise _error(
                web.HTTPUnprocessableEntity,
                "future_version",
                f"installed_version: {hb.installed_version} was never published",
            )
        rec.installed_version = hb.installed_version
        rec.install_s = hb.install_s
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
        return _reply(self.broker.grant(rec.worker_id, _parse(LeaseRequest, await request.read())))

    async def submit(self, request: web.Request) -> web.Response:
        """A submission, optionally carrying ``next_lease`` (a lease request answered in the same round
        trip: over a WAN link that halves the requests a worker makes per generation)."""
        rec = self._auth(request)
        body = _parse(SubmitRequest, await request.read())
        try:
            result = await self.intake.accept(rec, body)
        except Rejected as exc:  # counted by the intake
            return _reply(ErrorReply(error=exc.reason, detail=exc.detail), status=exc.http_status)
        reply = SubmitReply(admitted=result.admitted, dropped_stale=result.dropped_stale)
        if body.next_lease is not None:  # the submission stands even if this part is bad
            try:
                reply.next_lease = self.broker.grant(
                    rec.worker_id, parse_model(LeaseRequest, body.next_lease)
                )
            except Rejected as exc:
                self.store.record_rejection(exc.reason)
                reply.next_lease_error = ErrorReply(error=exc.reason, detail=f"next_lease: {exc.detail}")
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
        Streamed piece by piece: the learner never copies an anchor to answer."""
        self._auth(request)
        if self.snapshots.latest is None:
            raise _error(web.HTTPServiceUnavailable, "not_ready", "no snapshot published yet")
        try:
            have = int(request.query.get("have", "-1"))
        except ValueError:
            raise _error(web.HTTPBadRequest, "invalid", "have must be an integer version") from None
        parts = chain_parts([(link.manifest, link.blob) for link in self.snapshots.chain_from(have)])
        resp = web.StreamResponse(headers={VERSION_HEADER: str(self.snapshots.version)})
        resp.content_type = "application/octet-stream"
        resp.content_length = sum(len(p) for p in parts)
        await resp.prepare(request)
        for part in parts:
            await resp.write(part)
        await resp.write_eof()
        return resp

    async def model(self, request: web.Request) -> web.Response:
        self._auth(request)
        return _reply(ModelReply(files=self.identity.skeleton))

    # ---- helpers -----------------------------------------------------------------------------------
    def _auth(self, request: web.Request) -> WorkerRecord:
        header = request.headers.get("Authorization", "")
        if not header.startswith("Bearer ") or not header[7:].strip():
            raise _error(web.HTTPUnauthorized, "auth", "missing bearer credential")
        rec = self.registry.authenticate(header[7:].strip())
        if rec is None:
            raise _error(web.HTTPForbidden, "auth", "unknown credential")
        if rec.quarantined:
            raise _error(web.HTTPForbidden, "quarantined", f"credential revoked: {rec.quarantined}")
        return rec

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
            log.warning(
                "%s %s from %s: %d %s", request.method, request.path, request.remote, exc.status, exc.text
            )
            if ours is not None:
                raise
            # raised by aiohttp itself (body too large, no such route, ...): the same JSON shape as ours
            keep = {k: v for k, v in exc.headers.items() if k.lower() not in _BODY_HEADERS}
            return _reply(ErrorReply(error=reason, detail=exc.text or ""), status=exc.status, headers=keep)


_BODY_HEADERS = ("content-type", "content-length")
_REASON_BY_STATUS = {
    400: "malformed",
    401: "auth",
    403: "auth",
    404: "not_found",
    405: "method",
    413: "oversized",
}
_HTTP: dict[int, type[web.HTTPException]] = {
    400: web.HTTPBadRequest,
    401: web.HTTPUnauthorized,
    403: web.HTTPForbidden,
    404: web.HTTPNotFound,
    409: web.HTTPConflict,
    413: web.HTTPRequestEntityTooLarge,
    422: web.HTTPUnprocessableEntity,
}


def _reply(model: BaseModel, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        text=model.model_dump_json(), status=status, content_type="application/json", headers=headers
    )


def _parse(model: type[M], body: bytes | dict[str, Any]) -> M:
    try:
        return parse_model(model, body)
    except Rejected as exc:
        raise _error(_HTTP[exc.http_status], exc.reason, exc.detail) from None


async def _json_object(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read())
    except ValueError as exc:  # not JSON, not UTF-8, or an integer too long to convert
        raise _error(web.HTTPBadRequest, "malformed", f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _error(web.HTTPBadRequest, "malformed", "body must be a JSON object")
    return body


def _error(cls: type[web.HTTPException], reason: str, detail: str) -> web.HTTPException:
    exc = cls(text=ErrorReply(error=reason, detail=detail).model_dump_json(), content_type="application/json")
    exc.echo2_reason = reason  # type: ignore[attr-defined]  # the counted rejection reason
    return exc
