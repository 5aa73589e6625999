"""A worker stopped by SIGTERM in the middle of a generation: the generation ends and lands, the
generator thread is joined, and the process exits 0 (not torch's abort at interpreter exit,
``terminate called without an active exception``, which a thread still inside torch caused)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from waiting import echo2, kill_left, wait_for

pytestmark = pytest.mark.integration


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_worker_stopped_mid_generation_submits_it_and_exits_0(tiny_overrides, tmp_path):
    run_dir = tmp_path / "run"
    sets = [*tiny_overrides, "runtime.port=0", "runtime.broadcast_port=0"]
    # one lease = 16 completions of up to 160 tokens: a generation of seconds, long enough to stop inside
    sets += ["model.embedded.max_positions=256", "sampling.max_new_tokens=160", "runtime.lease_prompts=4"]
    args = [a for s in sets for a in ("--set", s)]
    learner = echo2("learner", *args, "--steps", "1000", "--no-progress", log=tmp_path / "learner.log")
    started = [learner]
    try:
        up = run_dir / "learner.json"
        wait_for(lambda: up.is_file() or learner.poll() is not None, 180, "the learner")
        assert learner.poll() is None, (tmp_path / "learner.log").read_text()[-3000:]
        env = {**os.environ, "ECHO2_JOIN_TOKEN": (run_dir / "join_token").read_text().strip()}
        url = json.loads(up.read_text())["join"]
        log = tmp_path / "worker.log"
        worker = echo2("worker", "--join", url, "--name", "w0", env=env, log=log)
        started.append(worker)
        wait_for(lambda: "ready at v0" in log.read_text() or worker.poll() is not None, 180, "the worker")
        assert worker.poll() is None, log.read_text()[-3000:]
        # ready, then its first lease: the CPU time it spends from here is that generation's
        ready_cpu = _cpu_s(worker.pid)
        wait_for(lambda: _cpu_s(worker.pid) > ready_cpu + 0.5, 120, "the worker generating")
        worker.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        code = worker.wait(120)
        text = log.read_text()
    finally:
        kill_left(started)
    assert "terminate called" not in text and "Traceback" not in text, text[-3000:]
    assert code == 0, text[-3000:]
    counters = json.loads(next(x for x in reversed(text.splitlines()) if x.startswith("{")))
    assert counters["rollouts_submitted"] > 0, text[-3000:]  # the generation it was in landed
    assert time.monotonic() - t0 < 90
