"""Learner side of the TCP transport: membership, announcements, chunk serving, install tracking.

One TCP port serves two kinds of connection, told apart by the first frame:
``join`` (a worker's long-lived control connection: membership, announcements, install acks) and
``get`` (a pull stream of chunks). A worker is a member while its control connection is open, so
workers join the topology of the next version and leave at any time.

With a TLS identity (``tls``: the run's certificate, ``echo2.transport``) the port speaks TLS only;
workers pin its fingerprint. A worker's join names the fingerprint of its own relay certificate, and
every announcement hands each member the addresses *and* fingerprints of the peers it pulls from, the
members it serves (``serve``) and its credential for the version (``access.py``), which a ``get``
must carry: the learner is the only party that vouches for who is who.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from echo2.broadcast.access import AccessError, Gate, ServeCounters, issue
from echo2.broadcast.api import BroadcastStats
from echo2.broadcast.manifest import Lineage, Manifest, ManifestKey, as_key, build_manifest
from echo2.broadcast.store import MAX_REQUEST, Admission, SnapshotBuffer, serve_pull
from echo2.broadcast.strategy import LEARNER, Strategy
from echo2.broadcast.wire import Pacer, ProtocolError, read_header, write_frame
from echo2.errors import Echo2Error
from echo2.physics.broadcast import relay_chunk_bytes
from echo2.transport import HANDSHAKE_TIMEOUT_S, TlsIdentity, normalize_pin

log = logging.getLogger(__name__)


@dataclass
class _Member:
    worker: str  # worker id, unique among live members
    addr: tuple[str, int]  # where its chunk server listens
    cert: str  # SHA-256 fingerprint of its chunk server's certificate ("" without TLS)
    writer: asyncio.StreamWriter  # control connection
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # serialises control frames


@dataclass
class _Round:
    manifest: Manifest  # the version being broadcast
    started: float  # monotonic time of publication
    targets: tuple[str, ...]  # members the plan covered
    install_s: dict[str, float] = field(default_factory=dict)  # worker -> install delay
    learner_bytes: int = 0  # payload bytes served for this version
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # pulsed on every ack
    stream_rate: float | None = None  # cap per learner pull stream (bytes/s), None = uncapped


class TcpPublisher:
    """Serves snapshots to workers over TCP according to a :class:`Strategy`."""

    def __init__(
        self,
        key: bytes | ManifestKey,
        strategy: Strategy,
        chunk_size: int | None = 1 << 20,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        uplink: Pacer | None = None,
        serve_wait_timeout: float = 30.0,
        keep_versions: int = 2,
        link_rates: tuple[float, float] | None = None,
        authorize: Callable[[str, object], bool] | None = None,
        tls: TlsIdentity | None = None,
    ) -> None:
        self.key = as_key(key)  # the learner's signing key (or a shared HMAC secret)
        self.strategy = strategy
        self.chunk_size = chunk_size  # None: chosen per snapshot (physics.broadcast.relay_chunk_bytes)
        self.host, self.port = host, port
        self.advertise_host = advertise_host or host
        self.uplink = uplink  # application pacing (loopback harness only)
        self.serve_wait_timeout = serve_wait_timeout
        self.keep_versions = keep_versions  # how many recent versions stay servable
        self.link_rates = link_rates  # (B0, B_w) in bytes/s when known: enables rate-matched stripes
        self.authorize = authorize  # (worker id, credential from the join frame) -> may join; None = anyone
        self.tls = tls  # the run's certificate and key: TLS on this port (None = plain TCP)
        self.refusals = ServeCounters()  # pulls refused (no credential, out of bounds, over budget)
        self._gate = Gate(self.key, tls, self.refusals)
        self._members: dict[str, _Member] = {}
        self._buffers: dict[int, SnapshotBuffer] = {}
        self._rounds: dict[int, _Round] = {}
        self._joined = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> tuple[str, int]:
        tls: dict[str, Any] = {} if self.tls is None else {
            "ssl": self.tls.server_context(), "ssl_handshake_timeout": HANDSHAKE_TIMEOUT_S,
        }  # fmt: skip
        self._server = await asyncio.start_server(
            self._on_connect, self.host, self.port, limit=1 << 22, **tls
        )
        self.port = self._server.sockets[0].getsockname()[1]
        log.info(
            "publisher listening on %s:%d (strategy %s, %s)",
            self.host,
            self.port,
            self.strategy.name,
            f"TLS sha256 {self.fingerprint}" if self.tls else "plain TCP",
        )
        return self.address

    @property
    def address(self) -> tuple[str, int]:
        return self.advertise_host, self.port

    @property
    def fingerprint(self) -> str:
        """SHA-256 fingerprint of the certificate this port presents ("" without TLS): workers pin it."""
        return self.tls.fingerprint if self.tls is not None else ""

    def members(self) -> list[str]:
        return list(self._members)

    async def wait_members(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self._members) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Echo2Error(f"only {len(self._members)} of {count} workers joined within {timeout:.0f}s")
            self._joined.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._joined.wait(), left)

    async def publish(self, version: int, blob: bytes, lineage: Lineage | None = None) -> Manifest:
        """Sign ``blob`` as ``version`` (an anchor or a patch, ``lineage``), plan over the live members,
        announce to each, start serving. The bytes travel as they are: a relay never decodes them."""
        if self._buffers and version <= max(self._buffers):
            raise Echo2Error(f"version {version} is not newer than published version {max(self._buffers)}")
        chunk = self.chunk_size or relay_chunk_bytes(
            len(blob), self.link_rates[0] / self.link_rates[1] if self.link_rates else 1.0
        )
        manifest = await asyncio.to_thread(build_manifest, blob, version, chunk, self.key, lineage)
        self._buffers[version] = SnapshotBuffer(manifest, blob)
        for old in sorted(self._buffers)[: -self.keep_versions]:
            del self._buffers[old]
        self._gate.forget_before(min(self._buffers))
        members = dict(self._members)
        plan = self.strategy.plan(list(members), manifest.n_chunks)
        peers = {w: [*m.addr, m.cert] for w, m in members.items()}
        peers[LEARNER] = [*self.address, self.fingerprint]
        serves: dict[str, list[str]] = {w: [] for w in members}  # who pulls from whom, per the plan
        for w, pulls in plan.items():
            for src in {a.source for a in pulls} - {LEARNER}:
                serves[src].append(w)
        rnd = _Round(manifest, time.monotonic(), tuple(members))
        if self.link_rates is not None:
            rnd.stream_rate = self.strategy.learner_stream_rate(len(members), *self.link_rates)
        self._rounds[version] = rnd
        for old in sorted(self._rounds)[: -max(8, self.keep_versions)]:
            del self._rounds[old]
        log.debug(
            "publishing v%d: %d bytes in %d chunks to %d workers (%s)",
            version,
            manifest.total_size,
            manifest.n_chunks,
            len(members),
            self.strategy.name,
        )
        man = manifest.to_dict()
        hint = self._stall_hint(len(members), manifest.chunk_size)
        for w, member in members.items():
            sources = [[a.source, list(a.chunks)] for a in plan[w]]
            msg = {
                "op": "announce", "manifest": man, "sources": sources, "peers": peers, "stall_hint": hint,
                "serve": sorted(serves[w]), "credential": issue(self.key, version, w, member.cert).to_dict(),
            }  # fmt: skip
            self._spawn(self._send(member, msg))
        return manifest

    def _stall_hint(self, n: int, chunk: int) -> float:
        """Seconds without data that are still normal: 8 chunk-times of a stream sharing B_w with N others."""
        if self.link_rates is None or n == 0:
            return 0.0
        return 8.0 * chunk * n / self.link_rates[1]

    async def wait_installed(
        self, version: int, count: int | None = None, timeout: float = 600.0
    ) -> BroadcastStats:
        """Wait until ``count`` (default: all targeted, still-live) workers acked ``version``."""
        rnd = self._rounds[version]
        deadline = time.monotonic() + timeout
        while True:
            live = [w for w in rnd.targets if w in self._members or w in rnd.install_s]
            need = len(live) if count is None else count
            if len(rnd.install_s) >= need or time.monotonic() >= deadline:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rnd.changed.wait(), min(1.0, max(0.01, deadline - time.monotonic())))
            rnd.changed.clear()
        return self._stats(version, rnd)  # the round itself: newer ones may have retired its entry

    def stats(self, version: int) -> BroadcastStats:
        return self._stats(version, self._rounds[version])

    def _stats(self, version: int, rnd: _Round) -> BroadcastStats:
        return BroadcastStats(
            version=version,
            n_workers=len(rnd.targets),
            total_size=rnd.manifest.total_size,
            install_s=dict(rnd.install_s),
            learner_bytes=rnd.learner_bytes,
        )

    async def close(self) -> None:
        for member in list(self._members.values()):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._send(member, {"op": "shutdown"}), 2.0)
            member.writer.close()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
        for task in list(self._tasks):
            task.cancel()

    # -- connection handling -------------------------------------------------------------------------
    def _spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, member: _Member, msg: dict) -> None:  # type: ignore[type-arg]
        try:
            async with member.lock:
                await write_frame(member.writer, msg)
        except (OSError, ConnectionError) as exc:
            log.warning("control send to %s failed: %s", member.worker, exc)

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            header = await asyncio.wait_for(read_header(reader, MAX_REQUEST), 30.0)
            if header["op"] == "get":
                await self._serve(header, writer)
            elif header["op"] == "join":
                await self._control(header, reader, writer)
            else:
                raise ProtocolError(f"unexpected first op {header['op']!r}")
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, OSError):
            pass  # a peer that goes away mid-stream is routine; its downstream repairs
        except AccessError as exc:  # counted by the gate
            log.warning("refused a pull from %s: %s", peer, exc)
        except ProtocolError as exc:
            log.warning("dropping connection from %s: %s", peer, exc)
        finally:
            writer.close()

    async def _serve(self, header: dict, writer: asyncio.StreamWriter) -> None:  # type: ignore[type-arg]
        """A pull: only by a member this version was announced to, with its credential; bounded."""

        async def admit(member: str, v: int) -> Admission:
            rnd, buffer = self._rounds.get(v), self._buffers.get(v)
            if rnd is None or buffer is None:  # no longer served
                return None, False, None
            stream = Pacer(rnd.stream_rate) if rnd.stream_rate and not header.get("repair") else None
            return buffer, member in rnd.targets and member in self._members, stream

        await serve_pull(
            self._gate, header, writer, admit, self.uplink, self.serve_wait_timeout, self._count_sent
        )

    def _count_sent(self, version: int, n: int) -> None:
        rnd = self._rounds.get(version)
        if rnd is not None:
            rnd.learner_bytes += n

    async def _control(self, hello: dict, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:  # type: ignore[type-arg]
        worker, host, port = hello.get("worker"), hello.get("host"), hello.get("port")
        if not (isinstance(worker, str) and worker and worker != LEARNER and isinstance(host, str)):
            raise ProtocolError("join needs a non-empty string 'worker' (not 'learner') and a 'host'")
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ProtocolError(f"join from {worker!r} has an invalid port {port!r}")
        cert = hello.get("cert", "")
        if self.tls is not None:  # a member's relay speaks TLS too; its peers pin what it names here
            try:
                cert = normalize_pin(cert if isinstance(cert, str) else "")
            except ValueError:
                raise ProtocolError(f"join from {worker!r} names no certificate fingerprint") from None
        if self.authorize is not None and not self.authorize(worker, hello.get("credential")):
            await write_frame(writer, {"op": "error", "reason": f"worker {worker!r}: credential refused"})
            raise ProtocolError(f"join from {worker!r} refused: bad or missing credential")
        if worker in self._members:
            await write_frame(writer, {"op": "error", "reason": f"worker id {worker!r} already joined"})
            raise ProtocolError(f"duplicate worker id {worker!r}")
        member = _Member(worker, (host, port), cert if isinstance(cert, str) else "", writer)
        self._members[worker] = member
        self._joined.set()
        log.debug("worker %s joined from %s:%d (%d members)", worker, host, port, len(self._members))
        try:
            while True:
                msg = await read_header(reader, 1 << 16)
                v = msg.get("v")
                rnd = self._rounds.get(v) if isinstance(v, int) else None
                if msg["op"] == "installed" and rnd is not None and worker not in rnd.install_s:
                    rnd.install_s[worker] = time.monotonic() - rnd.started
                    rnd.changed.set()
                elif msg["op"] == "rejected":
                    log.warning("worker %s rejected v%s: %s", worker, v, msg.get("reason"))
                elif msg["op"] == "leave":
                    break
        finally:
            if self._members.get(worker) is member:
                del self._members[worker]
            for rnd in self._rounds.values():
                rnd.changed.set()
            log.debug("worker %s left (%d members)", worker, len(self._members))
