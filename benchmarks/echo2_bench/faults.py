"""Fault injection for the broadcast harness: a worker that dies, freezes, corrupts what it relays, or
relays it a drip at a time (``drip_bps``: its uplink paced far below its link, each chunk inside the
stall timeout; the harness paces it, no tap).

:class:`FaultTap` plugs into the product's ``ChunkTap`` seam (``TcpWorkerNode(tap=...)``); the node
itself knows nothing of faults. ``corrupted_sent`` is the ground truth the benchmark compares with
the product's ``corrupt_detected`` counter. A relay that stalls on purpose (accepts pulls, sends
nothing, acks every version) is not a tap on an honest node but a node of its own:
:class:`echo2_bench.stalling.StallingNode`.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Faults:
    """What to inject into one worker (all off by default)."""

    die_at: float = 0.0  # SIGKILL itself once this fraction of chunks arrived (0 = never)
    stall_at: float = 0.0  # SIGSTOP itself (freeze, sockets stay open) at this fraction (0 = never)
    corrupt_every: int = 0  # flip a byte in every k-th chunk it relays (0 = never)
    drip_bps: float = 0.0  # relay at this uplink, bits/s, whatever its link (0 = its link): a drip feeder

    def removes_worker(self) -> bool:
        """True if the worker is killed or frozen, so it never reports an install."""
        return self.die_at > 0 or self.stall_at > 0


class FaultTap:
    """A ``ChunkTap`` that applies :class:`Faults` to the node it is plugged into."""

    def __init__(self, faults: Faults, name: str = "?") -> None:
        self.faults = faults
        self.name = name  # worker id, for the log
        self.served = 0  # chunks served to peers so far
        self.corrupted_sent = 0  # chunks deliberately corrupted (injection ground truth)

    def on_received(self, index: int, fraction: float) -> None:
        f = self.faults
        if f.die_at and fraction >= f.die_at:
            log.warning("worker %s: fault injection: SIGKILL at %.0f%%", self.name, 100 * fraction)
            os.kill(os.getpid(), signal.SIGKILL)
        if f.stall_at and fraction >= f.stall_at:
            log.warning("worker %s: fault injection: SIGSTOP at %.0f%%", self.name, 100 * fraction)
            os.kill(os.getpid(), signal.SIGSTOP)

    def on_serve(self, index: int, payload: bytes | memoryview) -> bytes | memoryview:
        if not self.faults.corrupt_every:
            return payload
        self.served += 1
        if self.served % self.faults.corrupt_every:
            return payload
        self.corrupted_sent += 1
        bad = bytearray(payload)
        bad[len(bad) // 2] ^= 0xFF
        return bytes(bad)
