"""The engine seam of the rollout plane: what a worker needs from whatever samples completions.

An engine holds one set of weights, samples completions with per-token log-probs, and installs a new
snapshot between generations (never during one). The worker and the learner's evaluation talk only to
this protocol; :mod:`echo2.rollout.engines` maps each :data:`echo2.config.EngineName` to a class, so a
second engine is a new registered class, not a change to worker code.

Log-prob convention every engine must keep: ``Sample.logprobs`` are log-probs under the
*temperature-scaled* distribution ``softmax(logits / T)``, before nucleus truncation. That is what
the learner recomputes, so an on-policy sample has importance weight exactly 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from echo2.config import SamplingConfig

if TYPE_CHECKING:
    import torch


EosIds = int | Sequence[int]  # the token (or tokens) that end a completion


def eos_tuple(eos: EosIds) -> tuple[int, ...]:
    """The end-of-sequence tokens as a non-empty tuple."""
    ids = (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)
    if not ids:
        raise ValueError("at least one end-of-sequence token is needed")
    return ids


def first_eos(ids: Sequence[int], eos: tuple[int, ...]) -> int:
    """Index of the first end-of-sequence token of ``ids``, -1 if none."""
    return next((i for i, t in enumerate(ids) if t in eos), -1)


@dataclass(frozen=True)
class Sample:
    """One generated completion."""

    completion_ids: tuple[int, ...]  # sampled token ids, EOS included when it was drawn
    logprobs: tuple[float, ...]  # sampler log-prob of each completion token (see module docstring)
    finished: bool  # True when EOS was drawn before max_new_tokens


class Engine(Protocol):
    """Samples completions from one set of weights; a snapshot install swaps the weights."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        seed: int,
        greedy: bool = False,
        max_new_tokens: int | None = None,
        rows: Sequence[int] | None = None,
        first_steps: Sequence[int] | None = None,
    ) -> list[Sample]:
        """One completion per entry of ``prompts`` (repeat a prompt to sample a group); deterministic
        under ``seed``; ``greedy`` takes the argmax token (held-out evaluation). Entry ``b`` draws its
        ``n``-th token with the seeded noise of row ``rows[b]`` (default ``b``) and step
        ``first_steps[b] + n`` (default ``n``): a multi-turn episode keeps one row and continues its
        steps across turns, so every token it drew is re-derivable (``rollout/sampling.py``)."""
        ...

    def install(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Load verified published weights (name -> tensor, every weight once, in the publication dtype;
        ``weights/chain.py`` built and checked them) in place of the current ones. Called only between
        generations; raises :class:`echo2.errors.CheckpointError` when they do not fit the model."""
        ...


# the engine settings a user gives a worker, one name each end to end: ``runtime.engine_<name>`` for
# the workers ``echo2 run`` starts (config/runtime.py, with the defaults below), ``echo2 worker
# --engine-<name>`` (cli/run.py), ``EngineOptions.<name>``; the others come from the run's settings
ENGINE_SETTINGS = ("dtype", "memory", "device", "batch_tokens")


@dataclass(frozen=True)
class EngineOptions:
    """How a worker sizes its engine (``echo2 worker --engine-*`` flags, ``[runtime]`` for the workers
    ``echo2 run`` starts). Engines take what applies to them: the HF engine computes in float32 on its
    ``device`` in ``dtype`` in batches of at most ``max_batch_tokens`` tokens."""

    dtype: str = "float32"  # compute dtype of the engine (float32, bfloat16)
    memory: float = 0.3  # share of accelerator memory (host memory on CPU) vLLM may claim
    max_context: int = 0  # longest prompt + completion the engine must hold; 0 = the model's own limit
    eager: bool | None = None  # vLLM without CUDA graphs / compilation; None = eager on CPU only
    device: str = "auto"  # where the HF engine's model runs: auto (CUDA when present), cpu, cuda, cuda:N
    batch_tokens: int | None = None  # HF engine: rows x (prompt + new tokens) per forward batch; None: one
    lora_rank: int | None = None  # vLLM: serve LoRA adapters of this rank natively (a LoRA run's setting)


class EngineFactory(Protocol):
    """How a worker builds an engine: from the model skeleton the learner serves (config + tokenizer
    files in ``skeleton_dir``, no weights: every weight arrives in snapshots). The engine must not read
    ``skeleton_dir`` after it returns (the worker deletes it)."""

    def __call__(
        self, skeleton_dir: Path, eos_id: int, pad_id: int, sampling: SamplingConfig, options: EngineOptions
    ) -> Engine: ...
