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
    LAG_FLOOR_S,
    LAG_MIN_CHUNKS,
    Pace,
    Pacer,
    finish_deadline,
    lagging,
    next_chunk_deadline,
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


def test_lagging_and_the_next_chunk_deadline_worked_by_hand() -> None:
    others = [_pace(0.0, 20.0, 20), _pace(0.5, 10.0, 17), _pace(0.0, 40.0, 40)]  # median rate 20/s
    assert next_chunk_deadline(STALL_S, others) == LAG_FLOOR_S  # 4 chunk-times (0.2 s) < the 2 s floor
    slow = [_pace(0.0, 1.0, LAG_MIN_CHUNKS + 1)] * 3  # 1 chunk/s: 4 chunk-times are 4 s
    assert next_chunk_deadline(STALL_S, slow) == pytest.approx(LAG_FACTOR / 1.0)
    assert next_chunk_deadline(STALL_S, [_pace(0.0, 0.1, LAG_MIN_CHUNKS)]) == STALL_S  # capped
    assert next_chunk_deadline(STALL_S, [_pace(0.0, 20.0, LAG_MIN_CHUNKS - 1)]) == STALL_S  # too few
    assert next_chunk_deadline(STALL_S, []) == STALL_S

    assert lagging(_pace(0.0, 0.5, 3), others) is not None  # 2 chunks in 4 s against 20/s: 40x slower
    assert "40x slower" in (lagging(_pace(0.0, 0.5, 3), others) or "")
    assert lagging(_pace(0.0, 0.6, 2), others) is None  # judged only LAG_FLOOR_S after its first chunk
    assert lagging(_pace(0.0, 5.1, 12), others) is None  # within LAG_FACTOR of the median
    assert lagging(_pace(0.0, 4.9, 12), others) is not None  # just past it
    assert lagging(_pace(0.0, 0.5, 3), [_pace(0.0, 20.0, LAG_MIN_CHUNKS - 1)]) is None  # no reference yet
    assert lagging(Pace(), others) is None

    assert finish_deadline(10.0, 10.1) == 10.0 + LAG_FLOOR_S  # the others done in 0.1 s: 2 s in all
    assert finish_deadline(10.0, 13.0) == pytest.approx(10.0 + LAG_FACTOR * 3.0)  # in 3 s: 12 s


class _Fleet:
    """A fake learner (control + chunks) and three fake peers around one real node: each source paced
    at its own rate (``drip``: a chunk, then ``DRIP_S`` of nothing), the node pulling a quarter of the
    chunks from each."""

    def __init__(self, rates: dict[str, float], blob: bytes, drip_s: float) -> None:
        self.rates = rates  # source -> bytes/s it serves at
        self.blob, self.drip_s = blob, drip_s
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
        sources = [[name, list(range(j, n, len(self.rates)))] for j, name in enumerate(self.rates)]
        return {
            "op": "announce", "manifest": manifest.to_dict(), "sources": sources, "serve": [],
            "peers": {k: list(a) for k, a in addrs.items()}, "credential": issue(KEY, v, "w", "").to_dict(),
        }  # fmt: skip


async def _install(
    rates: dict[str, float], blob: bytes = BLOB, drip_s: float = DRIP_S
) -> tuple[float, list[dict[str, Any]], TcpWorkerNode, _Fleet]:
    """One version of ``blob`` through a node pulling from sources at ``rates``: seconds to install, its
    control frames after the announcement (stall reports, the ack)."""
    fleet = _Fleet(rates, blob, drip_s)
    addrs = await fleet.start()
    node = TcpWorkerNode("w", addrs[LEARNER], KEY.verifier(), stall_timeout=STALL_S)
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
    """The learner and two peers at 20 chunks/s, a third at 10/s (half: kept), then the third sending its
    first chunk at once and then one every 1.5 s, inside the 5 s stall timeout: without the lag rule
    its 40 chunks take 60 s; now it is cut about LAG_FLOOR_S after its first chunk, reported, and its
    rest repaired from the learner."""
    fast = 20 * CHUNK
    caplog.set_level(logging.INFO, logger="echo2.broadcast.receiver")
    took, frames, node, fleet = asyncio.run(_install({LEARNER: fast, "a": fast, "b": fast, "half": fast / 2}))
    assert [f["op"] for f in frames] == ["installed"] and node.counters.stalls_reported == 0
    assert frames[0]["got"] == {LEARNER: PER_STREAM, "a": PER_STREAM, "b": PER_STREAM, "half": PER_STREAM}
    assert took < 6.0 and not fleet.repairs  # the half-speed stripe: 40 chunks at 10/s, about 4 s

    took, frames, node, fleet = asyncio.run(_install({LEARNER: fast, "a": fast, "b": fast, "drip": 0.0}))
    assert [f["op"] for f in frames] == ["stalled", "installed"]
    assert frames[0] == {"op": "stalled", "v": 1, "source": "drip"}
    assert node.counters.stalls_reported == 1 and node.avoided() == {"drip": 1 + 3}
    assert took < 10.0, f"installed in {took:.1f} s"  # 40 x 1.5 = 60 s without the lag rule
    got = frames[1]["got"]
    assert got[LEARNER] + got["drip"] == 2 * PER_STREAM and 2 <= got["drip"] <= 4
    assert sum(len(r) for r in fleet.repairs) == PER_STREAM - got["drip"]
    assert "source drip failed for v1 (lagging:" in caplog.text


def test_a_relay_holding_back_a_patchs_few_chunks_is_cut_once_every_other_source_is_done(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A patch-sized version (3 chunks a source): no rate to read, and the relay sends its first chunk
    at once and each next one 4.5 s later, inside the 5 s stall timeout (9 s for its stripe before this
    rule). The other sources are done in a fraction of a second, so the relay is given up at
    LAG_FLOOR_S (``wire.finish_deadline``), reported, and its 2 chunks repaired from the learner."""
    fast = 20 * CHUNK
    caplog.set_level(logging.INFO, logger="echo2.broadcast.receiver")
    patch = BLOB[: 12 * CHUNK]
    took, frames, _, fleet = asyncio.run(
        _install({LEARNER: fast, "a": fast, "b": fast, "drip": 0.0}, patch, drip_s=4.5)
    )
    assert [f["op"] for f in frames] == ["stalled", "installed"]
    assert frames[1]["got"] == {LEARNER: 3 + 2, "a": 3, "b": 3, "drip": 1}
    assert LAG_FLOOR_S <= took < LAG_FLOOR_S + 1.5, f"installed in {took:.1f} s"
    assert fleet.repairs == [[7, 11]]
    assert "source drip failed for v1 (lagging: 2 chunks left" in caplog.text
