"""The learner's snapshot publisher: weights -> signed anchor or patch -> broadcast plane; T_bcast back.

It owns the broadcast seam's publisher (``broadcast.factory``) and decides what each publication
ships (``[snapshot]`` config, docs/broadcast.md): the sampler copy of the weights in the precision
workers sample with (bf16 by default), as a lossless sparse patch against the previous publication
(``echo2.models.delta``), or as a full **anchor** every ``anchor_every`` publications and whenever a
patch would exceed ``max_patch_ratio`` of the full snapshot. The learner waits only for the copy:
encoding, digesting, signing and announcing run off the event loop while it trains on.

It keeps the **chain** (the latest anchor and the patches after it: the one provider of "what was
published") for a worker that catches up over HTTP: the patches after the version it holds if they
are in the chain, else the anchor and every patch (:meth:`chain_from`). Beyond the model it trains,
the learner holds one full copy of the published weights (the previous publication, the base of the
next patch; a second, the new copy, while a publication is encoded) and the encoded anchor (bytes
shared with the publisher, which also keeps the bytes of the version before the newest for workers in
the middle of that transfer, ``keep_versions = 2``).

It measures each publication's ``T_bcast``: the seconds until ``install_quorum(members, gamma)``
workers acked the install (SPEC §3: a fraction ``q = 1/gamma``), in the background so training never
waits for it, and reports bytes per publication (``broadcast/publication_bytes``; ``broadcast/bytes``
is what the learner itself uploaded).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from echo2.broadcast.api import SnapshotPublisher
from echo2.broadcast.manifest import Lineage
from echo2.config import SnapshotConfig
from echo2.observe import catalog
from echo2.physics.rules import install_quorum

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MEASURE_TIMEOUT_S = 120.0  # stop waiting for install acks of one version after this long


@dataclass(frozen=True)
class Link:
    """One publication as it is served: version, signed manifest (dict) and the bytes."""

    version: int
    manifest: dict[str, Any]
    blob: bytes


@dataclass(frozen=True)
class Encoded:
    """What :meth:`Snapshots.encode` made of the weights (not yet published)."""

    blob: bytes
    lineage: Lineage
    full_bytes: int  # bytes of the weights in the publication dtype (what an anchor ships, about)
    encode_s: float  # seconds to diff, compress and digest
    encode_cpu_s: float  # of which CPU seconds of the encoding thread


class Snapshots:
    def __init__(
        self,
        publisher: SnapshotPublisher,
        gamma: float,
        cfg: SnapshotConfig | None = None,
        on_published: Callable[[int, dict[str, torch.Tensor]], None] = lambda version, weights: None,
    ) -> None:
        self.publisher = publisher
        self.gamma = gamma
        self.cfg = cfg or SnapshotConfig()
        self.chain: list[Link] = []  # the latest anchor, then the patches published after it
        self.published: set[int] = set()  # every version this process published (a claim must be one)
        self.bcast: dict[str, float] = {}  # the newest finite broadcast/ metrics (T_bcast, bytes)
        self.publication: dict[str, float] = {}  # what the newest publication shipped
        self._base: dict[str, torch.Tensor] | None = None  # the newest published weights (chain[-1])
        self._pending: asyncio.Future[None] | None = None  # a publication being encoded and announced
        self._tasks: set[asyncio.Task[None]] = set()
        self.on_published = on_published  # told each published version's weights (the generation check's)

    @property
    def latest(self) -> tuple[int, dict[str, Any], bytes] | None:
        """The newest publication: version, signed manifest, bytes (None before the first)."""
        if not self.chain:
            return None
        link = self.chain[-1]
        return link.version, link.manifest, link.blob

    @property
    def version(self) -> int:
        """The newest published version (-1 before the first)."""
        return self.chain[-1].version if self.chain else -1

    def chain_from(self, have: int) -> list[Link]:
        """What a worker holding version ``have`` needs to reach the newest: the links after ``have``
        when it is in the chain (always fewer bytes than the anchor and its patches), else the whole
        chain, anchor first. Empty when ``have`` is the newest."""
        versions = [link.version for link in self.chain]
        if have in versions:
            return self.chain[versions.index(have) + 1 :]
        return list(self.chain)

    # ---- publishing ------------------------------------------------------------------------------------
    async def publish_model(self, version: int, model: Any, wait: bool = True) -> None:
        """Publish ``model``'s weights as ``version``: an anchor or a patch (chosen in :meth:`encode`).

        Only the copy of the weights happens before this returns when ``wait`` is false: encoding,
        signing and announcing run in the background while the learner trains on, and the next
        publication waits for this one (it is the next patch's base). ``wait`` (the first version, and
        anything that needs the publication out) returns once it is announced."""
        from echo2.models.delta import sampler_copy

        t0 = time.perf_counter()
        weights, copy_cpu_s = await asyncio.to_thread(_cpu_timed, sampler_copy, model, self.cfg.dtype)
        await self.flush()
        self._pending = asyncio.ensure_future(self._publish_weights(version, weights, t0, copy_cpu_s))
        if wait:
            await self.flush()

    async def flush(self) -> None:
        """Wait until the publication in progress (if any) is announced; re-raise what it raised."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            await pending

    async def _publish_weights(
        self, version: int, weights: dict[str, torch.Tensor], t0: float, copy_cpu_s: float
    ) -> None:
        enc = await asyncio.to_thread(self.encode, weights)
        await self.publish(version, enc.blob, enc.lineage)
        self._base = weights
        self.on_published(version, weights)
        self.publication = {
            catalog.BROADCAST_PUBLICATION_BYTES.key: float(len(enc.blob)),
            catalog.BROADCAST_FULL_BYTES.key: float(enc.full_bytes),
            catalog.BROADCAST_PATCH_RATIO.key: len(enc.blob) / max(1, enc.full_bytes),
            catalog.BROADCAST_ANCHOR.key: float(enc.lineage.kind == "full"),
            catalog.BROADCAST_ENCODE_S.key: enc.encode_s,
            # copy, encode, chunk digests, signature, announcements (wall time)
            catalog.BROADCAST_PUBLISH_S.key: time.perf_counter() - t0,
            # CPU seconds of the threads that copied and encoded (wall time above also counts waiting for
            # a core and for the interpreter lock, which the update holds between its native calls)
            catalog.BROADCAST_PUBLISH_CPU_S.key: copy_cpu_s + enc.encode_cpu_s,
        }

    def encode(self, weights: dict[str, torch.Tensor]) -> Encoded:
        """The next publication of ``weights`` (a sampler copy; any thread)."""
        from echo2.models.delta import encode_full, encode_patch, weights_digest

        t0, cpu0 = time.perf_counter(), time.thread_time()
        cfg = self.cfg
        digest = weights_digest(weights)
        full_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        # the chain holds the anchor and the patches since: the next one is an anchor once it is K long
        if cfg.deltas and self._base is not None and len(self.chain) < cfg.anchor_every:
            patch = encode_patch(self._base, weights, cfg.zstd_level)
            if len(patch) <= cfg.max_patch_ratio * full_bytes:
                base_digest = self.chain[-1].manifest["lineage"]["weights_digest"]
                lineage = Lineage("patch", self.version, base_digest, digest)
                return Encoded(
                    patch, lineage, full_bytes, time.perf_counter() - t0, time.thread_time() - cpu0
                )
        anchor = Lineage("full", weights_digest=digest)
        blob = encode_full(weights)
        return Encoded(blob, anchor, full_bytes, time.perf_counter() - t0, time.thread_time() - cpu0)

    async def publish(self, version: int, blob: bytes, lineage: Lineage | None = None) -> None:
        """Sign and announce ``blob`` as ``version`` (``lineage``: anchor or patch; default a full
        snapshot of unstated weights); measure its dissemination in the background."""
        self._base = None  # bytes from elsewhere: the next patch has no known base (publish_model sets it)
        manifest = (await self.publisher.publish(version, blob, lineage)).to_dict()
        link = Link(version, manifest, blob)
        self.published.add(version)
        self.chain = [*self.chain, link] if manifest["lineage"]["kind"] == "patch" else [link]
        members = len(self.publisher.members())
        if members:
            task = asyncio.ensure_future(self._measure(version, members))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _measure(self, version: int, members: int) -> None:
        need = install_quorum(members, self.gamma)
        stats = await self.publisher.wait_installed(version, count=need, timeout=MEASURE_TIMEOUT_S)
        metrics = stats.metrics(self.gamma)
        if math.isfinite(metrics[catalog.BROADCAST_T_BCAST_S.key]):
            self.bcast.update(metrics)

    def metrics(self) -> dict[str, float]:
        """broadcast/ metrics of the newest measured dissemination and the newest publication, and the
        publisher's counts of its members' conduct (stall reports, demoted relays, refused acks, bad
        frames: ``broadcast.api.PublisherCounters``)."""
        return {**self.bcast, **self.publication, **self.publisher.counters.metrics()}

    @property
    def t_bcast_s(self) -> float:
        """The newest measured T_bcast (0 before any was measured)."""
        return self.bcast.get(catalog.BROADCAST_T_BCAST_S.key, 0.0)

    async def close(self) -> None:
        try:
            await self.flush()
        except Exception:  # closing anyway: say what the last publication ran into
            log.exception("the last publication failed")
        for task in list(self._tasks):
            task.cancel()
        await self.publisher.close()


def _cpu_timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` and the CPU seconds the calling thread spent in it."""
    cpu0 = time.thread_time()
    return fn(*args), time.thread_time() - cpu0
