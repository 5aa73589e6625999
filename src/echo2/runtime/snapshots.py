"""The learner's snapshot publisher: weights -> signed snapshot -> the broadcast plane, and T_bcast back.

It owns the broadcast seam's publisher (``broadcast.factory``), keeps the newest published version
(the one provider of "what was published"), its manifest and bytes for a worker that catches up over
HTTP, and measures each publication's ``T_bcast``: the seconds until ``install_quorum(members, gamma)``
workers acked the install (SPEC §3: a fraction ``q = 1/gamma``), in the background so training never
waits for it. Beyond the model's own weights the learner holds the serialized bytes of the newest
version (one object, shared by this class and the publisher) and of the version before it, which the
TCP publisher still serves to workers in the middle of that transfer (its ``keep_versions = 2``).
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from echo2.broadcast.api import SnapshotPublisher
from echo2.physics.rules import install_quorum

log = logging.getLogger(__name__)

MEASURE_TIMEOUT_S = 120.0  # stop waiting for install acks of one version after this long


class Snapshots:
    def __init__(self, publisher: SnapshotPublisher, gamma: float) -> None:
        self.publisher = publisher
        self.gamma = gamma
        self.latest: tuple[int, dict[str, Any], bytes] | None = None  # version, manifest, blob
        self.bcast: dict[str, float] = {}  # the newest finite broadcast/ metrics
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def version(self) -> int:
        """The newest published version (-1 before the first)."""
        return self.latest[0] if self.latest is not None else -1

    async def publish(self, version: int, blob: bytes) -> None:
        """Sign and announce ``blob`` as ``version``; measure its dissemination in the background."""
        manifest = await self.publisher.publish(version, blob)
        self.latest = (version, manifest.to_dict(), blob)
        members = len(self.publisher.members())
        if members:
            task = asyncio.ensure_future(self._measure(version, members))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _measure(self, version: int, members: int) -> None:
        need = install_quorum(members, self.gamma)
        stats = await self.publisher.wait_installed(version, count=need, timeout=MEASURE_TIMEOUT_S)
        metrics = stats.metrics(self.gamma)
        if math.isfinite(metrics["broadcast/t_bcast_s"]):
            self.bcast.update(metrics)

    @property
    def t_bcast_s(self) -> float:
        """The newest measured T_bcast (0 before any was measured)."""
        return self.bcast.get("broadcast/t_bcast_s", 0.0)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.publisher.close()
