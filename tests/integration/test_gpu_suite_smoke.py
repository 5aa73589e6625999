"""The GPU suite (benchmarks/gpu_suite.py) in its smoke mode: every section at tiny shapes on the CPU, in
its own group's process under its time budget, the JSON and the figure written. CI keeps the suite
working for the minutes an H200 is at hand; the smoke run's readings are the code paths', not figures.

It runs in an environment like the H200's: a virtual environment holding only torch and transformers
with what they require (less pydantic, which that machine lacks; less typer, transformers' command line,
which pulls it in) and the packages ``scripts/prepare-gpu-carry`` fetches (its ``PINS``), so a package
the suite needs that the carry leaves out fails this test."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_suite.py"
ABSENT = {"pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typer"}  # not on the H200


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(roots: list[str]) -> set[str]:
    """``roots`` and what they require (no extras), transitively, as installed; less ``ABSENT``."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = _norm(todo.pop())
        if name in seen or name in ABSENT:
            continue
        seen.add(name)
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0] for r in reqs if "extra ==" not in r]
    return seen


def _like_the_h200(where: Path) -> Path:
    """A virtual environment whose site-packages links only torch, transformers, their requirements and
    the carried packages from this one; its python."""
    import runpy

    pins = runpy.run_path(str(ROOT / "scripts" / "prepare-gpu-carry"), run_name="carry")["PINS"]
    keep = _requirements(["torch", "transformers"]) | {_norm(n) for n in pins}
    venv.create(where, with_pip=False, symlinks=True)
    site = next(where.glob("lib/python*/site-packages"))
    for name in sorted(keep):
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # a requirement for another platform (CUDA libraries on a CPU build)
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            src, dst = Path(dist.locate_file(top)), site / top
            if src.exists() and not dst.exists() and not top.endswith(".pth"):
                dst.symlink_to(src)
    return where / "bin" / "python"


def test_every_section_of_the_gpu_suite_runs_in_its_smoke_mode(tmp_path):
    out = tmp_path / "gpu_suite.json"
    python = _like_the_h200(tmp_path / "h200-like")
    for module in ("peft", "datasets", "sklearn"):  # echo2's other requirements are not there, nor extras
        bare = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, text=True)
        assert bare.returncode != 0, module
    res = subprocess.run([str(python), str(SCRIPT), "--smoke", "--out", str(out)], capture_output=True,
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
    noise = r["preflight"]["noise"]  # on the CPU the device is this machine: the same bits
    assert noise["bit_identical_to_plain"] and noise["equal_to_cpu_share"] == 1.0, noise
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


def test_carried_wheels_are_unpacked_first_on_the_path(tmp_path, monkeypatch):
    """``--wheels``: every wheel unpacked into one folder first on this process's path and its children's
    (``PYTHONPATH``), compiled modules included (they cannot import from a zip); the folder named."""
    import zipfile

    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_suite

    wheels = tmp_path / "carry"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "carried_probe-1.0-py3-none-any.whl", "w") as z:
        z.writestr("carried_probe/__init__.py", "WHERE = __file__\n")
        z.writestr("carried_probe-1.0.dist-info/METADATA", "Name: carried_probe\nVersion: 1.0\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    got = gpu_suite.use_wheels(wheels)
    import carried_probe

    assert carried_probe.WHERE.startswith(got["unpacked_to"])
    assert got["wheels"] == ["carried_probe-1.0-py3-none-any.whl"] and got["shadowed_installed"] == {}
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [got["unpacked_to"], "/elsewhere"]
    with pytest.raises(SystemExit, match="no wheels"):
        gpu_suite.use_wheels(tmp_path)
