"""The worker's end of the wire protocol: typed calls to the learner's API (``echo2.protocol``).

Every call sends a request model and parses the reply model; a 4xx/5xx reply raises :class:`Refused`
with the learner's :class:`~echo2.protocol.ErrorReply`. Connection failures are retried for
``reconnect_s`` (the learner may be restarting), then :class:`LearnerGone` is raised; a 503 (a learner
that is up but not ready, e.g. restarted and not yet republished) is retried as long, then returned,
and so is a 429 ``rate_limited`` (this identity's request rate is over ``security.max_requests_per_s``)
or ``token_budget`` (the join token's identities together had their copies of an object for now),
each retry after the ``Retry-After`` the learner sent (at most what is left of ``reconnect_s``). Any
other 429, ``over_budget`` above all (this identity was sent its byte budget of a snapshot version:
asking again cannot help), is returned at once.

The client is made from the join string (``echo2.transport.parse_join``): over ``https`` it talks
only to the certificate whose SHA-256 fingerprint the join string pins (``aiohttp.Fingerprint``,
checked right after the handshake, before the request is sent: the join token never reaches an
impostor), and a mismatch raises :class:`~echo2.transport.PinError` at once, never retried.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections.abc import Callable
from typing import Any, TypeVar

import aiohttp
from pydantic import BaseModel, ValidationError

from echo2.errors import Echo2Error
from echo2.protocol import (
    API,
    LEASE_REPLY,
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
)
from echo2.transport import PinError, parse_join
from echo2.weights.chain import decode_chain

R = TypeVar("R", bound=BaseModel)
RETRY_S = 0.5  # pause between attempts to reach an unreachable learner (or one not ready: 503)


class LearnerGone(Echo2Error):
    """The learner stayed unreachable past ``reconnect_s``."""


class Refused(Echo2Error):
    """The learner answered with an error status."""

    def __init__(self, status: int, reply: ErrorReply) -> None:
        super().__init__(f"{status} {reply.error}: {reply.detail}")
        self.status = status  # HTTP status
        self.reply = reply  # reason code and detail


# 429s that say "later" (this identity's request rate; the join token's copies of an object for now);
# over_budget (this identity had its copies) stands
RETRIED_429 = frozenset({"rate_limited", "token_budget"})
SNAPSHOT_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=10, sock_read=60)


class LearnerClient:
    def __init__(
        self,
        join_url: str,
        session: aiohttp.ClientSession,
        reconnect_s: float,
        give_up: Callable[[], bool] = lambda: False,
    ) -> None:
        join = parse_join(join_url)
        self.base = join.url + API
        self.pin = join.pin  # SHA-256 of the learner's certificate (None: plain http); the broadcast's too
        self._ssl = aiohttp.Fingerprint(bytes.fromhex(join.pin)) if join.pin else None
        self.session = session
        self.reconnect_s = reconnect_s
        self.give_up = give_up  # stop retrying early (the worker is shutting down)
        self.credential: str | None = None

    async def register(self, req: RegisterRequest, token: str) -> RegisterReply:
        """Join the run with its join ``token`` (sent as the bearer of this one request); the credential
        the reply carries is the bearer of every later one."""
        if req.attempt is None:  # one id for this registration, repeated by every retry of it (_request)
            req = req.model_copy(update={"attempt": secrets.token_urlsafe(16)})
        self.credential = token
        try:
            reply = await self._call("POST", "/register", RegisterReply, req)
        finally:
            self.credential = None
        self.credential = reply.credential
        return reply

    async def heartbeat(self, req: HeartbeatRequest) -> HeartbeatReply:
        return await self._call("POST", "/heartbeat", HeartbeatReply, req)

    async def lease(self, req: LeaseRequest) -> LeaseGrant | LeaseRefusal:
        status, body, _ = await self._request("POST", "/lease", req)
        self._raise_for(status, body)
        return LEASE_REPLY.validate_json(body)

    async def submit(self, req: SubmitRequest) -> SubmitReply:
        return await self._call("POST", "/submit", SubmitReply, req)

    async def version(self) -> VersionReply:
        return await self._call("GET", "/version", VersionReply)

    async def snapshot_chain(
        self, have: int, base_held: bool = False
    ) -> list[tuple[dict[str, Any], memoryview]]:
        """The signed links (manifest dict, bytes) from installed version ``have`` to the newest (in a
        LoRA run led by the base unless ``base_held``); the caller verifies every one (``ChainError``
        if the body itself is malformed)."""
        # no total timeout: the first anchor of a real model is GBs over a WAN; a stall still ends it
        path = f"/snapshot?have={int(have)}&base={int(base_held)}"
        status, body, _ = await self._request("GET", path, timeout=SNAPSHOT_TIMEOUT)
        self._raise_for(status, body)
        return decode_chain(body)

    async def model(self) -> ModelReply:
        return await self._call("GET", "/model", ModelReply)

    # ---- plumbing -----------------------------------------------------------------------------------
    async def _call(self, method: str, path: str, reply: type[R], req: BaseModel | None = None) -> R:
        status, body, _ = await self._request(method, path, req)
        self._raise_for(status, body)
        return reply.model_validate_json(body)

    async def _request(
        self,
        method: str,
        path: str,
        req: BaseModel | None = None,
        timeout: aiohttp.ClientTimeout | None = None,
    ) -> tuple[int, bytes, dict[str, str]]:
        headers = {"Content-Type": "application/json"}
        if self.credential:
            headers["Authorization"] = f"Bearer {self.credential}"
        data = req.model_dump_json() if req is not None else None
        deadline = time.monotonic() + self.reconnect_s
        while True:
            try:
                extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}  # None: no timeout
                if self._ssl is not None:
                    extra["ssl"] = self._ssl
                async with self.session.request(
                    method, self.base + path, data=data, headers=headers, allow_redirects=False, **extra
                ) as resp:
                    status, body = resp.status, await resp.read()
                    pause = _retry_pause(status, body, resp.headers.get("Retry-After"))
                    left = deadline - time.monotonic()
                    if pause is None or left <= 0 or self.give_up():
                        return status, body, dict(resp.headers)
                # 503: up but not ready (a restarted learner serves before it republishes); 429
                # rate_limited: asking too often. Either way: again, after the pause
                await asyncio.sleep(min(pause, left))
            except aiohttp.ServerFingerprintMismatch as exc:
                raise PinError(
                    f"the learner at {self.base} presented a TLS certificate with sha256 {exc.got.hex()}, "
                    f"not the {self.pin} of the join string: refusing to talk to it (an impostor on the "
                    "path, or a learner of another run)"
                ) from None
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                if self.give_up():
                    raise LearnerGone(f"learner at {self.base} unreachable while stopping: {exc}") from None
                if time.monotonic() >= deadline:
                    raise LearnerGone(
                        f"learner at {self.base} unreachable for {self.reconnect_s:.0f}s: {exc}"
                    ) from None
                await asyncio.sleep(RETRY_S)

    @staticmethod
    def _raise_for(status: int, body: bytes) -> None:
        if status == 200:
            return
        try:
            reply = ErrorReply.model_validate_json(body)
        except ValidationError:
            reply = ErrorReply(error="non_json", detail=body[:200].decode(errors="replace"))
        raise Refused(status, reply)


def _retry_pause(status: int, body: bytes, retry_after: str | None) -> float | None:
    """Seconds to wait before asking again, or None when the reply stands: 503 ``RETRY_S``; 429
    ``rate_limited`` or ``token_budget`` the learner's ``Retry-After`` (seconds; ``RETRY_S`` when absent
    or unreadable); anything else (``over_budget`` included) stands."""
    if status == 503:
        return RETRY_S
    if status != 429:
        return None
    try:
        if ErrorReply.model_validate_json(body).error not in RETRIED_429:
            return None
    except ValidationError:
        return None
    try:
        pause = float(retry_after) if retry_after is not None else RETRY_S
    except ValueError:
        return RETRY_S
    return pause if math.isfinite(pause) and pause >= 0 else RETRY_S
