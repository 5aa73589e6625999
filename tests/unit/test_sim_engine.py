"""The discrete-event simulator: determinism, admission, bubble vs capacity model, cost, controller."""

from __future__ import annotations

import math
import random

import pytest

from echo2.config import ControllerConfig
from echo2.errors import ConfigError
from echo2.planner import capacity
from echo2.sim.engine import SimParams, SimWorker, _Sim, simulate

MBIT100 = 12.5e6  # 100 Mbit/s in bytes/s

SPEC7 = {
    "learner/bubble_ratio",
    "learner/version",
    "learner/t_train_s",
    "store/staleness_max",
    "store/staleness_mean",
    "store/dropped_stale",
    "store/admitted",
    "store/size",
    "broadcast/t_bcast_s",
    "broadcast/bytes",
    "broadcast/install_p90_s",
    "pool/mu_pool",
    "pool/mu_target",
    "pool/active_workers",
    "cost/usd_per_step",
    "cost/usd_total",
}


def _params(**kw: object) -> SimParams:
    base: dict[str, object] = dict(
        rollouts_per_step=2048,
        group_size=16,
        t_train_s=1631.2,
        staleness=3,
        kappa=2,
        learner_usd_per_hour=12.24,
        snapshot_bytes=16.38e9,
        b0_bytes_per_s=62.5e6,  # 500 Mbit/s
        strategy="tree-pipelined",
        steps=30,
        reload_s=127,
        seed=0,
    )
    base.update(kw)
    return SimParams(**base)  # type: ignore[arg-type]


def _workers(n: int, rate: float = 0.32, price: float = 0.35) -> list[SimWorker]:
    return [SimWorker(f"w{i}", "rtx5090", price, rate, MBIT100) for i in range(n)]


def _run(n: int, **kw: object):  # type: ignore[no-untyped-def]
    ws = _workers(n)
    return simulate(_params(**kw), ws, [w.worker_id for w in ws])


def test_deterministic_under_seed_and_metric_names() -> None:
    a, b, c = _run(9, seed=5), _run(9, seed=5), _run(9, seed=6)
    assert a.metrics == b.metrics
    assert a.metrics != c.metrics
    assert len(a.metrics) == 30
    for m in a.metrics:
        assert set(m) >= SPEC7
    assert [m["learner/version"] for m in a.metrics] == list(range(1, 31))


@pytest.mark.parametrize("s_budget", [0, 1, 2, 3, 5])
def test_staleness_never_exceeds_s(s_budget: int) -> None:
    res = _run(12, staleness=s_budget, kappa=max(1, s_budget - 1), steps=25)
    assert max(m["store/staleness_max"] for m in res.metrics) <= s_budget
    assert res.summary["staleness_max"] <= s_budget
    bound = res.summary["staleness_bound_conservative_discrete"]
    assert bound is not None and res.summary["staleness_max"] <= bound
    if s_budget == 0:  # synchronous special case: every batch is on-policy
        assert res.summary["staleness_max"] == 0


def test_bubble_knee_matches_n_min() -> None:
    # mu_min = 4096 / (3262.4 - T_bcast); with the simulated tree T_bcast ~ 1438 s: 2.245/s;
    # N_min = ceil(2.245 / 0.32) = 8; ceil(1.1 x 8) = 9
    t_bcast = _run(9).summary["t_bcast_mean_s"]
    mu_min = capacity.mu_min(kappa=2, t_train=1631.2, t_bcast=t_bcast, rollouts=2048)
    n_min = capacity.n_min(mu_min, 0.32)
    assert n_min == 8
    assert _run(math.ceil(1.1 * n_min)).summary["bubble_ratio"] <= 0.02
    assert _run(n_min).summary["bubble_ratio"] <= 0.02
    # N_min - 2 = 6: cycle model says 1 - 3262.4 / (1438 + 4096 / 1.92) = 8.6%; the simulation agrees
    b6 = _run(6).summary["bubble_ratio"]
    model = capacity.cycle_bubble_ratio(kappa=2, t_train=1631.2, t_bcast=t_bcast, rollouts=2048, mu_pool=1.92)
    assert b6 == pytest.approx(model, abs=0.02)
    assert b6 > 0.05


def test_overlap_generation_needs_fewer_workers() -> None:
    # keeping generation going during the broadcast only needs R / T_train = 1.256/s -> 4 workers
    paused, overlapped = _run(5), _run(5, overlap_generation=True)
    assert paused.summary["bubble_ratio"] > 0.1
    assert overlapped.summary["bubble_ratio"] <= 0.02


def test_cost_accounting_matches_the_planner() -> None:
    # no bubble: each step costs (12.24 + 9 x 0.35) x 1631.2 / 3600 = 15.39 x 0.45311 = 6.97338 $
    res = _run(9)
    assert res.summary["usd_per_step_steady"] == pytest.approx(6.97338, rel=1e-3)
    assert res.metrics[-1]["cost/usd_total"] == pytest.approx(
        sum(m["cost/usd_per_step"] for m in res.metrics)
    )


def test_star_limited_broadcast_creates_a_bubble() -> None:
    # 9 workers through a 500 Mbit/s uplink: 9 x 262 s + 127 = 2486 s > the 1825 s the pool can spare
    tree, star = _run(9), _run(9, strategy="star-limited")
    assert star.summary["t_bcast_mean_s"] > 2400 > tree.summary["t_bcast_mean_s"]
    assert star.summary["bubble_ratio"] > 0.1 and tree.summary["bubble_ratio"] <= 0.02


def test_delta_publications_ship_patches_between_anchors() -> None:
    """Patches of 1% of G between anchors every 5 publications: the star's uplink stops being the
    bottleneck for patches, the anchors still take the full time, and the bubble goes."""
    star = _run(9, strategy="star-limited")
    deltas = _run(9, strategy="star-limited", patch_ratio=0.01, anchor_every=5)
    assert deltas.summary["t_bcast_max_s"] == pytest.approx(star.summary["t_bcast_max_s"])  # an anchor
    assert deltas.summary["t_bcast_mean_s"] < 0.4 * star.summary["t_bcast_mean_s"]
    assert deltas.summary["bubble_ratio"] < star.summary["bubble_ratio"] / 2


def test_planner_sizes_the_pool_with_the_mean_publication() -> None:
    from echo2.planner.scenario import ModelSpec

    full = ModelSpec(snapshot_gb=16.0)
    deltas = ModelSpec(snapshot_gb=16.0, patch_ratio=0.01, anchor_every=20)
    assert full.publication_bytes == full.snapshot_bytes == 16e9
    assert deltas.publication_bytes == pytest.approx(16e9 * (1 + 19 * 0.01) / 20)
    assert [deltas.bytes_of_publication(i) for i in (0, 1, 19, 20)] == [16e9, 16e7, 16e7, 16e9]
    with pytest.raises(ValueError):
        ModelSpec(snapshot_gb=16.0, patch_ratio=1.5)


def test_controller_holds_the_pool_through_churn() -> None:
    # 8 active of 12 plus joins; workers leave after ~10 h on average; 120 steps ~ 54 h
    ws = _workers(12)
    p = _params(
        steps=120,
        mu_target=2.468,
        controller=ControllerConfig(
            heartbeat_timeout_s=90,
            rate_halflife_s=600,
            low_band=0.05,
            high_band=0.10,
            sustain_s=600,
            cooldown_s=1800,
            replace_prior=False,
        ),
        churn_mean_lifetime_s=36000.0,
        join_interval_s=3600.0,
        seed=3,
    )
    res = simulate(p, ws, [w.worker_id for w in ws[:8]])
    s = res.summary
    assert s["workers_joined"] > 0
    assert s["controller_decisions"] > 0
    assert s["bubble_ratio"] <= 0.05
    actives = [m["pool/active_workers"] for m in res.metrics[10:]]
    # a leaver is noticed after the heartbeat timeout (90 s) and replaced at once, so short dips only;
    # the pool never grows past what the target needs plus one (no over-provisioning)
    assert sum(a >= 8 for a in actives) / len(actives) >= 0.9
    assert min(actives) >= 6 and max(actives) <= 9
    assert s["staleness_max"] <= 3


def test_speed_smoke() -> None:
    # 300 workers x 100 steps stays well under a second of wall time on an idle core
    ws = [SimWorker(f"w{i}", "g", 0.35, 0.32, 25e6) for i in range(300)]
    p = _params(
        rollouts_per_step=4096,
        t_train_s=110,
        snapshot_bytes=1.2e9,
        b0_bytes_per_s=125e6,
        reload_s=10,
        steps=100,
    )
    res = simulate(p, ws, [w.worker_id for w in ws])
    assert res.summary["steps"] == 100
    assert res.summary["wall_s"] < 10.0  # generous: the machine is shared


def test_batches_are_the_oldest_admissible_groups_by_arrival() -> None:
    # the real TrajectoryStore.take_batch: drop v < v_t - S, then take the earliest arrivals (FIFO).
    # v_t = 5, S = 3 -> floor 2. Arrivals: v1 (stale), v3, v5, v4; R = 2 groups of 16.
    sim = _Sim(_params(rollouts_per_step=32, group_size=16), [], [])
    sim.version = 5
    for t, v in enumerate((1, 3, 5, 4)):  # arrivals at t = 0, 1, 2, 3 s
        sim.now = float(t)
        sim._deliver(v)
    sim.now = 10.0
    sim._try_train()
    # v1 dropped; the batch is v3 + v5 (first to arrive), not v5 + v4 (freshest) nor v3 + v4 (lowest)
    assert sim.dropped == 16
    assert sim.store == {4: 16} and list(sim.fifo) == [(4, 3.0)]
    # staleness: oldest in the batch 5 - 3 = 2; mean (2 x 16 + 0 x 16) / 32 = 1.0
    assert sim.batch_stats == (2, 1.0)
    # the v3 group waited longest: taken at 10 s, arrived at 1 s
    assert sim.wait_max == 9.0


def test_the_engines_normal_draws_are_random_gauss_draws() -> None:
    # _Sim._gauss is random.gauss's Box-Muller pair without the call: the same numbers from the same seed
    sim = _Sim(_params(), [], [])
    ref = random.Random(sim.p.seed)
    assert [sim._gauss() for _ in range(101)] == [ref.gauss(0.0, 1.0) for _ in range(101)]


def test_a_dropped_versions_groups_are_skipped_in_arrival_order() -> None:
    # v_t = 5, S = 3: v1 is dropped while it sits between admissible groups (arrivals v3, v1, v5, v4);
    # the batch (R = 2 groups) is v3 + v5, the FIFO keeps v4 only
    sim = _Sim(_params(rollouts_per_step=32, group_size=16), [], [])
    sim.version = 5
    for t, v in enumerate((3, 1, 5, 4)):
        sim.now = float(t)
        sim._deliver(v)
    sim.now = 10.0
    sim._try_train()
    assert sim.dropped == 16 and sim.store == {4: 16} and list(sim.fifo) == [(4, 3.0)]
    assert sim.batch_stats == (2, 1.0) and sim.wait_max == 10.0


def test_a_pool_sized_for_the_useful_groups_hides_the_broadcast_one_sized_for_all_does_not() -> None:
    # half the groups zero-variance (left out): the 9 workers that sized the pool for R above now leave
    # a bubble; 9 / 0.5 = 18 hide it again, and the measured useful share is the one drawn
    t_bcast = _run(9).summary["t_bcast_mean_s"]
    mu_min = capacity.mu_min(kappa=2, t_train=1631.2, t_bcast=t_bcast, rollouts=2048) / 0.5
    n_min = capacity.n_min(mu_min, 0.32)
    assert n_min == 15
    short = _run(9, useful_share=0.5).summary
    sized = _run(math.ceil(1.1 * n_min), useful_share=0.5).summary
    # the cycle model with the pool's useful rate (9 x 0.32 x 0.5): 1 - 3262.4 / (T_bcast + 4096 / 1.44) = 24%
    model = capacity.cycle_bubble_ratio(kappa=2, t_train=1631.2, t_bcast=t_bcast, rollouts=2048, mu_pool=1.44)
    assert short["bubble_ratio"] == pytest.approx(model, abs=0.03) and model > 0.2
    assert sized["bubble_ratio"] <= 0.02
    assert (
        sized["useful_share_measured"] == pytest.approx(0.5, abs=0.05) and sized["zero_variance_rollouts"] > 0
    )
    assert sized["staleness_max"] <= 3
    # every group useful: no draw, the run the same as before the option
    assert _run(9, useful_share=1.0).metrics == _run(9).metrics
    assert _run(9).summary["useful_share_measured"] == 1.0
    with pytest.raises(ConfigError, match="useful_share"):
        _params(useful_share=0.0)
