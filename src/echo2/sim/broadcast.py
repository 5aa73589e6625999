"""Bandwidth model of the three broadcast strategies for the simulator (SPEC section 4).

Given the snapshot size, the learner uplink ``B0`` and each receiving worker's link ``B_i`` (both
directions), each function returns, per worker, the seconds from publication until that worker
holds the full snapshot (reload not included; the engine adds it). Models:

- Star-Unlimited: worker i downloads at its own link: ``t_i = G / B_i``.
- Star-Limited: N concurrent downloads share ``B0`` by max-min fairness (water-filling with caps
  ``B_i``); solved exactly phase by phase (a phase ends when a download completes). Homogeneous:
  ``max(G/B_w, N*G/B0)``.
- Tree-Pipelined (ECHO-2): the learner feeds ``k`` chains at ``B0/k`` each; each worker relays
  chunks of ``c`` bytes downstream as they arrive (fan-out 1). Workers are sorted by link speed and
  dealt round-robin over the chains, so the fastest links sit near the heads and the slowest at
  the tails, where they throttle nobody. Along a chain the line rate reaching position j is
  ``r_j = min(B0/k, B_0..B_j)`` (bottleneck so far) and the last chunk arrives at
  ``G/r_j + sum_{h<=j} (c/r_h + hop_latency)`` (pipeline fill, then line rate). ``k`` minimizes
  the mean completion (slow links finish late under any layout; the mean keeps the bulk at line
  rate), searched over 1..min(N, 4*B0/median B_i).
Churn during a broadcast is not modelled (a departing relay's downstream is assumed re-attached at
once), and consecutive broadcasts do not compete for bandwidth.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from echo2.errors import ConfigError


def _check(g_bytes: float, links_bps: Sequence[float]) -> np.ndarray:
    if not (math.isfinite(g_bytes) and g_bytes > 0):
        raise ConfigError(f"snapshot size must be > 0 bytes, got {g_bytes!r}")
    b = np.asarray(links_bps, dtype=float)
    if b.size and (not np.all(np.isfinite(b)) or np.any(b <= 0)):
        raise ConfigError(f"worker links must be > 0 bit/s, got min {b.min()!r}")
    return b


def star_unlimited(g_bytes: float, links_bps: Sequence[float]) -> np.ndarray:
    """Per-worker completion: ``G / B_i``."""
    b = _check(g_bytes, links_bps)
    return g_bytes * 8 / b


def star_limited(g_bytes: float, links_bps: Sequence[float], b0_bps: float) -> np.ndarray:
    """Per-worker completion under max-min fair sharing of ``B0`` with per-flow caps ``B_i``."""
    b = _check(g_bytes, links_bps)
    if not (math.isfinite(b0_bps) and b0_bps > 0):
        raise ConfigError(f"learner uplink b0 must be > 0 bit/s, got {b0_bps!r}")
    n = b.size
    done = np.zeros(n)
    left = np.full(n, g_bytes * 8.0)
    active = np.ones(n, dtype=bool)
    t = 0.0
    while active.any():
        idx = np.flatnonzero(active)
        caps = b[idx]
        order = np.argsort(caps)
        rate = np.empty(idx.size)
        budget, m = float(b0_bps), idx.size
        for pos, o in enumerate(order):  # water-filling: smallest caps saturate first
            share = budget / (m - pos)
            r = min(caps[o], share)
            rate[o] = r
            budget -= r
        dt = np.min(left[idx] / rate)
        t += dt
        left[idx] -= rate * dt
        fin = idx[left[idx] <= 1e-6 * g_bytes]
        done[fin] = t
        active[fin] = False
    return done


def tree_pipelined(
    g_bytes: float,
    links_bps: Sequence[float],
    b0_bps: float,
    chunk_bytes: float = 4 * 2**20,
    hop_latency_s: float = 0.05,
) -> np.ndarray:
    """Per-worker completion for striped store-and-forward chains (see the module docstring)."""
    b = _check(g_bytes, links_bps)
    if not (math.isfinite(b0_bps) and b0_bps > 0):
        raise ConfigError(f"learner uplink b0 must be > 0 bit/s, got {b0_bps!r}")
    n = b.size
    if n == 0:
        return np.zeros(0)
    c_bits = min(chunk_bytes, g_bytes) * 8
    g_bits = g_bytes * 8
    order = np.argsort(-b, kind="stable")
    k_max = min(n, max(1, math.ceil(4 * b0_bps / float(np.median(b)))))
    best_key, best = (math.inf, math.inf), None
    for k in range(1, k_max + 1):
        out = np.empty(n)
        for chain in range(k):
            members = order[chain::k]
            r = np.minimum.accumulate(np.minimum(b[members], b0_bps / k))
            fill = np.cumsum(c_bits / r + hop_latency_s)
            out[members] = g_bits / r + fill - c_bits / r  # last chunk: G/r_j + fill of the earlier hops
        key = (float(out.mean()), float(out.max()))  # the average worker, then the slowest
        if key < best_key:
            best_key, best = key, out
    assert best is not None
    return best


def completion_times(
    strategy: str,
    g_bytes: float,
    links_bps: Sequence[float],
    b0_bps: float,
    chunk_bytes: float = 4 * 2**20,
    hop_latency_s: float = 0.05,
) -> np.ndarray:
    """Dispatch by strategy name; seconds from publication until each worker holds the snapshot."""
    if strategy == "star_unlimited":
        return star_unlimited(g_bytes, links_bps)
    if strategy == "star_limited":
        return star_limited(g_bytes, links_bps, b0_bps)
    if strategy == "tree_pipelined":
        return tree_pipelined(g_bytes, links_bps, b0_bps, chunk_bytes, hop_latency_s)
    raise ConfigError(
        f"broadcast strategy must be star_unlimited, star_limited or tree_pipelined; got {strategy!r}"
    )
