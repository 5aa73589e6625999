"""The generation check's rule at one completion position (SPEC §10: no free tokens), and the
distributions of what it measured.

At position ``n`` of row ``r`` the claimed version's weights give temperature-scaled logits ``s`` and
the lease's seed gives Gumbel noise ``g`` (``rollout/sampling.py``); the seeded draw is
``d = argmax_v nucleus(s)[v] + g[v]``. The claimed token ``t`` **passes** iff

1. its claimed sampler log-prob is within ``logprob_tolerance`` of ``log softmax(s)[t]``, and
2. ``t = d``, the check's own draw, or ``t`` is a **declared numerical near tie**: its perturbed score
   ``s[t] + g[t]`` is within ``gumbel_tolerance`` (the margin of the check's precision,
   ``config.ENGINE_TOLERANCES``) of the best perturbed score of the tokens surely in the nucleus, and
   ``t`` is in the nucleus up to ``NUCLEUS_SLACK`` of probability mass, **and the grader does not read
   ``t``** (the caller says from which position it reads: ``Verifier.graded_from``).

A position failing 1 or 2 is a **miss**, and one miss makes the completion a forgery: no share of a
completion may miss. A near tie on a token the grader reads is no forgery (honest rounding makes them)
and is not accepted either: the caller drops the submission untrained (``graded_tie``).

What the rule leaves an attacker is the **room**: the positions where a token other than the draw has a
perturbed score within the margin of the best. There, and only there, it may submit that token instead;
:func:`judge` counts them, so a run reports how much choice its margin leaves (docs/security.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

NUCLEUS_SLACK = 1e-3  # probability mass of slack given to the top-p boundary (numerical noise)
_EDGES = [0.0] + [10.0 ** (k / 4) for k in range(-36, 5)]  # 0, 1e-9 ... 10 (four bins a decade), then more


@dataclass(frozen=True)
class Positions:
    """What one chunk of positions gave."""

    error_c: torch.Tensor  # |claimed - recomputed| sampler log-prob
    exact_c: torch.Tensor  # the token is the check's own seeded draw
    near_c: torch.Tensor  # not the draw, but a declared near tie (within the margin, in the nucleus)
    deficit_c: torch.Tensor  # best perturbed score (surely in the nucleus) - the token's (<= 0: the best)
    room_c: torch.Tensor  # a token other than the draw lies within the margin of the best: room to choose
    gap_c: torch.Tensor  # best - second best perturbed score of the tokens surely in the nucleus (inf: one)


def judge(
    scaled_cV: torch.Tensor,
    noise_cV: torch.Tensor,
    tok_c: torch.Tensor,
    logp_c: torch.Tensor,
    claimed_c: torch.Tensor,
    top_p: float,
    margin: float,
) -> Positions:
    """The rule above at ``c`` positions: temperature-scaled logits ``scaled_cV`` (overwritten: they
    become the perturbed scores, so no second ``[c, V]`` tensor exists), their noise, the claimed tokens,
    the recomputed and the claimed log-probs of those tokens, the nucleus ``top_p`` and the draw margin."""
    from echo2.rollout.sampling import nucleus_mass_before

    c = tok_c.shape[0]
    if top_p < 1.0:
        before_cV = nucleus_mass_before(scaled_cV)
        maybe_in_c = before_cV.gather(-1, tok_c[:, None]).squeeze(-1) < top_p + NUCLEUS_SLACK
        out_cV = (before_cV >= top_p) & (before_cV != 0)  # the check's own nucleus (the best always in)
        unsure_cV = (before_cV >= top_p - NUCLEUS_SLACK) & ~out_cV & (before_cV != 0)  # near its edge
        del before_cV
    else:
        maybe_in_c = torch.ones(c, dtype=torch.bool, device=tok_c.device)
    scores_cV = scaled_cV.add_(noise_cV)
    chosen_c = scores_cV.gather(-1, tok_c[:, None]).squeeze(-1)
    if top_p < 1.0:
        scores_cV.masked_fill_(out_cV, float("-inf"))
    draw_c = scores_cV.argmax(dim=-1)
    if top_p < 1.0:
        scores_cV.masked_fill_(unsure_cV, float("-inf"))  # now only the tokens surely in
        del out_cV, unsure_cV
    top2_c2 = scores_cV.topk(min(2, scores_cV.shape[-1]), dim=-1).values
    best_c = top2_c2[:, 0]
    deficit_c = best_c - chosen_c
    exact_c = tok_c == draw_c
    near_c = ~exact_c & maybe_in_c & (deficit_c <= margin)
    second_c = top2_c2[:, -1] if top2_c2.shape[-1] > 1 else torch.full_like(best_c, -math.inf)
    gap_c = best_c - second_c
    room_c = (gap_c <= margin) | near_c
    return Positions((logp_c - claimed_c).abs(), exact_c, near_c, deficit_c, room_c, gap_c)


class LogHistogram:
    """Counts of non-negative numbers in log-spaced bins (four a decade from 1e-9 to 10, one below, one
    above) and the largest seen: the distribution of a per-position error in bounded memory."""

    def __init__(self) -> None:
        self.edges = torch.tensor(_EDGES, dtype=torch.float64)
        self.counts = [0] * (len(_EDGES) + 1)  # bin k: edges[k-1] < x <= edges[k]; the last: above 10
        self.n = 0
        self.max = 0.0

    def add(self, x: torch.Tensor) -> None:
        if x.numel() == 0:
            return
        x = x.detach().to("cpu", torch.float64).clamp_min(0.0)
        for k, n in zip(*torch.bucketize(x, self.edges).unique(return_counts=True), strict=True):
            self.counts[int(k)] += int(n)
        self.n += x.numel()
        self.max = max(self.max, float(x.max()))

    def quantile(self, q: float) -> float:
        """An upper bound of the ``q``-quantile: the upper edge of its bin (the largest seen, above 10)."""
        if self.n == 0:
            return 0.0
        need, seen = q * self.n, 0
        for k, n in enumerate(self.counts):
            seen += n
            if seen >= need and n:
                return min(self.max, _EDGES[k]) if k < len(_EDGES) else self.max
        return self.max

    def at_most(self, x: float) -> int:
        """How many were at most ``x``'s bin's upper edge (an upper bound of how many were at most ``x``)."""
        k = int(torch.bucketize(torch.tensor([x], dtype=torch.float64), self.edges)[0])
        return sum(self.counts[: k + 1])

    def above(self, x: float) -> int:
        """How many exceeded ``x``'s bin (an upper bound of how many exceeded ``x``)."""
        k = int(torch.bucketize(torch.tensor([x], dtype=torch.float64), self.edges)[0])
        return sum(self.counts[k:])

    def to_dict(self) -> dict[str, object]:
        return {"edges": _EDGES, "counts": list(self.counts), "n": self.n, "max": self.max}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LogHistogram:
        """The histogram :meth:`to_dict` wrote (its bins must be this class's: ValueError otherwise)."""
        if list(d["edges"]) != list(_EDGES) or len(d["counts"]) != len(_EDGES) + 1:
            raise ValueError("a histogram written with other bins cannot be read into these")
        h = cls()
        h.counts, h.n, h.max = [int(c) for c in d["counts"]], int(d["n"]), float(d["max"])
        return h

    def merge(self, other: LogHistogram) -> None:
        """Add ``other``'s counts to these (samples pooled: its bins are the same)."""
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.n += other.n
        self.max = max(self.max, other.max)
