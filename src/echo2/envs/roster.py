"""The one list of environments, and the spec of an environment config.

An environment is declared once, in its module under ``envs/`` (its ``TextEnv``, its ``[task]``
config model, its spec and its ``--task`` preset, tied together by an :class:`~echo2.envs.base.Environment`;
``envs/guess.py`` is the small example), and listed once, in :data:`ENVIRONMENTS`. Everything else
is derived from this list: the ``[task]`` union of the config tree and ``config.TASK_PRESETS``
(``echo2.config``), :func:`env_spec` here, and the task registry (``echo2.tasks.registry``).
``tests/unit/test_env_declaration.py`` checks that one line here is all a new environment takes.
(``GuessSpec``, ``PokerSpec`` and ``RULE_STYLES`` are re-exported: they lived here before.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from echo2.envs.base import Environment, EnvironmentFields
from echo2.envs.guess import GUESS, GuessSpec
from echo2.envs.poker_task import POKER, RULE_STYLES, PokerSpec
from echo2.envs.verifiers_turns import VERIFIERS_ENV

if TYPE_CHECKING:
    from echo2.data.tasks.environment import EnvSpec

__all__ = ["ENVIRONMENTS", "RULE_STYLES", "GuessSpec", "PokerSpec", "env_spec", "environment"]

# the one list (its order is the order of the ``[task]`` variants after the single-turn tasks)
ENVIRONMENTS: tuple[Environment, ...] = (POKER, GUESS, VERIFIERS_ENV)


def environment(cfg: EnvironmentFields) -> Environment:
    """The declaration whose config model ``cfg`` is."""
    for env in ENVIRONMENTS:
        if type(cfg) is env.config:
            return env
    raise KeyError(f"{type(cfg).__name__} is the config of no listed environment (envs/roster.py)")


def env_spec(cfg: EnvironmentFields) -> EnvSpec:
    """The spec of an environment config (what its task adapter reads)."""
    return environment(cfg).spec(cfg)
