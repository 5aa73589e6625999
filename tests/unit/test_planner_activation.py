"""Greedy / exact / random activation over heterogeneous catalogs (SPEC section 5)."""

from __future__ import annotations

import math
import random

import pytest

from echo2.errors import ConfigError, InfeasibleError
from echo2.planner.activation import (
    Candidate,
    activate,
    exact,
    expand_catalog,
    greedy,
    greedy_prefix,
    random_nocost,
)


def _c(wid: str, price: float, rate: float) -> Candidate:
    return Candidate(wid, wid.rstrip("0123456789"), price, rate)


def test_hand_example_greedy_completion_beats_prefix() -> None:
    # A: $1, 1/s (rho 1.0)   B: $1.5, 2/s (rho 0.75)   C: $3, 3/s (rho 1.0), target 3/s
    # rho order: B (0.75), then C before A (tie at 1.0 goes to the faster worker)
    # prefix: B + C = $4.5 (pool 5); completions: before B, C alone = $3; after B (residual 1),
    # cheapest remaining with mu >= 1 is A -> B + A = $2.5 (pool 3). Optimum: B + A = $2.5.
    cands = [_c("A", 1.0, 1.0), _c("B", 1.5, 2.0), _c("C", 3.0, 3.0)]
    assert greedy_prefix(cands, 3.0).usd_per_hour == pytest.approx(4.5)
    g = greedy(cands, 3.0)
    assert sorted(c.worker_id for c in g.selected) == ["A", "B"]
    assert g.usd_per_hour == pytest.approx(2.5) and g.mu_pool == pytest.approx(3.0)
    assert exact(cands, 3.0).usd_per_hour == pytest.approx(2.5)


def test_homogeneous_catalog_picks_ceil_target_over_rate() -> None:
    # 2.468 / 0.32 = 7.71 -> 8 RTX 5090 at $0.35 = $2.80/h, by every policy but random order
    cands = expand_catalog([("rtx5090", 0.35, 0.32, 64)])
    for policy in ("greedy", "greedy_prefix", "exact", "random"):
        a = activate(policy, cands, 2.468)
        assert len(a.selected) == 8 and a.usd_per_hour == pytest.approx(2.8)


def _random_pool(rng: random.Random) -> tuple[list[Candidate], float]:
    types = [("a", 0.22, 0.14), ("b", 0.40, 0.24), ("c", 0.35, 0.32), ("d", 0.79, 0.30), ("e", 2.1, 0.55)]
    cands = [
        Candidate(f"{n}-{j}", n, p * rng.uniform(0.7, 1.3), r * rng.uniform(0.8, 1.2))
        for n, p, r in rng.sample(types, rng.randint(2, 5))
        for j in range(rng.randint(1, 12))
    ]
    return cands, rng.uniform(0.05, 0.7) * math.fsum(c.rollouts_per_s for c in cands)


def test_greedy_near_exact_on_random_pools_and_random_is_worse() -> None:
    rng = random.Random(7)
    ratios, rnd = [], []
    for _ in range(150):
        cands, target = _random_pool(rng)
        opt = exact(cands, target)
        g = greedy(cands, target)
        r = random_nocost(cands, target, rng)
        for a in (opt, g, r):  # every policy reaches the target
            assert a.mu_pool >= target * (1 - 1e-9)
        assert opt.usd_per_hour <= g.usd_per_hour * (1 + 1e-9)  # the optimum is optimal
        assert g.usd_per_hour <= greedy_prefix(cands, target).usd_per_hour * (1 + 1e-9)
        ratios.append(g.usd_per_hour / opt.usd_per_hour)
        rnd.append(r.usd_per_hour / opt.usd_per_hour)
    assert sum(x <= 1.05 for x in ratios) / len(ratios) >= 0.95
    assert sorted(rnd)[len(rnd) // 2] > 1.2  # NoCost pays visibly more at the median


def test_errors_are_clear() -> None:
    with pytest.raises(InfeasibleError, match="catalog is empty"):
        greedy([], 1.0)
    with pytest.raises(InfeasibleError, match="exceeds the whole catalog"):
        exact([_c("A", 1.0, 1.0)], 5.0)
    with pytest.raises(ConfigError, match="usd_per_hour must be > 0"):
        greedy([_c("A", 0.0, 1.0)], 0.5)
    with pytest.raises(ConfigError, match="rollouts_per_s must be > 0"):
        greedy([_c("A", 1.0, -1.0)], 0.5)
    with pytest.raises(ConfigError, match="mu_target"):
        greedy([_c("A", 1.0, 1.0)], 0.0)
    with pytest.raises(ConfigError, match="policy"):
        activate("cheapest", [_c("A", 1.0, 1.0)], 0.5)


def test_random_is_deterministic_under_seed() -> None:
    cands = expand_catalog([("x", 0.3, 0.1, 20), ("y", 1.0, 0.5, 20)])
    a = activate("random", cands, 3.0, seed=3)
    b = activate("random", cands, 3.0, seed=3)
    assert a.selected == b.selected
