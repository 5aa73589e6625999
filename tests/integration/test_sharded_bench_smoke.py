"""The sharded-learner benchmark (benchmarks/sharded.py) runs K = 1 and K = 2 on a tiny shape on the CPU:
CI keeps the script working for the day GPUs are at hand, and its tensor accounting reads what FSDP2
divides (parameters + gradients + AdamW: 16 bytes a parameter in one process, half of that per rank)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_sharded_benchmark_smoke(tmp_path):
    script = Path(__file__).parents[2] / "benchmarks" / "sharded.py"
    res = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads((tmp_path / "sharded_smoke.json").read_text())
    one, two = got["runs"]
    assert (one["k"], two["k"], len(two["ranks"])) == (1, 2, 2)
    assert one["max_rank_bytes_per_param"] == pytest.approx(16.0, rel=0.01)  # 4 + 4 + 8, nothing sharded
    assert 0.45 <= got["bytes_k2_vs_k1"] <= 0.55 and got["met"] is True
    assert two["publication_bytes"] == one["publication_bytes"] > 0  # the same bf16 bytes, gathered
    assert (tmp_path / "sharded_smoke.png").is_file()
