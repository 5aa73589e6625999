"""The learner's undos of older published versions (echo2.weights.undo): bit-exact, sharing what did
not change, refusing weights of another shape."""

from __future__ import annotations

import pytest
import torch

from echo2.weights.delta import DeltaError, weights_digest
from echo2.weights.undo import Undo, rebuild


def _versions() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    w = {
        "a": (torch.randn(64, 32, generator=g) * 0.02).bfloat16(),
        "b": torch.randn(17, generator=g).bfloat16(),
        "c": torch.randn(5, generator=g),  # float32, never changed
        "d": torch.randn(4096, generator=g).bfloat16(),  # two elements change, once
    }
    w["b"][0], w["b"][1], w["b"][2] = -0.0, float("nan"), float("inf")
    out = [w]
    for step in range(3):
        nxt = dict(out[-1])
        a = nxt["a"].clone()
        a.view(-1)[step::7] += 1e-3  # a few percent of the elements cross a rounding boundary
        nxt["a"] = a
        if step == 1:
            b = nxt["b"].clone()
            b[0], b[1] = 0.0, float("-nan")  # -0.0 -> 0.0 and a NaN payload: bits, not values
            nxt["b"] = b
            d = nxt["d"].clone()
            d[5], d[100] = 7.0, -7.0
            nxt["d"] = d
        out.append(nxt)
    return out


def test_undos_rebuild_every_older_version_bit_for_bit_and_share_the_rest():
    vs = _versions()
    undos = [Undo.of(vs[i + 1], vs[i]) for i in range(len(vs) - 1)]  # undos[i]: v(i+1) -> v(i)
    newest = vs[-1]
    for target in range(len(vs) - 1):
        chain = list(reversed(undos[target:]))  # newest first
        old = rebuild(newest, chain)
        assert weights_digest(old) == weights_digest(vs[target])
        assert old["c"] is newest["c"]  # untouched: shared, not copied
    assert weights_digest(newest) == weights_digest(vs[-1])  # never modified
    assert "c" not in undos[0].changes and "b" not in undos[0].changes and "b" in undos[1].changes
    a = undos[0].changes["a"]  # every 7th element nudged, about half cross a rounding boundary
    changed = a.values.numel()
    assert 0 < changed < vs[0]["a"].numel() and a.kind == "mask"  # >= 1/32 changed: a mask is smaller
    assert undos[0].nbytes == a.nbytes == 64 * 32 // 8 + 2 * changed
    d = undos[1].changes["d"]  # 2 of 4096: positions are smaller than a mask
    assert d.kind == "sparse" and d.where is not None and d.where.dtype == torch.int32
    assert d.where.tolist() == [5, 100] and d.nbytes == 2 * (4 + 2)


def test_a_dense_change_is_kept_whole_and_never_written_through():
    """A tensor most of whose elements changed is kept whole (an undo never exceeds a copy); an older
    undo applied after it copies it rather than writing into the kept tensor."""
    vs = _versions()
    v3 = {**vs[-1], "a": vs[-1]["a"] + 1}  # every element of a moves
    dense = Undo.of(v3, vs[-1])
    assert dense.changes["a"].kind == "whole" and dense.nbytes == vs[-1]["a"].nbytes
    kept = dense.changes["a"].values.clone()
    older = rebuild(v3, [dense, Undo.of(vs[-1], vs[-2])])
    assert weights_digest(older) == weights_digest(vs[-2])
    assert torch.equal(dense.changes["a"].values.view(torch.int16), kept.view(torch.int16))
    assert weights_digest(dense.apply(v3)) == weights_digest(vs[-1])


def test_undo_refuses_weights_of_another_shape_or_set():
    vs = _versions()
    with pytest.raises(DeltaError, match="same tensor names"):
        Undo.of({"a": vs[0]["a"]}, vs[0])
    with pytest.raises(DeltaError, match="tensor a"):
        Undo.of({**vs[0], "a": vs[0]["a"].float()}, vs[0])
