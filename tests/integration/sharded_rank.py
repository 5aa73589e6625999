"""One rank of the sharded-learner test (torchrun starts two): the tiny model sharded with FSDP2 over a
CPU mesh (gloo), three updates on the batches the test gives every rank, then the full weights
gathered for publication; rank 0 saves them and their digest."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the fixtures' model

from conftest import _tiny_policy
from echo2.config import GRPOConfig, LearnerConfig, SamplingConfig
from echo2.learner.sharded import full_weights, shard
from echo2.learner.trainer import GRPOTrainer
from echo2.types import Trajectory
from echo2.weights.delta import weights_digest


def main(out: Path, batches: Path) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    policy = _tiny_policy()
    model = shard(policy.model, init_device_mesh("cpu", (dist.get_world_size(),)))
    grpo = GRPOConfig(**json.loads((batches.parent / "grpo.json").read_text()))
    trainer = GRPOTrainer(model, grpo, SamplingConfig(temperature=0.9, max_new_tokens=12), policy.pad_id,
                          learner=LearnerConfig(micro_batch_tokens=40, logprob_chunk=5))  # fmt: skip
    stats = []
    for batch in json.loads(batches.read_text()):
        s = trainer.update([_trajectory(t) for t in batch])
        stats.append({"loss": s.loss, "grad_norm": s.grad_norm, "tokens": s.tokens, "clipfrac": s.clipfrac})
    fp32 = full_weights(model, "float32")
    bf16 = full_weights(model, "bfloat16")
    if dist.get_rank() == 0:
        assert fp32 is not None and bf16 is not None
        torch.save(fp32, out / "weights.pt")
        (out / "rank0.json").write_text(
            json.dumps({"stats": stats, "digest": weights_digest(bf16), "world": dist.get_world_size()})
        )
    dist.destroy_process_group()


def _trajectory(t: dict) -> Trajectory:
    tuples = ("prompt_ids", "completion_ids", "sampler_logprobs", "turn_mask")
    return Trajectory(**{k: tuple(v) if k in tuples else v for k, v in t.items()})


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
