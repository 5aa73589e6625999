"""Learner side of the TCP transport: membership, announcements, chunk serving, install tracking.

One TCP port serves two kinds of connection, told apart by the first frame:
``join`` (a worker's long-lived control connection: membership, announcements, install acks) and
``get`` (a pull stream of chunks). A worker is a member while its control connection is open, so
workers join the topology of the next version and leave at any time.

Who is who is not the publisher's: it must be handed a :class:`~echo2.broadcast.api.MemberLedger`
(the runtime's worker registry; there is no default, so a forgotten one cannot open the door). A join
is admitted only if ``ledger.may_join(worker, credential)``; a publication is planned and announced
only to the connected members the ledger makes targets (``ledger.is_target``), and a pull is served
only to such a member; when the ledger stops trusting a member (``ledger.watch``: quarantine,
retirement) its control connection and pull streams are closed at once and the members told to serve
it get a ``revoke`` frame; and every install ack the publisher counts is written to the ledger
(``ledger.installed``), a refused one never. Before anyone is known, the port's perimeter
(``echo2/perimeter.py``) bounds connections, deadlines and rates, and the first frame is read from at
most ``frames.PRE_AUTH_HEADER`` bytes. The publisher keeps only transport state: the live connections
(``_members``), and per version the plan, the acks it counted and refused.

With a TLS identity (``tls``: the run's certificate, ``echo2.transport``) the port speaks TLS only;
workers pin its fingerprint. A worker's join names the fingerprint of its own relay certificate, and
every announcement hands each member the addresses *and* fingerprints of the peers it pulls from, the
members it serves (``serve``), where each of its peers gets its chunks (``repair``: the stripe
ancestors it asks first when that peer fails, ``strategy.repairs_of``; an ancestor serves the
members below it) and its credential for the version (``access.py``), which a ``get``
must carry: the learner is the only party that vouches for who is who.

An announcement's size does not grow with the fleet: it names only the peers its member pulls or
repairs from (not every member's address), a stripe's chunks as a stride, and how many members the
version went to. Planning (the strategy, its repair sources, who serves whom) and encoding the
announcements run off the event loop (``asyncio.to_thread``, the encoding ``ANNOUNCE_BATCH`` members at
a time), so the loop keeps serving leases and heartbeats meanwhile; the manifest, the same for every
member, is encoded once per version. Measured: ``benchmarks/fleet.py --study publish``.

Latecomers (``rounds.py``): a member that joins after the newest anchor was announced (after a learner
restart, every member) is attached to it at its join below a member that holds it or receives it, and
left out of newer publications until it acks it (at most ``LATE_WINDOW_S``); the newest anchor stays
servable however many patches follow it (the same bytes the learner's chain keeps). Measured:
``benchmarks/fleet.py --study restart``.

Members are untrusted, so the publisher keeps their conduct (docs/broadcast.md, "A stalling relay"):
a stall report (``{"op": "stalled", "v": v, "source": peer}``) counts once per (reporter, version,
source), for a tracked version, about a peer of the reporter's own plan, and not against a member that
reported a source of its own stalling in that version (``reports_starved``); ``DEMOTE_AFTER_REPORTS``
counted reports demote a member (it pulls every chunk from the learner: ``strategy.plan_with_leaves``).
An install ack counts toward ``T_bcast`` only if its member was not reported stalling and
:func:`receipt_fault` passes its receipts (final for the version; every refusal counted in
``TcpPublisher.counters``); its peers' paces go to ``conduct.Conduct``, whose slow relays the next
trees place at their leaves. A malformed control frame drops the member's connection.

Every frame is one of ``echo2.weights.frames``: built as its model, sent as ``to_wire`` of it (an
announcement, one per member, as ``frames.announce`` writes that form without building the model), and
parsed by ``parse_frame`` before use (a ``get`` after the gate has read its credential, ``parse_pull``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from echo2.broadcast.access import AccessError, Gate, ServeCounters, issue_batch
from echo2.broadcast.api import BroadcastStats, MemberLedger, PublisherCounters
from echo2.broadcast.buffer import Admission, SnapshotBuffer, serve_pull
from echo2.broadcast.conduct import Conduct
from echo2.broadcast.rounds import LATE_HOP_S, Round, planned_sources, receipt_fault
from echo2.broadcast.strategy import (
    LEARNER,
    Plan,
    Strategy,
    plan_with_leaves,
    repairs_of,
)
from echo2.broadcast.wire import (
    Pacer,
    ProtocolError,
    dumps,
    encode,
    encode_with,
    parse_pull,
    read_header,
    show,
    write_frame,
)
from echo2.errors import Echo2Error
from echo2.logs import SampledLog
from echo2.perimeter import Limits, Perimeter, default_limits, streams
from echo2.physics.broadcast import relay_chunk_bytes
from echo2.resources import paused
from echo2.transport import TlsIdentity, normalize_pin
from echo2.weights.frames import (
    PRE_AUTH_HEADER,
    PRE_AUTH_ITEMS,
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
    announce,
    parse_frame,
    to_wire,
)
from echo2.weights.manifest import Lineage, Manifest, ManifestKey, as_key, build_manifest

log = logging.getLogger(__name__)

DEMOTE_AFTER_REPORTS = 2  # counted stall reports against a member that end its relaying for the run
MAX_TRACKED = 4096  # members whose reports / demotion the publisher remembers (then: the current ones)
MAX_CONTROL = 1 << 16  # bytes of a member's control frame (an install ack with its receipts is the largest)
ANNOUNCE_BATCH = 256  # announcements encoded per trip off the event loop
LATE_WINDOW_S = 600.0  # a latecomer left out of newer publications until it acks its anchor, at most this


@dataclass
class _Member:
    worker: str  # worker id, unique among live members
    addr: tuple[str, int]  # where its chunk server listens
    cert: str  # SHA-256 fingerprint of its chunk server's certificate ("" without TLS)
    writer: asyncio.StreamWriter  # control connection
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # serialises control frames
    pulls: set[asyncio.StreamWriter] = field(default_factory=set)  # its pull streams from the learner
    held: tuple[int, int] | None = None  # (run epoch, version) of the weights it said it holds at its join


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
        tls: TlsIdentity | None = None,
        *,
        ledger: MemberLedger,
        perimeter: Limits | None = None,
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
        self.ledger = ledger  # who may join, who is a target, who installed what (no default: the door)
        self.tls = tls  # the run's certificate and key: TLS on this port (None = plain TCP)
        # connections, deadlines and rates before anyone is known (echo2/perimeter.py)
        self.perimeter = Perimeter("broadcast", perimeter or default_limits())
        self._sampled = SampledLog(log)  # refusals a stranger can repeat at will: counted, logged sparingly
        self.refusals = ServeCounters()  # pulls refused (no credential, out of bounds, over budget)
        self.counters = PublisherCounters()  # stall reports, demotions, refused acks, refused frames
        self._reports: dict[str, int] = {}  # member -> counted stall reports against it
        self.conduct = Conduct()  # the paces acks report of the relays, and the relays found slow
        self._demoted: set[str] = set()  # members that no longer relay (DEMOTE_AFTER_REPORTS)
        self._gate = Gate(self.key, tls, self.refusals)
        self._members: dict[str, _Member] = {}  # live control connections (transport state only)
        self._buffers: dict[int, SnapshotBuffer] = {}
        self._rounds: dict[int, Round] = {}
        self._joined = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._planning = asyncio.Lock()  # publications plan one at a time
        # the last plan and what it was made for (members and addresses, leaves, chunks): a version
        # published to the same fleet reuses it (the rounds only read it)
        self._last_plan: tuple[Any, Plan, dict[str, dict[str, str]], dict[str, set[str]]] | None = None
        self._anchor: int | None = None  # the newest anchor: kept servable, latecomers are attached to it
        self._catching: dict[str, float] = {}  # latecomer -> until when newer publications leave it out

    async def start(self) -> tuple[str, int]:
        self.ledger.watch(self._expel)  # a quarantine or a retirement closes the member's connections
        self._server = await self.perimeter.serve(
            lambda: streams(self._on_connect),
            self.host,
            self.port,
            self.tls.server_context() if self.tls is not None else None,
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
        """Connected members the ledger makes targets (the next publication's: not a latecomer still
        receiving its anchor)."""
        now = time.monotonic()
        return [w for w in self._members if self.ledger.is_target(w) and self._catching.get(w, 0.0) <= now]

    def port_metrics(self) -> dict[str, float]:
        """The broadcast port's perimeter counts (``perimeter/broadcast/...``)."""
        return self.perimeter.metrics()

    def demoted(self) -> list[str]:
        """Members no longer planned as relays (they pull everything from the learner), sorted."""
        return sorted(self._demoted)

    async def wait_members(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self._members) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Echo2Error(f"only {len(self._members)} of {count} workers joined within {timeout:.0f}s")
            self._joined.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._joined.wait(), left)

    async def publish(
        self, version: int, blob: bytes | memoryview, lineage: Lineage | None = None
    ) -> Manifest:
        """Sign ``blob`` as ``version`` (an anchor or a patch, ``lineage``), plan over the live members
        the ledger makes targets, announce to each, start serving. The bytes travel as they are: a
        relay never decodes them."""
        if self._buffers and version <= max(self._buffers):
            raise Echo2Error(f"version {version} is not newer than published version {max(self._buffers)}")
        chunk = self.chunk_size or relay_chunk_bytes(
            len(blob), self.link_rates[0] / self.link_rates[1] if self.link_rates else 1.0
        )
        manifest = await asyncio.to_thread(build_manifest, blob, version, chunk, self.key, lineage)
        self._buffers[version] = SnapshotBuffer(manifest, blob)
        anchor = manifest.lineage.anchor
        if anchor:  # latecomers of the last anchor are members of this one like everybody else
            self._anchor = version
            self._catching.clear()
        for old in sorted(self._buffers)[: -self.keep_versions]:
            if old != self._anchor:  # the newest anchor stays servable to latecomers
                del self._buffers[old]
        self._gate.forget_before(min(self._buffers))
        now = time.monotonic()
        self._catching = {w: t for w, t in self._catching.items() if t > now and w in self._members}
        members = {
            w: m for w, m in self._members.items() if self.ledger.is_target(w) and w not in self._catching
        }
        leaves = frozenset(w for w in members if w in self._demoted)
        addresses = {w: (*m.addr, m.cert) for w, m in members.items()}
        declared = {w: self.ledger.uplink(w) for w in members}  # upload rates (None: not declared)
        links = self.conduct.links(
            version, list(members), declared, self.link_rates[1] if self.link_rates else 1.0
        )
        self.counters.relays_slow = self.conduct.findings
        async with self._planning:  # one plan at a time: a strategy keeps its last trees
            rnd = await asyncio.to_thread(paused, self._plan_round, manifest, addresses, leaves, links)
        man = manifest.to_dict()
        encoded = {"manifest": await asyncio.to_thread(dumps, man)}  # the same in every announcement: once
        hint = self._stall_hint(len(members), manifest.chunk_size)
        rnd.anchor, rnd.announced = anchor, (man, encoded, hint)
        self._rounds[version] = rnd
        for old in sorted(self._rounds)[: -max(8, self.keep_versions)]:
            if old != self._anchor:
                del self._rounds[old]
        log.debug("publishing v%d: %d bytes in %d chunks to %d workers (%s)", version, manifest.total_size,
                  manifest.n_chunks, len(members), self.strategy.name)  # fmt: skip
        order = list(members)
        for i in range(0, len(order), ANNOUNCE_BATCH):  # encoded off the loop, a batch at a time
            batch = order[i : i + ANNOUNCE_BATCH]
            args = (rnd, man, encoded, hint, addresses, batch)
            frames = await asyncio.to_thread(paused, self._announcements, *args)
            for w, frame in zip(batch, frames, strict=True):
                if (member := self._members.get(w)) is members[w]:  # still the member it was planned for
                    self._post(member, frame)
        if anchor:  # members that joined (or joined again) while it was planned: latecomers
            for w, member in list(self._members.items()):
                if members.get(w) is not member:
                    self._admit_late(member)
        return manifest

    def _plan_round(
        self,
        manifest: Manifest,
        addresses: dict[str, tuple[str, int, str]],
        leaves: frozenset[str],
        links: dict[str, float | None],
    ) -> Round:
        """The plan of a version over ``addresses``' members (``leaves`` relay nothing; ``links`` their
        declared upload rates, which shape the trees when every relay declared one), whom each asks
        when a peer fails and whom each serves; pure in its arguments but for the strategy's kept trees,
        run off the event loop."""
        n = manifest.n_chunks
        key = (tuple(addresses.items()), leaves, n, tuple(links.items()))
        if self._last_plan is None or self._last_plan[0] != key:  # else the same fleet: the same plan
            b0 = self.link_rates[0] if self.link_rates is not None else None
            plan = plan_with_leaves(self.strategy, list(addresses), leaves, n, links, b0)
            repair = repairs_of(self.strategy, plan, n)  # whom each member asks first when a peer fails
            serves: dict[str, set[str]] = {w: set() for w in addresses}  # who may pull from whom
            for w in plan:
                for src in planned_sources(plan, repair, w) - {LEARNER}:
                    serves[src].add(w)
            self._last_plan = (key, plan, repair, serves)
        _, plan, repair, serves = self._last_plan
        rnd = Round(manifest, time.monotonic(), tuple(addresses), plan=plan, leaves=leaves, repair=repair)
        rnd.serves = serves
        if self.link_rates is not None and len(addresses) > len(leaves):
            rnd.stream_rate = self.strategy.learner_stream_rate(
                len(addresses) - len(leaves), *self.link_rates
            )
        return rnd

    def _announcements(
        self,
        rnd: Round,
        man: dict[str, object],
        encoded: dict[str, bytes],
        hint: float,
        addresses: dict[str, tuple[str, int, str]],
        batch: list[str],
    ) -> list[list[bytes]]:
        """The encoded ``announce`` frames of ``batch``'s members, each in pieces (``wire.encode_with``:
        ``encoded``'s manifest, the one bytes object, in every frame): each names only the peers it
        pulls or repairs from (and the learner), so a frame's size does not grow with the fleet."""
        version, n = rnd.manifest.version, len(rnd.plan)
        me = (*self.address, self.fingerprint)
        creds = issue_batch(self.key, version, {w: addresses[w][2] for w in batch})  # one signature
        out = []
        for w in batch:
            peers = {LEARNER: me} | {p: addresses[p] for p in rnd.sources(w) - {LEARNER}}
            frame = announce(
                manifest=man, sources=[(a.source, rnd.on_wire(a.chunks)) for a in rnd.plan[w]], peers=peers,
                stall_hint=hint, serve=sorted(rnd.serves[w]), repair=rnd.repair[w],
                credential=creds[w].to_dict(), members=n,
            )  # fmt: skip
            out.append(encode_with(frame, encoded))
        return out

    def _admit_late(self, member: _Member) -> None:
        """Attach ``member``, which joined after the newest anchor was announced, to it (module docstring,
        "Latecomers"): it pulls the whole anchor from a member that holds it or is receiving it, or from
        the learner when the round has nobody to take it, and is left out of newer publications until it
        acks the anchor (or ``LATE_WINDOW_S`` passed), so a patch announced meanwhile does not cut it off."""
        v, w = self._anchor, member.worker
        rnd = self._rounds.get(v) if v is not None else None
        if v is None or rnd is None or rnd.announced is None or v not in self._buffers:
            return
        if not rnd.may_attach(w) or not self.ledger.is_target(w) or self._members.get(w) is not member:
            return  # (one it covers but that does not hold it re-joined before its ack: attached again)
        if member.held is not None and member.held >= (rnd.manifest.lineage.epoch, v):
            return  # it holds the anchor or newer weights of this epoch: the next publication is enough
        newer = [r for x, r in self._rounds.items() if x > v]
        parent = rnd.late_parent(w, lambda p: self._may_serve_late(p, rnd, newer))
        depth = rnd.attach_late(w, parent, self._members.__contains__)
        for src in rnd.sources(w) - {LEARNER}:
            self._post(self._members[src], [encode(to_wire(ServeFrame(v=v, member=w)))])
        self._catching[w] = time.monotonic() + LATE_WINDOW_S
        self.counters.latecomers += 1
        self.counters.latecomers_from_learner += int(parent == LEARNER)
        man, encoded, hint = rnd.announced
        hint = max(hint, depth * LATE_HOP_S)  # a silent parent is abandoned that much later
        near = (rnd.sources(w) | {w}) - {LEARNER}
        addresses = {x: (*self._members[x].addr, self._members[x].cert) for x in near}
        (frame,) = self._announcements(rnd, man, encoded, hint, addresses, [w])
        self._post(member, frame)
        log.debug("latecomer %s pulls v%d from %s", w, v, parent)

    def _may_serve_late(self, member: str, rnd: Round, newer: list[Round]) -> bool:
        """Whether ``member`` may take a latecomer of ``rnd``: connected, relaying, its ack not refused,
        not reported stalling, and not past the version (a node keeps only its newest: ``receiver.py``)."""
        if member not in self._members or member in self._demoted or member in rnd.refused:
            return False
        return member not in rnd.stalled and not any(r.holds(member) for r in newer)

    def _stall_hint(self, n: int, chunk: int) -> float:
        """Seconds without data that are still normal: 8 chunk-times of a stream sharing B_w with N others."""
        if self.link_rates is None or n == 0:
            return 0.0
        return 8.0 * chunk * n / self.link_rates[1]

    async def wait_installed(
        self, version: int, count: int | None = None, timeout: float = 600.0
    ) -> BroadcastStats:
        """Wait until ``count`` workers acked ``version``, or every targeted, still-live worker whose ack
        can count did (a member whose ack was refused, or that was reported stalling, is not waited
        for); ``count`` None waits for the latter."""
        rnd = self._rounds[version]
        deadline = time.monotonic() + timeout
        while True:  # a member whose ack was refused or will be (reported stalling) is done
            live = [
                w
                for w in rnd.targets
                if (w in self._members or w in rnd.install_s)
                and w not in rnd.refused
                and w not in rnd.stalled
            ]
            need = len(live) if count is None else min(count, len(live))
            if len(rnd.install_s) >= need or time.monotonic() >= deadline:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rnd.changed.wait(), min(1.0, max(0.01, deadline - time.monotonic())))
            rnd.changed.clear()
        return rnd.stats()  # the round itself: newer ones may have retired its entry

    def stats(self, version: int) -> BroadcastStats:
        return self._rounds[version].stats()

    async def close(self) -> None:
        for member in list(self._members.values()):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._send(member, ShutdownFrame()), 2.0)
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

    async def _send(self, member: _Member, frame: Frame) -> None:
        await self._send_raw(member, [encode(to_wire(frame))])

    def _post(self, member: _Member, pieces: list[bytes]) -> None:
        """One encoded frame to ``member``: written at once when nothing else is being written to it
        (the transport buffers what its socket does not take yet; nothing waits on the flush), else
        queued behind what is (``_send_raw``, a task). A task per member and publication cost the loop
        ~25 us each: a quarter of a second at 10,000 members."""
        if member.lock.locked() or member.writer.is_closing():
            self._spawn(self._send_raw(member, pieces))
            return
        try:
            member.writer.writelines(pieces)
        except (OSError, ConnectionError, RuntimeError) as exc:
            log.warning("control send to %s failed: %s", member.worker, exc)

    async def _send_raw(self, member: _Member, pieces: list[bytes]) -> None:
        """One encoded frame, in ``pieces``, on ``member``'s control connection."""
        try:
            async with member.lock:
                member.writer.writelines(pieces)
                await member.writer.drain()
        except (OSError, ConnectionError) as exc:
            log.warning("control send to %s failed: %s", member.worker, exc)

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:  # nobody is known yet: a small first frame, soon (the perimeter closes the connection then)
            header = await asyncio.wait_for(
                read_header(reader, PRE_AUTH_HEADER, PRE_AUTH_ITEMS), self.perimeter.limits.header_s
            )
            if header["op"] == "get":  # the gate reads its credential first, then parse_pull the rest
                await self._serve(header, reader, writer)
            else:
                await self._control(parse_frame(header, JoinFrame), reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, OSError):
            pass  # a peer that goes away mid-stream is routine; its downstream repairs
        except AccessError as exc:  # counted by the gate
            self._sampled.log(f"refused:{str(exc)[:24]}", "refused a pull from %s: %s", peer, exc)
        except ProtocolError as exc:
            self.counters.bad_frames += 1
            self._sampled.log(f"dropped:{str(exc)[:24]}", "dropping connection from %s: %s", peer, exc)
        except Exception as exc:  # a peer's bytes found a case no check names: one line, keep serving
            self.counters.peer_errors += 1
            log.warning(
                "dropping connection from %s on an unexpected %s: %.200s", peer, type(exc).__name__, exc
            )
        finally:
            writer.close()

    async def _serve(
        self,
        header: dict,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,  # type: ignore[type-arg]
    ) -> None:
        """A pull: only by a connected member this version was announced to and the ledger still
        trusts, with its credential; bounded. Its stream is closed if the member is expelled."""
        owner: list[_Member] = []

        async def admit(member: str, v: int) -> Admission:
            pull = await parse_pull(header, writer, self.refusals)
            rnd, buffer = self._rounds.get(v), self._buffers.get(v)
            if rnd is None or buffer is None:  # no longer served
                return None, False, None
            paced = not pull.repair and member not in rnd.leaves and member not in rnd.late
            rate = rnd.stream_rate if paced else None
            stream = Pacer(rate) if rate else None
            live = self._members.get(member)
            scheduled = rnd.covers(member) and live is not None and self.ledger.is_target(member)
            if scheduled and live is not None:
                owner.append(live)
                live.pulls.add(writer)
            return buffer, scheduled, stream

        try:
            await serve_pull(
                self._gate, header, reader, writer, admit, self.uplink, self.serve_wait_timeout,
                self._count_sent, vouch=lambda: self.perimeter.vouch(writer.transport),
            )  # fmt: skip
        finally:
            for live in owner:
                live.pulls.discard(writer)

    def _count_sent(self, member: str, version: int, n: int) -> None:
        rnd = self._rounds.get(version)
        if rnd is not None:
            rnd.learner_bytes += n
            rnd.served[member] = rnd.served.get(member, 0) + 1

    async def _control(
        self, hello: JoinFrame, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        worker, cert = hello.worker, hello.cert
        if worker == LEARNER:
            raise ProtocolError(f"a join may not use the learner's id {LEARNER!r}")
        if self.tls is not None:  # a member's relay speaks TLS too; its peers pin what it names here
            try:
                cert = normalize_pin(cert)
            except ValueError:
                raise ProtocolError(f"join from {worker!r} names no certificate fingerprint") from None
        if not self.ledger.may_join(worker, hello.credential):
            await write_frame(writer, to_wire(ErrorFrame(reason=f"worker {worker!r}: credential refused")))
            raise ProtocolError(f"join from {worker!r} refused: bad or missing credential")
        self.perimeter.vouch(writer.transport)  # a registered, trusted member's control connection
        if worker in self._members:
            await write_frame(writer, to_wire(ErrorFrame(reason=f"worker id {worker!r} already joined")))
            raise ProtocolError(f"duplicate worker id {worker!r}")
        held = (hello.held[0], hello.held[1]) if hello.held is not None else None
        member = _Member(worker, (hello.host, hello.port), cert, writer, held=held)
        self._members[worker] = member
        self._joined.set()
        self._admit_late(member)
        log.debug("worker %s joined from %s:%d (%d members)", worker, *member.addr, len(self._members))
        try:
            while True:
                header = await read_header(reader, MAX_CONTROL)
                match parse_frame(
                    header, InstalledFrame, StalledFrame, RejectedFrame, LeaveFrame, sender=worker
                ):
                    case LeaveFrame():
                        break
                    case InstalledFrame(v=v, got=got, pace=pace):
                        self._on_installed(worker, v, got, pace)
                    case StalledFrame(v=v, source=source):
                        self._on_stalled(worker, v, source)
                    case RejectedFrame(v=v, reason=reason):
                        log.warning("worker %s rejected v%s: %s", worker, v, show(reason))
        finally:
            if self._members.get(worker) is member:
                del self._members[worker]
                self._catching.pop(worker, None)
            for rnd in self._rounds.values():
                rnd.changed.set()
            log.debug("worker %s left (%d members)", worker, len(self._members))

    def _on_installed(self, worker: str, v: int, got: Mapping[str, int], pace: Mapping[str, float]) -> None:
        """An install ack: counted (its delay since publication), and written to the ledger, unless
        :func:`receipt_fault` or a stall report against ``worker`` for ``v`` says otherwise; late or
        repeated acks are ignored. A counted ack withdrawn by a later stall report stays written: the
        worker did say it installed ``v``; only ``T_bcast`` no longer counts it."""
        rnd = self._rounds.get(v)
        if rnd is None or not rnd.covers(worker) or worker in rnd.refused:
            return
        if worker in rnd.late:  # it holds the anchor (counted or not): newer publications reach it again
            self._catching.pop(worker, None)
        if worker in rnd.install_s or worker in rnd.late_installed:
            return
        if worker in rnd.stalled:
            self._refuse_ack(rnd, worker, "it was reported stalling for this version", stalled=True)
            return
        why = receipt_fault(got, rnd.sources(worker), rnd.manifest.n_chunks, rnd.served.get(worker, 0))
        if why is not None:
            self._refuse_ack(rnd, worker, why)
            return
        delay = time.monotonic() - rnd.started
        if worker in rnd.late:  # a latecomer: written, not counted toward T_bcast (it started late)
            rnd.late_installed[worker] = delay
        else:
            rnd.install_s[worker] = delay
        if rnd.anchor and worker not in self._demoted:  # it holds the anchor: latecomers may pull it here
            rnd.holders.append(worker)
        self.ledger.installed(worker, v, delay)
        self.conduct.heard(v, worker, pace, rnd.sources(worker))
        rnd.changed.set()

    def _refuse_ack(self, rnd: Round, worker: str, why: str, stalled: bool = False) -> None:
        rnd.refused.add(worker)
        if stalled:
            rnd.refused_as_stalled.add(worker)
        rnd.install_s.pop(worker, None)  # withdrawn if it was counted before a report arrived
        self.counters.acks_refused += 1
        rnd.changed.set()
        log.warning("not counting %s's install of v%d: %s", worker, rnd.manifest.version, why)

    def _on_stalled(self, reporter: str, v: int, source: str) -> None:
        """A stall report (module docstring): counted, or refused and counted as refused."""
        rnd = self._rounds.get(v)
        why = None
        if rnd is None or source == LEARNER or source not in rnd.sources(reporter):
            why = "no such version here" if rnd is None else f"{show(source)} is not a peer it pulls from"
        elif reporter in rnd.stalled.get(source, ()):
            why = "already reported"
        if why is not None:
            self.counters.reports_refused += 1
            log.debug("ignoring %s's report of a stall of %s in v%d: %s", reporter, show(source), v, why)
            return
        if reporter not in rnd.starved:
            rnd.starved.add(reporter)
            self._exonerate(rnd, reporter)
        if source in rnd.starved:  # its own source stalled for it first: the stall is not its doing
            self.counters.reports_starved += 1
            log.info("%s reports %s in v%d, which its own source starved: not counted", reporter, source, v)
            return
        rnd.stalled.setdefault(source, set()).add(reporter)
        self.counters.stall_reports += 1
        count = self._reports[source] = self._reports.get(source, 0) + 1
        log.warning("%s reports that %s stalled for it in v%d (%d reports)", reporter, source, v, count)
        if source in rnd.install_s:  # it acked before the report arrived: withdrawn
            self._refuse_ack(rnd, source, f"{reporter} reported it stalling", stalled=True)
        if count >= DEMOTE_AFTER_REPORTS and source not in self._demoted:
            self._demoted.add(source)
            self.counters.relays_demoted += 1
            self.ledger.relay_conduct(source, True)  # its record shows it (the pool table, /metrics)
            log.warning("%s no longer relays: %d stall reports; it pulls from the learner", source, count)
        self._forget()

    def _exonerate(self, rnd: Round, member: str) -> None:
        """``member`` reported a source of its own stalling in this version: reports of it stalling in
        the same version are of the starvation it passed on, not counted against it (its count and a
        demotion they caused are undone, and it may ack again). An ack it sent before and that was
        refused for those reports is not counted back: the publisher keeps no refused ack's receipts,
        so a member exonerated only after its ack stays out of this version's ``T_bcast``."""
        against = rnd.stalled.pop(member, set())
        if not against:
            return
        self.counters.stall_reports -= len(against)
        self.counters.reports_starved += len(against)
        self._reports[member] = max(0, self._reports.get(member, 0) - len(against))
        if member in self._demoted and self._reports[member] < DEMOTE_AFTER_REPORTS:
            self._demoted.discard(member)
            self.counters.relays_demoted -= 1
            self.ledger.relay_conduct(member, False)
        if member in rnd.refused_as_stalled:
            rnd.refused_as_stalled.discard(member)
            rnd.refused.discard(member)
            self.counters.acks_refused -= 1
        log.info("%s was starved by its own source in v%d: %d reports against it not counted",
                 member, rnd.manifest.version, len(against))  # fmt: skip
        rnd.changed.set()

    def _expel(self, worker: str) -> None:
        """The ledger no longer trusts ``worker`` (quarantined, retired): its control connection and its
        pull streams from the learner are closed now, and every member told to serve it in a version
        still tracked is told to stop (a ``revoke`` frame: it closes the streams it serves it)."""
        member = self._members.pop(worker, None)
        if member is not None:
            member.writer.transport.abort()
            for pull in list(member.pulls):
                pull.transport.abort()
            member.pulls.clear()
            self.counters.members_expelled += 1
            log.warning("closed the broadcast connections of %s: the run no longer trusts it", worker)
        relays = {w for rnd in self._rounds.values() for w, served in rnd.serves.items() if worker in served}
        for w in relays:
            relay = self._members.get(w)
            if relay is not None:
                self._spawn(self._send(relay, RevokeFrame(member=worker)))
        for rnd in self._rounds.values():
            rnd.changed.set()

    def _forget(self) -> None:
        """Keep what the publisher remembers of members bounded (MAX_TRACKED): past the bound, only the
        current members' reports and demotions stay."""
        if len(self._reports) + len(self._demoted) > MAX_TRACKED:
            self._reports = {w: c for w, c in self._reports.items() if w in self._members}
            self._demoted &= set(self._members)
