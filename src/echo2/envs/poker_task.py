"""No-Limit Texas Hold'em as a task: its ``[task]`` config, its spec and its ``--task poker`` preset.

The poker environment's declaration (``envs/base.py``): :data:`POKER`, listed once in
``envs/roster.ENVIRONMENTS``. The table itself (``envs/poker.py``) and its rule-based players
(``envs/poker_players.py``) run on pokerkit, which takes most of a second to import; the config tree
imports this module, so the spec imports them only when it builds a table or asks its teacher.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from pydantic import Field, model_validator

from echo2.envs.base import Environment, EnvironmentFields, EnvKnobs, EnvScore, TextEnv

if TYPE_CHECKING:
    from collections.abc import Callable

    from echo2.envs.poker_players import Style
    from echo2.types import Prompt

PokerOpponent = Literal["tag", "station", "lag", "selfplay"]
# the rule-based tables; add "selfplay" to train against earlier snapshots too (docs/environments.md:
# against the tag-imitating warm start it rewards bluffing, which the station and lag punish)
POKER_OPPONENTS: tuple[PokerOpponent, ...] = ("tag", "station", "lag")
RULE_STYLES: tuple[Literal["tag", "station", "lag"], ...] = ("tag", "station", "lag")


class PokerTaskConfig(EnvironmentFields):
    """No-Limit Texas Hold'em on pokerkit (``envs/poker.py``): one hand per episode, the return is the
    hero's chip change in big blinds."""

    name: Literal["poker"] = "poker"
    players: int = Field(2, ge=2, le=6, description="seats at the table: 2 = heads-up, 6 = 6-max")
    stack_bb: int = Field(20, ge=2, le=1000, description="starting stack of every seat, in big blinds")
    small_blind: int = Field(1, ge=1, description="small blind, in chips")
    big_blind: int = Field(2, ge=2, description="big blind, in chips")
    opponents: list[PokerOpponent] = Field(
        default_factory=lambda: list(POKER_OPPONENTS),
        min_length=1,
        description="styles training tables draw opponents from (selfplay: an earlier snapshot)",
    )
    selfplay_every: int = Field(
        20, ge=1, description="a worker keeps every this-many-th installed version as a self-play opponent"
    )
    selfplay_pool: int = Field(3, ge=1, le=16, description="earlier snapshots a worker keeps as opponents")
    eval_deals: int = Field(
        250, ge=1, description="deals per opponent in evaluation; each is played from every seat (duplicate)"
    )
    warmstart_teacher: Literal["tag", "station", "lag"] = Field(
        "tag", description="the rule-based player the warm start imitates"
    )

    @model_validator(mode="after")
    def _check(self) -> PokerTaskConfig:
        if self.big_blind <= self.small_blind:
            raise ValueError(f"big_blind={self.big_blind} must exceed small_blind={self.small_blind}")
        return self


@dataclass(frozen=True)
class PokerSpec(EnvKnobs):
    """What the task adapter asks of poker (``data/tasks/environment.EnvSpec``): a table against the
    prompt's opponent, the opponents a training deal draws, the rule-based teacher of the warm start."""

    cfg: PokerTaskConfig
    score: EnvScore = "chips"  # held out: the mean chip change per hand, in big blinds

    def make(self, prompt: Prompt, opponent_policy: Callable[[str], str] | None = None) -> TextEnv:
        from echo2.envs.poker import PokerEnv, TextPolicyOpponent, rule_player

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


POKER = Environment(
    PokerTaskConfig,
    PokerSpec,
    packages=("pokerkit",),  # the game state its episodes are played on (a worker's must be the learner's)
    preset=(
        "model.embedded.max_positions=320",  # a hand of up to 6 decisions of <= 60-character observations
        "task.max_turns=6",
        "task.illegal_penalty=1.0",  # a big blind per illegal action: the fallback is often harmless
        "sampling.max_new_tokens=2",  # one action letter and EOS
        "model.warmstart.target_accuracy=0.9",  # agreement with the rule-based teacher's decisions
        "model.warmstart.batch_size=32",
        "batch.prompts=8",  # 8 deals x 16 hands each: a group of 16 sees more than one line of play
        "batch.group_size=16",
        "grpo.lr=5e-4",
        "train.eval_size=200",
        "train.max_minutes=12",
    ),
)
