"""The prepared GPU check of the learner (benchmarks/learner_gpu.py) runs its steps on a tiny shape on the
CPU: CI keeps the script working for the day a GPU is at hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_learner_gpu_script_smoke(tmp_path):
    script = Path(__file__).parents[2] / "benchmarks" / "learner_gpu.py"
    out = tmp_path / "learner_gpu.json"
    cmd = [sys.executable, str(script), "--smoke", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["smoke"] is True and got["params"] > 0 and len(got["update_s"]) == 3
    assert got["tokens_per_s"] > 0 and got["engine_tokens"] > 0 and got["model_memory_bytes"] > 0
    assert got["mfu"] is None and got["met"] is None  # no peak FLOP/s and no GPU memory on the CPU
