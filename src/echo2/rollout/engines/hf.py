"""Rollout engine on HF transformers: batched sampling with temperature and top-p, returning the
completion token ids and the sampler's per-token log-probs. Sampling is seeded Gumbel-max
(``rollout/sampling.py``): row ``r`` of a call with ``seed`` draws step ``n`` from noise of
``(seed, r, n)`` alone, so the learner can confirm any token from the claimed weights.

The decode loop drives the model's own forward with a KV cache (``DynamicCache``) instead of
``generate()``: it keeps exactly the log-probs we need, draws with seeded noise, and has no per-token
processor overhead, which dominates on small models.

Log-prob convention: ``sampler_logprobs`` are log-probs under the *temperature-scaled* distribution
``softmax(logits / T)``, before nucleus truncation. This is what the learner recomputes, so an
on-policy sample has importance weight exactly 1; nucleus truncation only decides which tokens can
be drawn.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from echo2.config import SamplingConfig
from echo2.models.policy import cache_kwarg
from echo2.models.snapshot import install_weights, model_from_skeleton
from echo2.rollout.engines.base import EngineOptions, EosIds, Sample, eos_tuple
from echo2.rollout.sampling import gumbel_draw


class HFEngine:
    """Samples completions from a causal LM (any transformers ``*ForCausalLM``); implements the
    :class:`~echo2.rollout.engines.base.Engine` seam. The learner wraps its own training model in one
    (held-out evaluation, the synchronous loop); a worker builds one from the learner's skeleton."""

    def __init__(
        self,
        model: torch.nn.Module,
        eos_id: EosIds,
        pad_id: int,
        sampling: SamplingConfig,
        max_batch_tokens: int | None = None,
        all_done: Callable[[torch.Tensor], bool] | None = None,
    ) -> None:
        self.model = model
        self.eos_ids = eos_tuple(eos_id)  # every token that ends a completion
        self.pad_id = pad_id
        self.sampling = sampling
        # rows x (longest prompt + new tokens) per forward batch (the KV cache grows with it); None: one
        # batch. Rows keep their seeded noise whatever batch they are drawn in (``generate``'s ``rows``).
        self.max_batch_tokens = max_batch_tokens
        self._cache_kwarg = cache_kwarg(model)  # `cache` or `past_key_values`, by transformers version
        # whether every row has ended: on a sharded model every rank must stop at the same step (each
        # step's forward is a collective), so the learner passes its ranks' agreement (``Ranks.all_done``)
        self.all_done: Callable[[torch.Tensor], bool] = all_done or (lambda done_B: bool(done_B.all()))

    @classmethod
    def on_policy(
        cls,
        policy: Any,
        sampling: SamplingConfig,
        max_batch_tokens: int | None,
        all_done: Callable[[torch.Tensor], bool] | None = None,
    ) -> HFEngine:
        """An engine on a loaded policy's own weights (the learner's evaluation): its end-of-sequence ids,
        its padding, batches of at most ``max_batch_tokens`` tokens, ``all_done`` its ranks' agreement
        that every row has ended (None: this process's rows)."""
        return cls(
            policy.model, policy.eos_ids, policy.pad_id, sampling, max_batch_tokens=max_batch_tokens,
            all_done=all_done,
        )  # fmt: skip

    @classmethod
    def from_skeleton(
        cls,
        skeleton_dir: Path,
        eos_id: EosIds,
        pad_id: int,
        sampling: SamplingConfig,
        options: EngineOptions | None = None,
    ) -> HFEngine:
        """The architecture of the skeleton's ``config.json`` with untrained weights (the first snapshot
        fills them), computing in ``options.dtype`` (float32, or bfloat16 as GPU workers run: the
        learner's check then needs ``security.engine_precision = "bfloat16"``)."""
        from echo2.models.policy import resolve_device

        options = options or EngineOptions()
        dtype = getattr(torch, options.dtype)
        model = model_from_skeleton(skeleton_dir).to(resolve_device(options.device, "engine device"), dtype)
        return cls(model, eos_id, pad_id, sampling, max_batch_tokens=options.batch_tokens)

    def install(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Load published weights into the model in place, cast to its dtype (``models/snapshot.py``)."""

        install_weights(self.model, weights)

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        seed: int,
        greedy: bool = False,
        max_new_tokens: int | None = None,
        rows: Sequence[int] | None = None,
        first_steps: Sequence[int] | None = None,
    ) -> list[Sample]:
        """One completion per entry of ``prompts`` (repeat a prompt to sample a group), in batches of at
        most ``max_batch_tokens`` tokens; row ``r`` of the call draws the noise of row ``rows[r]`` (default
        ``r``) from step ``first_steps[r]`` (default 0) on, whatever batch it is computed in."""
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        steps = max_new_tokens or self.sampling.max_new_tokens
        B = len(prompts)
        per_row = max(len(p) for p in prompts) + steps
        size = B if self.max_batch_tokens is None else max(1, self.max_batch_tokens // per_row)
        if size >= B:
            return self._generate(prompts, seed, greedy, steps, rows, first_steps)
        rows = list(range(B)) if rows is None else list(rows)
        firsts = [0] * B if first_steps is None else list(first_steps)
        out: list[Sample] = []
        for i in range(0, B, size):
            j = i + size
            out += self._generate(prompts[i:j], seed, greedy, steps, rows[i:j], firsts[i:j])
        return out

    def _generate(
        self,
        prompts: Sequence[Sequence[int]],
        seed: int,
        greedy: bool,
        steps: int,
        rows: Sequence[int] | None,
        first_steps: Sequence[int] | None,
    ) -> list[Sample]:
        from transformers import DynamicCache

        temperature = self.sampling.temperature
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        rows_B = (
            torch.arange(len(prompts), device=device) if rows is None else torch.tensor(rows, device=device)
        )
        steps_B = (
            torch.zeros_like(rows_B) if first_steps is None else torch.tensor(first_steps, device=device)
        )

        B = len(prompts)
        input_ids_BT, mask_BT, positions_BT = self._left_padded(prompts, device)

        cache = DynamicCache()
        tokens_BS = torch.empty((B, steps), dtype=torch.long, device=device)
        logprobs_BS = torch.zeros((B, steps), dtype=torch.float32, device=device)
        done_B = torch.zeros(B, dtype=torch.bool, device=device)
        lengths_B = torch.full((B,), steps, dtype=torch.long, device=device)
        eos_B = torch.tensor(self.eos_ids, dtype=torch.long, device=device)
        step_ids_BT = input_ids_BT
        n = 0
        for n in range(steps):
            out = self.model(
                input_ids=step_ids_BT,
                attention_mask=mask_BT,
                position_ids=positions_BT,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kwarg: cache},
            )
            logits_BV = out.logits[:, -1, :].float() / temperature
            logp_BV = torch.log_softmax(logits_BV, dim=-1)
            if greedy:
                next_B = logits_BV.argmax(dim=-1)
            else:
                next_B = gumbel_draw(logits_BV, self.sampling.top_p, seed, rows_B, steps_B + n)
            next_B = torch.where(done_B, torch.full_like(next_B, self.pad_id), next_B)
            tokens_BS[:, n] = next_B
            logprobs_BS[:, n] = logp_BV.gather(-1, next_B[:, None]).squeeze(-1)
            newly_done_B = (~done_B) & torch.isin(next_B, eos_B)
            lengths_B = torch.where(newly_done_B, torch.full_like(lengths_B, n + 1), lengths_B)
            done_B |= newly_done_B
            if self.all_done(done_B):
                break
            step_ids_BT = next_B[:, None]
            mask_BT = torch.cat([mask_BT, (~done_B).long()[:, None]], dim=-1)
            positions_BT = positions_BT[:, -1:] + 1
        if was_training:
            self.model.train()

        tokens = tokens_BS[:, : n + 1].tolist()
        logprobs = logprobs_BS[:, : n + 1].tolist()
        return [
            Sample(tuple(tokens[i][:k]), tuple(logprobs[i][:k]), bool(done_B[i]))
            for i, k in enumerate(lengths_B.tolist())
        ]

    def _left_padded(
        self, prompts: Sequence[Sequence[int]], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids, attention mask and positions of ``prompts`` left-padded, so that every row's next
        token sits in the last column."""
        width = max(len(p) for p in prompts)
        input_ids_BT = torch.full((len(prompts), width), self.pad_id, dtype=torch.long, device=device)
        mask_BT = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            input_ids_BT[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask_BT[i, width - len(p) :] = 1
        return input_ids_BT, mask_BT, (mask_BT.cumsum(-1) - 1).clamp(min=0)
