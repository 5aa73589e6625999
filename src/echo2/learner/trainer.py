"""One GRPO learner update: a batch of R graded trajectories in, one new policy version out.

``GRPOTrainer.update`` is one call: it packs the batch on the model's device, computes group
advantages, evaluates the loss of ``learner/grpo.py`` (one or more minibatches, groups kept whole; each
minibatch in micro-batches of at most ``learner.micro_batch_tokens`` padded tokens whose gradients
accumulate, normalised over the whole minibatch: ``learner/logprobs.py``), clips gradients over the
minibatch's whole gradient, steps AdamW once per minibatch, and reports the wall time it took as
``t_train_s`` (T_train of SPEC §3). A NaN or inf loss or
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

import contextlib
import copy
import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from echo2.config import GRPOConfig, LearnerConfig, SamplingConfig
from echo2.data.tasks.base import full_mask
from echo2.errors import ConfigError, TrainingDivergedError
from echo2.learner import grpo
from echo2.learner.logprobs import (
    LMParts,
    PackedBatch,
    Rows,
    completion_logprobs,
    lm_parts,
    micro_batches,
    pack,
    with_proximal,
)
from echo2.learner.sharded import Ranks, is_sharded, settle
from echo2.models.lora import adapter_off, has_adapter
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
    clipfrac_low: float = 0.0  # of clipfrac, tokens clipped at 1 - eps_low
    clipfrac_high: float = 0.0  # of clipfrac, tokens clipped at 1 + eps_high
    masked_seq_frac: float = 0.0  # sequences off-policy sequence masking left out
    mismatch_kl: float = math.nan  # k3 KL(sampler || learner) on tokens sampled at the learner's version
    zero_variance_share: float = 0.0  # groups whose rewards are all equal (no signal), of the batch
    entropy: float = math.nan  # the policy's per-token entropy, estimated on its own fresh samples
    # per group with fresh sequences: (their k3 sum, their fresh tokens), read per worker by the node
    mismatch_by_group: dict[str, tuple[float, float]] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """The ``learner/`` metrics of SPEC §7 this update produced."""
        return {
            catalog.LEARNER_EXCLUDED_GROUPS.key: len(self.excluded),
            catalog.LEARNER_LOSS.key: self.loss,
            catalog.LEARNER_KL.key: self.kl,
            catalog.LEARNER_CLIPFRAC.key: self.clipfrac,
            catalog.LEARNER_CLIPFRAC_LOW.key: self.clipfrac_low,
            catalog.LEARNER_CLIPFRAC_HIGH.key: self.clipfrac_high,
            catalog.LEARNER_MASKED_SEQ_FRAC.key: self.masked_seq_frac,
            catalog.LEARNER_MISMATCH_KL.key: self.mismatch_kl,
            catalog.LEARNER_ZERO_VARIANCE_SHARE.key: self.zero_variance_share,
            catalog.LEARNER_ENTROPY.key: self.entropy,
            catalog.LEARNER_GRAD_NORM.key: self.grad_norm,
            catalog.LEARNER_IS_WEIGHT_MEAN.key: self.is_weight_mean,
            catalog.LEARNER_T_TRAIN_S.key: self.t_train_s,
            catalog.LEARNER_VERSION.key: self.version,
        }


class PoisonedBatch(TrainingDivergedError):
    """Every group of a batch had a non-finite loss or gradient on its own: no step was made."""

    def __init__(self, excluded: Sequence[str]) -> None:
        super().__init__(f"every group of the batch has a non-finite loss or gradient: {list(excluded)}")
        self.excluded = tuple(excluded)  # the group ids, to purge


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
    ``learner`` says how an update computes (``LearnerConfig``): on the model's own device, in fp32 or
    bf16 autocast (fp32 master weights, gradients and AdamW states either way), in micro-batches of at
    most ``micro_batch_tokens`` padded tokens whose gradients accumulate into one optimizer step per
    minibatch, with log-probs taken ``logprob_chunk`` completion positions at a time. ``reference``: the
    frozen KL reference when the caller builds it (a sharded model's: :func:`frozen_reference`, sharded
    the same way); else that copy of ``model`` is made here, or, for a model carrying a LoRA adapter
    (``models/lora.py``), the model itself with its adapter off. ``ranks``: the learner's ranks
    (``learner/sharded.Ranks``; by default those the model is sharded over), through which every
    collective of an update goes.
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
        learner: LearnerConfig | None = None,
        reference: torch.nn.Module | None = None,
        ranks: Ranks | None = None,
        eos_ids: Sequence[int] = (),
    ) -> None:
        self.model = model
        self.eos_ids = frozenset(eos_ids)  # a completion that ends in none of them was cut: truncated
        if cfg.mask_truncated and not self.eos_ids:
            raise ConfigError("grpo.mask_truncated needs the model's EOS ids to tell a truncated completion")
        if cfg.overlong_buffer >= sampling.max_new_tokens:
            raise ConfigError(
                f"grpo.overlong_buffer = {cfg.overlong_buffer} must be below sampling.max_new_tokens = "
                f"{sampling.max_new_tokens} (the penalty starts that many tokens before it)"
            )
        self.isolate = isolate  # leave out the groups that make a minibatch non-finite (module docstring)
        self.cfg = cfg
        self.objective = grpo.Objective(
            clip_eps_low=cfg.eps_low, clip_eps_high=cfg.eps_high, is_cap=cfg.is_cap, kl_beta=cfg.kl_beta,
            loss_agg=cfg.loss_agg, clip_anchor=cfg.clip_anchor, ratio_level=cfg.ratio_level,
            policy_loss=cfg.loss, is_mode=cfg.is_mode, is_level=cfg.is_level,
            offpolicy_delta=cfg.offpolicy_mask_delta,
        )  # fmt: skip
        self.learner = learner or LearnerConfig()
        self.temperature = sampling.temperature
        self.max_tokens = sampling.max_new_tokens
        self.pad_id = pad_id
        self.token_mask = token_mask
        self.version = version
        self.device = next(model.parameters()).device
        self.mixed = self.learner.precision == "bf16-mixed"
        # sharded with FSDP2 (learner/sharded.py): each rank computes its share of the micro-batches and
        # every collective of the update goes through ``ranks`` (the identity at one rank)
        self.ranks = ranks if ranks is not None else Ranks.of(model)
        self.sharded = is_sharded(model)  # wrapped with FSDP2, at any world size (one rank included)
        if self.learner.activation_checkpointing:
            _enable_activation_checkpointing(model)
        # the LM head at completion positions only (learner/logprobs.py); a sharded model's hidden states
        # come from its own forward with the head set aside (its root gathers the head's parameters)
        self.parts = lm_parts(model, through_root=self.sharded)
        if self.sharded:  # the optimizer over the sharded parameters, whatever a forward gathered
            settle(model)
        self.optimizer = torch.optim.AdamW(
            (p for p in model.parameters() if p.requires_grad), lr=cfg.lr, weight_decay=cfg.weight_decay
        )
        self.reference: torch.nn.Module | None = None
        self.reference_parts: LMParts | None = None
        if cfg.kl_beta > 0 and reference is None and self.ranks.sharded:
            raise ConfigError(
                "grpo.kl_beta > 0 on a sharded model needs its KL reference sharded the same way "
                "(trainer.frozen_reference, then sharded.shard)"
            )
        # LoRA (models/lora.py): the reference is the base alone, the same model with its adapter off
        self.adapter_reference = cfg.kl_beta > 0 and has_adapter(model)
        if self.adapter_reference:
            self.reference, self.reference_parts = model, self.parts
        elif cfg.kl_beta > 0:  # the caller's (a sharded learner's, sharded), else a copy made here
            self.reference = reference if reference is not None else frozen_reference(model, self.mixed)
            self.reference_parts = lm_parts(self.reference, through_root=self.sharded)

    def truncated(self, t: Trajectory) -> bool:
        """Whether ``t`` was cut before its EOS (a trajectory ends with one unless it was)."""
        return not t.completion_ids or t.completion_ids[-1] not in self.eos_ids

    def length_shaping(self, n: int) -> float:
        """What the length of an ``n``-token completion adds to its reward: DAPO's soft overlong penalty
        ``min(0, (L_max - L_cache - n) / L_cache) x overlong_penalty`` (``L_cache`` the overlong buffer,
        ``L_max`` ``sampling.max_new_tokens``), minus ``length_penalty x n / L_max``."""
        cfg, top = self.cfg, self.max_tokens
        shaped = -cfg.length_penalty * n / top
        if cfg.overlong_buffer:
            free = top - cfg.overlong_buffer
            shaped += max(-1.0, min(0.0, (free - n) / cfg.overlong_buffer)) * cfg.overlong_penalty
        return shaped

    def autocast(self, cache: bool = True) -> contextlib.AbstractContextManager[None]:
        """The update's compute precision (bf16 autocast under ``bf16-mixed``; a no-op in fp32).
        ``cache``: autocast keeps the bf16 cast of each weight until the context ends (an evaluation's
        generation casts once, not at every step); the update's passes go without it (:meth:`logprobs`)."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, cache_enabled=cache)

    def logprobs(self, batch: PackedBatch, reference: bool = False) -> torch.Tensor:
        """Completion log-probs ``[B, T]`` of ``batch`` under the policy (or the frozen reference), in the
        update's precision; float32 out. Without autocast's weight cache: each weight is cast to bf16 at
        its use and autograd keeps the cast a backward needs, so with activation checkpointing one
        layer's casts exist at a time; the cache would hold every layer's until the forward ends, 2
        bytes a parameter on top of the update's peak (planner/memory_model.py: ``autocast_copies``)."""
        model, parts = (self.reference, self.reference_parts) if reference else (self.model, self.parts)
        assert model is not None
        base_alone = adapter_off(model) if reference and self.adapter_reference else contextlib.nullcontext()
        with self.autocast(cache=False), base_alone:
            return completion_logprobs(
                model, batch, self.temperature, chunk=self.learner.logprob_chunk, parts=parts
            )

    def update(self, trajectories: Sequence[Trajectory]) -> UpdateStats:
        """One learner update on whole GRPO groups (``trajectories`` ordered group by group)."""
        t0 = time.perf_counter()
        cfg = self.cfg
        groups = _group_sizes(trajectories)
        G = groups[0]
        if any(g != G for g in groups) or G < 2:
            raise ValueError(f"update needs whole groups of equal size >= 2, got sizes {groups}")
        rewards = [t.reward + self.length_shaping(len(t.completion_ids)) for t in trajectories]
        rewards_PG = torch.tensor(rewards, dtype=torch.float32, device=self.device)
        advantages_B = grpo.group_advantages(rewards_PG.view(-1, G), cfg.scale_by_std).flatten()
        flat_P = rewards_PG.view(-1, G).std(dim=1) == 0  # every reward of the group equal: no signal
        fresh_B = torch.tensor([t.policy_version == self.version for t in trajectories], device=self.device)
        masks = [loss_mask(t, self.token_mask) for t in trajectories]
        if cfg.mask_truncated:  # DAPO's overlong filtering: a cut completion teaches nothing about its end
            masks = [
                [0.0] * len(m) if self.truncated(t) else m for t, m in zip(trajectories, masks, strict=True)
            ]
        batch = pack(trajectories, masks, self.pad_id, self.device)

        self.model.train()
        n_mb = cfg.num_minibatches
        if len(groups) % n_mb:
            raise ValueError(f"{len(groups)} groups cannot be split into {n_mb} whole-group minibatches")
        rows_per_mb = len(groups) // n_mb * G
        if n_mb > 1 and cfg.clip_anchor == "proximal":  # frozen before the first optimizer step
            batch = with_proximal(batch, self._frozen_logprobs(batch))
        losses, gnorms, seen = [], [], list[grpo.LossStats]()
        excluded: list[int] = []  # the first row of each group left out
        for k in range(n_mb):
            rows = list(range(k * rows_per_mb, (k + 1) * rows_per_mb))
            while True:  # each round leaves out at least one group, so this ends
                loss, stats, grad_norm = self._evaluate(batch, advantages_B, rows, fresh_B)
                if math.isfinite(grad_norm):
                    break
                culprits = self._culprits(batch, advantages_B, rows, G, fresh_B) if self.isolate else []
                if not culprits:
                    what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {grad_norm}"
                    raise TrainingDivergedError(f"{what} at version {self.version}, minibatch {k}")
                excluded += culprits
                dropped = {r + j for r in culprits for j in range(G)}
                rows = [r for r in rows if r not in dropped]
                if not rows:
                    break
            if not math.isfinite(grad_norm):
                continue  # every group of this minibatch was left out: no step for it
            self.optimizer.step()
            losses.append(loss)
            gnorms.append(grad_norm)
            seen.append(stats)
        self.optimizer.zero_grad(set_to_none=True)  # no gradient outlives the update (memory model)
        ids = tuple(trajectories[r].group_id for r in excluded)
        if not losses:
            raise PoisonedBatch(ids)
        self.version += 1
        kept_BT = batch.mask_BT.clone()
        for r in excluded:
            kept_BT[r : r + G] = 0
        fresh = [s for s in seen if s.fresh_tokens > 0]
        return UpdateStats(
            version=self.version,
            loss=_mean(losses),
            kl=_mean([s.kl for s in seen]),
            clipfrac=_mean([s.clipfrac for s in seen]),
            grad_norm=_mean(gnorms),
            is_weight_mean=_mean([s.is_weight_mean for s in seen]),
            t_train_s=time.perf_counter() - t0,
            tokens=int(kept_BT.gt(0).sum()),
            excluded=ids,
            clipfrac_low=_mean([s.clipfrac_low for s in seen]),
            clipfrac_high=_mean([s.clipfrac_high for s in seen]),
            masked_seq_frac=_mean([s.masked_seq_frac for s in seen]),
            mismatch_kl=_mean([s.mismatch_kl for s in fresh]) if fresh else math.nan,
            entropy=_mean([s.entropy for s in fresh]) if fresh else math.nan,
            zero_variance_share=float(flat_P.float().mean()),
            mismatch_by_group=_by_group(trajectories, [q for s in seen for q in s.seq_mismatch]),
        )

    def _frozen_logprobs(self, batch: PackedBatch) -> torch.Tensor:
        """The policy's log-probs of the whole batch before any optimizer step, micro-batch by micro-batch
        (sharded: each rank its share, then summed over the ranks: every row is computed by one)."""
        out_BT = torch.zeros_like(batch.logp_sampler_BT)
        rows = list(range(batch.rows))
        with torch.no_grad():
            for mb in self._my_micro_batches(batch, rows):
                logp_bT = self.logprobs(batch.select(mb or rows[:1]))
                if mb:  # an empty share runs a row only to keep the ranks' collectives in step
                    out_BT[torch.as_tensor(mb, device=self.device), : logp_bT.shape[1]] = logp_bT
        return self.ranks.sum_(out_BT)

    def _my_micro_batches(self, batch: PackedBatch, rows: Rows) -> list[list[int]]:
        """The micro-batches of ``rows`` (row indices of ``batch``) this rank computes: all of them in one
        process; sharded, every ``world``-th, padded with empty ones so that every rank runs as many
        forward and backward passes (FSDP's collectives must pair up)."""
        lengths = batch.lengths()
        plan = [
            [rows[i] for i in mb]
            for mb in micro_batches([lengths[r] for r in rows], self.learner.micro_batch_tokens)
        ]
        return self.ranks.share_of(plan, pad=[])

    def _evaluate(
        self, batch: PackedBatch, advantages_B: torch.Tensor, rows: Rows, fresh_B: torch.Tensor | None = None
    ) -> tuple[float, grpo.LossStats, float]:
        """Loss and clipped gradient (left in the parameters) of the minibatch ``rows``, accumulated over
        its micro-batches with the minibatch's own normalisation (``grpo.Norm``), so the result is the
        unbatched update's: ``(loss, stats, grad_norm)``; ``grad_norm`` is nan (and no gradient is left)
        when a micro-batch's loss is not finite. ``fresh_B``: the rows sampled at the learner's version
        (the mismatch KL is read over them)."""
        self.optimizer.zero_grad(set_to_none=True)
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=self.device)
        norm = grpo.Norm.of(batch.mask_BT[idx])  # over the whole minibatch, on every rank
        loss_sum, parts = 0.0, list[tuple[grpo.LossStats, float]]()
        for mine in self._my_micro_batches(batch, rows):
            mb = batch.select(mine or list(rows)[:1])
            if not mine:  # this rank's share is empty: a weightless pass keeps the collectives in step
                mb = dataclasses.replace(mb, mask_BT=torch.zeros_like(mb.mask_BT))
            logp_BT = self.logprobs(mb)
            logp_ref_BT = None
            if self.reference is not None:
                with torch.no_grad():
                    logp_ref_BT = self.logprobs(mb, reference=True)
            picked = torch.as_tensor(mine or list(rows)[:1], device=self.device)
            loss, stats = grpo.grpo_loss(
                logp_BT,
                logp_BT.detach() if mb.logp_prox_BT is None else mb.logp_prox_BT,
                mb.logp_sampler_BT,
                advantages_B[picked],
                mb.mask_BT,
                objective=self.objective,
                logp_ref_BT=logp_ref_BT,
                max_tokens=self.max_tokens,
                norm=norm,
                fresh_B=fresh_B[picked] if fresh_B is not None else None,
            )
            value = float(loss.detach())  # non-finite on every rank when it is on any: all skip together
            if self.ranks.any(not math.isfinite(value)):
                self.optimizer.zero_grad(set_to_none=True)
                return value, _combine(parts), math.nan
            loss.backward()
            loss_sum += value
            if mine:  # its sequences' rows, as rows of the batch
                seqs = tuple((mine[r], k3, n) for r, k3, n in stats.seq_mismatch)
                parts.append((dataclasses.replace(stats, seq_mismatch=seqs), float(mb.mask_BT.sum())))
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
        everyone = [p for rank_parts in self.ranks.gather(parts) for p in rank_parts]
        return self.ranks.sum(loss_sum), _combine(everyone), grad_norm

    def _culprits(
        self, batch: PackedBatch, advantages_B: torch.Tensor, rows: Rows, G: int, fresh_B: torch.Tensor
    ) -> list[int]:
        """The groups of ``rows`` (by their first row) whose loss or gradient alone is not finite: one
        forward and backward per group, about the cost of the minibatch once more."""
        bad = []
        for r in list(rows)[::G]:
            _, _, grad_norm = self._evaluate(batch, advantages_B, range(r, r + G), fresh_B)
            if not math.isfinite(grad_norm):
                bad.append(r)
        self.optimizer.zero_grad(set_to_none=True)
        return bad


def frozen_reference(model: torch.nn.Module, mixed: bool) -> torch.nn.Module:
    """The KL reference of ``model``: a frozen copy, in bf16 when the update computes in bf16 anyway
    (2 bytes a parameter). A sharded learner makes it before sharding the model and shards it the same
    way, so every rank computes its reference log-probs in step with its policy's."""
    reference = copy.deepcopy(model).eval()
    if mixed:
        reference.to(torch.bfloat16)
    reference.requires_grad_(False)
    return reference


def _enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """transformers' per-layer activation checkpointing (non-reentrant), by its new name or its old one."""
    kwargs = {"use_reentrant": False}
    hf: Any = model  # a transformers model: the methods are its own
    if hasattr(hf, "activation_checkpointing_enable"):
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(hf, "gradient_checkpointing_enable"):
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise ValueError(
            f"{type(model).__name__} has no activation checkpointing (learner.activation_checkpointing)"
        )


def _combine(parts: Sequence[tuple[grpo.LossStats, float]]) -> grpo.LossStats:
    """The diagnostics of a minibatch from its micro-batches' (each with its valid-token count): the
    aggregated losses add up (each is already its share), the per-token shares and means are weighted
    by tokens."""
    if not parts:
        return grpo.LossStats(math.nan, math.nan, math.nan, math.nan, math.nan)
    n = sum(w for _, w in parts) or 1.0
    fresh = sum(s.fresh_tokens for s, _ in parts)

    def mean(name: str) -> float:
        return sum(getattr(s, name) * w for s, w in parts) / n

    def fresh_mean(name: str) -> float:  # over the fresh tokens (nan when there are none)
        if not fresh:
            return math.nan
        return sum(getattr(s, name) * s.fresh_tokens for s, _ in parts if s.fresh_tokens) / fresh

    return grpo.LossStats(
        pg_loss=sum(s.pg_loss for s, _ in parts),
        kl=sum(s.kl for s, _ in parts),
        clipfrac=mean("clipfrac"),
        is_weight_mean=mean("is_weight_mean"),
        is_truncated_frac=mean("is_truncated_frac"),
        clipfrac_low=mean("clipfrac_low"),
        clipfrac_high=mean("clipfrac_high"),
        masked_seq_frac=mean("masked_seq_frac"),
        mismatch_kl=fresh_mean("mismatch_kl"),
        entropy=fresh_mean("entropy"),
        fresh_tokens=fresh,
        seq_mismatch=tuple(seq for s, _ in parts for seq in s.seq_mismatch),
    )


def _summed(items: Iterable[tuple[str | None, float, float]]) -> dict[str, tuple[float, float]]:
    """``(key, k3 sum, tokens)`` items summed per key (items whose key is None left out)."""
    sums: dict[str, tuple[float, float]] = {}
    for key, k3, n in items:
        if key is not None:
            k3_sum, tokens = sums.get(key, (0.0, 0.0))
            sums[key] = (k3_sum + k3, tokens + n)
    return sums


def _by_group(
    trajectories: Sequence[Trajectory], seqs: Sequence[tuple[int, float, float]]
) -> dict[str, tuple[float, float]]:
    """The fresh sequences ``seqs`` (row, k3 sum, tokens) summed per group of ``trajectories``."""
    return _summed((trajectories[row].group_id, k3, n) for row, k3, n in seqs)


def mismatch_by(
    key_of: Callable[[str], str | None], by_group: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """The mismatch KL per key (a worker) of groups ``by_group`` (``UpdateStats.mismatch_by_group``):
    each key's k3 sum over its fresh tokens; groups ``key_of`` gives None are left out."""
    sums = _summed((key_of(gid), k3, n) for gid, (k3, n) in by_group.items())
    return {key: k3 / n for key, (k3, n) in sums.items() if n > 0}


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
