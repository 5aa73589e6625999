"""Typed registry of broadcast strategies: a variant is a new registered class, not another `if`."""

from __future__ import annotations

from echo2.broadcast.pipelined import RelayChain, TreeChains, TreePipelined
from echo2.broadcast.star import StarLimited, StarUnlimited
from echo2.broadcast.strategy import Strategy
from echo2.physics.broadcast import StrategyName, strategy_name


def registry() -> dict[StrategyName, Strategy]:
    """Name -> strategy for every shipped strategy (frozen dataclasses: safe to share); the keys are
    exactly the names of :data:`echo2.physics.broadcast.StrategyName`."""
    shipped: list[Strategy] = [StarUnlimited(), StarLimited(), TreePipelined(), RelayChain(), TreeChains()]
    return {s.name: s for s in shipped}


def get_strategy(name: str) -> Strategy:
    """The strategy called ``name``; ConfigError listing the choices for an unknown name."""
    return registry()[strategy_name(name)]
