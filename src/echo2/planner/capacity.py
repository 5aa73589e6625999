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
value and says what to change. The rules shared with the simulator and the runtime (kappa from S,
gamma's default, the admission rule, the bubble ratio) live in :mod:`echo2.physics.rules`; broadcast
times in :mod:`echo2.physics.broadcast`.
"""

from __future__ import annotations

import math

from echo2.errors import ConfigError, InfeasibleError
from echo2.physics.rules import DEFAULT_GAMMA, bubble_ratio


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
    """Scheduler target ``mu_target = gamma * mu_min(kappa)`` (gamma >= 1, default ``DEFAULT_GAMMA``)."""
    g = require_positive("gamma", gamma)
    if g < 1:
        raise ConfigError(f"gamma must be >= 1 (slack over mu_min), got {gamma!r}")
    return g * require_positive("mu_min", mu_min_value)


def mu_policed(check_completions_per_s: float, floor: float) -> float:
    """The largest pool rate (rollouts/s) whose drawn share the generation check keeps up with (SPEC §10):
    every rollout is drawn with probability at least ``floor`` and a drawn one waits for its check, so a
    checker re-running ``c`` completions/s polices at most ``c / floor`` rollouts/s. Beyond it drawn
    submissions pile up held, and the learner starves for them."""
    return require_positive("check_completions_per_s", check_completions_per_s) / require_positive(
        "floor", floor
    )


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
    a batch of them; meanwhile the learner advances one version per T_train. It assumes the learner
    trains on those first new-policy rollouts; a first-in-first-out store holding a backlog of older
    admissible rollouts delays them by their queueing time (:func:`staleness_bound_after` with that
    wait added to the latency), and only the admission rule ``Delta <= S`` holds unconditionally.
    """
    b = _non_negative("t_bcast", t_bcast)
    r = require_positive("rollouts_per_step", rollouts)
    mu = require_positive("mu_pool", mu_pool)
    return staleness_bound_after(kappa=kappa, t_train=t_train, latency=b + r / mu)


def staleness_bound_after(*, kappa: int, t_train: float, latency: float) -> int:
    """``Delta_max <= kappa + ceil(latency / T_train) - 1`` when every trained rollout was generated by a
    snapshot whose successor was published at most ``latency`` seconds before that rollout was trained on.

    The successor of the generating version ``v`` is ``v + kappa``; from its publication to the moment
    the rollout is taken the learner completes fewer than ``latency / T_train`` further updates. The
    conservative bound is this with ``latency = T_bcast + R/mu_pool``.
    """
    k = _kappa(kappa)
    t = require_positive("t_train", t_train)
    lat = _non_negative("latency", latency)
    return k + math.ceil(lat / t * (1 - 1e-12)) - 1


def staleness_bound_tight(*, kappa: int, t_train: float, t_bcast: float) -> int:
    """Tightened bound under (1): ``Delta_max <= kappa + ceil((1 - 1/kappa) * T_bcast / T_train)``.

    With kappa = S - 1 and T_bcast < T_train this is <= S.
    """
    k = _kappa(kappa)
    t = require_positive("t_train", t_train)
    b = _non_negative("t_bcast", t_bcast)
    return k + math.ceil((1 - 1 / k) * b / t * (1 - 1e-12))


def cycle_bubble_ratio(*, kappa: int, t_train: float, t_bcast: float, rollouts: int, mu_pool: float) -> float:
    """Steady-state bubble of the serialized cycle model behind (1).

    One publication cycle lasts ``C = max(kappa*T_train, T_bcast + kappa*R/mu_pool)``; the learner
    idles ``C - kappa*T_train`` of it, so the bubble is ``1 - kappa*T_train / C``
    (:func:`echo2.physics.rules.bubble_ratio` over one cycle). Zero exactly when (1) holds, i.e. when
    mu_pool >= mu_min.
    """
    k = _kappa(kappa)
    t = require_positive("t_train", t_train)
    b = _non_negative("t_bcast", t_bcast)
    r = require_positive("rollouts_per_step", rollouts)
    mu = require_positive("mu_pool", mu_pool)
    cycle = max(k * t, b + k * r / mu)
    return bubble_ratio(k * t, cycle)


def cost_per_step(*, usd_per_hour: float, step_seconds: float) -> float:
    """Dollars per learner step: ``(learner $/h + sum of worker $/h) * step seconds / 3600``."""
    return (
        _non_negative("usd_per_hour", usd_per_hour) * require_positive("step_seconds", step_seconds) / 3600.0
    )


def saving(cost: float, baseline_cost: float) -> float:
    """Fractional saving against a baseline: ``1 - cost / baseline_cost``."""
    return 1.0 - _non_negative("cost", cost) / require_positive("baseline_cost", baseline_cost)
