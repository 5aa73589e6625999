"""``echo2-vf-probe``: a verifiers (v1) multi-turn environment, higher or lower, as an ordinary verifiers
env package (its ``Taskset`` and ``Env`` exported in ``__all__``; the id is the package's name). Nothing
in it knows echo2: echo2 trains on it with ``--task verifiers_env`` (``echo2/envs/verifiers_turns.py``).

A task hides a number in ``0..max_value``; the player's first reply is a guess, and the environment
(host-side, in ``run()``, as verifiers' TextArena games step their engine) answers ``higher``, ``lower``
or ``?`` until a guess is right or ``max_guesses`` were made. The task's ``@reward`` pays 1 when the last
reply names the number.

``probe_teacher`` is binary search over what the answers so far leave open: the scripted expert a
model that starts from nothing (echo2's embedded one) imitates first.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence

import verifiers.v1 as vf

__all__ = ["ProbeEnv", "ProbeTaskset", "probe_teacher"]

_INTEGER = re.compile(r"-?\d+")


def _first_int(text: str) -> int | None:
    got = _INTEGER.search(text)
    return None if got is None else int(got.group())


class ProbeData(vf.TaskData):
    secret: int  # the hidden number
    max_value: int


class ProbeTask(vf.Task[ProbeData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def found(self, trace: vf.Trace) -> float:
        """1 when the last reply names the hidden number."""
        return float(_first_int(trace.last_reply) == self.data.secret)


class ProbeConfig(vf.TasksetConfig):
    n: int = 2048  # tasks (the held-out split about 200 of them)
    max_value: int = 15  # the hidden number is in 0..max_value
    seed: int = 0


class ProbeTaskset(vf.Taskset[ProbeTask, ProbeConfig]):
    def load(self) -> Iterator[ProbeTask]:
        c = self.config
        rng = random.Random(c.seed)
        for i in range(c.n):
            data = ProbeData(
                name=f"probe#{i}", prompt=f"guess 0-{c.max_value}>", secret=rng.randint(0, c.max_value),
                max_value=c.max_value,
            )  # fmt: skip
            yield ProbeTask(data, c.task)


class ProbeEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()
    max_guesses: int = 5


class ProbeEnv(vf.Env[ProbeEnvConfig]):
    async def run(self, task: ProbeTask, agents: vf.Agents) -> None:
        secret = task.data.secret
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            for _ in range(self.config.max_guesses - 1):
                guess = None if segment.terminated else _first_int(segment.last_reply)
                if segment.terminated or guess == secret:
                    break
                answer = "?" if guess is None else ("higher" if guess < secret else "lower")
                segment = await interaction.turn(f"{answer}>")


def probe_teacher(observations: Sequence[str], actions: Sequence[str]) -> str:
    """The next guess of binary search, given the environment's messages so far and the guesses."""
    low, high = 0, _first_int(observations[0].rsplit("-", 1)[-1]) or 0
    for guess, answer in zip(actions, observations[1:], strict=False):
        g = _first_int(guess)
        if g is not None and answer.startswith("higher"):
            low = max(low, g + 1)
        elif g is not None and answer.startswith("lower"):
            high = min(high, g - 1)
    return str((low + high) // 2)
