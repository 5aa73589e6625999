"""A worker's copy of the published weights, and staged, transactional installs of anchors and patches.

A worker holds the weights of the version it serves exactly as the learner published them (the
publication dtype, ``[snapshot] dtype``) and their digest. :meth:`WeightChain.stage` turns verified
links (full anchors and patches, ``echo2.models.delta``) into the weights of a newer version on a
**copy**: a patch must name the version and digest the worker holds, and every version built is
checked against the weights digest the learner signed. Only a staged result that passed every check
is swapped in (:meth:`WeightChain.commit`, after the engine loaded it); any failure leaves the old
version serving and says why. A gap (a patch whose base the worker never had) stops the walk where
it is, so the caller fetches the missing links (``GET /v1/snapshot?have=V``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from echo2.broadcast.manifest import Manifest, ManifestError, ManifestKey, blob_ok, verify_manifest
from echo2.models.delta import DeltaError, apply_patch, decode_full, weights_digest

if TYPE_CHECKING:
    import torch


def verified_links(
    raw: Sequence[tuple[dict[str, Any], memoryview]], key: ManifestKey
) -> list[tuple[Manifest, memoryview]]:
    """Links as the learner served them over HTTP (``protocol.decode_chain``), each manifest
    authenticated with ``key`` and each blob checked against it; :class:`ManifestError` otherwise."""
    links = []
    for d, data in raw:
        manifest = Manifest.from_dict(d)
        verify_manifest(manifest, key)
        if not blob_ok(manifest, data):
            raise ManifestError(f"v{manifest.version}: the bytes served do not match the signed manifest")
        links.append((manifest, data))
    return links


@dataclass(frozen=True)
class Weights:
    """One version's published weights, as the worker serves them."""

    version: int
    digest: str  # ``weights_digest(tensors)``
    tensors: dict[str, torch.Tensor]


class WeightChain:
    """The weights a worker serves, and how a verified link takes them to a newer version."""

    def __init__(self) -> None:
        self.current: Weights | None = None

    @property
    def version(self) -> int:
        return self.current.version if self.current is not None else -1

    def stage(self, links: Iterable[tuple[Manifest, bytes | bytearray | memoryview]]) -> Weights | None:
        """Apply ``links`` (authenticated manifests with their verified bytes; any order, older ones
        ignored) in version order to a copy of the current weights. Returns the newest version reached
        (None if none was newer or the first one needed is missing); stops at a gap. Raises
        :class:`DeltaError` when a link does not fit what it claims (wrong base digest, result digest
        mismatch, malformed bytes): nothing is swapped in then."""
        cur = self.current
        for manifest, data in sorted(links, key=lambda link: link[0].version):
            held = cur.version if cur is not None else -1
            if manifest.version <= held:
                continue
            lin = manifest.lineage
            if lin.kind == "full":
                tensors = decode_full(data)
            elif cur is None or lin.base_version != cur.version:
                break  # a gap: the caller fetches the chain from the version it holds
            elif lin.base_digest != cur.digest:
                raise DeltaError(
                    f"v{manifest.version} patches v{lin.base_version} with digest {lin.base_digest[:12]}, "
                    f"but the weights held for v{cur.version} have digest {cur.digest[:12]}"
                )
            else:
                tensors = apply_patch(cur.tensors, data)
            digest = weights_digest(tensors)
            if lin.weights_digest and digest != lin.weights_digest:
                raise DeltaError(
                    f"v{manifest.version}: the weights built have digest {digest[:12]}, the learner "
                    f"published {lin.weights_digest[:12]}; not installing"
                )
            cur = Weights(manifest.version, digest, tensors)
        return cur if cur is not None and cur is not self.current else None

    def commit(self, staged: Weights) -> None:
        """``staged`` is now what the worker serves (call after the engine loaded it)."""
        self.current = staged
