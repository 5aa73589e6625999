"""Seeded Gumbel-max sampling: a draw anyone holding the weights can re-derive from the seed.

A worker is a stranger's machine, so the learner must be able to confirm that a completion is the one
the claimed weights and the lease's seed produce. Sampling is therefore Gumbel-max with noise that is
a pure function of ``(seed, row, step, token)``: at step ``n`` row ``r`` takes

    argmax_v  nucleus_p(logits / T)[v] + g(seed, r, n, v),    g = -log(-log(u)),  u ~ U(0, 1)

which is an exact draw from the temperature-scaled, nucleus-truncated distribution (the Gumbel-max
trick), and whose noise the learner recomputes for any single step without replaying the others
(:func:`gumbel_noise`). The uniforms come from a counter-based integer hash evaluated in int64 with
32-bit lanes (every product stays below 2**63), so they are the same bits on every device; only the
final ``log`` may differ by an ulp, which the learner's tolerance absorbs.

The noise is predictable to whoever knows the seed; that is harmless: it fixes *which* token the
claimed weights must have chosen, it does not let a worker choose another one.

The uniforms take 23 bits, ``u = (b + 0.5) / 2**23`` for ``b`` in ``[0, 2**23)``: every one is exact
in float32 (with 24 bits the top one, ``1 - 2**-25``, rounds to 1.0, whose noise is ``+inf``: a token
drawn whatever its probability, at ``V / 2**24`` of all steps). So the noise lies in
``[GUMBEL_MIN, GUMBEL_MAX]`` = ``[-log(-log(2**-24)), -log(-log(1 - 2**-24))]`` ~ ``[-2.81, 16.64]``,
and a drawn token's scaled logit is at most ``GUMBEL_MAX - GUMBEL_MIN`` below the best one's (the
best token is always in the nucleus). Its log-prob under the temperature-scaled distribution is
therefore at least ``-(GUMBEL_MAX - GUMBEL_MIN) - ln V``: :func:`min_drawn_logprob`, the bound the
learner holds every submitted sampler log-prob to (``data/submission.py``).
"""

from __future__ import annotations

import math

import torch

_MASK = 0xFFFFFFFF
_M1 = 0x7FEB352D  # odd multipliers below 2**31: x (< 2**32) * M stays below 2**63 in int64
_M2 = 0x5BD1E995
_STRIDE = 0x61C88647  # spreads consecutive counters (token ids, rows, steps) over the 32-bit lanes
_BITS = 23  # uniform bits per draw: (b + 0.5) / 2**23 is exact in float32 for every b < 2**23
_U_SCALE = 1.0 / (1 << _BITS)
GUMBEL_MIN = -math.log(-math.log(0.5 * _U_SCALE))  # noise of the smallest uniform, ~ -2.81
GUMBEL_MAX = -math.log(-math.log1p(-0.5 * _U_SCALE))  # noise of the largest uniform, ~ 16.64
CPU_BLOCK = 1 << 18  # values of noise computed at once on a CPU (2 MiB of int64 hash state)
DEVICE_BLOCK = 1 << 24  # on an accelerator: few launches, and at most 256 MiB of hash state besides the noise
LOGPROB_SLACK = 1.0  # nats below the bound still accepted: a bf16 engine's log-probs are off by ~0.2


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) of int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK
    return x ^ (x >> 15)


def _mix_(x: torch.Tensor, tmp: torch.Tensor) -> None:
    """:func:`_mix` in place on ``x`` (``tmp``: a scratch tensor of its shape): the same bits, with no
    tensor allocated per operation."""
    for shift, mult in ((16, _M1), (15, _M2), (16, _M1)):
        x ^= torch.bitwise_right_shift(x, shift, out=tmp)
        x.mul_(mult).bitwise_and_(_MASK)
    x ^= torch.bitwise_right_shift(x, 15, out=tmp)


def _key(seed: int, rows: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row for ``(seed, row, step)`` (``step`` an int, or one per row)."""
    lo, hi = seed & _MASK, (seed >> 32) & _MASK
    k = _mix(torch.tensor(hi, dtype=torch.int64, device=rows.device)) ^ lo
    k = _mix(k) ^ ((rows.to(torch.int64) * _STRIDE) & _MASK)
    return _mix(_mix(k) ^ ((step * _STRIDE) & _MASK))


def gumbel_noise(seed: int, rows: torch.Tensor, step: int | torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise ``[len(rows), vocab]`` (float32) for sampling step ``step`` of the given
    rows of a generation seeded with ``seed`` (a non-negative integer below 2**64). ``step`` may be a
    tensor of one step per row: the learner takes every step of one row in one call.

    Computed in place, block by block (on a CPU, blocks of :data:`CPU_BLOCK` values, which stay in the
    cache through the hash's passes; elsewhere :data:`DEVICE_BLOCK`, so that a vLLM step of hundreds of
    rows at a 152k vocabulary holds two blocks of hash state, not two ``[rows, V]`` int64 tensors beside
    the engine's reserved memory): the bits do not depend on the blocks. At a Qwen3 vocabulary, 0.05 s
    a step for 64 rows on two cores where the formula computed whole took 0.49 s (``check_scale.py
    --study noise``); ``tests/unit/test_verify_generation.py`` holds it to the formula, bit for bit."""
    if seed < 0:
        raise ValueError(f"seed: {seed} must be >= 0")
    dev = rows.device
    key_B1 = _key(seed, rows, step)[:, None]
    tokens_1V = ((torch.arange(vocab, dtype=torch.int64, device=dev) * _STRIDE) & _MASK)[None, :]
    noise_BV = torch.empty((len(key_B1), vocab), dtype=torch.float32, device=dev)
    block = CPU_BLOCK if dev.type == "cpu" else DEVICE_BLOCK
    cols = max(1, min(vocab, block))
    per = max(1, block // cols)  # whole rows a block when a row fits in one
    x = torch.empty((min(per, len(key_B1)), cols), dtype=torch.int64, device=dev)
    tmp = torch.empty_like(x)
    for i in range(0, len(key_B1), per):
        for j in range(0, vocab, cols):
            k_b1, t_1c, out = (
                key_B1[i : i + per],
                tokens_1V[:, j : j + cols],
                noise_BV[i : i + per, j : j + cols],
            )
            xb, tb = x[: len(k_b1), : t_1c.shape[1]], tmp[: len(k_b1), : t_1c.shape[1]]
            torch.bitwise_xor(k_b1, t_1c, out=xb)
            _mix_(xb, tb)
            xb >>= 32 - _BITS  # 23 uniform bits
            out.copy_(xb).add_(0.5).mul_(_U_SCALE)  # u in (0, 1), never 0 or 1, exact in float32
            out.log_().neg_().log_().neg_()  # -log(-log(u))
    return noise_BV


def min_drawn_logprob(vocab_size: int) -> float:
    """The lowest log-prob (temperature-scaled, natural log) a token drawn by :func:`gumbel_draw` can
    have at a vocabulary of ``vocab_size``, less :data:`LOGPROB_SLACK`: a drawn token ``t`` beat the
    best token ``b`` (``s_t + g_t >= s_b + g_b``), so ``s_t >= max s - (GUMBEL_MAX - GUMBEL_MIN)``, and
    ``log p_t = s_t - logsumexp(s) >= s_t - max s - ln V``. At V = 151,936 (Qwen3) it is -32.4."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size: {vocab_size} must be >= 1")
    return -(GUMBEL_MAX - GUMBEL_MIN) - math.log(vocab_size) - LOGPROB_SLACK


def nucleus_mass_before(logits_BV: torch.Tensor) -> torch.Tensor:
    """For every token, the probability mass of the tokens strictly more likely than it (in the order
    nucleus truncation keeps them); a token is in the top-p nucleus iff this is below ``top_p``."""
    sorted_BV, order_BV = torch.sort(logits_BV, dim=-1, descending=True)
    probs_BV = torch.softmax(sorted_BV, dim=-1)
    before_sorted_BV = probs_BV.cumsum(dim=-1) - probs_BV
    return torch.empty_like(before_sorted_BV).scatter(-1, order_BV, before_sorted_BV)


def top_p_filter(logits_BV: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside the smallest set whose probability mass reaches ``top_p``
    (the most likely token always stays)."""
    if top_p >= 1.0:
        return logits_BV
    return logits_BV.masked_fill(nucleus_mass_before(logits_BV) >= top_p, float("-inf"))


def gumbel_draw(
    scaled_logits_BV: torch.Tensor, top_p: float, seed: int, rows: torch.Tensor, step: int | torch.Tensor
) -> torch.Tensor:
    """The token each row draws at ``step`` (one for all rows, or one per row): Gumbel-max over the
    nucleus of temperature-scaled logits."""
    noise_BV = gumbel_noise(seed, rows, step, scaled_logits_BV.shape[-1]).to(scaled_logits_BV.device)
    return (top_p_filter(scaled_logits_BV, top_p) + noise_BV).argmax(dim=-1)
