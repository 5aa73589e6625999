"""Policy weights <-> the safetensors blob a full snapshot carries, and the skeleton a worker builds from.

A snapshot holds each tensor once: tied parameters (an LM head sharing the embedding matrix) are
sent under their first name only, and re-tied on load. A worker needs no local checkpoint: the learner
serves the model's config and tokenizer files (the skeleton, a few hundred KB for the embedded model),
the worker instantiates the architecture from them, and every weight then arrives in snapshots.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from echo2.errors import CheckpointError
from echo2.weights.delta import encode_full, sampler_copy

log = logging.getLogger(__name__)

SKELETON_MAX_FILE = 64 << 20  # largest single skeleton file served (tokenizer.json of real models ~10 MB)


def snapshot_blob(model: Any) -> bytes:
    """A full fp32 snapshot: safetensors bytes of the model's weights, each storage once (first name
    wins; ``echo2.weights.delta.sampler_copy`` in float32)."""

    return encode_full(sampler_copy(model, "float32"))


def install_weights(model: Any, tensors: Mapping[str, Any]) -> None:
    """Load ``tensors`` (name -> tensor, any float dtype: cast to the model's) into ``model`` in place;
    every parameter must be covered (tied ones through the tensor they share). Checks every name and
    shape before changing anything; raises CheckpointError naming what does not fit."""
    import torch

    own = model.state_dict()
    _check_known(tensors, {n: tuple(t.shape) for n, t in own.items()})
    with torch.no_grad():
        result = model.load_state_dict(tensors, strict=False)
    covered = {n for n, t in own.items() if n in tensors}
    ptrs = {(own[n].untyped_storage().data_ptr(), own[n].storage_offset()) for n in covered}
    missing = [
        n
        for n in result.missing_keys
        if (own[n].untyped_storage().data_ptr(), own[n].storage_offset()) not in ptrs
    ]
    if missing:
        raise CheckpointError(f"snapshot lacks weights for {missing[:5]}")


class _Cast:
    """The parametrization :func:`aliasing_model` registers (built lazily: this module imports no torch)."""

    cls: Any = None

    @classmethod
    def make(cls, dtype: Any) -> Any:
        if cls.cls is None:
            import torch

            class Cast(torch.nn.Module):
                """The stored tensor (the publication dtype) read in the compute dtype at each use."""

                def __init__(self, dtype: torch.dtype) -> None:
                    super().__init__()
                    self.dtype = dtype

                def forward(self, x: torch.Tensor) -> torch.Tensor:
                    return x.to(self.dtype)

            cls.cls = Cast
        return cls.cls(dtype)


@dataclass
class _Aliases:
    """What :func:`alias_weights` needs of an aliasing model."""

    device: Any  # where the model computes
    shapes: dict[str, tuple[int, ...]]  # shipped name -> shape of every weight a snapshot carries
    slots: dict[str, list[Any]]  # shipped parameter name -> the parametrizations reading it
    buffers: dict[str, Any]  # shipped buffer name -> the buffer (copied into, as install_weights does)


def empty_model(config: Any, dtype: Any = None) -> Any:
    """The causal LM of ``config`` with its parameters on the meta device (no memory, no random init) and
    its buffers real, on the CPU (a rotary embedding's frequencies, which no checkpoint carries), tied
    parameters tied: what a loader fills (``learner/sharded.py``) or an aliasing model points at
    (:func:`aliasing_model`). ``dtype``: the parameters' (default float32)."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    model.tie_weights()  # the meta parameters were registered anew, each on its own
    return model


def aliasing_model(model: Any, dtype: str = "float32") -> Any:
    """A model of ``model``'s architecture (built as a worker builds its engine's: from the config, then
    cast whole to ``dtype``, the engines' compute dtype) whose floating parameters own no memory: each
    is a parametrization that reads, at every use, the tensor :func:`alias_weights` gave it, cast to
    ``dtype``. So a version's weights in the publication dtype (the sampler copies the learner keeps
    anyway) are loaded without a copy on the same device, and the model computes what an engine in
    ``dtype`` holding the same (rounded) values computes: the worker's (a bf16 engine checked in
    float32 differed 18.6x more at the median: adversary.py --study bf16_errors). Built from the config
    with its parameters on the meta device (:func:`empty_model`): no full-precision twin is ever
    allocated (at 8B a float32 random init would be 33 GB of host memory); its buffers go to
    ``model``'s device in ``dtype``, as a worker's whole-model cast puts them; tied parameters stay
    tied (one tensor read by two modules)."""
    import torch
    from torch.nn.utils import parametrize

    device = next(model.parameters()).device
    compute = getattr(torch, dtype)
    twin = empty_model(model.config).eval()
    twin.requires_grad_(False)
    for module in twin.modules():  # the buffers as `.to(device, compute)` of a whole model leaves them
        for key, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[key] = buf.to(device, compute if buf.is_floating_point() else buf.dtype)
    first: dict[int, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    slots: dict[str, list[Any]] = {}
    placeholders: dict[int, Any] = {}
    for name, param in list(twin.named_parameters(remove_duplicate=False)):
        shipped = first.setdefault(id(param), name)
        shapes[shipped] = tuple(param.shape)
        module_name, _, attr = name.rpartition(".")
        module = twin.get_submodule(module_name)
        empty = placeholders.setdefault(
            id(param), torch.nn.Parameter(torch.empty(0, device=device, dtype=compute), requires_grad=False)
        )
        delattr(module, attr)
        module.register_parameter(attr, empty)  # tied parameters share one placeholder
        parametrize.register_parametrization(module, attr, _Cast.make(compute), unsafe=True)
        slots.setdefault(shipped, []).append(module.parametrizations[attr])
    buffers = {
        n: b
        for n, b in twin.state_dict(keep_vars=True).items()
        if n not in shapes and ".parametrizations." not in n
    }
    for name, b in buffers.items():
        shapes[name] = tuple(b.shape)
    twin._echo2_aliases = _Aliases(device, shapes, slots, buffers)
    return twin


def alias_weights(twin: Any, tensors: Mapping[str, Any]) -> None:
    """Point an :func:`aliasing_model`'s parameters at ``tensors`` (a whole snapshot: name -> tensor,
    tied ones once; any float dtype): no copy when a tensor is already on the model's device. Checks
    every name and shape first and raises CheckpointError naming what does not fit."""
    import torch

    aliases: _Aliases = twin._echo2_aliases
    check_snapshot({n: t for n, t in tensors.items()}, aliases.shapes)
    with torch.no_grad():
        for name, buf in aliases.buffers.items():
            buf.copy_(tensors[name])
        for name, parametrizations in aliases.slots.items():
            shared = torch.nn.Parameter(tensors[name].to(aliases.device), requires_grad=False)
            for plist in parametrizations:
                plist.original = shared


def load_for_check(model: Any, tensors: Mapping[str, Any]) -> None:
    """Load a version into a model the generation check runs: aliased (:func:`aliasing_model`) or copied
    into a plain model (:func:`install_weights`)."""
    if hasattr(model, "_echo2_aliases"):
        alias_weights(model, tensors)
    else:
        install_weights(model, tensors)


def _check_known(tensors: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Every tensor of ``tensors`` names a weight of ``shapes`` and has its shape (CheckpointError)."""
    unknown = sorted(set(tensors) - set(shapes))
    if unknown:
        raise CheckpointError(f"snapshot has tensors the model lacks: {unknown[:5]}")
    for name, t in tensors.items():
        if shapes[name] != tuple(t.shape):
            raise CheckpointError(f"snapshot tensor {name} has shape {tuple(t.shape)}, model {shapes[name]}")


def check_snapshot(tensors: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """``tensors`` is a whole snapshot of a model whose weights have ``shapes`` (one entry per weight a
    snapshot carries, tied ones once: :func:`snapshot_layout`): nothing unknown, nothing missing, every
    shape right. Raises CheckpointError naming what does not fit, before anything is loaded."""
    _check_known(tensors, shapes)
    missing = sorted(set(shapes) - set(tensors))
    if missing:
        raise CheckpointError(f"snapshot lacks weights for {missing[:5]}")


@dataclass(frozen=True)
class SnapshotLayout:
    """The weights a snapshot of an architecture carries, and the tied names it leaves out."""

    shapes: dict[str, tuple[int, ...]]  # name -> shape of every weight a snapshot carries
    ties: dict[str, str]  # tied name left out (e.g. ``lm_head.weight``) -> the name it ships under

    def untied(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """``tensors`` with every tied name added back (the same tensor), for loaders that expect each
        checkpoint name (vLLM's in-place reload re-creates parameters and so loses ties)."""
        return {**tensors, **{alias: tensors[name] for alias, name in self.ties.items() if name in tensors}}


def snapshot_layout(where: Path) -> SnapshotLayout:
    """The :class:`SnapshotLayout` of the skeleton's architecture, from a weightless instance on the meta
    device (tied parameters once, under their first name, as ``weights.delta.sampler_copy`` ships them)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(where, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes: dict[str, tuple[int, ...]] = {}
    first: dict[int, str] = {}
    ties: dict[str, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():  # the parameter objects: tied ones repeat
        if id(t) in first:
            ties[name] = first[id(t)]
        else:
            first[id(t)] = name
            shapes[name] = tuple(t.shape)
    return SnapshotLayout(shapes, ties)


def skeleton_files(policy_source: str | Path, model: Any, tokenizer: Any, out: Path) -> dict[str, str]:
    """Write the model config and tokenizer files (no weights) to ``out``; return name -> text."""
    out.mkdir(parents=True, exist_ok=True)
    if not getattr(model.config, "architectures", None):  # a model never saved yet: engines dispatch on it
        model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    files = {}
    for p in sorted(out.iterdir()):
        if p.is_file() and p.stat().st_size <= SKELETON_MAX_FILE:
            files[p.name] = p.read_text()
    return files


def write_skeleton(files: dict[str, str], where: Path) -> None:
    """Write skeleton files (from :func:`skeleton_files`, as a peer sent them) into ``where``."""
    where.mkdir(parents=True, exist_ok=True)
    if "config.json" not in files:
        raise CheckpointError("skeleton has no config.json")
    for name, text in files.items():
        if "/" in name or "\\" in name or name.startswith("."):
            raise CheckpointError(f"skeleton file name {name!r} is not a plain file name")
        (where / name).write_text(text)


def tokenizer_from_skeleton(where: Path) -> Any:
    """The tokenizer of a skeleton directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(where, local_files_only=True)


def model_from_skeleton(where: Path) -> Any:
    """The architecture of a skeleton directory's ``config.json`` with untrained weights, to be filled
    by :func:`install_weights`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(where, local_files_only=True)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
