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


def test_each_engine_setting_has_one_name_from_the_config_to_the_engine():
    """``runtime.engine_<name>`` (the workers `echo2 run` starts), ``echo2 worker --engine-<name>`` and
    ``EngineOptions.<name>``, for each of ENGINE_SETTINGS: the config's defaults are the engine's, and a
    run's settings reach the engine of the worker it starts through the command line, unchanged."""
    import dataclasses

    from echo2.cli import build_parser
    from echo2.cli.run import engine_options
    from echo2.config import RuntimeConfig
    from echo2.rollout.engines.base import ENGINE_SETTINGS, EngineOptions

    fields = {f.name for f in dataclasses.fields(EngineOptions)}
    assert set(ENGINE_SETTINGS) <= fields
    assert {n: getattr(RuntimeConfig(), f"engine_{n}") for n in ENGINE_SETTINGS} == {
        n: getattr(EngineOptions(), n) for n in ENGINE_SETTINGS
    }
    sets = ["runtime.engine_dtype=bfloat16", "security.engine_precision=bfloat16"]
    sets += ["runtime.engine_memory=0.7", "runtime.engine_device=cpu", "runtime.engine_batch_tokens=512"]
    cmd = worker_command("http://127.0.0.1:9", "local-0", load_config(overrides=sets))
    got = engine_options(build_parser().parse_args(cmd[3:]))
    want = EngineOptions(dtype="bfloat16", memory=0.7, device="cpu", batch_tokens=512)
    assert got == want
    plain = worker_command("http://127.0.0.1:9", "local-0", load_config())  # the defaults, end to end
    assert engine_options(build_parser().parse_args(plain[3:])) == EngineOptions()


def test_stop_tells_every_worker_to_leave_at_once_and_kills_at_one_deadline(tmp_path):
    """After the learner ends, the workers get SIGTERM together (one leaves at once, exit 0) and one that
    does not leave is killed when the one shared grace runs out, not after a grace per worker."""
    import time

    leaves = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); time.sleep(60)"
    stays = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    workers = LocalWorkers(load_config(overrides=[f"train.run_dir={str(tmp_path)!r}"]))
    workers.procs = [subprocess.Popen([sys.executable, "-c", code]) for code in (stays, stays, leaves)]
    try:
        time.sleep(1.0)  # their handlers installed
        t0 = time.monotonic()
        codes = workers.stop(grace_s=2.0)
        took = time.monotonic() - t0
        assert codes == [-9, -9, 0]
        assert 1.9 <= took < 3.5, took  # one deadline: two stubborn workers do not take two graces
    finally:
        for p in workers.procs:
            if p.poll() is None:
                p.kill()
