"""Random-init Qwen3-shaped models and synthetic GRPO batches for the learner's benchmarks (no download)."""

from __future__ import annotations

from typing import Any

# Qwen3-style shapes the learner's benchmarks share (random init, tied embeddings)
SHAPE_235M = {"hidden": 1024, "intermediate": 3072, "layers": 16, "heads": 16, "kv_heads": 8, "head_dim": 64,
              "vocab": 32768}  # fmt: skip
SHAPE_55M = {"hidden": 512, "intermediate": 1536, "layers": 12, "heads": 8, "kv_heads": 4, "head_dim": 64,
             "vocab": 32768}  # fmt: skip
SHAPE_SMOKE = {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 2, "kv_heads": 1, "head_dim": 32,
               "vocab": 512}  # fmt: skip


def config_of(shape: dict[str, int]) -> Any:
    """The Qwen3 config of ``shape`` (tied embeddings)."""
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"], max_position_embeddings=4096,
        tie_word_embeddings=True, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    config.architectures = ["Qwen3ForCausalLM"]
    return config


def build(shape: dict[str, int], seed: int = 0, device: str = "cpu") -> Any:
    """A random-init fp32 Qwen3 of ``shape``, initialised on ``device`` (a GPU inits billions of
    parameters in a moment)."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        return Qwen3ForCausalLM(config_of(shape)).float()


def batch(vocab: int, rows: int, prompt: int, completion: int, seed: int, group: int = 8) -> list[Any]:
    import random

    from echo2.types import Trajectory

    rng = random.Random(seed)
    out = []
    for g in range(rows // group):
        p = tuple(rng.randrange(3, vocab) for _ in range(prompt))
        for i in range(group):
            out.append(
                Trajectory(
                    prompt_id=f"p{g}", group_id=f"s{seed}g{g}", prompt_ids=p,
                    completion_ids=tuple(rng.randrange(3, vocab) for _ in range(completion)),
                    sampler_logprobs=tuple(-rng.uniform(5.0, 12.0) for _ in range(completion)),
                    reward=float((g + i) % 3 == 0), policy_version=0,
                )
            )  # fmt: skip
    return out
