"""Multi-turn environments end to end, as a user runs them: `echo2 run --task poker` with real learner
and worker processes (self-play tables included), every episode replayed by the learner, then the
Table 4 evaluation; and `echo2 train --task guess`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

TINY = [
    "model.embedded.hidden_size=32",
    "model.embedded.intermediate_size=64",
    "model.embedded.num_layers=1",
    "model.embedded.num_heads=2",
    "model.embedded.num_kv_heads=1",
    "model.warmstart.max_steps=10",
    "model.warmstart.eval_every=5",
    "model.warmstart.eval_size=16",
    "batch.prompts=4",
    "batch.group_size=4",
    "train.eval_size=16",
    "train.eval_every=4",
    "train.checkpoint_every=4",
    "train.threads=1",
]


def echo2(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "echo2.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def _sets(tmp_path, extra=()):
    overrides = [*TINY, f"model.warmstart.cache_dir={str(tmp_path / 'cache')!r}", *extra]
    return [x for o in overrides for x in ("--set", o)]


def test_poker_run_trains_on_replayed_episodes_and_prints_table_4(tmp_path):
    run = tmp_path / "run"
    out = echo2(
        "run",
        "--task",
        "poker",
        *_sets(
            tmp_path, ["task.eval_deals=8", "task.selfplay_every=2", 'task.opponents=["selfplay", "tag"]']
        ),
        "--steps",
        "8",
        "--run-dir",
        str(run),
        "--no-progress",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "held-out mean return" in out.stdout
    assert "station" in out.stdout and "start" in out.stdout  # the closing Table 4
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("step", 0) > 0 and "env/turns_mean" in r]
    assert len(steps) == 8
    last = records[-1]
    assert last["store/rejected"] == 0 and last["security/quarantined"] == 0  # every replay agreed
    assert all(r["env/turns_mean"] >= 1 for r in steps)
    table = json.loads((run / "matchups.json").read_text())
    names = [m["opponent"] for m in table["matchups"]]
    assert names == ["tag", "station", "lag", "start"]
    assert all(m["hands"] == 16 for m in table["matchups"])
    assert (run / "matchups.png").is_file()
    ev = echo2("eval", "--task", "poker", *_sets(tmp_path), "--model", table["checkpoint"], "--deals", "4")
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert "chips/hand" in ev.stdout


def test_guess_trains_synchronously(tmp_path):
    run = tmp_path / "run"
    out = echo2(
        "train", "--task", "guess", *_sets(tmp_path), "--steps", "3", "--run-dir", str(run), "--no-progress"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 3


def test_a_verifiers_env_with_a_local_tool_trains_on_replayed_rescored_episodes(tmp_path):
    pytest.importorskip("verifiers.v1")
    run = tmp_path / "run"
    sets = _sets(
        tmp_path,
        [
            "task.env=echo2-vf-adder",
            "task.teacher=echo2_vf_adder:adder_teacher",
            "task.taskset_args={n = 64}",
            "task.max_turns=4",
            "sampling.max_new_tokens=10",
        ],
    )
    out = echo2(
        "run", "--task", "verifiers_env", *sets, "--steps", "6", "--run-dir", str(run), "--no-progress"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("step", 0) > 0 and "env/turns_mean" in r]
    assert len(steps) == 6 and all(r["env/turns_mean"] >= 1 for r in steps)
    last = records[-1]
    # every episode the workers sent was replayed, its turns, mask and reward the learner's own
    assert last["store/admitted"] > 0 and last["store/rejected"] == 0 and last["security/quarantined"] == 0
    assert all(r.get("env/errors", 0) == 0 for r in steps)


def test_an_unknown_task_is_one_clear_line():
    out = echo2("run", "--task", "chess", "--no-progress", timeout=60)
    assert out.returncode == 2 and "unknown task" in out.stderr and "Traceback" not in out.stderr
