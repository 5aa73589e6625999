"""Tree-Pipelined (ECHO-2): striped, chunked store-and-forward relay trees of bounded degree (SPEC §4).

Design (docs/broadcast.md derives it; :func:`echo2.physics.broadcast.relay_layout` builds it, so the
planner's and the simulator's times come from the very topology the runtime plans). The chunks are dealt
round-robin into ``k`` stripes; stripe s is a tree over all N workers fed by the learner at its root:

    k = min(N, max_peers // 2)   (links unknown: equal; echo2.physics.broadcast.relay_stripes)
    each worker relays in one stripe (its home) to up to k children, and is a leaf in the others

so the learner sends each chunk once (G over B0), every worker uploads about G, holds at most
``max_peers`` relay connections (k parents + k children), and a chunk crosses ``~log_k N`` relays.
At N <= max_peers // 2 this is exactly the former default: N stripes, each rooted at one worker that
forwards it to all N - 1 others (depth 2). Each relay forwards a chunk as soon as it has verified it.

Membership changes between versions (:class:`RelayTree`, the ledger's targets being the input): a
member that left is cut out and each of its children, in every stripe, re-attached to the nearest
ancestor with a free connection (its parent first, which just lost one; the learner last); a joiner is
attached as a leaf under the shallowest relay with a free slot in every stripe, and becomes a relay of
the stripe with the fewest. The tree is rebuilt only when the learner feeds more than twice the stripes.

Rate matching: stripe s leaves its root at about B_w/k (the root's uplink carries its k children's
streams of 1/k of G each). Feeding the root faster gains nothing and, while the learner streams,
overloads the root's downlink, which costs TCP losses at small N. So when the publisher knows the link
rates, each learner stream is capped at ``RATE_MATCH * B_w / k`` (and never below B0/k's fair share
when B0 < B_w, where the learner link is the bottleneck anyway).

``tree-chains`` (fan-out-1 rotated chains) and ``relay-chain`` (one chain) keep the rotated-stripe plan
of :func:`striped_tree_plan`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from echo2.broadcast.strategy import LEARNER, REPAIR_HOPS, Assignment, Plan, climb, repair_sources
from echo2.errors import ConfigError
from echo2.physics.broadcast import (
    DEFAULT_MAX_PEERS,
    LEARNER_INDEX,
    RelayLayout,
    StrategyName,
    relay_layout,
    relay_stripes,
)

RATE_MATCH = 1.1  # learner stripe streams run this much above B_w/k (slack for jitter)
RELINK_SHARE = 0.1  # link-shaped trees are built afresh once this share of members joined or left
RELINK_FACTOR = 2.0  # ... or a member's link moved by more than this factor


def matched_stream_rate(n: int, b0: float, bw: float, stripes: int | None = None) -> float | None:
    """Per-stripe learner stream cap in bytes/s for ``stripes`` = k stripes (default N, the rotated
    plans); None when a cap cannot help (one stripe)."""
    k = n if stripes is None else stripes
    if k <= 1:
        return None
    return max(RATE_MATCH * bw / k, b0 / k) if b0 < bw else RATE_MATCH * bw / k


class RelayTree:
    """Striped relay trees over a changing membership; :meth:`plan` turns them into pulls.

    Built by :func:`echo2.physics.broadcast.relay_layout` (links unknown: all equal), then kept across
    versions: :meth:`remove` repairs a departed member's subtrees from its ancestors, :meth:`add`
    attaches a joiner without touching anyone else's parent. No member ever holds more than
    ``max_peers`` relay connections (:meth:`degree`)."""

    def __init__(
        self,
        workers: Sequence[str],
        max_peers: int = DEFAULT_MAX_PEERS,
        links: Mapping[str, float] | None = None,
        b0: float | None = None,
    ) -> None:
        if len(set(workers)) != len(workers):
            raise ConfigError("relay tree members must be unique")
        self.max_peers = max_peers
        ids = list(workers)
        n = len(ids)
        self.stripes = 1
        self.parent: list[dict[str, str]] = []  # per stripe: member -> its source (LEARNER for a root)
        self.children: list[dict[str, list[str]]] = []  # per stripe: source -> members it feeds
        self.capacity: dict[str, int] = {}  # children a member may serve over all stripes
        self.home: dict[str, int] = {}  # the stripe a member relays in (-1: a leaf everywhere)
        self.repairs = 0  # children re-attached after a departure (cumulative)
        self._memo: _PlanMemo | None = None  # the last plan and repair sources, for the next version
        self._moved: list[set[str]] = []  # per stripe: members whose parent there changed since
        self._gone: set[str] = set()  # members removed since
        self._out: dict[str, int] = {}  # out_degree of every member, kept as the trees change
        self._open: set[str] = set()  # members with a free child slot (out_degree < capacity)
        self._relays: list[int] = [0]  # per stripe: members whose home it is
        if n == 0:
            return
        b = np.array([links[w] for w in ids] if links else np.ones(n), dtype=float)
        lay = relay_layout(b, float(b0) if b0 else float(np.median(b)), max_peers)
        self.stripes = lay.stripes
        for s in range(lay.stripes):
            par = {ids[i]: (LEARNER if p < 0 else ids[p]) for i, p in enumerate(lay.parent[s].tolist())}
            kids: dict[str, list[str]] = {}
            for i in lay.order[s].tolist():  # breadth first: children listed shallowest first
                kids.setdefault(par[ids[i]], []).append(ids[i])
            self.parent.append(par)
            self.children.append(kids)
        self.capacity = {w: int(c) for w, c in zip(ids, lay.capacity.tolist(), strict=True)}
        self.home = {w: int(h) for w, h in zip(ids, lay.home.tolist(), strict=True)}
        self._moved = [set() for _ in range(lay.stripes)]
        self._relays = [0] * lay.stripes
        for h in self.home.values():
            if h >= 0:
                self._relays[h] += 1
        self._out = dict.fromkeys(ids, 0)
        for kids in self.children:
            for src, fed in kids.items():
                if src != LEARNER:
                    self._out[src] += len(fed)
        self._open = {w for w in ids if self._out[w] < self.capacity[w]}

    @property
    def members(self) -> list[str]:
        return list(self.parent[0]) if self.parent else []

    def out_degree(self, w: str) -> int:
        """Children ``w`` serves over all stripes (its upload streams)."""
        if w == LEARNER:
            return sum(len(kids.get(w, ())) for kids in self.children)
        return self._out.get(w, 0)

    def _feed(self, src: str, delta: int) -> None:
        """``src`` feeds ``delta`` more children (a member: its count and whether it has a free slot)."""
        if src == LEARNER:
            return
        self._out[src] += delta
        if self._out[src] < self.capacity.get(src, 0):
            self._open.add(src)
        else:
            self._open.discard(src)

    def degree(self, w: str) -> int:
        """Relay connections of ``w``: distinct peer sources plus distinct peers it feeds."""
        srcs = {par[w] for par in self.parent} - {LEARNER}
        kids = {c for kids in self.children for c in kids.get(w, ())}
        return len(srcs) + len(kids)

    def learner_streams(self) -> int:
        """Members the learner feeds directly, over all stripes (k in a fresh tree)."""
        return sum(len(kids.get(LEARNER, ())) for kids in self.children)

    def depth(self) -> int:
        """Hops from the learner to the deepest member over all stripes."""
        best = 0
        for par in self.parent:
            memo: dict[str, int] = {LEARNER: 0}
            for w in par:
                chain = []
                x = w
                while x not in memo:
                    chain.append(x)
                    x = par[x]
                d = memo[x]
                for y in reversed(chain):
                    d += 1
                    memo[y] = d
            best = max(best, max(memo.values()))
        return best

    def _free(self, w: str) -> bool:
        return w == LEARNER or self.degree(w) < self.max_peers

    def remove(self, w: str) -> None:
        """Cut ``w`` out; in each stripe its children re-attach to the nearest ancestor of ``w`` with a
        free connection (its parent first: it just lost one), else to the learner."""
        if not self.parent or w not in self.parent[0]:
            return
        cut = []  # per stripe: (its former source, its children), after w is gone from every stripe
        for par, kids in zip(self.parent, self.children, strict=True):
            up = par.pop(w)
            kids[up].remove(w)
            self._feed(up, -1)
            orphans = kids.pop(w, [])
            for child in orphans:
                par[child] = LEARNER  # until re-attached: w no longer counts as its connection
            cut.append((up, orphans))
        self._out.pop(w, None)
        self._open.discard(w)
        self.capacity.pop(w, None)
        for (up, orphans), par, kids, moved in zip(cut, self.parent, self.children, self._moved, strict=True):
            for child in orphans:
                src = self._adopter(par, kids, child, up)
                par[child] = src
                kids.setdefault(src, []).append(child)
                self._feed(src, +1)
                self.repairs += 1
                moved.add(child)
            moved.discard(w)
        if (h := self.home.pop(w, -1)) >= 0:
            self._relays[h] -= 1
        self._gone.add(w)

    def _adopter(self, par: dict[str, str], kids: dict[str, list[str]], child: str, up: str) -> str:
        """The new source of an orphaned ``child`` in one stripe: the nearest ancestor of the departed member
        with a free slot and connection (``up`` first), else the shallowest member with a free child slot
        outside the child's own subtree (the departed member's parents in the other stripes each freed
        one), else the learner."""
        anc = up
        while anc != LEARNER:
            if self._can_adopt(anc, child):
                return anc
            anc = par[anc]
        return self._first_open(par, kids, lambda x: self._can_adopt(x, child), avoid=child)

    def _can_adopt(self, x: str, child: str) -> bool:
        return self.out_degree(x) < self.capacity.get(x, 0) and self._free(x) and self._connects(child, x)

    def _connects(self, child: str, source: str) -> bool:
        """Whether ``child`` may take one more source without exceeding its own degree cap (a source it
        already pulls from costs no new connection)."""
        if source == LEARNER or any(par.get(child) == source for par in self.parent):
            return True
        return self.degree(child) < self.max_peers

    def add(self, w: str) -> None:
        """Attach ``w`` as a leaf in every stripe under the shallowest member with a free child slot and
        a free connection (else the learner); it relays in the stripe with the fewest relays."""
        if not self.parent:
            self.__dict__.update(RelayTree([w], self.max_peers).__dict__)
            return
        if w in self.parent[0]:
            return
        self.home[w] = h = self._relays.index(min(self._relays))
        self._relays[h] += 1
        self.capacity[w] = min(self.stripes, self.max_peers - self.stripes)
        self._out[w] = 0
        self._feed(w, 0)
        for par, kids, moved in zip(self.parent, self.children, self._moved, strict=True):
            src = self._first_open(par, kids, self._free)
            par[w] = src
            kids.setdefault(src, []).append(w)
            self._feed(src, +1)
            moved.add(w)
        self._gone.discard(w)

    def _first_open(
        self,
        par: dict[str, str],
        kids: dict[str, list[str]],
        fits: Callable[[str], bool],
        avoid: str | None = None,
    ) -> str:
        """The member a breadth-first walk of one stripe's tree from the learner would meet first among
        those with a free child slot that ``fits`` (else the learner), never entering ``avoid``'s subtree,
        nor a subtree not yet hung back from the learner (an orphan being re-attached). Read off the few
        members with a free slot (``_open``) instead of walking the tree: the walk meets nodes by depth,
        then by their paths of child positions, so the first is the least (depth, path)."""
        best, best_key = LEARNER, None
        for x in self._open:
            key = _walk_key(par, kids, x, avoid)
            if key is not None and (best_key is None or key < best_key) and fits(x):
                best, best_key = x, key
        return best

    def plan(self, n_chunks: int) -> Plan:
        """Chunk i travels stripe ``i % k``: each member pulls a stripe's chunks from its source there.
        A pull of one stripe holds that stripe's one tuple of chunks (shared by every member, so a plan
        costs O(N k) and not O(N C)); only a source feeding a member several stripes gets a merged one.
        Kept for the next version: after joins and departures only the members whose sources changed
        are planned again (:meth:`_updated`)."""
        return dict(self._updated(n_chunks).plan)

    def _updated(self, n_chunks: int) -> _PlanMemo:
        """The plan and repair sources over ``n_chunks`` chunks, the last ones brought up to date: a
        member's plan reads only its own parents, and its repair chain its source's parents and that
        source's (``REPAIR_HOPS`` = 2 links) in the stripes it pulls from that source, so after a churn
        only the members whose parent changed in some stripe are planned again, and they and their
        descendants ``REPAIR_HOPS`` levels down in that stripe get their chains again; everything when
        the chunk count changed (or the first time)."""
        live = min(self.stripes, n_chunks)
        memo = self._memo
        if memo is None or memo.n_chunks != n_chunks:
            memo = _PlanMemo(n_chunks, [tuple(range(s, n_chunks, self.stripes)) for s in range(live)], {}, {})
            moved: set[str] | list[str] = self.members
            near: set[str] | list[str] = moved
        else:
            for w in self._gone:
                memo.plan.pop(w, None)
                memo.repair.pop(w, None)
            moved = set().union(*self._moved)
            near = set(moved)
            for kids, frontier in zip(self.children, self._moved, strict=True):
                for _ in range(REPAIR_HOPS):
                    frontier = {c for d in frontier for c in kids.get(d, ())}
                    near |= frontier
        parent = self.parent
        pulls = {w: self._pulls(w, live) for w in near}  # near holds moved
        for w in moved:
            memo.plan[w] = tuple(Assignment(src, memo.chunks(ss)) for src, ss in pulls[w])
        for w in near:
            ups: dict[str, str] = {}
            for src, fed in pulls[w]:
                climb(ups, w, src, lambda p, ss=fed: {parent[s][p] for s in ss})
            memo.repair[w] = ups
        self._memo, self._gone = memo, set()
        for moved_in in self._moved:
            moved_in.clear()
        return memo

    def _pulls(self, w: str, live: int) -> list[tuple[str, list[int]]]:
        """``w``'s sources over the first ``live`` stripes (those that carry a chunk), each with the
        stripes it feeds ``w``, in a plan's order (the learner first, then by id)."""
        by_src: dict[str, list[int]] = {}
        for s in range(live):
            by_src.setdefault(self.parent[s][w], []).append(s)
        return sorted(by_src.items(), key=lambda kv: (kv[0] != LEARNER, kv[0]))

    def layout(self, order: Sequence[str]) -> RelayLayout:
        """These trees as the model's :class:`~echo2.physics.broadcast.RelayLayout` over the members in
        ``order`` (index i: ``order[i]``), so the model can time the runtime's own topology
        (``relay_times(..., layout=...)``: ``benchmarks/fleet.py --study links``)."""
        idx = {w: i for i, w in enumerate(order)}
        if set(idx) != set(self.members):
            raise ConfigError("a layout's order must name every member of the trees once")
        k, n = self.stripes, len(order)
        parent = np.full((k, n), LEARNER_INDEX, dtype=np.int64)
        bfs = np.zeros((k, n), dtype=np.int64)
        ends = []
        for s, (par, kids) in enumerate(zip(self.parent, self.children, strict=True)):
            for w, p in par.items():
                parent[s, idx[w]] = LEARNER_INDEX if p == LEARNER else idx[p]
            level, seen, stripe_ends = list(kids.get(LEARNER, ())), [], []
            while level:
                seen += level
                stripe_ends.append(len(seen))
                level = [c for x in level for c in kids.get(x, ())]
            bfs[s] = [idx[w] for w in seen]
            ends.append(tuple(stripe_ends))
        return RelayLayout(
            stripes=k, stripe_rate=0.0, max_peers=self.max_peers,
            home=np.array([self.home.get(w, -1) for w in order], dtype=np.int64),
            capacity=np.array([self.capacity.get(w, 0) for w in order], dtype=np.int64),
            parent=parent, order=bfs, level_ends=tuple(ends),
        )  # fmt: skip

    def repair_sources(self, n_chunks: int) -> dict[str, dict[str, str]]:
        """:func:`~echo2.broadcast.strategy.repair_sources` of :meth:`plan` (``n_chunks``), read off the
        parent maps instead of the chunk lists: a member's pulls from one source are the stripes in which
        that source is its parent, and the source's own source for them is its parent in those stripes.
        O(N k depth) rather than O(N C depth) for C chunks (9,000 of them in a 1.2 GB anchor); after a
        churn, only for the members it touched (:meth:`_updated`)."""
        return dict(self._updated(n_chunks).repair)


def _walk_key(
    par: dict[str, str], kids: dict[str, list[str]], x: str, avoid: str | None
) -> tuple[int, tuple[int, ...]] | None:
    """Where a breadth-first walk from the learner meets ``x`` in one stripe: its depth and its path of
    positions in its ancestors' child lists; None when the walk never meets it (below ``avoid``, or under
    a member not hung from its parent's child list)."""
    path = []
    y = x
    while y != LEARNER:
        if y == avoid:
            return None
        up = par.get(y)  # None: not in this stripe's tree yet (a joiner being attached)
        fed = kids.get(up, ()) if up is not None else ()
        if y not in fed:
            return None
        path.append(fed.index(y))
        y = up
    path.reverse()
    return len(path), tuple(path)


@dataclass
class _PlanMemo:
    """A relay tree's last plan (:meth:`RelayTree.plan`) and repair sources, kept for the next version."""

    n_chunks: int
    stripes: list[tuple[int, ...]]  # each stripe's chunks, shared by every pull of one stripe
    plan: dict[str, tuple[Assignment, ...]]
    repair: dict[str, dict[str, str]]
    merged: dict[tuple[int, ...], tuple[int, ...]] = field(default_factory=dict)  # several stripes' chunks

    def chunks(self, which: list[int]) -> tuple[int, ...]:
        """The chunks of the stripes ``which`` (ascending): one stripe's own tuple, or their merge, made
        once per set of stripes and shared (orphans the learner adopted pull several from it)."""
        if len(which) == 1:
            return self.stripes[which[0]]
        key = tuple(which)
        if key not in self.merged:
            self.merged[key] = _merged(self.stripes, which)
        return self.merged[key]


def _merged(stripes: list[tuple[int, ...]], which: list[int]) -> tuple[int, ...]:
    """The chunks of the stripes ``which``, ascending (the stripe's own tuple when there is one)."""
    if len(which) == 1:
        return stripes[which[0]]
    return tuple(sorted(i for s in which for i in stripes[s]))


@dataclass
class _TreeCache:
    tree: RelayTree | None = None  # the relay trees of the last plan, kept for the next version
    linked: bool = False  # built over the workers' upload rates
    built: frozenset[str] = frozenset()  # the members it was built for (joiners since came in link-blind)
    rates: Mapping[str, float] = field(default_factory=dict)  # the links it was built over


def _relinked(cache: _TreeCache, links: Mapping[str, float]) -> bool:
    """Whether a member's link moved by more than ``RELINK_FACTOR`` since the trees were built (a relay
    found slow, ``conduct.Conduct``, or past its finding): its place in them is no longer its link's."""
    return any(
        not 1 / RELINK_FACTOR <= links[w] / was <= RELINK_FACTOR
        for w, was in cache.rates.items()
        if w in links and was > 0
    )


def striped_tree_plan(
    workers: Sequence[str], n_chunks: int, fanout: int, n_stripes: int | None = None
) -> Plan:
    """Plan for N rotated d-ary stripe trees (``fanout`` d >= 1; d >= N-1 means depth 2)."""
    n = len(workers)
    if n == 0:
        return {}
    d = max(1, min(fanout, n - 1)) if n > 1 else 1
    k = n if n_stripes is None else max(1, min(n_stripes, n))
    pulls: dict[str, dict[str, list[int]]] = {w: {} for w in workers}
    for s in range(k):
        order = list(workers[s:]) + list(workers[:s])
        stripe = list(range(s, n_chunks, k))
        if not stripe:
            continue
        for j, w in enumerate(order):
            src = LEARNER if j == 0 else order[(j - 1) // d]
            pulls[w].setdefault(src, []).extend(stripe)
    plan: Plan = {}
    for w in workers:
        items = sorted(pulls[w].items(), key=lambda kv: (kv[0] != LEARNER, kv[0]))
        plan[w] = tuple(Assignment(src, tuple(sorted(ch))) for src, ch in items)
    return plan


def _planned_by(tree: RelayTree, plan: Plan, n_chunks: int) -> bool:
    """Whether ``plan`` is ``tree``'s over ``n_chunks`` chunks, give or take leaves that pull every chunk
    from the learner: each member of the tree pulls from its parents in the stripes that carry chunks,
    every other member only from the learner. O(N k)."""
    members = tree.members
    if not members or not plan.keys() >= set(members):
        return False
    live = tree.parent[: min(tree.stripes, n_chunks)]
    if any({a.source for a in plan[w]} != {par[w] for par in live} for w in members):
        return False
    inside = set(members)
    return all(w in inside or all(a.source == LEARNER for a in pulls) for w, pulls in plan.items())


@dataclass(frozen=True)
class TreePipelined:
    """ECHO-2 peer-assisted pipelined broadcast over bounded-degree striped relay trees (:class:`RelayTree`),
    kept across versions: members that left are repaired around, joiners attached."""

    name: StrategyName = "tree-pipelined"  # registry key
    learner_uplink_capped: bool = True  # the learner uplink is capped at B0 on the harness
    max_peers: int = DEFAULT_MAX_PEERS  # relay connections per worker: k parents + max_peers - k children
    _cache: _TreeCache = field(default_factory=_TreeCache, compare=False, repr=False)  # last version's trees

    def tree(
        self, workers: Sequence[str], links: Mapping[str, float] | None = None, b0: float | None = None
    ) -> RelayTree:
        """The relay trees for ``workers``: last version's, repaired and extended, or a fresh build when
        none fits (first version, all members changed, the learner feeds more than twice the stripes,
        or the stripe count no longer fits the fleet). With ``links`` (every worker's upload rate,
        bytes/s) the trees are the model's (``physics.broadcast.relay_layout``: fast workers relay
        near the root), and are built afresh once more than ``RELINK_SHARE`` of the members joined or
        left since (a joiner is attached wherever there is room, whatever its link) or a member's link
        moved by more than ``RELINK_FACTOR`` (a relay found slow: ``conduct.Conduct``)."""
        old, cache = self._cache.tree, self._cache
        now = set(workers)
        rates = np.array([links[w] for w in workers]) if links is not None else np.ones(len(workers))
        ref = (b0 or float(np.median(rates))) if links is not None else 1.0
        if old is not None and old.members and now & set(old.members) and cache.linked == (links is not None):
            for w in [m for m in old.members if m not in now]:
                old.remove(w)
            for w in workers:
                old.add(w)
            moved = len(now ^ cache.built) / max(1, len(cache.built))
            fits = old.learner_streams() <= 2 * old.stripes
            same_k = old.stripes == relay_stripes(rates, ref, self.max_peers)
            if fits and same_k and (links is None or (moved <= RELINK_SHARE and not _relinked(cache, links))):
                return old
        cache.tree = RelayTree(workers, self.max_peers, links, ref if links is not None else None)
        cache.linked, cache.built, cache.rates = links is not None, frozenset(workers), dict(links or {})
        return cache.tree

    def plan(self, workers: Sequence[str], n_chunks: int) -> Plan:
        if not workers:
            return {}
        return self.tree(workers).plan(n_chunks)

    def plan_over_links(
        self, workers: Sequence[str], n_chunks: int, links: Mapping[str, float], b0: float | None
    ) -> Plan:
        """The plan over trees shaped to the workers' upload rates (``strategy.LinkAware``)."""
        if not workers:
            return {}
        return self.tree(workers, links, b0).plan(n_chunks)

    def repair_sources(self, plan: Plan, n_chunks: int) -> dict[str, dict[str, str]]:
        """``strategy.repair_sources(plan)`` for a plan of this strategy's last trees (members outside
        them, the leaves of ``plan_with_leaves``, pull only from the learner: nothing to repair from);
        from the parent maps (:meth:`RelayTree.repair_sources`)."""
        tree = self._cache.tree
        if tree is None or not _planned_by(tree, plan, n_chunks):
            return repair_sources(plan)  # not a plan of the cached trees: from its chunk lists
        out = tree.repair_sources(n_chunks)
        return {w: out.get(w, {}) for w in plan}

    def learner_stream_rate(self, n: int, b0: float, bw: float) -> float | None:
        return matched_stream_rate(n, b0, bw, relay_stripes(np.ones(max(1, n)), 1.0, self.max_peers))


@dataclass(frozen=True)
class RelayChain:
    """One fan-out-1 chain learner -> w0 -> w1 -> ... (no striping): the relay-throughput probe."""

    name: StrategyName = "relay-chain"  # registry key
    learner_uplink_capped: bool = True  # the learner uplink is capped at B0 on the harness

    def plan(self, workers: Sequence[str], n_chunks: int) -> Plan:
        return striped_tree_plan(workers, n_chunks, fanout=1, n_stripes=1)

    def learner_stream_rate(self, n: int, b0: float, bw: float) -> float | None:
        return None  # one stripe: the learner feeds the chain head at whatever the chain takes


@dataclass(frozen=True)
class TreeChains:
    """Tree-Pipelined with fan-out-1 stripe chains (the paper-literal variant; one in + one out per link)."""

    name: StrategyName = "tree-chains"  # registry key
    learner_uplink_capped: bool = True  # the learner uplink is capped at B0 on the harness

    def plan(self, workers: Sequence[str], n_chunks: int) -> Plan:
        return striped_tree_plan(workers, n_chunks, fanout=1)

    def learner_stream_rate(self, n: int, b0: float, bw: float) -> float | None:
        return matched_stream_rate(n, b0, bw)
