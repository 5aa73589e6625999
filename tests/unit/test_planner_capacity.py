"""SPEC section 3 equations, with the arithmetic worked by hand in the comments (kappa from S, the
bubble ratio and the broadcast times are tested with echo2.physics in test_physics.py)."""

from __future__ import annotations

import math

import pytest

from echo2.errors import ConfigError, InfeasibleError
from echo2.physics.rules import kappa_from_staleness
from echo2.planner import capacity

# The paper's setting: R = 128 x 16 = 2048, T_train = 1631.2 s, S = 3 -> kappa = 2, T_bcast = 1437 s
R, T, TB, K = 2048, 1631.2, 1437.0, 2


def test_mu_min_paper_setting() -> None:
    # mu_min = kappa R / (kappa T - T_bcast) = 4096 / (3262.4 - 1437) = 4096 / 1825.4 = 2.243892...
    mu = capacity.mu_min(kappa=K, t_train=T, t_bcast=TB, rollouts=R)
    assert mu == pytest.approx(4096 / 1825.4, rel=1e-12)
    assert mu == pytest.approx(2.243892, abs=1e-6)
    # mu_target = 1.1 * 2.243892 = 2.468281
    assert capacity.mu_target(mu) == pytest.approx(2.468281, abs=1e-6)


def test_n_min_rounds_up_but_not_on_float_noise() -> None:
    # 2.243892 / 0.32 = 7.0122 -> 8 workers; 2.243892 / 0.28 = 8.014 -> 9
    mu = capacity.mu_min(kappa=K, t_train=T, t_bcast=TB, rollouts=R)
    assert capacity.n_min(mu, 0.32) == 8
    assert capacity.n_min(mu, 0.28) == 9
    # an exact multiple must not round up: 3.0 / 0.1 = 30.000000000000004 in floats -> 30
    assert capacity.n_min(3.0, 0.1) == 30


def test_overlap_condition_is_the_provisioning_rule() -> None:
    mu = capacity.mu_min(kappa=K, t_train=T, t_bcast=TB, rollouts=R)
    # at mu_min: kappa T = T_bcast + kappa R / mu exactly; 0.1% below it fails
    assert capacity.overlap_holds(kappa=K, t_train=T, t_bcast=TB, rollouts=R, mu_pool=mu * (1 + 1e-12))
    assert not capacity.overlap_holds(kappa=K, t_train=T, t_bcast=TB, rollouts=R, mu_pool=mu * 0.999)


def test_infeasible_when_broadcast_cannot_be_hidden() -> None:
    # kappa T = 1 x 1000 = 1000 <= T_bcast = 1200: raise kappa to floor(1200/1000) + 1 = 2 (S >= 3)
    with pytest.raises(InfeasibleError, match=r"raise kappa to >= 2 \(staleness S >= 3\)"):
        capacity.mu_min(kappa=1, t_train=1000, t_bcast=1200, rollouts=R)
    with pytest.raises(InfeasibleError):  # equality is infeasible too (division by zero)
        capacity.mu_min(kappa=2, t_train=600, t_bcast=1200, rollouts=R)


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        ({"t_train": 0.0}, "t_train"),
        ({"t_train": -5.0}, "t_train"),
        ({"t_bcast": -1.0}, "t_bcast"),
        ({"rollouts": 0}, "rollouts_per_step"),
        ({"t_train": math.nan}, "t_train"),
    ],
)
def test_bad_inputs_name_the_field(kw: dict[str, float], name: str) -> None:
    args = {"kappa": K, "t_train": T, "t_bcast": TB, "rollouts": R} | kw
    with pytest.raises(ConfigError, match=name):
        capacity.mu_min(**args)  # type: ignore[arg-type]


def test_bad_kappa_and_rates() -> None:
    with pytest.raises(ConfigError, match="kappa"):
        capacity.mu_min(kappa=0, t_train=T, t_bcast=TB, rollouts=R)
    with pytest.raises(ConfigError, match="worker_rate"):
        capacity.n_min(2.0, 0.0)
    with pytest.raises(ConfigError, match="mu_pool"):
        capacity.overlap_holds(kappa=K, t_train=T, t_bcast=TB, rollouts=R, mu_pool=-1.0)
    with pytest.raises(ConfigError, match="gamma"):
        capacity.mu_target(2.0, 0.9)


def test_staleness_bounds_paper_setting() -> None:
    # conservative: kappa + ceil((T_bcast + R/mu)/T) - 1 with mu = 8 x 0.32 = 2.56:
    # R/mu = 800 s; (1437 + 800)/1631.2 = 1.3714 -> ceil 2; 2 + 2 - 1 = 3 (= S)
    assert (
        capacity.staleness_bound_conservative(kappa=K, t_train=T, t_bcast=TB, rollouts=R, mu_pool=2.56) == 3
    )
    # tight: kappa + ceil((1 - 1/kappa) T_bcast / T) = 2 + ceil(0.5 x 0.881) = 2 + 1 = 3
    assert capacity.staleness_bound_tight(kappa=K, t_train=T, t_bcast=TB) == 3
    # kappa = 1: tight = 1 + ceil(0) = 1
    assert capacity.staleness_bound_tight(kappa=1, t_train=T, t_bcast=TB) == 1
    # a slow pool loosens the conservative bound: mu = 0.5 -> R/mu = 4096 s;
    # (1437 + 4096)/1631.2 = 3.392 -> 4; 2 + 4 - 1 = 5
    assert capacity.staleness_bound_conservative(kappa=K, t_train=T, t_bcast=TB, rollouts=R, mu_pool=0.5) == 5
    # the same rule with an explicit latency: 1437 + 800 = 2237 s -> 2 + ceil(1.371) - 1 = 3; a rollout
    # that also waited 3276 s in a FIFO store: 5513 s / 1631.2 = 3.38 -> 2 + 4 - 1 = 5; no latency: kappa - 1
    assert capacity.staleness_bound_after(kappa=K, t_train=T, latency=TB + 800.0) == 3
    assert capacity.staleness_bound_after(kappa=K, t_train=T, latency=TB + 800.0 + 3276.0) == 5
    assert capacity.staleness_bound_after(kappa=K, t_train=T, latency=0.0) == 1


def test_with_kappa_s_minus_1_tight_bound_is_at_most_s() -> None:
    # SPEC: with kappa = S - 1 and T_bcast < T_train, Delta_max <= S
    for s in range(2, 12):
        k = kappa_from_staleness(s)
        for tb in (0.0, 100.0, 900.0, 1600.0):
            assert capacity.staleness_bound_tight(kappa=k, t_train=T, t_bcast=tb) <= s


def test_cycle_bubble_model() -> None:
    mu = capacity.mu_min(kappa=K, t_train=T, t_bcast=TB, rollouts=R)
    assert capacity.cycle_bubble_ratio(kappa=K, t_train=T, t_bcast=TB, rollouts=R, mu_pool=mu * 1.01) == 0.0
    # half of mu_min: cycle = 1437 + 2 x 1825.4 = 5087.8 s; bubble = 1 - 3262.4 / 5087.8 = 0.35878
    b = capacity.cycle_bubble_ratio(kappa=K, t_train=T, t_bcast=TB, rollouts=R, mu_pool=mu / 2)
    assert b == pytest.approx(1 - 3262.4 / 5087.8, rel=1e-9)


def test_cost_and_saving_paper_arithmetic() -> None:
    # ECHO-2 with 8 RTX 5090: (4 x 3.06 + 8 x 0.35) $/h x 1631.2 s / 3600 = 15.04 x 0.45311 = 6.81479 $
    echo = capacity.cost_per_step(usd_per_hour=4 * 3.06 + 8 * 0.35, step_seconds=1631.2)
    assert echo == pytest.approx(6.814791, abs=1e-6)
    # verl-sync: 8 x 3.06 x 1508.2 / 3600 = 10.25576; verl-async: 24.48 x 1582.3 / 3600 = 10.75964
    sync = capacity.cost_per_step(usd_per_hour=8 * 3.06, step_seconds=1508.2)
    async_ = capacity.cost_per_step(usd_per_hour=8 * 3.06, step_seconds=1582.3)
    assert sync == pytest.approx(10.25576, abs=1e-5)
    assert async_ == pytest.approx(10.75964, abs=1e-5)
    # savings 1 - 6.81479/10.25576 = 33.55%, 1 - 6.81479/10.75964 = 36.66%
    assert capacity.saving(echo, sync) == pytest.approx(0.33552, abs=1e-5)
    assert capacity.saving(echo, async_) == pytest.approx(0.36663, abs=1e-5)
