"""The strategy seam: who pulls which chunk from whom (SPEC §4).

A strategy turns the membership of one version (ordered worker ids) and the chunk count into a
:data:`Plan`: for every worker, an ordered list of (source, chunks) pulls. The node code is the same for
every strategy; only the plan differs. ``LEARNER`` names the publisher as a source.

A strategy's registry key is a :data:`echo2.physics.broadcast.StrategyName`; its predicted times and the
lower bound ``T*`` live in :mod:`echo2.physics.broadcast` (bytes and bytes/s, like this package).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from echo2.physics.broadcast import StrategyName

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
    def name(self) -> StrategyName:
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


def plan_with_leaves(
    strategy: Strategy, members: Sequence[str], leaves: Collection[str], n_chunks: int
) -> Plan:
    """The plan of one version when some members may no longer relay (``leaves``: the publisher demoted
    them after stall reports, ``publisher.py``): ``strategy`` plans over the other members, in their
    order, and every leaf pulls every chunk straight from the learner. Nobody pulls from a leaf, so a
    leaf's chunks cost the learner G each instead of costing its peers a stall."""
    relays = [w for w in members if w not in leaves]
    plan = strategy.plan(relays, n_chunks) if relays else {}
    every = (Assignment(LEARNER, tuple(range(n_chunks))),)
    return {w: plan.get(w, every) for w in members}
