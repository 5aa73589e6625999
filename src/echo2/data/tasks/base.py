"""The task adapter contract (SPEC §1) and its typed registry.

A task builds prompts ``x`` (a train stream and a fixed held-out split), defines the reward
``R(x, y)``, and says how a trajectory's metadata ``Ω`` becomes learner-side signals (a per-token
loss mask). A new task is a new adapter class plus its config model, registered here.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from echo2.config import ArithmeticTaskConfig, MathTaskConfig, TaskConfig
from echo2.types import Prompt


@dataclass(frozen=True)
class Grade:
    """What the reward function says of one completion."""

    reward: float  # scalar r = R(x, y)
    parsed: bool  # False when no answer could be read from y (then reward is 0 and it is counted)


class Task(Protocol):
    """A data-plane task adapter."""

    name: str

    def sample_train(self, rng: random.Random, n: int) -> list[Prompt]:
        """``n`` training prompts drawn with ``rng`` (never from the held-out split)."""
        ...

    def eval_prompts(self, n: int) -> list[Prompt]:
        """The first ``n`` prompts of the fixed held-out split (same list on every call)."""
        ...

    def grade(self, prompt: Prompt, completion: str) -> Grade:
        """The reward of ``completion`` for ``prompt``; never raises on unparseable text."""
        ...

    def token_mask(self, completion_ids: Sequence[int], meta: dict[str, object]) -> list[float]:
        """Per-token loss weights for a completion, from its metadata Ω (1.0 = trained on)."""
        ...


def full_mask(completion_ids: Sequence[int], meta: dict[str, object]) -> list[float]:
    """Train on every completion token (the mask most tasks want)."""
    return [1.0] * len(completion_ids)


def stable_fraction(key: str) -> float:
    """A deterministic number in [0, 1) for ``key``, the same on every machine and run
    (Python's ``hash`` is salted per process, so it cannot split data reproducibly)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def _build_arithmetic(cfg: TaskConfig, seed: int) -> Task:
    from echo2.data.tasks.arithmetic import ArithmeticTask

    assert isinstance(cfg, ArithmeticTaskConfig)
    return ArithmeticTask(cfg, seed)


def _build_math(cfg: TaskConfig, seed: int) -> Task:
    from echo2.data.tasks.math import MathTask

    assert isinstance(cfg, MathTaskConfig)
    return MathTask(cfg, seed)


TASKS: dict[type[ArithmeticTaskConfig] | type[MathTaskConfig], Callable[[TaskConfig, int], Task]] = {
    ArithmeticTaskConfig: _build_arithmetic,
    MathTaskConfig: _build_math,
}


def build_task(cfg: TaskConfig, seed: int = 0) -> Task:
    """The registered adapter for ``cfg`` (the config class is the registry key)."""
    return TASKS[type(cfg)](cfg, seed)
