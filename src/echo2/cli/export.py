"""`echo2 export CHECKPOINT OUT`: a plain HF checkpoint (``save_pretrained``: config, safetensors weights,
tokenizer) of any echo2 checkpoint, a sharded learner's (DCP) and a LoRA one (the adapter merged into
its base) included, in one process (module imports
stay stdlib-only)."""

from __future__ import annotations

import argparse
from pathlib import Path

from echo2.cli.common import Command
from echo2.errors import ConfigError


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint directory (runs/<run>/checkpoints/step_NNNNNN)")
    p.add_argument("out", help="where to write the HF checkpoint (a new or empty directory)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the weights' dtype (default float32, as the learner keeps them)")  # fmt: skip


def _run(args: argparse.Namespace) -> int:
    import torch

    from echo2.learner.sharded import load_model_states
    from echo2.models.policy import DCP_DIR, load_checkpoint

    src, out = Path(args.checkpoint).expanduser(), Path(args.out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty directory: choose a new one")
    policy = load_checkpoint(src)  # a LoRA checkpoint: its recorded base, checked by digest, + adapter
    if (src / DCP_DIR).is_dir():  # a sharded learner's: the weights from its DCP states, whole here
        load_model_states(src / DCP_DIR, policy.model)
    if policy.lora_base is not None:  # the adapter folded into its base: a plain HF model
        from echo2.models.lora import merged_weights

        merged = merged_weights(policy.model)
        policy = load_checkpoint(policy.lora_base["path"])
        policy.model.load_state_dict(merged, strict=True)
    policy.model.to(getattr(torch, args.dtype))
    policy.save(out)
    params = sum(p.numel() for p in policy.model.parameters())
    print(f"wrote {out}: {params / 1e6:.1f}M parameters in {args.dtype} (load it with from_pretrained)")
    return 0


EXPORT = Command(
    help="a plain HF checkpoint (save_pretrained) of an echo2 checkpoint (a sharded or LoRA one too)",
    add_arguments=_add_arguments,
    run=_run,
)
