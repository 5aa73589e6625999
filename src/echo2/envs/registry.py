"""The typed environment registry: config class -> :class:`~echo2.data.tasks.environment.EnvSpec`.

A new environment is a module under ``envs/`` implementing :class:`~echo2.envs.base.TextEnv`, its
config model in ``config.py`` (a ``[task]`` variant with its own ``name``), and one spec here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from echo2.config import GuessTaskConfig, PokerTaskConfig
from echo2.envs.base import EnvScore, TextEnv
from echo2.envs.guess import GuessEnv

if TYPE_CHECKING:
    from collections.abc import Callable

    from echo2.types import Prompt


@dataclass(frozen=True)
class _Common:
    """The adapter knobs every environment config carries (``config._EnvironmentFields``)."""

    cfg: Any

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


@dataclass(frozen=True)
class GuessSpec(_Common):
    cfg: GuessTaskConfig
    name: str = "guess"
    score: EnvScore = "return"  # held out: the mean discounted return of a greedy episode

    def make(self, prompt: Prompt, opponent_policy: Callable[[str], str] | None = None) -> TextEnv:
        return GuessEnv(self.cfg)

    def draw_meta(self, rng: random.Random) -> dict[str, Any]:
        return {}

    def fixed_meta(self, index: int) -> dict[str, Any]:
        return {}

    def teacher(self, env: TextEnv) -> str:
        assert isinstance(env, GuessEnv)
        return env.expert_action()


RULE_STYLES: tuple[Literal["tag", "station", "lag"], ...] = ("tag", "station", "lag")


@dataclass(frozen=True)
class PokerSpec(_Common):
    cfg: PokerTaskConfig
    name: str = "poker"
    score: EnvScore = "chips"  # held out: the mean chip change per hand, in big blinds

    def make(self, prompt: Prompt, opponent_policy: Callable[[str], str] | None = None) -> TextEnv:
        from echo2.envs.poker import PokerEnv, TextPolicyOpponent, rule_player
        from echo2.envs.poker_players import Style

        style = str(prompt.meta.get("opponent", "tag"))
        if style == "selfplay":
            if opponent_policy is None:
                raise ValueError(f"{prompt.prompt_id}: a self-play episode needs an opponent policy")
            return PokerEnv(self.cfg, [TextPolicyOpponent(opponent_policy)])
        if style not in RULE_STYLES:
            raise ValueError(f"{prompt.prompt_id}: unknown opponent {style!r}")
        return PokerEnv(self.cfg, [rule_player(cast("Style", style))])

    def draw_meta(self, rng: random.Random) -> dict[str, Any]:
        return {"opponent": rng.choice(self.cfg.opponents)}

    def fixed_meta(self, index: int) -> dict[str, Any]:
        styles = [s for s in self.cfg.opponents if s != "selfplay"] or list(RULE_STYLES)
        return {"opponent": styles[index % len(styles)]}

    def teacher(self, env: TextEnv) -> str:
        from echo2.envs.poker import PokerEnv, rule_player

        assert isinstance(env, PokerEnv)
        rng = random.Random(f"teacher:{env.hero_view().text}")
        return rule_player(self.cfg.warmstart_teacher).act(env.hero_view(), rng)


def env_spec(cfg: GuessTaskConfig | PokerTaskConfig) -> GuessSpec | PokerSpec:
    """The registered spec of an environment config."""
    if isinstance(cfg, PokerTaskConfig):
        return PokerSpec(cfg)
    return GuessSpec(cfg)
