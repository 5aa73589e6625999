"""Intake of the learner node: a worker's submission -> validated trajectories in the store.

Validation (``data/submission.py``, the protocol's codec) checks the body against the run's limits
and the newest published version; the verifier (``verify.py``, off the event loop) checks that each
sample answers the leased prompt with its own tokens and earned the reward it claims; the store checks
the lease (exists, this worker's, not answered before, same prompts) and applies the admission rule
at the learner's current version. Every refusal
is counted by reason in the store (``store/rejected/<reason>``); an admission wakes the learner loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from echo2.config import Config
from echo2.data.store import SubmitResult, TrajectoryStore
from echo2.data.submission import Rejected, SubmissionLimits, validate_submission
from echo2.protocol import SubmitRequest
from echo2.runtime.registry import WorkerRecord
from echo2.runtime.verify import Verifier

log = logging.getLogger(__name__)

USER_CHECKPOINT_PROMPT_TOKENS = 32768  # longest prompt accepted when the model's context is unknown


def submission_limits(cfg: Config, vocab_size: int) -> SubmissionLimits:
    """What a submission may contain in this run: the model's vocabulary, the group size, the longest
    prompt (the embedded model's context minus the completion budget, else a generous fixed bound)
    and completion, and at most one lease's worth of groups."""
    if cfg.model.path is None:
        max_prompt = max(1, cfg.model.embedded.max_positions - cfg.sampling.max_new_tokens)
    else:
        max_prompt = USER_CHECKPOINT_PROMPT_TOKENS
    return SubmissionLimits(
        vocab_size=vocab_size,
        group_size=cfg.batch.group_size,
        max_prompt_tokens=max_prompt,
        max_completion_tokens=cfg.sampling.max_new_tokens,
        max_groups=cfg.runtime.lease_prompts,
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
    ) -> None:
        self.store = store
        self.verifier = verifier  # None: prompts and rewards are taken as claimed (tests without a model)
        self.limits = limits
        self.version = version  # the learner's v_t (the trainer's)
        self.published = published  # newest published snapshot version (-1 before the first)
        self.clock = clock
        self.data_ready: Callable[[], None] = lambda: None  # the learner loop's wake-up

    async def accept(self, rec: WorkerRecord, body: SubmitRequest) -> SubmitResult:
        """Validate, verify and store one submission of ``rec``; :class:`Rejected` (already counted) if
        refused."""
        try:
            sub = validate_submission(body, self.limits, self.published())
            if self.verifier is not None and self.store.lease_owner(sub.lease_id) == rec.worker_id:
                prompts = self.store.lease_prompts(sub.lease_id)  # the store's own thread
                await asyncio.to_thread(self.verifier.check, prompts, sub)
            result = self.store.submit(sub, rec.worker_id, self.version(), self.clock())
        except Rejected as exc:
            self.store.record_rejection(exc.reason)
            log.warning("submission from %s rejected: %s", rec.worker_id, exc)
            raise
        rec.rollouts += result.admitted
        if result.admitted:
            self.data_ready()
        return result
