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
- ``tree-pipelined``: **striped relay trees of bounded degree** (:func:`relay_layout`, which the
  runtime's plan, ``echo2.broadcast.pipelined``, builds too). The chunks are dealt round-robin into
  ``k`` stripes; stripe s is a tree over all N workers whose root the learner feeds at ``B0/k``. Each
  stripe runs at ``r = min(B0, B_ref)/k`` (``B_ref`` the median link); a worker serves as many
  children as its uplink carries at r, ``floor(B_i/r)``, capped so that it holds at most
  ``max_peers`` relay connections (k parents + its children). Every worker relays in about one stripe
  (its *home* stripe: relays dealt fastest first over the stripes) and is a leaf in the others, so
  the learner sends G once and each link carries about G each way. A stripe's tree is laid out
  breadth first: home relays fastest first, then the other workers fastest first, so slow links sit
  at the leaves. Depth ``D ~ log_d N`` with ``d ~ k`` children per relay. Worker j of stripe s gets
  the stripe at ``r_j = min(B0/k, B_j/k, parent's uplink / its children, r_parent)`` and holds it at
  ``t_j = G_s/r_j + sum_{hops} (c_s/r_h + h) - c_s/r_j`` (``G_s`` the stripe's bytes, ``c_s`` its
  chunk); a worker is done when its last stripe is. ``k`` (:func:`relay_stripes`) is the largest
  ``<= min(N, max_peers // 2)`` whose relays' capacity covers every stripe. Homogeneous links:
  ``k = min(N, max_peers // 2)``, ``d = k``, and the last worker finishes at
  ``G/B_w + (D - 1)*k*c/B_w + D*h`` with D the hops of a complete k-ary tree of N nodes.
- ``tree-chains``: the learner feeds ``k`` fan-out-1 chains at ``B0/k`` each; every worker relays
  chunks downstream as they arrive. Workers sorted by link (fastest first) are dealt round-robin over
  the chains. Position j of a chain runs at ``r_j = min(B0/k, B_0, ..., B_j)`` and holds the snapshot
  at ``t_j = G/r_j + sum_{h<=j} (c/r_h + h) - c/r_j``. ``k`` is the one in
  ``1..min(N, ceil(4*B0/median B_i))`` with the smallest (mean, max) completion. Homogeneous links:
  ``L = ceil(N/k)``, ``r = min(B_w, B0/k)``: ``G/r + (L - 1)*c/r + L*h``; linear in N.
- ``relay-chain``: the chain model with ``k = 1``: ``G/B_w + (N - 1)*c/B_w + N*h`` homogeneous.

Churn during a broadcast and competition between consecutive broadcasts are not modelled here (the
runtime's ``RelayTree`` repairs a departed relay's subtrees from its ancestors between versions).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
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


def _hop_latency(seconds: float) -> float:
    """A per-hop latency, checked: finite and >= 0 s (the chain and relay-tree models share it)."""
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ConfigError(f"hop latency must be a finite number >= 0 s, got {seconds!r}")
    return seconds


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
        srt = np.argsort(caps, kind="stable")
        cs = caps[srt]
        m = idx.size
        # in ascending caps, flow p keeps its cap while cap_p <= (B0 - sum of smaller caps)/(m - p); from
        # the first one that does not, every flow gets that same fair share
        share = (b0 - np.concatenate(([0.0], np.cumsum(cs)[:-1]))) / (m - np.arange(m))
        free = np.flatnonzero(cs > share)
        rate_sorted = cs.copy()
        if free.size:
            rate_sorted[free[0] :] = share[free[0]]
        rate = np.empty(m)
        rate[srt] = rate_sorted
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
    _hop_latency(hop_latency_s)
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


def best_chain_count(
    g_bytes: float,
    links: Sequence[float] | npt.ArrayLike,
    b0: float,
    chunk_bytes: float = DEFAULT_CHUNK_BYTES,
    hop_latency_s: float = DEFAULT_HOP_LATENCY_S,
) -> int:
    """``tree-chains``' one k-selection rule: the chain count with the smallest (mean, max) completion."""
    return _best_chains(g_bytes, _links(links), b0, chunk_bytes, hop_latency_s)[0]


def tree_chains_times(
    g_bytes: float,
    links: Sequence[float] | npt.ArrayLike,
    b0: float,
    chunk_bytes: float = DEFAULT_CHUNK_BYTES,
    hop_latency_s: float = DEFAULT_HOP_LATENCY_S,
) -> Times:
    """``tree-chains``, per worker: :func:`chain_times` at k = :func:`best_chain_count`."""
    return _best_chains(g_bytes, _links(links), b0, chunk_bytes, hop_latency_s)[1]


# ---- tree-pipelined: striped relay trees of bounded degree ---------------------------------------------


@dataclass(frozen=True)
class RelayLayout:
    """Striped relay trees over N workers (indices 0..N-1 in the order of the links given).

    ``parent[s, i]`` is worker i's source for stripe s (``LEARNER_INDEX`` = -1: the learner); stripe s
    carries chunks ``s, s + k, s + 2k, ...``. ``order[s]`` lists stripe s breadth first (a parent always
    precedes its children), ``level_ends[s]`` the end positions of its levels (level 0 = the root).
    """

    stripes: int  # k
    stripe_rate: float  # r = min(B0, B_ref)/k, bytes/s: the rate a relay's capacity is counted in
    max_peers: int  # the degree cap: relay connections one worker holds (parents + children)
    home: npt.NDArray[np.int64]  # (N,) the stripe a worker relays in (-1: a leaf in every stripe)
    capacity: npt.NDArray[np.int64]  # (N,) children a worker may serve: min(floor(B_i/r), cap - k)
    parent: npt.NDArray[np.int64]  # (k, N) source per stripe; -1 = the learner
    order: npt.NDArray[np.int64]  # (k, N) breadth-first order of each stripe's tree
    level_ends: tuple[tuple[int, ...], ...]  # per stripe: exclusive end position of each level

    @property
    def n(self) -> int:
        return int(self.parent.shape[1])

    def children(self) -> npt.NDArray[np.int64]:
        """(N,) children each worker serves over all stripes (its uplink streams)."""
        p = self.parent[self.parent >= 0]
        return np.bincount(p, minlength=self.n).astype(np.int64)

    def degree(self) -> npt.NDArray[np.int64]:
        """(N,) relay connections per worker: distinct peer parents + distinct children (the learner's
        streams are not counted: they are the control plane's)."""
        n = self.n
        child = np.broadcast_to(np.arange(n), self.parent.shape)
        peer = self.parent >= 0
        edges = np.unique(self.parent[peer] * n + child[peer])  # distinct (parent, child) pairs
        return np.bincount(edges // n, minlength=n) + np.bincount(edges % n, minlength=n)

    def depth(self) -> int:
        """Hops from the learner to the deepest worker (1 = the stripe roots)."""
        return max(len(e) for e in self.level_ends) if self.level_ends else 0


LEARNER_INDEX = -1  # RelayLayout.parent value naming the learner
DEFAULT_MAX_PEERS = 16  # relay connections per worker in tree-pipelined: k parents + up to 16 - k children


def _max_peers(max_peers: int) -> int:
    if int(max_peers) != max_peers or max_peers < 2:
        raise ConfigError(
            f"max_peers (relay connections per worker) must be an integer >= 2, got {max_peers!r}"
        )
    return int(max_peers)


def _relay_capacity(
    b: Times, b0: float, k: int, max_peers: int, inflate: bool = True
) -> tuple[float, npt.NDArray[np.int64]]:
    """Stripe rate ``r = min(B0, median B_i)/k`` and each worker's child capacity at k stripes.

    A worker that takes all k stripes at r (``B_i >= k*r``) may serve ``floor(B_i/r)`` children, at most
    ``max_peers - k``. When those slots fall short of the ``k*(N - 1)`` tree edges (slow links that
    cannot relay), they are scaled up by the shortfall, still within ``max_peers - k``: each child then
    gets less than r, and the times say so. A slower worker keeps ``floor(B_i/r)`` (used only if the
    fast ones still fall short)."""
    n = b.size
    r = min(b0, float(np.median(b))) / k
    room = max(0, max_peers - k)
    base = np.floor(b / r * (1 + 1e-9))
    strong = b >= k * r * (1 - 1e-9)
    fair = np.minimum(base, room)
    need = k * (n - 1)
    have = float(fair[strong].sum())
    if inflate and 0 < have < need:
        fair = np.where(strong, np.minimum(np.ceil(base * need / have), room), fair)
    return r, fair.astype(np.int64)


def relay_stripes(
    links: Sequence[float] | npt.ArrayLike, b0: float, max_peers: int = DEFAULT_MAX_PEERS
) -> int:
    """The stripe count k of ``tree-pipelined``: the largest ``k <= min(N, max_peers // 2)`` whose workers'
    bandwidth-fair child capacity (``floor(B_i/r)`` within the degree cap) covers the ``k*(N - 1)`` tree
    edges; if no k >= 2 does (too many links too slow to relay), the largest whose scaled-up capacity
    does (:func:`_relay_capacity`); else 1 (a chain). Homogeneous links: ``min(N, max_peers // 2)``."""
    b = _links(links)
    b0 = _positive("learner uplink b0 (bytes/s)", b0)
    cap_peers = _max_peers(max_peers)
    n = b.size
    if n <= 1:
        return 1
    for inflate in (False, True):
        for k in range(min(n, cap_peers // 2), 1, -1):
            _r, cap = _relay_capacity(b, b0, k, cap_peers, inflate)
            if int(cap.sum()) >= k * (n - 1):
                return k
    return 1


def relay_layout(
    links: Sequence[float] | npt.ArrayLike,
    b0: float,
    max_peers: int = DEFAULT_MAX_PEERS,
    stripes: int | None = None,
) -> RelayLayout:
    """The striped relay trees of ``tree-pipelined`` for workers with these links (module docstring).

    1. k = :func:`relay_stripes` (or ``stripes``), r = min(B0, median B_i)/k, capacity
       ``c_i = min(floor(B_i/r), max_peers - k)``.
    2. Relays: the workers that can take all k stripes at r (``B_i >= k*r``), plus, while their capacity
       falls short of the k*(N-1) edges, the next fastest; dealt fastest first over the stripes in a
       snake (0..k-1, k-1..0, ...) so every stripe gets about the same capacity. That stripe is their home.
    3. Stripe s, breadth first: its home relays (fastest first), then every other worker (fastest first).
       Position j >= 1 hangs under the first relay with a free slot (cumulative capacity); positions no
       home relay can take (capacity short by rounding) go to workers with spare capacity elsewhere, and
       only then to the learner.
    """
    b = _links(links)
    b0 = _positive("learner uplink b0 (bytes/s)", b0)
    cap_peers = _max_peers(max_peers)
    n = b.size
    if n == 0:
        raise ConfigError("a relay layout needs at least one worker")
    k = relay_stripes(b, b0, cap_peers) if stripes is None else max(1, min(int(stripes), n))
    r, cap = _relay_capacity(b, b0, k, cap_peers, inflate=False)
    if int(cap.sum()) < k * (n - 1):
        r, cap = _relay_capacity(b, b0, k, cap_peers)
    if k == 1:  # one stripe: a chain (every worker serves the next), the capacity rule does not apply
        cap = np.ones(n, dtype=np.int64)
    by_speed = np.argsort(-b, kind="stable")
    # 2. relays and their home stripes
    strong = b[by_speed] >= k * r * (1 - 1e-9)
    cum = np.cumsum(cap[by_speed])
    need = k * (n - 1)
    n_relays = int(strong.sum())
    if n_relays == 0 or cum[n_relays - 1] < need:
        n_relays = min(n, int(np.searchsorted(cum, need)) + 1)
    n_relays = max(n_relays, min(n, k))  # at least one relay (the root) per stripe
    relays = by_speed[:n_relays]
    relays = relays[cap[relays] > 0] if n > 1 else relays
    lap = np.arange(relays.size) % (2 * k)
    home_of = np.where(lap < k, lap, 2 * k - 1 - lap)
    home = np.full(n, -1, dtype=np.int64)
    home[relays] = home_of
    # 3. each stripe breadth first
    parent = np.full((k, n), LEARNER_INDEX, dtype=np.int64)
    order = np.empty((k, n), dtype=np.int64)
    used = np.zeros(n, dtype=np.int64)
    ends: list[tuple[int, ...]] = []
    orphans: list[tuple[int, int]] = []  # (stripe, position) no home relay could take
    for s in range(k):
        is_home = home[by_speed] == s
        o = np.concatenate([by_speed[is_home], by_speed[~is_home]])
        order[s] = o
        m = int(is_home.sum())
        if m == 0:  # no relay of its own (N < k cannot happen; a degenerate mix): its root is the fastest
            m = 1
        slots = np.cumsum(cap[o[:m]])
        pos = np.arange(1, n)
        holder = np.searchsorted(slots, pos, side="left")  # first relay with a free slot for position j
        ok = holder < m
        parent[s, o[1:][ok]] = o[holder[ok]]
        used += np.bincount(o[holder[ok]], minlength=n)
        orphans.extend((s, int(j)) for j in pos[~ok])
        # levels: children of positions [lo, hi) are (slots[lo-1], slots[hi-1]]
        level, lo, hi = [1], 0, 1
        while hi < n:
            last = min(hi, m) - 1
            if last < lo:
                break
            nxt = min(n, int(slots[last]) + 1)
            if nxt <= hi:
                break
            lo, hi = hi, nxt
            level.append(hi)
        ends.append(tuple(level))
    if orphans:  # spill: workers with spare capacity (fastest first), then the learner
        spare = cap - used
        donors = [int(i) for i in by_speed if spare[i] > 0]
        for s in range(k):
            tail = [int(order[s, j]) for t, j in orphans if t == s]
            if not tail:
                continue
            waiting = set(tail)  # an unplaced orphan cannot adopt: that could close a cycle
            while waiting:  # repeat: a placed orphan may adopt the others
                progress = False
                for node in [t for t in tail if t in waiting]:
                    pick = next((d for d in donors if spare[d] > 0 and d != node and d not in waiting), None)
                    if pick is not None:
                        parent[s, node] = pick
                        spare[pick] -= 1
                        waiting.discard(node)
                        progress = True
                if not progress:  # only waiting orphans have room: the learner feeds one, which places it
                    waiting.discard(next(t for t in tail if t in waiting))
            ends[s] = _levels(parent[s], order[s])
    return RelayLayout(k, r, cap_peers, home, cap, parent, order, tuple(ends))


def _levels(parent: npt.NDArray[np.int64], order: npt.NDArray[np.int64]) -> tuple[int, ...]:
    """Level ends of one stripe whose spill broke the contiguous layout: re-sort ``order`` by depth."""
    n = parent.size
    depth = np.ones(n, dtype=np.int64)
    has = parent >= 0
    for _ in range(n):  # relax until stable: at most the depth of the tree
        new = np.where(has, depth[np.where(has, parent, 0)] + 1, 1)
        if np.array_equal(new, depth):
            break
        depth = new
    order[:] = order[np.argsort(depth[order], kind="stable")]
    return tuple(int(x) for x in np.cumsum(np.bincount(depth)[1:]))


def relay_times(
    g_bytes: float,
    links: Sequence[float] | npt.ArrayLike,
    b0: float,
    chunk_bytes: float = DEFAULT_CHUNK_BYTES,
    hop_latency_s: float = DEFAULT_HOP_LATENCY_S,
    layout: RelayLayout | None = None,
    max_peers: int = DEFAULT_MAX_PEERS,
) -> Times:
    """``tree-pipelined``, per worker: the time its last stripe arrives over :func:`relay_layout`.

    Stripe s holds ``m_s`` of the ``m = ceil(G/c)`` chunks (round-robin), ``G_s = G*m_s/m`` bytes.
    Worker j receives it at ``r_j = min(r_parent, B0/k if its parent is the learner, B_j/k,
    B_parent/children_parent)`` and holds it at ``t_j = G_s/r_j + fill_j - c_s/r_j`` with
    ``fill_j = fill_parent + c_s/r_j + hop_latency`` (store-and-forward per chunk, as in a chain).
    """
    g = _positive("snapshot size (bytes)", g_bytes)
    b0 = _positive("learner uplink b0 (bytes/s)", b0)
    c = _positive("chunk size (bytes)", chunk_bytes)
    _hop_latency(hop_latency_s)
    b = _links(links)
    n = b.size
    if n == 0:
        return np.zeros(0)
    lay = relay_layout(b, b0, max_peers) if layout is None else layout
    if lay.n != n:
        raise ConfigError(f"layout is for {lay.n} workers, links for {n}")
    k = lay.stripes
    m = max(1, math.ceil(g / c * (1 - 1e-12)))
    kids = np.maximum(lay.children(), 1)
    up_share = b / kids  # a relay's uplink split over the streams it serves
    down_share = b / k  # a worker's downlink split over its k parents
    out = np.zeros(n)
    for s in range(k):
        m_s = len(range(s, m, k))
        if m_s == 0:
            continue
        g_s = g * m_s / m
        c_s = min(c, g_s)
        par, o = lay.parent[s], lay.order[s]
        rate = np.empty(n)
        fill = np.empty(n)
        lo = 0
        for hi in lay.level_ends[s]:
            nodes = o[lo:hi]
            p = par[nodes]
            root = p < 0
            pp = np.where(root, 0, p)
            src_rate = np.where(root, b0 / k, np.minimum(rate[pp], up_share[pp]))
            r = np.minimum(src_rate, down_share[nodes])
            rate[nodes] = r
            fill[nodes] = np.where(root, 0.0, fill[pp]) + c_s / r + hop_latency_s
            lo = hi
        out = np.maximum(out, g_s / rate + fill - c_s / rate)
    return out


def tree_pipelined_times(
    g_bytes: float,
    links: Sequence[float] | npt.ArrayLike,
    b0: float,
    chunk_bytes: float = DEFAULT_CHUNK_BYTES,
    hop_latency_s: float = DEFAULT_HOP_LATENCY_S,
    max_peers: int = DEFAULT_MAX_PEERS,
) -> Times:
    """Tree-Pipelined, per worker: :func:`relay_times` over :func:`relay_layout`."""
    return relay_times(g_bytes, links, b0, chunk_bytes, hop_latency_s, max_peers=max_peers)


def complete_tree_hops(n: int, fanout: int) -> int:
    """Hops from the learner to the deepest of N workers in a complete ``fanout``-ary tree (root = 1)."""
    n, d = _workers(n), max(1, int(fanout))
    hops, level, total = 1, 1, 1
    while total < n:
        level *= d
        total += level
        hops += 1
        if d == 1:
            return n
    return hops


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
    if name == "tree-chains":
        return tree_chains_times(g_bytes, links, b0, chunk_bytes, hop_latency_s)
    return tree_pipelined_times(g_bytes, links, b0, chunk_bytes, hop_latency_s)


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
