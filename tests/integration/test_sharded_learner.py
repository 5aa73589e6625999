"""The learner's model sharded over 2 gloo ranks with FSDP2 (learner/sharded.py) on the CPU, against the
one-process learner on the same weights and batches:

- three updates give its weights (within 1e-5, fp32) and the same step statistics, and the publication
  gathered from the shards is byte-identical to the one-process learner's of the same weights;
- the sharded checkpoint (DCP) those ranks wrote resumes in one process (2 -> 1) bit-identically, and
  the next update matches the one-process learner's (so the optimizer's state came back too);
- a one-process checkpoint (HF weights + optimizer.pt) resumes on 2 ranks (1 -> 2), and the next update
  matches the one-process learner's."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from echo2.config import GRPOConfig, LearnerConfig, SamplingConfig
from echo2.errors import CheckpointError
from echo2.learner.sharded import load_full_optimizer, load_states
from echo2.learner.trainer import GRPOTrainer
from echo2.models.policy import DCP_DIR, load_checkpoint
from echo2.models.snapshot import install_weights
from echo2.observe.rundir import OPTIM_FILE
from echo2.types import Trajectory
from echo2.weights.delta import sampler_copy, weights_digest

pytestmark = pytest.mark.integration
GRPO = {"lr": 1e-3, "clip_anchor": "proximal", "num_minibatches": 2}  # both the frozen pass and the update
SAMPLING = SamplingConfig(temperature=0.9, max_new_tokens=12)
LEARNER = LearnerConfig(micro_batch_tokens=40, logprob_chunk=5)
SCRIPT = Path(__file__).with_name("sharded_rank.py")


def _batch(vocab: int, seed: int) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for g in range(4):
        prompt = tuple(rng.randrange(3, vocab) for _ in range(rng.randint(2, 9)))
        for i in range(4):
            n = rng.randint(1, 12)
            out.append(
                Trajectory(f"p{g}", f"s{seed}g{g}", prompt, tuple(rng.randrange(3, vocab) for _ in range(n)),
                           tuple(-rng.uniform(0.5, 4.0) for _ in range(n)), float((i + g) % 3 == 0), 0)
            )  # fmt: skip
    return out


def _trainer(policy) -> GRPOTrainer:
    return GRPOTrainer(policy.model, GRPOConfig(**GRPO), SAMPLING, policy.pad_id, learner=LEARNER)


def _torchrun(mode: str, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPT), mode, str(out), str(out / "batches.json")]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads((out / f"{mode}_rank0.json").read_text())


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float = 1e-5) -> None:
    assert sorted(got) == sorted(want)  # every tensor once, tied ones under their first name
    for name, t in want.items():
        assert float((got[name] - t).abs().max()) <= tol, name


def _same_stats(sharded: list[dict], one: list) -> None:
    for s, want in zip(sharded, one, strict=True):
        assert s["kl"] == pytest.approx(want.kl, rel=1e-4, abs=1e-8)
        assert s["loss"] == pytest.approx(want.loss, rel=1e-4, abs=1e-6)
        assert s["grad_norm"] == pytest.approx(want.grad_norm, rel=1e-4)
        assert s["tokens"] == want.tokens and s["clipfrac"] == pytest.approx(want.clipfrac, abs=1e-6)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Four batches; the 2-rank run of the first three (weights, stats, digest, its DCP checkpoint) and
    the one-process learner's four updates (weights after the third and the fourth)."""
    from conftest import _tiny_policy

    out = tmp_path_factory.mktemp("sharded")
    vocab = _tiny_policy().model.config.vocab_size
    batches = [_batch(vocab, s) for s in range(4)]
    (out / "batches.json").write_text(json.dumps([[dataclasses.asdict(t) for t in b] for b in batches[:3]]))
    (out / "grpo.json").write_text(json.dumps(GRPO))
    sharded = _torchrun("train", out)
    torch.manual_seed(0)
    policy = _tiny_policy()
    trainer = _trainer(policy)
    stats = [trainer.update(b) for b in batches[:3]]
    after3 = sampler_copy(policy.model, "float32")
    trainer.update(batches[3])
    return {"out": out, "batches": batches, "sharded": sharded, "stats": stats, "after3": after3,
            "after4": sampler_copy(policy.model, "float32")}  # fmt: skip


def test_two_ranks_train_as_one_process_and_publish_the_same_bytes(world, tiny_policy_factory):
    assert world["sharded"]["world"] == 2
    got = torch.load(world["out"] / "train_weights.pt", weights_only=True)
    _close(got, world["after3"])
    _same_stats(world["sharded"]["stats"], world["stats"])
    # the publication gathered from the shards is the one-process learner's of the same weights
    same = tiny_policy_factory()
    install_weights(same.model, got)
    assert world["sharded"]["digest"] == weights_digest(sampler_copy(same.model, "bfloat16"))


def test_a_sharded_checkpoint_resumes_in_one_process(world):
    ckpt = world["out"] / "sharded"
    policy = load_checkpoint(ckpt)  # the model built from the checkpoint's config, its states from DCP
    trainer = _trainer(policy)
    load_states(ckpt / DCP_DIR, policy.model, trainer.optimizer)
    got = sampler_copy(policy.model, "float32")
    gathered = torch.load(world["out"] / "train_weights.pt", weights_only=True)
    assert all(torch.equal(got[n], gathered[n]) for n in gathered)  # bit-identical to the ranks' weights
    trainer.update(world["batches"][3])  # the optimizer's moments came back: the next step is the same
    _close(sampler_copy(policy.model, "float32"), world["after4"])
    # with a KL reference (a copy made before the states load): it takes the checkpoint's weights too
    policy = load_checkpoint(ckpt)
    grpo = GRPOConfig(**GRPO, kl_beta=0.1)
    trainer = GRPOTrainer(policy.model, grpo, SAMPLING, policy.pad_id, learner=LEARNER)
    assert trainer.reference is not None
    load_states(ckpt / DCP_DIR, policy.model, trainer.optimizer, trainer.reference)
    reference = sampler_copy(trainer.reference, "float32")
    assert all(torch.equal(reference[n], gathered[n]) for n in gathered)


def test_a_one_process_checkpoint_resumes_on_two_ranks(world, tiny_policy_factory):
    out = world["out"]
    torch.manual_seed(0)
    policy = tiny_policy_factory()
    trainer = _trainer(policy)
    for b in world["batches"][:2]:
        trainer.update(b)
    policy.save(out / "one")
    torch.save(trainer.optimizer.state_dict(), out / "one" / OPTIM_FILE)
    resumed = _torchrun("resume", out)
    _close(torch.load(out / "resume_weights.pt", weights_only=True), world["after3"])
    _same_stats(resumed["stats"], world["stats"][2:])


def test_the_kl_reference_sharded_the_same_way_trains_as_one_process(world, tiny_policy_factory):
    sharded = _torchrun("kl", world["out"])
    torch.manual_seed(0)
    policy = tiny_policy_factory()
    grpo = GRPOConfig(**GRPO, kl_beta=0.1)
    trainer = GRPOTrainer(policy.model, grpo, SAMPLING, policy.pad_id, learner=LEARNER)
    stats = [trainer.update(b) for b in world["batches"][:2]]
    assert stats[-1].kl > 0  # the policy moved away from its reference: the KL term is in the loss
    got = torch.load(world["out"] / "kl_weights.pt", weights_only=True)
    _close(got, sampler_copy(policy.model, "float32"))
    _same_stats(sharded["stats"], stats)


def test_echo2_export_writes_a_plain_hf_checkpoint_of_a_sharded_one(world, tmp_path, capsys):
    from echo2.cli import main

    out = tmp_path / "hf"
    assert main(["export", str(world["out"] / "sharded"), str(out)]) == 0
    assert (out / "model.safetensors").is_file() and not (out / DCP_DIR).exists()
    exported = sampler_copy(load_checkpoint(out).model, "float32")  # plain from_pretrained
    gathered = torch.load(world["out"] / "train_weights.pt", weights_only=True)
    assert all(torch.equal(exported[n], gathered[n]) for n in gathered)
    assert main(["export", str(world["out"] / "sharded"), str(out)]) == 2  # not over an existing one
    assert "is not an empty directory" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "hf2")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bad_sharded_checkpoints_are_named(world, tmp_path, tiny_policy_factory):
    policy = tiny_policy_factory()
    trainer = _trainer(policy)
    with pytest.raises(CheckpointError, match=r"DCP \.metadata is missing"):
        load_states(tmp_path, policy.model, trainer.optimizer)
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(CheckpointError, match="not this model's optimizer"):
        load_full_optimizer(policy.model, trainer.optimizer, other.state_dict())
