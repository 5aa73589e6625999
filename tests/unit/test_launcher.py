"""`echo2 run`'s local worker processes: the command line it starts, and the dead-pool check."""

from __future__ import annotations

import subprocess
import sys

import pytest

from echo2.config import load_config
from echo2.errors import Echo2Error
from echo2.runtime.launcher import LocalWorkers, worker_command


def test_worker_command_carries_price_and_throttle_but_not_the_token():
    cfg = load_config(overrides=["runtime.worker_usd_per_hour=0.5", "runtime.worker_max_rollouts_per_s=40"])
    cmd = worker_command("http://127.0.0.1:9", "local-0", cfg)
    assert cmd[:4] == [sys.executable, "-m", "echo2.cli", "worker"]
    assert cmd[cmd.index("--usd-per-hour") + 1] == "0.5"
    assert cmd[cmd.index("--max-rollouts-per-s") + 1] == "40.0"
    assert "--token" not in cmd  # the join token travels in the environment, not in argv


def test_check_raises_only_once_every_worker_has_exited(tmp_path):
    workers = LocalWorkers(load_config(overrides=[f"train.run_dir={str(tmp_path)!r}"]))
    workers.check()  # no workers started: nothing to say
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    workers.procs = [alive, dead]
    try:
        dead.wait(10)
        workers.check()  # one still runs
        alive.kill()
        alive.wait(10)
        with pytest.raises(Echo2Error, match=r"all 2 local workers exited \(codes \[-9, 3\]\)"):
            workers.check()
    finally:
        for p in (alive, dead):
            if p.poll() is None:
                p.kill()
