"""A real `echo2 learner --lora` on a user's checkpoint: one worker receives the frozen base with the
first link of the weights chain, one reads the same checkpoint from its own disk (`echo2 worker
--lora-base PATH`: it never receives the base), both train the run; one pointed at another checkpoint
is refused at setup with one line before it registers a lease."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from waiting import echo2, kill_left, last_step, wait_for

from echo2.observe.rundir import read_metrics

pytestmark = pytest.mark.integration


def _passed(run_dir, name: str) -> int:
    """Groups of the worker registered as ``name`` admitted and past their check (trainable or trained),
    read from the run's store beside the learner (every submission is checked here)."""
    import sqlite3

    try:
        ids = [
            r["worker_id"] for r in json.loads((run_dir / "workers.json").read_text()) if r["name"] == name
        ]
        db = sqlite3.connect(f"file:{run_dir / 'store.sqlite'}?mode=ro", uri=True, timeout=30)
    except (OSError, ValueError, sqlite3.Error):
        return 0
    try:
        (n,) = db.execute(
            "SELECT COUNT(*) FROM rollout_groups g JOIN leases l USING (lease_id) WHERE l.worker_id IN "
            f"({','.join('?' * len(ids)) or 'NULL'}) AND g.held = 0 AND (g.consumed_step IS NULL OR "
            "g.consumed_step >= 0)",
            ids,
        ).fetchone()
    except sqlite3.Error:
        return 0
    finally:
        db.close()
    return int(n)


def test_a_worker_reads_the_lora_base_from_its_own_disk(tiny_overrides, tiny_policy_factory, tmp_path):
    base, other = tmp_path / "base", tmp_path / "other"
    tiny_policy_factory().save(base)
    changed = tiny_policy_factory()
    with torch.no_grad():
        changed.model.get_input_embeddings().weight.add_(0.01)
    changed.save(other)
    run_dir = tmp_path / "run"
    sets = [*tiny_overrides, "runtime.lease_prompts=2", "lora.r=4", "security.check_fraction=1"]
    args = [a for s in sets for a in ("--set", s)]
    learner = echo2(
        "learner", *args, "--model", str(base), "--lora", "--steps", "100000", "--no-progress",
        log=tmp_path / "learner.log",
    )  # fmt: skip
    started = [learner]
    try:
        wait_for(lambda: (run_dir / "learner.json").is_file(), 120, "the learner")
        info = json.loads((run_dir / "learner.json").read_text())
        env = {**os.environ, "ECHO2_JOIN_TOKEN": (run_dir / "join_token").read_text().strip()}
        join = ["worker", "--join", info["join"], "--lora-base"]
        wrong = echo2(*join, str(other), "--name", "wrong", env=env, log=tmp_path / "wrong.log")
        started.append(wrong)
        local = echo2(*join, str(base), "--name", "local", env=env, log=tmp_path / "local.log")
        started.append(local)
        chained = echo2(*join[:-1], "--name", "chained", env=env, log=tmp_path / "chained.log")
        started.append(chained)
        assert wrong.wait(120) != 0

        def both() -> bool:
            return last_step(run_dir) >= 4 and min(_passed(run_dir, "local"), _passed(run_dir, "chained")) > 0

        wait_for(both, 300, "four steps, and work of both workers past its check")
        assert local.poll() is None, (tmp_path / "local.log").read_text()[-3000:]
        assert chained.poll() is None, (tmp_path / "chained.log").read_text()[-3000:]
        learner.send_signal(signal.SIGINT)
        rc = learner.wait(120)
    finally:
        kill_left(started)
    text = (tmp_path / "learner.log").read_text()
    assert rc == 0, text[-3000:]
    assert "LoRA base installed (" in (local_log := (tmp_path / "local.log").read_text())
    assert f"the LoRA base at {base} (--lora-base, as bfloat16)" in local_log  # read, not received
    assert "from the chain's first link" not in local_log
    chained_log = (tmp_path / "chained.log").read_text()
    assert "LoRA base installed from the chain's first link" in chained_log and "ready at v" in chained_log
    wrong_log = (tmp_path / "wrong.log").read_text()
    assert "(--lora-base, as bfloat16) digests to" in wrong_log and "another base; refusing it" in wrong_log
    admitted = {r["name"]: r["rollouts"] for r in json.loads((run_dir / "workers.json").read_text())}
    assert admitted.get("local", 0) > 0 and admitted.get("chained", 0) > 0, admitted  # both trained it
    rows = [r for r in read_metrics(run_dir) if "learner/t_train_s" in r]
    assert len(rows) >= 4 and all(r["store/rejected"] == 0 for r in rows)
    assert rows[-1]["security/quarantined"] == 0 and rows[-1]["security/checked_submissions"] > 0
