"""`echo2 learner --nproc-per-node 2` (two gloo ranks under torchrun; rank 0 the node) with one worker:
it trains, one rank is killed with SIGKILL, the whole learner stops (no hang), and `echo2 learner
--resume` at world size 1 resumes from the sharded (DCP) checkpoint with nothing admitted lost: every
accepted trajectory is in the ledger and every step trained on exactly P groups, each group once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import free_ports, last_step, wait_for

from echo2.models.policy import DCP_DIR
from echo2.observe.rundir import read_metrics

pytestmark = pytest.mark.integration
P = 4  # prompts per step of the tiny overrides


def _echo2(*args: str, env: dict[str, str] | None = None, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "echo2.cli", *args], stdout=log.open("ab"),
                            stderr=subprocess.STDOUT, env=env)  # fmt: skip


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_a_rank_killed_stops_the_learner_and_it_resumes_at_world_size_one(tiny_overrides, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "learner.log"
    steps = 60
    http, bcast = free_ports(2)
    sets = [*tiny_overrides, f"runtime.port={http}", f"runtime.broadcast_port={bcast}",
            "runtime.lease_prompts=2", "runtime.heartbeat_s=0.5", "train.checkpoint_every=8",
            "train.eval_every=1000"]  # fmt: skip
    args = [a for s in sets for a in ("--set", s)] + ["--steps", str(steps), "--no-progress"]
    learner = _echo2("learner", *args, "--nproc-per-node", "2", log=log)  # becomes torchrun's agent
    started, ranks = [learner], []
    try:
        wait_for(lambda: (run_dir / "learner.json").is_file(), 180, "the learner")
        env = {**os.environ, "ECHO2_JOIN_TOKEN": (run_dir / "join_token").read_text().strip()}
        join = json.loads((run_dir / "learner.json").read_text())
        worker = _echo2("worker", "--join", join["join"], "--name", "w0", "--max-rollouts-per-s", "150",
                        env=env, log=tmp_path / "worker.log")  # fmt: skip
        started.append(worker)
        wait_for(lambda: last_step(run_dir) >= 30, 180, "step 30 on two ranks")
        ranks = _children(learner.pid)
        assert len(ranks) == 2 and join["pid"] in ranks, ranks  # torchrun's two ranks; rank 0 is the node
        os.kill(next(p for p in ranks if p != join["pid"]), signal.SIGKILL)  # the other rank dies
        assert learner.wait(120) != 0, log.read_text()[-3000:]  # the learner stops, no hang
        crashed_at = last_step(run_dir)
        checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
        assert checkpoints and all((c / DCP_DIR / ".metadata").is_file() for c in checkpoints)  # sharded
        learner = _echo2("learner", *args, "--resume", log=log)  # one rank
        started.append(learner)
        assert learner.wait(240) == 0, log.read_text()[-3000:]
        assert worker.wait(60) == 0  # the worker followed the restart and left cleanly
        # and back to two ranks from the one-process checkpoint (1 -> 2), with a new worker
        args[args.index("--steps") + 1] = str(steps + 16)
        learner = _echo2("learner", *args, "--resume", "--nproc-per-node", "2", log=log)
        started.append(learner)
        wait_for(lambda: log.read_text().count("learner API at") == 3, 180, "rank 0 of the second resume")
        started.append(_echo2("worker", "--join", join["join"], env=env, log=tmp_path / "w1.log"))
        assert learner.wait(240) == 0, log.read_text()[-3000:]
    finally:
        for p in started:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    resumed_at = int(text.split("resuming at version ")[1].split()[0])
    assert 8 <= resumed_at <= crashed_at and resumed_at % 8 == 0  # the last sharded checkpoint
    rows = [r for r in read_metrics(run_dir) if "learner/t_train_s" in r]
    assert rows[-1]["step"] == steps + 16
    db = sqlite3.connect(run_dir / "store.sqlite")
    admitted = db.execute("SELECT value FROM counters WHERE name = 'admitted'").fetchone()[0]
    stored = db.execute("SELECT COALESCE(SUM(n_traj), 0) FROM rollout_groups").fetchone()[0]
    per_step = dict(db.execute("SELECT consumed_step, COUNT(*) FROM rollout_groups WHERE consumed_step > 0 "
                               "GROUP BY consumed_step").fetchall())  # fmt: skip
    db.close()
    assert admitted == stored  # every accepted trajectory is in the ledger: none lost
    assert per_step == {s: P for s in range(1, steps + 17)}  # each group under one step: none twice
