"""The learner sharded over K ranks with FSDP2 (``learner/sharded.py``) against the one-process learner.

Targets (fixed here, before the runs):

- **bytes per rank**: a random-init Qwen3-shaped model of ~235M parameters (``memory.py``'s ``BIG``),
  ``STEPS`` real updates (``GRPOTrainer.update``) at K = 1 (one process, the model whole, as a user runs
  it today) and K = 2 (two ranks under ``torchrun``, each decoder layer and the root wrapped with
  ``fully_shard``). Each rank's bytes of parameters + gradients + AdamW states, counted tensor by tensor
  (each storage once; a sharded tensor's local shard, padding included), right after every optimizer
  step from the second on (when all three exist). Target: the largest rank's at K = 2 <= 0.55x the one
  process's at K = 1. Each rank's peak resident memory above what it held before the model was built
  is reported beside it (no target: it also holds the transient all-gathered layers and activations).
- **step time**: the median wall time of an update after the first at K = 2 vs K = 1, on the same cores
  (K = 1 with 2 intra-op threads, K = 2 with 1 each). Reported, no target: the 2 cores are shared.
- **publication from shards**: the seconds to gather the bf16 publication tensor by tensor to rank 0
  (``full_weights``) at K = 2, beside the one-process ``sampler_copy`` at K = 1. Reported, no target.

Writes results/sharded.json and results/sharded.png.

``--study load`` (added with the loading on the meta device; target fixed here before its first run):
the learner loading a bf16 HF checkpoint of the ~235M shape (safetensors, as released checkpoints are)
at K = 2 and 4 gloo ranks, bf16-mixed with a KL reference (``grpo.kl_beta`` > 0), exactly as
``runtime/core.Plane.load`` does it (``load_checkpoint(weights=False)``, then ``shard_policy``: every
rank its shard, rank 0 reading and sending). Each rank's **peak resident memory** (``VmHWM``, reset
through ``/proc/self/clear_refs`` after its baseline) above its resident memory right before loading
(the baseline: the library code imported, the process group up, glibc's mmap threshold as the learner
sets it). Target:
every rank's peak - baseline <= its shard, (4 + 2) x P / K bytes (fp32 weights, bf16 reference), plus
one decoder layer in fp32 (4 x its parameters). Reported beside it, no target: the memory model's
``load_peak_bytes``, the bytes counted tensor by tensor after the load, the first forward's peak (the
trainer's probe, which gathers the root), and at K = 2 the loading before (every rank the whole fp32
model, then a deep copy as the reference, then sharded). Writes results/sharded_load.json and .png.

    python benchmarks/sharded.py                  # K = 1, 2 on the CPU (gloo), ~235M (about 6 minutes here)
    python benchmarks/sharded.py --device cuda --ks 1,2,4,8   # on GPUs (NCCL): one rank per GPU
    python benchmarks/sharded.py --smoke          # a tiny shape, 2 updates: that the script runs
    python benchmarks/sharded.py --study load     # the load's peak per rank, K = 2, 4 (gloo)
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

from echo2_bench.synthetic import SHAPE_235M, SHAPE_SMOKE, batch, build  # noqa: E402

BIG, SMOKE = SHAPE_235M, SHAPE_SMOKE
STEPS = 4
ROWS, PROMPT, COMPLETION = 16, 16, 32
MAX_RATIO = 0.55  # the largest rank's bytes at K = 2 / the one process's at K = 1


# ---- one rank (run by torchrun, or alone for K = 1) ------------------------------------------------------
def _local_bytes(tensors: list[Any]) -> int:
    """Bytes of ``tensors`` as this rank holds them (a DTensor's local shard), each storage once."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def rank_main(shape_name: str, steps: int, device: str, out: Path) -> None:
    import resource

    import torch
    import torch.distributed as dist
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from echo2.config import GRPOConfig, LearnerConfig, SamplingConfig
    from echo2.learner.sharded import full_weights, shard
    from echo2.learner.trainer import GRPOTrainer
    from echo2.weights.delta import sampler_copy

    world = int(os.environ.get("WORLD_SIZE", "1"))
    sharded = world > 1
    if sharded:
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank = dist.get_rank() if sharded else 0
    torch.set_num_threads(max(1, 2 // world) if device == "cpu" else 1)
    dev = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if device == "cuda" else "cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    shape = SMOKE if shape_name == "smoke" else BIG
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = build(shape).to(dev)
    params = sum(p.numel() for p in model.parameters())
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh

        shard(model, init_device_mesh(device, (world,)))
    trainer = GRPOTrainer(
        model, GRPOConfig(lr=1e-5), SamplingConfig(max_new_tokens=COMPLETION), 0,
        learner=LearnerConfig(device=device, micro_batch_tokens=1024),
    )  # fmt: skip
    held: list[dict[str, int]] = []

    def count(opt: Any, args: Any, kwargs: Any) -> None:
        ps = list(model.parameters())
        states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        grads = [p.grad for p in ps if p.grad is not None]
        held.append(
            {"params": _local_bytes(ps), "grads": _local_bytes(grads), "optimizer": _local_bytes(states)}
        )

    hook = register_optimizer_step_post_hook(count)
    times = []
    for step in range(steps):
        trajs = batch(shape["vocab"], ROWS, PROMPT, COMPLETION, seed=step)
        t0 = time.perf_counter()
        trainer.update(trajs)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    hook.remove()
    t0 = time.perf_counter()
    weights = full_weights(model, "bfloat16") if sharded else sampler_copy(model, "bfloat16")
    publish_s = time.perf_counter() - t0
    steady = held[1:]  # from the second step on: AdamW's states exist
    mine = {
        "rank": rank,
        "params": params,
        "held_bytes": max(sum(h.values()) for h in steady),
        "parts_bytes": {k: max(h[k] for h in steady) for k in steady[0]},
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before,
        "cuda_peak_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
        "step_s": times,
        "publish_s": publish_s,
        "publication_bytes": sum(t.numel() * t.element_size() for t in weights.values()) if weights else None,
    }
    everyone: list[Any] = [mine]
    if sharded:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        dist.barrier()  # every rank done talking before any tears its connections down
        dist.destroy_process_group()
    if rank == 0:
        out.write_text(json.dumps({"world": world, "ranks": everyone}))


# ---- the load study: one rank (torchrun) -----------------------------------------------------------------
LOAD_KS = (2, 4)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def load_rank_main(ckpt: Path, path: str, out: Path) -> None:
    """One rank of the load study: the learner's loading (``path`` "now") or the loading before it
    ("before"), its peak above the baseline; rank 0 writes every rank's reading to ``out``."""
    import accelerate  # noqa: F401 (the library code imported before the baseline: not the model's)
    import torch
    import torch.distributed as dist
    from torch.distributed import checkpoint, fsdp, tensor  # noqa: F401
    from transformers import (  # noqa: F401
        AutoConfig,
        AutoTokenizer,
        PreTrainedTokenizerFast,
        Qwen3ForCausalLM,
    )

    from echo2.config import load_config
    from echo2.learner.sharded import Ranks, shard
    from echo2.learner.trainer import GRPOTrainer, frozen_reference
    from echo2.models.policy import chat_format, load_checkpoint
    from echo2.runtime.core import shard_policy
    from echo2_bench.resident import as_the_learner, rss

    as_the_learner()
    torch.set_num_threads(1)
    cfg = load_config(overrides=[f"model.path={str(ckpt)!r}", "grpo.kl_beta=0.04",
                                 "learner.precision='bf16-mixed'"])  # fmt: skip
    ranks = Ranks.from_env("cpu", 600.0)
    device = torch.device("cpu")
    dist.barrier()  # the process group's buffers exist before the baseline
    base = rss()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak from here
    t0 = time.perf_counter()
    if path == "now":
        policy = load_checkpoint(ckpt, chat_format(cfg), weights=False)
        reference = shard_policy(cfg, ranks, device, policy, ckpt, resumed=False)
    else:  # runtime/core.Plane.load before: the whole fp32 model, a deep copy, both then sharded
        policy = load_checkpoint(ckpt, chat_format(cfg))
        mesh = ranks.mesh("cpu")
        reference = shard(frozen_reference(policy.model, True), mesh)
        shard(policy.model, mesh)
    dist.barrier()
    load_s = time.perf_counter() - t0
    peak = _status("VmHWM") - base
    held = _local_bytes(list(policy.model.parameters())) + _local_bytes(list(reference.parameters()))
    after = rss() - base
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before_probe = _status("VmRSS")
    GRPOTrainer(policy.model, cfg.grpo, cfg.sampling, policy.pad_id, learner=cfg.learner, reference=reference)
    mine = {"rank": ranks.rank, "peak_bytes": peak, "after_bytes": after, "held_bytes": held,
            "load_s": load_s, "probe_peak_bytes": _status("VmHWM") - before_probe}  # fmt: skip
    everyone: list[Any] = [None] * ranks.world
    dist.all_gather_object(everyone, mine)
    if ranks.leader:
        out.write_text(json.dumps(everyone))
    ranks.close()


def _write_checkpoint(shape: dict[str, int], where: Path) -> int:
    """A bf16 HF checkpoint (safetensors) of a random-init model of ``shape``, with the embedded
    tokenizer; its parameter count."""
    import torch

    from echo2.models.embedded import build_tokenizer

    model = build(shape).to(torch.bfloat16)
    model.save_pretrained(where)
    build_tokenizer().save_pretrained(where)
    return sum(p.numel() for p in model.parameters())


def study_load(smoke: bool) -> dict[str, Any]:
    from echo2.planner.memory_model import load_peak_bytes

    shape = SMOKE if smoke else BIG
    mshape = _model_shape(shape)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        params = _write_checkpoint(shape, ckpt)
        runs = []
        for k, path in [*((k, "now") for k in ((2,) if smoke else LOAD_KS)), (2, "before")]:
            out = Path(tmp) / f"load_{k}_{path}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(k),
                   str(Path(__file__).resolve()), "--load-rank", path, "--ckpt", str(ckpt),
                   "--rank-out", str(out)]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
            if res.returncode != 0:
                raise SystemExit(f"load K = {k} ({path}) failed:\n{res.stderr[-4000:]}")
            ranks = json.loads(out.read_text())
            budget = 6 * params / k + 4 * mshape.layer_params()  # the target, fixed before the runs
            runs.append({
                "k": k, "path": path, "ranks": ranks, "budget_bytes": budget,
                "shard_bytes": 6 * params / k, "layer_bytes": 4 * mshape.layer_params(),
                "model_bytes": load_peak_bytes(mshape, k, kl_reference=True),
                "max_peak_bytes": max(r["peak_bytes"] for r in ranks),
                "met": all(r["peak_bytes"] <= budget for r in ranks),
            })  # fmt: skip
    now = [r for r in runs if r["path"] == "now"]
    return {"params": params, "shape": shape, "smoke": smoke, "runs": runs,
            "met": all(r["met"] for r in now)}  # fmt: skip


def _model_shape(shape: dict[str, int]) -> Any:
    from echo2.planner.memory_model import ModelShape

    keys = ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab")
    return ModelShape.qwen3(*(shape[k] for k in keys), tied=True)


def plot_load(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.2))
    xs, labels, mib = [], [], 2**20
    for gap, run in enumerate(result["runs"]):
        for r in run["ranks"]:
            x = len(xs) + 0.5 * gap  # a gap between runs
            ax.bar(x, r["peak_bytes"] / mib, 0.6, color="C0" if run["path"] == "now" else "C3")
            ax.plot([x - 0.35, x + 0.35], [run["budget_bytes"] / mib] * 2, "k-", lw=2)
            ax.plot([x - 0.35, x + 0.35], [run["model_bytes"] / mib] * 2, "k:", lw=1)
            xs.append(x)
            labels.append(f"K={run['k']}\n{run['path']}\nrank {r['rank']}")
    ax.set_xticks(xs, labels, fontsize=7)
    ax.set_ylabel("peak resident MiB above the baseline")
    ax.set_title(
        f"loading a sharded learner ({result['params'] / 1e6:.0f}M, bf16 checkpoint, KL reference): peak "
        "per rank;\nsolid: shard + one fp32 layer (the target), dotted: the memory model",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- the parent ---------------------------------------------------------------------------------------
def run_k(k: int, shape: str, steps: int, device: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        child = [str(Path(__file__).resolve()), "--rank", "--shape", shape, "--steps", str(steps),
                 "--device", device, "--rank-out", str(out)]  # fmt: skip
        if k == 1:
            cmd = [sys.executable, *child]
        else:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(k),
                *child,
            ]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, 2 // k))}
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        if res.returncode != 0:
            raise SystemExit(f"K = {k} failed:\n{res.stderr[-4000:]}")
        got = json.loads(out.read_text())
    ranks = got["ranks"]
    step_s = [statistics.median(r["step_s"][1:]) for r in ranks]
    return {
        "k": k,
        "params": ranks[0]["params"],
        "max_rank_held_bytes": max(r["held_bytes"] for r in ranks),
        "max_rank_bytes_per_param": max(r["held_bytes"] for r in ranks) / ranks[0]["params"],
        "step_s_median": max(step_s),  # the slowest rank's: an update ends when every rank's does
        "publish_s": ranks[0]["publish_s"],
        "publication_bytes": ranks[0]["publication_bytes"],
        "ranks": ranks,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    ax = axes[0]
    parts = ("params", "grads", "optimizer")
    x = list(range(len(runs)))
    bottom = [0.0] * len(runs)
    for part in parts:
        vals = [max(r["parts_bytes"][part] for r in run["ranks"]) / run["params"] for run in runs]
        ax.bar(x, vals, 0.5, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.plot(x, [16 / run["k"] for run in runs], "k_", markersize=40, label="16 / K (memory model)")
    ax.set_xticks(x, [f"K = {run['k']}" for run in runs])
    ax.set_ylabel("bytes per parameter, largest rank")
    ax.set_title(f"parameters + gradients + AdamW per rank ({runs[0]['params'] / 1e6:.0f}M)")
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.bar([i - 0.2 for i in x], [run["step_s_median"] for run in runs], 0.4, label="update (median)")
    ax.bar([i + 0.2 for i in x], [run["publish_s"] for run in runs], 0.4, label="bf16 publication copy")
    ax.set_xticks(x, [f"K = {run['k']}" for run in runs])
    ax.set_ylabel("seconds")
    ax.set_title(f"time on the same {result['device']} cores / devices")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ks", default="1,2", help="world sizes, comma-separated (the first is the baseline)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--smoke", action="store_true", help="a tiny shape and 2 updates: that the script runs")
    p.add_argument("--out", type=Path, default=ROOT / "results")
    p.add_argument("--study", choices=("bytes", "load"), default="bytes")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--load-rank", choices=("now", "before"), help=argparse.SUPPRESS)
    p.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--shape", default="big", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=STEPS, help=argparse.SUPPRESS)
    p.add_argument("--rank-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank or args.load_rank:  # a rank: its results written, its group closed (sharded.leave)
        from echo2.learner.sharded import leave

        if args.rank:
            rank_main(args.shape, args.steps, args.device, args.rank_out)
        else:
            load_rank_main(args.ckpt, args.load_rank, args.rank_out)
        leave(0)
    if args.study == "load":
        name = "sharded_load_smoke" if args.smoke else "sharded_load"
        result = study_load(args.smoke)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
        plot_load(result, args.out / f"{name}.png")
        for run in result["runs"]:
            peaks = ", ".join(f"{r['peak_bytes'] / 2**20:.0f}" for r in run["ranks"])
            verdict = "met" if run["met"] else "NOT met"
            print(f"K = {run['k']} ({run['path']}): peak per rank {peaks} MiB; target <= "
                  f"{run['budget_bytes'] / 2**20:.0f} MiB -> {verdict}")  # fmt: skip
        return 0
    shape, steps = ("smoke", 3) if args.smoke else ("big", STEPS)
    ks = [int(k) for k in args.ks.split(",")]
    runs = [run_k(k, shape, steps, args.device) for k in ks]
    base = runs[0]
    for run in runs:
        run["bytes_vs_k1"] = run["max_rank_held_bytes"] / base["max_rank_held_bytes"]
        run["step_time_vs_k1"] = run["step_s_median"] / base["step_s_median"]
    two = next((r for r in runs if r["k"] == 2), None)
    result = {
        "device": args.device,
        "smoke": args.smoke,
        "shape": SMOKE if args.smoke else BIG,
        "rows": ROWS,
        "tokens_per_row": PROMPT + COMPLETION,
        "steps": steps,
        "runs": runs,
        "target": {"bytes_k2_vs_k1_max": MAX_RATIO},
        "bytes_k2_vs_k1": two["bytes_vs_k1"] if two else None,
        "met": (two["bytes_vs_k1"] <= MAX_RATIO) if two else None,
    }
    name = "sharded_smoke" if args.smoke else "sharded" if args.device == "cpu" else "sharded_gpu"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / f"{name}.png")
    for run in runs:
        print(
            f"K = {run['k']}: {run['max_rank_bytes_per_param']:.2f} B/param on the largest rank "
            f"({run['bytes_vs_k1']:.3f}x K = 1), update {run['step_s_median']:.2f} s "
            f"({run['step_time_vs_k1']:.2f}x), publication copy {run['publish_s']:.2f} s"
        )
    if two:
        print(
            f"target: K = 2 <= {MAX_RATIO}x K = 1 bytes per rank -> {'met' if result['met'] else 'NOT met'}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
