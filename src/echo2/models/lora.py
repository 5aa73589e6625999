"""LoRA on the learner (``[lora]``, docs/learner.md#lora): low-rank adapters attached to a policy's
linear layers through transformers' PEFT integration (``add_adapter``), the base frozen.

- :func:`attach`: the adapter on ``lora.target_modules`` (rank ``r``, ``alpha``, ``dropout``); only
  its weights train (float32, as are their AdamW states); the frozen base is cast to bf16 under
  ``learner.precision = "bf16-mixed"`` (it is never stepped, so it needs no float32 master copy).
  A module list or a rank that does not fit the model, or a model PEFT cannot wrap, is a ConfigError
  naming what is wrong.
- :func:`adapter_off`: the KL reference is the base alone: the same model with its adapter disabled
  for the duration of a ``with`` (no second model).
- A LoRA checkpoint holds the adapter (PEFT's ``adapter_config.json`` + ``adapter_model.safetensors``),
  the tokenizer, and ``base.json``: the base checkpoint's path and the digest of its weights
  (:func:`base_digest`), so a checkpoint is never resumed or exported over another base
  (:func:`load_lora_checkpoint`).
- :func:`merged_weights`: the adapter folded into the base weights (``W + alpha / r * B @ A``) under
  the base's own names: a plain HF model's state (``echo2 export``).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from echo2.config import LoRAConfig
from echo2.errors import CheckpointError, ConfigError
from echo2.weights.delta import sampler_copy, weights_digest

ADAPTER_CONFIG = "adapter_config.json"  # PEFT's file: what makes a checkpoint directory a LoRA one
BASE_FILE = "base.json"  # the base checkpoint a LoRA checkpoint was trained on: path and digest

log = logging.getLogger(__name__)


def _is_adapter(name: str) -> bool:
    """Is ``name`` a tensor of the adapter (PEFT's ``lora_A`` / ``lora_B``), not of the base."""
    return ".lora_" in name


def is_lora_checkpoint(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file()


def has_adapter(model: Any) -> bool:
    """Is a LoRA adapter attached to ``model`` (by :func:`attach` or a LoRA checkpoint)."""
    return bool(getattr(model, "_hf_peft_config_loaded", False))


class _Widened(Mapping[str, Any]):
    """``state`` with each floating tensor widened to float32 when read, one at a time (a bf16 base's
    digest builds no float32 copy of the model)."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.state = state

    def __getitem__(self, name: str) -> Any:
        t = self.state[name].detach().cpu()
        return (t.float() if t.is_floating_point() else t).contiguous()

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


def base_digest(model: Any) -> str:
    """The weights digest (``weights.delta.weights_digest``) of ``model``'s whole state as loaded,
    before an adapter is attached or the base is cast, its floating tensors widened to float32: what a
    LoRA checkpoint's ``base.json`` pins. Widening makes it the same whether a bf16 checkpoint was
    loaded as stored (``load_checkpoint(keep_bf16=True)``) or in float32."""

    if has_adapter(model):
        raise ValueError("base_digest: the model already carries an adapter")
    return weights_digest(_Widened(model.state_dict()))


def attach(model: Any, cfg: LoRAConfig, precision: str = "fp32") -> None:
    """Attach a LoRA adapter of ``cfg`` to ``model`` (only its weights train, in float32); under
    ``bf16-mixed`` the frozen base is cast to bf16. ConfigError when the model cannot take it."""
    import torch
    from peft import LoraConfig as PeftLoraConfig

    if not hasattr(model, "add_adapter"):
        raise ConfigError(
            f"lora.enabled: {type(model).__name__} is not a transformers model PEFT can wrap (no add_adapter)"
        )
    targets = set(cfg.target_modules)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    names = sorted({n.rsplit(".", 1)[-1] for n, _ in linears})
    missing = sorted(targets - set(names))
    if missing:
        raise ConfigError(
            f"lora.target_modules: {missing} name no linear layer of {type(model).__name__}; its linear "
            f"layers are {names}"
        )
    hit = [(n, m) for n, m in linears if n.rsplit(".", 1)[-1] in targets]
    narrow = min(hit, key=lambda nm: min(nm[1].in_features, nm[1].out_features))
    width = min(narrow[1].in_features, narrow[1].out_features)
    if cfg.r > width:
        raise ConfigError(
            f"lora.r = {cfg.r} exceeds the smallest dimension ({width}) of a targeted layer ({narrow[0]}): "
            "a rank above it adds parameters and no capacity; lower lora.r"
        )
    try:
        model.add_adapter(
            PeftLoraConfig(
                r=cfg.r,
                lora_alpha=cfg.alpha,
                lora_dropout=cfg.dropout,
                target_modules=sorted(targets),
            )
        )
    except Exception as exc:  # PEFT raises its own types for models it cannot wrap
        raise ConfigError(
            f"lora.enabled: PEFT cannot attach an adapter to {type(model).__name__}: {exc}"
        ) from exc
    train_adapter_only(model, precision)


def train_adapter_only(model: Any, precision: str) -> None:
    """The adapter's weights trainable in float32, the base frozen (cast to bf16 under ``bf16-mixed``)."""
    import torch

    for name, p in model.named_parameters():
        if _is_adapter(name):
            p.data = p.data.float()
            p.requires_grad_(True)
        else:
            p.requires_grad_(False)
            if precision == "bf16-mixed" and p.is_floating_point():
                p.data = p.data.to(torch.bfloat16)


def check_matches(model: Any, cfg: LoRAConfig, where: Path) -> None:
    """ConfigError when the adapter a checkpoint carries is not the one ``[lora]`` asks for."""
    have = model.peft_config["default"]
    mine = {"r": cfg.r, "alpha": cfg.alpha, "target_modules": sorted(cfg.target_modules)}
    theirs = {"r": have.r, "alpha": have.lora_alpha, "target_modules": sorted(have.target_modules)}
    if mine != theirs:
        raise ConfigError(
            f"[lora] asks for {mine}, but the adapter of {where} is {theirs}: set [lora] to match"
        )


@contextlib.contextmanager
def adapter_off(model: Any) -> Iterator[None]:
    """``model`` as its base alone (the KL reference) for the duration of the ``with``."""
    model.disable_adapters()
    try:
        yield
    finally:
        model.enable_adapters()


def adapter_state(model: Any) -> dict[str, Any]:
    """The adapter's weights by PEFT's names (``...q_proj.lora_A.weight``): what a LoRA checkpoint holds."""
    return dict(model.get_adapter_state_dict())


def save_adapter(model: Any, path: Path, base: dict[str, str]) -> None:
    """The adapter (PEFT's files; ``model.save_pretrained`` writes only those for a model carrying
    one) and ``base.json`` (the base checkpoint's path and digest) into ``path``."""
    model.save_pretrained(path)
    (path / BASE_FILE).write_text(json.dumps(base) + "\n")


def load_lora_checkpoint(path: Path, load_base: Any) -> tuple[Any, dict[str, str]]:
    """The policy of a LoRA checkpoint: its base loaded with ``load_base(base_path)`` (checked against
    the recorded digest), the adapter of ``adapter_config.json`` attached with the saved weights.
    Returns ``(policy, base)``; CheckpointError when the base is missing or has other weights."""
    from safetensors.torch import load_file

    try:
        base = json.loads((path / BASE_FILE).read_text())
        base_path, digest = Path(base["path"]), str(base["sha256"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is a LoRA checkpoint without a readable {BASE_FILE}: {exc}") from exc
    policy = load_base(base_path)
    got = base_digest(policy.model)
    if got != digest:
        raise CheckpointError(
            f"{path}: the adapter was trained on a base whose weights digest to {digest[:16]}..., but "
            f"{base_path} now digests to {got[:16]}...: another base; an adapter only fits its own"
        )
    try:
        policy.model.load_adapter(str(path), adapter_name="default")
        saved = load_file(str(path / "adapter_model.safetensors"))
    except Exception as exc:  # PEFT and transformers raise many types; the user needs the cause
        raise CheckpointError(f"{path}: cannot attach its adapter to the base at {base_path}: {exc}") from exc
    live = adapter_state(policy.model)
    for name, t in saved.items():  # every saved tensor loaded, bit for bit
        mine = live.get(name.removeprefix("base_model.model."))
        if mine is None or not mine.detach().cpu().equal(t.to(mine.dtype)):
            raise CheckpointError(
                f"{path}: its adapter tensor {name} fits no layer of the base at {base_path}"
            )
    return policy, {"path": str(base_path), "sha256": digest}


def merged_weights(model: Any) -> dict[str, Any]:
    """The weights of ``model`` with its adapter folded into the base (``W + alpha / r * B @ A``, in
    the base's dtype, PEFT's ``merge``), by the base model's own names: a plain HF state dict (load it
    into the base, ``echo2 export``). ``model`` keeps the merged weights and is not trained after."""
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.merge()
    return {
        name.replace(".base_layer.", "."): t
        for name, t in model.state_dict().items()
        if not _is_adapter(name)
    }


# ---- publications of the adapter -------------------------------------------------------------------
# A LoRA learner publishes the adapter alone (``adapter_copy``: the live names, ``...q_proj.lora_A.
# default.weight``) through the usual codec, chain and broadcast; the base (``base_copy``) rides the
# first link of each learner process's chain, and a worker keeps it in a ``BaseSlot``. Workers and
# the learner's generation check turn a published adapter into the full
# weights an engine loads with one function (``merge_published``), exactly, so both hold the same bytes.

LORA_A, LORA_B = ".lora_A.default.weight", ".lora_B.default.weight"


def adapter_copy(model: Any, dtype: str = "bfloat16") -> dict[str, Any]:
    """The adapter's weights as a publication ships them (``weights.delta.sampler_copy`` of the adapter
    tensors alone, by their live names; the base is not copied)."""

    return sampler_copy(model, dtype, keep=_is_adapter)


def base_copy(model: Any, dtype: str = "bfloat16") -> dict[str, Any]:
    """The frozen base as a full snapshot ships it (``weights.delta.sampler_copy`` without the adapter),
    under the base model's own names (``...q_proj.weight``): what a worker installs once. A tensor
    already in ``dtype`` on the CPU is the frozen parameter itself (never stepped: no copy)."""

    weights = sampler_copy(model, dtype, keep=lambda name: not _is_adapter(name), frozen=True)
    return {name.replace(".base_layer.", "."): t for name, t in weights.items()}


@dataclass(frozen=True)
class PublishedBase:
    """A LoRA run's base as workers hold it: the tensors (publication dtype, base names), their weights
    digest (signed into every manifest's lineage as ``model_base``) and the adapter's scale."""

    tensors: dict[str, Any]
    digest: str
    scale: float
    # the dtype of the merged weights (``expand``): None = the base's; float32 in a run whose vLLM
    # workers apply adapters natively (``lora.vllm = "native"``), whose unmerged ``W x + s B A x``
    # the float32 merge matches to float32 rounding (a merge rounded to bf16 would differ by bf16's)
    merged_dtype: str | None = None

    @classmethod
    def of(cls, model: Any, dtype: str, scale: float, merged_dtype: str | None = None) -> PublishedBase:

        tensors = base_copy(model, dtype)
        return cls(tensors, weights_digest(tensors), scale, merged_dtype)

    def expand(self, adapter: Any) -> dict[str, Any]:
        """A published adapter as the full weights an engine or the check loads (:func:`merge_published`)."""
        return merge_published(self.tensors, adapter, self.scale, self.merged_dtype)

    def check(self, adapter: Any) -> None:
        """CheckpointError when ``adapter`` does not fit this base (what ``expand`` would refuse)."""
        for _ in adapter_pairs(self.tensors, adapter):
            pass


class BaseSlot:
    """A worker's LoRA base: empty until the first link of the chain (or a checkpoint on the worker's
    own disk) fills it with the base the run's settings pin (``digest``); then held for the run. Its
    engines read it at every install (``rollout.engines.AdapterEngine``)."""

    def __init__(self, digest: str, scale: float, merged_dtype: str | None = None) -> None:
        self.digest, self.scale, self.merged_dtype = digest, scale, merged_dtype
        self.held: PublishedBase | None = None

    def fill(self, tensors: dict[str, Any], where: str = "the base the chain carried") -> PublishedBase:
        """Hold ``tensors`` as the base (once: a base already held stays); CheckpointError naming
        ``where`` when their digest is not the run's."""
        if self.held is None:
            got = weights_digest(tensors)
            if got != self.digest:
                raise CheckpointError(
                    f"{where} digests to {got[:16]}..., the run's settings state {self.digest[:16]}...: "
                    "another base; refusing it"
                )
            self.held = PublishedBase(tensors, got, self.scale, self.merged_dtype)
        return self.held

    @property
    def base(self) -> PublishedBase:
        """The base held; CheckpointError before one is (an adapter needs its base)."""
        if self.held is None:
            raise CheckpointError("an adapter arrived before the base it applies to (the chain's first link)")
        return self.held


def lora_scale(cfg: LoRAConfig) -> float:
    return cfg.alpha / cfg.r


def merged_dtype(vllm: str) -> str | None:
    """The dtype base + adapter are merged in (``PublishedBase.merged_dtype``) for a run whose vLLM
    workers apply adapters as ``lora.vllm`` says: float32 for ``native`` (vLLM's unmerged sum), else
    None (the base's own dtype)."""
    return "float32" if vllm == "native" else None


def adapter_pairs(base: Any, adapter: Any) -> Iterator[tuple[str, Any, Any, Any]]:
    """``(stem, A, B, W)`` for every adapted layer of ``adapter`` over ``base``: CheckpointError when a
    pair does not fit its base weight (``B @ A`` of ``W``'s shape) or a tensor belongs to no pair."""
    unpaired = [n for n in adapter if not (n.endswith(LORA_A) or n.endswith(LORA_B))]
    unpaired += [n for n in adapter if n.endswith(LORA_B) and n[: -len(LORA_B)] + LORA_A not in adapter]
    if unpaired:
        raise CheckpointError(f"adapter tensors that are no LoRA pair: {unpaired[:3]}")
    for name_a, a in adapter.items():
        if not name_a.endswith(LORA_A):
            continue
        stem = name_a[: -len(LORA_A)]
        b, w = adapter.get(stem + LORA_B), base.get(stem + ".weight")
        if b is None or w is None or b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != tuple(w.shape):
            have = tuple(w.shape) if w is not None else "absent"
            raise CheckpointError(f"adapter tensors of {stem} do not fit the base's weight ({have})")
        yield stem, a, b, w


def merge_published(base: Any, adapter: Any, scale: float, dtype: str | None = None) -> dict[str, Any]:
    """The full weights of base + adapter, in ``dtype`` (default: the base's): every targeted ``W``
    becomes ``round(W + scale * B @ A)``, computed in float64 (the products of two bf16 numbers and their
    sum over the rank are exact there, whatever order a machine's matmul adds them in) and rounded once,
    so every worker and the learner's check get the same bytes; untargeted tensors are the base's own
    (not copied). CheckpointError when the adapter does not fit the base."""
    import torch

    out = dict(base)
    for stem, a, b, w in list(adapter_pairs(base, adapter)):
        with torch.no_grad():
            delta = (b.to(torch.float64) @ a.to(torch.float64)).mul_(scale)
            to = getattr(torch, dtype) if dtype is not None else w.dtype
            out[stem + ".weight"] = delta.add_(w.to(torch.float64)).to(to)
    return out
