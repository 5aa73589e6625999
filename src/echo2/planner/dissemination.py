"""Analytic broadcast-time estimates for the three strategies of SPEC section 4 (pure, no I/O).

Units: snapshot size ``G`` in bytes, links in bits/s, times in seconds. ``B0`` is the learner's
uplink, ``B_w`` one worker's link (both directions), ``N`` the number of workers. Every estimate is
the time until the last worker holds the full snapshot, plus ``reload_s`` (SPEC: T_bcast includes
reload). These are the planner's estimates; the simulator computes per-worker install times for
heterogeneous links with its own model (``echo2.sim.broadcast``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from echo2.errors import ConfigError
from echo2.planner.capacity import require_positive

STRATEGIES = ("star_unlimited", "star_limited", "tree_pipelined")


def _workers(n: int) -> int:
    if int(n) != n or n < 1:
        raise ConfigError(f"number of workers must be an integer >= 1, got {n!r}")
    return int(n)


def lower_bound(*, g_bytes: float, b0_bps: float, bw_bps: float, n: int) -> float:
    """Physical lower bound ``T* = max(G/B_w, G/B0, N*G/(B0 + N*B_w))`` (no reload)."""
    g = require_positive("snapshot_bytes", g_bytes) * 8
    b0 = require_positive("b0_bps", b0_bps)
    bw = require_positive("bw_bps", bw_bps)
    n = _workers(n)
    return max(g / bw, g / b0, n * g / (b0 + n * bw))


def star_unlimited(*, g_bytes: float, bw_bps: float, reload_s: float = 0.0) -> float:
    """Star with an uncapped learner uplink: every worker downloads at its own link, ``G/B_w``."""
    return require_positive("snapshot_bytes", g_bytes) * 8 / require_positive("bw_bps", bw_bps) + reload_s


def star_limited(*, g_bytes: float, b0_bps: float, bw_bps: float, n: int, reload_s: float = 0.0) -> float:
    """Star through the capped uplink: ``max(G/B_w, N*G/B0)`` (fair sharing; linear in N once N*B_w > B0)."""
    g = require_positive("snapshot_bytes", g_bytes) * 8
    b0 = require_positive("b0_bps", b0_bps)
    bw = require_positive("bw_bps", bw_bps)
    return max(g / bw, _workers(n) * g / b0) + reload_s


@dataclass(frozen=True)
class TreePlan:
    """The chain layout chosen for Tree-Pipelined and its predicted time."""

    chains: int  # k: parallel chains ("stripes") the learner's uplink feeds, B0/k each
    depth: int  # workers in the longest chain, ceil(N/k)
    rate_bps: float  # line rate of every chain, min(B_w, B0/k)
    seconds: float  # time until the last worker holds the snapshot, reload included


def tree_pipelined(
    *,
    g_bytes: float,
    b0_bps: float,
    bw_bps: float,
    n: int,
    chunk_bytes: float = 4 * 2**20,
    hop_latency_s: float = 0.05,
    reload_s: float = 0.0,
) -> TreePlan:
    """Tree-Pipelined: the learner feeds ``k`` chains at ``B0/k`` each; workers relay chunk by chunk.

    With ``m = ceil(G/c)`` chunks of ``c`` bytes, chain rate ``r = min(B_w, B0/k)`` and depth
    ``L = ceil(N/k)``, store-and-forward per chunk delivers the last chunk to the chain's tail at
    ``T(k) = (m + L - 1) * c / r + L * hop_latency`` (pipeline fill, then line rate). We pick the
    ``k`` in 1..min(N, 4*B0/B_w) minimizing ``T(k)``; with ``B0 >= B_w`` this is about
    ``k = B0/B_w`` chains and
    ``T = G/B_w * (1 + (L-1)/m)``, within a few percent of ``T*`` for m >> L.
    """
    g = require_positive("snapshot_bytes", g_bytes)
    b0 = require_positive("b0_bps", b0_bps)
    bw = require_positive("bw_bps", bw_bps)
    c = min(require_positive("chunk_bytes", chunk_bytes), g)
    n = _workers(n)
    m = math.ceil(g / c)
    best: TreePlan | None = None
    k_max = min(n, max(1, math.ceil(4 * b0 / bw)))  # past ~B0/B_w chains each extra one only slows
    for k in range(1, k_max + 1):
        rate = min(bw, b0 / k)
        depth = math.ceil(n / k)
        t = (m + depth - 1) * c * 8 / rate + depth * hop_latency_s
        if best is None or t < best.seconds:
            best = TreePlan(chains=k, depth=depth, rate_bps=rate, seconds=t)
    assert best is not None
    return TreePlan(best.chains, best.depth, best.rate_bps, best.seconds + reload_s)


def estimate_all(
    *,
    g_bytes: float,
    b0_bps: float,
    bw_bps: float,
    n: int,
    reload_s: float = 0.0,
    chunk_bytes: float = 4 * 2**20,
    hop_latency_s: float = 0.05,
) -> dict[str, float]:
    """T_bcast estimate (seconds, reload included) for each strategy plus the lower bound ``T*``."""
    return {
        "star_unlimited": star_unlimited(g_bytes=g_bytes, bw_bps=bw_bps, reload_s=reload_s),
        "star_limited": star_limited(g_bytes=g_bytes, b0_bps=b0_bps, bw_bps=bw_bps, n=n, reload_s=reload_s),
        "tree_pipelined": tree_pipelined(
            g_bytes=g_bytes,
            b0_bps=b0_bps,
            bw_bps=bw_bps,
            n=n,
            chunk_bytes=chunk_bytes,
            hop_latency_s=hop_latency_s,
            reload_s=reload_s,
        ).seconds,
        "lower_bound": lower_bound(g_bytes=g_bytes, b0_bps=b0_bps, bw_bps=bw_bps, n=n) + reload_s,
    }
