"""Dissemination times of the broadcast strategies and the lower bound ``T*`` (SPEC §4), defined once.

The planner (homogeneous estimates), the simulator (per-worker times on heterogeneous links) and the
runtime's benchmarks all call these functions. One unit system: sizes in **bytes**, rates in
**bytes/s**, times in **seconds**; configs give links in Mbit/s, converted with
:func:`mbps_to_bytes_per_s`.

Symbols: ``G`` snapshot bytes, ``B0`` the learner's uplink, ``B_i`` worker i's link (both directions),
``B_w`` one link when all are equal, ``N`` workers, ``c`` relay chunk bytes, ``h`` per-hop latency.

- Lower bound (any scheme): ``T* = max(G/B_w, G/B0, N*G/(B0 + N*B_w))``.
- ``star-unlimited``: worker i downloads at its own link: ``t_i = G/B_i``.
- ``star-limited``: N concurrent downloads share ``B0`` max-min fairly (water-filling with per-flow caps
  ``B_i``), solved exactly phase by phase; homogeneous: ``max(G/B_w, N*G/B0)``.
- ``tree-pipelined`` / ``tree-chains``: the learner feeds ``k`` fan-out-1 chains ("stripes") at ``B0/k``
  each; every worker relays chunks downstream as they arrive. Workers are sorted by link (fastest
  first) and dealt round-robin over the chains, so slow links sit at the tails, where they throttle
  nobody. Position j of a chain runs at ``r_j = min(B0/k, B_0, ..., B_j)`` and holds the snapshot at
  ``t_j = G/r_j + sum_{h<=j} (c/r_h + h) - c/r_j`` (pipeline fill, then line rate). ``k`` is the one
  in ``1..min(N, ceil(4*B0/median B_i))`` with the smallest (mean, max) completion: slow links finish
  late under any layout, the mean keeps the bulk at line rate. Homogeneous links: chain depth
  ``L = ceil(N/k)``, ``r = min(B_w, B0/k)`` and the last worker finishes at
  ``G/r + (L - 1)*c/r + L*h`` (= ``(m + L - 1)*c/r + L*h`` with ``m = G/c`` chunks).
- ``relay-chain``: the same chain model with ``k = 1``: ``G/B_w + (N - 1)*c/B_w + N*h`` homogeneous.

The runtime's ``tree-pipelined`` default relays through depth-2 striped trees rather than chains
(``echo2.broadcast.pipelined``); its per-link load is the same, and the chain model is its estimate.
Churn during a broadcast and competition between consecutive broadcasts are not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, cast, get_args

import numpy as np
import numpy.typing as npt

from echo2.errors import ConfigError

StrategyName = Literal["star-unlimited", "star-limited", "tree-pipelined", "relay-chain", "tree-chains"]
STRATEGY_NAMES: tuple[StrategyName, ...] = get_args(StrategyName)

DEFAULT_CHUNK_BYTES = 4 * 2**20  # relay chunk of the chain model (4 MiB)
ANNOUNCE_BYTES_PER_CHUNK = 26  # what a chunk adds to each announcement: its 16-byte digest (base64), index
MIN_AUTO_CHUNK_BYTES = 4 << 10  # below this, per-chunk frames and hashing cost more than they save
MAX_AUTO_CHUNK_BYTES = 1 << 20
DEFAULT_HOP_LATENCY_S = 0.05  # per-hop WAN latency of the chain model

Times = npt.NDArray[np.float64]  # seconds per worker, in the order of the links given


def strategy_name(name: str) -> StrategyName:
    """``name`` as a :data:`StrategyName`; ConfigError listing the choices otherwise."""
    if name not in STRATEGY_NAMES:
        raise ConfigError(f"unknown broadcast strategy {name!r}; choose one of {', '.join(STRATEGY_NAMES)}")
    return cast(StrategyName, name)


def mbps_to_bytes_per_s(mbps: float) -> float:
    """A config's link in Mbit/s (10^6 bit/s) as bytes/s: ``mbps * 10^6 / 8``."""
    return float(mbps) * 1e6 / 8.0


def _positive(name: str, value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _links(links: Sequence[float] | npt.ArrayLike) -> Times:
    b = np.asarray(links, dtype=float).reshape(-1)
    if b.size and (not np.all(np.isfinite(b)) or np.any(b <= 0)):
        raise ConfigError(f"worker links must be finite and > 0 bytes/s, got min {b.min()!r}")
    return b


def _workers(n: int) -> int:
    if int(n) != n or n < 1:
        raise ConfigError(f"number of workers must be an integer >= 1, got {n!r}")
    return int(n)


def lower_bound(g_bytes: float, b0: float, bw: float, n: int) -> float:
    """Physical lower bound ``T* = max(G/B_w, G/B0, N*G/(B0 + N*B_w))`` seconds (no reload).

    Every worker must receive G over its own link; the learner must send G at least once; and the N*G
    bytes delivered in total enter through the learner's uplink plus the N workers' uplinks.
    """
    g = _positive("snapshot size (bytes)", g_bytes)
    b0 = _positive("learner uplink b0 (bytes/s)", b0)
    bw = _positive("worker link bw (bytes/s)", bw)
    n = _workers(n)
    return max(g / bw, g / b0, n * g / (b0 + n * bw))


def relay_chunk_bytes(
    g_bytes: float,
    ratio: float = 1.0,
    announce_bytes: float = ANNOUNCE_BYTES_PER_CHUNK,
    lo: int = MIN_AUTO_CHUNK_BYTES,
    hi: int = MAX_AUTO_CHUNK_BYTES,
) -> int:
    """The chunk size for a snapshot of ``G`` bytes that minimises what the depth-2 striped broadcast
    (``tree-pipelined``) spends beyond the link time, with ``ratio = B0/B_w``.

    Two costs grow with N, in opposite directions of the chunk size ``c``: the pipeline fill, one chunk
    time of each of the N streams sharing a link at each of the two hops, ``N*c*(1/B0 + 1/B_w)``; and
    the announcements, which carry ``a`` bytes per chunk to each of the N workers over the learner's
    uplink, ``N*(G/c)*a/B0``. Their sum is smallest at ``c* = sqrt(G*a/(1 + B0/B_w))``, for every N and
    link speed; e.g. 3.2 KB for a 1.55 MB patch at ``B0/B_w = 3`` (so the 4 KiB floor), 7.2 KB for
    8 MB, 0.32 MB for a 16 GB anchor. Clamped to ``[lo, hi]`` and rounded down to a whole KiB."""
    g = _positive("snapshot size (bytes)", max(g_bytes, 1.0))
    c = math.sqrt(
        g * _positive("announce bytes per chunk", announce_bytes) / (1.0 + _positive("B0/B_w", ratio))
    )
    return int(min(max(c, lo), hi)) >> 10 << 10


def star_unlimited_times(g_bytes: float, links: Sequence[float] | npt.ArrayLike) -> Times:
    """Star-Unlimited, per worker: ``t_i = G/B_i``."""
    g = _positive("snapshot size (bytes)", g_bytes)
    return g / _links(links)


def star_limited_times(g_bytes: float, links: Sequence[float] | npt.ArrayLike, b0: float) -> Times:
    """Star-Limited, per worker: N flows share ``B0`` max-min fairly, flow i capped at ``B_i``.

    Water-filling per phase: the smallest caps saturate first, the rest split what is left equally;
    a phase ends when a download completes. Homogeneous links: ``max(G/B_w, N*G/B0)``.
    """
    g = _positive("snapshot size (bytes)", g_bytes)
    b0 = _positive("learner uplink b0 (bytes/s)", b0)
    b = _links(links)
    n = b.size
    done = np.zeros(n)
    left = np.full(n, g)
    active = np.ones(n, dtype=bool)
    t = 0.0
    while active.any():
        idx = np.flatnonzero(active)
        caps = b[idx]
        rate = np.empty(idx.size)
        budget, m = b0, idx.size
        for pos, o in enumerate(np.argsort(caps)):
            r = min(float(caps[o]), budget / (m - pos))
            rate[o] = r
            budget -= r
        dt = float(np.min(left[idx] / rate))
        t += dt
        left[idx] -= rate * dt
        fin = idx[left[idx] <= 1.25e-7 * g]  # done up to float noise
        done[fin] = t
        active[fin] = False
    return done


def chain_times(
    g_bytes: float,
    links: Sequence[float] | npt.ArrayLike,
    b0: float,
    stripes: int,
    chunk_bytes: float = DEFAULT_CHUNK_BYTES,
    hop_latency_s: float = DEFAULT_HOP_LATENCY_S,
) -> Times:
    """Per-worker times for ``stripes`` = k fan-out-1 store-and-forward chains fed at ``B0/k`` each.

    Workers sorted by link (fastest first, stable) are dealt round-robin over the k chains. Position j
    of a chain runs at ``r_j = min(B0/k, B_0..B_j)`` and finishes at
    ``t_j = G/r_j + sum_{h<=j} (c/r_h + hop_latency) - c/r_j`` with ``c = min(chunk, G)``.
    """
    g = _positive("snapshot size (bytes)", g_bytes)
    b0 = _positive("learner uplink b0 (bytes/s)", b0)
    c = min(_positive("chunk size (bytes)", chunk_bytes), g)
    if not (math.isfinite(hop_latency_s) and hop_latency_s >= 0):
        raise ConfigError(f"hop latency must be a finite number >= 0 s, got {hop_latency_s!r}")
    b = _links(links)
    n = b.size
    if int(stripes) != stripes or stripes < 1:
        raise ConfigError(f"stripes (chains) must be an integer >= 1, got {stripes!r}")
    k = min(int(stripes), max(1, n))
    out = np.zeros(n)
    order = np.argsort(-b, kind="stable")
    for chain in range(k):
        members = order[chain::k]
        r = np.minimum.accumulate(np.minimum(b[members], b0 / k))
        fill = np.cumsum(c / r + hop_latency_s)
        out[members] = g / r + fill - c / r
    return out


def _best_chains(
    g_bytes: float, links: Times, b0: float, chunk_bytes: float, hop_latency_s: float
) -> tuple[int, Times]:
    n = links.size
    if n == 0:
        return 1, np.zeros(0)
    k_max = min(n, max(1, math.ceil(4 * b0 / float(np.median(links)))))
    best_key, best_k, best = (math.inf, math.inf), 1, np.zeros(0)
    for k in range(1, k_max + 1):  # past ~B0/B_w chains every extra one only slows them all
        t = chain_times(g_bytes, links, b0, k, chunk_bytes, hop_latency_s)
        key = (float(t.mean()), float(t.max()))  # the average worker, then the slowest
        if key < best_key:
            best_key, best_k, best = key, k, t
    return best_k, best


def tree_stripes(
    g_bytes: float,
    links: Sequence[float] | npt.ArrayLike,
    b0: float,
    chunk_bytes: float = DEFAULT_CHUNK_BYTES,
    hop_latency_s: float = DEFAULT_HOP_LATENCY_S,
) -> int:
    """The one k-selection rule: the chain count with the smallest (mean, max) completion time."""
    return _best_chains(g_bytes, _links(links), b0, chunk_bytes, hop_latency_s)[0]


def tree_pipelined_times(
    g_bytes: float,
    links: Sequence[float] | npt.ArrayLike,
    b0: float,
    chunk_bytes: float = DEFAULT_CHUNK_BYTES,
    hop_latency_s: float = DEFAULT_HOP_LATENCY_S,
) -> Times:
    """Tree-Pipelined (and tree-chains), per worker: :func:`chain_times` at k = :func:`tree_stripes`."""
    return _best_chains(g_bytes, _links(links), b0, chunk_bytes, hop_latency_s)[1]


def completion_times(
    strategy: str,
    g_bytes: float,
    links: Sequence[float] | npt.ArrayLike,
    b0: float,
    chunk_bytes: float = DEFAULT_CHUNK_BYTES,
    hop_latency_s: float = DEFAULT_HOP_LATENCY_S,
) -> Times:
    """Seconds from publication until each worker holds the snapshot (reload not included)."""
    name = strategy_name(strategy)
    if name == "star-unlimited":
        return star_unlimited_times(g_bytes, links)
    if name == "star-limited":
        return star_limited_times(g_bytes, links, b0)
    if name == "relay-chain":
        return chain_times(g_bytes, links, b0, 1, chunk_bytes, hop_latency_s)
    return tree_pipelined_times(g_bytes, links, b0, chunk_bytes, hop_latency_s)  # tree-pipelined, -chains


def homogeneous_time(
    strategy: str,
    g_bytes: float,
    b0: float,
    bw: float,
    n: int,
    chunk_bytes: float = DEFAULT_CHUNK_BYTES,
    hop_latency_s: float = DEFAULT_HOP_LATENCY_S,
    reload_s: float = 0.0,
) -> float:
    """``T_bcast`` of N equal links: the last worker's :func:`completion_times` plus ``reload_s``.

    Closed forms: star-unlimited ``G/B_w``; star-limited ``max(G/B_w, N*G/B0)``; chains
    ``G/r + (L - 1)*c/r + L*hop`` with ``r = min(B_w, B0/k)``, ``L = ceil(N/k)``.
    """
    links = np.full(_workers(n), _positive("worker link bw (bytes/s)", bw))
    return float(completion_times(strategy, g_bytes, links, b0, chunk_bytes, hop_latency_s).max()) + reload_s


def estimates(
    g_bytes: float,
    b0: float,
    bw: float,
    n: int,
    chunk_bytes: float = DEFAULT_CHUNK_BYTES,
    hop_latency_s: float = DEFAULT_HOP_LATENCY_S,
    reload_s: float = 0.0,
    strategies: Sequence[StrategyName] = STRATEGY_NAMES,
) -> dict[str, float]:
    """:func:`homogeneous_time` of each strategy, plus ``"lower_bound"`` = ``T* + reload_s``."""
    out: dict[str, float] = {
        s: homogeneous_time(s, g_bytes, b0, bw, n, chunk_bytes, hop_latency_s, reload_s) for s in strategies
    }
    out["lower_bound"] = lower_bound(g_bytes, b0, bw, n) + reload_s
    return out
