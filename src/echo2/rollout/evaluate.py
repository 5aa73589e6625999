"""Held-out evaluation: greedy completions on a task's eval split, graded by the task."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from echo2.data.tasks.base import Task
from echo2.models.policy import TextCodec
from echo2.rollout.engines.base import Engine
from echo2.types import Prompt


@dataclass(frozen=True)
class EvalResult:
    accuracy: float  # mean reward of greedy completions (share correct for 0/1 rewards)
    unparsed: float  # share of completions the reward function could not parse
    n: int  # prompts evaluated


def evaluate(
    codec: TextCodec, engine: Engine, task: Task, prompts: Sequence[Prompt], batch_size: int = 256
) -> EvalResult:
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
