"""A batch of trajectories as tensors on the learner's device, split into micro-batches by a token
budget, and the log-probs of its completion tokens computed without a ``[B, L, V]`` tensor.

**Packing** (``pack``): prompt + completion per row, right-padded, on the model's device; the completion
of row ``b`` starts at ``start_B[b]`` and has ``length_B[b]`` tokens.

**Micro-batches** (``micro_batches``): the rows of one minibatch are grouped so that every group's
``rows x longest row`` (its padded tokens, what activation memory grows with) stays within a budget;
rows are taken longest first, so each group holds rows of similar length and little padding. Groups
of one GRPO group may land in different micro-batches: advantages are computed over the whole batch
first. A row longer than the budget on its own forms its own micro-batch (a row cannot be split).

**Log-probs** (``completion_logprobs``): the decoder's hidden states, then the LM head only at the
positions that predict a completion token (``h_NH`` for the ``N`` completion tokens of the micro-batch),
``logprob_chunk`` positions at a time: ``log softmax(head(h) / T)[target]`` computed in float32 as
``logit[target] - logsumexp(logits)``. Under autograd each chunk is recomputed in the backward pass
(``torch.utils.checkpoint``), so the logits kept at any moment are one chunk's, ``chunk x V``, whatever
``B`` and ``L``. This needs the model's logits to be exactly ``head(hidden)``; an architecture that
scales or soft-caps them (``lm_parts`` probes it once per model) takes the model's own forward instead,
whose logits are ``[b, L, V]`` per micro-batch.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from echo2.learner import grpo
from echo2.types import Trajectory

log = logging.getLogger(__name__)

Rows = Sequence[int]  # row indices into a packed batch


@dataclass(frozen=True)
class PackedBatch:
    """Trajectories as right-padded tensors (prompt + completion per row) on one device."""

    input_ids_BL: torch.Tensor  # prompt + completion ids, right-padded
    attention_mask_BL: torch.Tensor  # 1 on real tokens
    targets_BT: torch.Tensor  # completion ids, right-padded to T
    mask_BT: torch.Tensor  # loss weight of each completion token, 0 on padding
    logp_sampler_BT: torch.Tensor  # sampler log-probs aligned with targets
    start_B: torch.Tensor  # index in input_ids of each row's first completion token
    length_B: torch.Tensor  # completion tokens of each row
    logp_prox_BT: torch.Tensor | None = None  # the learner's log-probs before this update (proximal anchor)

    @property
    def rows(self) -> int:
        return int(self.input_ids_BL.shape[0])

    def lengths(self) -> list[int]:
        """Prompt + completion tokens of each row (what a micro-batch's padded width is made of)."""
        return (self.start_B + self.length_B).tolist()

    def select(self, rows: Rows) -> PackedBatch:
        """The batch of ``rows`` only, trimmed to their own longest row and completion."""
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=self.input_ids_BL.device)
        L = int((self.start_B[idx] + self.length_B[idx]).max())
        T = max(1, int(self.length_B[idx].max()))

        def cut(x: torch.Tensor | None, width: int) -> torch.Tensor | None:
            return None if x is None else x[idx, :width]

        return PackedBatch(
            input_ids_BL=self.input_ids_BL[idx, :L],
            attention_mask_BL=self.attention_mask_BL[idx, :L],
            targets_BT=self.targets_BT[idx, :T],
            mask_BT=self.mask_BT[idx, :T],
            logp_sampler_BT=self.logp_sampler_BT[idx, :T],
            start_B=self.start_B[idx],
            length_B=self.length_B[idx],
            logp_prox_BT=cut(self.logp_prox_BT, T),
        )


def pack(
    trajectories: Sequence[Trajectory],
    masks: Sequence[Sequence[float]],
    pad_id: int,
    device: torch.device | str | None = None,
) -> PackedBatch:
    """``trajectories`` (with their per-token loss weights ``masks``) as a :class:`PackedBatch` on
    ``device`` (default the CPU). Built on the CPU and moved once."""
    B = len(trajectories)
    L = max(len(t.prompt_ids) + len(t.completion_ids) for t in trajectories)
    T = max(1, max(len(t.completion_ids) for t in trajectories))
    cpu = torch.device("cpu")  # staged on the host, moved once
    input_ids = torch.full((B, L), pad_id, dtype=torch.long, device=cpu)
    attn = torch.zeros((B, L), dtype=torch.long, device=cpu)
    targets = torch.full((B, T), pad_id, dtype=torch.long, device=cpu)
    mask = torch.zeros((B, T), dtype=torch.float32, device=cpu)
    logp_s = torch.zeros((B, T), dtype=torch.float32, device=cpu)
    start = torch.zeros(B, dtype=torch.long, device=cpu)
    length = torch.zeros(B, dtype=torch.long, device=cpu)
    for i, (t, m) in enumerate(zip(trajectories, masks, strict=True)):
        p, c = len(t.prompt_ids), len(t.completion_ids)
        input_ids[i, : p + c] = torch.tensor(t.prompt_ids + t.completion_ids, dtype=torch.long, device=cpu)
        attn[i, : p + c] = 1
        targets[i, :c] = torch.tensor(t.completion_ids, dtype=torch.long, device=cpu)
        mask[i, :c] = torch.tensor(m, dtype=torch.float32, device=cpu)
        logp_s[i, :c] = torch.tensor(t.sampler_logprobs, dtype=torch.float32, device=cpu)
        start[i], length[i] = p, c
    batch = PackedBatch(input_ids, attn, targets, mask, logp_s, start, length)
    if device is None or torch.device(device) == cpu:
        return batch
    return PackedBatch(*(x.to(device, non_blocking=True) for x in _fields(batch)))


def _fields(batch: PackedBatch) -> tuple[torch.Tensor, ...]:
    return (
        batch.input_ids_BL,
        batch.attention_mask_BL,
        batch.targets_BT,
        batch.mask_BT,
        batch.logp_sampler_BT,
        batch.start_B,
        batch.length_B,
    )


def with_proximal(batch: PackedBatch, logp_prox_BT: torch.Tensor) -> PackedBatch:
    return replace(batch, logp_prox_BT=logp_prox_BT)


def micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Positions of ``lengths`` grouped so that each group's ``len(group) * max(its lengths)`` is at most
    ``budget`` (a length above the budget alone forms a group); longest first, ties by position, so the
    plan is deterministic and each group's rows have similar lengths.

    >>> micro_batches([3, 8, 5, 8], 16)
    [[1, 3], [2, 0]]
    """
    if budget < 1:
        raise ValueError(f"budget = {budget} must be >= 1 token")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    width = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * width <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
            width = lengths[i]  # the longest row of the new group (rows come longest first)
    return groups


# ---- log-probs of completion tokens ------------------------------------------------------------------
def completion_logits(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """``model``'s logits at the positions that predict each completion token, ``[B, T, V]`` (raw: not
    temperature-scaled; rows past a completion's end hold its last position's). The generation check
    compares whole logit rows; the trainer never builds this tensor (``completion_logprobs``)."""
    input_ids_BL = batch.input_ids_BL
    logits_BLV = model(input_ids=input_ids_BL, attention_mask=batch.attention_mask_BL, use_cache=False).logits
    T = batch.targets_BT.shape[1]
    arange_T = torch.arange(T, device=input_ids_BL.device)
    # the logit at position start-1+j predicts completion token j
    idx_BT = (batch.start_B[:, None] - 1 + arange_T[None, :]).clamp(max=input_ids_BL.shape[1] - 1)
    return logits_BLV.gather(1, idx_BT[..., None].expand(-1, -1, logits_BLV.shape[-1]))


@dataclass(frozen=True)
class LMParts:
    """An HF causal LM as its decoder (ids -> hidden states) and its LM head (hidden -> logits)."""

    decoder: torch.nn.Module
    head: torch.nn.Module


class _RootHidden(torch.nn.Module):
    """The decoder of a sharded model (FSDP2, ``learner/sharded.py``) as the whole model's forward with
    its LM head set aside: the root's forward gathers the embeddings, the final norm and the head's
    parameters (a tied head's are the embeddings') and keeps them whole until its backward, so the head
    can then run on the completion positions alone."""

    def __init__(self, model: torch.nn.Module, head: torch.nn.Module) -> None:
        super().__init__()
        self._model = [model]  # not a submodule: the model is the caller's
        self._head = head

    def release(self) -> None:
        """Shard the root's parameters again (a backward does it; a pass without one must)."""
        self._model[0].reshard()  # type: ignore[operator]

    def forward(self, **kwargs: Any) -> Any:
        model = self._model[0]
        model.set_output_embeddings(torch.nn.Identity())
        try:
            with warnings.catch_warnings():  # the output is a view of the hidden states; nothing here
                warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # writes to it
                hidden = model(**kwargs).logits  # the head's input: the decoder's normed hidden states
        finally:
            model.set_output_embeddings(self._head)

        class _Out:
            last_hidden_state = hidden

        return _Out()


def lm_parts(model: Any, through_root: bool = False) -> LMParts | None:
    """The decoder and LM head of ``model`` if its logits are exactly ``head(decoder(...))`` — probed
    once on a few tokens (an architecture that scales or soft-caps its logits fails the probe) — else
    None (log-probs then come from the model's own forward). ``through_root``: a sharded model's hidden
    states come from its own forward with the head set aside (``_RootHidden``; every rank probes)."""
    get_decoder = getattr(model, "get_decoder", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:
        return None
    decoder, head = get_decoder(), get_head()
    if decoder is None or head is None or decoder is model:
        return None
    if through_root:
        if not hasattr(model, "set_output_embeddings") or not hasattr(model, "reshard"):
            return None
        decoder = _RootHidden(model, head)
    param = next(model.parameters())
    vocab = int(getattr(model.config, "vocab_size", 2))
    ids = (torch.arange(6, device=param.device) * 7919 % max(vocab, 1))[None]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            full = model(input_ids=ids, use_cache=False).logits.float()
            mine = head(decoder(input_ids=ids, use_cache=False).last_hidden_state).float()
    finally:
        model.train(was_training)
    if isinstance(decoder, _RootHidden):
        decoder.release()
    if full.shape != mine.shape or not torch.allclose(full, mine, rtol=1e-4, atol=1e-5):
        log.warning(
            "%s's logits are not its LM head applied to its hidden states (scaled or soft-capped): "
            "log-probs come from the model's whole forward, [b, L, V] logits per micro-batch",
            type(model).__name__,
        )
        return None
    return LMParts(decoder, head)


def _chunk_logprobs(head: torch.nn.Module, h_cH: torch.Tensor, targets_c: torch.Tensor, temperature: float):
    logits_cV = head(h_cH).float() / temperature
    return logits_cV.gather(-1, targets_c[:, None]).squeeze(-1) - torch.logsumexp(logits_cV, dim=-1)


def completion_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    temperature: float,
    *,
    chunk: int = 4096,
    parts: LMParts | None = None,
) -> torch.Tensor:
    """Log-probs of the completion tokens under ``model`` (temperature-scaled, float32), ``[B, T]``
    (0 past each completion's end). With ``parts`` (``lm_parts(model)``), the LM head runs only at the
    completion positions, ``chunk`` of them at a time, each recomputed in the backward pass; without,
    the model's whole forward gives the logits."""
    B, T = batch.targets_BT.shape
    device = batch.input_ids_BL.device
    valid_BT = torch.arange(T, device=device)[None, :] < batch.length_B[:, None]
    b_N, j_N = valid_BT.nonzero(as_tuple=True)
    targets_N = batch.targets_BT[b_N, j_N]
    if parts is None:
        logits_BLV = model(
            input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL, use_cache=False
        ).logits
        logp_N = grpo.token_logprobs(logits_BLV[b_N, batch.start_B[b_N] - 1 + j_N], targets_N, temperature)
    else:
        hidden_BLH = parts.decoder(
            input_ids=batch.input_ids_BL, attention_mask=batch.attention_mask_BL, use_cache=False
        ).last_hidden_state
        h_NH = hidden_BLH[b_N, batch.start_B[b_N] - 1 + j_N]
        pieces = []
        for i in range(0, h_NH.shape[0], chunk):
            args = (parts.head, h_NH[i : i + chunk], targets_N[i : i + chunk], temperature)
            if torch.is_grad_enabled() and h_NH.requires_grad:
                pieces.append(torch.utils.checkpoint.checkpoint(_chunk_logprobs, *args, use_reentrant=False))
            else:
                pieces.append(_chunk_logprobs(*args))
        logp_N = torch.cat(pieces) if pieces else h_NH.new_zeros(0, dtype=torch.float32)
        if isinstance(parts.decoder, _RootHidden) and not h_NH.requires_grad:
            parts.decoder.release()  # no backward will: the root's gathered parameters go now
    out_BT = torch.zeros((B, T), dtype=torch.float32, device=device)
    return out_BT.index_put((b_N, j_N), logp_N.float())
