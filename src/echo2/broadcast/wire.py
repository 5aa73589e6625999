"""Framing, pacing and deadlines for the TCP transport.

A frame is ``u32 header_len | header (UTF-8 JSON object) | payload`` where the payload length is the
header's ``"n"`` field (0 when absent). Readers enforce limits on both lengths before allocating, so a
peer cannot make a node buffer more than one chunk.

Every header is a peer's bytes, so :func:`read_header` refuses anything but strict UTF-8 JSON: no
lone surrogates (``"\\ud800"`` decodes to a string nothing can encode again), no ``NaN`` /
``Infinity`` (nor a float that overflows to it), no integer past Python's digit limit, containers
nested at most ``MAX_DEPTH`` deep, a JSON object with a string ``op`` and, when present, a
non-negative integer ``n``. Each refusal is a :class:`ProtocolError`, never a RecursionError or a
UnicodeError from deep inside a handler. What each op's fields must be is its model's rule
(``echo2.weights.frames``: a node passes every header it reads through ``parse_frame`` before use, a
pull's through :func:`parse_pull`, and sends every header as ``to_wire`` of a model); what only the
manifest knows, an announcement's chunk indices and addresses, :func:`parse_announcement` checks.
The framing itself (``n``, the payload length, :func:`encode` writes and :func:`read_payload` reads)
is this module's, for every kind alike. :class:`ProtocolError` and :func:`show` are defined
there and named here as well.

:func:`first_chunk_deadline` is how long a pull from a peer may wait for its first chunk;
:func:`lagging` and :func:`finish_deadline` how slow it may be after it.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import BaseModel

from echo2.broadcast.strategy import LEARNER
from echo2.weights.frames import (
    AnnounceFrame,
    GetFrame,
    ProtocolError,
    Stride,
    parse_frame,
    refusal,
    show,
    to_wire,
)

if TYPE_CHECKING:
    from echo2.broadcast.access import ServeCounters

_LEN = struct.Struct("!I")
MAX_HEADER = 8 << 20  # manifests with many chunk digests travel in headers
MAX_DEPTH = 16  # containers a header may nest (the deepest real frame, an announcement, nests 4)
_SURROGATE = re.compile(rb"\\u[dD][89abcdefABCDEF]")  # an escape in U+D800..U+DFFF (maybe half a pair)


def encode(header: dict[str, Any], payload_len: int = 0) -> bytes:
    if payload_len:
        header = {**header, "n": payload_len}
    body = dumps(header)
    return _LEN.pack(len(body)) + body


def encode_with(header: dict[str, Any], encoded: dict[str, bytes]) -> list[bytes]:
    """:func:`encode` of ``header`` (no payload) when the JSON of some of its values is at hand
    (``encoded``: key -> that value's JSON, as :func:`dumps` writes it),
    as pieces whose concatenation is those bytes: the pieces at hand are not encoded or copied again
    (an announcement's manifest, the same for every member, is encoded once per version and the same
    bytes object goes to every member; ``StreamWriter.writelines`` sends the pieces)."""
    parts: list[bytes] = []
    run: dict[str, Any] = {}  # consecutive values still to encode: one call for them all

    def flush() -> None:
        if run:
            parts.append(dumps(run)[1:-1])
            run.clear()

    for k, v in header.items():
        if k in encoded:
            flush()
            parts += [(b"," if parts else b"") + json.dumps(k).encode() + b":", encoded[k]]
        else:
            if not run and parts:
                parts.append(b",")
            run[k] = v
    flush()
    size = 2 + sum(map(len, parts))
    return [_LEN.pack(size) + b"{", *parts, b"}"]


def dumps(value: object) -> bytes:
    """``value`` as a frame header writes it: compact JSON, by orjson (a publication encodes one header
    per member: at 10,000 members a third of its CPU was the standard library's encoder); non-ASCII as
    UTF-8, integer keys as strings, as ``json.loads`` reads them back."""
    return orjson.dumps(value, default=_plain, option=orjson.OPT_NON_STR_KEYS)


def _plain(value: object) -> object:
    """A frame's nested model (a parsed announcement's ``frames.Stride``) as JSON: its fields."""
    if isinstance(value, BaseModel):
        return value.model_dump()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


async def write_frame(
    writer: asyncio.StreamWriter, header: dict[str, Any], payload: bytes | memoryview | None = None
) -> None:
    writer.write(encode(header, len(payload) if payload is not None else 0))
    if payload is not None and len(payload):
        writer.write(payload)
    await writer.drain()


async def read_header(
    reader: asyncio.StreamReader, max_header: int = MAX_HEADER, max_items: int | None = None
) -> dict[str, Any]:
    """Read one frame header; raises asyncio.IncompleteReadError on EOF, ProtocolError on garbage.
    ``max_items``: a first frame from a stranger (``frames.PRE_AUTH_ITEMS``), refused by a count of its
    separators before the JSON parser sees it."""
    (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if size > max_header:
        raise ProtocolError(f"frame header of {size} bytes exceeds the {max_header}-byte limit")
    raw = await reader.readexactly(size)
    if max_items is not None and raw.count(b",") + raw.count(b"[") + raw.count(b"{") > max_items:
        raise ProtocolError(f"a first frame holds at most {max_items} fields and items")
    return parse_header(raw)


def parse_header(raw: bytes) -> dict[str, Any]:
    """A frame header from a peer's bytes (the module docstring's rules); ProtocolError naming the fault."""
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite)
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"frame header is not UTF-8: {exc.reason} at byte {exc.start}") from None
    except RecursionError:
        raise ProtocolError("frame header nests deeper than the JSON parser allows") from None
    except ValueError as exc:  # JSONDecodeError, NaN / Infinity, an integer past the digit limit
        raise ProtocolError(f"frame header is not JSON: {str(exc)[:120]}") from None
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise ProtocolError("frame header must be a JSON object with a string 'op'")
    _check_tree(header, bool(_SURROGATE.search(raw)))
    n = header.get("n", 0)
    if type(n) is not int or n < 0:
        raise ProtocolError(f"frame payload length must be a non-negative integer, got {show(n)}")
    return header


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number a frame may carry")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} overflows a float")
    return value


def _check_tree(header: dict[str, Any], surrogates: bool) -> None:
    """ProtocolError if containers nest deeper than MAX_DEPTH or (``surrogates``: the raw bytes hold a
    surrogate escape) a string holds a lone surrogate. Iterative, so no depth can overflow the stack."""
    stack: list[tuple[object, int]] = [(header, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ProtocolError(f"frame header nests deeper than {MAX_DEPTH} levels")
        items = [*node.keys(), *node.values()] if isinstance(node, dict) else node
        for item in items:  # type: ignore[union-attr]
            if isinstance(item, dict | list):
                stack.append((item, depth + 1))
            elif surrogates and isinstance(item, str):
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    raise ProtocolError("frame header holds a lone UTF-16 surrogate") from None


async def read_payload(reader: asyncio.StreamReader, header: dict[str, Any], max_payload: int) -> bytes:
    n = int(header.get("n", 0))
    if n > max_payload:
        raise ProtocolError(
            f"payload of {n} bytes exceeds the {max_payload}-byte limit for op {header['op']!r}"
        )
    return await reader.readexactly(n) if n else b""


class Pacer:
    """Application-level rate limit (bytes/s) shared by every stream of one link direction.

    Used by the loopback harness, where no qdisc shapes traffic. FIFO reservations: each caller books
    ``n / rate`` seconds after the previous booking and sleeps until its slot ends, which keeps the long-run
    rate at ``rate`` while allowing a burst of ``burst`` bytes.
    """

    def __init__(self, rate_bytes_per_s: float, burst: int = 64 << 10) -> None:
        if rate_bytes_per_s <= 0:
            raise ValueError(f"pacer rate must be > 0 bytes/s, got {rate_bytes_per_s}")
        self.rate = float(rate_bytes_per_s)  # long-run bytes per second
        self._credit_s = burst / self.rate  # how far behind real time the schedule may lag
        self._next = time.monotonic()

    def reserve(self, n: int) -> float:
        """Book ``n`` bytes; return how long the caller must wait before they count as sent."""
        now = time.monotonic()
        start = max(self._next, now - self._credit_s)
        self._next = start + n / self.rate
        return max(0.0, self._next - now)

    async def consume(self, n: int) -> None:
        delay = self.reserve(n)
        if delay > 0:
            await asyncio.sleep(delay)


FIRST_FLOOR_S = 1.0  # a peer's first chunk may always take this long (first_chunk_deadline) ...
FIRST_FACTOR = 4.0  # ... or this many times the reference delay, whichever is longer


def first_chunk_deadline(
    stall_s: float,
    elapsed_s: float,
    learner_first_s: float | None,
    peer_first_s: float | None,
    n_members: int,
    chunk: int,
    received: int,
) -> float:
    """Seconds after a pull from a peer began by which its first chunk must have arrived:

        D = min(stall_s, max(FIRST_FLOOR_S, FIRST_FACTOR * ref)),
        ref = max(t_L, t_P, (N - 1) * c / r),   r = received / elapsed_s

    ``t_L`` (``learner_first_s``): seconds from the announcement to the first chunk of this node's own
    learner stream (0 when its plan has none). The learner feeds every relay's stripe at once, so an
    honest relay holds its first chunk about when this node does. ``t_P`` (``peer_first_s``): seconds
    to the first chunk from any peer of this version: what announcement skew, a handshake and one hop
    cost here. ``(N - 1) * c / r``: an honest relay sends one chunk of size ``c`` to each of its up to
    N - 1 children (``n_members`` N) over an uplink about this node's own receive rate ``r`` (payload
    bytes it received in this version per second since the announcement), so a child late in its
    queue waits that long. ``t_P`` unknown (None: no peer has delivered yet, e.g. a node whose only
    peer is the one being judged) counts as 0; while ``t_L`` is unknown (None: this node's learner
    stream has not delivered yet) or nothing has arrived, the peer is given the full ``stall_s``: with
    no evidence of how quick the other sources are, none is abandoned early.

    So a silent relay is abandoned after 1 s where its peers deliver quickly, and an honest one is
    abandoned only if it is 4 times slower than the first peer, than the learner, and than N - 1 chunk
    times at this node's rate. Since ``r`` falls as ``1/elapsed`` while nothing arrives, a deadline
    below ``stall_s`` also needs ``received > FIRST_FACTOR * (N - 1) * c``: the node got 4 chunks per
    peer stream elsewhere while this one sent nothing."""
    if learner_first_s is None or received <= 0 or elapsed_s <= 0:
        return stall_s
    ref = max(learner_first_s, peer_first_s or 0.0, (n_members - 1) * chunk * elapsed_s / received)
    return min(stall_s, max(FIRST_FLOOR_S, FIRST_FACTOR * ref))


LAG_FACTOR = 4.0  # a peer stream this many times slower than this node's other streams lags (lagging)
LAG_MIN_CHUNKS = 8  # ... judged once the other streams delivered this many chunks (the median's stream)
LAG_SPAN = 2.0  # ... and this many stall timeouts after its own first chunk


@dataclass
class Pace:
    """When one pull stream's chunks arrived: its first, its last, how many."""

    first: float | None = None
    last: float = 0.0
    count: int = 0

    def note(self, now: float) -> None:
        if self.first is None:
            self.first = now
        self.last, self.count = now, self.count + 1

    def rate(self) -> float | None:
        """Chunks per second from its first chunk to its last (None before two chunks)."""
        if self.first is None or self.count < 2 or self.last <= self.first:
            return None
        return (self.count - 1) / (self.last - self.first)


def _reference(others: Iterable[Pace]) -> float | None:
    """The median rate of the streams that delivered ``LAG_MIN_CHUNKS`` chunks (None: none did)."""
    rates = sorted(r for p in others if p.count >= LAG_MIN_CHUNKS and (r := p.rate()) is not None)
    return rates[len(rates) // 2] if rates else None


def lagging(mine: Pace, others: Iterable[Pace], now: float, stall_s: float) -> str | None:
    """Why a pull stream from a peer lags at ``now``, or None: ``LAG_SPAN`` stall timeouts (``stall_s``)
    or more after its first chunk, even were its next chunk to arrive now it would have delivered under
    1/``LAG_FACTOR`` of the median rate of this node's other planned streams (those that delivered
    ``LAG_MIN_CHUNKS`` chunks). In a striped tree each stream carries one stripe at about the stripe
    rate and they share this node's downlink, so a stream that slow is its source's doing (or its
    source's source's, which that source reports in turn: ``publisher._exonerate``). A relay that sends
    each chunk just inside the stall timeout is cut here, not after its whole stripe; the span keeps an
    honest stream that lost a stall timeout's worth of retransmissions above the line unless it was
    also twice as slow as the others."""
    if mine.first is None or now - mine.first < LAG_SPAN * stall_s or (ref := _reference(others)) is None:
        return None
    own = mine.count / (now - mine.first)
    if own * LAG_FACTOR >= ref:
        return None
    return f"{own:.2f} chunks/s, {ref / own:.0f}x slower than this node's other streams ({ref:.2f}/s)"


def relative_pace(mine: Pace, others: Iterable[Pace]) -> float | None:
    """A planned stream's rate over the median of this node's other planned streams' (both from their
    first chunk to their last; None below ``LAG_MIN_CHUNKS`` chunks on either side): about 1 for a relay
    that kept its stripe's pace, 0.3 for one at a third of it. What an install ack tells the learner of
    each peer (``conduct.Conduct``)."""
    if mine.count < LAG_MIN_CHUNKS or (own := mine.rate()) is None or (ref := _reference(others)) is None:
        return None
    return own / ref


def finish_deadline(started: float, alone: float, stall_s: float) -> float:
    """When a planned peer stream must be done once it alone holds this node back (every other chunk
    stored since ``alone``; the version announced at ``started``, both ``time.monotonic()``): it gets
    ``LAG_FACTOR`` times what the other sources took, at least a stall timeout (``stall_s``). What a
    stripe of a few chunks (a delta patch) needs, where :func:`lagging` has no rate to read: a relay
    that holds back its last chunks is given up a stall timeout after the announcement, not one stall
    timeout per chunk."""
    return started + max(stall_s, LAG_FACTOR * (alone - started))


@dataclass(frozen=True)
class Announcement:
    """The plan part of an ``announce`` frame (its manifest and credential are parsed by their owners)."""

    sources: list[tuple[str, list[int]]]  # this node's pull streams: (source id, chunk indices)
    peers: dict[str, tuple[str, int, str]]  # id -> host, port, certificate fingerprint ("" = plain TCP)
    serves: frozenset[str]  # members the plan has pulling from this node (and repairing from it)
    stall_hint: float  # seconds without data the learner still calls normal (0 = no hint)
    repair: dict[str, str]  # a source -> its own source for those chunks (strategy.repair_sources)
    members: int  # members the version was announced to (N in first_chunk_deadline)


def parse_announcement(frame: AnnounceFrame, n_chunks: int, tls: bool) -> Announcement:
    """An announcement's plan (the types and bounds of its fields are its model's; a stride is expanded to
    its chunks); ProtocolError naming the fault unless every chunk index is in ``[0, n_chunks)`` (a stride
    names at least one), ``peers`` names every source (a repair source too) and the learner, and (over
    TLS) each with a 64-digit fingerprint."""
    sources = []
    for source, chunks in frame.sources:
        if isinstance(chunks, Stride):
            chunks = list(range(chunks.start, n_chunks, chunks.step))
            if not chunks:
                raise ProtocolError(
                    f"announcement source {source!r} names a stride past chunk {n_chunks - 1}"
                )
        elif any(i >= n_chunks for i in chunks):
            raise ProtocolError(f"announcement source {source!r} names chunks outside [0, {n_chunks})")
        sources.append((source, chunks))
    peers = {k: (a[0], a[1], a[2] if len(a) == 3 else "") for k, a in frame.peers.items()}
    named = [s for s, _ in frame.sources] + list(frame.repair.values())
    if any(s not in peers for s in named) or LEARNER not in peers:
        raise ProtocolError("announcement names a source without an address")
    if tls and any(len(peers[s][2]) != 64 for s in named):
        raise ProtocolError("announcement names a source without its certificate fingerprint")
    repair = {k: v for k, v in frame.repair.items() if k != v and v != LEARNER}
    members = frame.members if frame.members is not None else max(1, len(peers) - 1)
    return Announcement(sources, peers, frozenset(frame.serve), frame.stall_hint, repair, members)


async def parse_pull(
    header: dict[str, Any], writer: asyncio.StreamWriter, counters: ServeCounters
) -> GetFrame:
    """The model of a ``get`` whose credential the gate has accepted (``store.serve_pull`` calls it right
    after ``gate.authenticate``, so a pull without a valid credential is still refused as such first).
    A malformed one is answered as a chunk list out of bounds is: an error frame naming the fault,
    counted in ``counters.bad_requests``, ProtocolError. Pure in ``header``: parsing it again (the
    publisher's ``admit`` does, for ``repair``) gives the same frame and costs nothing but the time."""
    try:
        return parse_frame(header, GetFrame)
    except ProtocolError as exc:
        counters.bad_requests += 1
        await write_frame(writer, to_wire(refusal(str(exc))))
        raise
