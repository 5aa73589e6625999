"""echo2.physics: the one definition of T*, the broadcast times, the admission rule and the knee, worked
by hand (bytes, bytes/s, seconds), and the strategy names every consumer accepts."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError

from echo2.broadcast.factory import get_strategy, registry
from echo2.config import RuntimeConfig
from echo2.errors import ConfigError
from echo2.physics import broadcast as pb
from echo2.physics.broadcast import relay_chunk_bytes
from echo2.physics.rules import admission_floor, bubble_ratio, is_admissible, kappa_from_staleness, knee
from echo2.planner.scenario import NetworkSpec
from echo2.sim.config import SimSection
from echo2.sim.engine import SimParams

MIB4 = 4 * 2**20  # 4 MiB = 4,194,304 bytes
MBIT100 = 12.5e6  # 100 Mbit/s in bytes/s
G8B = 16.38e9  # Qwen3-8B bf16 snapshot, bytes


def test_units() -> None:
    # 100 Mbit/s = 100e6 bit/s / 8 = 12.5e6 bytes/s; 500 Mbit/s = 62.5e6 bytes/s
    assert pb.mbps_to_bytes_per_s(100) == MBIT100
    assert pb.mbps_to_bytes_per_s(500) == 62.5e6


def test_lower_bound_by_hand() -> None:
    # G = 100 MB, B_w = 12.5 MB/s (100 Mbit), B0 = 37.5 MB/s (300 Mbit)
    g, bw, b0 = 100e6, 12.5e6, 37.5e6
    # N=4: max(G/B_w = 8, G/B0 = 2.67, 4*100/(37.5 + 4*12.5) = 400/87.5 = 4.57) = 8 s: the downlink binds
    assert pb.lower_bound(g, b0, bw, 4) == pytest.approx(8.0)
    # B0 = 6.25 MB/s < B_w, N=1: max(8, 100/6.25 = 16, 100/18.75 = 5.33) = 16 s: the uplink binds
    assert pb.lower_bound(g, 6.25e6, bw, 1) == pytest.approx(16.0)
    # 8 GB over 1 Gbit/s = 125 MB/s uplink, 100 Mbit links, N = 1000: max(80, 8, 8e12/12.625e9 = 63.4) = 80
    assert pb.lower_bound(1e9, 125e6, MBIT100, 1000) == pytest.approx(80.0)
    with pytest.raises(ConfigError, match="number of workers"):
        pb.lower_bound(g, b0, bw, 0)


def test_star_homogeneous_by_hand() -> None:
    g, bw, b0 = 100e6, 12.5e6, 37.5e6
    # Star-Unlimited: G/B_w = 100/12.5 = 8 s whatever N
    assert pb.homogeneous_time("star-unlimited", g, b0, bw, 16) == pytest.approx(8.0)
    # Star-Limited, N=16: max(G/B_w = 8, N*G/B0 = 1600/37.5 = 42.67) = 42.67 s; N=2: max(8, 5.33) = 8 s
    assert pb.homogeneous_time("star-limited", g, b0, bw, 16) == pytest.approx(1600 / 37.5)
    assert pb.homogeneous_time("star-limited", g, b0, bw, 2) == pytest.approx(8.0)
    # reload is added once: 8 + 2 = 10 s
    assert pb.homogeneous_time("star-unlimited", g, b0, bw, 3, reload_s=2.0) == pytest.approx(10.0)


def test_tree_chains_homogeneous_by_hand() -> None:
    # G = 1 GB, B0 = 125 MB/s (1 Gbit/s), B_w = 12.5 MB/s, N = 100, 4 MiB chunks.
    # k <= B0/B_w = 10 chains keep r = min(B_w, B0/k) = 12.5 MB/s; k = 10 gives depth L = 10; k = 11 drops
    # r to 11.36 MB/s (G/r = 88 s > any fill saved), so k = 10.
    g, b0 = 1e9, 125e6
    assert pb.best_chain_count(g, np.full(100, MBIT100), b0, MIB4, 0.0) == 10
    # last worker: G/r + (L - 1)*c/r + L*hop = 80 + 9 x 0.33554432 + 0 = 83.01989888 s
    t = pb.homogeneous_time("tree-chains", g, b0, MBIT100, 100, MIB4, 0.0)
    assert t == pytest.approx(80 + 9 * MIB4 / MBIT100, rel=1e-12)
    assert t == pytest.approx(83.01989888, abs=1e-8)
    # with 0.05 s per hop: + L x 0.05 = 0.5 s
    t = pb.homogeneous_time("tree-chains", g, b0, MBIT100, 100, MIB4, 0.05)
    assert t == pytest.approx(83.51989888, abs=1e-8)


def test_chain_model_equals_the_planners_old_closed_form_when_chunks_divide_g() -> None:
    # G = 250 chunks of 4 MiB: the planner's (m + L - 1)*c/r + L*hop = (250 + 9) x 0.33554432 + 0.5
    # = 87.40597888 s; the per-worker model's G/r + (L - 1)*c/r + L*hop is the same number
    g = 250 * MIB4
    t = pb.homogeneous_time("tree-chains", g, 125e6, MBIT100, 100, MIB4, 0.05)
    assert t == pytest.approx((250 + 10 - 1) * MIB4 / MBIT100 + 10 * 0.05, rel=1e-12)
    assert t == pytest.approx(87.40597888, abs=1e-8)


def test_relay_tree_homogeneous_by_hand() -> None:
    # G = 256 chunks of 4 MiB = 1,073,741,824 bytes, B0 = 125 MB/s, B_w = 12.5 MB/s, N = 100, cap 16.
    # k = min(N, 16 // 2) = 8 stripes of 32 chunks; r = min(B0, B_w)/8 = 1.5625 MB/s; each worker serves
    # floor(B_w/r) = 8 children. A complete 8-ary tree of 100 nodes has levels 1 + 8 + 64 + 27: D = 4 hops,
    # but 100 = 8 x 12 + 4, so four stripes have 12 home relays (96 slots for 99 children) and their last
    # 3 workers hang under spare relays one level lower still: D = 5 there (checked below by layout).
    g, b0, n = 256 * MIB4, 125e6, 100
    lay = pb.relay_layout(np.full(n, MBIT100), b0)
    assert lay.stripes == 8 and lay.stripe_rate == pytest.approx(1.5625e6)
    assert lay.capacity.tolist() == [8] * n
    assert pb.complete_tree_hops(n, 8) == 4 and pb.complete_tree_hops(9, 8) == 2
    d = lay.depth()
    # last worker: G_s/r + D*(c/r + hop) - c/r = G/B_w + (D - 1)*k*c/B_w + D*hop
    #   = 85.8993459 + (D - 1) x 2.68435456 + D x 0.05
    t = pb.homogeneous_time("tree-pipelined", g, b0, MBIT100, n, MIB4, 0.05)
    assert t == pytest.approx(g / MBIT100 + (d - 1) * 8 * MIB4 / MBIT100 + d * 0.05, rel=1e-12)
    assert d in (4, 5, 6)
    # N = 64 = 8 x 8: no remainder, so a complete tree: 1 + 8 + 55 -> D = 3 hops exactly
    t64 = pb.homogeneous_time("tree-pipelined", g, b0, MBIT100, 64, MIB4, 0.05)
    assert pb.relay_layout(np.full(64, MBIT100), b0).depth() == 3
    assert t64 == pytest.approx(85.89934592 + 2 * 2.68435456 + 3 * 0.05, rel=1e-9)


def test_relay_tree_degree_learner_load_and_depth_at_scale() -> None:
    # the properties the issue asks of the topology, on 10,000 equal links: bounded degree, the learner
    # feeds k streams (G once), every worker relays in one stripe and serves k children (uploads ~G),
    # depth grows as log_k N
    n, b0 = 10_000, 125e6
    lay = pb.relay_layout(np.full(n, 25e6), b0)
    k = lay.stripes
    assert k == 8
    assert int(lay.degree().max()) <= pb.DEFAULT_MAX_PEERS
    assert int((lay.parent == pb.LEARNER_INDEX).sum()) == k  # one root stream per stripe
    assert int(lay.children().sum()) == k * (n - 1)
    assert int(lay.children().max()) <= k  # each upload <= k x (G/k) = G
    assert (lay.home >= 0).all() and np.bincount(lay.home).max() - np.bincount(lay.home).min() <= 1
    assert lay.depth() <= pb.complete_tree_hops(n, k) + 2  # 1 + 8 + 64 + 512 + 4096 + ... -> 6 (+ spill)
    # a custom cap: 6 connections -> 3 stripes, 3 children each
    small = pb.relay_layout(np.full(50, 25e6), b0, max_peers=6)
    assert small.stripes == 3 and int(small.degree().max()) <= 6


def test_relay_tree_slow_links_are_leaves_and_throttle_only_themselves() -> None:
    # 90 fast (100 Mbit/s) and 10 slow (10 Mbit/s) links: slow ones relay for nobody and finish at ~G/B_slow.
    # The 90 fast ones carry the 99 tree edges of each stripe: with 8 stripes they would need 8.8 children
    # each (over the cap of 16 - 8), so k = 7 and each serves ceil(7 x 99/90) = 8 children at B/8 instead
    # of 7 at B/7: they finish at ~8/7 x G/B_fast (the price of relaying for the slow ones)
    links = np.array([MBIT100] * 90 + [1.25e6] * 10)
    lay = pb.relay_layout(links, 62.5e6)
    assert lay.stripes == 7
    assert (lay.children()[90:] == 0).all()
    t = pb.relay_times(G8B, links, 62.5e6, layout=lay)
    assert t[:90].max() <= 8 / 7 * G8B / MBIT100 * 1.01
    assert t[90:].min() >= G8B / 1.25e6


def test_relay_chain_is_one_chain() -> None:
    # k = 1, L = N = 100: G/B_w + 99*c/B_w + 100*hop = 80 + 99 x 0.33554432 + 5 = 118.21888768 s
    t = pb.homogeneous_time("relay-chain", 1e9, 125e6, MBIT100, 100, MIB4, 0.05)
    assert t == pytest.approx(118.21888768, abs=1e-8)
    assert pb.chain_times(1e9, np.full(100, MBIT100), 125e6, 1, MIB4, 0.05).max() == pytest.approx(t)


def test_star_unlimited_is_g_over_own_link() -> None:
    # 8 bytes over 2 and 4 bytes/s -> 4 s and 2 s
    assert pb.star_unlimited_times(8.0, [2.0, 4.0]).tolist() == [4.0, 2.0]


def test_star_limited_water_filling_by_hand() -> None:
    # G = 8 bytes, B0 = 6 bytes/s, links [1, 4, 4]. Max-min share: flow 0 capped at 1, flows 1-2 get
    # (6 - 1)/2 = 2.5 each -> done at 8/2.5 = 3.2 s; flow 0 has 8 - 3.2 = 4.8 bytes left at its cap
    # of 1 byte/s -> done at 3.2 + 4.8 = 8.0 s.
    assert pb.star_limited_times(8.0, [1.0, 4.0, 4.0], 6.0).tolist() == pytest.approx([8.0, 3.2, 3.2])
    # G = 18, B0 = 9, links [2, 3, 10]. Phase 1: fair share 3 -> flow 0 capped at 2; 7 left over two
    # flows = 3.5 -> flow 1 capped at 3; flow 2 gets the last 4 (not its 10). Flow 2 is done at
    # 18/4 = 4.5 s, flow 0 then has 18 - 9 = 9 left, flow 1 has 18 - 13.5 = 4.5.
    # Phase 2: caps 2 and 3 fit in 9: flow 1 is done after 4.5/3 = 1.5 s (t = 6), flow 0 has 9 - 3 = 6.
    # Phase 3: flow 0 alone at its cap 2: 6/2 = 3 s more -> t = 9.
    assert pb.star_limited_times(18.0, [2.0, 3.0, 10.0], 9.0).tolist() == pytest.approx([9.0, 6.0, 4.5])


def test_star_limited_homogeneous_is_linear_in_n() -> None:
    # N x 16.38 GB through 62.5 MB/s once N x 12.5 MB/s > 62.5 MB/s (N > 5): 262.08 s per worker
    for n in (1, 5, 50, 500):
        t = pb.star_limited_times(G8B, np.full(n, MBIT100), 62.5e6)
        assert t.max() == pytest.approx(max(G8B / MBIT100, n * G8B / 62.5e6), rel=1e-9)


def test_tree_pipelined_near_lower_bound_and_logarithmic_in_n() -> None:
    worst = []
    for n in (1, 8, 64, 512, 1000, 100_000):
        t = pb.tree_pipelined_times(G8B, np.full(n, MBIT100), 62.5e6)
        worst.append(t.max() / pb.lower_bound(G8B, 62.5e6, MBIT100, n))
    assert max(worst) <= 1.10  # within 10% of T* up to 100,000 workers (16 GB: the fill is small)
    assert worst[-1] - worst[0] <= 0.10  # grows with the depth, log N


def test_chains_put_slow_links_at_the_tails() -> None:
    # 10 fast (100 Mbit/s) and 2 slow (20 Mbit/s) workers: the slow ones throttle only themselves
    links = [MBIT100] * 10 + [2.5e6] * 2
    t = pb.tree_chains_times(G8B, links, 62.5e6)
    assert t[:10].max() <= 1.05 * G8B / MBIT100
    assert t[10:].min() >= G8B / 2.5e6


def test_planner_estimate_is_the_simulators_last_worker() -> None:
    # one model: the planner's homogeneous estimate is the max of the per-worker times plus reload
    for name in pb.STRATEGY_NAMES:
        per_worker = pb.completion_times(name, G8B, np.full(9, MBIT100), 62.5e6)
        est = pb.estimates(G8B, 62.5e6, MBIT100, 9, reload_s=127.0)
        assert est[name] == pytest.approx(float(per_worker.max()) + 127.0, rel=1e-12)
    assert est["lower_bound"] == pytest.approx(G8B / MBIT100 + 127.0)


def test_bad_inputs() -> None:
    with pytest.raises(ConfigError, match="links"):
        pb.star_unlimited_times(1.0, [0.0])
    with pytest.raises(ConfigError, match="snapshot"):
        pb.tree_pipelined_times(0.0, [1.0], 1.0)
    with pytest.raises(ConfigError, match="uplink"):
        pb.star_limited_times(1.0, [1.0], -1.0)


def test_admission_rule_by_hand() -> None:
    # v_t = 10, S = 3: floor = 10 - 3 = 7; version 7 is admissible, 6 is not
    assert admission_floor(10, 3) == 7
    assert is_admissible(7, 10, 3) and not is_admissible(6, 10, 3)
    # S = 0 (synchronous): only the current version
    assert is_admissible(10, 10, 0) and not is_admissible(9, 10, 0)
    # kappa = max(1, S - 1)
    assert [kappa_from_staleness(s) for s in (0, 1, 2, 3, 4, 11)] == [1, 1, 1, 2, 3, 10]
    with pytest.raises(ConfigError, match="staleness S"):
        kappa_from_staleness(-1)


def test_bubble_ratio_and_knee_by_hand() -> None:
    # 1 s idle + 3 s training in a 4 s window: 1 - 3/4 = 0.25; an empty window is 0
    assert bubble_ratio(3.0, 4.0) == 0.25
    assert bubble_ratio(0.0, 0.0) == 0.0
    # knee: the smallest N with bubble <= 5% (inclusive), in N order whatever the input order
    assert knee([1, 2, 3, 4, 5], [0.5, 0.2, 0.06, 0.05, 0.0]) == 4
    assert knee([5, 3, 4], [0.0, 0.3, 0.04]) == 4
    assert knee([1, 2], [0.5, 0.2]) is None
    assert knee([1, 2], [0.5, 0.2], threshold=0.3) == 2


def test_planner_simulator_and_registry_accept_the_same_strategy_names() -> None:
    names = set(pb.STRATEGY_NAMES)
    assert names == {"star-unlimited", "star-limited", "tree-pipelined", "relay-chain", "tree-chains"}
    assert set(registry()) == names
    base = dict(
        rollouts_per_step=32, group_size=8, t_train_s=1.0, staleness=1, kappa=1, learner_usd_per_hour=0.0,
        snapshot_bytes=1e6, b0_bytes_per_s=1e6, steps=1,
    )  # fmt: skip
    for name in names:
        assert get_strategy(name).name == name
        assert NetworkSpec(strategy=name).strategy == name  # planner scenario
        assert SimSection(strategy=name).strategy == name  # simulator scenario
        assert SimParams(strategy=name, **base).strategy == name  # type: ignore[arg-type]  # engine
        assert RuntimeConfig(strategy=name).strategy == name  # runtime
        assert pb.completion_times(name, 1e6, [1e5, 2e5], 1e6).shape == (2,)
    for bad in ("tree_pipelined", "gossip"):  # the old underscore spelling is gone everywhere
        with pytest.raises(ConfigError, match="tree-pipelined, relay-chain, tree-chains"):
            get_strategy(bad)
        with pytest.raises(ConfigError, match="unknown broadcast strategy"):
            SimParams(strategy=bad, **base)  # type: ignore[arg-type]
        for model in (NetworkSpec, SimSection, RuntimeConfig):
            with pytest.raises(ValidationError, match="'star-unlimited', 'star-limited', 'tree-pipelined'"):
                model(strategy=bad)


def test_relay_chunk_size_by_hand() -> None:
    # c* = sqrt(G * a / (1 + B0/B_w)): G = 8e6 bytes, a = 26, B0/B_w = 3 -> sqrt(5.2e7) = 7211 bytes,
    # rounded down to whole KiB: 7 KiB
    assert relay_chunk_bytes(8e6, 3.0) == 7 << 10
    # it balances the two costs it trades: fill N*c*(1/B0 + 1/B_w) = announcements N*(G/c)*a/B0
    g, ratio, a, n, bw = 64e6, 3.0, 26.0, 16, 1e6
    c = math.sqrt(g * a / (1 + ratio))
    fill = n * c * (1 / (ratio * bw) + 1 / bw)
    announce = n * (g / c) * a / (ratio * bw)
    assert fill == pytest.approx(announce)
    assert relay_chunk_bytes(g, ratio) == int(c) >> 10 << 10
    assert relay_chunk_bytes(1.55e6, 3.0) == 4 << 10  # a small patch: the floor
    assert relay_chunk_bytes(1e3) == 4 << 10 and relay_chunk_bytes(0) == 4 << 10
    assert relay_chunk_bytes(1e15) == 1 << 20  # the ceiling
    with pytest.raises(ConfigError):
        relay_chunk_bytes(1e6, ratio=0)
