"""Math word problems from a JSONL file of ``{"question": ..., "answer": ...}`` records, graded by
math-verify (symbolic equivalence: ``1/2`` == ``0.5`` == ``\\frac{1}{2}``).

Every line is validated when the file is read; a bad line fails with the file and line number.

Splits hold out whole questions, keyed by ``normalise_question`` (whitespace runs collapsed, case
folded), so records that differ only in formatting always share a split. With a stable hash ``u`` of
that key: without ``eval_path``, test = ``[0, eval_fraction)``, validation =
``[eval_fraction, eval_fraction + validation_fraction)``, train = the rest of ``train_path``. With
``eval_path``, that file is the test split; validation = ``[0, validation_fraction)`` of
``train_path``, and records of ``train_path`` whose question also appears in ``eval_path`` are left
out of train and validation (logged), so no split shares a question.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from echo2.config import MathTaskConfig
from echo2.data.tasks.base import Grade, Split, full_mask, split_of, stable_fraction
from echo2.errors import DataError
from echo2.types import Prompt

log = logging.getLogger(__name__)

SAMPLE_FILE = "math_sample.jsonl"


def normalise_question(question: str) -> str:
    """The split key of a question: whitespace runs collapsed to one space, ends stripped, case folded."""
    return " ".join(question.split()).casefold()


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
        records = read_jsonl(train_file)
        splits: dict[Split, list[Prompt]] = {"train": [], "validation": [], "test": []}
        if cfg.eval_path is None:
            test_fraction, test_questions = cfg.eval_fraction, set[str]()
        else:
            eval_file = Path(cfg.eval_path)
            eval_records = read_jsonl(eval_file)
            splits["test"] = [self._prompt(eval_file, *r) for r in eval_records]
            test_fraction, test_questions = 0.0, {normalise_question(q) for q, _, _ in eval_records}
        overlap = 0
        for record in records:
            key = normalise_question(record[0])
            if key in test_questions:
                overlap += 1
                continue
            split = split_of(stable_fraction(f"math:{key}"), test_fraction, cfg.validation_fraction)
            splits[split].append(self._prompt(train_file, *record))
        if overlap:
            log.warning(
                "%s: %d records ask a question of the test file %s; left out of train and validation",
                train_file,
                overlap,
                cfg.eval_path,
            )
        empty = [name for name, prompts in splits.items() if not prompts]
        if empty:
            sizes = ", ".join(f"{name} {len(prompts)}" for name, prompts in splits.items())
            raise DataError(
                f"{train_file}: {len(records)} records leave an empty {' and '.join(empty)} split ({sizes}; "
                f"eval_fraction={cfg.eval_fraction}, validation_fraction={cfg.validation_fraction}); "
                "add records, change the fractions, or set task.eval_path"
            )
        self._train = splits["train"]
        self._validation = splits["validation"]
        self._eval = splits["test"]

    def _prompt(self, path: Path, question: str, answer: str, lineno: int) -> Prompt:
        return Prompt(
            prompt_id=f"{path.name}:{lineno}",
            text=self.cfg.prompt_template.format(question=question),
            answer=answer,
        )

    def sample_train(self, rng: random.Random, n: int) -> list[Prompt]:
        return [rng.choice(self._train) for _ in range(n)]

    def validation_prompts(self, n: int) -> list[Prompt]:
        return self._validation[:n]

    def eval_prompts(self, n: int) -> list[Prompt]:
        return self._eval[:n]

    def grade(self, prompt: Prompt, completion: str) -> Grade:
        from math_verify import parse, verify

        # without math-verify's own timeout: it uses SIGALRM, which works only on the main thread, and
        # the learner loop evaluates and generates off it (a timeout of echo2's own is not built yet)
        predicted = parse(completion, parsing_timeout=None)  # type: ignore[arg-type]
        if not predicted:
            return Grade(reward=0.0, parsed=False)
        gold = parse(f"${prompt.answer}$", parsing_timeout=None) or parse(  # type: ignore[arg-type]
            prompt.answer,
            parsing_timeout=None,  # type: ignore[arg-type]
        )
        return Grade(reward=1.0 if verify(gold, predicted, timeout_seconds=None) else 0.0, parsed=True)

    def token_mask(self, completion_ids: Sequence[int], meta: dict[str, object]) -> list[float]:
        return full_mask(completion_ids, meta)
