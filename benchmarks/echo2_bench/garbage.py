"""A garbage suite: every malformed request a learner must refuse, sent over real sockets to a running one.

Given a learner's API (``https://host:port``, trusted through the run's certificate PEM, or plain
``http``), the join token, a registered credential and the broadcast port, :func:`run_garbage` sends
each item of :data:`ITEMS` and returns, per item, the status codes it got: 0 where the learner dropped
the connection (the broadcast port's answer to garbage, and a short body's sender that hangs up), -1
where it answered nothing within the wait (a stall: always wrong). Header-level items go as raw bytes
over TLS (``ssl`` + ``asyncio`` streams: no HTTP client would send them), the floods through aiohttp.

What each item must get is in the item (:attr:`Item.want`, :attr:`Item.error`, :attr:`Item.must`),
and :func:`problems` lists every item that got something else (an empty list: the learner passed).
:attr:`Item.counted` is the ``store/rejected/<reason>`` each answer is counted under, for a caller that
checks the learner's metrics too (the integration test, ``tests/integration/test_garbage.py``).

Run against a run directory (it registers an identity of its own)::

    PYTHONPATH=benchmarks python -m echo2_bench.garbage RUN_DIR
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import ssl
import struct
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

DEEP = 50_000  # nesting of the deep JSON bodies
DEEP_REGISTER = 2_000  # ... of a registration's (its body is read up to 4 KiB only)
DEEP_FRAME = 5_000  # nesting of the deep broadcast frame header
FLOOD = 400  # requests of the flood (the default cap is 50/s, bursts of 100)
MAX_PULLS = 64  # snapshot pulls before the over-budget item gives up waiting for a 429
DROPPED, SILENT = 0, -1  # statuses for a connection the learner closed without an answer / never answered


@dataclass(frozen=True)
class Target:
    """A running learner, as the suite reaches it."""

    api: str  # the API base, e.g. https://127.0.0.1:8765 (no /v1, no fragment)
    cert_pem: str | None  # the run's certificate (PEM), the only one trusted; None for plain http
    token: str  # the run's join token
    credential: str  # a registered identity's bearer credential (the suite spends its rate and budget)
    broadcast: tuple[str, int]  # host and port of the snapshot broadcast (TLS with the same certificate)

    @property
    def tls(self) -> ssl.SSLContext | None:
        if self.cert_pem is None:
            return None
        ctx = ssl.create_default_context(cadata=self.cert_pem)
        ctx.check_hostname = False  # trusting exactly the run's certificate is the check
        return ctx

    @property
    def host_port(self) -> tuple[str, int]:
        parts = urlsplit(self.api)
        assert parts.hostname is not None, self.api
        return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


@dataclass(frozen=True)
class Item:
    """One piece of garbage and the answer it must get."""

    name: str
    send: Callable[[Target, float], Awaitable[list[tuple[int, str]]]]  # -> (status, error code) per answer
    want: frozenset[int]  # every answer's status is one of these
    error: str | None = None  # every non-200 answer carries this ErrorReply code (None: no body expected)
    must: int | None = None  # and this status appears at least once (the floods)
    counted: str | None = None  # the store/rejected/<reason> each refusal is counted under
    wait_s: float = 15.0  # how long one answer may take


@dataclass
class Outcome:
    """What one item got."""

    name: str
    statuses: list[int] = field(default_factory=list)  # HTTP statuses (0 dropped, -1 no answer in time)
    errors: list[str] = field(default_factory=list)  # the ErrorReply code of each answer ("" if none)


# ---- raw HTTP over TLS -----------------------------------------------------------------------------------
async def _raw(target: Target, request: bytes, wait_s: float) -> tuple[int, str]:
    """Send ``request`` as bytes over a fresh connection, read until the learner closes it: (status,
    error code); (0, "") if it closed without an answer, (-1, "") if it said nothing in ``wait_s``."""
    host, port = target.host_port
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=target.tls, server_hostname=host if target.tls else None),
            wait_s,
        )
    except (OSError, TimeoutError):
        return DROPPED, ""
    try:
        writer.write(request)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), wait_s)
    except TimeoutError:
        return SILENT, ""
    except (OSError, ssl.SSLError):
        return DROPPED, ""
    finally:
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()
    return _parse_response(data)


def _parse_response(data: bytes) -> tuple[int, str]:
    if not data.startswith(b"HTTP/"):
        return DROPPED, ""
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, _error_code(body)


def _error_code(body: bytes) -> str:
    try:
        reply = json.loads(body)
    except ValueError:
        return ""
    return reply.get("error", "") if isinstance(reply, dict) else ""


def _request(
    method: str, path: str, body: bytes = b"", headers: tuple[bytes, ...] = (), length: int | None = None
) -> bytes:
    """A request with a Content-Length of ``length`` (default: the body's; none for a chunked one)."""
    lines = [f"{method} /v1/{path} HTTP/1.1".encode(), b"Host: echo2", b"Connection: close", *headers]
    chunked = any(h.lower().startswith(b"transfer-encoding") for h in headers)
    if length is not None or (body and not chunked):
        lines.append(b"Content-Length: %d" % (len(body) if length is None else length))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _bearer(target: Target) -> bytes:
    return b"Authorization: Bearer " + target.credential.encode()


def _join(target: Target) -> bytes:
    """What a registration carries: the join token as its bearer."""
    return b"Authorization: Bearer " + target.token.encode()


def raw_item(build: Callable[[Target], bytes]) -> Callable[[Target, float], Awaitable[list[tuple[int, str]]]]:
    async def send(target: Target, wait_s: float) -> list[tuple[int, str]]:
        return [await _raw(target, build(target), wait_s)]

    return send


def _deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


def _deep_object(n: int) -> bytes:
    return b'{"a": ' * n + b"1" + b"}" * n


# ---- floods, through a real HTTP client ------------------------------------------------------------------
async def _over_budget(target: Target, wait_s: float) -> list[tuple[int, str]]:
    """Pull the whole chain (``have=-1``) again and again until the learner says over_budget."""
    out: list[tuple[int, str]] = []
    timeout = aiohttp.ClientTimeout(total=wait_s * 4)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for _ in range(MAX_PULLS):
            async with session.get(
                f"{target.api}/v1/snapshot?have=-1",
                headers={"Authorization": f"Bearer {target.credential}"},
                ssl=target.tls or False,
            ) as resp:
                body = await resp.read()
                out.append((resp.status, "" if resp.status == 200 else _error_code(body)))
            if resp.status != 200:
                break
    return out


async def _flood(target: Target, wait_s: float) -> list[tuple[int, str]]:
    """``FLOOD`` requests at once from one identity, over a few kept-alive connections."""
    timeout = aiohttp.ClientTimeout(total=wait_s * 4)
    connector = aiohttp.TCPConnector(limit=16, ssl=target.tls or False)
    auth = {"Authorization": f"Bearer {target.credential}"}

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        beat = {"rollouts": 0, "busy_s": 0.0, "installed_version": -1}  # no bytes to serve: the rate alone

        async def one() -> tuple[int, str]:
            async with session.post(f"{target.api}/v1/heartbeat", json=beat, headers=auth) as resp:
                body = await resp.read()
                if resp.status == 429 and not resp.headers.get("Retry-After"):
                    return resp.status, "no_retry_after"
                return resp.status, "" if resp.status == 200 else _error_code(body)

        return list(await asyncio.gather(*(one() for _ in range(FLOOD))))


# ---- the broadcast port ----------------------------------------------------------------------------------
async def _broadcast(target: Target, payload: bytes, wait_s: float, tls: bool) -> list[tuple[int, str]]:
    """Send ``payload`` to the broadcast port (over TLS when ``tls`` and the run has a certificate) and
    read until the learner closes: 0 (it did, whatever it said first) or -1 (still open after
    ``wait_s``). A refused handshake is a dropped connection too."""
    host, port = target.broadcast
    ctx = target.tls if tls else None
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=ctx, server_hostname="" if ctx else None), wait_s
        )
    except (OSError, TimeoutError):
        return [(DROPPED, "")]
    try:
        writer.write(payload)
        await writer.drain()
        async with asyncio.timeout(wait_s):
            while await reader.read(1 << 16):
                pass
    except TimeoutError:
        return [(SILENT, "")]
    except (OSError, ssl.SSLError):
        pass
    finally:
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()
    return [(DROPPED, "")]


def _frame(header: bytes) -> bytes:
    return struct.pack("!I", len(header)) + header


def broadcast_item(
    payload: bytes, tls: bool = True
) -> Callable[[Target, float], Awaitable[list[tuple[int, str]]]]:
    async def send(target: Target, wait_s: float) -> list[tuple[int, str]]:
        return await _broadcast(target, payload, wait_s, tls)

    return send


_JUNK = b"\xde\xad\xbe\xef" * 4096
_DEEP_FRAME = _frame(b'{"op": "get", "x": ' + _deep(DEEP_FRAME) + b"}")
_SURROGATE_JOIN = _frame(
    b'{"op": "join", "worker": "w", "host": "127.0.0.1", "port": 1, "cert": "' + b"0" * 64 + b'", '
    b'"credential": "\\ud800"}'
)


_JOIN_STRANGER = _frame(
    b'{"op": "join", "worker": "made-up", "host": "127.0.0.1", "port": 1, "cert": "' + b"0" * 64 + b'"}'
)
_GET_NO_CREDENTIAL = _frame(b'{"op": "get", "v": 0, "from": "made-up", "n": 4, "cred": {}}') + b"\0" * 4


def _http(name: str, build: Callable[[Target], bytes], status: int, error: str, wait_s: float = 15.0) -> Item:
    """An item of raw bytes to the API whose one answer is ``status`` with ``error``, counted so."""
    return Item(name, raw_item(build), frozenset({status}), error, counted=error, wait_s=wait_s)


def _heartbeat(t: Target, body: bytes, *headers: bytes, length: int | None = None) -> bytes:
    return _request("POST", "heartbeat", body, (_bearer(t), *headers), length=length)


_CHUNKED = b"Transfer-Encoding: chunked"
_NUL = b"X-Evil: a\x00b"
_DEEP_NAME = b'{"name": ' + _deep_object(500) + b', "usd_per_hour": 1.0}'
_DEEP_SUBMIT = (
    b'{"lease_id": "x", "policy_version": 0, "groups": [], "next_lease": ' + _deep_object(DEEP) + b"}"
)
_HUGE_INSTALL = {"rollouts": 0, "busy_s": 0.0, "installed_version": 0, "install_s": 1e308}

ITEMS: tuple[Item, ...] = (
    # what aiohttp's parser refuses before any handler runs: the ErrorReply shape, counted bad_http
    _http("nul_in_header", lambda t: _request("GET", "version", headers=(_NUL,)), 400, "bad_http"),
    _http("length_and_chunked", lambda t: _heartbeat(t, b"0\r\n\r\n", _CHUNKED, length=5), 400, "bad_http"),
    _http("bad_request_line", lambda t: b"GARBAGE \x01\x02\r\n\r\n", 400, "bad_http"),
    _http(
        "long_header",
        lambda t: _request("GET", "version", headers=(b"X-Long: " + b"a" * 20_000,)),
        400,
        "bad_http",
    ),
    _http("bad_chunk_size", lambda t: _heartbeat(t, b"zz\r\n\r\n", _CHUNKED), 400, "bad_http"),
    # bodies: nested 50,000 deep, lone surrogates, numbers out of range
    _http(
        "deep_json_register",
        lambda t: _request("POST", "register", _deep(DEEP_REGISTER), (_join(t),)),
        400,
        "malformed",
    ),
    _http(
        "deep_json_name", lambda t: _request("POST", "register", _DEEP_NAME, (_join(t),)), 400, "malformed"
    ),
    _http("deep_json_heartbeat", lambda t: _heartbeat(t, _deep(DEEP)), 400, "malformed"),
    _http(
        "deep_json_submit",
        lambda t: _request("POST", "submit", _DEEP_SUBMIT, (_bearer(t),)),
        400,
        "malformed",
    ),
    _http(
        "surrogate_name",
        lambda t: _request("POST", "register", b'{"name": "\\ud800", "usd_per_hour": 1.0}', (_join(t),)),
        400,
        "malformed",
    ),
    _http(
        "surrogate_join_token",
        lambda t: _request("POST", "register", b"{}", (b"Authorization: Bearer \xed\xa0\x80\xff",)),
        403,
        "auth",
    ),
    # before anyone is known: nothing of a body is read (an 8 MiB one is announced, a few bytes sent)
    _http("register_no_token", lambda t: _request("POST", "register", b"{}"), 401, "auth"),
    _http(
        "register_big_body_wrong_token",
        lambda t: _request("POST", "register", b'{"x": 1}', (b"Authorization: Bearer nope",), length=8 << 20),
        403,
        "auth",
        wait_s=5.0,
    ),
    _http(
        "surrogate_bearer",
        lambda t: _request("GET", "version", headers=(b"Authorization: Bearer \xed\xa0\x80\xff",)),
        403,
        "auth",
    ),
    _http(
        "tiny_price",
        lambda t: _request("POST", "register", json.dumps({"usd_per_hour": 1e-300}).encode(), (_join(t),)),
        422,
        "invalid_price",
    ),
    _http("huge_install_s", lambda t: _heartbeat(t, json.dumps(_HUGE_INSTALL).encode()), 422, "schema"),
    # a body shorter than its Content-Length: 408 after security.body_timeout_s
    _http("short_body", lambda t: _heartbeat(t, b'{"rollouts"', length=100), 408, "slow_body", wait_s=60.0),
    # the broadcast port: the connection dropped, nothing else
    Item("broadcast_junk_plain", broadcast_item(_JUNK, tls=False), frozenset({DROPPED})),
    Item("broadcast_junk", broadcast_item(_JUNK), frozenset({DROPPED})),
    Item("broadcast_deep_header", broadcast_item(_DEEP_FRAME), frozenset({DROPPED})),
    Item("broadcast_surrogate_join", broadcast_item(_SURROGATE_JOIN), frozenset({DROPPED})),
    # ... and before anyone is known there: a made-up member, no credential, a 4 MiB header announced
    Item("broadcast_join_unregistered", broadcast_item(_JOIN_STRANGER), frozenset({DROPPED})),
    Item("broadcast_get_no_credential", broadcast_item(_GET_NO_CREDENTIAL), frozenset({DROPPED})),
    Item(
        "broadcast_big_header", broadcast_item(struct.pack("!I", 4 << 20) + b"{" * 1024), frozenset({DROPPED})
    ),
    # floods of one identity: its snapshot byte budget, then its request rate (last: it spends the rate)
    Item(
        "snapshot_over_budget",
        _over_budget,
        frozenset({200, 429}),
        "over_budget",
        must=429,
        counted="over_budget",
        wait_s=30.0,
    ),
    Item(
        "request_flood",
        _flood,
        frozenset({200, 429}),
        "rate_limited",
        must=429,
        counted="rate_limited",
        wait_s=30.0,
    ),
)


async def run_garbage(target: Target, items: tuple[Item, ...] = ITEMS) -> dict[str, Outcome]:
    """Send every item, one after the other; what each got."""
    out: dict[str, Outcome] = {}
    for item in items:
        got = await item.send(target, item.wait_s)
        out[item.name] = Outcome(item.name, [s for s, _ in got], [e for _, e in got])
    return out


def problems(outcomes: dict[str, Outcome], items: tuple[Item, ...] = ITEMS) -> list[str]:
    """Every item whose answers are not what it must get (empty: the learner passed)."""
    bad = []
    for item in items:
        got = outcomes[item.name]
        wrong = [s for s in got.statuses if s not in item.want]
        errors = {e for s, e in zip(got.statuses, got.errors, strict=True) if s not in (200, DROPPED, SILENT)}
        if not got.statuses or wrong:
            bad.append(f"{item.name}: got {sorted(set(got.statuses))}, wants {sorted(item.want)}")
        elif item.error is not None and errors - {item.error}:
            bad.append(f"{item.name}: refused as {sorted(errors)}, wants {item.error!r}")
        elif item.must is not None and item.must not in got.statuses:
            bad.append(f"{item.name}: never got {item.must} in {len(got.statuses)} answers")
    return bad


def refusals(outcomes: dict[str, Outcome], items: tuple[Item, ...] = ITEMS) -> dict[str, int]:
    """How many refusals the learner should have counted under each reason for these outcomes."""
    want: dict[str, int] = {}
    for item in items:
        if item.counted is not None:
            n = sum(1 for s in outcomes[item.name].statuses if s not in (200, DROPPED, SILENT))
            want[item.counted] = want.get(item.counted, 0) + n
    return want


async def register(api: str, cert_pem: str | None, token: str, name: str = "garbage") -> str:
    """Register an identity for the suite; its credential."""
    target = Target(api, cert_pem, token, "", ("", 0))
    async with aiohttp.ClientSession() as session:
        body = {"name": name, "usd_per_hour": 1.0}
        auth = {"Authorization": f"Bearer {token}"}
        async with session.post(
            f"{api}/v1/register", json=body, headers=auth, ssl=target.tls or False
        ) as resp:
            reply = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"registration refused: {resp.status} {reply}")
            return str(reply["credential"])


def target_of_run(run_dir: Path, credential: str) -> Target:
    """The learner of ``run_dir`` (``learner.json``, ``join_token``, ``tls_cert.pem``)."""
    info = json.loads((run_dir / "learner.json").read_text())
    cert = run_dir / "tls_cert.pem"
    token = (run_dir / "join_token").read_text().strip()
    host, port = info["broadcast"]
    return Target(
        info["url"], cert.read_text() if cert.is_file() else None, token, credential, (host, int(port))
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run directory of a running `echo2 learner`")
    args = parser.parse_args(argv)
    blank = target_of_run(args.run_dir, "")
    credential = asyncio.run(register(blank.api, blank.cert_pem, blank.token))
    outcomes = asyncio.run(run_garbage(target_of_run(args.run_dir, credential)))
    bad = problems(outcomes)
    report = {
        "outcomes": {k: sorted(set(v.statuses)) for k, v in outcomes.items()},
        "problems": bad,
        "counted": refusals(outcomes),
    }
    print(json.dumps(report, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
