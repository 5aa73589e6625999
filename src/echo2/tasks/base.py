"""The task protocol (SPEC §1, §8): one set of verbs that single-turn tasks and environments both
implement fully, so the learner, the worker, the CLI and the benchmarks never ask which kind a task is.

- :class:`~echo2.types.Bounds` — how long a run lets a completion and a context be.
- :class:`Task` — the data verbs of the adapter (prompts, splits, token mask) and the run verbs:
  ``collect`` (one rollout round of GRPO groups), ``evaluate`` (greedy held-out score), ``verifier``
  (the every-submission check the learner runs on a worker's answers), ``warm_start`` (the embedded
  model's supervised start), ``batch_metrics`` (what a trained batch adds to ``metrics.jsonl``) and
  ``max_completion_tokens`` (the longest completion a submission may carry), plus ``score``, the name
  of what ``evaluate`` measures ("accuracy" for a share of correct answers, "return" for an
  environment's mean episodic return, "chips" for poker's mean chip change per hand in big blinds).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from echo2.envs.base import EnvScore
from echo2.types import Bounds, Prompt, Trajectory

if TYPE_CHECKING:
    from echo2.config import Config
    from echo2.data.tasks.environment import TextPolicy
    from echo2.models.policy import TextCodec
    from echo2.rollout.collect import RolloutBatch
    from echo2.rollout.engines.base import Engine, EosIds
    from echo2.rollout.evaluate import EvalResult
    from echo2.tasks.verify import Verifier

Score = Literal["accuracy"] | EnvScore  # what a task's held-out evaluation measures


class Task(Protocol):
    """What every task of a run does (``single_turn.SingleTurn``, ``episodic.Episodic``)."""

    name: str
    score: Score  # the name of what evaluate() measures

    def sample_train(self, rng: random.Random, n: int) -> list[Prompt]:
        """``n`` training prompts drawn with ``rng`` (never a validation or test problem)."""
        ...

    def train_prompts(self) -> Sequence[Prompt] | None:
        """The whole training split when it is finite (leased in epochs), None for a stream."""
        ...

    def validation_prompts(self, n: int) -> list[Prompt]:
        """The first ``n`` prompts of the fixed validation split (training-time decisions look here)."""
        ...

    def eval_prompts(self, n: int) -> list[Prompt]:
        """The first ``n`` prompts of the fixed test split (reported only)."""
        ...

    def token_mask(self, completion_ids: Sequence[int], meta: dict[str, object]) -> list[float]:
        """Per-token loss weights of a completion, from its metadata (1.0 = trained on)."""
        ...

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
        """One rollout round: ``group_size`` samples of every prompt with the engine's weights (version
        ``policy_version``), rewarded and tagged, group by group. ``opponent_policy`` gives a self-play
        prompt its model opponent (ignored by tasks without opponents). ``grade = False`` on a worker:
        its prompts carry no grading secret, so what only a grader can say is left out (a single-turn
        task's rewards are 0; an episode's return is the environment's, which the learner replays)."""
        ...

    def evaluate(
        self, codec: TextCodec, engine: Engine, prompts: Sequence[Prompt], bounds: Bounds
    ) -> EvalResult:
        """The greedy held-out score on ``prompts`` (its ``accuracy`` field holds :attr:`score`)."""
        ...

    def verifier(self, codec: TextCodec, eos_id: EosIds, bounds: Bounds) -> Verifier:
        """The checks every submission of this task gets on the learner (``verify.py``)."""
        ...

    def warm_start(self, cfg: Config, policy: Any, out: Path) -> dict[str, float | int | str]:
        """Fit the embedded model ``policy`` to this task's reference behaviour, save it under ``out``
        and say how it went (``warm_cache.py`` caches the result)."""
        ...

    def batch_metrics(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """What a trained batch of this task adds to ``metrics.jsonl`` (nothing, or ``env/*``)."""
        ...

    def max_completion_tokens(self, bounds: Bounds) -> int:
        """The longest completion a submission of this task may carry."""
        ...


def outcome_metrics(counts: dict[str, int], seen: dict[str, int]) -> dict[str, float]:
    """``reward/outcomes/<outcome>``: the gradings since ``seen`` (the previous call's ``counts``), by
    outcome, from running ``counts``."""
    from echo2.observe import catalog as m

    return {m.REWARD_OUTCOMES.of(o): float(n - seen.get(o, 0)) for o, n in sorted(counts.items())}
