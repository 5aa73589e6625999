"""One node's copy of a snapshot being received or served, and the chunk-serving side of the protocol.

A pull, as a server (the publisher or a relaying worker) answers it in :func:`serve_pull`: the gate
reads the ``get``'s credential (``access.Gate.authenticate``), ``wire.parse_pull`` the whole header
(``echo2.weights.frames.GetFrame``, strict), the caller's ``admit`` says what this node holds and
whether it serves that member, the payload (the chunk list, at most 4 bytes per chunk of that version)
is read only then, and :func:`serve_get` streams the chunks. Every frame sent back is a
model of ``echo2.weights.frames`` as ``to_wire`` makes it: ``chunk`` frames (``ChunkFrame``, then
the payload) or one ``error`` (``frames.refusal``), after which the connection ends. Nothing here
reads a peer's header but through those parsers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from echo2.broadcast.access import AccessError, Gate
from echo2.broadcast.wire import Pacer, ProtocolError, parse_pull, write_frame
from echo2.weights.frames import CHUNK_INDEX_BYTES, ChunkFrame, GetFrame, decode_chunk_list, refusal, to_wire
from echo2.weights.manifest import Manifest

log = logging.getLogger(__name__)

PAYLOAD_TIMEOUT_S = 30.0  # seconds an authenticated get's chunk list may take to arrive


class SnapshotBuffer:
    """The single in-memory copy of one version on one node, filled chunk by chunk.

    ``wait_chunk`` lets a relay stream a chunk to its children the moment it has been verified.
    """

    def __init__(self, manifest: Manifest, data: bytes | bytearray | memoryview | None = None) -> None:
        self.manifest = manifest  # authenticated description of the snapshot
        # the only copy (a publisher's: the bytes it was given, a spilled file's map included)
        self.buf: bytearray | bytes | memoryview = bytearray(manifest.total_size) if data is None else data
        n = manifest.n_chunks
        self._have = bytearray(n) if data is None else bytearray(b"\x01" * n)
        self.count = 0 if data is None else n  # chunks verified so far
        self._waiters: dict[int, asyncio.Event] = {}
        self.complete = asyncio.Event()  # set once every chunk is present
        self.failed: str | None = None  # set when the node gave up on this version (reason)
        if self.count == n:
            self.complete.set()

    def has(self, index: int) -> bool:
        return bool(self._have[index])

    def put(self, index: int, data: bytes) -> bool:
        """Store a chunk the caller has verified; False if it was already present."""
        if self._have[index]:
            return False
        start, end = self.manifest.chunk_range(index)
        assert isinstance(self.buf, bytearray), "a publisher's buffer is complete and read-only"
        self.buf[start:end] = data
        self._have[index] = 1
        self.count += 1
        ev = self._waiters.pop(index, None)
        if ev is not None:
            ev.set()
        if self.count == self.manifest.n_chunks:
            self.complete.set()
        return True

    def fail(self, reason: str) -> None:
        self.failed = reason
        for ev in self._waiters.values():
            ev.set()
        self._waiters.clear()

    async def wait_chunk(self, index: int, timeout: float) -> bool:
        if self._have[index]:
            return True
        if self.failed is not None:
            return False
        ev = self._waiters.setdefault(index, asyncio.Event())
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except TimeoutError:
            return False
        return bool(self._have[index])

    def view(self, index: int) -> memoryview:
        start, end = self.manifest.chunk_range(index)
        return memoryview(self.buf)[start:end]

    def missing(self, chunks: list[int] | tuple[int, ...]) -> list[int]:
        return [i for i in chunks if not self._have[i]]


def check_chunk_list(chunks: list[int], n_chunks: int) -> list[int]:
    """``chunks`` (a ``get``'s, so a non-empty list of indices >= 0: its model's rule) if they are
    distinct and below ``n_chunks``, the snapshot's chunk count (so never more than ``n_chunks``);
    ProtocolError naming the fault otherwise."""
    if len(chunks) > n_chunks:
        raise ProtocolError(f"'chunks' must be a list of 1 to {n_chunks} chunk indices, got {len(chunks)}")
    if any(i >= n_chunks for i in chunks):
        raise ProtocolError(f"'chunks' must hold chunk indices in [0, {n_chunks})")
    if len(set(chunks)) != len(chunks):
        raise ProtocolError("'chunks' asks for the same chunk more than once")
    return chunks


async def serve_get(
    pull: GetFrame,
    chunks: list[int],
    writer: asyncio.StreamWriter,
    lookup: Callable[[int], SnapshotBuffer | None],
    uplink: Pacer | None,
    wait_timeout: float,
    on_sent: Callable[[int, int], None] | None = None,
    mangle: Callable[[int, bytes | memoryview], bytes | memoryview] | None = None,
    stream: Pacer | None = None,
    budget: Callable[[int], bool] | None = None,
) -> None:
    """Answer one pull (``pull``, a parsed ``get``, and ``chunks``, its payload's list): stream the
    asked chunks in order, each as soon as this node has it, each a ``chunk`` frame and its payload.

    ``on_sent(version, n)`` counts payload bytes; ``mangle`` is the fault-injection hook of the harness;
    ``stream`` caps this one stream (the learner's rate-matched stripes), ``uplink`` the whole node;
    ``budget(n)`` books each chunk to the requester's allowance (``access.Gate.charge``). A chunk list
    out of bounds raises ProtocolError, an exhausted budget AccessError, each after an error frame.
    """
    peer, version = pull.member, pull.v
    buffer = lookup(version)
    if buffer is None:
        reason = f"unknown version {version!r}"
        log.info("refusing get from %s: %s", peer, reason)
        await write_frame(writer, to_wire(refusal(reason)))
        return
    try:
        chunks = check_chunk_list(chunks, buffer.manifest.n_chunks)
    except ProtocolError as exc:
        await write_frame(writer, to_wire(refusal(str(exc))))
        raise
    # Let the kernel + transport hold a few chunks so the sender is never the one waiting.
    writer.transport.set_write_buffer_limits(high=max(4 << 20, 2 * buffer.manifest.chunk_size))
    for i in chunks:
        if not await buffer.wait_chunk(i, wait_timeout):
            reason = f"chunk {i} of version {version} not available within {wait_timeout:.1f}s"
            if buffer.failed:
                reason = f"version {version} abandoned here: {buffer.failed}"
            log.info("stopping stream to %s: %s", peer, reason)
            await write_frame(writer, to_wire(refusal(reason)))
            return
        payload: bytes | memoryview = buffer.view(i)
        if budget is not None and not budget(len(payload)):
            reason = f"{peer} has had its byte budget of version {version} from this node"
            await write_frame(writer, to_wire(refusal(reason)))
            raise AccessError(reason)
        if stream is not None:
            await stream.consume(len(payload))
        if uplink is not None:
            await uplink.consume(len(payload))
        if mangle is not None:
            payload = mangle(i, payload)
        await write_frame(writer, to_wire(ChunkFrame(v=version, i=i)), payload)  # n: the payload's
        if on_sent is not None:
            on_sent(version, len(payload))


# (buffer asked for or None: unknown version here; is the member scheduled to pull it from this node;
# the stream's own pace or None)
Admission = tuple[SnapshotBuffer | None, bool, Pacer | None]


async def serve_pull(
    gate: Gate,
    header: Mapping[str, Any],
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    admit: Callable[[str, int], Awaitable[Admission]],
    uplink: Pacer | None,
    wait_timeout: float,
    on_sent: Callable[[str, int, int], None] | None = None,
    mangle: Callable[[int, bytes | memoryview], bytes | memoryview] | None = None,
    vouch: Callable[[], None] | None = None,
) -> None:
    """One pull from a peer, publisher or relay alike (``header``: the ``get`` as ``wire.read_header``
    returned it): its credential (``gate.authenticate``; then ``vouch()``, the port's perimeter told the
    connection is a member's), the whole header (``wire.parse_pull``), what ``admit(member, version)``
    says of it, the schedule (``gate.require``), then its payload (the chunk list: no longer than 4
    bytes per chunk of the version asked) and :func:`serve_get` within the member's byte budget. A
    refused credential, a malformed frame or a refused schedule gets an error frame before any chunk;
    every refusal is counted by the gate's counters and raised (AccessError / ProtocolError).
    ``on_sent(member, version, n)`` is called once per chunk sent, with its payload bytes."""
    budget, stream, buffer = None, None, None
    try:
        member, version = gate.authenticate(header)
    except AccessError as exc:
        await write_frame(writer, to_wire(refusal(f"refused: {exc}")))
        raise
    if vouch is not None:
        vouch()
    pull = await parse_pull(header, writer, gate.counters)  # malformed: refused (bad_requests), raised
    try:
        buffer, scheduled, stream = await admit(member, version)
        if buffer is not None:  # else "unknown version": serve_get says so
            gate.require(scheduled, member, version)
            budget = gate.charge(member, version, buffer.manifest.total_size, buffer.manifest.chunk_size)
    except AccessError as exc:
        await write_frame(writer, to_wire(refusal(f"refused: {exc}")))
        raise
    chunks: list[int] = []
    if buffer is not None:
        if pull.n > CHUNK_INDEX_BYTES * buffer.manifest.n_chunks:
            gate.counters.bad_requests += 1
            reason = f"'chunks' must be a list of 1 to {buffer.manifest.n_chunks} chunk indices"
            await write_frame(writer, to_wire(refusal(f"{reason}, got {pull.n // CHUNK_INDEX_BYTES}")))
            raise ProtocolError(reason)
        payload = await asyncio.wait_for(reader.readexactly(pull.n), PAYLOAD_TIMEOUT_S)
        chunks = decode_chunk_list(payload)
    sent = None if on_sent is None else lambda v, n: on_sent(member, v, n)
    try:
        await serve_get(
            pull,
            chunks,
            writer,
            lambda _: buffer,
            uplink,
            wait_timeout,
            sent,
            mangle,
            stream=stream,
            budget=budget,
        )
    except AccessError:
        raise
    except ProtocolError:
        gate.counters.bad_requests += 1
        raise
