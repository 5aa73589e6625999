"""A locally defined verifiers (v1) taskset: sums of two numbers, ``"37+45="`` -> ``"82"``, rewarded by
an ``@reward`` function that reads the task's gold answer (the default of ``task.env`` for
``--task verifiers``, and what the tests train on). It is an ordinary verifiers taskset: nothing in it
knows echo2.

    load_taskset(n=4000, max_value=99, seed=0)
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf

_INTEGER = re.compile(r"-?\d+")


class SumData(vf.TaskData):
    answer: str  # the sum, as text: the grading secret (it never leaves the learner)


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        """1 when the reply's first integer is the sum, else 0."""
        got = _INTEGER.search(trace.last_reply)
        return float(got is not None and got.group() == self.data.answer)


class SumsConfig(vf.TasksetConfig):
    n: int = 4000  # tasks, each a distinct pair
    max_value: int = 99  # operands in [0, max_value]
    seed: int = 0


class SumTaskset(vf.Taskset[SumTask, SumsConfig]):
    def load(self) -> Iterator[SumTask]:
        c = self.config
        pairs = [(a, b) for a in range(c.max_value + 1) for b in range(c.max_value + 1)]
        random.Random(c.seed).shuffle(pairs)
        for a, b in pairs[: c.n]:
            yield SumTask(SumData(prompt=f"{a}+{b}=", answer=str(a + b)), c.task)


def load_taskset(n: int = 4000, max_value: int = 99, seed: int = 0) -> SumTaskset:
    """The taskset of ``n`` distinct sums of operands up to ``max_value``."""
    return SumTaskset(SumsConfig(n=n, max_value=max_value, seed=seed))
