"""Snapshot format: chunking, digests, Ed25519 / HMAC authentication, safetensors payloads."""

from __future__ import annotations

import base64
import dataclasses
import hashlib

import numpy as np
import pytest
from safetensors.numpy import load

from echo2.weights.manifest import (
    Ed25519Key,
    HmacKey,
    Manifest,
    ManifestError,
    blob_ok,
    build_manifest,
    chunk_ok,
    key_from_text,
    new_signing_key,
    serialize_state_dict,
    synthetic_snapshot,
    verify_manifest,
)

SECRET = b"k" * 32


def test_chunks_cover_blob_exactly() -> None:
    data = bytes(range(256)) * 40  # 10240 bytes
    m = build_manifest(data, version=3, chunk_size=4096, key=SECRET)
    # 10240 = 4096 + 4096 + 2048 -> three chunks, the last one short
    assert m.n_chunks == 3
    assert [m.chunk_len(i) for i in range(3)] == [4096, 4096, 2048]
    assert b"".join(data[slice(*m.chunk_range(i))] for i in range(3)) == data
    assert all(chunk_ok(m, i, data[slice(*m.chunk_range(i))]) for i in range(3))
    assert blob_ok(m, data)
    verify_manifest(m, SECRET)


def test_empty_blob_has_one_empty_chunk() -> None:
    m = build_manifest(b"", 0, 1024, SECRET)
    assert m.n_chunks == 1 and m.chunk_len(0) == 0 and chunk_ok(m, 0, b"")


@pytest.mark.parametrize(
    "change",
    [
        {"version": 4},
        {"total_size": 10239},
        {"digest": "0" * 64},
        {"chunk_digests": ("0" * 64, "1" * 64, "2" * 64)},
        {"mac": "f" * 64},
    ],
)
def test_any_tampering_fails_authentication(change: dict) -> None:
    data = b"x" * 10240
    m = build_manifest(data, 3, 4096, SECRET)
    with pytest.raises(ManifestError):
        verify_manifest(dataclasses.replace(m, **change), SECRET)


def test_wrong_secret_fails() -> None:
    m = build_manifest(b"abc" * 1000, 1, 512, SECRET)
    with pytest.raises(ManifestError, match="fails hmac-sha256"):
        verify_manifest(m, b"another secret of enough length")


def test_ed25519_learner_signs_workers_verify_with_the_public_key_only() -> None:
    key = new_signing_key()
    public = key.verifier()
    assert public.private is None and public.public == key.public
    m = build_manifest(b"w" * 3000, 4, 1024, key)
    assert m.auth == "ed25519" and len(m.mac) == 128  # 64-byte signature, hex
    verify_manifest(m, public)
    verify_manifest(Manifest.from_dict(m.to_dict()), public)
    with pytest.raises(ManifestError, match="fails ed25519"):
        verify_manifest(dataclasses.replace(m, version=5), public)
    with pytest.raises(ManifestError, match="fails ed25519"):
        verify_manifest(m, new_signing_key().verifier())  # another run's learner
    with pytest.raises(ManifestError, match="cannot sign"):
        build_manifest(b"w", 4, 1024, public)


def test_scheme_is_authenticated_and_must_match_the_key() -> None:
    hm = build_manifest(b"z" * 100, 1, 64, SECRET)
    assert hm.auth == "hmac-sha256"
    with pytest.raises(ManifestError, match="expects 'ed25519'"):
        verify_manifest(hm, new_signing_key().verifier())
    # the scheme is inside the authenticated payload: relabelling it breaks the signature
    relabelled = dataclasses.replace(build_manifest(b"z" * 100, 1, 64, new_signing_key()), auth="hmac-sha256")
    with pytest.raises(ManifestError, match="fails hmac"):
        verify_manifest(relabelled, SECRET)


def test_key_text_round_trip_and_errors() -> None:
    key = new_signing_key()
    for k in (key, key.verifier(), HmacKey(SECRET)):
        assert key_from_text(k.to_text()) == k
    assert isinstance(key_from_text(key.to_text()), Ed25519Key)
    with pytest.raises(ManifestError, match="unknown key kind"):
        key_from_text("rsa:00")
    with pytest.raises(ManifestError, match="malformed"):
        key_from_text("ed25519-pub:zz")
    with pytest.raises(ManifestError, match="at least 16 bytes"):
        HmacKey(b"short")


def test_wrong_truncated_oversized_chunks_rejected() -> None:
    data = np.random.default_rng(0).bytes(4096)
    m = build_manifest(data, 1, 1024, SECRET)
    good = data[:1024]
    assert chunk_ok(m, 0, good)
    assert not chunk_ok(m, 1, good)  # wrong index
    assert not chunk_ok(m, 0, good[:-1])  # truncated
    assert not chunk_ok(m, 0, good + b"\0")  # oversized
    flipped = bytearray(good)
    flipped[10] ^= 1
    assert not chunk_ok(m, 0, bytes(flipped))  # corrupted
    assert not chunk_ok(m, 99, good)  # out of range


def test_round_trip_through_dict_and_bad_fields() -> None:
    m = build_manifest(b"y" * 5000, 2, 1000, SECRET)
    again = Manifest.from_dict(m.to_dict())
    assert again == m
    verify_manifest(again, SECRET)
    bad = m.to_dict() | {"version": "2"}
    with pytest.raises(ManifestError, match="version"):
        Manifest.from_dict(bad)
    with pytest.raises(ManifestError, match="chunk digests"):  # one digest where five are due
        Manifest.from_dict(m.to_dict() | {"chunk_digests": base64.b64encode(bytes(16)).decode()})
    for garbage, match in ((["0" * 32] * 5, "base64"), ("not base64!", "base64"), ("AAAA", "16-byte")):
        with pytest.raises(ManifestError, match=match):
            Manifest.from_dict(m.to_dict() | {"chunk_digests": garbage})
    assert len(m.to_dict()["chunk_digests"]) == 4 * -(-16 * 5 // 3)  # base64 of the raw digests
    assert m.chunk_digests[0] == hashlib.sha256(b"y" * 1000).hexdigest()[:32]  # SHA-256, first 16 bytes
    with pytest.raises(ManifestError, match="chunk_size"):
        Manifest.from_dict(m.to_dict() | {"chunk_size": 0})
    with pytest.raises(ManifestError, match="missing"):
        Manifest.from_dict({"version": 1})


def test_snapshots_are_loadable_safetensors() -> None:
    blob = synthetic_snapshot(100_000, seed=1)
    tensors = load(blob)
    assert sum(t.nbytes for t in tensors.values()) >= 99_000
    assert synthetic_snapshot(100_000, seed=1) == blob  # deterministic for the harness's digest check
    sd = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    assert np.array_equal(load(serialize_state_dict(sd))["w"], sd["w"])
