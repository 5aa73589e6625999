"""Rollout engines behind the :class:`~echo2.rollout.engines.base.Engine` seam, by name.

``ENGINES`` is the typed registry a worker builds its engine from (``echo2 worker --engine NAME``);
adding an engine means adding a module with a class that satisfies the protocol and one entry here.
``hf`` (transformers, the default) needs nothing beyond echo2's dependencies; ``vllm`` needs the vLLM
package (docs/engines.md), which :func:`require_engine` checks before a worker registers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from echo2.config import EngineName, SamplingConfig
from echo2.rollout.engines.base import Engine, EngineFactory, EngineOptions
from echo2.rollout.engines.vllm_engine import VLLMEngine, require_vllm


def _hf(
    skeleton_dir: Path, eos_id: int, pad_id: int, sampling: SamplingConfig, options: EngineOptions
) -> Engine:
    from echo2.rollout.engines.hf import HFEngine  # torch is imported when an engine is built, not before

    return HFEngine.from_skeleton(skeleton_dir, eos_id, pad_id, sampling, options)


ENGINES: dict[EngineName, EngineFactory] = {"hf": _hf, "vllm": VLLMEngine.from_skeleton}


def require_engine(name: EngineName) -> None:
    """Raise a one-line :class:`echo2.errors.ConfigError` naming what to install when the engine's
    optional package is missing or does not import (only ``vllm`` has one)."""
    if name == "vllm":
        require_vllm()


def build_engine(
    name: EngineName,
    skeleton_dir: Path,
    eos_id: int,
    pad_id: int,
    sampling: SamplingConfig,
    options: EngineOptions | None = None,
) -> Engine:
    """The registered engine ``name``, built on the model skeleton in ``skeleton_dir``."""
    return ENGINES[name](skeleton_dir, eos_id, pad_id, sampling, options or EngineOptions())


class AdapterEngine:
    """An engine of a LoRA run: what it installs are published adapters. An engine that serves adapters
    natively (vLLM built with ``EngineOptions.lora_rank``: ``install_adapter``) gets the base once and
    then each adapter alone; any other loads base + adapter merged (``PublishedBase.expand``: exact, so
    the learner's check, which expands the same way, computes on the same weights). The native path
    computes ``W x + scale B A x`` unmerged; a run set for it (``lora.vllm = "native"``) merges in
    float32 everywhere (``PublishedBase.merged_dtype``), which that matches to float32 rounding
    (measured: tests/integration/vllm_lora_probe.py)."""

    def __init__(self, engine: Engine, slot: Any) -> None:
        self.engine = engine
        self.slot = slot  # models.lora.BaseSlot: the base, once the chain's first link filled it
        self.native = bool(getattr(engine, "serves_lora", False))  # it has install_adapter
        self._base_in = False  # the native path: the base installed (once, with the first adapter)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine.generate(*args, **kwargs)

    def install(self, weights: Any) -> None:
        base = self.slot.base  # CheckpointError before the base arrived
        if not self.native:
            self.engine.install(base.expand(weights))
            return
        base.check(weights)  # an adapter that does not fit its base changes nothing
        if not self._base_in:
            self.engine.install(base.tensors)
            self._base_in = True
        self.engine.install_adapter(weights, base.scale)  # type: ignore[attr-defined]
