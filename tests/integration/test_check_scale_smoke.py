"""The generation check's benchmark (benchmarks/check_scale.py) runs every study on a tiny shape: CI keeps
the script working against the intake, the check and the turns it measures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_check_scale_script_smoke():
    script = Path(__file__).parents[2] / "benchmarks" / "check_scale.py"
    cmd = [sys.executable, str(script), "--smoke"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = {
        line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1])
        for line in res.stdout.splitlines()
        if line.split(" ", 1)[0] in ("latency", "step", "memory", "noise")
    }
    assert set(got) == {"latency", "step", "memory", "noise"}
    assert got["latency"]["submissions"] == 8 and got["latency"]["p99_s"] > 0
    assert got["step"]["checks_run"] >= 1 and got["step"]["check_duty"] == 0.02
    assert got["memory"]["peak_ratio_512_vs_64"] > 0
    noise = got["noise"]["noise_alone"]["rows"]
    assert noise and all(r["bit_identical"] for r in noise), noise
    assert got["noise"]["what_it_buys"]["check"]["median_ratio"] > 0
