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


# ``[grpo] algorithm``: the published hyper-parameters of each recipe (learner/grpo.py defines each term);
# a field given explicitly wins over its preset. A recipe's parts echo2 does not build yet (DAPO's overlong
# shaping) are not in its preset (docs/learner.md, "The loss menu").
PRESETS: dict[str, dict[str, object]] = {
    # DeepSeekMath (Shao et al. 2024): eps 0.2, a k3 KL of beta 0.04, per-sequence mean
    "grpo": {"clip_eps": 0.2, "kl_beta": 0.04, "loss_agg": "seq-mean-token-mean", "scale_by_std": True},
    # Dr. GRPO (Liu et al. 2025): no std scaling, a constant token normaliser
    "dr_grpo": {
        "clip_eps": 0.2, "kl_beta": 0.0, "loss_agg": "seq-mean-token-sum-norm", "scale_by_std": False,
    },
    # DAPO (Yu et al. 2025): clip-higher 0.2 / 0.28, token-level mean, no KL, dynamic sampling (groups whose
    # rewards are all equal never trained, the batch filled from the buffer)
    "dapo": {
        "clip_eps_low": 0.2, "clip_eps_high": 0.28, "kl_beta": 0.0, "loss_agg": "token-mean",
        "drop_zero_variance": True,
    },
    # GSPO (Zheng et al. 2025): the sequence ratio, eps 3e-4 / 4e-4, per-sequence mean, no KL
    "gspo": {
        "ratio_level": "sequence", "clip_eps_low": 3e-4, "clip_eps_high": 4e-4, "kl_beta": 0.0,
        "loss_agg": "seq-mean-token-mean",
    },
    # CISPO (MiniMax-M1 2025): the IS weight clipped above only (no lower bound), normalised by all the
    # batch's tokens, no KL; eps_high 0.28 is DAPO's (the report states none)
    "cispo": {
        "loss": "cispo", "clip_eps_low": 1.0, "clip_eps_high": 0.28, "kl_beta": 0.0, "loss_agg": "token-mean",
    },
}  # fmt: skip


class GRPOConfig(_Section):
    """GRPO with the off-policy corrections of the paper's App. D and the loss menu of learner/grpo.py."""

    algorithm: Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo"] | None = Field(
        None,
        description="a named recipe's published settings (config/training.PRESETS); explicit fields win",
    )
    lr: float = Field(2e-4, gt=0.0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay")
    clip_eps: float = Field(0.2, gt=0.0, lt=1.0, description="PPO clip epsilon_c (both sides unless split)")
    clip_eps_low: float | None = Field(
        None, gt=0.0, le=1.0, description="the clip's lower side, 1 - eps_low (default clip_eps; 1: no bound)"
    )
    clip_eps_high: float | None = Field(
        None, gt=0.0, description="the clip's upper side, 1 + eps_high (default clip_eps; DAPO's clip-higher)"
    )
    loss: Literal["ppo", "cispo"] = Field(
        "ppo",
        description="the PPO clipped surrogate, or CISPO's clipped stop-gradient IS weight on the log-prob",
    )
    ratio_level: Literal["token", "sequence"] = Field(
        "token", description="the ratio per token, or GSPO's length-normalised sequence ratio"
    )
    is_cap: float = Field(
        2.0,
        ge=1.0,
        le=1e8,
        description="cap C: of the IS weight sampler->learner (proximal), dual clip (sampler)",
    )
    is_mode: Literal["truncate", "mask"] = Field(
        "truncate", description="the IS weight (proximal anchor): min(rho, C), or rho inside [1/C, C], else 0"
    )
    is_level: Literal["token", "sequence", "geometric"] = Field(
        "token", description="rho per token, per sequence (the product), or the sequence's geometric mean"
    )
    offpolicy_mask_delta: float | None = Field(
        None,
        ge=0.0,
        description="leave out sequences with A < 0 whose mean log(sampler / learner) exceeds this "
        "(DeepSeek-V3.2's off-policy sequence masking); unset: none",
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
    drop_zero_variance: bool = Field(
        False,
        description="never train a group whose rewards are all equal (zero advantage: no signal); the "
        "batch is filled from the buffer (DAPO's dynamic sampling)",
    )
    mask_truncated: bool = Field(
        False, description="a completion cut at sampling.max_new_tokens (no EOS) carries no loss (DAPO)"
    )
    overlong_buffer: int = Field(
        0,
        ge=0,
        description="DAPO's soft overlong penalty: over the last this many tokens before max_new_tokens the "
        "reward falls linearly to -overlong_penalty (0: none)",
    )
    overlong_penalty: float = Field(1.0, ge=0.0, description="the soft overlong penalty at max_new_tokens")
    length_penalty: float = Field(
        0.0, ge=0.0, description="reward minus this x completion tokens / max_new_tokens (0: none)"
    )
    num_minibatches: int = Field(1, ge=1, description="optimizer steps per update (one learner version)")
    max_grad_norm: float = Field(1.0, gt=0.0, description="gradient clipping threshold")

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: object) -> object:
        """A named recipe fills the fields the config does not give (a ``clip_eps`` given sets both
        sides: the recipe's split clip gives way to it)."""
        if isinstance(data, dict) and isinstance(name := data.get("algorithm"), str) and name in PRESETS:
            preset = dict(PRESETS[name])
            if "clip_eps" in data:
                preset = {k: v for k, v in preset.items() if k not in ("clip_eps_low", "clip_eps_high")}
            return {**preset, **data}
        return data

    @property
    def eps_low(self) -> float:
        return self.clip_eps if self.clip_eps_low is None else self.clip_eps_low

    @property
    def eps_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

    @model_validator(mode="after")
    def _coherent(self) -> GRPOConfig:
        high = "clip_eps" if self.clip_eps_high is None else "clip_eps_high"
        if self.clip_anchor == "sampler" and self.loss == "ppo" and self.is_cap <= 1.0 + self.eps_high:
            raise ValueError(
                f"is_cap={self.is_cap:g} must exceed 1 + {high} = {1.0 + self.eps_high:g}: with the "
                "sampler anchor it is the dual-clip constant C, and at C <= 1 + clip_eps the dual clip "
                "cuts inside the PPO clip (raise is_cap, or lower clip_eps)"
            )
        if self.clip_anchor == "sampler" and (self.is_mode, self.is_level) != ("truncate", "token"):
            raise ValueError(
                f"is_mode={self.is_mode!r} / is_level={self.is_level!r} shape the IS weight of the decoupled "
                'objective (clip_anchor = "proximal"); with the sampler anchor the ratio itself carries '
                'the correction: set clip_anchor = "proximal", or leave them at truncate / token'
            )
        if self.mask_truncated and self.overlong_buffer:
            raise ValueError(
                "mask_truncated leaves truncated completions out of the loss, overlong_buffer penalises the "
                "long ones that are still trained: DAPO uses one or the other, choose one"
            )
        if self.loss == "cispo" and self.ratio_level == "sequence":
            raise ValueError(
                'loss = "cispo" weighs each token\'s log-prob by its own clipped ratio; ratio_level = '
                '"sequence" is GSPO\'s: choose one'
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
