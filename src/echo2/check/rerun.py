"""The generation check: on a drawn share of submissions the learner re-runs the claimed version's
published weights over the prompt and completion and, with the lease's seed, recomputes at every step
the sampler's log-prob and the seeded Gumbel-max draw (``rollout/sampling.py``). Every position must
pass (``check/positions.py``): the log-prob within ``logprob_tolerance``, the token the draw or a
declared numerical near tie (within ``gumbel_tolerance`` of the best perturbed score); one miss is a
forgery [forged_generation], and a near tie on a token the grader reads (``Verifier.graded_from``) is
no forgery but is not trained [graded_tie]. A different model, tampered log-probs, an inflated version,
best-of-n cherry-picking, an answer rewritten or a phrase inserted all fail it; honest numerical noise
stays inside the tolerances, which follow the run's declared ``security.engine_precision``
(config.ENGINE_TOLERANCES), never a worker's claim. In a multi-turn episode only the policy's tokens are
checked: its token at completion index ``c`` was drawn at noise step ``c`` (``rollout/episodes.py``).

The check keeps the weights of every version a submission may still claim (the newest whole, older ones
as undos, ``weights/undo.py``), pinned while a drawn submission waits for its check, and gives a running
update its turn between chunks (``check/turns.py``). What a task checks of every submission (prompts,
shape, the grade, an episode's replay) is the task's: ``tasks/verify.py``.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from echo2.check.positions import LogHistogram, Positions, judge
from echo2.check.turns import Turns
from echo2.config import SamplingConfig, SecurityConfig
from echo2.data.submission import Rejected, Submission
from echo2.models.snapshot import load_for_check
from echo2.types import Trajectory
from echo2.weights.undo import Undo, rebuild

if TYPE_CHECKING:
    import torch

    from echo2.data.store import Lease

SHORT_ROWS = 64  # completions that fit in one chunk re-run together through the decoder


@dataclass(frozen=True)
class Verdict:
    """What re-running one completion found."""

    tokens: int  # completion tokens checked
    misses: int  # tokens failing either check
    draw_misses: int  # tokens that are not the seeded draw of the claimed weights
    logprob_misses: int  # tokens whose claimed log-prob is off by more than the tolerance
    max_logprob_error: float  # largest |claimed - recomputed| log-prob
    near_ties: int = 0  # tokens that were not the check's draw but declared near ties (positions.py)
    tie_positions: tuple[int, ...] = ()  # the completion positions of those near ties
    room: int = 0  # positions where a token other than the draw lay within the margin (an attacker's choice)


class GenerationCheck:
    """Re-derives sampled completions with the claimed version's published weights (the expensive
    check, on a fraction of submissions). Holds the newest published version's sampler copy (shared
    with the snapshot publisher: the base of its next patch) and, for each older version still
    admissible (:meth:`keep`, :meth:`forget_below`), only an undo (``echo2.weights.undo``): the
    elements the next publication changed, as they were. A check of an older version rebuilds its
    weights from the newest for the duration of the check (one transient copy of the changed tensors)."""

    def __init__(
        self,
        model: Any,
        sampling: SamplingConfig,
        security: SecurityConfig,
        rng: random.Random | None = None,
        expand: Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]] | None = None,
        turns: Turns | None = None,
    ) -> None:
        # a model of the trained architecture, the check's own: the learner's reads the kept copies in
        # place (models/snapshot.py:aliasing_model), so it holds no weights of its own
        self.model = model.eval()
        # what a kept version's published weights become in the model: themselves, or in a LoRA run
        # (models/lora.PublishedBase.expand) base + adapter, exactly as the workers' engines load them
        self.expand = expand or (lambda weights: weights)
        self.sampling = sampling
        self.cfg = security
        self.rng = rng or random.SystemRandom()  # which submissions: workers must not predict it
        # the learner's update comes first: between chunks a check gives the update its turn
        # (check/turns.py, security.check_duty); without one it never waits
        self.turns = turns or Turns()
        self._newest: tuple[int, Mapping[str, torch.Tensor]] | None = None
        self._undos: dict[int, Undo] = {}  # older version -> the undo from the next held version to it
        self._pins: dict[int, int] = {}  # version -> drawn submissions waiting for their check of it
        self._floor = -1  # the oldest version a submission may still claim (forget_below)
        self._loaded: int | None = None  # version whose weights are in self.model
        self._lock = threading.Lock()  # one check at a time (the model is loaded per version)
        self._wlock = threading.Lock()  # the held weights (the event loop adds; never waits on a check)
        self.checked = 0  # completions re-run
        self.tokens = 0  # tokens re-checked
        self.worst_passing_error = 0.0  # largest |claimed - recomputed| log-prob of a passing completion
        self.rebuilds = 0  # older versions rebuilt from the newest for a check
        self.near_ties = 0  # tokens that were not the check's draw but declared near ties (positions.py)
        self.room = 0  # positions where another token lay within the draw margin (what it leaves a forger)
        self.graded_ties = 0  # submissions dropped for a near tie on a token the grader reads
        self.errors = LogHistogram()  # per position: |claimed - recomputed| sampler log-prob
        self._busy_s = self._busy_done = self._busy_tokens = 0.0  # checking: seconds, completions, tokens
        self.deficits = LogHistogram()  # per position not the check's draw: best perturbed score - its
        self.gaps = LogHistogram()  # per position: best - second best perturbed score (room at any margin)
        self.declined = 0  # submissions the full-rate draw picked that a full check queue let through
        self._parts: Any = None  # the model's decoder and LM head (learner/logprobs.lm_parts), False: none
        self._stream: Any = None  # on a CUDA device, the check's own stream (:meth:`_own_stream`)

    def keep(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """The published weights of ``version``, newer than any kept (any thread but the event loop:
        the undo of the version it replaces as the newest is computed here)."""
        with self._wlock:
            newest = self._newest
        undo = None
        if newest is not None:
            if version <= newest[0]:
                raise ValueError(f"version {version} is not newer than the kept version {newest[0]}")
            undo = Undo.of(weights, newest[1])
        with self._wlock:
            if newest is not None and undo is not None:
                self._undos[newest[0]] = undo
            self._newest = (version, weights)
        if self._lock.acquire(blocking=False):  # else the check in progress settles when it ends
            try:
                self._settle()
            finally:
                self._lock.release()

    def forget_below(self, version: int) -> None:
        """Drop what is kept of versions no submission can still be admitted with, except what a drawn
        submission waiting for its check needs (:meth:`pin`): a check, once drawn, always runs."""
        with self._wlock:
            self._floor = max(self._floor, version)
            self._forget()

    def pin(self, version: int) -> bool:
        """Hold the weights of ``version`` until :meth:`unpin` (a drawn submission's check waits for
        them); False, nothing pinned, when they are not held now."""
        with self._wlock:
            if not self._holds(version):
                return False
            self._pins[version] = self._pins.get(version, 0) + 1
            return True

    def unpin(self, version: int) -> None:
        """The check that pinned ``version`` ran (or never will): what only it kept goes."""
        with self._wlock:
            left = self._pins.pop(version) - 1
            if left:
                self._pins[version] = left
            self._forget()

    def _forget(self) -> None:
        """(``_wlock`` held) Drop the undos below the floor and below every pinned version: rebuilding a
        version takes every undo from the newest down to it."""
        keep_from = min([self._floor, *self._pins])
        for v in [v for v in self._undos if v < keep_from]:
            del self._undos[v]

    def versions(self) -> list[int]:
        with self._wlock:
            return sorted([*self._undos, *([self._newest[0]] if self._newest else [])])

    def held_bytes(self) -> int:
        """Bytes of what the check keeps of older versions (the undos; the newest copy is shared)."""
        with self._wlock:
            return sum(u.nbytes for u in self._undos.values())

    def holds(self, version: int) -> bool:
        """Whether the weights of ``version`` can be rebuilt (a claim of it can be re-run)."""
        with self._wlock:
            return self._holds(version)

    def _holds(self, version: int) -> bool:
        return version in self._undos or (self._newest is not None and self._newest[0] == version)

    def _weights_of(self, version: int) -> Mapping[str, torch.Tensor] | None:
        """The weights of ``version`` (None when not held): the newest copy itself, or an older
        version rebuilt from it (a transient copy of the tensors the undos touch)."""
        with self._wlock:
            if self._newest is None:
                return None
            newest_v, newest_w = self._newest
            if version == newest_v:
                return newest_w
            if version not in self._undos:
                return None
            undos = [self._undos[v] for v in sorted(self._undos, reverse=True) if v >= version]
        self.rebuilds += 1
        return rebuild(newest_w, undos)

    def pick(
        self, sub: Submission, share: float | None = None, full: float | None = None
    ) -> list[tuple[int, int]]:
        """The (group, sample) positions to re-check in ``sub``: none unless the submission is drawn
        (probability ``share``, at most ``full``: the submitter's draw, ``check_fraction`` unless the
        checker says otherwise; the checker lowers ``share`` as its queue fills, never below
        ``check_floor``, and a draw under ``full`` but not under ``share`` is counted ``declined``), else
        ``check_samples`` of them at random (0: every one, so a submission with any forged completion
        fails its check)."""
        full = self.cfg.check_fraction if full is None else full
        share = full if share is None else min(share, full)
        u = self.rng.random()
        if u >= share:
            self.declined += int(u < full)
            return []
        where = [(i, j) for i, g in enumerate(sub.groups) for j in range(len(g))]
        rows = self.cfg.check_samples or len(where)
        return where if rows >= len(where) else self.rng.sample(where, rows)

    def check(
        self,
        lease: Lease,
        sub: Submission,
        picks: Sequence[tuple[int, int]],
        due: Callable[[], bool] | None = None,
        graded_from: Callable[[int, int], int] | None = None,
    ) -> list[Verdict]:
        """Re-run the picked completions (any thread; one check at a time); raise
        :class:`Rejected` ``forged_generation`` at the first forgery (a position that misses,
        ``positions.py``), ``graded_tie`` when none was forged but a near tie fell on a token the grader
        reads (``graded_from(group, sample)``: the first such position; None: every position), and
        ``unchecked_version`` when the claimed version's weights are not held (the checker pins
        it first). Between its chunks it gives a running update its turn (:attr:`turns`)
        unless ``due()`` says it cannot wait."""
        if not self.holds(sub.policy_version):
            raise Rejected(
                "unchecked_version", f"policy_version: {sub.policy_version}: its weights are not held here"
            )
        with self._lock, self._own_stream():
            if not picks:
                return []
            self.turns.begin(due, self._stream.synchronize if self._stream is not None else None)
            if self._loaded != sub.policy_version:
                weights = self._weights_of(sub.policy_version)
                if weights is None:  # forgotten since holds() above
                    raise Rejected(
                        "unchecked_version",
                        f"policy_version: {sub.policy_version}: its weights are not held here",
                    )
                load_for_check(self.model, self.expand(weights))
                self._loaded = sub.policy_version
                del weights
                self.turns.pause()
            t0, done, tokens = time.perf_counter(), self.checked, self.tokens
            try:
                return self._run(lease, sub, picks, graded_from or (lambda i, j: 0))
            finally:  # a rebuilt copy goes with the check, an older newest with its successor
                self._settle()
                self._busy_s += time.perf_counter() - t0
                self._busy_done += self.checked - done
                self._busy_tokens += self.tokens - tokens

    def capacity(self) -> tuple[float, float]:
        """What the check re-runs per second of checking: (completions/s, tokens/s), its waits for the
        learner's updates included (0, 0 before the first check)."""
        if self._busy_s <= 0.0:
            return 0.0, 0.0
        return self._busy_done / self._busy_s, self._busy_tokens / self._busy_s

    def _own_stream(self) -> contextlib.AbstractContextManager[Any]:
        """On a CUDA device, a stream of the check's own, after what the default stream has queued (the
        kept copies are written there): the check's kernels never queue behind the update's, nor the
        update's behind them (prepared, not measured on a GPU). Elsewhere nothing."""
        import torch

        device = next(self.model.parameters()).device
        if device.type != "cuda":
            return contextlib.nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        return torch.cuda.stream(self._stream)

    def _settle(self) -> None:
        """Point the check model at the newest kept copy (no copy on the CPU), so that it holds no
        rebuilt or superseded weights between checks (with ``_lock`` held)."""

        with self._wlock:
            newest = self._newest
        if newest is not None and self._loaded != newest[0]:
            load_for_check(self.model, self.expand(newest[1]))
            self._loaded = newest[0]

    def _run(
        self,
        lease: Lease,
        sub: Submission,
        picks: Sequence[tuple[int, int]],
        graded_from: Callable[[int, int], int],
    ) -> list[Verdict]:
        verdicts, ties = [], []
        for i, j, state_CX in self._states_of(sub, picks):  # in order: the first forgery ends the check
            t = sub.groups[i][j]
            row = i * len(sub.groups[i]) + j  # the row it was sampled in (rollout/collect.py)
            verdict = self.rerun(t, lease.seed, row, state_CX)
            verdicts.append(verdict)
            if verdict.misses:  # no share of a completion may miss
                raise Rejected(
                    "forged_generation",
                    f"groups[{i}].samples[{j}]: {verdict.draw_misses} of {verdict.tokens} tokens are "
                    f"not version {sub.policy_version}'s seeded draw, {verdict.logprob_misses} "
                    f"log-probs are off (worst by {verdict.max_logprob_error:.3g})",
                )
            self.worst_passing_error = max(self.worst_passing_error, verdict.max_logprob_error)
            if verdict.tie_positions and verdict.tie_positions[-1] >= (start := graded_from(i, j)):
                ties.append(f"groups[{i}].samples[{j}] at {verdict.tie_positions[-1]} (graded from {start})")
        if ties:  # honest rounding makes these: no forgery, and nothing trained on a choice the grade reads
            self.graded_ties += 1
            raise Rejected(
                "graded_tie",
                f"a near tie on a token the grader reads: {', '.join(ties[:4])}; the submission is dropped "
                "untrained (no strike)",
            )
        return verdicts

    def _states_of(self, sub: Submission, picks: Sequence[tuple[int, int]]) -> Iterator[tuple[int, int, Any]]:
        """``(group, sample, state)`` of every pick, in order: completions that fit in one chunk with their
        prompt go through the decoder together (runs of up to ``SHORT_ROWS``: one padded pass instead of
        a pass each), longer ones one at a time in chunks (:meth:`_hidden`)."""
        step = max(1, self.cfg.check_chunk_tokens)

        def short(k: int) -> bool:
            t = sub.groups[picks[k][0]][picks[k][1]]
            return len(t.prompt_ids) + len(t.completion_ids) <= step

        k = 0
        while k < len(picks):
            run = [k]
            while short(k) and len(run) < SHORT_ROWS and run[-1] + 1 < len(picks) and short(run[-1] + 1):
                run.append(run[-1] + 1)
            states = self._hidden([sub.groups[picks[r][0]][picks[r][1]] for r in run])
            yield from ((*picks[r], st) for r, st in zip(run, states, strict=True))
            k = run[-1] + 1

    def _hidden(self, trajectories: Sequence[Trajectory]) -> list[Any]:
        """What the loaded weights give at every completion position of each trajectory: the decoder's
        hidden states there (``[C, H]``; the LM head runs later, one chunk of positions at a time), from
        a teacher-forced pass over ``check_chunk_tokens`` positions at a time with the keys and values
        of the earlier ones cached (:meth:`_states`), so that no activation of the whole sequence
        exists at once; or, for a model whose logits are not its head of its hidden states, the logits
        themselves (``[C, V]``, float32, from one packed forward pass)."""
        import torch

        from echo2.learner.logprobs import completion_logits, lm_parts, pack

        if self._parts is None:
            self._parts = lm_parts(self.model) or False
        device = next(self.model.parameters()).device
        step = max(1, self.cfg.check_chunk_tokens)
        if self._parts and len(trajectories) > 1:
            assert all(len(t.prompt_ids) + len(t.completion_ids) <= step for t in trajectories)
            return self._short_states(trajectories, device)
        if self._parts:
            return [self._states(t, device) for t in trajectories]
        batch = pack(trajectories, [[1.0] * len(t.completion_ids) for t in trajectories], 0, device)
        with torch.no_grad():
            logits_BTV = completion_logits(self.model, batch).float()
        return [logits_BTV[b, : len(t.completion_ids)] for b, t in enumerate(trajectories)]

    def _short_states(self, trajectories: Sequence[Trajectory], device: Any) -> list[Any]:
        """:meth:`_states` of completions that fit in one chunk with their prompt, in one right-padded
        pass of the decoder (a pad after a row's tokens is never attended to by them)."""
        import torch

        L = max(len(t.prompt_ids) + len(t.completion_ids) for t in trajectories) - 1
        ids_BL = torch.zeros((len(trajectories), L), dtype=torch.long)
        mask_BL = torch.zeros((len(trajectories), L), dtype=torch.long)
        for b, t in enumerate(trajectories):
            seq = [*t.prompt_ids, *t.completion_ids][:-1]  # the last token predicts nothing checked
            ids_BL[b, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask_BL[b, : len(seq)] = 1
        with torch.no_grad():
            h_BLH = self._parts.decoder(
                input_ids=ids_BL.to(device), attention_mask=mask_BL.to(device), use_cache=False
            ).last_hidden_state
        self.turns.pause()
        return [
            h_BLH[b, len(t.prompt_ids) - 1 : len(t.prompt_ids) - 1 + len(t.completion_ids)]
            for b, t in enumerate(trajectories)
        ]

    def _states(self, t: Trajectory, device: Any) -> Any:
        """The decoder's hidden states at the positions that predict ``t``'s completion tokens
        (``[C, H]``: position ``P - 1 + j`` predicts token ``j``), computed ``check_chunk_tokens``
        positions at a time over the prompt and the completion with a key-value cache: the memory of
        one chunk's activations plus the cache, never the whole sequence's."""
        import torch
        from transformers import DynamicCache

        from echo2.models.policy import cache_kwarg

        P, C = len(t.prompt_ids), len(t.completion_ids)
        ids = torch.tensor([[*t.prompt_ids, *t.completion_ids]], dtype=torch.long, device=device)
        step, cache, parts = max(1, self.cfg.check_chunk_tokens), DynamicCache(), []
        key = cache_kwarg(self._parts.decoder)  # the cache's keyword in this transformers
        with torch.no_grad():
            for lo in range(0, P + C - 1, step):  # the last token predicts nothing that is checked
                hi = min(P + C - 1, lo + step)
                h_cH = self._parts.decoder(
                    input_ids=ids[:, lo:hi], use_cache=True, **{key: cache}
                ).last_hidden_state[0]
                if hi > P - 1:
                    parts.append(h_cH[max(0, P - 1 - lo) :])
                self.turns.pause()
        return torch.cat(parts)

    def _chunk_logits(self, state_CX: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Float32 logits of completion positions ``lo:hi`` from :meth:`_hidden`'s state."""
        import torch

        if not self._parts:
            return state_CX[lo:hi].float()
        with torch.no_grad():
            return self._parts.head(state_CX[lo:hi]).float()

    def rerun(self, t: Trajectory, seed: int, row: int, state_CX: torch.Tensor | None = None) -> Verdict:
        """Recompute one completion's per-step log-probs and seeded draws with the loaded weights
        (``state_CX``: :meth:`_hidden`'s for it, when already computed), ``check_chunk_tokens``
        positions at a time: the logits, the noise and the nucleus of one chunk exist at once, never
        ``[C, V]`` tensors. Every position is judged by ``positions.judge`` (no share may miss)."""
        import torch

        from echo2.learner.grpo import token_logprobs
        from echo2.rollout.sampling import gumbel_noise

        C = len(t.completion_ids)
        if state_CX is None:
            (state_CX,) = self._hidden([t])
        temperature = self.sampling.temperature
        lp_tol, draw_tol = self.cfg.tolerances()
        dev = state_CX.device
        tokens_C = torch.tensor(t.completion_ids, dtype=torch.long, device=dev)
        claimed_C = torch.tensor(t.sampler_logprobs, dtype=torch.float32, device=dev)
        parts: list[Positions] = []
        step = max(1, self.cfg.check_chunk_tokens)
        for lo in range(0, C, step):
            hi = min(C, lo + step)
            logits_cV = self._chunk_logits(state_CX, lo, hi)
            tok_c = tokens_C[lo:hi]
            logp_c = token_logprobs(logits_cV[None], tok_c[None], temperature)[0]  # as the learner's ratio
            scaled_cV = logits_cV.div_(temperature)
            steps_c = torch.arange(lo, hi, device=dev)
            noise_cV = gumbel_noise(
                seed, torch.full((hi - lo,), row, device=dev), steps_c, scaled_cV.shape[-1]
            )
            parts.append(
                judge(scaled_cV, noise_cV, tok_c, logp_c, claimed_C[lo:hi], self.sampling.top_p, draw_tol)
            )
            del logits_cV, scaled_cV, noise_cV
            self.turns.pause()
        if not parts:
            return Verdict(0, 0, 0, 0, 0.0)
        got = Positions(*(torch.cat([getattr(p, f) for p in parts]) for f in Positions.__dataclass_fields__))
        where_C = torch.arange(C, device=dev)
        if t.turn_mask:  # an episode: only the policy's tokens were drawn (step = completion index)
            policy_C = torch.tensor(t.turn_mask, dtype=torch.bool, device=dev)
            got = Positions(*(getattr(got, f)[policy_C] for f in Positions.__dataclass_fields__))
            where_C = where_C[policy_C]
        lp_ok_C, draw_ok_C = got.error_c <= lp_tol, got.exact_c | got.near_c
        verdict = Verdict(
            tokens=int(where_C.numel()),
            misses=int((~(draw_ok_C & lp_ok_C)).sum()),
            draw_misses=int((~draw_ok_C).sum()),
            logprob_misses=int((~lp_ok_C).sum()),
            max_logprob_error=float(got.error_c.max()) if where_C.numel() else 0.0,
            near_ties=int(got.near_c.sum()),
            tie_positions=tuple(int(k) for k in where_C[got.near_c].tolist()),
            room=int(got.room_c.sum()),
        )
        self.errors.add(got.error_c)
        self.deficits.add(got.deficit_c[~got.exact_c])
        self.gaps.add(got.gap_c[torch.isfinite(got.gap_c)])
        self.checked += 1
        self.tokens += verdict.tokens
        self.near_ties += verdict.near_ties
        self.room += verdict.room
        return verdict
