"""Run by tests/integration/test_vllm_engine.py in a subprocess (vLLM binds threads and memory for the
whole process): the vLLM and HF engines on the same weights of a tiny embedded policy. Prints one JSON
object of measurements; the test holds them to its thresholds."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from echo2.config import EmbeddedModelConfig, SamplingConfig
from echo2.errors import CheckpointError
from echo2.learner.grpo import token_logprobs
from echo2.models.embedded import build_model, build_tokenizer
from echo2.models.snapshot import skeleton_files
from echo2.rollout.engines import EngineOptions, build_engine
from echo2.rollout.engines.hf import HFEngine
from echo2.weights.delta import sampler_copy

# head_dim 32: vLLM's CPU attention has no kernel for 16
SHAPE = EmbeddedModelConfig(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=2, num_kv_heads=1)


def compare(a, b) -> dict:
    same = [x.completion_ids == y.completion_ids for x, y in zip(a, b, strict=True)]
    errs = [
        abs(p - q)
        for x, y, s in zip(a, b, same, strict=True)
        if s
        for p, q in zip(x.logprobs, y.logprobs, strict=True)
    ]
    finished = all(x.finished == y.finished for x, y, s in zip(a, b, same, strict=True) if s)
    return {"same": sum(same), "n": len(same), "max_err": max(errs, default=None), "finished_agree": finished}


def main() -> None:
    tok = build_tokenizer()
    old, new = build_model(SHAPE, tok, seed=1), build_model(SHAPE, tok, seed=2)
    prompts = [tok(f"{i}+{3 * i % 17}=", add_special_tokens=False)["input_ids"] for i in range(48)]
    rows, firsts = list(range(5, 53)), [i % 3 for i in range(48)]
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        skeleton_files("probe", old, tok, Path(tmp))
        sampling = SamplingConfig(max_new_tokens=12)
        opts = EngineOptions(max_context=128)
        vllm = build_engine("vllm", Path(tmp), tok.eos_token_id, tok.pad_token_id, sampling, opts)
    vllm.install(sampler_copy(old, "float32"))

    def pair(model, sampling, **kw):
        vllm.sampling = sampling
        hf = HFEngine(model, tok.eos_token_id, tok.pad_token_id, sampling)
        return vllm.generate(prompts, **kw), hf.generate(prompts, **kw)

    s1 = SamplingConfig(max_new_tokens=12)
    out["sampled"] = compare(*pair(old, s1, seed=11, rows=rows, first_steps=firsts))
    s2 = SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=12)
    v, h = pair(old, s2, seed=12)
    out["tempered"] = compare(v, h)
    recompute = []  # the learner's own log-probs of the vLLM completions (grpo.token_logprobs)
    for p, s in zip(prompts, v, strict=True):
        with torch.no_grad():
            logits = old(input_ids=torch.tensor([p + list(s.completion_ids)])).logits[:, len(p) - 1 : -1]
        lp = token_logprobs(logits, torch.tensor([s.completion_ids]), 0.7)[0]
        recompute += [abs(a - b) for a, b in zip(lp.tolist(), s.logprobs, strict=True)]
    out["learner_recompute_max_err"] = max(recompute)
    out["greedy"] = compare(*pair(old, s1, seed=0, greedy=True))
    out["distinct_seeds_differ"] = vllm.generate(prompts, seed=1) != vllm.generate(prompts, seed=2)

    vllm.install(sampler_copy(new, "float32"))  # a new version into the running engine
    out["after_install"] = compare(*pair(new, s1, seed=13))
    out["install_s"] = vllm.last_install_s
    refused = {}
    good = sampler_copy(old, "float32")
    missing = {k: t for k, t in good.items() if k != "model.norm.weight"}
    reshaped = {**good, "model.norm.weight": torch.ones(7)}
    unknown = {**good, "extra.w": torch.ones(2)}
    for name, bad in (("missing", missing), ("reshaped", reshaped), ("unknown", unknown)):
        try:
            vllm.install(bad)
            refused[name] = ""
        except CheckpointError as exc:
            refused[name] = str(exc)
    out["refused"] = refused

    real_rpc = vllm.llm.collective_rpc

    def half_then_fail(method, kwargs):  # vLLM loads half of a version, then fails (once)
        vllm.llm.collective_rpc = real_rpc
        named = kwargs["weights_iterator"]
        real_rpc(method, kwargs={"weights_iterator": named[: len(named) // 2]})
        raise RuntimeError("device lost")

    vllm.llm.collective_rpc = half_then_fail
    try:
        vllm.install(sampler_copy(old, "float32"))
        out["partial_failure"] = ""
    except CheckpointError as exc:
        out["partial_failure"] = str(exc)
    finally:
        vllm.llm.collective_rpc = real_rpc
    out["still_new_after_refusals"] = compare(*pair(new, s1, seed=14))
    print("PROBE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
