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


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_wildcard_bind_without_an_address_peers_can_reach_is_refused(host):
    from echo2.errors import ConfigError
    from echo2.runtime.learner import AsyncLearner

    with pytest.raises(ConfigError, match=r"runtime\.advertise_host"):
        AsyncLearner(load_config(overrides=[f"runtime.host={host!r}"]))
    ok = AsyncLearner(load_config(overrides=[f"runtime.host={host!r}", "runtime.advertise_host=203.0.113.7"]))
    assert ok.cfg.runtime.advertise_host == "203.0.113.7"


def test_the_multi_machine_learner_command_says_what_to_set():
    res = subprocess.run(
        [sys.executable, "-m", "echo2.cli", "learner", "--set", "runtime.host=0.0.0.0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (
        res.returncode == 2 and "set runtime.advertise_host" in res.stderr and "Traceback" not in res.stderr
    )
