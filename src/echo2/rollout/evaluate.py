"""Held-out evaluation of a single-turn task: greedy completions graded by the task; the result record
every task's evaluation returns (``Task.evaluate``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from echo2.data.tasks.base import Adapter, grade_all
from echo2.models.policy import TextCodec
from echo2.rollout.engines.base import Engine
from echo2.types import Prompt


@dataclass(frozen=True)
class EvalResult:
    accuracy: float  # the task's score (Task.score): share correct, or an environment's mean return
    unparsed: float  # share of completions the reward function could not parse
    n: int  # prompts evaluated


def evaluate_text(
    codec: TextCodec, engine: Engine, task: Adapter, prompts: Sequence[Prompt], batch_size: int = 256
) -> EvalResult:
    """Greedy held-out evaluation of a single-turn task: one greedy completion per prompt, graded by
    the task (an environment's evaluation plays episodes: ``echo2.tasks.episodic``)."""
    rewards: list[float] = []
    unparsed = 0
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        samples = engine.generate([codec.encode(p) for p in chunk], seed=0, greedy=True)
        texts = [codec.decode_completion(s.completion_ids) for s in samples]
        for grade in grade_all(task, list(zip(chunk, texts, strict=True))):  # at once where the task can
            rewards.append(grade.reward)
            unparsed += not grade.parsed
    n = len(rewards)
    return EvalResult(accuracy=sum(rewards) / max(n, 1), unparsed=unparsed / max(n, 1), n=n)
