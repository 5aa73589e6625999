"""Closed-loop pool controller (SPEC section 5): heartbeats in, activate / release decisions out.

The controller holds no clock and does no I/O: a runtime (or the simulator) feeds it heartbeats
with their timestamps and calls :meth:`PoolController.decide` with the current time. It is the
online form of the greedy policy of :mod:`echo2.planner.activation`:

    mu_pool(t) = sum_i a_i(t) * mu_i(t)

where ``a_i(t) = 1`` for an active worker whose last heartbeat is at most ``heartbeat_timeout_s``
old and ``mu_i(t)`` is an exponentially weighted average of its measured rate over *generating*
time (``rollouts / busy_s`` per heartbeat, weight ``1 - exp(-busy_s / tau)``, ``tau`` =
``rate_halflife_s / ln 2``), starting from the catalog estimate. Time spent installing a snapshot
is not generating time, so the estimate matches mu_i in the capacity model.

Rules (thresholds with hysteresis, sustained deviation, one cool-down):
- lost: an active worker silent for ``heartbeat_timeout_s`` is released ("heartbeat timeout") and
  is not a candidate again until it sends a heartbeat; the timeout already is a sustained
  observation, so the shortfall it causes is acted on at once.
- shortfall: ``mu_pool < (1 - low_band) * mu_target`` continuously for ``sustain_s`` -> activate
  the cheapest idle workers by ``rho_i = c_i / mu_i`` until the estimate reaches ``mu_target``.
- surplus: the most expensive active worker (highest rho) could go and leave
  ``mu_pool - mu_j >= (1 + high_band) * mu_target``, continuously for ``sustain_s``, and no
  activation happened in the last ``cooldown_s`` -> release it (one per call).
Activation fills to 1.0x target but release needs (1 + high_band)x after the release, and a
shortfall needs (1 - low_band)x, so one decision cannot undo the previous one: no flapping.

The thresholds are :class:`echo2.config.ControllerConfig` (the ``[controller]`` section the run and
simulate configs share; its defaults are the only controller defaults).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from echo2.config import ControllerConfig
from echo2.errors import ConfigError
from echo2.planner.activation import Candidate


@dataclass(frozen=True)
class Heartbeat:
    """What a worker reports periodically."""

    worker_id: str  # which worker
    time_s: float  # when it was sent (the caller's clock)
    rollouts: int  # rollouts delivered since the previous heartbeat
    busy_s: float  # seconds spent generating since the previous heartbeat (installing excluded)


@dataclass(frozen=True)
class Decision:
    """One action for the runtime to carry out."""

    action: Literal["activate", "release"]  # start renting / using the worker, or stop
    worker_id: str  # which worker
    reason: str  # "shortfall", "surplus" or "heartbeat timeout"


@dataclass
class _WorkerState:
    candidate: Candidate  # price and catalog estimate
    rate: float  # current mu_i estimate, rollouts/s
    active: bool = False  # a_i as far as the controller decided
    last_heartbeat_s: float = -math.inf  # time of the newest heartbeat
    activated_at_s: float = -math.inf  # when it was last activated
    lost: bool = False  # timed out; not a candidate again until it sends a heartbeat
    measured: bool = False  # at least one heartbeat with generating time arrived

    @property
    def rho(self) -> float:
        return self.candidate.usd_per_hour / self.rate


@dataclass
class PoolController:
    """The closed loop of SPEC section 5. Feed :meth:`observe`, call :meth:`decide`, apply the result."""

    mu_target: float  # rollouts/s the pool must deliver (gamma * mu_min)
    config: ControllerConfig = field(default_factory=ControllerConfig)  # thresholds
    _workers: dict[str, _WorkerState] = field(default_factory=dict, init=False)
    _shortfall_since: float | None = field(default=None, init=False)
    _surplus_since: float | None = field(default=None, init=False)
    _last_activation_s: float = field(default=-math.inf, init=False)
    decisions_made: int = field(default=0, init=False)  # total activate + release decisions so far

    def __post_init__(self) -> None:
        self.set_target(self.mu_target)

    # ---- inputs -------------------------------------------------------------------------------------
    def set_target(self, mu_target: float) -> None:
        """Change mu_target (e.g. after T_train or T_bcast was re-measured)."""
        if not (math.isfinite(mu_target) and mu_target > 0):
            raise ConfigError(f"controller mu_target must be > 0 rollouts/s, got {mu_target!r}")
        self.mu_target = float(mu_target)

    def add_candidate(self, candidate: Candidate, *, active: bool = False, now_s: float = 0.0) -> None:
        """A worker became available (idle) or, with ``active=True``, is already running."""
        if candidate.worker_id in self._workers:
            raise ConfigError(f"worker {candidate.worker_id!r} is already known to the controller")
        if not (math.isfinite(candidate.rollouts_per_s) and candidate.rollouts_per_s > 0):
            raise ConfigError(f"worker {candidate.worker_id!r}: rollouts_per_s must be > 0")
        st = _WorkerState(candidate, candidate.rollouts_per_s, active=active)
        if active:
            st.last_heartbeat_s = now_s
            st.activated_at_s = now_s
        self._workers[candidate.worker_id] = st

    def remove_candidate(self, worker_id: str) -> None:
        """A worker is gone for good (left the marketplace); forget it."""
        self._workers.pop(worker_id, None)

    def observe(self, hb: Heartbeat) -> None:
        """Record one heartbeat: liveness, and the rate measured over its generating time."""
        st = self._workers.get(hb.worker_id)
        if st is None:
            raise ConfigError(f"heartbeat from unknown worker {hb.worker_id!r}; add_candidate it first")
        if hb.rollouts < 0 or hb.busy_s < 0:
            raise ConfigError(f"heartbeat from {hb.worker_id!r}: rollouts and busy_s must be >= 0")
        st.last_heartbeat_s = max(st.last_heartbeat_s, hb.time_s)
        st.lost = False
        if hb.busy_s > 0:
            tau = self.config.rate_halflife_s / math.log(2)
            alpha = 1.0 if self.config.replace_prior and not st.measured else 1.0 - math.exp(-hb.busy_s / tau)
            st.rate += alpha * (hb.rollouts / hb.busy_s - st.rate)
            st.rate = max(st.rate, 1e-9)
            st.measured = True

    def charge_idle(self, worker_id: str, busy_s: float) -> None:
        """``busy_s`` of generating time that delivered nothing (a lease the worker held and never
        answered): a zero-rate sample over it, with no liveness (unlike a heartbeat)."""
        st = self._workers.get(worker_id)
        if st is None or busy_s <= 0:
            return
        tau = self.config.rate_halflife_s / math.log(2)
        st.rate = max(st.rate * math.exp(-busy_s / tau), 1e-9)
        st.measured = True

    # ---- queries ------------------------------------------------------------------------------------
    def known(self) -> set[str]:
        """The workers the controller holds as candidates."""
        return set(self._workers)

    def is_alive(self, worker_id: str, now_s: float) -> bool:
        """a_i(t): active and heard from within the heartbeat timeout (False for a worker not known)."""
        st = self._workers.get(worker_id)
        return st is not None and st.active and now_s - st.last_heartbeat_s <= self.config.heartbeat_timeout_s

    def measured_rate(self, worker_id: str) -> float:
        """Current mu_i estimate of one worker, rollouts/s."""
        return self._workers[worker_id].rate

    def is_lost(self, worker_id: str) -> bool:
        """Timed out and not heard from since (not a candidate until its next heartbeat)."""
        return self._workers[worker_id].lost

    def active_ids(self) -> list[str]:
        """Workers the controller considers active."""
        return [w for w, st in self._workers.items() if st.active]

    def mu_pool(self, now_s: float) -> float:
        """mu_pool(t) = sum_i a_i(t) * mu_i(t)."""
        return math.fsum(st.rate for st in self._alive(now_s))

    def _alive(self, now_s: float) -> Iterator[_WorkerState]:
        """The states :meth:`is_alive` holds alive, in the order they were added (one pass, no lookups)."""
        timeout = self.config.heartbeat_timeout_s
        return (st for st in self._workers.values() if st.active and now_s - st.last_heartbeat_s <= timeout)

    # ---- the loop -----------------------------------------------------------------------------------
    def decide(self, now_s: float) -> list[Decision]:
        """Apply the rules at time ``now_s``; returns the decisions (the runtime must carry them out)."""
        cfg = self.config
        out: list[Decision] = []
        for w, st in self._workers.items():
            if st.active and now_s - st.last_heartbeat_s > cfg.heartbeat_timeout_s:
                st.active = False
                st.lost = True
                out.append(Decision("release", w, "heartbeat timeout"))
        lost = bool(out)
        pool = self.mu_pool(now_s)

        if pool < (1 - cfg.low_band) * self.mu_target:
            if self._shortfall_since is None:
                self._shortfall_since = now_s
            if lost or now_s - self._shortfall_since >= cfg.sustain_s:
                idle = sorted(
                    (st for st in self._workers.values() if not st.active and not st.lost),
                    key=lambda st: (st.rho, -st.rate, st.candidate.worker_id),
                )
                for st in idle:
                    if pool >= self.mu_target:
                        break
                    st.active = True
                    st.activated_at_s = now_s
                    st.last_heartbeat_s = now_s  # grace period: it has a full timeout to report
                    pool += st.rate
                    out.append(Decision("activate", st.candidate.worker_id, "shortfall"))
                self._last_activation_s = now_s
                self._shortfall_since = None
            self._surplus_since = None
        else:
            self._shortfall_since = None
            victim = self._release_candidate(now_s, pool)
            if victim is None:
                self._surplus_since = None
            else:
                if self._surplus_since is None:
                    self._surplus_since = now_s
                sustained = now_s - self._surplus_since >= cfg.sustain_s
                cooled = now_s - self._last_activation_s >= cfg.cooldown_s
                if sustained and cooled:
                    victim.active = False
                    out.append(Decision("release", victim.candidate.worker_id, "surplus"))
                    self._surplus_since = None
        self.decisions_made += len(out)
        return out

    def _release_candidate(self, now_s: float, pool: float) -> _WorkerState | None:
        floor = (1 + self.config.high_band) * self.mu_target
        # the dearest per rollout (rho) whose release keeps the pool above the floor, ties by id: the first
        # of the alive sorted by (-rho, id) that may go, found in one pass
        return min(
            (st for st in self._alive(now_s) if pool - st.rate >= floor),
            key=lambda st: (-st.rho, st.candidate.worker_id),
            default=None,
        )

    def activate_initial(self, worker_ids: Iterable[str], now_s: float) -> None:
        """Mark a planned active set as running (e.g. the planner's greedy choice at t = now)."""
        for w in worker_ids:
            st = self._workers[w]
            st.active = True
            st.activated_at_s = now_s
            st.last_heartbeat_s = now_s
        self._last_activation_s = now_s
