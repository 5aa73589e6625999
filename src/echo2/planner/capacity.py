"""Capacity model of ECHO-2 (SPEC section 3): pure equations, no I/O, no clock.

Symbols (SPEC section 3):
    R        rollouts per learner update (prompts x group size)
    T_train  seconds per learner update
    T_bcast  seconds from publication until a fraction q = 1/gamma of active workers installed the
             snapshot (reload included)
    kappa    publication period in updates (a snapshot every kappa updates)
    S        staleness budget: only rollouts with version v >= v_t - S are admitted
    mu_i     delivered rollouts/s of worker i; c_i its price in $/h; rho_i = c_i / mu_i
    mu_pool  sum of mu_i over the active set

Every function validates its inputs and raises :class:`echo2.errors.ConfigError` (a bad value) or
:class:`echo2.errors.InfeasibleError` (a valid value with no solution) with a message that names the
value and says what to change.
"""

from __future__ import annotations

import math

from echo2.errors import ConfigError, InfeasibleError

DEFAULT_GAMMA = 1.1  # SPEC section 3: mu_target = gamma * mu_min


def require_positive(name: str, value: float) -> float:
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _non_negative(name: str, value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _kappa(kappa: int) -> int:
    if int(kappa) != kappa or kappa < 1:
        raise ConfigError(f"kappa (publication period) must be an integer >= 1, got {kappa!r}")
    return int(kappa)


def kappa_from_staleness(staleness: int) -> int:
    """Default coupling of SPEC section 2: ``kappa = max(1, S - 1)``.

    S is the one user-facing knob; S = 0 (synchronous) and S = 1 and S = 2 all give kappa = 1.
    """
    if int(staleness) != staleness or staleness < 0:
        raise ConfigError(f"staleness S must be an integer >= 0, got {staleness!r}")
    return max(1, int(staleness) - 1)


def overlap_holds(*, kappa: int, t_train: float, t_bcast: float, rollouts: int, mu_pool: float) -> bool:
    """Overlap condition (1): ``kappa*T_train >= T_bcast + kappa*R / mu_pool``.

    True when, within one publication cycle of kappa updates, the snapshot reaches the pool and the
    pool then generates the kappa*R rollouts those updates consume, so the learner never waits.
    """
    k = _kappa(kappa)
    t = require_positive("t_train", t_train)
    b = _non_negative("t_bcast", t_bcast)
    r = require_positive("rollouts_per_step", rollouts)
    mu = require_positive("mu_pool", mu_pool)
    return k * t >= b + k * r / mu


def mu_min(*, kappa: int, t_train: float, t_bcast: float, rollouts: int) -> float:
    """Provisioning rule (2): ``mu_min(kappa) = kappa*R / (kappa*T_train - T_bcast)`` in rollouts/s.

    Valid only when ``kappa*T_train > T_bcast``; otherwise no pool, however large, hides the
    broadcast, and :class:`InfeasibleError` says which knob to turn.
    """
    k = _kappa(kappa)
    t = require_positive("t_train", t_train)
    b = _non_negative("t_bcast", t_bcast)
    r = require_positive("rollouts_per_step", rollouts)
    window = k * t - b
    if window <= 0:
        need_kappa = math.floor(b / t) + 1
        raise InfeasibleError(
            f"kappa*T_train = {k}*{t:g} s = {k * t:g} s <= T_bcast = {b:g} s: "
            "the broadcast cannot be hidden; "
            f"raise kappa to >= {need_kappa} (staleness S >= {need_kappa + 1}) "
            f"or cut T_bcast below {k * t:g} s "
            "(faster links, tree-pipelined broadcast, smaller snapshot)"
        )
    return k * r / window


def mu_target(mu_min_value: float, gamma: float = DEFAULT_GAMMA) -> float:
    """Scheduler target ``mu_target = gamma * mu_min(kappa)`` (gamma >= 1, default 1.1)."""
    g = require_positive("gamma", gamma)
    if g < 1:
        raise ConfigError(f"gamma must be >= 1 (slack over mu_min), got {gamma!r}")
    return g * require_positive("mu_min", mu_min_value)


def n_min(mu_min_value: float, worker_rate: float) -> int:
    """Homogeneous pool: ``N_min = ceil(mu_min / mu_w)`` workers of rate ``mu_w`` rollouts/s.

    A tiny relative tolerance (1e-9) keeps exact multiples from rounding up on float noise.
    """
    m = require_positive("mu_min", mu_min_value)
    w = require_positive("worker_rate", worker_rate)
    return max(1, math.ceil(m / w * (1 - 1e-9)))


def staleness_bound_conservative(
    *, kappa: int, t_train: float, t_bcast: float, rollouts: int, mu_pool: float
) -> int:
    """Conservative bound: ``Delta_max <= kappa + ceil((T_bcast + R/mu_pool) / T_train) - 1``.

    Worst case: no new-policy rollouts until dissemination completes, then R/mu_pool seconds to make
    a batch of them; meanwhile the learner advances one version per T_train.
    """
    k = _kappa(kappa)
    t = require_positive("t_train", t_train)
    b = _non_negative("t_bcast", t_bcast)
    r = require_positive("rollouts_per_step", rollouts)
    mu = require_positive("mu_pool", mu_pool)
    return k + math.ceil((b + r / mu) / t * (1 - 1e-12)) - 1


def staleness_bound_tight(*, kappa: int, t_train: float, t_bcast: float) -> int:
    """Tightened bound under (1): ``Delta_max <= kappa + ceil((1 - 1/kappa) * T_bcast / T_train)``.

    With kappa = S - 1 and T_bcast < T_train this is <= S.
    """
    k = _kappa(kappa)
    t = require_positive("t_train", t_train)
    b = _non_negative("t_bcast", t_bcast)
    return k + math.ceil((1 - 1 / k) * b / t * (1 - 1e-12))


def bubble_ratio(t_idle: float, t_train_active: float) -> float:
    """Learner bubble ratio ``T_idle / (T_idle + T_train_active)``; 0 when both are 0."""
    idle = _non_negative("t_idle", t_idle)
    active = _non_negative("t_train_active", t_train_active)
    total = idle + active
    return idle / total if total > 0 else 0.0


def cycle_bubble_ratio(*, kappa: int, t_train: float, t_bcast: float, rollouts: int, mu_pool: float) -> float:
    """Steady-state bubble of the serialized cycle model behind (1).

    One publication cycle lasts ``C = max(kappa*T_train, T_bcast + kappa*R/mu_pool)``; the learner
    idles ``C - kappa*T_train`` of it, so the bubble is ``1 - kappa*T_train / C``. Zero exactly when
    (1) holds, i.e. when mu_pool >= mu_min.
    """
    k = _kappa(kappa)
    t = require_positive("t_train", t_train)
    b = _non_negative("t_bcast", t_bcast)
    r = require_positive("rollouts_per_step", rollouts)
    mu = require_positive("mu_pool", mu_pool)
    cycle = max(k * t, b + k * r / mu)
    return 1.0 - k * t / cycle


def cost_per_step(*, usd_per_hour: float, step_seconds: float) -> float:
    """Dollars per learner step: ``(learner $/h + sum of worker $/h) * step seconds / 3600``."""
    return (
        _non_negative("usd_per_hour", usd_per_hour) * require_positive("step_seconds", step_seconds) / 3600.0
    )


def saving(cost: float, baseline_cost: float) -> float:
    """Fractional saving against a baseline: ``1 - cost / baseline_cost``."""
    return 1.0 - _non_negative("cost", cost) / require_positive("baseline_cost", baseline_cost)
