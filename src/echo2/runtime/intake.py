"""Intake of the learner node: a worker's submission -> validated trajectories in the store.

Validation (``data/submission.py``, the protocol's codec) checks the body against the run's limits
and the newest published version; the verifier (``tasks/verify.py``, off the event loop) checks that
each sample answers the leased prompt with its own tokens, is well formed, earned the reward it claims
and claims a version the worker could hold. The checker (``check/checker.py``) then draws a share of
submissions for the generation check: a drawn one is stored *held*, not trainable, the worker answered
at once (``pending_check``), and its verdict releases the groups or quarantines the worker; one not
drawn from a worker with a drawn one waiting is held behind it (``Checker.follow``). The store
checks the lease (exists, this worker's, not answered before, same prompts) and applies the admission
rule at the learner's current version. Every refusal is counted by reason in the store
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
prompts go out again at once). A drawn claim of a version the check does not hold is refused
[unchecked_version] (it cannot happen for an admissible published version: the check keeps them all,
and is told a version before it is announced).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from echo2.check.checker import IDLE_METRICS, Checker
from echo2.check.rerun import GenerationCheck
from echo2.config import Config
from echo2.data.store import Lease, SubmitResult, TrajectoryStore
from echo2.data.submission import Rejected, Submission, SubmissionLimits, validate_submission
from echo2.observe import catalog as m
from echo2.physics.rules import admission_floor
from echo2.protocol import MAX_ID_CHARS, SubmitRequest
from echo2.runtime.members import WorkerRecord
from echo2.tasks.base import Task
from echo2.tasks.verify import EVIDENCE, Verifier
from echo2.types import Bounds

log = logging.getLogger(__name__)


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
        self.struck = struck  # a worker's answer was stale: a strike (reason)
        self.is_published = is_published  # did this learner process publish that version
        self.verifier = verifier  # None: prompts and rewards are taken as claimed (tests without a model)
        self.limits = limits
        self.version = version  # the learner's v_t (the trainer's)
        self.published = published  # newest published snapshot version (-1 before the first)
        self.clock = clock
        self.data_ready = data_ready  # the learner loop's wake-up
        self.quarantine = quarantine  # the node's: credential revoked, buffered groups purged, leases back
        self.quarantined = quarantined  # workers quarantined in this run (the registry's)
        # the generation check's draw, queue and verdicts (None: generations are never re-run)
        self.checker: Checker | None = None
        if generation is not None:
            self.checker = Checker(
                generation=generation, store=store, version=version, verifier=verifier, returned=returned,
                struck=struck, quarantine=quarantine, data_ready=data_ready,
            )  # fmt: skip

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
            # not drawn, but its member has a drawn one waiting: held behind it (Checker.follow)
            behind = not picks and self.checker is not None and self.checker.behind(rec)
            result: SubmitResult | None = None
            try:
                hold = bool(picks) or behind
                result = self.store.submit(sub, rec.worker_id, self.version(), self.clock(), hold=hold)
            finally:
                if picks and (result is None or not result.held) and self.checker is not None:
                    self.checker.undraw(sub)  # drawn by _verify; no check will run
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
            assert self.checker is not None  # only a drawn submission, or one behind a check, is held
            if picks:
                self.checker.enqueue(rec, lease, sub, picks, late)  # returned once its check passes
            else:
                self.checker.follow(rec, lease, late)  # returned once the checks before it passed
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
        """``security/`` metrics: what the generation check re-ran and found (``check/checker.py``), the
        workers quarantined, the learner's waits for checks (docs/security.md)."""
        return {
            **(self.checker.metrics() if self.checker is not None else IDLE_METRICS),
            m.SECURITY_QUARANTINED.key: self.quarantined(),
            m.SECURITY_WAITS_FOR_CHECKS.key: self.store.waits_for_checks,
        }

    async def _verify(
        self, rec: WorkerRecord, lease: Lease, sub: Submission
    ) -> tuple[Submission, list[tuple[int, int]]]:
        """The deterministic checks (in the request), which give the submission as the learner grades
        it; then, if it is admissible, the completions the checker draws for the generation check (none:
        not drawn; :class:`Rejected` when it cannot be checked, ``Checker.picks``)."""
        if self.verifier is not None:
            sub = await asyncio.to_thread(self.verifier.check, lease, sub)
        # read after the await: the learner may have moved on meanwhile (the store then drops it stale)
        admissible = sub.policy_version >= admission_floor(self.version(), self.store.staleness)
        if self.checker is None or not admissible:
            return sub, []
        return sub, self.checker.picks(rec, sub)

    async def settled(self) -> None:
        """Wait until every drawn submission so far has its verdict."""
        if self.checker is not None:
            await self.checker.settled()

    async def close(self) -> None:
        """Stop the checker (``Checker.close``)."""
        if self.checker is not None:
            await self.checker.close()
