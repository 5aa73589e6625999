"""`echo2 launch ray` on a one-node Ray cluster this test starts itself (`ray start --head --block` in a
temporary directory, stopped by its pid): the learner, sharded over 2 ranks in its actor
(`--learner-ranks 2`), and 2 workers placed as actors train 30+ steps;
one worker actor is killed and Ray restarts it, and its new process joins again; at the end every
process the launcher started is gone, and so is every process of the cluster."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from waiting import free_ports, last_step, wait_for

pytestmark = pytest.mark.integration
ray = pytest.importorskip("ray", reason="the [ray] extra (the dev extra installs it)")
STEPS = 60  # with workers throttled to 40 rollouts/s each: the restarted worker has time to deliver


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _processes_under(marker: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker in (d / "cmdline").read_bytes().decode(errors="replace") and _alive(int(d.name)):
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids


@pytest.fixture
def cluster():
    """A one-node Ray cluster of 4 CPUs in a short temporary directory (unix socket paths are short)."""
    temp = Path(tempfile.mkdtemp(prefix="e2r", dir="/tmp"))
    (port,) = free_ports(1)
    head = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--temp-dir={temp}",
         f"--port={port}", "--num-cpus=4", "--include-dashboard=false", "--disable-usage-stats"],
        stdout=(temp / "head.log").open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_for(lambda: "--block" in (temp / "head.log").read_text() or head.poll() is not None, 120, "ray")
        assert head.poll() is None, (temp / "head.log").read_text()[-2000:]
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        head.wait(60)
        wait_for(lambda: not _processes_under(str(temp)), 30, "the cluster's processes to end")
        shutil.rmtree(temp, ignore_errors=True)


def test_launch_ray_places_restarts_and_stops(cluster, tiny_overrides, tmp_path):
    address = cluster
    run_dir = tmp_path / "run"
    sets = [a for o in [*tiny_overrides, "runtime.worker_max_rollouts_per_s=40"] for a in ("--set", o)]
    cmd = [sys.executable, "-m", "echo2.cli", "launch", "ray", "--address", address, "--workers", "2",
           "--learner-ranks", "2",
           "--steps", str(STEPS), "--no-progress", *sets, "--set", "train.eval_every=10"]  # fmt: skip
    log = tmp_path / "launch.log"
    launcher = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        wait_for(lambda: last_step(run_dir) >= 10 or launcher.poll() is not None, 240, "step 10")
        assert launcher.poll() is None, log.read_text()[-3000:]
        actors = json.loads((run_dir / "ray_actors.json").read_text())
        assert set(actors) == {"learner", "learner-rank1", "ray-0", "ray-1"}  # the ranks: a placement group
        first = actors["ray-1"]
        os.kill(first["actor_pid"], signal.SIGKILL)  # the actor dies: Ray restarts it, its worker rejoins
        wait_for(lambda: json.loads((run_dir / "ray_actors.json").read_text())["ray-1"]["restarts"] == 1,
                 120, "the restart")  # fmt: skip
        assert launcher.wait(300) == 0, log.read_text()[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGINT)
            launcher.wait(60)
    actors = json.loads((run_dir / "ray_actors.json").read_text())
    started = [p for a in [*actors.values(), first] for p in (a["actor_pid"], a["pid"])]
    wait_for(lambda: not any(_alive(p) for p in started), 30, "every process the launcher started to end")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["version"] == STEPS and summary["staleness_max"] <= 3
    assert all((c / "dcp").is_dir() for c in (run_dir / "checkpoints").glob("step_*"))  # a sharded learner
    rejoined = (run_dir / "workers" / "ray-1.log").read_text()
    reports = [json.loads(x) for x in rejoined.splitlines() if x.startswith("{")]
    assert reports and reports[-1]["rollouts_submitted"] > 0  # the restarted worker delivered, left cleanly
    text = log.read_text()
    assert "echo2 launch ray: " in text and "restarted by Ray" in text
    print(f"held-out: launch ray {summary['final_accuracy']:.3f} (max staleness {summary['staleness_max']})")
