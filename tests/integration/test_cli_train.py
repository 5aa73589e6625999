"""`echo2` as a user runs it: real processes, real files."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def echo2(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "echo2.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_help_lists_subcommands():
    out = echo2("--help")
    assert out.returncode == 0
    for name in ("run", "learner", "worker", "train", "warmstart", "eval", "plan", "simulate"):
        assert name in out.stdout


def test_train_end_to_end_then_eval_the_checkpoint(tiny_overrides, tmp_path):
    sets = [x for o in tiny_overrides for x in ("--set", o)]
    out = echo2("train", *sets, "--steps", "5", "--no-progress")
    assert out.returncode == 0, out.stderr
    assert "held-out accuracy" in out.stdout
    run = tmp_path / "run"
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 6
    ckpt = run / "checkpoints" / "step_000005"
    ev = echo2("eval", *sets, "--model", str(ckpt))
    assert ev.returncode == 0, ev.stderr
    assert json.loads(ev.stdout.strip().splitlines()[-1])["checkpoint"] == str(ckpt)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--set", "batch.group_size=1"], "batch.group_size"),
        (["--config", "does-not-exist.toml"], "does not exist"),
        (["--model", "/nonexistent/ckpt"], "does not exist"),
    ],
)
def test_bad_input_fails_fast_with_one_line(args, needle):
    out = echo2("train", *args, "--no-progress", timeout=120)
    assert out.returncode == 2
    assert needle in out.stderr
    assert "Traceback" not in out.stderr
