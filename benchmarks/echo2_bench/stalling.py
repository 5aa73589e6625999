"""A stalling relay for the adversary benchmark: a member of the broadcast that joins like a real worker,
is planned as a relay, accepts every pull and then sends nothing, and acks ``installed`` for every
announced version at once, with whatever receipts it likes (a liar's).

What it costs the honest members is what the product must keep small: each pull from it is given up at
the node's first-chunk deadline (``broadcast.wire.first_chunk_deadline``), the node skips it for the
next versions and reports it, and the publisher demotes it (``publisher.DEMOTE_AFTER_REPORTS``) and
refuses its acks (``publisher.receipt_fault``; ``TcpPublisher.counters``). The benchmark registers an
identity over HTTP (the credential) and runs this node under it; the constructor mirrors
``TcpWorkerNode``'s. Nothing here is product code: fault injection lives outside the package.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from echo2.broadcast.strategy import LEARNER
from echo2.broadcast.wire import ProtocolError, parse_announcement, read_header, write_frame
from echo2.transport import HANDSHAKE_TIMEOUT_S, client_context, make_identity, open_pinned
from echo2.weights.frames import AnnounceFrame, parse_frame
from echo2.weights.manifest import Manifest, ManifestKey

log = logging.getLogger(__name__)

Receipts = Callable[[dict[str, Any]], dict[str, int]]  # an announcement -> the receipts its ack claims


def planned_receipts(announce: dict[str, Any]) -> dict[str, int]:
    """The most plausible lie: every chunk from the source the plan named for it (a stride expanded to
    its chunks, as a node reads it: ``wire.parse_announcement``)."""
    frame = parse_frame(announce, AnnounceFrame, sender=LEARNER)
    plan = parse_announcement(frame, Manifest.from_dict(frame.manifest).n_chunks, tls=False)
    got: dict[str, int] = {}
    for source, chunks in plan.sources:
        got[source] = got.get(source, 0) + len(chunks)
    return got


@dataclass
class StallCounters:
    """What the staller did (the benchmark's ground truth)."""

    pulls_held: int = 0  # pull connections accepted and left without a byte
    announced: int = 0  # announcements received
    acked: int = 0  # install acks sent (one per announcement)


class StallingNode:
    """Joins ``publisher`` as ``worker_id`` (``credential`` from the registry; ``pin``: TLS as a real
    node), serves no chunk to anyone and acks every announced version with ``receipts(announce)``.
    ``key`` is accepted for the same constructor as ``TcpWorkerNode``: a liar verifies nothing."""

    def __init__(
        self,
        worker_id: str,
        publisher: tuple[str, int],
        key: bytes | ManifestKey | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        credential: str | None = None,
        pin: str | None = None,
        receipts: Receipts = planned_receipts,
    ) -> None:
        self.worker_id = worker_id
        self.publisher = publisher
        self.key = key  # unused
        self.host, self.port = host, port
        self.advertise_host = advertise_host or host
        self.credential = credential
        self.pin = pin
        self.receipts = receipts
        self.counters = StallCounters()
        self.tls = make_identity([self.advertise_host]) if pin is not None else None
        self._server: asyncio.Server | None = None
        self._ctl: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._held: set[asyncio.StreamWriter] = set()
        self._closed = asyncio.Event()

    async def start(self, join_timeout: float = 30.0) -> None:
        tls: dict[str, Any] = {} if self.tls is None else {
            "ssl": self.tls.server_context(), "ssl_handshake_timeout": HANDSHAKE_TIMEOUT_S,
        }  # fmt: skip
        self._server = await asyncio.start_server(self._hold, self.host, self.port, **tls)
        self.port = self._server.sockets[0].getsockname()[1]
        ctx = client_context() if self.pin is not None else None
        deadline = time.monotonic() + join_timeout
        while True:  # like a real node: the learner may still be starting (a wrong pin fails at once)
            try:
                reader, writer = await open_pinned(*self.publisher, self.pin, ctx, 1 << 24)
                break
            except OSError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.2)
        self._ctl = writer
        hello: dict[str, Any] = {
            "op": "join", "worker": self.worker_id, "host": self.advertise_host, "port": self.port,
            "cert": self.tls.fingerprint if self.tls is not None else "",
        }  # fmt: skip
        if self.credential is not None:
            hello["credential"] = self.credential
        await write_frame(writer, hello)
        self._task = asyncio.ensure_future(self._control(reader, writer))
        log.info(
            "staller %s joined %s:%d, relaying nothing from port %d",
            self.worker_id,
            *self.publisher,
            self.port,
        )

    async def _control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                msg = await read_header(reader)
                if msg["op"] == "announce":
                    self.counters.announced += 1
                    v = msg.get("manifest", {}).get("version")
                    await write_frame(writer, {"op": "installed", "v": v, "got": self.receipts(msg)})
                    self.counters.acked += 1
                elif msg["op"] in ("shutdown", "error"):
                    log.info("staller %s: publisher says %s", self.worker_id, msg["op"])
                    break
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ProtocolError) as exc:
            log.info("staller %s: control connection ended: %s", self.worker_id, exc)
        finally:
            self._closed.set()

    async def _hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Accept a pull, read whatever the puller sends, send nothing, until it gives up."""
        self.counters.pulls_held += 1
        self._held.add(writer)
        try:
            while await reader.read(1 << 16):
                pass
        except (ConnectionError, OSError):
            pass
        finally:
            self._held.discard(writer)
            writer.close()

    async def close(self) -> None:
        if self._ctl is not None:
            with contextlib.suppress(Exception):
                await write_frame(self._ctl, {"op": "leave"})
            self._ctl.close()
        if self._task is not None:
            self._task.cancel()
        for writer in list(self._held):
            writer.close()
        if self._server is not None:
            self._server.close()
        self._closed.set()

    async def wait_closed(self) -> None:
        await self._closed.wait()
