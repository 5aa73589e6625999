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
the turn-aware loss mask, the per-step timeout and the discounted episodic return.

**Declaring one.** A new environment is declared once, in its module under ``envs/``: the class with
these two methods, its ``[task]`` config model (extending :class:`EnvironmentFields`, with its own
``name`` literal), its spec (what the task adapter asks of it, ``data/tasks/environment.EnvSpec``),
the overrides of ``--task NAME`` and the :class:`Environment` tying them together; then it is one
line of ``envs/roster.ENVIRONMENTS``. The config union, ``config.TASK_PRESETS``, ``env_spec`` and
the task registry are derived from that list; nothing in the runtime changes.

This package sits *below* ``echo2.config`` (the config tree is assembled from the environments'
models), so nothing here imports the config, the protocol or any plane; an environment's module must
stay cheap to import (the config imports it): a heavy engine (pokerkit) is imported by its spec when
an environment is built, from a sibling module.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from echo2.data.tasks.environment import EnvSpec


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

    # optional: ``close()``, called when an episode is cut before the environment ended it (the adapter
    # calls it if the environment has one), releases what the unfinished episode holds


class EnvError(RuntimeError):
    """An environment misbehaved (raised, hung past its timeout, returned a non-finite reward or a
    non-text observation): the message names what. It costs only the episode it happened in."""


class EnvironmentFields(BaseModel):
    """What every multi-turn environment's ``[task]`` config shares (the adapter's knobs,
    ``rollout/episodes.py``). An environment's model extends it with ``name: Literal["<its name>"]``
    and its own knobs; strict about unknown keys, like every config section."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    if TYPE_CHECKING:  # each environment's model declares it (after these knobs, as config.json shows it)
        name: str  # the task name: a one-value Literal, the discriminator of the ``[task]`` variants

    discount: float = Field(
        1.0, gt=0.0, le=1.0, description="gamma of the episodic return R = sum_t gamma^t r_t over decisions"
    )
    max_turns: int = Field(
        8, ge=1, le=64, description="model decisions per episode before it is cut (counted)"
    )
    illegal_penalty: float = Field(
        0.0, ge=0.0, description="subtracted from the reward of a step whose action was illegal (training)"
    )
    step_timeout_s: float = Field(
        5.0, gt=0.0, description="an environment step slower than this ends its episode (counted, reward 0)"
    )
    eval_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="share of episode seeds held out as the test split"
    )
    validation_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="share of episode seeds held out as the validation split"
    )

    @model_validator(mode="after")
    def _leaves_training_seeds(self) -> EnvironmentFields:
        if self.eval_fraction + self.validation_fraction >= 1.0:
            raise ValueError("eval_fraction + validation_fraction must be < 1 to leave seeds to train on")
        return self

    def check_run(self, loss_agg: str, max_new_tokens: int, context_tokens: int) -> None:
        """An episode has no constant completion length and needs room for several actions."""
        if loss_agg == "seq-mean-token-sum-norm":
            raise ValueError(
                "grpo.loss_agg=seq-mean-token-sum-norm needs a constant completion length; an environment "
                "task's episodes have none (use token-mean or seq-mean-token-mean)"
            )
        if context_tokens < 2 * max_new_tokens + 16:
            raise ValueError(
                f"model.embedded.max_positions={context_tokens} leaves no room for a multi-turn "
                f"episode of sampling.max_new_tokens={max_new_tokens} per action"
            )


@dataclass(frozen=True)
class EnvKnobs:
    """The name and the adapter knobs a spec reads off its config (:class:`EnvironmentFields`)."""

    cfg: Any

    @property
    def name(self) -> str:
        return str(self.cfg.name)

    @property
    def discount(self) -> float:
        return float(self.cfg.discount)

    @property
    def max_turns(self) -> int:
        return int(self.cfg.max_turns)

    @property
    def illegal_penalty(self) -> float:
        return float(self.cfg.illegal_penalty)

    @property
    def step_timeout_s(self) -> float:
        return float(self.cfg.step_timeout_s)

    @property
    def eval_fraction(self) -> float:
        return float(self.cfg.eval_fraction)

    @property
    def validation_fraction(self) -> float:
        return float(self.cfg.validation_fraction)

    @property
    def episodes(self) -> int | None:
        """How many distinct episodes there are (seeds ``0..episodes-1``), or None: any 31-bit seed."""
        return None

    def ready_judges(self) -> None:
        """On the learner, before it scores an episode: get the environment's judges ready (none here)."""

    def judged(self, envs: Sequence[TextEnv]) -> list[float | None]:
        """Each finished episode's whole reward as the learner's judges score it, None where the
        environment has none (here: none)."""
        return [None] * len(envs)

    def outcome_counts(self) -> dict[str, int]:
        """The learner's scorings of this environment's episodes so far, by outcome (here: none)."""
        return {}


@dataclass(frozen=True)
class Environment:
    """The one declaration of an environment (in its own module); listed once in
    ``envs/roster.ENVIRONMENTS``, from which the config union, ``--task`` presets, ``env_spec`` and
    the task registry are derived. Its name is its config model's ``name`` literal."""

    config: type[EnvironmentFields]  # its ``[task]`` model (``task.name = "<name>"`` selects it)
    spec: Callable[[Any], EnvSpec]  # its config -> the spec its task adapter reads
    preset: tuple[str, ...] = ()  # ``--task NAME``: overrides after ``task.name=NAME`` (the embedded default)
    # distributions its episodes import on a worker besides echo2 (``echo2.pins``: the run pins their
    # version and files, and a worker with others refuses to run)
    packages: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        field = self.config.model_fields.get("name")
        tags = typing.get_args(field.annotation) if field is not None else ()
        if (
            field is None
            or typing.get_origin(field.annotation) is not Literal
            or len(tags) != 1
            or field.default != tags[0]
        ):
            raise TypeError(
                f"{self.config.__name__}.name must be a one-value Literal defaulting to it "
                '(name: Literal["x"] = "x"): it names the environment and tells the [task] variants apart'
            )

    @property
    def name(self) -> str:
        """The task name (``task.name``, ``--task NAME``, the registry key)."""
        return str(self.config.model_fields["name"].default)
