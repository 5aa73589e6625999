"""Delta publications end to end without a network: the learner's Snapshots decides anchor or patch,
signs the lineage, keeps the chain; a worker's WeightChain stages links on a copy and refuses what does
not fit; the HTTP chain codec carries them."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from echo2.broadcast.factory import get_strategy, open_publisher
from echo2.config import EmbeddedModelConfig, SnapshotConfig
from echo2.models.embedded import build_model, build_tokenizer
from echo2.runtime.snapshots import Snapshots
from echo2.weights.chain import ChainError, WeightChain, decode_chain, encode_chain, with_frozen
from echo2.weights.delta import DeltaError, decode_full, sampler_copy, weights_digest
from echo2.weights.manifest import (
    Lineage,
    Manifest,
    ManifestError,
    build_manifest,
    new_signing_key,
    verify_manifest,
)

TINY = EmbeddedModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1)


def tiny_model() -> Any:
    return build_model(TINY, build_tokenizer(), seed=0)


def nudge(model: Any, lr: float, seed: int) -> None:
    """An optimizer-like step: every weight moves by about ``lr`` (most bf16 values do not change at a
    small ``lr``, all of them at a large one)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * lr)


KINDS: list[str] = []  # the kind of each publication of the newest publish_series


def publish_series(
    cfg: SnapshotConfig, lrs: list[float], spill_dir: Path | None = None
) -> tuple[Snapshots, list[str], Any]:
    """Publish version 0, then one version per entry of ``lrs`` after a nudge of that size; returns the
    Snapshots, the learner's weights digest of each version, and the key (kinds in ``KINDS``)."""
    key = new_signing_key()
    publisher = open_publisher("memory", key, get_strategy("star-limited"), 4096)
    snaps = Snapshots(publisher, 1.1, cfg, spill_dir=spill_dir)
    model = tiny_model()
    digests: list[str] = []
    KINDS.clear()

    async def go() -> None:
        for v in range(len(lrs) + 1):
            if v:
                nudge(model, lrs[v - 1], v)
            await snaps.publish_model(v, model)
            digests.append(weights_digest(sampler_copy(model, cfg.dtype)))
            KINDS.append(snaps.chain[-1].manifest["lineage"]["kind"])

    asyncio.run(go())
    return snaps, digests, key


def links_of(snaps: Snapshots, have: int) -> list[tuple[Manifest, memoryview]]:
    """What a worker holding ``have`` gets over HTTP, through the chain codec, verified as it would."""
    body = encode_chain([(link.manifest, link.blob) for link in snaps.chain_from(have)])
    return [(Manifest.from_dict(m), data) for m, data in decode_chain(body)]


def test_small_steps_ship_patches_big_ones_and_every_kth_ship_anchors() -> None:
    cfg = SnapshotConfig(anchor_every=4)
    lrs = [1e-5, 1e-5, 1.0, 1e-5, 1e-5, 1e-5, 1e-5]  # version 3 changes every value
    snaps, _, _ = publish_series(cfg, lrs)
    # v0 anchor; v1, v2 patches; v3 anchor (its patch would be too big); v4-v6 patches; v7 anchor (K = 4)
    assert KINDS == ["full", "patch", "patch", "full", "patch", "patch", "patch", "full"]
    assert [link.version for link in snaps.chain] == [7]
    assert snaps.publication["broadcast/anchor"] == 1.0


def test_the_chain_and_its_patch_sizes() -> None:
    cfg = SnapshotConfig(anchor_every=10)
    snaps, digests, _ = publish_series(cfg, [1e-5] * 5)
    assert [link.version for link in snaps.chain] == [0, 1, 2, 3, 4, 5]
    assert [link.manifest["lineage"]["kind"] for link in snaps.chain] == ["full"] + ["patch"] * 5
    full = len(snaps.chain[0].blob)
    assert all(len(link.blob) < 0.5 * full for link in snaps.chain[1:])
    assert snaps.publication["broadcast/patch_ratio"] < 0.5
    pub = snaps.publication  # the learner's part, in wall time and in CPU seconds of its threads
    assert 0 < pub["broadcast/encode_s"] <= pub["broadcast/publish_s"]
    assert 0 < pub["broadcast/publish_cpu_s"] <= pub["broadcast/publish_s"] + 0.05
    assert [link.version for link in snaps.chain_from(3)] == [4, 5]
    assert snaps.chain_from(5) == []
    assert [link.version for link in snaps.chain_from(-1)] == [0, 1, 2, 3, 4, 5]  # late joiner
    # the anchor decodes to the published copy, and the lineage names each base's digest
    assert weights_digest(decode_full(snaps.chain[0].blob)) == digests[0]
    for v in range(1, 6):
        lin = snaps.chain[v].manifest["lineage"]
        assert (lin["base_version"], lin["base_digest"], lin["weights_digest"]) == (
            v - 1,
            digests[v - 1],
            digests[v],
        )


def test_deltas_off_or_fp32_keep_full_snapshots() -> None:
    snaps, digests, _ = publish_series(SnapshotConfig(deltas=False, dtype="float32"), [1e-5, 1e-5])
    assert [link.version for link in snaps.chain] == [2]
    weights = decode_full(snaps.chain[0].blob)
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert weights_digest(weights) == digests[2]


def test_a_worker_reaches_every_version_bit_for_bit_from_anywhere() -> None:
    snaps, digests, _ = publish_series(SnapshotConfig(anchor_every=10), [1e-5] * 5)
    for have in (-1, 0, 2, 4):  # late joiner, and workers that missed links
        chain = WeightChain()
        if have >= 0:  # a worker at ``have`` got there through the same chain
            staged = chain.stage(links_of(snaps, -1)[: have + 1])
            assert staged is not None and staged.version == have
            chain.commit(staged)
        staged = chain.stage(links_of(snaps, have))
        assert staged is not None and (staged.version, staged.digest) == (5, digests[5])
        assert weights_digest(staged.tensors) == digests[5]


def test_published_bytes_live_in_files_and_leave_with_their_chain(tmp_path: Path) -> None:
    """``[snapshot] on_disk``: every link's bytes are a read-only map of a file in the run directory
    (not the learner's memory), workers reach every version bit for bit from them, a new anchor removes
    the files of the chain it ends, and a restarted learner removes an earlier process's files."""
    spill = tmp_path / "published"
    spill.mkdir()
    (spill / "v0000000099.bin").write_bytes(b"an earlier process's")
    cfg = SnapshotConfig(anchor_every=3)
    snaps, digests, _ = publish_series(cfg, [1e-5] * 4, spill_dir=spill)
    # v0 anchor, v1 v2 patches, v3 anchor, v4 patch: the files of v0-v2 went with their chain
    assert [link.version for link in snaps.chain] == [3, 4]
    assert sorted(p.name for p in spill.iterdir()) == ["v0000000003.bin", "v0000000004.bin"]
    for link in snaps.chain:
        assert isinstance(link.blob, memoryview) and link.blob.readonly
        assert bytes(link.blob) == (spill / f"v{link.version:010d}.bin").read_bytes()
    staged = WeightChain().stage(links_of(snaps, -1))
    assert staged is not None and (staged.version, staged.digest) == (4, digests[4])
    off, _, _ = publish_series(
        SnapshotConfig(anchor_every=3, on_disk=False), [1e-5], spill_dir=tmp_path / "x"
    )
    assert isinstance(off.chain[0].blob, bytes) and not (tmp_path / "x").exists()


def test_a_gap_stops_the_walk_and_nothing_is_swapped() -> None:
    snaps, digests, _ = publish_series(SnapshotConfig(anchor_every=10), [1e-5] * 4)
    links = links_of(snaps, -1)
    chain = WeightChain()
    chain.commit(chain.stage(links[:2]))  # holds v1
    assert chain.stage(links[3:]) is None  # v3, v4 patch v2 and v3: v2 is missing
    staged = chain.stage([links[4], links[2], links[3]])  # out of order is fine
    assert staged is not None and staged.digest == digests[4]
    assert chain.version == 1  # staging never changes what is served


def test_a_link_that_does_not_fit_is_refused_and_the_old_version_keeps_serving() -> None:
    snaps, _, key = publish_series(SnapshotConfig(anchor_every=10), [1e-5] * 2)
    links = links_of(snaps, -1)
    chain = WeightChain()
    chain.commit(chain.stage(links[:2]))
    served = chain.current
    m2, data2 = links[2]
    # a patch signed for another base digest (a learner bug or a spliced chain)
    lying = Lineage("patch", 1, "0" * 64, m2.lineage.weights_digest)
    forged = build_manifest(data2, 2, m2.chunk_size, key, lying)
    with pytest.raises(DeltaError, match="digest"):
        chain.stage([(forged, data2)])
    # a patch whose result is not what the learner said it published
    wrong_result = Lineage("patch", 1, m2.lineage.base_digest, "f" * 64)
    with pytest.raises(DeltaError, match="not installing"):
        chain.stage([(build_manifest(data2, 2, m2.chunk_size, key, wrong_result), data2)])
    # garbage bytes under a well-formed lineage
    with pytest.raises(DeltaError):
        chain.stage([(build_manifest(b"junk" * 10, 2, m2.chunk_size, key, m2.lineage), b"junk" * 10)])
    assert chain.current is served


def test_the_lineage_is_signed_and_checked() -> None:
    key = new_signing_key()
    lin = Lineage("patch", 3, "a" * 64, "b" * 64)
    m = build_manifest(b"patch bytes", 4, 1024, key, lin)
    verify_manifest(m, key.verifier())
    assert Manifest.from_dict(m.to_dict()) == m
    for bad in (
        Lineage("patch", 2, "a" * 64, "b" * 64),  # another base
        Lineage("full", -1, "", "b" * 64),  # claims to be an anchor
        Lineage("patch", 3, "a" * 64, "c" * 64),  # another result
    ):
        with pytest.raises(ManifestError, match="authentication"):
            verify_manifest(dataclasses.replace(m, lineage=bad), key.verifier())
    for bad_dict, match in (
        ({"kind": "diff"}, "kind"),
        (
            {"kind": "patch", "base_version": 4, "base_digest": "a" * 64, "weights_digest": "b" * 64},
            "base_version",
        ),
        ({"kind": "patch", "base_version": 1}, "base_digest"),
        ({"kind": "full", "base_version": 2}, "names no base"),
        (
            {"kind": "base", "base_version": 2, "weights_digest": "b" * 64, "model_base": "c" * 64},
            "names no base",
        ),
        ({"kind": "base", "weights_digest": "b" * 64}, "must state model_base"),
        ({"kind": "full", "weights_digest": "XYZ"}, "hex"),
        ({"kind": "full", "extra": 1}, "unknown"),
        ("full", "object"),
    ):
        with pytest.raises(ManifestError, match=match):
            Manifest.from_dict({**m.to_dict(), "lineage": bad_dict})


def test_the_chain_codec_refuses_malformed_bodies() -> None:
    body = encode_chain([({"v": 1}, b"abc"), ({"v": 2}, b"")])
    assert [(m, bytes(d)) for m, d in decode_chain(body)] == [({"v": 1}, b"abc"), ({"v": 2}, b"")]
    assert decode_chain(encode_chain([])) == []
    header_end = len(body) - 3
    for bad, match in (
        (b"NOTCHAIN" + body[8:], "magic"),
        (body[:8] + (10**9).to_bytes(8, "big") + body[16:], "overruns"),
        (body[:header_end] + b"ab", "overruns"),
        (body + b"x", "trailing"),
        (body[:16] + b"[" + body[17:], "header"),
    ):
        with pytest.raises(ChainError, match=match):
            decode_chain(bad)


def test_a_newer_run_epoch_starts_from_its_anchor_and_an_older_one_is_ignored():
    """Versions are ordered within their run epoch: after a learner restart (epoch 2) the same number
    names other weights, so a worker holding epoch 1's v2 installs epoch 2's anchor even at a lower
    number, never patches epoch 1's weights with epoch 2's patch, and never goes back to epoch 1."""
    import torch

    from echo2.weights.chain import WeightChain
    from echo2.weights.manifest import build_manifest
    from echo2.weights.publication import Link, PublishedChain

    key = b"k" * 32
    w1 = {"a": torch.linspace(-1, 1, 4096).to(torch.bfloat16)}
    w2 = {"a": w1["a"].clone()}
    w2["a"][:3] += 1  # a publication that changes 3 elements: a patch

    def links(epoch: int, *weights: dict) -> list:
        chain, out = PublishedChain(epoch=epoch), []
        for v, w in enumerate(weights):
            enc = chain.encode(w)
            assert enc.lineage.epoch == epoch
            manifest = build_manifest(enc.blob, v, 1 << 16, key, enc.lineage)
            out.append((manifest, enc.blob))
            chain.record(Link(v, manifest.to_dict(), enc.blob))
            chain.base = w
        return out

    old = links(1, w1, w2, w1)  # epoch 1: v0, v1, v2
    new = links(2, w2, w1)  # epoch 2 after a restart: v0 (anchor), v1 (patch)
    assert new[1][0].kind == "patch" and new[1][0].lineage.base_version == 0
    held = WeightChain()
    held.commit(held.stage(old))
    assert (held.epoch, held.version) == (1, 2)
    assert held.stage([new[1]]) is None  # epoch 2's patch has no base here: a gap, not a wrong install
    staged = held.stage(new)
    assert staged is not None and (staged.epoch, staged.version) == (2, 1)
    assert torch.equal(staged.tensors["a"], w1["a"])
    held.commit(staged)
    assert held.stage(old) is None  # epoch 1's versions, however numbered, are behind


def test_the_run_epoch_is_signed_and_bounded():
    import dataclasses

    from echo2.weights.manifest import Lineage, Manifest, ManifestError, build_manifest, verify_manifest

    key = b"k" * 32
    m = build_manifest(b"x" * 100, 4, 64, key, Lineage("full", epoch=5))
    verify_manifest(Manifest.from_dict(m.to_dict()), key)
    assert Manifest.from_dict(m.to_dict()).lineage.epoch == 5
    moved = dataclasses.replace(m, lineage=dataclasses.replace(m.lineage, epoch=6))
    with pytest.raises(ManifestError):
        verify_manifest(moved, key)  # a relay cannot move a version into another epoch
    bad = m.to_dict()
    bad["lineage"]["epoch"] = -1
    with pytest.raises(ManifestError, match="epoch"):
        Manifest.from_dict(bad)


def test_the_check_is_told_a_version_before_it_is_announced() -> None:
    """A worker may claim a version as soon as it is announced: by then the generation check holds it
    (else an honest drawn claim would be refused unchecked_version)."""
    key = new_signing_key()
    publisher = open_publisher("memory", key, get_strategy("star-limited"), 4096)
    seen: list[tuple[int, set[int]]] = []  # (version told, versions announced then)
    snaps = Snapshots(
        publisher, 1.1, SnapshotConfig(), on_published=lambda v, w: seen.append((v, set(snaps.published)))
    )
    model = tiny_model()

    async def go() -> None:
        for v in range(3):
            nudge(model, 1e-5, v)
            await snaps.publish_model(v, model)

    asyncio.run(go())
    assert [v for v, _ in seen] == [0, 1, 2] and all(v not in announced for v, announced in seen)
    assert snaps.published == {0, 1, 2}


def test_a_lora_runs_base_is_the_first_link_and_stays_after_every_anchor(tmp_path: Path) -> None:
    """With a frozen base (a LoRA run), the first publication is a ``base`` link (the adapter and the
    base, signed with the base's digest); it stays the chain's first link, and its file, after later
    anchors end the chain it led; a worker holding nothing stages it first and gets the base handed on,
    one holding the base gets the same version's adapter alone (its twin) while it leads the chain. A
    base link whose base is not the one it pins is refused."""
    g = torch.Generator().manual_seed(0)
    frozen = {"m.w.weight": torch.randn(32, 32, generator=g).to(torch.bfloat16)}
    adapter = {"m.w.lora_A.default.weight": torch.zeros(4, 32, dtype=torch.bfloat16)}
    key = new_signing_key()
    spill = tmp_path / "published"
    publisher = open_publisher("memory", key, get_strategy("star-limited"), 4096)
    snaps = Snapshots(
        publisher, 1.1, SnapshotConfig(anchor_every=3), spill_dir=spill, model_base=weights_digest(frozen),
        frozen=frozen,
    )  # fmt: skip
    seen: dict[int, list[int]] = {}

    async def go() -> None:
        for v in range(5):
            nudged = {n: t + (1.0 if v == 3 else 0.01 * v) for n, t in adapter.items()}
            await snaps.publish_copy(v, lambda dtype, w=nudged: w)
            if v == 2:
                seen[2] = [link.version for link in snaps.chain_from(-1, True)]
                twin = snaps.chain_from(-1, True)[0]
                assert twin.manifest["lineage"]["kind"] == "full" and len(twin.blob) < len(
                    snaps.chain[0].blob
                )

    asyncio.run(go())
    kinds = [link.manifest["lineage"]["kind"] for link in snaps.chain_from(-1)]
    assert kinds == ["base", "full", "patch"]  # v0 base link, then the v3 anchor and its patch
    assert seen[2] == [0, 1, 2]
    assert [link.version for link in snaps.chain_from(-1, True)] == [3, 4]  # no base: none needed
    assert sorted(p.name for p in spill.iterdir()) == [
        "v0000000000.bin",
        "v0000000003.bin",
        "v0000000004.bin",
    ]
    links = [(Manifest.from_dict(k.manifest), k.blob) for k in snaps.chain_from(-1)]
    staged = WeightChain().stage(links)
    assert staged is not None and staged.version == 4 and staged.frozen is not None
    assert weights_digest(staged.frozen) == weights_digest(frozen) and set(staged.tensors) == set(adapter)
    assert staged.digest == snaps.chain[-1].manifest["lineage"]["weights_digest"]
    lie = Lineage("base", weights_digest=weights_digest(adapter), model_base="c" * 64)
    blob = bytes(snaps.chain_from(-1)[0].blob)
    assert decode_full(blob).keys() == with_frozen(frozen, adapter).keys()
    with pytest.raises(DeltaError, match="the base it carries"):
        WeightChain().stage([(build_manifest(blob, 0, 4096, key, lie), blob)])
