"""The broadcast seam used by the runtime: a publisher on the learner, a receiver on each worker.

Two implementations ship: TCP (`TcpPublisher` / `TcpWorkerNode`, real processes and links) and
in-memory (`InMemoryHub`, for tests and single-process runs). Both verify every manifest and blob.

A publisher is handed its :class:`MemberLedger` at construction: the one ledger of members and
installed versions (the runtime's ``WorkerRegistry``). The publisher keeps only transport state (live
connections, per-round plans and acks); who may join, who is a target of a publication, and which
version each worker holds are the ledger's, and the ledger tells the publisher when it stops trusting a
member (``watch``), which closes that member's connections at once. The TCP publisher has no default
ledger (a forgotten one must not open the door): :class:`OpenLedger` (anyone joins, everyone is a
target, installs are not recorded) is passed by name where that is meant: tests, benchmarks, and the
in-memory hub, whose receivers live in the learner's own process.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from echo2.physics.rules import install_quorum
from echo2.weights.manifest import Lineage, Manifest, ManifestKey


@dataclass(frozen=True)
class InstalledSnapshot:
    """A verified snapshot a worker may install: a full anchor or a patch (``manifest.lineage``),
    decoded by ``echo2.weights.delta``."""

    manifest: Manifest  # authenticated manifest; manifest.version is the policy version
    data: memoryview  # read-only view of the verified blob (the node's only copy)


@dataclass(frozen=True)
class BroadcastStats:
    """What one version's dissemination cost, as seen by the publisher."""

    version: int  # policy version broadcast
    n_workers: int  # workers the plan targeted (active members at publish time)
    total_size: int  # G, bytes in the snapshot
    install_s: dict[str, float] = field(default_factory=dict)  # worker -> seconds from publish to install ack
    learner_bytes: int = 0  # payload bytes the learner uploaded for this version (narrow-link cost)
    n_refused: int = 0  # targeted workers whose ack does not count (reported stalling, bad receipts)
    late: int = 0  # members attached after the announcement (an anchor's latecomers; not in n_workers)
    # latecomer -> seconds from publish to its install ack (not part of T_bcast: they started late)
    late_install_s: dict[str, float] = field(default_factory=dict)

    @property
    def n_counted(self) -> int:
        """Targeted workers whose install can count: ``n_workers - n_refused``."""
        return self.n_workers - self.n_refused

    def t_installed(self, fraction: float) -> float:
        """Seconds until ceil(fraction * n_counted) workers installed (inf if not reached)."""
        need = max(1, math.ceil(fraction * self.n_counted - 1e-9))
        times = sorted(self.install_s.values())
        return times[need - 1] if len(times) >= need else math.inf

    def t_quorum(self, gamma: float) -> float:
        """``T_bcast`` (SPEC §3): seconds until ``install_quorum(n_counted, gamma)`` workers installed (a
        member whose ack the publisher refused is neither waited for nor counted)."""
        need = install_quorum(self.n_counted, gamma)
        times = sorted(self.install_s.values())
        return times[need - 1] if len(times) >= need else math.inf

    def metrics(self, gamma: float) -> dict[str, float]:
        """SPEC §7 metrics: T_bcast at q = 1/gamma (the run's ``staleness.gamma``), learner-uplink
        bytes, p90 install time."""
        return {
            "broadcast/t_bcast_s": self.t_quorum(gamma),
            "broadcast/bytes": float(self.learner_bytes),
            "broadcast/install_p90_s": self.t_installed(0.9),
        }


@dataclass
class PublisherCounters:
    """What the publisher refused or decided about its members (cumulative over the run; SPEC: catch
    only where tolerance is the point, and count). The in-memory hub has no relays: all stay 0."""

    stall_reports: int = 0  # valid reports of a peer that stalled for its reporter (docs/broadcast.md)
    reports_refused: int = 0  # stall reports refused: unknown version, not the reporter's source, repeated
    reports_starved: int = 0  # reports against a member its own source starved in that version: not counted
    relays_demoted: int = 0  # members no longer planned as relays after repeated stall reports
    relays_slow: int = 0  # relays found slow by their children's acks (conduct.py): planned lower a while
    acks_refused: int = 0  # install acks not counted: receipts inconsistent, or reported stalling
    members_expelled: int = (
        0  # connected members whose connections closed when the ledger stopped trusting them
    )
    bad_frames: int = 0  # connections dropped on a malformed frame (ProtocolError) from a peer
    peer_errors: int = 0  # connections dropped on an unexpected exception from a peer's bytes
    latecomers: int = 0  # members attached to an anchor after it was announced (publisher.py, latecomers)
    latecomers_from_learner: int = 0  # of which pulling it from the learner (nobody else could take them)

    def metrics(self) -> dict[str, float]:
        """The counters under their ``broadcast/`` metric names (cumulative)."""
        return {f"broadcast/{k}": float(v) for k, v in vars(self).items()}


class MemberLedger(Protocol):
    """What a publisher asks of the ledger of members (the runtime's ``WorkerRegistry``)."""

    def may_join(self, worker_id: str, credential: object) -> bool:
        """Whether a join under ``worker_id`` with ``credential`` (as the join frame carried it) is
        admitted to the snapshot topology."""
        ...

    def is_target(self, worker_id: str) -> bool:
        """Whether a connected member is planned and announced the next publication (a revoked or
        retired identity is not, even while its connection is open)."""
        ...

    def installed(self, worker_id: str, version: int, install_s: float) -> None:
        """A counted install ack: ``worker_id`` installed ``version``, ``install_s`` seconds after its
        publication (a refused ack is never recorded; an unknown id is ignored)."""
        ...

    def watch(self, on_untrusted: Callable[[str], None]) -> None:
        """Call ``on_untrusted(worker_id)`` whenever the ledger stops trusting a member (quarantine,
        retirement), at once, on the thread that decided it."""
        ...

    def uplink(self, worker_id: str) -> float | None:
        """The upload rate ``worker_id`` declared, bytes/s, or None: the relay trees put the fast members
        near the root when every relay's is known."""
        ...

    def relay_conduct(self, worker_id: str, demoted: bool) -> None:
        """The publisher's verdict on ``worker_id`` as a relay: demoted (its peers reported it stalling
        ``DEMOTE_AFTER_REPORTS`` times: it pulls from the learner and serves nobody), or relaying again
        (those reports were a starvation it passed on). An unknown id is ignored."""
        ...


class OpenLedger:
    """The ledger where none is given (tests, benchmarks, the in-memory hub): anyone may join, every
    member is a target, installs are not recorded (the publisher's own stats still count them)."""

    def may_join(self, worker_id: str, credential: object) -> bool:
        return True

    def is_target(self, worker_id: str) -> bool:
        return True

    def installed(self, worker_id: str, version: int, install_s: float) -> None:
        return None

    def watch(self, on_untrusted: Callable[[str], None]) -> None:
        return None  # nobody is ever untrusted here

    def uplink(self, worker_id: str) -> float | None:
        return None  # not known: the trees take every link as equal

    def relay_conduct(self, worker_id: str, demoted: bool) -> None:
        return None  # the publisher's own counters still count demotions


class SnapshotPublisher(Protocol):
    """Learner side: announce a snapshot to the current members and serve it."""

    counters: PublisherCounters  # stall reports, demotions, refused acks, refused frames
    key: ManifestKey  # what it signs manifests with (a base link's twin is signed with it too)

    async def start(self) -> tuple[str, int]:
        """Start serving; returns the address receivers join."""
        ...

    async def publish(
        self, version: int, blob: bytes | memoryview, lineage: Lineage | None = None
    ) -> Manifest:
        """Sign and announce ``blob`` as ``version``: a full snapshot, or a patch (``lineage``)."""
        ...

    async def wait_installed(
        self, version: int, count: int | None = None, timeout: float = 600.0
    ) -> BroadcastStats: ...

    def stats(self, version: int) -> BroadcastStats:
        """What ``version``'s dissemination has cost so far (installs acked until now)."""
        ...

    def members(self) -> list[str]:
        """Workers joined now that the ledger makes targets (the next publication's targets)."""
        ...

    def port_metrics(self) -> dict[str, float]:
        """Its listening port's perimeter counts (``perimeter/broadcast/...``; none in process)."""
        ...

    async def close(self) -> None: ...


class ChunkTap(Protocol):
    """Optional hook on a node's chunk flow; the node never needs one (default None: no calls at all).

    Tests and the benchmark harness (``benchmarks/echo2_bench/faults.py``) use it to kill, freeze or
    corrupt a relay at a chosen point. Both methods run inline on the node's event loop.
    """

    def on_received(self, index: int, fraction: float) -> None:
        """Chunk ``index`` arrived, verified and stored; ``fraction`` of this version's chunks are held."""
        ...

    def on_serve(self, index: int, payload: bytes | memoryview) -> bytes | memoryview:
        """Chunk ``index`` is about to be sent to a peer; return the bytes to send instead."""
        ...


@dataclass(frozen=True)
class Receiving:
    """A transfer under way on a receiver (``SnapshotReceiver.receiving``): what a worker waits on before it
    fetches the same weights over HTTP instead (``rollout/follower.py``)."""

    version: int  # the version being received
    epoch: int  # its run epoch (the manifest's lineage)
    idle_s: float  # seconds since it last stored a chunk (or since it started)


class SnapshotReceiver(Protocol):
    """Worker side: yields each newer verified snapshot; the caller acks after loading it."""

    async def start(self, join_timeout: float = 30.0) -> None: ...

    def snapshots(self) -> AsyncIterator[InstalledSnapshot]: ...

    def receiving(self) -> Receiving | None:
        """The version being received now, and how it goes (None: none)."""
        ...

    async def report_installed(self, version: int) -> None: ...

    async def close(self) -> None: ...
