"""Closed-loop controller (SPEC section 5): sustained thresholds, hysteresis, no flapping."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from echo2.config import ControllerConfig
from echo2.errors import ConfigError
from echo2.planner.activation import Candidate
from echo2.planner.controller import Heartbeat, PoolController

CFG = ControllerConfig(
    heartbeat_timeout_s=90,
    rate_halflife_s=300,
    low_band=0.05,
    high_band=0.10,
    sustain_s=300,
    cooldown_s=900,
    replace_prior=False,
)


def _pool(n_active: int, n_idle: int, target: float) -> PoolController:
    ctl = PoolController(target, CFG)
    for i in range(n_active + n_idle):
        # idle ones get dearer with i so "cheapest" is well defined; all deliver 1 rollout/s
        ctl.add_candidate(Candidate(f"w{i}", "t", 0.30 + 0.01 * i, 1.0))
    ctl.activate_initial([f"w{i}" for i in range(n_active)], 0.0)
    return ctl


def _beat(
    ctl: PoolController,
    ids: list[str],
    now: float,
    dt: float,
    rate: dict[str, float],
    rng: random.Random,
    noise: float = 0.0,
) -> None:
    for w in ids:
        r = rate.get(w, 1.0) * max(0.0, 1 + rng.gauss(0, noise))
        ctl.observe(Heartbeat(w, now, round(r * dt), dt))


def test_no_flapping_under_noisy_throughput() -> None:
    # 10 workers x 1.0/s, target 9.5: pool 10 is inside the dead band [0.95 x 9.5, 1.1 x 9.5 + 1]:
    # shortfall needs < 9.025 sustained; release needs 10 - 1 = 9 >= 10.45 (never). 30% noise per beat.
    ctl = _pool(10, 5, 9.5)
    rng = random.Random(0)
    ids = [f"w{i}" for i in range(10)]
    for step in range(1, 2001):  # 2,000 beats x 30 s = 16.7 h
        now = step * 30.0
        _beat(ctl, ids, now, 30.0, {}, rng, noise=0.3)
        assert ctl.decide(now) == []
    assert ctl.decisions_made == 0


def test_sustained_shortfall_activates_cheapest_after_sustain() -> None:
    ctl = _pool(10, 5, 9.5)
    rng = random.Random(1)
    ids = [f"w{i}" for i in range(10)]
    slow = {w: 0.8 for w in ids}  # pool drops to 8.0 < 9.025
    acted_at = None
    for step in range(1, 200):
        now = step * 30.0
        _beat(ctl, ids, now, 30.0, slow, rng)
        d = ctl.decide(now)
        if d:
            acted_at = now
            # the estimate must have fallen below 9.025 first, then stayed there >= 300 s
            assert all(x.action == "activate" and x.reason == "shortfall" for x in d)
            # cheapest idle first: w10 ($0.40) then w11 ($0.41)
            assert [x.worker_id for x in d][:1] == ["w10"]
            break
    assert acted_at is not None
    # EWMA with half-life 300 s needs ~270 s to move 1.0 -> < 0.9025 per worker, plus sustain 300 s
    assert acted_at >= 300.0 + 30.0


def test_lost_worker_is_replaced_at_once() -> None:
    ctl = _pool(10, 5, 9.5)
    rng = random.Random(2)
    alive = [f"w{i}" for i in range(10) if i != 3]  # w3 goes silent at t = 0
    out = []
    for step in range(1, 60):
        now = step * 30.0
        _beat(ctl, alive, now, 30.0, {}, rng)
        decisions = ctl.decide(now)
        alive += [d.worker_id for d in decisions if d.action == "activate"]  # the runtime applies them
        out += decisions
    # silent for > 90 s at t = 120: release w3 and activate the cheapest idle (w10) in the same call;
    # w3 is not re-activated although it is the cheapest, and nothing else happens for 30 min
    assert [(d.action, d.worker_id, d.reason) for d in out] == [
        ("release", "w3", "heartbeat timeout"),
        ("activate", "w10", "shortfall"),
    ]


def test_surplus_releases_most_expensive_after_cooldown_and_keeps_margin() -> None:
    ctl = PoolController(5.0, CFG)
    for i in range(10):
        ctl.add_candidate(Candidate(f"w{i}", "t", 0.30 + 0.1 * i, 1.0))
    ids = [f"w{i}" for i in range(10)]
    ctl.activate_initial(ids, 0.0)
    rng = random.Random(3)
    released = []
    for step in range(1, 400):
        now = step * 30.0
        _beat(ctl, [w for w in ids if w not in released], now, 30.0, {}, rng)
        for d in ctl.decide(now):
            assert d.action == "release" and d.reason == "surplus"
            assert now >= CFG.cooldown_s  # no release within the cool-down after activation
            released.append(d.worker_id)
    # releases go most expensive first and stop while pool - 1 >= 1.1 x 5 = 5.5 -> 6 remain
    assert released == ["w9", "w8", "w7", "w6"]
    assert ctl.mu_pool(400 * 30.0) == pytest.approx(6.0)


def test_api_errors() -> None:
    with pytest.raises(ConfigError, match="mu_target"):
        PoolController(0.0)
    with pytest.raises(ValidationError, match="sustain_s"):  # the shared [controller] section validates
        ControllerConfig(sustain_s=0)
    ctl = PoolController(1.0)
    with pytest.raises(ConfigError, match="unknown worker"):
        ctl.observe(Heartbeat("ghost", 0.0, 1, 1.0))
    ctl.add_candidate(Candidate("a", "t", 1.0, 1.0))
    with pytest.raises(ConfigError, match="already known"):
        ctl.add_candidate(Candidate("a", "t", 1.0, 1.0))


def test_replace_prior_takes_the_first_measurement_then_averages() -> None:
    # halflife 10 generating seconds: a 1 s heartbeat moves the estimate by 1 - 2**(-1/10) = 6.7%
    for replace, first in ((False, 1.0 + (100.0 - 1.0) * (1 - 2 ** (-0.1))), (True, 100.0)):
        c = PoolController(
            mu_target=10.0, config=ControllerConfig(rate_halflife_s=10.0, replace_prior=replace)
        )
        c.add_candidate(Candidate("a", "cpu", 1.0, 1.0), active=True)
        c.observe(Heartbeat("a", 1.0, rollouts=100, busy_s=1.0))
        assert c.measured_rate("a") == pytest.approx(first)
    c.observe(Heartbeat("a", 2.0, rollouts=200, busy_s=1.0))  # later ones average as before
    assert c.measured_rate("a") == pytest.approx(100.0 + 100.0 * (1 - 2 ** (-0.1)))
