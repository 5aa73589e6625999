"""One version's publication on the learner (``publisher.py`` keeps one :class:`Round` per version it
still serves): its plan, the acks it counted and refused, what the learner served, the stall reports
about its members, and its latecomers.

Latecomers: a member that joins after the newest anchor was announced (after a learner restart, whose
anchor goes out before the fleet has re-joined, every member; otherwise a worker that started late) is
attached to that anchor when it joins, so it does not fetch the model over HTTP through the learner's
uplink. It pulls the whole anchor from one member: the first whose install of it counted (in ack order),
else the first latecomer before it (which relays what it receives as it receives it), else a member of
the plan still receiving it, each serving at most ``LATE_FANOUT`` latecomers, else the learner (a
round's first latecomer when it was announced to nobody).
That member is told to serve it (a ``serve`` frame), its repair chain is that member's own sources (at
most ``REPAIR_HOPS``, then the learner), and its announcement is built like the others (its peers, its
credential). Until it acks the anchor (at most ``LATE_WINDOW_S``) newer publications leave it out: a
patch announced meanwhile would cut its anchor off and leave it a patch it cannot apply; it fetches the
patches since over HTTP once it holds the anchor. A member whose join says it holds the anchor or newer
weights of the same run epoch is not attached. The newest anchor stays servable however many patches
follow it (the same bytes the learner's chain keeps). A latecomer's install is written to the ledger
but not counted in ``T_bcast`` (it started late). Measured: ``benchmarks/fleet.py --study restart``.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from echo2.broadcast.api import BroadcastStats
from echo2.broadcast.strategy import LEARNER, REPAIR_HOPS, Assignment, Plan
from echo2.broadcast.wire import show
from echo2.weights.manifest import Manifest

LATE_FANOUT = 4  # latecomers one member serves a version to, whole (their upload: this x the version)
LATE_HOP_S = 5.0  # a latecomer's stall hint per hop below a member that holds the anchor (or the learner)
LATE_REJOINS = 3  # times a member that re-joins before its ack is attached again (then: over HTTP)


@dataclass
class Round:
    """One version's publication: its plan, who installed it, what the learner served, the conduct its
    members reported, and the latecomers attached to it."""

    manifest: Manifest  # the version being broadcast
    started: float  # monotonic time of publication
    targets: tuple[str, ...]  # members the plan covered
    install_s: dict[str, float] = field(default_factory=dict)  # worker -> install delay
    learner_bytes: int = 0  # payload bytes served for this version
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # pulsed on every ack
    stream_rate: float | None = None  # cap per learner pull stream (bytes/s), None = uncapped
    plan: Plan = field(default_factory=dict)  # who pulls which chunks from whom this version
    leaves: frozenset[str] = frozenset()  # demoted targets: everything from the learner, no cap
    served: dict[str, int] = field(default_factory=dict)  # member -> chunk frames the learner sent it
    stalled: dict[str, set[str]] = field(default_factory=dict)  # source -> members that reported it
    starved: set[str] = field(default_factory=set)  # members that reported a source of theirs stalling
    refused: set[str] = field(default_factory=set)  # members whose ack of this version does not count
    refused_as_stalled: set[str] = field(default_factory=set)  # of which for a stall report against it
    repair: dict[str, dict[str, str]] = field(default_factory=dict)  # strategy.repairs_of(plan)
    serves: dict[str, set[str]] = field(default_factory=dict)  # member -> the members it serves
    anchor: bool = False  # an anchor (or a whole snapshot): members joining later are attached to it
    announced: tuple[dict[str, object], dict[str, bytes], float] | None = None  # manifest, encoded, hint
    late: dict[str, str] = field(default_factory=dict)  # latecomer -> the member (or learner) it pulls from
    late_kids: dict[str, int] = field(default_factory=dict)  # member -> latecomers it serves
    late_depth: dict[str, int] = field(default_factory=dict)  # latecomer -> hops below a holder / the learner
    holders: deque[str] = field(default_factory=deque)  # members whose install counted, in ack order
    late_open: deque[str] = field(default_factory=deque)  # latecomers that may take latecomers, in order
    planned: deque[str] | None = None  # the plan's relays, in order: taken only while nobody else can
    late_installed: dict[str, float] = field(default_factory=dict)  # latecomer -> install delay (not T_bcast)
    attached: dict[str, int] = field(default_factory=dict)  # latecomer -> times attached
    _own: bool = False  # plan, repair and serves are this round's copies (a latecomer changed them)

    @functools.cached_property
    def every(self) -> tuple[int, ...]:
        """Every chunk of the version, one tuple for all the latecomers' pulls."""
        return tuple(range(self.manifest.n_chunks))

    def hops(self, member: str) -> int:
        """Hops between ``member`` and one that holds the version (or the learner): a latecomer below it
        gets its first chunk about that many chunk times late (its stall hint, ``LATE_HOP_S`` a hop)."""
        if member == LEARNER or self.holds(member):
            return 0
        return self.late_depth[member] if member in self.late else 2  # a plan's relay: about 2

    def holds(self, member: str) -> bool:
        """Whether ``member``'s install of this version was acked (counted, or a latecomer's)."""
        return member in self.install_s or member in self.late_installed

    def late_parent(self, member: str, usable: Callable[[str], bool]) -> str:
        """Whom latecomer ``member`` pulls this version from: the first member whose install counted, else
        the first latecomer (it relays what it receives), else a member of the plan still receiving it,
        each ``usable`` and serving fewer than ``LATE_FANOUT`` latecomers, and not ``member`` nor one it
        feeds that does not hold the version yet (a member attached again); else the learner."""
        if not self.holders and not self.late_open and self.planned is None:  # nobody else yet: a relay
            self.planned = deque(w for w in self.targets if w not in self.leaves)  # of the plan
        again = member in self.plan  # planned before: some may be fed through it
        for queue in (self.holders, self.late_open, self.planned or deque()):
            while queue and not (usable(queue[0]) and self.late_kids.get(queue[0], 0) < LATE_FANOUT):
                queue.popleft()  # gone for every latecomer
            for p in queue:  # the first one (but for a member attached again)
                if p == member or (again and not self.holds(p) and self.fed_by(p, member)):
                    continue
                if usable(p) and self.late_kids.get(p, 0) < LATE_FANOUT:
                    self.late_kids[p] = self.late_kids.get(p, 0) + 1
                    return p
        return LEARNER

    def may_attach(self, member: str) -> bool:
        """Whether ``member`` may be attached as a latecomer: it does not hold the version, and it was not
        attached ``1 + LATE_REJOINS`` times already (each re-join starts a whole copy from its parent: a
        member that keeps re-joining costs its parents that much, then fetches over HTTP)."""
        return not self.holds(member) and self.attached.get(member, 0) <= LATE_REJOINS

    def fed_by(self, member: str, source: str) -> bool:
        """Whether ``member`` gets any chunk of this version through ``source``: ``source`` is one of its
        sources, or of theirs, up to the learner (a member re-attached under one it feeds would wait on
        itself)."""
        seen, todo = {member}, [member]
        while todo:
            for up in self.sources(todo.pop()) - {LEARNER}:
                if up == source:
                    return True
                if up not in seen:
                    seen.add(up)
                    todo.append(up)
        return False

    def attach_late(self, member: str, parent: str, live: Callable[[str], bool]) -> int:
        """Plan ``member`` as a latecomer pulling every chunk from ``parent``; its repair chain is
        ``parent``'s own sources (the ``live`` ones, at most ``REPAIR_HOPS``, then the learner), and each
        source serves it. A member attached again (it re-joined before its ack: a new node, holding
        nothing of the version) leaves its former sources, and whom it served may still pull from it.
        Returns its hops below a member that holds the version."""
        self.own()
        before = self.late.get(member)
        if before is not None and before != LEARNER:
            self.late_kids[before] -= 1
        for src in self.sources(member) - {LEARNER}:
            self.serves.get(src, set()).discard(member)
        ups: dict[str, str] = {}
        p = parent
        while p in self.late and len(ups) < REPAIR_HOPS:  # a latecomer's own source, then its source's
            up = self.late[p]
            if up == LEARNER or not live(up):
                break
            ups[p] = p = up
        self.plan[member] = (Assignment(parent, self.every),)
        self.repair[member] = ups
        self.late[member] = parent
        self.attached[member] = self.attached.get(member, 0) + 1
        depth = self.late_depth[member] = 1 + self.hops(parent)
        self.serves.setdefault(member, set())
        for src in self.sources(member) - {LEARNER}:
            self.serves.setdefault(src, set()).add(member)
        if before is None:
            self.late_open.append(member)
        return depth

    def stats(self) -> BroadcastStats:
        """What this version's dissemination has cost so far."""
        return BroadcastStats(
            version=self.manifest.version,
            n_workers=len(self.targets),
            total_size=self.manifest.total_size,
            install_s=dict(self.install_s),
            learner_bytes=self.learner_bytes,
            n_refused=sum(1 for w in self.targets if w in self.refused or w in self.stalled),
            late=len(self.late),
            late_install_s=dict(self.late_installed),
        )

    def covers(self, member: str) -> bool:
        """Whether ``member`` was announced this version (planned, or attached as a latecomer)."""
        return member in self.plan

    def own(self) -> None:
        """Copy the plan, repair chains and serve sets, shared with the publisher's kept plan, before a
        latecomer changes them."""
        if not self._own:
            self.plan, self.repair = dict(self.plan), dict(self.repair)
            self.serves = {w: set(s) for w, s in self.serves.items()}
            self._own = True

    _wire: dict[int, tuple[tuple[int, ...], object]] = field(default_factory=dict)  # id -> chunks, as sent

    def on_wire(self, chunks: tuple[int, ...]) -> object:
        """A pull's chunks as an announcement carries them: a stride (``frames.Stride``) when they are every
        step-th chunk from the first to the version's last, as a relay tree's stripe is, else the list.
        Worked out once per tuple of the plan (its stripes' tuples are shared by every member)."""
        hit = self._wire.get(id(chunks))
        if hit is not None and hit[0] is chunks:
            return hit[1]
        wire: object = list(chunks)
        step = chunks[1] - chunks[0] if len(chunks) >= 2 else 0
        if step >= 1 and chunks == tuple(range(chunks[0], self.manifest.n_chunks, step)):
            wire = {"start": chunks[0], "step": step}
        self._wire[id(chunks)] = (chunks, wire)
        return wire

    def sources(self, member: str) -> set[str]:
        """The sources ``member``'s plan names this version (the learner included when it does) and the
        ancestors it was told to repair a failed one from."""
        return planned_sources(self.plan, self.repair, member)


def planned_sources(plan: Plan, repair: Mapping[str, Mapping[str, str]], member: str) -> set[str]:
    """The sources ``plan`` names for ``member`` (the learner included when it does) and the ancestors
    ``repair`` tells it to repair a failed one from."""
    return {a.source for a in plan.get(member, ())} | set(repair.get(member, {}).values())


def receipt_fault(got: Mapping[str, int], sources: set[str], n_chunks: int, served: int) -> str | None:
    """Why a member's install ack does not count toward ``T_bcast``, or None when it does.

    ``got`` is the member's receipts (source -> chunks it stored from that source), ``sources`` its
    plan's sources for the version, ``served`` the chunk frames the learner sent it for the version.
    The ack counts iff every named source is in its plan or is the learner (repairs), the receipts add
    up to the manifest's chunk count (``sum(got) == n_chunks``: each chunk is stored once), and its
    learner part is at most what the learner served it (``got[learner] <= served``). A member cannot
    claim chunks from the learner it never pulled, nor from a peer it was not told to pull from; what
    peers served it the learner cannot see (see docs/broadcast.md for what a liar can still claim)."""
    unknown = sorted(set(got) - sources - {LEARNER})
    if unknown:
        return f"names sources outside its plan: {show(unknown)}"
    total = sum(got.values())
    if total != n_chunks:
        return f"receipts add up to {total} chunks, the manifest has {n_chunks}"
    if got.get(LEARNER, 0) > served:
        return f"claims {got[LEARNER]} chunks from the learner, which served it {served}"
    return None
