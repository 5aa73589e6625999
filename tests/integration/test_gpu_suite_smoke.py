"""The GPU suite (benchmarks/gpu_suite.py) in its smoke mode: every section at tiny shapes on the CPU, in
its own group's process under its time budget, the JSON and the figure written. CI keeps the suite
working for the minutes an H200 is at hand; the smoke run's readings are the code paths', not figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_suite.py"


def test_every_section_of_the_gpu_suite_runs_in_its_smoke_mode(tmp_path):
    out = tmp_path / "gpu_suite.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], capture_output=True,
                         text=True, timeout=400)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["smoke"] is True and got["met"] is None  # no target is judged on the CPU
    sections = got["sections"]
    names = ["preflight", "learner", "publication", "engine", "bf16_errors", "check", "four_b", "sharded"]
    assert list(sections) == names
    bad = {
        k: (v["status"], (v.get("error") or "")[-500:]) for k, v in sections.items() if v["status"] != "ok"
    }
    assert not bad, bad
    r = {k: v["result"] for k, v in sections.items()}
    assert r["preflight"]["measured_bf16_flops"] > 0 and r["preflight"]["transformers"]
    assert [run["micro_batch_tokens"] for run in r["learner"]["runs"]] == [256, 128]
    assert all(run["tokens_per_s"] > 0 and run["model_gib"] > 0 for run in r["learner"]["runs"])
    pub = r["publication"]
    assert pub["patch_rebuilds_publication"] and pub["logits_equal_fresh"]  # the worker's side is exact
    assert r["engine"]["tokens"] > 0 and r["engine"]["tokens_per_s"] > 0
    errors = r["bf16_errors"]
    assert len(errors["completions"]) == 16 and errors["hook_agrees"] and errors["failing_completions"] == 0
    assert 0 <= errors["p999_error"] <= errors["max_error"] < errors["logprob_tolerance"]
    chk = r["check"]
    assert chk["alone_s"] > 0 and chk["tokens"] == 4 * 24 and len(chk["switch_s"]) == 2
    assert [b["duty"] for b in chk["beside_update"]] == [0.02, 1.0]
    assert all("error" not in b and b["check_s"] > 0 for b in chk["beside_update"])
    assert len(r["four_b"]["update_s"]) == 2 and r["four_b"]["model_fits_80"]["fits"] is True
    sh = r["sharded"]
    assert sh["backend"] == "gloo" and sh["publication_equal_at_load"] and sh["dcp_round_trip_equal"]
    assert sh["max_weight_diff_after_updates"] < 1e-5
    assert out.with_suffix(".png").is_file()


def test_a_section_past_its_budget_reports_what_it_read_and_the_rest_run(tmp_path, monkeypatch):
    """The guard: a section that fails or runs past its time is recorded as such (with its partial
    readings), the sections that need what it would have made are skipped and say why, the others run."""
    sys.path.insert(0, str(SCRIPT.parent))
    import torch  # noqa: F401 (imported before the alarms: an import cut short leaves a broken module)
    import transformers  # noqa: F401

    import gpu_suite
    from echo2_bench import gpu_sections

    def slow(ctx):
        ctx.partial["before_the_hang"] = 1
        import time

        time.sleep(30)

    def broken(ctx):
        raise RuntimeError("no device")

    monkeypatch.setitem(gpu_sections.SECTIONS, "learner", slow)
    monkeypatch.setitem(gpu_sections.SECTIONS, "four_b", broken)
    monkeypatch.setattr(gpu_suite, "SMOKE_BUDGET_S", 5)
    log = tmp_path / "log.jsonl"
    for group in ("main", "four_b"):
        gpu_suite.run_group(group, True, log)
    recs = {}
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        if "event" not in rec:
            recs[rec["name"]] = rec
    assert recs["preflight"]["status"] == "ok"
    assert recs["learner"]["status"] == "timeout" and recs["learner"]["result"] == {"before_the_hang": 1}
    assert recs["publication"]["status"] == "skipped" and "model" in recs["publication"]["reason"]
    assert recs["four_b"]["status"] == "error" and "no device" in recs["four_b"]["error"]
