"""Rice codes for many small non-negative integers at once (numpy, no Python loop per value).

A Rice code with parameter ``r`` writes ``v >= 0`` as ``v >> r`` in unary (that many one bits, then
a zero) followed by the low ``r`` bits of ``v``. For geometrically distributed values, which is how
the gaps between independent rare events are distributed, the best ``r`` comes within a few
hundredths of a bit of the entropy (:func:`parameters` picks it from counts alone, so a decoder
derives it without being told).

The two halves travel as two bit streams, so that both decode without a scan:

- the *unary* stream holds every value's unary part in value order, padded with one bits to a whole
  byte: value ``i``'s part ends at the ``i``-th zero bit;
- the *remainder* stream holds every value's ``r``-bit remainder (most significant bit first) in
  value order, padded with zero bits to a whole byte; values come in runs of one parameter (a
  class each, in a patch), which is how both ends process them.

Everything decoded here may come from a stranger: :func:`decode` checks that the streams have
exactly the bits the parameters call for, and raises :class:`CodeError` naming what does not fit.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

# -ln 2 / ln(phi - 1) = 1.4404 / 1.4966 in 16-bit fixed point: the optimal Rice parameter for a
# geometric value of mean mu is floor(log2(C * (mu + 1/2))) to within the last term of a series,
# and integer arithmetic makes it the same on every machine
_C_Q16 = 63072
MAX_PARAMETER = 56  # a remainder and its bit offset in a byte fit one 64-bit word


class CodeError(ValueError):
    """Coded bits that do not fit their parameters (the message says which stream and how)."""


def parameters(n: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The Rice parameter for ``m`` values that are the gaps between ``m`` of ``n`` ranks (per entry;
    0 where ``m`` is 0; ``n`` below 2**45): ``floor(log2(x))`` for ``x = floor(0.9624 * (mu + 1/2))
    >= 1``, else 0, where ``mu = (n - m) / m`` is the mean gap. This is the best parameter for
    geometric gaps (Kiely's formula, its logarithm expanded to first order), which is what
    independent changes at a rate ``m / n`` give; the tests compare it with the best of all."""
    import numpy as np

    n = np.asarray(n, dtype=np.int64)
    m = np.asarray(m, dtype=np.int64)
    x = ((2 * n - m) * _C_Q16) // (2 * np.maximum(m, 1)) >> 16
    powers = np.int64(1) << np.arange(1, MAX_PARAMETER + 1, dtype=np.int64)
    return np.searchsorted(powers, np.where(m > 0, x, 0), side="right").astype(np.int64)


def encode(values: np.ndarray, params: np.ndarray) -> tuple[bytes, bytes]:
    """The remainder stream and the unary stream of ``values`` (int64 >= 0), each coded with its
    entry of ``params`` (int64, 0 .. MAX_PARAMETER)."""
    import numpy as np

    values = np.asarray(values, dtype=np.int64)
    params = np.asarray(params, dtype=np.int64)
    rem_parts = []
    for a, b, r in _runs(params):
        if r:
            w = _word(r)
            words = (values[a:b] & ((1 << r) - 1)).astype(f">u{w}")
            bits = np.unpackbits(words.view(np.uint8).reshape(-1, w), axis=1)
            rem_parts.append(bits[:, 8 * w - r :].reshape(-1))
    rem = np.packbits(np.concatenate(rem_parts)).tobytes() if rem_parts else b""
    lengths = (values >> params) + 1
    total = int(lengths.sum())
    unary_bits = np.ones(-(-total // 8) * 8, dtype=np.bool_)  # ones, padding included
    unary_bits[np.cumsum(lengths) - 1] = False  # each value's terminating zero
    return rem, np.packbits(unary_bits).tobytes()


def remainder_bytes(params: np.ndarray) -> int:
    """Bytes of the remainder stream for values coded with ``params``."""
    import numpy as np

    return -(-int(np.asarray(params, dtype=np.int64).sum()) // 8)


def decode(rem: np.ndarray, unary: np.ndarray, params: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(quotients, remainders)`` of the values coded with ``params`` (one entry per value) from the
    two streams (uint8 arrays): value = quotient << param | remainder. The caller bounds the
    quotients before it shifts them. :class:`CodeError` when either stream has other bits than
    ``len(params)`` values need (too few or too many codes, nonzero padding, trailing bytes)."""
    import numpy as np

    params = np.asarray(params, dtype=np.int64)
    count = params.size
    need = remainder_bytes(params)
    if rem.size != need:
        raise CodeError(f"remainder stream is {rem.size} bytes, its parameters need {need}")
    pad = 8 * need - int(params.sum())
    if pad and int(rem[-1]) & ((1 << pad) - 1):
        raise CodeError("remainder stream has nonzero padding")
    # each value's remainder: the 8 bytes from its first bit's byte, as one big-endian word, shifted
    offsets = np.cumsum(params) - params
    padded = np.concatenate([rem, np.zeros(8, dtype=np.uint8)])
    windows = np.lib.stride_tricks.sliding_window_view(padded, 8)[offsets >> 3]
    words = np.ascontiguousarray(windows).view(">u8").reshape(-1).astype(np.uint64)
    shifted = words << (offsets & 7).astype(np.uint64)
    coded = params > 0
    remainders = np.zeros(count, dtype=np.int64)
    remainders[coded] = (shifted[coded] >> (64 - params[coded]).astype(np.uint64)).astype(np.int64)
    bits = np.unpackbits(unary).view(np.bool_)
    zeros = np.flatnonzero(~bits)
    if zeros.size != count:
        raise CodeError(f"unary stream holds {zeros.size} codes, {count} expected")
    end = int(zeros[-1]) + 1 if count else 0
    if bits.size - end >= 8:
        raise CodeError(f"unary stream has {(bits.size - end) // 8} bytes after its last code")
    quotients = np.diff(zeros, prepend=-1) - 1
    return quotients.astype(np.int64), remainders


def _runs(params: np.ndarray) -> list[tuple[int, int, int]]:
    """``(start, stop, parameter)`` of each run of equal parameters."""
    import numpy as np

    if not params.size:
        return []
    edges = [0, *(np.flatnonzero(np.diff(params)) + 1).tolist(), params.size]
    return [(a, b, int(params[a])) for a, b in itertools.pairwise(edges)]


def _word(r: int) -> int:
    """Bytes of the smallest unsigned integer holding ``r`` bits."""
    return next(w for w in (1, 2, 4, 8) if 8 * w >= r)
