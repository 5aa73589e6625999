import json
import random

import pytest

from echo2.config import ArithmeticTaskConfig, MathTaskConfig
from echo2.data.tasks.arithmetic import ArithmeticTask, _evaluate
from echo2.data.tasks.base import build_task
from echo2.data.tasks.math import MathTask
from echo2.errors import DataError
from echo2.types import Prompt


def test_arithmetic_precedence_by_hand():
    assert _evaluate([2, 3, 4], ["+", "*"]) == 14  # 2 + 3*4
    assert _evaluate([10, 3, 2], ["-", "-"]) == 5
    assert _evaluate([2, 3, 4], ["*", "-"]) == 2


def test_arithmetic_train_and_eval_splits_are_disjoint_and_seeded():
    task = ArithmeticTask(ArithmeticTaskConfig(), seed=0)
    evals = task.eval_prompts(200)
    assert len({p.prompt_id for p in evals}) == 200
    assert task.eval_prompts(200) == evals  # fixed split
    train = task.sample_train(random.Random(1), 2000)
    assert not {p.prompt_id for p in train} & {p.prompt_id for p in evals}
    assert task.sample_train(random.Random(1), 5) == train[:5]
    p = train[0]
    a, b = p.prompt_id.replace("-", "+").split("+")
    assert p.text == p.prompt_id + "=" and abs(int(p.answer)) <= int(a) + int(b)


def test_arithmetic_grading():
    task = build_task(ArithmeticTaskConfig())
    p = Prompt("12+30", "12+30=", "42")
    assert task.grade(p, "42").reward == 1.0
    assert task.grade(p, " 42 ").parsed
    wrong = task.grade(p, "41")
    assert wrong.reward == 0.0 and wrong.parsed
    junk = task.grade(p, "4x2")
    assert junk.reward == 0.0 and not junk.parsed
    assert not task.grade(p, "").parsed


def test_math_sample_file_and_math_verify_grading():
    task = MathTask(MathTaskConfig())
    assert task.eval_prompts(100) and task.sample_train(random.Random(0), 3)
    p = Prompt("q", "What is one half?\nAnswer: ", "\\frac{1}{2}")
    assert task.grade(p, "0.5").reward == 1.0
    assert task.grade(p, "1/2").reward == 1.0
    assert task.grade(p, "3").reward == 0.0
    unparsed = task.grade(p, "no idea")
    assert unparsed.reward == 0.0 and not unparsed.parsed


def test_math_jsonl_errors_name_file_and_line(tmp_path):
    f = tmp_path / "data.jsonl"
    f.write_text(
        json.dumps({"question": "1+1?", "answer": "2"}) + "\n\n" + json.dumps({"question": "x"}) + "\n"
    )
    with pytest.raises(DataError, match=r"data.jsonl:3: missing or empty field 'answer'"):
        MathTask(MathTaskConfig(train_path=str(f)))
    f.write_text("{not json}\n")
    with pytest.raises(DataError, match=r"data.jsonl:1: not valid JSON"):
        MathTask(MathTaskConfig(train_path=str(f)))
    with pytest.raises(DataError, match="no such file"):
        MathTask(MathTaskConfig(train_path=str(tmp_path / "missing.jsonl")))


def test_math_numeric_answers_and_explicit_eval_file(tmp_path):
    train = tmp_path / "train.jsonl"
    evalf = tmp_path / "eval.jsonl"
    train.write_text(json.dumps({"question": "2+2?", "answer": 4}) + "\n")
    evalf.write_text(json.dumps({"question": "3+3?", "answer": "6"}) + "\n")
    task = MathTask(MathTaskConfig(train_path=str(train), eval_path=str(evalf)))
    assert task.eval_prompts(5)[0].answer == "6"
    assert task.sample_train(random.Random(0), 1)[0].answer == "4"
