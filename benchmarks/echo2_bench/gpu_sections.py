"""The sections of the GPU suite (``benchmarks/gpu_suite.py``): each one a function of a :class:`Ctx`
returning its readings, filling ``ctx.partial`` as it goes (what a section that runs out of time still
reports) and leaving what later sections of its group need in ``ctx.state``."""

from __future__ import annotations

import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from echo2_bench.synthetic import SHAPE_235M, SHAPE_SMOKE, batch, build

QWEN3_17B = {"hidden": 2048, "intermediate": 6144, "layers": 28, "heads": 16, "kv_heads": 8, "head_dim": 128,
             "vocab": 151936}  # fmt: skip
QWEN3_4B = {"hidden": 2560, "intermediate": 9728, "layers": 36, "heads": 32, "kv_heads": 8, "head_dim": 128,
            "vocab": 151936}  # fmt: skip
H200_DENSE_BF16 = 989e12  # NVIDIA's datasheet: H200 SXM, dense BF16 Tensor Core FLOP/s (1,979 with sparsity)
GIB = 2**30


@dataclass(frozen=True)
class Plan:
    """The sizes of one run of the suite: the H200's, or the smoke run's on the CPU."""

    device: str  # where every section computes
    learner: dict[str, int]  # the learner's shape (Qwen3-1.7B)
    big: dict[str, int]  # the activation-checkpointing shape (Qwen3-4B)
    sharded: dict[str, int]  # the sharded learner's (the code path: a mid shape)
    rows: int  # R, completions per update
    prompt: int  # prompt tokens of a training row
    completion: int  # completion tokens of a training row
    micro: tuple[int, ...]  # micro-batch token budgets to time
    timed: int  # timed updates per budget (after one warm-up)
    big_rows: int  # rows of the 4B update
    big_micro: int  # its micro-batch budget
    gen_prompts: int  # prompts of the engine's generation, each sampled group times
    group: int  # completions per prompt
    gen_tokens: int  # completion tokens generated (and checked)
    gen_prompt_len: int  # prompt tokens of a generation
    matmul: tuple[int, ...]  # square sizes of the bf16 matmul peak


H200 = Plan("cuda", QWEN3_17B, QWEN3_4B, SHAPE_235M, 256, 64, 512, (16384, 8192), 2, 32, 8192, 16, 4, 1024,
            64, (4096, 8192))  # fmt: skip
SMOKE = Plan("cpu", SHAPE_SMOKE, SHAPE_SMOKE, SHAPE_SMOKE, 16, 8, 16, (256, 128), 1, 8, 128, 4, 4, 24, 8,
             (128,))  # fmt: skip


@dataclass
class Ctx:
    """What a section reads and leaves: the run's plan, its own partial readings, the group's state."""

    plan: Plan
    partial: dict[str, Any] = field(default_factory=dict)  # this section's readings so far
    state: dict[str, Any] = field(default_factory=dict)  # objects later sections of the group use

    @property
    def cuda(self) -> bool:
        return self.plan.device == "cuda"


def sync(ctx: Ctx) -> None:
    if ctx.cuda:
        import torch

        torch.cuda.synchronize()


def timed(ctx: Ctx, fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds of ``fn()`` with the device's queued work done on both sides, and its result."""
    sync(ctx)
    t0 = time.perf_counter()
    out = fn()
    sync(ctx)
    return time.perf_counter() - t0, out


def model_shape(shape: dict[str, int]) -> Any:
    from echo2.planner.memory_model import ModelShape

    keys = ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab")
    return ModelShape.qwen3(*(shape[k] for k in keys), tied=True)


def memory_reset(ctx: Ctx) -> int:
    """The device's peak counters reset; the bytes allocated now (0 on the CPU)."""
    if not ctx.cuda:
        return 0
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return int(torch.cuda.memory_allocated())


def memory_peak(ctx: Ctx) -> dict[str, float | None]:
    if not ctx.cuda:
        return {"peak_allocated_gib": None, "peak_reserved_gib": None}
    import torch

    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
    }


# ---- preflight ---------------------------------------------------------------------------------------
def preflight(ctx: Ctx) -> dict[str, Any]:
    """Versions, the device, and the bf16 matmul peak measured on it (the MFU's second denominator)."""
    import torch
    import transformers

    out = ctx.partial
    out.update({
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformers": transformers.__version__, "device": _device_name(ctx),
        "datasheet_bf16_flops": H200_DENSE_BF16 if ctx.cuda else None,
    })  # fmt: skip
    if ctx.cuda:
        props = torch.cuda.get_device_properties(0)
        out["memory_gib"] = props.total_memory / GIB
        out["capability"] = f"{props.major}.{props.minor}"
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    device = torch.device(ctx.plan.device)
    best = {}
    for n in ctx.plan.matmul:
        a, b, c = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(3))

        def matmuls(reps: int, a: Any = a, b: Any = b, c: Any = c) -> None:
            for _ in range(reps):
                torch.matmul(a, b, out=c)  # into one buffer: nothing accumulates

        matmuls(3)
        reps, took = 1, 0.0
        while took < (1.0 if ctx.cuda else 0.1):  # at least a second of matmuls on the GPU
            reps *= 2
            took, _ = timed(ctx, lambda reps=reps: matmuls(reps))
        best[str(n)] = 2 * n**3 * reps / took
        out["matmul_bf16_flops"] = best
        del a, b, c
    out["measured_bf16_flops"] = ctx.state["measured_bf16_flops"] = max(best.values())
    out["noise"] = _noise_on_device(ctx)
    return out


def _noise_on_device(ctx: Ctx) -> dict[str, Any]:
    """The seeded sampling noise of one step of a vLLM-sized batch (256 rows at the learner's
    vocabulary; smoke: 8) on the device: seconds blocked (``gumbel_noise``) and as the formula computed
    whole (``noise_study.plain``), and its agreement with this machine's CPU, the same function there (the
    draw is a protocol: the bits are integer hashing, only the final logs may differ by an ulp)."""
    import torch

    from echo2.rollout.sampling import gumbel_noise
    from echo2_bench.noise_study import plain

    rows, vocab = (256, ctx.plan.learner["vocab"]) if ctx.cuda else (8, 4099)
    device_rows = torch.arange(rows, device=ctx.plan.device)
    gumbel_noise(9, device_rows, 0, vocab)  # warm-up
    blocked_s, got = timed(ctx, lambda: gumbel_noise(9, device_rows, 3, vocab))
    plain_s, whole = timed(ctx, lambda: plain(9, device_rows, 3, vocab))
    cpu = gumbel_noise(9, torch.arange(rows), 3, vocab)
    diff = (got.cpu() - cpu).abs()
    return {
        "rows": rows, "vocab": vocab, "blocked_s": blocked_s, "plain_s": plain_s,
        "bit_identical_to_plain": bool(torch.equal(got, whole)),
        "equal_to_cpu_share": float((diff == 0).float().mean()), "max_abs_diff_to_cpu": float(diff.max()),
    }  # fmt: skip


def _device_name(ctx: Ctx) -> str:
    import torch

    return torch.cuda.get_device_name(0) if ctx.cuda else "cpu (smoke: tiny shapes, no figure to read)"


# ---- the learner at the 1.7B shape ---------------------------------------------------------------------
def learner(ctx: Ctx) -> dict[str, Any]:
    """Full updates of R rows in bf16-mixed at each micro-batch budget: step time, tokens/s, MFU against
    the measured peak and the datasheet's, peak device memory against the memory model."""
    from echo2.config import GRPOConfig, LearnerConfig, SamplingConfig
    from echo2.learner.trainer import GRPOTrainer
    from echo2.planner.memory_model import learner_memory, logits_chunk_bytes

    p, out = ctx.plan, ctx.partial
    model = build(p.learner, device=p.device)
    params = sum(x.numel() for x in model.parameters())
    cfg = LearnerConfig(device=p.device, precision="bf16-mixed", micro_batch_tokens=p.micro[0])
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-6), SamplingConfig(max_new_tokens=p.completion), 0,
                          learner=cfg)  # fmt: skip
    ctx.state.update(model=model, trainer=trainer, params=params)
    row = p.prompt + p.completion
    tokens = p.rows * row
    peak = ctx.state.get("measured_bf16_flops")
    mem = learner_memory(model_shape(p.learner), "bf16-mixed", checks=False, gpu=True)
    out.update({"params": params, "rows": p.rows, "tokens_per_update": tokens, "runs": []})
    for seed, budget in enumerate(p.micro):
        trainer.learner = cfg.model_copy(update={"micro_batch_tokens": budget})
        trainer.update(batch(p.learner["vocab"], p.rows, p.prompt, p.completion, seed=100 + seed))  # warm-up
        memory_reset(ctx)
        times = []
        for i in range(p.timed):
            trajs = batch(p.learner["vocab"], p.rows, p.prompt, p.completion, seed=10 * seed + i)
            times.append(timed(ctx, lambda trajs=trajs: trainer.update(trajs))[0])
        step = statistics.median(times)
        micro_tokens = min(budget // row, p.rows) * row
        model_bytes = mem.device_bytes(
            params, micro_tokens, logits_chunk_bytes(p.learner["vocab"], cfg.logprob_chunk)
        )
        run = {"micro_batch_tokens": budget, "update_s": times, "step_s": step, "tokens_per_s": tokens / step,
               "mfu_datasheet": 6 * params * tokens / (step * H200_DENSE_BF16) if ctx.cuda else None,
               "mfu_measured_peak": 6 * params * tokens / (step * peak) if peak else None,
               "model_gib": model_bytes / GIB, **memory_peak(ctx)}  # fmt: skip
        if run["peak_allocated_gib"] is not None:
            run["allocated_vs_model"] = run["peak_allocated_gib"] / run["model_gib"] - 1
        out["runs"].append(run)
    return out


# ---- a publication from the GPU learner and its install into an HF engine on the GPU -------------------
def publication(ctx: Ctx) -> dict[str, Any]:
    """The learner's bf16 copy (device to host) and its digest, installed whole into an HF engine on the
    device (a worker's first version; the engine the next sections use); one update, the lossless patch
    between the two copies, the worker's side (apply, digest, install into that engine), and the
    engine's logits against a model freshly loaded from the full snapshot's bytes: equal."""
    import torch

    from echo2.config import SamplingConfig
    from echo2.models.snapshot import install_weights
    from echo2.rollout.engines.hf import HFEngine
    from echo2.weights.delta import (
        apply_patch,
        decode_full,
        encode_full,
        encode_patch,
        patch_info,
        sampler_copy,
    )
    from echo2.weights.delta import weights_digest as digest

    p, out = ctx.plan, ctx.partial
    model, trainer = ctx.state["model"], ctx.state["trainer"]
    out["copy_s"], w0 = timed(ctx, lambda: sampler_copy(model, "bfloat16"))
    out["bytes"] = sum(t.numel() * t.element_size() for t in w0.values())
    out["digest_s"], _ = timed(ctx, lambda: digest(w0))
    engine_model = _engine_model(ctx, p.learner)
    out["install_full_s"], _ = timed(ctx, lambda: install_weights(engine_model, w0))
    sampling = SamplingConfig(max_new_tokens=p.gen_tokens)
    ctx.state.update(engine=HFEngine(engine_model, 1, 0, sampling), w_pub=w0, sampling=sampling)
    rows = max(p.group * 2, p.rows // 4)
    trainer.update(batch(p.learner["vocab"], rows, p.prompt, p.completion, seed=7))
    _, w1 = timed(ctx, lambda: sampler_copy(model, "bfloat16"))
    out["encode_patch_s"], patch = timed(ctx, lambda: encode_patch(w0, w1))
    info = patch_info(patch)
    out.update({"patch_bytes": len(patch), "changed_fraction": info["changed"] / info["elements"]})
    out["apply_patch_s"], rebuilt = timed(ctx, lambda: apply_patch(w0, patch))
    out["worker_digest_s"], got = timed(ctx, lambda: digest(rebuilt))
    out["patch_rebuilds_publication"] = got == digest(w1)
    del ctx.state["w_pub"]  # the engine is between versions while it installs
    out["install_patched_s"], _ = timed(ctx, lambda: install_weights(engine_model, rebuilt))
    ctx.state["w_pub"] = w1
    fresh = _engine_model(ctx, p.learner, seed=1)  # other random weights until loaded
    install_weights(fresh, decode_full(encode_full(w1)))
    ids = torch.randint(3, p.learner["vocab"], (4, 256 if ctx.cuda else 16), device=p.device)
    with torch.no_grad():
        a, b = engine_model(input_ids=ids).logits.float(), fresh(input_ids=ids).logits.float()
    out["logits_max_abs_diff_vs_fresh"] = float((a - b).abs().max())
    out["logits_equal_fresh"] = bool(torch.equal(a, b))
    return out


def _engine_model(ctx: Ctx, shape: dict[str, int], seed: int = 0) -> Any:
    """A worker's engine model on the device: the architecture in float32, cast whole to bf16 (as
    ``HFEngine.from_skeleton`` casts it), built on the device."""
    import torch

    return build(shape, seed=seed, device=ctx.plan.device).to(torch.bfloat16).eval()


# ---- the HF engine's generation ---------------------------------------------------------------------
def engine(ctx: Ctx) -> dict[str, Any]:
    """``gen_prompts`` x ``group`` completions of ``gen_tokens`` tokens from the HF engine on the device
    (bf16, the published weights), seeded; in two calls (their rows keep their noise), so a run out of
    time keeps the first half. Tokens/s = tokens generated / seconds."""
    p, out = ctx.plan, ctx.partial
    eng = ctx.state["engine"]
    rng = random.Random(3)
    prompts = [
        [rng.randrange(3, p.learner["vocab"]) for _ in range(p.gen_prompt_len)] for _ in range(p.gen_prompts)
    ]
    rows = [ids for ids in prompts for _ in range(p.group)]
    seed = 12345
    eng.generate(rows[:2], seed=1, max_new_tokens=4)  # warm-up
    half = len(rows) // 2
    samples: list[Any] = []
    out.update({"prompts": p.gen_prompts, "group": p.group, "max_new_tokens": p.gen_tokens, "calls": []})
    for lo, hi in ((0, half), (half, len(rows))):
        call = lambda lo=lo, hi=hi: eng.generate(rows[lo:hi], seed=seed, rows=list(range(lo, hi)))  # noqa: E731
        took, got = timed(ctx, call)
        samples += got
        n = sum(len(s.completion_ids) for s in got)
        out["calls"].append({"rows": hi - lo, "seconds": took, "tokens": n})
        ctx.state["generated"] = (prompts, samples, seed)
    total_s = sum(c["seconds"] for c in out["calls"])
    out["tokens"] = sum(c["tokens"] for c in out["calls"])
    out["tokens_per_s"] = out["tokens"] / total_s
    return out


def _groups(ctx: Ctx) -> tuple[list[Any], int]:
    """The generated completions as trajectories (version 1), group by group; the lease's seed."""
    from echo2.types import Trajectory

    prompts, samples, seed = ctx.state["generated"]
    g = ctx.plan.group
    groups = []
    for i in range(len(samples) // g):
        ids = tuple(prompts[i])
        chunk = samples[i * g : (i + 1) * g]
        groups.append(
            tuple(
                Trajectory(f"p{i}", f"L:{i}", ids, tuple(x.completion_ids), tuple(x.logprobs), 0.0, 1)
                for x in chunk
            )
        )
    return groups, seed


# ---- honest bf16 errors, re-run by the check -----------------------------------------------------------
def bf16_errors(ctx: Ctx) -> dict[str, Any]:
    """Every generated completion re-run by the generation check computing in bf16 (its model aliasing
    the published copy, as the learner's does) at the bf16 tolerances: per completion its verdict (draw
    misses, log-prob misses, largest error), per token the log-prob error, read where the check computes
    its log-probs (``grpo.token_logprobs``, called once per chunk of positions, in order); the largest of
    those per completion must equal the verdict's (``hook_agrees``)."""
    import torch

    from echo2.check.rerun import GenerationCheck
    from echo2.config import SecurityConfig
    from echo2.learner import grpo
    from echo2.models.snapshot import aliasing_model

    out = ctx.partial
    security = SecurityConfig(engine_precision="bfloat16")
    check = GenerationCheck(aliasing_model(ctx.state["model"], "bfloat16"), ctx.state["sampling"], security,
                            rng=random.Random(0))  # fmt: skip
    check.keep(1, ctx.state["w_pub"])
    groups, seed = _groups(ctx)
    lp_tol, draw_tol = security.tolerances()
    out.update({"logprob_tolerance": lp_tol, "gumbel_tolerance": draw_tol,
                "completions": []})  # fmt: skip
    seen: list[Any] = []
    real = grpo.token_logprobs

    def hook(*args: Any, **kw: Any) -> Any:
        got = real(*args, **kw)
        seen.append(got.detach().float().flatten().cpu())
        return got

    errors: list[Any] = []
    grpo.token_logprobs = hook
    try:
        for i, group in enumerate(groups):
            for j, t in enumerate(group):
                seen.clear()
                v = check.rerun(t, seed, i * len(group) + j)
                err = (torch.cat(seen) - torch.tensor(t.sampler_logprobs)).abs() if seen else torch.zeros(0)
                errors.append(err)
                out["completions"].append({
                    "tokens": v.tokens, "draw_misses": v.draw_misses, "logprob_misses": v.logprob_misses,
                    "max_logprob_error": v.max_logprob_error, "near_ties": v.near_ties,
                    "room": v.room, "passes": v.misses == 0,  # every position the draw or a near tie
                    "hook_agrees": _agrees(err, v),
                })  # fmt: skip
                _error_summary(out, errors)
    finally:
        grpo.token_logprobs = real
    return out


def _agrees(err: Any, v: Any) -> bool:
    """The per-token errors read by the hook are the verdict's: one per token, the same largest."""
    return bool(err.numel() == v.tokens and abs(float(err.max()) - v.max_logprob_error) < 1e-5)


def _error_summary(out: dict[str, Any], errors: list[Any]) -> None:
    import torch

    every = torch.cat(errors).double()
    done = out["completions"]
    out.update({
        "tokens": int(every.numel()), "max_error": float(every.max()),
        "p999_error": float(torch.quantile(every, 0.999)), "median_error": float(every.median()),
        "draw_misses_per_completion": [c["draw_misses"] for c in done],
        "max_draw_misses": max(c["draw_misses"] for c in done),
        "failing_completions": sum(not c["passes"] for c in done),
        "hook_agrees": all(c["hook_agrees"] for c in done),
    })  # fmt: skip


# ---- the generation check beside the learner -------------------------------------------------------
def check(ctx: Ctx) -> dict[str, Any]:
    """The check of one submission of ``group`` generated completions (4 x ``gen_tokens``): seconds
    alone; its device memory; the host-to-device copy of a version switch (the whole bf16 copy onto
    the check's model); seconds while an update runs, at the default duty and at duty 1, beside the
    update's seconds alone and with it."""
    from echo2.check.rerun import GenerationCheck
    from echo2.check.turns import Turns
    from echo2.config import SecurityConfig
    from echo2.data.store import Lease
    from echo2.data.submission import Submission
    from echo2.models.snapshot import aliasing_model
    from echo2.types import Prompt

    p, out = ctx.plan, ctx.partial
    model, trainer, w1 = ctx.state["model"], ctx.state["trainer"], ctx.state["w_pub"]
    security = SecurityConfig(engine_precision="bfloat16")
    groups, seed = _groups(ctx)
    lease = Lease("L", "w", "open", 0.0, [Prompt("p0", "", "")], seed, 1)
    sub = Submission("L", 1, (groups[0],))
    picks = [(0, j) for j in range(len(groups[0]))]
    base = memory_reset(ctx)
    chk = GenerationCheck(
        aliasing_model(model, "bfloat16"), ctx.state["sampling"], security, rng=random.Random(0)
    )
    out["first_load_s"], _ = timed(ctx, lambda: chk.keep(1, w1))  # the newest copy onto its model
    held = memory_reset(ctx)
    out["model_gib"] = (held - base) / GIB if ctx.cuda else None  # the check model's weights on the device
    out["alone_s"], verdicts = timed(ctx, lambda: chk.check(lease, sub, picks))
    out["tokens"] = sum(v.tokens for v in verdicts)
    peak = memory_peak(ctx)["peak_allocated_gib"]
    out["alone_peak_above_held_gib"] = peak - held / GIB if peak is not None else None
    switches = _switches(ctx, aliasing_model(model, "bfloat16"), w1)
    out.update({"switch_s": switches, "switch_bytes": sum(t.numel() * t.element_size() for t in w1.values())})
    out["switch_gb_per_s"] = out["switch_bytes"] / min(switches) / 1e9
    trajs = batch(p.learner["vocab"], p.rows, p.prompt, p.completion, seed=77)
    out["update_alone_s"], _ = timed(ctx, lambda: trainer.update(trajs))
    out["beside_update"] = []
    for duty in (SecurityConfig().check_duty, 1.0):
        chk.turns = Turns(duty)
        out["beside_update"].append(_check_beside_update(ctx, chk, trainer, trajs, lease, sub, picks, duty))
    return out


def _switches(ctx: Ctx, twin: Any, weights: Any) -> list[float]:
    """Seconds of loading a version into a check model on the device (its bf16 copy from host memory),
    twice (the first also allocates)."""
    from echo2.models.snapshot import load_for_check

    return [timed(ctx, lambda: load_for_check(twin, weights))[0] for _ in range(2)]


def _check_beside_update(ctx: Ctx, chk: Any, trainer: Any, trajs: Any, lease: Any, sub: Any, picks: Any,
                         duty: float) -> dict[str, Any]:  # fmt: skip
    import threading

    took: dict[str, Any] = {}

    def run() -> None:
        t0 = time.perf_counter()
        try:
            chk.check(lease, sub, picks)
        except Exception as exc:  # a verdict of forgery on honest work is a reading, not a crash
            took["error"] = f"{type(exc).__name__}: {exc}"
        took["check_s"] = time.perf_counter() - t0

    th = threading.Thread(target=run)
    sync(ctx)
    with chk.turns.updating():
        th.start()
        took["update_s"], _ = timed(ctx, lambda: trainer.update(trajs))
    th.join()
    return {"duty": duty, **took, "held_s": chk.turns.held_s, "pauses": chk.turns.pauses}


# ---- one update at the 4B shape with activation checkpointing ----------------------------------------
def four_b(ctx: Ctx) -> dict[str, Any]:
    """Two updates of ``big_rows`` rows at the 4B shape, bf16-mixed, activation checkpointing, with the
    check's bf16 model on the device: the peak against 80 GiB (the README's claim) and the memory
    model (``planner/memory.fits``)."""
    from echo2.config import GRPOConfig, LearnerConfig, SamplingConfig
    from echo2.learner.trainer import GRPOTrainer
    from echo2.models.snapshot import alias_weights, aliasing_model
    from echo2.planner.memory_model import fits, learner_memory, logits_chunk_bytes
    from echo2.weights.delta import sampler_copy

    p, out = ctx.plan, ctx.partial
    model = build(p.big, device=p.device)
    params = sum(x.numel() for x in model.parameters())
    cfg = LearnerConfig(device=p.device, precision="bf16-mixed", micro_batch_tokens=p.big_micro,
                        activation_checkpointing=True)  # fmt: skip
    trainer = GRPOTrainer(
        model, GRPOConfig(lr=1e-6), SamplingConfig(max_new_tokens=p.completion), 0, learner=cfg
    )
    check_model = aliasing_model(model, "bfloat16")
    alias_weights(check_model, {k: v.to(p.device) for k, v in sampler_copy(model, "bfloat16").items()})
    memory_reset(ctx)
    out["update_s"] = []
    for seed in range(2):  # the first creates AdamW's states
        trajs = batch(p.big["vocab"], p.big_rows, p.prompt, p.completion, seed=seed)
        out["update_s"].append(timed(ctx, lambda trajs=trajs: trainer.update(trajs))[0])
        out.update(memory_peak(ctx))
    shape = model_shape(p.big)
    row = p.prompt + p.completion
    micro_tokens = min(p.big_micro // row, p.big_rows) * row
    mem = learner_memory(shape, "bf16-mixed", gpu=True, checkpointing=True)
    out["params"] = params
    out["model_gib"] = (
        mem.device_bytes(params, micro_tokens, logits_chunk_bytes(p.big["vocab"], cfg.logprob_chunk)) / GIB
    )
    out["model_fits_80"] = fits(shape, 80, micro_batch_tokens=p.big_micro, checkpointing=True)
    if out["peak_reserved_gib"] is not None:
        out["claim_80_gib"] = "confirmed" if out["peak_reserved_gib"] <= 80 else "corrected"
        out["allocated_vs_model"] = out["peak_allocated_gib"] / out["model_gib"] - 1
    return out


# ---- the sharded learner at world size 1 ------------------------------------------------------------------
def sharded(ctx: Ctx) -> dict[str, Any]:
    """The sharded learner's code path at world size 1 (NCCL on the GPU, gloo in the smoke run): loaded
    as ``Plane.load`` loads it (meta device, its shard, rank 0 reading), its bf16 publication gathered
    from the shards against a one-process model loaded from the same checkpoint (the same digest), two
    updates beside the one-process learner's (largest weight difference), a DCP checkpoint written and
    read back (the same digest)."""
    import os
    import socket
    import tempfile

    import torch
    import torch.distributed as dist

    from echo2.config import load_config
    from echo2.learner.sharded import Ranks, full_weights, load_states, materialize, save_states
    from echo2.learner.trainer import GRPOTrainer
    from echo2.models.policy import chat_format, load_checkpoint
    from echo2.runtime.core import shard_policy
    from echo2.weights.delta import sampler_copy, weights_digest

    p, out = ctx.plan, ctx.partial
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    backend = "nccl" if ctx.cuda else "gloo"
    dist.init_process_group(backend)
    out["backend"] = backend
    device = torch.device(p.device)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = Path(tmp) / "ckpt"
            _bf16_checkpoint(p.sharded, ckpt, p.device)
            cfg = load_config(overrides=[f"model.path={str(ckpt)!r}", "grpo.kl_beta=0.04", "grpo.lr=1e-5",
                                         "learner.precision='bf16-mixed'", f"learner.device={p.device!r}",
                                         f"sampling.max_new_tokens={p.completion}"])  # fmt: skip
            ranks = Ranks(0, 1, 0, 600.0)
            policy = load_checkpoint(ckpt, chat_format(cfg), weights=False)
            out["load_s"], reference = timed(
                ctx, lambda: shard_policy(cfg, ranks, device, policy, ckpt, False)
            )
            one = load_checkpoint(ckpt, chat_format(cfg)).model.to(device)
            out["publication_equal_at_load"] = weights_digest(full_weights(policy.model)) == weights_digest(
                sampler_copy(one)
            )
            kw = {"learner": cfg.learner}
            trainer = GRPOTrainer(policy.model, cfg.grpo, cfg.sampling, 0, reference=reference, **kw)
            single = GRPOTrainer(one, cfg.grpo, cfg.sampling, 0, **kw)
            out["update_s"], out["one_process_update_s"] = [], []
            for seed in range(2):
                trajs = batch(p.sharded["vocab"], 16, p.prompt, p.completion, seed=seed)
                out["update_s"].append(timed(ctx, lambda trajs=trajs: trainer.update(trajs))[0])
                out["one_process_update_s"].append(timed(ctx, lambda trajs=trajs: single.update(trajs))[0])
            got, want = full_weights(policy.model, "float32"), sampler_copy(one, "float32")
            assert got is not None
            out["max_weight_diff_after_updates"] = max(float((got[k] - want[k]).abs().max()) for k in want)
            out["publish_s"], pub = timed(ctx, lambda: full_weights(policy.model))
            save_states(Path(tmp) / "dcp", policy.model, trainer.optimizer)
            back = load_checkpoint(ckpt, chat_format(cfg), weights=False).model
            materialize(back, ranks.mesh(p.device), device)
            opt = torch.optim.AdamW(back.parameters())
            load_states(Path(tmp) / "dcp", back, opt)
            out["dcp_round_trip_equal"] = weights_digest(full_weights(back)) == weights_digest(pub)
    finally:
        dist.destroy_process_group()
    return out


def _bf16_checkpoint(shape: dict[str, int], where: Path, device: str) -> None:
    """A bf16 HF checkpoint of a random-init model of ``shape`` (initialised on ``device``), with the
    embedded tokenizer."""
    import torch

    from echo2.models.embedded import build_tokenizer

    build(shape, device=device).to(torch.bfloat16).save_pretrained(where)
    build_tokenizer().save_pretrained(where)


SECTIONS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "preflight": preflight,
    "learner": learner,
    "publication": publication,
    "engine": engine,
    "bf16_errors": bf16_errors,
    "check": check,
    "four_b": four_b,
    "sharded": sharded,
}
