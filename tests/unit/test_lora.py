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


def test_a_bf16_base_loads_as_stored_under_bf16_mixed_with_the_same_pinned_digest(tiny_policy, tmp_path):
    """A LoRA learner under bf16-mixed loads a bf16 checkpoint without a float32 copy of the base; the
    digest its checkpoints pin is the one a float32 load gives, so either load resumes them; a float32
    checkpoint still loads in float32."""
    from echo2.learner.sharded import Ranks
    from echo2.models.policy import stored_float_dtypes
    from echo2.runtime.core import Plane

    fp32_dir, bf16_dir = tmp_path / "fp32", tmp_path / "bf16"
    tiny_policy.save(fp32_dir)
    tiny_policy.model.to(torch.bfloat16)
    tiny_policy.save(bf16_dir)
    assert stored_float_dtypes(bf16_dir) == {"BF16"} and stored_float_dtypes(fp32_dir) == {"F32"}
    as_stored = load_checkpoint(bf16_dir, keep_bf16=True)
    widened = load_checkpoint(bf16_dir)
    assert {p.dtype for p in as_stored.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in widened.model.parameters()} == {torch.float32}
    assert lora.base_digest(as_stored.model) == lora.base_digest(widened.model)
    assert {p.dtype for p in load_checkpoint(fp32_dir, keep_bf16=True).model.parameters()} == {torch.float32}

    mixed = Config.model_validate({"lora": LORA.model_dump(), "learner": {"precision": "bf16-mixed"}})
    plane = Plane.load(mixed, Ranks(), torch.device("cpu"), bf16_dir, False, False)
    frozen = {p.dtype for n, p in plane.policy.model.named_parameters() if not p.requires_grad}
    trained = {p.dtype for n, p in plane.policy.model.named_parameters() if p.requires_grad}
    assert frozen == {torch.bfloat16} and trained == {torch.float32}
    assert plane.policy.lora_base["sha256"] == lora.base_digest(widened.model)
    (bf16_dir / "broken.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match=r"broken\.safetensors is not a readable safetensors file"):
        load_checkpoint(bf16_dir, keep_bf16=True)


def _trained_adapter(policy):
    """``policy`` with an adapter whose B is non-zero (as after training), and the run's scale."""
    lora.attach(policy.model, LORA)
    with torch.no_grad():
        for n, p in policy.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    return lora.lora_scale(LORA)


def test_a_published_adapter_expands_to_the_same_bytes_on_every_machine(tiny_policy):
    """merge_published is exact in float64: the same bytes at 1 and 2 threads and for a tensor laid out
    otherwise; it is base + scale x B @ A rounded once; an adapter that does not fit is refused."""
    scale = _trained_adapter(tiny_policy)
    base = lora.PublishedBase.of(tiny_policy.model, "bfloat16", scale)
    adapter = lora.adapter_copy(tiny_policy.model)
    assert set(base.tensors) == set(sampler_copy_names(tiny_policy.model))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = base.expand(adapter)
        torch.set_num_threads(2)
        two = base.expand({n: t.t().contiguous().t() for n, t in adapter.items()})
    finally:
        torch.set_num_threads(threads)
    assert set(one) == set(base.tensors) and all(torch.equal(one[n], two[n]) for n in one)
    name = "model.layers.0.self_attn.q_proj.weight"
    stem = name[: -len(".weight")]
    a, b = adapter[stem + lora.LORA_A].double(), adapter[stem + lora.LORA_B].double()
    want = (base.tensors[name].double() + scale * b @ a).to(torch.bfloat16)
    assert torch.equal(one[name], want) and not torch.equal(one[name], base.tensors[name])
    k = "model.layers.0.mlp.down_proj.lora_B.default.weight"
    with pytest.raises(CheckpointError, match="do not fit the base"):
        base.expand({**adapter, k: adapter[k][:, :2]})
    with pytest.raises(CheckpointError, match="no LoRA pair"):
        base.expand({**adapter, "model.norm.weight": torch.ones(3)})


def sampler_copy_names(model):
    from echo2.weights.delta import sampler_copy

    return [n.replace(".base_layer.", ".") for n in sampler_copy(model) if ".lora_" not in n]


def test_the_check_reruns_base_plus_adapter_as_the_workers_engine_does(tiny_policy, tiny_policy_factory):
    """A worker's HF engine installs published adapters through AdapterEngine; the learner's check keeps
    the adapters and expands them the same way: honest completions pass with no error beyond batching,
    completions of another adapter are forgeries."""
    import copy
    import random

    from echo2.check.rerun import GenerationCheck
    from echo2.config import SecurityConfig
    from echo2.data.store import Lease
    from echo2.data.submission import Rejected, Submission
    from echo2.models.snapshot import aliasing_model
    from echo2.rollout.engines import AdapterEngine
    from echo2.rollout.engines.hf import HFEngine
    from echo2.types import Prompt

    sampling = SamplingConfig(temperature=1.0, top_p=0.95, max_new_tokens=8)
    scale = _trained_adapter(tiny_policy)
    base = lora.PublishedBase.of(tiny_policy.model, "bfloat16", scale)
    v1 = lora.adapter_copy(tiny_policy.model)
    v2 = {n: t + 0.2 * torch.randn_like(t.float()).to(t.dtype) for n, t in v1.items()}
    plain = tiny_policy_factory()  # a worker's engine model: the architecture alone
    slot = lora.BaseSlot(base.digest, scale)
    slot.fill(base.tensors)
    engine = AdapterEngine(HFEngine(plain.model, plain.eos_id, plain.pad_id, sampling), slot)
    check = GenerationCheck(
        aliasing_model(tiny_policy.model), sampling, SecurityConfig(), random.Random(0), expand=base.expand
    )
    check.keep(1, v1)
    check.keep(2, v2)
    prompts = [Prompt(f"p{i}", f"{i}+{i}=", str(2 * i)) for i in range(3)]
    encoded = [tiny_policy.encode_prompt(p.text) for p in prompts]

    def submission(adapter, version):
        engine.install(adapter)
        samples = engine.generate([ids for ids in encoded for _ in range(4)], seed=99)
        groups = tuple(
            tuple(
                Trajectory(
                    prompts[i].prompt_id,
                    f"L:{i}",
                    tuple(encoded[i]),
                    s.completion_ids,
                    s.logprobs,
                    0.0,
                    version,
                )
                for s in samples[i * 4 : i * 4 + 4]
            )
            for i in range(3)
        )
        return Lease("L", "w", "open", 0.0, prompts, 99, version), Submission("L", version, groups)

    every = [(i, j) for i in range(3) for j in range(4)]
    lease, honest = submission(v1, 1)
    verdicts = check.check(lease, honest, every)
    assert all(v.misses == 0 for v in verdicts) and max(v.max_logprob_error for v in verdicts) < 1e-3
    lease, other = submission(v2, 1)  # sampled with v2's adapter, claimed as v1
    with pytest.raises(Rejected, match=r"not version 1's seeded draw|log-probs are off"):
        check.check(lease, copy.deepcopy(other), every)
    assert check.held_bytes() <= sum(t.nbytes for t in v1.values())  # an undo of an adapter, not a model


def test_the_base_rides_the_first_link_and_a_worker_refuses_another_base(tiny_policy, tmp_path):
    """The learner's first publication carries the frozen base (a signed ``base`` link); a worker that
    holds no base gets it first in the chain and its engine then loads base + adapter; one that holds it
    (``base=1``) gets the same version's adapter alone. The follower installs only links whose signed
    lineage pins the base it holds, and refuses (an install failure) a base link whose base is not the
    pinned one; an adapter before any base is a gap the chain over HTTP fills, not a refusal. A worker
    holding the base checkpoint (``--lora-base``) fills its slot from it, never from the chain; another
    checkpoint there ends its setup."""
    import asyncio

    from echo2.broadcast.factory import get_strategy, open_publisher
    from echo2.errors import Echo2Error
    from echo2.protocol import LoraSettings
    from echo2.rollout.engines import AdapterEngine
    from echo2.rollout.follower import WeightFollower
    from echo2.rollout.worker import RolloutWorker, WorkerCounters, WorkerOptions
    from echo2.runtime.snapshots import Snapshots
    from echo2.weights.chain import decode_chain, encode_chain, verified_links
    from echo2.weights.manifest import new_signing_key

    tiny_policy.save(tmp_path / "base")  # the base checkpoint, as the worker's machine holds it
    scale = _trained_adapter(tiny_policy)
    base = lora.PublishedBase.of(tiny_policy.model, "bfloat16", scale)

    class Engine:
        loaded = None

        def install(self, weights):
            self.loaded = weights

    def follower(slot, counters, key):
        engine = AdapterEngine(Engine(), slot)
        f = WeightFollower(
            None, engine, key.verifier(), None, "w0", counters, finished=lambda: True,
            model_base=slot.digest, base=slot,
        )  # type: ignore[arg-type]  # fmt: skip
        return f, engine.engine

    async def publications(model_base: str):
        key = new_signing_key()
        snaps = Snapshots(
            open_publisher("memory", key, get_strategy("star-limited"), 4096),
            1.1,
            model_base=model_base,
            frozen=base.tensors,
        )
        for v in range(2):
            with torch.no_grad():
                for name, p in tiny_policy.model.named_parameters():
                    if "lora_B" in name:
                        p.add_(0.01)
            await snaps.publish_copy(v, lambda dtype: lora.adapter_copy(tiny_policy.model, dtype))
        await snaps.close()

        def chain(held: bool):
            body = encode_chain([(k.manifest, k.blob) for k in snaps.chain_from(-1, held)])
            return verified_links(decode_chain(body), key.verifier())

        return key, snaps, chain

    async def go() -> None:
        key, _, chain = await publications(base.digest)
        first, twin = chain(False)[0], chain(True)[0]
        assert [m.kind for m, _ in chain(False)] == ["base", "patch"]
        assert (first[0].version, twin[0].version, twin[0].kind) == (0, 0, "full")
        assert twin[0].lineage.weights_digest == first[0].lineage.weights_digest
        assert len(twin[1]) < len(first[1]) // 4  # the adapter alone
        counters = WorkerCounters()
        empty = lora.BaseSlot(base.digest, scale)
        f, engine = follower(empty, counters, key)
        assert f._install(chain(False)) and empty.held is not None and empty.held.digest == base.digest
        newest = lora.adapter_copy(tiny_policy.model)
        assert all(torch.equal(t, base.expand(newest)[n]) for n, t in engine.loaded.items())
        # no base yet: an adapter alone (a late joiner's broadcast) is a gap, not a refusal; the chain fills
        late = lora.BaseSlot(base.digest, scale)
        f, _ = follower(late, counters, key)
        assert not f._install(chain(True)) and counters.install_failures == 0 and late.held is None
        assert f._install(chain(False)) and late.held is not None and f.installed == 1
        f, _ = follower(lora.BaseSlot("ab" * 32, scale), counters, key)  # links pin another base
        assert not f._install(chain(False)) and counters.install_failures == 1
        key, _, lying = await publications("cd" * 32)  # a base link whose base is not the one it pins
        f, _ = follower(lora.BaseSlot("cd" * 32, scale), counters, key)
        assert not f._install(lying(False)) and counters.install_failures == 2

        worker = RolloutWorker.__new__(RolloutWorker)
        worker.opts = WorkerOptions("https://learner.invalid", "t")  # the base comes with the chain
        assert (await worker._lora_base(LoraSettings(scale=scale, base_digest=base.digest))).held is None
        worker.opts = WorkerOptions("https://learner.invalid", "t", lora_base=tmp_path / "base")
        local = await worker._lora_base(LoraSettings(scale=scale, base_digest=base.digest))
        assert local.held.digest == base.digest and local.held.tensors.keys() == base.tensors.keys()
        other = load_checkpoint(tmp_path / "base")
        with torch.no_grad():
            other.model.get_input_embeddings().weight.add_(0.01)
        other.save(tmp_path / "base")  # another base where the worker looks
        with pytest.raises(Echo2Error, match=r"--lora-base, as bfloat16\) digests to .*another base"):
            await worker._lora_base(LoraSettings(scale=scale, base_digest=base.digest))

    asyncio.run(go())
