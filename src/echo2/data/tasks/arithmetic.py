"""Synthetic arithmetic: ``"37+45="`` -> ``"82"``, graded by exact integer match (embedded default task).

Difficulty knobs: operand range, number of operands, operator set.

**Splits hold out whole problems.** A written problem is a signed sum of terms (``*`` binds tighter):
cut the text at ``+`` and ``-``; each piece is a *term*, the product of one or more *factors*
(operands joined by ``*``), and carries the sign written before it, the first term ``+`` (a problem
never starts with a sign). Two problems are *trivial variants* of each other, i.e. the same problem,
iff they have the same **multiset of signed terms, each term the sorted tuple of its factors**. So
reordering the factors of a product or the terms of a sum does not change the problem: ``37+45`` /
``45+37``, ``a+b-c`` / ``b-c+a``, ``a*b+c`` / ``c+b*a``; but ``a-b`` ({+a, -b}) and ``b-a``
({+b, -a}) differ, and so do ``2*3`` and ``6`` (different terms, though equal values).

``canonical_key`` writes that multiset back as a problem: terms ordered ``+`` before ``-`` and then by
their factor tuples, factors ascending, e.g. ``canonical_key("9-3*2+1") == "1+9-2*3"``. There is
always a ``+`` term, so the key is itself a problem of the same space, the representative of its
class, and equal keys imply equal values.

The split of a problem is a stable hash ``u`` of its key in [0, 1): test = ``[0, eval_fraction)``,
validation = ``[eval_fraction, eval_fraction + validation_fraction)``, train = the rest. Every
variant of a problem lands in the same split, so no training prompt is a rewording of a held-out
one. The fixed held-out lists hold distinct prompt texts (two variants of one held-out problem may
both appear; both are held out).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence

from echo2.config import ArithmeticTaskConfig
from echo2.data.tasks.base import Grade, Split, full_mask, split_of, stable_fraction
from echo2.types import Prompt

_INTEGER = re.compile(r"-?\d+")
_PROBLEM = re.compile(r"\d+(?:[-+*]\d+)*")
_TOKEN = re.compile(r"\d+|[-+*]")

SignedTerm = tuple[str, tuple[int, ...]]  # ("+" or "-", the term's factors in ascending order)


class ArithmeticTask:
    name = "arithmetic"

    def __init__(self, cfg: ArithmeticTaskConfig, seed: int = 0) -> None:
        self.cfg = cfg
        self.seed = seed
        self._fixed_cache: dict[Split, list[Prompt]] = {"validation": [], "test": []}

    # -- splits --------------------------------------------------------------------------------------
    def split(self, text: str) -> Split:
        """The split of the problem ``text`` (without ``=``), the same for all its variants."""
        u = stable_fraction(f"arith:{canonical_key(text)}")
        return split_of(u, self.cfg.eval_fraction, self.cfg.validation_fraction)

    # -- prompts -------------------------------------------------------------------------------------
    def _draw(self, rng: random.Random) -> tuple[str, int]:
        c = self.cfg
        operands = [rng.randint(c.min_value, c.max_value) for _ in range(c.num_operands)]
        ops = [rng.choice(c.operators) for _ in range(c.num_operands - 1)]
        text = str(operands[0]) + "".join(op + str(v) for op, v in zip(ops, operands[1:], strict=True))
        return text, _evaluate(operands, ops)

    def _prompt(self, text: str, value: int) -> Prompt:
        return Prompt(prompt_id=text, text=f"{text}=", answer=str(value))

    def train_prompts(self) -> list[Prompt] | None:
        return None  # a stream of generated problems

    def sample_train(self, rng: random.Random, n: int) -> list[Prompt]:
        out: list[Prompt] = []
        while len(out) < n:
            text, value = self._draw(rng)
            if self.split(text) == "train":
                out.append(self._prompt(text, value))
        return out

    def validation_prompts(self, n: int) -> list[Prompt]:
        return self._fixed("validation", n)

    def eval_prompts(self, n: int) -> list[Prompt]:
        return self._fixed("test", n)

    def _fixed(self, split: Split, n: int) -> list[Prompt]:
        """The first ``n`` distinct prompts of ``split`` in a seeded draw order. Redrawing from the
        start and skipping what is cached makes the list a prefix of any longer request, whatever
        the call history. A space with fewer than ``n`` such prompts yields fewer (bounded search)."""
        cache = self._fixed_cache[split]
        if len(cache) < n:
            rng = random.Random(f"arith-{'eval' if split == 'test' else split}:{self.seed}")
            seen = {p.prompt_id for p in cache}
            attempts = 0
            while len(cache) < n and attempts < 200 * n:
                attempts += 1
                text, value = self._draw(rng)
                if text not in seen and self.split(text) == split:
                    seen.add(text)
                    cache.append(self._prompt(text, value))
        return cache[:n]

    # -- reward --------------------------------------------------------------------------------------
    def grade(self, prompt: Prompt, completion: str) -> Grade:
        text = completion.strip()
        if not _INTEGER.fullmatch(text):
            return Grade(reward=0.0, parsed=False)
        return Grade(reward=1.0 if int(text) == int(prompt.answer) else 0.0, parsed=True)

    def token_mask(self, completion_ids: Sequence[int], meta: dict[str, object]) -> list[float]:
        return full_mask(completion_ids, meta)


def parse_problem(text: str) -> tuple[list[int], list[str]]:
    """``"12+3*4"`` -> ``([12, 3, 4], ["+", "*"])``; ValueError for anything that is not a problem."""
    if not _PROBLEM.fullmatch(text):
        raise ValueError(f"not an arithmetic problem: {text!r} (want e.g. '12+3*4')")
    tokens = _TOKEN.findall(text)
    return [int(t) for t in tokens[0::2]], tokens[1::2]


def signed_terms(operands: Sequence[int], ops: Sequence[str]) -> list[SignedTerm]:
    """The written terms in order, each ``(sign, sorted factors)``; the first term's sign is ``+``."""
    terms: list[tuple[str, list[int]]] = [("+", [operands[0]])]
    for op, v in zip(ops, operands[1:], strict=True):
        if op == "*":
            terms[-1][1].append(v)
        else:
            terms.append((op, [v]))
    return [(sign, tuple(sorted(factors))) for sign, factors in terms]


def canonical_key(text: str) -> str:
    """The canonical problem of ``text`` (see the module docstring): its multiset of signed terms,
    ``+`` terms first, then by factor tuple, written back as a problem. ``"45+37"`` -> ``"37+45"``."""
    terms = sorted(signed_terms(*parse_problem(text)), key=lambda t: (t[0] != "+", t[1]))
    out = ""
    for i, (sign, factors) in enumerate(terms):
        out += ("" if i == 0 else sign) + "*".join(map(str, factors))
    return out


def _evaluate(operands: list[int], ops: list[str]) -> int:
    """Left-to-right with ``*`` binding tighter, as a reader expects (no ``eval``)."""
    return sum(math.prod(f) if s == "+" else -math.prod(f) for s, f in signed_terms(operands, ops))
