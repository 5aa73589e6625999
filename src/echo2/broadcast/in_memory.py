"""In-memory implementation of the broadcast seam (tests, single-process runs, the simulator's glue).

Same contract as the TCP pair: the publisher signs a manifest; each receiver verifies it and the blob
before yielding, and acks after loading. No copies are made beyond the one blob the hub holds. Nothing
is relayed, so nothing can stall: every ack of a target counts, and ``counters`` (the TCP publisher's
``PublisherCounters``, for the same metrics) stays at 0.

The hub takes the same :class:`~echo2.broadcast.api.MemberLedger` as the TCP publisher (default
:class:`~echo2.broadcast.api.OpenLedger`): a publication targets the receivers the ledger makes
targets, and each counted ack is written to it (``ledger.installed``). Receivers are created in the
process, with no credential to present, so ``may_join`` is not asked.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from echo2.broadcast.api import (
    BroadcastStats,
    InstalledSnapshot,
    MemberLedger,
    OpenLedger,
    PublisherCounters,
    Receiving,
)
from echo2.errors import Echo2Error
from echo2.physics.broadcast import relay_chunk_bytes
from echo2.weights.manifest import (
    Lineage,
    Manifest,
    ManifestError,
    ManifestKey,
    as_key,
    blob_ok,
    build_manifest,
    verify_manifest,
)


class InMemoryHub:
    """A publisher and any number of receivers sharing one process."""

    def __init__(
        self, key: bytes | ManifestKey, chunk_size: int | None = 1 << 20, ledger: MemberLedger | None = None
    ) -> None:
        self.key = as_key(key)  # signing key; receivers verify with its public half
        self.chunk_size = chunk_size
        self.ledger = ledger if ledger is not None else OpenLedger()  # who is a target, who installed what
        self.counters = PublisherCounters()  # the TCP publisher's counters; no relays here, so all 0
        self._latest: tuple[Manifest, bytes] | None = None
        self._published = asyncio.Event()
        self._started: dict[int, float] = {}
        self._acks: dict[int, dict[str, float]] = {}
        self._targets: dict[int, int] = {}
        self._receivers: dict[str, InMemoryReceiver] = {}
        self._acked = asyncio.Event()

    def port_metrics(self) -> dict[str, float]:
        return {}  # no port: receivers are in this process

    # lifecycle (the same calls as the TCP publisher's)
    async def start(self) -> tuple[str, int]:
        return self.address

    @property
    def address(self) -> tuple[str, int]:
        return ("memory", 0)  # receivers join the hub object itself (broadcast.factory.open_receiver)

    def members(self) -> list[str]:
        return [w for w in self._receivers if self.ledger.is_target(w)]

    async def close(self) -> None:
        for rx in list(self._receivers.values()):
            await rx.close()

    # publisher side (SnapshotPublisher)
    async def publish(
        self, version: int, blob: bytes | memoryview, lineage: Lineage | None = None
    ) -> Manifest:
        if self._latest is not None and version <= self._latest[0].version:
            raise Echo2Error(f"version {version} is not newer than published {self._latest[0].version}")
        chunk = self.chunk_size or relay_chunk_bytes(len(blob))
        manifest = build_manifest(blob, version, chunk, self.key, lineage)
        self._latest = (manifest, blob)
        self._started[version] = time.monotonic()
        self._acks[version] = {}
        self._targets[version] = len(self.members())
        self._published.set()
        self._published = asyncio.Event()
        return manifest

    async def wait_installed(
        self, version: int, count: int | None = None, timeout: float = 600.0
    ) -> BroadcastStats:
        need = self._targets[version] if count is None else count
        deadline = time.monotonic() + timeout
        while len(self._acks[version]) < need and time.monotonic() < deadline:
            self._acked.clear()
            try:
                await asyncio.wait_for(self._acked.wait(), deadline - time.monotonic())
            except TimeoutError:
                break
        return self.stats(version)

    def stats(self, version: int) -> BroadcastStats:
        assert self._latest is not None
        return BroadcastStats(
            version, self._targets[version], self._latest[0].total_size, dict(self._acks[version])
        )

    # worker side
    def receiver(self, worker_id: str) -> InMemoryReceiver:
        if worker_id in self._receivers:
            raise Echo2Error(f"worker id {worker_id!r} already joined")
        rx = InMemoryReceiver(self, worker_id)
        self._receivers[worker_id] = rx
        return rx

    def leave(self, worker_id: str) -> None:
        self._receivers.pop(worker_id, None)

    def _ack(self, worker_id: str, version: int) -> None:
        acks = self._acks.get(version)
        if acks is not None and worker_id not in acks and self.ledger.is_target(worker_id):
            delay = acks[worker_id] = time.monotonic() - self._started[version]
            self.ledger.installed(worker_id, version, delay)
            self._acked.set()


class InMemoryReceiver:
    """Worker end of :class:`InMemoryHub` (implements ``SnapshotReceiver``)."""

    def __init__(self, hub: InMemoryHub, worker_id: str) -> None:
        self.hub = hub
        self.worker_id = worker_id
        self.installed_version = -1
        self._closed = asyncio.Event()

    async def start(self, join_timeout: float = 30.0) -> None:
        """Joined at construction; here for the same lifecycle as a TCP node."""

    async def close(self) -> None:
        """Leave the hub; :meth:`snapshots` ends."""
        self.hub.leave(self.worker_id)
        self._closed.set()

    async def snapshots(self) -> AsyncIterator[InstalledSnapshot]:
        while not self._closed.is_set():
            latest = self.hub._latest
            if latest is None or latest[0].version <= self.installed_version:
                published = asyncio.ensure_future(self.hub._published.wait())
                closed = asyncio.ensure_future(self._closed.wait())
                await asyncio.wait({published, closed}, return_when=asyncio.FIRST_COMPLETED)
                published.cancel()
                closed.cancel()
                continue
            manifest, blob = latest
            verify_manifest(manifest, self.hub.key.verifier())
            if not blob_ok(manifest, blob):
                raise ManifestError(f"in-memory blob for v{manifest.version} fails its digest")
            self.installed_version = manifest.version
            yield InstalledSnapshot(manifest, memoryview(blob).toreadonly())

    def receiving(self) -> Receiving | None:
        """Never: a hub's publication is delivered whole, at once."""
        return None

    async def report_installed(self, version: int) -> None:
        self.hub._ack(self.worker_id, version)
