"""One rank of the sharded-learner tests (torchrun starts two), the tiny model sharded with FSDP2 over a
CPU mesh (gloo):

- ``train OUT BATCHES``: three updates on the batches every rank is given, the full weights gathered
  for publication (rank 0 saves them and their digest), then a sharded checkpoint in ``OUT/sharded``;
- ``resume OUT BATCHES``: the one-process checkpoint ``OUT/one`` (HF weights + ``optimizer.pt``)
  loaded as the learner loads it (the model on the meta device, each rank its shard, rank 0 reading
  the weights and the optimizer's state and sending them), one update on the last batch, the full
  weights gathered (rank 0 saves them);
- ``kl OUT BATCHES``: as ``train`` with ``grpo.kl_beta = 0.1`` and the KL reference sharded from the
  start (``sharded_reference``), two updates (no checkpoint)."""

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
from echo2.errors import ConfigError
from echo2.learner import sharded
from echo2.learner.sharded import (
    full_weights,
    leave,
    load_from_rank0,
    load_full_optimizer,
    materialize,
    save_states,
    shard,
    sharded_reference,
    write_shell,
)
from echo2.learner.trainer import GRPOTrainer
from echo2.models.policy import DCP_DIR, load_checkpoint
from echo2.models.snapshot import empty_model
from echo2.observe.rundir import OPTIM_FILE
from echo2.types import Trajectory
from echo2.weights.delta import weights_digest

LEARNER = LearnerConfig(micro_batch_tokens=40, logprob_chunk=5)
SAMPLING = SamplingConfig(temperature=0.9, max_new_tokens=12)


def main(mode: str, out: Path, batches_file: Path) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    grpo = GRPOConfig(**json.loads((batches_file.parent / "grpo.json").read_text()))
    batches = [[_trajectory(t) for t in b] for b in json.loads(batches_file.read_text())]
    torch.manual_seed(0)
    rank0 = dist.get_rank() == 0
    reference = None
    if mode == "resume":  # as the learner loads it: meta device, shards, rank 0 reads and sends
        sharded.LOAD_CHUNK_BYTES = 4096  # many pieces per tensor (the tiny model's are under 4 MiB)
        policy = load_checkpoint(out / "one", weights=False)
        model = materialize(policy.model, mesh, torch.device("cpu"))
        load_from_rank0(model, out / "one" if rank0 else None)
    else:
        policy = _tiny_policy()
        model = shard(policy.model, mesh)
    if mode == "kl":
        grpo = grpo.model_copy(update={"kl_beta": 0.1})
        reference = sharded_reference(model, empty_model(model.config), False, mesh)
        batches = batches[:2]
    try:  # without a reference sharded the same way: refused in one line, not half-built
        GRPOTrainer(model, grpo.model_copy(update={"kl_beta": 0.1}), SAMPLING, policy.pad_id, learner=LEARNER)
        raise AssertionError("kl_beta > 0 was accepted by a sharded trainer without a sharded reference")
    except ConfigError as exc:
        assert "kl_beta" in str(exc)
    trainer = GRPOTrainer(model, grpo, SAMPLING, policy.pad_id, learner=LEARNER, reference=reference)
    assert trainer.parts is not None  # the LM head at completion positions only, sharded too
    assert reference is None or trainer.reference_parts is not None
    if mode == "resume":
        full = torch.load(out / "one" / OPTIM_FILE, weights_only=True, mmap=True) if rank0 else None
        load_full_optimizer(model, trainer.optimizer, full)
        batches = batches[-1:]
    stats = []
    for batch in batches:
        s = trainer.update(batch)
        stats.append({"loss": s.loss, "grad_norm": s.grad_norm, "tokens": s.tokens, "clipfrac": s.clipfrac,
                      "kl": s.kl})  # fmt: skip
    fp32 = full_weights(model, "float32")
    bf16 = full_weights(model, "bfloat16")
    if mode == "train":
        if dist.get_rank() == 0:
            write_shell(out / "sharded", policy)
        save_states(out / "sharded" / DCP_DIR, model, trainer.optimizer)
    if dist.get_rank() == 0:
        assert fp32 is not None and bf16 is not None
        torch.save(fp32, out / f"{mode}_weights.pt")
        (out / f"{mode}_rank0.json").write_text(
            json.dumps({"stats": stats, "digest": weights_digest(bf16), "world": dist.get_world_size()})
        )
    dist.barrier()  # every rank done talking before any tears its connections down
    dist.destroy_process_group()


def _trajectory(t: dict) -> Trajectory:
    tuples = ("prompt_ids", "completion_ids", "sampler_logprobs", "turn_mask")
    return Trajectory(**{k: tuple(v) if k in tuples else v for k, v in t.items()})


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))  # an error: its traceback and exit 1, as ever
    leave(0)  # every result written and the group destroyed
