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
"""

from __future__ import annotations

import random

from echo2.config import GuessTaskConfig
from echo2.envs.base import EnvStep


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
