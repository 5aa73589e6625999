"""Loading a policy (model + tokenizer) from a local HF checkpoint directory. Loading never trains.

The embedded default goes through the same function: its warm-started checkpoint is an ordinary
``save_pretrained`` directory (safetensors), so the code path a user's real checkpoint takes is the
one every test exercises. Which checkpoint a run starts from (the user's, or the embedded model's
warm start, trained first when it is not cached) is the learner side's decision:
``echo2.learner.warmstart.starting_checkpoint``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from echo2.config import Config
from echo2.errors import CheckpointError, ConfigError
from echo2.models.snapshot import empty_model

DCP_DIR = "dcp"  # a sharded checkpoint's model and optimizer states (torch.distributed.checkpoint)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatFormat:
    """How a prompt becomes the model's input: as it is, or wrapped by the tokenizer's chat template with
    an optional system message and the template's own keyword arguments (Qwen3's ``enable_thinking``)."""

    template: bool = False  # wrap prompts with the tokenizer's chat template
    system_prompt: str | None = None  # a system message before the prompt (needs the template)
    template_kwargs: tuple[tuple[str, Any], ...] = ()  # extra arguments of apply_chat_template

    @classmethod
    def of(
        cls, chat_template: bool, system_prompt: str | None = None, kwargs: Mapping[str, Any] | None = None
    ) -> ChatFormat:
        return cls(chat_template, system_prompt, tuple(sorted((kwargs or {}).items())))


@dataclass(frozen=True)
class TextCodec:
    """Prompt text -> token ids and completion ids -> text, the way every plane agrees on: what a
    worker needs of a model besides its engine."""

    tokenizer: Any  # transformers tokenizer
    chat_template: bool  # wrap prompts with the tokenizer's chat template
    system_prompt: str | None = None  # the system message of every prompt (chat template only)
    template_kwargs: tuple[tuple[str, Any], ...] = ()  # apply_chat_template's extra arguments

    @classmethod
    def of(cls, tokenizer: Any, chat: ChatFormat) -> TextCodec:
        return cls(tokenizer, chat.template, chat.system_prompt, chat.template_kwargs)

    @property
    def chat(self) -> ChatFormat:
        return ChatFormat(self.chat_template, self.system_prompt, self.template_kwargs)

    def encode_prompt(self, text: str, system: str | None = None) -> list[int]:
        """The token ids of a prompt: ``text`` as it is, or wrapped by the chat template with ``system``
        (a record's own system message) or else the configured one before it."""
        if self.chat_template:
            messages = [{"role": "user", "content": text}]
            system = system if system is not None else self.system_prompt
            if system is not None:
                messages.insert(0, {"role": "system", "content": system})
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **dict(self.template_kwargs)
            )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode(self, prompt: Any) -> list[int]:
        """The token ids of a task's ``Prompt`` (its record's system message, if it has one)."""
        return self.encode_prompt(prompt.text, prompt.meta.get("system"))

    def decode_completion(self, ids: tuple[int, ...] | list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


@dataclass
class Policy:
    """A causal LM with its tokenizer and the token conventions the planes agree on."""

    model: Any  # transformers *ForCausalLM
    tokenizer: Any  # transformers tokenizer
    eos_id: int  # the tokenizer's end-of-sequence token
    pad_id: int  # token used for padding (never trained on)
    chat_template: bool  # wrap prompts with the tokenizer's chat template
    source: str  # the checkpoint directory it was loaded from
    chat: ChatFormat | None = None  # system prompt and template arguments (None: the template alone)
    extra_eos: tuple[int, ...] = ()  # more tokens that end a completion (the generation config's)
    lora_base: dict[str, str] | None = None  # a LoRA policy's base checkpoint: path and weights digest

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every token that ends a completion: the tokenizer's, then the generation config's others."""
        return (self.eos_id, *(e for e in self.extra_eos if e != self.eos_id))

    @property
    def codec(self) -> TextCodec:
        return TextCodec.of(self.tokenizer, self.chat or ChatFormat(self.chat_template))

    def encode_prompt(self, text: str) -> list[int]:
        return self.codec.encode_prompt(text)

    def decode_completion(self, ids: tuple[int, ...] | list[int]) -> str:
        return self.codec.decode_completion(ids)

    def save(self, path: Path) -> None:
        """``save_pretrained`` of the model and the tokenizer; a LoRA policy's: the adapter alone, with its
        base's path and digest (``models/lora.py``)."""
        path.mkdir(parents=True, exist_ok=True)
        if self.lora_base is not None:
            from echo2.models.lora import save_adapter

            save_adapter(self.model, path, self.lora_base)
        else:
            self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)


def configure_torch(cfg: Config) -> None:
    """Process-wide torch settings of a run: intra-op threads (see ``train.threads``) and the seed."""
    import torch

    threads = cfg.train.resolved_threads(embedded=cfg.model.path is None)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    return_freed_memory(cfg.learner.malloc_mmap_threshold)


M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def return_freed_memory(threshold: int) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process (``learner.malloc_mmap_threshold``):
    allocations of that size or more get pages of their own, returned when freed. glibc's default
    threshold adapts upwards after such frees, so later tensors come from the heap and a heap that
    held one micro-batch's activations stays resident under the next ones (a CPU learner's peak then
    grew 1.35x from R = 64 to 1024 at one token budget; docs/learner.md). True when set; False with
    another libc, ``threshold`` 0, or ``MALLOC_MMAP_THRESHOLD_`` in the environment (the user's wins)."""
    import ctypes
    import os
    import platform

    if threshold <= 0 or "MALLOC_MMAP_THRESHOLD_" in os.environ or platform.libc_ver()[0] != "glibc":
        return False
    return bool(ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, threshold))


def cache_kwarg(module: Any) -> str:
    """The keyword a transformers model's (or decoder's) ``forward`` takes its key-value cache by:
    ``cache`` from transformers 5.24 on (where ``past_key_values`` is deprecated, to be removed in
    5.40), ``past_key_values`` before. Read from the signature, so one call site serves both."""
    import inspect

    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


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


def generation_eos_ids(path: Path) -> tuple[int, ...]:
    """The end-of-sequence ids of a checkpoint's ``generation_config.json`` (one id or a list; none when
    the file or the field is absent); CheckpointError when the field is not ids."""
    file = path / "generation_config.json"
    if not file.is_file():
        return ()
    try:
        value = json.loads(file.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{file}: not a JSON object ({exc})") from exc
    ids = (
        [value]
        if isinstance(value, int)
        else value
        if isinstance(value, list)
        else []
        if value is None
        else None
    )
    if ids is None or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"{file}: eos_token_id must be a token id or a list of them, got {value!r}")
    return tuple(ids)


def stored_float_dtypes(path: Path) -> set[str]:
    """The safetensors dtypes (``"BF16"``, ``"F32"``, ...) of the floating tensors in the checkpoint at
    ``path``, read from the files' headers (no tensor is loaded); empty without safetensors files."""
    from safetensors import safe_open

    dtypes: set[str] = set()
    for f in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                dtypes |= {st.get_slice(k).get_dtype() for k in st.keys()}  # noqa: SIM118 (a safe_open handle, not a dict)
        except Exception as exc:  # safetensors raises its own types; the user needs the file and cause
            raise CheckpointError(f"{f} is not a readable safetensors file: {exc}") from exc
    return {d for d in dtypes if d.startswith(("F", "BF"))}


def load_model(p: Path, keep_bf16: bool = False, weights: bool = True) -> Any:
    """The causal LM of the checkpoint at ``p`` (:func:`load_checkpoint` says which dtype); a sharded
    checkpoint's built from its config; without ``weights`` built from the config with its parameters
    on the meta device (``snapshot.empty_model``: a sharded learner's ranks fill their shards).
    CheckpointError with the cause when transformers cannot."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sharded = (p / DCP_DIR).is_dir()  # the model from its config, its states loaded by the caller
    as_stored = keep_bf16 and not sharded and stored_float_dtypes(p) == {"BF16"}
    dtype = torch.bfloat16 if as_stored else torch.float32
    try:
        if not weights:
            return empty_model(AutoConfig.from_pretrained(p, local_files_only=True), dtype)
        if sharded:
            return AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(p, local_files_only=True), dtype=dtype
            )
        return AutoModelForCausalLM.from_pretrained(p, local_files_only=True, dtype=dtype)
    except Exception as exc:
        raise CheckpointError(f"cannot load a causal LM from {p}: {exc}") from exc


def load_checkpoint(
    path: str | Path, chat_template: bool | ChatFormat = False, keep_bf16: bool = False, weights: bool = True
) -> Policy:
    """Model + tokenizer from a local directory; CheckpointError says what is missing or broken. Every
    end-of-sequence id of the tokenizer and of ``generation_config.json`` ends a completion. A sharded
    checkpoint (a ``dcp/`` folder, ``learner/sharded.py``) gives the model built from its config: its
    states are loaded by the caller (``sharded.load_states``, with the optimizer's). A LoRA checkpoint
    (``models/lora.py``) gives its base with the adapter attached.

    The model is float32, except with ``keep_bf16`` (a LoRA learner under ``bf16-mixed``, whose frozen
    base is bf16 anyway) when every floating tensor the checkpoint stores is bf16: then it loads as
    stored, so no float32 copy of the base is ever built (the values are the same: bf16 widens to
    float32 exactly). Without ``weights`` the model's parameters are on the meta device (no memory,
    nothing read): a sharded learner's ranks load their shards (``learner/sharded.py``)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no per-load / per-save weight bars in our logs
    p = Path(path).expanduser()
    if not p.is_dir():
        raise CheckpointError(f"checkpoint directory {p} does not exist")
    from echo2.models.lora import is_lora_checkpoint, load_lora_checkpoint

    if is_lora_checkpoint(p):  # an adapter: its base loaded from the path it records, then the adapter
        policy, base = load_lora_checkpoint(p, lambda b: load_checkpoint(b, chat_template, keep_bf16))
        policy.lora_base = base
        return policy
    if not (p / "config.json").is_file():
        raise CheckpointError(f"{p} is not an HF checkpoint: config.json is missing")
    try:
        tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except Exception as exc:  # transformers raises many types; the user needs the path and the cause
        raise CheckpointError(f"cannot load a tokenizer from {p}: {exc}") from exc
    model = load_model(p, keep_bf16, weights)
    chat = chat_template if isinstance(chat_template, ChatFormat) else ChatFormat(chat_template)
    extra = generation_eos_ids(p)
    eos = tokenizer.eos_token_id
    if eos is None and extra:
        eos = extra[0]
    if eos is None:
        raise CheckpointError(f"the tokenizer in {p} defines no eos_token (nor does generation_config.json)")
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    bad = [i for i in (eos, *extra) if vocab and not 0 <= int(i) < vocab]
    if bad:
        raise CheckpointError(f"{p}: end-of-sequence ids {bad} are outside the model's vocabulary of {vocab}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    if chat.template and not getattr(tokenizer, "chat_template", None):
        raise CheckpointError(f"model.chat_template is set but the tokenizer in {p} has no chat template")
    policy = Policy(model, tokenizer, int(eos), int(pad), chat.template, str(p), chat, extra)
    if chat.template:
        try:  # a template that rejects a system message or an argument fails here, not mid-run
            policy.codec.encode_prompt("1+1=")
        except Exception as exc:  # jinja raises its own types; the user needs the template's complaint
            raise CheckpointError(
                f"the chat template of {p} fails on a prompt with model.system_prompt / "
                f"model.chat_template_kwargs as set: {type(exc).__name__}: {exc}"
            ) from exc
    return policy


def chat_format(cfg: Config) -> ChatFormat:
    """The run's ``[model]`` chat settings."""
    m = cfg.model
    return ChatFormat.of(m.chat_template, m.system_prompt, m.chat_template_kwargs)
