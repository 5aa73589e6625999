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

What is not built here: launching ranks from ``echo2 learner`` (rank 0 as the node, the others
following its updates), sharded DCP checkpoints, and the KL reference of a sharded model.
"""

from __future__ import annotations

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
