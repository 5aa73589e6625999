"""Loading a policy (model + tokenizer) from a local HF checkpoint directory. Loading never trains.

The embedded default goes through the same function: its warm-started checkpoint is an ordinary
``save_pretrained`` directory (safetensors), so the code path a user's real checkpoint takes is the
one every test exercises. Which checkpoint a run starts from (the user's, or the embedded model's
warm start, trained first when it is not cached) is the learner side's decision:
``echo2.learner.warmstart.starting_checkpoint``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from echo2.config import Config
from echo2.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TextCodec:
    """Prompt text -> token ids and completion ids -> text, the way every plane agrees on: what a
    worker needs of a model besides its engine."""

    tokenizer: Any  # transformers tokenizer
    chat_template: bool  # wrap prompts with the tokenizer's chat template

    def encode_prompt(self, text: str) -> list[int]:
        if self.chat_template:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode_completion(self, ids: tuple[int, ...] | list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


@dataclass
class Policy:
    """A causal LM with its tokenizer and the token conventions the planes agree on."""

    model: Any  # transformers *ForCausalLM
    tokenizer: Any  # transformers tokenizer
    eos_id: int  # token that ends a completion
    pad_id: int  # token used for padding (never trained on)
    chat_template: bool  # wrap prompts with the tokenizer's chat template
    source: str  # the checkpoint directory it was loaded from

    @property
    def codec(self) -> TextCodec:
        return TextCodec(self.tokenizer, self.chat_template)

    def encode_prompt(self, text: str) -> list[int]:
        return self.codec.encode_prompt(text)

    def decode_completion(self, ids: tuple[int, ...] | list[int]) -> str:
        return self.codec.decode_completion(ids)

    def save(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)


def configure_torch(cfg: Config) -> None:
    """Process-wide torch settings of a run: intra-op threads (see ``train.threads``) and the seed."""
    import torch

    threads = cfg.train.resolved_threads(embedded=cfg.model.path is None)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)


def resolve_device(spec: str, field: str = "learner.device") -> Any:
    """The ``torch.device`` a device setting names (``auto``: the first CUDA device when this torch
    sees one, else the CPU); ConfigError when it names a device this machine lacks."""
    import torch

    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{field} = {spec!r}, but this torch ({torch.__version__}) sees no CUDA device; "
                "use cpu or auto"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"{field} = {spec!r}, but this machine has {torch.cuda.device_count()} CUDA devices"
            )
    return device


def load_checkpoint(path: str | Path, chat_template: bool = False) -> Policy:
    """Model + tokenizer from a local directory; CheckpointError says what is missing or broken."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no per-load / per-save weight bars in our logs
    p = Path(path).expanduser()
    if not p.is_dir():
        raise CheckpointError(f"checkpoint directory {p} does not exist")
    if not (p / "config.json").is_file():
        raise CheckpointError(f"{p} is not an HF checkpoint: config.json is missing")
    try:
        tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except Exception as exc:  # transformers raises many types; the user needs the path and the cause
        raise CheckpointError(f"cannot load a tokenizer from {p}: {exc}") from exc
    try:
        model = AutoModelForCausalLM.from_pretrained(p, local_files_only=True, dtype=torch.float32)
    except Exception as exc:
        raise CheckpointError(f"cannot load a causal LM from {p}: {exc}") from exc
    eos = tokenizer.eos_token_id
    if eos is None:
        raise CheckpointError(f"the tokenizer in {p} defines no eos_token")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise CheckpointError(f"model.chat_template is set but the tokenizer in {p} has no chat template")
    return Policy(model, tokenizer, int(eos), int(pad), chat_template, str(p))
