"""The bit-level helpers of the patch codec (``delta.py``): a tensor's raw bits and bytes, byte-plane
shuffles, order-preserving keys, the exponent classes of the hot elements. numpy and torch are imported
inside functions: importing this module stays cheap."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from echo2.errors import Echo2Error

if TYPE_CHECKING:
    import numpy as np
    import torch


class DeltaError(Echo2Error):
    """Weights or a patch do not fit together or are malformed; the message names what is wrong."""


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
_HOT_CLASSES = 10  # exponent classes of the hot elements, the lowest also takes all smaller exponents
_BLOCK_ELEMENTS = 1 << 24  # changed tensors coded together, at most (a larger tensor alone)
_SAMPLE_STRIDE = 61  # the cut is one below the median exponent of every 61st element
_CUT_OFFSET = -1
_MIN_CUT_ELEMENTS = 64  # fewer changed elements of a dtype (and other dtypes) have no hot elements


def _exponents(bits: np.ndarray, dtype: str) -> np.ndarray:
    """The exponent field of each element (uint8, or uint16 for float64)."""
    import numpy as np

    mant, ebits = _EXPONENT[dtype]
    field = bits.view(f"u{bits.itemsize}") >> mant  # sign and exponent
    if ebits == 8:
        return field.astype(np.uint8)  # drops the sign
    return (field & ((1 << ebits) - 1)).astype(np.uint8 if ebits < 8 else np.uint16)


def _cut(old_bits: np.ndarray, dtype: str) -> int:
    """The exponent below which elements are hot (their ulp is small, so they are likely to change):
    one below the median exponent of a sample of the base bits; 0 (none) for other dtypes and fewer
    than 64 elements."""
    import numpy as np

    if dtype not in _EXPONENT or old_bits.size < _MIN_CUT_ELEMENTS:
        return 0
    return max(0, int(np.median(_exponents(old_bits[::_SAMPLE_STRIDE], dtype))) + _CUT_OFFSET)


def _count_width_of(table: list[list[Any]]) -> int:
    """Bytes per class count in a patch: 4, or 8 when some tensor has 2**32 elements or more."""
    big = any(math.prod(row[2]) >= 1 << 32 for row in table)
    return 8 if big else 4


def _unpack(packed: np.ndarray, n: int, what: str) -> np.ndarray:
    import numpy as np

    bits = np.unpackbits(packed).view(np.bool_)
    if np.any(bits[n:]):
        raise DeltaError(f"patch {what} bits have nonzero padding")
    return bits[:n]


def _cat(arrays: list[np.ndarray], dtype: Any) -> np.ndarray:
    import numpy as np

    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)
