"""Environment tasks (poker, guess; SPEC §8): a prompt is an episode seed, a group is ``G`` episodes of
that seed played by ``rollout/episodes.py``, evaluation is the greedy mean episodic return, verification
replays every episode from its seed, and the warm start imitates the environment's scripted teacher."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo2.data.tasks.environment import EnvironmentTask, TextPolicy
from echo2.rollout.collect import RolloutBatch
from echo2.rollout.episodes import collect_episodes, episode_metrics, evaluate_episodes
from echo2.rollout.evaluate import EvalResult
from echo2.tasks.base import Score, outcome_metrics
from echo2.tasks.verify import EpisodeReplay, Verifier
from echo2.types import Bounds, Prompt, Trajectory

if TYPE_CHECKING:
    from echo2.config import Config
    from echo2.models.policy import TextCodec
    from echo2.rollout.engines.base import Engine, EosIds


class Episodic:
    """The :class:`~echo2.tasks.base.Task` of a multi-turn text environment."""

    def __init__(self, data: EnvironmentTask) -> None:
        self.data = data  # episode seeds, splits and the environment's spec
        self.name = data.name
        self.score: Score = data.spec.score
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
        return collect_episodes(
            codec,
            engine,
            self.data,
            prompts,
            group_size,
            seed=seed,
            policy_version=policy_version,
            group_prefix=group_prefix,
            max_context=bounds.max_context,
            max_new_tokens=bounds.max_new_tokens,
            opponent_policy=opponent_policy,
        )

    def evaluate(
        self, codec: TextCodec, engine: Engine, prompts: Sequence[Prompt], bounds: Bounds
    ) -> EvalResult:
        """One greedy episode per prompt: ``accuracy`` holds the mean episodic return and ``unparsed``
        the share of illegal actions."""
        returns, illegal, decisions = evaluate_episodes(
            codec,
            engine,
            self.data,
            prompts,
            max_context=bounds.max_context,
            max_new_tokens=bounds.max_new_tokens,
        )
        n = len(returns)
        return EvalResult(accuracy=sum(returns) / max(n, 1), unparsed=illegal / max(decisions, 1), n=n)

    def verifier(self, codec: TextCodec, eos_id: EosIds, bounds: Bounds) -> Verifier:
        return EpisodeReplay(codec, self.data, eos_id, bounds.max_new_tokens, bounds.max_context)

    def warm_start(self, cfg: Config, policy: Any, out: Path) -> dict[str, float | int | str]:
        from echo2.learner.warmstart import imitate

        return imitate(cfg, policy, self.data, out)

    def batch_metrics(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """The ``env/`` metrics of the batch, and ``reward/outcomes/<outcome>`` of the learner's own
        scorings since the previous call (a verifiers env's judged episodes: judged, judge_error)."""
        counts = self.data.spec.outcome_counts()
        out = {**episode_metrics(trajectories), **outcome_metrics(counts, self._outcomes_seen)}
        self._outcomes_seen = counts
        return out

    def max_completion_tokens(self, bounds: Bounds) -> int:
        return bounds.max_context  # an episode's completion holds every turn after its first observation
