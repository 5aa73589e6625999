"""Published weights as full snapshots or as lossless sparse patches against the previous publication.

A worker samples with a low-precision copy of the learner's fp32 master weights (``sampler_copy``,
bf16 by default). Between two publications at LLM-RL learning rates (1e-6 .. 1e-5) most bf16 values do
not move at all: an AdamW step of about ``lr`` crosses a bf16 rounding boundary (one ulp, ~1e-4 for a
weight of 0.02) for only a few percent of the elements. ``encode_patch`` sends only those, bit exact,
and ``apply_patch`` rebuilds the new copy from the old one; ``weights_digest`` proves the result is
the very tensor set the learner published.

Patch format v2 (all integers little-endian)::

    b"E2WP" | u16 format version | u32 table length | table (UTF-8 JSON) | one zstandard frame

The table is ``[[name, dtype, shape, changed, coding], ...]``: every tensor of the weights, changed or
not, names sorted; ``coding`` says how the tensor's changed positions are coded (0: gaps, 1: a bitmap).
The frame's header carries its content size, which must not exceed the bound the table implies;
decompression is capped at that bound, so no patch can inflate beyond what its table
allows. The frame carries zstandard's content checksum, so corrupted bytes are refused, not decoded.

Per changed element the patch stores where it is and by how much its bits moved:

- *value*: ``d = key(new) - key(old)``, the wrapping integer difference of the bit patterns (int16 for
  2-byte dtypes, int32 for 4-byte ones, ...). For floating dtypes ``key`` maps sign-magnitude bit
  patterns to integers in float order (an involution), so ``d`` counts ulps, also across zero.
  Stored as a sign bit and ``|d| - 1`` (almost always 0 at RL learning rates: a one-ulp step).
  Comparing and differencing bits, never float values, keeps NaN payloads, -0.0 and inf exact.
- *position*: whether an element changes depends mostly on its exponent (one AdamW step of ~lr moves
  a weight across a rounding boundary with probability ~ lr / ulp). Per float tensor the encoder sends
  a *cut* (two binades under the tensor's median exponent; 0: none, as for other dtypes and tiny
  tensors). Elements whose exponent lies below it are *hot* and fall into 8 exponent classes (the
  lowest also takes all smaller exponents); the others are *cold*. The decoder derives both from the
  base weights alone.

  - *gaps* (sparse changes, the LLM-RL case): the changed hot elements are coded by their rank in the
    hot set ordered by class (stable), the cold ones by their rank among the cold elements; both rank
    lists are gap coded (``r_0 + 1``, then ``r_i - r_{i-1}``: strictly increasing ranks have gaps
    >= 1). Without a cut the positions themselves are gap coded.
  - *bitmap* (the encoder's choice once 1/8 of a tensor changed or more): one bit per element, set
    where it changed, the hot elements first, then the cold ones, each in position order (position
    order without a cut). Values follow the same order. At such densities a bitmap is smaller than
    gaps and much cheaper to code.

Frame content, each integer array byte-plane shuffled (all low bytes, then all next bytes, ...) so
zstandard sees long runs of zero high bytes:

1. per tensor with ``changed > 0``: its cut and its number of hot changes (0 unless gap coded with a
   cut);
2. the gaps of the gap-coded tensors (hot, then cold, per tensor).

   1 and 2 are uint32, or uint64 when some tensor has 2**32 elements or more;
3. the bitmaps of the bitmap-coded tensors, each packed to whole bytes (padding bits zero);
4. all sign bits, packed; 5. bits "|d| > 1", packed (padding bits zero);
6. the values ``|d| - 1`` of the elements whose bit in 5 is set, grouped by element width (1, 2, 4,
   8 bytes), in table order within a group.

Everything in a patch is untrusted: ``apply_patch`` checks the magic, the version, the table against
the base weights, the counts, every position, the frame's declared size, and trailing bytes, and raises
:class:`DeltaError` naming the first thing that is wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from echo2.errors import Echo2Error

if TYPE_CHECKING:
    import numpy as np
    import torch

MAGIC = b"E2WP"
FORMAT_VERSION = 2
GAPS, BITMAP = 0, 1  # how a tensor's changed positions are coded (the table's fifth column)
BITMAP_DENSITY = 1 / 8  # encoder's choice: a bitmap once at least this fraction of a tensor changed
_PREFIX = struct.Struct("<4sHI")  # magic, format version, table length

_PUBLISH_NAMES = ("bfloat16", "float16", "float32")


class DeltaError(Echo2Error):
    """Weights or a patch do not fit together or are malformed; the message names what is wrong."""


def __getattr__(name: str) -> Any:  # PUBLISH_DTYPES without importing torch at module import
    if name == "PUBLISH_DTYPES":
        return _publish_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _publish_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {name: getattr(torch, name) for name in _PUBLISH_NAMES}


if TYPE_CHECKING:
    PUBLISH_DTYPES: dict[str, torch.dtype]


# ---------------------------------------------------------------------------------------------------
# full weights


def sampler_copy(model: Any, dtype: str = "bfloat16") -> dict[str, torch.Tensor]:
    """The weights workers sample with: every tensor of ``model.state_dict()`` once (tied parameters
    under their first name only: the one place weights are deduplicated for shipping), detached,
    contiguous, on CPU, floating tensors cast to ``PUBLISH_DTYPES[dtype]`` (integer buffers keep their
    dtype). The tensors are fresh copies, never views of the live parameters."""
    import torch

    dtypes = _publish_dtypes()
    if dtype not in dtypes:
        raise DeltaError(f"publish dtype {dtype!r} is not one of {sorted(dtypes)}")
    target = dtypes[dtype]
    seen: set[tuple[int, int]] = set()
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, t in model.state_dict().items():
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
            if key in seen:
                continue
            seen.add(key)
            cast = target if t.is_floating_point() else t.dtype
            out[name] = t.detach().to(device="cpu", dtype=cast, copy=True).contiguous()
    return out


def weights_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """Hex SHA-256 of the weights in a canonical encoding: for each name in sorted order its name,
    dtype, shape (each length-prefixed) and raw bytes. Equal digests <=> bit-identical weights."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        meta = json.dumps([name, _dtype_name(t), list(t.shape)], separators=(",", ":")).encode()
        h.update(struct.pack("<Q", len(meta)))
        h.update(meta)
        raw = _raw_bytes(t)
        h.update(struct.pack("<Q", raw.nbytes))
        h.update(raw.data)
    return h.hexdigest()


def encode_full(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """safetensors bytes of ``tensors`` (CPU, contiguous); tensors that share memory (tied weights:
    use :func:`sampler_copy`) are refused with :class:`DeltaError`."""
    from safetensors.torch import save

    try:
        return save({name: t.detach().cpu().contiguous() for name, t in tensors.items()})
    except RuntimeError as e:  # safetensors refuses tensors sharing memory
        raise DeltaError(f"cannot serialize these weights: {e}") from e


def decode_full(blob: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """The tensors of safetensors bytes; :class:`DeltaError` when they are not valid safetensors."""
    from safetensors.torch import load

    try:
        return load(bytes(blob))
    except Exception as e:  # safetensors raises its own SafetensorError, or others on odd input
        raise DeltaError(f"full weights are not valid safetensors: {e}") from e


# ---------------------------------------------------------------------------------------------------
# patches


def encode_patch(base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], level: int = 3) -> bytes:
    """A lossless patch turning ``base`` into ``new`` (same names, shapes and dtypes, else
    :class:`DeltaError`), zstandard ``level`` (see the module docstring for the format)."""
    import numpy as np
    import zstandard

    missing, extra = sorted(set(base) - set(new)), sorted(set(new) - set(base))
    if missing or extra:
        raise DeltaError(
            f"patch needs the same tensor names: missing in new {missing[:5]}, extra {extra[:5]}"
        )
    table: list[list[Any]] = []
    sec = _Sections()
    for name in sorted(base):
        b, n = base[name], new[name]
        dtype = _dtype_name(b)
        if dtype != _dtype_name(n):
            raise DeltaError(f"tensor {name}: dtype {_dtype_name(n)} in new, {dtype} in base")
        if tuple(b.shape) != tuple(n.shape):
            raise DeltaError(f"tensor {name}: shape {tuple(n.shape)} in new, {tuple(b.shape)} in base")
        old_bits, new_bits = _bits(b), _bits(n)
        changed = old_bits != new_bits
        count = int(np.count_nonzero(changed))
        coding = BITMAP if count and count >= BITMAP_DENSITY * changed.size else GAPS
        table.append([name, dtype, list(b.shape), count, coding])
        if count == 0:
            continue
        pos = _code_positions(sec, old_bits, changed, dtype, coding)
        floating = b.is_floating_point()
        d = (_key(new_bits[pos], floating) - _key(old_bits[pos], floating)).view(f"u{old_bits.itemsize}")
        negative = d >= d.dtype.type(1 << (8 * old_bits.itemsize - 1))
        sec.signs.append(negative)
        sec.extras.append(np.where(negative, np.negative(d), d) - d.dtype.type(1))  # |d| - 1
    parts = sec.parts(_gap_width_of(table))
    head = json.dumps(table, separators=(",", ":")).encode()
    cctx = zstandard.ZstdCompressor(level=level, write_checksum=True)
    cobj = cctx.compressobj(size=sum(p.nbytes for p in parts))
    frame = [cobj.compress(p.data) for p in parts]
    frame.append(cobj.flush())
    return b"".join([_PREFIX.pack(MAGIC, FORMAT_VERSION, len(head)), head, *frame])


class _Sections:
    """What :func:`encode_patch` collects per changed tensor, in table order, for the frame."""

    def __init__(self) -> None:
        self.heads: list[tuple[int, int]] = []
        self.gaps: list[np.ndarray] = []
        self.bitmaps: list[np.ndarray] = []
        self.signs: list[np.ndarray] = []
        self.extras: list[np.ndarray] = []

    def parts(self, gap_width: int) -> list[np.ndarray]:
        """The frame content: per-tensor heads, all gaps, all bitmaps, all sign bits, all "|d| > 1"
        bits, then the values |d| - 1 > 0 grouped by element width (integer arrays byte-plane shuffled)."""
        import numpy as np

        empty = np.zeros(0, np.uint8)
        parts = [
            _shuffle(np.array(self.heads, dtype=f"u{gap_width}").reshape(-1)),
            _shuffle(np.concatenate(self.gaps).astype(f"u{gap_width}")) if self.gaps else empty,
            np.concatenate(self.bitmaps) if self.bitmaps else empty,
            np.packbits(np.concatenate(self.signs)) if self.signs else empty,
        ]
        flags = [x != 0 for x in self.extras]
        parts.append(np.packbits(np.concatenate(flags)) if flags else empty)
        for width in _WIDTHS:
            vals = [x[f] for x, f in zip(self.extras, flags, strict=True) if x.itemsize == width]
            parts.append(_shuffle(np.concatenate(vals)) if vals else empty)
        return parts


def _code_positions(
    sec: _Sections, old_bits: np.ndarray, changed: np.ndarray, dtype: str, coding: int
) -> np.ndarray:
    """Code where a tensor changed (``changed``: its mask) into ``sec``; returns the flat positions in
    the order the tensor's values are stored."""
    import numpy as np

    cut = _choose_cut(old_bits, dtype)
    sec.heads.append((cut, 0))
    if coding == BITMAP:
        if not cut:
            sec.bitmaps.append(np.packbits(changed))
            return np.flatnonzero(changed)
        order = _bitmap_order(old_bits, dtype, cut)
        in_order = changed[order]
        sec.bitmaps.append(np.packbits(in_order))
        return order[in_order]
    pos = np.flatnonzero(changed)
    if not cut:
        sec.gaps.append(np.diff(pos, prepend=-1))
        return pos
    hot_set, order = _hot_set(old_bits, dtype, cut)
    before = np.searchsorted(hot_set, pos)  # hot elements before each changed position
    is_hot = _hot_mask(old_bits[pos], dtype, cut)
    rank = np.empty(hot_set.size, np.int64)
    rank[order] = np.arange(hot_set.size)  # index of each hot element in class order
    q = rank[before[is_hot]]
    by_class = np.argsort(q)
    hot_q, hot_pos = q[by_class], pos[is_hot][by_class]
    cold_pos = pos[~is_hot]
    cold_r = cold_pos - before[~is_hot]
    sec.gaps.append(np.diff(hot_q, prepend=-1))
    sec.gaps.append(np.diff(cold_r, prepend=-1))
    sec.heads[-1] = (cut, int(hot_q.size))
    return np.concatenate([hot_pos, cold_pos])


@dataclass(frozen=True)
class _Changed:
    """A tensor a patch changes, as its table states it."""

    name: str
    count: int
    width: int  # bytes per element
    coding: int  # GAPS or BITMAP
    numel: int


def apply_patch(
    base: Mapping[str, torch.Tensor], patch: bytes | bytearray | memoryview
) -> dict[str, torch.Tensor]:
    """The weights ``patch`` turns ``base`` into, as a new dict. ``base`` is never modified: unchanged
    tensors are shared with it, changed ones are new. Raises :class:`DeltaError` when the patch is
    malformed or was not made against weights shaped like ``base``."""
    import numpy as np
    import torch

    table, frame = _parse(patch)
    changed = _changed_tensors(base, table)
    gw = _gap_width_of(table)
    buf = np.frombuffer(_inflate(frame, changed, gw), dtype=np.uint8)
    heads, codes, signs, flags, values = _split(buf, changed, gw)
    out: dict[str, torch.Tensor] = {row[0]: base[row[0]] for row in table}
    used = dict.fromkeys(_WIDTHS, 0)
    at = 0
    for c, head, code in zip(changed, heads, codes, strict=True):
        b = base[c.name]
        old_bits = _bits(b)
        sl = slice(at, at + c.count)
        at += c.count
        pos = _decode_positions(c, old_bits, _dtype_name(b), head, code)
        f = flags[sl]
        k = int(np.count_nonzero(f))
        mag = np.ones(c.count, f"u{c.width}")  # |d|
        if k:
            extra = values[c.width][used[c.width] : used[c.width] + k]  # |d| - 1 where it is > 0
            used[c.width] += k
            if np.any(extra == 0) or np.any(extra >= extra.dtype.type(1 << (8 * c.width - 1))):
                raise DeltaError(f"patch tensor {c.name}: a magnitude is out of range")
            mag[f] += extra
        d = np.where(signs[sl], np.negative(mag), mag).view(old_bits.dtype)
        floating = b.is_floating_point()
        new_bits = old_bits.copy()
        new_bits[pos] = _key(_key(old_bits[pos], floating) + d, floating)
        if b.dtype == torch.bool and np.any(new_bits.view(np.uint8) > 1):
            raise DeltaError(f"patch tensor {c.name}: a bool element gets a value other than 0 or 1")
        out[c.name] = torch.from_numpy(new_bits).view(b.dtype).reshape(b.shape)
    return out


def _changed_tensors(base: Mapping[str, torch.Tensor], table: list[list[Any]]) -> list[_Changed]:
    """The tensors the table changes, in table order, after checking the table against ``base``."""
    names = [row[0] for row in table]
    missing, unknown = sorted(set(base) - set(names)), sorted(set(names) - set(base))
    if missing or unknown:
        raise DeltaError(
            f"patch table does not match the base weights: missing {missing[:5]}, unknown {unknown[:5]}"
        )
    changed = []
    for name, dtype, shape, count, coding in table:
        b = base[name]
        if dtype != _dtype_name(b):
            raise DeltaError(f"patch tensor {name}: dtype {dtype}, base has {_dtype_name(b)}")
        if tuple(shape) != tuple(b.shape):
            raise DeltaError(f"patch tensor {name}: shape {tuple(shape)}, base has {tuple(b.shape)}")
        if count > b.numel():
            raise DeltaError(f"patch tensor {name}: {count} changed positions for {b.numel()} elements")
        if count:
            _bits_width(b)  # refuses unsupported dtypes before anything is decompressed
            changed.append(_Changed(name, count, b.element_size(), coding, b.numel()))
    return changed


def _sizes(changed: list[_Changed], gw: int) -> tuple[int, int, int, int]:
    """Byte sizes of the sections the table fixes: heads, gaps, bitmaps, and each packed-bit section."""
    gaps = sum(c.count for c in changed if c.coding == GAPS) * gw
    bitmaps = sum((c.numel + 7) // 8 for c in changed if c.coding == BITMAP)
    return 2 * gw * len(changed), gaps, bitmaps, (sum(c.count for c in changed) + 7) // 8


def _inflate(frame: memoryview, changed: list[_Changed], gw: int) -> bytes:
    """The frame's content, decompressed no further than the table allows."""
    import zstandard

    heads, gaps, bitmaps, flag_bytes = _sizes(changed, gw)
    fixed = heads + gaps + bitmaps + 2 * flag_bytes
    bound = fixed + sum(c.count * c.width for c in changed)
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as e:
        raise DeltaError(f"patch data is not a zstandard frame: {e}") from e
    if params.content_size == zstandard.CONTENTSIZE_UNKNOWN:
        raise DeltaError(f"patch frame does not declare its size (the table allows at most {bound} bytes)")
    if params.content_size > bound:
        raise DeltaError(
            f"patch frame declares {params.content_size} bytes, the table allows at most {bound}"
        )
    if params.content_size < fixed:
        raise DeltaError(
            f"patch frame declares {params.content_size} bytes, the table needs at least {fixed}"
        )
    try:
        payload = zstandard.ZstdDecompressor().decompress(
            frame, max_output_size=max(bound, 1), allow_extra_data=False
        )
    except zstandard.ZstdError as e:
        raise DeltaError(f"patch data is corrupt, truncated or has trailing bytes: {e}") from e
    if len(payload) < fixed:
        raise DeltaError(f"patch data decompressed to {len(payload)} bytes, the table needs at least {fixed}")
    return payload


def _split(
    buf: np.ndarray, changed: list[_Changed], gw: int
) -> tuple[np.ndarray, list[np.ndarray], np.ndarray, np.ndarray, dict[int, np.ndarray]]:
    """The frame content's sections: heads (one row per changed tensor), each tensor's position code
    (its gaps or its bitmap), sign bits, "|d| > 1" bits, and the values |d| - 1 > 0 by element width."""
    import numpy as np

    heads_n, gaps_n, bitmaps_n, flag_bytes = _sizes(changed, gw)
    total = sum(c.count for c in changed)
    at = heads_n
    heads = _unshuffle(buf[:at], gw).reshape(-1, 2)
    all_gaps = _unshuffle(buf[at : at + gaps_n], gw)
    at += gaps_n
    codes, g, m = [], 0, at
    for c in changed:
        if c.coding == GAPS:
            codes.append(all_gaps[g : g + c.count])
            g += c.count
        else:
            codes.append(buf[m : m + (c.numel + 7) // 8])
            m += (c.numel + 7) // 8
    at += bitmaps_n
    signs = _unpack(buf[at : at + flag_bytes], total, "sign")
    at += flag_bytes
    flags = _unpack(buf[at : at + flag_bytes], total, "magnitude")
    at += flag_bytes
    values: dict[int, np.ndarray] = {}  # width -> the values |d| - 1 > 0 of that width, in order
    starts = np.concatenate([[0], np.cumsum([c.count for c in changed])]).astype(np.int64)
    for width in _WIDTHS:
        k = sum(
            int(np.count_nonzero(flags[starts[i] : starts[i + 1]]))
            for i, c in enumerate(changed)
            if c.width == width
        )
        if at + k * width > len(buf):
            raise DeltaError(f"patch data is {len(buf)} bytes, too short for its {width}-byte magnitudes")
        values[width] = _unshuffle(buf[at : at + k * width], width)
        at += k * width
    if at != len(buf):
        raise DeltaError(f"patch data has {len(buf) - at} bytes after its last section")
    return heads, codes, signs, flags, values


def _decode_positions(
    c: _Changed, old_bits: np.ndarray, dtype: str, head: np.ndarray, code: np.ndarray
) -> np.ndarray:
    """Flat indices of a tensor's changed elements, in the order its values are stored."""
    import numpy as np

    cut, n_hot = int(head[0]), int(head[1])
    if n_hot > c.count:
        raise DeltaError(f"patch tensor {c.name}: {n_hot} hot positions of {c.count} changed")
    if cut and (dtype not in _EXPONENT or cut > 1 << _EXPONENT[dtype][1]):
        raise DeltaError(f"patch tensor {c.name}: exponent cut {cut} does not fit dtype {dtype}")
    if n_hot and (not cut or c.coding == BITMAP):
        raise DeltaError(f"patch tensor {c.name}: hot positions without an exponent cut and gaps")
    if c.coding == BITMAP:
        in_order = _unpack(code, c.numel, "position")
        if int(np.count_nonzero(in_order)) != c.count:
            raise DeltaError(
                f"patch tensor {c.name}: its bitmap marks {int(np.count_nonzero(in_order))} "
                f"positions, the table says {c.count}"
            )
        return _bitmap_order(old_bits, dtype, cut)[in_order] if cut else np.flatnonzero(in_order)
    if not cut:
        return _positions(c.name, code, c.numel)
    hot_set, order = _hot_set(old_bits, dtype, cut)
    hot_pos = hot_set[order[_positions(c.name, code[:n_hot], hot_set.size)]] if n_hot else hot_set[:0]
    cold_r = _positions(c.name, code[n_hot:], c.numel - hot_set.size) if n_hot < c.count else hot_set[:0]
    cold_pos = cold_r + np.searchsorted(hot_set - np.arange(hot_set.size), cold_r, side="right")
    return np.concatenate([hot_pos, cold_pos])


def patch_info(patch: bytes | bytearray | memoryview) -> dict[str, int]:
    """Counts from a patch's header, for metrics: tensors, changed elements, all elements, bytes."""
    table, _ = _parse(patch)
    return {
        "tensors": len(table),
        "changed": sum(row[3] for row in table),
        "elements": sum(math.prod(row[2]) for row in table),
        "bytes": memoryview(patch).nbytes,
    }


# ---------------------------------------------------------------------------------------------------
# helpers (numpy and torch are imported inside functions: importing this module stays cheap)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


_INT_VIEWS = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def _bits_width(t: torch.Tensor) -> int:
    """Bytes per element of a tensor patches can carry; DeltaError for other dtypes (complex, ...)."""
    width = t.element_size()
    if width not in _INT_VIEWS or t.is_complex():
        raise DeltaError(f"dtype {_dtype_name(t)} is not supported in patches")
    return width


def _bits(t: torch.Tensor) -> np.ndarray:
    """A flat numpy view of the tensor's bit patterns as signed integers of its element width."""
    import torch

    width = _bits_width(t)
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(getattr(torch, _INT_VIEWS[width])).numpy()


def _raw_bytes(t: torch.Tensor) -> np.ndarray:
    import torch

    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _key(x: np.ndarray, floating: bool) -> np.ndarray:
    """Sign-magnitude float bits -> integers in float order (and back: it is an involution). Signed
    integer dtypes are already in order."""
    if not floating:
        return x
    bits = 8 * x.itemsize
    mask = x.dtype.type((1 << (bits - 1)) - 1)
    return x ^ ((x >> (bits - 1)) & mask)


def _shuffle(a: np.ndarray) -> np.ndarray:
    """Little-endian byte planes of ``a``: all low bytes, then all next bytes, ..."""
    import numpy as np

    w = a.dtype.itemsize
    le = a.astype(a.dtype.newbyteorder("<"), copy=False)
    return np.ascontiguousarray(le.view(np.uint8).reshape(-1, w).T).reshape(-1)


def _unshuffle(planes: np.ndarray, width: int) -> np.ndarray:
    """Inverse of :func:`_shuffle`: unsigned little-endian integers of ``width`` bytes, native order."""
    import numpy as np

    n = planes.size // width
    le = np.ascontiguousarray(planes.reshape(width, n).T).reshape(-1).view(f"<u{width}")
    return le.astype(le.dtype.newbyteorder("="), copy=False)


_WIDTHS = (1, 2, 4, 8)

# float formats whose exponent classes steer position coding: dtype -> (mantissa bits, exponent bits)
_EXPONENT = {"bfloat16": (7, 8), "float16": (10, 5), "float32": (23, 8), "float64": (52, 11)}
_CLASSES = 8  # exponent classes of the hot elements, the lowest also takes all smaller exponents (format v2)
_CUT_OFFSET = -2  # encoder's choice (sent per tensor): the cut is 2 binades below the median exponent
_SAMPLE_STRIDE = 61  # the median is taken over every 61st element


def _choose_cut(old_bits: np.ndarray, dtype: str) -> int:
    """Exponent below which an element is "hot" (its ulp is small, so it is likely to change): a few
    binades below the tensor's median exponent; 0 (no hot set) for other dtypes and tiny tensors."""
    import numpy as np

    if dtype not in _EXPONENT or old_bits.size < 64:
        return 0
    mant, ebits = _EXPONENT[dtype]
    sample = old_bits[::_SAMPLE_STRIDE].view(f"u{old_bits.itemsize}")
    med = int(np.median((sample >> mant) & ((1 << ebits) - 1)))
    return max(0, min(med + _CUT_OFFSET, 1 << ebits))


def _hot_mask(bits: np.ndarray, dtype: str, cut: int) -> np.ndarray:
    mant, _ = _EXPONENT[dtype]
    u = bits.view(f"u{bits.itemsize}")
    return (u & ((1 << (8 * bits.itemsize - 1)) - 1)) < (cut << mant)


def _bitmap_order(old_bits: np.ndarray, dtype: str, cut: int) -> np.ndarray:
    """Flat indices of all elements in a bitmap's order: the hot ones (exponent < cut), then the cold
    ones, each in position order."""
    import numpy as np

    hot = _hot_mask(old_bits, dtype, cut)
    return np.concatenate([np.flatnonzero(hot), np.flatnonzero(~hot)])


def _hot_set(old_bits: np.ndarray, dtype: str, cut: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices of the hot elements (exponent < cut) and the stable order that sorts them by
    exponent class; both sides of a patch derive them from the base weights alone."""
    import numpy as np

    mant, ebits = _EXPONENT[dtype]
    hot_set = np.flatnonzero(_hot_mask(old_bits, dtype, cut))
    e = ((old_bits[hot_set].view(f"u{old_bits.itemsize}") >> mant) & ((1 << ebits) - 1)).astype(np.int64)
    cls = np.clip(e - (cut - _CLASSES), 0, _CLASSES - 1).astype(np.uint8)
    return hot_set, np.argsort(cls, kind="stable")


def _gap_width_of(table: list[list[Any]]) -> int:
    """Bytes per gap in a patch: 4, or 8 when some tensor has 2**32 elements or more."""
    big = any(math.prod(row[2]) >= 1 << 32 for row in table)
    return 8 if big else 4


def _unpack(packed: np.ndarray, n: int, what: str) -> np.ndarray:
    import numpy as np

    bits = np.unpackbits(packed).view(np.bool_)
    if np.any(bits[n:]):
        raise DeltaError(f"patch {what} bits have nonzero padding")
    return bits[:n]


def _positions(name: str, gaps: np.ndarray, limit: int) -> np.ndarray:
    """Indices from gaps (``p_0 + 1``, then ``p_i - p_{i-1}``), checked strictly increasing and below
    ``limit``; int64 arithmetic, a wrap-around shows up as a decrease."""
    import numpy as np

    g = gaps.astype(np.int64)  # uint64 gaps >= 2**63 turn negative and fail the next check
    if not np.all(g >= 1):
        raise DeltaError(f"patch tensor {name}: changed positions are not strictly increasing")
    pos = np.cumsum(g) - 1
    if pos.size > 1 and not np.all(pos[1:] > pos[:-1]):
        raise DeltaError(f"patch tensor {name}: changed positions overflow")
    if pos.size and pos[-1] >= limit:
        raise DeltaError(f"patch tensor {name}: changed position {int(pos[-1])} is out of range ({limit})")
    return pos


def _parse(patch: bytes | bytearray | memoryview) -> tuple[list[list[Any]], memoryview]:
    """The checked table and the frame bytes of a patch (structure only; no base needed)."""
    data = memoryview(patch).cast("B")
    if len(data) < _PREFIX.size:
        raise DeltaError(f"patch is {len(data)} bytes, shorter than its {_PREFIX.size}-byte header")
    magic, version, head_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise DeltaError(f"not a weight patch: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise DeltaError(
            f"patch format version {version} is not supported (this build reads {FORMAT_VERSION})"
        )
    end = _PREFIX.size + head_len
    if end > len(data):
        raise DeltaError(
            f"patch table of {head_len} bytes runs past the end of the patch ({len(data)} bytes)"
        )
    try:
        table = json.loads(bytes(data[_PREFIX.size : end]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise DeltaError(f"patch table is not JSON: {e}") from e
    if not isinstance(table, list):
        raise DeltaError("patch table is not a list")
    seen: set[str] = set()
    for i, row in enumerate(table):
        if not (
            isinstance(row, list)
            and len(row) == 5
            and isinstance(row[0], str)
            and isinstance(row[1], str)
            and isinstance(row[2], list)
            and all(type(s) is int and s >= 0 for s in row[2])
            and type(row[3]) is int
            and row[3] >= 0
            and type(row[4]) is int
            and row[4] in (GAPS, BITMAP)
        ):
            raise DeltaError(
                f"patch table row {i} is not [name, dtype, shape, changed, coding]: {str(row)[:200]}"
            )
        if row[0] in seen:
            raise DeltaError(f"patch table names tensor {row[0]} twice")
        seen.add(row[0])
    return table, data[end:]
