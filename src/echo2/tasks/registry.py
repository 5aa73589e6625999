"""The one task registry, keyed by the config's task name: its config model, its ``--task`` preset and
its builder (config -> :class:`~echo2.tasks.base.Task`). It sits above the adapters and the two kinds
of task (it imports them; they never import it).

A new single-turn task is an adapter (``data/tasks/``), its config model in ``config/model.py`` and one
:class:`Entry` here. A new environment takes none of that: it is declared once in its module under
``envs/`` and listed in ``envs/roster.ENVIRONMENTS``, and its entry here is derived from that
declaration (config model, preset, the one environment builder), as its ``[task]`` variant and its
preset are in ``config/model.py``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from echo2.config import (
    TASK_PRESETS,
    ArithmeticTaskConfig,
    CodeTaskConfig,
    MathTaskConfig,
    TaskConfig,
    VerifiersTaskConfig,
)
from echo2.data.tasks.arithmetic import ArithmeticTask
from echo2.data.tasks.code import CodeTask
from echo2.data.tasks.environment import EnvironmentTask
from echo2.data.tasks.math import MathTask
from echo2.data.tasks.verifiers_env import VerifiersTask
from echo2.envs.base import EnvironmentFields
from echo2.envs.roster import ENVIRONMENTS, env_spec
from echo2.tasks.base import Task
from echo2.tasks.episodic import Episodic
from echo2.tasks.single_turn import SingleTurn


@dataclass(frozen=True)
class Entry:
    """One task of the registry."""

    config: type  # its config model (the ``[task]`` section when ``task.name`` is this name)
    preset: tuple[str, ...]  # the overrides of ``--task NAME`` (``config.TASK_PRESETS``, the loader's)
    build: Callable[[TaskConfig, int], Task]  # (its config, the run's seed) -> the task
    # distributions its worker runs it with besides echo2, pinned for the run (``echo2.pins``): an
    # environment's (its episodes are played there); none for a single-turn task (its worker generates)
    packages: tuple[str, ...] = ()


def _arithmetic(cfg: TaskConfig, seed: int) -> Task:
    assert isinstance(cfg, ArithmeticTaskConfig)
    return SingleTurn(ArithmeticTask(cfg, seed))


def _math(cfg: TaskConfig, seed: int) -> Task:
    assert isinstance(cfg, MathTaskConfig)
    return SingleTurn(MathTask(cfg, seed))


def _code(cfg: TaskConfig, seed: int) -> Task:
    assert isinstance(cfg, CodeTaskConfig)
    return SingleTurn(CodeTask(cfg, seed))


def _verifiers(cfg: TaskConfig, seed: int) -> Task:
    assert isinstance(cfg, VerifiersTaskConfig)
    return SingleTurn(VerifiersTask(cfg, seed))


def _environment(cfg: TaskConfig, seed: int) -> Task:
    """Every environment's builder: its declared spec behind the episodic task."""
    assert isinstance(cfg, EnvironmentFields)
    return Episodic(EnvironmentTask(env_spec(cfg), seed))


REGISTRY: dict[str, Entry] = {
    "arithmetic": Entry(ArithmeticTaskConfig, tuple(TASK_PRESETS["arithmetic"]), _arithmetic),
    "math": Entry(MathTaskConfig, tuple(TASK_PRESETS["math"]), _math),
    "code": Entry(CodeTaskConfig, tuple(TASK_PRESETS["code"]), _code),
    "verifiers": Entry(VerifiersTaskConfig, tuple(TASK_PRESETS["verifiers"]), _verifiers),
    **{
        env.name: Entry(env.config, tuple(TASK_PRESETS[env.name]), _environment, env.packages)
        for env in ENVIRONMENTS
    },
}
TASKS: dict[type, Callable[[TaskConfig, int], Task]] = {e.config: e.build for e in REGISTRY.values()}


def build_task(cfg: TaskConfig, seed: int = 0) -> Task:
    """The task ``cfg`` names (``cfg.name`` is the registry key)."""
    return REGISTRY[cfg.name].build(cfg, seed)


def worker_packages(cfg: TaskConfig) -> tuple[str, ...]:
    """The distributions a worker runs the task ``cfg`` names with, pinned for the run."""
    own = getattr(cfg, "packages", None)  # a config naming its environment's package (verifiers_env)
    extra = own() if callable(own) else ()
    return tuple(dict.fromkeys((*REGISTRY[cfg.name].packages, *extra)))
