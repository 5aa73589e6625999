"""echo2's seeded sampler inside vLLM: a vLLM logits processor that makes the engine draw exactly the
token :mod:`echo2.rollout.sampling` defines, and report exactly the log-prob the learner recomputes.

Imported only when a worker builds the vLLM engine (it subclasses vLLM's ``LogitsProcessor``).

How it fits vLLM's sampler (``vllm/v1/sample/sampler.py``): every echo2 request is a *greedy* vLLM
request (``temperature=0``) whose ``SamplingParams.extra_args["echo2"]`` carries the draw's
coordinates (seed, noise row, first step, temperature, top-p, greedy). The processor is registered as
not argmax-invariant, so vLLM applies it to the float32 logits before its greedy argmax. For each
echo2 row it computes

    z = logits / T,   c = argmax_v  nucleus_p(z)[v] + g(seed, row, step, v)   (greedy: argmax_v z[v])

and leaves a row that is ``-inf`` everywhere except ``log_softmax(z)[c]`` at ``c``. vLLM's argmax then
takes ``c``, and with ``logprobs_mode="processed_logits"`` and ``logprobs=0`` the log-prob vLLM
returns for the sampled token is that single finite value: the sampler log-prob under the
temperature-scaled distribution before nucleus truncation, the convention of
:mod:`echo2.rollout.engines.base`. vLLM's own random sampler is never used, so the draw is the one the
learner re-derives from the seed (``runtime/verify.GenerationCheck``).

Rows of requests without echo2 arguments are left untouched.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from echo2.rollout.sampling import gumbel_draw

EXTRA_KEY = "echo2"  # SamplingParams.extra_args key carrying a request's draw coordinates


class Draw(NamedTuple):
    """Where one request's tokens come from (``SamplingParams.extra_args[EXTRA_KEY]`` as a dict)."""

    seed: int
    row: int  # noise row
    first_step: int  # noise step of the request's first completion token
    temperature: float
    top_p: float
    greedy: bool


class Echo2Sampler(LogitsProcessor):
    """Seeded Gumbel-max draws with exact sampler log-probs for echo2 requests (module docstring)."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self._rows: dict[int, tuple[Draw, list[int]]] = {}  # batch index -> (draw, live output ids)

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        args = (sampling_params.extra_args or {}).get(EXTRA_KEY)
        if args is not None:
            Draw(**args)  # a malformed request fails at submission, not inside the forward pass
            if sampling_params.temperature != 0.0:
                raise ValueError("echo2 requests must be greedy vLLM requests (temperature=0)")

    def is_argmax_invariant(self) -> bool:
        return False  # it picks the token: vLLM must apply it before its greedy argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._rows.pop(index, None)
        for index, params, _prompt, output_ids in batch_update.added:
            args = (params.extra_args or {}).get(EXTRA_KEY)
            if args is None:
                self._rows.pop(index, None)
            else:
                self._rows[index] = (Draw(**args), output_ids)
        for a, b, direction in batch_update.moved:
            at_a, at_b = self._rows.pop(a, None), self._rows.pop(b, None)
            if at_a is not None:
                self._rows[b] = at_a
            if at_b is not None and direction == MoveDirectionality.SWAP:
                self._rows[a] = at_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        groups: dict[tuple[int, float, float, bool], list[tuple[int, int, int]]] = {}
        for index, (d, output_ids) in self._rows.items():
            key = (d.seed, d.temperature, d.top_p, d.greedy)
            groups.setdefault(key, []).append((index, d.row, d.first_step + len(output_ids)))
        for (seed, temperature, top_p, greedy), members in groups.items():
            index_B = torch.tensor([m[0] for m in members], device=logits.device)
            z_BV = logits.index_select(0, index_B).float() / temperature
            if greedy:
                chosen_B = z_BV.argmax(dim=-1)
            else:
                rows_B = torch.tensor([m[1] for m in members], device=logits.device)
                steps_B = torch.tensor([m[2] for m in members], device=logits.device)
                chosen_B = gumbel_draw(z_BV, top_p, seed, rows_B, steps_B)
            logp_B = torch.log_softmax(z_BV, dim=-1).gather(-1, chosen_B[:, None]).squeeze(-1)
            logits[index_B] = float("-inf")
            logits[index_B, chosen_B] = logp_B.to(logits.dtype)
        return logits
