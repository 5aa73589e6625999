"""A locally defined verifiers (v1) taskset: sums of two numbers, ``"37+45="`` -> ``"82"``, rewarded by
an ``@reward`` function that reads the task's gold answer (the default of ``task.env`` for
``--task verifiers``, and what the tests train on). It is an ordinary verifiers taskset: nothing in it
knows echo2.

    load_taskset(n=4000, max_value=99, seed=0)

``load_judged_taskset(judge_url, ...)``: the same sums with no reward of their own, graded by a plugged
reference judge (verifiers' ``reference``: an LLM judge at an OpenAI-compatible endpoint, asked whether
the reply matches the answer), for ``task.judges = "learner"``.

``load_judged_probe(judge_url, ...)``: the bundled multi-turn env ``echo2-vf-probe`` (higher or lower)
with the same reference judge plugged into its tasks, asked whether the last guess is the hidden number
(on top of the task's own ``@reward``: a right last guess scores 2), for ``--task verifiers_env`` with
``task.judges = "learner"``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf
from verifiers.v1.judges import ReferenceJudgeConfig

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


def _sums(c: SumsConfig) -> Iterator[SumData]:
    pairs = [(a, b) for a in range(c.max_value + 1) for b in range(c.max_value + 1)]
    random.Random(c.seed).shuffle(pairs)
    for a, b in pairs[: c.n]:
        yield SumData(prompt=f"{a}+{b}=", answer=str(a + b))


class SumTaskset(vf.Taskset[SumTask, SumsConfig]):
    def load(self) -> Iterator[SumTask]:
        for data in _sums(self.config):
            yield SumTask(data, self.config.task)


def load_taskset(n: int = 4000, max_value: int = 99, seed: int = 0) -> SumTaskset:
    """The taskset of ``n`` distinct sums of operands up to ``max_value``."""
    return SumTaskset(SumsConfig(n=n, max_value=max_value, seed=seed))


class JudgedSumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    """A sum with no ``@reward``: its task config plugs the judge."""


class JudgedSumsConfig(SumsConfig):
    judge_url: str = ""  # the judge's OpenAI-compatible endpoint (".../v1")
    judge_model: str = "judge"
    judge_key_var: str = "ECHO2_JUDGE_KEY"  # the environment variable holding its key


class JudgedSumTaskset(vf.Taskset[JudgedSumTask, JudgedSumsConfig]):
    def load(self) -> Iterator[JudgedSumTask]:
        c = self.config
        judge = ReferenceJudgeConfig(base_url=c.judge_url, model=c.judge_model, api_key_var=c.judge_key_var)
        task_config = vf.TaskConfig(judges=[judge])
        for data in _sums(c):
            yield JudgedSumTask(data, task_config)


def load_judged_taskset(
    judge_url: str, judge_model: str = "judge", judge_key_var: str = "ECHO2_JUDGE_KEY",
    n: int = 4000, max_value: int = 99, seed: int = 0,
) -> JudgedSumTaskset:  # fmt: skip
    """The sums of :func:`load_taskset`, each graded by a reference judge at ``judge_url``."""
    return JudgedSumTaskset(
        JudgedSumsConfig(
            n=n,
            max_value=max_value,
            seed=seed,
            judge_url=judge_url,
            judge_model=judge_model,
            judge_key_var=judge_key_var,
        )
    )


def load_judged_probe(
    judge_url: str, judge_model: str = "judge", judge_key_var: str = "ECHO2_JUDGE_KEY", n: int = 2048,
    max_value: int = 15,
) -> vf.Env:  # fmt: skip
    """``echo2-vf-probe`` whose tasks a reference judge at ``judge_url`` also grades (the hidden number)."""
    from echo2_vf_probe import ProbeEnv, ProbeEnvConfig

    judge = ReferenceJudgeConfig(
        base_url=judge_url, model=judge_model, api_key_var=judge_key_var, answer_field="secret"
    )
    taskset = {"id": "echo2-vf-probe", "n": n, "max_value": max_value, "task": {"judges": [judge]}}
    return ProbeEnv(ProbeEnvConfig(taskset=taskset))
