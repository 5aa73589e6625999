"""Intake of the learner node: a worker's submission -> validated trajectories in the store.

Validation (``data/submission.py``, the protocol's codec) checks the body against the run's limits
and the newest published version; the verifier (``verify.py``, off the event loop) checks that each
sample answers the leased prompt with its own tokens, is well formed, earned the reward it claims and
claims a version the worker could hold. A drawn fraction of submissions (all of a new identity's until
it has passed ``check_first`` checks, then ``check_fraction`` lowered as the check queue fills; a new
identity's submission at a full queue is refused [check_busy], never admitted unchecked) is
stored *held*, not trainable, and
the worker is answered at once (``pending_check``); the checker, a task with a thread of its own,
re-runs their completions with the claimed version's weights and the lease's seed and releases the
groups (passed) or quarantines the worker (forged); it runs at ``security.check_nice`` (19) and gives
a running update its turn between chunks (``check/turns.py``, ``security.check_duty``; not a new
identity's check, nor one whose claim is at the admission floor): the update comes first, checks use
what it leaves; the queue bound lowers the draw while they wait; the store checks the
lease (exists, this worker's, not answered before, same prompts) and applies the admission rule at the
learner's current version. Every refusal is counted by reason in the store
(``store/rejected/<reason>``); evidence of lying (a forged reward or generation) quarantines the worker
(the node's ``quarantine``: credential revoked, buffered groups purged, leases taken back); any other
refused answer to an open lease expires that lease at once (the lease broker's ``refused``: its prompts
go out again, a strike for the worker); an admission wakes the learner loop. Submissions too stale to
be admitted are not re-run.

Every claimed version can be checked, or the claim is refused, deterministically, before anything is
drawn: a version this learner process never published [unpublished_version] (with kappa = 2 the odd
ones: the learner holds no weights of them), and any claim answering a lease of another run epoch
[stale_epoch]: every learner process on a run directory has an epoch of its own (one more than the last),
carried by its leases and its signed manifests; after a restart a version number may name other weights
than the ones the worker sampled with, so such a generation cannot be re-run (no strike; the lease's
prompts go out again at once). A drawn submission whose version the check does not hold is refused
[unchecked_version] (it cannot happen for an admissible published version: the check keeps them all,
and is told a version before it is announced); a drawn submission pins its version's weights until its
check ran (``GenerationCheck.pin``), so a check, once drawn, always runs, even when the learner's update
moved past its version meanwhile (its groups then pass and are dropped stale, untrained). Held groups
whose check cannot run (the learner stopped) are dropped untrained and counted
(``store/unchecked_dropped``), never trained unchecked.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from echo2.check.rerun import GenerationCheck
from echo2.config import Config, SecurityConfig
from echo2.data.store import Lease, SubmitResult, TrajectoryStore
from echo2.data.submission import Rejected, Submission, SubmissionLimits, validate_submission
from echo2.observe import catalog as m
from echo2.physics.rules import admission_floor
from echo2.protocol import MAX_ID_CHARS, SubmitRequest
from echo2.runtime.registry import WorkerRecord
from echo2.tasks.base import Task
from echo2.tasks.verify import EVIDENCE, Verifier
from echo2.types import Bounds

log = logging.getLogger(__name__)


def yield_to_the_update(nice: int) -> None:
    """Lower the calling thread's priority to ``nice`` (``security.check_nice``; never raised). Linux
    schedules every thread by its own niceness and a thread made later inherits its maker's, so torch's
    compute threads that this thread's first check starts run at it too: the checker then takes the
    cores the update leaves (a check would otherwise take half of them from the update)."""
    if not sys.platform.startswith("linux"):  # elsewhere a thread id is no process id: an equal share
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):  # not allowed: an equal share
        if nice > os.getpriority(os.PRIO_PROCESS, tid):
            os.setpriority(os.PRIO_PROCESS, tid, nice)


def proving(rec: WorkerRecord, security: SecurityConfig) -> bool:
    """A new identity: fewer than ``security.check_first`` of its generation checks passed. Every
    submission of it is drawn, its check does not give the update its turn, it gets no lease while one
    waits (``leases.py``: check_pending) and none is admitted unchecked (check_busy)."""
    return rec.checks_passed < security.check_first


def submission_limits(cfg: Config, task: Task, vocab_size: int) -> SubmissionLimits:
    """What a submission may contain in this run: the model's vocabulary, the group size, the longest
    prompt (the embedded model's context minus the completion budget, else a generous fixed bound)
    and completion (the task's bound), at most one lease's worth of groups, and no sampler log-prob
    below what seeded Gumbel-max can draw at this vocabulary (``security.min_logprob`` when set)."""
    from echo2.rollout.sampling import min_drawn_logprob

    lowest = cfg.security.min_logprob
    max_prompt = max(1, cfg.context_tokens() - cfg.sampling.max_new_tokens)
    max_completion = task.max_completion_tokens(Bounds.of(cfg))
    return SubmissionLimits(
        vocab_size=vocab_size,
        group_size=cfg.batch.group_size,
        max_prompt_tokens=max_prompt,
        max_completion_tokens=max_completion,
        max_groups=cfg.runtime.lease_prompts,
        min_logprob=min_drawn_logprob(vocab_size) if lowest is None else lowest,
    )


@dataclass(frozen=True)
class _Drawn:
    """A drawn submission waiting for its generation check."""

    rec: WorkerRecord  # its worker
    lease: Lease  # the lease it answers (its seed, its prompts)
    sub: Submission  # as the learner graded it
    picks: list[tuple[int, int]]  # the (group, sample) completions to re-run
    late: bool  # it answered a lease that had expired: no return when it passes


class Intake:
    def __init__(
        self,
        *,
        store: TrajectoryStore,
        limits: SubmissionLimits,
        version: Callable[[], int],
        published: Callable[[], int],
        clock: Callable[[], float],
        verifier: Verifier | None = None,
        generation: GenerationCheck | None = None,
        is_published: Callable[[int], bool] = lambda version: True,
        returned: Callable[[str], None] = lambda worker_id: None,
        refused: Callable[[str, str, str], None] = lambda worker_id, lease_id, reason: None,
        struck: Callable[[str, str], None] = lambda worker_id, reason: None,
        quarantine: Callable[[WorkerRecord, Rejected], None] = lambda rec, exc: None,
        quarantined: Callable[[], int] = lambda: 0,
        data_ready: Callable[[], None] = lambda: None,
        epoch: int = 0,
    ) -> None:
        self.store = store
        self.epoch = epoch  # this learner process's run epoch: an answer to a lease of another is refused
        self.returned = returned  # a lease of a worker's came back with admitted work (its standing)
        self.refused = refused  # the answer to an open lease (worker, lease, reason) was refused
        self.struck = struck  # a worker's answer was stale, or its drawn check expired: a strike (reason)
        self.is_published = is_published  # did this learner process publish that version
        self.verifier = verifier  # None: prompts and rewards are taken as claimed (tests without a model)
        self.generation = generation  # None: generations are never re-run
        self.limits = limits
        self.version = version  # the learner's v_t (the trainer's)
        self.published = published  # newest published snapshot version (-1 before the first)
        self.clock = clock
        self.data_ready = data_ready  # the learner loop's wake-up
        self.quarantine = quarantine  # the node's: credential revoked, buffered groups purged, leases back
        self.checked_submissions = 0  # submissions whose generation was re-run (only real re-runs)
        self.quarantined = quarantined  # workers quarantined in this run (the registry's)
        # drawn submissions waiting for the checker (lease id -> arrival, monotonic), and its queue: a
        # proven identity's first (its held groups hold up training and expire), the oldest version first
        self._pending: dict[str, float] = {}
        self._queue: asyncio.PriorityQueue[tuple[tuple[int, int, int], _Drawn]] = asyncio.PriorityQueue()
        self._seq = 0  # arrival order, the queue's last key
        self.check_expired = 0  # drawn submissions whose check could not run before their version left
        self.graded_ties = 0  # drawn submissions dropped for a near tie on a token the grader reads
        self._checker: asyncio.Future[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.check_latency_s = 0.0  # arrival to verdict of the newest checked submission

    async def accept(self, rec: WorkerRecord, body: SubmitRequest) -> SubmitResult:
        """Validate, verify and store one submission of ``rec``; :class:`Rejected` (already counted) if
        refused. Evidence of lying (``verify.EVIDENCE``) also quarantines the worker."""
        lease: Lease | None = None
        picks: list[tuple[int, int]] = []
        try:
            lease = self._lease_named(body)  # the store's own thread
            ours = lease is not None and lease.worker_id == rec.worker_id and lease.state != "submitted"
            mine = lease if ours else None  # a lease of this worker's it may still answer
            if mine is not None and mine.epoch != self.epoch:  # before any version check: the numbers
                # it claims name the earlier process's weights (a "future" or "unpublished" one here is
                # no lie of the worker's)
                raise Rejected(
                    "stale_epoch",
                    f"lease_id: {body.lease_id!r} was issued by the learner process of run epoch "
                    f"{mine.epoch}, this one is {self.epoch}: its version numbers name other weights",
                )
            sub = validate_submission(body, self.limits, self.published())
            if not self.is_published(sub.policy_version):
                raise Rejected(
                    "unpublished_version",
                    f"policy_version: {sub.policy_version} was never published by this learner",
                )
            if mine is not None:  # else the store refuses it, without the expense
                sub, picks = await self._verify(rec, mine, sub)  # the learner's grades from here on
            result: SubmitResult | None = None
            try:
                result = self.store.submit(sub, rec.worker_id, self.version(), self.clock(), hold=bool(picks))
            finally:
                if picks and (result is None or not result.held) and self.generation is not None:
                    self.generation.unpin(sub.policy_version)  # pinned by _verify; no check will run
        except Rejected as exc:
            self.store.record_rejection(exc.reason)
            log.warning("submission from %s rejected: %s", rec.worker_id, exc)
            if exc.reason in EVIDENCE and not rec.quarantined:
                self.quarantine(rec, exc)  # its leases too
            elif lease is not None and lease.worker_id == rec.worker_id and lease.state == "open":
                self.refused(rec.worker_id, lease.lease_id, exc.reason)  # the lease its body names
            raise
        assert lease is not None and result is not None  # the store refuses a submission of no lease
        late = lease.state == "expired"  # its expiry was a strike already; a late answer is no return
        if result.dropped_stale:
            self.struck(rec.worker_id, "stale")  # a stale answer returns nothing: a strike, never a return
        elif result.held:
            self._enqueue(rec, lease, sub, picks, late)  # returned once its check passes
        elif result.admitted:
            rec.rollouts += result.admitted  # what its measured rate counts (a held one's: once passed)
            if not late:
                self.returned(rec.worker_id)
            self.data_ready()
        return result

    def _lease_named(self, body: SubmitRequest) -> Lease | None:
        """The lease a (parsed, maybe refused) submission names, if it names one that exists."""
        if not 1 <= len(body.lease_id) <= MAX_ID_CHARS:
            return None
        return self.store.lease(body.lease_id)

    def metrics(self) -> dict[str, float]:
        """``security/`` metrics: what the generation check re-ran and what it found (docs/security.md)."""
        gen = self.generation
        errors = gen.errors if gen else None
        return {
            m.SECURITY_CHECKED_SUBMISSIONS.key: self.checked_submissions,
            m.SECURITY_CHECKED_TRAJECTORIES.key: gen.checked if gen else 0,
            m.SECURITY_CHECKED_TOKENS.key: gen.tokens if gen else 0,
            m.SECURITY_WORST_PASSING_LOGPROB_ERROR.key: gen.worst_passing_error if gen else 0.0,
            m.SECURITY_POSITION_ERROR_P99.key: errors.quantile(0.99) if errors else 0.0,
            m.SECURITY_POSITION_ERROR_MAX.key: errors.max if errors else 0.0,
            m.SECURITY_QUARANTINED.key: self.quarantined(),
            m.SECURITY_CHECK_BACKLOG.key: len(self._pending),
            m.SECURITY_CHECK_LATENCY_S.key: self.check_latency_s,
            m.SECURITY_CHECK_SHARE.key: self.check_share(),
            m.SECURITY_CHECK_DECLINED.key: gen.declined if gen else 0,
            m.SECURITY_CHECK_EXPIRED.key: self.check_expired,
            m.SECURITY_WAITS_FOR_CHECKS.key: self.store.waits_for_checks,
            m.SECURITY_CHECK_CAPACITY.key: gen.capacity()[0] if gen else 0.0,
            m.SECURITY_CHECK_CAPACITY_TOKENS.key: gen.capacity()[1] if gen else 0.0,
            m.SECURITY_NEAR_TIES.key: gen.near_ties if gen else 0,
            m.SECURITY_NEAR_TIE_ROOM.key: gen.room if gen else 0,
            m.SECURITY_GRADED_TIES.key: self.graded_ties,
        }

    async def _verify(
        self, rec: WorkerRecord, lease: Lease, sub: Submission
    ) -> tuple[Submission, list[tuple[int, int]]]:
        """The deterministic checks (in the request), which give the submission as the learner grades
        it; then whether it is drawn for the generation check: the completions to re-run (none: not
        drawn). A new identity's is drawn whole, and refused at a full queue; a proven identity's with
        :meth:`check_share`. A drawn claim of a version whose weights are not held is refused here, never
        passed."""
        if self.verifier is not None:
            sub = await asyncio.to_thread(self.verifier.check, lease, sub)
        # read after the await: the learner may have moved on meanwhile (the store then drops it stale)
        admissible = sub.policy_version >= admission_floor(self.version(), self.store.staleness)
        if self.generation is None or not admissible:
            return sub, []
        cfg = self.generation.cfg
        full = self.draw(rec)
        new = proving(rec, cfg)
        if new and self.queue_room() <= 0.0:  # never admitted unchecked: a flood makes no stranger trusted
            raise Rejected(
                "check_busy",
                f"the generation check's queue is full ({cfg.check_queue} waiting) and this worker has "
                f"passed {rec.checks_passed} of its first {cfg.check_first} checks: its submission cannot "
                "be checked now (no strike; the lease's prompts go out again)",
            )
        picks = self.generation.pick(sub, full if new else self.check_share(), full)
        if picks and not self.generation.pin(sub.policy_version):  # held until its check ran
            raise Rejected(
                "unchecked_version",
                f"policy_version: {sub.policy_version}: the learner does not hold its weights to "
                "re-run the generation",
            )
        return sub, picks

    def draw(self, rec: WorkerRecord) -> float:
        """The share of ``rec``'s submissions drawn for the generation check while the check queue is
        empty: 1 until it has passed ``security.check_first`` checks (a new identity proves itself
        first: a forger is caught in its first submissions, before the pool has trusted it with much or
        released it), then ``check_fraction``. A new identity's draw stays 1 whatever the backlog: at a
        full queue its submission is refused (``check_busy``, no strike), never admitted unchecked."""
        assert self.generation is not None
        cfg = self.generation.cfg
        return 1.0 if proving(rec, cfg) else cfg.check_fraction

    def queue_room(self) -> float:
        """``1 - backlog / check_queue`` (at least 0): the factor a proven identity's draw is scaled by,
        down to ``check_floor`` and no further (a drawn submission waits beyond the queue, held: never
        admitted unchecked); at 0 a new identity's submission is refused."""
        assert self.generation is not None
        return max(0.0, 1.0 - len(self._pending) / self.generation.cfg.check_queue)

    def check_share(self) -> float:
        """The share of a proven identity's submissions drawn for the generation check now:
        ``max(check_floor, check_fraction x (1 - backlog / check_queue))`` (0 without a check): the
        floor holds whatever the queue does."""
        if self.generation is None:
            return 0.0
        cfg = self.generation.cfg
        return max(cfg.floor(), cfg.check_fraction * self.queue_room())

    def _enqueue(
        self, rec: WorkerRecord, lease: Lease, sub: Submission, picks: list[tuple[int, int]], late: bool
    ) -> None:
        """Queue a drawn submission (its groups stored held) for the checker, started on first use: a
        proven identity's before a new one's, the oldest claimed version first."""
        assert self.generation is not None
        if self._checker is None:
            nice = self.generation.cfg.check_nice
            self._executor = ThreadPoolExecutor(
                1, thread_name_prefix="echo2-check", initializer=lambda: yield_to_the_update(nice)
            )
            self._checker = asyncio.ensure_future(self._run_checks())
        self._pending[lease.lease_id] = time.monotonic()
        rec.checks_waiting += 1  # a new identity gets no lease while it has one waiting (leases.py)
        self._seq += 1
        key = (int(proving(rec, self.generation.cfg)), sub.policy_version, self._seq)
        self._queue.put_nowait((key, _Drawn(rec, lease, sub, picks, late)))

    async def _run_checks(self) -> None:
        """The checker: one drawn submission at a time, on a thread of its own (never the executor the
        update, the publisher or the deterministic checks use); :meth:`_check_one` says what follows a
        verdict."""
        assert self.generation is not None
        while True:
            _, drawn = await self._queue.get()
            try:
                await self._check_one(drawn)
            finally:
                self.check_latency_s = time.monotonic() - self._pending.pop(drawn.lease.lease_id)
                self.generation.unpin(drawn.sub.policy_version)  # pinned when it was drawn
                drawn.rec.checks_waiting -= 1
                self._queue.task_done()

    async def _check_one(self, drawn: _Drawn) -> None:
        """Passed: its groups become trainable, its lease counts as returned (an answer after the lease
        expired: not), its rollouts as admitted. Evidence of a forgery: the worker is quarantined (its
        groups purged). A check that cannot run because its version is no longer held expired: a strike
        for the worker, counted (the rule stands, though a drawn submission's pin keeps its version). A
        near tie on a token the grader reads: dropped, no strike, counted. An error of the check itself:
        dropped. Dropped groups are never trained, counted, their prompts leased again."""
        assert self.generation is not None
        rec, lease, sub = drawn.rec, drawn.lease, drawn.sub
        # due, its check does not give the update its turn (check/turns.py): a new identity's (it gets
        # no lease until the verdict), or a claim at the admission floor (the next update leaves its
        # version behind, and its held groups with it)
        due = functools.partial(self._due, sub.policy_version, proving(rec, self.generation.cfg))
        check = functools.partial(
            self.generation.check, lease, sub, drawn.picks, due, self._graded(lease, sub)
        )
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, check)
        except Rejected as exc:
            self.store.record_rejection(exc.reason)
            log.warning("checked submission from %s rejected: %s", rec.worker_id, exc)
            if exc.reason in EVIDENCE and not rec.quarantined:
                self.quarantine(rec, exc)  # its groups (these held ones too) and leases
            elif exc.reason == "unchecked_version":  # its version left the window before its check ran
                self.check_expired += 1
                self.struck(rec.worker_id, "check_expired")
            elif exc.reason == "graded_tie":
                self.graded_ties += 1
            self.store.drop_held(lease.lease_id)
        except Exception:  # a bug or resource failure of the check itself: the groups go, untrained
            log.exception("the generation check of %s's lease %s failed", rec.worker_id, lease.lease_id)
            self.store.drop_held(lease.lease_id)
        else:
            self.checked_submissions += 1
            rec.checks_passed += 1
            released = self.store.release(lease.lease_id)
            rec.rollouts += released
            if released:
                if not drawn.late:
                    self.returned(rec.worker_id)
                self.data_ready()

    def _graded(self, lease: Lease, sub: Submission) -> Callable[[int, int], int] | None:
        """Where the grader starts reading each completion (``Verifier.graded_from``; None: everywhere)."""
        verifier = self.verifier
        if verifier is None:
            return None
        return lambda i, j: verifier.graded_from(lease.prompts[i], sub.groups[i][j])

    def _due(self, version: int, new: bool) -> bool:
        """A check that cannot wait for the update: of a new identity (``new``: it idles, without a
        lease, until the verdict), or of a claim of ``version`` at the admission floor (the learner's
        next update leaves it)."""
        return new or version <= admission_floor(self.version(), self.store.staleness)

    async def settled(self) -> None:
        """Wait until every drawn submission so far has its verdict."""
        await self._queue.join()

    async def close(self) -> None:
        """Stop the checker; submissions still waiting stay held in the store (the next learner process
        drops them untrained, their prompts leased again: their versions cannot be re-run there)."""
        if self._checker is not None:
            self._checker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checker
            self._checker = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
