"""Rollout engines behind the :class:`~echo2.rollout.engines.base.Engine` seam, by name.

``ENGINES`` is the typed registry a worker builds its engine from (``echo2 worker --engine NAME``);
adding an engine means adding a module with a class that satisfies the protocol and one entry here.
"""

from __future__ import annotations

from pathlib import Path

from echo2.config import EngineName, SamplingConfig
from echo2.rollout.engines.base import Engine, EngineFactory
from echo2.rollout.engines.hf import HFEngine

ENGINES: dict[EngineName, EngineFactory] = {"hf": HFEngine.from_skeleton}


def build_engine(
    name: EngineName, skeleton_dir: Path, eos_id: int, pad_id: int, sampling: SamplingConfig
) -> Engine:
    """The registered engine ``name``, built on the model skeleton in ``skeleton_dir``."""
    return ENGINES[name](skeleton_dir, eos_id, pad_id, sampling)
