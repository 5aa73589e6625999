"""Cost-aware activation of the registered workers (SPEC §3, §5): the closed-loop controller and what
the pool costs, fed from the worker registry.

Until ``T_train`` has been measured there is no target, and every worker heard from within the
heartbeat timeout is active. Then ``mu_target = gamma * mu_min(kappa)`` from the measured ``T_train``
and ``T_bcast`` (:meth:`Pool.retarget`), and :class:`~echo2.planner.controller.PoolController` activates
the cheapest workers by ``rho_i = c_i / mu_i`` and releases surplus ones; a worker learns its state at
its next heartbeat or lease. Every decision is logged to ``activation.jsonl`` in the run directory.

A worker's measured rate ``mu_i`` counts the rollouts the learner **admitted** from it (never what its
heartbeat claims), over the generating time it reports, which is not believed below
``MIN_BUSY_SHARE`` of the wall time it covers: a lying worker can overstate its rate by at most
``1 / MIN_BUSY_SHARE``, and one that submits nothing measures 0. A quarantined worker is no candidate.

No identity counts before it delivers: a registered worker is on **probation** (active: it may lease,
on the lease broker's probation terms, ``standing.py``) but no candidate of the controller, so its own
rate estimate moves nothing, until rollouts of it were admitted; it then enters the controller with its
first measured rate. (A worker restored from an earlier learner process that had delivered enters with
the small prior ``DEFAULT_RATE`` until measured.) So an identity that registers at 10,000 rollouts/s for
$0.01/h and only heartbeats can never have a delivering worker released as surplus.

A heartbeat keeps a candidate alive only while it works: it holds an open lease, or asked for one
within the heartbeat timeout. One that delivered once and then only heartbeats times out as lost, and
its old rate stops counting. A lease it left unreturned is charged as its time to live of generating
time that delivered nothing (:meth:`Pool.unreturned`), which pulls its measured rate down.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from echo2.config import ControllerConfig, StalenessConfig
from echo2.errors import InfeasibleError
from echo2.logs import SampledLog
from echo2.observe import catalog
from echo2.planner import capacity
from echo2.planner.activation import Candidate
from echo2.planner.controller import Heartbeat, PoolController
from echo2.protocol import HeartbeatRequest
from echo2.runtime.members import DEFAULT_RATE, Cadence, WorkerRecord, WorkerRegistry

log = logging.getLogger(__name__)

ACTIVATION_FILE = "activation.jsonl"
MIN_BUSY_SHARE = 0.5  # generating time claimed below this share of the wall time is not believed


MIN_USEFUL = 0.05  # the pool is never sized for more than 20x the batch (a run whose groups are all flat)
ROUND_S = 1.0  # a heartbeat runs a controller round only when none ran for this long (Pool.tick_due)


class Pool:
    def __init__(
        self,
        registry: WorkerRegistry,
        controller: ControllerConfig,
        staleness: StalenessConfig,
        rollouts_per_step: int,
        learner_usd_per_hour: float,
        run_path: Path,
        clock: Callable[[], float],
        working: Callable[[str], bool] = lambda worker_id: True,
        check: Callable[[], tuple[float, float]] | None = None,
        cadence: Cadence | None = None,
    ) -> None:
        self.registry = registry
        # the fleet's call cadence: the controller's heartbeat timeout stretches with it (tick_due)
        self.cadence = cadence or Cadence(1.0, math.inf, lambda: 0)
        self._controller_config = controller  # as configured: _follow_cadence stretches a copy
        # the generation check's measured capacity (completions/s) and floor: the pool it can police
        self.check = check
        self.mu_check_max: float | None = None  # capacity / floor, once the check has run
        self._capped = SampledLog(log, every_s=60.0, per_window=1)  # a line a minute, not one a round
        self.working = working  # holds an open lease or asked for one lately (the lease broker's say)
        self.staleness = staleness
        self.rollouts = rollouts_per_step
        self.useful = 1.0  # the share of received rollouts a batch can use (retarget's)
        self.learner_usd_per_hour = learner_usd_per_hour
        self.log_path = run_path / ACTIVATION_FILE
        self.clock = clock
        self.controller = PoolController(mu_target=1.0, config=controller)
        self.target_known = False  # until T_train is measured every live worker is active
        self._last_round = -math.inf  # clock of the last controller round (tick)
        self.mu_min: float | None = None  # SPEC §3 mu_min(kappa) from the last measurement
        self.decisions: list[dict[str, Any]] = []  # activation log (also in the run directory)
        self.last_reason: dict[str, str] = {}  # worker -> why the controller last acted on it
        self.probation: set[str] = set()  # registered, nothing admitted yet: no controller candidate

    def enroll(self, rec: WorkerRecord) -> None:
        """A registered (or restored) worker: on probation until it delivers; one restored with admitted
        rollouts goes to the controller at once, active, with the small prior ``DEFAULT_RATE``."""
        if not rec.trusted:
            return
        rec.rate_window = (self.clock(), 0.0, rec.rollouts)  # since, busy_s, admitted then
        if rec.rollouts == 0:
            self.probation.add(rec.worker_id)
            return
        self._candidate(rec, DEFAULT_RATE)

    def _candidate(self, rec: WorkerRecord, rate: float) -> None:
        cand = Candidate(rec.worker_id, rec.hardware or "worker", rec.usd_per_hour, rate)
        self.controller.add_candidate(cand, active=True, now_s=self.clock())

    def observe(self, rec: WorkerRecord, hb: HeartbeatRequest) -> None:
        """A heartbeat: liveness (of a worker that works); and once rollouts of ``rec`` were admitted
        since the last rate sample, a sample of admitted rollouts over the claimed generating time (at
        least ``MIN_BUSY_SHARE`` of the wall time since). A worker on probation leaves it with that
        first sample as its rate."""
        wid, now = rec.worker_id, self.clock()
        since, busy, admitted = rec.rate_window or (now, 0.0, rec.rollouts)
        busy += hb.busy_s
        new = rec.rollouts - admitted
        if new > 0:
            sample = Heartbeat(wid, now, new, max(busy, MIN_BUSY_SHARE * (now - since), 1e-3))
            rec.rate_window = (now, 0.0, rec.rollouts)
        else:
            sample = Heartbeat(wid, now, 0, 0.0)  # liveness only
            rec.rate_window = (since, busy, admitted)
        if wid in self.probation:
            if new <= 0:
                return  # liveness of a probationer is the registry's (last seen)
            self.probation.discard(wid)
            self._candidate(rec, sample.rollouts / sample.busy_s)
            log.info("pool: %s delivered; measured %.1f rollouts/s", wid, sample.rollouts / sample.busy_s)
        if new > 0 or self.working(wid):
            self.controller.observe(sample)

    def unreturned(self, worker_id: str, held_s: float) -> None:
        """A lease of ``worker_id`` expired unanswered after ``held_s``: that long of generating time
        that delivered nothing (its measured rate decays as over any generating time)."""
        if worker_id in self.probation or not self.registry[worker_id].trusted:
            return
        self.controller.charge_idle(worker_id, held_s)

    def quarantine(self, worker_id: str, reason: str) -> None:
        """A worker caught lying leaves the pool for good (the registry revoked its credential)."""
        self.controller.remove_candidate(worker_id)
        self.probation.discard(worker_id)
        rec = self.registry.get(worker_id)
        if rec is not None:
            rec.rate_window = None
        self.last_reason[worker_id] = f"quarantined: {reason}"

    def rate(self, worker_id: str) -> float:
        """The measured mu_i of a worker (0 for one quarantined or on probation)."""
        if not self.registry[worker_id].trusted or worker_id in self.probation:
            return 0.0
        return self.controller.measured_rate(worker_id)

    def active_ids(self) -> list[str]:
        """The registered workers :meth:`is_active` holds active."""
        return [rec.worker_id for rec in self.registry if self.is_active(rec.worker_id)]

    def is_active(self, worker_id: str) -> bool:
        """Before T_train is measured, a worker heard from within the heartbeat timeout; then one the
        controller has active and alive, or one on probation heard from. Constant time (asked on every
        heartbeat, lease and pool-table row, whatever the fleet's size)."""
        seen = self.registry.heard_from(worker_id, self.controller.config.heartbeat_timeout_s)
        if not self.target_known:
            return seen
        return (seen and worker_id in self.probation) or self.controller.is_alive(worker_id, self.clock())

    def retarget(self, t_train_s: float, t_bcast_s: float, useful: float = 1.0) -> None:
        """``mu_target = gamma * mu_min(kappa)`` from measured ``T_train`` and ``T_bcast`` (SPEC §3), for
        the rollouts a batch can use: ``R / useful``, ``useful`` the measured share of received rollouts
        a batch takes (below 1 when zero-variance groups are left out; at least ``MIN_USEFUL``); when no
        pool can hide the broadcast, keep every worker active and say why."""
        kappa = self.staleness.effective_kappa
        self.useful = min(1.0, max(MIN_USEFUL, useful))
        try:  # mu_min is linear in R: the pool for R / useful rollouts a batch is mu_min(R) / useful
            rule = capacity.mu_min(kappa=kappa, t_train=t_train_s, t_bcast=t_bcast_s, rollouts=self.rollouts)
            mu = rule / self.useful
        except InfeasibleError as exc:
            log.warning("capacity model: %s; keeping every worker active", exc)
            return
        target = self._policed(capacity.mu_target(mu, self.staleness.gamma))
        self.mu_min = mu
        if not self.target_known:
            log.info(
                "measured T_train %.3f s, T_bcast %.3f s: mu_target %.1f rollouts/s",
                t_train_s,
                t_bcast_s,
                target,
            )
        self.controller.set_target(target)
        self.target_known = True

    def _policed(self, target: float) -> float:
        """``target``, at most what the generation check can keep at its floor (``capacity.mu_policed``:
        its measured completions/s over ``check_floor``); a pool beyond it would have its drawn
        submissions wait for their checks, so the learner would starve anyway."""
        if self.check is None:
            return target
        done_per_s, floor = self.check()
        if done_per_s <= 0.0 or floor <= 0.0:
            return target
        self.mu_check_max = capacity.mu_policed(done_per_s, floor)
        if target > self.mu_check_max:
            self._capped.log(
                "check_cap",
                "the pool's target %.1f rollouts/s is more than the generation check can keep at its floor "
                "(%.2f completions/s / check_floor %.2f = %.1f rollouts/s): capped there; a faster check "
                "(its own device) or a lower security.check_floor raises it",
                target, done_per_s, floor, self.mu_check_max,
            )  # fmt: skip
            return self.mu_check_max
        return target

    def tick_due(self) -> None:
        """A controller round if none ran in the last ``ROUND_S`` (a heartbeat's: the controller keeps
        deciding while an update holds the training loop, and a thousand members' heartbeats a second
        cost one round a second, not a thousand)."""
        if self.clock() - self._last_round >= ROUND_S:
            self._follow_cadence()
            self.tick()

    def _follow_cadence(self) -> None:
        """Stretch the controller's heartbeat timeout by the fleet's cadence factor (workers of a large
        fleet heartbeat less often: their silence must be read over a longer window)."""
        base = self._controller_config
        timeout = self.cadence.silence(base.heartbeat_timeout_s)
        if timeout != self.controller.config.heartbeat_timeout_s:
            self.controller.config = base.model_copy(update={"heartbeat_timeout_s": timeout})

    def tick(self) -> None:
        """One controller round: carry out and log its decisions (the worker learns at its next call)."""
        self._last_round = self.clock()
        if not self.target_known:
            return
        for d in self.controller.decide(self.clock()):
            entry = {"time_s": round(self.clock(), 3), **asdict(d)}
            self.decisions.append(entry)
            self.last_reason[d.worker_id] = f"{d.action}: {d.reason}"
            log.info("pool: %s %s (%s)", d.action, d.worker_id, d.reason)
            with self.log_path.open("a") as fh:
                fh.write(json.dumps(entry) + "\n")

    def usd_per_hour(self) -> float:
        """Learner plus every active worker, $/h."""
        active = self.active_ids()
        return self.learner_usd_per_hour + math.fsum(self.registry[w].usd_per_hour for w in active)

    def state(self, worker_id: str) -> str:
        """``active``; ``lost`` (heartbeat timeout); ``released`` (the controller's surplus decision);
        before a target exists (or on probation), ``silent`` for a worker not heard from within the
        heartbeat timeout;
        ``quarantined`` for one caught lying; ``retired`` for one retired for silence (members.py)."""
        rec = self.registry[worker_id]
        if rec.quarantined:
            return "quarantined"
        if not rec.trusted:
            return "retired"
        if self.is_active(worker_id):
            return "active"
        if not self.target_known or worker_id in self.probation:
            return "silent"
        return "lost" if self.controller.is_lost(worker_id) else "released"

    def planned_n_min(self) -> int | None:
        """SPEC §3 ``N_min = ceil(mu_min / mu_w)`` with mu_w the mean measured rate of the registered
        workers (None before T_train is measured)."""
        known = self.controller.known()  # once: asked per worker, /api/state was O(N^2) (1.3 s at 10,000)
        rates = [self.rate(r.worker_id) for r in self.registry if r.worker_id in known]
        if self.mu_min is None or not rates:
            return None
        return capacity.n_min(self.mu_min, sum(rates) / len(rates))

    def metrics(self) -> dict[str, float | None]:
        """SPEC §7 ``pool/`` metrics."""
        return {
            catalog.POOL_MU_POOL.key: self.controller.mu_pool(self.clock()),
            catalog.POOL_MU_TARGET.key: self.controller.mu_target if self.target_known else None,
            catalog.POOL_MU_CHECK_MAX.key: self.mu_check_max,
            catalog.POOL_USEFUL_SHARE.key: self.useful,
            catalog.POOL_ACTIVE_WORKERS.key: len(self.active_ids()),
        }
