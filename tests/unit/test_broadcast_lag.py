"""A relay that sends, but far slower than a member's other sources: ``wire.lagging`` and
``wire.next_chunk_deadline`` worked by hand, and a real node that cuts a drip-feeding peer (one chunk
just inside the stall timeout, which no stall ever caught), reports it and repairs its stripe from the
learner, while a peer half as fast as the others keeps its stream."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from echo2.broadcast.access import issue
from echo2.broadcast.buffer import SnapshotBuffer, serve_get
from echo2.broadcast.receiver import TcpWorkerNode
from echo2.broadcast.strategy import LEARNER
from echo2.broadcast.wire import (
    LAG_FACTOR,
    LAG_MIN_CHUNKS,
    LAG_SPAN,
    Pace,
    Pacer,
    finish_deadline,
    lagging,
    read_header,
    write_frame,
)
from echo2.weights.frames import ChunkFrame, GetFrame, decode_chunk_list, parse_frame, to_wire
from echo2.weights.manifest import build_manifest, new_signing_key

KEY = new_signing_key()
CHUNK = 4096
PER_STREAM = 40  # chunks of each of the 4 sources' stripes
BLOB = bytes(range(256)) * (16 * 4 * PER_STREAM)  # 160 chunks of 4 KiB
STALL_S = 5.0
DRIP_S = 1.5  # the drip-feeding relay's pause after each chunk: inside the stall timeout


def _pace(first: float, rate: float, count: int) -> Pace:
    """A stream whose ``count`` chunks came ``1 / rate`` s apart from ``first``."""
    p = Pace()
    for j in range(count):
        p.note(first + j / rate)
    return p


def test_lagging_and_the_finish_deadline_worked_by_hand() -> None:
    others = [_pace(0.0, 20.0, 20), _pace(0.5, 10.0, 17), _pace(0.0, 40.0, 40)]  # median rate 20/s
    span = LAG_SPAN * STALL_S  # 10 s
    assert "67x slower" in (lagging(_pace(0.0, 0.5, 3), others, span, STALL_S) or "")  # 3 in 10 s: 0.3/s
    assert lagging(_pace(0.0, 0.5, 3), others, span - 0.1, STALL_S) is None  # judged LAG_SPAN stalls in
    assert lagging(_pace(0.0, 5.0, 52), others, span, STALL_S) is None  # 5.2/s: within LAG_FACTOR of 20
    assert lagging(_pace(0.0, 5.0, 48), others, span, STALL_S) is not None  # 4.8/s: past it
    few = [_pace(0.0, 20.0, LAG_MIN_CHUNKS - 1)] * 3
    assert lagging(_pace(0.0, 0.5, 3), few, span, STALL_S) is None  # no reference yet
    assert lagging(Pace(), others, span, STALL_S) is None
    assert LAG_FACTOR == 4.0

    assert finish_deadline(10.0, 10.1, STALL_S) == 10.0 + STALL_S  # the others done in 0.1 s
    assert finish_deadline(10.0, 13.0, STALL_S) == pytest.approx(10.0 + LAG_FACTOR * 3.0)  # in 3 s: 12 s


class _Fleet:
    """A fake learner (control + chunks) and three fake peers around one real node: each source paced
    at its own rate (``drip``: a chunk, then ``DRIP_S`` of nothing), the node pulling a quarter of the
    chunks from each."""

    def __init__(self, rates: dict[str, float], blob: bytes, drip_s: float, planned: list[str]) -> None:
        self.rates = rates  # source -> bytes/s it serves at
        self.blob, self.drip_s = blob, drip_s
        self.planned = planned  # the sources the announcement names, in turn (default: every one)
        self.joined: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
        self.buffers: dict[int, SnapshotBuffer] = {}
        self.servers: list[asyncio.Server] = []
        self.repairs: list[list[int]] = []

    async def start(self) -> dict[str, tuple[str, int]]:
        def serving(name: str):  # type: ignore[no-untyped-def]
            async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                h = await read_header(reader)
                if h["op"] != "get":
                    await self.joined.put((reader, writer))
                    return
                pull = parse_frame(h, GetFrame)
                chunks = decode_chunk_list(await reader.readexactly(pull.n))
                if pull.repair:
                    self.repairs.append(chunks)
                if name == "drip" and not pull.repair:  # each chunk at once, then DRIP_S of nothing
                    buffer = self.buffers[pull.v]
                    for i in chunks:
                        payload = memoryview(buffer.buf)[i * CHUNK : (i + 1) * CHUNK]
                        await write_frame(writer, to_wire(ChunkFrame(v=pull.v, i=i)), payload)
                        await asyncio.sleep(self.drip_s)
                else:
                    pacer = None if pull.repair else Pacer(self.rates[name], burst=CHUNK)
                    await serve_get(pull, chunks, writer, self.buffers.get, None, 5.0, stream=pacer)
                writer.close()

            return handler

        addrs = {}
        for name in self.rates:
            server = await asyncio.start_server(serving(name), "127.0.0.1", 0)
            self.servers.append(server)
            addrs[name] = server.sockets[0].getsockname()[:2]
        return addrs

    def announce(self, v: int, addrs: dict[str, tuple[str, int]]) -> dict[str, Any]:
        manifest = build_manifest(self.blob, v, CHUNK, KEY)
        self.buffers[v] = SnapshotBuffer(manifest, self.blob)
        n = len(self.blob) // CHUNK
        sources = [[name, list(range(j, n, len(self.planned)))] for j, name in enumerate(self.planned)]
        return {
            "op": "announce", "manifest": manifest.to_dict(), "sources": sources, "serve": [],
            "peers": {k: list(a) for k, a in addrs.items()}, "credential": issue(KEY, v, "w", "").to_dict(),
        }  # fmt: skip


async def _install(
    rates: dict[str, float],
    blob: bytes = BLOB,
    drip_s: float = DRIP_S,
    stall_s: float = STALL_S,
    planned: list[str] | None = None,
) -> tuple[float, list[dict[str, Any]], TcpWorkerNode, _Fleet]:
    """One version of ``blob`` through a node pulling from sources at ``rates``: seconds to install, its
    control frames after the announcement (stall reports, the ack)."""
    fleet = _Fleet(rates, blob, drip_s, planned or list(rates))
    addrs = await fleet.start()
    node = TcpWorkerNode("w", addrs[LEARNER], KEY.verifier(), stall_timeout=stall_s)
    await node.start()
    ctl_r, ctl_w = await fleet.joined.get()
    t0 = time.monotonic()
    await write_frame(ctl_w, fleet.announce(1, addrs))
    snap = await asyncio.wait_for(node.snapshots().__anext__(), 60)
    took = time.monotonic() - t0
    assert bytes(snap.data) == blob
    await node.report_installed(1)
    frames = []
    while not frames or frames[-1]["op"] != "installed":
        frames.append(await asyncio.wait_for(read_header(ctl_r), 10))
    await node.close()
    for server in fleet.servers:
        server.close()
    return took, frames, node, fleet


def test_a_drip_feeding_relay_is_cut_reported_and_repaired_a_half_speed_one_is_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 2 s stall timeout. The learner and two peers at 20 chunks/s, a third at 10/s (half: kept), then
    the third sending its first chunk at once and one every 1.5 s after it, inside the stall timeout:
    without the lag rule its 40 chunks take 60 s; now it is cut LAG_SPAN stall timeouts (4 s) after its
    first chunk (3 chunks in 4 s against 20/s), reported, and its rest repaired from the learner."""
    fast, stall = 20 * CHUNK, 2.0
    caplog.set_level(logging.INFO, logger="echo2.broadcast.receiver")
    rates = {LEARNER: fast, "a": fast, "b": fast, "half": fast / 2}
    took, frames, node, fleet = asyncio.run(_install(rates, stall_s=stall))
    assert [f["op"] for f in frames] == ["installed"] and node.counters.stalls_reported == 0
    assert frames[0]["got"] == {LEARNER: PER_STREAM, "a": PER_STREAM, "b": PER_STREAM, "half": PER_STREAM}
    assert took < 6.0 and not fleet.repairs  # the half-speed stripe: 40 chunks at 10/s, about 4 s

    rates = {LEARNER: fast, "a": fast, "b": fast, "drip": 0.0}
    took, frames, node, fleet = asyncio.run(_install(rates, stall_s=stall))
    assert [f["op"] for f in frames] == ["stalled", "installed"]
    assert frames[0] == {"op": "stalled", "v": 1, "source": "drip"}
    assert node.counters.stalls_reported == 1 and node.avoided() == {"drip": 1 + 3}
    assert LAG_SPAN * stall <= took < LAG_SPAN * stall + 1.5, f"installed in {took:.1f} s"  # 60 s before
    got = frames[1]["got"]
    assert got[LEARNER] + got["drip"] == 2 * PER_STREAM and got["drip"] == 3
    assert sum(len(r) for r in fleet.repairs) == PER_STREAM - got["drip"]
    assert "source drip failed for v1 (lagging 4." in caplog.text and "x slower than this node" in caplog.text


def test_a_relay_holding_back_a_patchs_few_chunks_is_cut_once_every_other_source_is_done(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A patch-sized version (4 chunks a source), a 2 s stall timeout: no rate to read, and the relay
    sends its first chunk at once and each next one 1.6 s later, inside the stall timeout (4.8 s for its
    stripe before this rule). The other sources are done in a fraction of a second, so the relay is given
    up one stall timeout after the announcement (``wire.finish_deadline``), with 2 chunks sent, reported,
    and its other 2 repaired from the learner."""
    fast = 20 * CHUNK
    caplog.set_level(logging.INFO, logger="echo2.broadcast.receiver")
    patch = BLOB[: 16 * CHUNK]
    took, frames, _, fleet = asyncio.run(
        _install({LEARNER: fast, "a": fast, "b": fast, "drip": 0.0}, patch, drip_s=1.6, stall_s=2.0)
    )
    assert [f["op"] for f in frames] == ["stalled", "installed"]
    assert frames[1]["got"] == {LEARNER: 4 + 2, "a": 4, "b": 4, "drip": 2}
    assert 2.0 <= took < 3.0, f"installed in {took:.1f} s"
    assert fleet.repairs == [[11, 15]]
    assert (
        "source drip failed for v1 (lagging 2." in caplog.text and "2 chunks left: every other" in caplog.text
    )


def test_a_slow_but_only_source_is_never_judged_against_nothing() -> None:
    """A node whose plan names one source (a latecomer pulling the anchor from its holder) at 4 chunks/s
    with a 1 s stall timeout: 12 chunks in about 3 s, every one inside the timeout; nothing to compare it
    with, so no lag rule applies (the finish rule once cut every latecomer one stall timeout in)."""
    rates = {LEARNER: 20 * CHUNK, "holder": 4 * CHUNK}
    took, frames, node, fleet = asyncio.run(
        _install(rates, BLOB[: 12 * CHUNK], stall_s=1.0, planned=["holder"])
    )
    assert [f["op"] for f in frames] == ["installed"] and frames[0]["got"] == {"holder": 12}
    assert node.counters.stalls_reported == 0 and not fleet.repairs and 2.5 < took < 4.5
