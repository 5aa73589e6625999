"""The learner's chain: what was published, and what the next publication ships.

The chain is the latest anchor and the patches published after it: the one provider of "what was
published", for the routes (``GET /v1/snapshot?have=V``: :meth:`PublishedChain.chain_from`) and for
the checks of a worker's claimed version (:attr:`PublishedChain.published`). :meth:`PublishedChain.encode`
decides what the next publication of the weights ships (``[snapshot]`` config, docs/broadcast.md): the
sampler copy in the precision workers sample with (bf16 by default) as a lossless sparse patch against
the previous publication (``echo2.weights.delta``), or as a full **anchor** every ``anchor_every``
publications and whenever a patch would exceed ``max_patch_ratio`` of the full snapshot.

In a LoRA run (``frozen``: the base the adapter applies to) the first publication of the process is a
**base** link: the adapter anchor with the frozen base (``weights.chain.with_frozen``), relayed like
any publication, and kept as the chain's first link for as long as the process runs
(:attr:`PublishedChain.first`): a worker that holds no base gets it ahead of the latest anchor. A
worker that holds the base gets, in its place, the same version's adapter alone (:attr:`PublishedChain.twin`,
an anchor signed like the rest), so the largest object of the run crosses to a worker once.

No event loop and no network here: ``runtime/snapshots.py`` copies the weights, calls :meth:`encode`
off the loop, signs and announces the result, and records it (:meth:`PublishedChain.record`).
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo2.config import SnapshotConfig
from echo2.resources import is_exhausted, retry_exhausted
from echo2.weights.chain import Blob, with_frozen
from echo2.weights.delta import encode_full, encode_patch, weights_digest
from echo2.weights.manifest import Lineage

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Link:
    """One publication as it is served: version, signed manifest (dict) and the bytes."""

    version: int
    manifest: dict[str, Any]
    blob: Blob  # bytes, or a read-only view of the file it was spilled to


@dataclass(frozen=True)
class Encoded:
    """What :meth:`PublishedChain.encode` made of the weights (not yet published)."""

    blob: bytes
    lineage: Lineage
    full_bytes: int  # bytes of the weights in the publication dtype (what an anchor ships, about)
    encode_s: float  # seconds to diff, compress and digest
    encode_cpu_s: float  # of which CPU seconds of the encoding thread
    alone: bytes | None = None  # a base link's adapter anchor alone (its twin for workers holding the base)


SPILL_GLOB = "v*.bin"  # the files PublishedChain.spill writes (_spilled: v<version, 10 digits>.bin)


class PublishedChain:
    """The latest anchor and the patches after it, every version published, and the base of the next
    patch (the weights of the newest publication, when this process encoded it)."""

    def __init__(
        self,
        cfg: SnapshotConfig | None = None,
        spill_dir: Path | None = None,
        epoch: int = 0,
        model_base: str = "",
        frozen: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.cfg = cfg or SnapshotConfig()
        self.epoch = epoch  # this learner process's run epoch: signed into every lineage
        self.spill_dir = spill_dir if self.cfg.on_disk else None  # where published bytes live
        self.spill_failures = 0  # publications served from memory: their spill directory stayed full
        if self.spill_dir is not None:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            for stale in self.spill_dir.glob(SPILL_GLOB):  # an earlier process's: never served again
                stale.unlink()
        self.links: list[Link] = []  # the latest anchor, then the patches published after it
        self.published: set[int] = set()  # every version this process published (a claim must be one)
        self.base: dict[str, torch.Tensor] | None = None  # the newest published weights (links[-1])
        self.model_base = model_base  # a LoRA run's: digest of the base model every publication applies to
        self.frozen = frozen  # ... and that base (weights_digest == model_base), shipped in the first link
        self.first: Link | None = None  # the base link this process published (LoRA runs), kept for good
        self.twin: Link | None = (
            None  # the same version's adapter alone, signed (for workers holding the base)
        )

    @property
    def latest(self) -> Link | None:
        """The newest publication (None before the first)."""
        return self.links[-1] if self.links else None

    @property
    def version(self) -> int:
        """The newest published version (-1 before the first)."""
        return self.links[-1].version if self.links else -1

    def chain_from(self, have: int, base_held: bool = False) -> list[Link]:
        """What a worker holding version ``have`` needs to reach the newest: the links after ``have``
        when it is in the chain (always fewer bytes than the anchor and its patches), else the whole
        chain, anchor first. Empty when ``have`` is the newest. In a LoRA run a worker that does not
        hold the base (``base_held`` false) gets the base link first; one that does gets the base
        link's twin in its place."""
        versions = [link.version for link in self.links]
        if have in versions:
            return self.links[versions.index(have) + 1 :]
        links = list(self.links)
        if self.first is None:
            return links
        if base_held:
            return [self.twin if link is self.first and self.twin is not None else link for link in links]
        return links if links[0] is self.first else [self.first, *links]

    def budget_size(self, link: Link) -> int:
        """The bytes a version's serve budget is reckoned from: its link's, or for the base link's twin
        the base link's (both are that version; a member may get either, within one budget)."""
        first = self.first
        return len(first.blob) if first is not None and link.version == first.version else len(link.blob)

    def encode(self, weights: dict[str, torch.Tensor]) -> Encoded:
        """The next publication of ``weights`` (a sampler copy; any thread)."""

        t0, cpu0 = time.perf_counter(), time.thread_time()
        cfg = self.cfg
        digest = weights_digest(weights)
        full_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        # the chain holds the anchor and the patches since: the next one is an anchor once it is K long
        if cfg.deltas and self.base is not None and len(self.links) < cfg.anchor_every:
            patch = encode_patch(self.base, weights, cfg.zstd_level)
            if len(patch) <= cfg.max_patch_ratio * full_bytes:
                base_digest = self.links[-1].manifest["lineage"]["weights_digest"]
                lineage = Lineage("patch", self.version, base_digest, digest, self.epoch, self.model_base)
                return Encoded(
                    patch, lineage, full_bytes, time.perf_counter() - t0, time.thread_time() - cpu0
                )
        anchor = Lineage("full", weights_digest=digest, epoch=self.epoch, model_base=self.model_base)
        if self.frozen is not None and self.first is None:  # this process's first link of the weights
            blob, alone = encode_full(with_frozen(self.frozen, weights)), encode_full(weights)
            anchor = dataclasses.replace(anchor, kind="base")
            full_bytes += sum(t.numel() * t.element_size() for t in self.frozen.values())
            return Encoded(
                blob, anchor, full_bytes, time.perf_counter() - t0, time.thread_time() - cpu0, alone
            )
        blob = encode_full(weights)
        return Encoded(blob, anchor, full_bytes, time.perf_counter() - t0, time.thread_time() - cpu0)

    def spill(self, version: int, blob: Blob) -> Blob:
        """``blob`` as it will be served: with a spill directory, written to a file there and returned
        as a read-only memory map of it (the publisher, the routes and this chain share the view; its
        pages are the kernel's page cache, not the learner's memory), else unchanged (any thread).
        A descriptor table or a disk that is full is waited out (``resources.retry_exhausted``); if it
        stays full the publication is served from memory instead (counted ``spill_failures``), never
        lost and never the end of the run."""
        if self.spill_dir is None or len(blob) == 0:
            return blob
        path = self._spilled(version)
        try:
            return retry_exhausted(lambda: spill_file(path, blob), f"spilling v{version} to {path}")
        except OSError as exc:
            if not is_exhausted(exc):
                raise
            self.spill_failures += 1
            path.unlink(missing_ok=True)
            log.error("v%d is served from memory: %s stays full (%s)", version, path.parent, exc.strerror)
            return blob

    def _spilled(self, version: int) -> Path:
        """The file ``version``'s published bytes are spilled to (a spill directory is set)."""
        assert self.spill_dir is not None
        return self.spill_dir / f"v{version:010d}.bin"

    def record(self, link: Link) -> None:
        """``link`` is announced: a patch extends the chain, an anchor starts a new one (the files of the
        chain it ends are removed, but the first link's; views still open on them stay readable until
        dropped). A base link is also kept as the first link for good."""
        self.published.add(link.version)
        kind = link.manifest["lineage"]["kind"]
        if kind == "patch":
            self.links = [*self.links, link]
            return
        if kind == "base":
            self.first = link
        ended, self.links = self.links, [link]
        if self.spill_dir is not None:
            for old in ended:
                if old is not self.first:
                    self._spilled(old.version).unlink(missing_ok=True)


def spill_file(path: Path, blob: Blob) -> Blob:
    """``blob`` written to ``path`` and returned as a read-only memory map of the file (its pages the
    kernel's page cache, not the process's memory)."""
    with open(path, "wb") as f:
        f.write(blob)
    with open(path, "rb") as f:  # the map outlives the descriptor
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
