"""Higher-or-lower: the small deterministic text game the tests and the docs' example use.

The environment hides an integer ``n`` in ``0..max_value`` (drawn from the episode seed). The first
observation asks for a guess; every guess is answered ``higher``, ``lower`` or ``correct``; the episode
ends when the guess is correct or after ``max_turns`` guesses. Reward: 1 on the step that finds ``n``,
0 otherwise (so the discounted return ``γ^t`` pays finding it sooner).

Action language: a non-negative integer (surrounding whitespace ignored). **Fallback:** anything else
(empty, letters, a number outside ``0..max_value``) is an illegal guess: it uses up the turn, is
answered ``?`` and is reported with ``EnvStep.illegal``.

Transcript (one character per token for the embedded tokenizer)::

    guess 0-15>7<eos>higher>11<eos>lower>9<eos>correct

The whole environment is declared here, the example of the one-place procedure (``envs/base.py``):
its ``[task]`` config (:class:`GuessTaskConfig`), the environment, its spec (:class:`GuessSpec`) and
:data:`GUESS`, the declaration ``envs/roster.ENVIRONMENTS`` lists.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from echo2.envs.base import Environment, EnvironmentFields, EnvKnobs, EnvScore, EnvStep, TextEnv

if TYPE_CHECKING:
    from collections.abc import Callable

    from echo2.types import Prompt


class GuessTaskConfig(EnvironmentFields):
    """Higher-or-lower (``envs/guess.py``): find a hidden integer; the environment answers each guess
    with ``higher``, ``lower`` or ``correct``. Small, deterministic: the tests' multi-turn task."""

    name: Literal["guess"] = "guess"
    max_value: int = Field(15, ge=1, le=9999, description="the hidden number is drawn from 0..max_value")
    max_turns: int = Field(5, ge=1, le=64, description="guesses per episode")
    discount: float = Field(0.8, gt=0.0, le=1.0, description="gamma: finding it sooner pays more")


class GuessEnv:
    """Implements :class:`echo2.envs.base.TextEnv`."""

    def __init__(self, cfg: GuessTaskConfig) -> None:
        self.cfg = cfg
        self.hidden = 0
        self.turn = 0
        self.done = True
        self.low, self.high = 0, cfg.max_value

    def reset(self, seed: int) -> str:
        self.hidden = random.Random(f"guess:{seed}").randint(0, self.cfg.max_value)
        self.turn = 0
        self.done = False
        self.low, self.high = 0, self.cfg.max_value  # what the answers so far leave open
        return f"guess 0-{self.cfg.max_value}>"

    def step(self, action: str) -> EnvStep:
        if self.done:
            raise RuntimeError("step() after the episode ended; call reset()")
        self.turn += 1
        text = action.strip()
        guess = int(text) if text.isdigit() and len(text) <= 6 else -1
        illegal = not 0 <= guess <= self.cfg.max_value
        found = guess == self.hidden
        self.done = found or self.turn >= self.cfg.max_turns
        if self.done:
            return EnvStep("", 1.0 if found else 0.0, True, illegal)
        answer = "?" if illegal else ("higher" if guess < self.hidden else "lower")
        if not illegal:
            self.low, self.high = (
                (max(self.low, guess + 1), self.high)
                if guess < self.hidden
                else (self.low, min(self.high, guess - 1))
            )
        return EnvStep(f"{answer}>", 0.0, False, illegal)

    def expert_action(self) -> str:
        """Binary search's next guess (the warm start's teacher)."""
        return str((self.low + self.high) // 2)


@dataclass(frozen=True)
class GuessSpec(EnvKnobs):
    """What the task adapter asks of higher-or-lower (``data/tasks/environment.EnvSpec``)."""

    cfg: GuessTaskConfig
    score: EnvScore = "return"  # held out: the mean discounted return of a greedy episode

    def make(self, prompt: Prompt, opponent_policy: Callable[[str], str] | None = None) -> TextEnv:
        return GuessEnv(self.cfg)

    def draw_meta(self, rng: random.Random) -> dict[str, Any]:
        return {}

    def fixed_meta(self, index: int) -> dict[str, Any]:
        return {}

    def teacher(self, env: TextEnv) -> str:
        assert isinstance(env, GuessEnv)
        return env.expert_action()


GUESS = Environment(
    GuessTaskConfig,
    GuessSpec,
    preset=(
        "sampling.max_new_tokens=3",  # up to two digits and EOS
        "model.warmstart.target_accuracy=0.5",  # half of binary search's choices: GRPO has room to learn
    ),
)
