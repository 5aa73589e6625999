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

What is not built here: launching ranks from ``echo2 learner`` (rank 0 as the node, the others
following its updates) and the KL reference of a sharded model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def shard(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """``model`` (an HF causal LM) wrapped in place with FSDP2 on ``mesh``: each decoder layer, then the
    root; gradients summed over ranks. Returns the model."""
    from torch.distributed.fsdp import fully_shard

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers to shard (model.get_decoder().layers)")
    for module in [*layers, model]:
        fsdp = fully_shard(module, mesh=mesh)
        fsdp.set_gradient_divide_factor(1.0)  # a sum: each rank's loss is its share of the whole
        fsdp.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def full_weights(model: torch.nn.Module, dtype: str = "bfloat16") -> dict[str, torch.Tensor] | None:
    """The weights of a sharded model as ``sampler_copy`` makes them (each storage once, detached, on
    the CPU, floating tensors in ``dtype``), gathered tensor by tensor; on rank 0, None elsewhere. Every
    rank must call it (the gathers are collectives)."""
    from torch.distributed.tensor import DTensor

    from echo2.weights.delta import _publish_dtypes

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

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path), no_dist=_unsharded())


def load_states(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The states :func:`save_states` wrote at any world size, into ``model`` and ``optimizer`` as this
    process holds them (sharded over this world, or whole); every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from echo2.errors import CheckpointError

    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path} is not a sharded checkpoint: its DCP .metadata is missing")
    model_sd, optim_sd = get_state_dict(model, optimizer)  # the optimizer's state initialised (zeros)
    state = {"model": model_sd, "optim": optim_sd}
    try:
        dcp.load(state, checkpoint_id=str(path), no_dist=_unsharded())
    except Exception as exc:  # DCP raises its own types (CheckpointException); name the checkpoint
        raise CheckpointError(f"cannot load the sharded checkpoint {path}: {exc}") from exc
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


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
