"""A worker's copy of the published weights, staged installs of anchors and patches, and the chain as
it travels over HTTP.

A worker holds the weights of the version it serves exactly as the learner published them (the
publication dtype, ``[snapshot] dtype``) and their digest. :meth:`WeightChain.stage` turns verified
links (full anchors and patches, ``echo2.weights.delta``) into the weights of a newer version on a
**copy**: a patch must name the version and digest the worker holds, and every version built is
checked against the weights digest the learner signed. Only a staged result that passed every check
is swapped in (:meth:`WeightChain.commit`, after the engine loaded it); any failure leaves the old
version serving and says why. A gap (a patch whose base the worker never had) stops the walk where
it is, so the caller fetches the missing links (``GET /v1/snapshot?have=V``).

A LoRA run's chain starts, in each learner process, with a **base** link: the adapter anchor and the
frozen base it applies to in one safetensors blob (:func:`with_frozen`: the base's tensors under
``FROZEN``), relayed like any publication. Staging it checks the base against the lineage's signed
``model_base`` digest and hands it on (:attr:`Weights.frozen`) to whoever holds it for the engine;
the weights a version names stay the adapter's.

That body (:func:`chain_parts` on the learner, :func:`decode_chain` on the worker) is magic, an 8-byte
header length, a JSON header naming each link's signed manifest and size, then the links' bytes in
order; nothing in it is trusted: :func:`verified_links` authenticates every manifest and checks every
blob against it before :meth:`WeightChain.stage` sees them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pydantic_core

from echo2.weights.delta import DeltaError, apply_patch, decode_full, weights_digest
from echo2.weights.manifest import Manifest, ManifestError, ManifestKey, blob_ok, verify_manifest

if TYPE_CHECKING:
    import torch

CHAIN_MAGIC = b"E2CHAIN1"
MAX_CHAIN_LINKS = 1024  # a chain longer than this is refused (the learner anchors far more often)

Blob = bytes | bytearray | memoryview


FROZEN = "frozen/"  # a base link's tensors of the frozen base are named FROZEN + their own name


def with_frozen(frozen: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The tensors a base link ships: ``weights`` (the adapter) and the frozen base under ``FROZEN``."""
    return {**{FROZEN + name: t for name, t in frozen.items()}, **weights}


def split_frozen(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Inverse of :func:`with_frozen`: (the frozen base by its own names, the rest)."""
    n = len(FROZEN)
    frozen = {name[n:]: t for name, t in tensors.items() if name.startswith(FROZEN)}
    return frozen, {name: t for name, t in tensors.items() if not name.startswith(FROZEN)}


class ChainError(ValueError):
    """A snapshot chain body is malformed; the message says what is wrong."""


def chain_parts(links: Sequence[tuple[dict[str, Any], Blob]]) -> list[Blob]:
    """``GET /v1/snapshot`` body, in the pieces a server writes one after the other (the links' bytes
    as they are, never copied into one buffer: an anchor of a real model is GBs): magic, 8-byte header
    length, a JSON header naming each link's signed manifest and size, then the links' bytes in order
    (each verified by the receiver against its manifest; nothing here is trusted)."""
    header = json.dumps({"links": [{"manifest": m, "size": len(b)} for m, b in links]}).encode()
    return [CHAIN_MAGIC + len(header).to_bytes(8, "big") + header, *(b for _, b in links)]


def encode_chain(links: Sequence[tuple[dict[str, Any], Blob]]) -> bytes:
    """The whole body of :func:`chain_parts` as one bytes object (tests, small chains)."""
    return b"".join(chain_parts(links))


def decode_chain(body: bytes) -> list[tuple[dict[str, Any], memoryview]]:
    """Inverse of :func:`encode_chain`, for untrusted bytes: raises :class:`ChainError` naming the fault,
    never anything else. The header is parsed by pydantic's JSON parser (nesting bounded by its
    recursion limit, no lone surrogates, no integer too long to convert), so no header, however deep,
    reaches the caller as a RecursionError or a string nothing can encode."""
    view = memoryview(body)
    if len(view) < 16 or bytes(view[:8]) != CHAIN_MAGIC:
        raise ChainError("snapshot chain: bad magic")
    n = int.from_bytes(view[8:16], "big")
    if n > len(view) - 16:
        raise ChainError(f"snapshot chain: header of {n} bytes overruns a body of {len(view)}")
    try:
        header = pydantic_core.from_json(bytes(view[16 : 16 + n]))
        raw = header["links"]
        if not isinstance(raw, list) or len(raw) > MAX_CHAIN_LINKS:
            raise ChainError(f"snapshot chain: links must be a list of at most {MAX_CHAIN_LINKS}")
        sizes = [(link["manifest"], link["size"]) for link in raw]
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise ChainError(f"snapshot chain: malformed header ({str(exc)[:200]!r})") from None
    out, at = [], 16 + n
    for manifest, size in sizes:
        if not isinstance(manifest, dict) or not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ChainError("snapshot chain: a link needs a manifest object and a size >= 0")
        if at + size > len(view):
            raise ChainError(f"snapshot chain: link of {size} bytes overruns the body")
        out.append((manifest, view[at : at + size]))
        at += size
    if at != len(view):
        raise ChainError(f"snapshot chain: {len(view) - at} trailing bytes")
    return out


def verified_links(
    raw: Sequence[tuple[dict[str, Any], memoryview]], key: ManifestKey
) -> list[tuple[Manifest, memoryview]]:
    """Links as the learner served them over HTTP (:func:`decode_chain`), each manifest
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
    epoch: int = 0  # the run epoch of the learner process that published it (its manifest's lineage)
    frozen: dict[str, torch.Tensor] | None = None  # a LoRA run's base, when a base link was staged


class WeightChain:
    """The weights a worker serves, and how a verified link takes them to a newer version."""

    def __init__(self) -> None:
        self.current: Weights | None = None

    @property
    def version(self) -> int:
        return self.current.version if self.current is not None else -1

    @property
    def epoch(self) -> int:
        """The run epoch of the weights served (0 before the first install)."""
        return self.current.epoch if self.current is not None else 0

    def stage(self, links: Iterable[tuple[Manifest, bytes | bytearray | memoryview]]) -> Weights | None:
        """Apply ``links`` (authenticated manifests with their verified bytes; any order, older ones
        ignored) in version order to a copy of the current weights. Returns the newest version reached
        (None if none was newer or the first one needed is missing); stops at a gap. Versions are
        ordered within their run epoch, epochs first: a link of an earlier epoch than the weights held
        is ignored, and a newer epoch starts from its anchor (its patches' bases are of its own epoch,
        whatever their numbers). Raises
        :class:`DeltaError` when a link does not fit what it claims (wrong base digest, result digest
        mismatch, malformed bytes, a base link whose base is not the one its lineage pins): nothing is
        swapped in then. A base link staged hands its base on in the result's ``frozen``."""
        cur, frozen = self.current, None
        for manifest, data in sorted(links, key=lambda link: (link[0].lineage.epoch, link[0].version)):
            lin = manifest.lineage
            if cur is not None and (lin.epoch, manifest.version) <= (cur.epoch, cur.version):
                continue
            if lin.anchor:
                tensors = decode_full(data)
                if lin.kind == "base":
                    frozen, tensors = split_frozen(tensors)
                    if (got := weights_digest(frozen)) != lin.model_base:
                        raise DeltaError(
                            f"v{manifest.version}: the base it carries has digest {got[:12]}, its signed "
                            f"lineage pins {lin.model_base[:12]}; not installing"
                        )
            elif cur is None or lin.epoch != cur.epoch or lin.base_version != cur.version:
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
            cur = Weights(manifest.version, digest, tensors, lin.epoch, frozen)
        return cur if cur is not None and cur is not self.current else None

    def commit(self, staged: Weights) -> None:
        """``staged`` is now what the worker serves (call after the engine loaded it)."""
        self.current = staged
