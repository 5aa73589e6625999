"""Latecomers (broadcast/publisher.py): a member that joins after an anchor was announced is attached to
it under a member that holds it or is receiving it, not left to fetch the model over HTTP; the learner
serves one only when its round has nobody to take it. Real publisher and worker nodes on loopback
(each test a few seconds at most)."""

from __future__ import annotations

import asyncio
from collections import Counter

from echo2.broadcast.api import OpenLedger
from echo2.broadcast.pipelined import TreePipelined
from echo2.broadcast.publisher import TcpPublisher
from echo2.broadcast.receiver import TcpWorkerNode
from echo2.broadcast.rounds import LATE_FANOUT
from echo2.broadcast.strategy import LEARNER
from echo2.weights.manifest import Lineage, new_signing_key

KEY = new_signing_key()
PUBLIC = KEY.verifier()
CHUNK = 4096
BLOB = bytes(range(256)) * 160  # 40960 bytes: 10 chunks
PATCH = bytes(range(7, 256)) * 4  # 996 bytes: one chunk
EPOCH = 2


def _anchor() -> Lineage:
    return Lineage(kind="full", epoch=EPOCH)


def _patch(base: int) -> Lineage:
    return Lineage(
        kind="patch", base_version=base, epoch=EPOCH, base_digest="ab" * 32, weights_digest="cd" * 32
    )


async def _member(
    pub: TcpPublisher,
    name: str,
    held: tuple[int, int] | None = None,
    acks: bool = True,
    stall_timeout: float = 5.0,
) -> tuple[TcpWorkerNode, asyncio.Task[list[int]]]:
    """A joined node and the task that collects (and acks) what it installs."""
    node = TcpWorkerNode(name, pub.address, PUBLIC, held=held, stall_timeout=stall_timeout)
    await node.start()

    async def collect() -> list[int]:
        got = []
        async for snap in node.snapshots():
            got.append(snap.manifest.version)
            if acks:
                await node.report_installed(snap.manifest.version)
        return got

    return node, asyncio.ensure_future(collect())


async def _holders(pub: TcpPublisher, n: int) -> list[TcpWorkerNode]:
    """``n`` members joined before the anchor v0 was announced, every one holding it."""
    first = [(await _member(pub, f"w{i}"))[0] for i in range(n)]
    await pub.wait_members(n, 5)
    await pub.publish(0, BLOB, _anchor())
    await pub.wait_installed(0, timeout=10)
    return first


async def _installed(pub: TcpPublisher, version: int, late: int, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while len(pub.stats(version).late_install_s) < late:
            await asyncio.sleep(0.01)


def test_a_fleet_that_joins_after_the_anchor_costs_the_learner_one_copy() -> None:
    """The restart case: the anchor is announced to nobody, then members join one after another; the first
    pulls it from the learner, every later one from a member, no member serves more than LATE_FANOUT."""

    async def go() -> tuple[TcpPublisher, list[int], int]:
        pub = TcpPublisher(KEY, TreePipelined(), chunk_size=CHUNK, ledger=OpenLedger())
        await pub.start()
        await pub.publish(0, BLOB, _anchor())
        nodes = []
        for i in range(11):
            node, _ = await _member(pub, f"w{i}")
            nodes.append(node)
            await asyncio.sleep(0.02 if i % 3 else 0.0)  # some while others still receive, some at once
        await _installed(pub, 0, 11)
        held = [n.installed_version for n in nodes]
        relayed = sum(n.counters.bytes_relayed for n in nodes)
        for n in nodes:
            await n.close()
        await pub.close()
        return pub, held, relayed

    pub, held, relayed = asyncio.run(go())
    stats, rnd = pub.stats(0), pub._rounds[0]
    assert stats.n_workers == 0 and stats.late == 11 and len(stats.late_install_s) == 11
    assert stats.learner_bytes == len(BLOB)  # one copy: the first latecomer's
    assert pub.counters.latecomers == 11 and pub.counters.latecomers_from_learner == 1
    parents = Counter(rnd.late.values())
    assert parents[LEARNER] == 1 and max(parents.values()) <= LATE_FANOUT
    assert held == [0] * 11 and relayed == 10 * len(BLOB)


def test_a_latecomer_pulls_from_a_member_that_holds_the_anchor() -> None:
    async def go() -> tuple[TcpPublisher, str, int]:
        pub = TcpPublisher(KEY, TreePipelined(), chunk_size=CHUNK, ledger=OpenLedger())
        await pub.start()
        first = await _holders(pub, 3)
        before = pub.stats(0).learner_bytes
        late, _ = await _member(pub, "late")
        await _installed(pub, 0, 1)
        parent = pub._rounds[0].late["late"]
        for node in [*first, late]:
            await node.close()
        await pub.close()
        return pub, parent, before

    pub, parent, before = asyncio.run(go())
    assert parent in {"w0", "w1", "w2"}  # a holder, not the learner
    assert pub.stats(0).learner_bytes == before  # the latecomer cost the learner nothing
    assert pub.counters.latecomers_from_learner == 0


def test_a_member_holding_the_anchor_or_newer_is_not_attached_again() -> None:
    async def go() -> TcpPublisher:
        pub = TcpPublisher(KEY, TreePipelined(), chunk_size=CHUNK, ledger=OpenLedger())
        await pub.start()
        await pub.publish(3, BLOB, _anchor())
        nodes = [
            (await _member(pub, "same", held=(EPOCH, 3)))[0],
            (await _member(pub, "newer", held=(EPOCH, 4)))[0],
            (await _member(pub, "older_epoch", held=(EPOCH - 1, 9)))[0],  # a restart's: other weights
        ]
        await _installed(pub, 3, 1)
        for node in nodes:
            await node.close()
        await pub.close()
        return pub

    pub = asyncio.run(go())
    assert set(pub._rounds[3].late) == {"older_epoch"}


def test_a_patch_announced_meanwhile_leaves_latecomers_out_until_they_ack_the_anchor() -> None:
    """A latecomer still receiving the anchor is not announced the patch after it (a newer announcement
    would cut its anchor off, leaving it a patch it cannot apply); once it acks, the next one reaches it."""

    async def go() -> tuple[TcpPublisher, list[int], list[int]]:
        pub = TcpPublisher(KEY, TreePipelined(), chunk_size=CHUNK, ledger=OpenLedger())
        await pub.start()
        await pub.publish(0, BLOB, _anchor())
        quiet, _ = await _member(pub, "quiet", acks=False)  # receives, never acks
        await asyncio.wait_for(_until(lambda: quiet.installed_version == 0), 10)
        await pub.publish(1, PATCH, _patch(0))
        left_out = pub._rounds[1].covers("quiet")
        loud, loud_got = await _member(pub, "loud")
        await _installed(pub, 0, 1)  # "loud" acked the anchor
        await pub.publish(2, PATCH, _patch(1))
        await asyncio.wait_for(_until(lambda: loud.installed_version == 2), 10)
        covered = [pub._rounds[2].covers(w) for w in ("quiet", "loud")]
        for node in (quiet, loud):
            await node.close()
        await pub.close()
        assert not left_out
        return pub, [int(c) for c in covered], await loud_got

    _, covered, loud_got = asyncio.run(go())
    assert covered == [0, 1]  # the one that acked is a member again, the silent one still catching up
    assert loud_got == [0, 2]  # it was attached to the anchor, not announced v1 (the patch)


def test_a_latecomers_parent_that_leaves_is_repaired_around() -> None:
    async def go() -> TcpPublisher:
        pub = TcpPublisher(KEY, TreePipelined(), chunk_size=CHUNK, ledger=OpenLedger())
        await pub.start()
        await pub.publish(0, BLOB, _anchor())
        head, _ = await _member(pub, "head")
        await asyncio.wait_for(_until(lambda: head.installed_version == 0), 10)
        await head.close()  # the only holder leaves before anyone pulls from it
        await asyncio.sleep(0.05)
        late, _ = await _member(pub, "late")
        await _installed(pub, 0, 2)
        await late.close()
        await pub.close()
        return pub

    pub = asyncio.run(go())
    assert pub._rounds[0].late["late"] == LEARNER  # the holder had left: nobody else could take it
    assert pub.stats(0).learner_bytes == 2 * len(BLOB)


async def _until(ok) -> None:  # type: ignore[no-untyped-def]
    while not ok():
        await asyncio.sleep(0.01)


def test_a_member_that_installed_a_newer_version_is_no_latecomers_parent() -> None:
    """A node keeps only its newest version (receiver.py): once the holders installed the patch after
    the anchor, a latecomer of that anchor is attached to the learner, and still gets it."""

    async def go() -> tuple[TcpPublisher, str, list[int]]:
        pub = TcpPublisher(KEY, TreePipelined(), chunk_size=CHUNK, ledger=OpenLedger())
        await pub.start()
        first = await _holders(pub, 2)
        await pub.publish(1, PATCH, _patch(0))
        await pub.wait_installed(1, timeout=10)
        late, got = await _member(pub, "late")
        await _installed(pub, 0, 1)
        parent = pub._rounds[0].late["late"]
        for node in [*first, late]:
            await node.close()
        await pub.close()
        return pub, parent, await got

    _, parent, got = asyncio.run(go())
    assert parent == LEARNER and got == [0]


def test_a_member_that_joins_again_before_its_ack_is_attached_again() -> None:
    """A node that lost its control connection re-joins as a new node holding nothing of the anchor: a
    planned member and a latecomer alike are attached (again) under a member that holds it, never under
    itself or one it feeds that does not hold it, and the parent it left takes another latecomer."""

    async def go() -> tuple[TcpPublisher, dict[str, str], dict[str, str], list[int]]:
        pub = TcpPublisher(KEY, TreePipelined(), chunk_size=CHUNK, ledger=OpenLedger())
        await pub.start()
        loud = [(await _member(pub, f"w{i}"))[0] for i in range(2)]
        quiet, _ = await _member(pub, "quiet", acks=False)  # planned; receives, never acks
        await pub.wait_members(3, 5)
        await pub.publish(0, BLOB, _anchor())
        await asyncio.wait_for(_until(lambda: quiet.installed_version == 0), 10)
        await pub.wait_installed(0, count=2, timeout=10)
        late, _ = await _member(pub, "late", acks=False)  # a latecomer, never acks
        await asyncio.wait_for(_until(lambda: late.installed_version == 0), 10)
        before = dict(pub._rounds[0].late)
        for node in (quiet, late):  # both lose their connection, and come back as new nodes
            await node.close()
        await asyncio.wait_for(_until(lambda: len(pub.members()) == 2), 5)
        again = [(await _member(pub, w))[0] for w in ("quiet", "late")]
        await _installed(pub, 0, 2)
        after = dict(pub._rounds[0].late)
        held = [n.installed_version for n in again]
        for node in [*loud, *again]:
            await node.close()
        await pub.close()
        return pub, before, after, held

    pub, before, after, held = asyncio.run(go())
    rnd = pub._rounds[0]
    assert set(before) == {"late"} and before["late"] in {"w0", "w1"}
    assert set(after) == {"late", "quiet"} and set(after.values()) <= {"w0", "w1"}
    assert held == [0, 0] and set(rnd.late_installed) == {"late", "quiet"}
    assert sum(rnd.late_kids.values()) == 2  # the parent "late" left freed its place
    assert pub.counters.latecomers == 3 and pub.counters.latecomers_from_learner == 0


def test_a_member_is_never_attached_under_one_it_feeds() -> None:
    """A latecomer that re-joins while the one it feeds has not got the anchor yet is not attached under
    it (each would wait on the other): the learner serves it."""
    from echo2.broadcast.rounds import Round
    from echo2.weights.manifest import build_manifest

    rnd = Round(build_manifest(BLOB, 0, CHUNK, KEY, _anchor()), 0.0, ())
    rnd.serves = {}
    rnd.attach_late("a", rnd.late_parent("a", lambda p: True), lambda p: True)
    rnd.attach_late("b", rnd.late_parent("b", lambda p: True), lambda p: True)
    assert rnd.late == {"a": LEARNER, "b": "a"} and rnd.fed_by("b", "a") and not rnd.fed_by("a", "b")
    assert rnd.late_parent("a", lambda p: True) == LEARNER  # "b" is fed through "a"; "a" is itself
    rnd.late_installed["b"] = 1.0  # once "b" holds it, it may serve "a"
    assert rnd.late_parent("a", lambda p: True) == "b"


def test_a_latecomer_that_acks_what_it_does_not_hold_costs_its_victims_one_stall(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An attacker who read the rules (``echo2_bench.stalling.StallingNode``): it joins as the second
    latecomer (its parent a peer, whose service the learner cannot see), acks the anchor at once with the
    receipts its plan would give (every chunk from that parent), and so becomes a holder, the parent of the
    next latecomers; it sends them nothing. Each victim waits its stall hint, reports it, and repairs from
    the liar's own parent; two reports demote it, and nobody is attached to it after that. The learner
    serves one copy in all."""
    import echo2.broadcast.publisher as publisher_module
    from echo2_bench.stalling import StallingNode

    monkeypatch.setattr(publisher_module, "LATE_HOP_S", 0.5)

    async def go() -> tuple[TcpPublisher, list[int], float, str]:
        pub = TcpPublisher(KEY, TreePipelined(), chunk_size=CHUNK, ledger=OpenLedger())
        await pub.start()
        await pub.publish(0, BLOB, _anchor())
        first, _ = await _member(pub, "first")
        liar = StallingNode("liar", pub.address, PUBLIC)
        await liar.start()
        await asyncio.wait_for(_until(lambda: pub._rounds[0].holds("liar")), 5)
        parent = pub._rounds[0].late["liar"]
        t0 = asyncio.get_running_loop().time()
        victims = [  # 4 under the liar (fan-out), then others
            (await _member(pub, f"victim{i}", stall_timeout=0.5))[0] for i in range(LATE_FANOUT + 2)
        ]
        await _installed(pub, 0, 2 + len(victims), timeout=20)  # first, the liar's ack, every victim
        took = asyncio.get_running_loop().time() - t0
        held = [v.installed_version for v in victims]
        for node in [first, liar, *victims]:
            await node.close()
        await pub.close()
        return pub, held, took, parent

    pub, held, took, parent = asyncio.run(go())
    rnd = pub._rounds[0]
    assert parent == "first" and held == [0] * (LATE_FANOUT + 2)
    under_liar = [w for w, p in rnd.late.items() if p == "liar"]
    assert 2 <= len(under_liar) <= LATE_FANOUT  # it took latecomers until 2 reports demoted it
    assert "liar" in pub.demoted()
    assert pub.stats(0).learner_bytes == len(BLOB)  # the victims repaired from "first", not the learner
    assert all(rnd.late_installed[w] >= 0.5 for w in under_liar)  # each waited its stall hint: the cost
    assert pub.counters.stall_reports >= 2 and pub.counters.latecomers_from_learner == 1
    assert took < 10.0


def test_a_member_that_keeps_re_joining_is_attached_a_bounded_number_of_times() -> None:
    from echo2.broadcast.rounds import LATE_REJOINS, Round
    from echo2.weights.manifest import build_manifest

    rnd = Round(build_manifest(BLOB, 0, CHUNK, KEY, _anchor()), 0.0, ())
    rnd.serves = {}
    times = 0
    while rnd.may_attach("a") and times < 10:
        rnd.attach_late("a", rnd.late_parent("a", lambda p: True), lambda p: True)
        times += 1
    assert times == 1 + LATE_REJOINS and rnd.late_kids.get(LEARNER, 0) == 0
    assert rnd.may_attach("b")  # others unaffected
    rnd.late_installed["c"] = 1.0
    assert not rnd.may_attach("c")  # holds it
