"""Policy weights <-> the safetensors blob a full snapshot carries, and the skeleton a worker builds from.

A snapshot holds each tensor once: tied parameters (an LM head sharing the embedding matrix) are
sent under their first name only, and re-tied on load. A worker needs no local checkpoint: the learner
serves the model's config and tokenizer files (the skeleton, a few hundred KB for the embedded model),
the worker instantiates the architecture from them, and every weight then arrives in snapshots.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from echo2.errors import CheckpointError

log = logging.getLogger(__name__)

SKELETON_MAX_FILE = 64 << 20  # largest single skeleton file served (tokenizer.json of real models ~10 MB)


def snapshot_blob(model: Any) -> bytes:
    """A full fp32 snapshot: safetensors bytes of the model's weights, each storage once (first name
    wins; ``echo2.models.delta.sampler_copy`` in float32)."""
    from echo2.models.delta import encode_full, sampler_copy

    return encode_full(sampler_copy(model, "float32"))


def install_weights(model: Any, tensors: Mapping[str, Any]) -> None:
    """Load ``tensors`` (name -> tensor, any float dtype: cast to the model's) into ``model`` in place;
    every parameter must be covered (tied ones through the tensor they share). Checks every name and
    shape before changing anything; raises CheckpointError naming what does not fit."""
    import torch

    own = model.state_dict()
    unknown = sorted(set(tensors) - set(own))
    if unknown:
        raise CheckpointError(f"snapshot has tensors the model lacks: {unknown[:5]}")
    for name, t in tensors.items():
        if own[name].shape != t.shape:
            raise CheckpointError(
                f"snapshot tensor {name} has shape {tuple(t.shape)}, model {tuple(own[name].shape)}"
            )
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


def skeleton_files(policy_source: str | Path, model: Any, tokenizer: Any, out: Path) -> dict[str, str]:
    """Write the model config and tokenizer files (no weights) to ``out``; return name -> text."""
    out.mkdir(parents=True, exist_ok=True)
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
