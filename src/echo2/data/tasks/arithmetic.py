"""Synthetic arithmetic: ``"37+45="`` -> ``"82"``, graded by exact integer match (embedded default task).

Difficulty knobs: operand range, number of operands, operator set. The held-out split is a fixed
``eval_fraction`` of the problem space chosen by a stable hash of the problem text, so no training
prompt ever equals a held-out one.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from echo2.config import ArithmeticTaskConfig
from echo2.data.tasks.base import Grade, full_mask, stable_fraction
from echo2.types import Prompt

_INTEGER = re.compile(r"-?\d+")


class ArithmeticTask:
    name = "arithmetic"

    def __init__(self, cfg: ArithmeticTaskConfig, seed: int = 0) -> None:
        self.cfg = cfg
        self.seed = seed
        self._eval_cache: list[Prompt] = []

    # -- prompts -------------------------------------------------------------------------------------
    def _draw(self, rng: random.Random) -> tuple[str, int]:
        c = self.cfg
        operands = [rng.randint(c.min_value, c.max_value) for _ in range(c.num_operands)]
        ops = [rng.choice(c.operators) for _ in range(c.num_operands - 1)]
        text = str(operands[0]) + "".join(op + str(v) for op, v in zip(ops, operands[1:], strict=True))
        return text, _evaluate(operands, ops)

    def _is_eval(self, text: str) -> bool:
        return stable_fraction(f"arith:{text}") < self.cfg.eval_fraction

    def _prompt(self, text: str, value: int) -> Prompt:
        return Prompt(prompt_id=text, text=f"{text}=", answer=str(value))

    def sample_train(self, rng: random.Random, n: int) -> list[Prompt]:
        out: list[Prompt] = []
        while len(out) < n:
            text, value = self._draw(rng)
            if not self._is_eval(text):
                out.append(self._prompt(text, value))
        return out

    def eval_prompts(self, n: int) -> list[Prompt]:
        if len(self._eval_cache) < n:
            rng = random.Random(f"arith-eval:{self.seed}")
            seen = {p.prompt_id for p in self._eval_cache}
            attempts = 0
            while len(self._eval_cache) < n and attempts < 200 * n:
                attempts += 1
                text, value = self._draw(rng)
                if text not in seen and self._is_eval(text):
                    seen.add(text)
                    self._eval_cache.append(self._prompt(text, value))
        return self._eval_cache[:n]

    # -- reward --------------------------------------------------------------------------------------
    def grade(self, prompt: Prompt, completion: str) -> Grade:
        text = completion.strip()
        if not _INTEGER.fullmatch(text):
            return Grade(reward=0.0, parsed=False)
        return Grade(reward=1.0 if int(text) == int(prompt.answer) else 0.0, parsed=True)

    def token_mask(self, completion_ids: Sequence[int], meta: dict[str, object]) -> list[float]:
        return full_mask(completion_ids, meta)


def _evaluate(operands: list[int], ops: list[str]) -> int:
    """Left-to-right with ``*`` binding tighter, as a reader expects (no ``eval``)."""
    terms: list[int] = [operands[0]]
    signs: list[str] = []
    for op, v in zip(ops, operands[1:], strict=True):
        if op == "*":
            terms[-1] *= v
        else:
            signs.append(op)
            terms.append(v)
    total = terms[0]
    for sign, term in zip(signs, terms[1:], strict=True):
        total = total + term if sign == "+" else total - term
    return total
