"""TCP transport on loopback, in one process: delivery, bad peers, corruption, auth, join/leave."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import pytest
from waiting import free_ports

from echo2.broadcast.api import OpenLedger
from echo2.broadcast.factory import get_strategy
from echo2.broadcast.pipelined import TreePipelined
from echo2.broadcast.publisher import TcpPublisher
from echo2.broadcast.receiver import TcpWorkerNode
from echo2.broadcast.strategy import Strategy, repair_sources
from echo2.broadcast.wire import encode, read_header, write_frame
from echo2.errors import Echo2Error
from echo2.physics.rules import DEFAULT_GAMMA
from echo2.weights.frames import decode_chunk_list
from echo2.weights.manifest import blob_ok, new_signing_key, synthetic_snapshot
from echo2_bench.faults import Faults, FaultTap

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
KEY = new_signing_key()  # the learner's key pair
PUBLIC = KEY.verifier()  # what workers hold
CHUNK = 8 << 10
BLOB = synthetic_snapshot(200_000, seed=3)


async def _install(node: TcpWorkerNode, got: dict[str, bytes]) -> None:
    async for snap in node.snapshots():
        assert blob_ok(snap.manifest, snap.data)
        got[node.worker_id] = bytes(snap.data)
        await node.report_installed(snap.manifest.version)
        return


async def _cluster(
    strategy: Strategy,
    n: int,
    extra: Callable[[tuple[str, int]], Awaitable[object]] | None = None,
    node_kw: dict[int, dict] | None = None,
) -> tuple[TcpPublisher, list[TcpWorkerNode], dict[str, bytes], object]:
    pub = TcpPublisher(KEY, strategy, chunk_size=CHUNK, ledger=OpenLedger())
    await pub.start()
    nodes = [
        TcpWorkerNode(f"w{i}", pub.address, PUBLIC, stall_timeout=1.0, **(node_kw or {}).get(i, {}))
        for i in range(n)
    ]
    for nd in nodes:
        await nd.start()
    handle = await extra(pub.address) if extra else None
    await pub.wait_members(n + (1 if extra else 0), 10)
    return pub, nodes, {}, handle


async def _broadcast(pub: TcpPublisher, nodes: list[TcpWorkerNode], got: dict[str, bytes], version: int = 1):
    tasks = [asyncio.create_task(_install(nd, got)) for nd in nodes]
    await pub.publish(version, BLOB)
    stats = await pub.wait_installed(version, count=len(nodes), timeout=30)
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    return stats


async def _shutdown(pub: TcpPublisher, nodes: list[TcpWorkerNode]) -> None:
    for nd in nodes:
        await nd.close()
    await pub.close()


@pytest.mark.parametrize("name", ["tree-pipelined", "tree-chains", "star-limited"])
def test_every_worker_installs_the_exact_blob(name: str) -> None:
    async def go() -> None:
        pub, nodes, got, _ = await _cluster(get_strategy(name), 4)
        stats = await _broadcast(pub, nodes, got)
        await _shutdown(pub, nodes)
        assert got == {f"w{i}": BLOB for i in range(4)}
        # Peer-assisted strategies send G once from the learner; star sends it N times.
        expected = len(BLOB) if name.startswith("tree") else 4 * len(BLOB)
        assert stats.learner_bytes == expected
        assert set(stats.metrics(DEFAULT_GAMMA)) == {
            "broadcast/t_bcast_s",
            "broadcast/bytes",
            "broadcast/install_p90_s",
        }
        assert all(nd.counters.stream_failures == 0 for nd in nodes)

    asyncio.run(go())


def _fake_member(behavior: str) -> Callable[[tuple[str, int]], Awaitable[object]]:
    """A member that joins and is planned as a relay, then misbehaves on every pull."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        h = await read_header(reader)
        v, i = h["v"], decode_chunk_list(await reader.readexactly(h["n"]))[0]
        if behavior == "silent":
            await asyncio.sleep(3600)
        elif behavior == "wrong_index":
            await write_frame(writer, {"op": "chunk", "v": v, "i": i + 1}, b"x" * CHUNK)
        elif behavior == "oversized":
            await write_frame(writer, {"op": "chunk", "v": v, "i": i}, b"x" * (CHUNK + 1))
        elif behavior == "truncated":
            writer.write(encode({"op": "chunk", "v": v, "i": i}, CHUNK) + b"x" * 100)
            await writer.drain()
        elif behavior == "garbage":
            writer.write(b"\x00\x00\x00\x05hello")
            await writer.drain()
        elif behavior == "unknown_version":
            await write_frame(writer, {"op": "error", "reason": f"unknown version {v}"})
        elif behavior == "wrong_bytes":
            await write_frame(writer, {"op": "chunk", "v": v, "i": i}, b"\0" * CHUNK)
            await asyncio.sleep(3600)
        writer.close()

    async def start(addr: tuple[str, int]) -> object:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        _, w = await asyncio.open_connection(*addr)
        port = server.sockets[0].getsockname()[1]
        await write_frame(w, {"op": "join", "worker": "zz-bad", "host": "127.0.0.1", "port": port})
        return server, w

    return start


@pytest.mark.parametrize(
    "behavior",
    ["silent", "wrong_index", "oversized", "truncated", "garbage", "unknown_version", "wrong_bytes"],
)
def test_a_bad_relay_does_not_stop_the_others(behavior: str, caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        pub, nodes, got, (server, ctl) = await _cluster(
            get_strategy("tree-pipelined"), 3, _fake_member(behavior)
        )
        await _broadcast(pub, nodes, got)
        server.close()
        ctl.close()
        await _shutdown(pub, nodes)
        assert got == {f"w{i}": BLOB for i in range(3)}
        # each real worker pulled the bad member's stripe, saw it fail, and repaired from the learner
        assert all(nd.counters.stream_failures >= 1 and nd.counters.repaired_chunks > 0 for nd in nodes)
        if behavior == "wrong_bytes":
            assert all(nd.counters.corrupt_detected == 1 for nd in nodes)

    asyncio.run(go())
    assert "source zz-bad failed" in caplog.text  # a clear logged reason


def test_corrupting_relay_is_fully_detected() -> None:
    async def go() -> None:
        kw = {i: {"max_bad_chunks": 10**9} for i in range(4)}
        tap = FaultTap(Faults(corrupt_every=3), "w1")
        kw[1]["tap"] = tap
        pub, nodes, got, _ = await _cluster(get_strategy("tree-pipelined"), 4, node_kw=kw)
        await _broadcast(pub, nodes, got)
        await _shutdown(pub, nodes)
        injected = tap.corrupted_sent
        detected = sum(nd.counters.corrupt_detected for nd in nodes)
        assert injected > 0 and detected == injected
        assert got == {f"w{i}": BLOB for i in range(4)}  # 0 bad installs

    asyncio.run(go())


def test_a_failing_relay_is_repaired_from_its_stripe_ancestor_not_the_learner() -> None:
    """Bounded-degree trees (4 connections a peer: 2 stripes of depth 3 over 6 workers): a relay one
    level below a stripe's root corrupts every chunk it relays; its children take those chunks from
    its own parent (the announcement's repair source), so the learner still sends G exactly once."""

    async def go() -> None:
        members = [f"w{i}" for i in range(6)]
        ups = repair_sources(TreePipelined(max_peers=4).plan(members, 25))
        bad = sorted({peer for w in members for peer in ups[w]})[0]  # a relay with a peer above it
        children = [w for w in members if bad in ups[w]]
        tap = FaultTap(Faults(corrupt_every=1), bad)
        kw = {int(bad[1:]): {"tap": tap}}
        pub, nodes, got, _ = await _cluster(TreePipelined(max_peers=4), 6, node_kw=kw)
        stats = await _broadcast(pub, nodes, got)
        await _shutdown(pub, nodes)
        assert got == {w: BLOB for w in members}  # every install exact
        by_id = {nd.worker_id: nd for nd in nodes}
        assert tap.corrupted_sent > 0 and children
        for w in children:
            assert by_id[w].counters.corrupt_detected > 0 and by_id[w].counters.ancestor_repairs > 0
        assert stats.learner_bytes == len(BLOB)  # nothing repaired from the learner
        assert stats.n_refused == 0 and len(stats.install_s) == 6  # receipts naming the ancestor count

    asyncio.run(go())


def test_forged_manifest_is_refused_without_blocking_others() -> None:
    async def go() -> None:
        pub, nodes, got, _ = await _cluster(get_strategy("tree-pipelined"), 2)
        liar = TcpWorkerNode("w-wrong-key", pub.address, new_signing_key().verifier(), stall_timeout=1.0)
        await liar.start()
        await pub.wait_members(3, 5)
        await _broadcast(pub, nodes, got)
        await asyncio.sleep(0.2)
        assert liar.counters.rejected_manifests == 1 and liar.installed_version == -1
        await liar.close()
        await _shutdown(pub, nodes)
        assert got == {"w0": BLOB, "w1": BLOB}

    asyncio.run(go())


def test_workers_join_for_the_next_version_and_leave_any_time() -> None:
    async def go() -> None:
        pub, nodes, got, _ = await _cluster(get_strategy("tree-pipelined"), 2)
        await _broadcast(pub, nodes, got, version=1)
        late = TcpWorkerNode("late", pub.address, PUBLIC, stall_timeout=1.0)
        await late.start()
        await pub.wait_members(3, 5)
        first: dict[str, bytes] = {}  # a latecomer of v1 (an anchor): it gets v1 from a member holding it
        await asyncio.wait_for(_install(late, first), 10)
        assert first == {"late": BLOB} and pub.stats(1).late == 1 and pub.stats(1).learner_bytes == len(BLOB)
        await asyncio.sleep(0.1)  # its ack: newer publications reach it again
        await nodes[0].close()  # leaves between versions
        await asyncio.sleep(0.1)
        assert sorted(pub.members()) == ["late", "w1"]
        got.clear()
        stats = await _broadcast(pub, [nodes[1], late], got, version=2)
        assert stats.n_workers == 2 and got == {"w1": BLOB, "late": BLOB}
        assert late.installed_version == 2
        await _shutdown(pub, [nodes[1], late])

    asyncio.run(go())


def test_publisher_survives_junk_and_unknown_versions() -> None:
    async def go() -> None:
        pub = TcpPublisher(KEY, get_strategy("star-limited"), chunk_size=CHUNK, ledger=OpenLedger())
        await pub.start()
        r, w = await asyncio.open_connection(*pub.address)
        w.write(b"\xff\xff\xff\xffjunk")
        await w.drain()
        assert await r.read() == b""  # dropped with a logged reason
        r, w = await asyncio.open_connection(*pub.address)
        await write_frame(w, {"op": "get", "v": 99, "chunks": [0], "from": "x"})
        h = await read_header(r)
        assert h["op"] == "error" and "refused: no credential" in h["reason"]  # asks for nothing without one
        assert await r.read() == b""  # and the connection is closed
        r, w = await asyncio.open_connection(*pub.address)
        await write_frame(w, {"op": "join", "worker": "learner", "host": "h", "port": 1})
        assert await r.read() == b""
        node = TcpWorkerNode("ok", pub.address, PUBLIC)
        await node.start()
        await pub.wait_members(1, 5)
        got: dict[str, bytes] = {}
        await _broadcast(pub, [node], got)
        assert got == {"ok": BLOB}
        await _shutdown(pub, [node])

    asyncio.run(go())


def test_worker_refuses_replayed_and_malformed_announcements() -> None:
    from echo2.broadcast.access import issue
    from echo2.broadcast.buffer import SnapshotBuffer, serve_get
    from echo2.weights.frames import GetFrame, parse_frame
    from echo2.weights.manifest import build_manifest

    async def go() -> None:
        manifest = build_manifest(BLOB, 5, CHUNK, KEY)
        buffer = SnapshotBuffer(manifest, BLOB)
        joined: asyncio.Queue = asyncio.Queue()

        async def fake_learner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            h = await read_header(reader)
            if h["op"] == "get":
                pull = parse_frame(h, GetFrame)
                chunks = decode_chunk_list(await reader.readexactly(pull.n))
                await serve_get(pull, chunks, writer, lambda v: buffer if v == 5 else None, None, 5.0)
                writer.close()
                return
            await joined.put((reader, writer))
            await asyncio.sleep(3600)

        server = await asyncio.start_server(fake_learner, "127.0.0.1", 0)
        addr = server.sockets[0].getsockname()[:2]
        node = TcpWorkerNode("w", addr, PUBLIC, stall_timeout=1.0)
        await node.start()
        reader, writer = await joined.get()
        every = list(range(manifest.n_chunks))
        ann = {
            "op": "announce", "manifest": manifest.to_dict(), "sources": [["learner", every]],
            "peers": {"learner": list(addr)}, "credential": issue(KEY, 5, "w", "").to_dict(),
        }  # fmt: skip
        await write_frame(writer, {**ann, "manifest": "not a dict"})  # malformed
        await write_frame(writer, {**ann, "sources": [["ghost", [0]]]})  # source without an address
        await write_frame(writer, {**ann, "credential": issue(KEY, 5, "v", "").to_dict()})  # someone else's
        await write_frame(writer, ann)  # good
        await write_frame(writer, ann)  # replay of the in-flight version
        got: dict[str, bytes] = {}
        await asyncio.wait_for(_install(node, got), 10)
        ack = await asyncio.wait_for(read_header(reader), 5)
        while ack["op"] == "rejected":
            ack = await asyncio.wait_for(read_header(reader), 5)
        assert ack == {
            "op": "installed",
            "v": 5,
            "got": {"learner": manifest.n_chunks},
            "pace": {},
        }  # receipts
        await write_frame(writer, ann)  # replay of the installed version
        await asyncio.sleep(0.2)
        assert node.counters.rejected_manifests == 5 and got == {"w": BLOB}
        await node.close()
        server.close()

    asyncio.run(go())


def test_worker_holding_only_the_public_key_cannot_forge_for_peers() -> None:
    """The reason Ed25519 is the default: a rented worker can verify manifests but not sign one,
    and a manifest under another scheme (a shared HMAC secret) is refused outright."""
    from echo2.weights.manifest import ManifestError, build_manifest, verify_manifest

    with pytest.raises(ManifestError, match="cannot sign"):
        build_manifest(b"poisoned weights", 7, CHUNK, PUBLIC)
    forged = build_manifest(b"poisoned weights", 7, CHUNK, b"a secret the worker made up!")
    with pytest.raises(ManifestError, match="expects 'ed25519'"):
        verify_manifest(forged, PUBLIC)


def test_publisher_admits_only_authorized_members(caplog: pytest.LogCaptureFixture) -> None:
    """With a ledger (the runtime's registry checks credentials) a join under a wrong or missing
    credential is refused with a logged reason, and the authorized worker still installs."""
    creds = {"good": "secret-good"}

    async def main() -> tuple[list[str], dict[str, bytes], bool, bool]:
        class Ledger(OpenLedger):
            def may_join(self, worker_id: str, credential: object) -> bool:
                return isinstance(credential, str) and creds.get(worker_id) == credential

        pub = TcpPublisher(KEY, get_strategy("tree-pipelined"), chunk_size=CHUNK, ledger=Ledger())
        await pub.start()
        good = TcpWorkerNode("good", pub.address, PUBLIC, credential="secret-good")
        forged = TcpWorkerNode("good2", pub.address, PUBLIC, credential="secret-good")  # another id
        anonymous = TcpWorkerNode("anon", pub.address, PUBLIC)
        for nd in (good, forged, anonymous):
            await nd.start()
        await asyncio.wait_for(asyncio.gather(forged.wait_closed(), anonymous.wait_closed()), 10)
        await pub.wait_members(1, 10)
        got: dict[str, bytes] = {}
        await _broadcast(pub, [good], got)
        members = pub.members()
        await _shutdown(pub, [good])
        return members, got, forged._closed.is_set(), anonymous._closed.is_set()

    members, got, forged_closed, anon_closed = asyncio.run(main())
    assert members == ["good"] and got["good"] == BLOB
    assert forged_closed and anon_closed
    assert "credential refused" in caplog.text


def test_a_stalling_relay_costs_the_honest_workers_one_deadline_once() -> None:
    """Over TLS: three honest nodes (stall_timeout 5 s) and a member that is planned as a relay, accepts
    every pull, sends nothing and acks every version at once (``echo2_bench.stalling``). In v1 each
    honest node gives the staller up at its first-chunk deadline (about 1 s here: its other sources
    deliver in milliseconds), reports it and repairs from the learner: every honest install of v1 within
    2.5 s (it was 5 s and more: the stall timeout). The 3 reports (>= DEMOTE_AFTER_REPORTS = 2) demote
    it, so v2-v4 plan nobody on it: every honest install within 1 s. None of its acks counts."""
    from echo2.broadcast.publisher import DEMOTE_AFTER_REPORTS
    from echo2.transport import make_identity
    from echo2_bench.stalling import StallingNode

    ident = make_identity(["127.0.0.1"])
    honest = [f"w{i}" for i in range(3)]

    async def go() -> None:
        pub = TcpPublisher(
            KEY, get_strategy("tree-pipelined"), chunk_size=CHUNK, tls=ident, ledger=OpenLedger()
        )
        await pub.start()
        nodes = [
            TcpWorkerNode(w, pub.address, PUBLIC, stall_timeout=5.0, pin=ident.fingerprint) for w in honest
        ]
        for nd in nodes:
            await nd.start()
        staller = StallingNode("zz-staller", pub.address, PUBLIC, pin=ident.fingerprint)
        await staller.start()
        await pub.wait_members(4, 10)
        for v in range(1, 5):
            got: dict[str, bytes] = {}
            tasks = [asyncio.create_task(_install(nd, got)) for nd in nodes]
            await pub.publish(v, BLOB)
            stats = await pub.wait_installed(v, timeout=20)  # all live members whose ack may count
            await asyncio.wait_for(asyncio.gather(*tasks), 20)
            assert got == dict.fromkeys(honest, BLOB)
            assert sorted(stats.install_s) == honest and stats.n_workers == 4  # the staller never counts
            assert stats.n_refused == 1 and stats.metrics(DEFAULT_GAMMA)["broadcast/t_bcast_s"] < 5.0
            worst = max(stats.install_s.values())
            assert worst <= (2.5 if v == 1 else 1.0), f"v{v}: an honest install took {worst:.2f}s"
            assert pub.demoted() == ["zz-staller"]  # from v1's reports on
        assert DEMOTE_AFTER_REPORTS == 2 and pub.counters.stall_reports == 3
        assert pub.counters.relays_demoted == 1 and pub.counters.acks_refused == 4
        assert all(nd.counters.stalls_reported == 1 for nd in nodes)  # v1 only: nobody pulls from it later
        assert staller.counters.acked == 4 and staller.counters.pulls_held == 3
        await staller.close()
        await _shutdown(pub, nodes)

    asyncio.run(go())


def test_a_drip_feeding_relay_costs_the_honest_workers_seconds_and_is_demoted() -> None:
    """Three honest nodes and a real node whose uplink sends one chunk every 0.3 s (one each 0.9 s to each
    of its 3 children), each inside the 1 s stall timeout: no stall ever ends its streams, so its stripe's
    50 chunks took its children about 45 s a version. Now each child cuts it as lagging (``wire.lagging``:
    under 1/4 of its other streams' rate, 2 stall timeouts after its first chunk), reports it and repairs
    the stripe from the learner: v1 within 10 s; the reports demote it, so v2 plans nobody on it."""
    from echo2.broadcast.wire import Pacer

    blob = synthetic_snapshot(50 * 4 * CHUNK, seed=4)  # 50 chunks a stripe, 4 stripes

    async def go() -> None:
        drip = {3: {"uplink": Pacer(CHUNK / 0.3, burst=CHUNK)}}
        pub, nodes, _, _ = await _cluster(TreePipelined(), 4, node_kw=drip)
        honest = nodes[:3]
        for v in (1, 2):
            got: dict[str, bytes] = {}
            tasks = [asyncio.create_task(_install(nd, got)) for nd in nodes]
            await pub.publish(v, blob)
            await asyncio.wait_for(asyncio.gather(*tasks[:3]), 60)
            stats = await pub.wait_installed(v, timeout=10)  # every member whose ack may count
            assert {w: got[w] for w in ("w0", "w1", "w2")} == dict.fromkeys(("w0", "w1", "w2"), blob)
            worst = max(stats.install_s.get(nd.worker_id, float("inf")) for nd in honest)
            assert worst <= (10.0 if v == 1 else 3.0), f"v{v}: an honest install took {worst:.1f}s"
            assert pub.demoted() == ["w3"]
            for t in tasks[3:]:
                t.cancel()
        assert sum(nd.counters.stalls_reported for nd in honest) >= 2  # each child that pulled from it
        await _shutdown(pub, nodes)

    asyncio.run(go())


def test_a_relay_slower_than_its_peers_but_never_lagging_is_placed_lower() -> None:
    """Six members, every uplink paced: five at 800 KB/s, one at a third of that. Each roots a stripe of
    20 chunks and serves it to the five others, so the slow one's children get it at a third of their
    other sources' pace: above the lag rule's quarter (never cut, never reported), so before the acks'
    paces it slowed every member for every version. Its children's acks read it at about 0.33 of their
    other sources (``conduct.SLOW_PACE`` 0.5): found slow READ_AFTER versions later, the trees are built
    again over links that say so, and it serves one or two members (the model's layout for its link:
    k = N = 6 stripes, so it still roots one and hands it on) instead of five; the honest installs take
    well under 0.7x as long (3.1 s -> 1.3 s here)."""
    from echo2.broadcast.conduct import READ_AFTER
    from echo2.broadcast.wire import Pacer

    blob = synthetic_snapshot(20 * 6 * CHUNK, seed=5)
    rate = 800_000.0

    async def go() -> None:
        kw = {i: {"uplink": Pacer(rate / (3 if i == 5 else 1), burst=CHUNK)} for i in range(6)}
        pub, nodes, _, _ = await _cluster(TreePipelined(), 6, node_kw=kw)
        worst = {}
        for v in range(1, READ_AFTER + 3):
            got: dict[str, bytes] = {}
            tasks = [asyncio.create_task(_install(nd, got)) for nd in nodes]
            await pub.publish(v, blob)
            stats = await pub.wait_installed(v, count=6, timeout=30)
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            assert got == {nd.worker_id: blob for nd in nodes}
            worst[v] = max(t for w, t in stats.install_s.items() if w != "w5")
            served = [w for w, pulls in pub._rounds[v].plan.items() if any(a.source == "w5" for a in pulls)]
            assert len(served) == 5 if v <= READ_AFTER else len(served) <= 2, f"v{v}: w5 serves {served}"
        assert sum(nd.counters.stalls_reported for nd in nodes) == 0  # never lagging: nobody cut it
        assert set(pub.conduct.slow()) == {"w5"} and 0.2 < pub.conduct.slow()["w5"] < 0.5
        assert pub.counters.metrics()["broadcast/relays_slow"] >= 1  # found in v1, again in v2
        assert worst[READ_AFTER + 2] < 0.7 * worst[1], worst
        await _shutdown(pub, nodes)

    asyncio.run(go())


async def _forwarder(listen: int, target: int) -> tuple[asyncio.Server, list[int]]:
    """A router's port forwarding: connections to ``listen`` are piped to ``target`` (counted)."""
    seen: list[int] = []

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await r.read(1 << 16):
                w.write(data)
                await w.drain()
        w.close()

    async def on(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        seen.append(1)
        tr, tw = await asyncio.open_connection("127.0.0.1", target)
        await asyncio.gather(pipe(r, tw), pipe(tr, w))

    return await asyncio.start_server(on, "127.0.0.1", listen), seen


def test_a_relay_behind_port_forwarding_serves_its_peers() -> None:
    """A worker whose chunk server binds a fixed port (``--relay-port``) behind a router that forwards
    another (``--advertise-port``): it joins with the forwarded port, its peers pull through the router,
    and every worker installs the exact blob. A fixed port already taken is refused in one line."""

    async def go() -> None:
        bound, forwarded = free_ports(2)
        router, pulls = await _forwarder(forwarded, bound)
        behind = {"port": bound, "advertise_port": forwarded}
        pub, nodes, got, _ = await _cluster(get_strategy("tree-pipelined"), 3, node_kw={0: behind})
        assert nodes[0].port == bound
        await _broadcast(pub, nodes, got)
        assert got == {f"w{i}": BLOB for i in range(3)}
        assert pulls, "no peer pulled through the forwarded port"
        taken = TcpWorkerNode("late", pub.address, PUBLIC, port=bound)  # the fixed port is in use
        with pytest.raises(Echo2Error, match=f"cannot serve chunks on 127.0.0.1:{bound}"):
            await taken.start(join_timeout=2)
        await _shutdown(pub, nodes)
        router.close()

    asyncio.run(go())
