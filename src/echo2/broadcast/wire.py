"""Framing and pacing for the TCP transport.

A frame is ``u32 header_len | header (UTF-8 JSON object) | payload`` where the payload length is the
header's ``"n"`` field (0 when absent). Readers enforce limits on both lengths before allocating, so a
peer cannot make a node buffer more than one chunk.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from typing import Any

from echo2.errors import Echo2Error

_LEN = struct.Struct("!I")
MAX_HEADER = 8 << 20  # manifests with many chunk digests travel in headers


class ProtocolError(Echo2Error):
    """A peer sent a malformed, oversized or unexpected frame; the message says what."""


def encode(header: dict[str, Any], payload_len: int = 0) -> bytes:
    if payload_len:
        header = {**header, "n": payload_len}
    body = json.dumps(header, separators=(",", ":")).encode()
    return _LEN.pack(len(body)) + body


async def write_frame(
    writer: asyncio.StreamWriter, header: dict[str, Any], payload: bytes | memoryview | None = None
) -> None:
    writer.write(encode(header, len(payload) if payload is not None else 0))
    if payload is not None and len(payload):
        writer.write(payload)
    await writer.drain()


async def read_header(reader: asyncio.StreamReader, max_header: int = MAX_HEADER) -> dict[str, Any]:
    """Read one frame header; raises asyncio.IncompleteReadError on EOF, ProtocolError on garbage."""
    (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if size > max_header:
        raise ProtocolError(f"frame header of {size} bytes exceeds the {max_header}-byte limit")
    try:
        header = json.loads(await reader.readexactly(size))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"frame header is not JSON: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise ProtocolError("frame header must be a JSON object with a string 'op'")
    n = header.get("n", 0)
    if not isinstance(n, int) or n < 0:
        raise ProtocolError(f"frame payload length must be a non-negative integer, got {n!r}")
    return header


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
