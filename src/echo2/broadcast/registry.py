"""Typed registry of broadcast strategies: a variant is a new registered class, not another `if`."""

from __future__ import annotations

from echo2.broadcast.pipelined import RelayChain, TreeChains, TreePipelined
from echo2.broadcast.star import StarLimited, StarUnlimited
from echo2.broadcast.strategy import Strategy
from echo2.errors import ConfigError


def registry() -> dict[str, Strategy]:
    """Name -> strategy for every shipped strategy (frozen dataclasses: safe to share)."""
    shipped: list[Strategy] = [StarUnlimited(), StarLimited(), TreePipelined(), RelayChain(), TreeChains()]
    return {s.name: s for s in shipped}


def get_strategy(name: str) -> Strategy:
    strategies = registry()
    if name not in strategies:
        raise ConfigError(f"unknown broadcast strategy {name!r}; choose one of {sorted(strategies)}")
    return strategies[name]
