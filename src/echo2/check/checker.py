"""The checker of the learner node: which submissions are drawn for the generation check, the queue
they wait in, the thread that re-runs them (``rerun.py``) and what follows each verdict. It is the sole
writer of a member's check bookkeeping (``checks_waiting``, ``checks_passed``).

The draw: every submission of a new identity (fewer than ``security.check_first`` checks passed), then
``check_fraction`` lowered as the check queue fills, down to ``check_floor`` and no further; a new
identity's submission at a full queue is refused [check_busy], never admitted unchecked. A drawn
submission pins its version's weights until its check ran (``GenerationCheck.pin``), so a check, once
drawn, always runs, even when the learner's update moved past its version meanwhile (its groups then
pass and are dropped stale, untrained); a drawn claim of a version whose weights are not held is refused
[unchecked_version].

The queue: a proven identity's submissions first (their held groups hold up training and expire), the
oldest claimed version first. The checker runs one at a time on a thread of its own at
``security.check_nice`` (19) and gives a running update its turn between chunks (``turns.py``,
``security.check_duty``), except a new identity's check (it gets no lease until the verdict) and one
whose claim is at the admission floor (the next update leaves its version behind, and its held groups
with it): the update comes first, checks use what it leaves.

The verdict: passed, the held groups become trainable and the lease counts as returned; evidence of a
forgery quarantines the member (the node's ``quarantine``: credential revoked, buffered groups purged,
leases taken back); a check whose version left the window before it ran expired (a strike); a near tie
on a token the grader reads is dropped without a strike [graded_tie]; an error of the check itself drops
the groups. Dropped groups are never trained, counted, their prompts leased again. Held groups whose
check cannot run (the learner stopped) are dropped untrained by the next learner process and counted
(``store/unchecked_dropped``), never trained unchecked.

Behind a waiting check: a submission of a member that has a drawn one waiting, and is not drawn itself,
is stored held too (:meth:`Checker.follow`) until every check of that member queued before it has its
verdict. It is released if they all passed (or were near ties on graded tokens), dropped untrained
otherwise (a forgery quarantines the member and purges it with the rest; an expired or failed check
drops what waited behind it). So what a member sends after a drawn forgery is never trained, however
long that check waits, and the floor's bound on forgeries trained holds whatever the check's delay: a
forger gets only its undrawn submissions before its first drawn one trained (``docs/security.md``).
Nothing is re-run for it; an honest member's work waits for its own check, not for the others'. The
first ``security.check_behind_free`` of them while a check waits go on at once (counted from when none
waited), a stated addition to the bound.
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
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from echo2.check.rerun import GenerationCheck
from echo2.config import SecurityConfig
from echo2.data.submission import Rejected, Submission
from echo2.observe import catalog as m
from echo2.physics.rules import admission_floor
from echo2.tasks.verify import EVIDENCE, Verifier

if TYPE_CHECKING:
    from echo2.data.store import Lease, TrajectoryStore

log = logging.getLogger(__name__)


class Member(Protocol):
    """What the checker reads and writes of a member's record (``runtime/registry.WorkerRecord``)."""

    worker_id: str
    quarantined: str  # why its credential was revoked ("" while trusted)
    rollouts: int  # rollouts it has had admitted (its measured rate counts them)
    checks_passed: int  # of its submissions, those whose check passed (written here only)
    checks_waiting: int  # of its submissions, those drawn and waiting (written here only)


def proving(rec: Member, security: SecurityConfig) -> bool:
    """A new identity: fewer than ``security.check_first`` of its generation checks passed. Every
    submission of it is drawn, its check does not give the update its turn, it gets no lease while one
    waits (:func:`waiting`) and none is admitted unchecked (check_busy)."""
    return rec.checks_passed < security.check_first


def waiting(rec: Member, security: SecurityConfig) -> bool:
    """A new identity with a submission waiting for its check: it gets no lease until the verdict
    (``runtime/leases.py``: check_pending), so a forger is caught at its first forgeries."""
    return rec.checks_waiting > 0 and proving(rec, security)


def keeper(generation: GenerationCheck | None, S: int) -> Callable[[int, Mapping[str, Any]], None]:
    """What a publication tells the generation check (in a thread: it computes an undo): keep what
    rebuilds the published weights of the versions a submission may still claim (``v >= v_t - S``),
    forget the older ones."""
    if generation is None:
        return lambda version, weights: None

    def keep(v: int, weights: Mapping[str, Any]) -> None:
        generation.keep(v, weights)
        generation.forget_below(admission_floor(v, S))

    return keep


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


@dataclass(frozen=True)
class _Drawn:
    """A drawn submission waiting for its generation check."""

    rec: Member  # its member
    lease: Lease  # the lease it answers (its seed, its prompts)
    sub: Submission  # as the learner graded it
    picks: list[tuple[int, int]]  # the (group, sample) completions to re-run
    late: bool  # it answered a lease that had expired: no return when it passes


@dataclass(frozen=True)
class _Behind:
    """A submission not drawn, held behind checks of its member's that were waiting when it came."""

    lease: Lease  # the lease it answers
    late: bool  # it answered a lease that had expired: no return when it is released
    upto: int  # the newest check of its member's (queue sequence number) it waits for


class Checker:
    """The draw policy, the queue and the checker thread over one :class:`GenerationCheck` (module
    docstring). The store holds a drawn submission's groups *held* until :meth:`release` or drop."""

    def __init__(
        self,
        *,
        generation: GenerationCheck,
        store: TrajectoryStore,
        version: Callable[[], int],
        verifier: Verifier | None = None,
        returned: Callable[[str], None] = lambda worker_id: None,
        struck: Callable[[str, str], None] = lambda worker_id, reason: None,
        quarantine: Callable[[Any, Rejected], None] = lambda rec, exc: None,
        data_ready: Callable[[], None] = lambda: None,
    ) -> None:
        self.generation = generation
        self.cfg = generation.cfg
        self.store = store
        self.version = version  # the learner's v_t (the trainer's)
        self.verifier = verifier  # where the grader reads a completion (None: everywhere)
        self.returned = returned  # a lease of a member's came back with admitted work (its standing)
        self.struck = struck  # a member's drawn check expired: a strike (reason)
        self.quarantine = quarantine  # the node's: credential revoked, buffered groups purged, leases back
        self.data_ready = data_ready  # the learner loop's wake-up
        # drawn submissions waiting (lease id -> arrival, monotonic), and the queue (module docstring)
        self._pending: dict[str, float] = {}
        self._queue: asyncio.PriorityQueue[tuple[tuple[int, int, int], _Drawn]] = asyncio.PriorityQueue()
        self._seq = 0  # arrival order, the queue's last key
        self.checked_submissions = 0  # submissions whose generation was re-run (only real re-runs)
        self.check_expired = 0  # drawn submissions whose check could not run before their version left
        self.graded_ties = 0  # drawn submissions dropped for a near tie on a token the grader reads
        # the checks each member has waiting (queue sequence numbers), and its submissions held behind them
        self._waiting: dict[str, set[int]] = {}
        self._behind: dict[str, list[_Behind]] = {}
        self._free: dict[str, int] = {}  # undrawn submissions admitted while a check of its waited
        self.held_behind = 0  # submissions held behind a waiting check of their member's
        self.dropped_behind = 0  # of those, dropped untrained: a check they waited for failed or expired
        self.latency_s = 0.0  # arrival to verdict of the newest checked submission
        self._task: asyncio.Future[None] | None = None
        self._executor: ThreadPoolExecutor | None = None

    # ---- the draw ---------------------------------------------------------------------------------
    def draw(self, rec: Member) -> float:
        """The share of ``rec``'s submissions drawn while the queue is empty: 1 until it has passed
        ``check_first`` checks (a forger is caught in its first submissions, before the pool has trusted
        it with much), then ``check_fraction``. A new identity's draw stays 1 whatever the backlog: at a
        full queue its submission is refused (``check_busy``, no strike), never admitted unchecked."""
        return 1.0 if proving(rec, self.cfg) else self.cfg.check_fraction

    def queue_room(self) -> float:
        """``1 - backlog / check_queue`` (at least 0): the factor a proven identity's draw is scaled by,
        down to ``check_floor`` and no further; at 0 a new identity's submission is refused."""
        return max(0.0, 1.0 - len(self._pending) / self.cfg.check_queue)

    def check_share(self) -> float:
        """The share of a proven identity's submissions drawn now:
        ``max(check_floor, check_fraction x (1 - backlog / check_queue))``."""
        return max(self.cfg.floor(), self.cfg.check_fraction * self.queue_room())

    def picks(self, rec: Member, sub: Submission) -> list[tuple[int, int]]:
        """The completions of ``sub`` (admissible, as the learner grades it) drawn for the check, their
        version pinned until it ran (none: not drawn); :class:`Rejected` for a new identity's at a full
        queue, or a drawn claim of a version whose weights are not held."""
        full, new = self.draw(rec), proving(rec, self.cfg)
        if new and self.queue_room() <= 0.0:  # never admitted unchecked: a flood makes no stranger trusted
            raise Rejected(
                "check_busy",
                f"the generation check's queue is full ({self.cfg.check_queue} waiting) and this worker "
                f"has passed {rec.checks_passed} of its first {self.cfg.check_first} checks: its "
                "submission cannot be checked now (no strike; the lease's prompts go out again)",
            )
        picks = self.generation.pick(sub, full if new else self.check_share(), full)
        if picks and not self.generation.pin(sub.policy_version):  # held until its check ran
            raise Rejected(
                "unchecked_version",
                f"policy_version: {sub.policy_version}: the learner does not hold its weights to "
                "re-run the generation",
            )
        return picks

    def undraw(self, sub: Submission) -> None:
        """A drawn submission the store did not hold: no check will run (its pin is given back)."""
        self.generation.unpin(sub.policy_version)

    # ---- the queue and the thread ---------------------------------------------------------------------
    def enqueue(
        self, rec: Member, lease: Lease, sub: Submission, picks: list[tuple[int, int]], late: bool
    ) -> None:
        """Queue a drawn submission (its groups stored held), the checker started on first use."""
        if self._task is None:
            nice = self.cfg.check_nice
            self._executor = ThreadPoolExecutor(
                1, thread_name_prefix="echo2-check", initializer=lambda: yield_to_the_update(nice)
            )
            self._task = asyncio.ensure_future(self._run())
        self._pending[lease.lease_id] = time.monotonic()
        rec.checks_waiting += 1
        self._seq += 1
        self._waiting.setdefault(rec.worker_id, set()).add(self._seq)
        key = (int(proving(rec, self.cfg)), sub.policy_version, self._seq)
        self._queue.put_nowait((key, _Drawn(rec, lease, sub, picks, late)))

    def behind(self, rec: Member) -> bool:
        """Whether ``rec``'s next submission, if not drawn, is held behind a drawn one of its own waiting
        for its check (:meth:`follow`): once ``security.check_behind_free`` have been admitted while such
        a check waited (those count here)."""
        wid = rec.worker_id
        if not self._waiting.get(wid):
            return False
        free = self._free.get(wid, 0)
        if free < self.cfg.check_behind_free:
            self._free[wid] = free + 1
            return False
        return True

    def follow(self, rec: Member, lease: Lease, late: bool) -> None:
        """A submission of ``rec`` not drawn, stored held while a check of ``rec``'s waits: released once
        every check of ``rec``'s waiting now passed, dropped if one did not (module docstring)."""
        upto = max(self._waiting[rec.worker_id])
        self._behind.setdefault(rec.worker_id, []).append(_Behind(lease, late, upto))
        self.held_behind += 1

    async def _run(self) -> None:
        """One drawn submission at a time, on a thread of its own (never the executor the update, the
        publisher or the deterministic checks use); :meth:`_check_one` says what follows a verdict."""
        while True:
            (_, _, seq), drawn = await self._queue.get()
            passed = False
            try:
                passed = await self._check_one(drawn)
            finally:
                self.latency_s = time.monotonic() - self._pending.pop(drawn.lease.lease_id)
                self.generation.unpin(drawn.sub.policy_version)  # pinned when it was drawn
                drawn.rec.checks_waiting -= 1
                try:
                    self._settle(drawn.rec, seq, passed)
                finally:  # settled() never waits on a verdict that came
                    self._queue.task_done()

    def _settle(self, rec: Member, seq: int, passed: bool) -> None:
        """After the verdict on ``rec``'s check ``seq``: what waited behind it is dropped if it did not
        pass, released once no earlier check of ``rec``'s waits."""
        waiting = self._waiting.get(rec.worker_id, set())
        waiting.discard(seq)
        first = min(waiting, default=self._seq + 1)  # the oldest check of rec's still waiting
        keep: list[_Behind] = []
        for held in self._behind.pop(rec.worker_id, []):
            if (not passed and held.upto >= seq) or rec.quarantined:
                self.dropped_behind += 1
                self.store.drop_held(held.lease.lease_id)
            elif held.upto < first:
                self._release(rec, held.lease, held.late)
            else:
                keep.append(held)
        if keep:
            self._behind[rec.worker_id] = keep
        if not waiting:
            self._waiting.pop(rec.worker_id, None)
            self._free.pop(rec.worker_id, None)

    def _release(self, rec: Member, lease: Lease, late: bool) -> None:
        """``lease``'s held groups become trainable; the lease counts as returned (unless ``late``)."""
        released = self.store.release(lease.lease_id)
        rec.rollouts += released
        if released:
            if not late:
                self.returned(rec.worker_id)
            self.data_ready()

    async def _check_one(self, drawn: _Drawn) -> bool:
        """The verdict and what follows it (module docstring): whether what waited behind it may go on
        (it passed, or was a near tie on a graded token)."""
        rec, lease, sub = drawn.rec, drawn.lease, drawn.sub
        due = functools.partial(self._due, sub.policy_version, proving(rec, self.cfg))
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
            return exc.reason == "graded_tie"  # no lie found in a tie: what waited behind it goes on
        except Exception:  # a bug or resource failure of the check itself: the groups go, untrained
            log.exception("the generation check of %s's lease %s failed", rec.worker_id, lease.lease_id)
            self.store.drop_held(lease.lease_id)
        else:
            self.checked_submissions += 1
            rec.checks_passed += 1
            self._release(rec, lease, drawn.late)
            return True
        return False

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
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def metrics(self) -> dict[str, float]:
        """``security/`` metrics of the check: what it re-ran and found, its queue and its draw."""
        gen = self.generation
        capacity, capacity_tokens = gen.capacity()
        return {
            m.SECURITY_CHECKED_SUBMISSIONS.key: self.checked_submissions,
            m.SECURITY_CHECKED_TRAJECTORIES.key: gen.checked,
            m.SECURITY_CHECKED_TOKENS.key: gen.tokens,
            m.SECURITY_WORST_PASSING_LOGPROB_ERROR.key: gen.worst_passing_error,
            m.SECURITY_POSITION_ERROR_P99.key: gen.errors.quantile(0.99),
            m.SECURITY_POSITION_ERROR_MAX.key: gen.errors.max,
            m.SECURITY_CHECK_BACKLOG.key: len(self._pending),
            m.SECURITY_CHECK_LATENCY_S.key: self.latency_s,
            m.SECURITY_CHECK_SHARE.key: self.check_share(),
            m.SECURITY_CHECK_DECLINED.key: gen.declined,
            m.SECURITY_CHECK_EXPIRED.key: self.check_expired,
            m.SECURITY_CHECK_CAPACITY.key: capacity,
            m.SECURITY_CHECK_CAPACITY_TOKENS.key: capacity_tokens,
            m.SECURITY_NEAR_TIES.key: gen.near_ties,
            m.SECURITY_NEAR_TIE_ROOM.key: gen.room,
            m.SECURITY_GRADED_TIES.key: self.graded_ties,
            m.SECURITY_HELD_BEHIND.key: self.held_behind,
            m.SECURITY_DROPPED_BEHIND.key: self.dropped_behind,
        }


# the check's metrics of a run without one (every key, at zero)
IDLE_METRICS = {
    metric.key: 0.0
    for metric in (
        m.SECURITY_CHECKED_SUBMISSIONS,
        m.SECURITY_CHECKED_TRAJECTORIES,
        m.SECURITY_CHECKED_TOKENS,
        m.SECURITY_WORST_PASSING_LOGPROB_ERROR,
        m.SECURITY_POSITION_ERROR_P99,
        m.SECURITY_POSITION_ERROR_MAX,
        m.SECURITY_CHECK_BACKLOG,
        m.SECURITY_CHECK_LATENCY_S,
        m.SECURITY_CHECK_SHARE,
        m.SECURITY_CHECK_DECLINED,
        m.SECURITY_CHECK_EXPIRED,
        m.SECURITY_CHECK_CAPACITY,
        m.SECURITY_CHECK_CAPACITY_TOKENS,
        m.SECURITY_NEAR_TIES,
        m.SECURITY_NEAR_TIE_ROOM,
        m.SECURITY_GRADED_TIES,
        m.SECURITY_HELD_BEHIND,
        m.SECURITY_DROPPED_BEHIND,
    )
}
