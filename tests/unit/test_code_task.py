"""The code task and its sandbox (``echo2/sandbox.py``, ``data/tasks/code.py``): real bubblewrap runs of
honest and hostile programs. Skipped where bubblewrap is missing or cannot make namespaces (CI installs
it and runs as root)."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest

from echo2.config import CodeTaskConfig, load_config
from echo2.data.tasks.code import CodeTask, extract_code
from echo2.errors import ConfigError, DataError
from echo2.sandbox import Limits, Sandbox, SandboxUnavailable, probe
from echo2.types import Prompt


def _sandbox(**limits: float) -> Sandbox:
    try:
        box = Sandbox(Limits(**{"wall_s": 3.0, "cpu_s": 1, **limits}))  # type: ignore[arg-type]
        probe(box)
    except SandboxUnavailable as exc:
        pytest.skip(f"no usable bubblewrap here: {exc}")
    return box


@pytest.fixture(scope="module")
def box() -> Sandbox:
    return _sandbox()


def _left(marker: str) -> list[int]:
    """Pids of processes whose command line holds ``marker`` (a sandboxed program's leftovers)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmd and b"pytest" not in cmd:
            found.append(int(pid))
    return found


def _gone(marker: str, within_s: float = 3.0) -> bool:
    deadline = time.monotonic() + within_s
    while _left(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _code_task(tmp_path: Path, rows: list[dict[str, object]], **cfg: object) -> CodeTask:
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = CodeTask(CodeTaskConfig(train_path=str(path), timeout_s=3.0, cpu_s=1, **cfg))  # type: ignore[arg-type]
    try:
        task.sandbox()
    except SandboxUnavailable as exc:
        pytest.skip(f"no usable bubblewrap here: {exc}")
    return task


ADD = {
    "prompt": "Write add(a, b).",
    "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"],
    "entry_point": "add",
}


def _prompt(task: CodeTask, row: int = 1) -> Prompt:
    return next(p for split in task.splits().values() for p in split if p.prompt_id.endswith(f":{row}"))


def _rows(n: int = 12) -> list[dict[str, object]]:
    return [ADD] + [{**ADD, "prompt": f"Write add(a, b), variant {i}."} for i in range(n)]


# ---- the sandbox, program by program -------------------------------------------------------------------
def test_sandbox_runs_a_program_and_reports_its_exit(box: Sandbox) -> None:
    ok = box.run([box.python, "-I", "-S", "-c", "print(6 * 7)"])
    assert (ok.status, ok.exit_code, ok.output) == ("ok", 0, b"42\n")
    bad = box.run([box.python, "-I", "-S", "-c", "raise SystemExit(3)"])
    assert (bad.status, bad.exit_code) == ("exit", 3)


HOSTILE = {  # what hostile code tries -> the outcome the sandbox must give
    "fork_bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        {"timeout", "cpu", "killed"},
    ),
    "infinite_loop": ("while True: pass", {"cpu"}),
    "allocate_10gb": ("x = bytearray(10 * 1024 ** 3)", {"memory"}),
    "sleep_past_limit": ("import time; time.sleep(60)", {"timeout"}),
    "print_1gb": ("import sys\nb = 'x' * (1 << 20)\nfor _ in range(1024): sys.stdout.write(b)", {"output"}),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_programs_end_at_their_limit_and_leave_nothing_running(box: Sandbox, name: str) -> None:
    code, outcomes = HOSTILE[name]
    marker = f"echo2-test-{uuid.uuid4().hex}"
    t0 = time.monotonic()
    got = box.run([box.python, "-I", "-S", "-c", f"{code}\n# {marker}"])
    assert got.status in outcomes, (got.status, got.output[-300:])
    assert time.monotonic() - t0 < box.limits.wall_s + 2.0
    assert _gone(marker), f"{name}: processes left running: {_left(marker)}"


def test_a_daemonised_child_dies_with_the_sandbox(box: Sandbox) -> None:
    marker = f"echo2-test-{uuid.uuid4().hex}"
    code = "import os, time\nif os.fork() == 0:\n    os.setsid(); time.sleep(60)\nprint('parent done')"
    code += f"\n# {marker}"
    got = box.run([box.python, "-I", "-S", "-c", code])
    assert got.status == "ok"
    assert _gone(marker), _left(marker)


def test_the_sandbox_sees_no_network_no_learner_files_and_writes_only_its_tmp(
    box: Sandbox, tmp_path: Path
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("the learner's key")
    probes = {
        "socket": "import socket; socket.create_connection(('127.0.0.1', 22), timeout=1)",
        "read": f"print(open({str(secret)!r}).read())",
        "read_home": "import os; print(os.listdir(os.path.expanduser('~root')))",
        "write_usr": "open('/usr/echo2-test', 'w').write('x')",
        "write_out": f"open({str(tmp_path / 'written.txt')!r}, 'w').write('x')",
    }
    for name, code in probes.items():
        got = box.run([box.python, "-I", "-S", "-c", code])
        assert got.status == "exit", (name, got.status, got.output[-300:])
        assert b"the learner's key" not in got.output
    assert not (tmp_path / "written.txt").exists() and not Path("/usr/echo2-test").exists()
    tmp = box.run(
        [box.python, "-I", "-S", "-c", "open('/tmp/x', 'w').write('ok'); print(open('/tmp/x').read())"]
    )
    assert (tmp.status, tmp.output) == ("ok", b"ok\n")
    big = box.run([box.python, "-I", "-S", "-c", "open('/tmp/big', 'wb').write(b'x' * (200 << 20))"])
    assert big.status == "exit" and b"File too large" in big.output


def test_limits_refuse_nonsense() -> None:
    with pytest.raises(ConfigError, match="wall_s"):
        Limits(wall_s=0)
    with pytest.raises(ConfigError, match="no such file"):
        Sandbox(python="/nonexistent/python3")


def test_a_missing_bubblewrap_is_one_line_naming_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        Sandbox()


# ---- the code task ---------------------------------------------------------------------------------------
def test_extract_code_takes_the_first_fenced_block_or_the_whole_text() -> None:
    assert extract_code("Here:\n```python\ndef f(): return 1\n```\nand ```py\nx\n```") == "def f(): return 1"
    assert extract_code("```\nprint(1)") == "print(1)"
    assert extract_code("\n    return 2  \n") == "    return 2"


def test_code_task_grades_by_running_the_tests(tmp_path: Path) -> None:
    task = _code_task(tmp_path, _rows())
    p = _prompt(task)
    assert task.grade(p, "def add(a, b): return a + b").reward == 1.0
    assert task.grade(p, "```python\ndef add(a, b):\n    return b + a\n```").reward == 1.0
    assert task.grade(p, "def add(a, b): return a - b").reward == 0.0
    for cheat in ("import sys; sys.exit(0)", "import os; os._exit(0)", "raise SystemExit(0)"):
        assert task.grade(p, cheat).reward == 0.0, cheat
    assert task.grade(p, "").parsed is False
    assert task.outcome_counts() == {"passed": 2, "failed": 1, "exited_early": 3, "no_code": 1}


def test_humaneval_shape_prepends_the_head_and_calls_check(tmp_path: Path) -> None:
    row = {
        "prompt": 'def add(a, b):\n    """The sum of a and b."""\n',
        "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n",
        "entry_point": "add",
    }
    rows = [row] + [{**row, "prompt": row["prompt"] + f"    # variant {i}\n"} for i in range(12)]
    task = _code_task(tmp_path, rows, tests_field="test", prepend_prompt=True)
    p = _prompt(task)
    assert task.grade(p, "    return a + b\n").reward == 1.0
    assert task.grade(p, "    return a * b\n").reward == 0.0


def test_hostile_completions_score_zero_with_their_outcome(tmp_path: Path) -> None:
    task = _code_task(tmp_path, _rows())
    p = _prompt(task)
    for code in ("while True: pass", "x = bytearray(10 * 1024 ** 3)", "import time; time.sleep(60)"):
        assert task.grade(p, code).reward == 0.0
    assert task.outcome_counts() == {"cpu": 1, "memory": 1, "timeout": 1}


def test_no_test_reaches_a_lease(tmp_path: Path) -> None:
    from echo2.protocol import LeasedPrompt

    task = _code_task(tmp_path, _rows())
    p = _prompt(task)
    wire = LeasedPrompt.of(p).model_dump_json()
    assert "assert add" not in wire and "assert" in p.answer


@pytest.mark.parametrize(
    ("row", "error"),
    [
        ({"tests": ["assert True"]}, "missing or empty field 'prompt'"),
        ({"prompt": "x"}, "missing or empty field 'tests'"),
        ({"prompt": "x", "tests": "assert (("}, "'tests' is not Python"),
        ({"prompt": "x", "tests": "assert 1", "entry_point": "not a name"}, "is not a Python name"),
        ({"prompt": "x", "tests": 42}, "must be text"),
    ],
)
def test_bad_records_name_the_file_line_and_field(tmp_path: Path, row: dict[str, object], error: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ADD) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=error) as got:
        CodeTask(CodeTaskConfig(train_path=str(path))).splits()
    assert "bad.jsonl:2" in str(got.value)


def test_a_record_without_a_solution_cannot_be_imitated(tmp_path: Path) -> None:
    task = _code_task(tmp_path, _rows())
    with pytest.raises(DataError, match="no reference solution"):
        task.reference(_prompt(task))


def test_the_bundled_sample_passes_its_own_references() -> None:
    task = CodeTask(CodeTaskConfig(timeout_s=3.0, cpu_s=1))
    try:
        task.sandbox()
    except SandboxUnavailable as exc:
        pytest.skip(f"no usable bubblewrap here: {exc}")
    prompts = [p for split in task.splits().values() for p in split]
    assert len(prompts) > 150
    for p in prompts[::10]:
        assert task.grade(p, task.reference(p)).reward == 1.0, p.prompt_id
        assert task.grade(p, task.reference(p).replace("return ", "return 1 + ")).reward == 0.0, p.prompt_id


def test_code_config_refuses_contradictions() -> None:
    with pytest.raises(Exception, match="cpu_s"):
        load_config(None, ["task.name=code", "task.cpu_s=10", "task.timeout_s=5"])
    with pytest.raises(Exception, match="prompt"):
        load_config(None, ["task.name=code", "task.prompt_template=Solve:"])


def test_a_workers_reward_is_never_believed_every_completion_is_graded_here(tmp_path: Path) -> None:
    """The verifier re-grades every completion of a submission in the sandbox (several at once): a worker
    claiming 1.0 for a wrong or hostile program gets 0, and an honest one gets 1 whatever it claimed."""
    from echo2.data.store import Lease
    from echo2.data.submission import Submission
    from echo2.models.embedded import build_tokenizer
    from echo2.models.policy import TextCodec
    from echo2.tasks.verify import Verifier
    from echo2.types import Trajectory

    task = _code_task(tmp_path, _rows())
    p = _prompt(task)
    codec = TextCodec(build_tokenizer(), False)
    verifier = Verifier(codec, task, eos_id=1, max_new_tokens=64)
    prompt_ids = tuple(codec.encode(p))
    texts = [
        "def add(a, b): return a + b",
        "def add(a, b): return 0",
        "import os; os._exit(0)",
        "while 1: pass",
    ]
    claimed = [0.0, 1.0, 1.0, 1.0]
    ids = [(*codec.tokenizer(text, add_special_tokens=False)["input_ids"], 1) for text in texts]
    group = tuple(
        Trajectory(p.prompt_id, f"L:{i}", prompt_ids, c, (-0.5,) * len(c), reward, 0)
        for i, (c, reward) in enumerate(zip(ids, claimed, strict=True))
    )
    lease = Lease("L", "w", "open", 0.0, [p], 0, 0)
    got = verifier.check(lease, Submission("L", 0, (group,)))
    assert [t.reward for t in got.groups[0]] == [1.0, 0.0, 0.0, 0.0]
    assert task.outcome_counts() == {"passed": 1, "failed": 1, "exited_early": 1, "cpu": 1}


def test_the_process_cap_holds_inside_and_a_program_that_never_reads_its_input_cannot_block(
    box: Sandbox,
) -> None:
    forks = "\n".join([
        "import os, time", "n = 0", "for _ in range(100):", "    try:", "        pid = os.fork()",
        "    except OSError:", "        break", "    if pid == 0:", "        time.sleep(2); os._exit(0)",
        "    n += 1", "print(n, os.getuid())",
    ])  # fmt: skip
    got = box.run([box.python, "-I", "-S", "-c", forks])
    started, uid = (int(x) for x in got.output.split())
    assert got.status == "ok" and started < box.limits.processes, got.output
    if os.geteuid() == 0:
        assert uid == 65534  # a root learner's sandbox runs as nobody
    t0 = time.monotonic()
    stuck = box.run([box.python, "-I", "-S", "-c", "import time; time.sleep(60)"], stdin=b"x" * (4 << 20))
    assert stuck.status == "timeout" and time.monotonic() - t0 < box.limits.wall_s + 2.0
