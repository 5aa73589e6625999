"""What a worker says that the learner checks itself: the prompt it answered, the reward it earned, the
version it sampled with, and (on a sample of submissions) that its tokens are the claimed weights' draw.

A worker is a stranger's machine (docs/security.md). Nothing it claims is believed:

- **Every submission** (:class:`Verifier`, cheap): every sample's ``prompt_ids`` are the leased
  prompt's own tokens (the learner encodes the prompt text exactly as workers do) [prompt_mismatch];
  every reward of a verifiable task is the task's grade of the completion [reward_mismatch]; a
  completion ends at its first EOS, and one without EOS is exactly ``max_new_tokens`` long (no
  cherry-picked truncation) [completion_shape]; the claimed version is not older than the one the
  worker said it held when it took the lease (installs only move forward) [version_mismatch].
- **A sampled fraction** (:class:`GenerationCheck`, one forward pass per checked completion): the
  learner re-runs the claimed version's published weights over the prompt and completion and, with
  the lease's seed, recomputes at every step the sampler's log-prob and the seeded Gumbel-max draw
  (``rollout/sampling.py``). A token that is not the draw (beyond ``gumbel_tolerance`` in logit units,
  with the nucleus boundary given the same slack) or whose log-prob differs by more than
  ``logprob_tolerance`` is a miss; more than ``max_token_misses`` of a completion's tokens is a forgery
  [forged_generation]. A different model, tampered log-probs, an inflated version (the tokens are
  not the claimed version's draw), best-of-n cherry-picking and a made-up completion all fail it;
  honest numerical noise (batched vs unbatched kernels, another GPU) stays inside the tolerances.

The checks run off the event loop, one at a time, on models and a tokenizer of their own. A failure
of ``reward_mismatch`` or ``forged_generation`` is evidence of lying: the intake quarantines the
worker (``intake.py``).
"""

from __future__ import annotations

import copy
import math
import random
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from echo2.config import SamplingConfig, SecurityConfig
from echo2.data.submission import Rejected, Submission
from echo2.types import Prompt, Trajectory

if TYPE_CHECKING:
    import torch

    from echo2.data.store import Lease
    from echo2.data.tasks.base import Task
    from echo2.models.policy import TextCodec

REWARD_TOLERANCE = 1e-6  # a claimed reward this close to the recomputed one is the same reward
NUCLEUS_SLACK = 1e-3  # probability mass of slack given to the top-p boundary (numerical noise)
EVIDENCE = frozenset({"reward_mismatch", "forged_generation"})  # refusals that quarantine the worker


class Verifier:
    """The checks every submission gets (cheap: a tokenizer and the task's grader)."""

    def __init__(self, codec: TextCodec, task: Task, eos_id: int, max_new_tokens: int) -> None:
        from echo2.models.policy import TextCodec

        self.codec = TextCodec(copy.deepcopy(codec.tokenizer), codec.chat_template)  # this thread's own
        self.task = task
        self.eos_id = eos_id
        self.max_new_tokens = max_new_tokens
        self._lock = threading.Lock()  # one check at a time: the tokenizer is not shared across calls
        self._tokens: dict[str, tuple[int, ...]] = {}  # prompt text -> its tokens

    def check(self, lease: Lease, sub: Submission) -> None:
        """Raise :class:`Rejected` unless the submission is what ``lease`` asked for: the claimed version
        not older than the worker held, every group answering its leased prompt with that prompt's own
        tokens, every completion well formed and every reward the task's (any thread). Groups whose
        prompt id is not in the lease are left to the store, which refuses them (``prompt_mismatch``)."""
        if sub.policy_version < lease.installed_version:
            raise Rejected(
                "version_mismatch",
                f"policy_version: {sub.policy_version}, but the worker held "
                f"{lease.installed_version} when it took the lease",
            )
        by_id = {p.prompt_id: p for p in lease.prompts}
        with self._lock:
            for i, group in enumerate(sub.groups):
                prompt = by_id.get(group[0].prompt_id) if group else None
                if prompt is None:
                    continue
                want = self._prompt_tokens(prompt.text)
                for j, t in enumerate(group):
                    self._check_sample(prompt, want, t, f"groups[{i}].samples[{j}]")

    def _check_sample(self, prompt: Prompt, want: tuple[int, ...], t: Trajectory, where: str) -> None:
        if tuple(t.prompt_ids) != want:
            raise Rejected("prompt_mismatch", f"{where}.prompt_ids: not the leased prompt's tokens")
        ids = t.completion_ids
        eos = ids.index(self.eos_id) if self.eos_id in ids else -1
        if eos >= 0 and eos != len(ids) - 1:
            raise Rejected("completion_shape", f"{where}.completion_ids: tokens after EOS at {eos}")
        if eos < 0 and len(ids) != self.max_new_tokens:
            raise Rejected(
                "completion_shape",
                f"{where}.completion_ids: {len(ids)} tokens without EOS (a completion ends at EOS or "
                f"after max_new_tokens={self.max_new_tokens})",
            )
        reward = self.task.grade(prompt, self.codec.decode_completion(ids)).reward
        if not math.isclose(t.reward, reward, rel_tol=0.0, abs_tol=REWARD_TOLERANCE):
            raise Rejected(
                "reward_mismatch", f"{where}.reward: {t.reward!r} claimed, the task gives {reward!r}"
            )

    def _prompt_tokens(self, text: str) -> tuple[int, ...]:
        tokens = self._tokens.get(text)
        if tokens is None:
            if len(self._tokens) > 65536:  # bounded: a long run leases many distinct prompts
                self._tokens.clear()
            tokens = self._tokens[text] = tuple(self.codec.encode_prompt(text))
        return tokens


@dataclass(frozen=True)
class Verdict:
    """What re-running one completion found."""

    tokens: int  # completion tokens checked
    misses: int  # tokens failing either check
    draw_misses: int  # tokens that are not the seeded draw of the claimed weights
    logprob_misses: int  # tokens whose claimed log-prob is off by more than the tolerance
    max_logprob_error: float  # largest |claimed - recomputed| log-prob


class GenerationCheck:
    """Re-derives sampled completions with the claimed version's published weights (the expensive
    check, on a fraction of submissions). Holds the sampler copies of the versions still admissible
    (:meth:`keep`, :meth:`forget_below`): up to ``S + 1`` copies in the publication dtype, the newest
    shared with the snapshot publisher."""

    def __init__(
        self,
        model: Any,
        sampling: SamplingConfig,
        security: SecurityConfig,
        rng: random.Random | None = None,
    ) -> None:
        self.model = model.eval()  # a model of the trained architecture, the check's own
        self.sampling = sampling
        self.cfg = security
        self.rng = rng or random.SystemRandom()  # which submissions: workers must not predict it
        self._weights: dict[int, Mapping[str, torch.Tensor]] = {}
        self._loaded: int | None = None  # version whose weights are in self.model
        self._lock = threading.Lock()  # one check at a time (the model is loaded per version)
        self._wlock = threading.Lock()  # the held weights (the event loop adds; never waits on a check)
        self.checked = 0  # completions re-run
        self.tokens = 0  # tokens re-checked
        self.worst_passing_error = 0.0  # largest |claimed - recomputed| log-prob of a passing completion
        self.passing_misses = 0  # tokens that missed in completions that passed (numerical noise)

    def keep(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """The published weights of ``version`` (any thread)."""
        with self._wlock:
            self._weights[version] = weights

    def forget_below(self, version: int) -> None:
        """Drop weights of versions no submission can still be admitted with."""
        with self._wlock:
            for v in [v for v in self._weights if v < version]:
                del self._weights[v]

    def versions(self) -> list[int]:
        return sorted(self._weights)

    def pick(self, sub: Submission) -> list[tuple[int, int]]:
        """The (group, sample) positions to re-check in ``sub``: none unless the submission is drawn
        (probability ``check_fraction``), else ``check_samples`` of them at random."""
        if self.cfg.check_fraction <= 0 or self.rng.random() >= self.cfg.check_fraction:
            return []
        where = [(i, j) for i, g in enumerate(sub.groups) for j in range(len(g))]
        return self.rng.sample(where, min(self.cfg.check_samples, len(where)))

    def check(self, lease: Lease, sub: Submission, picks: Sequence[tuple[int, int]]) -> list[Verdict]:
        """Re-run the picked completions (any thread; one check at a time); raise
        :class:`Rejected` ``forged_generation`` at the first forgery. A version whose weights are not
        held (published from raw bytes, or already forgotten) cannot be checked: returns ``[]``."""
        with self._wlock:
            weights = self._weights.get(sub.policy_version)
        with self._lock:
            if weights is None or not picks:
                return []
            if self._loaded != sub.policy_version:
                from echo2.models.snapshot import install_weights

                install_weights(self.model, weights)
                self._loaded = sub.policy_version
            verdicts = []
            trajectories = [sub.groups[i][j] for i, j in picks]
            for (i, j), t, logits_CV in zip(picks, trajectories, self._logits(trajectories), strict=True):
                row = i * len(sub.groups[i]) + j  # the row it was sampled in (rollout/collect.py)
                verdict = self.rerun(t, lease.seed, row, logits_CV)
                verdicts.append(verdict)
                allowed = math.floor(self.cfg.max_token_misses * verdict.tokens)
                if verdict.misses <= allowed:
                    self.worst_passing_error = max(self.worst_passing_error, verdict.max_logprob_error)
                    self.passing_misses += verdict.misses
                else:
                    raise Rejected(
                        "forged_generation",
                        f"groups[{i}].samples[{j}]: {verdict.draw_misses} of {verdict.tokens} tokens are "
                        f"not version {sub.policy_version}'s seeded draw, {verdict.logprob_misses} "
                        f"log-probs are off (worst by {verdict.max_logprob_error:.3g})",
                    )
            return verdicts

    def _logits(self, trajectories: Sequence[Trajectory]) -> list[torch.Tensor]:
        """The loaded weights' logits at every completion position of each trajectory (``[C, V]``):
        one forward pass over them all, packed as the trainer packs a batch."""
        import torch

        from echo2.learner.trainer import completion_logits, pack

        batch = pack(trajectories, [[1.0] * len(t.completion_ids) for t in trajectories], pad_id=0)
        with torch.no_grad():
            logits_BTV = completion_logits(self.model, batch).float()
        return [logits_BTV[b, : len(t.completion_ids)] for b, t in enumerate(trajectories)]

    def rerun(self, t: Trajectory, seed: int, row: int, logits_CV: torch.Tensor | None = None) -> Verdict:
        """Recompute one completion's per-step log-probs and seeded draws with the loaded weights
        (``logits_CV``: their logits at its completion positions, when already computed)."""
        import torch

        from echo2.learner.grpo import token_logprobs
        from echo2.rollout.sampling import gumbel_noise, nucleus_mass_before

        C = len(t.completion_ids)
        if logits_CV is None:
            (logits_CV,) = self._logits([t])
        temperature = self.sampling.temperature
        scaled_CV = logits_CV / temperature
        tokens_C = torch.tensor(t.completion_ids, dtype=torch.long)
        logp_C = token_logprobs(logits_CV[None], tokens_C[None], temperature)[0]  # as the learner's ratio
        err_C = (logp_C - torch.tensor(t.sampler_logprobs, dtype=torch.float32)).abs()

        noise_CV = gumbel_noise(seed, torch.full((C,), row), torch.arange(C), scaled_CV.shape[-1])
        scores_CV = scaled_CV + noise_CV
        top_p = self.sampling.top_p
        if top_p < 1.0:
            before_CV = nucleus_mass_before(scaled_CV)
            surely_in_CV = (before_CV < top_p - NUCLEUS_SLACK) | (before_CV == 0)
            maybe_in_C = before_CV.gather(-1, tokens_C[:, None]).squeeze(-1) < top_p + NUCLEUS_SLACK
        else:
            surely_in_CV = torch.ones_like(scores_CV, dtype=torch.bool)
            maybe_in_C = torch.ones(C, dtype=torch.bool)
        best_C = scores_CV.masked_fill(~surely_in_CV, float("-inf")).max(dim=-1).values
        chosen_C = scores_CV.gather(-1, tokens_C[:, None]).squeeze(-1)
        draw_ok_C = maybe_in_C & (chosen_C >= best_C - self.cfg.gumbel_tolerance)
        lp_ok_C = err_C <= self.cfg.logprob_tolerance
        verdict = Verdict(
            tokens=C,
            misses=int((~(draw_ok_C & lp_ok_C)).sum()),
            draw_misses=int((~draw_ok_C).sum()),
            logprob_misses=int((~lp_ok_C).sum()),
            max_logprob_error=float(err_C.max()) if C else 0.0,
        )
        self.checked += 1
        self.tokens += C
        return verdict
