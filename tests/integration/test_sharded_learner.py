"""The learner's model sharded over 2 gloo ranks with FSDP2 (learner/sharded.py) on the CPU: three
updates from the same weights and batches give the one-process learner's weights (within 1e-5, fp32),
and the publication gathered from the shards is byte-identical to the one-process learner's of the
same weights (the same digest)."""

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
from echo2.learner.trainer import GRPOTrainer
from echo2.models.snapshot import install_weights
from echo2.types import Trajectory
from echo2.weights.delta import sampler_copy, weights_digest

pytestmark = pytest.mark.integration
GRPO = {"lr": 1e-3, "clip_anchor": "proximal", "num_minibatches": 2}  # both the frozen pass and the update


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


def test_two_ranks_train_as_one_process_and_publish_the_same_bytes(tiny_policy_factory, tmp_path):
    vocab = tiny_policy_factory().model.config.vocab_size
    batches = [_batch(vocab, s) for s in range(3)]
    (tmp_path / "batches.json").write_text(json.dumps([[dataclasses.asdict(t) for t in b] for b in batches]))
    (tmp_path / "grpo.json").write_text(json.dumps(GRPO))
    script = Path(__file__).with_name("sharded_rank.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), str(tmp_path), str(tmp_path / "batches.json")]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    sharded = json.loads((tmp_path / "rank0.json").read_text())
    assert sharded["world"] == 2
    # the same three updates in one process
    torch.manual_seed(0)
    policy = tiny_policy_factory()
    sampling = SamplingConfig(temperature=0.9, max_new_tokens=12)
    learner = LearnerConfig(micro_batch_tokens=40, logprob_chunk=5)
    trainer = GRPOTrainer(policy.model, GRPOConfig(**GRPO), sampling, policy.pad_id, learner=learner)
    stats = [trainer.update(b) for b in batches]
    one = sampler_copy(policy.model, "float32")
    got = torch.load(tmp_path / "weights.pt", weights_only=True)
    assert sorted(got) == sorted(one)  # every tensor once, tied ones under their first name
    for name, t in one.items():
        assert float((got[name] - t).abs().max()) <= 1e-5, name
    for s, want in zip(sharded["stats"], stats, strict=True):
        assert s["loss"] == pytest.approx(want.loss, rel=1e-4, abs=1e-6)
        assert s["grad_norm"] == pytest.approx(want.grad_norm, rel=1e-4)
        assert s["tokens"] == want.tokens and s["clipfrac"] == pytest.approx(want.clipfrac, abs=1e-6)
    # the publication gathered from the shards is the one-process learner's of the same weights
    same = tiny_policy_factory()
    install_weights(same.model, got)
    assert sharded["digest"] == weights_digest(sampler_copy(same.model, "bfloat16"))
