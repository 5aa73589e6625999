"""One rollout round of the rollout plane: sample GRPO groups, grade them, tag them with a version.

The synchronous loop calls this once per learner step; a rollout worker calls it with its installed
snapshot's version. Trajectories come out ordered group by group, as the learner expects.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from echo2.data.tasks.base import Adapter, Grade, grade_all
from echo2.models.policy import TextCodec
from echo2.rollout.engines.base import Engine
from echo2.types import Prompt, Trajectory


@dataclass(frozen=True)
class RolloutBatch:
    """Graded, version-tagged groups and what producing them cost."""

    trajectories: list[Trajectory]  # group by group, group_size each
    unparsed: int  # completions the reward function could not parse (reward 0)
    tokens: int  # completion tokens generated
    t_gen_s: float  # wall seconds spent sampling (grading excluded)


def collect_groups(
    codec: TextCodec,
    engine: Engine,
    task: Adapter,
    prompts: Sequence[Prompt],
    group_size: int,
    *,
    seed: int,
    policy_version: int,
    group_prefix: str,
    grade: bool = True,
) -> RolloutBatch:
    """Sample ``group_size`` completions of every prompt with the engine's weights (which are
    version ``policy_version``), grade each with the task (``grade``; a worker does not: its prompts
    carry no answer, the learner grades every completion itself, so its rewards are 0 and its
    completions carry no parse status), and build the trajectories."""
    encoded = [codec.encode(p) for p in prompts]
    t0 = time.perf_counter()
    samples = engine.generate([ids for ids in encoded for _ in range(group_size)], seed=seed)
    t_gen = time.perf_counter() - t0
    trajectories: list[Trajectory] = []
    unparsed = 0
    # a worker grades nothing (its prompts carry no answer): not even decoded; else all at once
    grades: list[Grade | None] = [None] * len(samples)
    if grade:
        texts = [codec.decode_completion(s.completion_ids) for s in samples]
        grades = list(grade_all(task, [(prompts[i // group_size], t) for i, t in enumerate(texts)]))
    for i, (s, graded) in enumerate(zip(samples, grades, strict=True)):
        g = i // group_size
        meta: dict[str, Any] = {}
        reward = 0.0
        if graded is not None:
            unparsed += not graded.parsed
            meta["parsed"], reward = graded.parsed, graded.reward
        meta["finished"] = s.finished
        trajectories.append(
            Trajectory(
                prompt_id=prompts[g].prompt_id,
                group_id=f"{group_prefix}:{g}",
                prompt_ids=tuple(encoded[g]),
                completion_ids=s.completion_ids,
                sampler_logprobs=s.logprobs,
                reward=reward,
                policy_version=policy_version,
                meta=meta,
            )
        )
    return RolloutBatch(
        trajectories=trajectories,
        unparsed=unparsed,
        tokens=sum(len(s.completion_ids) for s in samples),
        t_gen_s=t_gen,
    )
