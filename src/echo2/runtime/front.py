"""The API's fronts: processes that hold the learner's public API port, so that serving the fleet does
not take the learner's event loop and GIL from the update (``runtime.api_processes``).

A front (``python -m echo2.runtime.front``, started and stopped by the learner: :class:`Fronts`) owns
what every request costs before the learner is asked: the port's perimeter (``echo2/perimeter.py``:
caps, TLS and its deadlines, eviction), TLS, HTTP parsing and aiohttp's own refusals in the
``ErrorReply`` shape (``http.Runner``), and reading each body within ``security.body_timeout_s`` and
its route's size. It then asks the learner over the learner's unix socket (owner-only,
``Routes.serve_internal``), where the same handlers answer:

- ``register``, ``submit``, ``version``, ``snapshot``, ``model`` are forwarded one by one (the
  peer's address in ``http.PEER_HEADER``; the learner's reply says whether to vouch for the connection,
  ``VOUCH_HEADER``, or close it, ``CLOSE_HEADER``); a snapshot chain streams through;
- heartbeats and lease requests, most of a fleet's requests (an idle member's lease polls among them),
  are **batched**: every ``runtime.front_batch_s`` (or at ``MAX_BATCH`` waiting) one request carries all
  that arrived, and each peer gets its own answer from the batch's reply (``Routes.batch``): a request
  waits up to that long, and the learner's loop pays one HTTP request a batch instead of one each;
- a body longer than ``SMALL_BODY`` (a submission) is read only for a credential the learner vouched for
  in the last ``VOUCHED_TTL_S`` seconds, else after the learner said yes to the credential alone
  (``/internal/auth``): a stranger cannot make a front buffer a large body (as the learner, serving
  alone, refuses before reading one).

What a front counts (its refusals by reason, its perimeter's metrics) rides on its batches to the learner,
which keeps the counts (``store/rejected/<reason>``, ``perimeter/api/``). With several fronts
(``api_processes`` > 1) they share the port (``SO_REUSEPORT``: the kernel spreads new connections) and
each holds the perimeter's caps for its own descriptors; a peer's connections may land on several,
so its per-address caps hold per front. A front stops when the learner's process is gone. If the
learner does not answer, a peer gets 503 ``unavailable`` with ``Retry-After``, never a 500.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from echo2.config import PerimeterConfig
from echo2.perimeter import Perimeter, port_limits
from echo2.protocol import API, VERSION_HEADER, ErrorReply
from echo2.resources import RESERVED_FDS, raise_descriptor_limit
from echo2.runtime import http
from echo2.transport import TlsIdentity

log = logging.getLogger("echo2.runtime.front")

SMALL_BODY = 16 << 10  # a body up to this is read before anyone is asked (a registration)
# a batched request's body (a heartbeat or a lease request: under 200 bytes): a batch of MAX_BATCH stays
# under 3 MiB, below the smallest body the learner takes (8 MiB), whatever strangers send
BATCHED_BODY = 4 << 10
MAX_BATCH = 512  # batched requests that go at once, whatever the clock says
VOUCHED_TTL_S = 60.0  # a credential the learner vouched for may send a large body this long after
UPSTREAM_CONNECT_S = 5.0  # the learner's socket refusing a connection this long: 503 unavailable
# a front's connections to the learner at once, by lane (its requests queue for them)
UPSTREAM_CONNECTIONS = {"control": 64, "snapshot": 64, "batch": 4}
PARENT_POLL_S = 1.0  # how often a front looks for the learner's process
START_S = 60.0  # a front that does not say its port within this is a failed start
FINAL_BATCH_S = 5.0  # a stopping front's last batch (its counts, the requests waiting) waits this long
BATCHED = ("heartbeat", "lease")  # the endpoints whose requests go to the learner in batches
KEEP_REPLY = ("Content-Type", "Retry-After", VERSION_HEADER)  # the learner's reply headers a peer gets


@dataclass(frozen=True)
class FrontSpec:
    """What a front is started with (JSON on its standard input)."""

    name: str  # "front-0": its batches' and log lines' name
    host: str
    port: int  # 0: any free port (the first front), then the one the first bound
    upstream: str  # the learner's unix socket
    perimeter: dict[str, Any]  # [security.perimeter], cut to the front's own descriptors
    idle_s: float  # security.perimeter.idle_s: a member's idle connection
    body_timeout_s: float
    max_request_bytes: int
    batch_s: float  # runtime.front_batch_s
    parent: int  # the learner's pid: gone, the front stops
    reuse_port: bool = False  # several fronts on one port
    cert_pem: str | None = None  # the run's TLS identity (None: plain HTTP)
    key_pem: str | None = None


class Front:
    """One front's application (module docstring)."""

    def __init__(self, spec: FrontSpec, sessions: dict[str, aiohttp.ClientSession]) -> None:
        self.spec, self.sessions = spec, sessions  # by lane: "batch", "snapshot", "control"
        per = PerimeterConfig(**spec.perimeter)
        limits = port_limits(per, raise_descriptor_limit(per.max_connections + RESERVED_FDS), ports=1)
        self.perimeter = Perimeter("api", limits)
        self.refused: Counter[str] = Counter()  # by reason, since the last batch
        self.vouched: dict[bytes, float] = {}  # credential digest -> when the learner last vouched for it
        self._waiting: list[tuple[list[Any], asyncio.Future[list[Any]]]] = []  # (item, its answer)
        self._wake = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.spec.max_request_bytes, middlewares=[self._errors])
        post = [f"{API}/{p}" for p in ("register", "submit")]
        get = [f"{API}/{p}" for p in ("version", "snapshot", "model")]
        app.add_routes(
            [web.post(f"{API}/{p}", self.batched) for p in BATCHED]
            + [web.post(p, self.forward) for p in post]
            + [web.get(p, self.forward) for p in get]
        )
        return app

    # ---- requests ----------------------------------------------------------------------------------
    async def forward(self, request: web.Request) -> web.StreamResponse:
        """``request`` asked of the learner; its reply streamed back to the peer."""
        credential = http.bearer(request)
        body = b""
        if request.method == "POST":
            length = request.content_length if request.content_length is not None else SMALL_BODY + 1
            if length > SMALL_BODY and request.path != f"{API}/register":
                refusal = await self._vouched_for(request, credential)
                if refusal is not None:
                    return refusal
            limit = SMALL_BODY if request.path == f"{API}/register" else None
            body = await http.read_body(request, limit, self.spec.body_timeout_s)
        async with self._ask(request.method, request.path, request, body) as up:
            if up.status == 200 and request.path == f"{API}/snapshot":
                self._heed(request, up.headers, credential)
                resp = web.StreamResponse(headers=_kept(up.headers))
                await resp.prepare(request)
                try:
                    async for chunk in up.content.iter_chunked(1 << 20):
                        await resp.write(chunk)
                    await resp.write_eof()
                except ConnectionError:  # the peer went away mid-chain (killed, restarted): routine
                    self.refused["dropped"] += 1
                return resp
            return await self._answer(request, up.status, await up.read(), up.headers, credential)

    async def batched(self, request: web.Request) -> web.StreamResponse:
        """A heartbeat or a lease request: read, then answered with its batch (:meth:`batches`)."""
        body = await http.read_body(request, BATCHED_BODY, self.spec.body_timeout_s)
        kind = request.path.rsplit("/", 1)[1]
        item = [kind, http.bearer(request), request.remote, base64.b64encode(body).decode()]
        done: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._waiting.append((item, done))
        if len(self._waiting) >= MAX_BATCH:
            self._wake.set()
        status, text, retry_after, vouch, close = await done
        headers = {"Content-Type": "application/json"}
        headers.update({"Retry-After": retry_after} if retry_after else {})
        headers.update({http.VOUCH_HEADER: "1"} if vouch else {})
        headers.update({http.CLOSE_HEADER: "1"} if close else {})
        return await self._answer(request, status, text.encode(), headers, item[1])

    async def batches(self) -> None:
        """Every ``batch_s`` (sooner at ``MAX_BATCH`` waiting), the requests that arrived go to the
        learner as one request, with the front's counts; at least once a second even with none."""
        last = 0.0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.spec.batch_s)
            self._wake.clear()
            if not self._waiting and time.monotonic() - last < 1.0:
                continue
            last = time.monotonic()
            await self._send_next()

    async def flush(self) -> None:
        """Every request waiting, in batches of at most ``MAX_BATCH``, and the counts (a front stopping)."""
        await self._send_next()
        while self._waiting:
            await self._send_next()

    async def _send_next(self) -> None:
        waiting, self._waiting = self._waiting[:MAX_BATCH], self._waiting[MAX_BATCH:]
        await self._send(waiting)

    async def _send(self, waiting: list[tuple[list[Any], asyncio.Future[list[Any]]]]) -> None:
        refused, self.refused = self.refused, Counter()
        batch = {
            "front": self.spec.name,
            "items": [item for item, _ in waiting],
            "refused": dict(refused),
            "perimeter": self.perimeter.metrics(),
        }
        try:
            async with self._ask("POST", http.FRONT_BATCH, None, orjson.dumps(batch)) as up:
                answers = orjson.loads(await up.read())["items"] if up.status == 200 else None
        except (aiohttp.ClientError, OSError, TimeoutError, KeyError, orjson.JSONDecodeError) as exc:
            log.warning(
                "%s: a batch of %d requests not answered by the learner: %s",
                self.spec.name,
                len(waiting),
                exc,
            )
            answers = None
        if answers is None or len(answers) != len(waiting):
            self.refused.update(refused)  # told with the next batch
            answers = [UNAVAILABLE_ITEM] * len(waiting)
        for (_, done), answer in zip(waiting, answers, strict=True):
            if not done.done():
                done.set_result(answer)

    def _ask(self, method: str, path: str, request: web.Request | None, body: bytes) -> Any:
        """A request to the learner: the peer's credential, content type and version header, and its
        address (``PEER_HEADER``); nothing else of the peer's headers."""
        headers = {}
        if request is not None:
            headers = {
                k: request.headers[k]
                for k in ("Authorization", "Content-Type", VERSION_HEADER)
                if k in request.headers
            }
            headers[http.PEER_HEADER] = request.remote or "?"
        lane = (
            "batch"
            if path.startswith("/internal/")
            else "snapshot"
            if path.endswith("/snapshot")
            else "control"
        )
        return self.sessions[lane].request(
            method,
            f"http://learner{path}",
            data=body or None,
            headers=headers,
            params=request.query if request is not None else None,
        )

    async def _vouched_for(self, request: web.Request, credential: str | None) -> web.StreamResponse | None:
        """None if ``credential`` may send a large body (the learner vouched for it lately, or says so
        now), else the learner's refusal for the peer."""
        if (
            credential is not None
            and time.monotonic() - self.vouched.get(_digest(credential), -VOUCHED_TTL_S) < VOUCHED_TTL_S
        ):
            return None
        async with self._ask("GET", http.FRONT_AUTH, request, b"") as up:
            status, text, headers = up.status, await up.read(), up.headers
        if status == 204:
            self._remember(credential)
            self.perimeter.vouch(request.transport)
            return None
        return await self._answer(request, status, text, headers, credential)

    async def _answer(
        self, request: web.Request, status: int, body: bytes, headers: Any, credential: str | None
    ) -> web.StreamResponse:
        """The learner's reply to the peer; the connection vouched for or closed as it says."""
        self._heed(request, headers, credential)
        resp = web.Response(body=body, status=status, headers=_kept(headers))
        if headers.get(http.CLOSE_HEADER):  # a stranger's refusal: nothing more is read from it
            return await http.send_and_close(request, resp)
        return resp

    def _heed(self, request: web.Request, headers: Any, credential: str | None) -> None:
        """The learner vouched for the request (``VOUCH_HEADER``): its connection is a member's."""
        if headers.get(http.VOUCH_HEADER):
            self._remember(credential)
            self.perimeter.vouch(request.transport)

    def _remember(self, credential: str | None) -> None:
        if credential is None:
            return
        now = time.monotonic()
        if len(self.vouched) > 4 * MAX_BATCH and len(self.vouched) % MAX_BATCH == 0:  # forget the old
            self.vouched = {k: t for k, t in self.vouched.items() if now - t < VOUCHED_TTL_S}
        self.vouched[_digest(credential)] = now

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        """What a front refuses itself (a body too large or too slow, no such route, the learner
        unreachable) in the ``ErrorReply`` shape, counted by reason (told to the learner)."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            self.refused[http.reason_of(exc)] += 1
            if getattr(exc, "echo2_close", False):
                return await http.answer_and_close(request, exc)
            return http.refusal(exc)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.warning(
                "%s: %s %s not answered by the learner: %s", self.spec.name, request.method, request.path, exc
            )
            self.refused["unavailable"] += 1
            return web.Response(text=UNAVAILABLE, status=503, content_type="application/json", headers=RETRY)


UNAVAILABLE = ErrorReply(error="unavailable", detail="the learner did not answer; retry").model_dump_json()
RETRY = {"Retry-After": "1"}
UNAVAILABLE_ITEM = [503, UNAVAILABLE, RETRY["Retry-After"], False, False]  # a batch's answer to each


def _kept(headers: Any) -> dict[str, str]:
    return {k: headers[k] for k in KEEP_REPLY if k in headers}


def _digest(credential: str) -> bytes:
    return hashlib.sha256(credential.encode("utf-8", "surrogateescape")).digest()


# ---- the process ----------------------------------------------------------------------------------
async def _serve(spec: FrontSpec) -> None:
    # connections to the learner in lanes, each with a cap and its requests waiting here for one (a burst
    # of registrations would otherwise overflow the socket's backlog: refused at once, 503), so that
    # snapshot streams never hold up a registration, nor either a batch of heartbeats
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=UPSTREAM_CONNECT_S)
    async with contextlib.AsyncExitStack() as stack:
        sessions = {}
        for lane, cap in UPSTREAM_CONNECTIONS.items():
            connector = aiohttp.UnixConnector(path=spec.upstream, limit=cap, keepalive_timeout=60.0)
            session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False)
            sessions[lane] = await stack.enter_async_context(session)
        front = Front(spec, sessions)
        runner = http.Runner(
            front.app(),
            lambda reason: front.refused.update([reason]),
            access_log=None,
            keepalive_timeout=spec.idle_s,
            max_field_size=http.MAX_HEADER_FIELD,
            max_headers=http.MAX_HEADERS,
        )
        await runner.setup()
        tls = (
            TlsIdentity(spec.cert_pem.encode(), spec.key_pem.encode(), "")
            if spec.cert_pem and spec.key_pem
            else None
        )
        site = http.PerimeterSite(
            runner,
            spec.host,
            spec.port,
            tls.server_context() if tls else None,
            front.perimeter,
            reuse_port=spec.reuse_port,
        )
        await site.start()
        print(json.dumps({"port": site.port}), flush=True)  # the learner reads this line
        batches = asyncio.create_task(front.batches())
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        while not stop.is_set() and os.getppid() == spec.parent:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), PARENT_POLL_S)
        batches.cancel()
        with contextlib.suppress(TimeoutError):  # the heartbeats waiting and the counts, not lost
            await asyncio.wait_for(front.flush(), FINAL_BATCH_S)
        await runner.cleanup()


def main() -> None:
    """``python -m echo2.runtime.front``: a :class:`FrontSpec` as JSON on standard input."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = FrontSpec(**json.loads(sys.stdin.readline()))
    asyncio.run(_serve(spec))


class Fronts:
    """The learner's fronts: started on its API port, stopped with it (:meth:`close`)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.port = 0

    async def start(self, count: int, spec: FrontSpec) -> int:
        """``count`` fronts from ``spec`` (the first on ``spec.port``, the others on the port it bound);
        the port. A front that fails to start stops the learner with its reason."""
        for i in range(count):
            one = FrontSpec(
                **{
                    **asdict(spec),
                    "name": f"front-{i}",
                    "port": self.port or spec.port,
                    "reuse_port": count > 1,
                }
            )
            self.port = await asyncio.to_thread(self._start_one, one)
        return self.port

    def _start_one(self, spec: FrontSpec) -> int:
        proc = subprocess.Popen(
            [sys.executable, "-m", "echo2.runtime.front"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(asdict(spec)) + "\n")
        proc.stdin.close()
        ready, _, _ = select.select([proc.stdout], [], [], START_S)
        line = proc.stdout.readline() if ready else ""  # its stderr is the learner's: a failure is there
        if not line:
            proc.kill()
            proc.wait()
            raise RuntimeError(
                f"the API's {spec.name} did not start (exit status {proc.returncode}; its log above)"
            )
        return int(json.loads(line)["port"])

    async def aclose(self) -> None:
        """:meth:`close` off the event loop, which answers the fronts' last batches meanwhile."""
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []


if __name__ == "__main__":
    main()
