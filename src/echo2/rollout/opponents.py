"""Self-play opponents: earlier snapshots of the policy, kept by a worker, playing the other seats.

A worker keeps the first version it installs (the warm start) and then every ``every``-th version it
installs, up to ``size`` of them (the first always stays; the oldest of the others goes first). A
self-play episode draws its opponent's version from the pool by the episode's seed, so the ``G``
episodes of a group face the same opponent. The opponent answers greedily, so it is deterministic
given its weights; what it answered is recorded in the trajectory (``meta["opponent_actions"]``) and
the learner's replay plays those answers back (``tasks/verify.py``): the learner does not hold the
opponent's weights, so that the opponent's answers were its own greedy choices is not checked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from echo2.models.policy import TextCodec
from echo2.rollout.engines.base import Engine
from echo2.types import Prompt

if TYPE_CHECKING:
    import torch


class SelfPlayPool:
    """Earlier versions' weights and one engine that plays whichever of them a seat needs."""

    def __init__(self, engine: Engine, codec: TextCodec, every: int, size: int, max_new_tokens: int) -> None:
        self.engine = engine  # the opponents' own engine (never the one generating the policy's turns)
        self.codec = codec
        self.every = every
        self.size = size
        self.max_new_tokens = max_new_tokens
        self.pool: dict[int, Mapping[str, torch.Tensor]] = {}  # version -> published weights
        self._loaded: int | None = None
        self._lock = threading.Lock()

    def offer(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """A newly installed version: kept when it is the first, or crosses a multiple of ``every``."""
        with self._lock:
            held = sorted(self.pool)
            if held and version // self.every <= held[-1] // self.every:
                return
            self.pool[version] = weights
            while len(self.pool) > self.size:
                del self.pool[sorted(self.pool)[1]]  # never the first (the warm start)

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self.pool)

    def policy_for(self, prompt: Prompt) -> Callable[[str], str] | None:
        """The text policy of the opponent a self-play episode of ``prompt`` faces (None when the
        prompt is not self-play or nothing is held yet)."""
        if prompt.meta.get("opponent") != "selfplay":
            return None
        versions = self.versions()
        if not versions:
            return None
        version = versions[int(prompt.meta["seed"]) % len(versions)]
        return lambda observation: self._act(version, observation)

    def _act(self, version: int, observation: str) -> str:
        with self._lock:
            if self._loaded != version:
                self.engine.install(self.pool[version])
                self._loaded = version
            ids = self.codec.encode_prompt(observation)
            (sample,) = self.engine.generate([ids], seed=0, greedy=True, max_new_tokens=self.max_new_tokens)
        return self.codec.decode_completion(sample.completion_ids)
