"""The typed task registry: config class -> adapter. It sits above the adapters (it imports them;
they import only ``base``), so there is no import circle. A new task adds one line to ``TASKS``."""

from __future__ import annotations

from collections.abc import Callable

from echo2.config import ArithmeticTaskConfig, GuessTaskConfig, MathTaskConfig, PokerTaskConfig, TaskConfig
from echo2.data.tasks.arithmetic import ArithmeticTask
from echo2.data.tasks.base import Task
from echo2.data.tasks.environment import EnvironmentTask
from echo2.data.tasks.math import MathTask
from echo2.envs.registry import env_spec


def _build_arithmetic(cfg: TaskConfig, seed: int) -> Task:
    assert isinstance(cfg, ArithmeticTaskConfig)
    return ArithmeticTask(cfg, seed)


def _build_math(cfg: TaskConfig, seed: int) -> Task:
    assert isinstance(cfg, MathTaskConfig)
    return MathTask(cfg, seed)


def _build_environment(cfg: TaskConfig, seed: int) -> Task:
    assert isinstance(cfg, PokerTaskConfig | GuessTaskConfig)
    return EnvironmentTask(env_spec(cfg), seed)


TASKS: dict[type, Callable[[TaskConfig, int], Task]] = {
    ArithmeticTaskConfig: _build_arithmetic,
    MathTaskConfig: _build_math,
    PokerTaskConfig: _build_environment,
    GuessTaskConfig: _build_environment,
}


def build_task(cfg: TaskConfig, seed: int = 0) -> Task:
    """The registered adapter for ``cfg`` (the config class is the registry key)."""
    return TASKS[type(cfg)](cfg, seed)
