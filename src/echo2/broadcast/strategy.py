"""The strategy seam: who pulls which chunk from whom, plus the pure bounds of SPEC §4.

A strategy turns the membership of one version (ordered worker ids) and the chunk count into a
:data:`Plan`: for every worker, an ordered list of (source, chunks) pulls. The node code is the same for
every strategy; only the plan differs. ``LEARNER`` names the publisher as a source.

Bounds (SPEC §4), with G bytes, learner uplink B0, per-worker link B_w (both directions), N workers::

    T*            = max(G/B_w, G/B0, N*G/(B0 + N*B_w))      # no scheme can beat this
    T_star_unlim  = G/B_w                                   # each worker's downlink is the bottleneck
    T_star_lim    = max(G/B_w, N*G/B0)                      # the learner uplink carries N copies
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

LEARNER = "learner"


@dataclass(frozen=True)
class Assignment:
    """One pull stream of a worker: these chunks, in this order, from this source."""

    source: str  # node id to pull from (LEARNER for the publisher)
    chunks: tuple[int, ...]  # chunk indices, ascending


Plan = dict[str, tuple[Assignment, ...]]  # worker id -> its pull streams


class Strategy(Protocol):
    """A dissemination strategy: a pure function from membership to a plan."""

    @property
    def name(self) -> str:
        """Registry key, e.g. "tree-pipelined"."""
        ...

    @property
    def learner_uplink_capped(self) -> bool:
        """False only for the Star-Unlimited reference (learner uplink left uncapped on the harness)."""
        ...

    def plan(self, workers: Sequence[str], n_chunks: int) -> Plan: ...

    def learner_stream_rate(self, n: int, b0: float, bw: float) -> float | None:
        """Cap (bytes/s) on each learner pull stream given N, B0, B_w in bytes/s; None = no cap."""
        ...


def lower_bound(g_bytes: float, b0: float, bw: float, n: int) -> float:
    """T* = max(G/B_w, G/B0, N*G/(B0 + N*B_w)) seconds, with bandwidths in bytes/s."""
    return max(g_bytes / bw, g_bytes / b0, n * g_bytes / (b0 + n * bw))


def star_limited_time(g_bytes: float, b0: float, bw: float, n: int) -> float:
    """Ideal Star-Limited time: max(G/B_w, N*G/B0)."""
    return max(g_bytes / bw, n * g_bytes / b0)


def star_unlimited_time(g_bytes: float, bw: float) -> float:
    """Ideal Star-Unlimited time: G/B_w."""
    return g_bytes / bw
