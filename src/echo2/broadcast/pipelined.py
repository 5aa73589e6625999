"""Tree-Pipelined (ECHO-2): striped, chunked store-and-forward trees rooted at the learner (SPEC §4).

Design (see docs/broadcast.md for the derivation). The chunks are dealt round-robin into N stripes, one
per worker; stripe ``s`` is a tree over all N workers whose root is worker ``s``:

    order_s = workers rotated by s
    parent(order_s[0]) = learner,  parent(order_s[j]) = order_s[(j - 1) // d]   (j >= 1)

with fan-out ``d``. Every worker is the root of exactly one stripe and, by rotation, holds every tree
position once, so the learner sends each chunk exactly once (G bytes over B0) and every worker uploads
about (N-1)/N * G over its own B_w. Per link the time is therefore max(G/B0, G/B_w) = T* whenever
B0 >= B_w; what remains is pipeline fill, which grows with the tree depth times the per-hop delay of
one chunk (N * chunk / B_w, because N stripes share each link):

* d = 1 (paper-literal fan-out-1 chains, `RelayChain` with N stripes): depth N, fill ~ N^2 * chunk / B_w;
* d = N - 1 (default, "slice + all-to-all"): depth 2, fill ~ N * chunk * (1/B0 + 1/B_w).

Each relay forwards a chunk as soon as it has verified it (pull streams wait on per-chunk events).

Rate matching: stripe s leaves its root at the rate the root can pass it on, about B_w/N (its uplink
is shared by N-1 children streams of 1/N of G each, over T = G/B_w). Feeding the root faster than
that gains nothing and, while the learner streams, overloads the root's downlink (learner stream +
N-1 peer streams > B_w), which costs TCP losses at small N. So when the publisher knows the link
rates, each learner stream is capped at ``RATE_MATCH * B_w / N`` (and never below B0/N's fair share
when B0 < B_w, where the learner link is the bottleneck anyway).

Predicted times (planner and simulator): :mod:`echo2.physics.broadcast`, whose chain model covers
``relay-chain`` (one chain) and ``tree-chains`` / ``tree-pipelined`` (k striped chains).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from echo2.broadcast.strategy import LEARNER, Assignment, Plan
from echo2.physics.broadcast import StrategyName

RATE_MATCH = 1.1  # learner stripe streams run this much above B_w/N (slack for jitter)


def matched_stream_rate(n: int, b0: float, bw: float) -> float | None:
    """Per-stripe learner stream cap in bytes/s (None when a cap cannot help: N = 1)."""
    if n <= 1:
        return None
    return max(RATE_MATCH * bw / n, b0 / n) if b0 < bw else RATE_MATCH * bw / n


def striped_tree_plan(
    workers: Sequence[str], n_chunks: int, fanout: int, n_stripes: int | None = None
) -> Plan:
    """Plan for N rotated d-ary stripe trees (``fanout`` d >= 1; d >= N-1 means depth 2)."""
    n = len(workers)
    if n == 0:
        return {}
    d = max(1, min(fanout, n - 1)) if n > 1 else 1
    k = n if n_stripes is None else max(1, min(n_stripes, n))
    pulls: dict[str, dict[str, list[int]]] = {w: {} for w in workers}
    for s in range(k):
        order = list(workers[s:]) + list(workers[:s])
        stripe = list(range(s, n_chunks, k))
        if not stripe:
            continue
        for j, w in enumerate(order):
            src = LEARNER if j == 0 else order[(j - 1) // d]
            pulls[w].setdefault(src, []).extend(stripe)
    plan: Plan = {}
    for w in workers:
        items = sorted(pulls[w].items(), key=lambda kv: (kv[0] != LEARNER, kv[0]))
        plan[w] = tuple(Assignment(src, tuple(sorted(ch))) for src, ch in items)
    return plan


@dataclass(frozen=True)
class TreePipelined:
    """ECHO-2 peer-assisted pipelined broadcast; ``fanout=0`` means N-1 (depth-2 trees, the default)."""

    name: StrategyName = "tree-pipelined"  # registry key
    learner_uplink_capped: bool = True  # the learner uplink is capped at B0 on the harness
    fanout: int = 0  # children per relay in each stripe tree; 0 = all other workers, 1 = chains

    def plan(self, workers: Sequence[str], n_chunks: int) -> Plan:
        d = self.fanout if self.fanout > 0 else max(1, len(workers) - 1)
        return striped_tree_plan(workers, n_chunks, d)

    def learner_stream_rate(self, n: int, b0: float, bw: float) -> float | None:
        return matched_stream_rate(n, b0, bw)


@dataclass(frozen=True)
class RelayChain:
    """One fan-out-1 chain learner -> w0 -> w1 -> ... (no striping): the relay-throughput probe."""

    name: StrategyName = "relay-chain"  # registry key
    learner_uplink_capped: bool = True  # the learner uplink is capped at B0 on the harness

    def plan(self, workers: Sequence[str], n_chunks: int) -> Plan:
        return striped_tree_plan(workers, n_chunks, fanout=1, n_stripes=1)

    def learner_stream_rate(self, n: int, b0: float, bw: float) -> float | None:
        return None  # one stripe: the learner feeds the chain head at whatever the chain takes


@dataclass(frozen=True)
class TreeChains:
    """Tree-Pipelined with fan-out-1 stripe chains (the paper-literal variant; one in + one out per link)."""

    name: StrategyName = "tree-chains"  # registry key
    learner_uplink_capped: bool = True  # the learner uplink is capped at B0 on the harness

    def plan(self, workers: Sequence[str], n_chunks: int) -> Plan:
        return striped_tree_plan(workers, n_chunks, fanout=1)

    def learner_stream_rate(self, n: int, b0: float, bw: float) -> float | None:
        return matched_stream_rate(n, b0, bw)
