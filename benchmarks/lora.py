"""LoRA on the learner (``models/lora.py``, docs/learner.md#lora): what an adapter publication costs on
the wire against a full snapshot, and what the learner holds in memory per base parameter.

Targets (fixed here, before any run):

1. ``--study bytes``: a random-init Qwen3-shaped model, ``SHAPE_55M`` of ``echo2_bench/synthetic.py``
   (hidden 512, 12 layers, vocab 32,768, tied embeddings: ~55M parameters), a LoRA adapter of rank
   r = 16, alpha = 32, dropout 0 on ``LoRAConfig``'s default target modules (q/k/v/o and gate/up/down
   projections), attached with ``attach(model, cfg, "fp32")`` (the learner's default precision; the
   adapter trains in fp32 either way). ``PUBS`` = 20 real updates (``GRPOTrainer.update``, default
   ``GRPOConfig`` apart from the learning rate) per learning rate, one publication after each:
   ``adapter_copy(model, "bfloat16")``. Batches: 2 GRPO groups of 4 completions, 16 random prompt and
   16 random completion tokens (the batch of ``deltas.py`` (a)); per group k ones among its 4 rewards,
   k drawn from 1..3 and shuffled (every group has nonzero advantages); sampler log-probs are the
   model's own (adapter on), computed just before the update (on-policy, as ``deltas.py``).
   Per publication: the adapter anchor, ``len(encode_full(adapter))``; the adapter patch against the
   previous publication, ``len(encode_patch(prev, cur, 3))`` (publication 0 is the adapter as
   attached, B = 0: what a run ships first); the changed-element share of the patch
   (``patch_info``); and whether ``apply_patch(prev, patch)`` rebuilds ``cur`` bit for bit (digest).
   Denominator, "the full bf16 snapshot": ``len(encode_full(sampler_copy(model, "bfloat16")))`` of the
   plain model before the adapter is attached, i.e. what a full-fine-tuning learner of this model
   publishes (every tensor once, tied embeddings once; safetensors, so 2 bytes x parameters + a header;
   its size does not depend on the values, so it is measured once). Ratios adapter anchor / full and
   adapter patch / full per publication, and their medians over all 20 publications (none left out).
   Learning rates, both declared here: 2e-5 (the verdict's) and 5e-6 (a second row, read against the
   same threshold and reported, not the verdict).
   Target: median adapter patch / full bf16 snapshot <= 0.001 (0.1%) at lr 2e-5 (one-sided: at most).
   Checks reported beside it: every patch rebuilds its publication bit for bit, and the frozen base's
   bf16 copy (``base_copy``) has the same digest after the 20 updates as before them.
   Added after the first reading of this study (median 0.91% at 2e-5, 0.85% at 5e-6, ~55% of the
   adapter's elements changed per publication at both rates), without a target and leaving the one
   above as it is: the changed share of the ``lora_A`` and of the ``lora_B`` tensors apart, per
   publication (bf16 bit patterns of the two publications compared), to show where the changes are.

2. ``--study memory``: learner memory per base parameter with LoRA, measured as ``memory.py``'s bytes
   study: each mode in a fresh child process; ``SHAPE_235M`` (hidden 1024, 16 layers, vocab 32,768:
   ~235M parameters); ``learner.precision = "bf16-mixed"``, ``micro_batch_tokens = 1024``,
   ``GRPOConfig(lr=2e-5)`` (``kl_beta`` = 0, the default: no KL reference); ``UPDATES`` = 5 updates on
   ``synthetic.batch(vocab, 2 rows, 8 prompt + 16 completion tokens, seed=update, group=2)`` (the same
   in both children). memory.py's batches (16 rows of 16 + 32 tokens) were declared first; the first
   attempt was stopped inside its first child, before any reading: bf16 matmuls on these CPUs (AVX2,
   no AVX512-BF16) run on PyTorch's reference GEMM at ~1.5-2 GFLOP/s, ~10 minutes an update at this
   shape with that batch. So the batch is cut and the shape and the updates are kept; activations are
   freed before the optimizer step and between updates, so neither reading should depend on the
   batch's size. The child measures the trainer alone: no publications, no sampler copies, no
   generation check. Resident memory (``/proc/self/statm`` after ``malloc_trim``)
   less the child's resident memory before the model was built (torch, transformers, peft and echo2
   already imported, so the libraries are not counted), divided by the base parameters (the plain
   model's, tied once; the same denominator in both modes), read (a) at the optimizer step of each
   update (``register_optimizer_step_pre_hook``) and (b) between updates, from update 3 on (the first
   two settle the allocator and create the AdamW states, as memory.py); the median of the readings.
   Modes: LoRA (``attach(model, r=16, alpha=32, default targets, "bf16-mixed")``: base in bf16, adapter
   and its AdamW states fp32) and, side by side in the same run on the same shape and batches, full
   fine-tuning bf16-mixed (fp32 master weights, gradients and AdamW states), also without publications
   or checks.
   Target: LoRA reading (a) <= 2.5 bytes per base parameter (one-sided: at most). The full-fine-tuning
   readings and the ratio LoRA / full are reported without a target. Each child also reports the
   bytes of its live tensors at the step (parameters + gradients + AdamW states) per base parameter,
   to show what the resident reading is made of.

3. ``--study load``, added with ``load_checkpoint(keep_bf16=True)`` (targets fixed here before its first
   run): a LoRA learner under bf16-mixed loading its base from a bf16 checkpoint on disk, as real
   checkpoints are stored. The parent saves ``SHAPE_235M`` in bf16 (``save_pretrained``, safetensors)
   to a temporary directory; each mode in a fresh child process (``as_the_learner``, libraries
   imported before the baseline) runs what ``runtime/core.py`` does before its trainer exists:
   ``models.policy.load_model(path, keep_bf16)``, ``lora.base_digest``, ``lora.attach(model, r=16,
   "bf16-mixed")``. Modes: "as-stored" (``keep_bf16=True``, the learner's path now) and "float32"
   (``keep_bf16=False``, the path before: load in float32, cast the base after). Readings: peak
   resident memory (``ru_maxrss``) less the baseline, per base parameter, and resident memory after
   (``/proc/self/statm`` after ``malloc_trim``); both digests must be equal. Target: as-stored peak /
   float32 peak <= 0.75 (one-sided: at most).

4. ``--smoke``: every study on ``SHAPE_SMOKE`` (hidden 64, 2 layers, vocab 512) with 3 publications
   per learning rate and 3 updates per memory mode (both modes in one child process, so the run pays
   one more import, not two), in seconds; writes ``lora_smoke.json`` and ``lora_smoke.png`` under
   ``--out``; no verdict is asserted (tests/integration/test_lora_bench_smoke.py checks that it ran
   and wrote the fields; its memory readings on a model this small say nothing).

Writes results/lora.json (one key per study, merged into an existing file) and results/lora.png.

    python benchmarks/lora.py                      # both studies (~2-5 + ~16 minutes on 2 cores)
    python benchmarks/lora.py --study bytes
    python benchmarks/lora.py --study memory
    python benchmarks/lora.py --study load
    python benchmarks/lora.py --smoke --out /tmp/lora
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from echo2_bench.resident import peak_rss, rss  # noqa: E402
from echo2_bench.synthetic import SHAPE_55M, SHAPE_235M, SHAPE_SMOKE, batch, build  # noqa: E402

# study 1: bytes
BYTES_SHAPE = SHAPE_55M
PUBS = 20
LRS = (2e-5, 5e-6)  # the first is the verdict's; the second a reported row
VERDICT_LR = LRS[0]
MAX_MEDIAN_PATCH_RATIO = 0.001  # median adapter patch / full bf16 snapshot, at most
ZSTD_LEVEL = 3
BYTES_BATCH = {"prompts": 2, "group_size": 4, "prompt_tokens": 16, "completion_tokens": 16}
# study 2: memory
MEMORY_SHAPE = SHAPE_235M
UPDATES = 5
SETTLE = 2  # updates before the readings count (allocator, AdamW states)
MEMORY_LR = 2e-5
MICRO_BATCH_TOKENS = 1024
MEMORY_BATCH = {"rows": 2, "prompt": 8, "completion": 16, "group": 2}
MAX_LORA_BYTES_PER_PARAM = 2.5  # at the optimizer step, bf16-mixed, at most
# study 3: load
LOAD_SHAPE = SHAPE_235M
MAX_LOAD_PEAK_RATIO = 0.75  # as-stored peak / float32 peak, at most
# the adapter (LoRAConfig defaults apart from enabled)
LORA = {"r": 16, "alpha": 32.0, "dropout": 0.0}
# --smoke
SMOKE_PUBS = 3
SMOKE_UPDATES = 3


def lora_config() -> Any:
    from echo2.config import LoRAConfig

    return LoRAConfig(enabled=True, **LORA)


# ---- study 1: bytes ----------------------------------------------------------------------------------
def onpolicy_batch(trainer: Any, vocab: int, rng: random.Random, step: int) -> list[Any]:
    """Whole GRPO groups of random token ids, each group with both rewards (nonzero advantages); sampler
    log-probs are the model's own (adapter on), computed now, before the update."""
    import torch

    from echo2.learner.logprobs import pack
    from echo2.types import Trajectory

    shape, low = BYTES_BATCH, 3  # keep clear of pad / eos / unk
    G = shape["group_size"]
    trajs = []
    for p in range(shape["prompts"]):
        prompt = tuple(rng.randrange(low, vocab) for _ in range(shape["prompt_tokens"]))
        ones = rng.randint(1, G - 1)
        rewards = [1.0] * ones + [0.0] * (G - ones)
        rng.shuffle(rewards)
        for i in range(G):
            n = shape["completion_tokens"]
            trajs.append(
                Trajectory(
                    prompt_id=f"s{step}p{p}", group_id=f"s{step}p{p}", prompt_ids=prompt,
                    completion_ids=tuple(rng.randrange(low, vocab) for _ in range(n)),
                    sampler_logprobs=(0.0,) * n, reward=rewards[i], policy_version=step,
                )
            )  # fmt: skip
    packed = pack(trajs, [[1.0] * len(t.completion_ids) for t in trajs], trainer.pad_id)
    trainer.model.eval()
    with torch.no_grad():
        logp = trainer.logprobs(packed)
    return [
        dataclasses.replace(t, sampler_logprobs=tuple(float(x) for x in logp[i, : len(t.completion_ids)]))
        for i, t in enumerate(trajs)
    ]


def _changed_by_kind(prev: dict[str, Any], cur: dict[str, Any]) -> dict[str, float]:
    """Share of the elements of the ``lora_A`` and of the ``lora_B`` tensors whose bf16 bits changed."""
    import torch

    out = {}
    for kind in ("lora_A", "lora_B"):
        names = [n for n in cur if f".{kind}." in n]
        changed = sum(int((prev[n].view(torch.int16) != cur[n].view(torch.int16)).sum()) for n in names)
        out[kind] = changed / max(1, sum(cur[n].numel() for n in names))
    return out


def bytes_series(shape: dict[str, int], lr: float, pubs: int, seed: int = 0) -> dict[str, Any]:
    """``pubs`` GRPO updates of a LoRA adapter at ``lr``, one adapter publication after each."""
    import torch

    from echo2.config import GRPOConfig, SamplingConfig
    from echo2.learner.trainer import GRPOTrainer
    from echo2.models.lora import adapter_copy, attach, base_copy
    from echo2.weights.delta import (
        apply_patch,
        encode_full,
        encode_patch,
        patch_info,
        sampler_copy,
        weights_digest,
    )

    torch.set_num_threads(2)
    model = build(shape, seed)
    base_params = sum(p.numel() for p in model.parameters())
    plain = sampler_copy(model, "bfloat16")  # what a full-fine-tuning learner of this model publishes
    full_bytes = len(encode_full(plain))
    plain_names = sorted(plain)
    del plain
    attach(model, lora_config(), "fp32")
    adapter_params = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    base_before = base_copy(model, "bfloat16")
    base_digest_before = weights_digest(base_before)
    same_names = sorted(base_before) == plain_names
    del base_before
    trainer = GRPOTrainer(model, GRPOConfig(lr=lr), SamplingConfig(max_new_tokens=16), pad_id=0)
    rng = random.Random(seed)
    prev = adapter_copy(model, "bfloat16")
    adapter_elements = sum(t.numel() for t in prev.values())
    rows = []
    for step in range(pubs):
        trajs = onpolicy_batch(trainer, shape["vocab"], rng, step)
        stats = trainer.update(trajs)
        cur = adapter_copy(model, "bfloat16")
        anchor = len(encode_full(cur))
        t0 = time.perf_counter()
        patch = encode_patch(prev, cur, ZSTD_LEVEL)
        t1 = time.perf_counter()
        ok = weights_digest(apply_patch(prev, patch)) == weights_digest(cur)
        info = patch_info(patch)
        by_kind = _changed_by_kind(prev, cur)
        rows.append(
            {
                "publication": step + 1,
                "anchor_bytes": anchor,
                "patch_bytes": len(patch),
                "anchor_ratio": anchor / full_bytes,
                "patch_ratio": len(patch) / full_bytes,
                "patch_vs_anchor": len(patch) / anchor,
                "changed_fraction": info["changed"] / info["elements"],
                "changed_fraction_lora_A": by_kind["lora_A"],
                "changed_fraction_lora_B": by_kind["lora_B"],
                "bits_per_changed": 8 * len(patch) / max(1, info["changed"]),
                "digest_ok": ok,
                "encode_s": t1 - t0,
                "t_train_s": stats.t_train_s,
                "grad_norm": stats.grad_norm,
                "loss": stats.loss,
                "is_weight_mean": stats.is_weight_mean,
            }
        )
        prev = cur
        r = rows[-1]
        print(
            f"  lr={lr:g} pub {step + 1}/{pubs}: anchor {anchor} B ({r['anchor_ratio']:.3%}), patch "
            f"{len(patch)} B ({r['patch_ratio']:.4%}), changed {r['changed_fraction']:.1%} "
            f"(A {by_kind['lora_A']:.1%}, B {by_kind['lora_B']:.1%}), "
            f"train {stats.t_train_s:.2f}s, digest {'ok' if ok else 'MISMATCH'}",
            flush=True,
        )
    base_frozen = weights_digest(base_copy(model, "bfloat16")) == base_digest_before
    patch_ratios = [r["patch_ratio"] for r in rows]
    anchor_ratios = [r["anchor_ratio"] for r in rows]
    return {
        "lr": lr,
        "publications": pubs,
        "base_params": base_params,
        "adapter_params": adapter_params,
        "adapter_elements_published": adapter_elements,
        "full_snapshot_bytes": full_bytes,
        "full_snapshot_is": "len(encode_full(sampler_copy(plain model, 'bfloat16'))), before attach",
        "two_bytes_x_base_params": 2 * base_params,
        "base_copy_names_equal_plain": same_names,
        "anchor_ratio_median": statistics.median(anchor_ratios),
        "patch_ratio_median": statistics.median(patch_ratios),
        "patch_ratio_min": min(patch_ratios),
        "patch_ratio_max": max(patch_ratios),
        "patch_ratio_last5_median": statistics.median(patch_ratios[-5:]),  # trend only, no verdict
        "patch_vs_anchor_median": statistics.median(r["patch_vs_anchor"] for r in rows),
        "changed_fraction_median": statistics.median(r["changed_fraction"] for r in rows),
        "changed_fraction_lora_A_median": statistics.median(r["changed_fraction_lora_A"] for r in rows),
        "changed_fraction_lora_B_median": statistics.median(r["changed_fraction_lora_B"] for r in rows),
        "digest_ok": sum(r["digest_ok"] for r in rows),
        "base_frozen": base_frozen,
        "per_publication": rows,
    }


def study_bytes(smoke: bool = False) -> dict[str, Any]:
    shape, pubs = (SHAPE_SMOKE, SMOKE_PUBS) if smoke else (BYTES_SHAPE, PUBS)
    series = []
    for lr in LRS:
        print(
            f"bytes: LoRA r={LORA['r']}, alpha {LORA['alpha']:g}, lr {lr:g}, {pubs} publications", flush=True
        )
        series.append(bytes_series(shape, lr, pubs))
    verdict = next(s for s in series if s["lr"] == VERDICT_LR)
    checked = sum(s["publications"] for s in series)
    ok = sum(s["digest_ok"] for s in series)
    return {
        "shape": shape,
        "lora": {**LORA, "target_modules": lora_config().target_modules, "precision": "fp32"},
        "batch": BYTES_BATCH,
        "zstd_level": ZSTD_LEVEL,
        "series": series,
        "median_patch_ratio": {f"{s['lr']:g}": s["patch_ratio_median"] for s in series},
        "median_anchor_ratio": {f"{s['lr']:g}": s["anchor_ratio_median"] for s in series},
        "digest_checked": checked,
        "digest_ok": ok,
        "targets": {"median_patch_ratio_max": MAX_MEDIAN_PATCH_RATIO, "verdict_lr": VERDICT_LR},
        "met": {"median_patch_ratio": verdict["patch_ratio_median"] <= MAX_MEDIAN_PATCH_RATIO},
        "second_row_at_threshold": {  # reported, not the verdict
            f"{s['lr']:g}": s["patch_ratio_median"] <= MAX_MEDIAN_PATCH_RATIO
            for s in series
            if s is not verdict
        },
        "checks": {"digest_ok_fraction": ok / checked, "base_frozen": all(s["base_frozen"] for s in series)},
    }


# ---- study 2: memory (run in child processes) ------------------------------------------------------


def _tensor_bytes(model: Any, opt: Any) -> dict[str, int]:
    import torch

    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    states = sum(
        v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)
    )
    return {"params": params, "grads": grads, "adamw": states}


def child_memory(mode: str, smoke: bool) -> dict[str, Any]:
    """Study 2 in this (fresh) process: the trainer alone, ``mode`` "lora" or "full"."""
    import peft  # noqa: F401  (imported before the baseline: libraries are not the model's memory)
    import torch
    import transformers  # noqa: F401
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: F401

    from echo2.config import GRPOConfig, LearnerConfig, SamplingConfig
    from echo2.learner.trainer import GRPOTrainer
    from echo2.models.lora import attach

    torch.set_num_threads(2)
    shape, updates = (SHAPE_SMOKE, SMOKE_UPDATES) if smoke else (MEMORY_SHAPE, UPDATES)
    mb = MEMORY_BATCH
    batches = [
        batch(shape["vocab"], mb["rows"], mb["prompt"], mb["completion"], seed=s, group=mb["group"])
        for s in range(updates)
    ]
    base = rss()
    model = build(shape)
    params = sum(p.numel() for p in model.parameters())
    if mode == "lora":
        attach(model, lora_config(), "bf16-mixed")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    after_model = rss()
    trainer = GRPOTrainer(
        model,
        GRPOConfig(lr=MEMORY_LR),
        SamplingConfig(max_new_tokens=MEMORY_BATCH["completion"]),
        0,
        learner=LearnerConfig(precision="bf16-mixed", micro_batch_tokens=MICRO_BATCH_TOKENS),
    )
    at_step: list[int] = []
    tensors_at_step: list[dict[str, int]] = []

    def on_step(opt: Any, args: Any, kwargs: Any) -> None:
        at_step.append(rss())
        tensors_at_step.append(_tensor_bytes(model, opt))

    hook = register_optimizer_step_pre_hook(on_step)
    between: list[int] = []
    train_s: list[float] = []
    for b in batches:
        train_s.append(trainer.update(b).t_train_s)
        between.append(rss())
    hook.remove()
    tensors_between = _tensor_bytes(model, trainer.optimizer)
    last = tensors_at_step[-1]
    return {
        "mode": mode,
        "precision": "bf16-mixed",
        "shape": shape,
        "updates": updates,
        "base_params": params,
        "trainable_params": trainable,
        "weights_bytes_per_param": (after_model - base) / params,
        "at_step_bytes_per_param_all": [(x - base) / params for x in at_step],
        "between_bytes_per_param_all": [(x - base) / params for x in between],
        "at_step_bytes_per_param": [(x - base) / params for x in at_step[SETTLE:]],
        "between_bytes_per_param": [(x - base) / params for x in between[SETTLE:]],
        "tensors_at_step_bytes_per_param": {k: v / params for k, v in last.items()},
        "tensors_at_step_total_bytes_per_param": sum(last.values()) / params,
        "tensors_between_total_bytes_per_param": sum(tensors_between.values()) / params,
        "peak_rss_bytes_per_param": (peak_rss() - base) / params,
        "t_train_s": train_s,
    }


def _child_cmd(mode: str, smoke: bool) -> list[str]:
    return [sys.executable, __file__, "--child-memory", mode, *(["--smoke"] if smoke else [])]


def _result(res: subprocess.CompletedProcess[str], mode: str) -> Any:
    if res.returncode != 0:
        raise RuntimeError(f"memory child {mode}: {res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def study_memory(smoke: bool = False) -> dict[str, Any]:
    modes = ("lora", "full")
    if smoke:  # both modes in one child: the smoke run checks the script, not the readings
        res = subprocess.run(_child_cmd("both", smoke), capture_output=True, text=True, check=False)
        runs = _result(res, "both")
    else:  # each mode in a fresh process, one after the other
        runs = []
        for m in modes:
            print(f"memory: {m} fine-tuning child", flush=True)
            res = subprocess.run(_child_cmd(m, smoke), capture_output=True, text=True, check=False)
            runs.append(_result(res, m))
    for r in runs:
        r["at_step_median"] = statistics.median(r["at_step_bytes_per_param"])
        r["between_median"] = statistics.median(r["between_bytes_per_param"])
        print(
            f"  {r['mode']}: at the step {r['at_step_median']:.3f} B/param, "
            f"between {r['between_median']:.3f}, "
            f"tensors at the step {r['tensors_at_step_total_bytes_per_param']:.3f}",
            flush=True,
        )
    lora, full = runs
    return {
        "runs": runs,
        "lora_at_step_median": lora["at_step_median"],
        "full_at_step_median": full["at_step_median"],
        "lora_between_median": lora["between_median"],
        "full_between_median": full["between_median"],
        "lora_vs_full_at_step": lora["at_step_median"] / full["at_step_median"],
        "lora_vs_full_between": lora["between_median"] / full["between_median"],
        "measures": "the trainer alone: no publications, sampler copies or generation check; kl_beta = 0",
        "targets": {"lora_at_step_max_bytes_per_param": MAX_LORA_BYTES_PER_PARAM},
        "met": {"lora_at_step": lora["at_step_median"] <= MAX_LORA_BYTES_PER_PARAM},
    }


# ---- study 3: loading a bf16 base (run in child processes) -----------------------------------------


def child_load(mode: str, path: str) -> dict[str, Any]:
    """Study 3 in this (fresh) process: what the learner does with a bf16 checkpoint before training."""
    import peft  # noqa: F401  (imported before the baseline: libraries are not the model's memory)
    import torch
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM  # noqa: F401  (the model code too)

    from echo2.models import lora
    from echo2.models.policy import load_model
    from echo2_bench.resident import as_the_learner

    as_the_learner()
    base = rss()
    model = load_model(Path(path), keep_bf16=mode == "as-stored")
    loaded_dtypes = sorted({str(p.dtype) for p in model.parameters()})
    params = sum(p.numel() for p in model.parameters())
    digest = lora.base_digest(model)
    lora.attach(model, lora_config(), "bf16-mixed")
    frozen = sorted({str(p.dtype) for p in model.parameters() if not p.requires_grad})
    return {
        "mode": mode,
        "base_params": params,
        "loaded_dtypes": loaded_dtypes,
        "frozen_dtypes_after_attach": frozen,
        "digest": digest,
        "peak_bytes_per_param": (peak_rss() - base) / params,
        "after_bytes_per_param": (rss() - base) / params,
        "threads": torch.get_num_threads(),
    }


def study_load(smoke: bool = False) -> dict[str, Any]:
    import tempfile

    import torch

    shape = SHAPE_SMOKE if smoke else LOAD_SHAPE
    with tempfile.TemporaryDirectory() as tmp:
        build(shape).to(torch.bfloat16).save_pretrained(tmp)
        runs = []
        for mode in ("as-stored", "float32"):
            print(f"load: {mode} child", flush=True)
            cmd = [sys.executable, __file__, "--child-load", mode, tmp]
            runs.append(_result(subprocess.run(cmd, capture_output=True, text=True, check=False), mode))
    stored, wide = runs
    ratio = stored["peak_bytes_per_param"] / wide["peak_bytes_per_param"]
    print(f"  peak as stored {stored['peak_bytes_per_param']:.2f} B/param, float32 "
          f"{wide['peak_bytes_per_param']:.2f}: {ratio:.2f}x", flush=True)  # fmt: skip
    return {
        "shape": shape,
        "runs": runs,
        "peak_ratio": ratio,
        "digests_equal": stored["digest"] == wide["digest"],
        "targets": {"as_stored_over_float32_peak_max": MAX_LOAD_PEAK_RATIO},
        "met": {
            "peak_ratio": ratio <= MAX_LOAD_PEAK_RATIO,
            "digests_equal": stored["digest"] == wide["digest"],
        },
    }


# ---- output ----------------------------------------------------------------------------------------
def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    if "bytes" in result:
        b = result["bytes"]
        for s, color in zip(b["series"], ("tab:blue", "tab:orange"), strict=False):
            rows = s["per_publication"]
            x = [r["publication"] for r in rows]
            median = s["patch_ratio_median"]
            ax.plot(x, [r["patch_ratio"] for r in rows], "o-", color=color, ms=3,
                    label=f"adapter patch, lr {s['lr']:g} (median {median:.4%})")  # fmt: skip
            ax.plot(x, [r["anchor_ratio"] for r in rows], "--", color=color, alpha=0.6,
                    label=f"adapter anchor, lr {s['lr']:g}")  # fmt: skip
        ax.axhline(MAX_MEDIAN_PATCH_RATIO, color="tab:red", ls=":", lw=1, label="target: median <= 0.1%")
        s0 = b["series"][0]
        ax.set(
            xlabel="publication (one GRPO update each)",
            ylabel="bytes / full bf16 snapshot",
            yscale="log",
            title=f"LoRA r={b['lora']['r']}, {s0['base_params'] / 1e6:.3g}M Qwen3 shape: publication bytes",
        )
        ax.legend(fontsize=7)
    if "memory" in result:
        m = result["memory"]
        runs = m["runs"]
        x = range(len(runs))
        ax2.bar([i - 0.27 for i in x], [r["at_step_median"] for r in runs], 0.27, label="RSS at the step")
        ax2.bar([i for i in x], [r["between_median"] for r in runs], 0.27, label="RSS between updates")
        ax2.bar([i + 0.27 for i in x], [r["tensors_at_step_total_bytes_per_param"] for r in runs], 0.27,
                label="live tensors at the step")  # fmt: skip
        ax2.axhline(MAX_LORA_BYTES_PER_PARAM, color="tab:red", ls=":", lw=1, label="target (LoRA): <= 2.5")
        ax2.set_xticks(list(x), [f"{r['mode']} ({r['precision']})" for r in runs])
        ax2.set_ylabel("bytes / base parameter")
        ax2.set_title(f"learner memory, {runs[0]['base_params'] / 1e6:.3g}M base parameters, trainer alone")
        ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", choices=["bytes", "memory", "load", "all"], default="all")
    p.add_argument("--smoke", action="store_true", help="both studies on a tiny shape, in seconds")
    p.add_argument("--out", type=Path, default=ROOT / "results")
    p.add_argument("--child-memory", choices=["lora", "full", "both"], help=argparse.SUPPRESS)
    p.add_argument("--child-load", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child_load:
        print(json.dumps(child_load(*a.child_load)))
        return 0
    if a.child_memory == "both":  # --smoke only: one process, so the smoke run pays one import
        print(json.dumps([child_memory(m, a.smoke) for m in ("lora", "full")]))
        return 0
    if a.child_memory:
        print(json.dumps(child_memory(a.child_memory, a.smoke)))
        return 0
    name = "lora_smoke" if a.smoke else "lora"
    path = a.out / f"{name}.json"
    result: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    studies = ["bytes", "memory", "load"] if a.study == "all" else [a.study]
    for s in studies:
        t0 = time.perf_counter()
        result[s] = {"bytes": study_bytes, "memory": study_memory, "load": study_load}[s](a.smoke)
        result[s]["wall_s"] = time.perf_counter() - t0
        print(s, json.dumps(result[s]["met"]), f"{result[s]['wall_s']:.0f}s", flush=True)
    result["smoke"] = a.smoke
    result["command"] = "python benchmarks/lora.py [--study bytes | memory | load] [--smoke --out DIR]"
    a.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    plot(result, a.out / f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
