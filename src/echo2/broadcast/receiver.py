"""Worker side of the TCP transport: join, receive + verify + relay chunks, install, repair on faults.

For each announced version the node opens one pull stream per source in its plan. A stream that
stalls, breaks, sends an error, or sends a chunk that fails its digest hands its missing chunks to a
repair stream from the failed peer's own source for them (its stripe ancestor, named in the
announcement's ``repair``), and from the learner, which always holds the snapshot, when there is none
or it failed too. A stream stalls when its first chunk misses ``wire.first_chunk_deadline`` (pulls
from peers; from the learner: ``stall_timeout``), a later chunk comes more than ``stall_timeout``
after the one before, or (a planned stream from a peer) it lags far behind the node's other planned
streams (``wire.lagging``, ``wire.finish_deadline``; the deadlines of ``transfer.Transfer.due``).
Meanwhile the node's own chunk server
relays every verified chunk to the members the learner told it to serve, each with its credential for
the version (``access.py``), within a per-member byte budget.

A hostile relay must cost only its own work, so the node remembers: a peer that failed for it is
skipped for the next ``AVOID_VERSIONS`` versions (its chunks come from the learner at once), and a
peer that stalled is reported to the learner (``{"op": "stalled", "v", "source"}``), which demotes a
member reported ``publisher.DEMOTE_AFTER_REPORTS`` times. Its install ack carries its receipts (how
many chunks it stored from each source) for the learner to check (``rounds.receipt_fault``) and the
pace of each peer it pulled a stripe from (``wire.relative_pace``, read by ``conduct.Conduct``).

Given the learner's certificate fingerprint (``pin``) the node speaks TLS on every connection: it
pins the learner's certificate on the control connection and on repairs, each peer's certificate (the
fingerprint the learner announced with the peer's address) on a pull, and serves its own chunks under
an ephemeral certificate made at start, whose fingerprint its join tells the learner. Without a pin
everything is plain TCP (``security.tls = false``); the credentials are checked either way.

A node carries no fault logic of its own: an optional :class:`ChunkTap` sees every chunk it stores
and every chunk it serves, which is where the benchmark harness plugs in its fault injection.

Every frame is one of ``echo2.weights.frames``: built as its model, sent as ``to_wire`` of it, and
parsed by ``parse_frame`` before use (a ``get`` after the gate has read its credential: ``store.serve_pull``).
A malformed announcement is refused (``rejected``) like a forged one; a malformed frame anywhere else
ends its connection (a pull stream's: repaired from the learner).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from echo2.broadcast.access import AccessError, Credential, Gate, ServeCounters, pull_request
from echo2.broadcast.api import ChunkTap, InstalledSnapshot, Receiving
from echo2.broadcast.buffer import Admission, SnapshotBuffer, serve_pull
from echo2.broadcast.strategy import LEARNER
from echo2.broadcast.transfer import Transfer
from echo2.broadcast.wire import (
    Pace,
    Pacer,
    ProtocolError,
    parse_announcement,
    read_header,
    read_payload,
    show,
    write_frame,
)
from echo2.errors import Echo2Error
from echo2.logs import SampledLog
from echo2.perimeter import Limits, Perimeter, default_limits, streams
from echo2.transport import PinError, client_context, make_identity, open_pinned
from echo2.weights.frames import (
    PRE_AUTH_HEADER,
    PRE_AUTH_ITEMS,
    AnnounceFrame,
    ChunkFrame,
    ErrorFrame,
    Frame,
    InstalledFrame,
    JoinFrame,
    LeaveFrame,
    RejectedFrame,
    RevokeFrame,
    ServeFrame,
    ShutdownFrame,
    StalledFrame,
    parse_frame,
    to_wire,
    version_or_none,
)
from echo2.weights.manifest import (
    Manifest,
    ManifestError,
    ManifestKey,
    as_key,
    blob_ok,
    chunk_ok,
    verify_manifest,
)

log = logging.getLogger(__name__)

FIRST_TICK_S = 0.1  # how often a pull from a peer waiting for its first chunk reads its deadline again
LAG_TICK_S = 0.5  # ... and after it (the lag rules judge over stall timeouts: seconds)
AVOID_VERSIONS = 3  # versions after a peer failed for which this node pulls its chunks from the learner
RECEIPTS_KEPT = 8  # newest versions whose receipts the node keeps for its install acks


@dataclass
class NodeCounters:
    """Fault-tolerance counters of one worker (SPEC: catch only where tolerance is the point, and count)."""

    corrupt_detected: int = 0  # chunks that failed their digest and were refetched
    stream_failures: int = 0  # pull streams abandoned (stall, broken, peer error)
    repaired_chunks: int = 0  # chunks fetched again from a fallback source
    rejected_manifests: int = 0  # announcements refused (auth, shape, stale)
    bytes_received: int = 0  # payload bytes read
    bytes_relayed: int = 0  # payload bytes served to peers
    pin_failures: int = 0  # sources whose TLS certificate was not the one the learner announced
    stalls_reported: int = 0  # peers reported to the learner for stalling (no data within the deadline)
    avoided_chunks: int = 0  # chunks pulled from the learner at once: their source failed here lately
    ancestor_repairs: int = 0  # repairs asked of a failed peer's stripe ancestor rather than the learner
    bad_frames: int = 0  # connections to this node's chunk server dropped on a malformed frame
    peer_errors: int = 0  # connections or streams dropped on an unexpected exception from peer bytes


class TcpWorkerNode:
    """A rollout worker's end of the broadcast plane (implements ``SnapshotReceiver``)."""

    def __init__(
        self,
        worker_id: str,
        publisher: tuple[str, int],
        key: bytes | ManifestKey,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        uplink: Pacer | None = None,
        advertise_port: int | None = None,
        downlink: Pacer | None = None,
        stall_timeout: float = 5.0,
        serve_wait_timeout: float = 60.0,
        max_repairs: int = 5,
        max_bad_chunks: int = 3,
        tap: ChunkTap | None = None,
        credential: str | None = None,
        pin: str | None = None,
        perimeter: Limits | None = None,
        held: tuple[int, int] | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.held = held  # (run epoch, version) of the weights its worker holds, told in the join
        self.credential = credential  # sent in the join frame when the publisher checks membership
        self.pin = pin  # SHA-256 fingerprint of the learner's certificate: TLS everywhere (None = plain)
        self.publisher = publisher
        self.key = as_key(key)  # the learner's public key (or the shared HMAC secret)
        self.host, self.port = host, port  # where the chunk server binds (port 0: any free one)
        self.advertise_host = advertise_host or host  # what peers dial (behind NAT: the router's)
        self.advertise_port = advertise_port  # what peers dial, when not the bound port (NAT forwarding)
        self.uplink, self.downlink = uplink, downlink  # application pacing (loopback harness only)
        self.stall_timeout = stall_timeout  # seconds without a frame before a source counts as stalled
        self.serve_wait_timeout = serve_wait_timeout
        self.max_repairs = max_repairs
        self.max_bad_chunks = max_bad_chunks  # corrupt chunks tolerated from one source before dropping it
        self.tap = tap  # hook on stored / served chunks (harness fault injection); None = no hook
        self.counters = NodeCounters()
        self.refusals = ServeCounters()  # pulls this node's chunk server refused
        self.tls = make_identity([self.advertise_host]) if pin is not None else None  # own relay cert
        self._client_ctx = client_context() if pin is not None else None
        self._gate = Gate(self.key, self.tls, self.refusals)
        self._serves: dict[int, frozenset[str]] = {}  # version -> members the plan has pulling from here
        self._revoked: set[str] = set()  # members the learner revoked: never served again
        self._streams: dict[str, set[asyncio.StreamWriter]] = {}  # member -> the streams it pulls here
        # connections, deadlines and rates before anyone is known (echo2/perimeter.py)
        self.perimeter = Perimeter("relay", perimeter or default_limits())
        self._sampled = SampledLog(log)  # refusals a stranger can repeat at will: counted, logged sparingly
        self.installed_version = -1
        self._avoid: dict[str, int] = {}  # peer -> last version whose chunks come from the learner instead
        self._receipts: dict[int, tuple[dict[str, int], dict[str, float]]] = {}  # version -> got, pace (acks)
        self._reports: set[asyncio.Task[None]] = set()  # stall reports being sent
        self._buffers: dict[int, SnapshotBuffer] = {}  # installed (relayable) + in-progress versions
        self._transfer: Transfer | None = None
        self._latest: InstalledSnapshot | None = None
        self._new = asyncio.Event()
        self._closed = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._ctl: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._ctl_lock = asyncio.Lock()
        self._ctl_task: asyncio.Task[None] | None = None
        self._announced = asyncio.Event()  # pulsed whenever a new version is announced to this node
        self._served = asyncio.Event()  # pulsed whenever the learner attaches a latecomer here

    # -- lifecycle ------------------------------------------------------------------------------------
    async def start(self, join_timeout: float = 30.0) -> None:
        ctx = self.tls.server_context() if self.tls is not None else None
        try:
            self._server = await self.perimeter.serve(
                lambda: streams(self._on_connect), self.host, self.port, ctx
            )
        except OSError as exc:
            why = exc.strerror or exc
            raise Echo2Error(f"cannot serve chunks on {self.host}:{self.port}: {why}") from None
        self.port = self._server.sockets[0].getsockname()[1]
        deadline = time.monotonic() + join_timeout
        while True:  # the learner may still be starting: retry until the deadline (a wrong pin: never)
            try:
                reader, writer = await open_pinned(*self.publisher, self.pin, self._client_ctx, 1 << 24)
                break
            except PinError:
                self._server.close()
                raise
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise Echo2Error(f"cannot reach the publisher at {self.publisher}: {exc}") from None
                await asyncio.sleep(0.2)
        self._ctl = (reader, writer)
        hello = JoinFrame(
            worker=self.worker_id, host=self.advertise_host, port=self.advertise_port or self.port,
            cert=self.tls.fingerprint if self.tls is not None else "", credential=self.credential,
            held=list(self.held) if self.held is not None else None,
        )  # fmt: skip
        await write_frame(writer, to_wire(hello))
        self._ctl_task = asyncio.ensure_future(self._control_loop())
        log.info(
            "worker %s serving on %s:%d (peers dial %s:%d), joined %s:%d",
            self.worker_id,
            self.host,
            self.port,
            self.advertise_host,
            self.advertise_port or self.port,
            *self.publisher,
        )

    async def close(self) -> None:
        """Leave the topology: stop pulling, stop serving, close the control connection."""
        if self._transfer is not None:
            self._abandon(self._transfer, "node closing")
        if self._ctl is not None:
            with contextlib.suppress(Exception):
                async with self._ctl_lock:
                    await write_frame(self._ctl[1], to_wire(LeaveFrame()))
            self._ctl[1].close()
        if self._ctl_task is not None:
            self._ctl_task.cancel()
        if self._server is not None:
            self._server.close()
        self._closed.set()
        self._new.set()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    # -- SnapshotReceiver -----------------------------------------------------------------------------
    async def snapshots(self) -> AsyncIterator[InstalledSnapshot]:
        """Yield each newer installed snapshot (skipping ones superseded before the caller looked)."""
        seen = -1
        while not self._closed.is_set():
            await self._new.wait()
            self._new.clear()
            snap = self._latest
            if snap is not None and snap.manifest.version > seen:
                seen = snap.manifest.version
                yield snap

    async def report_installed(self, version: int) -> None:
        """Ack ``version``'s install, with this node's receipts of it and its peers' paces (empty if it
        has none)."""
        got, pace = self._receipts.get(version, ({}, {}))
        await self._ctl_send(InstalledFrame(v=version, got=got, pace=pace))

    def receiving(self) -> Receiving | None:
        """The version this node is receiving now and how it goes (None when it receives none)."""
        t = self._transfer
        if t is None:
            return None
        return Receiving(t.manifest.version, t.manifest.lineage.epoch, time.monotonic() - t.stored)

    def avoided(self) -> dict[str, int]:
        """Peers this node does not pull from now -> the last version it skips them for."""
        return dict(self._avoid)

    # -- control --------------------------------------------------------------------------------------
    async def _ctl_send(self, frame: Frame) -> None:
        if self._ctl is None or self._ctl[1].is_closing():  # closed (an install acked while leaving)
            return
        try:
            async with self._ctl_lock:
                await write_frame(self._ctl[1], to_wire(frame))
        except (OSError, ConnectionError) as exc:
            log.warning("worker %s: control send failed: %s", self.worker_id, exc)

    async def _control_loop(self) -> None:
        assert self._ctl is not None
        reader = self._ctl[0]
        try:
            while True:
                header = await read_header(reader)
                if header["op"] == "announce":  # malformed: refused like a forged one, not fatal
                    await self._on_announce(header)
                elif header["op"] == "revoke":
                    self._revoke(parse_frame(header, RevokeFrame, sender=LEARNER).member)
                elif header["op"] == "serve":
                    serve = parse_frame(header, ServeFrame, sender=LEARNER)
                    self._serve_late(serve.v, serve.member)
                elif header["op"] in ("shutdown", "error"):  # any other op is ignored, as ever
                    match parse_frame(header, ShutdownFrame, ErrorFrame, sender=LEARNER):
                        case ErrorFrame(reason=reason):
                            log.error("worker %s: publisher refused us: %s", self.worker_id, reason)
                        case _:
                            log.info("worker %s: publisher says shutdown", self.worker_id)
                    break
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            log.info("worker %s: control connection closed", self.worker_id)
        except ProtocolError as exc:
            self.counters.bad_frames += 1
            log.error("worker %s: bad control frame: %s", self.worker_id, exc)
        except Exception as exc:  # the learner's bytes found a case no check names: one line, then leave
            self.counters.peer_errors += 1
            log.error("worker %s: control frame raised %s: %.200s", self.worker_id, type(exc).__name__, exc)
        finally:
            self._ctl_task = None
            await self.close()

    async def _on_announce(self, header: dict[str, Any]) -> None:
        try:
            frame = parse_frame(header, AnnounceFrame, sender=LEARNER)
            manifest = Manifest.from_dict(frame.manifest)
            verify_manifest(manifest, self.key)
            current = self._transfer.manifest.version if self._transfer is not None else -1
            if manifest.version <= max(self.installed_version, current):
                raise ManifestError(
                    f"version {manifest.version} is not newer than installed v{self.installed_version} "
                    f"or in-flight v{current}"
                )
            plan = parse_announcement(frame, manifest.n_chunks, self.pin is not None)
            sources, peers = plan.sources, plan.peers
            credential = Credential.from_dict(frame.credential)
            if credential.member != self.worker_id or credential.version != manifest.version:
                raise ManifestError(f"credential is for {credential.member!r} v{credential.version}")
        except (ManifestError, ProtocolError) as exc:  # AccessError is a ProtocolError
            self.counters.rejected_manifests += 1
            log.warning("worker %s: refusing announcement: %s", self.worker_id, exc)
            raw = header.get("manifest")  # the version it names, if any: the frame may be garbage
            version = version_or_none(raw.get("version") if isinstance(raw, dict) else None)
            await self._ctl_send(RejectedFrame(v=version, reason=str(exc)[:500]))
            return
        if self._transfer is not None:
            self._abandon(self._transfer, f"superseded by v{manifest.version}")
        v = manifest.version
        buffer = SnapshotBuffer(manifest)
        self._buffers[v] = buffer
        self._serves[v] = plan.serves
        stall = max(self.stall_timeout, plan.stall_hint)
        transfer = Transfer(manifest, buffer, peers, stall, credential, plan.members, repair=plan.repair)
        if all(s != LEARNER for s, _ in sources):
            transfer.learner_first = 0.0  # no learner stream: that term of the deadline is absent
        self._transfer = transfer
        self._announced.set()
        self._announced = asyncio.Event()
        self._avoid = {w: last for w, last in self._avoid.items() if last >= v}
        skipped = sorted(i for s, ch in sources if s in self._avoid for i in ch)
        log.info(
            "worker %s: receiving v%d from %s%s",
            self.worker_id,
            v,
            [s for s, _ in sources if s not in self._avoid],
            f" (skipping {sorted(self._avoid)}: {len(skipped)} chunks from the learner)" if skipped else "",
        )
        for source, chunks in sources:
            if source not in self._avoid:
                self._spawn(transfer, self._pull(transfer, source, chunks, repairs=0))
        if skipped:
            self.counters.avoided_chunks += len(skipped)
            self._spawn(transfer, self._pull(transfer, LEARNER, skipped, repairs=0, repair=True))
        self._spawn(transfer, self._finish(transfer))

    def _spawn(self, transfer: Transfer, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.ensure_future(coro)
        transfer.tasks.add(task)
        task.add_done_callback(transfer.tasks.discard)

    def _abandon(self, transfer: Transfer, reason: str) -> None:
        if not transfer.buffer.complete.is_set():
            transfer.buffer.fail(reason)
            self._buffers.pop(transfer.manifest.version, None)
            self._serves.pop(transfer.manifest.version, None)
        for task in list(transfer.tasks):
            task.cancel()
        if self._transfer is transfer:
            self._transfer = None

    async def _finish(self, transfer: Transfer) -> None:
        await transfer.buffer.complete.wait()
        m = transfer.manifest
        if not blob_ok(m, transfer.buffer.buf):  # cannot happen if every chunk verified; checked anyway
            log.error(
                "worker %s: v%d assembled blob fails its digest; not installing", self.worker_id, m.version
            )
            self._abandon(transfer, "whole-blob digest mismatch")
            return
        self.installed_version = m.version
        self._receipts[m.version] = dict(transfer.got), transfer.relative()
        for old in sorted(self._receipts)[:-RECEIPTS_KEPT]:
            del self._receipts[old]
        for old in [v for v in self._buffers if v < m.version]:
            del self._buffers[old]  # one installed copy is all a node needs
        self._serves = {v: s for v, s in self._serves.items() if v >= m.version}
        self._gate.forget_before(m.version)
        self._latest = InstalledSnapshot(m, memoryview(transfer.buffer.buf).toreadonly())
        self._new.set()
        if self._transfer is transfer:
            self._transfer = None
        log.info(
            "worker %s: v%d verified in %.2fs", self.worker_id, m.version, time.monotonic() - transfer.started
        )

    # -- pulling --------------------------------------------------------------------------------------
    async def _pull(
        self, transfer: Transfer, source: str, chunks: list[int], repairs: int, repair: bool = False
    ) -> None:
        """Pull ``chunks`` from ``source`` (``repair``: in place of another source, so never paced as a
        stripe); on any fault hand what is missing to :meth:`_repair`, and remember a failed peer."""
        buffer, m = transfer.buffer, transfer.manifest
        todo = buffer.missing(chunks)
        if not todo:
            return
        pos, writer, reason, stalled, late = 0, None, "", False, ""
        planned = not (repair or repairs > 0)  # one of the announcement's streams: judged, and a reference
        pace = transfer.paces.setdefault(source, Pace()) if planned else Pace()
        if not planned:
            transfer.repairs.append(pace)
        loop = asyncio.get_running_loop()
        start = loop.time()
        ticker: asyncio.TimerHandle | None = None
        try:
            async with asyncio.timeout(transfer.stall_timeout) as watchdog:  # one timer, moved on progress

                def tick() -> None:  # a peer's stream: the deadline follows what this node sees
                    nonlocal ticker, late
                    when, late = transfer.due(source, pace, start, todo, pos, planned)
                    if not watchdog.expired():
                        watchdog.reschedule(when)
                    every = FIRST_TICK_S if pace.count == 0 else LAG_TICK_S
                    ticker = loop.call_later(every, tick) if when > loop.time() else None

                if source != LEARNER:
                    tick()
                host, port, cert = transfer.peers[source]
                if source == LEARNER and self.pin is not None:
                    cert = self.pin  # the learner is pinned from the join string, never from an announcement
                pin = cert if self.pin is not None else None
                limit = max(1 << 22, 2 * m.chunk_size)
                reader, writer = await open_pinned(host, port, pin, self._client_ctx, limit)
                request, chunk_list = pull_request(
                    transfer.credential, todo, repairs > 0 or repair, cert, self.tls
                )
                await write_frame(writer, request, chunk_list)
                bad = 0
                while pos < len(todo):
                    i = todo[pos]
                    header = await read_header(reader, 1 << 16)
                    frame = parse_frame(header, ChunkFrame, ErrorFrame, sender=source)
                    if isinstance(frame, ErrorFrame):
                        raise ProtocolError(f"peer error: {show(frame.reason)}")
                    if frame.v != m.version or frame.i != i:
                        raise ProtocolError(
                            f"expected chunk {i} of v{m.version}, got v{frame.v} chunk {frame.i}"
                        )
                    if frame.n != m.chunk_len(i):
                        raise ProtocolError(f"chunk {i} has {frame.n} bytes, manifest says {m.chunk_len(i)}")
                    payload = await read_payload(reader, header, m.chunk_size)
                    if ticker is not None:
                        ticker.cancel()
                        ticker = None
                    pace.note(loop.time())
                    if source == LEARNER:
                        watchdog.reschedule(loop.time() + transfer.stall_timeout)
                    else:
                        tick()
                    self._first_chunk(transfer, source, repair or repairs > 0)
                    if self.downlink is not None:
                        await self.downlink.consume(len(payload))
                    self.counters.bytes_received += len(payload)
                    transfer.received += len(payload)
                    pos += 1
                    if not chunk_ok(m, i, payload):
                        self.counters.corrupt_detected += 1
                        bad += 1
                        log.warning(
                            "worker %s: chunk %d of v%d from %s fails its digest; refetching",
                            self.worker_id,
                            i,
                            m.version,
                            source,
                        )
                        self._repair(transfer, [i], source, repairs)
                        if bad >= self.max_bad_chunks:
                            raise ProtocolError(f"{bad} corrupt chunks; dropping source")
                        continue
                    if buffer.put(i, payload):
                        transfer.got[source] = transfer.got.get(source, 0) + 1
                        transfer.stored = time.monotonic()
                    if self.tap is not None:
                        self.tap.on_received(i, buffer.count / m.n_chunks)
            return
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            waited, stalled = loop.time() - start, True  # sent nothing for its deadline: report it
            reason = f"no data for {waited:.1f}s" if pos else f"no first chunk within {waited:.1f}s"
            if late:  # it sends, but far slower than this node's other sources
                reason = f"lagging {waited:.1f}s in, {len(buffer.missing(todo[pos:]))} chunks left: {late}"
        except asyncio.IncompleteReadError:
            reason = "connection closed mid-stream"
        except (ConnectionError, OSError) as exc:
            reason = f"connection failed: {exc}"
        except PinError as exc:
            self.counters.pin_failures += 1
            reason = str(exc)
        except ProtocolError as exc:
            reason = str(exc)
        except Exception as exc:  # a peer's bytes found a case no check names: repair, count, one line
            self.counters.peer_errors += 1
            reason = f"unexpected {type(exc).__name__}: {str(exc)[:200]}"
        finally:
            if ticker is not None:
                ticker.cancel()
            if writer is not None:
                writer.close()
        self.counters.stream_failures += 1
        rest = buffer.missing(todo[pos:])
        log.warning(
            "worker %s: source %s failed for v%d (%s); %d chunks to repair",
            self.worker_id, source, m.version, reason, len(rest),
        )  # fmt: skip
        if source != LEARNER:
            self._avoid[source] = m.version + AVOID_VERSIONS
            if stalled:
                self._report_stall(m.version, source)
        self._repair(transfer, rest, source, repairs)

    def _first_chunk(self, transfer: Transfer, source: str, repair: bool) -> None:
        """Note the delays to the first chunk of a planned learner stream and of any peer stream."""
        if source == LEARNER and not repair and transfer.learner_first is None:
            transfer.learner_first = time.monotonic() - transfer.started
        elif source != LEARNER and transfer.peer_first is None:
            transfer.peer_first = time.monotonic() - transfer.started

    def _report_stall(self, version: int, source: str) -> None:
        """Tell the learner ``source`` stalled for this node in ``version`` (sent in the background)."""
        self.counters.stalls_reported += 1
        task = asyncio.ensure_future(self._ctl_send(StalledFrame(v=version, source=source)))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    def _repair(self, transfer: Transfer, chunks: list[int], failed: str, repairs: int) -> None:
        if not chunks:
            return
        if repairs >= self.max_repairs:
            log.error(
                "worker %s: giving up on v%d after %d repairs",
                self.worker_id,
                transfer.manifest.version,
                repairs,
            )
            self._abandon(transfer, f"{repairs} failed repairs")
            return
        self.counters.repaired_chunks += len(chunks)
        # A failed peer's chunks come from the peer's own source for them (its stripe ancestor, which
        # got them first), or the next one up the stripe when that one failed here lately too; the
        # learner holds every chunk from the start, so it is the fallback of last resort; a second
        # failure of the learner itself is retried after a short backoff.
        source, seen = transfer.repair.get(failed, LEARNER), {failed}
        while source in self._avoid and source not in seen:
            seen.add(source)
            source = transfer.repair.get(source, LEARNER)
        if source in seen:  # a chain that loops back: no ancestor holds the chunks for sure
            source = LEARNER
        if source != LEARNER:
            self.counters.ancestor_repairs += 1
        delay = 0.0 if failed != LEARNER else min(2.0, 0.2 * 2**repairs)
        self._spawn(transfer, self._delayed_pull(transfer, source, chunks, repairs + 1, delay))

    async def _delayed_pull(
        self, transfer: Transfer, source: str, chunks: list[int], repairs: int, delay: float
    ) -> None:
        if delay:
            await asyncio.sleep(delay)
        await self._pull(transfer, source, chunks, repairs)

    # -- serving --------------------------------------------------------------------------------------
    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:  # nobody is known yet: a small first frame, soon (the perimeter closes the connection then)
            header = await asyncio.wait_for(
                read_header(reader, PRE_AUTH_HEADER, PRE_AUTH_ITEMS), self.perimeter.limits.header_s
            )
            if header["op"] != "get":  # a get: the gate reads its credential, then parse_pull the rest
                raise ProtocolError(f"a worker only serves 'get', not {header['op']!r}")
            await self._serve(header, reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, OSError):
            pass  # the puller went away; nothing to repair on this side
        except AccessError as exc:  # counted by the gate
            self._sampled.log(
                f"refused:{str(exc)[:24]}", "worker %s: refused a pull: %s", self.worker_id, exc
            )
        except ProtocolError as exc:
            self.counters.bad_frames += 1
            key = f"dropped:{str(exc)[:24]}"
            self._sampled.log(key, "worker %s: dropping a peer connection: %s", self.worker_id, exc)
        except Exception as exc:  # a peer's bytes found a case no check names: one line, keep serving
            self.counters.peer_errors += 1
            log.warning(
                "worker %s: dropped a peer on an unexpected %s: %.200s",
                self.worker_id,
                type(exc).__name__,
                exc,
            )
        finally:
            writer.close()

    async def _serve(
        self, header: dict[str, Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """A pull: only by a member the learner told this node to serve the version to (and has not
        revoked since), with its credential and (over TLS) proof; bounded in chunks and in bytes."""
        asker: list[str] = []

        async def admit(member: str, v: int) -> Admission:  # serve_pull has parsed the whole get by now
            # a peer may ask before this node has the announcement (else "unknown version": e.g. abandoned
            # here, the puller repairs), and a latecomer before the learner's serve frame naming it
            await self._until(
                lambda: v <= self.installed_version or v in self._buffers, lambda: self._announced
            )
            await self._until(lambda: member in self._serves.get(v, {member}), lambda: self._served)
            scheduled = member in self._serves.get(v, ()) and member not in self._revoked
            if scheduled:
                asker.append(member)
                self._streams.setdefault(member, set()).add(writer)
            return self._buffers.get(v), scheduled, None

        try:
            await serve_pull(
                self._gate,
                header,
                reader,
                writer,
                admit,
                self.uplink,
                self.serve_wait_timeout,
                self._count_relayed,
                self.tap.on_serve if self.tap is not None else None,
                vouch=lambda: self.perimeter.vouch(writer.transport),
            )
        finally:
            for member in asker:
                self._streams.get(member, set()).discard(writer)

    def _serve_late(self, version: int, member: str) -> None:
        """The learner attached ``member``, which joined after ``version`` was announced, below this node:
        serve it ``version`` like a member of the plan (ignored for a version this node no longer has)."""
        if version in self._serves:
            self._serves[version] = self._serves[version] | {member}
            self._served.set()
            self._served = asyncio.Event()

    def _revoke(self, member: str) -> None:
        """The learner no longer trusts ``member``: it is served nothing more here, its streams close."""
        self._revoked.add(member)
        for writer in self._streams.pop(member, set()):
            writer.transport.abort()
        log.info("worker %s: stopped serving %s (revoked by the learner)", self.worker_id, member)

    async def _until(self, ready: Callable[[], bool], pulse: Callable[[], asyncio.Event]) -> None:
        """Wait until ``ready()``, at most ``stall_timeout``, waking at each ``pulse()``."""
        deadline = time.monotonic() + self.stall_timeout
        while not ready() and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pulse().wait(), deadline - time.monotonic())

    def _count_relayed(self, member: str, version: int, n: int) -> None:
        self.counters.bytes_relayed += n
