"""Policy weights <-> the safetensors blob a snapshot carries, and the skeleton a worker builds from.

A snapshot holds each tensor once: tied parameters (an LM head sharing the embedding matrix) are
sent under their first name only, and re-tied on load. A worker needs no local checkpoint: the learner
serves the model's config and tokenizer files (the skeleton, a few hundred KB for the embedded model),
the worker instantiates the architecture from them, and every weight then arrives in snapshots.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from echo2.errors import CheckpointError

log = logging.getLogger(__name__)

SKELETON_MAX_FILE = 64 << 20  # largest single skeleton file served (tokenizer.json of real models ~10 MB)


def snapshot_blob(model: Any) -> bytes:
    """safetensors bytes of the model's weights, each storage once (first name wins)."""
    from safetensors.torch import save

    seen: set[tuple[int, int]] = set()
    tensors = {}
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = t.detach().contiguous().cpu()
    return save(tensors)


def install_blob(model: Any, blob: bytes | bytearray | memoryview) -> None:
    """Load snapshot weights into ``model`` in place; every parameter must be covered (tied ones
    through the tensor they share). Raises CheckpointError naming what does not fit."""
    import torch
    from safetensors.torch import load

    tensors = load(bytes(blob))
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
    by :func:`install_blob`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(where, local_files_only=True)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
