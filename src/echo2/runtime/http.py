"""The HTTP plumbing of the learner's API (aiohttp), beneath the handlers of ``routes.py``.

The server: :class:`Runner` serves the application through :class:`Server`, whose connections are
:class:`JsonRefusals` protocols (aiohttp's own parser refusals answered in the ``ErrorReply`` JSON
shape), listening through :class:`PerimeterSite`, the port's ``echo2.perimeter.Perimeter``. The
replies: :func:`reply`, :func:`error` (a refusal as aiohttp's exception, counted by its reason),
:func:`stream_parts`, :func:`answer_and_close`, :func:`clean`. What a request may cost: :func:`bearer`,
:func:`read_at_most`, :class:`CopyBudget` (the join token's copies of each served object),
and ``echo2.logs.SampledLog`` logs the refusals a stranger can repeat, without a flood.
"""

from __future__ import annotations

import asyncio
import logging
import math
import ssl
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from pydantic import BaseModel

from echo2.perimeter import Perimeter
from echo2.protocol import ErrorReply

log = logging.getLogger("echo2.runtime.routes")  # its lines are the API's

MAX_DETAIL_CHARS = 300  # the longest detail of aiohttp's own refusals echoed back (they quote the peer)


class JsonRefusals(RequestHandler):
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
                clean(message or str(exc) or "malformed HTTP request")[:MAX_DETAIL_CHARS],
            )
            log.warning("refused a malformed HTTP request from %s: %d %r", request.remote, status, detail)
        self.on_refusal(reason)
        if request.writer.output_size > 0:  # a response is under way: only the connection can end
            raise ConnectionError(f"{reason} after the response started: {detail}")
        resp = reply(ErrorReply(error=reason, detail=detail), status=status)
        resp.force_close()
        return resp


class Server(web.Server):
    """The application's low-level server, making :class:`JsonRefusals` protocols."""

    def __init__(self, *args: Any, on_refusal: Callable[[str], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_refusal = on_refusal

    def __call__(self) -> RequestHandler:
        return JsonRefusals(self, loop=self._loop, on_refusal=self.on_refusal, **self._kwargs)


class Runner(web.AppRunner):
    """``web.AppRunner`` serving the application through :class:`Server`, built from the server the
    application makes (the same handler, request factory and protocol settings)."""

    def __init__(self, app: web.Application, on_refusal: Callable[[str], None], **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._on_refusal = on_refusal

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()
        return Server(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            loop=made._loop,
            on_refusal=self._on_refusal,
            **made._kwargs,
        )


BODY_HEADERS = ("content-type", "content-length")
# between the API's fronts (``runtime/front.py``) and the learner, on the learner's owner-only unix socket
# alone: a front sets the first on every request it forwards (any peer's own is never forwarded), the
# learner the other two on a reply (the front then vouches for, or closes, the peer's connection)
PEER_HEADER = "X-Echo2-Peer"  # the peer address the front saw
VOUCH_HEADER = "X-Echo2-Vouch"  # the request authenticated: the connection is a member's
CLOSE_HEADER = "X-Echo2-Close"  # a stranger's refusal: close the connection once it is answered
FRONT_BATCH = "/internal/batch"  # a front's batch of heartbeats and lease requests (Routes.batch)
FRONT_AUTH = "/internal/auth"  # a front asks whether a credential may send a large body (Routes.credential)
# refusals any stranger can repeat at will (counted in metrics; logged at most every LOG_EVERY_S each)
# (a caught or retired identity's credential too: its catch or retirement is logged once, where it happens,
# and a liar that keeps knocking with it would otherwise write a line a request)
FLOODABLE = frozenset(
    {"rate_limited", "auth", "oversized", "token_budget", "bad_http", "malformed", "quarantined", "retired"}
)
LOG_EVERY_S = 10.0
# what aiohttp's parser reads of a stranger's request head: its lines (a worker's requests send about 7
# of under 100 bytes; the request line keeps aiohttp's 8190-byte limit)
MAX_HEADER_FIELD = 4 << 10  # bytes of one header line
MAX_HEADERS = 24  # header lines of one request


async def stream_parts(
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


def reply(model: BaseModel, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        text=model.model_dump_json(), status=status, content_type="application/json", headers=headers
    )


REASON_BY_STATUS = {  # the counted reason of aiohttp's own refusals (ours carry theirs: ``error``)
    400: "malformed",
    401: "auth",
    403: "auth",
    404: "not_found",
    405: "method",
    413: "oversized",
}


def reason_of(exc: web.HTTPException) -> str:
    """The counted reason of the refusal ``exc``: ours as :func:`error` named it, aiohttp's by status."""
    ours: str | None = getattr(exc, "echo2_reason", None)
    return ours or REASON_BY_STATUS.get(exc.status, f"http_{exc.status}")


def refusal(exc: web.HTTPException) -> web.Response:
    """``exc``'s reply in the :class:`ErrorReply` shape (ours as made; aiohttp's own wrapped), its
    headers but the body's kept (``Retry-After``)."""
    keep = {k: v for k, v in exc.headers.items() if k.lower() not in BODY_HEADERS}
    if getattr(exc, "echo2_reason", None) is not None:
        return web.Response(body=exc.body, status=exc.status, content_type="application/json", headers=keep)
    return reply(ErrorReply(error=reason_of(exc), detail=clean(exc.text or "")), exc.status, keep)


async def answer_and_close(request: web.Request, exc: web.HTTPException) -> web.StreamResponse:
    """Send ``exc``'s reply and close the connection at once (aiohttp would otherwise linger, reading
    what is left of the body, for up to ``lingering_time``: a slow sender's grip on the connection)."""
    return await send_and_close(request, refusal(exc))


async def send_and_close(request: web.Request, resp: web.Response) -> web.StreamResponse:
    """Send ``resp`` and close the connection at once (what is left of the request's body unread)."""
    resp.force_close()
    await resp.prepare(request)
    await resp.write_eof()
    transport = request.transport
    if transport is not None and not transport.is_closing():  # a TLS transport closed twice forgets its
        transport.close()  # connection while aiohttp may still read a pipelined request off it
    return resp


def clean(text: str) -> str:
    """``text`` with what cannot be UTF-8 (lone surrogates from a peer's escapes or undecodable header
    bytes) written as ``\\uXXXX`` escapes: safe in a JSON reply and a log line."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error(
    cls: type[web.HTTPException],
    reason: str,
    detail: str,
    headers: dict[str, str] | None = None,
    close: bool = False,
    retry_after_s: float | None = None,
) -> web.HTTPException:
    """The refusal ``reason`` as aiohttp's exception (the :class:`ErrorReply` shape); ``close``: the
    connection closes once it is sent (a stranger's refusal: nothing more is read from it);
    ``retry_after_s``: a ``Retry-After`` header of those seconds (whole, at least 1)."""
    if retry_after_s is not None:
        headers = {**(headers or {}), "Retry-After": str(max(1, math.ceil(retry_after_s)))}
    body = ErrorReply(error=reason, detail=clean(detail)).model_dump_json()
    sizes = (0, 0) if cls is web.HTTPRequestEntityTooLarge else ()  # its sizes: the detail says them
    exc = cls(*sizes, text=body, content_type="application/json", headers=headers)
    exc.echo2_reason = reason  # type: ignore[attr-defined]  # the counted rejection reason
    exc.echo2_close = close  # type: ignore[attr-defined]
    return exc


def bearer(request: web.Request) -> str | None:
    """The bearer credential (or, on register, join token) of ``Authorization``, or None."""
    header = request.headers.get("Authorization", "")
    value = header[7:].strip() if header.startswith("Bearer ") else ""
    return value or None


async def read_body(request: web.Request, limit: int | None, timeout: float) -> bytes:
    """The whole body, within ``timeout`` seconds (``security.body_timeout_s``; 408 ``slow_body`` and the
    connection closed, else) and ``limit`` bytes (413 ``oversized``, closed, before it is read; None: the
    app's ``client_max_size``); 400 ``bad_http`` if its framing breaks; ``dropped`` if the peer left
    first."""
    if limit is not None and (request.content_length or 0) > limit:
        raise error(
            web.HTTPRequestEntityTooLarge,
            "oversized",
            f"a body of {request.content_length} bytes; this request takes at most {limit}",
            close=True,
        )
    try:
        async with asyncio.timeout(timeout):
            return await (request.read() if limit is None else read_at_most(request, limit))
    except TimeoutError:
        raise error(
            web.HTTPRequestTimeout,
            "slow_body",
            f"the body did not arrive within {timeout:g} s (security.body_timeout_s)",
            close=True,  # the rest of that body is not waited for
        ) from None
    except web.RequestPayloadError as exc:
        raise error(web.HTTPBadRequest, "bad_http", f"body: {clean(str(exc))}") from None
    except ConnectionError:  # nobody left to answer: counted, and the reply goes nowhere
        raise error(web.HTTPBadRequest, "dropped", "the connection closed before the body arrived") from None


async def read_at_most(request: web.Request, limit: int) -> bytes:
    """The body, read until its end but refused (413 ``oversized``, the connection closed) at the first
    byte past ``limit``: a chunked body with no length is held to the same bound."""
    out = bytearray()
    while chunk := await request.content.read(limit + 1 - len(out)):
        out += chunk
        if len(out) > limit:
            raise error(
                web.HTTPRequestEntityTooLarge,
                "oversized",
                f"this request takes at most {limit} bytes",
                close=True,
            )
    return bytes(out)


class CopyBudget:
    """What all identities of one join token may be served of each kind of object (the model files, a
    version's manifest, snapshot chains, a LoRA run's base), in copies of that object: a token bucket
    per kind holding ``burst`` copies (``security.max_workers``: the whole fleet fetching once at
    start), refilled at ``per_hour`` copies an hour (``security.token_copies_per_hour``). A request
    books its bytes as a fraction of a whole copy (``copy_bytes``: the object's size now), so a
    patch-sized catch-up costs a patch's share. One join token per run today: the kinds are the keys."""

    def __init__(self, burst: float, per_hour: float, clock: Callable[[], float]) -> None:
        self.burst, self.per_hour, self.clock = float(burst), float(per_hour), clock
        self._levels: dict[str, tuple[float, float]] = {}  # kind -> (copies left, at clock time)

    def level(self, kind: str) -> float:
        """Copies of ``kind`` the token may still be served now."""
        left, at = self._levels.get(kind, (self.burst, self.clock()))
        return min(self.burst, left + (self.clock() - at) * self.per_hour / 3600.0)

    def take(self, kind: str, nbytes: int, copy_bytes: int) -> float:
        """Book ``nbytes`` of ``kind`` (0: booked) or the seconds until they fit (nothing booked)."""
        need = nbytes / max(1, copy_bytes)
        left = self.level(kind)
        if need <= left:
            self._levels[kind] = (left - need, self.clock())
            return 0.0
        return (need - left) * 3600.0 / self.per_hour


class PerimeterSite(web.BaseSite):
    """An aiohttp site whose listener is the port's :class:`~echo2.perimeter.Perimeter` (caps, TLS with
    its deadline, the header deadline) in front of the runner's server."""

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None,
        perimeter: Perimeter,
        reuse_port: bool = False,
    ) -> None:
        super().__init__(runner)
        self._host, self._port, self._tls, self._perimeter = host, port, ssl_context, perimeter
        self._reuse_port = reuse_port  # several processes serve the port (runtime/front.py)

    @property
    def name(self) -> str:
        return f"{'https' if self._tls else 'http'}://{self._host}:{self.port}"

    @property
    def port(self) -> int:
        server = self._server
        if not isinstance(server, asyncio.Server) or not server.sockets:
            return self._port
        return int(server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self._server = await self._perimeter.serve(
            server, self._host, self._port, self._tls, reuse_port=self._reuse_port
        )
