"""One version's transfer on a worker's broadcast node (``receiver.TcpWorkerNode``): what the
announcement told it, what has arrived, and when each pull stream is given up: before its first chunk
at ``wire.first_chunk_deadline``, then at the stall timeout, ``wire.lagging`` or ``wire.finish_deadline``
(the node's other planned streams are what a stream is judged by)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from echo2.broadcast.access import Credential
from echo2.broadcast.buffer import SnapshotBuffer
from echo2.broadcast.strategy import LEARNER
from echo2.broadcast.wire import Pace, finish_deadline, first_chunk_deadline, lagging, relative_pace
from echo2.weights.frames import MAX_PACE
from echo2.weights.manifest import Manifest


@dataclass
class Transfer:
    """One announced version on its way into a node: what it was told (plan, credential), what arrived
    (receipts, paces), and when each pull from a peer is given up (:meth:`due`)."""

    manifest: Manifest
    buffer: SnapshotBuffer
    peers: dict[str, tuple[str, int, str]]  # source -> host, port, certificate fingerprint ("" = plain)
    stall_timeout: float  # this version's stall timeout: the node's, raised to the learner's hint
    credential: Credential  # the learner's permission for this node to pull this version
    n_members: int  # members this version was announced to (N in first_chunk_deadline)
    started: float = field(default_factory=time.monotonic)
    stored: float = field(default_factory=time.monotonic)  # when it last stored a chunk (or started)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    learner_first: float | None = None  # seconds to the first chunk of a planned learner stream
    peer_first: float | None = None  # seconds to the first chunk from any peer
    received: int = 0  # payload bytes read in this version
    got: dict[str, int] = field(default_factory=dict)  # source -> chunks stored from it (receipts)
    repair: dict[str, str] = field(default_factory=dict)  # source -> its stripe ancestor (the announcement's)
    paces: dict[str, Pace] = field(default_factory=dict)  # planned stream's source -> when its chunks came
    repairs: list[Pace] = field(default_factory=list)  # when the repair streams' chunks came

    def others(self, source: str) -> list[Pace]:
        """The paces of this version's planned streams other than ``source``'s (the learner's included)."""
        return [p for s, p in self.paces.items() if s != source]

    def due(
        self, source: str, pace: Pace, start: float, todo: list[int], pos: int, planned: bool
    ) -> tuple[float, str]:
        """When a pull from the peer ``source`` (begun at ``start``; of ``todo``, read up to ``pos``) is
        given up, as of now, and why if not for silence: before its first chunk :meth:`first_deadline`;
        then ``stall_timeout`` after its last, and a planned stream at once when it lags
        (:func:`~echo2.broadcast.wire.lagging`) or, once only its chunks are missing, by
        :func:`~echo2.broadcast.wire.finish_deadline` (a small patch's stripe, where no rate is read;
        never a node's only planned source, a latecomer's holder)."""
        if pace.count == 0:
            return start + self.first_deadline(), ""
        when = pace.last + self.stall_timeout
        if not planned:
            return when, ""
        now, others = time.monotonic(), self.others(source)
        if why := lagging(pace, others, now, self.stall_timeout):
            return now, why
        missing = self.manifest.n_chunks - self.buffer.count  # first: buffer.missing walks the list
        left = todo[pos:] if others and 0 < missing <= len(todo) - pos else []
        if left and len(self.buffer.missing(left)) == missing:  # only its chunks are missing
            # since when: the last chunk of another stream (planned or repair); none comes after it
            came = [p.last for p in (*self.paces.values(), *self.repairs) if p is not pace and p.count]
            alone = min(now, max(came, default=now))
            done_by = finish_deadline(self.started, alone, self.stall_timeout)
            if done_by < when:
                return done_by, f"every other chunk stored by {alone - self.started:.1f}s"
        return when, ""

    def relative(self) -> dict[str, float]:
        """Each planned peer stream's :func:`~echo2.broadcast.wire.relative_pace` (those with one), for
        the install ack."""
        paces = {s: relative_pace(p, self.others(s)) for s, p in self.paces.items() if s != LEARNER}
        return {s: min(r, MAX_PACE) for s, r in paces.items() if r is not None}

    def first_deadline(self) -> float:
        """:func:`first_chunk_deadline` of a peer pull of this version, as of now."""
        return first_chunk_deadline(
            self.stall_timeout,
            time.monotonic() - self.started,
            self.learner_first,
            self.peer_first,
            self.n_members,
            self.manifest.chunk_size,
            self.received,
        )
