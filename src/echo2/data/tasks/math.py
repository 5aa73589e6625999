"""Math word problems from a JSONL file of ``{"question": ..., "answer": ...}`` records, graded by
math-verify (symbolic equivalence: ``1/2`` == ``0.5`` == ``\\frac{1}{2}``).

Every line is validated when the file is read; a bad line fails with the file and line number.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from echo2.config import MathTaskConfig
from echo2.data.tasks.base import Grade, full_mask, stable_fraction
from echo2.errors import DataError
from echo2.types import Prompt

SAMPLE_FILE = "math_sample.jsonl"


def read_jsonl(path: Path) -> list[tuple[str, str, int]]:
    """``(question, answer, line_number)`` for every non-blank line; DataError names file:line."""
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    records = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            for key in ("question", "answer"):
                value = obj.get(key)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    value = str(value)
                if not isinstance(value, str) or not value.strip():
                    raise DataError(f"{path}:{lineno}: missing or empty field {key!r}")
                obj[key] = value
            records.append((obj["question"], obj["answer"], lineno))
    if not records:
        raise DataError(f"{path}: no records")
    return records


class MathTask:
    name = "math"

    def __init__(self, cfg: MathTaskConfig, seed: int = 0) -> None:
        self.cfg = cfg
        if cfg.train_path is None:
            train_file = Path(str(resources.files("echo2.data.tasks") / "samples" / SAMPLE_FILE))
        else:
            train_file = Path(cfg.train_path)
        records = [self._prompt(train_file, *r) for r in read_jsonl(train_file)]
        if cfg.eval_path is not None:
            eval_file = Path(cfg.eval_path)
            self._train = records
            self._eval = [self._prompt(eval_file, *r) for r in read_jsonl(eval_file)]
        else:
            held = [stable_fraction(f"math:{p.text}") < cfg.eval_fraction for p in records]
            self._train = [p for p, h in zip(records, held, strict=True) if not h]
            self._eval = [p for p, h in zip(records, held, strict=True) if h]
        if not self._train or not self._eval:
            raise DataError(
                f"{train_file}: {len(records)} records leave an empty train or eval split "
                f"(eval_fraction={cfg.eval_fraction}); add records or set task.eval_path"
            )

    def _prompt(self, path: Path, question: str, answer: str, lineno: int) -> Prompt:
        return Prompt(
            prompt_id=f"{path.name}:{lineno}",
            text=self.cfg.prompt_template.format(question=question),
            answer=answer,
        )

    def sample_train(self, rng: random.Random, n: int) -> list[Prompt]:
        return [rng.choice(self._train) for _ in range(n)]

    def eval_prompts(self, n: int) -> list[Prompt]:
        return self._eval[:n]

    def grade(self, prompt: Prompt, completion: str) -> Grade:
        from math_verify import parse, verify

        predicted = parse(completion)
        if not predicted:
            return Grade(reward=0.0, parsed=False)
        gold = parse(f"${prompt.answer}$") or parse(prompt.answer)
        return Grade(reward=1.0 if verify(gold, predicted) else 0.0, parsed=True)

    def token_mask(self, completion_ids: Sequence[int], meta: dict[str, object]) -> list[float]:
        return full_mask(completion_ids, meta)
