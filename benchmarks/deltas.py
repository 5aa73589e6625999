"""Publishing weights as sparse patches (``echo2.weights.delta``): what do they cost on the wire?

Study ``bytes`` (``--study bytes``): bytes of a lossless patch / bytes of the full bf16 snapshot, per
publication, from real GRPO updates. Each publication is ``sampler_copy(model, "bfloat16")`` after one
``GRPOTrainer.update`` (the project's learner: GRPO loss of ``learner/grpo.py``, gradient clipping,
AdamW on fp32 master weights, default ``GRPOConfig`` apart from the learning rate), patched against
the previous publication with ``encode_patch`` (zstandard level 3). Batches are synthetic: whole GRPO
groups of random prompt and completion token ids, Bernoulli(0.5) rewards (so most groups have nonzero
advantages), and sampler log-probs computed by the model itself just before the update (fresh, on-policy
data). Random tokens stand in for rollouts: every weight gets a gradient through the same GRPO loss, and
AdamW normalises its scale, which is what decides how many bf16 values move per step; they say nothing
about how a learning policy's gradients evolve over thousands of steps. AdamW's first steps move every
weight by about lr (bias correction), so the first publications of a series are its largest; the JSON
also gives the median of the last 5 publications of each series as the trend.

(a) LLM-shaped model: a random-init Qwen3 (``transformers.Qwen3ForCausalLM``), hidden 512, 12 layers,
    intermediate 1536, 8 query / 4 key-value heads, vocab 32,000, tied embeddings (~54M parameters),
    AdamW at lr 1e-6 and 3e-6 (the LLM-RL range), 20 publications each.
    Target (fixed before running): median patch/full ratio <= 1% at both learning rates (aim 0.5%).
(b) The embedded default model (``echo2.models.embedded.build_model`` with the ``EmbeddedModelConfig``
    defaults, random init), the default batch shape (32 prompts x 8) and the default GRPO lr 2e-4:
    20 publications, ratio reported (no target); and a learning-rate sweep 1e-6 .. 2e-4 on the same
    model, 10 publications each, to show where the ratio curve bends towards a full snapshot.

Study ``steady`` (``--study steady``): the series of (a) for 80 publications, medians per window of 20:
how the ratio settles once AdamW's first steps are past (added after the first reading of (a); no
target of its own, writes results/deltas_steady.png).

Every publication is also checked end to end: ``weights_digest(apply_patch(prev, patch)) ==
weights_digest(new)`` (target: 100% of publications). Encode and apply seconds are wall time on one
thread of the 2-core box (``torch.set_num_threads`` does not affect the codec: it is numpy + zstd).

Study ``lossless`` (``--study lossless``): anchors and patches of a small model through the real TCP
broadcast plane (Tree-Pipelined, 1 KiB chunks), with a slow worker that misses versions, a late
joiner, a relay killed while it holds half a patch and a relay that corrupts chunks
(``benchmarks/echo2_bench/deltas_chain.py``). Target: 100% of installs bit-identical (weights digest
equal to the learner's).

Study ``patch`` (``--study patch``, root): the 54M model's median patch at lr 3e-6 (from the ``bytes``
entry) through the netns broadcast harness at N = 4, 8, 16, with the runtime's per-publication chunk
size and with a fixed 16 KiB, interleaved, 3 times. Target: median T_all / T* <= 1.25 at every N
(``study_patch_broadcast``).

Study ``accuracy`` (``--study accuracy``): ``echo2 run`` (S = 3, 2 local workers, 300 steps) with bf16
deltas (the default) against fp32 full snapshots, 5 seeds (3 in the first reading, whose interval was too
wide to decide), same cores and warm start per seed.
Targets (fixed before running): the 95% interval of mean(deltas - full) held-out points has its lower
bound >= -5 (non-inferiority, as the staleness study); and the learner's part of a publication
(``broadcast/publish_s``: encode + sign + announce) and a worker's part (patch + digest + engine load,
its ``install_s`` per install) each <= 10% of the run's T_train.

Writes results/deltas.json (one key per study, merged into an existing file: other studies' keys are
kept), results/deltas.png (bytes) and results/deltas_accuracy.png.

    python benchmarks/deltas.py --study bytes            # ~5-10 minutes on 2 cores
    python benchmarks/deltas.py --study bytes --quick    # smoke run of the script
    python benchmarks/deltas.py --study steady           # ~6 minutes: (a) for 80 publications
    python benchmarks/deltas.py --study lossless         # ~10 s
    python benchmarks/deltas.py --study accuracy         # ~35 minutes on 2 cores
    sudo python benchmarks/deltas.py --study links       # ~10 minutes; network namespaces (root)
    sudo python benchmarks/deltas.py --study patch       # ~2 minutes; network namespaces (root)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from echo2.weights.delta import (  # noqa: E402
    FORMAT_VERSION,
    apply_patch,
    encode_full,
    encode_patch,
    patch_info,
    sampler_copy,
    weights_digest,
)

TARGET_MEDIAN_RATIO = 0.01  # (a), at each LLM-RL learning rate; aim 0.005
AIM_MEDIAN_RATIO = 0.005
TARGET_DIGEST_OK = 1.0  # every publication reconstructs bit for bit
LLM_LRS = (1e-6, 3e-6)
SWEEP_LRS = (1e-6, 3e-6, 1e-5, 3e-5, 1e-4, 2e-4)
LLM_SHAPE = {
    "vocab_size": 32_000,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
}
LLM_BATCH = {"prompts": 2, "group_size": 4, "prompt_tokens": 16, "completion_tokens": 16}  # ~1-2 s/step


# ---------------------------------------------------------------------------------------------------
# models and batches


def llm_model(seed: int) -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        **LLM_SHAPE,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(config)


def embedded_model(seed: int) -> tuple[Any, int, dict[str, int]]:
    from echo2.config import BatchConfig, EmbeddedModelConfig, SamplingConfig
    from echo2.models.embedded import build_model, build_tokenizer

    tok = build_tokenizer()
    cfg = EmbeddedModelConfig()
    batch = BatchConfig()
    sampling = SamplingConfig()
    shape = {
        "prompts": batch.prompts,
        "group_size": batch.group_size,
        "prompt_tokens": 12,
        "completion_tokens": sampling.max_new_tokens,
    }
    return build_model(cfg, tok, seed), tok.pad_token_id, shape


def synthetic_batch(model: Any, rng: random.Random, shape: dict[str, int], pad_id: int, step: int) -> list:
    """Whole GRPO groups of random token ids with Bernoulli(0.5) rewards; sampler log-probs are the
    model's own (computed now, before the update)."""
    import torch

    from echo2.learner.logprobs import completion_logprobs, pack
    from echo2.types import Trajectory

    vocab = model.config.vocab_size
    low = 3  # keep clear of pad / eos / unk
    trajs = []
    for p in range(shape["prompts"]):
        prompt = tuple(rng.randrange(low, vocab) for _ in range(shape["prompt_tokens"]))
        for _ in range(shape["group_size"]):
            n = shape["completion_tokens"]
            trajs.append(
                Trajectory(
                    prompt_id=f"s{step}p{p}",
                    group_id=f"s{step}p{p}",
                    prompt_ids=prompt,
                    completion_ids=tuple(rng.randrange(low, vocab) for _ in range(n)),
                    sampler_logprobs=(0.0,) * n,
                    reward=float(rng.random() < 0.5),
                    policy_version=step,
                )
            )
    packed = pack(trajs, [[1.0] * len(t.completion_ids) for t in trajs], pad_id)
    model.eval()
    with torch.no_grad():
        logp = completion_logprobs(model, packed, temperature=1.0)
    return [
        dataclasses.replace(t, sampler_logprobs=tuple(float(x) for x in logp[i, : len(t.completion_ids)]))
        for i, t in enumerate(trajs)
    ]


# ---------------------------------------------------------------------------------------------------
# the measurement


def publish_series(model: Any, pad_id: int, shape: dict[str, int], lr: float, pubs: int, seed: int) -> dict:
    """``pubs`` GRPO updates at ``lr``, one publication after each, patched against the previous one."""
    from echo2.config import GRPOConfig, SamplingConfig
    from echo2.learner.trainer import GRPOTrainer

    rng = random.Random(seed)
    sampling = SamplingConfig(max_new_tokens=max(8, shape["completion_tokens"]))
    trainer = GRPOTrainer(model, GRPOConfig(lr=lr), sampling, pad_id=pad_id)
    prev = sampler_copy(model, "bfloat16")
    full_bytes = len(encode_full(prev))
    elements = sum(t.numel() for t in prev.values())
    rows = []
    for step in range(pubs):
        batch = synthetic_batch(model, rng, shape, pad_id, step)
        stats = trainer.update(batch)
        new = sampler_copy(model, "bfloat16")
        t0 = time.perf_counter()
        patch = encode_patch(prev, new)
        t1 = time.perf_counter()
        rebuilt = apply_patch(prev, patch)
        t2 = time.perf_counter()
        ok = weights_digest(rebuilt) == weights_digest(new)
        info = patch_info(patch)
        rows.append(
            {
                "step": step + 1,
                "patch_bytes": len(patch),
                "ratio": len(patch) / full_bytes,
                "changed_fraction": info["changed"] / info["elements"],
                "bits_per_changed": 8 * len(patch) / max(1, info["changed"]),
                "encode_s": t1 - t0,
                "apply_s": t2 - t1,
                "digest_ok": ok,
                "t_train_s": stats.t_train_s,
                "grad_norm": stats.grad_norm,
            }
        )
        prev = new
        print(
            f"  lr={lr:g} pub {step + 1}/{pubs}: ratio {rows[-1]['ratio']:.4%}, "
            f"changed {rows[-1]['changed_fraction']:.3%}, encode {t1 - t0:.3f}s apply {t2 - t1:.3f}s, "
            f"train {stats.t_train_s:.2f}s, digest {'ok' if ok else 'MISMATCH'}",
            flush=True,
        )
    ratios = [r["ratio"] for r in rows]
    return {
        "lr": lr,
        "publications": pubs,
        "full_bytes": full_bytes,
        "elements": elements,
        "ratio_median": statistics.median(ratios),
        "ratio_max": max(ratios),
        "ratio_min": min(ratios),
        "ratio_last5_median": statistics.median(ratios[-5:]),  # the trend once AdamW's first steps pass
        "changed_fraction_median": statistics.median(r["changed_fraction"] for r in rows),
        "changed_fraction_max": max(r["changed_fraction"] for r in rows),
        "bits_per_changed_median": statistics.median(r["bits_per_changed"] for r in rows),
        "encode_s_median": statistics.median(r["encode_s"] for r in rows),
        "encode_s_max": max(r["encode_s"] for r in rows),
        "apply_s_median": statistics.median(r["apply_s"] for r in rows),
        "apply_s_max": max(r["apply_s"] for r in rows),
        "digest_ok": sum(r["digest_ok"] for r in rows),
        "per_publication": rows,
    }


def study_bytes(quick: bool = False, seed: int = 0) -> dict:
    """Study (a) + (b) of the module docstring; returns the ``bytes`` entry of results/deltas.json."""
    import torch

    pubs_llm, pubs_emb, pubs_sweep = (3, 3, 2) if quick else (20, 20, 10)
    llm: dict[str, Any] = {"shape": LLM_SHAPE, "batch": LLM_BATCH, "series": []}
    for lr in LLM_LRS:
        torch.manual_seed(seed)
        model = llm_model(seed)
        llm["parameters"] = sum(p.numel() for p in model.parameters())
        print(f"(a) Qwen3 {llm['parameters'] / 1e6:.1f}M parameters, lr {lr:g}", flush=True)
        llm["series"].append(publish_series(model, 0, LLM_BATCH, lr, pubs_llm, seed))
        del model

    from echo2.config import EmbeddedModelConfig, GRPOConfig

    default_lr = GRPOConfig().lr
    emb: dict[str, Any] = {"config": EmbeddedModelConfig().model_dump(), "default_lr": default_lr}
    torch.manual_seed(seed)
    model, pad_id, shape = embedded_model(seed)
    emb["parameters"] = sum(p.numel() for p in model.parameters())
    emb["batch"] = shape
    print(f"(b) embedded {emb['parameters'] / 1e6:.2f}M parameters, default lr {default_lr:g}", flush=True)
    emb["default"] = publish_series(model, pad_id, shape, default_lr, pubs_emb, seed)
    emb["sweep"] = []
    for lr in SWEEP_LRS:
        torch.manual_seed(seed)
        model, pad_id, shape = embedded_model(seed)
        emb["sweep"].append(publish_series(model, pad_id, shape, lr, pubs_sweep, seed))

    all_series = [*llm["series"], emb["default"], *emb["sweep"]]
    checked = sum(s["publications"] for s in all_series)
    ok = sum(s["digest_ok"] for s in all_series)
    llm_medians = {f"{s['lr']:g}": s["ratio_median"] for s in llm["series"]}
    return {
        "llm": llm,
        "embedded": emb,
        "digest_checked": checked,
        "digest_ok": ok,
        "digest_ok_fraction": ok / checked,
        "llm_median_ratio": llm_medians,
        "targets": {
            "llm_median_ratio_max": TARGET_MEDIAN_RATIO,
            "llm_median_ratio_aim": AIM_MEDIAN_RATIO,
            "digest_ok_fraction": TARGET_DIGEST_OK,
        },
        "met": {
            "llm_median_ratio": all(v <= TARGET_MEDIAN_RATIO for v in llm_medians.values()),
            "llm_median_ratio_aim": all(v <= AIM_MEDIAN_RATIO for v in llm_medians.values()),
            "digest_ok_fraction": ok / checked >= TARGET_DIGEST_OK,
        },
        "codec": {"zstd_level": 3, "publish_dtype": "bfloat16", "patch_format": FORMAT_VERSION},
        "quick": quick,
    }


STEADY_PUBS = 80  # publications per learning rate in the steady study
STEADY_WINDOW = 20  # its ratios are summarised per window of this many publications


def study_steady(seed: int = 0) -> dict[str, Any]:
    """Study ``steady``: the series of (a) run for 80 publications instead of 20, medians per window of
    20. Added after the first reading of (a) missed 1% at 3e-6 while its ratios still fell from one
    publication to the next (AdamW's first steps move every weight by about lr; later steps of noisy
    gradients by less); its target stays the one of (a), on the first 20. No target of its own."""
    import torch

    out: dict[str, Any] = {"shape": LLM_SHAPE, "batch": LLM_BATCH, "window": STEADY_WINDOW, "series": []}
    for lr in LLM_LRS:
        torch.manual_seed(seed)
        model = llm_model(seed)
        print(f"(steady) Qwen3, lr {lr:g}, {STEADY_PUBS} publications", flush=True)
        series = publish_series(model, 0, LLM_BATCH, lr, STEADY_PUBS, seed)
        del model
        rows = series["per_publication"]
        series["windows"] = [
            {
                "publications": f"{i + 1}-{i + STEADY_WINDOW}",
                "ratio_median": statistics.median(r["ratio"] for r in rows[i : i + STEADY_WINDOW]),
                "changed_fraction_median": statistics.median(
                    r["changed_fraction"] for r in rows[i : i + STEADY_WINDOW]
                ),
            }
            for i in range(0, len(rows), STEADY_WINDOW)
        ]
        out["series"].append(series)
    return out


def plot_steady(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for s, color in zip(r["series"], ("tab:blue", "tab:orange"), strict=False):
        rows = s["per_publication"]
        ax.plot([x["step"] for x in rows], [x["ratio"] for x in rows], color=color, label=f"lr {s['lr']:g}")
    ax.axhline(TARGET_MEDIAN_RATIO, color="tab:red", ls="--", lw=1, label="1%")
    ax.set(
        xlabel="publication (one GRPO update each)",
        ylabel="patch / full bf16 snapshot",
        yscale="log",
        title="Qwen3-shaped, 54M parameters: patch size over a series",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------------------------
# output


def plot_bytes(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    llm, emb = r["bytes"]["llm"], r["bytes"]["embedded"]

    def curve(series: list[dict], label: str, color: str, marker: str) -> None:
        lrs = [s["lr"] for s in series]
        med = [s["ratio_median"] for s in series]
        lo = [s["ratio_median"] - s["ratio_min"] for s in series]
        hi = [s["ratio_max"] - s["ratio_median"] for s in series]
        ax.errorbar(lrs, med, yerr=[lo, hi], color=color, marker=marker, capsize=3, label=label)
        frac = [s["changed_fraction_median"] for s in series]
        ax.plot(
            lrs,
            frac,
            color=color,
            ls=":",
            marker=marker,
            alpha=0.6,
            label="  its fraction of changed elements",
        )

    curve(llm["series"], f"Qwen3 {llm['parameters'] / 1e6:.0f}M (median, min-max)", "tab:blue", "o")
    curve(emb["sweep"], f"embedded {emb['parameters'] / 1e6:.2f}M (median, min-max)", "tab:orange", "s")
    d = emb["default"]
    ax.scatter([d["lr"]], [d["ratio_median"]], color="tab:red", zorder=5, label="embedded at the default lr")
    ax.axhline(TARGET_MEDIAN_RATIO, color="tab:red", ls="--", lw=1, label="target 1% (LLM-RL lrs)")
    ax.axvspan(min(LLM_LRS), max(LLM_LRS), color="tab:green", alpha=0.1, label="LLM-RL lr range")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("AdamW learning rate")
    ax.set_ylabel("patch / full bf16 snapshot (bytes); changed fraction")
    ax.set_title("bf16 publication patch size vs learning rate")
    ax.legend(fontsize=7, loc="lower right")

    for s, color in zip(llm["series"], ("tab:blue", "tab:cyan"), strict=False):
        steps = [p["step"] for p in s["per_publication"]]
        ax2.plot(steps, [100 * p["ratio"] for p in s["per_publication"]], color=color, marker=".")
        ax2.plot([], [], color=color, label=f"Qwen3, lr {s['lr']:g}")
    ax2.plot(
        [p["step"] for p in d["per_publication"]],
        [100 * p["ratio"] for p in d["per_publication"]],
        color="tab:red",
        marker=".",
        label=f"embedded, lr {d['lr']:g}",
    )
    ax2.axhline(100 * TARGET_MEDIAN_RATIO, color="tab:red", ls="--", lw=1)
    ax2.set_yscale("log")
    ax2.set_xlabel("publication (one GRPO update each)")
    ax2.set_ylabel("patch / full (%)")
    ax2.set_title("per publication")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _summary(b: dict) -> dict:
    def short(s: dict) -> dict:
        return {k: v for k, v in s.items() if k != "per_publication"}

    return {
        "llm": [short(s) for s in b["llm"]["series"]],
        "embedded_default": short(b["embedded"]["default"]),
        "embedded_sweep": [
            {k: s[k] for k in ("lr", "ratio_median", "ratio_max", "changed_fraction_median")}
            for s in b["embedded"]["sweep"]
        ],
        "digest_ok": f"{b['digest_ok']}/{b['digest_checked']}",
        "met": b["met"],
    }


# ---- accuracy: bf16 deltas vs fp32 full snapshots in echo2 run ----------------------------------------
COMPUTE_SHARE = 0.10  # publish and install each at most this share of T_train
ACCURACY_STEPS = 300  # learner steps per run (as the staleness study)
ACCURACY_TOLERANCE_POINTS = 5.0  # deltas may cost at most this many points of held-out accuracy ...
ACCURACY_SIDEDNESS = "one-sided (non-inferiority): the 95% CI lower bound of mean(deltas - full) >= -5 points"
FULL_FP32 = ("--set", "snapshot.dtype=float32", "--set", "snapshot.deltas=false")


def study_accuracy(out: Path, seeds: list[int], steps: int = ACCURACY_STEPS) -> dict[str, Any]:
    """``echo2 run`` (S = 3, 2 local workers) publishing bf16 deltas (the default) against fp32 full
    snapshots (the earlier behaviour), same seed, steps, cores and cached warm start per seed. Score per
    run: the mean of its last 3 evaluations (512 held-out problems each); per seed the difference in
    points; over seeds the mean and its 95% t-interval. Met (declared before running,
    ACCURACY_SIDEDNESS): the interval's lower bound is at least -ACCURACY_TOLERANCE_POINTS."""
    import runtime as rt  # benchmarks/runtime.py: the same run driver, cores and scoring as its studies

    runs = out / "deltas_runs"
    res: dict[str, Any] = {
        "steps": steps,
        "seeds": seeds,
        "tolerance_points": ACCURACY_TOLERANCE_POINTS,
        "sidedness": ACCURACY_SIDEDNESS,
        "score": f"mean of the last {rt.STALENESS_LAST_K} evaluations (512 problems each)",
        "runs": {},
    }
    diffs = []
    for seed in seeds:
        rt.warm_start(seed)
        scores = {}
        for side, extra in (("full_fp32", FULL_FP32), ("deltas_bf16", ())):
            d = runs / f"{side}_seed{seed}"
            rt.scored_run(d, steps, seed, *extra)
            rows = rt.steps_of(d)
            kappa = run_kappa(d)  # a record carries the newest publication's metrics: one per kappa
            pubs = [r for r in rows if "broadcast/publication_bytes" in r and r["step"] % kappa == 0]
            scores[side] = rt.smoothed_final(d)
            reports = [worker_report(p) for p in sorted((d / "workers").glob("*.log"))]
            t_train = statistics.median(r["learner/t_train_s"] for r in rows)
            res["runs"][f"{side}_seed{seed}"] = {
                "final_smoothed": scores[side],
                "t_train_s_median": t_train,
                # the learner's part of a publication (encode + sign + announce) and a worker's part
                # (patch / decode + digest + engine load), each per publication / T_train of the run
                "publish_s_median": statistics.median(r["broadcast/publish_s"] for r in pubs),
                "publish_over_t_train": statistics.median(r["broadcast/publish_s"] for r in pubs) / t_train,
                "install_s_mean": sum(w["install_s"] for w in reports)
                / max(1, sum(w["installs"] for w in reports)),
                "install_over_t_train": (
                    sum(w["install_s"] for w in reports)
                    / max(1, sum(w["installs"] for w in reports))
                    / t_train
                ),
                # the same in CPU seconds of the threads doing it (a second reading, added after the first
                # run of this study: wall time also counts waiting for a core and the interpreter lock)
                "publish_cpu_s_median": statistics.median(r["broadcast/publish_cpu_s"] for r in pubs),
                "sign_cpu_s": sign_cpu_s(statistics.median(r["broadcast/publication_bytes"] for r in pubs)),
                "install_cpu_s_mean": sum(w["install_cpu_s"] for w in reports)
                / max(1, sum(w["installs"] for w in reports)),
                "installs": sum(w["installs"] for w in reports),
                "install_failures": sum(w["install_failures"] for w in reports),
                "anchors": sum(int(r["broadcast/anchor"]) for r in pubs),
                "staleness_max": max(r["store/staleness_max"] for r in rows),
                "bubble_ratio": json.loads((d / "summary.json").read_text())["bubble_ratio"],
                "publication_bytes_median": statistics.median(r["broadcast/publication_bytes"] for r in pubs),
                "full_bytes": pubs[-1]["broadcast/full_bytes"],
                "accuracy_curve": [(r["step"], r["reward/accuracy"]) for r in rt.evals(d)],
            }
        diffs.append(100 * (scores["deltas_bf16"] - scores["full_fp32"]))
    mean, lo, hi = rt.t_interval(diffs)
    deltas = [r for k, r in res["runs"].items() if k.startswith("deltas")]
    res.update(
        deltas_minus_full_points_per_seed=diffs,
        deltas_minus_full_points_mean=mean,
        deltas_minus_full_points_ci95=[lo, hi],
        met=lo >= -ACCURACY_TOLERANCE_POINTS,
        compute_target=f"publish and install each <= {COMPUTE_SHARE:.0%} of T_train (median over runs)",
        publish_over_t_train=statistics.median(r["publish_over_t_train"] for r in deltas),
        install_over_t_train=statistics.median(r["install_over_t_train"] for r in deltas),
    )
    res["compute_met"] = max(res["publish_over_t_train"], res["install_over_t_train"]) <= COMPUTE_SHARE
    for r in deltas:
        r["publish_cpu_over_t_train"] = (r["publish_cpu_s_median"] + r["sign_cpu_s"]) / r["t_train_s_median"]
        r["install_cpu_over_t_train"] = r["install_cpu_s_mean"] / r["t_train_s_median"]
    res.update(
        compute_target_cpu=(
            f"CPU seconds of copy + encode + sign, and of a worker's install, each <= {COMPUTE_SHARE:.0%} "
            "of T_train (median over runs); a second reading of the same target, added after its first run"
        ),
        publish_cpu_over_t_train=statistics.median(r["publish_cpu_over_t_train"] for r in deltas),
        install_cpu_over_t_train=statistics.median(r["install_cpu_over_t_train"] for r in deltas),
    )
    res["compute_met_cpu"] = (
        max(res["publish_cpu_over_t_train"], res["install_cpu_over_t_train"]) <= COMPUTE_SHARE
    )
    return res


def sign_cpu_s(size: float, repeats: int = 20) -> float:
    """Median CPU seconds of the learner's chunk digests and signature (``build_manifest``, chunks of
    the runtime's default size for it, Ed25519) for a publication of ``size`` bytes: publish_cpu_s
    does not include them."""
    from echo2.physics.broadcast import relay_chunk_bytes
    from echo2.weights.manifest import build_manifest, new_signing_key

    blob, key = os.urandom(int(size)), new_signing_key()
    times = []
    for v in range(repeats):
        c0 = time.thread_time()
        build_manifest(blob, v, relay_chunk_bytes(len(blob)), key)  # runtime.chunk_kb unset
        times.append(time.thread_time() - c0)
    return statistics.median(times)


def run_kappa(run_dir: Path) -> int:
    """The publication period of a finished run, from its config.json."""
    from echo2.config import StalenessConfig

    return StalenessConfig(**json.loads((run_dir / "config.json").read_text())["staleness"]).effective_kappa


def worker_report(log: Path) -> dict[str, Any]:
    """The counters a worker prints as its last JSON line (rollout/worker.py WorkerCounters)."""
    for line in reversed(log.read_text().splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    raise RuntimeError(f"{log}: no worker report")


# ---- lossless: anchors and patches over the real TCP broadcast plane --------------------------------
def study_lossless(seed: int = 0) -> dict[str, Any]:
    """benchmarks/echo2_bench/deltas_chain.py: a chain of anchors and patches through a TcpPublisher and
    TCP worker nodes with a slow worker, a late joiner, a relay killed mid-patch and a corrupting relay.
    Target: every install bit-identical to the learner's published weights (100%)."""
    import asyncio

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from echo2_bench.deltas_chain import chain_over_tcp

    r = asyncio.run(chain_over_tcp(publications=40, anchor_every=10, seed=seed))
    r["target"] = "bit_identical == installs (100%)"
    r["met"] = r["installs"] > 0 and r["bit_identical"] == r["installs"]
    return r


# ---- links: echo2 run with its workers behind shaped links, full snapshots vs deltas -----------------
LINK_BW_MBPS = 8.0  # each worker's link, both directions (a rented GPU on a home-class line)
LINK_B0_MBPS = 16.0  # the learner's uplink
LINK_STEPS = 200


PATCH_NS = (4, 8, 16)
PATCH_REPEATS = 3
TARGET_PATCH_T_STAR = 1.25  # Tree-Pipelined T_all / T* of a patch-sized publication, median of the repeats


def study_patch_broadcast(size_bytes: int, repeats: int = PATCH_REPEATS) -> dict[str, Any]:
    """Study ``patch`` (root): a patch-sized publication (``size_bytes``: the 54M model's median patch
    at lr 3e-6 from the bytes study) through the netns harness (``benchmarks/echo2_bench``,
    tbf-shaped: B_w = 8 Mbit/s, B0/B_w = 3), Tree-Pipelined, N = 4, 8, 16, with the chunk size the
    runtime picks per publication (``physics.broadcast.relay_chunk_bytes``) and with the harness's
    fixed 16 KiB, interleaved, ``repeats`` times each. Target (fixed before running): the median over
    the repeats of T_all / T* (T* from the patch's size) <= 1.25 at every N, with the runtime's
    chunk size."""
    from echo2.physics.broadcast import relay_chunk_bytes
    from echo2_bench.broadcast_bench import BenchConfig, run_benchmark

    auto = relay_chunk_bytes(size_bytes, 3.0)
    sides = {"auto": 0, "fixed_16k": 16 << 10}
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in sides}
    for rep in range(repeats):
        for side, chunk in sides.items():
            cfg = BenchConfig(
                mode="netns", ns=PATCH_NS, size=size_bytes, chunk=chunk, strategies=("tree-pipelined",),
                faults=False, relay=False,
            )  # fmt: skip
            sweep = run_benchmark(cfg)["sweep"]
            runs[side].append({str(r["n"]): r["t_all_over_t_star"] for r in sweep})
            print(f"  patch broadcast {side} repeat {rep + 1}: {runs[side][-1]}", flush=True)
    medians = {
        side: {str(n): statistics.median(r[str(n)] for r in rows) for n in PATCH_NS}
        for side, rows in runs.items()
    }
    return {
        "size_bytes": size_bytes,
        "bw_mbps": 8.0,
        "ratio": 3.0,
        "ns": list(PATCH_NS),
        "repeats": repeats,
        "chunk_bytes": {"auto": auto, "fixed_16k": 16 << 10},
        "t_all_over_t_star": runs,
        "median_t_all_over_t_star": medians,
        "target": {"t_all_over_t_star_max": TARGET_PATCH_T_STAR, "reading": "median of the repeats, auto"},
        "met": all(v <= TARGET_PATCH_T_STAR for v in medians["auto"].values()),
    }


def study_links(out: Path, seed: int = 0, steps: int = LINK_STEPS) -> dict[str, Any]:
    """``echo2 learner`` in one network namespace and two ``echo2 worker`` processes in two others,
    behind tbf-shaped links (B_w = 8 Mbit/s each way per worker, B0 = 16 Mbit/s learner uplink;
    benchmarks/echo2_bench/netns.py), 200 steps, once with fp32 full snapshots (3.2 MB each: ~3.2 s
    per publication on such a link, against kappa * T_train ~ 0.6 s) and once with bf16 deltas. Reported
    side by side: bubble and its causes, measured T_bcast, the planner's N_min for the measured T_train,
    T_bcast and per-worker rate (planner/capacity.py), max staleness, held-out accuracy. No target: the
    issue asks for the comparison. Needs root."""
    import secrets
    import subprocess

    import runtime as rt
    from echo2.planner import capacity
    from echo2_bench.netns import NetnsTopology

    runs = out / "deltas_runs"
    res: dict[str, Any] = {"bw_mbps": LINK_BW_MBPS, "b0_mbps": LINK_B0_MBPS, "steps": steps, "runs": {}}
    rt.warm_start(seed)
    for side, extra in (("full_fp32", FULL_FP32), ("deltas_bf16", ())):
        d = runs / f"links_{side}"
        d.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(16)
        with NetnsTopology(3) as topo:
            topo.shape(0, LINK_B0_MBPS * 1e6, None)
            for k in (1, 2):
                topo.shape(k, LINK_BW_MBPS * 1e6, LINK_BW_MBPS * 1e6)
            host = topo.ip(0)
            learner_cmd = [
                *topo.exec_prefix(0), sys.executable, "-m", "echo2.cli", "learner", "--no-progress",
                "--steps", str(steps), "--seed", str(seed), "--run-dir", str(d),
                "--set", f"runtime.host={host}", "--set", "runtime.port=18765",
                "--set", "runtime.broadcast_port=18766", "--set", f"runtime.join_token={token}",
                "--set", "runtime.dashboard=false", "--set", "train.max_minutes=30",
                "--set", "train.eval_every=50", "--set", "train.eval_size=512", *extra,
            ]  # fmt: skip
            procs = []
            with (d.parent / f"links_{side}.log").open("w") as fh:
                learner = subprocess.Popen(learner_cmd, stdout=fh, stderr=fh)
                procs.append(learner)
                deadline = time.monotonic() + 120
                while "learner ready" not in (d.parent / f"links_{side}.log").read_text():
                    if learner.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"learner did not start; see {fh.name}")
                    time.sleep(0.5)
                for k in (1, 2):
                    wlog = (d / f"worker{k}.log").open("w")
                    procs.append(
                        subprocess.Popen(
                            [
                                *topo.exec_prefix(k),
                                sys.executable,
                                "-m",
                                "echo2.cli",
                                "worker",
                                "--join",
                                json.loads((d / "learner.json").read_text())["join"],  # URL + pin
                                "--token",
                                token,
                                "--name",
                                f"w{k}",
                            ],
                            stdout=wlog,
                            stderr=wlog,
                        )
                    )
                try:
                    rc = learner.wait(timeout=1800)
                finally:
                    for p in procs[1:]:
                        try:
                            p.wait(timeout=30)
                        except subprocess.TimeoutExpired:
                            p.kill()
                    if learner.poll() is None:
                        learner.kill()
            if rc != 0:
                raise RuntimeError(f"echo2 learner failed (rc {rc}); see {d.parent / f'links_{side}.log'}")
        rows = rt.steps_of(d)
        summary = json.loads((d / "summary.json").read_text())
        steady = rows[len(rows) // 4 :]  # past the start: the first snapshots and evaluations
        t_train = statistics.median(r["learner/t_train_s"] for r in steady)
        t_bcast = statistics.median(r["broadcast/t_bcast_s"] for r in steady if "broadcast/t_bcast_s" in r)
        per_worker = statistics.median(r["pool/mu_pool"] / 2 for r in steady if r.get("pool/mu_pool"))
        kappa = run_kappa(d)
        batch = json.loads((d / "config.json").read_text())["batch"]
        rollouts = batch["prompts"] * batch["group_size"]
        try:
            mu_min = capacity.mu_min(kappa=kappa, t_train=t_train, t_bcast=t_bcast, rollouts=rollouts)
            n_min: int | None = capacity.n_min(mu_min, per_worker)
        except Exception:  # kappa * T_train <= T_bcast: no pool hides the broadcast
            n_min = None
        wall = summary["bubble"]
        res["runs"][side] = {
            "bubble_ratio": summary["bubble_ratio"],
            "bubble": wall,
            "t_train_s": t_train,
            "t_bcast_s": t_bcast,
            "kappa_t_train_s": kappa * t_train,
            "per_worker_rollouts_per_s": per_worker,
            "n_min_planner": n_min,
            "staleness_max": max(r["store/staleness_max"] for r in rows),
            "stale_dropped": rows[-1].get("store/dropped_stale"),
            "final_smoothed_accuracy": rt.smoothed_final(d),
            "publication_bytes_median": statistics.median(
                r["broadcast/publication_bytes"] for r in steady if "broadcast/publication_bytes" in r
            ),
            "wall_s": rows[-1]["time_s"],
        }
    return res


def plot_accuracy(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in res["runs"].items():
        style = "-" if name.startswith("deltas") else "--"
        ax.plot(*zip(*r["accuracy_curve"], strict=True), style, marker="o", ms=3, label=name)
    lo, hi = res["deltas_minus_full_points_ci95"]
    ax.set(
        xlabel="learner step",
        ylabel="held-out accuracy",
        title=f"bf16 deltas vs fp32 full: {res['deltas_minus_full_points_mean']:+.1f} points "
        f"(95% CI {lo:+.1f} .. {hi:+.1f})",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--study",
        choices=["bytes", "steady", "lossless", "accuracy", "links", "patch"],
        required=True,
        help="which study to run",
    )
    ap.add_argument("--seeds", default="0,1,2,3,4", help="accuracy: comma-separated seeds")
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a few publications only, to check the script")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "deltas.json"
    results: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    t0 = time.perf_counter()
    if args.study == "bytes":
        b = study_bytes(args.quick, args.seed)
        b["wall_s"] = time.perf_counter() - t0
        b["machine"] = {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        }
        results["bytes"] = b
        path.write_text(json.dumps(results, indent=2))
        plot_bytes(results, out / "deltas.png")
        print(json.dumps(_summary(b), indent=2))
    elif args.study == "steady":
        results["steady"] = study_steady(args.seed)
        results["steady"]["wall_s"] = time.perf_counter() - t0
        path.write_text(json.dumps(results, indent=2))
        plot_steady(results["steady"], out / "deltas_steady.png")
        print(
            json.dumps(
                [{"lr": x["lr"], "windows": x["windows"]} for x in results["steady"]["series"]], indent=2
            )
        )
    elif args.study == "lossless":
        results["lossless"] = study_lossless(args.seed)
        path.write_text(json.dumps(results, indent=2))
        print(json.dumps(results["lossless"], indent=2))
    elif args.study == "patch":
        series = results["bytes"]["llm"]["series"]
        size = int(statistics.median(p["patch_bytes"] for p in series[-1]["per_publication"]))
        results["patch_broadcast"] = study_patch_broadcast(size)
        path.write_text(json.dumps(results, indent=2))
        print(
            json.dumps(
                {k: v for k, v in results["patch_broadcast"].items() if k != "t_all_over_t_star"}, indent=2
            )
        )
    elif args.study == "links":
        results["links"] = study_links(out, args.seed)
        path.write_text(json.dumps(results, indent=2))
        print(json.dumps(results["links"], indent=2))
    elif args.study == "accuracy":
        acc = study_accuracy(out, [int(x) for x in args.seeds.split(",")])
        results["accuracy"] = acc
        path.write_text(json.dumps(results, indent=2))
        plot_accuracy(acc, out / "deltas_accuracy.png")
        print(json.dumps({k: v for k, v in acc.items() if k != "runs"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
