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

from dataclasses import dataclass

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
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
    policy while bounding the variance a very stale token can inject."""
    return _exp_ratio(logp_prox_BT - logp_sampler_BT).clamp(max=cap).detach()


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

    pg_loss: float  # aggregated clipped surrogate
    kl: float  # aggregated k3 KL to the reference (0 when beta == 0 and no reference given)
    clipfrac: float  # share of valid tokens where the PPO clip was active
    is_weight_mean: float  # mean IS weight sampler -> learner over valid tokens (truncated when decoupled)
    is_truncated_frac: float  # share of valid tokens whose IS weight (ratio when coupled) hit the cap


def grpo_loss(
    logp_BT: torch.Tensor,
    logp_prox_BT: torch.Tensor,
    logp_sampler_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_eps: float,
    is_cap: float,
    kl_beta: float = 0.0,
    logp_ref_BT: torch.Tensor | None = None,
    loss_agg: str = "token-mean",
    clip_anchor: str = "sampler",
    max_tokens: int | None = None,
    norm: Norm | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The GRPO objective of the module docstring; returns the scalar loss and its diagnostics.
    ``max_tokens`` is the constant normaliser of ``loss_agg="seq-mean-token-sum-norm"``; ``norm`` the
    aggregation's denominators when these rows are a micro-batch of a larger minibatch (the loss is
    then this micro-batch's share; the diagnostics' shares and means stay over its own tokens)."""
    if kl_beta > 0.0 and logp_ref_BT is None:
        raise ValueError("kl_beta > 0 needs logp_ref_BT")
    if clip_anchor not in CLIP_ANCHORS:
        raise ValueError(f"clip_anchor must be one of {CLIP_ANCHORS}, got {clip_anchor!r}")
    logp_prox_BT = logp_prox_BT.detach()
    logp_sampler_BT = logp_sampler_BT.detach()
    mask_BT = mask_BT.to(logp_BT.dtype)
    A_B1 = advantages_B[:, None].to(logp_BT.dtype)

    if clip_anchor == "proximal":
        w_BT = truncated_is_weights(logp_prox_BT, logp_sampler_BT, is_cap)
        ratio_BT = _exp_ratio(logp_BT - logp_prox_BT)
    else:
        ratio_BT = _exp_ratio(logp_BT - logp_sampler_BT)
        w_BT = ratio_BT.detach()  # reported only: the ratio carries the IS
    surr1_BT = ratio_BT * A_B1
    surr2_BT = ratio_BT.clamp(1.0 - clip_eps, 1.0 + clip_eps) * A_B1
    surr_BT = torch.minimum(surr1_BT, surr2_BT)
    if clip_anchor == "proximal":
        pg_BT = -w_BT * surr_BT
    else:  # dual clip: a stale token with A < 0 and a large ratio cannot dominate the update
        pg_BT = -torch.where(A_B1 < 0, torch.maximum(surr_BT, is_cap * A_B1), surr_BT)
    pg = aggregate(pg_BT, mask_BT, loss_agg, max_tokens, norm)

    kl = torch.zeros((), dtype=logp_BT.dtype, device=logp_BT.device)
    if logp_ref_BT is not None:
        kl = aggregate(kl_k3(logp_BT, logp_ref_BT.detach()), mask_BT, loss_agg, max_tokens, norm)
    loss = pg + kl_beta * kl

    with torch.no_grad():
        n = mask_BT.sum().clamp(min=1.0)
        clipped_BT = (surr2_BT < surr1_BT).to(mask_BT.dtype)  # the clip bound was the minimum
        stats = LossStats(
            pg_loss=float(pg),
            kl=float(kl),
            clipfrac=float((clipped_BT * mask_BT).sum() / n),
            is_weight_mean=float((w_BT * mask_BT).sum() / n),
            is_truncated_frac=float(((w_BT >= is_cap).to(mask_BT.dtype) * mask_BT).sum() / n),
        )
    return loss, stats


def token_logprobs(
    logits_BTV: torch.Tensor, targets_BT: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``log softmax(logits / T)[target]`` per position, without materialising the full log-softmax
    (``logit[target] - logsumexp(logit)``), so memory stays O(B·T) beyond the logits themselves."""
    logits_BTV = logits_BTV.float() / temperature
    picked_BT = logits_BTV.gather(-1, targets_BT[..., None]).squeeze(-1)
    return picked_BT - torch.logsumexp(logits_BTV, dim=-1)
