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

Grading (``MathTask.grade``), in three steps:

1. **The gold answer** is read from the record's ``answer`` by ``gold_answer`` (the task's
   ``answer_rule``, default ``"auto"``: the text after the last ``####`` if there is one, as in
   GSM8K's "worked solution #### 42"; else the content of the last ``\\boxed{...}``; else the whole
   string).
2. **math-verify** parses the completion and that gold text and checks them for symbolic
   equivalence (``grade_answer``). It is called without its own timeout: math-verify's timeout is a
   ``SIGALRM``, which raises ``ValueError`` off the main thread, and every grading site of the
   asynchronous runtime (the learner's evaluation, the intake's re-grade, the worker's generator
   thread) is off the main thread.
3. **echo2's own timeout** instead: each grading runs in one small persistent grading process
   (``MathGrader``: started on the first grade, one per ``MathTask``), and a grading that has not
   answered within ``GRADE_TIMEOUT_S`` (5 s) is stopped by killing that process (a thread cannot be
   killed) and starting a fresh one. Such a grading scores 0, counts as unparsed, and is counted in
   ``MathTask.grade_timeouts`` (the step record's ``reward/grade_timeouts``); so is a grading whose
   process died. The round trip costs about 0.2 ms (2 shared cores) against 2-3 ms of sympy for a
   typical completion; a fresh grading process takes about 1 s to start (sympy's import).

A gold answer math-verify cannot turn into math (nothing parsed, or only the raw-text fallback)
scores 0 for every completion of that prompt; it is logged once per prompt id and counted in
``MathTask.gold_unparsed``.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from echo2.data.tasks.base import FileSplitsAccess, Grade, Split, file_splits, full_mask
from echo2.data.tasks.records import Fields, Record, read_records
from echo2.types import Prompt

if TYPE_CHECKING:  # the grading process imports this module: it stays light (no pydantic)
    from echo2.config import MathTaskConfig

log = logging.getLogger(__name__)

GRADE_TIMEOUT_S = 5.0  # default wall-clock limit of one grading (parse + verify) in the grading process
GRADER_START_TIMEOUT_S = 120.0  # limit on a fresh grading process's start (imports sympy and math-verify)
GoldRule = Literal["auto", "gsm8k", "boxed", "whole"]


def normalise_question(question: str) -> str:
    """The split key of a question: whitespace runs collapsed to one space, ends stripped, case folded."""
    return " ".join(question.split()).casefold()


# ---- the gold answer -------------------------------------------------------------------------------
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` of ``text`` (braces matched), or None if it has none
    or the last one is never closed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None


def gold_answer(answer: str, rule: GoldRule = "auto") -> str:
    """The gold answer of a record's ``answer`` text, the one rule every grade uses.

    - ``"gsm8k"``: the text after the last ``####`` (GSM8K's "worked solution ... #### 42"), thousands
      separators dropped (``#### 1,000`` -> ``1000``); the whole string if there is no ``####``.
    - ``"boxed"``: the content of the last ``\\boxed{...}``; the whole string if there is none.
    - ``"whole"``: the whole string.
    - ``"auto"`` (the default): ``"gsm8k"`` if the text has ``####``, else ``"boxed"`` if it has a
      ``\\boxed{``, else ``"whole"``.

    The result is stripped; a rule that finds an empty answer falls back to the whole string."""
    text = answer.strip()
    if rule == "auto":
        rule = "gsm8k" if "####" in text else "boxed" if "\\boxed{" in text else "whole"
    found: str | None = None
    if rule == "gsm8k" and "####" in text:
        found = _THOUSANDS.sub("", text.rsplit("####", 1)[1].strip())
    elif rule == "boxed":
        found = last_boxed(text)
    return found or text


# ---- grading (math-verify, without its signal timeout) ------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    """What math-verify says of one completion against one gold text."""

    reward: float  # 1.0 if equivalent to the gold answer, else 0.0
    parsed: bool  # an answer was read from the completion
    gold_parsed: bool  # the gold text parsed as math (else the reward is 0)


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple[Any, ...]:
    """The parsed gold (``$gold$`` first, then the bare text), or () if math-verify reads no math in it
    (nothing, or only its raw-string fallback). Cached: a group's G completions share one gold."""
    from math_verify import parse
    from sympy import Basic, MatrixBase

    for text in (f"${gold}$", gold):
        parsed = parse(text, parsing_timeout=None)
        if any(isinstance(x, Basic | MatrixBase) for x in parsed):
            return tuple(parsed)
    return ()


def grade_answer(completion: str, gold: str) -> Verdict:
    """math-verify's verdict on ``completion`` against the gold text ``gold`` (see ``gold_answer``),
    with math-verify's signal timeouts off, so it runs in any thread but is not bounded in time:
    ``MathGrader`` runs it in a process it can kill. Never raises on any text."""
    from math_verify import parse, verify

    predicted = parse(completion, parsing_timeout=None)
    gold_expr = _parse_gold(gold)
    if not predicted or not gold_expr:
        return Verdict(0.0, parsed=bool(predicted), gold_parsed=bool(gold_expr))
    ok = verify(list(gold_expr), predicted, timeout_seconds=None)
    return Verdict(1.0 if ok else 0.0, parsed=True, gold_parsed=True)


_READY = "ready"


def _serve(read_fd: str, write_fd: str, parent_pid: str, hang_marker: str) -> None:
    """The grading process's loop: ``(completion, gold)`` in, a ``Verdict`` out, until the request pipe
    closes. It ignores Ctrl-C (its parent decides when it stops) and exits by itself if the parent
    dies, even in the middle of a grading. ``hang_marker`` is a test seam (see ``MathGrader``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled" warning: ours
    parent = int(parent_pid)

    def orphaned() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=orphaned, name="echo2-grader-orphan-watch", daemon=True).start()
    requests = Connection(int(read_fd), writable=False)
    replies = Connection(int(write_fd), readable=False)
    import math_verify  # noqa: F401  (the import is the start-up cost; pay it before "ready")

    replies.send(_READY)
    while True:
        try:
            completion, gold = requests.recv()
        except EOFError:
            return
        if hang_marker and hang_marker in completion:
            while not requests.poll(0.5):  # hang for real: answer nothing until killed or the pipe closes
                pass
            return
        v = grade_answer(completion, gold)
        replies.send((v.reward, v.parsed, v.gold_parsed))  # a tuple pickles faster than the dataclass


_SERVE = "import sys; from echo2.data.tasks.math import _serve; _serve(*sys.argv[1:])"


def _stop(proc: subprocess.Popen[bytes], *conns: Connection) -> None:
    for conn in conns:
        conn.close()
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=10.0)
    except subprocess.TimeoutExpired:  # a kill that did not land in 10 s: nothing more to do here
        log.warning("math grading process %d did not exit after SIGKILL", proc.pid)


@dataclass
class _Child:
    proc: subprocess.Popen[bytes]
    requests: Connection  # parent -> child: (completion, gold)
    replies: Connection  # child -> parent: "ready", then one (reward, parsed, gold_parsed) per request
    stop: weakref.finalize  # kills it once (when replaced, closed, collected, or at interpreter exit)
    ready: bool = False


class MathGrader:
    """``grade_answer`` under a wall-clock timeout that works from any thread.

    One persistent grading process (``python -c`` running ``_serve``, not a ``multiprocessing`` child,
    so the caller's ``__main__`` is never re-imported), started on the first grade; gradings from all
    threads go through it one at a time (sympy holds the GIL, so in-process threads would not run
    them in parallel either). A grading with no answer after ``timeout_s`` seconds (or whose process
    died) kills the process, starts a fresh one for the next grading, is counted in ``timeouts`` and
    returns None. The process is killed when the grader is closed or garbage-collected, or at
    interpreter exit, and exits by itself if its parent dies.

    ``hang_marker`` is a test seam: a completion containing it makes the grading process hang for
    real (it answers nothing until killed). Empty (the default) turns it off."""

    def __init__(
        self,
        timeout_s: float = GRADE_TIMEOUT_S,
        *,
        start_timeout_s: float = GRADER_START_TIMEOUT_S,
        hang_marker: str = "",
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s = {timeout_s!r} must be > 0")
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.hang_marker = hang_marker
        self.timeouts = 0  # gradings that did not answer in time or whose process died (each scored 0)
        self.starts = 0  # grading processes started
        self._lock = threading.Lock()
        self._child: _Child | None = None

    def grade(self, completion: str, gold: str) -> Verdict | None:
        """The verdict of ``grade_answer(completion, gold)``, or None if it did not finish in time."""
        with self._lock:
            child = self._ready_child()
            try:
                child.requests.send((completion, gold))
                if child.replies.poll(self.timeout_s):
                    reward, parsed, gold_parsed = child.replies.recv()
                    return Verdict(reward, parsed, gold_parsed)
                reason = f"ran past {self.timeout_s:g} s"
            except (EOFError, OSError) as exc:
                reason = f"lost its process ({type(exc).__name__}, exit code {child.proc.poll()})"
            self.timeouts += 1
            child.stop()
            self._child = self._spawn()  # its start-up overlaps whatever the caller does next
        log.warning(
            "math grading %s: reward 0 (%d such gradings so far); completion %r",
            reason,
            self.timeouts,
            completion[:200],
        )
        return None

    def close(self) -> None:
        """Kill the grading process if one runs; a later grade starts a fresh one."""
        with self._lock:
            if self._child is not None:
                self._child.stop()
                self._child = None

    @property
    def pid(self) -> int | None:
        """The grading process's pid, None before the first grade (and after ``close``)."""
        child = self._child
        return None if child is None else child.proc.pid

    def _ready_child(self) -> _Child:
        child = self._child
        if child is None or child.proc.poll() is not None:
            if child is not None:
                child.stop()
            child = self._child = self._spawn()
        if not child.ready:
            message = "no answer"
            try:
                if child.replies.poll(self.start_timeout_s):
                    hello = child.replies.recv()
                    child.ready, message = hello == _READY, f"said {hello!r}"
            except (EOFError, OSError) as exc:
                message = f"{type(exc).__name__}: it exited"
            if not child.ready:
                child.stop()
                self._child = None
                raise RuntimeError(
                    f"the math grading process did not start within {self.start_timeout_s:g} s "
                    f"({message}, exit code {child.proc.poll()}; its stderr is above): "
                    "is math-verify installed in this interpreter?"
                )
        return child

    def _spawn(self) -> _Child:
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # the same echo2
        args = [str(req_r), str(rep_w), str(os.getpid()), self.hang_marker]
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _SERVE, *args],
                pass_fds=(req_r, rep_w),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        except BaseException:
            for fd in (req_w, rep_r):
                os.close(fd)
            raise
        finally:
            os.close(req_r)
            os.close(rep_w)
        requests, replies = Connection(req_w, readable=False), Connection(rep_r, writable=False)
        self.starts += 1
        return _Child(proc, requests, replies, weakref.finalize(self, _stop, proc, requests, replies))


class MathTask(FileSplitsAccess):
    name = "math"
    SAMPLE = "math_sample.jsonl"

    def __init__(self, cfg: MathTaskConfig, seed: int = 0, *, grader: MathGrader | None = None) -> None:
        self.cfg = cfg
        self.grader = grader or MathGrader()  # its process starts on the first grade
        self._bad_gold: set[str] = set()  # prompt ids whose gold answer math-verify cannot parse
        self._gold_lock = threading.Lock()  # grade runs in several threads; each bad gold is logged once
        super().__init__()

    def _read_splits(self) -> dict[Split, list[Prompt]]:
        cfg = self.cfg
        train_file, eval_file = self.dataset_files(cfg.train_path, cfg.eval_path)
        fields = Fields(cfg.question_field, cfg.answer_field, cfg.system_field)
        records = read_records(train_file, fields)
        test = None if eval_file is None else read_records(eval_file, fields)
        by_record = file_splits(
            records, test, lambda r: normalise_question(r.question), "math",
            cfg.eval_fraction, cfg.validation_fraction, (train_file, eval_file),
        )  # fmt: skip
        return {
            name: [self._prompt(eval_file if name == "test" and eval_file else train_file, r) for r in got]
            for name, got in by_record.items()
        }

    def _prompt(self, path: Path, r: Record) -> Prompt:
        return Prompt(
            prompt_id=f"{path.name}:{r.row}",
            text=self.cfg.prompt_template.format(question=r.question),
            answer=r.answer,
            meta={} if r.system is None else {"system": r.system},
        )

    def answer_start(self, prompt: Prompt, completion: str) -> int:
        """Where the grade is read from: the last ``\\boxed{`` of ``completion`` when grading the text from
        there gives the whole text's grade (math-verify took that box), else 0 (the whole text)."""
        at = completion.rfind("\\boxed{")
        if at <= 0:
            return 0
        whole, tail = self.grade(prompt, completion), self.grade(prompt, completion[at:])
        return at if (whole.reward, whole.parsed) == (tail.reward, tail.parsed) else 0

    def grade(self, prompt: Prompt, completion: str) -> Grade:
        """math-verify's grade against ``gold_answer(prompt.answer, cfg.answer_rule)``, under
        ``GRADE_TIMEOUT_S``; safe from any thread. A grading past the timeout is unparsed with reward 0
        (``grade_timeouts``); an unparsable gold gives reward 0 (logged once per prompt id,
        ``gold_unparsed``)."""
        verdict = self.grader.grade(completion, gold_answer(prompt.answer, self.cfg.answer_rule))
        if verdict is None:
            return Grade(reward=0.0, parsed=False)
        if not verdict.gold_parsed and self._first_bad_gold(prompt.prompt_id):
            log.warning(
                "%s: math-verify cannot parse the gold answer %r (read as %r): every completion of "
                "this prompt scores 0",
                prompt.prompt_id,
                prompt.answer[-200:],
                gold_answer(prompt.answer, self.cfg.answer_rule),
            )
        return Grade(reward=verdict.reward, parsed=verdict.parsed)

    def _first_bad_gold(self, prompt_id: str) -> bool:
        with self._gold_lock:
            first = prompt_id not in self._bad_gold
            self._bad_gold.add(prompt_id)
        return first

    @property
    def grade_timeouts(self) -> int:
        """Gradings of this process that ran past the grade timeout or lost their grading process."""
        return self.grader.timeouts

    @property
    def gold_unparsed(self) -> int:
        """Prompts graded so far whose gold answer math-verify cannot parse."""
        return len(self._bad_gold)

    def token_mask(self, completion_ids: Sequence[int], meta: dict[str, object]) -> list[float]:
        return full_mask(completion_ids, meta)
