"""Where a worker repairs a failed peer's chunks from (broadcast/receiver.py ``_repair``): the failed peer's
stripe ancestor, or the next one up when that one failed here lately too, and the learner when the
chain is exhausted (or loops)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from echo2.broadcast.receiver import NodeCounters, TcpWorkerNode
from echo2.broadcast.strategy import LEARNER


def _node(avoid: set[str]) -> tuple[Any, list[str]]:
    node: Any = object.__new__(TcpWorkerNode)  # only what _repair reads
    asked: list[str] = []
    node.worker_id, node.max_repairs, node.counters = "w", 5, NodeCounters()
    node._avoid = {peer: 9 for peer in avoid}
    node._delayed_pull = lambda transfer, source, chunks, repairs, delay: source
    node._spawn = lambda transfer, source: asked.append(source)
    return node, asked


CHAIN = {"c": "b", "b": "a"}  # c pulls from b, b from a, a from the learner


@pytest.mark.parametrize(
    ("avoid", "failed", "expected", "ancestor_repairs"),
    [
        (set(), "c", "b", 1),  # its own ancestor
        ({"b"}, "c", "a", 1),  # that one failed here lately: the next one up the stripe
        ({"b", "a"}, "c", LEARNER, 0),  # the chain exhausted
        (set(), "a", LEARNER, 0),  # a peer fed by the learner
    ],
)
def test_a_failed_peer_is_repaired_from_the_nearest_usable_ancestor(
    avoid, failed, expected, ancestor_repairs
):
    node, asked = _node(avoid)
    transfer = SimpleNamespace(repair=dict(CHAIN), manifest=SimpleNamespace(version=3))
    node._repair(transfer, [0, 1], failed, repairs=0)
    assert asked == [expected] and node.counters.ancestor_repairs == ancestor_repairs


def test_a_looping_chain_ends_at_the_learner():
    node, asked = _node({"b"})
    transfer = SimpleNamespace(repair={"c": "b", "b": "c"}, manifest=SimpleNamespace(version=3))
    node._repair(transfer, [0], "c", repairs=0)
    assert asked == [LEARNER]
