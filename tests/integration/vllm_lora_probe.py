"""Run by tests/integration/test_vllm_engine.py in a subprocess (vLLM binds threads and memory for the
whole process): a vLLM engine serving a LoRA run's adapters natively (``enable_lora``, a LoRA request
per version) against the HF engine on the merged weights the learner's check runs
(``PublishedBase.expand``), through ``AdapterEngine`` as a worker uses it. Prints one JSON object of
measurements; the test holds them to its thresholds."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from vllm_probe import SHAPE, compare

from echo2.config import LoRAConfig, SamplingConfig
from echo2.errors import CheckpointError
from echo2.models import lora
from echo2.models.embedded import build_model, build_tokenizer
from echo2.models.snapshot import skeleton_files
from echo2.rollout.engines import AdapterEngine, EngineOptions, build_engine
from echo2.rollout.engines.hf import HFEngine

RANK = 4  # below vLLM's smallest LoRA slot above 1 (8): the engine reserves 8


def main() -> None:
    tok = build_tokenizer()
    model = build_model(SHAPE, tok, seed=1)
    prompts = [tok(f"{i}+{3 * i % 17}=", add_special_tokens=False)["input_ids"] for i in range(48)]
    sampling = SamplingConfig(max_new_tokens=12)
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        skeleton_files("probe", model, tok, Path(tmp))
        opts = EngineOptions(max_context=128, lora_rank=RANK)
        vllm = build_engine("vllm", Path(tmp), tok.eos_token_id, tok.pad_token_id, sampling, opts)
    cfg = LoRAConfig(enabled=True, r=RANK, alpha=8.0)
    lora.attach(model, cfg, "fp32")
    base = lora.PublishedBase.of(model, "bfloat16", lora.lora_scale(cfg), "float32")  # lora.vllm = native
    slot = lora.BaseSlot(base.digest, base.scale, base.merged_dtype)
    slot.fill(base.tensors)
    engine = AdapterEngine(vllm, slot)
    out["native"] = engine.native
    plain = build_model(SHAPE, tok, seed=1)

    def version(seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        return lora.adapter_copy(model, "bfloat16")

    def against_merged(adapter: dict, seed: int) -> dict:
        merged = {k: t.float() for k, t in base.expand(adapter).items()}
        plain.load_state_dict(merged, strict=False)
        hf = HFEngine(plain, tok.eos_token_id, tok.pad_token_id, sampling)
        return compare(engine.generate(prompts, seed=seed), hf.generate(prompts, seed=seed))

    v1, v2 = version(1), version(2)
    engine.install(v1)
    out["v1"] = against_merged(v1, 11)
    out["v1_install_s"] = vllm.last_install_s
    engine.install(v2)  # the next version swapped in between generations
    out["v2"] = against_merged(v2, 12)
    out["v2_install_s"] = vllm.last_install_s
    base_only = build_model(SHAPE, tok, seed=1)
    base_only.load_state_dict({k: t.float() for k, t in base.tensors.items()}, strict=False)
    hf_base = HFEngine(base_only, tok.eos_token_id, tok.pad_token_id, sampling)
    out["base_only_same"] = compare(engine.generate(prompts, seed=12), hf_base.generate(prompts, seed=12))[
        "same"
    ]
    bad = {k: t[:, :-1] if "lora_A" in k else t for k, t in v1.items()}  # an adapter that does not fit
    try:
        engine.install(bad)
        out["refused"] = ""
    except CheckpointError as exc:
        out["refused"] = str(exc)
    out["still_v2"] = against_merged(v2, 13)
    print("PROBE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
