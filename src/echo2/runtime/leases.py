"""The lease broker of the learner node: which prompts go to which worker, and when to say no.

A lease is granted only (in this order of refusal reasons):
- while the run is not finished                          [finished]
- to a worker the pool controller has active              [inactive]
- that is not benched for leases it left unreturned (``standing.py``)   [benched]
- whose installed weights are of this learner process's run epoch (a version number names weights only
  within its epoch: those of an earlier process may be other weights under the same number) [stale_epoch]
- whose installed version is still admissible (``>= v_t - S``), so it never generates what the
  learner would discard                                   [stale_weights]
- and not newer than ``v_t``: such weights were published by a learner process that crashed after
  its last checkpoint, and this one will publish other weights under the same number  [rolled_back]
- and one this learner process published (so its generation can be re-run)   [unpublished_version]
- to a worker that is not a new identity (fewer than ``security.check_first`` checks passed) with a
  submission waiting for its generation check: a stranger's work goes no further until its first work
  is checked, so however slow the check, a forger is caught at its first forgeries  [check_pending]
- to a worker that holds fewer open leases than its standing allows: 1 on probation, then one more
  per lease returned, up to ``max_leases_per_worker``    [too_many_leases]
- while leased-but-unsubmitted plus buffered rollouts stay within the in-flight budget
  ``min(max_inflight_batches, S + 1) * R`` (what is leased on probation does not count here: the
  workers on probation have an allowance of their own, so neither can crowd out the other); a lease
  that would pass it is cut to the prompts that fit     [buffer_full when not one does]
- and, for a worker whose weights lag the learner's by ``L`` versions, within ``(S + 1 - L) * R``, a
  batch less while an update is under way: its groups queue behind the rollouts leased and buffered
  before them (those leased on probation and held for their check included: once checked they keep
  their place in the queue) and must still be admissible when an update takes them (``_fresh_room``);
  cut to what fits     [stale_weights when not one does: its ``min_version`` is the oldest version
  with room, which the worker installs before it asks again; buffer_full if current weights would not
  fit either]
- for a worker on probation (``standing.py``: nothing returned yet, or a strike since), while all
  workers on probation hold at most ``security.probation_share`` of that budget (open leases and
  groups waiting for their check), and those
  with an unreturned lease on their record at most half of it; room that frees up goes first to the
  workers refused for want of it earlier (first refused, first served, while they keep asking), so
  hoarders cannot keep a newcomer from its first lease for longer than it takes one probation lease
  to come back or expire                                  [probation_full]

A lease on probation has ``security.probation_prompts`` prompts; its time to live halves with every
unreturned lease in a row (``standing.py``). A lease whose answer is refused expires at once: its
prompts go out again, and the worker takes a strike as for an unreturned lease (unless the learner
caused the refusal: a restart, a version it does not hold, a full check queue). A lease counts as
returned only with admitted work (``intake.py``): an answer too stale to admit is a strike, a late one
(after its lease expired, which was its strike) returns nothing. Every lease carries the run epoch of the
learner process that issued it; an answer to a lease of another epoch is refused (``intake.py``).

Each lease assigns a fresh random sampling seed (the worker samples with seeded Gumbel-max under it,
so the learner can re-derive any sampled token, ``check/rerun.py``) and records the version the
worker said it held (a submission claiming an older one is refused).

Prompts come from a :class:`~echo2.runtime.prompts.PromptSource`: those of expired leases and those
whose groups were discarded untrained first, then the epoch (or a stream's draws). The learner's
version is read from one provider (the trainer), never pushed in.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from echo2.config import BatchConfig, RuntimeConfig, SecurityConfig, StalenessConfig
from echo2.data.store import TrajectoryStore
from echo2.physics.rules import admission_floor
from echo2.protocol import LeasedPrompt, LeaseGrant, LeaseRefusal, LeaseRequest
from echo2.runtime.members import Cadence
from echo2.runtime.prompts import PromptSource
from echo2.runtime.standing import Standings

SEED_BITS = 53  # lease seeds stay exact in any JSON reader
# refusals of an answer that are the learner's doing, not the worker's: no strike (intake.py)
NO_FAULT = frozenset({"stale_epoch", "unchecked_version", "check_busy"})


class LeaseBroker:
    def __init__(
        self,
        *,
        store: TrajectoryStore,
        prompts: PromptSource,
        batch: BatchConfig,
        staleness: StalenessConfig,
        runtime: RuntimeConfig,
        version: Callable[[], int],
        is_active: Callable[[str], bool],
        clock: Callable[[], float],
        security: SecurityConfig | None = None,
        standings: Standings | None = None,
        published: Callable[[], set[int]] = set,
        epoch: int = 0,
        proving: Callable[[str], bool] = lambda worker_id: False,
        cadence: Cadence | None = None,
    ) -> None:
        self.store = store
        # how often the fleet is asked to call (the pause a refusal asks for, the probation queue's
        # "still asking"): stretched as the fleet grows
        self.cadence = cadence or Cadence(runtime.heartbeat_s, runtime.heartbeats_per_s, lambda: 0)
        self.proving = proving  # a new identity with a submission waiting for its generation check
        self.epoch = epoch  # this learner process's run epoch: leases carry it, installs of another refuse
        self.prompts = prompts
        self.batch = batch
        self.S = staleness.S
        self.rt = runtime
        self.sec = security or SecurityConfig()
        self.version = version  # the learner's v_t (the trainer's, read on every call)
        self.is_active = is_active  # the pool controller's say
        self.clock = clock
        self.standings = standings or Standings(self.sec.max_unreturned, runtime.lease_ttl_s)
        self.published = published  # the versions this learner process published (empty: not checked)
        self.inflight_cap = int(min(runtime.max_inflight_batches, self.S + 1) * batch.rollouts)
        # rollouts all workers on probation may hold together (at least one probation lease: else nobody
        # could ever pass probation)
        one_lease = self.sec.probation_prompts * batch.group_size
        self.probation_cap = max(int(self.sec.probation_share * self.inflight_cap), one_lease)
        self.struck_cap = max(self.probation_cap // 2, one_lease)  # of which workers with a strike
        self.finished = False  # the run is over: no more leases
        # worker on probation -> when it was first refused for room, in that order (insertion order)
        self._waiting: dict[str, float] = {}

    @property
    def min_version(self) -> int:
        """Oldest generating version still admissible: ``v_t - S`` (SPEC §2)."""
        return admission_floor(self.version(), self.S)

    def grant(self, worker_id: str, req: LeaseRequest) -> LeaseGrant | LeaseRefusal:
        """A lease of up to ``max_prompts`` prompts (fewer on probation), or why not (and when to ask
        again)."""
        now = self.clock()
        self.standings.asked(worker_id, now)
        probation = self.standings.on_probation(worker_id)
        n = min(req.max_prompts, self.rt.lease_prompts, self.sec.probation_prompts if probation else 2**62)
        fit = self._refusal(worker_id, req.installed_version, req.installed_epoch, n, probation, now)
        if isinstance(fit, LeaseRefusal):
            return fit
        self.prompts.redo(self.store.take_redo())  # discarded untrained since the last look: first in line
        prompts = self.prompts.take(fit)
        seed = secrets.randbits(SEED_BITS)  # not the run's seed: workers know that one
        ttl = self.standings.ttl(worker_id)
        lease_id = self.store.issue_lease(
            worker_id, prompts, now, ttl, seed, req.installed_version, self.epoch
        )
        return LeaseGrant(
            lease_id=lease_id,
            epoch=self.epoch,
            prompts=[LeasedPrompt.of(p) for p in prompts],  # their answers stay here: the learner grades
            group_size=self.batch.group_size,
            min_version=self.min_version,
            expires_in_s=ttl,
            seed=seed,
        )

    def _refusal(
        self, worker_id: str, installed: int, epoch: int, n: int, probation: bool, now: float
    ) -> LeaseRefusal | int:
        """Why no lease of ``n`` prompts now, or how many prompts to lease: ``n``, or fewer when only
        fewer fit in the in-flight budget (a lease of whatever fits rather than none: a budget of
        about one lease would otherwise stay locked by the groups buffered below a batch)."""
        retry = self.cadence.retry()
        G = self.batch.group_size
        if self.finished:
            return LeaseRefusal(reason="finished", retry_after_s=retry)
        if not self.is_active(worker_id):
            return LeaseRefusal(reason="inactive", retry_after_s=self.cadence.heartbeat())
        if (bench := self.standings.bench_left(worker_id, now)) > 0:
            return LeaseRefusal(reason="benched", retry_after_s=bench)
        if installed >= 0 and epoch != self.epoch:  # weights of another learner process: numbers name others
            published = self.published()
            newest = max(published) if published else self.min_version
            return LeaseRefusal(reason="stale_epoch", retry_after_s=retry, min_version=newest)
        if installed < self.min_version:
            return LeaseRefusal(reason="stale_weights", retry_after_s=retry, min_version=self.min_version)
        if installed > self.version():  # weights of a learner process that was rolled back to a checkpoint
            return LeaseRefusal(reason="rolled_back", retry_after_s=retry, min_version=self.min_version)
        published = self.published()
        if published and installed not in published:
            newest = max(published)
            return LeaseRefusal(reason="unpublished_version", retry_after_s=retry, min_version=newest)
        if self.proving(worker_id):
            return LeaseRefusal(reason="check_pending", retry_after_s=retry)
        if self.store.open_leases(worker_id) >= self.standings.max_open(
            worker_id, self.rt.max_leases_per_worker
        ):
            return LeaseRefusal(reason="too_many_leases", retry_after_s=retry)
        by_worker = self.store.open_prompts_by_worker()
        on_probation = sum(k for w, k in by_worker.items() if self.standings.on_probation(w)) * G
        # and what workers on probation have waiting for its check (a flood of new identities' submissions
        # holds this share of the budget, not the others')
        on_probation += sum(
            n for w, n in self.store.held_by_worker().items() if self.standings.on_probation(w)
        )
        if probation:  # the probation share is its own: a fast delivering worker cannot crowd it out
            if not self._probation_turn(worker_id, n, now, by_worker, on_probation):
                return LeaseRefusal(reason="probation_full", retry_after_s=retry * 4)
        else:
            outstanding = self.store.outstanding_rollouts()
            room = (self.inflight_cap - (outstanding - on_probation)) // G
            if room < 1:
                return LeaseRefusal(reason="buffer_full", retry_after_s=retry)
            # probation's rollouts are outside the budget but not outside the queue: its groups held for
            # their check keep their place and an update takes them first once checked
            fresh, max_lag = self._fresh_room(installed, outstanding)
            if fresh < 1:  # what it would generate now goes stale behind the rollouts ahead of it
                newest = self.version() - max_lag
                if max_lag < 0 or newest <= installed:  # newer weights would not help: the queue is too long
                    return LeaseRefusal(reason="buffer_full", retry_after_s=retry)
                return LeaseRefusal(reason="stale_weights", retry_after_s=retry, min_version=newest)
            return min(n, room, fresh)
        return n

    def _fresh_room(self, installed: int, ahead: int) -> tuple[int, int]:
        """Prompts a worker holding version ``installed`` may take so that its groups are still admissible
        when an update takes them, and the most lag that would leave room for one group. Updates take
        the oldest groups first (``TrajectoryStore.take_batch``), so the ``ahead`` rollouts leased or
        buffered before it go first, and a group of version ``i`` taken by the update at version ``v``
        is admissible while ``v - i <= S``; an update under way (a batch taken at ``v_t``) moves the
        version on by one without taking any of ``ahead``. With ``L = v_t - i`` its rollouts all fit while
        ``ahead + n G <= (S + 1 - L - u) R``, ``u`` 1 while an update is under way: for current weights
        and an idle learner that is the in-flight budget's ``(S + 1) R``; each version of lag takes one
        batch off it.

        Measured on the default run (``benchmarks/default_run.py``, runtime): without this rule 15.7% of
        the rollouts that reached the learner were dropped as stale (that run shared its cores with other
        work); with ``(S + 1 - L) R`` (the update under way not counted) 14.5%, every one in the buffer,
        in whole leases of workers two or three versions behind."""
        v_t, R = self.version(), self.batch.rollouts
        batches = self.S + 1 - (self.store.taken_at == v_t)  # for current weights
        room = ((batches - max(0, v_t - installed)) * R - ahead) // self.batch.group_size
        return room, batches - -(-(ahead + self.batch.group_size) // R)  # the most lag with room for a group

    def _probation_turn(
        self, worker_id: str, n: int, now: float, by_worker: dict[str, int], held: int
    ) -> bool:
        """Whether a worker on probation may take a lease of ``n`` prompts now: the probation share
        has room beside the ``held`` rollouts leased on probation (half of it for workers with a
        strike), and no worker that was refused for want of room earlier, and still asks, is waiting
        for it (first refused, first served)."""
        G = self.batch.group_size
        room = (self.probation_cap - held) // (n * G)  # probation leases of this size that fit
        if self.standings.struck(worker_id):
            struck = sum(k for w, k in by_worker.items() if self.standings.struck(w))
            room = min(room, (self.struck_cap - struck * G) // (n * G))
        ahead = self._waiting_ahead(worker_id, now, room)
        if room <= ahead:
            self._waiting.setdefault(worker_id, now)
            return False
        self._waiting.pop(worker_id, None)
        return True

    def _waiting_ahead(self, worker_id: str, now: float, room: int) -> int:
        """Waiters refused for room before ``worker_id`` (all of them when it is not waiting) that still
        wait, counted up to ``room`` (past that the answer is no either way). ``_waiting`` keeps the
        order of first refusal, so this walks from its head and stops there or at ``worker_id``: O(room)
        whatever the number of newcomers waiting; a waiter that stopped asking (or left probation) gives
        up its place when the walk passes it."""
        alive = 4 * self.cadence.heartbeat()
        mine = self._waiting.get(worker_id, now)
        ahead, gone = 0, []
        for w, t in self._waiting.items():
            if w == worker_id or ahead >= room or t >= mine:
                break
            if self.standings.asked_within(w, now, alive) and self.standings.on_probation(w):
                ahead += 1
            else:
                gone.append(w)
        for w in gone:
            del self._waiting[w]
        return ahead

    def returned(self, worker_id: str) -> None:
        """A lease of ``worker_id`` came back with admitted work (the intake's say: trainable groups, in
        time)."""
        self.standings.returned_lease(worker_id)

    def struck(self, worker_id: str, reason: str) -> None:
        """An answer of ``worker_id`` returned nothing (``stale``), or a drawn check of it expired
        (``check_expired``): a strike."""
        if reason == "stale":
            self.standings.stale(worker_id, self.clock())
        else:
            self.standings.strike(worker_id, self.clock())

    def refused(self, worker_id: str, lease_id: str, reason: str) -> None:
        """The answer to an open lease of ``worker_id`` was refused: the lease expires now (its prompts
        go out again at once, not after its time to live) and, unless the learner is the cause
        (:data:`NO_FAULT`), the worker takes a strike as for an unreturned lease."""
        prompts = self.store.expire_lease(lease_id)
        self.prompts.again(prompts)
        if prompts and reason not in NO_FAULT:
            self.standings.expired(worker_id, self.clock())

    def expire(self) -> list[tuple[str, float]]:
        """Leases past their deadline give their prompts back for re-issue and cost their workers a
        strike (``standing.py``); returns ``(worker, seconds it held the lease)`` per expired lease."""
        now = self.clock()
        owners = []
        self.prompts.redo(self.store.take_redo())  # discarded untrained: lease them again
        for worker_id, prompts, held_s in self.store.expire_leases_by_worker(now):
            self.prompts.again(prompts)
            self.standings.expired(worker_id, now)
            owners.append((worker_id, held_s))
        return owners
