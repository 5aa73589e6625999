"""Cost-aware activation (SPEC section 5): which workers to rent so the pool reaches mu_target.

Objective (a covering knapsack):

    min_{A subset of W} sum_{i in A} c_i   s.t.   sum_{i in A} mu_i >= mu_target

Three policies share one result type:
- :func:`greedy` (the paper's online policy): rank by ``rho_i = c_i / mu_i`` ascending, activate the
  cheapest prefix that reaches the target, then release the most expensive members the target does
  not need (the controller's release rule applied once).
- :func:`exact`: the optimum, as an integer program solved by scipy's ``milp`` (HiGHS); identical
  workers are aggregated into one integer variable per (price, rate) class.
- :func:`random_nocost` ("NoCost" baseline): activate capable workers in random order until the
  target is reached.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import math
import os
import random
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from echo2.errors import ConfigError, InfeasibleError


@dataclass(frozen=True)
class Candidate:
    """One rentable worker as the activation policies see it."""

    worker_id: str  # unique id, e.g. "rtx5090-3"
    type_name: str  # catalog type, e.g. "rtx5090"
    usd_per_hour: float  # c_i, $/h
    rollouts_per_s: float  # mu_i, delivered rollouts/s (catalog estimate or measured)

    @property
    def rho(self) -> float:
        """rho_i = c_i / mu_i: dollars per hour per (rollout/s); lower is better."""
        return self.usd_per_hour / self.rollouts_per_s


@dataclass(frozen=True)
class Activation:
    """An active set chosen by one policy."""

    policy: str  # "greedy", "exact" or "random"
    selected: tuple[Candidate, ...]  # the active set A
    target: float  # mu_target it had to reach, rollouts/s

    @property
    def usd_per_hour(self) -> float:
        """Sum of c_i over A."""
        return math.fsum(c.usd_per_hour for c in self.selected)

    @property
    def mu_pool(self) -> float:
        """Sum of mu_i over A."""
        return math.fsum(c.rollouts_per_s for c in self.selected)

    def counts_by_type(self) -> dict[str, int]:
        """How many workers of each type A holds."""
        out: dict[str, int] = {}
        for c in self.selected:
            out[c.type_name] = out.get(c.type_name, 0) + 1
        return out


def expand_catalog(types: Iterable[tuple[str, float, float, int]]) -> list[Candidate]:
    """Candidates from ``(type_name, usd_per_hour, rollouts_per_s, count)`` rows, ``count`` each."""
    out: list[Candidate] = []
    for name, price, rate, count in types:
        for j in range(count):
            out.append(Candidate(f"{name}-{j}", name, price, rate))
    return out


@contextlib.contextmanager
def _silence_fd1() -> Iterator[None]:
    """Mute C-level stdout for one solver call (HiGHS 1.x prints debug lines there even with disp off)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # no real fd (e.g. captured): nothing to silence
        yield
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(devnull)
        os.close(saved)


def _check(candidates: Sequence[Candidate], target: float) -> None:
    if not math.isfinite(target) or target <= 0:
        raise ConfigError(
            f"activation target mu_target must be a finite number > 0 rollouts/s, got {target!r}"
        )
    if not candidates:
        raise InfeasibleError("the worker catalog is empty: no worker can be activated; add worker types")
    for c in candidates:
        if not (math.isfinite(c.usd_per_hour) and c.usd_per_hour > 0):
            raise ConfigError(f"worker {c.worker_id!r}: usd_per_hour must be > 0, got {c.usd_per_hour!r}")
        if not (math.isfinite(c.rollouts_per_s) and c.rollouts_per_s > 0):
            raise ConfigError(f"worker {c.worker_id!r}: rollouts_per_s must be > 0, got {c.rollouts_per_s!r}")
    total = math.fsum(c.rollouts_per_s for c in candidates)
    if total < target * (1 - 1e-12):
        best = max(candidates, key=lambda c: c.rollouts_per_s)
        more = math.ceil((target - total) / best.rollouts_per_s)
        raise InfeasibleError(
            f"mu_target = {target:.4g} rollouts/s exceeds the whole catalog's {total:.4g} rollouts/s "
            f"({len(candidates)} workers); make >= {more} more {best.type_name!r} available, "
            "or lower the target (raise kappa / S, cut T_bcast)"
        )


def _prune(chosen: list[Candidate], target: float) -> list[Candidate]:
    """Release the most expensive members while the rest still reach ``target``."""
    pool = math.fsum(c.rollouts_per_s for c in chosen)
    released: set[int] = set()
    for i in sorted(range(len(chosen)), key=lambda i: (-chosen[i].usd_per_hour, chosen[i].rollouts_per_s)):
        if pool - chosen[i].rollouts_per_s >= target:
            released.add(i)
            pool -= chosen[i].rollouts_per_s
    return [c for i, c in enumerate(chosen) if i not in released]


def _finishers(ranked: Sequence[Candidate], residuals: Sequence[float]) -> list[int | None]:
    """For each ``j < len(residuals)``: the position of the cheapest worker in ``ranked[j:]`` whose rate
    covers ``residuals[j]`` (the first such in ranked order among equal prices), or None.

    All the queries are known up front (the residuals are the target less the prefix sums), so they are
    answered in one backward sweep over the positions, inserting each worker into a Fenwick tree of
    prefix minima over its rate's rank (fastest first): O(n log n) where asking each position's question
    of the whole suffix was O(n^2), 5 minutes for a plan of 100,000 workers. Positions before the first
    whose residual some later worker can cover are never swept.
    """
    n, m = len(ranked), len(residuals)
    out: list[int | None] = [None] * m
    if m == 0:
        return out
    rates = [c.rollouts_per_s for c in ranked]
    fastest_after = list(itertools.accumulate(reversed(rates), max))[::-1]  # max rate of ranked[j:]
    asked = [j for j in range(m) if residuals[j] <= fastest_after[j]]
    if not asked:
        return out
    ascending = sorted(set(rates))
    k = len(ascending)
    tree: list[tuple[float, int] | None] = [None] * (k + 1)  # prefix minima of (price, position)
    rank = {r: k - i for i, r in enumerate(ascending)}  # 1 = the fastest rate
    todo = set(asked)
    for j in range(n - 1, asked[0] - 1, -1):
        key = (ranked[j].usd_per_hour, j)
        i = rank[rates[j]]
        while i <= k:
            cur = tree[i]
            if cur is None or key < cur:
                tree[i] = key
            i += i & -i
        if j in todo:  # the workers at least as fast as the residual: the k - bisect fastest ranks
            i = k - bisect.bisect_left(ascending, residuals[j])
            best: tuple[float, int] | None = None
            while i > 0:
                cur = tree[i]
                if cur is not None and (best is None or cur < best):
                    best = cur
                i -= i & -i
            out[j] = None if best is None else best[1]
    return out


def greedy_prefix(candidates: Sequence[Candidate], target: float) -> Activation:
    """The paper's policy verbatim: rank by ``rho_i`` ascending and take the shortest prefix reaching
    ``target`` (ties go to the faster worker)."""
    _check(candidates, target)
    ranked = sorted(candidates, key=lambda c: (c.rho, -c.rollouts_per_s, c.worker_id))
    return Activation("greedy_prefix", _prefix_reaching(ranked, target), target)


def greedy(candidates: Sequence[Candidate], target: float) -> Activation:
    """Greedy by rho with a completion step and a pruning pass (the default policy).

    Walk the rho-ranked list as :func:`greedy_prefix` does; before taking each next worker, also
    price the alternative "stop here and finish with the cheapest single remaining worker whose
    mu covers the residual ``target - mu_prefix``". Keep the cheaper of all these finishes, then
    release the most expensive members the target does not need. The prefix is one of the
    alternatives, so this is never worse than the paper's prefix. The finishers are found in O(n log n)
    (:func:`_finishers`); each alternative priced below the best so far is pruned in O(n log n).
    Each alternative is pruned before the costs are compared.
    """
    _check(candidates, target)
    ranked = sorted(candidates, key=lambda c: (c.rho, -c.rollouts_per_s, c.worker_id))
    pools = list(itertools.accumulate((c.rollouts_per_s for c in ranked), initial=0.0))
    # the prefix's last worker (all of them where the sum falls a rounding error short, as _check allows)
    reach = next((j for j in range(len(ranked)) if pools[j + 1] >= target), len(ranked) - 1)
    finishers = _finishers(ranked, [target - pools[j] for j in range(reach + 1)])
    best: list[Candidate] | None = None
    best_cost = math.inf
    cost = priciest = 0.0  # the prefix's cost, and its most expensive member (what pruning can save)
    for j in range(reach + 1):
        f = finishers[j]
        if f is not None and cost + ranked[f].usd_per_hour < best_cost + priciest:
            option = _prune([*ranked[:j], ranked[f]], target)
            option_cost = math.fsum(d.usd_per_hour for d in option)
            if option_cost < best_cost:
                best, best_cost = option, option_cost
        cost += ranked[j].usd_per_hour
        priciest = max(priciest, ranked[j].usd_per_hour)
    option = _prune(list(ranked[: reach + 1]), target)
    option_cost = math.fsum(d.usd_per_hour for d in option)
    if option_cost < best_cost:
        best = option
    assert best is not None  # feasibility was checked: the full prefix reaches the target
    return Activation("greedy", tuple(best), target)


def exact(candidates: Sequence[Candidate], target: float) -> Activation:
    """The optimum of the covering knapsack as an integer program (scipy ``milp``, HiGHS).

    Variables ``x_k in {0..n_k}`` count the workers taken from class k (same price and rate);
    minimize ``sum_k c_k x_k`` subject to ``sum_k mu_k x_k >= target``.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    _check(candidates, target)
    classes: dict[tuple[float, float], list[Candidate]] = {}
    for c in candidates:
        classes.setdefault((c.usd_per_hour, c.rollouts_per_s), []).append(c)
    keys = list(classes)
    price = np.array([k[0] for k in keys])
    rate = np.array([k[1] for k in keys])
    upper = np.array([len(classes[k]) for k in keys], dtype=float)
    with _silence_fd1():
        res = milp(
            c=price,
            constraints=LinearConstraint(rate[None, :], lb=target, ub=np.inf),
            integrality=np.ones(len(keys)),
            bounds=Bounds(np.zeros(len(keys)), upper),
            options={"mip_rel_gap": 1e-7},
        )
    if res.x is None:  # pragma: no cover - feasibility was checked above
        raise InfeasibleError(f"the exact solver found no active set reaching {target:.4g} rollouts/s")
    chosen: list[Candidate] = []
    for k, x in zip(keys, res.x, strict=True):
        chosen.extend(classes[k][: round(x)])
    return Activation("exact", tuple(chosen), target)


def random_nocost(candidates: Sequence[Candidate], target: float, rng: random.Random) -> Activation:
    """The "NoCost" baseline: activate capable workers in random order until the target is reached."""
    _check(candidates, target)
    order = list(candidates)
    rng.shuffle(order)
    return Activation("random", _prefix_reaching(order, target), target)


def _prefix_reaching(ordered: Sequence[Candidate], target: float) -> tuple[Candidate, ...]:
    """The shortest prefix of ``ordered`` whose summed throughput reaches ``target``."""
    chosen: list[Candidate] = []
    pool = 0.0
    for c in ordered:
        if pool >= target:
            break
        chosen.append(c)
        pool += c.rollouts_per_s
    return tuple(chosen)


def activate(policy: str, candidates: Sequence[Candidate], target: float, seed: int = 0) -> Activation:
    """Dispatch by policy name: ``greedy``, ``exact`` or ``random``."""
    if policy == "greedy":
        return greedy(candidates, target)
    if policy == "greedy_prefix":
        return greedy_prefix(candidates, target)
    if policy == "exact":
        return exact(candidates, target)
    if policy == "random":
        return random_nocost(candidates, target, random.Random(seed))
    raise ConfigError(
        f"activation policy must be one of greedy, greedy_prefix, exact, random; got {policy!r}"
    )
