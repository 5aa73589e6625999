"""What the learner keeps of an older published version: the elements a publication changed, as they
were before it (an *undo*), instead of a whole copy.

The generation check re-runs a worker's completions with the weights of the version the worker
claims, any version still admissible (within ``S`` of the newest). Keeping each of them whole costs a
sampler copy (2 bytes per parameter in bf16) per admissible version; between two publications at
LLM-RL learning rates only a few percent of the bf16 elements move (``echo2.weights.delta``), so an
undo holds, per tensor, the ``b``-byte old values of the share ``f`` of elements that changed and
where they are: int32 positions (``4 f`` bytes per element; int64 for a tensor of 2**31 elements or
more) or a bit mask (1/8 byte per element), whichever is smaller, so ``b f + min(4 f, 1/8)`` bytes per
parameter; it rebuilds the older version from the newer one in one scatter per tensor. A tensor whose
undo would be no smaller than the tensor (a large step) is kept whole: an undo never exceeds a copy.

Unlike a patch, an undo is made and used only by the learner (never sent, never trusted from anyone):
plain positions and values, fast to make and to apply, no entropy coding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from echo2.weights.delta import DeltaError


@dataclass(frozen=True)
class Change:
    """One tensor's part of an undo: where it changed and the older values there."""

    where: torch.Tensor | None  # flat int positions ("sparse"), a packed bit mask ("mask"), None ("whole")
    values: torch.Tensor  # the older values at those positions, in order (the whole old tensor: "whole")
    kind: str  # "sparse" | "mask" | "whole"

    @property
    def nbytes(self) -> int:
        return (0 if self.where is None else self.where.nbytes) + self.values.nbytes


@dataclass(frozen=True)
class Undo:
    """Turns the weights of one version back into those of an older one, tensor by tensor."""

    changes: dict[str, Change]

    @classmethod
    def of(cls, new: Mapping[str, torch.Tensor], old: Mapping[str, torch.Tensor]) -> Undo:
        """The undo turning ``new`` into ``old`` (same names, shapes and dtypes, else DeltaError).
        Per changed tensor the smallest of: int32 positions (int64 from 2**31 elements) + values, a
        bit mask + values, or the old tensor whole."""
        import numpy as np
        import torch

        if set(new) != set(old):
            raise DeltaError(f"undo needs the same tensor names: {sorted(set(new) ^ set(old))[:5]} differ")
        changes: dict[str, Change] = {}
        for name, n in new.items():
            o = old[name]
            if n.dtype != o.dtype or n.shape != o.shape:
                raise DeltaError(
                    f"tensor {name}: {o.dtype} {tuple(o.shape)} before, {n.dtype} {tuple(n.shape)} now"
                )
            flat_o = o.reshape(-1)
            differ = _int_view(n.reshape(-1)) != _int_view(flat_o)  # bits: -0.0, NaN payloads exact
            count, size, width = int(differ.sum()), n.numel(), n.element_size()
            if count == 0:
                continue
            index_width = 4 if size < 2**31 else 8
            sparse, mask = count * index_width, -(-size // 8)
            if min(sparse, mask) + count * width >= size * width:  # no smaller than the tensor
                changes[name] = Change(None, o.clone(memory_format=torch.contiguous_format), "whole")
            elif sparse <= mask:
                pos = differ.nonzero().squeeze(1)
                where = pos.to(torch.int32 if index_width == 4 else torch.int64)
                changes[name] = Change(where, flat_o[pos].clone(), "sparse")
            else:
                bits = torch.from_numpy(np.packbits(differ.cpu().numpy()))
                changes[name] = Change(bits, flat_o[differ].clone(), "mask")
        return cls(changes)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.changes.values())

    def apply(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The older weights, from ``weights`` (those of the newer version): :func:`rebuild` of one."""
        return rebuild(weights, [self])


def rebuild(newest: Mapping[str, torch.Tensor], undos: Sequence[Undo]) -> dict[str, torch.Tensor]:
    """The weights of an older version from the newest and the undos from it back to that version, in
    order (newest first), as a new dict: a tensor an undo changes in place is copied once, one it keeps
    whole is shared with the undo, the others with ``newest``; neither is ever written to."""
    import numpy as np
    import torch

    out = dict(newest)
    owned: set[str] = set()  # tensors copied here (the only ones written to)
    for undo in undos:
        for name, c in undo.changes.items():
            if c.where is None:
                out[name] = c.values
                owned.discard(name)
                continue
            if name not in owned:
                out[name] = out[name].clone(memory_format=torch.contiguous_format)
                owned.add(name)
            flat = out[name].view(-1)
            if c.kind == "sparse":
                flat[c.where.long()] = c.values
            else:
                bits = np.unpackbits(c.where.numpy(), count=flat.numel()).view(np.bool_)
                flat[torch.from_numpy(bits).to(flat.device)] = c.values
    return out


def _int_view(t: torch.Tensor) -> torch.Tensor:
    import torch

    by_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(by_size[t.element_size()]) if t.dtype != torch.bool else t
