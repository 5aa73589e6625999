"""A user's checkpoint and a user's GSM8K-style file through the whole distributed system: `echo2 learner
--model <ckpt>` on `math` with a chat template (a system message and a template argument) and a
generation config with two end-of-sequence ids, and two `echo2 worker` processes started in another
directory, where the dataset file does not exist: they need nothing but the join string."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from waiting import wait_for

from echo2.observe.rundir import read_metrics

pytestmark = pytest.mark.integration
STEPS = 50


def test_learner_and_two_fileless_workers_train_a_users_model_on_gsm8k(user_checkpoint, tmp_path):
    home, elsewhere = tmp_path / "learner", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    rows = [
        {"question": f"What is {a} times {b}?", "answer": f"{a} * {b} = {a * b}\n#### {a * b}"}
        for a in range(12)
        for b in range(12)
    ]
    (home / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = [
        "task.name=math",
        "task.train_path=gsm8k.jsonl",  # relative to the learner's directory: no worker could open it
        "model.chat_template=true",
        "model.system_prompt='Answer with a number.'",
        "model.chat_template_kwargs.think=false",
        "sampling.max_new_tokens=6",
        "batch.prompts=4",
        "batch.group_size=4",
        "runtime.lease_prompts=2",
        "runtime.workers=0",
        "train.eval_size=16",
        "train.eval_every=25",
        "train.checkpoint_every=25",
        "train.threads=1",
    ]
    run_dir = home / "run"
    args = [
        "--model",
        str(user_checkpoint),
        "--run-dir",
        str(run_dir),
        "--steps",
        str(STEPS),
        "--no-progress",
    ]
    args += [a for s in sets for a in ("--set", s)]
    started = []
    try:
        with (home / "learner.log").open("wb") as log:
            learner = subprocess.Popen([sys.executable, "-m", "echo2.cli", "learner", *args], cwd=home,
                                       stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        started.append(learner)
        wait_for(lambda: (run_dir / "learner.json").is_file(), 180, "the learner")
        join = json.loads((run_dir / "learner.json").read_text())["join"]
        env = {**os.environ, "ECHO2_JOIN_TOKEN": (run_dir / "join_token").read_text().strip()}
        for i in range(2):
            cmd = [sys.executable, "-m", "echo2.cli", "worker", "--join", join, "--name", f"w{i}"]
            with (elsewhere / f"worker{i}.log").open("wb") as log:
                started.append(
                    subprocess.Popen(cmd, cwd=elsewhere, env=env, stdout=log, stderr=subprocess.STDOUT)
                )
        rc = learner.wait(420)
        assert rc == 0, (home / "learner.log").read_text()[-3000:]
        for w in started[1:]:
            assert w.wait(60) == 0
    finally:
        for p in started:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
    logs = [
        (home / "learner.log").read_text(),
        *((elsewhere / f"worker{i}.log").read_text() for i in range(2)),
    ]
    assert not any("Traceback" in text for text in logs), logs
    assert not (elsewhere / "gsm8k.jsonl").exists()
    records = read_metrics(run_dir)
    steps = [r for r in records if "learner/t_train_s" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    last = steps[-1]
    # both workers' prompts (system message, template argument), completions (either end-of-sequence id)
    # and sampled generations passed the learner's checks: nothing was refused (a drawn submission pins
    # its version's weights until its check ran: never `unchecked_version`)
    assert last["store/rejected"] == 0 and last["store/admitted"] >= STEPS * 16
    assert last["security/checked_submissions"] >= 1
    assert last["data/epoch"] > 0 and last["data/prompts_skipped"] == 0
    assert last["reward/grade_timeouts"] == 0 and last["data/completion_tokens_trained"] > 0
    config = json.loads((run_dir / "config.json").read_text())
    assert config["model"]["system_prompt"] == "Answer with a number."
