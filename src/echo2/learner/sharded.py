"""The learner's model sharded over ranks with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each decoder layer and then the whole model are wrapped with ``fully_shard`` on a 1-D device mesh
(``cpu`` with the gloo backend, ``cuda`` with NCCL): every rank holds a shard of the parameters, their
gradients and the AdamW states, and a layer's full parameters exist only while it computes. Gradients
are **summed** over ranks (``set_gradient_divide_factor(1.0)``), because each rank's loss is already its
share of the whole minibatch's (``grpo.Norm`` over the minibatch): so the sharded update equals the
one-process update (``GRPOTrainer`` splits the micro-batches over the ranks and keeps their
collectives in step, ``learner/trainer.py``). Gradient clipping over DTensors takes the global norm.

Publication from shards (:func:`full_weights`): every tensor is gathered (``DTensor.full_tensor``, a
collective all ranks call in the same order) one at a time, cast to the publication dtype and kept on
rank 0 only, so no rank holds two full fp32 copies; tied parameters ship once, under their first name,
as ``weights.delta.sampler_copy`` ships a one-process model's. The bytes are then the one-process
learner's for the same weights.

Sharded checkpoints (:func:`save_states` / :func:`load_states`): the model's and the optimizer's
states written with ``torch.distributed.checkpoint`` (DCP, each rank its own shards, rank 0 the
metadata) into a checkpoint's ``dcp/`` folder beside the config and tokenizer files
(:func:`write_shell`); DCP reshards on load, so such a checkpoint resumes at any world size, one process
without a process group included. The other way, a one-process checkpoint (HF weights +
``optimizer.pt``) resumes sharded: the weights load whole and are sharded, and the optimizer's state,
keyed by parameter position, is re-keyed by name and sharded (:func:`load_full_optimizer`).

The ranks of one learner (:class:`Ranks`): ``torchrun``'s environment names them, rank 0 is the
learner node (API, store, broadcast, checks, run directory) and announces each collective operation on
the model before it does it (an update, an evaluation, a publication's gather, a checkpoint's states);
the other ranks wait for the announcement and do the same (``runtime/core.py``: ``Follower``). Every
collective runs under a stated timeout (``learner.collective_timeout_s``); while rank 0 waits for
workers it announces nothing, so it sends an empty announcement every quarter of that timeout.

The KL reference (``grpo.kl_beta > 0``) is a frozen copy (``trainer.frozen_reference``) sharded the
same way; resumed from a sharded checkpoint it takes that checkpoint's weights
(:func:`load_states`), as a one-process learner's reference is the weights it loaded.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Ranks:
    """This process's place among the learner's ranks (one rank: ``world`` = 1, no process group)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    timeout_s: float = 600.0
    last_announced: float = field(default_factory=time.monotonic)

    @classmethod
    def from_env(cls, device_type: str, timeout_s: float) -> Ranks:
        """The ranks ``torchrun`` started (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR`` /
        ``MASTER_PORT``): the process group initialised, gloo on the CPU and NCCL on CUDA, every
        collective bounded by ``timeout_s``; one rank when ``WORLD_SIZE`` is unset or 1."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls(timeout_s=timeout_s)
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device_type == "cuda":
            torch.cuda.set_device(local)
        if not dist.is_initialized():
            backend = "nccl" if device_type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        return cls(dist.get_rank(), dist.get_world_size(), local, timeout_s)

    @property
    def sharded(self) -> bool:
        return self.world > 1

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def mesh(self, device_type: str) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.world,))

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (what the others pass is ignored)."""
        if not self.sharded:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def announce(self, op: str, *args: Any) -> None:
        """Rank 0: the collective operation it is about to do (the other ranks do it too)."""
        if self.sharded:
            self.share((op, args))
            self.last_announced = time.monotonic()

    def receive(self) -> tuple[str, tuple[Any, ...]]:
        """A rank other than 0: the next operation rank 0 announced."""
        op, args = self.share(None)
        return str(op), tuple(args)

    def keepalive(self) -> None:
        """Rank 0 while it waits: an empty announcement every quarter of the collective timeout, so the
        other ranks, waiting for the next one, do not time out while workers generate."""
        if self.sharded and time.monotonic() - self.last_announced > self.timeout_s / 4:
            self.announce("noop")

    def close(self) -> None:
        """The process group ends on every rank together (a rank tearing its connections down while
        another still talks to it can abort the other's process)."""
        if self.sharded and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def shard(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """``model`` (an HF causal LM) wrapped in place with FSDP2 on ``mesh``: each decoder layer, then the
    root; gradients summed over ranks. Returns the model."""
    from torch.distributed.fsdp import fully_shard

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers to shard (model.get_decoder().layers)")
    if not getattr(model.config, "architectures", None):  # sharding renames the class (FSDP<name>)
        model.config.architectures = [type(model).__name__]
    for module in [*layers, model]:
        fsdp = fully_shard(module, mesh=mesh)
        fsdp.set_gradient_divide_factor(1.0)  # a sum: each rank's loss is its share of the whole
        fsdp.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    return model


def settle(model: torch.nn.Module) -> None:
    """Every parameter of a sharded model back in its sharded form (the root keeps what its forward
    gathered until a backward; a forward without one, an evaluation, leaves it gathered): what the
    optimizer and the state-dict functions expect. Nothing for a model that is not sharded."""
    reshard = getattr(model, "reshard", None)
    if callable(reshard) and is_sharded(model):
        reshard()


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def full_weights(model: torch.nn.Module, dtype: str = "bfloat16") -> dict[str, torch.Tensor] | None:
    """The weights of a sharded model as ``sampler_copy`` makes them (each storage once, detached, on
    the CPU, floating tensors in ``dtype``), gathered tensor by tensor; on rank 0, None elsewhere. Every
    rank must call it (the gathers are collectives)."""
    from torch.distributed.tensor import DTensor

    from echo2.weights.delta import _publish_dtypes

    settle(model)
    target = _publish_dtypes()[dtype]
    rank0 = dist.get_rank() == 0
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if id(t) in seen:  # a tied parameter: shipped under its first name
                continue
            seen.add(id(t))
            full = t.full_tensor() if isinstance(t, DTensor) else t
            if rank0:
                cast = target if full.is_floating_point() else full.dtype
                out[name] = full.detach().to(device="cpu", dtype=cast, copy=True).contiguous()
            del full
    return out if rank0 else None


def _unsharded() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def save_states(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The model's and the optimizer's states into ``path`` with DCP; every rank calls it (each writes
    its own shards; rank 0 writes the metadata last, after every rank's files)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    settle(model)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path), no_dist=_unsharded())


def load_states(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    reference: torch.nn.Module | None = None,
) -> None:
    """The states :func:`save_states` wrote at any world size, into ``model`` and ``optimizer`` as this
    process holds them (sharded over this world, or whole), and the model's weights into ``reference``
    (a frozen KL reference, in its own dtype) when given; every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    settle(model)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # the optimizer's state initialised (zeros)
    state = _read(path, {"model": model_sd, "optim": optim_sd})
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if reference is not None:
        load_model_states(path, reference)


def load_model_states(path: Path, model: torch.nn.Module) -> None:
    """Only the model's weights of a checkpoint :func:`save_states` wrote, into ``model`` in its own
    dtype (a KL reference; a model to export as a plain HF checkpoint); every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    settle(model)
    set_model_state_dict(model, _read(path, {"model": get_model_state_dict(model)})["model"])


def _read(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (state dicts shaped as this process holds them) filled in place from the DCP checkpoint
    at ``path``; CheckpointError naming the checkpoint when it is none or does not fit."""
    import torch.distributed.checkpoint as dcp

    from echo2.errors import CheckpointError

    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path} is not a sharded checkpoint: its DCP .metadata is missing")
    try:
        dcp.load(state, checkpoint_id=str(path), no_dist=_unsharded())
    except Exception as exc:  # DCP raises its own types (CheckpointException); name the checkpoint
        raise CheckpointError(f"cannot load the sharded checkpoint {path}: {exc}") from exc
    return state


def write_shell(path: Path, policy: Any) -> None:
    """A sharded checkpoint's files besides ``dcp/`` (rank 0): the model's config and generation config
    and the tokenizer, so that the model is rebuilt from them before its states are loaded."""
    path.mkdir(parents=True, exist_ok=True)
    policy.model.config.save_pretrained(path)
    generation = getattr(policy.model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(path)
    policy.tokenizer.save_pretrained(path)


def load_full_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, full: dict[str, Any]
) -> None:
    """A one-process optimizer's ``state_dict()`` (``optimizer.pt``: states keyed by the position of
    each trainable parameter in ``model.parameters()``) into ``optimizer`` over ``model`` as this
    process holds it, sharded or whole: re-keyed by parameter name, then loaded as a full state dict
    (each rank keeps its shard)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    from echo2.errors import CheckpointError

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    groups = full.get("param_groups", [])
    if sum(len(g["params"]) for g in groups) != len(names):
        raise CheckpointError(
            f"optimizer state for {sum(len(g['params']) for g in groups)} parameters, "
            f"the model trains {len(names)}: not this model's optimizer"
        )
    state = {names[i]: v for i, v in full.get("state", {}).items()}
    by_name = [{**g, "params": [names[i] for i in g["params"]]} for g in groups]
    set_optimizer_state_dict(
        model,
        optimizer,
        {"state": state, "param_groups": by_name},
        options=StateDictOptions(full_state_dict=True),
    )
