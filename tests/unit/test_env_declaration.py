"""An environment is declared once: its module under ``envs/`` plus one line of ``ENVIRONMENTS``.

The ``[task]`` union and ``TASK_PRESETS`` (``config.py``), ``env_spec`` (``envs/roster.py``) and the
task registry (``tasks/registry.py``) are all derived from ``envs/roster.ENVIRONMENTS``; here that is
checked name by name and class by class, and then shown end to end on a throwaway environment that
a child interpreter adds to that one list (and nowhere else) before the config tree is built.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import typing
from pathlib import Path
from typing import Literal

import pytest

from echo2.config import SINGLE_TURN_TASKS, TASK_PRESETS, Config, TaskConfig, task_preset
from echo2.envs.base import Environment, EnvironmentFields
from echo2.envs.roster import ENVIRONMENTS, env_spec, environment
from echo2.tasks.registry import REGISTRY, build_task

ROOT = Path(__file__).resolve().parents[2]


def test_the_task_union_presets_env_spec_and_registry_all_derive_from_the_one_list():
    names = [env.name for env in ENVIRONMENTS]
    assert names == ["poker", "guess", "verifiers_env"]
    single = [m.model_fields["name"].default for m in SINGLE_TURN_TASKS]
    # the [task] union: the single-turn models, then one variant per listed environment, in list order
    (union, field) = typing.get_args(TaskConfig)
    assert typing.get_args(union) == (*SINGLE_TURN_TASKS, *(env.config for env in ENVIRONMENTS))
    assert field.discriminator == "name"
    assert typing.get_args(Config.model_fields["task"].annotation) == typing.get_args(union)
    # the presets: `task.name=NAME` then the declaration's own overrides
    assert list(TASK_PRESETS) == [*single, *names]
    for env in ENVIRONMENTS:
        assert task_preset(env.name) == [f"task.name={env.name}", *env.preset]
    # the task registry: the same names, the declared config model, the derived preset
    assert list(REGISTRY) == [*single, *names]
    for env in ENVIRONMENTS:
        entry = REGISTRY[env.name]
        assert entry.config is env.config and entry.preset == tuple(TASK_PRESETS[env.name])
        # env_spec and the built task: the declared spec, named by the config
        cfg = env.config()
        assert environment(cfg) is env and type(env_spec(cfg)) is env.spec
        task = build_task(cfg, 0)
        assert task.name == env.name and type(task.data.spec) is env.spec  # type: ignore[attr-defined]


def test_a_declaration_needs_a_one_value_name_literal():
    class NoName(EnvironmentFields):
        pass

    class TwoNames(EnvironmentFields):
        name: Literal["a", "b"] = "a"

    class OddDefault(EnvironmentFields):
        name: Literal["a"] = "b"  # type: ignore[assignment]

    for model in (NoName, TwoNames, OddDefault):
        with pytest.raises(TypeError, match="one-value Literal"):
            Environment(model, lambda cfg: cfg)
    with pytest.raises(KeyError, match="no listed environment"):
        environment(NoName.model_construct())


# A throwaway environment, declared in one module like envs/guess.py: a coin with `sides` faces to call.
COIN_MODULE = """
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from echo2.envs.base import EnvironmentFields, EnvKnobs, EnvStep, Environment


class CoinTaskConfig(EnvironmentFields):
    name: Literal["coin"] = "coin"
    sides: int = Field(2, ge=2, le=6, description="faces of the coin")
    max_turns: int = Field(1, ge=1, le=64, description="calls per episode")


class CoinEnv:
    def __init__(self, cfg: CoinTaskConfig) -> None:
        self.cfg = cfg

    def reset(self, seed: int) -> str:
        self.face = random.Random(f"coin:{seed}").randrange(self.cfg.sides)
        return f"call 0-{self.cfg.sides - 1}>"

    def step(self, action: str) -> EnvStep:
        return EnvStep("", 1.0 if action.strip() == str(self.face) else 0.0, True)


@dataclass(frozen=True)
class CoinSpec(EnvKnobs):
    cfg: CoinTaskConfig
    score: str = "return"

    def make(self, prompt, opponent_policy=None):
        return CoinEnv(self.cfg)

    def draw_meta(self, rng):
        return {}

    def fixed_meta(self, index):
        return {}

    def teacher(self, env):
        return str(env.face)


COIN = Environment(CoinTaskConfig, CoinSpec, preset=("sampling.max_new_tokens=2",))
"""

# The child: the one line a new environment takes (here made before the config tree is built), then
# every derived registry, as a user meets it.
CHILD = """
import pickle, random, sys

import echo2.envs.roster as envs
import coin

envs.ENVIRONMENTS = (*envs.ENVIRONMENTS, coin.COIN)  # the one place

from echo2.config import TASK_PRESETS, Config, load_config, task_preset
from echo2.errors import ConfigError
from echo2.tasks.episodic import Episodic
from echo2.tasks.registry import REGISTRY, build_task

assert TASK_PRESETS["coin"] == ["task.name=coin", "sampling.max_new_tokens=2"], TASK_PRESETS
cfg = load_config(overrides=[*task_preset("coin"), "task.sides=3"])  # `--task coin --set task.sides=3`
assert type(cfg.task) is coin.CoinTaskConfig and cfg.task.sides == 3 and cfg.sampling.max_new_tokens == 2
assert load_config(sys.argv[1]).task == coin.CoinTaskConfig(sides=4)  # `[task] name = "coin"`
for bad, says in (
    (["task.name=coin", "task.sides=9"], "task.coin.sides: Input should be less than or equal to 6 (got 9)"),
    (["task.name=coin", "task.side=3"], "task.coin.side: Extra inputs are not permitted"),
    (
        ["task.name=dice"],
        "'arithmetic', 'math', 'code', 'verifiers', 'poker', 'guess', 'verifiers_env', 'coin'",
    ),
    (["task.name=coin", "grpo.loss_agg=seq-mean-token-sum-norm"], "needs a constant completion length"),
):
    try:
        load_config(overrides=bad)
    except ConfigError as exc:
        assert says in str(exc), (says, str(exc))
    else:
        raise AssertionError(bad)
assert "CoinTaskConfig" in Config.model_json_schema()["$defs"]
assert pickle.loads(pickle.dumps(cfg)) == cfg and cfg.model_copy(update={"seed": 1}).task == cfg.task

assert REGISTRY["coin"].config is coin.CoinTaskConfig
task = build_task(cfg.task, 0)
assert isinstance(task, Episodic) and task.name == "coin" and task.score == "return"
prompt = task.data.sample_train(random.Random(0), 1)[0]
env = task.data.spec.make(prompt)
env.reset(prompt.meta["seed"])
assert env.step(task.data.spec.teacher(env)).reward == 1.0
assert "pokerkit" not in sys.modules  # declarations stay cheap: no environment's engine was imported
print("coin ok")
"""


def test_a_new_environment_is_one_module_and_one_line(tmp_path):
    (tmp_path / "coin.py").write_text(textwrap.dedent(COIN_MODULE))
    (tmp_path / "run.toml").write_text('[task]\nname = "coin"\nsides = 4\n')
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "run.toml")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "src")])},
    )
    assert out.returncode == 0 and "coin ok" in out.stdout, out.stderr
