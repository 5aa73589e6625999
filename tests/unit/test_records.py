"""A user's dataset as users have it (data/tasks/records.py): JSONL, JSON, Parquet, Arrow and a
save_to_disk directory, field names mapped in the config, one-line errors naming file, row and field; and
a math task that reads no file until its prompts are asked for (a worker grades leased prompts only)."""

from __future__ import annotations

import json

import pytest

from echo2.config import Config, MathTaskConfig
from echo2.data.tasks.math import MathTask
from echo2.data.tasks.records import Fields, read_records
from echo2.errors import DataError
from echo2.types import Prompt

ROWS = [
    {
        "problem": f"What is {a} plus {a}?",
        "solution": f"{a} + {a} = {2 * a}\n#### {2 * a}",
        "sys": "Be brief.",
    }
    for a in range(30)
]
FIELDS = Fields("problem", "solution", "sys")


def _write(tmp_path, fmt: str):
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    if fmt == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif fmt == "json":
        path = tmp_path / "d.json"
        path.write_text(json.dumps(ROWS))
    elif fmt == "parquet":
        path = tmp_path / "d.parquet"
        ds.to_parquet(str(path))
    elif fmt == "arrow":
        path = tmp_path / "d.arrow"
        import pyarrow as pa

        table = ds.data.table
        with pa.ipc.new_stream(str(path), table.schema) as w:
            w.write_table(table)
    else:
        path = tmp_path / "saved"
        datasets.DatasetDict({"train": ds}).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "arrow", "save_to_disk"])
def test_every_format_gives_the_same_records(tmp_path, fmt):
    records = read_records(_write(tmp_path, fmt), FIELDS)
    assert [(r.question, r.answer, r.system) for r in records] == [
        (r["problem"], r["solution"], r["sys"]) for r in ROWS
    ]
    assert [r.row for r in records] == list(range(1, 31))


def test_a_math_task_on_parquet_with_mapped_fields_grades_gsm8k_answers(tmp_path):
    path = _write(tmp_path, "parquet")
    task = MathTask(MathTaskConfig(train_path=str(path), question_field="problem", answer_field="solution"))
    try:
        prompts = task.eval_prompts(100) + task.validation_prompts(100)
        p = next(iter(prompts))
        assert p.prompt_id.startswith("d.parquet:") and "#### " in p.answer and p.meta == {}
        a = int(p.answer.rsplit("####", 1)[1])
        assert task.grade(p, f"so the answer is {a}").reward == 1.0  # the gold after ####
    finally:
        task.grader.close()
    with_system = MathTask(
        MathTaskConfig(
            train_path=str(path), question_field="problem", answer_field="solution", system_field="sys"
        )
    )
    assert with_system.eval_prompts(1)[0].meta == {"system": "Be brief."}


def test_bad_files_and_fields_are_one_line_naming_file_row_and_field(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "1"}\n\n{"question": "b"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:3: no field 'answer'"):
        read_records(bad)
    bad.write_text('{"question": "a", "answer": ""}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: missing or empty field 'answer'"):
        read_records(bad)
    bad.write_text('{"question": "a", "answer": "1"}\n{nope\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        read_records(bad)
    parquet = _write(tmp_path, "parquet")  # another schema than the config names
    with pytest.raises(DataError, match=r"d.parquet:1: no field 'question' .*set task.question_field"):
        read_records(parquet)
    garbage = tmp_path / "x.parquet"
    garbage.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"x.parquet: cannot read it as parquet"):
        read_records(garbage)
    with pytest.raises(DataError, match=r"unknown dataset format '\.csv'"):
        (tmp_path / "x.csv").write_text("a,b\n")
        read_records(tmp_path / "x.csv")
    with pytest.raises(DataError, match="no such file"):
        read_records(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="save_to_disk"):
        (tmp_path / "emptydir").mkdir()
        read_records(tmp_path / "emptydir")
    numbers = tmp_path / "n.jsonl"
    numbers.write_text('{"question": "1+1", "answer": 2}\n')
    assert read_records(numbers)[0].answer == "2"  # numbers are read as text


def test_a_worker_side_task_reads_no_file_and_grades_what_the_lease_carries(tmp_path):
    """The learner's config names a file only the learner has: a worker builds the same task, grades the
    leased prompt (its gold answer travels with it), and never opens the file."""
    cfg = Config.model_validate(
        {"task": {"name": "math", "train_path": str(tmp_path / "only-on-the-learner.jsonl")}}
    )
    task = MathTask(cfg.task)  # type: ignore[arg-type]
    try:
        p = Prompt("train.jsonl:7", "What is 6 times 7?\nAnswer: ", "6 * 7 = 42\n#### 42")
        assert task.grade(p, "42").reward == 1.0 and task.grade(p, "41").reward == 0.0
        with pytest.raises(DataError, match=r"only-on-the-learner\.jsonl: no such file"):
            task.eval_prompts(1)  # the learner, which needs its prompts, is told at once
    finally:
        task.grader.close()
