"""Single-turn tasks (arithmetic, math): a prompt is a text, a completion is graded by the adapter's
reward function (``echo2.data.tasks``), evaluation is the greedy share of correct answers, verification
re-grades every completion, and the warm start is supervised on the reference answers.

An adapter whose grader can time out (math: ``grade_timeouts``, a running count of this process) has
its count reported per step as ``reward/grade_timeouts``: the gradings since the previous step record.
In the learner process that covers every completion it trains on (the intake re-grades each one) and
its evaluations; a worker's own gradings are counted in the worker process, not here."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from echo2.data.tasks.base import Adapter, CountsOutcomes, Grade
from echo2.observe import catalog as m
from echo2.rollout.collect import RolloutBatch, collect_groups
from echo2.rollout.evaluate import EvalResult, evaluate_text
from echo2.tasks.base import Score, outcome_metrics
from echo2.tasks.verify import Verifier
from echo2.types import Bounds, Prompt, Trajectory

if TYPE_CHECKING:
    from echo2.config import Config
    from echo2.data.tasks.environment import TextPolicy
    from echo2.models.policy import TextCodec
    from echo2.rollout.engines.base import Engine, EosIds


@runtime_checkable
class CountsGradeTimeouts(Protocol):
    """An adapter whose grading runs under a timeout and counts the gradings that ran past it."""

    @property
    def grade_timeouts(self) -> int:
        """Gradings of this process so far that ran past the timeout (each scored 0)."""
        ...


class SingleTurn:
    """The :class:`~echo2.tasks.base.Task` of a text adapter (one prompt, one graded completion)."""

    score: Score = "accuracy"

    def __init__(self, data: Adapter) -> None:
        self.data = data  # prompts, splits and the reward function
        self.name = data.name
        self._timeouts = data if isinstance(data, CountsGradeTimeouts) else None
        self._timeouts_seen = 0  # the count at the previous batch_metrics
        self._outcomes = data if isinstance(data, CountsOutcomes) else None
        self._outcomes_seen: dict[str, int] = {}

    def sample_train(self, rng: random.Random, n: int) -> list[Prompt]:
        return self.data.sample_train(rng, n)

    def train_prompts(self) -> Sequence[Prompt] | None:
        return self.data.train_prompts()

    def validation_prompts(self, n: int) -> list[Prompt]:
        return self.data.validation_prompts(n)

    def eval_prompts(self, n: int) -> list[Prompt]:
        return self.data.eval_prompts(n)

    def token_mask(self, completion_ids: Sequence[int], meta: dict[str, object]) -> list[float]:
        return self.data.token_mask(completion_ids, meta)

    def grade(self, prompt: Prompt, completion: str) -> Grade:
        """The adapter's reward of ``completion`` (a single-turn task's own verb)."""
        return self.data.grade(prompt, completion)

    def collect(
        self,
        codec: TextCodec,
        engine: Engine,
        prompts: Sequence[Prompt],
        group_size: int,
        *,
        seed: int,
        policy_version: int,
        group_prefix: str,
        bounds: Bounds,
        opponent_policy: Callable[[Prompt], TextPolicy | None] | None = None,
        grade: bool = True,
    ) -> RolloutBatch:
        return collect_groups(
            codec,
            engine,
            self.data,
            prompts,
            group_size,
            seed=seed,
            policy_version=policy_version,
            group_prefix=group_prefix,
            grade=grade,
        )

    def evaluate(
        self, codec: TextCodec, engine: Engine, prompts: Sequence[Prompt], bounds: Bounds
    ) -> EvalResult:
        return evaluate_text(codec, engine, self.data, prompts)

    def verifier(self, codec: TextCodec, eos_id: EosIds, bounds: Bounds) -> Verifier:
        return Verifier(codec, self.data, eos_id, bounds.max_new_tokens)

    def warm_start(self, cfg: Config, policy: Any, out: Path) -> dict[str, float | int | str]:
        from echo2.learner.warmstart import supervised

        return supervised(cfg, policy, self.data, out)

    def batch_metrics(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """``reward/grade_timeouts`` (gradings past the timeout since the previous call) for an adapter
        that counts them, ``reward/outcomes/<outcome>`` (gradings since the previous call, by outcome)
        for one that counts outcomes; nothing for the others."""
        out: dict[str, float] = {}
        if self._timeouts is not None:
            now = self._timeouts.grade_timeouts
            new, self._timeouts_seen = now - self._timeouts_seen, now
            out[m.REWARD_GRADE_TIMEOUTS.key] = float(new)
        if self._outcomes is not None:
            counts = self._outcomes.outcome_counts()
            out.update(outcome_metrics(counts, self._outcomes_seen))
            self._outcomes_seen = counts
        return out

    def max_completion_tokens(self, bounds: Bounds) -> int:
        return bounds.max_new_tokens
