"""The vLLM engine (rollout/engines/vllm_engine.py): what it samples and reports against the HF engine
on the same weights, installs into the running engine, and a whole `echo2 run` whose workers use it.

vLLM is optional (scripts/install-vllm.sh): without it these tests skip, and the ones at the bottom
check the one-line error a user gets instead."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from echo2.errors import ConfigError
from echo2.observe.rundir import read_metrics
from echo2.rollout.engines.vllm_engine import require_vllm

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM, reason="the vLLM engine is not installed (scripts/install-vllm.sh)"
)


@pytest.fixture(scope="module")
def probe() -> dict:
    """The measurements of vllm_probe.py (its own process: vLLM binds threads and memory process-wide)."""
    script = Path(__file__).with_name("vllm_probe.py")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("PROBE "))
    return json.loads(line[len("PROBE ") :])


@needs_vllm
@pytest.mark.integration
@pytest.mark.vllm
def test_vllm_draws_the_seeded_tokens_with_the_learners_logprobs(probe):
    # the same seeded Gumbel-max draws as the HF engine, rows and first steps honoured
    for case in ("sampled", "tempered", "greedy"):
        c = probe[case]
        assert c["same"] == c["n"], (case, c)
        assert c["finished_agree"], case
    # log-probs under softmax(logits / T), before nucleus truncation: fp32 kernels agree to ~1e-6
    assert probe["sampled"]["max_err"] < 1e-4
    assert probe["tempered"]["max_err"] < 1e-4
    assert probe["learner_recompute_max_err"] < 1e-4
    assert probe["distinct_seeds_differ"]


@needs_vllm
@pytest.mark.integration
@pytest.mark.vllm
def test_vllm_installs_into_the_running_engine_and_refuses_what_does_not_fit(probe):
    assert probe["after_install"]["same"] == probe["after_install"]["n"]  # the new version samples
    assert probe["install_s"] > 0
    refused = probe["refused"]
    assert "lacks weights for ['model.norm.weight']" in refused["missing"]
    assert "model.norm.weight has shape (7,)" in refused["reshaped"]
    assert "lacks: ['extra.w']" in refused["unknown"]
    # vLLM failing half-way through a load: the version served before is loaded back
    assert probe["partial_failure"].startswith("vLLM failed loading the new version (device lost)")
    # a refused or failed install changed nothing: the version installed before still serves
    assert probe["still_new_after_refusals"]["same"] == probe["still_new_after_refusals"]["n"]


@needs_vllm
@pytest.mark.integration
@pytest.mark.vllm
def test_vllm_serves_lora_adapters_natively_as_the_check_computes_them():
    """vLLM's own LoRA (enable_lora, a LoRA request per version, the base loaded once) against the HF
    engine on the float32 merge the learner's check runs in a native run: the same seeded tokens and
    log-probs within fp32 kernel noise; the next version swaps in between generations; an adapter that
    does not fit the base is refused and the one before keeps serving."""
    script = Path(__file__).with_name("vllm_lora_probe.py")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=400,
                         cwd=script.parent)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(x for x in res.stdout.splitlines() if x.startswith("PROBE "))
    probe = json.loads(line[len("PROBE ") :])
    assert probe["native"] is True
    for case in ("v1", "v2", "still_v2"):
        c = probe[case]
        assert c["same"] == c["n"] and c["finished_agree"], (case, c)
        assert c["max_err"] < 1e-4, (case, c)  # the fp32 engines' own agreement (test above)
    assert probe["base_only_same"] < 24  # the adapter changes what is sampled: it was applied
    assert "adapter tensors of model.layers.0.self_attn.q_proj do not fit" in probe["refused"]


@needs_vllm
@pytest.mark.integration
@pytest.mark.vllm
def test_echo2_run_with_vllm_workers_and_lora(tiny_overrides, tmp_path):
    """A LoRA run (the learner publishes the adapter alone) with vLLM workers, which serve each adapter
    through vLLM's own LoRA support (``lora.vllm = "native"``, the default): every submission re-checked
    against base + adapter, all admitted; each publication after the first (which carries the base) is a
    fraction of it."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "echo2.cli", "run", *[a for o in tiny_overrides for a in ("--set", o)]]
    # head_dim 32 (the tiny shape's 16 has no vLLM CPU attention kernel); every submission re-checked
    vllm_run = ["model.embedded.hidden_size=64", "runtime.engine=vllm", "security.check_fraction=1"]
    for o in [*vllm_run, "runtime.lease_prompts=4", "lora.r=4"]:
        cmd += ["--set", o]
    cmd += ["--steps", "20", "--workers", "2", "--no-progress", "--lora"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [r for r in read_metrics(run_dir) if "learner/t_train_s" in r]
    assert [r["step"] for r in rows] == list(range(1, 21))
    # every submission re-checked (seeded tokens and log-probs against the learner's weights): all pass
    assert all(r["store/rejected"] == 0 for r in rows)
    assert rows[-1]["security/quarantined"] == 0
    logs = sorted((run_dir / "workers").glob("*.log"))
    reports = [json.loads(p.read_text().strip().splitlines()[-1]) for p in logs]
    assert len(reports) == 2 and all(r["install_failures"] == 0 for r in reports)
    assert all("LoRA adapters served natively by the engine" in p.read_text() for p in logs)
    # all 20 steps' rollouts came from vLLM workers (a slow starter may miss a short run altogether)
    assert sum(r["rollouts_submitted"] for r in reports) >= 20 * 4 * 4
    # the first link (v0, kept for the whole run) carries the base; later ones the adapter alone
    base_bytes = (run_dir / "published" / "v0000000000.bin").stat().st_size
    published = [r["broadcast/publication_bytes"] for r in rows if r["step"] >= 3]
    assert published and max(published) < 0.5 * base_bytes  # the adapter, not the model
    assert rows[-1]["security/checked_submissions"] > 0


def test_a_missing_vllm_is_one_line_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ModuleNotFoundError
    with pytest.raises(ConfigError) as exc:
        require_vllm()
    assert str(exc.value).startswith("the vLLM engine needs the vllm package: bash scripts/install-vllm.sh")
    argv = ["worker", "--join", "http://127.0.0.1:9", "--token", "x" * 16, "--engine", "vllm"]
    code = f"import sys; sys.modules['vllm'] = None; from echo2.cli import main; sys.exit(main({argv!r}))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "echo2 worker: error: the vLLM engine needs the vllm package: bash scripts/install-vllm.sh "
        "(or pip install 'echo2[vllm]' on a CUDA machine)"
    ]


def test_a_vllm_that_does_not_import_says_why(monkeypatch):
    class Broken:  # a finder whose module raises on import, as a torchvision built for another torch does
        def find_spec(self, name, path=None, target=None):
            if name != "vllm":
                return None
            return importlib.util.spec_from_loader(name, self)

        def create_module(self, spec):
            return None

        def exec_module(self, module):
            raise RuntimeError("operator torchvision::nms does not exist\nmore detail")

    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    with pytest.raises(ConfigError) as exc:
        require_vllm()
    assert str(exc.value) == (
        "vllm is installed but does not import (operator torchvision::nms does not exist): "
        "bash scripts/install-vllm.sh (or pip install 'echo2[vllm]' on a CUDA machine)"
    )


@needs_vllm
@pytest.mark.integration
@pytest.mark.vllm
def test_the_prepared_gpu_check_runs_end_to_end_on_a_tiny_shape(tmp_path):
    script = Path(__file__).parents[2] / "benchmarks" / "engines_gpu.py"
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, str(script), "--smoke", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["device"] == "cpu" and got["samples"] == 32
    for key in ("start_s", "install_full_s", "install_patch_s", "vllm_over_hf"):
        assert got[key] > 0, key
    assert 0 < got["patch_bytes"] < got["full_bytes"]
