"""Wire records shared by all planes. Frozen; every field documented; ``policy_version`` is required."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from echo2.config import Config

# A learner process's run epoch (observe/rundir.next_epoch): one more at every start on a run directory;
# versions, leases and manifests are of one epoch. Below 2^53 so that any JSON reader keeps it exact.
MAX_EPOCH = 2**53
SECRET = "grading_secret"  # field metadata: what grades a completion, never sent to a worker (SPEC §10)


@dataclass(frozen=True)
class Prompt:
    """One task prompt ``x`` with what the reward function needs to grade a completion."""

    prompt_id: str  # stable id within the task split (also the GRPO group key)
    text: str  # the prompt shown to the policy
    # the reference answer the reward function checks against: a grading secret, kept by the learner
    # (a lease carries protocol.LeasedPrompt, without it); "" on a worker, which does not grade
    answer: str = field(metadata={SECRET: True})
    # task-specific public extras (an episode's seed, a system message, ...): leased to workers, so never
    # a grading secret
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Trajectory:
    """``τ = (x, y, r, v, Ω)`` of SPEC §1: one sampled completion, graded and version-tagged."""

    prompt_id: str  # the prompt x this completion answers
    group_id: str  # GRPO group: completions of the same prompt, sampled together
    prompt_ids: tuple[int, ...]  # token ids of x as the policy saw it
    completion_ids: tuple[int, ...]  # token ids of y (ends with EOS unless truncated)
    sampler_logprobs: tuple[float, ...]  # per-token log-probs of y under the sampler, len == completion
    reward: float  # scalar r = R(x, y) from the task adapter
    policy_version: int  # version v of the weights that generated y (required, never defaulted)
    meta: dict[str, Any] = field(default_factory=dict)  # Ω: parse status, truncation, worker id, ...
    # multi-turn episodes (SPEC §8): per completion token, 1 = the policy's own token (trained on), 0 = the
    # environment's (an observation turn: never trained on, its sampler log-prob is 0); () = all the policy's
    turn_mask: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.sampler_logprobs) != len(self.completion_ids):
            raise ValueError(
                f"sampler_logprobs has {len(self.sampler_logprobs)} entries for "
                f"{len(self.completion_ids)} completion tokens"
            )
        if self.turn_mask and len(self.turn_mask) != len(self.completion_ids):
            raise ValueError(
                f"turn_mask has {len(self.turn_mask)} entries for {len(self.completion_ids)} completion ids"
            )


@dataclass(frozen=True)
class Bounds:
    """How long a run lets its sequences be."""

    max_context: int  # prompt + completion tokens the model attends to
    max_new_tokens: int  # tokens of one generation (one action of an episode)

    @classmethod
    def of(cls, cfg: Config) -> Bounds:
        """The bounds of a run's config (the embedded model's context, or the fixed user-model bound)."""
        return cls(cfg.context_tokens(), cfg.sampling.max_new_tokens)
