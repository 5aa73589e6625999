"""Snapshot format: safetensors bytes cut into fixed-size chunks, described by an authenticated manifest.

SPEC §4: "Every snapshot has a manifest (version, sizes, chunk size, a digest per chunk and for the whole)
authenticated by the learner; a worker installs nothing that fails verification."

Digests are SHA-256 (hardware-accelerated on current CPUs, ~2 GB/s per core). The manifest is
authenticated over a canonical JSON encoding of every other field, so any change to the version, a
size or a digest is caught, with one of two keys:

- ``Ed25519Key`` (default): the learner signs with its private key; workers hold only the public key,
  so a worker can verify a manifest but never forge one for its peers. Rented workers are not
  trusted, which is why this is the default.
- ``HmacKey``: HMAC-SHA256 under a per-run secret shared by the learner and its workers. Any holder
  can both verify and forge, so it suits only a fleet whose workers all trust each other.

A manifest names its scheme (``auth``) inside the authenticated payload, and a node refuses a manifest
whose scheme is not the one of its key.

Chunk ``i`` covers bytes ``[i*chunk_size, min((i+1)*chunk_size, total_size))``.

A snapshot is either a full **anchor** (the weights as safetensors) or a **patch** against an earlier
published version (``echo2.weights.delta``); a LoRA run's first link of each learner process is a
**base** anchor, the adapter with the frozen base it applies to (``echo2.weights.chain``). Its
:class:`Lineage` (kind, base version, digest of the base weights, digest of the resulting weights) is
part of the signed payload, so a relay cannot splice a patch onto the wrong base, and a worker checks
the weights it builds against what the learner published before it serves them.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import json
import secrets
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from echo2.errors import Echo2Error
from echo2.types import MAX_EPOCH

DIGEST = "sha256"
CHUNK_DIGEST_BYTES = 16  # a chunk's digest: the first 128 bits of its SHA-256 (see chunk_digest)
MAX_CHUNK_SIZE = 64 << 20  # a manifest asking for chunks above 64 MiB is rejected (bounded memory per chunk)
MAX_CHUNKS = 1 << 20  # ... and so is one with more than ~1M chunks (bounded manifest size)


class ManifestError(Echo2Error):
    """A manifest is malformed or fails authentication; the message says which field or check."""


KINDS = ("full", "patch", "base")  # an anchor, a patch, an anchor carrying a LoRA run's base
_HEX64 = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Lineage:
    """What a snapshot's bytes turn into: the full weights (``full``) or a patch of ``base_version``
    (``patch``), and the digest (``echo2.weights.delta.weights_digest``) of the base and of the result.
    Empty digests mean "not stated" (a blob that is not model weights, as in the transport tests).
    ``epoch`` is the run epoch of the learner process that published it (one more at every start of a
    learner on the run directory): a version number names weights only within its epoch, so a restart
    makes every earlier version unusable by construction (a patch's base is of its own epoch).
    ``model_base`` pins a LoRA run's publications (the adapter alone) to the base model they apply to:
    a worker holding another base refuses them (``models/lora.py``). A ``base`` link is an anchor
    that also carries that frozen base (its weights digest ``model_base``, checked by the receiver):
    the first link of a LoRA run's chain (``echo2.weights.chain``)."""

    kind: str = "full"  # "full" (an anchor), "patch", or "base" (an anchor with a LoRA run's base)
    base_version: int = -1  # the version a patch applies to; -1 for an anchor
    base_digest: str = ""  # weights digest of the base (patches only)
    weights_digest: str = ""  # weights digest of the result of installing this snapshot
    epoch: int = 0  # the publishing learner process's run epoch (0: none stated)
    model_base: str = ""  # a LoRA run's: weights digest of the frozen base the adapter applies to

    @property
    def anchor(self) -> bool:
        """Whether these bytes are whole weights (an anchor, with or without a base), not a patch."""
        return self.kind != "patch"

    def check(self, version: int) -> None:
        if not 0 <= self.epoch <= MAX_EPOCH:
            raise ManifestError(f"manifest.lineage.epoch must be in [0, {MAX_EPOCH}], got {self.epoch}")
        if self.kind not in KINDS:
            raise ManifestError(f"manifest.kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("base_digest", "weights_digest", "model_base"):
            value = getattr(self, name)
            if value and (len(value) != 64 or not set(value) <= _HEX64):
                raise ManifestError(
                    f"manifest.{name} must be 64 lowercase hex digits or empty, got {value!r}"
                )
        if self.kind != "patch" and (self.base_version != -1 or self.base_digest):
            raise ManifestError(
                f"a {self.kind} snapshot's manifest names no base version (base_version -1, no base_digest)"
            )
        if self.kind == "base" and not (self.model_base and self.weights_digest):
            raise ManifestError("a base snapshot's manifest must state model_base and weights_digest")
        if self.kind == "patch":
            if not 0 <= self.base_version < version:
                raise ManifestError(
                    f"a patch's base_version must be in [0, {version}), got {self.base_version}"
                )
            if not self.base_digest or not self.weights_digest:
                raise ManifestError("a patch's manifest must state base_digest and weights_digest")


@dataclass(frozen=True)
class Manifest:
    """Authenticated description of one immutable policy snapshot."""

    version: int  # policy version v this snapshot holds (required, never defaulted)
    total_size: int  # G: bytes in the whole safetensors blob
    chunk_size: int  # bytes per chunk (the last chunk may be shorter)
    chunk_digests: tuple[str, ...]  # hex chunk_digest of each chunk (SHA-256, first 16 bytes), in order
    digest: str  # hex SHA-256 of the whole blob
    auth: str  # authentication scheme of ``mac``: "ed25519" or "hmac-sha256" (itself authenticated)
    mac: str  # hex signature (Ed25519) or MAC (HMAC-SHA256) over the canonical encoding of the other fields
    lineage: Lineage = Lineage()  # anchor or patch, base and result digests (signed with the rest)

    @property
    def kind(self) -> str:
        return self.lineage.kind

    @property
    def n_chunks(self) -> int:
        return len(self.chunk_digests)

    def chunk_range(self, index: int) -> tuple[int, int]:
        """Byte range [start, end) of chunk ``index``."""
        start = index * self.chunk_size
        return start, min(start + self.chunk_size, self.total_size)

    def chunk_len(self, index: int) -> int:
        start, end = self.chunk_range(index)
        return end - start

    def to_dict(self) -> dict[str, Any]:
        """The manifest as it travels (JSON-ready): the chunk digests as one base64 string of the raw
        16-byte digests end to end (22 characters a chunk instead of 67 for a full SHA-256 as a hex
        string in a list: every announcement carries them, to every worker, over the learner's
        uplink)."""
        d = asdict(self)
        d["chunk_digests"] = base64.b64encode(b"".join(map(bytes.fromhex, self.chunk_digests))).decode()
        d["lineage"] = asdict(self.lineage)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Manifest:
        """Parse an untrusted dict; raises ManifestError naming the bad field (does not check the MAC)."""
        try:
            m = cls(
                version=_int(d, "version"),
                total_size=_int(d, "total_size"),
                chunk_size=_int(d, "chunk_size"),
                chunk_digests=_digests(d["chunk_digests"]),
                digest=str(d["digest"]),
                auth=str(d["auth"]),
                mac=str(d["mac"]),
                lineage=_lineage(d.get("lineage", {})),
            )
        except (KeyError, TypeError) as exc:
            raise ManifestError(f"manifest is missing or mistypes a field: {exc!r}") from None
        m.check_shape()
        return m

    def check_shape(self) -> None:
        """Structural checks that need no secret."""
        if self.version < 0:
            raise ManifestError(f"manifest.version must be >= 0, got {self.version}")
        if not 0 < self.chunk_size <= MAX_CHUNK_SIZE:
            raise ManifestError(
                f"manifest.chunk_size must be in (0, {MAX_CHUNK_SIZE}], got {self.chunk_size}"
            )
        if self.total_size < 0:
            raise ManifestError(f"manifest.total_size must be >= 0, got {self.total_size}")
        expected = max(1, -(-self.total_size // self.chunk_size))
        if len(self.chunk_digests) != expected or expected > MAX_CHUNKS:
            raise ManifestError(
                f"manifest has {len(self.chunk_digests)} chunk digests, expected {expected} "
                f"for total_size={self.total_size} chunk_size={self.chunk_size} (limit {MAX_CHUNKS})"
            )
        self.lineage.check(self.version)


def _digests(value: object) -> tuple[str, ...]:
    """Hex chunk digests from their wire form (:meth:`Manifest.to_dict`)."""
    try:
        if not isinstance(value, str):
            raise ValueError(f"a {type(value).__name__}")
        raw = base64.b64decode(value, validate=True)
    except (ValueError, binascii.Error) as exc:
        raise ManifestError(f"manifest.chunk_digests must be a base64 string of digests: {exc}") from None
    w = CHUNK_DIGEST_BYTES
    if len(raw) % w:
        raise ManifestError(f"manifest.chunk_digests holds {len(raw)} bytes, not whole {w}-byte digests")
    return tuple(raw[i : i + w].hex() for i in range(0, len(raw), w))


def _lineage(d: object) -> Lineage:
    if not isinstance(d, Mapping):
        raise ManifestError(f"manifest.lineage must be an object, got {d!r}")
    unknown = set(d) - {"kind", "base_version", "base_digest", "weights_digest", "epoch", "model_base"}
    if unknown:
        raise ManifestError(f"manifest.lineage has unknown fields {sorted(unknown)}")
    return Lineage(
        kind=str(d.get("kind", "full")),
        base_version=_int(d, "base_version") if "base_version" in d else -1,
        base_digest=str(d.get("base_digest", "")),
        weights_digest=str(d.get("weights_digest", "")),
        epoch=_int(d, "epoch") if "epoch" in d else 0,
        model_base=str(d.get("model_base", "")),
    )


def _int(d: Mapping[str, Any], key: str) -> int:
    value = d[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ManifestError(f"manifest.{key} must be an integer, got {value!r}")
    return value


AUTH_ED25519 = "ed25519"
AUTH_HMAC = "hmac-sha256"


@dataclass(frozen=True)
class HmacKey:
    """A per-run secret shared by the learner and every worker (holders can sign *and* verify)."""

    secret: bytes  # the shared secret, at least 16 bytes
    alg: ClassVar[str] = AUTH_HMAC

    def __post_init__(self) -> None:
        if len(self.secret) < 16:
            raise ManifestError(f"an HMAC secret needs at least 16 bytes, got {len(self.secret)}")

    def sign(self, payload: bytes) -> str:
        return hmac.new(self.secret, payload, hashlib.sha256).hexdigest()

    def verify(self, payload: bytes, tag: str) -> bool:
        """False for a wrong tag, and for one that is not ASCII (a peer's; compare_digest would raise)."""
        return isinstance(tag, str) and tag.isascii() and hmac.compare_digest(self.sign(payload), tag)

    def verifier(self) -> HmacKey:
        """What a worker holds: with a shared secret, the same key."""
        return self

    def to_text(self) -> str:
        return f"hmac:{self.secret.hex()}"


@dataclass(frozen=True)
class Ed25519Key:
    """The learner's Ed25519 key pair, or (``private`` unset) the public half that workers hold."""

    public: bytes  # 32-byte raw public key
    private: bytes | None = None  # 32-byte raw private key; only the learner has it
    alg: ClassVar[str] = AUTH_ED25519

    @classmethod
    def generate(cls) -> Ed25519Key:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import (
            Encoding,
            NoEncryption,
            PrivateFormat,
            PublicFormat,
        )

        key = Ed25519PrivateKey.generate()
        return cls(
            public=key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw),
            private=key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()),
        )

    def sign(self, payload: bytes) -> str:
        if self.private is None:
            raise ManifestError("this node holds only the learner's public key and cannot sign manifests")
        return self._signer.sign(payload).hex()

    @functools.cached_property
    def _signer(self) -> Any:
        """The private key as the library's object, built once (a publication signs one credential per
        member: rebuilding it cost as much as the signature)."""
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        assert self.private is not None
        return Ed25519PrivateKey.from_private_bytes(self.private)

    @functools.cached_property
    def _verifier(self) -> Any:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        return Ed25519PublicKey.from_public_bytes(self.public)

    def verify(self, payload: bytes, tag: str) -> bool:
        from cryptography.exceptions import InvalidSignature

        try:
            self._verifier.verify(bytes.fromhex(tag), payload)
        except (InvalidSignature, ValueError, TypeError):  # TypeError: a tag that is not a string
            return False
        return True

    def verifier(self) -> Ed25519Key:
        """What a worker holds: the public key only."""
        return Ed25519Key(public=self.public)

    def to_text(self) -> str:
        if self.private is not None:
            return f"ed25519:{self.private.hex()}:{self.public.hex()}"
        return f"ed25519-pub:{self.public.hex()}"


ManifestKey = HmacKey | Ed25519Key


def new_signing_key() -> Ed25519Key:
    """A fresh per-run learner key pair (the default scheme)."""
    return Ed25519Key.generate()


def new_secret() -> bytes:
    """A fresh per-run shared secret (32 random bytes) for the HMAC scheme."""
    return secrets.token_bytes(32)


def as_key(key: bytes | ManifestKey) -> ManifestKey:
    """Raw bytes mean a shared HMAC secret; keys pass through."""
    return HmacKey(bytes(key)) if isinstance(key, bytes | bytearray) else key


def key_from_text(text: str) -> ManifestKey:
    """Parse ``to_text()`` output (``hmac:HEX``, ``ed25519:PRIV:PUB``, ``ed25519-pub:PUB``)."""
    kind, _, rest = text.partition(":")
    try:
        if kind == "hmac":
            return HmacKey(bytes.fromhex(rest))
        if kind == "ed25519":
            private, _, public = rest.partition(":")
            return Ed25519Key(public=bytes.fromhex(public), private=bytes.fromhex(private))
        if kind == "ed25519-pub":
            return Ed25519Key(public=bytes.fromhex(rest))
    except ValueError as exc:
        raise ManifestError(f"malformed {kind} key text: {exc}") from None
    raise ManifestError(f"unknown key kind {kind!r}: expected hmac, ed25519 or ed25519-pub")


def digest(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def chunk_digest(data: bytes | bytearray | memoryview) -> str:
    """Hex of the first 16 bytes of the chunk's SHA-256. A relay that wants a forged chunk accepted
    needs a second preimage of 128 bits (about 2**128 hashes), which is as out of reach as one of
    256; collisions (2**64) would help only the learner, which signs the manifest. Every install also
    checks the whole snapshot's full SHA-256 and, for weights, the weights digest."""
    return hashlib.sha256(data).digest()[:CHUNK_DIGEST_BYTES].hex()


def _signed_payload(
    version: int,
    total_size: int,
    chunk_size: int,
    chunk_digests: tuple[str, ...],
    whole: str,
    auth: str,
    lineage: Lineage,
) -> bytes:
    body = {
        "lineage": asdict(lineage),
        "v": version,
        "total_size": total_size,
        "chunk_size": chunk_size,
        "chunk_digests": list(chunk_digests),
        "digest": whole,
        "alg": DIGEST,
        "auth": auth,
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def build_manifest(
    data: bytes | bytearray | memoryview,
    version: int,
    chunk_size: int,
    key: bytes | ManifestKey,
    lineage: Lineage | None = None,
) -> Manifest:
    """Cut ``data`` into chunks, digest each chunk and the whole, and authenticate with ``key``
    (the learner's signing key, or a shared HMAC secret given as bytes) together with ``lineage``
    (default: a full snapshot stating no weights digest)."""
    if chunk_size <= 0 or chunk_size > MAX_CHUNK_SIZE:
        raise ManifestError(f"chunk_size must be in (0, {MAX_CHUNK_SIZE}], got {chunk_size}")
    k = as_key(key)
    view = memoryview(data).cast("B")
    total = len(view)
    n = max(1, -(-total // chunk_size))
    chunk_digests = tuple(chunk_digest(view[i * chunk_size : (i + 1) * chunk_size]) for i in range(n))
    whole = digest(view)
    lin = lineage or Lineage()
    lin.check(version)
    tag = k.sign(_signed_payload(version, total, chunk_size, chunk_digests, whole, k.alg, lin))
    return Manifest(version, total, chunk_size, chunk_digests, whole, k.alg, tag, lin)


def verify_manifest(manifest: Manifest, key: bytes | ManifestKey) -> None:
    """Raise ManifestError unless the manifest is well formed, uses ``key``'s scheme, and its
    signature (or MAC) checks under ``key``."""
    manifest.check_shape()
    m = manifest
    k = as_key(key)
    if m.auth != k.alg:
        raise ManifestError(
            f"manifest for version {m.version} is authenticated with {m.auth!r}; this node expects {k.alg!r}"
        )
    payload = _signed_payload(
        m.version, m.total_size, m.chunk_size, m.chunk_digests, m.digest, m.auth, m.lineage
    )
    if not k.verify(payload, m.mac):
        raise ManifestError(
            f"manifest for version {m.version} fails {k.alg} authentication (wrong key or tampered)"
        )


def chunk_ok(manifest: Manifest, index: int, data: bytes | bytearray | memoryview) -> bool:
    """True iff ``data`` is exactly chunk ``index`` of the snapshot ``manifest`` describes."""
    if not 0 <= index < manifest.n_chunks or len(data) != manifest.chunk_len(index):
        return False
    return hmac.compare_digest(chunk_digest(data), manifest.chunk_digests[index])


def blob_ok(manifest: Manifest, data: bytes | bytearray | memoryview) -> bool:
    """True iff ``data`` is the whole snapshot ``manifest`` describes."""
    return len(data) == manifest.total_size and hmac.compare_digest(digest(data), manifest.digest)


def serialize_state_dict(state_dict: Mapping[str, Any]) -> bytes:
    """safetensors bytes for a torch or numpy state dict (torch imported only if a tensor needs it)."""
    values = list(state_dict.values())
    if values and type(values[0]).__module__.startswith("torch"):
        from safetensors.torch import save as save_torch

        return save_torch({k: v.detach().contiguous().cpu() for k, v in state_dict.items()})
    from safetensors.numpy import save as save_numpy

    return save_numpy(dict(state_dict))


def synthetic_snapshot(size_bytes: int, seed: int = 0, n_tensors: int = 8) -> bytes:
    """A safetensors blob of about ``size_bytes`` of random float16 tensors (benchmarks need no model)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    per = max(1, size_bytes // (2 * n_tensors))
    tensors = {
        f"layers.{i}.weight": np.frombuffer(rng.bytes(2 * per), dtype=np.float16) for i in range(n_tensors)
    }
    return serialize_state_dict(tensors)
