"""Sparse weight patches (echo2.weights.delta): bit-exact round trips, and every malformed patch refused
with DeltaError. Malformed patches are crafted byte by byte from the format the module docstring
specifies, so the crafting helper is itself checked against a valid patch first."""

from __future__ import annotations

import json
import random
import struct

import numpy as np
import pytest
import torch
import zstandard

from echo2.errors import Echo2Error
from echo2.weights import delta, rice
from echo2.weights.delta import (
    DeltaError,
    apply_patch,
    decode_full,
    encode_full,
    encode_patch,
    patch_info,
    sampler_copy,
    weights_digest,
)

FLOATS = [torch.bfloat16, torch.float16, torch.float32]
INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as integers (for bit-exact comparisons that see NaN payloads)."""
    return t.contiguous().view(INT_VIEW[t.element_size()])


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(bits(a[k]), bits(b[k]))
        for k in a
    )


def specials(dtype: torch.dtype) -> torch.Tensor:
    """NaNs with different payloads and signs, +-0, +-inf, a subnormal, extremes, as raw bits."""
    if dtype == torch.float32:
        raw = [0x7FC00000, 0x7FC00001, 0x7F800001, 0xFFC00000, 0x00000000, 0x80000000, 0x7F800000]
        raw += [0xFF800000, 0x00000001, 0x7F7FFFFF, 0xFF7FFFFF]
        return torch.tensor(np.array(raw, dtype=np.uint32).view(np.int32)).view(dtype)
    if dtype == torch.bfloat16:
        raw = [0x7FC0, 0x7FC1, 0x7F81, 0xFFC0, 0x0000, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x7F7F, 0xFF7F]
    else:  # float16
        raw = [0x7E00, 0x7E01, 0x7C01, 0xFE00, 0x0000, 0x8000, 0x7C00, 0xFC00, 0x0001, 0x7BFF, 0xFBFF]
    return torch.tensor(np.array(raw, dtype=np.uint16).view(np.int16)).view(dtype)


def weights(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """A small model-like dict: N(0, 0.02) matrices (so the exponent cut is in use), a norm vector of
    ones, an int64 buffer, a 0-d scalar and an empty tensor."""
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": (torch.randn(64, 48, generator=g) * 0.02).to(dtype),
        "b.weight": (torch.randn(3000, generator=g) * 0.02).to(dtype),
        "norm.weight": torch.ones(48, dtype=dtype),
        "steps": torch.arange(10, dtype=torch.int64),
        "scale": torch.tensor(0.5, dtype=dtype),
        "empty": torch.zeros(0, 4, dtype=dtype),
    }


def step(w: dict[str, torch.Tensor], lr: float, seed: int = 1) -> dict[str, torch.Tensor]:
    """An "optimizer step": each float moved by ~lr in fp32, then cast back (most do not change)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in w.items():
        if t.is_floating_point() and t.numel():
            moved = t.float() + lr * torch.randn(t.shape, generator=g)
            out[k] = moved.to(t.dtype)
        else:
            out[k] = t.clone()
    return out


def round_trip(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> bytes:
    patch = encode_patch(base, new)
    got = apply_patch(base, patch)
    assert bits_equal(got, new)
    assert weights_digest(got) == weights_digest(new)
    return patch


# ---------------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_round_trip_small_steps_specials_and_sign_flips(dtype):
    base = weights(dtype)
    base["special"] = specials(dtype)
    new = step(base, 1e-3)
    sp = specials(dtype)
    new["special"] = torch.cat([sp[1:], sp[:1]])  # every special becomes another: NaN payloads, +-0, inf
    new["b.weight"][:100] = -base["b.weight"][:100]  # sign flips (large jumps in key space)
    new["b.weight"][100] = float("nan")
    new["steps"][3] = -(2**63)  # integer buffer wraps to its extreme
    assert not bits_equal(base, new)
    assert delta._cut(delta._bits(base["a.weight"]), str(dtype)[6:]) > 0  # hot classes are in use
    patch = round_trip(base, new)
    info = patch_info(patch)
    changed = sum(int((bits(base[k]) != bits(new[k])).sum()) for k in base)
    assert info == {
        "tensors": len(base),
        "changed": changed,
        "elements": sum(t.numel() for t in base.values()),
        "bytes": len(patch),
    }


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_round_trip_all_changed_and_none_changed(dtype):
    base = weights(dtype)
    g = torch.Generator().manual_seed(7)
    other = {}
    for k, t in base.items():  # every element gets random other bits (NaNs and infs included)
        b = bits(t)
        x = torch.randint(1, 2**15, b.shape, generator=g, dtype=torch.int64).to(b.dtype)
        other[k] = (b ^ x).view(t.dtype)
    patch = round_trip(base, other)
    assert patch_info(patch)["changed"] == sum(t.numel() for t in base.values())
    same = {k: t.clone() for k, t in base.items()}
    patch = round_trip(base, same)
    assert patch_info(patch)["changed"] == 0
    got = apply_patch(base, patch)
    assert all(got[k] is base[k] for k in base)  # nothing changed: shared, not copied


def test_round_trip_integer_and_bool_buffers():
    g = torch.Generator().manual_seed(3)
    base = {
        "i8": torch.randint(-128, 128, (500,), dtype=torch.int8, generator=g),
        "u8": torch.randint(0, 256, (500,), dtype=torch.uint8, generator=g),
        "i16": torch.randint(-(2**15), 2**15, (500,), dtype=torch.int16, generator=g),
        "i32": torch.randint(-(2**31), 2**31, (500,), dtype=torch.int32, generator=g),
        "i64": torch.randint(-(2**62), 2**62, (500,), dtype=torch.int64, generator=g),
        "mask": torch.rand(500, generator=g) < 0.5,
        "f64": torch.randn(500, generator=g, dtype=torch.float64),
    }
    new = {k: t.clone() for k, t in base.items()}
    for k in ("i8", "u8", "i16", "i32", "i64"):
        info = torch.iinfo(base[k].dtype)
        new[k][::7] = info.max
        new[k][1::7] = info.min
        new[k][2::11] += 1
    new["mask"][::3] = ~new["mask"][::3]
    new["f64"][::5] *= 1 + 1e-12
    round_trip(base, new)


def test_patch_is_small_at_rl_learning_rates():
    """A ~1% sparse bf16 change costs a small fraction of the full snapshot (regression guard: a
    format that stored dense arrays, or positions without compression, fails this)."""
    g = torch.Generator().manual_seed(0)
    master = torch.randn(1_000_000, generator=g) * 0.02
    base = {"w": master.bfloat16()}
    new = {"w": (master + 1e-6 * torch.randn(master.shape, generator=g).sign()).bfloat16()}
    patch = round_trip(base, new)
    info = patch_info(patch)
    assert 0.005 < info["changed"] / info["elements"] < 0.05
    full = len(encode_full(base))
    assert len(patch) / full < 0.8 * info["changed"] / info["elements"]  # < 0.8 bytes per changed bf16


def position_costs(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> tuple[float, float, bool]:
    """Bits of the Rice streams that code the changed positions; the sum over the classes of
    n * H(k / n), what coding them costs at best given the classes; and whether some class has more
    than half of it changed. The classes as the decoder derives them."""
    from echo2.weights import rice

    coded = entropy = 0.0
    flipped = False
    for dtype, names in delta._blocks(
        [k for k in sorted(base) if not torch.equal(bits(base[k]), bits(new[k]))], base
    ):
        old = np.concatenate([delta._bits(base[k]) for k in names])
        classes = delta._Classes.of(old, dtype)
        counts, gaps, params, _ = classes.code(old != np.concatenate([delta._bits(new[k]) for k in names]))
        rem, unary = rice.encode(gaps, params)
        coded += 8 * (len(rem) + len(unary))
        flipped |= bool(np.any(2 * counts > classes.sizes))
        mixed = (counts > 0) & (counts < classes.sizes)
        n, p = classes.sizes[mixed], counts[mixed] / classes.sizes[mixed]
        entropy += float(np.sum(n * -(p * np.log2(p) + (1 - p) * np.log2(1 - p))))
    return coded, entropy, flipped


def test_sparse_and_dense_classes_round_trip_close_to_the_entropy():
    """Sparse changes (few per class: their ranks are coded) and dense ones (more than half of a class:
    the unchanged elements' ranks are coded), floats with hot classes and integers; every mix round
    trips bit for bit, and the Rice-coded positions cost within 0.1 bit per change of the entropy of
    the changed positions given the classes."""
    g = torch.Generator().manual_seed(4)
    master = torch.randn(200_000, generator=g) * 0.02
    ints = torch.randint(-1000, 1000, (20_000,), generator=g, dtype=torch.int32)
    base = {"sparse": master.bfloat16(), "dense": master.bfloat16(), "ints_s": ints, "ints_d": ints.clone()}
    new = {k: t.clone() for k, t in base.items()}
    new["sparse"] = (master + 3e-6 * torch.randn(master.shape, generator=g)).bfloat16()
    new["dense"] = (master + 3e-4 * torch.randn(master.shape, generator=g)).bfloat16()
    new["ints_s"][::50] += 1
    new["ints_d"][torch.rand(20_000, generator=g) < 2 / 3] -= 3  # about two thirds, at random
    round_trip(base, new)
    for name in ("sparse", "dense", "ints_s", "ints_d"):
        one_base, one_new = {"w": base[name]}, {"w": new[name]}
        k = patch_info(round_trip(one_base, one_new))["changed"]
        density = k / base[name].numel()
        assert density < 0.1 if name.startswith(("sparse", "ints_s")) else density > 0.3
        coded, entropy, flipped = position_costs(one_base, one_new)
        assert flipped or name not in ("dense", "ints_d"), name  # dense classes code the unchanged
        assert coded < entropy + 0.1 * k + 16, (name, coded / k, entropy / k)


def test_base_is_never_modified():
    base = weights(torch.bfloat16)
    before = {k: t.clone() for k, t in base.items()}
    digest = weights_digest(base)
    new = step(base, 1e-2)
    got = apply_patch(base, encode_patch(base, new))
    assert bits_equal(base, before)
    assert weights_digest(base) == digest
    for k in base:
        if not torch.equal(bits(base[k]), bits(new[k])):
            assert got[k].data_ptr() != base[k].data_ptr()  # changed tensors are new copies
    got["a.weight"].add_(1.0)  # writing the result never reaches the base
    assert bits_equal(base, before)


def test_encode_patch_refuses_mismatched_weights():
    base = weights(torch.bfloat16)
    with pytest.raises(DeltaError, match="missing"):
        encode_patch(base, {k: t for k, t in base.items() if k != "scale"})
    with pytest.raises(DeltaError, match="dtype"):
        encode_patch(base, {**base, "a.weight": base["a.weight"].float()})
    with pytest.raises(DeltaError, match="shape"):
        encode_patch(base, {**base, "a.weight": base["a.weight"].reshape(48, 64)})
    with pytest.raises(DeltaError, match="not supported"):
        encode_patch(
            {"c": torch.zeros(3, dtype=torch.complex64)}, {"c": torch.ones(3, dtype=torch.complex64)}
        )


# ---------------------------------------------------------------------------------------------------
# digest, full weights, sampler copy


def test_weights_digest_is_canonical_and_sensitive():
    w = weights(torch.bfloat16)
    d = weights_digest(w)
    assert weights_digest(dict(reversed(list(w.items())))) == d  # insertion order does not matter
    assert weights_digest({k: t.clone() for k, t in w.items()}) == d
    flipped = {k: t.clone() for k, t in w.items()}
    bits(flipped["a.weight"]).view(-1)[17] ^= 1  # one bit
    assert weights_digest(flipped) != d
    assert weights_digest({**w, "a.weight": w["a.weight"].view(torch.int16)}) != d  # same bytes, dtype
    assert weights_digest({**w, "a.weight": w["a.weight"].reshape(48, 64)}) != d  # same bytes, shape
    renamed = {("z" if k == "scale" else k): t for k, t in w.items()}
    assert weights_digest(renamed) != d
    # no ambiguity between where one tensor's name/bytes end and the next begins
    x = torch.zeros(2, dtype=torch.uint8)
    assert weights_digest({"a": x, "b": x[:0]}) != weights_digest({"a": x[:0], "b": x})
    nan1 = torch.tensor([0x7FC0], dtype=torch.int16).view(torch.bfloat16)
    nan2 = torch.tensor([0x7FC1], dtype=torch.int16).view(torch.bfloat16)
    assert weights_digest({"n": nan1}) != weights_digest({"n": nan2})  # NaN payloads are bits too


def test_full_weights_round_trip_and_garbage():
    w = weights(torch.bfloat16)
    w["special"] = specials(torch.bfloat16)
    assert bits_equal(decode_full(encode_full(w)), w)
    blob = encode_full(w)
    shared = torch.zeros(4)
    with pytest.raises(DeltaError, match="serialize"):
        encode_full({"a": shared, "b": shared})
    for bad in (b"", b"garbage", blob[: len(blob) // 2], b"\xff" * 64):
        with pytest.raises(DeltaError):
            decode_full(bad)


def _tiny_tied_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(config)


def test_sampler_copy_dedups_tied_weights_casts_and_copies():
    from safetensors.torch import load

    from echo2.models.snapshot import snapshot_blob

    model = _tiny_tied_qwen3()
    model.register_buffer("counter", torch.arange(5, dtype=torch.int64))
    state = model.state_dict()
    assert "lm_head.weight" in state  # tied: two names, one storage
    copy = sampler_copy(model, "bfloat16")
    assert "lm_head.weight" not in copy and "model.embed_tokens.weight" in copy
    assert set(copy) == set(state) - {"lm_head.weight"}  # every other tensor, once
    assert set(load(snapshot_blob(model))) == set(copy)  # the full fp32 snapshot ships the same names
    assert copy["counter"].dtype == torch.int64 and torch.equal(copy["counter"], state["counter"])
    for name, t in copy.items():
        assert t.device.type == "cpu" and t.is_contiguous()
        if state[name].is_floating_point():
            assert t.dtype == torch.bfloat16
            assert torch.equal(t, state[name].to(torch.bfloat16))
    # fresh tensors, also when no cast is needed
    fp32 = sampler_copy(model, "float32")
    live = dict(model.named_parameters())
    for name, t in fp32.items():
        if name in live:
            assert t.data_ptr() != live[name].data_ptr()
    before = fp32["model.norm.weight"].clone()
    with torch.no_grad():
        live["model.norm.weight"].add_(1.0)
    assert torch.equal(fp32["model.norm.weight"], before)
    assert sampler_copy(model, "float16")["model.norm.weight"].dtype == torch.float16
    with pytest.raises(DeltaError, match="publish dtype"):
        sampler_copy(model, "int8")
    assert set(delta.PUBLISH_DTYPES) == {"bfloat16", "float16", "float32"}


def test_sampler_copy_of_the_embedded_model_patches_across_an_update():
    from echo2.config import EmbeddedModelConfig
    from echo2.models.embedded import build_model, build_tokenizer

    cfg = EmbeddedModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    model = build_model(cfg, build_tokenizer(), seed=0)
    before = sampler_copy(model)
    assert "lm_head.weight" not in before
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(3, 50, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    after = sampler_copy(model)
    patch = encode_patch(before, after)
    assert 0 < patch_info(patch)["changed"] < patch_info(patch)["elements"]
    assert weights_digest(apply_patch(before, patch)) == weights_digest(after)


# ---------------------------------------------------------------------------------------------------
# malformed patches: crafted from the format spec


def _le_planes(values, width: int) -> bytes:
    a = np.asarray(values, dtype=f"<u{width}")
    return np.ascontiguousarray(a.view(np.uint8).reshape(-1, width).T).tobytes()


def _packed(bit_string: str, pad: str = "0") -> bytes:
    """Bits (a string of 0 and 1) packed most significant first, padded with ``pad`` to whole bytes."""
    bit_string += pad * ((-len(bit_string)) % 8)
    return bytes(int(bit_string[i : i + 8], 2) for i in range(0, len(bit_string), 8))


def rice_streams(gaps, params) -> tuple[bytes, bytes]:
    """The remainder and unary streams of the module docstrings, written out bit by bit (an
    independent spelling of echo2.weights.rice)."""
    pairs = list(zip(gaps, params, strict=True))
    rem = "".join(format(v & ((1 << r) - 1), f"0{r}b") if r else "" for v, r in pairs)
    unary = "".join("1" * (v >> r) + "0" for v, r in pairs)
    return _packed(rem), _packed(unary, pad="1")


def payload(counts, gaps, params, signs, flags, values, width: int, *, pad_sign=False, rem=None, unary=None):
    """Frame content of a patch whose changed tensors share one dtype of ``width`` bytes (sections 1-6
    of the module docstring; uint32 counts). ``rem`` / ``unary`` replace the streams ``gaps`` and
    ``params`` give."""
    good_rem, good_unary = rice_streams(gaps, params)
    n = len(signs)
    sign_bits = "".join(map(str, signs)) + ("1" if pad_sign and n % 8 else "")
    return b"".join(
        [
            _le_planes(counts, 4),
            good_rem if rem is None else rem,
            _packed(sign_bits),
            _packed("".join(map(str, flags))),
            _le_planes(values, width),
            good_unary if unary is None else unary,
        ]
    )


def craft(
    table, content: bytes, *, magic=b"E2WP", version=3, content_size=True, tail=b"", frame=None
) -> bytes:
    head = json.dumps(table).encode()
    if frame is None:
        frame = zstandard.ZstdCompressor(write_content_size=content_size).compress(content)
    return struct.pack("<4sHI", magic, version, len(head)) + head + frame + tail


# an int32 tensor of 16 (one cold class): positions 2 and 5 change by +1 and -3. Two of 16 coded:
# Rice parameter floor(log2(floor(0.9624 * (7 + 0.5)))) = 2; ranks 2, 5 are gaps 2, 2; signs 0, 1;
# |d| - 1 = 0, 2 (flagged on the second)
BASE = {"w": torch.arange(16, dtype=torch.int32)}
TABLE = [["w", "int32", [16], 2]]


def body(counts=(2,), gaps=(2, 2), params=(2, 2), signs=(0, 1), flags=(0, 1), values=(2,), **kw) -> bytes:
    """A variant of GOOD."""
    return payload(counts, gaps, params, signs, flags, values, 4, **kw)


GOOD = body()


def test_crafted_patch_matches_the_spec():
    assert rice.parameters(np.array([16]), np.array([2])).tolist() == [2]
    assert rice_streams([2, 2], [2, 2]) == (b"\xa0", b"\x3f")  # 10 10 0000 | 0 0 111111
    got = apply_patch(BASE, craft(TABLE, GOOD))
    want = BASE["w"].clone()
    want[2] += 1
    want[5] -= 3
    assert torch.equal(got["w"], want)
    # and the encoder writes exactly this: table and frame content
    table, frame = delta._parse(encode_patch(BASE, {"w": want}))
    assert table == TABLE
    assert zstandard.ZstdDecompressor().decompress(bytes(frame)) == GOOD


BAD_PATCHES = {
    "bad magic": (craft(TABLE, GOOD, magic=b"E2XX"), "magic"),
    "unknown version": (craft(TABLE, GOOD, version=4), "version 4"),
    "old version": (craft(TABLE, GOOD, version=2), "version 2"),
    "short header": (b"E2WP\x03", "shorter than"),
    "table past the end": (struct.pack("<4sHI", b"E2WP", 3, 1000) + b"[]", "past the end"),
    "table not json": (struct.pack("<4sHI", b"E2WP", 3, 3) + b"{[x", "not JSON"),
    "table not a list": (craft({"w": 1}, GOOD), "not a list"),
    "bad row": (craft([["w", "int32", [16], 2, 0]], GOOD), "row 0"),
    "bool count": (craft([["w", "int32", [16], True]], GOOD), "row 0"),
    "negative dim": (craft([["w", "int32", [-16], 2]], GOOD), "row 0"),
    "duplicate name": (craft([*TABLE, *TABLE], GOOD), "twice"),
    "unknown tensor": (craft([*TABLE, ["v", "int32", [1], 0]], GOOD), "unknown"),
    "missing tensor": (craft([], b""), "missing"),
    "dtype mismatch": (craft([["w", "int64", [16], 2]], GOOD), "dtype"),
    "shape mismatch": (craft([["w", "int32", [4, 4], 2]], GOOD), "shape"),
    "count too large": (craft([["w", "int32", [16], 17]], GOOD), "17 changed"),
    "not a zstd frame": (craft(TABLE, GOOD, frame=b"\x00" * 30), "not a zstandard frame"),
    "empty frame": (craft(TABLE, GOOD, frame=b""), "not a zstandard frame"),
    "truncated frame": (craft(TABLE, GOOD)[:-3], "truncated"),
    "trailing garbage": (craft(TABLE, GOOD, tail=b"\x00"), "trailing"),
    "second frame": (craft(TABLE, GOOD, tail=zstandard.ZstdCompressor().compress(b"x")), "trailing"),
    "no content size": (craft(TABLE, GOOD, content_size=False), "does not declare its size"),
    "frame too small": (craft(TABLE, GOOD[:5]), "at least"),
    "class counts disagree with the table": (craft(TABLE, body(counts=(3,))), "add up"),
    "table disagrees with the frame": (craft([["w", "int32", [16], 3]], GOOD), "add up"),
    "position out of range": (craft(TABLE, body(gaps=(2, 13))), "out of range"),
    "huge quotient": (craft(TABLE, body(unary=_packed("1" * 40 + "0" + "0", pad="1"))), "out of range"),
    "too few unary codes": (craft(TABLE, body(unary=b"\x7f")), "1 codes, 2 expected"),
    "too many unary codes": (craft(TABLE, body(unary=b"\x1f")), "3 codes, 2 expected"),
    "a unary byte too many": (craft(TABLE, body(unary=b"\x3f\xff")), "after its last code"),
    "no unary stream": (craft(TABLE, body(unary=b"")), "0 codes, 2 expected"),
    "remainder padding set": (craft(TABLE, body(rem=b"\xa1")), "nonzero padding"),
    "sign padding set": (craft(TABLE, body(pad_sign=True)), "padding"),
    "zero magnitude flagged": (craft(TABLE, body(values=(0,))), "magnitude"),
    "magnitude overflow": (craft(TABLE, body(values=(2**31,))), "magnitude"),
    "magnitudes missing": (craft(TABLE, body(flags=(1, 1))), "too short|codes"),
    "bytes after the last section": (craft(TABLE, GOOD + b"\xff"), "after its last code"),
}


@pytest.mark.parametrize("case", list(BAD_PATCHES))
def test_malformed_patch_is_refused(case):
    patch, match = BAD_PATCHES[case]
    with pytest.raises(DeltaError, match=match):
        apply_patch(BASE, patch)


def test_crafted_hot_classes_and_bool_values():
    # bf16 0.0625 (exponent 123) and 1.0 (127) alternating: every 61st element samples both, so the
    # cut is one below their median 125; the 0.0625s (even positions) are hot, in one class, and come
    # first
    h = {"h": torch.tensor([0.0625, 1.0] * 40, dtype=torch.bfloat16)}
    assert delta._cut(delta._bits(h["h"]), "bfloat16") == 124
    table = [["h", "bfloat16", [80], 2]]
    # one change per class: the last hot element (rank 39 of 40, position 78) and the first cold one
    # (rank 0, position 1); parameter floor(log2(floor(0.9624 * 39.5))) = 5 for both
    content = payload([1, 1], [39, 0], [5, 5], [0, 0], [0, 0], [], 2)
    got = apply_patch(h, craft(table, content))["h"]
    assert (bits(got) != bits(h["h"])).nonzero().flatten().tolist() == [1, 78]
    assert got[78].item() > 0.0625 and got[1].item() > 1.0  # +1 ulp each
    with pytest.raises(DeltaError, match="out of range"):  # hot rank 40 of 40 hot elements
        apply_patch(h, craft(table, payload([1, 1], [40, 0], [5, 5], [0, 0], [0, 0], [], 2)))
    with pytest.raises(DeltaError, match="add up"):  # three changes for the table's two
        apply_patch(h, craft(table, payload([2, 1], [0, 0, 0], [4, 4, 5], [0] * 3, [0] * 3, [], 2)))
    one_hot = {"h": torch.tensor([0.0625] + [1.0] * 79, dtype=torch.bfloat16)}  # a hot class of one
    with pytest.raises(DeltaError, match="add up"):  # both changes claimed by it
        apply_patch(one_hot, craft(table, payload([2, 0], [0, 0], [0, 0], [0, 0], [0, 0], [], 2)))
    flags = {"m": torch.tensor([True, False])}
    bad = craft([["m", "bool", [2], 1]], payload([1], [1], [0], [0], [1], [1], 1))  # False + 2
    with pytest.raises(DeltaError, match="0 or 1"):
        apply_patch(flags, bad)


def test_the_changes_must_fall_in_the_tensors_the_table_says():
    # the changed int32 tensors are coded end to end as one class of 24 (v: 0..7, then w: 8..23);
    # parameter floor(log2(floor(0.9624 * (11 + 0.5)))) = 3 for 2 of 24
    base = {"v": torch.arange(8, dtype=torch.int32), "w": torch.arange(16, dtype=torch.int32)}
    table = [["v", "int32", [8], 1], ["w", "int32", [16], 1]]
    assert rice.parameters(np.array([24]), np.array([2])).tolist() == [3]
    ok = payload([2], [3, 6], [3, 3], [0, 0], [0, 0], [], 4)  # ranks 3 (v's 3) and 10 (w's 2)
    got = apply_patch(base, craft(table, ok))
    assert (got["v"] - base["v"]).nonzero().flatten().tolist() == [3]
    assert (got["w"] - base["w"]).nonzero().flatten().tolist() == [2]
    both_in_w = payload([2], [10, 2], [3, 3], [0, 0], [0, 0], [], 4)  # ranks 10 and 13: w's 2 and 5
    with pytest.raises(DeltaError, match="tensor v: 0 changed positions, the table says 1"):
        apply_patch(base, craft(table, both_in_w))


def test_a_class_more_than_half_changed_codes_its_unchanged_elements():
    # 14 of the 16 int32 elements change by +1, all but positions 3 and 9: the 2 unchanged are coded
    # (ranks 3, 9: gaps 3, 5 with parameter 2), the values of the 14 changed follow in position order
    content = payload([14], [3, 5], [2, 2], [0] * 14, [0] * 14, [], 4)
    got = apply_patch(BASE, craft([["w", "int32", [16], 14]], content))["w"]
    assert (got - BASE["w"]).tolist() == [1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1]


def test_decompression_is_bounded_by_the_table():
    """A table that claims one change, with a frame that inflates to 64 MiB: refused from the frame
    header, before anything is inflated; and a frame header that lies about its size cannot make the
    decompressor write past the table's bound."""
    big = b"\x00" * (64 << 20)
    bomb = craft(TABLE, big)
    assert len(bomb) < 64 << 10  # small on the wire
    with pytest.raises(DeltaError, match="allows at most"):
        apply_patch(BASE, bomb)
    # rewrite the frame header's content size to a small value: decompression must stop at the bound
    head_len = struct.unpack_from("<I", bomb, 6)[0]
    start = 10 + head_len
    frame = bytearray(bomb[start:])
    fhd = frame[4]
    assert fhd >> 6 == 2  # 4-byte content size field
    at = 5 + (0 if fhd & 0x20 else 1) + [0, 1, 2, 4][fhd & 3]
    frame[at : at + 4] = struct.pack("<I", len(GOOD))
    lying = bomb[:start] + bytes(frame)
    assert zstandard.get_frame_parameters(bytes(frame)).content_size == len(GOOD)
    with pytest.raises(DeltaError):
        apply_patch(BASE, lying)


@pytest.mark.parametrize("lr", [1e-3, 3e-6], ids=["dense", "sparse"])
def test_corrupted_or_truncated_real_patches_never_decode_wrongly(lr):
    """Flip bytes anywhere in a real patch (dense changes, where most classes code their unchanged
    elements; sparse ones), or cut it short: apply_patch either raises DeltaError (never another
    exception) or, where a flipped byte carries no information, returns exactly the right weights."""
    base = weights(torch.bfloat16)
    new = step(base, lr)
    patch = encode_patch(base, new)
    want = weights_digest(new)
    rng = random.Random(0)
    spots = sorted({*range(0, 24), *rng.sample(range(len(patch)), min(150, len(patch)))})
    for i in spots:
        for flip in (0x01, 0x80, 0xFF):
            bad = bytearray(patch)
            bad[i] ^= flip
            try:
                got = apply_patch(base, bytes(bad))
            except DeltaError:
                continue
            assert weights_digest(got) == want, f"byte {i} ^ {flip:#x} decoded to other weights"
    for n in range(len(patch)):
        with pytest.raises(DeltaError):
            apply_patch(base, patch[:n])
    with pytest.raises(DeltaError):
        patch_info(patch[:5])


def test_patch_against_the_wrong_base_is_refused_or_detected():
    base = weights(torch.bfloat16)
    patch = encode_patch(base, step(base, 1e-3))
    with pytest.raises(DeltaError, match="missing"):
        apply_patch({k: t for k, t in base.items() if k != "scale"}, patch)
    with pytest.raises(DeltaError, match="dtype"):
        apply_patch({**base, "a.weight": base["a.weight"].float()}, patch)


def test_delta_error_is_a_user_facing_error():
    assert issubclass(DeltaError, Echo2Error)


def test_blocks_follow_the_spec(monkeypatch):
    """Changed tensors are coded in blocks: by dtype name, consecutive tensors of one dtype up to the
    block size together, a larger one alone; a patch across several blocks round trips."""
    monkeypatch.setattr(delta, "_BLOCK_ELEMENTS", 100)
    t = {
        "a": torch.zeros(60, dtype=torch.bfloat16),
        "b": torch.zeros(30, dtype=torch.bfloat16),
        "c": torch.zeros(20, dtype=torch.bfloat16),
        "d": torch.zeros(500, dtype=torch.bfloat16),
        "e": torch.zeros(5, dtype=torch.bfloat16),
        "i": torch.zeros(3, dtype=torch.int32),
    }
    got = delta._blocks(sorted(t), t)
    assert got == [
        ("bfloat16", ["a", "b"]),
        ("bfloat16", ["c"]),
        ("bfloat16", ["d"]),
        ("bfloat16", ["e"]),
        ("int32", ["i"]),
    ]
    base = weights(torch.bfloat16)  # a.weight 3072, b.weight 3000, ...: several blocks of 100
    round_trip(base, step(base, 3e-4))
