"""The strategy seam: who pulls which chunk from whom (SPEC §4).

A strategy turns the membership of one version (ordered worker ids) and the chunk count into a
:data:`Plan`: for every worker, an ordered list of (source, chunks) pulls. The node code is the same for
every strategy; only the plan differs. ``LEARNER`` names the publisher as a source.

A strategy's registry key is a :data:`echo2.physics.broadcast.StrategyName`; its predicted times and the
lower bound ``T*`` live in :mod:`echo2.physics.broadcast` (bytes and bytes/s, like this package).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from echo2.physics.broadcast import StrategyName

LEARNER = "learner"


@dataclass(frozen=True)
class Assignment:
    """One pull stream of a worker: these chunks, in this order, from this source."""

    source: str  # node id to pull from (LEARNER for the publisher)
    chunks: tuple[int, ...]  # chunk indices, ascending


Plan = dict[str, tuple[Assignment, ...]]  # worker id -> its pull streams


class Strategy(Protocol):
    """A dissemination strategy: a pure function from membership to a plan."""

    @property
    def name(self) -> StrategyName:
        """Registry key, e.g. "tree-pipelined"."""
        ...

    @property
    def learner_uplink_capped(self) -> bool:
        """False only for the Star-Unlimited reference (learner uplink left uncapped on the harness)."""
        ...

    def plan(self, workers: Sequence[str], n_chunks: int) -> Plan: ...

    def learner_stream_rate(self, n: int, b0: float, bw: float) -> float | None:
        """Cap (bytes/s) on each learner pull stream given N, B0, B_w in bytes/s; None = no cap."""
        ...


@runtime_checkable
class LinkAware(Protocol):
    """A strategy that shapes its plan to the members' upload rates where it knows them."""

    def plan_over_links(
        self, workers: Sequence[str], n_chunks: int, links: Mapping[str, float], b0: float | None
    ) -> Plan:
        """:meth:`Strategy.plan` with every worker's upload rate (bytes/s) and the learner's (None:
        unknown)."""
        ...


def plan_with_leaves(
    strategy: Strategy,
    members: Sequence[str],
    leaves: Collection[str],
    n_chunks: int,
    links: Mapping[str, float | None] | None = None,
    b0: float | None = None,
) -> Plan:
    """The plan of one version when some members may no longer relay (``leaves``: the publisher demoted
    them after stall reports, ``publisher.py``): ``strategy`` plans over the other members, in their
    order, and every leaf pulls every chunk straight from the learner. Nobody pulls from a leaf, so a
    leaf's chunks cost the learner G each instead of costing its peers a stall. Where the strategy is
    :class:`LinkAware` and ``links`` names an upload rate for every relay, it plans over them."""
    relays = [w for w in members if w not in leaves]
    rates = {w: r for w in relays if links is not None and (r := links.get(w)) is not None}
    if relays and isinstance(strategy, LinkAware) and len(rates) == len(relays):
        plan = strategy.plan_over_links(relays, n_chunks, rates, b0)
    else:
        plan = strategy.plan(relays, n_chunks) if relays else {}
    every = (Assignment(LEARNER, tuple(range(n_chunks))),)
    return {w: plan.get(w, every) for w in members}


REPAIR_HOPS = 2  # stripe ancestors above a failed peer a member is told to ask before the learner


def repair_sources(plan: Plan) -> dict[str, dict[str, str]]:
    """For every member, each peer it pulls from -> where that peer pulls those chunks from, and so on
    up its stripe, at most ``REPAIR_HOPS`` ancestors above the peer (the learner is never named): a
    member repairs a failed peer's chunks from the peer's own source, an ancestor that holds them
    before the failed peer did, and asks the learner only when the chain is exhausted. A peer whose
    chunks for the member come from several sources ends the chain there (the learner repairs them).
    The cap bounds whom a relay serves (about the members below it within ``REPAIR_HOPS + 1`` levels,
    ``k + k^2 + k^3`` for fan-out k, whatever N is: 580 at N = 10,000, k = 8) and so its
    announcement's ``serve`` list; it cuts only the chains of members more than 4 levels below the
    learner (fleets of hundreds at k = 8), whose learner repairs what 3 failed relays in a row leave."""
    source_of = {w: {i: a.source for a in pulls for i in a.chunks} for w, pulls in plan.items()}
    out: dict[str, dict[str, str]] = {}
    for w, pulls in plan.items():
        ups: dict[str, str] = {}
        for a in pulls:
            if a.chunks:
                climb(ups, w, a.source, lambda p, ch=a.chunks: {source_of.get(p, {}).get(i) for i in ch})
        out[w] = ups
    return out


def climb(ups: dict[str, str], member: str, peer: str, above: Callable[[str], set[str | None]]) -> None:
    """Record in ``ups`` the chain above ``peer`` for one pull of ``member``: ``above(p)`` is where
    ``p`` gets that pull's chunks (one source: the next link; several: the chain ends), at most
    ``REPAIR_HOPS`` links, never the learner or ``member`` itself, ending where ``ups`` already goes on
    (another pull's chain)."""
    hops = 0
    while peer != LEARNER and peer not in ups and hops < REPAIR_HOPS:
        sources = above(peer)
        up = sources.pop() if len(sources) == 1 else None
        if up is None or up in (LEARNER, member):
            break
        ups[peer] = peer = up
        hops += 1


@runtime_checkable
class TreeRepairs(Protocol):
    """A strategy that derives :func:`repair_sources` of its own plans from its trees (cheaper than from
    the chunk lists)."""

    def repair_sources(self, plan: Plan, n_chunks: int) -> dict[str, dict[str, str]]: ...


def repairs_of(strategy: Strategy, plan: Plan, n_chunks: int) -> dict[str, dict[str, str]]:
    """:func:`repair_sources` of ``plan`` (made by ``strategy`` over ``n_chunks`` chunks), from the
    strategy's trees where it keeps them."""
    if isinstance(strategy, TreeRepairs):
        return strategy.repair_sources(plan, n_chunks)
    return repair_sources(plan)
