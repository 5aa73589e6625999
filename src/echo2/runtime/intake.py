"""Intake of the learner node: a worker's submission -> validated trajectories in the store.

Validation (``data/submission.py``, the protocol's codec) checks the body against the run's limits
and the newest published version; the verifier (``verify.py``, off the event loop) checks that each
sample answers the leased prompt with its own tokens, is well formed, earned the reward it claims and
claims a version the worker could hold; on a drawn fraction of submissions the generation check
re-runs completions with the claimed version's weights and the lease's seed; the store checks the
lease (exists, this worker's, not answered before, same prompts) and applies the admission rule at the
learner's current version. Every refusal is counted by reason in the store
(``store/rejected/<reason>``); evidence of lying (a forged reward or generation) quarantines the worker
(the node's ``quarantine``: credential revoked, buffered groups purged, leases taken back); any other
refused answer to an open lease expires that lease at once (the lease broker's ``refused``: its prompts
go out again, a strike for the worker); an admission wakes the learner loop. Submissions too stale to
be admitted are not re-run.

Every claimed version can be checked, or the claim is refused, deterministically, before anything is
drawn: a version this learner process never published [unpublished_version] (with kappa = 2 the odd
ones: the learner holds no weights of them), and any claim answering a lease issued before this process
started [lease_before_restart] (after a restart from a checkpoint a version number may name other
weights than the ones the worker sampled with, so its generation cannot be re-run; the lease's prompts
go out again when it expires). A drawn submission whose version the check does not hold is refused
[unchecked_version] (it cannot happen for an admissible published version: the check keeps them all).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from echo2.config import Config
from echo2.data.store import Lease, SubmitResult, TrajectoryStore
from echo2.data.submission import Rejected, Submission, SubmissionLimits, validate_submission
from echo2.observe import catalog as m
from echo2.physics.rules import admission_floor
from echo2.protocol import MAX_ID_CHARS, SubmitRequest
from echo2.runtime.registry import WorkerRecord
from echo2.tasks.base import Task
from echo2.tasks.verify import EVIDENCE, GenerationCheck, Verifier
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
        *,
        quarantine: Callable[[WorkerRecord, Rejected], None] = lambda rec, exc: None,
        quarantined: Callable[[], int] = lambda: 0,
        data_ready: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        self.returned = returned  # a worker answered one of its leases (the lease broker's standing)
        self.refused = refused  # the answer to an open lease (worker, lease, reason) was refused
        self.is_published = is_published  # did this learner process publish that version
        self.verifier = verifier  # None: prompts and rewards are taken as claimed (tests without a model)
        self.generation = generation  # None: generations are never re-run
        self.limits = limits
        self.version = version  # the learner's v_t (the trainer's)
        self.published = published  # newest published snapshot version (-1 before the first)
        self.clock = clock
        self.data_ready = data_ready  # the learner loop's wake-up
        self.started = clock()  # leases issued before (by a learner process since rolled back) are not re-run
        self.quarantine = quarantine  # the node's: credential revoked, buffered groups purged, leases back
        self.checked_submissions = 0  # submissions whose generation was re-run (only real re-runs)
        self.quarantined = quarantined  # workers quarantined in this run (the registry's)

    async def accept(self, rec: WorkerRecord, body: SubmitRequest) -> SubmitResult:
        """Validate, verify and store one submission of ``rec``; :class:`Rejected` (already counted) if
        refused. Evidence of lying (``verify.EVIDENCE``) also quarantines the worker."""
        lease = None
        try:
            sub = validate_submission(body, self.limits, self.published())
            lease = self.store.lease(sub.lease_id)  # the store's own thread
            if not self.is_published(sub.policy_version):
                raise Rejected(
                    "unpublished_version",
                    f"policy_version: {sub.policy_version} was never published by this learner",
                )
            if lease is not None and lease.worker_id == rec.worker_id and lease.state != "submitted":
                if lease.issued_at < self.started:
                    raise Rejected(
                        "lease_before_restart",
                        f"lease_id: {sub.lease_id!r} was issued before the learner restarted; its "
                        "version cannot be checked against the weights that number names now",
                    )
                await self._verify(lease, sub)  # else the store refuses it, without the expense
            result = self.store.submit(sub, rec.worker_id, self.version(), self.clock())
        except Rejected as exc:
            self.store.record_rejection(exc.reason)
            log.warning("submission from %s rejected: %s", rec.worker_id, exc)
            if exc.reason in EVIDENCE and not rec.quarantined:
                self.quarantine(rec, exc)  # its leases too
            else:  # the lease it answers: looked up, or (refused before that) the one its body names
                lease = lease or self._lease_named(body)
                if lease is not None and lease.worker_id == rec.worker_id and lease.state == "open":
                    self.refused(rec.worker_id, lease.lease_id, exc.reason)
            raise
        self.returned(rec.worker_id)
        rec.rollouts += result.admitted
        if result.admitted:
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
        return {
            m.SECURITY_CHECKED_SUBMISSIONS.key: self.checked_submissions,
            m.SECURITY_CHECKED_TRAJECTORIES.key: gen.checked if gen else 0,
            m.SECURITY_CHECKED_TOKENS.key: gen.tokens if gen else 0,
            m.SECURITY_WORST_PASSING_LOGPROB_ERROR.key: gen.worst_passing_error if gen else 0.0,
            m.SECURITY_PASSING_TOKEN_MISSES.key: gen.passing_misses if gen else 0,
            m.SECURITY_QUARANTINED.key: self.quarantined(),
        }

    async def _verify(self, lease: Lease, sub: Submission) -> None:
        if self.verifier is not None:
            await asyncio.to_thread(self.verifier.check, lease, sub)
        admissible = sub.policy_version >= admission_floor(self.version(), self.store.staleness)
        if self.generation is not None and admissible:
            picks = self.generation.pick(sub)
            if picks:
                if not self.generation.holds(sub.policy_version):
                    raise Rejected(
                        "unchecked_version",
                        f"policy_version: {sub.policy_version}: the learner does not hold its weights to "
                        "re-run the generation",
                    )
                await asyncio.to_thread(self.generation.check, lease, sub, picks)
                self.checked_submissions += 1  # re-run (a forgery raised above: counted by its reason)
