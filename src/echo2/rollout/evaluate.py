"""Held-out evaluation: greedy completions on a task's eval split, graded by the task."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from echo2.config import Config
from echo2.data.tasks.base import Task
from echo2.data.tasks.environment import EnvironmentTask, is_episodic
from echo2.models.policy import TextCodec
from echo2.rollout.engines.base import Engine
from echo2.rollout.episodes import evaluate_episodes
from echo2.types import Prompt


@dataclass(frozen=True)
class EvalResult:
    accuracy: float  # mean reward of greedy completions (share correct for 0/1 rewards)
    unparsed: float  # share of completions the reward function could not parse
    n: int  # prompts evaluated


def evaluate(
    codec: TextCodec,
    engine: Engine,
    task: Task,
    prompts: Sequence[Prompt],
    batch_size: int = 256,
    *,
    max_context: int = 0,
    max_new_tokens: int = 0,
) -> EvalResult:
    """Greedy held-out evaluation. For an environment task, one greedy episode per prompt:
    ``accuracy`` is then the mean episodic return and ``unparsed`` the share of illegal actions
    (``max_context`` / ``max_new_tokens`` bound its episodes, as in training)."""
    if is_episodic(task):
        assert isinstance(task, EnvironmentTask)
        returns, illegal, decisions = evaluate_episodes(
            codec, engine, task, prompts, max_context=max_context, max_new_tokens=max_new_tokens
        )
        n = len(returns)
        return EvalResult(accuracy=sum(returns) / max(n, 1), unparsed=illegal / max(decisions, 1), n=n)
    rewards: list[float] = []
    unparsed = 0
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        samples = engine.generate([codec.encode_prompt(p.text) for p in chunk], seed=0, greedy=True)
        for p, s in zip(chunk, samples, strict=True):
            grade = task.grade(p, codec.decode_completion(s.completion_ids))
            rewards.append(grade.reward)
            unparsed += not grade.parsed
    n = len(rewards)
    return EvalResult(accuracy=sum(rewards) / max(n, 1), unparsed=unparsed / max(n, 1), n=n)


def evaluate_run(
    cfg: Config, codec: TextCodec, engine: Engine, task: Task, prompts: Sequence[Prompt]
) -> EvalResult:
    """:func:`evaluate` with the run's bounds on an episode (its context and tokens per action)."""
    return evaluate(
        codec,
        engine,
        task,
        prompts,
        max_context=cfg.context_tokens(),
        max_new_tokens=cfg.sampling.max_new_tokens,
    )
