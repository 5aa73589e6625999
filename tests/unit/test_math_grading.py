"""The math task's grading (data/tasks/math.py): math-verify without its SIGALRM timeout, run in a
persistent grading process under echo2's own timeout, so it grades the same from any thread and a
grading that hangs is stopped, scored 0 and counted; the gold answer as users write it (GSM8K's
``#### 42``, ``\\boxed{}``, plain); an unparsable gold scores 0 and is logged once per prompt id."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time

import pytest

from echo2.config import ArithmeticTaskConfig, MathTaskConfig
from echo2.data.tasks.math import (
    GRADE_TIMEOUT_S,
    MathGrader,
    MathTask,
    Verdict,
    gold_answer,
    grade_answer,
    last_boxed,
)
from echo2.observe import catalog
from echo2.tasks.registry import build_task
from echo2.types import Prompt

HANG = "<<hang the grading process>>"  # the test seam: a completion with it makes the child hang
TIMEOUT_S = 1.0
CASES = [  # (gold record answer, completion, expected reward)
    ("\\frac{1}{2}", "0.5", 1.0),
    ("\\frac{1}{2}", "1/2", 1.0),
    ("\\frac{1}{2}", "3", 0.0),
    ("1/2", "\\boxed{0.5}", 1.0),
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "so she sold 72 in total", 1.0),
    ("worked: 40 + 2 = 42\n#### 42", "the answer is 42", 1.0),
    ("worked: 40 + 2 = 42\n#### 42", "the answer is 40", 0.0),
    ("The answer is $\\boxed{\\sqrt{2}}$.", "so $x = \\sqrt{2}$", 1.0),
    ("12", "First 5, then 7, so $\\boxed{12}$", 1.0),
    ("12", "no idea", 0.0),
]


@pytest.fixture(scope="module")
def task():
    t = MathTask(MathTaskConfig())
    yield t
    t.grader.close()


@pytest.fixture
def hanging(request):
    grader = MathGrader(timeout_s=TIMEOUT_S, hang_marker=HANG)
    yield grader
    grader.close()


def _prompt(answer: str, pid: str = "p") -> Prompt:
    return Prompt(pid, "What?\nAnswer: ", answer)


def _grades(task: MathTask) -> list[tuple[float, bool]]:
    return [(g.reward, g.parsed) for g in (task.grade(_prompt(a), c) for a, c, _ in CASES)]


# ---- the gold answer --------------------------------------------------------------------------------
def test_gold_answer_rule():
    assert gold_answer("Natalia sold 48/2 = 24 clips.\n#### 72") == "72"
    assert gold_answer("a #### 1 then #### 1,000,000 ") == "1000000"  # the last ####; separators go
    assert gold_answer("so $\\boxed{\\frac{1}{2}}$ and \\boxed{x^{2}}") == "x^{2}"  # the last, braces matched
    assert gold_answer("first \\boxed{7}, then\n#### 5") == "5"  # #### before a box
    assert gold_answer("  \\frac{3}{2} ") == "\\frac{3}{2}"
    assert gold_answer("\\boxed{7}", "whole") == "\\boxed{7}"
    assert gold_answer("x #### 7", "boxed") == "x #### 7"  # no box: the whole string
    assert gold_answer("text ####   ") == "text ####"  # an empty answer after ####: the whole string
    assert last_boxed("\\boxed{1") is None and last_boxed("none") is None
    assert last_boxed("\\boxed{\\frac{a}{b}}.") == "\\frac{a}{b}"


# ---- the grades users expect --------------------------------------------------------------------------
def test_gsm8k_boxed_and_plain_answers(task):
    for (answer, completion, want), (reward, parsed) in zip(CASES, _grades(task), strict=True):
        assert reward == want, (answer, completion)
        assert parsed == (completion != "no idea")
    assert task.grade(_prompt("12"), "no idea").parsed is False
    assert task.grade_timeouts == 0


def test_the_grading_process_agrees_with_in_process_grading(task):
    for answer, completion, _ in CASES:
        got = task.grade(_prompt(answer), completion)
        want = grade_answer(completion, gold_answer(answer))
        assert (got.reward, got.parsed) == (want.reward, want.parsed)


# ---- any thread --------------------------------------------------------------------------------------
def test_grading_off_the_main_thread_gives_the_main_threads_grades(task):
    main = _grades(task)
    assert [r for r, _ in main] == [want for _, _, want in CASES]
    out: list[list[tuple[float, bool]]] = []
    threads = [threading.Thread(target=lambda: out.append(_grades(task))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert out == [main] * 3  # three threads at once, one grading process

    async def in_threads() -> list[list[tuple[float, bool]]]:
        return list(await asyncio.gather(*(asyncio.to_thread(_grades, task) for _ in range(2))))

    assert asyncio.run(in_threads()) == [main, main]
    assert task.grade_timeouts == 0


def test_a_fresh_task_first_grades_in_a_thread():
    """The learner's first evaluation runs in asyncio.to_thread: the grading process starts from there."""
    t = MathTask(MathTaskConfig())
    try:
        assert t.grader.pid is None  # started lazily
        grade = asyncio.run(asyncio.to_thread(t.grade, _prompt("1/2"), "\\boxed{0.5}"))
        assert (grade.reward, grade.parsed) == (1.0, True) and t.grader.pid is not None
    finally:
        t.grader.close()
    assert t.grader.pid is None


# ---- a grading that hangs ---------------------------------------------------------------------------
def test_a_hanging_grading_scores_zero_in_time_is_counted_and_the_next_works(hanging, caplog):
    t = MathTask(MathTaskConfig(), grader=hanging)
    p = _prompt("\\frac{1}{2}")
    assert t.grade(p, "0.5").reward == 1.0
    first_pid = hanging.pid
    assert first_pid is not None
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="echo2.data.tasks.math"):
        hung = t.grade(p, f"0.5 {HANG}")
    took = time.monotonic() - start
    assert (hung.reward, hung.parsed) == (0.0, False)
    assert TIMEOUT_S <= took < TIMEOUT_S + 3.0
    assert t.grade_timeouts == 1 and "ran past 1 s" in caplog.text
    with pytest.raises(ProcessLookupError):  # the hung process was killed (and reaped)
        os.kill(first_pid, 0)
    assert t.grade(p, "1/2").reward == 1.0  # the next grading works, in a fresh process
    assert hanging.pid not in (None, first_pid) and hanging.starts == 2
    assert t.grade_timeouts == 1


def test_a_hang_in_a_thread_is_stopped_too(hanging):
    t = MathTask(MathTaskConfig(), grader=hanging)
    p = _prompt("7")
    hung = asyncio.run(asyncio.to_thread(t.grade, p, f"{HANG} 7"))
    assert hung.reward == 0.0 and t.grade_timeouts == 1
    assert asyncio.run(asyncio.to_thread(t.grade, p, "7")).reward == 1.0


def test_a_grading_process_that_dies_is_replaced_and_a_lost_grading_counted(hanging):
    assert hanging.grade("7", "7") == Verdict(1.0, True, True)
    pid = hanging.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)  # dies between gradings: found dead, replaced, no grading lost
    deadline = time.monotonic() + 10
    while hanging._child is not None and hanging._child.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hanging.grade("7", "7") == Verdict(1.0, True, True) and hanging.timeouts == 0
    replaced = hanging.pid
    assert replaced not in (None, pid)
    pid = replaced
    # dies in the middle of a grading: that grading returns at once (not after the timeout), counted
    killer = threading.Timer(0.3, os.kill, (pid, signal.SIGKILL))
    killer.start()
    hanging.timeout_s = 30.0
    start = time.monotonic()
    assert hanging.grade(HANG, "7") is None
    assert time.monotonic() - start < 10.0 and hanging.timeouts == 1
    killer.join()
    assert hanging.grade("7", "7") == Verdict(1.0, True, True) and hanging.pid != pid


def test_the_timeout_is_a_documented_constant_and_checked():
    assert GRADE_TIMEOUT_S == 5.0 and MathGrader().timeout_s == GRADE_TIMEOUT_S
    with pytest.raises(ValueError, match="timeout_s"):
        MathGrader(timeout_s=0)


# ---- an unparsable gold answer ----------------------------------------------------------------------
def test_an_unparsable_gold_scores_zero_and_is_logged_once_per_prompt(task, caplog):
    before = task.gold_unparsed
    with caplog.at_level(logging.WARNING, logger="echo2.data.tasks.math"):
        grades = [task.grade(_prompt("\\frac{", "bad:1"), c) for c in ("\\frac{", "1", "no idea", "2")]
        grades += [task.grade(_prompt("???", "bad:2"), "42")]
    assert [g.reward for g in grades] == [0.0] * 5
    assert [g.parsed for g in grades] == [False, True, False, True, True]  # parsed: of the completion
    assert task.gold_unparsed == before + 2
    logged = [r for r in caplog.records if "cannot parse the gold answer" in r.getMessage()]
    assert [r.getMessage().split(":")[0] for r in logged] == ["bad", "bad"]
    assert "bad:1" in logged[0].getMessage() and "bad:2" in logged[1].getMessage()
    assert task.grade_timeouts == 0


# ---- the metric ---------------------------------------------------------------------------------------
def test_grade_timeouts_reach_the_step_record_per_step(hanging):
    entry = catalog.find("reward/grade_timeouts")
    assert entry is not None and set(entry.writers) == {"run", "train"}
    single = build_task(MathTaskConfig(), 0)
    single.data.grader.close()  # type: ignore[attr-defined]
    single.data.grader = hanging  # type: ignore[attr-defined]
    assert single.batch_metrics([]) == {"reward/grade_timeouts": 0.0}
    single.data.grade(_prompt("1"), HANG)  # type: ignore[attr-defined]
    single.data.grade(_prompt("1"), HANG)  # type: ignore[attr-defined]
    assert single.batch_metrics([]) == {"reward/grade_timeouts": 2.0}
    assert single.batch_metrics([]) == {"reward/grade_timeouts": 0.0}  # since the previous step
    assert build_task(ArithmeticTaskConfig(), 0).batch_metrics([]) == {}  # a grader that cannot hang


def test_the_answer_rule_is_a_task_option():
    record = "first \\boxed{7}, then\n#### 5"
    whole = MathTask(MathTaskConfig(answer_rule="boxed"))
    try:
        assert whole.grade(_prompt(record), "7").reward == 1.0  # boxed: 7, whatever follows
        assert whole.grade(_prompt(record), "5").reward == 0.0
    finally:
        whole.grader.close()
    with pytest.raises(ValueError, match="answer_rule"):
        MathTaskConfig(answer_rule="last-number")  # type: ignore[arg-type]


# ---- where the grade is read (the generation check's graded tokens) ------------------------------------
def test_the_answer_starts_at_the_box_the_grade_comes_from(task):
    """The graded part of a completion: from its last box when grading from there gives the whole text's
    grade; the whole text when it has no box, or when the box is not what the grade read."""
    text = "First 5, then 7, so 12. Hence $\\boxed{12}$"
    at = task.answer_start(_prompt("12"), text)
    assert at == text.rindex("\\boxed{") and at > 0
    assert task.answer_start(_prompt("12"), "First 5, then 7, so 12") == 0  # no box: every token is read
    # a box math-verify cannot read: the grade (1) comes from the text before it, which is all read
    assert task.grade(_prompt("12"), "the answer is 12. \\boxed{\\}").reward == 1.0
    assert task.answer_start(_prompt("12"), "the answer is 12. \\boxed{\\}") == 0
    assert task.answer_start(_prompt("12"), "so 12 \\boxed{}") == 0


def test_the_verifier_maps_the_answer_to_its_first_token(task):
    """Verifier.graded_from: the first completion token of the graded part, less one of margin; 0 for a
    task that cannot say (arithmetic reads every token)."""
    from echo2.models.embedded import build_tokenizer
    from echo2.models.policy import TextCodec
    from echo2.tasks.verify import Verifier
    from echo2.types import Trajectory

    codec = TextCodec(build_tokenizer(), False)
    text = "so 5 + 7 is $\\boxed{12}$"
    ids = (*codec.tokenizer(text, add_special_tokens=False)["input_ids"], 1)
    t = Trajectory("p", "L:0", (3,), ids, (-0.5,) * len(ids), 0.0, 0)
    start = Verifier(codec, task, eos_id=1, max_new_tokens=64).graded_from(_prompt("12"), t)
    box = text.rindex("\\boxed{")  # one character per token in the embedded tokenizer
    assert start == box - 1 and codec.decode_completion(ids[: start + 1]) == text[:box]
