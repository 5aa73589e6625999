"""A user's dataset as question / answer records: JSONL, JSON, Parquet and Arrow files and directories
written by ``datasets``' ``save_to_disk``, with the field names the task's config maps.

JSONL is read line by line here, so an error names its line and a record's id is ``file:line``; every
other format goes through the ``datasets`` library (``load_dataset`` with the ``json`` / ``parquet`` /
``arrow`` builder into a throw-away cache, or ``load_from_disk``), and a record's id is ``file:row``
(1-based). Numbers are read as text (``42`` -> ``"42"``). A file that cannot be read, a missing column or
a row without a usable value gets one :class:`DataError` line naming the file, the row and the field.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from echo2.errors import DataError

BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}


@dataclass(frozen=True)
class Fields:
    """Which column holds what (``[task]`` ``question_field``, ``answer_field``, ``system_field``)."""

    question: str = "question"
    answer: str = "answer"
    system: str | None = None  # a per-record system message (used with the chat template)


@dataclass(frozen=True)
class Record:
    question: str
    answer: str
    row: int  # the JSONL line, else the 1-based row
    system: str | None = None


def read_records(path: Path, fields: Fields = Fields()) -> list[Record]:
    """Every record of ``path`` (module docstring); DataError on anything unreadable."""
    records = [_record(path, row, obj, fields) for row, obj in read_rows(path)]
    if not records:
        raise DataError(f"{path}: no records")
    return records


def read_rows(path: Path) -> list[tuple[int, Any]]:
    """Every row of ``path`` as ``(line or row, object)`` (module docstring), unvalidated; DataError if the
    file cannot be read."""
    if path.is_dir():
        rows = _from_disk(path)
    elif not path.is_file():
        raise DataError(f"{path}: no such file or directory")
    elif path.suffix == ".jsonl":
        rows = _jsonl(path)
    elif path.suffix in BUILDERS:
        rows = _builder(path, BUILDERS[path.suffix])
    else:
        raise DataError(
            f"{path}: unknown dataset format {path.suffix!r}; use .jsonl, .json, .parquet, .arrow or a "
            "directory saved with datasets' save_to_disk"
        )
    return rows


def _record(path: Path, row: int, obj: Any, fields: Fields) -> Record:
    where = f"{path}:{row}"
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected an object with fields, got {type(obj).__name__}")
    values: dict[str, str | None] = {}
    for name, column in (("question", fields.question), ("answer", fields.answer), ("system", fields.system)):
        if column is None:
            values[name] = None
            continue
        if column not in obj:
            raise DataError(
                f"{where}: no field {column!r} (fields: {sorted(obj)[:10]}; set task.{name}_field)"
            )
        value = obj[column]
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)
        if name == "system" and (value is None or value == ""):
            values[name] = None  # a row without a system message
            continue
        if not isinstance(value, str) or not value.strip():
            raise DataError(f"{where}: missing or empty field {column!r}")
        values[name] = value
    assert values["question"] is not None and values["answer"] is not None
    return Record(values["question"], values["answer"], row, values["system"])


def _jsonl(path: Path) -> list[tuple[int, Any]]:
    out = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                out.append((lineno, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
    return out


def _builder(path: Path, builder: str) -> list[tuple[int, Any]]:
    import datasets

    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory(prefix="echo2-datasets-") as cache:
        try:
            ds = datasets.load_dataset(
                builder, data_files=str(path), split="train", cache_dir=cache, keep_in_memory=True
            )
        except Exception as exc:  # datasets / pyarrow raise many types; the user needs file and cause
            raise DataError(f"{path}: cannot read it as {builder}: {_first_line(exc)}") from None
        return list(enumerate(ds.to_list(), start=1))


def _from_disk(path: Path) -> list[tuple[int, Any]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise DataError(
            f"{path}: not a directory saved with datasets' save_to_disk: {_first_line(exc)}"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds)
        if "train" not in ds and len(names) != 1:
            raise DataError(f"{path}: a dataset with splits {names} and none called 'train'; point at one")
        ds = ds["train" if "train" in ds else names[0]]
    return list(enumerate(ds.to_list(), start=1))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
