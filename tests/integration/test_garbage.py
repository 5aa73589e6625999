"""The garbage suite (benchmarks/echo2_bench/garbage.py) against a real `echo2 learner` over TLS while an
honest worker trains: not one 500, every item its 4xx (or the dropped connection that is its answer),
each refusal counted in the metrics under its reason, no traceback in the learner's log, and training
goes on."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest
from waiting import echo2, kill_left, last_step, wait_for

from echo2.observe.rundir import read_metrics
from echo2_bench.garbage import problems, refusals, register, run_garbage, target_of_run

pytestmark = pytest.mark.integration


def test_the_garbage_suite_gets_counted_4xx_and_training_goes_on(tiny_overrides, tmp_path):
    run_dir = tmp_path / "run"
    sets = [*tiny_overrides, "runtime.lease_prompts=2", "train.eval_every=1000", "security.body_timeout_s=2"]
    args = [a for s in sets for a in ("--set", s)]
    learner = echo2("learner", *args, "--steps", "100000", "--no-progress", log=tmp_path / "learner.log")
    started = [learner]
    try:
        wait_for(lambda: (run_dir / "learner.json").is_file(), 120, "the learner")
        info = json.loads((run_dir / "learner.json").read_text())
        token = (run_dir / "join_token").read_text().strip()
        env = {**os.environ, "ECHO2_JOIN_TOKEN": token}
        honest = echo2(
            "worker", "--join", info["join"], "--name", "honest", env=env, log=tmp_path / "worker.log"
        )
        started.append(honest)
        wait_for(lambda: last_step(run_dir) >= 3, 180, "three steps with the honest worker")
        blank = target_of_run(run_dir, "")
        credential = asyncio.run(register(blank.api, blank.cert_pem, token))
        outcomes = asyncio.run(asyncio.wait_for(run_garbage(target_of_run(run_dir, credential)), 300))
        after = last_step(run_dir)
        wait_for(lambda: last_step(run_dir) >= after + 3, 120, "three more steps after the garbage")
        assert honest.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]  # still at work
        learner.send_signal(signal.SIGINT)
        rc = learner.wait(120)
    finally:
        kill_left(started)
    text = (tmp_path / "learner.log").read_text()
    assert rc == 0, text[-3000:]
    statuses = {name: sorted(set(o.statuses)) for name, o in outcomes.items()}
    assert not any(500 in o.statuses for o in outcomes.values()), statuses
    assert problems(outcomes) == [], statuses
    rows = [r for r in read_metrics(run_dir) if "learner/t_train_s" in r]
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] >= after + 3  # training went on
    last = rows[-1]
    for reason, n in refusals(outcomes).items():
        assert last.get(f"store/rejected/{reason}", 0) >= n, (reason, n, last.get(f"store/rejected/{reason}"))
    assert "Traceback" not in text, text[text.index("Traceback") - 500 :][:3000]
