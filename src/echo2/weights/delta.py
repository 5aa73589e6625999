"""Published weights as full snapshots or as lossless sparse patches against the previous publication.

A worker samples with a low-precision copy of the learner's fp32 master weights (``sampler_copy``,
bf16 by default). Between two publications at LLM-RL learning rates (1e-6 .. 1e-5) most bf16 values do
not move at all: an AdamW step of about ``lr`` crosses a bf16 rounding boundary (one ulp, ~1e-4 for a
weight of 0.02) for only a few percent of the elements. ``encode_patch`` sends only those, bit exact,
and ``apply_patch`` rebuilds the new copy from the old one; ``weights_digest`` proves the result is
the very tensor set the learner published.

Patch format v3 (all integers little-endian)::

    b"E2WP" | u16 format version | u32 table length | table (UTF-8 JSON) | one zstandard frame

The table is ``[[name, dtype, shape, changed], ...]``: every tensor of the weights, changed or not,
names sorted. The frame's header carries its content size, which must not exceed the bound the table
(and the base) imply; decompression is capped at that bound, so no patch can inflate beyond what its
table allows. The frame carries zstandard's content checksum, so corrupted bytes are refused, not
decoded.

Per changed element the patch stores where it is and by how much its bits moved:

- *value*: ``d = key(new) - key(old)``, the wrapping integer difference of the bit patterns (int16 for
  2-byte dtypes, int32 for 4-byte ones, ...). For floating dtypes ``key`` maps sign-magnitude bit
  patterns to integers in float order (an involution), so ``d`` counts ulps, also across zero.
  Stored as a sign bit and ``|d| - 1`` (almost always 0 at RL learning rates: a one-ulp step).
  Comparing and differencing bits, never float values, keeps NaN payloads, -0.0 and inf exact.
- *position*: whether an element changes depends mostly on its exponent (one AdamW step of ~lr moves
  a weight across a rounding boundary with probability ~ lr / ulp, and the ulp doubles per binade).
  So elements are grouped into *classes* that the decoder derives from the base alone. The changed
  tensors are coded in *blocks*: by dtype (dtype names sorted), consecutive changed tensors of one
  dtype in table order, end to end, up to 2**24 elements together (a larger tensor is a block of its
  own); the blocks in that order are the *patch order*. A float block of 64 elements or more has a
  *cut*, one below the median exponent of every 61st of its elements (about 15% of normally
  distributed weights lie below it); the elements below the cut are *hot* and fall into 10 classes
  by exponent (the lowest also takes all smaller exponents), the others form the *cold* class.
  Other blocks are one cold class. The *class order* lists the hot classes that have elements by
  ascending exponent, then the cold class, each in position order. (Conditioning on the tensor as
  well gains nothing measurable: AdamW normalises every element's step, so the exponent alone sets
  how likely it is to cross a rounding boundary. Blocks bound the memory a patch takes to code.)
  Per class of ``n`` elements of which ``k`` changed, the patch codes the ranks within the class of
  the changed elements, or of the unchanged ones where ``2k > n``: ``m = min(k, n - k)`` strictly
  increasing ranks as gaps ``rank_0``, then ``rank_i - rank_{i-1} - 1``, each Rice coded
  (``echo2.weights.rice``) with the parameter ``rice.parameters(n, m)``. Changes within a class are
  close to independent, so the gaps are close to geometric, and this comes within ~0.1 bit per
  change of the entropy of the positions given their exponents (format v2 coded rank gaps as bytes
  through zstandard and paid ~1.5 bits more).

Frame content, integer arrays byte-plane shuffled (all low bytes, then all next bytes, ...) so
zstandard sees long runs of zero high bytes:

1. per class (blocks in patch order, classes in class order; hot classes only where they have
   elements, the cold class always): its changed count (uint32, or uint64 when some tensor has
   2**32 elements or more);
2. the Rice remainder stream of the coded ranks, in that order;
3. the sign bits of the changed elements, in that order, packed (padding bits zero);
4. bits "|d| > 1", likewise;
5. per block, the values ``|d| - 1`` of its elements whose bit in 4 is set, in that order;
6. the Rice unary stream (the rest of the frame).

Everything in a patch is untrusted: ``apply_patch`` checks the magic, the version, the table against
the base weights, the counts, every position, the frame's declared size, and trailing bytes, and raises
:class:`DeltaError` naming the first thing that is wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from echo2.weights.bitplanes import (
    _BLOCK_ELEMENTS,
    _EXPONENT,
    _HOT_CLASSES,
    DeltaError,
    _bits,
    _bits_width,
    _cat,
    _count_width_of,
    _cut,
    _dtype_name,
    _exponents,
    _key,
    _raw_bytes,
    _shuffle,
    _unpack,
    _unshuffle,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

MAGIC = b"E2WP"
FORMAT_VERSION = 3
_PREFIX = struct.Struct("<4sHI")  # magic, format version, table length

_PUBLISH_NAMES = ("bfloat16", "float16", "float32")


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


def sampler_copy(
    model: Any,
    dtype: str = "bfloat16",
    keep: Callable[[str], bool] | None = None,
    frozen: bool = False,
) -> dict[str, torch.Tensor]:
    """The weights workers sample with: every tensor of ``model.state_dict()`` once (tied parameters
    under their first name only: the one place weights are deduplicated for shipping), detached,
    contiguous, on CPU, floating tensors cast to ``PUBLISH_DTYPES[dtype]`` (integer buffers keep their
    dtype). ``keep``: only the tensors whose name it accepts (a LoRA run's adapter, or its base), the
    others never copied. The tensors are fresh copies, never views of the live parameters, unless
    ``frozen`` (parameters that are never stepped: a LoRA run's base), where a tensor already in its
    shipped dtype, on the CPU and contiguous is the live one, detached."""
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
            if key in seen or (keep is not None and not keep(name)):
                continue
            seen.add(key)
            cast = target if t.is_floating_point() else t.dtype
            if frozen and t.dtype == cast and t.device.type == "cpu" and t.is_contiguous():
                out[name] = t.detach()
            else:
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

    from echo2.weights import rice

    missing, extra = sorted(set(base) - set(new)), sorted(set(new) - set(base))
    if missing or extra:
        raise DeltaError(
            f"patch needs the same tensor names: missing in new {missing[:5]}, extra {extra[:5]}"
        )
    names = sorted(base)
    for name in names:
        b, n = base[name], new[name]
        if _dtype_name(b) != _dtype_name(n):
            raise DeltaError(f"tensor {name}: dtype {_dtype_name(n)} in new, {_dtype_name(b)} in base")
        if tuple(b.shape) != tuple(n.shape):
            raise DeltaError(f"tensor {name}: shape {tuple(n.shape)} in new, {tuple(b.shape)} in base")
    counts = {name: int(np.count_nonzero(_bits(base[name]) != _bits(new[name]))) for name in names}
    sec = _Sections()
    for dtype, members in _blocks([name for name in names if counts[name]], base):
        olds, news = [_bits(base[m]) for m in members], [_bits(new[m]) for m in members]
        old, new_bits = (
            (olds[0], news[0]) if len(members) == 1 else (np.concatenate(olds), np.concatenate(news))
        )
        class_counts, gaps, params, pos = _Classes.of(old, dtype).code(old != new_bits)
        sec.counts.append(class_counts)
        sec.gaps.append(gaps)
        sec.params.append(params)
        floating = dtype in _EXPONENT
        d = (_key(new_bits[pos], floating) - _key(old[pos], floating)).view(f"u{old.itemsize}")
        negative = d >= d.dtype.type(1 << (8 * old.itemsize - 1))
        sec.signs.append(negative)
        sec.extras.append(np.where(negative, np.negative(d), d) - d.dtype.type(1))  # |d| - 1
    table = [[name, _dtype_name(base[name]), list(base[name].shape), counts[name]] for name in names]
    rem, unary = rice.encode(_cat(sec.gaps, np.int64), _cat(sec.params, np.int64))
    sections = sec.parts(_count_width_of(table), rem, unary)
    head = json.dumps(table, separators=(",", ":")).encode()
    cctx = zstandard.ZstdCompressor(level=level, write_checksum=True)
    cobj = cctx.compressobj(size=sum(len(p) for p in sections))
    frame = [cobj.compress(p) for p in sections]
    frame.append(cobj.flush())
    return b"".join([_PREFIX.pack(MAGIC, FORMAT_VERSION, len(head)), head, *frame])


def _blocks(names: list[str], tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, list[str]]]:
    """The *blocks* of a patch (module docstring) when ``names`` are its changed tensors in table
    order: by dtype name (sorted), consecutive tensors of one dtype together up to
    ``_BLOCK_ELEMENTS`` elements, a larger tensor alone."""
    by_dtype: dict[str, list[str]] = {}
    for name in names:
        by_dtype.setdefault(_dtype_name(tensors[name]), []).append(name)
    blocks: list[tuple[str, list[str]]] = []
    for dtype, members in sorted(by_dtype.items()):
        size = _BLOCK_ELEMENTS  # start a block with the first member
        for name in members:
            n = tensors[name].numel()
            if size + n > _BLOCK_ELEMENTS:
                blocks.append((dtype, []))
                size = 0
            blocks[-1][1].append(name)
            size += n
    return blocks


class _Sections:
    """What :func:`encode_patch` collects per block, in patch order, for the frame."""

    def __init__(self) -> None:
        self.counts: list[np.ndarray] = []  # changed elements per class
        self.gaps: list[np.ndarray] = []  # the coded ranks' gaps, class by class
        self.params: list[np.ndarray] = []  # the Rice parameter of each gap
        self.signs: list[np.ndarray] = []
        self.extras: list[np.ndarray] = []  # |d| - 1 per changed element

    def parts(self, count_width: int, rem: bytes, unary: bytes) -> list[bytes]:
        """The frame content, sections 1-6 of the module docstring."""
        import numpy as np

        flags = [x != 0 for x in self.extras]
        return [
            _shuffle(_cat(self.counts, np.int64).astype(f"u{count_width}")).tobytes(),
            rem,
            np.packbits(_cat(self.signs, np.bool_)).tobytes(),
            np.packbits(_cat(flags, np.bool_)).tobytes(),
            *(_shuffle(x[f]).tobytes() for x, f in zip(self.extras, flags, strict=True)),
            unary,
        ]


@dataclass(frozen=True)
class _Classes:
    """The changed tensors of a block, end to end, grouped into the classes both sides of a patch
    derive from the base (module docstring): for a float dtype the elements below the cut are *hot*
    and fall into ``_HOT_CLASSES`` classes by exponent, the others form the *cold* class; other dtypes
    are one cold class. Class order: the hot classes by ascending exponent, then the cold class; in a
    class, position order. Positions are flat indices into the tensors end to end."""

    sizes: np.ndarray  # int64: elements per class present, in class order (the cold class last, always)
    hot_mask: np.ndarray  # bool per element: hot
    hot_flat: np.ndarray  # the hot elements in position order
    hot: np.ndarray  # the same in class order

    @classmethod
    def of(cls, old: np.ndarray, dtype: str) -> _Classes:
        """Classes of the base bits ``old`` (flat) of a block's tensors."""
        import numpy as np
        import torch

        cut = _cut(old, dtype)
        if not cut:
            none = np.zeros(0, dtype=np.int64)
            return cls(np.array([old.size], dtype=np.int64), np.zeros(old.size, dtype=np.bool_), none, none)
        e = _exponents(old, dtype)
        hot_mask = e < cut
        hot_flat = np.flatnonzero(hot_mask)
        lo = cut - _HOT_CLASSES  # class of exponent x: max(x - lo, 0), so 0 .. classes - 1 below the cut
        level = (np.maximum(e[hot_flat], lo) - lo if lo >= 0 else e[hot_flat] + (-lo)).astype(np.uint8)
        counts = torch.from_numpy(level).bincount().numpy().astype(np.int64)
        sizes = np.append(counts[counts > 0], old.size - hot_flat.size)
        return cls(sizes, hot_mask, hot_flat, hot_flat[np.argsort(level, kind="stable")])

    def coded(self, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per class, for ``counts`` changed elements: how many elements are coded (the changed ones,
        or the unchanged ones where more than half changed), whether they are the unchanged ones, and
        their Rice parameter."""
        import numpy as np

        from echo2.weights import rice

        flip = 2 * counts > self.sizes
        m = np.where(flip, self.sizes - counts, counts)
        return m, flip, rice.parameters(self.sizes, m)

    def _cold_rank(self, pos: np.ndarray) -> np.ndarray:
        """Ranks within the cold class of the cold elements at (increasing) positions ``pos``."""
        import numpy as np

        if 8 * pos.size < self.hot_mask.size:  # few: count the hot elements before each
            return pos - np.searchsorted(self.hot_flat, pos)
        return (np.cumsum(~self.hot_mask) - 1)[pos]

    def code(self, changed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For the ``changed`` mask (flat, like ``old``): the changed count per class, the gaps of the
        coded ranks (class by class) with their Rice parameters, and the positions of the changed
        elements in class order (the order their values are stored in)."""
        import numpy as np

        in_hot = changed[self.hot]
        sel = np.flatnonzero(in_hot)
        hot_sizes = self.sizes[:-1]
        starts = np.cumsum(hot_sizes) - hot_sizes
        cold = np.flatnonzero(changed > self.hot_mask)
        counts = np.append(np.diff(np.searchsorted(sel, [*starts.tolist(), in_hot.size])), cold.size)
        m, flip, params = self.coded(counts)
        coded_hot = np.flatnonzero(in_hot ^ np.repeat(flip[:-1], hot_sizes)) if flip[:-1].any() else sel
        coded_cold = np.flatnonzero(~changed > self.hot_mask) if flip[-1] else cold  # unchanged cold ones
        rank = np.concatenate([coded_hot - np.repeat(starts, m[:-1]), self._cold_rank(coded_cold)])
        gaps = np.diff(rank, prepend=-1) - 1
        first = (np.cumsum(m) - m)[m > 0]
        gaps[first] = rank[first]  # a class's first rank is its own gap
        return counts, gaps, np.repeat(params, m), np.concatenate([self.hot[sel], cold])

    def positions(
        self, counts: np.ndarray, quotients: np.ndarray, remainders: np.ndarray, what: str
    ) -> np.ndarray:
        """Positions of the changed elements in class order, from the decoded Rice codes of the coded
        ranks; :class:`DeltaError` (naming ``what``) when a rank does not fit its class."""
        import numpy as np

        m, flip, params = self.coded(counts)
        n_v, r_v = np.repeat(self.sizes, m), np.repeat(params, m)
        if np.any(quotients > (n_v - 1) >> r_v):
            raise DeltaError(f"patch {what}: a changed position is out of range")
        ends = np.cumsum(quotients << r_v | remainders) + np.arange(1, quotients.size + 1)  # sums of gaps + 1
        if ends.size > 1 and not np.all(ends[1:] > ends[:-1]):
            raise DeltaError(f"patch {what}: changed positions overflow")
        first = (np.cumsum(m) - m)[m > 0]
        before = np.where(first > 0, ends[np.maximum(first - 1, 0)], 0)  # the sums up to each class
        rank = ends - np.repeat(before, m[m > 0]) - 1
        if np.any(rank >= n_v):
            raise DeltaError(f"patch {what}: a changed position is out of range")
        hot_sizes, hot_m = self.sizes[:-1], int(m[:-1].sum())
        idx = rank[:hot_m] + np.repeat(np.cumsum(hot_sizes) - hot_sizes, m[:-1])
        if flip[:-1].any():
            mask = np.repeat(flip[:-1], hot_sizes)
            mask[idx] ^= True
            idx = np.flatnonzero(mask)
        r = rank[hot_m:]
        if flip[-1]:  # the ranks of the unchanged cold elements: the changed ones are the others
            keep = np.ones(self.sizes[-1], dtype=np.bool_)
            keep[r] = False
            r = np.flatnonzero(keep)
        if 8 * r.size < self.hot_mask.size:  # few: skip the hot elements before each
            cold = r + np.searchsorted(self.hot_flat - np.arange(self.hot_flat.size), r, side="right")
        else:
            cold = np.flatnonzero(~self.hot_mask)[r]
        return np.concatenate([self.hot[idx], cold])

    def per_tensor(self, pos: np.ndarray, counts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """How many of the changed positions ``pos`` (class order, as :meth:`positions` returns them,
        ``counts`` per class) fall in each tensor of the block (``ends``: where each one ends)."""
        import numpy as np

        per = np.zeros(ends.size, dtype=np.int64)
        at = 0
        for k in counts.tolist():  # positions increase within a class
            per += np.diff(np.searchsorted(pos[at : at + k], ends, side="left"), prepend=0)
            at += k
        return per


@dataclass(frozen=True)
class _Block:
    """A block of the tensors a patch changes (module docstring), as the decoder sees it."""

    dtype: str
    names: list[str]
    counts: list[int]  # changed elements per tensor, as the table states them
    width: int  # bytes per element
    old: np.ndarray  # the base bits of the tensors, end to end (a copy)
    classes: _Classes

    @property
    def changes(self) -> int:
        return sum(self.counts)


def apply_patch(
    base: Mapping[str, torch.Tensor], patch: bytes | bytearray | memoryview
) -> dict[str, torch.Tensor]:
    """The weights ``patch`` turns ``base`` into, as a new dict. ``base`` is never modified: unchanged
    tensors are shared with it, changed ones are new (those of one block are views of one new
    buffer). Raises :class:`DeltaError` when the patch is malformed or was not made against weights
    shaped like ``base``."""
    import numpy as np
    import torch

    from echo2.weights import rice

    table, frame = _parse(patch)
    blocks = _changed_blocks(base, table)
    cw = _count_width_of(table)
    sec = _split(np.frombuffer(_inflate(frame, blocks, cw), dtype=np.uint8), blocks, cw)
    try:
        quotients, remainders = rice.decode(sec.rem, sec.unary, sec.params)
    except rice.CodeError as e:
        raise DeltaError(f"patch positions: {e}") from e
    out: dict[str, torch.Tensor] = {row[0]: base[row[0]] for row in table}
    for i, g in enumerate(blocks):
        codes = slice(sec.code_starts[i], sec.code_starts[i + 1])
        vals = slice(sec.value_starts[i], sec.value_starts[i + 1])
        pos = g.classes.positions(sec.counts[i], quotients[codes], remainders[codes], f"{g.dtype} tensors")
        extra = sec.magnitudes[i]  # |d| - 1 where it is > 0
        if extra.size and (extra.min() == 0 or extra.max() >= extra.dtype.type(1 << (8 * g.width - 1))):
            raise DeltaError(f"patch {g.dtype} tensors: a magnitude is out of range")
        d = np.ones(g.changes, f"u{g.width}")  # |d|, then d
        d[sec.flags[vals]] = extra + extra.dtype.type(1)
        np.negative(d, out=d, where=sec.signs[vals])
        d = d.view(g.old.dtype)
        floating = g.dtype in _EXPONENT
        new_bits = g.old  # a copy of the base's bits: the new buffer
        new_bits[pos] = _key(_key(new_bits[pos], floating) + d, floating)
        ends = np.cumsum([base[name].numel() for name in g.names])
        per_tensor = g.classes.per_tensor(pos, sec.counts[i], ends)
        if not np.array_equal(per_tensor, g.counts):
            bad = int(np.flatnonzero(per_tensor != g.counts)[0])
            raise DeltaError(
                f"patch tensor {g.names[bad]}: {per_tensor[bad]} changed positions, "
                f"the table says {g.counts[bad]}"
            )
        for name, a, b in zip(g.names, [0, *ends[:-1].tolist()], ends.tolist(), strict=True):
            t = base[name]
            if t.dtype == torch.bool and np.any(new_bits[a:b].view(np.uint8) > 1):
                raise DeltaError(f"patch tensor {name}: a bool element gets a value other than 0 or 1")
            out[name] = torch.from_numpy(new_bits[a:b]).view(t.dtype).reshape(t.shape)
    return out


def _changed_blocks(base: Mapping[str, torch.Tensor], table: list[list[Any]]) -> list[_Block]:
    """The tensors the table changes, as blocks in patch order, after checking the table against
    ``base``; their classes are derived from ``base``."""
    import numpy as np

    names = [row[0] for row in table]
    missing, unknown = sorted(set(base) - set(names)), sorted(set(names) - set(base))
    if missing or unknown:
        raise DeltaError(
            f"patch table does not match the base weights: missing {missing[:5]}, unknown {unknown[:5]}"
        )
    counts = {}
    for name, dtype, shape, count in table:
        b = base[name]
        if dtype != _dtype_name(b):
            raise DeltaError(f"patch tensor {name}: dtype {dtype}, base has {_dtype_name(b)}")
        if tuple(shape) != tuple(b.shape):
            raise DeltaError(f"patch tensor {name}: shape {tuple(shape)}, base has {tuple(b.shape)}")
        if count > b.numel():
            raise DeltaError(f"patch tensor {name}: {count} changed positions for {b.numel()} elements")
        if count:
            _bits_width(b)  # refuses unsupported dtypes before anything is decompressed
            counts[name] = count
    blocks = []
    for dtype, members in _blocks(list(counts), base):
        old = np.concatenate([_bits(base[m]) for m in members])  # a copy, also of a single tensor
        width = base[members[0]].element_size()
        blocks.append(
            _Block(dtype, members, [counts[m] for m in members], width, old, _Classes.of(old, dtype))
        )
    return blocks


def _inflate(frame: memoryview, blocks: list[_Block], cw: int) -> bytes:
    """The frame's content, decompressed no further than the table (and the base's classes) allow:
    the class counts, sign and flag bits exactly; remainders and unary codes of at most one and
    2.67 bits per element (gaps that fit their classes, with the parameters of
    ``rice.parameters``, take at most 0.64 and 1.54); and a value per change."""
    import zstandard

    flag_bytes = (sum(g.changes for g in blocks) + 7) // 8
    fixed = cw * sum(g.classes.sizes.size for g in blocks) + 2 * flag_bytes
    numel = sum(g.old.size for g in blocks)
    bound = fixed + numel // 8 + numel // 3 + 2 + sum(g.changes * g.width for g in blocks)
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


@dataclass(frozen=True)
class _Split:
    """The frame content's sections (module docstring), checked against the table."""

    counts: list[np.ndarray]  # per block, changed elements per class
    params: np.ndarray  # the Rice parameter of every coded rank, all blocks
    code_starts: np.ndarray  # where each block's coded ranks begin in ``params`` (and one past the end)
    rem: np.ndarray  # the remainder stream
    signs: np.ndarray  # one per changed element, all blocks
    flags: np.ndarray  # "|d| > 1", likewise
    value_starts: np.ndarray  # where each block's changed elements begin in ``signs`` (and the end)
    magnitudes: list[np.ndarray]  # per block, its values |d| - 1 > 0
    unary: np.ndarray  # the unary stream


def _split(buf: np.ndarray, blocks: list[_Block], cw: int) -> _Split:
    import numpy as np

    from echo2.weights import rice

    n_classes = [g.classes.sizes.size for g in blocks]
    at = cw * sum(n_classes)
    counts = np.split(_unshuffle(buf[:at], cw).astype(np.int64), np.cumsum(n_classes)[:-1]) if blocks else []
    params = []
    for g, k in zip(blocks, counts, strict=True):
        if np.any(k > g.classes.sizes) or int(k.sum()) != g.changes:
            raise DeltaError(
                f"patch {g.dtype} tensors: their class counts do not add up to the table's "
                f"{g.changes} changes"
            )
        m, _, r = g.classes.coded(k)
        params.append(np.repeat(r, m))
    code_starts = np.cumsum([0, *(p.size for p in params)])
    all_params = _cat(params, np.int64)
    rem_n = rice.remainder_bytes(all_params)
    total = sum(g.changes for g in blocks)
    flag_bytes = (total + 7) // 8
    if at + rem_n + 2 * flag_bytes > len(buf):
        raise DeltaError(f"patch data is {len(buf)} bytes, too short for its position codes")
    rem = buf[at : at + rem_n]
    at += rem_n
    signs = _unpack(buf[at : at + flag_bytes], total, "sign")
    at += flag_bytes
    flags = _unpack(buf[at : at + flag_bytes], total, "magnitude")
    at += flag_bytes
    value_starts = np.cumsum([0, *(g.changes for g in blocks)])
    magnitudes = []
    for i, g in enumerate(blocks):
        n = int(np.count_nonzero(flags[value_starts[i] : value_starts[i + 1]])) * g.width
        if at + n > len(buf):
            raise DeltaError(f"patch data is {len(buf)} bytes, too short for its {g.dtype} magnitudes")
        magnitudes.append(_unshuffle(buf[at : at + n], g.width))
        at += n
    return _Split(counts, all_params, code_starts, rem, signs, flags, value_starts, magnitudes, buf[at:])


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
# a patch's structure (the bit-level helpers: bitplanes.py)


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
            and len(row) == 4
            and isinstance(row[0], str)
            and isinstance(row[1], str)
            and isinstance(row[2], list)
            and all(type(s) is int and s >= 0 for s in row[2])
            and type(row[3]) is int
            and row[3] >= 0
        ):
            raise DeltaError(f"patch table row {i} is not [name, dtype, shape, changed]: {str(row)[:200]}")
        if row[0] in seen:
            raise DeltaError(f"patch table names tensor {row[0]} twice")
        seen.add(row[0])
    return table, data[end:]
