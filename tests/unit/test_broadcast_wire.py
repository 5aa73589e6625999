"""Framing limits, the pacer's arithmetic, BroadcastStats, and the in-memory seam."""

from __future__ import annotations

import asyncio
import struct

import pytest

from echo2.broadcast.api import BroadcastStats, OpenLedger
from echo2.broadcast.in_memory import InMemoryHub
from echo2.broadcast.wire import Pacer, ProtocolError, dumps, encode, encode_with, read_header, read_payload
from echo2.weights.manifest import HmacKey, ManifestError, blob_ok


def _reader(data: bytes) -> asyncio.StreamReader:
    r = asyncio.StreamReader()
    r.feed_data(data)
    r.feed_eof()
    return r


def test_frame_round_trip_and_limits() -> None:
    async def go() -> None:
        r = _reader(encode({"op": "chunk", "i": 3}, 5) + b"hello")
        h = await read_header(r)
        assert h == {"op": "chunk", "i": 3, "n": 5}
        assert await read_payload(r, h, 5) == b"hello"
        with pytest.raises(ProtocolError, match="exceeds"):
            await read_payload(_reader(b"x" * 10), {"op": "chunk", "n": 10}, 9)  # oversized chunk
        with pytest.raises(ProtocolError, match="header"):
            await read_header(_reader(struct.pack("!I", 1 << 30)))  # absurd header length
        with pytest.raises(ProtocolError, match="JSON"):
            await read_header(_reader(struct.pack("!I", 3) + b"{{{"))
        with pytest.raises(ProtocolError, match="op"):
            await read_header(_reader(encode({"nope": 1})))
        with pytest.raises(asyncio.IncompleteReadError):  # truncated payload
            r2 = _reader(encode({"op": "chunk"}, 10) + b"abc")
            await read_payload(r2, await read_header(r2), 10)

    asyncio.run(go())


def test_pacer_books_bytes_at_the_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("echo2.broadcast.wire.time.monotonic", lambda: now[0])
    p = Pacer(1000.0, burst=0)  # 1000 bytes/s, no burst credit
    assert p.reserve(500) == pytest.approx(0.5)  # first 500 B end at t+0.5
    assert p.reserve(500) == pytest.approx(1.0)  # queued behind the first
    now[0] += 5.0  # idle for a while: no credit accumulates beyond the burst
    assert p.reserve(1000) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        Pacer(0)


def test_stats_fraction_and_metric_names() -> None:
    s = BroadcastStats(7, 10, 1000, {f"w{i}": float(i + 1) for i in range(10)}, learner_bytes=1000)
    # q = 1/1.1 -> ceil(9.09) = 10th fastest worker; p90 -> 9th
    m = s.metrics(gamma=1.1)
    assert m == {"broadcast/t_bcast_s": 10.0, "broadcast/bytes": 1000.0, "broadcast/install_p90_s": 9.0}
    assert BroadcastStats(1, 3, 1, {"a": 1.0}).t_installed(1.0) == float("inf")


def test_in_memory_hub_delivers_verified_snapshots() -> None:
    async def go() -> None:
        hub = InMemoryHub(b"s" * 32, chunk_size=100)
        rx = [hub.receiver(f"w{i}") for i in range(3)]
        got: list[tuple[str, int, bytes]] = []

        async def consume(r) -> None:  # type: ignore[no-untyped-def]
            async for snap in r.snapshots():
                assert blob_ok(snap.manifest, snap.data)
                got.append((r.worker_id, snap.manifest.version, bytes(snap.data)))
                await r.report_installed(snap.manifest.version)
                return

        tasks = [asyncio.create_task(consume(r)) for r in rx]
        await asyncio.sleep(0)
        await hub.publish(1, b"weights" * 50)
        stats = await hub.wait_installed(1, timeout=5)
        await asyncio.gather(*tasks)
        assert sorted(w for w, _, _ in got) == ["w0", "w1", "w2"]
        assert all(v == 1 and b == b"weights" * 50 for _, v, b in got)
        assert len(stats.install_s) == 3
        with pytest.raises(Exception, match="not newer"):
            await hub.publish(1, b"again")
        # a hub whose manifest was signed by another key refuses to install
        evil = InMemoryHub(b"s" * 32)
        r = evil.receiver("x")
        await evil.publish(1, b"abc")
        evil.key = HmacKey(b"another secret, same length!")
        with pytest.raises(ManifestError):
            async for _ in r.snapshots():
                pass

    asyncio.run(go())


def test_a_measurement_outlives_its_round() -> None:
    """Waiting for the installs of a version that newer publications retired (a slow pool) returns
    what was measured instead of failing."""
    from echo2.broadcast.factory import get_strategy, open_publisher
    from echo2.weights.manifest import new_signing_key

    async def go() -> None:
        pub = open_publisher(
            "tcp", new_signing_key(), get_strategy("tree-pipelined"), 1 << 10, ledger=OpenLedger()
        )
        await pub.start()
        try:
            await pub.publish(1, b"v1" * 100)
            waiting = asyncio.ensure_future(pub.wait_installed(1, count=1, timeout=1.0))
            for v in range(2, 12):  # more than the publisher keeps
                await pub.publish(v, b"vx" * 100)
            stats = await waiting
            assert stats.version == 1 and stats.install_s == {}
        finally:
            await pub.close()

    asyncio.run(go())


def test_publishers_size_chunks_per_snapshot_unless_told() -> None:
    """chunk_size None: each publication is cut at relay_chunk_bytes of its own size (and, over TCP,
    of the link rates the publisher was told); a fixed size stays fixed."""
    from echo2.broadcast.factory import get_strategy, open_publisher
    from echo2.broadcast.publisher import TcpPublisher
    from echo2.physics.broadcast import relay_chunk_bytes
    from echo2.weights.manifest import new_signing_key

    small, large = b"p" * 300_000, b"a" * 20_000_000

    async def go() -> None:
        hub = InMemoryHub(b"s" * 32, chunk_size=None)
        assert (await hub.publish(1, small)).chunk_size == relay_chunk_bytes(len(small)) == 4 << 10
        assert (await hub.publish(2, large)).chunk_size == relay_chunk_bytes(len(large)) > 4 << 10
        fixed = open_publisher(
            "tcp", new_signing_key(), get_strategy("tree-pipelined"), 64 << 10, ledger=OpenLedger()
        )
        rated = TcpPublisher(
            new_signing_key(),
            get_strategy("tree-pipelined"),
            None,
            link_rates=(3e6, 1e6),
            ledger=OpenLedger(),
        )
        for pub in (fixed, rated):
            await pub.start()
        try:
            assert (await fixed.publish(1, large)).chunk_size == 64 << 10
            assert (await rated.publish(1, large)).chunk_size == relay_chunk_bytes(len(large), 3.0)
            assert relay_chunk_bytes(len(large), 3.0) < relay_chunk_bytes(len(large))  # a fast uplink
        finally:
            await fixed.close()
            await rated.close()

    asyncio.run(go())


def test_a_header_with_a_value_encoded_once_is_the_same_bytes() -> None:
    """The publisher encodes a version's manifest once and splices it into every announcement
    (``wire.encode_with``): byte for byte the frame ``encode`` writes."""
    header = {
        "op": "announce", "manifest": {"version": 3, "chunk_digests": "QUJD" * 50, "lineage": {"base": None}},
        "sources": [["w2", {"start": 1, "step": 8}], ["learner", [0, 8]]], "peers": {"w2": ["h", 9, ""]},
        "stall_hint": 0.5, "serve": [], "repair": {}, "credential": {"member": "w1"}, "members": 12,
    }  # fmt: skip
    whole = encode(header)
    assert b"".join(encode_with(header, {"manifest": dumps(header["manifest"])})) == whole
    assert b"".join(encode_with(header, {})) == whole
    for keys in (["op"], ["members"], ["manifest", "sources"], ["op", "manifest", "members"], list(header)):
        assert b"".join(encode_with(header, {k: dumps(header[k]) for k in keys})) == whole, keys
    shared = dumps(header["manifest"])
    assert any(p is shared for p in encode_with(header, {"manifest": shared}))  # not copied
