"""A stalling relay costs only its own work: the first-chunk deadline, a node's memory of peers that
failed it, stall reports, demotion and plan exclusion on the publisher, install acks checked against
their receipts; and a peer's garbage refused on both ports as a ProtocolError with one log line, never a
traceback. In-process, on loopback sockets (each test well under two seconds)."""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from typing import Any

import pytest
from plans import announced

from echo2.broadcast.access import Credential, issue, pull_request
from echo2.broadcast.api import OpenLedger, PublisherCounters
from echo2.broadcast.buffer import SnapshotBuffer, serve_get
from echo2.broadcast.in_memory import InMemoryHub
from echo2.broadcast.pipelined import TreePipelined
from echo2.broadcast.publisher import DEMOTE_AFTER_REPORTS, TcpPublisher, receipt_fault
from echo2.broadcast.receiver import AVOID_VERSIONS, TcpWorkerNode
from echo2.broadcast.strategy import LEARNER, Assignment, plan_with_leaves
from echo2.broadcast.wire import (
    MAX_DEPTH,
    ProtocolError,
    encode,
    first_chunk_deadline,
    parse_header,
    read_header,
    read_payload,
    write_frame,
)
from echo2.weights.frames import GetFrame, decode_chunk_list, parse_frame
from echo2.weights.manifest import build_manifest, new_signing_key

KEY = new_signing_key()
PUBLIC = KEY.verifier()
CHUNK = 4096
BLOB = bytes(range(256)) * 160  # 40960 bytes: 10 chunks
N_CHUNKS = 10


def _frame(body: bytes) -> bytes:
    return struct.pack("!I", len(body)) + body


def _no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    assert not [r for r in caplog.records if r.exc_info], "a handler logged a traceback"
    assert "Traceback" not in caplog.text and "never retrieved" not in caplog.text


# -- the rules, by hand -------------------------------------------------------------------------------
def test_first_chunk_deadline_worked_by_hand() -> None:
    # No evidence yet that peers are quick (no learner chunk, no peer chunk, no bytes): the full stall.
    assert first_chunk_deadline(5.0, 0.5, None, 0.1, 4, 8192, 10_000) == 5.0
    # no peer delivered yet (two members: the only peer is the one judged): the learner's stripe is the
    # reference; ref = max(0.1, 3 * 8192 * 0.5 / 10,000 = 1.2288 s); 4 * that = 4.9152 s
    assert first_chunk_deadline(5.0, 0.5, 0.1, None, 4, 8192, 10_000) == pytest.approx(4.9152)
    assert first_chunk_deadline(5.0, 0.5, 0.05, None, 2, 8192, 300_000) == 1.0  # N = 2 on loopback: 1 s
    assert first_chunk_deadline(5.0, 0.5, 0.1, 0.1, 4, 8192, 0) == 5.0
    # Loopback: ref = max(0.01, 0.02, 3 * 8192 B / (150 kB / 1 s) = 0.164 s); 4 * 0.164 = 0.66 < 1 s floor.
    assert first_chunk_deadline(5.0, 1.0, 0.01, 0.02, 4, 8192, 150_000) == 1.0
    # The first peer took 0.5 s: 4 * 0.5 = 2 s.
    assert first_chunk_deadline(5.0, 1.0, 0.01, 0.5, 4, 8192, 150_000) == pytest.approx(2.0)
    # N = 16, c = 16 KiB, 1 MB in 2 s (r = 0.5 MB/s): 15 * 16384 / 5e5 = 0.49152 s; 4 * that = 1.96608 s.
    assert first_chunk_deadline(5.0, 2.0, 0.1, 0.2, 16, 16384, 1_000_000) == pytest.approx(1.96608)
    # A WAN anchor whose first peer chunk came at 1.4 s (rate term 15 * 114 kB / 2 MB/s = 0.855 s): 4 * 1.4
    # = 5.6 s, never above the stall timeout, which the learner's hint may raise (to 20 s here).
    assert first_chunk_deadline(5.0, 1.5, 0.015, 1.4, 16, 114_000, 3_000_000) == 5.0
    assert first_chunk_deadline(20.0, 1.5, 0.015, 1.4, 16, 114_000, 3_000_000) == pytest.approx(5.6)
    # While nothing more arrives r falls as 1/elapsed: at 10 s the rate term is 3 * 8192 * 10 / 150 kB.
    assert first_chunk_deadline(5.0, 10.0, 0.01, 0.02, 4, 8192, 150_000) == 5.0  # 4 * 1.64 = 6.6 > 5


def test_demoted_members_pull_everything_from_the_learner_and_relay_nothing() -> None:
    members = ["a", "b", "c", "d"]
    plan = plan_with_leaves(TreePipelined(), members, {"c"}, 12)
    assert plan["c"] == (Assignment(LEARNER, tuple(range(12))),)
    assert all(x.source != "c" for w in members for x in plan[w])  # nobody waits on c
    assert {w: plan[w] for w in "abd"} == TreePipelined().plan(["a", "b", "d"], 12)  # the rest as before
    every = plan_with_leaves(TreePipelined(), members, set(members), 3)  # all demoted: a star
    assert all(every[w] == (Assignment(LEARNER, (0, 1, 2)),) for w in members)
    assert plan_with_leaves(TreePipelined(), members, set(), 12) == TreePipelined().plan(members, 12)


def test_receipt_fault_names_what_does_not_add_up() -> None:
    plan = {"learner", "b", "c"}
    assert receipt_fault({"learner": 4, "b": 3, "c": 3}, plan, 10, served=4) is None
    assert receipt_fault({"learner": 10}, plan, 10, served=12) is None  # repairs: the learner served more
    assert "outside its plan" in (receipt_fault({"learner": 4, "z": 6}, plan, 10, 4) or "")
    assert "add up to 9" in (receipt_fault({"learner": 4, "b": 3, "c": 2}, plan, 10, 4) or "")
    assert "served it 0" in (receipt_fault({"learner": 4, "b": 3, "c": 3}, plan, 10, 0) or "")
    assert "add up to 0" in (receipt_fault({}, plan, 10, 0) or "")  # an ack without receipts


def test_headers_refuse_garbage_as_protocol_errors() -> None:
    deep = b'{"op":"get","x":' + b"[" * 5000 + b"]" * 5000 + b"}"
    for raw, what in [
        (deep, "nests deeper"),
        (b'{"op":"get","x":' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}", "deeper than 16"),
        (b'{"op":"get","from":"\xff"}', "not UTF-8"),
        (b'{"op":"get","from":"\xed\xa0\x80"}', "not UTF-8"),  # a surrogate encoded as UTF-8
        (b'{"op":"join","worker":"\\ud800"}', "lone UTF-16 surrogate"),
        (b'{"op":"join","w":{"\\udfff":1}}', "lone UTF-16 surrogate"),  # in a key
        (b'{"op":"get","v":NaN}', "not JSON"),
        (b'{"op":"get","v":-Infinity}', "not JSON"),
        (b'{"op":"get","v":1e999}', "not JSON"),
        (b'{"op":"get","v":' + b"9" * 5000 + b"}", "not JSON"),
        (b'{"op":"chunk","n":true}', "non-negative integer"),
        (b'{"op":"chunk","n":-1}', "non-negative integer"),
        (b'["op"]', "JSON object"),
        (b'{"op":5}', "string 'op'"),
    ]:
        with pytest.raises(ProtocolError, match=what):
            parse_header(raw)
    ok = b'{"op":"x","a":' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b',"s":"\\ud83d\\ude00"}'
    assert parse_header(ok)["s"] == "\N{GRINNING FACE}"  # a surrogate pair is a character, depth 16 is fine


def test_the_in_memory_hub_has_the_same_counters() -> None:
    hub = InMemoryHub(b"s" * 32)
    assert isinstance(hub.counters, PublisherCounters)
    assert hub.counters.metrics() == {
        "broadcast/stall_reports": 0.0,
        "broadcast/reports_refused": 0.0,
        "broadcast/reports_starved": 0.0,
        "broadcast/relays_demoted": 0.0,
        "broadcast/relays_slow": 0.0,
        "broadcast/acks_refused": 0.0,
        "broadcast/members_expelled": 0.0,
        "broadcast/bad_frames": 0.0,
        "broadcast/peer_errors": 0.0,
        "broadcast/latecomers": 0.0,
        "broadcast/latecomers_from_learner": 0.0,
    }


# -- the publisher: reports, demotion, acks -----------------------------------------------------------
async def _join(addr: tuple[str, int], worker: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(*addr)
    await write_frame(writer, {"op": "join", "worker": worker, "host": "127.0.0.1", "port": 9})
    return reader, writer


async def _pull_learner(addr: tuple[str, int], ann: dict[str, Any]) -> int:
    """Pull the chunks the plan puts on the learner, as a member would; how many came."""
    chunks = [i for s, ch in announced(ann) if s == LEARNER for i in ch]
    if not chunks:
        return 0
    reader, writer = await asyncio.open_connection(*addr)
    await write_frame(writer, *pull_request(Credential.from_dict(ann["credential"]), chunks, False, "", None))
    for _ in chunks:
        h = await read_header(reader)
        await read_payload(reader, h, CHUNK)
    writer.close()
    return len(chunks)


def _planned(ann: dict[str, Any]) -> dict[str, int]:
    got: dict[str, int] = {}
    for s, ch in announced(ann):
        got[s] = got.get(s, 0) + len(ch)
    return got


class Verdicts(OpenLedger):
    """A ledger that keeps the publisher's verdicts on its members as relays, in order."""

    def __init__(self) -> None:
        self.conduct: list[tuple[str, bool]] = []

    def relay_conduct(self, worker_id: str, demoted: bool) -> None:
        self.conduct.append((worker_id, demoted))


async def _three_members() -> tuple[TcpPublisher, dict[str, Any]]:
    """A started publisher with members a, b and c joined (their control connections by name), its
    ledger a :class:`Verdicts`."""
    pub = TcpPublisher(KEY, TreePipelined(), chunk_size=CHUNK, ledger=Verdicts())
    await pub.start()
    ctl = {}
    for w in "abc":
        ctl[w] = await _join(pub.address, w)
        await pub.wait_members(len(ctl), 5)
    return pub, ctl


async def _send(ctl: dict[str, Any], w: str, msg: dict[str, Any]) -> None:
    await write_frame(ctl[w][1], msg)
    await asyncio.sleep(0.02)


def test_publisher_counts_reports_demotes_a_staller_and_checks_acks(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)

    async def go() -> None:
        pub, ctl = await _three_members()
        await pub.publish(1, BLOB)
        ann = {w: await read_header(ctl[w][0]) for w in ctl}
        assert all("c" in {s for s, _ in announced(ann[w])} for w in "ab")  # c relays for a and b

        async def send(w: str, msg: dict[str, Any]) -> None:
            await _send(ctl, w, msg)

        # c really pulls its stripe and acks first, with receipts that add up: counted, for now
        assert await _pull_learner(pub.address, ann["c"]) > 0
        await send("c", {"op": "installed", "v": 1, "got": _planned(ann["c"])})
        assert set(pub.stats(1).install_s) == {"c"}
        await send("a", {"op": "stalled", "v": 1, "source": "c"})  # withdrawn: reported stalling
        assert pub.stats(1).install_s == {} and pub.counters.acks_refused == 1 and pub.demoted() == []
        for bad in ("learner", "c", "ghost"):  # not a peer source / already reported / not in its plan
            await send("a", {"op": "stalled", "v": 1, "source": bad})
        await send("a", {"op": "stalled", "v": 99, "source": "b"})  # no such version
        assert pub.counters.reports_refused == 4 and pub.counters.stall_reports == 1
        await send("b", {"op": "stalled", "v": 1, "source": "c"})
        assert DEMOTE_AFTER_REPORTS == 2 and pub.demoted() == ["c"] and pub.counters.relays_demoted == 1
        assert pub.ledger.conduct == [("c", True)]  # the member's record shows it (runtime/members.py)
        await send("c", {"op": "installed", "v": 1, "got": _planned(ann["c"])})  # ignored: already refused
        await send("a", {"op": "installed", "v": 1, "got": {"learner": N_CHUNKS}})  # learner served it 0
        assert pub.counters.acks_refused == 2
        await _pull_learner(pub.address, ann["b"])
        # b reports a, then acks; a had reported c (its own source) first: the report is of the
        # starvation a passed on (reports_starved), and a's ack is out for its receipts, not for it
        await send("b", {"op": "stalled", "v": 1, "source": "a"})
        await send("b", {"op": "installed", "v": 1, "got": _planned(ann["b"])})
        assert set(pub.stats(1).install_s) == {"b"}
        t0 = time.monotonic()
        stats = await pub.wait_installed(1, timeout=5)  # refused / reported members are not waited for
        assert time.monotonic() - t0 < 1.0 and set(stats.install_s) == {"b"}
        assert stats.n_refused == 2 and stats.n_counted == 1 and stats.t_quorum(1.1) == stats.install_s["b"]

        await pub.publish(2, BLOB)
        ann = {w: await read_header(ctl[w][0]) for w in ctl}
        assert announced(ann["c"]) == [(LEARNER, list(range(N_CHUNKS)))] and ann["c"]["serve"] == []
        assert all(s != "c" for w in "ab" for s, _ in announced(ann[w]))  # nobody pulls from c again
        await send("a", {"op": "installed", "v": 2, "got": {"c": N_CHUNKS}})  # c is no source of a now
        assert pub.counters.acks_refused == 3
        assert await _pull_learner(pub.address, ann["c"]) == N_CHUNKS  # a leaf: everything, uncapped
        await send("c", {"op": "installed", "v": 2, "got": {LEARNER: N_CHUNKS}})
        assert set(pub.stats(2).install_s) == {"c"}  # an honest install of a demoted member counts
        assert pub.counters.metrics()["broadcast/stall_reports"] == 2.0
        assert pub.counters.metrics()["broadcast/reports_starved"] == 1.0
        for w in ctl:
            ctl[w][1].close()
        await pub.close()

    asyncio.run(go())
    _no_traceback(caplog)
    assert "no longer relays" in caplog.text


# -- garbage on the publisher's port ------------------------------------------------------------------
FIRST_FRAMES = [  # each a connection's first frame: refused before anything else happens
    b'{"op":"get","x":' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"op":"join","worker":"\xff\xfe","host":"h","port":1}',
    b'{"op":"join","worker":"\\ud800","host":"h","port":1}',
    b'{"op":"get","v":NaN}',
    encode({"op": "join", "worker": ["w"], "host": "h", "port": 1})[4:],
    encode({"op": "join", "worker": "w", "host": "h", "port": "1"})[4:],
    encode({"op": "join", "worker": "w", "host": "h", "port": True})[4:],
    encode({"op": "join", "worker": "w", "host": "h" * 300, "port": 1})[4:],
    encode({"op": "join", "worker": "w" * 200, "host": "h", "port": 1})[4:],
    encode({"op": "join", "worker": "w", "host": "h", "port": 1, "cert": 5})[4:],
    encode({"op": "dance"})[4:],
]
CONTROL_FRAMES = [  # after a good join, on the control connection: the member is dropped
    {"op": "installed", "v": "1", "got": {}},
    {"op": "installed", "v": True, "got": {}},
    {"op": "installed", "v": 1, "got": [1]},
    {"op": "installed", "v": 1, "got": {"learner": -1}},
    {"op": "installed", "v": 1, "got": {"learner": 1.5}},
    {"op": "stalled", "v": 1, "source": 5},
    {"op": "stalled", "v": None, "source": "x"},
    {"op": "rejected", "v": "x"},
    {"op": "dance", "v": 1},
]


def test_publisher_port_refuses_garbage_with_one_line_each(caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> TcpPublisher:
        pub = TcpPublisher(KEY, TreePipelined(), chunk_size=CHUNK, ledger=OpenLedger())
        await pub.start()
        for body in FIRST_FRAMES:
            r, w = await asyncio.open_connection(*pub.address)
            w.write(_frame(body))
            await w.drain()
            assert await asyncio.wait_for(r.read(), 5) == b""  # dropped
        for frame in CONTROL_FRAMES:
            r, w = await _join(pub.address, "m")
            await pub.wait_members(1, 5)
            await write_frame(w, frame)
            assert await asyncio.wait_for(r.read(), 5) == b""
            await asyncio.sleep(0.01)
            assert pub.members() == []  # and it is no longer a member
        r, w = await asyncio.open_connection(*pub.address)  # a get with wrong types: the gate refuses it
        await write_frame(w, {"op": "get", "from": 5, "v": "1", "chunks": "all", "cred": []})
        assert (await read_header(r))["op"] == "error" and await r.read() == b""
        r, w = await _join(pub.address, "ok")  # and the port still serves
        await pub.wait_members(1, 5)
        w.close()
        await pub.close()
        return pub

    pub = asyncio.run(go())
    assert pub.counters.bad_frames == len(FIRST_FRAMES) + len(CONTROL_FRAMES)
    assert pub.refusals.refused_requests == 1 and pub.counters.peer_errors == 0
    _no_traceback(caplog)
    # each counted; logged one line at a time, the repeats of a kind sampled (a stranger can send them at
    # will: echo2.logs.SampledLog), so at least one line and never more than one per frame
    lines = caplog.text.count("dropping connection")
    assert 1 <= lines <= len(FIRST_FRAMES) + len(CONTROL_FRAMES)


def test_an_unexpected_exception_from_a_peer_is_counted_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    class Ledger(OpenLedger):
        def may_join(self, worker_id: str, credential: object) -> bool:
            raise RuntimeError("a case nobody thought of")

    async def go() -> TcpPublisher:
        pub = TcpPublisher(KEY, TreePipelined(), chunk_size=CHUNK, ledger=Ledger())
        await pub.start()
        r, _ = await _join(pub.address, "m")
        assert await asyncio.wait_for(r.read(), 5) == b""
        await pub.close()
        return pub

    pub = asyncio.run(go())
    assert pub.counters.peer_errors == 1
    _no_traceback(caplog)
    assert "unexpected RuntimeError: a case nobody thought of" in caplog.text


# -- a worker node: its port, its announcements, its memory -------------------------------------------
def test_node_port_refuses_garbage_with_one_line_each(caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> TcpWorkerNode:
        pub = TcpPublisher(KEY, TreePipelined(), chunk_size=CHUNK, ledger=OpenLedger())
        await pub.start()
        node = TcpWorkerNode("w", pub.address, PUBLIC)
        await node.start()
        for body in [*FIRST_FRAMES, encode({"op": "join", "worker": "x", "host": "h", "port": 1})[4:]]:
            r, w = await asyncio.open_connection("127.0.0.1", node.port)
            w.write(_frame(body))
            await w.drain()
            assert await asyncio.wait_for(r.read(), 5) == b""
        r, w = await asyncio.open_connection("127.0.0.1", node.port)
        await write_frame(w, {"op": "get", "from": "x", "v": 1, "chunks": [0], "cred": {"run": 5}})
        assert (await read_header(r))["op"] == "error" and await r.read() == b""

        async def boom(header: dict[str, Any], reader: Any, writer: asyncio.StreamWriter) -> None:
            raise KeyError("nobody expected this")

        node._serve = boom  # type: ignore[method-assign]  # the last catch: whatever a peer's bytes reach
        r, w = await asyncio.open_connection("127.0.0.1", node.port)
        await write_frame(w, {"op": "get"})
        assert await asyncio.wait_for(r.read(), 5) == b""
        await node.close()
        await pub.close()
        return node

    node = asyncio.run(go())
    assert node.counters.bad_frames == len(FIRST_FRAMES) + 1 and node.refusals.refused_requests == 1
    assert node.counters.peer_errors == 1
    _no_traceback(caplog)
    assert "unexpected KeyError" in caplog.text


class _Cluster:
    """A fake learner (control + chunks), an honest fake peer and a silent one around one real node."""

    def __init__(self) -> None:
        self.joined: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
        self.learner_gets: list[dict[str, Any]] = []
        self.buffers: dict[int, SnapshotBuffer] = {}
        self.servers: list[asyncio.Server] = []

    async def start(self) -> dict[str, tuple[str, int]]:
        async def learner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            h = await read_header(reader)
            if h["op"] != "get":
                await self.joined.put((reader, writer))
                return
            pull = parse_frame(h, GetFrame)
            chunks = decode_chunk_list(await reader.readexactly(pull.n))
            self.learner_gets.append({**h, "chunks": chunks})
            await serve_get(pull, chunks, writer, self.buffers.get, None, 5.0)
            writer.close()

        async def honest(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            pull = parse_frame(await read_header(reader), GetFrame)
            chunks = decode_chunk_list(await reader.readexactly(pull.n))
            await serve_get(pull, chunks, writer, self.buffers.get, None, 5.0)
            writer.close()

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while await reader.read(1 << 16):
                pass

        addrs = {}
        for name, handler in ((LEARNER, learner), ("honest", honest), ("silent", silent)):
            server = await asyncio.start_server(handler, "127.0.0.1", 0)
            self.servers.append(server)
            addrs[name] = server.sockets[0].getsockname()[:2]
        return addrs

    def announce(self, v: int, addrs: dict[str, tuple[str, int]]) -> dict[str, Any]:
        manifest = build_manifest(BLOB, v, CHUNK, KEY)
        self.buffers[v] = SnapshotBuffer(manifest, BLOB)
        sources = [[LEARNER, [0, 3, 6, 9]], ["honest", [1, 4, 7]], ["silent", [2, 5, 8]]]
        return {
            "op": "announce", "manifest": manifest.to_dict(), "sources": sources, "serve": [],
            "peers": {k: list(a) for k, a in addrs.items()}, "credential": issue(KEY, v, "w", "").to_dict(),
        }  # fmt: skip


async def _next_ctl(reader: asyncio.StreamReader, op: str) -> dict[str, Any]:
    while True:
        h = await asyncio.wait_for(read_header(reader), 10)
        if h["op"] == op:
            return h


def test_node_gives_up_a_silent_peer_at_the_deadline_reports_and_remembers_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """v1: the silent peer is abandoned about 1 s in (not the 5 s stall timeout), reported, and its
    chunks repaired from the learner; v2: its chunks come from the learner at once and nothing is
    reported again. Each ack carries the node's receipts. Malformed announcements are refused first."""

    async def go() -> None:
        cluster = _Cluster()
        addrs = await cluster.start()
        node = TcpWorkerNode("w", addrs[LEARNER], PUBLIC, stall_timeout=5.0)
        await node.start()
        ctl_r, ctl_w = await cluster.joined.get()
        good = cluster.announce(1, addrs)
        bad = [
            {**good, "peers": [["learner", *addrs[LEARNER]]]},
            {**good, "peers": {**good["peers"], "honest": ["127.0.0.1", "port"]}},
            {**good, "sources": [[LEARNER, list(range(N_CHUNKS + 1))]]},
            {**good, "sources": [[LEARNER, [0.5]]]},
            {**good, "sources": {"learner": [0]}},
            {**good, "stall_hint": "long"},
            {**good, "stall_hint": True},
            {**good, "serve": [1]},
            {**good, "manifest": [1, 2]},
        ]
        for ann in bad:
            await write_frame(ctl_w, ann)
            assert (await _next_ctl(ctl_r, "rejected"))["v"] in (1, None)
        assert node.counters.rejected_manifests == len(bad)

        for v, (lo, hi) in ((1, (0.8, 2.5)), (2, (0.0, 0.5))):
            t0 = time.monotonic()
            await write_frame(ctl_w, cluster.announce(v, addrs))
            snaps = node.snapshots()
            snap = await asyncio.wait_for(snaps.__anext__(), 10)
            took = time.monotonic() - t0
            assert snap.manifest.version == v and bytes(snap.data) == BLOB
            assert lo <= took <= hi, f"v{v} installed in {took:.2f}s"
            await node.report_installed(v)
            if v == 1:
                assert await _next_ctl(ctl_r, "stalled") == {"op": "stalled", "v": 1, "source": "silent"}
            ack = await _next_ctl(ctl_r, "installed")  # v2: no stall report before it
            assert ack == {"op": "installed", "v": v, "got": {LEARNER: 7, "honest": 3}, "pace": {}}
        assert node.counters.stalls_reported == 1 and node.counters.avoided_chunks == 3
        assert node.avoided() == {"silent": 1 + AVOID_VERSIONS}
        v2 = {tuple(g["chunks"]): g["repair"] for g in cluster.learner_gets if g["v"] == 2}
        assert v2 == {(0, 3, 6, 9): False, (2, 5, 8): True}  # the silent peer's chunks: at once, uncapped
        await node.close()
        for server in cluster.servers:
            server.close()

    asyncio.run(go())
    _no_traceback(caplog)
    assert "source silent failed for v1 (no first chunk within 1." in caplog.text


def test_a_demotion_undone_by_a_starvation_report_is_told_to_the_ledger_both_ways() -> None:
    """b reports a stalling in two versions: a is demoted (the ledger told); a then reports its own
    source c in the second: the second report was the starvation it passed on, the demotion is undone
    (the ledger told again) and a relays."""

    async def go() -> None:
        pub, ctl = await _three_members()
        for v in (1, 2):
            await pub.publish(v, BLOB)
            ann = {w: await read_header(ctl[w][0]) for w in ctl}
            assert "c" in {s for s, _ in announced(ann["a"])} and "a" in {s for s, _ in announced(ann["b"])}
            await _send(ctl, "b", {"op": "stalled", "v": v, "source": "a"})
        assert pub.demoted() == ["a"] and pub.ledger.conduct == [("a", True)]
        await _send(ctl, "a", {"op": "stalled", "v": 2, "source": "c"})
        assert pub.demoted() == [] and pub.ledger.conduct == [("a", True), ("a", False)]
        assert pub.counters.relays_demoted == 0
        for w in ctl:
            ctl[w][1].close()
        await pub.close()

    asyncio.run(go())


def test_a_relay_starved_by_its_own_source_is_not_blamed_for_the_stall_it_passes_on() -> None:
    """A relay whose source froze passes the stall on to the members below it: their reports of it,
    before or after its own report of its source, count as ``reports_starved`` (no strike, no
    demotion), and its install ack counts; the frozen source is the one reported."""

    async def go() -> None:
        pub, ctl = await _three_members()

        async def send(w: str, msg: dict[str, Any]) -> None:
            await _send(ctl, w, msg)

        for v in (1, 2):  # two versions: two counted reports would demote a
            await pub.publish(v, BLOB)
            ann = {w: await read_header(ctl[w][0]) for w in ctl}
            src = {w: {s for s, _ in announced(ann[w])} for w in ctl}
            assert "c" in src["a"] and "a" in src["b"]  # c relays for a, a for b
            if v == 1:  # b's report of a arrives first, then a's of c: a is exonerated afterwards
                await send("b", {"op": "stalled", "v": v, "source": "a"})
                assert pub.counters.stall_reports == 1
                await send("a", {"op": "stalled", "v": v, "source": "c"})
            else:  # a reports c first; b's report of a is then not counted at all
                await send("a", {"op": "stalled", "v": v, "source": "c"})
                await send("b", {"op": "stalled", "v": v, "source": "a"})
            await _pull_learner(pub.address, ann["a"])
            await send("a", {"op": "installed", "v": v, "got": _planned(ann["a"])})
            assert "a" in pub.stats(v).install_s  # a's install counts
        assert pub.counters.stall_reports == 2 and pub.counters.reports_starved == 2  # c twice; a none
        assert pub.demoted() == ["c"] and pub.counters.acks_refused == 0
        for w in ctl:
            ctl[w][1].close()
        await pub.close()

    asyncio.run(go())


def test_an_announcement_names_only_the_peers_its_member_needs() -> None:
    """A member is told the address of each peer it pulls from or repairs from (and the learner's), never
    the whole fleet's, and how many members the version went to (its stall deadline's N): a frame's size
    does not grow with the fleet. 12 and 48 members over loopback (trees of depth 2 and 3)."""

    async def frames(n: int) -> list[tuple[dict[str, Any], int]]:
        pub = TcpPublisher(KEY, TreePipelined(), chunk_size=CHUNK, ledger=OpenLedger())
        await pub.start()
        ctl = {f"m{i}": await _join(pub.address, f"m{i}") for i in range(n)}
        await pub.wait_members(n, 5)
        await pub.publish(1, BLOB * 8)  # 80 chunks
        got = []
        for r, _ in ctl.values():
            (size,) = struct.unpack("!I", await r.readexactly(4))
            got.append((parse_header(await r.readexactly(size)), size))
        for _, w in ctl.values():
            w.close()
        await pub.close()
        return got

    sizes = {}
    for n in (12, 48):
        got = asyncio.run(frames(n))
        for ann, _ in got:
            named = {s for s, _ in announced(ann)} | set(ann["repair"].values()) | {LEARNER}
            assert set(ann["peers"]) == named and ann["members"] == n
        assert n < 48 or any(ann["repair"] for ann, _ in got)  # depth 3: ancestors named too
        sizes[n] = max(size for _, size in got)
    assert sizes[48] < 1.25 * sizes[12]  # 4 times the fleet, not 4 times the frame


class _Sink:
    """A member's control connection that keeps what is written to it."""

    def __init__(self) -> None:
        self.data = b""

    def writelines(self, pieces: list[bytes]) -> None:
        self.data += b"".join(pieces)

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        return None

    def is_closing(self) -> bool:
        return False


def test_a_version_to_the_same_fleet_reuses_the_plan_and_a_changed_fleet_gets_a_new_one() -> None:
    """Planning a publication for a large fleet costs (the trees, the repair sources, who serves whom):
    a version announced to the same members at the same addresses, with the same chunk count, reuses
    the last plan; a member gone, a member moved or another chunk count plans again. Each member still
    gets its own announcement, with a credential for that version."""
    from echo2.broadcast.publisher import _Member

    async def go() -> None:
        pub = TcpPublisher(KEY, TreePipelined(), chunk_size=CHUNK, ledger=OpenLedger())
        sinks = {f"m{i}": _Sink() for i in range(40)}
        for w, sink in sinks.items():
            pub._members[w] = _Member(w, ("127.0.0.1", 9), "", sink)  # type: ignore[arg-type]

        async def publish(v: int, blob: bytes) -> None:
            await pub.publish(v, blob)
            while pub._tasks:
                await asyncio.gather(*list(pub._tasks))

        await publish(1, BLOB)
        await publish(2, BLOB)
        assert pub._rounds[2].plan is pub._rounds[1].plan and pub._rounds[2].serves is pub._rounds[1].serves
        for sink in sinks.values():  # two announcements each, the second with its credential for v2
            (first,) = struct.unpack("!I", sink.data[:4])
            second = parse_header(sink.data[8 + first :])
            assert second["credential"]["version"] == 2 and second["manifest"]["version"] == 2
        del pub._members["m3"]
        await publish(3, BLOB)
        assert pub._rounds[3].plan is not pub._rounds[2].plan and "m3" not in pub._rounds[3].plan
        await publish(4, BLOB + BLOB)  # twice the chunks
        assert pub._rounds[4].plan is not pub._rounds[3].plan
        pub._members["m4"].addr = ("127.0.0.2", 9)
        await publish(5, BLOB + BLOB)
        assert pub._rounds[5].plan is not pub._rounds[4].plan

    asyncio.run(go())


def test_an_announcement_waits_behind_a_frame_being_written_to_its_member() -> None:
    """Announcements are written at once, without a task each, to members nothing else is being
    written to; a member with a frame under way (its lock held) gets its announcement after it, whole,
    in order."""
    from echo2.broadcast.publisher import _Member

    async def go() -> None:
        pub = TcpPublisher(KEY, TreePipelined(), chunk_size=CHUNK, ledger=OpenLedger())
        sinks = {w: _Sink() for w in ("a", "b")}
        for w, sink in sinks.items():
            pub._members[w] = _Member(w, ("127.0.0.1", 9), "", sink)  # type: ignore[arg-type]
        busy = pub._members["b"]
        await busy.lock.acquire()  # a frame to b under way
        await pub.publish(1, BLOB)
        assert sinks["a"].data and not sinks["b"].data and len(pub._tasks) == 1  # b's waits its turn
        sinks["b"].write(b"EARLIER")
        busy.lock.release()
        while pub._tasks:
            await asyncio.gather(*list(pub._tasks))
        assert sinks["b"].data.startswith(b"EARLIER")
        frame = parse_header(sinks["b"].data[len(b"EARLIER") + 4 :])
        assert frame["op"] == "announce" and frame["credential"]["member"] == "b"

    asyncio.run(go())
