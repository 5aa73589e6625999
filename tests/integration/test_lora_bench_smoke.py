"""The LoRA benchmark (benchmarks/lora.py) runs its studies on a tiny shape: adapter publications
(anchor and patch bytes against the full bf16 snapshot) and the learner's memory with LoRA beside full
fine-tuning, and a bf16 base loaded as stored. Only that it ran and wrote its fields is checked; no
verdict on a model this small."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_lora_benchmark_smoke(tmp_path):
    script = Path(__file__).parents[2] / "benchmarks" / "lora.py"
    res = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads((tmp_path / "lora_smoke.json").read_text())
    assert got["smoke"] is True
    assert (tmp_path / "lora_smoke.png").is_file()

    b = got["bytes"]
    assert [s["lr"] for s in b["series"]] == [2e-5, 5e-6]
    assert isinstance(b["met"]["median_patch_ratio"], bool)
    assert b["checks"] == {"digest_ok_fraction": 1.0, "base_frozen": True}
    for s in b["series"]:
        assert s["full_snapshot_bytes"] > 0 and s["adapter_params"] > 0 and s["base_copy_names_equal_plain"]
        assert len(s["per_publication"]) == s["publications"] == 3
        for row in s["per_publication"]:
            assert row["anchor_bytes"] > 0 and row["patch_bytes"] > 0 and row["digest_ok"]
            for key in ("anchor_ratio", "patch_ratio", "changed_fraction"):
                assert 0 < row[key] <= 1, (key, row[key])
        for key in ("anchor_ratio_median", "patch_ratio_median"):
            assert 0 < s[key] <= 1
        assert s["patch_ratio_median"] == b["median_patch_ratio"][f"{s['lr']:g}"]

    m = got["memory"]
    lora, full = m["runs"]
    assert (lora["mode"], full["mode"]) == ("lora", "full")
    assert isinstance(m["met"]["lora_at_step"], bool)
    assert lora["base_params"] == full["base_params"] > 0
    assert 0 < lora["trainable_params"] < full["trainable_params"] == full["base_params"]
    for r in (lora, full):
        assert len(r["at_step_bytes_per_param"]) == len(r["between_bytes_per_param"]) == 1
        assert math.isfinite(r["at_step_median"]) and math.isfinite(r["between_median"])
    # live tensors at the step: fp32 weights + gradients + AdamW = 16 bytes a parameter for full
    # fine-tuning (and AdamW's step counters); the bf16 base and the adapter's fp32 state come to less
    assert full["tensors_at_step_total_bytes_per_param"] == pytest.approx(16.0, rel=1e-3)
    assert 0 < lora["tensors_at_step_total_bytes_per_param"] < 16.0
    assert m["lora_vs_full_at_step"] > 0

    ld = got["load"]  # a bf16 checkpoint loaded as stored vs in float32, the same digest either way
    stored, wide = ld["runs"]
    assert (stored["mode"], wide["mode"]) == ("as-stored", "float32")
    assert stored["loaded_dtypes"] == ["torch.bfloat16"] and wide["loaded_dtypes"] == ["torch.float32"]
    assert stored["frozen_dtypes_after_attach"] == wide["frozen_dtypes_after_attach"] == ["torch.bfloat16"]
    assert ld["digests_equal"] is True and isinstance(ld["met"]["peak_ratio"], bool)
    assert stored["peak_bytes_per_param"] > 0 and wide["peak_bytes_per_param"] > 0
