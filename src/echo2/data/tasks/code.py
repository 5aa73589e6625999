"""Programming problems with unit tests, graded by running the completion's code against the tests in a
sandbox (``echo2.sandbox``: bubblewrap, no network, read-only root, private tmp, CPU / memory / process /
output caps).

**Records** (JSONL or any format ``records.py`` reads), one problem each, with the field names the config
maps:

- ``prompt`` (text): what the model is asked (a description, or a function's head to complete);
- ``tests`` (text, or a list of texts joined by newlines): Python run after the code: ``assert`` lines
  (MBPP's ``test_list``) or a ``def check(candidate)`` (HumanEval's ``test``);
- ``entry_point`` (optional): the function the tests' ``check`` is called with (HumanEval);
- ``solution`` (optional): a reference solution, what the embedded model's warm start imitates (never
  graded, never sent to a worker).

A bad record (missing prompt or tests, a test text that is not Python, an entry point that is not a
name) fails when the file is read, with its file and line.

**The program graded** is the completion's code (the first fenced ```` ``` ```` block if there is one,
else the whole text; with ``prepend_prompt`` the prompt's text first, HumanEval's way), then the tests,
then ``check(<entry_point>)`` when there is one. A fixed harness runs it inside the sandbox with
``__name__ == "solution"`` and stdin closed, and prints a per-grade random token only after the tests
returned: reward 1 if the program exits 0 and that token is its output's last line, else 0. So a
completion that exits early with status 0 (``sys.exit(0)``, ``os._exit(0)``) fails. What it cannot stop:
code that reads the token out of the interpreter's memory (the harness runs in the same process; the
token is never in the program's text) — a policy that learns that is reward hacking its grader, which
the docs state as this grader's limit.

Every grading's **outcome** is counted (``outcome_counts``; the step record's
``reward/outcomes/<outcome>``): ``passed``, ``failed`` (an exception or assertion: exit status not 0),
``exited_early`` (status 0 without the token), ``no_code``, and the limits: ``timeout``, ``cpu``,
``memory``, ``output``, ``killed``. Hostile code scores 0 with its outcome; it never raises here.

The tests are the grading secret: they live in ``Prompt.answer`` (a JSON text), which a lease never
carries; the learner grades every completion itself, so workers need no sandbox.
"""

from __future__ import annotations

import ast
import json
import os
import re
import secrets
import textwrap
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo2.data.tasks.base import FileSplitsAccess, Grade, Split, file_splits, full_mask
from echo2.data.tasks.records import read_rows
from echo2.errors import DataError
from echo2.sandbox import Limits, Sandbox, probe
from echo2.types import Prompt

if TYPE_CHECKING:
    from echo2.config import CodeTaskConfig

OUTCOMES = ("passed", "failed", "exited_early", "no_code", "timeout", "cpu", "memory", "output", "killed")
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)

# runs inside the sandbox: the program's parts on stdin (JSON), the token printed only after the tests
HARNESS = """\
import json, sys
job = json.loads(sys.stdin.buffer.read())
sys.stdin.close()
token = job.pop("token")
space = {"__name__": "solution", "__builtins__": __builtins__}
exec(compile(job["code"], "solution.py", "exec"), space)
exec(compile(job["tests"], "tests.py", "exec"), space)
if job["entry_point"] and "check" in space:
    space["check"](space[job["entry_point"]])
del job, space
sys.stdout.flush()
sys.stdout.write("\\n" + token + "\\n")
sys.stdout.flush()
"""


def extract_code(completion: str) -> str:
    """The code of a completion: its first fenced block (an unclosed fence runs to the end), else the
    whole text; blank lines around it and trailing spaces dropped, the first line's indentation kept (a
    function body that completes a head is indented)."""
    found = _FENCE.search(completion)
    return (found.group(1) if found else completion).rstrip().lstrip("\n")


def _text(obj: dict[str, Any], field: str, where: str, *, required: bool = True) -> str | None:
    value = obj.get(field)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        value = "\n".join(value)
    if value is None or (isinstance(value, str) and not value.strip()):
        if required:
            raise DataError(f"{where}: missing or empty field {field!r} (fields: {sorted(obj)[:10]})")
        return None
    if not isinstance(value, str):
        raise DataError(
            f"{where}: field {field!r} must be text (or a list of texts), got {type(value).__name__}"
        )
    return value


class CodeTask(FileSplitsAccess):
    name = "code"
    SAMPLE = "code_sample.jsonl"

    def __init__(self, cfg: CodeTaskConfig, seed: int = 0, *, sandbox: Sandbox | None = None) -> None:
        self.cfg = cfg
        self.grade_threads = cfg.grade_threads or os.cpu_count() or 1  # gradings a verifier runs at once
        self._sandbox = sandbox
        self._sandbox_lock = threading.Lock()
        self._refs: dict[str, str] = {}  # prompt id -> reference solution (the warm start's)
        self._counts: Counter[str] = Counter()
        self._counts_lock = threading.Lock()
        super().__init__()

    # ---- data ---------------------------------------------------------------------------------------
    def _read_splits(self) -> dict[Split, list[Prompt]]:
        cfg = self.cfg
        train_file, eval_file = self.dataset_files(cfg.train_path, cfg.eval_path)
        train = self._prompts(train_file)
        test = None if eval_file is None else self._prompts(eval_file)
        return file_splits(
            train, test, lambda p: " ".join(p.text.split()).casefold(), "code",
            cfg.eval_fraction, cfg.validation_fraction, (train_file, eval_file),
        )  # fmt: skip

    def _prompts(self, path: Path) -> list[Prompt]:
        cfg = self.cfg
        out = []
        for row, obj in read_rows(path):
            where = f"{path}:{row}"
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected an object with fields, got {type(obj).__name__}")
            prompt = _text(obj, cfg.prompt_field, where)
            tests = _text(obj, cfg.tests_field, where)
            assert prompt is not None and tests is not None
            entry = (
                _text(obj, cfg.entry_point_field, where, required=False) if cfg.entry_point_field else None
            )
            solution = _text(obj, cfg.solution_field, where, required=False) if cfg.solution_field else None
            try:
                ast.parse(tests)
            except SyntaxError as exc:
                raise DataError(
                    f"{where}: field {cfg.tests_field!r} is not Python ({exc.msg}, line {exc.lineno})"
                ) from None
            if entry is not None and not entry.isidentifier():
                raise DataError(f"{where}: field {cfg.entry_point_field!r} = {entry!r} is not a Python name")
            p = Prompt(
                prompt_id=f"{path.name}:{row}",
                text=cfg.prompt_template.format(prompt=prompt),
                answer=json.dumps({"tests": tests, "entry_point": entry, "head": prompt}),
                meta={},
            )
            if solution is not None:
                self._refs[p.prompt_id] = solution
            out.append(p)
        if not out:
            raise DataError(f"{path}: no records")
        return out

    def reference(self, prompt: Prompt) -> str:
        """The record's reference solution (the warm start's target); a problem without one cannot be
        imitated: :class:`DataError`."""
        self.splits()
        ref = self._refs.get(prompt.prompt_id)
        if ref is None:
            raise DataError(
                f"{prompt.prompt_id}: no reference solution (field {self.cfg.solution_field!r}) for the "
                "embedded model's warm start; give one per record, or bring a model (model.path)"
            )
        return ref

    def token_mask(self, completion_ids: Sequence[int], meta: dict[str, object]) -> list[float]:
        return full_mask(completion_ids, meta)

    # ---- grading ------------------------------------------------------------------------------------
    def sandbox(self) -> Sandbox:
        """The sandbox (made and probed on first use: a learner without bubblewrap fails at its first
        grade with one line saying what to install)."""
        with self._sandbox_lock:
            if self._sandbox is None:
                cfg = self.cfg
                limits = Limits(
                    wall_s=cfg.timeout_s, cpu_s=cfg.cpu_s, memory_mb=cfg.memory_mb,
                    processes=cfg.processes, output_bytes=cfg.output_kb << 10,
                )  # fmt: skip
                box = Sandbox(limits, python=cfg.python)
                probe(box)
                self._sandbox = box
            return self._sandbox

    def program(self, prompt: Prompt, completion: str) -> dict[str, Any] | None:
        """The harness's job for ``completion`` (module docstring), None when it holds no code."""
        spec = json.loads(prompt.answer)
        code = extract_code(completion)
        if not code.strip():
            return None
        code = spec["head"] + code if self.cfg.prepend_prompt else textwrap.dedent(code)
        return {"code": code, "tests": spec["tests"], "entry_point": spec["entry_point"]}

    def grade(self, prompt: Prompt, completion: str) -> Grade:
        """Run the completion's program against the prompt's tests in the sandbox (module docstring)."""
        job = self.program(prompt, completion)
        if job is None:
            return self._counted("no_code", Grade(0.0, parsed=False))
        box = self.sandbox()
        token = secrets.token_hex(16)
        got = box.run([box.python, "-I", "-S", "-c", HARNESS], json.dumps({**job, "token": token}).encode())
        if got.status == "ok":
            lines = got.output.rstrip(b"\n").rsplit(b"\n", 1)
            passed = lines[-1] == token.encode()
            return self._counted("passed" if passed else "exited_early", Grade(float(passed), parsed=True))
        return self._counted("failed" if got.status == "exit" else got.status, Grade(0.0, parsed=True))

    def _counted(self, outcome: str, grade: Grade) -> Grade:
        with self._counts_lock:
            self._counts[outcome] += 1
        return grade

    def outcome_counts(self) -> dict[str, int]:
        """Gradings of this process so far, by outcome (module docstring)."""
        with self._counts_lock:
            return dict(self._counts)
