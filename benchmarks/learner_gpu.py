"""The GPU check of the learner: one script, at most 5 minutes on one H200, for when a CUDA machine is here.

    python benchmarks/learner_gpu.py [--out results/learner_gpu.json]
    python benchmarks/learner_gpu.py --smoke --out /tmp/x.json   # the same steps on a tiny shape, on CPU (CI)

A random-init model of Qwen3-1.7B's shape (28 layers, width 2,048, 16 / 8 heads of 128, vocabulary
151,936; no download) trained by echo2's learner (``GRPOTrainer``, ``[learner] precision =
"bf16-mixed"``: fp32 master weights, gradients and AdamW states, bf16 autocast compute):

* step time and tokens/s of full updates of R = 256 rows (64-token prompts, 512-token completions), after
  one warm-up update, in micro-batches of ``MICRO_BATCH_TOKENS``;
* model FLOPs utilisation, MFU = 6 * N_params * tokens / (update seconds * peak dense bf16 FLOP/s) (SPEC §9;
  ``PEAK_BF16`` by device name, an H200 / H100 SXM: 989 TFLOP/s);
* peak GPU memory (``torch.cuda.max_memory_allocated``) against the memory model (``planner/memory.py``:
  the device's bytes per parameter, one micro-batch's activations and the LM head's chunk);
* the HF engine generating on the same GPU with the trained weights (bf16): tokens/s of 64 x 256 tokens.

Targets (SPEC §9, fixed before a run): MFU >= 35%, peak memory within 15% of the model. The project does
not depend on it: the figures go into docs/learner.md when a run was made.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from echo2_bench.synthetic import SHAPE_SMOKE, batch, build  # noqa: E402

QWEN3_17B = {
    "hidden": 2048,
    "intermediate": 6144,
    "layers": 28,
    "heads": 16,
    "kv_heads": 8,
    "head_dim": 128,
    "vocab": 151936,
}
SMOKE = SHAPE_SMOKE
ROWS, PROMPT, COMPLETION, UPDATES = 256, 64, 512, 3
SMOKE_ROWS, SMOKE_PROMPT, SMOKE_COMPLETION = 16, 8, 16
MICRO_BATCH_TOKENS = 16384
PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "RTX 4090": 165e12,
    "RTX 5090": 210e12,
}
MIN_MFU, MEMORY_WITHIN = 0.35, 0.15
GEN_PROMPTS, GEN_TOKENS = 64, 256


def peak_flops(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def run(smoke: bool) -> dict[str, Any]:
    import torch

    from echo2.config import GRPOConfig, LearnerConfig, SamplingConfig
    from echo2.learner.trainer import GRPOTrainer
    from echo2.planner.memory import ModelShape, learner_memory, logits_chunk_bytes
    from echo2.rollout.engines.hf import HFEngine

    shape = SMOKE if smoke else QWEN3_17B
    rows, prompt, completion = (
        (SMOKE_ROWS, SMOKE_PROMPT, SMOKE_COMPLETION) if smoke else (ROWS, PROMPT, COMPLETION)
    )
    device = torch.device("cpu" if smoke else "cuda")
    name = "cpu (smoke)" if smoke else torch.cuda.get_device_name(0)
    model = build(shape).to(device)
    params = sum(p.numel() for p in model.parameters())
    learner = LearnerConfig(device=device.type, precision="bf16-mixed", micro_batch_tokens=MICRO_BATCH_TOKENS)
    sampling = SamplingConfig(max_new_tokens=completion)
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-6), sampling, 0, learner=learner)
    trainer.update(batch(shape["vocab"], rows, prompt, completion, seed=0))  # warm-up; AdamW states
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(UPDATES):
        trajs = batch(shape["vocab"], rows, prompt, completion, seed=i + 1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(trainer.update(trajs).t_train_s)  # the update ends on a host read of its loss
    tokens = rows * (prompt + completion)
    step_s = sorted(times)[len(times) // 2]
    peak = peak_flops(name)
    mfu = None if peak is None else 6 * params * tokens / (step_s * peak)
    mshape = ModelShape.qwen3(
        **{
            k: shape[k]
            for k in ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab")
        },
        tied=True,
    )
    mem = learner_memory(mshape, "bf16-mixed", checks=False, gpu=True)
    micro_tokens = min(MICRO_BATCH_TOKENS // (prompt + completion), rows) * (prompt + completion)
    model_bytes = mem.device_bytes(
        params, micro_tokens, logits_chunk_bytes(shape["vocab"], learner.logprob_chunk)
    )
    measured = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    # the HF engine on the same device, on the trained weights in bf16
    engine_model = build(shape).to(device=device, dtype=torch.bfloat16)
    engine_model.load_state_dict(model.state_dict())
    engine = HFEngine(engine_model, 1, 0, SamplingConfig(max_new_tokens=GEN_TOKENS if not smoke else 8))
    gen_prompts = [
        [3 + (i * 7 + j) % (shape["vocab"] - 3) for j in range(32)]
        for i in range(GEN_PROMPTS if not smoke else 4)
    ]
    engine.generate(gen_prompts[:2], seed=0, max_new_tokens=4)  # warm-up
    t0 = time.perf_counter()
    samples = engine.generate(gen_prompts, seed=1)
    gen_s = time.perf_counter() - t0
    gen_tokens = sum(len(s.completion_ids) for s in samples)
    out = {
        "device": name,
        "smoke": smoke,
        "params": params,
        "rows": rows,
        "tokens_per_update": tokens,
        "micro_batch_tokens": MICRO_BATCH_TOKENS,
        "update_s": times,
        "step_s_median": step_s,
        "tokens_per_s": tokens / step_s,
        "mfu": mfu,
        "peak_memory_bytes": measured,
        "model_memory_bytes": model_bytes,
        "memory_vs_model": None if measured is None else measured / model_bytes - 1,
        "engine_tokens_per_s": gen_tokens / gen_s,
        "engine_tokens": gen_tokens,
    }
    out["met"] = (
        None
        if smoke
        else {
            "mfu": mfu is not None and mfu >= MIN_MFU,
            "memory": out["memory_vs_model"] is not None and abs(out["memory_vs_model"]) <= MEMORY_WITHIN,
        }
    )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU: checks the script runs")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "learner_gpu.json")
    a = p.parse_args()
    if not a.smoke:
        import torch

        if not torch.cuda.is_available():
            print("learner_gpu.py: no CUDA device here; --smoke runs the steps on the CPU", file=sys.stderr)
            return 2
    result = run(a.smoke)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
