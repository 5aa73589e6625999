"""Perimeter attackers: strangers (no join token, no credential, except where said) at both of a learner's
ports, each one process held to a CPU share (:class:`Governor`), dialling from many loopback addresses
(127.0.0.2-254: all of 127/8 is loopback on Linux) as strangers on many machines would.

Each attack (:data:`ATTACKS`) runs as ``python -m echo2_bench.perimeter KIND --target FILE ...``: it
prepares (``quarantined`` builds a real worker), prints ``ready``, waits for a line on stdin, attacks for
``--seconds`` and prints one JSON line: what it did and got, and the CPU seconds it spent.

- ``idle_api`` / ``idle_broadcast``: connections that do nothing (half plain TCP that never starts TLS,
  half a TLS handshake and then nothing, or an unfinished request line), re-opened as the learner closes
  them, up to ``--attempts`` in all and ``--open`` at once;
- ``slowloris``: TLS connections to the API dribbling a header that never ends, a byte every 2 s;
- ``oversized``: a registration with a wrong join token and an 8 MiB body, sent as fast as it goes, and
  a broadcast frame announcing a 4 MiB header (before: both were read and parsed whole);
- ``handshake_flood``: TLS handshakes, each followed by one uncredentialed request (a ``get`` on the
  broadcast port, ``GET /v1/model`` with a bad bearer on the API);
- ``joins_pulls``: joins of made-up members (no credential, a made-up one: the 8 fake relays of the issue)
  and pulls with credentials signed by another key; counts what came back other than a refusal;
- ``quarantined``: a registered identity (it holds the token) joins the broadcast as a real relay
  node, then submits a completion with a laundering turn mask and is quarantined (a forged reward no
  longer is: the learner grades every completion and reads no worker's reward); the seconds until its
  broadcast connection is closed, and the versions and bytes it got after;
- ``sybil``: identities of the one join token (every free slot) pulling every byte-serving route
  (model files, the version's manifest, snapshot chains) as fast as they are let: bytes served in all.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import resource
import ssl
import struct
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

SOURCES = [f"127.0.0.{i}" for i in range(2, 255)]  # attackers' addresses (the learner's workers: .1)
SLOWLORIS_S = 2.0  # a slowloris sends one header byte this often
BIG_BODY = 8 << 20  # bytes of the oversized registration's body
BIG_HEADER = 4 << 20  # bytes an oversized broadcast frame announces for its header
FAKE_MEMBERS = 8  # made-up members the joins attack tries, per round


@dataclass
class Target:
    """The learner under attack (``target.json`` the study writes)."""

    api: str  # https://host:port
    broadcast: tuple[str, int]
    join: str  # the join string (with the pin)
    token: str  # the run's join token (only ``quarantined`` and ``sybil`` use it)

    @property
    def api_addr(self) -> tuple[str, int]:
        parts = urlsplit(self.api)
        assert parts.hostname is not None and parts.port is not None
        return parts.hostname, parts.port


@dataclass
class Tally:
    """What an attack did and got."""

    attempts: int = 0  # connections or requests tried
    refused_at_connect: int = 0  # reset or closed before anything was sent back
    closed_by_learner: int = 0  # closed later by the learner (a deadline, an eviction, a refusal)
    answers: Counter[str] = field(default_factory=Counter)  # what came back, by kind
    bytes_sent: int = 0
    bytes_received: int = 0  # payload the learner sent (chunks, files): must be 0 for strangers
    max_open: int = 0  # connections held open at once, at most
    lifetimes_s: list[float] = field(default_factory=list)  # how long held connections lived
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        life = sorted(self.lifetimes_s)
        return {
            "attempts": self.attempts, "refused_at_connect": self.refused_at_connect,
            "closed_by_learner": self.closed_by_learner, "answers": dict(self.answers),
            "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received, "max_open": self.max_open,
            "lifetime_p50_s": life[len(life) // 2] if life else None,
            "lifetime_max_s": life[-1] if life else None,
            **self.extra,
        }  # fmt: skip


class Governor:
    """Holds this process to ``cores`` of CPU on average: :meth:`pace` sleeps off what was used above it."""

    def __init__(self, cores: float) -> None:
        self.cores = cores
        self.t0, self.c0 = time.monotonic(), time.process_time()

    async def pace(self) -> None:
        ahead = (time.process_time() - self.c0) / self.cores - (time.monotonic() - self.t0)
        await asyncio.sleep(max(0.0, ahead))

    def used(self) -> tuple[float, float]:
        """(CPU seconds, wall seconds) since the start."""
        return time.process_time() - self.c0, time.monotonic() - self.t0


def _client_tls() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # a stranger trusts nothing and needs nothing
    return ctx


async def _open(
    addr: tuple[str, int], source: str, tls: ssl.SSLContext | None, timeout: float = 15.0
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    try:
        return await asyncio.wait_for(
            asyncio.open_connection(
                *addr, local_addr=(source, 0), ssl=tls, server_hostname="" if tls else None
            ),
            timeout,
        )
    except (OSError, TimeoutError, ssl.SSLError):
        return None


async def _held(reader: asyncio.StreamReader, t: Tally, t0: float) -> None:
    """Wait until the learner closes the connection; its lifetime counted."""
    try:
        while data := await reader.read(1 << 16):
            t.answers["bytes_back"] += len(data)
    except (OSError, ssl.SSLError):
        pass
    t.closed_by_learner += 1
    t.lifetimes_s.append(time.monotonic() - t0)


# ---- the attacks ---------------------------------------------------------------------------------------
async def idle(target: Target, port: str, a: argparse.Namespace, gov: Governor, t: Tally) -> None:
    addr = target.api_addr if port == "api" else target.broadcast
    tls = _client_tls()
    open_now = 0
    sem = asyncio.Semaphore(a.open)
    tasks: set[asyncio.Task[None]] = set()
    deadline = time.monotonic() + a.seconds

    async def one(i: int, source: str) -> None:
        nonlocal open_now
        t0 = time.monotonic()
        conn = await _open(addr, source, tls if i % 2 else None)
        if conn is None:
            t.refused_at_connect += 1
            sem.release()
            return
        reader, writer = conn
        open_now += 1
        t.max_open = max(t.max_open, open_now)
        if i % 4 == 3 and port == "api":  # half of the TLS ones: an unfinished request line
            writer.write(b"GET /v1/model HTTP/1.1\r\nHost: x\r\nX-Wait: ")
        try:
            await asyncio.wait_for(_held(reader, t, t0), max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            t.extra["open_at_end"] = t.extra.get("open_at_end", 0) + 1
        finally:
            open_now -= 1
            writer.close()
            sem.release()

    for i, source in zip(range(a.attempts), itertools.cycle(SOURCES), strict=False):
        if time.monotonic() >= deadline:
            break
        await sem.acquire()
        t.attempts += 1
        task = asyncio.ensure_future(one(i, source))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        await gov.pace()
    t.extra["attempts_wanted"] = a.attempts
    await _finish(tasks, deadline)
    await asyncio.sleep(max(0.0, deadline - time.monotonic()))  # the window lasts its length either way


async def slowloris(target: Target, a: argparse.Namespace, gov: Governor, t: Tally) -> None:
    tls, deadline = _client_tls(), time.monotonic() + a.seconds
    tasks: set[asyncio.Task[None]] = set()

    async def one(source: str) -> None:
        t0 = time.monotonic()
        conn = await _open(target.api_addr, source, tls)
        if conn is None:
            t.refused_at_connect += 1
            return
        reader, writer = conn
        closing = asyncio.ensure_future(_held(reader, t, t0))
        header = b"GET /v1/model HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 10_000
        try:
            for byte in header:
                if closing.done() or time.monotonic() >= deadline:
                    break
                writer.write(bytes([byte]))
                t.bytes_sent += 1
                await asyncio.sleep(SLOWLORIS_S)
        except OSError:
            pass
        writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(closing, 1)

    for source in itertools.cycle(SOURCES):
        if time.monotonic() >= deadline:
            break
        if len(tasks) < a.open:
            t.attempts += 1
            task = asyncio.ensure_future(one(source))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        t.max_open = max(t.max_open, len(tasks))
        await gov.pace()
        await asyncio.sleep(0.01)
    await _finish(tasks, deadline)


async def oversized(target: Target, a: argparse.Namespace, gov: Governor, t: Tally) -> None:
    tls, deadline = _client_tls(), time.monotonic() + a.seconds
    head = (
        f"POST /v1/register HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer not-the-token\r\n"
        f"Content-Length: {BIG_BODY}\r\n\r\n"
    ).encode()
    piece = b"[" * (64 << 10)
    for i, source in enumerate(itertools.cycle(SOURCES)):
        if time.monotonic() >= deadline:
            break
        to_api = i % 2 == 0
        conn = await _open(target.api_addr if to_api else target.broadcast, source, tls)
        t.attempts += 1
        if conn is None:
            t.refused_at_connect += 1
            continue
        reader, writer = conn
        writer.write(head if to_api else struct.pack("!I", BIG_HEADER))
        sent, limit = 0, BIG_BODY if to_api else BIG_HEADER
        try:
            while sent < limit and time.monotonic() < deadline:
                writer.write(piece)
                await writer.drain()
                sent += len(piece)
                await gov.pace()
            reply = await asyncio.wait_for(reader.read(4096), 5)
            t.answers[_kind_of(reply)] += 1
        except (OSError, ssl.SSLError, TimeoutError):
            t.answers["cut"] += 1
        t.bytes_sent += sent
        t.extra.setdefault("sent_before_cut", []).append(sent)
        writer.close()
        await gov.pace()
    cuts = t.extra.pop("sent_before_cut", [])
    t.extra["sent_before_cut_max"] = max(cuts, default=0)


async def handshake_flood(target: Target, a: argparse.Namespace, gov: Governor, t: Tally) -> None:
    tls, deadline = _client_tls(), time.monotonic() + a.seconds
    get = _frame({"op": "get", "v": 0, "from": "stranger", "n": 4}) + b"\0" * 4
    api = b"GET /v1/model HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\nConnection: close\r\n\r\n"
    for i, source in enumerate(itertools.cycle(SOURCES)):
        if time.monotonic() >= deadline:
            break
        to_api = i % 2 == 0
        conn = await _open(target.api_addr if to_api else target.broadcast, source, tls)
        t.attempts += 1
        if conn is None:
            t.refused_at_connect += 1
        else:
            reader, writer = conn
            writer.write(api if to_api else get)
            try:
                t.answers[_kind_of(await asyncio.wait_for(reader.read(4096), 5))] += 1
            except (OSError, ssl.SSLError, TimeoutError):
                t.answers["cut"] += 1
            writer.close()
        await gov.pace()


async def joins_pulls(target: Target, a: argparse.Namespace, gov: Governor, t: Tally) -> None:
    """Made-up members (no credential; a made-up one) and pulls with another key's credential."""
    from echo2.broadcast.access import issue, pull_request
    from echo2.weights.manifest import new_signing_key

    tls, deadline = _client_tls(), time.monotonic() + a.seconds
    other = new_signing_key()
    for i, source in enumerate(itertools.cycle(SOURCES)):
        if time.monotonic() >= deadline:
            break
        member = f"fake{i % FAKE_MEMBERS}"
        if i % 3 == 2:
            header, chunks = pull_request(issue(other, 1, member, ""), [0], False, "", None)
            frame = _frame({**header, "n": len(chunks)}) + chunks
        else:
            join = {"op": "join", "worker": member, "host": source, "port": 9, "cert": "0" * 64}
            if i % 3 == 1:
                join["credential"] = "made-up-credential"
            frame = _frame(join)
        conn = await _open(target.broadcast, source, tls)
        t.attempts += 1
        if conn is None:
            t.refused_at_connect += 1
        else:
            reader, writer = conn
            writer.write(frame)
            try:
                got = await asyncio.wait_for(reader.read(1 << 16), 5)
                t.answers[_frame_op(got)] += 1
            except (OSError, ssl.SSLError, TimeoutError):
                t.answers["cut"] += 1
            writer.close()
        await gov.pace()


async def quarantined(target: Target, a: argparse.Namespace, gov: Governor, t: Tally) -> None:
    """Identities that join the broadcast as relay nodes, then launder a completion through its turn mask
    (quarantined in the request, ``turn_mask``)."""
    import aiohttp

    from echo2.broadcast.receiver import TcpWorkerNode
    from echo2.weights.manifest import key_from_text
    from echo2_bench.adversary_length import LengthAttacker

    deadline = time.monotonic() + a.seconds
    t.extra["cut_after_s"] = []
    t.extra["versions_after"] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        att = LengthAttacker(target.join, target.token, "launder", session)
        await att.start()  # a real worker's setup (its engine): before the window, see main()
        _ready()
        while time.monotonic() < deadline - 10:
            reg = await att.w._register()  # a fresh identity of the token
            node = TcpWorkerNode(
                reg.worker_id, tuple(reg.broadcast), key_from_text(reg.public_key),  # type: ignore[arg-type]
                credential=reg.credential, pin=att.w.client.pin,
            )  # fmt: skip
            await node.start()
            await asyncio.sleep(2.0)  # a member: announced, installing
            t.attempts += 1
            outcome = await att.submit_one()  # the laundering turn mask: quarantined
            t.answers[outcome] += 1
            caught, before = time.monotonic(), node.installed_version
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(node._closed.wait(), 10)
            t.extra["cut_after_s"].append(time.monotonic() - caught if node._closed.is_set() else None)
            t.extra["versions_after"].append(node.installed_version - before)
            await node.close()
            await gov.pace()
        await att.close()


async def sybil(target: Target, a: argparse.Namespace, gov: Governor, t: Tally) -> None:
    """Every free slot of the token, each identity pulling every byte-serving route as fast as let."""
    import aiohttp

    from echo2.protocol import RegisterRequest
    from echo2.rollout.client import LearnerClient, Refused

    deadline = time.monotonic() + a.seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        clients = []
        while len(clients) < a.open:
            client = LearnerClient(target.join, session, reconnect_s=5.0)
            try:
                await client.register(
                    RegisterRequest(name=f"sybil{len(clients)}", usd_per_hour=1.0), target.token
                )
            except Refused as exc:
                t.answers[f"register:{exc.reply.error}"] += 1
                break
            clients.append(client)
        t.extra["identities"] = len(clients)
        _ready()
        routes: list[tuple[str, Callable[[LearnerClient], Awaitable[int]]]] = [
            ("model", lambda c: _size(c.model())), ("version", lambda c: _size(c.version())),
            ("snapshot", lambda c: _chain_bytes(c)),
        ]  # fmt: skip
        while time.monotonic() < deadline:
            for client in clients:
                for name, call in routes:
                    t.attempts += 1
                    try:
                        n = await call(client)
                        t.bytes_received += n
                        t.answers[f"{name}:200"] += 1
                    except Refused as exc:
                        t.answers[f"{name}:{exc.reply.error}"] += 1
                    await gov.pace()
                    if time.monotonic() >= deadline:
                        break


async def _size(reply: Awaitable[Any]) -> int:
    return len((await reply).model_dump_json())


async def _chain_bytes(client: Any) -> int:
    return sum(len(b) for _, b in await client.snapshot_chain(-1))


def _frame(header: dict[str, Any]) -> bytes:
    body = json.dumps(header).encode()
    return struct.pack("!I", len(body)) + body


def _kind_of(reply: bytes) -> str:
    """An HTTP reply's status and error code, a broadcast frame's op, or "closed"."""
    if not reply:
        return "closed"
    if reply.startswith(b"HTTP/"):
        status = reply.split(b" ", 2)[1].decode()
        _, _, body = reply.partition(b"\r\n\r\n")
        try:
            return f"{status}:{json.loads(body).get('error', '')}"
        except ValueError:
            return status
    return _frame_op(reply)


def _frame_op(data: bytes) -> str:
    if len(data) < 4:
        return "closed"
    try:
        header = json.loads(data[4 : 4 + struct.unpack("!I", data[:4])[0]])
        return f"{header.get('op')}:{str(header.get('reason', ''))[:40]}"
    except ValueError:
        return "unparsed"


async def _finish(tasks: set[asyncio.Task[None]], deadline: float) -> None:
    if tasks:
        await asyncio.wait(tasks, timeout=max(0.1, deadline - time.monotonic()) + 2)
    for task in tasks:
        task.cancel()


ATTACKS: dict[str, Callable[[Target, argparse.Namespace, Governor, Tally], Awaitable[None]]] = {
    "idle_api": lambda tg, a, g, t: idle(tg, "api", a, g, t),
    "idle_broadcast": lambda tg, a, g, t: idle(tg, "broadcast", a, g, t),
    "slowloris": slowloris,
    "oversized": oversized,
    "handshake_flood": handshake_flood,
    "joins_pulls": joins_pulls,
    "quarantined": quarantined,
    "sybil": sybil,
}
SELF_READY = ("quarantined", "sybil")  # they say ready themselves, after their setup


def _ready() -> None:
    """Tell the study this attacker is set up, and wait for its window to start."""
    print("ready", flush=True)
    sys.stdin.readline()


async def _run(a: argparse.Namespace) -> dict[str, Any]:
    target = Target(**{**json.loads(Path(a.target).read_text()), "broadcast": tuple(a.broadcast)})
    if a.kind not in SELF_READY:
        _ready()
    gov, t = Governor(a.cores), Tally()
    await ATTACKS[a.kind](target, a, gov, t)
    cpu, wall = gov.used()
    return {"kind": a.kind, **t.summary(), "cpu_s": cpu, "wall_s": wall, "cores": cpu / max(wall, 1e-9)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m echo2_bench.perimeter", description=__doc__)
    p.add_argument("kind", choices=sorted(ATTACKS))
    p.add_argument("--target", required=True, help="target.json: api, join, token")
    p.add_argument("--broadcast", nargs=2, type=lambda x: int(x) if x.isdigit() else x, required=True)
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--cores", type=float, default=0.1, help="CPU share this attacker is held to")
    p.add_argument("--attempts", type=int, default=1000)
    p.add_argument("--open", type=int, default=1000, help="connections (identities: sybil) held at once")
    a = p.parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps(asyncio.run(_run(a))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
