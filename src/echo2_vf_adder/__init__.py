"""``echo2-vf-adder``: a verifiers (v1) multi-turn environment with a local Python tool, as an ordinary
verifiers env package (its ``Taskset`` and ``Env`` exported in ``__all__``). Nothing in it knows echo2:
echo2 trains on it with ``--task verifiers_env --set task.env=echo2-vf-adder``.

A task is a sum of a few one-digit terms (``"3+4+5="``). A reply ``add A B`` calls the environment's
tool :func:`add`, run host-side in ``run()``, whose result comes back as the next user message
(``"7>"``); any other reply is the final answer, which the task's ``@reward`` compares with the total.
At most ``max_calls`` tool calls; the reply after the last one is the answer.

``adder_teacher`` adds the terms left to right with the tool, then answers: the scripted expert a model
that starts from nothing imitates first.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence

import verifiers.v1 as vf

__all__ = ["AdderEnv", "AdderTaskset", "add", "adder_teacher"]

_INTEGER = re.compile(r"-?\d+")
_CALL = re.compile(r"^\s*add\s+(-?\d{1,6})\s+(-?\d{1,6})\s*$")


def _first_int(text: str) -> int | None:
    got = _INTEGER.search(text)
    return None if got is None else int(got.group())


def add(a: int, b: int) -> int:
    """The environment's tool."""
    return a + b


class AdderData(vf.TaskData):
    total: int


class AdderTask(vf.Task[AdderData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        """1 when the final reply is the total (a reply that is still a tool call is not an answer)."""
        reply = trace.last_reply
        return float(_CALL.match(reply) is None and _first_int(reply) == self.data.total)


class AdderConfig(vf.TasksetConfig):
    n: int = 2048
    terms: int = 3
    max_value: int = 9
    seed: int = 0


class AdderTaskset(vf.Taskset[AdderTask, AdderConfig]):
    def load(self) -> Iterator[AdderTask]:
        c = self.config
        rng = random.Random(c.seed)
        for i in range(c.n):
            terms = [rng.randint(0, c.max_value) for _ in range(c.terms)]
            data = AdderData(name=f"adder#{i}", prompt="+".join(map(str, terms)) + "=", total=sum(terms))
            yield AdderTask(data, c.task)


class AdderEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()
    max_calls: int = 4


class AdderEnv(vf.Env[AdderEnvConfig]):
    async def run(self, task: AdderTask, agents: vf.Agents) -> None:
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            for _ in range(self.config.max_calls):
                call = None if segment.terminated else _CALL.match(segment.last_reply)
                if call is None:
                    break  # a final answer (or the end): the task's reward reads it
                segment = await interaction.turn(f"{add(int(call[1]), int(call[2]))}>")


def adder_teacher(observations: Sequence[str], actions: Sequence[str]) -> str:
    """The next reply of the left-to-right adder: a tool call while terms are left, then the total."""
    terms = [int(t) for t in observations[0].rstrip("=").split("+")]
    if not actions:
        return f"add {terms[0]} {terms[1]}" if len(terms) > 1 else str(terms[0])
    acc = _first_int(observations[-1]) or 0
    return f"add {acc} {terms[len(actions) + 1]}" if len(actions) + 1 < len(terms) else str(acc)
