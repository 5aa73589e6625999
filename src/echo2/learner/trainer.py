"""One GRPO learner update: a batch of R graded trajectories in, one new policy version out.

``GRPOTrainer.update`` is one call: it packs the batch, computes group advantages, evaluates the
loss of ``learner/grpo.py`` (one or more minibatches, groups kept whole), clips gradients, steps
AdamW, and reports the wall time it took as ``t_train_s`` (T_train of SPEC §3). A NaN or inf loss or
gradient never reaches the optimizer, so the weights (and any checkpoint) stay those of the last good
step. By default it raises :class:`TrainingDivergedError`. With ``isolate=True`` (the asynchronous
learner, whose data comes from strangers' machines) it first looks for the groups that caused it: each
group of the minibatch is evaluated alone (forward and backward), the groups whose loss or gradient is
not finite are left out and the minibatch is evaluated again without them, until it is finite. The
update then reports them (``UpdateStats.excluded``: their group ids), so the learner can purge them and
quarantine their workers; only a non-finite minibatch with no such group (the learner's own
divergence) raises, and a batch whose every group was left out raises :class:`PoisonedBatch` (no step).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from echo2.config import GRPOConfig, SamplingConfig
from echo2.data.tasks.base import full_mask
from echo2.errors import TrainingDivergedError
from echo2.learner import grpo
from echo2.observe import catalog
from echo2.types import Trajectory


@dataclass(frozen=True)
class UpdateStats:
    """What one learner update reports (the ``learner/`` metrics of SPEC §7)."""

    version: int  # policy version after this update
    loss: float  # total loss (mean over minibatches)
    kl: float  # KL to the reference (0 when beta == 0)
    clipfrac: float  # share of tokens where the PPO clip was active
    grad_norm: float  # gradient norm before clipping (mean over minibatches)
    is_weight_mean: float  # mean truncated importance weight sampler -> learner
    t_train_s: float  # wall seconds of this update
    tokens: int  # completion tokens trained on
    excluded: tuple[str, ...] = ()  # group ids left out: their loss or gradient was not finite

    def metrics(self) -> dict[str, float]:
        """The ``learner/`` metrics of SPEC §7 this update produced."""
        return {
            catalog.LEARNER_EXCLUDED_GROUPS.key: len(self.excluded),
            catalog.LEARNER_LOSS.key: self.loss,
            catalog.LEARNER_KL.key: self.kl,
            catalog.LEARNER_CLIPFRAC.key: self.clipfrac,
            catalog.LEARNER_GRAD_NORM.key: self.grad_norm,
            catalog.LEARNER_IS_WEIGHT_MEAN.key: self.is_weight_mean,
            catalog.LEARNER_T_TRAIN_S.key: self.t_train_s,
            catalog.LEARNER_VERSION.key: self.version,
        }


@dataclass(frozen=True)
class PackedBatch:
    """Trajectories as right-padded tensors (prompt + completion per row)."""

    input_ids_BL: torch.Tensor  # prompt + completion ids, right-padded
    attention_mask_BL: torch.Tensor  # 1 on real tokens
    targets_BT: torch.Tensor  # completion ids, right-padded to T
    mask_BT: torch.Tensor  # task token mask on completion tokens, 0 on padding
    logp_sampler_BT: torch.Tensor  # sampler log-probs aligned with targets
    start_B: torch.Tensor  # index in input_ids of each row's first completion token


def pack(trajectories: Sequence[Trajectory], masks: Sequence[Sequence[float]], pad_id: int) -> PackedBatch:
    B = len(trajectories)
    L = max(len(t.prompt_ids) + len(t.completion_ids) for t in trajectories)
    T = max(len(t.completion_ids) for t in trajectories)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    targets = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float32)
    logp_s = torch.zeros((B, T), dtype=torch.float32)
    start = torch.zeros(B, dtype=torch.long)
    for i, (t, m) in enumerate(zip(trajectories, masks, strict=True)):
        p, c = len(t.prompt_ids), len(t.completion_ids)
        input_ids[i, : p + c] = torch.tensor(t.prompt_ids + t.completion_ids, dtype=torch.long)
        attn[i, : p + c] = 1
        targets[i, :c] = torch.tensor(t.completion_ids, dtype=torch.long)
        mask[i, :c] = torch.tensor(m, dtype=torch.float32)
        logp_s[i, :c] = torch.tensor(t.sampler_logprobs, dtype=torch.float32)
        start[i] = p
    return PackedBatch(input_ids, attn, targets, mask, logp_s, start)


class PoisonedBatch(TrainingDivergedError):
    """Every group of a batch had a non-finite loss or gradient on its own: no step was made."""

    def __init__(self, excluded: Sequence[str]) -> None:
        super().__init__(f"every group of the batch has a non-finite loss or gradient: {list(excluded)}")
        self.excluded = tuple(excluded)  # the group ids, to purge


Rows = slice | torch.Tensor  # the rows of a packed batch a minibatch covers (a slice, or their indices)


def completion_logits(model: torch.nn.Module, batch: PackedBatch, rows: Rows = slice(None)) -> torch.Tensor:
    """``model``'s logits at the positions that predict each completion token, ``[B, T, V]`` (raw: not
    temperature-scaled; rows past a completion's end hold its last position's)."""
    input_ids_BL = batch.input_ids_BL[rows]
    logits_BLV = model(input_ids=input_ids_BL, attention_mask=batch.attention_mask_BL[rows]).logits
    T = batch.targets_BT.shape[1]
    # the logit at position start-1+j predicts completion token j
    idx_BT = (batch.start_B[rows, None] - 1 + torch.arange(T)[None, :]).clamp(max=input_ids_BL.shape[1] - 1)
    return logits_BLV.gather(1, idx_BT[..., None].expand(-1, -1, logits_BLV.shape[-1]))


def completion_logprobs(
    model: torch.nn.Module, batch: PackedBatch, temperature: float, rows: Rows = slice(None)
) -> torch.Tensor:
    """Log-probs of the completion tokens under ``model`` (temperature-scaled), ``[B, T]``."""
    return grpo.token_logprobs(completion_logits(model, batch, rows), batch.targets_BT[rows], temperature)


TokenMask = Callable[[Sequence[int], dict[str, Any]], list[float]]  # (completion ids, meta) -> weights


def loss_mask(t: Trajectory, token_mask: TokenMask = full_mask) -> list[float]:
    """Per completion token, its loss weight: the task's mask, times the turn mask of a multi-turn
    episode (SPEC §8: only the policy's own tokens carry loss; observation turns never do)."""
    weights = token_mask(t.completion_ids, t.meta)
    if not t.turn_mask:
        return weights
    return [w * m for w, m in zip(weights, t.turn_mask, strict=True)]


class GRPOTrainer:
    """Owns the policy's optimizer and (when ``kl_beta > 0``) a frozen reference copy.

    ``token_mask`` is the task adapter's per-token loss mask (``Task.token_mask``): the one place a
    trajectory's metadata becomes learner-side loss weights. ``sampling`` gives the temperature the
    sampler's log-probs were taken at and the constant ``max_new_tokens`` of the Dr. GRPO normaliser.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: GRPOConfig,
        sampling: SamplingConfig,
        pad_id: int,
        token_mask: TokenMask = full_mask,
        version: int = 0,
        isolate: bool = False,
    ) -> None:
        self.model = model
        self.isolate = isolate  # leave out the groups that make a minibatch non-finite (module docstring)
        self.cfg = cfg
        self.temperature = sampling.temperature
        self.max_tokens = sampling.max_new_tokens
        self.pad_id = pad_id
        self.token_mask = token_mask
        self.version = version
        self.optimizer = torch.optim.AdamW(
            (p for p in model.parameters() if p.requires_grad), lr=cfg.lr, weight_decay=cfg.weight_decay
        )
        self.reference: torch.nn.Module | None = None
        if cfg.kl_beta > 0:
            self.reference = copy.deepcopy(model).eval()
            for p in self.reference.parameters():
                p.requires_grad_(False)

    def update(self, trajectories: Sequence[Trajectory]) -> UpdateStats:
        """One learner update on whole GRPO groups (``trajectories`` ordered group by group)."""
        t0 = time.perf_counter()
        cfg = self.cfg
        groups = _group_sizes(trajectories)
        G = groups[0]
        if any(g != G for g in groups) or G < 2:
            raise ValueError(f"update needs whole groups of equal size >= 2, got sizes {groups}")
        rewards_PG = torch.tensor([t.reward for t in trajectories], dtype=torch.float32).view(-1, G)
        advantages_B = grpo.group_advantages(rewards_PG, cfg.scale_by_std).flatten()
        masks = [loss_mask(t, self.token_mask) for t in trajectories]
        batch = pack(trajectories, masks, self.pad_id)

        self.model.train()
        n_mb = cfg.num_minibatches
        if len(groups) % n_mb:
            raise ValueError(f"{len(groups)} groups cannot be split into {n_mb} whole-group minibatches")
        rows_per_mb = len(groups) // n_mb * G
        logp_prox_BT = None
        if n_mb > 1 and cfg.clip_anchor == "proximal":  # frozen before the first optimizer step
            with torch.no_grad():
                logp_prox_BT = completion_logprobs(self.model, batch, self.temperature)
        losses, klv, clipf, gnorms, isw = [], [], [], [], []
        excluded: list[int] = []  # the first row of each group left out
        for k in range(n_mb):
            rows: Rows = slice(k * rows_per_mb, (k + 1) * rows_per_mb)
            while True:  # each round leaves out at least one group, so this ends
                loss, stats, grad_norm = self._evaluate(batch, advantages_B, rows, logp_prox_BT)
                if math.isfinite(grad_norm):
                    break
                culprits = self._culprits(batch, advantages_B, rows, logp_prox_BT, G) if self.isolate else []
                if not culprits:
                    value = float(loss.detach())
                    what = f"loss is {value}" if not math.isfinite(value) else f"gradient norm is {grad_norm}"
                    raise TrainingDivergedError(f"{what} at version {self.version}, minibatch {k}")
                excluded += culprits
                rows = _without(rows, culprits, G)
                if not len(rows):
                    break
            if not math.isfinite(grad_norm):
                continue  # every group of this minibatch was left out: no step for it
            self.optimizer.step()
            losses.append(float(loss.detach()))
            klv.append(stats.kl)
            clipf.append(stats.clipfrac)
            gnorms.append(grad_norm)
            isw.append(stats.is_weight_mean)
        ids = tuple(trajectories[r].group_id for r in excluded)
        if not losses:
            raise PoisonedBatch(ids)
        self.version += 1
        kept_BT = batch.mask_BT.clone()
        for r in excluded:
            kept_BT[r : r + G] = 0
        return UpdateStats(
            version=self.version,
            loss=_mean(losses),
            kl=_mean(klv),
            clipfrac=_mean(clipf),
            grad_norm=_mean(gnorms),
            is_weight_mean=_mean(isw),
            t_train_s=time.perf_counter() - t0,
            tokens=int(kept_BT.gt(0).sum()),
            excluded=ids,
        )

    def _evaluate(
        self, batch: PackedBatch, advantages_B: torch.Tensor, rows: Rows, logp_prox_BT: torch.Tensor | None
    ) -> tuple[torch.Tensor, grpo.LossStats, float]:
        """Loss and clipped gradient (left in the parameters) of the minibatch ``rows``: ``(loss, stats,
        grad_norm)``; ``grad_norm`` is nan (and no gradient is left) when the loss is not finite."""
        cfg = self.cfg
        logp_BT = completion_logprobs(self.model, batch, self.temperature, rows)
        prox_BT = logp_BT.detach() if logp_prox_BT is None else logp_prox_BT[rows]
        logp_ref_BT = None
        if self.reference is not None:
            with torch.no_grad():
                logp_ref_BT = completion_logprobs(self.reference, batch, self.temperature, rows)
        loss, stats = grpo.grpo_loss(
            logp_BT,
            prox_BT,
            batch.logp_sampler_BT[rows],
            advantages_B[rows],
            batch.mask_BT[rows],
            clip_eps=cfg.clip_eps,
            is_cap=cfg.is_cap,
            kl_beta=cfg.kl_beta,
            logp_ref_BT=logp_ref_BT,
            loss_agg=cfg.loss_agg,
            clip_anchor=cfg.clip_anchor,
            max_tokens=self.max_tokens,
        )
        self.optimizer.zero_grad(set_to_none=True)
        if not torch.isfinite(loss):
            return loss, stats, math.nan
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
        return loss, stats, grad_norm

    def _culprits(
        self,
        batch: PackedBatch,
        advantages_B: torch.Tensor,
        rows: Rows,
        logp_prox_BT: torch.Tensor | None,
        G: int,
    ) -> list[int]:
        """The groups of ``rows`` (by their first row) whose loss or gradient alone is not finite: one
        forward and backward per group, about the cost of the minibatch once more."""
        firsts = _rows_list(rows)[::G]
        bad = []
        for r in firsts:
            _, _, grad_norm = self._evaluate(batch, advantages_B, slice(r, r + G), logp_prox_BT)
            if not math.isfinite(grad_norm):
                bad.append(r)
        self.optimizer.zero_grad(set_to_none=True)
        return bad


def _rows_list(rows: Rows) -> list[int]:
    if isinstance(rows, slice):
        return list(range(rows.start, rows.stop))
    return [int(r) for r in rows]


def _without(rows: Rows, firsts: Sequence[int], G: int) -> torch.Tensor:
    """``rows`` less the groups starting at ``firsts`` (each ``G`` rows), as an index tensor."""
    drop = {r + j for r in firsts for j in range(G)}
    return torch.tensor([r for r in _rows_list(rows) if r not in drop], dtype=torch.long)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _group_sizes(trajectories: Sequence[Trajectory]) -> list[int]:
    sizes: list[int] = []
    current = None
    for t in trajectories:
        if t.group_id != current:
            sizes.append(0)
            current = t.group_id
        sizes[-1] += 1
    return sizes
