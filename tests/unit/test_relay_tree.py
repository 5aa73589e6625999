"""Tree-Pipelined's bounded-degree striped relay trees (echo2.broadcast.pipelined.RelayTree): the runtime
plans the topology the physics model times, with every chunk once from the learner, no member above the
degree cap, depth ~log_k N, churn repaired from ancestors and joiners attached; and a 1,000-peer plan run
in-process on the in-memory hub's signed manifest installs everywhere."""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import pytest
from plans import depth as _depth
from plans import sources as _sources

from echo2.broadcast.in_memory import InMemoryHub
from echo2.broadcast.pipelined import RelayTree, TreePipelined
from echo2.broadcast.strategy import LEARNER, REPAIR_HOPS, Plan, repair_sources
from echo2.physics import broadcast as pb
from echo2.weights.manifest import blob_ok, chunk_ok, new_signing_key, verify_manifest


def _connections(plan: Plan) -> Counter[str]:
    """Distinct relay peers per member, from the plan alone: its sources + the members pulling from it."""
    edges = {(a.source, w) for w, pulls in plan.items() for a in pulls if a.source != LEARNER}
    deg: Counter[str] = Counter()
    for src, dst in edges:
        deg[src] += 1
        deg[dst] += 1
    return deg


@pytest.mark.parametrize("n", [16, 33, 100, 1000])
def test_every_chunk_once_from_the_learner_bounded_degree_log_depth(n: int) -> None:
    workers = [f"w{i}" for i in range(n)]
    n_chunks = 64
    plan = TreePipelined().plan(workers, n_chunks)
    src = _sources(plan)
    assert set(src) == {(w, i) for w in workers for i in range(n_chunks)}
    uploads = Counter(src.values())
    k = pb.relay_stripes(np.ones(n), 1.0)
    assert k == 8
    # the learner sends about G: each chunk once, plus a few whole-stripe streams where N % k leaves a
    # stripe short of slots (<= k - 1 extra streams of 1/k of the chunks each)
    assert n_chunks <= uploads[LEARNER] <= n_chunks * (1 + (k - 1) / k)
    # every member uploads about G (k children x 1/k of the chunks), never more than k x its stripe
    assert max(uploads[w] for w in workers) <= k * (n_chunks // k) * 1.25
    assert max(_connections(plan).values()) <= pb.DEFAULT_MAX_PEERS
    depth = max(_depth(src, w, i) for w in workers for i in range(n_chunks))
    assert depth <= pb.complete_tree_hops(n, k) + 2


def test_the_runtime_plans_the_physics_layout() -> None:
    # one topology: the runtime's parents are relay_layout's on equal links, stripe by stripe
    workers = [f"w{i}" for i in range(50)]
    tree = RelayTree(workers)
    lay = pb.relay_layout(np.ones(50), 1.0)
    assert tree.stripes == lay.stripes
    for s in range(lay.stripes):
        want = {workers[i]: (LEARNER if p < 0 else workers[p]) for i, p in enumerate(lay.parent[s].tolist())}
        assert tree.parent[s] == want
    assert tree.depth() == lay.depth()
    # and the model times that same layout: T_bcast within 1.25 x T* at the speed case's links
    t = pb.relay_times(1.2e9, np.full(50, 25e6), 125e6, layout=pb.relay_layout(np.full(50, 25e6), 125e6))
    assert t.max() <= 1.25 * pb.lower_bound(1.2e9, 125e6, 25e6, 50)


@pytest.mark.parametrize("n", [8, 16, 100, 1000])
def test_a_failed_peers_chunks_are_asked_of_its_stripe_ancestors_in_order(n: int) -> None:
    """The announcement's repair sources: for each peer a member pulls from, that peer's own source for
    those chunks, then that one's, nearest first, at least ``REPAIR_HOPS`` of them where the tree has
    them, up to the learner (never named: the last resort); where the chunks came to a peer from several
    sources (a member pulling two stripes from one peer) the chain stops. Here only at N = 1,000 is a
    chain cut short of the learner."""
    workers = [f"w{i}" for i in range(n)]
    plan = TreePipelined().plan(workers, 64)
    src, ups = _sources(plan), repair_sources(plan)
    asked = stopped = cut = 0
    for w, pulls in plan.items():
        for a in pulls:
            expect, x = [], a.source
            while x != LEARNER:
                above = {src[(x, i)] for i in a.chunks}
                if len(above) > 1:
                    stopped += 1
                    break
                x = above.pop()
                if x != LEARNER:
                    expect.append(x)
            chain, peer = [], a.source
            while peer in ups[w]:
                peer = ups[w][peer]
                chain.append(peer)
            assert chain == expect[: len(chain)] and len(chain) >= min(len(expect), REPAIR_HOPS)
            cut += len(chain) < len(expect)
            asked += len(chain)
    k = pb.relay_stripes(np.ones(n), 1.0)
    assert asked > 0 if n > k else asked == 0  # depth 2 (n <= k): every peer's source is the learner
    assert stopped <= 0.05 * sum(len(p) for p in plan.values())  # the rare two-stripe pull
    assert (cut > 0) == (n == 1000)


def test_a_departed_relay_is_repaired_from_its_ancestors() -> None:
    workers = [f"w{i}" for i in range(200)]
    tree = RelayTree(workers)
    victim = tree.children[0][LEARNER][0]  # stripe 0's root: it relays stripe 0 to up to k children
    before = [dict(p) for p in tree.parent]
    orphans = [list(kids.get(victim, [])) for kids in tree.children]
    tree.remove(victim)
    assert victim not in tree.members and len(tree.members) == 199
    for s, par in enumerate(tree.parent):
        for w, src in par.items():
            if w in orphans[s]:
                # re-attached to a member with a free slot (the departed one's parents in the other
                # stripes each freed one) or the learner, never inside its own subtree (checked below)
                assert src != victim
            else:
                assert src == before[s][w]  # nobody else moved
    assert tree.repairs == sum(len(o) for o in orphans)
    assert max(tree.degree(w) for w in tree.members) <= pb.DEFAULT_MAX_PEERS
    plan = tree.plan(40)
    src = _sources(plan)
    assert set(src) == {(w, i) for w in tree.members for i in range(40)}
    for w in tree.members:
        for i in range(40):
            _depth(src, w, i)
    # the learner feeds at most the stripes' roots plus the orphans of a root (here: the departed root's
    # own stripe), fewer when peers adopt them
    assert tree.learner_streams() <= tree.stripes + len(orphans[0])


def test_a_mid_tree_departure_reuses_the_parents_freed_slot() -> None:
    workers = [f"w{i}" for i in range(200)]
    tree = RelayTree(workers)
    s = 3
    mid = next(w for w in tree.children[s] if w != LEARNER and tree.parent[s][w] != LEARNER)
    up = tree.parent[s][mid]
    first = tree.children[s][mid][0]
    tree.remove(mid)
    assert tree.parent[s][first] == up  # the parent's slot went to the departed member's first child


def test_a_joiner_is_attached_without_moving_anyone() -> None:
    workers = [f"w{i}" for i in range(100)]
    strategy = TreePipelined()
    strategy.plan(workers, 16)
    tree = strategy.tree(workers)
    before = [dict(p) for p in tree.parent]
    strategy.plan([*workers, "new"], 16)
    after = strategy.tree([*workers, "new"])
    assert after is tree  # kept, not rebuilt
    for s in range(tree.stripes):
        assert {w: after.parent[s][w] for w in workers} == before[s]
        assert after.parent[s]["new"] != "new"
    src = _sources(after.plan(16))
    assert all((("new", i) in src) for i in range(16))
    assert max(after.degree(w) for w in after.members) <= pb.DEFAULT_MAX_PEERS
    # a leave through the strategy: the departed member is cut out, the tree kept
    strategy.plan([w for w in [*workers, "new"] if w != "w5"], 16)
    assert strategy.tree([w for w in [*workers, "new"] if w != "w5"]) is tree


def test_small_pools_keep_the_former_all_to_all_plan() -> None:
    # N <= 8: k = N stripes, each rooted at one member that feeds every other (depth 2)
    workers = [f"w{i}" for i in range(6)]
    src = _sources(TreePipelined().plan(workers, 60))
    assert Counter(src.values())[LEARNER] == 60
    assert max(_depth(src, w, i) for w in workers for i in range(60)) == 2


def test_thousand_peers_in_process_on_the_in_memory_hub() -> None:
    """N = 1,000 peers, G = 256 KiB in 64 chunks: the hub signs the manifest and counts acks; every peer
    pulls each chunk from its planned source only once that source holds it (store and forward), checks
    it against the manifest, assembles, verifies the blob and acks. Every install completes, and no peer
    holds more than the degree cap of relay connections."""
    n, chunk = 1000, 4096
    blob = np.random.default_rng(0).integers(0, 256, 64 * chunk, dtype=np.uint8).tobytes()
    workers = [f"p{i}" for i in range(n)]
    plan = TreePipelined().plan(workers, 64)
    assert max(_connections(plan).values()) <= pb.DEFAULT_MAX_PEERS

    async def main() -> int:
        key = new_signing_key()
        hub = InMemoryHub(key, chunk)
        receivers = {w: hub.receiver(w) for w in workers}
        manifest = await hub.publish(1, blob)
        verify_manifest(manifest, key.verifier())
        have: dict[str, dict[int, bytes]] = {w: {} for w in workers}
        ready: dict[tuple[str, int], asyncio.Event] = {
            (w, i): asyncio.Event() for w in workers for i in range(64)
        }

        async def pull(w: str, source: str, chunks: tuple[int, ...]) -> None:
            for i in chunks:
                if source == LEARNER:
                    lo, hi = manifest.chunk_range(i)
                    data = blob[lo:hi]
                else:
                    await ready[(source, i)].wait()
                    data = have[source][i]
                assert chunk_ok(manifest, i, data)
                have[w][i] = data
                ready[(w, i)].set()

        async def peer(w: str) -> None:
            await asyncio.gather(*(pull(w, a.source, a.chunks) for a in plan[w]))
            got = b"".join(have[w][i] for i in range(64))
            assert blob_ok(manifest, got)
            await receivers[w].report_installed(1)

        await asyncio.wait_for(asyncio.gather(*(peer(w) for w in workers)), 60)
        stats = await hub.wait_installed(1, timeout=5)
        await hub.close()
        return len(stats.install_s)

    assert asyncio.run(main()) == n


@pytest.mark.parametrize("n_chunks", [3, 64])
def test_repair_sources_from_the_parent_maps_are_those_of_the_chunk_lists(n_chunks: int) -> None:
    """The publisher asks the strategy for the repair sources (``strategy.repairs_of``): Tree-Pipelined
    reads them off its parent maps in O(N k depth), and they equal the chunk lists' (``repair_sources``)
    on fresh trees, through departures and joiners, with demoted leaves beside the trees, and with fewer
    chunks than stripes; a plan of other trees gets the chunk lists' answer."""
    from echo2.broadcast.pipelined import _planned_by
    from echo2.broadcast.strategy import plan_with_leaves, repairs_of

    strategy = TreePipelined()
    rng = np.random.default_rng(7)
    members = [f"w{i}" for i in range(300)]
    for round_ in range(6):
        leaves = frozenset(members[j] for j in rng.choice(len(members), 5, replace=False))
        plan = plan_with_leaves(strategy, members, leaves, n_chunks)
        assert strategy._cache.tree is not None and _planned_by(strategy._cache.tree, plan, n_chunks)
        fast = repairs_of(strategy, plan, n_chunks)  # from the parent maps
        assert fast == repair_sources(plan), round_
        assert any(fast.values())  # 300 members: trees deeper than 2, chains to walk
        gone = set(rng.choice(members, 20, replace=False).tolist())
        members = [w for w in members if w not in gone] + [f"x{round_}-{i}" for i in range(25)]
    other = TreePipelined().plan([f"y{i}" for i in range(50)], n_chunks)  # not the cached trees
    assert not _planned_by(strategy._cache.tree, other, n_chunks)
    assert repairs_of(strategy, other, n_chunks) == repair_sources(other)


@pytest.mark.parametrize("n_chunks", [5, 96])
def test_a_churned_trees_plan_is_updated_only_where_it_changed_and_equals_a_fresh_one(n_chunks: int) -> None:
    """A relay tree keeps its plan and repair sources for the next version: after departures (relays
    with children among them, so orphans re-attach and chains move) and joiners, only the members the
    churn touched are planned again, and the plan and the repair sources equal those computed afresh on
    the same trees, every round; a change of chunk count plans everything again."""
    import copy

    rng = np.random.default_rng(11)
    members = [f"w{i}" for i in range(1000)]
    tree = RelayTree(members)
    calls = [0]
    pulls = RelayTree._pulls

    def counted(self, w, live):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return pulls(self, w, live)

    RelayTree._pulls = counted  # type: ignore[method-assign]
    try:
        tree.plan(n_chunks)
        first = calls[0]
        for round_ in range(8):
            relays = [w for w in tree.members if any(kids.get(w) for kids in tree.children)]
            for w in [rng.choice(relays), rng.choice(tree.members)]:
                tree.remove(str(w))
            for i in range(2):
                tree.add(f"x{round_}-{i}")
            calls[0] = 0
            plan, repair = tree.plan(n_chunks), tree.repair_sources(n_chunks)
            assert calls[0] < first / 4, (round_, calls[0])  # the touched members only
            fresh = copy.deepcopy(tree)
            fresh._memo = None
            assert plan == fresh.plan(n_chunks), round_
            assert repair == fresh.repair_sources(n_chunks), round_
            assert set(plan) == set(tree.members) and any(repair.values())
        calls[0] = 0
        tree.plan(n_chunks + 1)
        assert calls[0] >= len(tree.members)  # another chunk count: everything again
    finally:
        RelayTree._pulls = pulls  # type: ignore[method-assign]


class _WalkedTree:
    """The relay tree's choices of a new source as first written: a breadth-first walk of the whole
    stripe from the learner, every member's out-degree summed over the stripes (the oracle of the next
    test; O(N) a choice, ~20 s of churn at 10,000 members)."""

    @staticmethod
    def shallowest_free(tree, par, kids):  # type: ignore[no-untyped-def]
        queue, i = list(kids.get(LEARNER, ())), 0
        while i < len(queue):
            x = queue[i]
            i += 1
            if _out(tree, x) < tree.capacity.get(x, 0) and tree._free(x):
                return x
            queue.extend(kids.get(x, ()))
        return LEARNER

    @staticmethod
    def adopter(tree, par, kids, child, up):  # type: ignore[no-untyped-def]
        def can(x):  # type: ignore[no-untyped-def]
            return _out(tree, x) < tree.capacity.get(x, 0) and tree._free(x) and tree._connects(child, x)

        anc = up
        while anc != LEARNER:
            if can(anc):
                return anc
            anc = par[anc]
        queue, i = list(kids.get(LEARNER, ())), 0
        while i < len(queue):
            x = queue[i]
            i += 1
            if x != child:
                if can(x):
                    return x
                queue.extend(kids.get(x, ()))
        return LEARNER


def _out(tree, x):  # type: ignore[no-untyped-def]
    return sum(len(kids.get(x, ())) for kids in tree.children)


@pytest.mark.parametrize("n", [40, 700])
def test_churn_picks_the_sources_a_walk_of_the_whole_tree_picks(n: int) -> None:
    """Joiners and orphans take the source a breadth-first walk from the learner meets first (read off
    the few members with a free slot instead of walking every member): through rounds of departures
    (relays with children among them) and joins, the trees equal the walking oracle's at every step,
    and the kept out-degrees equal the children counted."""
    rng = np.random.default_rng(n)
    members = [f"w{i}" for i in range(n)]
    fast, walked = RelayTree(members), RelayTree(members)  # walked: changed by the oracle alone
    oracle = _WalkedTree()

    def add(w: str) -> None:
        counts = [0] * walked.stripes
        for h in walked.home.values():
            if h >= 0:
                counts[h] += 1
        walked.home[w] = counts.index(min(counts))
        walked.capacity[w] = min(walked.stripes, walked.max_peers - walked.stripes)
        for par, kids in zip(walked.parent, walked.children, strict=True):
            src = oracle.shallowest_free(walked, par, kids)
            par[w] = src
            kids.setdefault(src, []).append(w)

    def remove(w: str) -> None:
        cut = []
        for par, kids in zip(walked.parent, walked.children, strict=True):
            up = par.pop(w)
            kids[up].remove(w)
            orphans = kids.pop(w, [])
            for child in orphans:
                par[child] = LEARNER
            cut.append((up, orphans))
        for (up, orphans), par, kids in zip(cut, walked.parent, walked.children, strict=True):
            for child in orphans:
                src = oracle.adopter(walked, par, kids, child, up)
                par[child] = src
                kids.setdefault(src, []).append(child)
        walked.capacity.pop(w, None)
        walked.home.pop(w, None)

    for round_ in range(6):
        relays = [w for w in fast.members if any(kids.get(w) for kids in fast.children)]
        for w in [*rng.choice(relays, 2, replace=False).tolist(), *rng.choice(fast.members, 3).tolist()]:
            if w in fast.parent[0]:
                fast.remove(w)
                remove(w)
        for i in range(5):
            fast.add(f"x{round_}-{i}")
            add(f"x{round_}-{i}")
        assert fast.parent == walked.parent and fast.children == walked.children, round_
        assert all(fast.out_degree(w) == _out(fast, w) for w in fast.members)
        assert fast._open == {w for w in fast.members if _out(fast, w) < fast.capacity[w]}
        assert fast._relays == [sum(h == st for h in fast.home.values()) for st in range(fast.stripes)]
        assert fast.home == walked.home


def test_declared_upload_rates_shape_the_trees_as_the_model_does() -> None:
    """When every relay declared its upload rate, Tree-Pipelined builds the model's trees
    (``relay_layout`` over those rates: the fast workers relay near the root), keeps them while fewer
    than ``RELINK_SHARE`` of the members joined or left, and builds them afresh past that; one relay
    without a rate and the trees take every link as equal, as before."""
    from echo2.broadcast.pipelined import RELINK_SHARE
    from echo2.broadcast.strategy import plan_with_leaves

    rng = np.random.default_rng(3)
    mbit = 1e6 / 8
    workers = [f"w{i}" for i in range(300)]
    links = {w: float(rng.choice([200, 100, 1000], p=[0.6, 0.25, 0.15])) * mbit for w in workers}
    strategy = TreePipelined()
    plan = plan_with_leaves(strategy, workers, frozenset(), 64, links, 1000 * mbit)
    tree = strategy._cache.tree
    assert tree is not None and strategy._cache.linked
    model = pb.relay_layout(np.array([links[w] for w in workers]), 1000 * mbit)
    roots = {workers[i] for s in range(model.stripes) for i in np.flatnonzero(model.parent[s] < 0)}
    assert {w for kids in tree.children for w in kids.get(LEARNER, [])} == roots
    assert all(links[w] == 1000 * mbit for w in roots)  # the learner feeds 1 Gbit workers
    lay = tree.layout(workers)  # the runtime's trees, as the model times them: the model's own
    assert (lay.parent == model.parent).all() and lay.depth() == model.depth()
    b = np.array([links[w] for w in workers])
    assert np.allclose(
        pb.relay_times(1.2e9, b, 1000 * mbit, layout=lay), pb.relay_times(1.2e9, b, 1000 * mbit)
    )
    blind = TreePipelined()
    plan_with_leaves(blind, workers, frozenset(), 64, {**links, workers[0]: None}, 1000 * mbit)
    assert blind._cache.tree is not None and not blind._cache.linked
    few = int(RELINK_SHARE * len(workers)) // 2
    joined = [*workers, *(f"x{i}" for i in range(few))]
    links.update({w: 200 * mbit for w in joined[len(workers) :]})
    plan_with_leaves(strategy, joined, frozenset(), 64, links, 1000 * mbit)
    assert strategy._cache.tree is tree  # a few joiners: attached where there is room
    more = [*joined, *(f"y{i}" for i in range(few + 1))]
    links.update({w: 200 * mbit for w in more[len(joined) :]})
    plan_with_leaves(strategy, more, frozenset(), 64, links, 1000 * mbit)
    assert strategy._cache.tree is not tree and set(strategy._cache.built) == set(more)  # built afresh
    assert set(plan) == set(workers)
