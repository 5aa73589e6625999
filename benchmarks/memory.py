"""The learner's memory against its model (``planner/memory_model.py``, docs/learner.md), and the cost of
bounding it.

Targets (fixed here, before the runs):

1. ``--study bytes``: a random-init Qwen3-shaped model of ~235M parameters, in fp32 and in bf16-mixed,
   each in a fresh process: ``STEPS`` real updates (``GRPOTrainer.update``) with the node's publication
   cadence beside them (a sampler copy every kappa = 2 versions encoded by the learner's own chain,
   ``PublishedChain``, and kept by the generation check, ``GenerationCheck`` on its aliasing model, as
   ``runtime/node.py`` does; S = 3). Resident memory (``/proc/self/statm`` after ``malloc_trim``) less
   the process's before the model was built, per parameter, read (a) at the optimizer step of each
   update after the first two (weights, gradients, AdamW states, held copies; activations freed) and
   (b) between updates (no gradients). Targets: each reading within 15% of the memory model; (a) in
   bf16-mixed <= 20 bytes / parameter. Since the learner keeps older versions as undos and its
   published bytes in files (``[snapshot] on_disk``), the child does as the node does: the chain spills
   each link to a file, the check keeps undos, and after every update the oldest kept version is
   rebuilt and loaded as a check of it would (then dropped), so a rebuilt copy that outlived its check
   would show; the model's share of changed elements ``f`` is the one the run's patches measured.
2. ``--study growth``: a ~55M shape, peak resident memory of one update (``ru_maxrss``, a fresh process
   each) at R = 64 ... 1024 rows of 32 tokens under a fixed budget of 2,048 tokens per micro-batch.
   Target: the peak at R = 1024 <= 1.10x the peak at R = 64. A second reading, added after the first
   run (which read 1.31x): the same processes with glibc's mmap threshold fixed at 64 KiB
   (``MALLOC_MMAP_THRESHOLD_``), so a freed tensor's pages go back to the system at once and the peak
   is the live tensors' rather than what the allocator kept of earlier micro-batches; both are reported,
   the verdict is the first's. Since those two readings (1.30x, 1.35x as declared) the learner fixes
   glibc's mmap threshold itself (``learner.malloc_mmap_threshold``, set by ``configure_torch`` as
   every learner command starts), and each child does what the learner process does; the declared
   rule is unchanged, the earlier readings stay in the results file (``earlier_readings``): 1.08x with
   the setting at 1 MiB, then re-read at 256 KiB (check_scale.py's check kept pages at 1 MiB).
3. ``--study speed``: (a) a micro-batched update (1,024-token micro-batches) against the same update in
   one micro-batch, same batch and weights, on the ~55M shape; (b) the learner's log-probs (LM head at
   completion positions, in chunks) against the path before them (the whole ``[B, T, V]`` logits), a
   forward and backward on the embedded model and a default-sized batch. 5 interleaved pairs each,
   the median of the per-pair ratios. Targets: (a) <= 1.10x, (b) <= 1.10x.
   Reading rule changed after a reading (stated so, both readings kept in the results file): the
   re-read at the learner's 256 KiB mmap threshold gave 20.32 / 20.33 B/param at the step (fp32 /
   bf16-mixed; 19.55 / 19.57 in the first reading), over the 20 B/param target, and 5.46 B/param right
   after the model was built where the model's weights are 4. The 1.46 was not the allocator (the same
   build under glibc's default reads the same) but transformers importing the Qwen3 model code at the
   first build, after the baseline: 1.37 B/param of library, resident after the model is deleted. The
   child now imports that code before the baseline, as ``lora.py``'s memory children always did; the
   reading before the change is kept as ``earlier_readings`` and reported beside the new one.
4. ``--study allocator``, added with ``learner.malloc_mmap_threshold``, target fixed before its first
   run: the growth study's update at R = 128 (two micro-batches) in fresh processes, the learner's
   threshold vs glibc's default, 5 interleaved pairs: median ratio <= 1.10x (what returning freed
   pages costs in page faults).

5. ``--study check-model``, added with the check's model built on the meta device (target fixed here
   before its first run): the generation check's model (``aliasing_model``, computing in bf16) of a
   Qwen3-0.6B shape built in a fresh process, its peak resident memory (``VmHWM``, reset at the
   baseline, the library code imported before it) above the baseline per parameter, against the way
   before (the architecture built in float32 with its random init, then cast to the compute dtype,
   the same fresh-process reading). Target: now <= 0.25 bytes / parameter (before: about 6).

Writes results/memory.json and results/memory.png.

    python benchmarks/memory.py                   # all studies (about 10 minutes here)
    python benchmarks/memory.py --study bytes
"""

from __future__ import annotations

import argparse
import json
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from echo2_bench.record import on_record  # noqa: E402
from echo2_bench.resident import as_the_learner, peak_rss, peak_since_reset, reset_peak, rss  # noqa: E402
from echo2_bench.synthetic import SHAPE_55M, SHAPE_235M, batch, build  # noqa: E402

BIG = SHAPE_235M
MID = SHAPE_55M
STEPS = 6
S, KAPPA = 3, 2
WITHIN = 0.15  # measured / model - 1, both readings
MAX_MIXED_PEAK = 20.0  # bytes / parameter at the optimizer step, bf16-mixed
GROWTH_RS = (64, 128, 256, 512, 1024)
GROWTH_BUDGET = 2048
MAX_GROWTH = 1.10
SPEED_PAIRS = 5
MAX_SLOWDOWN = 1.10
ALLOCATOR_ROWS = 128


# ---- helpers (run in the child processes) ------------------------------------------------------------


def _shape_of(shape: dict[str, int]) -> Any:
    from echo2.planner.memory_model import ModelShape

    return ModelShape.qwen3(
        shape["hidden"], shape["intermediate"], shape["layers"], shape["heads"], shape["kv_heads"],
        shape["head_dim"], shape["vocab"], tied=True,
    )  # fmt: skip


def child_bytes(precision: str) -> dict[str, Any]:
    """Study 1 in this process: updates with the node's publications and kept copies beside them."""
    import dataclasses

    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    # the model's code imported before the baseline: transformers imports it at the first build, and
    # what the import holds (about 320 MB with transformers 5.19) is the library's, not the model's
    from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: F401

    from echo2.check.rerun import GenerationCheck
    from echo2.config import GRPOConfig, LearnerConfig, SamplingConfig, SecurityConfig, SnapshotConfig
    from echo2.learner.trainer import GRPOTrainer
    from echo2.models.snapshot import aliasing_model, load_for_check
    from echo2.physics.rules import admission_floor
    from echo2.planner.memory_model import learner_memory, logits_chunk_bytes
    from echo2.weights.delta import patch_info, sampler_copy
    from echo2.weights.publication import Link, PublishedChain

    as_the_learner()
    torch.set_num_threads(2)
    sampling = SamplingConfig(max_new_tokens=32)
    base = rss()
    phases: dict[str, float] = {}  # the peak of each phase above the baseline (VmHWM, reset before it)

    def phase(name: str, fn: Any, *args: Any) -> Any:
        reset_peak()
        out = fn(*args)
        phases[name] = max(phases.get(name, 0.0), float(peak_since_reset() - base))
        return out

    model = phase("build", build, BIG)
    params = sum(p.numel() for p in model.parameters())
    after_model = rss()
    trainer = GRPOTrainer(
        model,
        GRPOConfig(lr=1e-5),
        sampling,
        0,
        learner=LearnerConfig(precision=precision, micro_batch_tokens=1024),
    )
    spill = Path(tempfile.mkdtemp(prefix="echo2-memory-"))
    chain = PublishedChain(SnapshotConfig(), spill)  # runtime/node.py: the run directory's published/
    check = GenerationCheck(aliasing_model(model), sampling, SecurityConfig())
    changed: list[float] = []  # share of elements each patch changed
    at_step: list[int] = []
    hook = register_optimizer_step_pre_hook(lambda opt, a, k: at_step.append(rss()))

    def publish(version: int) -> None:  # runtime/snapshots.py + runtime/node.py's on_published
        weights = sampler_copy(model, "bfloat16")
        enc = chain.encode(weights)
        if enc.lineage.kind == "patch":
            info = patch_info(enc.blob)
            changed.append(info["changed"] / info["elements"])
        lineage, blob = dataclasses.asdict(enc.lineage), chain.spill(version, enc.blob)
        del enc  # the encoded bytes live in the file now
        chain.record(Link(version, {"lineage": lineage}, blob))
        chain.base = weights
        check.keep(version, weights)  # the undo of the version before; the check model reads the newest
        check.forget_below(admission_floor(version, S))

    def check_oldest() -> None:  # what a check of the oldest admissible version loads, then drops
        oldest = check.versions()[0]
        with check._lock:
            load_for_check(check.model, check._weights_of(oldest))
            check._loaded = oldest
            check._settle()

    phase("publish", publish, 0)
    between = []
    for step in range(STEPS):
        phase("update", trainer.update, batch(BIG["vocab"], 16, 16, 32, seed=step))
        if trainer.version % KAPPA == 0:
            phase("publish", publish, trainer.version)
        phase("check", check_oldest)
        between.append(rss())
    hook.remove()
    f = statistics.mean(changed) if changed else 0.0
    model_mem = learner_memory(_shape_of(BIG), precision, staleness=S, kappa=KAPPA, changed_fraction=f)  # type: ignore[arg-type]
    # the update's peak: what is held at the step, plus one micro-batch's activations (16 rows x 48
    # tokens), its LM-head chunk (512 completion positions) and, in bf16-mixed, the weights' casts
    act = model_mem.activation_per_token * 16 * 48
    logits = logits_chunk_bytes(BIG["vocab"], min(LearnerConfig().logprob_chunk, 16 * 32))
    transient_peak = act + logits + model_mem.autocast_copies * params
    steady_step = [(x - base) / params for x in at_step[2:]]
    steady_between = [(x - base) / params for x in between[2:]]
    return {
        "precision": precision,
        "params": params,
        "weights_bytes_per_param": (after_model - base) / params,
        "at_step_bytes_per_param": steady_step,
        "between_bytes_per_param": steady_between,
        "held_copy_bytes_per_param": _held(chain, check) / params,
        "undo_bytes_per_param": check.held_bytes() / params,
        "changed_fraction": f,
        "check_rebuilds": check.rebuilds,
        "published_file_bytes_per_param": sum(p.stat().st_size for p in spill.iterdir()) / params,
        "check_versions": check.versions(),
        "chain_links": len(chain.links),
        "model_at_step": model_mem.update_peak,
        "model_between": model_mem.update_peak - model_mem.gradients,
        "model_parts": model_mem.table(),
        "peak_rss_bytes_per_param": max(phases.values()) / params,
        "phase_peak_bytes_per_param": {k: v / params for k, v in phases.items()},
        "model_peak": model_mem.update_peak + transient_peak / params,
        "model_peak_parts": {
            "activations": act / params,
            "logits_chunk": logits / params,
            "autocast_copies": model_mem.autocast_copies,
        },
        "activation_model_per_token": model_mem.activation_per_token,
    }


def _held(chain: Any, check: Any) -> int:
    """Bytes of the sampler copies, undos and encoded publications held in memory (each storage once;
    a link spilled to a file is the page cache's, not counted)."""
    seen: dict[int, int] = {}
    for t in (chain.base or {}).values():
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    in_memory = sum(len(link.blob) for link in chain.links if not isinstance(link.blob, memoryview))
    return sum(seen.values()) + check.held_bytes() + in_memory


def child_growth(rows: int, glibc_default: bool = False) -> dict[str, Any]:
    import torch

    from echo2.config import GRPOConfig, LearnerConfig, SamplingConfig
    from echo2.learner.trainer import GRPOTrainer

    as_the_learner(glibc_default)
    torch.set_num_threads(2)
    trajs = batch(MID["vocab"], rows, 16, 16, seed=rows)
    base = rss()
    model = build(MID)
    params = sum(p.numel() for p in model.parameters())
    trainer = GRPOTrainer(
        model, GRPOConfig(lr=1e-5), SamplingConfig(max_new_tokens=16), 0,
        learner=LearnerConfig(micro_batch_tokens=GROWTH_BUDGET),
    )  # fmt: skip
    trainer.update(batch(MID["vocab"], 64, 16, 16, seed=0))  # optimizer states exist from here
    settled = rss()
    t0 = time.perf_counter()
    trainer.update(trajs)
    return {
        "rows": rows,
        "params": params,
        "tokens": rows * 32,
        "peak_bytes": peak_rss() - base,
        "settled_bytes": settled - base,
        "update_s": time.perf_counter() - t0,
    }


def _spawn(
    args: list[str], env: dict[str, str] | None = None, timeout: float | None = None
) -> dict[str, Any]:
    res = subprocess.run(
        [sys.executable, __file__, *args],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )
    if res.returncode != 0:
        raise RuntimeError(f"{args}: {res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---- the studies -----------------------------------------------------------------------------------
PRECISIONS = ("fp32", "bf16-mixed")
CHILD_TIMEOUT_S: float | None = None  # --child-timeout: a bytes child past it is reported as not read


def study_bytes() -> dict[str, Any]:
    runs, unread = [], []
    for p in PRECISIONS:
        try:
            runs.append(_spawn(["--child-bytes", p], timeout=CHILD_TIMEOUT_S))
        except subprocess.TimeoutExpired:  # bf16 on a CPU without AVX-512 runs many times slower
            unread.append({"precision": p, "not_read": f"did not finish in {CHILD_TIMEOUT_S:.0f} s"})
    for r in runs:
        r["at_step_median"] = statistics.median(r["at_step_bytes_per_param"])
        r["between_median"] = statistics.median(r["between_bytes_per_param"])
        r["at_step_vs_model"] = r["at_step_median"] / r["model_at_step"] - 1
        r["between_vs_model"] = r["between_median"] / r["model_between"] - 1
        r["peak_vs_model"] = r["peak_rss_bytes_per_param"] / r["model_peak"] - 1
    mixed = next((r for r in runs if r["precision"] == "bf16-mixed"), None)
    met = {
        "within_15pct": all(
            abs(r["at_step_vs_model"]) <= WITHIN and abs(r["between_vs_model"]) <= WITHIN for r in runs
        ),
        "mixed_at_most_20": None if mixed is None else mixed["at_step_median"] <= MAX_MIXED_PEAK,
    }
    return {"runs": runs, "not_read": unread, "met": met}


def study_growth() -> dict[str, Any]:
    runs = [_spawn(["--child-growth", str(r)]) for r in GROWTH_RS]
    fixed = [_spawn(["--child-growth", str(r)], {"MALLOC_MMAP_THRESHOLD_": "65536"}) for r in GROWTH_RS]
    ratio = runs[-1]["peak_bytes"] / runs[0]["peak_bytes"]
    ratio_fixed = fixed[-1]["peak_bytes"] / fixed[0]["peak_bytes"]
    return {
        "runs": runs,
        "peak_ratio_1024_vs_64": ratio,
        "runs_fixed_mmap_threshold": fixed,
        "peak_ratio_1024_vs_64_fixed_mmap_threshold": ratio_fixed,
        "met": {"growth": ratio <= MAX_GROWTH},
        "second_reading_met": ratio_fixed <= MAX_GROWTH,
    }


def study_speed() -> dict[str, Any]:
    import torch

    from echo2.config import GRPOConfig, LearnerConfig, SamplingConfig
    from echo2.learner.logprobs import completion_logits, completion_logprobs, lm_parts, pack
    from echo2.learner.trainer import GRPOTrainer

    as_the_learner()
    torch.set_num_threads(2)
    # (a) the update, micro-batched vs one micro-batch: two trainers on one model, lr 0 (same weights)
    model = build(MID)
    trajs = batch(MID["vocab"], 64, 16, 48, seed=1)
    whole = GRPOTrainer(model, GRPOConfig(lr=1e-12), SamplingConfig(max_new_tokens=48), 0,
                        learner=LearnerConfig(micro_batch_tokens=1 << 20))  # fmt: skip
    small = GRPOTrainer(model, GRPOConfig(lr=1e-12), SamplingConfig(max_new_tokens=48), 0,
                        learner=LearnerConfig(micro_batch_tokens=1024))  # fmt: skip
    whole.update(trajs), small.update(trajs)  # warm-up (and AdamW states)
    pairs_a = []
    for _ in range(SPEED_PAIRS):
        a = whole.update(trajs).t_train_s
        b = small.update(trajs).t_train_s
        pairs_a.append({"whole_s": a, "micro_s": b, "ratio": b / a})
    del model, whole, small
    # (b) log-probs: chunked LM head vs the whole [B, T, V] logits, forward + backward, embedded model
    from echo2.config import load_config
    from echo2.models.embedded import build_model, build_tokenizer

    cfg = load_config()
    tok = build_tokenizer()
    emb = build_model(cfg.model.embedded, tok, seed=0)
    eb = batch(
        emb.config.vocab_size, cfg.batch.prompts * cfg.batch.group_size, 8, cfg.sampling.max_new_tokens, 2
    )
    packed = pack(eb, [[1.0] * len(t.completion_ids) for t in eb], tok.pad_token_id)
    parts = lm_parts(emb)

    def legacy() -> None:
        logits = completion_logits(emb, packed).float()
        logp = torch.log_softmax(logits, -1).gather(-1, packed.targets_BT[..., None]).squeeze(-1)
        (logp * packed.mask_BT).sum().backward()

    def chunked() -> None:
        logp = completion_logprobs(emb, packed, 1.0, parts=parts)
        (logp * packed.mask_BT).sum().backward()

    def timed(fn: Any, reps: int = 10) -> float:
        t0 = time.perf_counter()
        for _ in range(reps):
            emb.zero_grad(set_to_none=True)
            fn()
        return (time.perf_counter() - t0) / reps

    timed(legacy, 3), timed(chunked, 3)
    pairs_b = []
    for _ in range(SPEED_PAIRS):
        a, b = timed(legacy), timed(chunked)
        pairs_b.append({"legacy_s": a, "chunked_s": b, "ratio": b / a})
    ra = statistics.median(p["ratio"] for p in pairs_a)
    rb = statistics.median(p["ratio"] for p in pairs_b)
    return {
        "micro_batched": {
            "pairs": pairs_a,
            "median_ratio": ra,
            "budget_tokens": 1024,
            "batch_tokens": 64 * 64,
        },
        "logprobs": {"pairs": pairs_b, "median_ratio": rb, "rows": len(eb)},
        "met": {"micro_batched": ra <= MAX_SLOWDOWN, "logprobs": rb <= MAX_SLOWDOWN},
    }


CHECK_SHAPE = {**SHAPE_235M, "hidden": 1024, "intermediate": 3072, "layers": 28, "head_dim": 128,
               "vocab": 151936}  # Qwen3-0.6B's  # fmt: skip
MAX_CHECK_MODEL = 0.25  # bytes / parameter above the baseline


def child_check_model(way: str) -> dict[str, Any]:
    """Study 5 in this process: the check's model of ``CHECK_SHAPE`` built ``way`` ("now": the learner's
    ``aliasing_model``; "before": a float32 random init cast to bf16, as it was built before)."""
    import accelerate  # noqa: F401 (the library code imported before the baseline)
    import torch
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

    from echo2.models.snapshot import aliasing_model
    from echo2_bench.resident import peak_since_reset, reset_peak
    from echo2_bench.synthetic import config_of

    as_the_learner()
    config = config_of(CHECK_SHAPE)
    with torch.device("meta"):  # the learner's model: only its config and device are read
        learner = Qwen3ForCausalLM(config)
    params = sum(p.numel() for p in learner.parameters())
    learner.to_empty(device="cpu")
    base = rss()
    reset_peak()
    t0 = time.perf_counter()
    if way == "now":
        twin = aliasing_model(learner, "bfloat16")
    else:
        twin = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to("cpu", torch.bfloat16)
    took = time.perf_counter() - t0
    peak = peak_since_reset() - base
    after = rss() - base
    del twin
    return {"way": way, "params": params, "peak_bytes_per_param": peak / params,
            "after_bytes_per_param": after / params, "build_s": took}  # fmt: skip


def study_check_model() -> dict[str, Any]:
    runs = [_spawn(["--child-check-model", way]) for way in ("now", "before")]
    now = runs[0]["peak_bytes_per_param"]
    return {"runs": runs, "shape": CHECK_SHAPE, "met": {"check_model": now <= MAX_CHECK_MODEL}}


def study_allocator() -> dict[str, Any]:
    """The learner's mmap threshold vs glibc's default: the growth update at R = 128, fresh processes."""
    from echo2.config import LearnerConfig

    pairs_c = []
    for k in range(SPEED_PAIRS):
        got = {}
        for side in ("default", "learner") if k % 2 == 0 else ("learner", "default"):
            flag = ["--glibc-default"] if side == "default" else []
            got[side] = _spawn(["--child-growth", str(ALLOCATOR_ROWS), *flag])
        pairs_c.append({
            "default_s": got["default"]["update_s"], "learner_s": got["learner"]["update_s"],
            "default_peak_bytes": got["default"]["peak_bytes"],
            "learner_peak_bytes": got["learner"]["peak_bytes"],
            "ratio": got["learner"]["update_s"] / got["default"]["update_s"],
        })  # fmt: skip
    rc = statistics.median(p["ratio"] for p in pairs_c)
    return {
        "pairs": pairs_c,
        "median_ratio": rc,
        "rows": ALLOCATOR_ROWS,
        "threshold_bytes": LearnerConfig().malloc_mmap_threshold,
        "met": {"allocator": rc <= MAX_SLOWDOWN},
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    if "bytes" in result:
        ax = axes[0]
        runs = result["bytes"]["runs"]
        x = range(len(runs))
        bars = (("model_between", "model, between updates"), ("between_median", "measured, between"),
                ("model_at_step", "model, at the step"), ("at_step_median", "measured, at the step"),
                ("model_peak", "model, peak"), ("peak_rss_bytes_per_param", "measured, peak"))  # fmt: skip
        for j, (key, label) in enumerate(bars):
            vals = [r.get(key, 0.0) for r in runs]
            ax.bar([i - 0.375 + 0.15 * j for i in x], vals, 0.15, label=label, color=f"C{j // 2}",
                   alpha=0.5 if j % 2 == 0 else 1.0)  # fmt: skip
        ax.axhline(MAX_MIXED_PEAK, color="k", ls=":", lw=1)
        ax.set_xticks(list(x), [r["precision"] for r in runs])
        ax.set_ylabel("bytes / parameter")
        ax.set_title(f"learner memory, {runs[0]['params'] / 1e6:.0f}M params")
        ax.legend(fontsize=7)
    if "growth" in result:
        ax = axes[1]
        runs = result["growth"]["runs"]
        ax.plot([r["rows"] for r in runs], [r["peak_bytes"] / 2**30 for r in runs], "o-", label="peak")
        ax.plot(
            [r["rows"] for r in runs],
            [r["settled_bytes"] / 2**30 for r in runs],
            "s--",
            label="between updates",
        )
        first = (result["growth"].get("earlier_readings") or [{}])[-1].get("runs") or []
        fixed = result["growth"].get("runs_fixed_mmap_threshold") or []
        for more, style, label in (
            (first, "x:", "peak, glibc's adaptive threshold (first reading)"),
            (fixed, "^-", "peak, MALLOC_MMAP_THRESHOLD_=64 KiB (2nd reading)"),
        ):
            if more:
                rows, peaks = [r["rows"] for r in more], [r["peak_bytes"] / 2**30 for r in more]
                ax.plot(rows, peaks, style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"R (rows of 32 tokens), budget {GROWTH_BUDGET} tokens")
        ax.set_ylabel("GiB")
        ax.set_ylim(bottom=0)
        ax.set_title("peak memory vs R")
        ax.legend()
    if "speed" in result:
        ax = axes[2]
        sp = result["speed"]
        boxes = [
            sp["micro_batched"],
            sp["logprobs"],
            *([result["allocator"]] if "allocator" in result else []),
        ]
        ax.boxplot([[p["ratio"] for p in b["pairs"]] for b in boxes])
        names = ["micro-batched\nvs one", "chunked log-probs\nvs [B,T,V]", "mmap threshold\nvs glibc's"]
        ax.set_xticks(list(range(1, len(boxes) + 1)), names[: len(boxes)])
        ax.axhline(MAX_SLOWDOWN, color="k", ls=":", lw=1)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_ylabel("time ratio (per pair)")
        ax.set_title("cost of bounding memory")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    global PRECISIONS, CHILD_TIMEOUT_S
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", choices=["bytes", "growth", "speed", "allocator", "check-model", "all"],
                   default="all")  # fmt: skip
    p.add_argument("--child-check-model", choices=["now", "before"], help=argparse.SUPPRESS)
    p.add_argument("--precisions", default=",".join(PRECISIONS), help="the bytes study's, comma-separated")
    p.add_argument("--child-timeout", type=float, help="seconds a bytes child may take (else: not read)")
    p.add_argument("--out", type=Path, default=ROOT / "results")
    p.add_argument("--child-bytes", help=argparse.SUPPRESS)
    p.add_argument("--child-growth", type=int, help=argparse.SUPPRESS)
    p.add_argument("--glibc-default", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--reading", default="", help="what changed since the study's last reading (kept with it)")
    a = p.parse_args()
    if a.child_bytes:
        print(json.dumps(child_bytes(a.child_bytes)))
        return 0
    if a.child_growth:
        print(json.dumps(child_growth(a.child_growth, a.glibc_default)))
        return 0
    path = a.out / "memory.json"
    result: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    PRECISIONS, CHILD_TIMEOUT_S = tuple(a.precisions.split(",")), a.child_timeout
    if a.child_check_model:
        print(json.dumps(child_check_model(a.child_check_model)))
        return 0
    studies = ["bytes", "growth", "speed", "allocator", "check-model"] if a.study == "all" else [a.study]
    for s in studies:
        t0 = time.perf_counter()
        new = {
            "bytes": study_bytes,
            "growth": study_growth,
            "speed": study_speed,
            "allocator": study_allocator,
            "check-model": study_check_model,
        }[s]()
        new["wall_s"] = time.perf_counter() - t0
        result[s] = on_record(result.get(s), new, a.reading)  # every earlier reading kept
        print(s, json.dumps(result[s]["met"]), flush=True)
    result["command"] = "python benchmarks/memory.py [--study bytes | growth | speed]"
    a.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    plot(result, a.out / "memory.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
