"""The GPU check of the vLLM engine: one script, at most 5 minutes, for when a CUDA machine is at hand.

    bash scripts/install-vllm.sh gpu && python benchmarks/engines_gpu.py [--out results/engines_gpu.json]
    python benchmarks/engines_gpu.py --smoke      # the same steps on a tiny shape, on CPU (tests run it)

A random-init model of Qwen3-0.6B's shape (28 layers, width 1024, 16 / 8 heads of 128, vocabulary
151,936, bf16; no download: token ids in, token ids out) served by echo2's vLLM engine:

* start-up seconds (engine construction, CUDA graphs included);
* rollouts/s and tokens/s of ``PROMPTS`` x ``GROUP`` samples of ``TOKENS`` tokens from ``PROMPT_LEN``-token
  prompts, after one warm-up call, against the HF engine on the same GPU and weights;
* the seconds to install a whole version into the running engine, and a patch version end to end
  (apply the lossless patch to the worker's copy, digest it, load it), with the patch's size.

The project does not depend on it: the figures go into docs/engines.md when a run was made.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

QWEN3_06B = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
}
SMOKE = {**QWEN3_06B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}  # fmt: skip
PROMPTS, GROUP, PROMPT_LEN, TOKENS = 32, 8, 64, 256
CALLS = 3


def _model(shape: dict[str, int], device: str, dtype: Any) -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        **shape, max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=1, pad_token_id=0
    )
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3ForCausalLM(config).to(dtype).eval()


def _timed(fn: Any) -> tuple[float, Any]:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU, small batch (tests the script)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "engines_gpu.json")
    args = ap.parse_args()

    import torch

    from echo2.config import SamplingConfig
    from echo2.rollout.engines import EngineOptions, build_engine
    from echo2.rollout.engines.hf import HFEngine
    from echo2.weights.delta import apply_patch, encode_patch, sampler_copy, weights_digest

    cuda = torch.cuda.is_available() and not args.smoke
    shape = SMOKE if args.smoke else QWEN3_06B
    prompts_n, tokens = (4, 8) if args.smoke else (PROMPTS, TOKENS)
    dtype = "bfloat16" if cuda else "float32"
    model = _model(shape, "cuda" if cuda else "cpu", getattr(torch, dtype))
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "shape": shape,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "dtype": dtype,
        "samples": prompts_n * GROUP,
        "prompt_len": PROMPT_LEN,
        "max_new_tokens": tokens,
    }
    sampling = SamplingConfig(max_new_tokens=tokens)
    with tempfile.TemporaryDirectory() as tmp:
        model.config.save_pretrained(tmp)
        opts = EngineOptions(dtype=dtype, memory=0.5, max_context=PROMPT_LEN + tokens + 8)
        res["start_s"], vllm = _timed(lambda: build_engine("vllm", Path(tmp), 1, 0, sampling, opts))
    base = sampler_copy(model, dtype)
    res["install_first_s"], _ = _timed(lambda: vllm.install(base))

    gen = torch.Generator().manual_seed(1)
    vocab = shape["vocab_size"]
    prompts = [torch.randint(2, vocab, (PROMPT_LEN,), generator=gen).tolist() for _ in range(prompts_n)]
    batch = [p for p in prompts for _ in range(GROUP)]
    hf = HFEngine(model, 1, 0, sampling)
    for name, eng in (("vllm", vllm), ("hf", hf)):
        eng.generate(batch, seed=0)  # warm-up
        times, n_tok = [], 0
        for c in range(CALLS):
            dt, out = _timed(lambda eng=eng, c=c: eng.generate(batch, seed=10 + c))
            times.append(dt)
            n_tok += sum(len(s.completion_ids) for s in out)
        res[name] = {"round_s": statistics.median(times), "rollouts_per_s": len(batch) * CALLS / sum(times),
                     "tokens_per_s": n_tok / sum(times)}  # fmt: skip
    res["vllm_over_hf"] = res["vllm"]["rollouts_per_s"] / res["hf"]["rollouts_per_s"]

    new = {}
    for name, t in base.items():  # ~1% of the entries move, as at an LLM-RL learning rate
        hit = torch.rand(t.shape, generator=gen) < 0.01
        new[name] = torch.where(hit, (t.float() * 1.01).to(t.dtype), t)
    t_enc, patch = _timed(lambda: encode_patch(base, new))
    full, chained = [], []
    for _ in range(CALLS):
        full.append(_timed(lambda: vllm.install(base))[0])
        chained.append(_timed(lambda: vllm.install(_built(apply_patch(base, patch), weights_digest)))[0])
    res.update(
        {
            "install_full_s": statistics.median(full),
            "install_patch_s": statistics.median(chained),
            "patch_bytes": len(patch),
            "full_bytes": sum(t.numel() * t.element_size() for t in base.values()),
            "encode_patch_s": t_enc,
        }
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


def _built(tensors: dict[str, Any], digest: Any) -> dict[str, Any]:
    digest(tensors)  # a worker checks the signed result digest before it loads anything
    return tensors


if __name__ == "__main__":
    main()
