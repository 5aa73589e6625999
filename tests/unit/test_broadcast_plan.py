"""Strategy plans: coverage, learner load, per-worker upload balance, tree depth; the registry (the bounds
and predicted times are echo2.physics.broadcast, tested in test_physics.py)."""

from __future__ import annotations

from collections import Counter

import pytest
from plans import depth as _depth
from plans import sources as _sources

from echo2.broadcast.factory import get_strategy, registry
from echo2.broadcast.pipelined import RelayChain, TreeChains, TreePipelined, striped_tree_plan
from echo2.broadcast.star import StarLimited, StarUnlimited
from echo2.broadcast.strategy import LEARNER
from echo2.errors import ConfigError
from echo2.physics.broadcast import STRATEGY_NAMES, homogeneous_time, lower_bound


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16, 33])
@pytest.mark.parametrize("strategy", [TreePipelined(), TreeChains(), StarLimited(), StarUnlimited()])
def test_every_worker_gets_every_chunk_from_a_tree_rooted_at_the_learner(n: int, strategy) -> None:
    workers = [f"w{i}" for i in range(n)]
    n_chunks = 5 * n + 3
    src = _sources(strategy.plan(workers, n_chunks))
    assert set(src) == {(w, i) for w in workers for i in range(n_chunks)}
    for w in workers:
        for i in range(n_chunks):
            _depth(src, w, i)  # terminates at the learner: no cycles, no orphans


@pytest.mark.parametrize("n", [4, 8])
def test_tree_pipelined_learner_sends_each_chunk_once_and_workers_share_upload(n: int) -> None:
    # N <= max_peers // 2: the relay trees are the former all-to-all plan (larger N: test_relay_tree.py)
    workers = [f"w{i}" for i in range(n)]
    n_chunks = 10 * n
    src = _sources(TreePipelined().plan(workers, n_chunks))
    uploads = Counter(src.values())
    # The learner's narrow uplink carries G once: n_chunks chunk-sends in total.
    assert uploads[LEARNER] == n_chunks
    # Every worker relays (N-1)/N of the snapshot: stripe of 10 chunks to each of the N-1 others.
    assert all(uploads[w] == 10 * (n - 1) for w in workers)
    # Depth 2: learner -> stripe owner -> everyone else.
    assert max(_depth(src, w, i) for w in workers for i in range(n_chunks)) == 2


def test_chains_have_fan_out_one_and_depth_n() -> None:
    workers = ["a", "b", "c", "d"]
    plan = TreeChains().plan(workers, 8)
    # one stream from the learner (own stripe) and one from the ring predecessor (everything else)
    assert [(a.source, a.chunks) for a in plan["b"]] == [(LEARNER, (1, 5)), ("a", (0, 2, 3, 4, 6, 7))]
    src = _sources(plan)
    assert max(_depth(src, w, i) for w in workers for i in range(8)) == 4
    chain = RelayChain().plan(workers, 3)
    assert [a.source for a in chain["d"]] == ["c"] and [a.source for a in chain["a"]] == [LEARNER]


def test_fanout_two_is_a_binary_tree() -> None:
    workers = [f"w{i}" for i in range(7)]
    src = _sources(striped_tree_plan(workers, 7, fanout=2))
    # 7 nodes in a binary heap: depths 1, 2, 2, 3, 3, 3, 3
    assert sorted(_depth(src, w, 0) for w in workers) == [1, 2, 2, 3, 3, 3, 3]


def test_star_pulls_everything_from_the_learner() -> None:
    plan = StarLimited().plan(["a", "b"], 4)
    assert all(p[0].source == LEARNER and p[0].chunks == (0, 1, 2, 3) for p in plan.values())
    assert StarUnlimited().learner_uplink_capped is False and StarLimited().learner_uplink_capped is True


def test_bounds_in_the_harness_units() -> None:
    # the harness works in bytes and bytes/s like echo2.physics: G = 100 MB, B_w = 12.5 MB/s (100 Mbit),
    # B0 = 37.5 MB/s (300 Mbit). T*(N=4) = max(8, 2.67, 4.57) = 8 s; Star-Limited N=16: 16*100/37.5 = 42.67 s
    g, bw, b0 = 100e6, 12.5e6, 37.5e6
    assert lower_bound(g, b0, bw, 4) == pytest.approx(8.0)
    assert homogeneous_time("star-limited", g, b0, bw, 16) == pytest.approx(42.666, rel=1e-3)


def test_registry_holds_every_strategy_name_and_rejects_others() -> None:
    assert tuple(registry()) == STRATEGY_NAMES
    for name in STRATEGY_NAMES:
        assert get_strategy(name).name == name
    with pytest.raises(
        ConfigError, match="unknown broadcast strategy 'gossip'; choose one of star-unlimited"
    ):
        get_strategy("gossip")
