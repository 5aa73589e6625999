"""The learner's snapshot publisher: weights -> signed anchor or patch -> broadcast plane; T_bcast back.

It owns the broadcast seam's publisher (``broadcast.factory``) and the learner's chain
(``echo2.weights.publication.PublishedChain``: the latest anchor and the patches after it, the one
provider of "what was published", and the choice of what each publication ships: a lossless sparse
patch of the sampler copy against the previous publication, or a full **anchor**). The learner waits
only for the copy: encoding, digesting, signing and announcing run off the event loop while it trains
on.

A worker that catches up over HTTP gets the patches after the version it holds if they are in the
chain, else the anchor and every patch (:meth:`Snapshots.chain_from`); in a LoRA run (``frozen``) the
first publication carries the frozen base and stays the chain's first link for workers that hold no
base (``PublishedChain.first``; its twin, the adapter alone signed for the same version, for those
that do). Beyond the model it trains,
the learner holds one full copy of the published weights (the newest publication, the base of the
next patch; a second, the new copy, while a publication is encoded). The published bytes themselves
(anchor and patches) are written to the run directory's ``published/`` and served from read-only maps
of those files (``[snapshot] on_disk``; ``PublishedChain.spill``), shared with the publisher, which
also keeps the version before the newest for workers in the middle of that transfer
(``keep_versions = 2``).

It measures each publication's ``T_bcast``: the seconds until ``install_quorum(members, gamma)``
workers acked the install (SPEC §3: a fraction ``q = 1/gamma``), in the background so training never
waits for it, and reports bytes per publication (``broadcast/publication_bytes``; ``broadcast/bytes``
is what the learner itself uploaded).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo2.broadcast.api import SnapshotPublisher
from echo2.config import SnapshotConfig
from echo2.observe import catalog
from echo2.physics.rules import install_quorum
from echo2.weights.chain import Blob
from echo2.weights.delta import sampler_copy
from echo2.weights.manifest import Lineage, build_manifest
from echo2.weights.publication import Link, PublishedChain

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MEASURE_TIMEOUT_S = 120.0  # stop waiting for install acks of one version after this long
GATHER_QUIET_S = 1.0  # a gathering ends when no member joined for this long (members re-join 5 a second)


async def gather(
    publisher: SnapshotPublisher, expected: int, window_s: float, quiet_s: float = GATHER_QUIET_S
) -> int:
    """Wait, before an anchor is announced, while members join ``publisher``: until ``expected`` joined,
    or none joined for ``quiet_s`` (from the start too: nobody coming ends it then), at most ``window_s``.
    A restarted learner's fleet re-joins within a second or two (a node retries its join every 0.2 s):
    announced to nobody, every member would be a latecomer in a fan-out-4 tree of whole copies (about
    4x one copy's time to install, ``publisher.py``); gathered, one striped plan covers them. Returns
    the members joined."""
    t0 = last = time.monotonic()
    seen = len(publisher.members())
    while seen < expected and time.monotonic() - t0 < window_s and time.monotonic() - last < quiet_s:
        await asyncio.sleep(0.05)
        now = len(publisher.members())
        if now > seen:
            seen, last = now, time.monotonic()
    return seen


class Snapshots:
    def __init__(
        self,
        publisher: SnapshotPublisher,
        gamma: float,
        cfg: SnapshotConfig | None = None,
        on_published: Callable[[int, dict[str, torch.Tensor]], None] = lambda version, weights: None,
        spill_dir: Path | None = None,
        epoch: int = 0,
        model_base: str = "",
        frozen: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.publisher = publisher
        self.gamma = gamma
        self.cfg = cfg or SnapshotConfig()
        # what was published (its bytes in files under spill_dir when given); the next patch's base;
        # every manifest's lineage carries this learner process's run epoch (and a LoRA run's base)
        self.published_chain = PublishedChain(self.cfg, spill_dir, epoch, model_base, frozen)
        self.bcast: dict[str, float] = {}  # the newest finite broadcast/ metrics (T_bcast, bytes)
        self.publication: dict[str, float] = {}  # what the newest publication shipped
        self._pending: asyncio.Future[None] | None = None  # a publication being encoded and announced
        self._tasks: set[asyncio.Task[None]] = set()
        self.on_published = on_published  # told each published version's weights (the generation check's)

    @property
    def chain(self) -> list[Link]:
        """The latest anchor, then the patches published after it."""
        return self.published_chain.links

    @property
    def published(self) -> set[int]:
        """Every version this process published (a claim must be one)."""
        return self.published_chain.published

    @property
    def latest(self) -> tuple[int, dict[str, Any], Blob] | None:
        """The newest publication: version, signed manifest, bytes (None before the first)."""
        link = self.published_chain.latest
        return None if link is None else (link.version, link.manifest, link.blob)

    @property
    def version(self) -> int:
        """The newest published version (-1 before the first)."""
        return self.published_chain.version

    def chain_from(self, have: int, base_held: bool = False) -> list[Link]:
        """What a worker holding ``have`` (and a LoRA run's base, ``base_held``) needs to reach the newest
        (``PublishedChain.chain_from``)."""
        return self.published_chain.chain_from(have, base_held)

    # ---- publishing ------------------------------------------------------------------------------------
    async def publish_model(self, version: int, model: Any, wait: bool = True) -> None:
        """Publish ``model``'s weights as ``version`` (:meth:`publish_copy` of ``sampler_copy``)."""

        await self.publish_copy(version, lambda dtype: sampler_copy(model, dtype), wait)

    async def publish_copy(
        self, version: int, copy: Callable[[str], dict[str, torch.Tensor]], wait: bool = True
    ) -> None:
        """Publish the weights ``copy(dtype)`` returns (a sampler copy in the snapshot's dtype; a sharded
        learner gathers it from its ranks) as ``version``: an anchor or a patch (``PublishedChain.encode``).

        Only the copy of the weights happens before this returns when ``wait`` is false: encoding,
        signing and announcing run in the background while the learner trains on, and the next
        publication waits for this one (it is the next patch's base). ``wait`` (the first version, and
        anything that needs the publication out) returns once it is announced."""
        t0 = time.perf_counter()
        weights, copy_cpu_s = await asyncio.to_thread(_cpu_timed, copy, self.cfg.dtype)
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
        # the check is told (and computes an undo) while the patch is encoded, before the announcement:
        # a worker's claim of a version announced is never one the check does not hold yet
        enc, _ = await asyncio.gather(
            asyncio.to_thread(self.published_chain.encode, weights),
            asyncio.to_thread(self.on_published, version, weights),
        )
        await self.publish(version, enc.blob, enc.lineage)
        if enc.alone is not None:  # a base link: its adapter alone, signed as the same version
            await self._sign_twin(version, enc.alone, dataclasses.replace(enc.lineage, kind="full"))
        self.published_chain.base = weights
        self.publication = {
            catalog.BROADCAST_PUBLICATION_BYTES.key: float(len(enc.blob)),
            catalog.BROADCAST_FULL_BYTES.key: float(enc.full_bytes),
            catalog.BROADCAST_PATCH_RATIO.key: len(enc.blob) / max(1, enc.full_bytes),
            catalog.BROADCAST_ANCHOR.key: float(enc.lineage.anchor),
            catalog.BROADCAST_ENCODE_S.key: enc.encode_s,
            # copy, encode, chunk digests, signature, announcements (wall time)
            catalog.BROADCAST_PUBLISH_S.key: time.perf_counter() - t0,
            # CPU seconds of the threads that copied and encoded (wall time above also counts waiting for
            # a core and for the interpreter lock, which the update holds between its native calls)
            catalog.BROADCAST_PUBLISH_CPU_S.key: copy_cpu_s + enc.encode_cpu_s,
        }

    async def publish(self, version: int, blob: Blob, lineage: Lineage | None = None) -> None:
        """Sign and announce ``blob`` as ``version`` (``lineage``: anchor or patch; default a full
        snapshot of unstated weights); measure its dissemination in the background."""
        # bytes from elsewhere: the next patch has no known base (publish_model sets it)
        self.published_chain.base = None
        blob = await asyncio.to_thread(self.published_chain.spill, version, blob)
        manifest = (await self.publisher.publish(version, blob, lineage)).to_dict()
        self.published_chain.record(Link(version, manifest, blob))
        members = len(self.publisher.members())
        if members:
            task = asyncio.ensure_future(self._measure(version, members))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _sign_twin(self, version: int, alone: bytes, lineage: Lineage) -> None:
        """The base link's twin: the same version's adapter alone, signed with the publication key and
        served over HTTP to workers that hold the base (never announced)."""
        first = self.published_chain.first
        chunk = int(first.manifest["chunk_size"]) if first is not None else len(alone)
        manifest = await asyncio.to_thread(build_manifest, alone, version, chunk, self.publisher.key, lineage)
        self.published_chain.twin = Link(version, manifest.to_dict(), alone)

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
        return {
            **self.bcast,
            **self.publication,
            catalog.BROADCAST_SPILL_FAILED.key: float(self.published_chain.spill_failures),
            **self.publisher.counters.metrics(),
            **self.publisher.port_metrics(),
        }

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
