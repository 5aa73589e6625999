"""GRPO as pure tensor functions (no I/O, no clock, no model), with the off-policy corrections of
the paper's App. D. Shapes are suffixes: ``P`` prompts, ``G`` group size, ``B`` sequences
(``B = P*G``), ``T`` completion tokens.

Three policies meet in one update:
  - the *sampler* (behaviour) policy that generated ``y``, possibly ``Δ`` versions old:
    ``logp_sampler``;
  - the *proximal* policy, the learner's weights at the start of this update: ``logp_prox``
    (detached; equal to the current policy on the first minibatch);
  - the current policy being optimised: ``logp``.

Per token (``A`` the sequence's group advantage), with the clip anchored at the proximal policy
(``clip_anchor="proximal"``, the decoupled objective)::

    w      = min(exp(logp_prox - logp_sampler), C)                 truncated IS weight (detached)
    ratio  = exp(logp - logp_prox)
    pg     = -w * min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)  PPO clipped surrogate
    kl     = exp(logp_ref - logp) - (logp_ref - logp) - 1          k3 estimator, >= 0
    loss_t = pg + beta * kl

or anchored at the sampler (``clip_anchor="sampler"``, the coupled objective; the default)::

    ratio  = exp(logp - logp_sampler)
    surr   = min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)
    pg     = -(max(surr, C * A) if A < 0 else surr)                 dual clip bounds A < 0 by C

The decoupled form has a trust region only between minibatches of one update: with one minibatch
``ratio == 1`` and a stale token is only reweighted by ``w``. The coupled form clips against the policy
that generated the token, so a token the learner has already moved past ``1 +- eps`` since then adds no
more gradient in that direction. On fresh data (``logp_sampler == logp_prox``) both are the same.

Log-ratios are clamped to ``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]`` (20 nats) before ``exp``: the
sampler's log-probs come from strangers' machines, and an admitted ``logp_sampler`` of -100 would
make ``exp`` overflow float32 (``inf * 0 = nan`` in the loss at ``A = 0``, ``0 * inf`` in its gradient).
Beyond ``e^20`` the clip already holds every token (``C <= 1e8 < e^20`` and ``1 + eps < e^20``: the
surrogate is ``(1 + eps) A`` or ``C A`` there, with no gradient), so the clamp changes neither the loss
nor its gradient; below ``e^-20`` it moves them by less than ``2e-9 |A|``.

The menu (``[grpo]``; presets in ``config/training.py``), each term below with its source:

- **clip-higher** (DAPO, Yu et al. 2025, eq. 10): ``clip(ratio, 1 - eps_low, 1 + eps_high)`` with
  ``eps_low != eps_high`` (``clip_eps`` is both when neither is given).
- **sequence-level ratio** (GSPO, Zheng et al. 2025, eq. 7; ``ratio_level="sequence"``)::

      s_i = exp((1 / |y_i|) sum_t (logp_t - logp_old_t))      the length-normalised geometric mean

  used in place of the token ratio at every token of sequence ``i`` (its gradient flows through the
  mean, so with ``seq-mean-token-mean`` the loss is GSPO's ``-(1/G) sum_i min(s_i A_i, clip(s_i) A_i)``).
- **CISPO** (MiniMax-M1, 2025, eq. 4; ``policy_loss="cispo"``): no min, a clipped, stop-gradient IS
  weight on the log-prob, so no token's gradient is dropped::

      pg_t = -sg(clip(ratio_t, 1 - eps_low, 1 + eps_high)) * A * logp_t

- **masked IS** for the sampler/learner mismatch (decoupled anchor only, ``is_mode`` / ``is_level``):
  ``rho`` is ``exp(logp_prox - logp_sampler)`` per token (``token``), its product over the sequence
  (``sequence``, seq-TIS) or its geometric mean (``geometric``, the sequence mask of IcePop / MIS);
  ``truncate`` weighs by ``min(rho, C)``, ``mask`` by ``rho`` inside ``[1/C, C]`` and 0 outside.
- **off-policy sequence masking** (DeepSeek-V3.2, 2025, eq. 9; ``offpolicy_delta``): a sequence with
  ``A < 0`` whose mean ``logp_sampler - logp`` exceeds ``delta`` carries no policy-gradient loss.

Group advantage (GRPO): ``A_i = (r_i - mean_G r) / (std_G r + eps)`` (or without the std division,
Dr. GRPO style, when ``scale_by_std=False``). A group whose rewards are all equal carries no signal
and gets ``A = 0``.

Loss aggregation (``loss_agg``), over valid tokens ``m_bt``:
  - ``token-mean`` (default; DAPO): ``Σ_bt m·l / Σ_bt m`` — every token weighs the same, so long
    completions are not down-weighted;
  - ``seq-mean-token-mean`` (original GRPO): ``mean_b (Σ_t m·l / Σ_t m)``;
  - ``seq-mean-token-sum-norm`` (Dr. GRPO): ``Σ_bt m·l / (B · T_max)`` with a constant ``T_max`` (the
    longest completion the sampler may produce, ``sampling.max_new_tokens``), never the batch's own
    padded width, so a token's weight does not depend on which other completions share its batch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSSES = ("ppo", "cispo")
RATIO_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")
IS_LEVELS = ("token", "sequence", "geometric")
LOG_RATIO_BOUND = 20.0  # |log-ratio| clamp before exp (module docstring): e^20 ~ 4.9e8, far inside float32
CLIP_ANCHORS = ("sampler", "proximal")


def group_advantages(rewards_PG: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages ``A_pg = (r_pg - mean_g r_pg) / (std_g r_pg + eps)``.

    ``std`` is the population std (``unbiased=False``), so a group of two rewards {0, 1} gets
    advantages {-1, +1}·(0.5 / (0.5 + eps)).
    """
    if rewards_PG.dim() != 2 or rewards_PG.shape[1] < 2:
        raise ValueError(f"rewards_PG must be [P, G] with G >= 2, got shape {tuple(rewards_PG.shape)}")
    centred_PG = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centred_PG
    std_P1 = rewards_PG.std(dim=1, unbiased=False, keepdim=True)
    return centred_PG / (std_P1 + eps)


def truncated_is_weights(
    logp_prox_BT: torch.Tensor, logp_sampler_BT: torch.Tensor, cap: float
) -> torch.Tensor:
    """``w = min(exp(logp_prox - logp_sampler), cap)``, detached: corrects for sampling with an older
    policy while bounding the variance a very stale token can inject (:func:`is_weights` per token)."""
    return is_weights(logp_prox_BT, logp_sampler_BT, torch.ones_like(logp_prox_BT), cap)


def sequence_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """``[B, 1]``: the mean of ``x`` over each sequence's valid tokens (0 for a sequence with none)."""
    return (x_BT * mask_BT).sum(-1, keepdim=True) / mask_BT.sum(-1, keepdim=True).clamp(min=1.0)


def is_weights(
    logp_prox_BT: torch.Tensor,
    logp_sampler_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    cap: float,
    mode: str = "truncate",
    level: str = "token",
) -> torch.Tensor:
    """The importance weight sampler -> learner of the decoupled objective (module docstring: masked
    IS), detached, ``[B, T]``: ``rho`` per token, per sequence (the product of its tokens') or their
    geometric mean, then ``min(rho, cap)`` (``truncate``) or ``rho`` inside ``[1/cap, cap]`` and 0
    outside (``mask``)."""
    if mode not in IS_MODES or level not in IS_LEVELS:
        raise ValueError(f"is_mode must be one of {IS_MODES} and is_level one of {IS_LEVELS}")
    log_rho_BT = (logp_prox_BT - logp_sampler_BT).detach() * mask_BT
    if level == "sequence":
        log_rho_BT = log_rho_BT.sum(-1, keepdim=True).expand_as(log_rho_BT)
    elif level == "geometric":
        log_rho_BT = sequence_mean(log_rho_BT, mask_BT).expand_as(log_rho_BT)
    rho_BT = _exp_ratio(log_rho_BT)
    if mode == "truncate":
        return rho_BT.clamp(max=cap)
    return rho_BT * ((rho_BT <= cap) & (rho_BT >= 1.0 / cap)).to(rho_BT.dtype)


def policy_ratio(
    logp_BT: torch.Tensor, logp_old_BT: torch.Tensor, mask_BT: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    """``exp(logp - logp_old)`` per token, or GSPO's length-normalised sequence ratio ``s_i`` at every
    token of sequence ``i`` (``level="sequence"``; its gradient flows through the mean)."""
    if level == "token":
        return _exp_ratio(logp_BT - logp_old_BT)
    if level != "sequence":
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {level!r}")
    return _exp_ratio(sequence_mean(logp_BT - logp_old_BT, mask_BT)).expand_as(logp_BT)


def _exp_ratio(log_ratio_BT: torch.Tensor) -> torch.Tensor:
    """``exp`` of a log-ratio clamped to ``+-LOG_RATIO_BOUND`` (finite for any finite or infinite input)."""
    return torch.exp(log_ratio_BT.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def kl_k3(logp_BT: torch.Tensor, logp_ref_BT: torch.Tensor) -> torch.Tensor:
    """Per-token ``KL(π || π_ref)`` estimator ``k3 = exp(d) - d - 1`` with ``d = logp_ref - logp``
    (unbiased, always >= 0; Schulman 2020)."""
    d_BT = logp_ref_BT - logp_BT
    return torch.exp(d_BT) - d_BT - 1.0


@dataclass(frozen=True)
class Norm:
    """The denominators of the loss aggregation. Taken over a whole minibatch (``Norm.of`` its mask),
    they let each micro-batch's loss be its share of the minibatch's: the micro-batches' losses (and
    gradients) add up to the unbatched ones exactly, in every mode."""

    tokens: float  # valid tokens of the minibatch, Σ_bt m (at least 1)
    seqs: int  # sequences of the minibatch, B

    @classmethod
    def of(cls, mask_BT: torch.Tensor) -> Norm:
        return cls(tokens=max(float(mask_BT.sum()), 1.0), seqs=int(mask_BT.shape[0]))


def aggregate(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str,
    max_tokens: int | None = None,
    norm: Norm | None = None,
) -> torch.Tensor:
    """One scalar from per-token losses (see module docstring for the three modes); ``max_tokens`` is
    the constant ``T_max`` of ``seq-mean-token-sum-norm`` (required there, at least the batch width);
    ``norm`` the denominators when these rows are part of a larger minibatch (default: their own)."""
    mask_BT = mask_BT.to(loss_BT.dtype)
    norm = norm or Norm.of(mask_BT)
    if mode == "token-mean":
        return (loss_BT * mask_BT).sum() / norm.tokens
    if mode == "seq-mean-token-mean":
        per_seq_B = (loss_BT * mask_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1.0)
        return per_seq_B.sum() / norm.seqs
    if mode == "seq-mean-token-sum-norm":
        if max_tokens is None or max_tokens < loss_BT.shape[1]:
            raise ValueError(
                f"seq-mean-token-sum-norm needs a constant max_tokens >= the batch width "
                f"{loss_BT.shape[1]}, got {max_tokens!r}"
            )
        return (loss_BT * mask_BT).sum() / (norm.seqs * max_tokens)
    raise ValueError(f"loss_agg must be one of {LOSS_AGG_MODES}, got {mode!r}")


@dataclass(frozen=True)
class LossStats:
    """Diagnostics of one loss evaluation (plain floats, detached)."""

    pg_loss: float  # aggregated policy-gradient loss
    kl: float  # aggregated k3 KL to the reference (0 when beta == 0 and no reference given)
    clipfrac: float  # share of valid tokens where the clip was active (PPO) or the IS weight clipped (CISPO)
    is_weight_mean: float  # mean IS weight sampler -> learner over valid tokens (the ratio when coupled)
    is_truncated_frac: float  # share of valid tokens whose IS weight hit the cap, or was masked (mask mode)
    clipfrac_low: float = 0.0  # of clipfrac, tokens clipped at 1 - eps_low
    clipfrac_high: float = 0.0  # of clipfrac, tokens clipped at 1 + eps_high
    masked_seq_frac: float = 0.0  # share of sequences off-policy sequence masking left out
    mismatch_kl: float = math.nan  # k3 KL(sampler || learner) over fresh tokens (nan: none)
    fresh_tokens: float = 0.0  # valid tokens of sequences sampled at the learner's version
    entropy: float = math.nan  # mean -logp_prox over fresh tokens: a Monte-Carlo estimate of the entropy
    # per fresh sequence with valid tokens: (its row in these rows, its k3 sum, its fresh tokens), so the
    # mismatch KL can be read per worker (``trainer.UpdateStats.mismatch_by_group``)
    seq_mismatch: tuple[tuple[int, float, float], ...] = ()


@dataclass(frozen=True)
class Objective:
    """The policy objective's settings (``[grpo]``; the module docstring defines each)."""

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    is_cap: float = 2.0
    kl_beta: float = 0.0
    loss_agg: str = "token-mean"
    clip_anchor: str = "sampler"
    ratio_level: str = "token"
    policy_loss: str = "ppo"
    is_mode: str = "truncate"
    is_level: str = "token"
    offpolicy_delta: float | None = None

    def check(self) -> None:
        for name, value, allowed in (
            ("clip_anchor", self.clip_anchor, CLIP_ANCHORS),
            ("ratio_level", self.ratio_level, RATIO_LEVELS),
            ("policy_loss", self.policy_loss, POLICY_LOSSES),
            ("is_mode", self.is_mode, IS_MODES),
            ("is_level", self.is_level, IS_LEVELS),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def grpo_loss(
    logp_BT: torch.Tensor,
    logp_prox_BT: torch.Tensor,
    logp_sampler_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_eps: float | None = None,
    is_cap: float | None = None,
    kl_beta: float | None = None,
    logp_ref_BT: torch.Tensor | None = None,
    loss_agg: str | None = None,
    clip_anchor: str | None = None,
    objective: Objective | None = None,
    max_tokens: int | None = None,
    norm: Norm | None = None,
    fresh_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The objective of the module docstring (``objective``, or the plain GRPO of ``clip_eps``,
    ``is_cap``, ``kl_beta``, ``loss_agg``, ``clip_anchor`` over it); returns the scalar loss and its
    diagnostics. ``max_tokens`` is the constant normaliser of ``loss_agg="seq-mean-token-sum-norm"``;
    ``norm`` the aggregation's denominators when these rows are a micro-batch of a larger minibatch (the
    loss is then this micro-batch's share; the diagnostics' shares and means stay over its own tokens).
    ``fresh_B``: the sequences sampled at the learner's version (the mismatch KL is read over them)."""
    obj = _objective(objective, clip_eps, is_cap, kl_beta, loss_agg, clip_anchor)
    if obj.kl_beta > 0.0 and logp_ref_BT is None:
        raise ValueError("kl_beta > 0 needs logp_ref_BT")
    logp_prox_BT, logp_sampler_BT = logp_prox_BT.detach(), logp_sampler_BT.detach()
    mask_BT = mask_BT.to(logp_BT.dtype)
    A_B1 = advantages_B[:, None].to(logp_BT.dtype)
    lo, hi = 1.0 - obj.clip_eps_low, 1.0 + obj.clip_eps_high
    decoupled = obj.clip_anchor == "proximal"
    old_BT = logp_prox_BT if decoupled else logp_sampler_BT
    ratio_BT = policy_ratio(logp_BT, old_BT, mask_BT, obj.ratio_level)
    w_BT = is_weights(logp_prox_BT, logp_sampler_BT, mask_BT, obj.is_cap, obj.is_mode, obj.is_level)
    if not decoupled:
        w_BT = ratio_BT.detach()  # reported only: the ratio carries the IS
    if obj.policy_loss == "cispo":
        clipped_BT = ratio_BT.detach().clamp(lo, hi)
        pg_BT = -clipped_BT * A_B1 * logp_BT
        low_BT, high_BT = ratio_BT.detach() < lo, ratio_BT.detach() > hi
    else:
        surr1_BT, surr2_BT = ratio_BT * A_B1, ratio_BT.clamp(lo, hi) * A_B1
        surr_BT = torch.minimum(surr1_BT, surr2_BT)
        active_BT = (surr2_BT < surr1_BT).detach()  # the clip bound was the minimum
        low_BT, high_BT = active_BT & (ratio_BT.detach() < lo), active_BT & (ratio_BT.detach() > hi)
        if decoupled:
            pg_BT = -surr_BT
        else:  # dual clip: a stale token with A < 0 and a large ratio cannot dominate the update
            pg_BT = -torch.where(A_B1 < 0, torch.maximum(surr_BT, obj.is_cap * A_B1), surr_BT)
    if decoupled:
        pg_BT = w_BT * pg_BT
    kept_B1 = _offpolicy_kept(logp_BT, logp_sampler_BT, mask_BT, A_B1, obj.offpolicy_delta)
    pg = aggregate(pg_BT * kept_B1, mask_BT, obj.loss_agg, max_tokens, norm)

    kl = torch.zeros((), dtype=logp_BT.dtype, device=logp_BT.device)
    if logp_ref_BT is not None:
        kl = aggregate(kl_k3(logp_BT, logp_ref_BT.detach()), mask_BT, obj.loss_agg, max_tokens, norm)
    flags = (w_BT, low_BT, high_BT, kept_B1)
    stats = _stats(pg, kl, mask_BT, flags, logp_prox_BT, logp_sampler_BT, fresh_B, obj)
    return pg + obj.kl_beta * kl, stats


def _objective(
    objective: Objective | None,
    clip_eps: float | None,
    is_cap: float | None,
    kl_beta: float | None,
    loss_agg: str | None,
    clip_anchor: str | None,
) -> Objective:
    """``objective`` (default: plain GRPO) with the named settings given over it, checked."""
    obj = objective or Objective()
    given: dict[str, Any] = {
        "is_cap": is_cap, "kl_beta": kl_beta, "loss_agg": loss_agg, "clip_anchor": clip_anchor,
        "clip_eps_low": clip_eps, "clip_eps_high": clip_eps,
    }  # fmt: skip
    obj = dataclasses.replace(obj, **{k: v for k, v in given.items() if v is not None})
    obj.check()
    return obj


def _offpolicy_kept(
    logp_BT: torch.Tensor,
    logp_sampler_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    A_B1: torch.Tensor,
    delta: float | None,
) -> torch.Tensor:
    """``[B, 1]``: 0 for a sequence off-policy sequence masking leaves out (``A < 0`` and its mean
    ``logp_sampler - logp`` over ``delta``), else 1 (all 1 without ``delta``)."""
    if delta is None:
        return torch.ones_like(A_B1)
    drift_B1 = sequence_mean((logp_sampler_BT - logp_BT).detach(), mask_BT)
    return (~((A_B1 < 0) & (drift_B1 > delta))).to(A_B1.dtype)


def _stats(
    pg: torch.Tensor,
    kl: torch.Tensor,
    mask_BT: torch.Tensor,
    flags: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    logp_prox_BT: torch.Tensor,
    logp_sampler_BT: torch.Tensor,
    fresh_B: torch.Tensor | None,
    obj: Objective,
) -> LossStats:
    """The diagnostics of one evaluation: ``flags`` are the IS weights, the tokens clipped low and high,
    and the sequences off-policy masking kept."""
    w_BT, low_BT, high_BT, kept_B1 = flags
    with torch.no_grad():
        n = mask_BT.sum().clamp(min=1.0)

        def share(flag_BT: torch.Tensor) -> float:
            return float((flag_BT.to(mask_BT.dtype) * mask_BT).sum() / n)

        capped_BT = w_BT >= obj.is_cap if obj.is_mode == "truncate" else w_BT == 0
        mismatch, fresh, entropy = math.nan, 0.0, math.nan
        per_seq: tuple[tuple[int, float, float], ...] = ()
        if fresh_B is not None:
            fresh_BT = mask_BT * fresh_B[:, None].to(mask_BT.dtype)
            fresh = float(fresh_BT.sum())
            if fresh > 0:
                log_r_BT = (logp_prox_BT - logp_sampler_BT).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
                k3_B = ((torch.exp(log_r_BT) - 1.0 - log_r_BT) * fresh_BT).sum(dim=1)
                n_B = fresh_BT.sum(dim=1)
                mismatch = float(k3_B.sum() / fresh)
                entropy = float(-(logp_prox_BT * fresh_BT).sum() / fresh)
                per_seq = tuple(
                    (r, float(k3_B[r]), float(n_B[r])) for r in torch.nonzero(n_B).flatten().tolist()
                )
        return LossStats(
            pg_loss=float(pg),
            kl=float(kl),
            clipfrac=share(low_BT | high_BT),
            is_weight_mean=float((w_BT * mask_BT).sum() / n),
            is_truncated_frac=share(capped_BT),
            clipfrac_low=share(low_BT),
            clipfrac_high=share(high_BT),
            masked_seq_frac=float(1.0 - kept_B1.mean()) if kept_B1.numel() else 0.0,
            mismatch_kl=mismatch,
            fresh_tokens=fresh,
            entropy=entropy,
            seq_mismatch=per_seq,
        )


def token_logprobs(
    logits_BTV: torch.Tensor, targets_BT: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``log softmax(logits / T)[target]`` per position, without materialising the full log-softmax
    (``logit[target] - logsumexp(logit)``), so memory stays O(B·T) beyond the logits themselves."""
    logits_BTV = logits_BTV.float() / temperature
    picked_BT = logits_BTV.gather(-1, targets_BT[..., None]).squeeze(-1)
    return picked_BT - torch.logsumexp(logits_BTV, dim=-1)
