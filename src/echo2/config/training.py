"""Sampling, the batch, staleness, the controller, GRPO, the learner, LoRA, the training budget and the
snapshot format: what one training run does."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from echo2.config.base import (
    DEVICE_PATTERN,
    FloatDtype,
    _Section,
)
from echo2.physics.rules import DEFAULT_GAMMA, kappa_from_staleness


class SamplingConfig(_Section):
    temperature: float = Field(1.0, gt=0.0, description="softmax temperature for rollouts")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    max_new_tokens: int = Field(8, ge=1, description="longest completion, in tokens")


class BatchConfig(_Section):
    """Rollouts one learner update consumes: ``R = prompts * group_size`` (SPEC §3). Shared by the run,
    plan and simulate configs (``[batch]``)."""

    prompts: int = Field(32, ge=1, description="prompts per learner update")
    group_size: int = Field(8, ge=2, description="rollouts per prompt, one GRPO group (>= 2 to normalise)")

    @property
    def rollouts(self) -> int:
        """R in SPEC §3: trajectories consumed by one learner update."""
        return self.prompts * self.group_size


class StalenessConfig(_Section):
    """Bounded staleness (SPEC §2) and the provisioning slack (SPEC §3). Shared by the run, plan and
    simulate configs (``[staleness]``); ``echo2 train`` is the synchronous case and runs with S = 0."""

    S: int = Field(3, ge=0, description="staleness budget: trajectories need v >= v_t - S")
    kappa: int | None = Field(None, ge=1, description="publish every kappa updates; unset = max(1, S - 1)")
    gamma: float = Field(
        DEFAULT_GAMMA,
        ge=1.0,
        allow_inf_nan=False,
        description="provisioning slack: mu_target = gamma * mu_min, T_bcast at q = 1/gamma installed",
    )

    @property
    def effective_kappa(self) -> int:
        return self.kappa if self.kappa is not None else kappa_from_staleness(self.S)


class ControllerConfig(_Section):
    """Thresholds of the closed-loop pool controller (SPEC §5, ``planner/controller.py``); all times in
    seconds. Shared by the run and simulate configs (``[controller]``). The defaults suit a run of
    minutes on one machine; paper-scale simulations set their own in their scenario file."""

    heartbeat_timeout_s: float = Field(
        10.0, gt=0.0, allow_inf_nan=False, description="a worker silent this long counts as lost"
    )
    rate_halflife_s: float = Field(
        10.0, gt=0.0, allow_inf_nan=False, description="half-life of the measured-rate average (generating s)"
    )
    low_band: float = Field(
        0.05, ge=0.0, lt=1.0, description="shortfall when mu_pool < (1 - low_band) * target"
    )
    high_band: float = Field(
        0.10, ge=0.0, allow_inf_nan=False, description="release only if (1 + high_band) * target stays"
    )
    sustain_s: float = Field(
        5.0, gt=0.0, allow_inf_nan=False, description="a shortfall or surplus must last this long"
    )
    cooldown_s: float = Field(
        20.0, ge=0.0, allow_inf_nan=False, description="no release this soon after an activation"
    )
    replace_prior: bool = Field(
        True, description="the first measured rate replaces a worker's own estimate (rough priors)"
    )


class GRPOConfig(_Section):
    """GRPO with the off-policy corrections of the paper's App. D (see learner/grpo.py)."""

    lr: float = Field(2e-4, gt=0.0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay")
    clip_eps: float = Field(0.2, gt=0.0, lt=1.0, description="PPO clip epsilon_c")
    is_cap: float = Field(
        2.0,
        ge=1.0,
        le=1e8,
        description="cap C: of the IS weight sampler->learner (proximal), dual clip (sampler)",
    )
    clip_anchor: Literal["sampler", "proximal"] = Field(
        "sampler",
        description="PPO clip against the policy that generated the tokens (coupled) or the learner's "
        "weights at the start of the update (decoupled, with a truncated IS weight)",
    )
    kl_beta: float = Field(0.0, ge=0.0, description="weight beta of the KL penalty to the frozen reference")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="how per-token losses become one scalar (learner/grpo.py)"
    )
    scale_by_std: bool = Field(True, description="divide group-centred rewards by the group std")
    num_minibatches: int = Field(1, ge=1, description="optimizer steps per update (one learner version)")
    max_grad_norm: float = Field(1.0, gt=0.0, description="gradient clipping threshold")

    @model_validator(mode="after")
    def _dual_clip_acts(self) -> GRPOConfig:
        if self.clip_anchor == "sampler" and self.is_cap <= 1.0 + self.clip_eps:
            raise ValueError(
                f"is_cap={self.is_cap:g} must exceed 1 + clip_eps = {1.0 + self.clip_eps:g}: with the "
                "sampler anchor it is the dual-clip constant C, and at C <= 1 + clip_eps the dual clip "
                "cuts inside the PPO clip (raise is_cap, or lower clip_eps)"
            )
        return self


# experiment trackers that mirror metrics.jsonl (observe/sinks.py: the registry maps each name to a sink)
SinkName = Literal["tensorboard", "wandb", "trackio", "mlflow"]


class LearnerConfig(_Section):
    """Where and how the learner computes an update (docs/learner.md: the memory model).

    One update is one optimizer step per minibatch whatever the token budget: rows are packed into
    micro-batches of at most ``micro_batch_tokens`` padded tokens whose gradients accumulate, with the
    loss normalised over the whole minibatch, so the budget bounds activation memory without changing
    the algorithm."""

    device: str = Field(
        "auto",
        pattern=DEVICE_PATTERN,
        description="where the learner's model, update, evaluation and checks run: auto (CUDA when "
        "present, else the CPU), cpu, cuda or cuda:N",
    )
    precision: Literal["fp32", "bf16-mixed"] = Field(
        "fp32",
        description="fp32, or bf16-mixed: bf16 autocast compute with fp32 master weights, gradients and "
        "optimizer states (log-probs, the loss and the checks in fp32)",
    )
    micro_batch_tokens: int = Field(
        8192,
        ge=16,
        description="padded tokens (rows x longest row) per forward + backward; gradients of the "
        "micro-batches of a minibatch accumulate into one optimizer step; also bounds evaluation batches",
    )
    logprob_chunk: int = Field(
        4096,
        ge=1,
        description="completion positions per chunk of the LM head when computing log-probs (peak logits "
        "memory ~ chunk x vocab x 4 bytes; no [B, L, V] tensor is built)",
    )
    activation_checkpointing: bool = Field(
        False,
        description="recompute each decoder layer's activations during its backward (less memory, more time)",
    )
    malloc_mmap_threshold: int = Field(
        1 << 18,
        ge=0,
        le=32 << 20,
        description="bytes, on glibc: host allocations of at least this size are mapped on their own and go "
        "back to the system when freed, so a CPU learner's resident memory follows its live tensors "
        "(glibc's adaptive threshold keeps the freed activations of earlier micro-batches); 0 keeps "
        "glibc's default; MALLOC_MMAP_THRESHOLD_ in the environment wins",
    )
    collective_timeout_s: float = Field(
        600.0,
        ge=10.0,
        description="a sharded learner (--nproc-per-node, torchrun): how long a rank waits in a collective "
        "before it gives up and the learner stops (a rank that died, a node that is gone)",
    )


class LoRAConfig(_Section):
    """Low-rank adapters on the learner (``[lora]``, docs/learner.md#lora): the base frozen, only the
    adapter trains (PEFT)."""

    enabled: bool = Field(False, description="train a LoRA adapter instead of every weight")
    r: int = Field(16, ge=1, description="the adapter's rank")
    alpha: float = Field(32.0, gt=0.0, description="the adapter's scale is alpha / r")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter's input while training")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="names of the linear layers that get an adapter (default: attention and MLP "
        "projections of Qwen / Llama-style models)",
    )
    vllm: Literal["native", "merged"] = Field(
        "native",
        description="how vLLM workers apply each adapter: native = vLLM's LoRA support (enable_lora, a "
        "LoRA request per version; the base loaded once), merged = base + adapter merged and reloaded "
        "as whole weights",
    )


class TrainConfig(_Section):
    steps: int = Field(2000, ge=1, description="learner updates at most")
    max_minutes: float | None = Field(8.0, gt=0.0, description="wall-clock budget; unset = no limit")
    eval_every: int = Field(25, ge=1, description="learner steps between held-out evaluations")
    eval_size: int = Field(256, ge=8, description="held-out problems per evaluation (greedy)")
    checkpoint_every: int = Field(100, ge=1, description="learner steps between checkpoints")
    run_dir: str = Field("runs/latest", description="where config.json, metrics.jsonl and checkpoints go")
    threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads; unset = 1 for the embedded model, else torch's default",
    )
    report_to: list[SinkName] = Field(
        default_factory=list,
        description="experiment trackers that mirror every metrics.jsonl record: tensorboard, wandb "
        "(offline), trackio, mlflow; each needs its extra, e.g. pip install 'echo2[wandb]'",
    )

    def resolved_threads(self, embedded: bool) -> int | None:
        """The tiny embedded model is dominated by per-op overhead, where extra threads only add
        synchronisation (measured: 2 threads ran half as many steps/s as 1 on a loaded 2-core box)."""
        if self.threads is not None:
            return self.threads
        return 1 if embedded else None


class SnapshotConfig(_Section):
    """What a publication ships (``[snapshot]``): the sampler copy in the precision workers sample
    with, as a lossless sparse patch against the previous publication, with a full anchor every
    ``anchor_every`` publications and whenever a patch would not be smaller (docs/broadcast.md)."""

    dtype: FloatDtype = Field(
        "bfloat16", description="precision of the published weights (the learner trains in float32)"
    )
    deltas: bool = Field(
        True, description="publish patches against the previous version; false = anchors only"
    )
    anchor_every: int = Field(
        20,
        ge=1,
        description="a full anchor at least every this many publications (bounds a late joiner's chain)",
    )
    max_patch_ratio: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="send an anchor instead when a patch exceeds this fraction of the full snapshot",
    )
    zstd_level: int = Field(3, ge=1, le=19, description="zstandard level of patches")
    on_disk: bool = Field(
        True,
        description="keep the published anchor and patches in files of the run directory, served from "
        "the page cache (false: in the learner's memory, 2 bytes per parameter more for the anchor)",
    )
