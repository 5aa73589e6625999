"""The environment seam of the data plane (SPEC §8): a text environment the policy plays turn by turn.

An environment is a sandbox ``E`` that shows the policy a text observation, takes the policy's text
action and answers with the next observation, an immediate reward and whether the episode is over.
Everything about it is deterministic in the seed given to :meth:`TextEnv.reset`: the same seed and
the same actions give the same observations and rewards on every machine, so an episode can be
replayed from ``(seed, actions)`` (the learner re-checks a worker's claimed return that way).

The environment parses the action text itself (it owns its action language). An action it cannot
parse, or one that is not legal in its state, is never an error: the environment applies the
fallback its docstring documents and reports it with ``EnvStep.illegal`` (the adapter counts it).

What the adapter (``rollout/episodes.py``) adds on top: rendering observations into prompt turns,
the turn-aware loss mask, the per-step timeout and the discounted episodic return. A new environment
is a class with these two methods plus its config model, registered in ``envs/registry.py``; nothing
in the runtime changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol


@dataclass(frozen=True)
class EnvStep:
    """What one environment step returns."""

    observation: str  # text shown to the policy before its next action ("" once done)
    reward: float  # immediate reward r_t of this step (must be finite)
    done: bool  # the episode is over
    illegal: bool = False  # the action was unparsable or not legal: the documented fallback was applied


EnvScore = Literal["return", "chips"]  # what an environment's held-out evaluation measures


class TextEnv(Protocol):
    """A multi-turn text environment (one episode at a time)."""

    def reset(self, seed: int) -> str:
        """Start the episode of ``seed`` (deterministic in it) and return the first observation."""
        ...

    def step(self, action: str) -> EnvStep:
        """Apply the policy's text ``action`` (raw model output, decoded) and return what follows."""
        ...


class EnvError(RuntimeError):
    """An environment misbehaved (raised, hung past its timeout, returned a non-finite reward or a
    non-text observation): the message names what. It costs only the episode it happened in."""
