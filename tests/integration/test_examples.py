"""CI runs both examples briefly on the embedded default and checks that they learn: held-out
accuracy after 60 GRPO updates is above the warm start's (by more than one evaluation's noise).

The budget is a number of updates, not of seconds: a minute made 78 updates on a busy CI machine,
and 78 were not always enough to rise above the noise (+0.8 points once, seed 0). Both run seed 1.
Seed 0, read before, is the weakest warm start (21.1% held-out) and how fast it takes off depends on
the machine: 150 updates of the sync example gained +8.5 points on an earlier machine and +1.2 on a
later one (bit for bit the same in two runs there, and the same with the code of the last run that had
passed: the machine, not the code, differs), where seeds 1 and 2 gained +41 and +25 (the async
example: seed 0 +7.0, seed 1 +44). Seed 1 on that machine: sync +32.1 / +40.6 points after 50 / 100
updates, async +35.2 / +40.3. The 8-minute cap only ends a run that hangs. The two run side by side
(the embedded model computes on one thread). 100 updates until the suite passed 20 minutes; 60 since
(seed 1 gained 8x the threshold by 50 on that machine)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
UPDATES = 60
SEED = 1
MIN_GAIN = 0.04  # accuracy points (as a fraction) over the start; one 256-prompt evaluation moves ~0.03


SCRIPTS = {
    "minimal_grpo.py": ["--steps", str(UPDATES), "--minutes", "8", "--seed", str(SEED)],
    "minimal_async_grpo.py": ["--steps", str(UPDATES), "--minutes", "8", "--seed", str(SEED)],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, subprocess.Popen[str]]:
    """Both examples at once (each computes on one thread: the embedded model's setting), on one
    warm-start cache made first (the default model's warm start takes ~40 s here)."""
    cache = str(tmp_path_factory.mktemp("echo2-cache"))
    env = {**os.environ, "ECHO2_CACHE": cache}
    warm = [sys.executable, "-m", "echo2.cli", "warmstart", "--seed", str(SEED)]
    subprocess.run(warm, check=True, capture_output=True, timeout=600, env=env)
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": env}
    procs = {
        script: subprocess.Popen([sys.executable, str(EXAMPLES / script), *args], **pipes)
        for script, args in SCRIPTS.items()
    }
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_example_learns(script, runs):
    stdout, stderr = runs[script].communicate(timeout=600)
    assert runs[script].returncode == 0, stderr[-3000:]
    start = float(re.search(r"start: held-out accuracy ([0-9.]+)", stdout).group(1))  # type: ignore[union-attr]
    done = re.search(r"end after (\d+) \w+: held-out accuracy ([0-9.]+)", stdout)
    assert done is not None and int(done.group(1)) == UPDATES, stdout  # the cap did not end it
    end = float(done.group(2))
    assert end >= start + MIN_GAIN, stdout
    if script == "minimal_async_grpo.py":
        assert re.search(r"max staleness [0-3] \(S = 3\)", stdout), stdout  # never above S
