"""Star strategies: every worker pulls every chunk straight from the learner (SPEC §4).

Star-Unlimited and Star-Limited share the plan; they differ only in whether the learner uplink is
capped at B0 on the harness (Star-Unlimited is the ideal reference, Star-Limited the naive baseline).
Their predicted times are ``star_unlimited_times`` / ``star_limited_times`` in
:mod:`echo2.physics.broadcast`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from echo2.broadcast.strategy import LEARNER, Assignment, Plan
from echo2.physics.broadcast import StrategyName


def star_plan(workers: Sequence[str], n_chunks: int) -> Plan:
    every = tuple(range(n_chunks))
    return {w: (Assignment(LEARNER, every),) for w in workers}


@dataclass(frozen=True)
class StarUnlimited:
    """Push to all with the learner uplink uncapped: T = G/B_w."""

    name: StrategyName = "star-unlimited"  # registry key
    learner_uplink_capped: bool = False  # the harness leaves the learner uplink unshaped

    def plan(self, workers: Sequence[str], n_chunks: int) -> Plan:
        return star_plan(workers, n_chunks)

    def learner_stream_rate(self, n: int, b0: float, bw: float) -> float | None:
        return None


@dataclass(frozen=True)
class StarLimited:
    """Push to all through the capped uplink B0: T = max(G/B_w, N*G/B0), linear in N."""

    name: StrategyName = "star-limited"  # registry key
    learner_uplink_capped: bool = True  # the harness caps the learner uplink at B0

    def plan(self, workers: Sequence[str], n_chunks: int) -> Plan:
        return star_plan(workers, n_chunks)

    def learner_stream_rate(self, n: int, b0: float, bw: float) -> float | None:
        return None
