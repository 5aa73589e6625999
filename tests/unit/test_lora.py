"""LoRA on the learner (models/lora.py): only the adapter trains, the KL reference is the base with the
adapter off, checkpoints hold the adapter pinned to its base by digest, export merges; bad input gets
one clear line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from echo2.config import Config, GRPOConfig, LoRAConfig, SamplingConfig
from echo2.errors import CheckpointError, ConfigError
from echo2.learner.logprobs import completion_logprobs, pack
from echo2.learner.trainer import GRPOTrainer
from echo2.models import lora
from echo2.models.policy import load_checkpoint
from echo2.types import Trajectory

SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=8)
LORA = LoRAConfig(enabled=True, r=4, alpha=8.0)


def _batch(policy, rewards):
    prompt = tuple(policy.encode_prompt("1+1="))
    return [
        Trajectory(
            prompt_id="1+1",
            group_id=f"g{i // 4}",
            prompt_ids=prompt,
            completion_ids=(5 + i % 3, policy.eos_id),
            sampler_logprobs=(-1.0, -1.0),
            reward=r,
            policy_version=0,
        )
        for i, r in enumerate(rewards)
    ]


def _logprobs(model, trajs):
    batch = pack(trajs, [[1.0] * len(t.completion_ids) for t in trajs], 0)
    with torch.no_grad():
        return completion_logprobs(model, batch, 1.0)


def test_only_the_adapter_trains_and_the_kl_reference_is_the_base_alone(tiny_policy):
    """An update with kl_beta > 0 moves the adapter and nothing of the base; the reference is the model
    itself (no copy), and its log-probs are the base's bit for bit, before and after the update."""
    model = tiny_policy.model
    trajs = _batch(tiny_policy, [1, 0, 0, 1, 0, 1, 1, 0])
    base_lp = _logprobs(model, trajs)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora.attach(model, LORA)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if ".lora_" in n)
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-2, kl_beta=0.1), SAMPLING, tiny_policy.pad_id)
    assert trainer.reference is model  # no second model
    for _ in range(3):
        trainer.update(trajs)
    after = dict(model.named_parameters())
    for name, before in base.items():  # the base, under its wrapped name, untouched
        live = after.get(name) if name in after else after[name.replace(".weight", ".base_layer.weight")]
        assert torch.equal(live, before), name
    assert not torch.equal(_logprobs(model, trajs), base_lp)  # the adapter learned something
    batch = pack(trajs, [[1.0] * 2 for _ in trajs], 0)
    assert torch.equal(trainer.logprobs(batch, reference=True).detach(), base_lp)


def test_bf16_mixed_keeps_the_frozen_base_in_bf16_and_the_adapter_in_fp32(tiny_policy):
    model = tiny_policy.model
    lora.attach(model, LORA, "bf16-mixed")
    kinds = {(".lora_" in n, p.dtype) for n, p in model.named_parameters()}
    assert kinds == {(True, torch.float32), (False, torch.bfloat16)}
    from echo2.config import LearnerConfig

    mixed = LearnerConfig(precision="bf16-mixed")
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-2), SAMPLING, tiny_policy.pad_id, learner=mixed)
    stats = trainer.update(_batch(tiny_policy, [1, 0, 0, 1]))
    assert stats.version == 1 and stats.grad_norm > 0


def test_a_module_list_or_a_rank_that_does_not_fit_is_one_clear_line(tiny_policy):
    with pytest.raises(ConfigError, match=r"lora.target_modules: \['qkv'\] name no linear layer.*q_proj"):
        lora.attach(tiny_policy.model, LoRAConfig(enabled=True, target_modules=["q_proj", "qkv"]))
    with pytest.raises(ConfigError, match=r"lora.r = 4096 exceeds the smallest dimension"):
        lora.attach(tiny_policy.model, LoRAConfig(enabled=True, r=4096))
    with pytest.raises(ConfigError, match="not a transformers model PEFT can wrap"):
        lora.attach(torch.nn.Sequential(torch.nn.Linear(4, 4)), LORA)
    assert not lora.has_adapter(tiny_policy.model)  # nothing attached by a refused attempt


def _lora_checkpoint(policy, base_dir: Path, out: Path) -> Path:
    """A LoRA checkpoint of ``policy`` over the base saved at ``base_dir``, its adapter made non-zero."""
    policy.save(base_dir)
    policy.lora_base = {"path": str(base_dir), "sha256": lora.base_digest(policy.model)}
    lora.attach(policy.model, LORA)
    with torch.no_grad():
        for n, p in policy.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    policy.save(out)
    return out


def test_a_lora_checkpoint_holds_the_adapter_pinned_to_its_base_and_exports_merged(tiny_policy, tmp_path):
    trajs = _batch(tiny_policy, [1, 0, 0, 1])
    ckpt = _lora_checkpoint(tiny_policy, tmp_path / "base", tmp_path / "ckpt")
    assert not (ckpt / "model.safetensors").exists()  # the adapter alone, not the base again
    assert json.loads((ckpt / lora.BASE_FILE).read_text())["path"] == str(tmp_path / "base")
    back = load_checkpoint(ckpt)
    assert back.lora_base == tiny_policy.lora_base
    assert torch.equal(_logprobs(back.model, trajs), _logprobs(tiny_policy.model, trajs))
    from echo2.cli import main

    assert main(["export", str(ckpt), str(tmp_path / "merged")]) == 0
    merged = load_checkpoint(tmp_path / "merged")
    assert merged.lora_base is None and not (tmp_path / "merged" / lora.ADAPTER_CONFIG).exists()
    assert torch.allclose(_logprobs(merged.model, trajs), _logprobs(tiny_policy.model, trajs), atol=1e-4)
    base = load_checkpoint(tmp_path / "base")
    assert not torch.allclose(_logprobs(merged.model, trajs), _logprobs(base.model, trajs), atol=1e-3)


def test_an_adapter_over_another_base_is_refused(tiny_policy, tmp_path):
    ckpt = _lora_checkpoint(tiny_policy, tmp_path / "base", tmp_path / "ckpt")
    other = load_checkpoint(tmp_path / "base")
    with torch.no_grad():
        other.model.get_input_embeddings().weight.add_(0.01)
    other.save(tmp_path / "base")  # the base changed under the adapter
    with pytest.raises(CheckpointError, match="another base; an adapter only fits its own"):
        load_checkpoint(ckpt)
    (ckpt / lora.BASE_FILE).write_text("{}")
    with pytest.raises(CheckpointError, match=r"without a readable base\.json"):
        load_checkpoint(ckpt)


def test_the_learner_refuses_mixing_lora_and_full_checkpoints(tiny_policy, tmp_path):
    """Resuming a LoRA checkpoint without [lora], or with another adapter shape, or a full fine-tuning
    checkpoint as LoRA, and a LoRA run on the distributed learner: each one clear line."""
    from echo2.learner.sharded import Ranks
    from echo2.runtime.core import Plane

    ckpt = _lora_checkpoint(tiny_policy, tmp_path / "base", tmp_path / "ckpt")
    (ckpt / "trainer_state.json").write_text('{"version": 3}')
    one = Ranks()
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match=r"is a LoRA checkpoint .*lora\.enabled = true"):
        Plane.load(Config(), one, cpu, ckpt, True, False)
    wrong = Config.model_validate({"lora": {"enabled": True, "r": 8, "alpha": 8.0}})
    with pytest.raises(ConfigError, match=r"\[lora\] asks for .*'r': 8"):
        Plane.load(wrong, one, cpu, ckpt, True, False)
    right = Config.model_validate({"lora": LORA.model_dump()})
    plane = Plane.load(right, one, cpu, ckpt, True, False)
    assert plane.trainer.version == 3 and lora.has_adapter(plane.policy.model)
    with pytest.raises(ConfigError, match="full fine-tuning: it cannot resume as LoRA"):
        Plane.load(right, one, cpu, tmp_path / "base", True, False)
    with pytest.raises(ConfigError, match=r"lora\.enabled on a sharded learner is not built"):
        Plane.load(right, Ranks(world=2), cpu, tmp_path / "base", False, False)


def test_the_distributed_node_says_adapter_publication_is_not_built():
    from echo2.runtime.learner import AsyncLearner

    with pytest.raises(ConfigError, match="publishing adapters to workers is not built yet"):
        AsyncLearner(Config.model_validate({"lora": {"enabled": True}}))
