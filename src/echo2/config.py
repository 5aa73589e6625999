"""The typed config tree of a training run (pydantic). No torch import here.

A run's config comes from defaults, then an optional TOML file, then ``--set key.sub=value``
overrides, and is validated once, before anything starts: a bad value fails with the field's dotted
path and the rule it breaks (:class:`echo2.errors.ConfigError`).

The paper's constraints live in validators: ``kappa >= 1`` and the default coupling
``kappa = max(1, S - 1)`` (SPEC §2), group size ``>= 2`` (GRPO needs a group to normalise against),
``0 < top_p <= 1``, ``C >= 1`` for truncated importance sampling.
"""

from __future__ import annotations

import copy
import functools
import operator
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from echo2.envs.base import EnvironmentFields
from echo2.envs.guess import GuessTaskConfig as GuessTaskConfig  # re-exported: the name predates envs/
from echo2.envs.poker_task import PokerTaskConfig as PokerTaskConfig  # re-exported: the name predates envs/
from echo2.envs.registry import ENVIRONMENTS
from echo2.errors import ConfigError
from echo2.physics.broadcast import StrategyName
from echo2.physics.rules import DEFAULT_GAMMA, kappa_from_staleness

REQUEST_BYTES_PER_TOKEN = 32  # a completion token in a submission's JSON: its id and log-prob (~26 bytes)
USER_CONTEXT_TOKENS = 32768  # longest prompt + completion accepted when the model's context is unknown
FloatDtype = Literal["bfloat16", "float16", "float32"]  # published weights, engine compute
DEVICE_PATTERN = r"^(auto|cpu|cuda|cuda:[0-9]+)$"  # a device setting: auto, cpu, cuda or cuda:N
EngineName = Literal["hf", "vllm"]  # rollout engines (rollout/engines/: the registry maps names to classes)


class _Section(BaseModel):
    """Every section is strict about unknown keys, so a typo fails instead of being ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class EmbeddedModelConfig(_Section):
    """Shape of the tiny Qwen3-architecture model echo2 builds itself (used when ``model.path`` is unset)."""

    hidden_size: int = Field(128, ge=8, description="width of the residual stream")
    intermediate_size: int = Field(384, ge=8, description="width of the MLP")
    num_layers: int = Field(4, ge=1, description="transformer blocks")
    num_heads: int = Field(4, ge=1, description="query heads")
    num_kv_heads: int = Field(2, ge=1, description="key/value heads (grouped-query attention)")
    max_positions: int = Field(128, ge=16, description="longest prompt + completion, in tokens")

    @model_validator(mode="after")
    def _heads_divide(self) -> EmbeddedModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}"
            )
        return self


class WarmstartConfig(_Section):
    """Short supervised training on the task that produces the embedded model's starting checkpoint.

    Training stops at the first evaluation whose held-out greedy accuracy reaches
    ``target_accuracy`` (or after ``max_steps``), so RL starts from a model that is right sometimes
    but not often, the way real post-training starts from a pretrained model.
    """

    target_accuracy: float = Field(0.2, gt=0.0, lt=1.0, description="stop SFT once held-out accuracy >= this")
    max_steps: int = Field(3000, ge=1, description="upper bound on SFT optimizer steps")
    batch_size: int = Field(64, ge=1, description="SFT sequences per step")
    lr: float = Field(2e-3, gt=0.0, description="SFT AdamW learning rate")
    eval_every: int = Field(25, ge=1, description="SFT steps between held-out evaluations")
    eval_size: int = Field(256, ge=8, description="held-out problems per SFT evaluation")
    cache_dir: str | None = Field(
        None, description="where warm-started checkpoints are cached (default ~/.cache/echo2)"
    )


class ModelConfig(_Section):
    path: str | None = Field(
        None, description="local HF checkpoint dir (model + tokenizer); unset = embedded"
    )
    chat_template: bool = Field(False, description="wrap prompts with the tokenizer's chat template")
    system_prompt: str | None = Field(
        None, max_length=8192, description="a system message before every prompt (needs chat_template)"
    )
    chat_template_kwargs: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description="extra arguments of the chat template, e.g. {enable_thinking = false} for Qwen3",
    )
    embedded: EmbeddedModelConfig = Field(default_factory=EmbeddedModelConfig)
    warmstart: WarmstartConfig = Field(default_factory=WarmstartConfig)

    @model_validator(mode="after")
    def _chat_needs_template(self) -> ModelConfig:
        if not self.chat_template and (self.system_prompt is not None or self.chat_template_kwargs):
            raise ValueError("system_prompt and chat_template_kwargs need chat_template = true")
        bad = [k for k in self.chat_template_kwargs if not k.isidentifier()]
        if bad:
            raise ValueError(f"chat_template_kwargs keys must be identifiers, got {bad}")
        return self


class _SingleTurnFields(_Section):
    """What every single-turn task's config answers for (its prompts and grading are its own)."""

    def check_run(self, loss_agg: str, max_new_tokens: int, context_tokens: int) -> None:
        """A single-turn task fits every run the other sections allow."""


class ArithmeticTaskConfig(_SingleTurnFields):
    """Synthetic arithmetic with an exact-answer reward (the embedded default task)."""

    name: Literal["arithmetic"] = "arithmetic"
    min_value: int = Field(0, ge=0, description="smallest operand")
    max_value: int = Field(99, ge=1, description="largest operand (difficulty knob)")
    num_operands: int = Field(2, ge=2, le=4, description="operands per problem (difficulty knob)")
    operators: str = Field(
        "+", min_length=1, description="operators drawn from, any of '+-*' (difficulty knob)"
    )
    eval_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="share of problems (up to commuting) held out as the test split"
    )
    validation_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="share of problems held out as the validation split (warm start)"
    )

    @model_validator(mode="after")
    def _check(self) -> ArithmeticTaskConfig:
        bad = set(self.operators) - set("+-*")
        if bad:
            raise ValueError(f"operators may only contain '+', '-', '*', got {''.join(sorted(bad))!r}")
        if self.max_value <= self.min_value:
            raise ValueError(f"max_value={self.max_value} must exceed min_value={self.min_value}")
        if self.eval_fraction + self.validation_fraction >= 1.0:
            raise ValueError(
                f"eval_fraction + validation_fraction = {self.eval_fraction + self.validation_fraction:g} "
                "must be < 1 to leave problems to train on"
            )
        return self


class MathTaskConfig(_SingleTurnFields):
    """Question/answer records from a JSONL file, graded by a math-answer checker (math-verify)."""

    name: Literal["math"] = "math"
    train_path: str | None = Field(
        None,
        description="question / answer records: .jsonl, .json, .parquet, .arrow or a datasets save_to_disk "
        "directory; unset = bundled sample",
    )
    eval_path: str | None = Field(
        None, description="test-split file (same formats); unset = a split of train_path"
    )
    question_field: str = Field("question", min_length=1, description="the records' question field")
    answer_field: str = Field("answer", min_length=1, description="the records' answer field")
    system_field: str | None = Field(
        None, min_length=1, description="a per-record system message field (chat template); unset = none"
    )
    eval_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="share of train_path held out as the test split if no eval_path"
    )
    validation_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="share of train_path held out as the validation split (warm start)"
    )
    prompt_template: str = Field("{question}\nAnswer: ", description="format string with a {question} slot")
    answer_rule: Literal["auto", "gsm8k", "boxed", "whole"] = Field(
        "auto",
        description="how the gold answer is read from a record's answer: the text after the last '####' "
        "(gsm8k), the last \\boxed{} (boxed), the whole string, or auto: gsm8k if '####' is there, else "
        "boxed if a \\boxed{ is, else whole",
    )

    @model_validator(mode="after")
    def _check(self) -> MathTaskConfig:
        held = self.validation_fraction + (self.eval_fraction if self.eval_path is None else 0.0)
        if held >= 1.0:
            names = "validation_fraction" + (" + eval_fraction" if self.eval_path is None else "")
            raise ValueError(f"{names} = {held:g} must be < 1 to leave problems of train_path to train on")
        return self


# The multi-turn environments are declared in their own modules (``envs/``: config model, spec,
# preset) and listed once in ``envs/registry.ENVIRONMENTS``; the ``[task]`` union and the presets
# below are derived from that list.
SINGLE_TURN_TASKS: tuple[type[_SingleTurnFields], ...] = (ArithmeticTaskConfig, MathTaskConfig)
# every ``[task]`` variant, in the order pydantic lists them: the single-turn tasks, then the environments
TASK_MODELS: tuple[type[BaseModel], ...] = (*SINGLE_TURN_TASKS, *(env.config for env in ENVIRONMENTS))

if TYPE_CHECKING:  # the checker's view: a single-turn task or any declared environment
    TaskConfig = ArithmeticTaskConfig | MathTaskConfig | EnvironmentFields
else:  # pydantic's: one variant per model, picked by its ``name`` literal
    TaskConfig = Annotated[functools.reduce(operator.or_, TASK_MODELS), Field(discriminator="name")]


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


# The generation check's default (log-prob, draw) tolerances per engine precision. float32: the
# learner's float32 re-run of a float32 engine differs by reduction order only. bfloat16: first set to
# 0.3 / 0.2 from honest bf16 HF-engine samples of the embedded model (1,024 completions, 3,618 tokens:
# largest |log-prob error| 0.143, p99 0.097; no drawn token further than 0.1 below the best perturbed
# score); the validating run (benchmarks/adversary.py --study honest_bf16) then quarantined both honest
# workers within 90 s (errors of 0.301 and 0.305, one drawn token beyond 0.2), so they are 0.6 / 0.5 now,
# about twice the worst seen; with the check then computing in the declared precision too
# (models/snapshot.aliasing_model) the worst honest error fell to 0.092 (docs/security.md). float16 (10
# mantissa bits to bfloat16's 7) is not measured and takes bfloat16's.
ENGINE_TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (0.05, 0.05),
    "bfloat16": (0.6, 0.5),
    "float16": (0.6, 0.5),
}


class PerimeterConfig(_Section):
    """What a stranger may hold on a listening port before anyone is known (``[security.perimeter]``;
    ``echo2/perimeter.py``, docs/security.md "The perimeter"). The same rules on the API port, the
    broadcast port and every worker's chunk relay; the connection caps are cut to fit the descriptor
    limit (raised to the hard limit at start)."""

    max_connections: int = Field(
        16384,
        ge=16,
        description="connections one port holds at once (members and strangers); at most 40% of the "
        "descriptors left after 256 kept for files, whatever is set",
    )
    max_per_address: int = Field(
        64,
        ge=1,
        description="connections one peer address may hold on one port (workers behind one NAT share it)",
    )
    pre_auth_share: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="share of max_connections that connections no request has authenticated yet may hold; "
        "past it the oldest of the address holding the most is closed for a new one",
    )
    accepts_per_s: float = Field(
        20.0, gt=0.0, allow_inf_nan=False, description="new connections one address may open per second"
    )
    accept_burst: float = Field(64.0, ge=1.0, allow_inf_nan=False, description="... in bursts of this many")
    accepts_per_s_total: float = Field(
        30.0,
        gt=0.0,
        allow_inf_nan=False,
        description="new connections one port accepts per second from all addresses together (each a TLS "
        "handshake: about 0.5 ms of the serving thread); a flood from many addresses is held to it",
    )
    handshake_s: float = Field(
        10.0, gt=0.0, allow_inf_nan=False, description="seconds a TLS handshake may take"
    )
    header_s: float = Field(
        10.0,
        gt=0.0,
        allow_inf_nan=False,
        description="seconds after the handshake by which a connection's first request (line and headers, "
        "or first frame) must have authenticated; else it is closed",
    )
    idle_s: float = Field(
        30.0,
        gt=0.0,
        allow_inf_nan=False,
        description="an API connection with no request in progress for this long is closed (HTTP keep-alive)",
    )
    requests_per_s: float = Field(
        10.0,
        gt=0.0,
        allow_inf_nan=False,
        description="requests one address may make that no identity vouches for (registration, a bad "
        "credential); more get 429",
    )
    request_burst: float = Field(20.0, ge=1.0, allow_inf_nan=False, description="... in bursts of this many")


class SecurityConfig(_Section):
    """What the learner checks of strangers' machines (``[security]``; docs/security.md)."""

    tls: bool = Field(
        True,
        description="TLS on the API and broadcast planes with a certificate made for the run; workers "
        "pin its fingerprint from the join string (false: plain text, for trusted networks only)",
    )
    check_fraction: float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        description="share of submissions whose generation is re-checked (log-probs and seeded "
        "Gumbel-max tokens recomputed with the claimed version's weights); 0 = never",
    )
    check_floor: float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        description="the least share of every proven identity's submissions drawn for the generation check, "
        "whatever the check queue does: a full queue lowers the draw from check_fraction to this and no "
        "further, and a drawn submission waits for its check (held, within the in-flight budget), never "
        "admitted unchecked; taken as check_fraction when above it",
    )
    check_samples: int = Field(
        0,
        ge=0,
        description="completions re-run per drawn submission; 0 = every one, so a submission with one "
        "forged completion fails whenever it is drawn",
    )
    check_first: int = Field(
        3,
        ge=0,
        description="generation checks a new identity must pass before its submissions are drawn at "
        "check_fraction: until then every one of them is drawn (at a full check queue refused, check_busy, "
        "never admitted unchecked), so a forger is caught in its first submissions, before it has been "
        "trusted with much; 0 = none",
    )
    check_queue: int = Field(
        32,
        ge=1,
        description="submissions waiting for their generation check beyond which a new identity's is "
        "refused (check_busy, no strike); a proven identity's share drawn falls as the queue fills, "
        "max(check_floor, check_fraction x (1 - waiting / check_queue)), and its drawn submissions wait "
        "beyond it (held, within the in-flight budget)",
    )
    check_nice: int = Field(
        19,
        ge=0,
        le=19,
        description="niceness of the checker's thread and of the compute threads it starts (Linux): at 19 "
        "the update, publications and the request path come first and checks use the cores they leave "
        "(about 1/70 of a core they keep busy, all of an idle one); 0 = an equal share",
    )
    check_duty: float = Field(
        0.02,
        ge=0.0,
        le=1.0,
        description="while the learner updates, the share of the update's time the generation check may "
        "compute: after each chunk of its work it waits that chunk's time x (1 / check_duty - 1), or until "
        "the update ends; between updates it runs freely (learner/turns.py). A new identity's check, and one "
        "whose claim is at the admission floor, never wait. 1 = never waits (check_nice alone); 0 = waits "
        "for the update to end",
    )
    check_chunk_tokens: int = Field(
        64,
        ge=1,
        description="completion positions whose logits, seeded noise and nucleus the check holds at once "
        "(peak memory: about 60 x this x vocabulary bytes, whatever the completion's length)",
    )
    engine_precision: FloatDtype = Field(
        "float32",
        description="the precision the run's workers' engines compute in (a run setting, never a worker's "
        "claim): the generation check computes in it too and takes its default tolerances (float32: "
        "log-prob 0.05, draw 0.05; bfloat16: 0.6, 0.5, docs/security.md); bfloat16 for GPU workers in bf16",
    )
    logprob_tolerance: float | None = Field(
        None,
        gt=0.0,
        description="largest |claimed - recomputed| sampler log-prob of a token counted as numerical noise; "
        "unset = engine_precision's (float32 0.05, bfloat16 0.6)",
    )
    gumbel_tolerance: float | None = Field(
        None,
        gt=0.0,
        description="a sampled token whose perturbed score is within this of the best (logit units) "
        "is taken as the seeded draw (numerical noise near ties); unset = engine_precision's (float32 0.05, "
        "bfloat16 0.5)",
    )
    min_logprob: float | None = Field(
        None,
        allow_inf_nan=False,
        description="lowest sampler log-prob a submitted token may carry; unset = the lowest seeded "
        "Gumbel-max can draw at the model's vocabulary (rollout/sampling.py: min_drawn_logprob)",
    )
    max_workers: int = Field(
        64,
        ge=1,
        description="registration slots of the join token: an identity holds one while trusted and heard "
        "from within slot_idle_s, or for slot_idle_s after it was quarantined",
    )
    max_identities: int = Field(
        256,
        ge=1,
        description="identities the join token may register over the whole run (restarts included: "
        "workers.json keeps them): every registration, re-registration and quarantined identity counts, so "
        "an attacker's identities, and what each can get trained before it is caught, are finite "
        "(identity_budget once spent)",
    )
    slot_idle_s: float = Field(
        600.0,
        gt=0.0,
        allow_inf_nan=False,
        description="an identity silent this long (holding no lease) is retired and frees its slot; a "
        "quarantined one frees it this long after it was caught",
    )
    min_usd_per_hour: float = Field(
        0.01, gt=0.0, allow_inf_nan=False, description="lowest price a worker may register with"
    )
    max_usd_per_hour: float = Field(
        100.0, gt=0.0, allow_inf_nan=False, description="highest price a worker may register with"
    )
    max_rollouts_per_s: float = Field(
        10000.0, gt=0.0, description="highest own throughput estimate a worker may register with"
    )
    probation_prompts: int = Field(
        1,
        ge=1,
        description="prompts per lease of a worker on probation (none of its work admitted yet, or an "
        "unreturned lease since)",
    )
    probation_share: float = Field(
        0.125,
        gt=0.0,
        le=1.0,
        description="share of the in-flight budget (leased + buffered rollouts) all workers on "
        "probation may hold together",
    )
    max_unreturned: int = Field(
        3,
        ge=1,
        description="unreturned leases in a row after which a worker is benched (no leases) for "
        "4 x runtime.lease_ttl_s; each one halves its next lease's time to live",
    )
    max_requests_per_s: float = Field(
        50.0,
        gt=0.0,
        allow_inf_nan=False,
        description="API requests per second one identity may make (bursts of twice that); more get 429",
    )
    body_timeout_s: float = Field(
        30.0, gt=0.0, allow_inf_nan=False, description="seconds a request body may take to arrive"
    )
    token_copies_per_hour: float = Field(
        16.0,
        gt=0.0,
        allow_inf_nan=False,
        description="copies of each object the API serves (the model files, the version's manifest, a "
        "snapshot chain, a LoRA run's base) that all identities of the join token together may pull per "
        "hour, beyond a burst of max_workers copies (docs/security.md: what a token holder can pull)",
    )
    perimeter: PerimeterConfig = Field(default_factory=PerimeterConfig)

    def floor(self) -> float:
        """The least share of a proven identity's submissions drawn: ``check_floor``, at most
        ``check_fraction`` (0 there turns the check off)."""
        return min(self.check_floor, self.check_fraction)

    def tolerances(self) -> tuple[float, float]:
        """(log-prob, draw) tolerances of the generation check: the ones set, else the engine
        precision's (ENGINE_TOLERANCES)."""
        lp, draw = ENGINE_TOLERANCES[self.engine_precision]
        return (
            lp if self.logprob_tolerance is None else self.logprob_tolerance,
            draw if self.gumbel_tolerance is None else self.gumbel_tolerance,
        )

    @model_validator(mode="after")
    def _price_range(self) -> SecurityConfig:
        if self.min_usd_per_hour > self.max_usd_per_hour:
            raise ValueError(
                f"min_usd_per_hour={self.min_usd_per_hour} is above max_usd_per_hour={self.max_usd_per_hour}"
            )
        return self


class RuntimeConfig(_Section):
    """The asynchronous three-plane runtime (``echo2 run`` / ``echo2 learner`` / ``echo2 worker``)."""

    workers: int = Field(2, ge=0, description="rollout worker processes `echo2 run` starts on this machine")
    host: str = Field("127.0.0.1", description="address the learner's HTTP API and broadcast port bind to")
    advertise_host: str | None = Field(
        None, description="address workers use to reach the learner; unset = host"
    )
    port: int = Field(0, ge=0, lt=65536, description="HTTP API port; 0 = any free port")
    broadcast_port: int = Field(0, ge=0, lt=65536, description="snapshot broadcast TCP port; 0 = any free")
    strategy: StrategyName = Field(
        "tree-pipelined",
        description="broadcast strategy: star-unlimited, star-limited, tree-pipelined, relay-chain or "
        "tree-chains (echo2.physics.broadcast.StrategyName; see benchmarks/broadcast.py)",
    )
    chunk_kb: int | None = Field(
        None,
        ge=4,
        le=65536,
        description="snapshot chunk size, KiB; unset = chosen per publication from its size "
        "(echo2.physics.broadcast.relay_chunk_bytes: small patches travel in small chunks)",
    )
    lease_prompts: int = Field(8, ge=1, description="prompts per lease (one worker generation batch)")
    lease_ttl_s: float = Field(
        30.0,
        gt=0.0,
        description="a lease not submitted within max(this, lease_ttl_per_token_s x sampling.max_new_tokens) "
        "is re-issued",
    )
    lease_ttl_per_token_s: float = Field(
        0.1,
        ge=0.0,
        description="seconds of a lease's lifetime per token of max_new_tokens (a decode of >= 10 steps/s)",
    )
    max_leases_per_worker: int = Field(
        4,
        ge=1,
        description="open leases one worker may hold (a worker keeps 2 in flight); bounds what one "
        "worker that never submits can tie up until its leases expire",
    )
    max_inflight_batches: float = Field(
        2.0, ge=1.0, description="cap on leased + buffered rollouts, in learner batches R (clamped to S + 1)"
    )
    heartbeat_s: float = Field(1.0, gt=0.0, description="seconds between worker heartbeats")
    engine: EngineName = Field(
        "hf", description="rollout engine of the workers `echo2 run` starts: hf or vllm (docs/engines.md)"
    )
    engine_dtype: FloatDtype = Field(
        "float32",
        description="compute dtype of the workers' engines (float32, or bfloat16 as GPU workers run it: "
        "declare security.engine_precision to match, the check's tolerances follow it)",
    )
    engine_memory: float = Field(
        0.3, gt=0.0, le=1.0, description="share of GPU (CPU: host) memory a vLLM engine may claim"
    )
    engine_device: str = Field(
        "auto",
        pattern=DEVICE_PATTERN,
        description="where the HF engine of the workers `echo2 run` starts computes: auto (CUDA when "
        "present), cpu, cuda or cuda:N",
    )
    engine_batch_tokens: int | None = Field(
        None,
        ge=16,
        description="HF engine: rows x (prompt + new tokens) per forward batch; unset = one batch",
    )
    dashboard: bool = Field(True, description="serve the live dashboard and Prometheus /metrics")
    dashboard_host: str = Field(
        "127.0.0.1", description="where the dashboard and /metrics listen (beyond loopback: view token)"
    )
    dashboard_port: int = Field(0, ge=0, lt=65536, description="dashboard + /metrics port; 0 = any free port")
    worker_usd_per_hour: float = Field(
        0.35, gt=0.0, description="price local workers register with (RTX 5090)"
    )
    learner_usd_per_hour: float = Field(12.24, ge=0.0, description="learner price for cost metrics (4x A100)")
    worker_max_rollouts_per_s: float | None = Field(
        None, gt=0.0, description="throttle local workers to emulate slower hardware; unset = full speed"
    )
    max_request_mb: float | None = Field(
        None,
        gt=0.0,
        description="largest HTTP request body the learner accepts; unset = what the largest honest "
        "submission needs (Config.request_cap_bytes), at least 8 MiB",
    )
    join_token: str | None = Field(None, min_length=16, description="run join token; unset = generated")


class Config(_Section):
    seed: int = Field(0, ge=0, description="seeds the task, the sampler and the model init")
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=ArithmeticTaskConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    staleness: StalenessConfig = Field(default_factory=StalenessConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    snapshot: SnapshotConfig = Field(default_factory=SnapshotConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    controller: ControllerConfig = Field(default_factory=ControllerConfig)

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _default_task_name(cls, data: Any) -> Any:
        """``[task]`` without ``name`` means the default task, so its knobs can be set alone."""
        if isinstance(data, dict) and isinstance(data.get("task"), dict) and "name" not in data["task"]:
            data = {**data, "task": {"name": "arithmetic", **data["task"]}}
        return data

    @model_validator(mode="after")
    def _engines_checked_as_they_compute(self) -> Config:
        rt, sec = self.runtime, self.security
        if rt.engine_dtype != "float32" and rt.engine_dtype != sec.engine_precision:
            raise ValueError(
                f"runtime.engine_dtype = {rt.engine_dtype!r} but security.engine_precision = "
                f"{sec.engine_precision!r}: the generation check would flag the honest workers' "
                f"completions at {sec.engine_precision} tolerances; set security.engine_precision = "
                f"{rt.engine_dtype!r}"
            )
        return self

    @model_validator(mode="after")
    def _record_system_needs_template(self) -> Config:
        if getattr(self.task, "system_field", None) and not self.model.chat_template:
            raise ValueError(
                "task.system_field (a per-record system message) needs model.chat_template = true"
            )
        return self

    @model_validator(mode="after")
    def _task_fits(self) -> Config:
        self.task.check_run(self.grpo.loss_agg, self.sampling.max_new_tokens, self.context_tokens())
        return self

    @model_validator(mode="after")
    def _minibatches_divide(self) -> Config:
        if self.batch.prompts % self.grpo.num_minibatches:
            raise ValueError(
                f"batch.prompts={self.batch.prompts} must be divisible by grpo.num_minibatches="
                f"{self.grpo.num_minibatches} (minibatches keep GRPO groups whole)"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def lease_ttl(self) -> float:
        """Seconds a lease lives: ``max(runtime.lease_ttl_s, lease_ttl_per_token_s x max_new_tokens)``, so a
        lease of long completions is not re-issued while it is still being generated."""
        rt = self.runtime
        return max(rt.lease_ttl_s, rt.lease_ttl_per_token_s * self.sampling.max_new_tokens)

    def request_cap_bytes(self) -> int:
        """The largest HTTP request body the learner accepts: ``runtime.max_request_mb``, else twice the
        largest honest submission (a lease of ``lease_prompts x group_size`` completions of
        ``max_new_tokens`` tokens at 32 JSON bytes a token, plus 16 KiB a completion for its prompt and
        fields), at least 8 MiB."""
        if self.runtime.max_request_mb is not None:
            return int(self.runtime.max_request_mb * (1 << 20))
        completions = self.runtime.lease_prompts * self.batch.group_size
        honest = completions * (REQUEST_BYTES_PER_TOKEN * self.sampling.max_new_tokens + (16 << 10))
        return max(8 << 20, 2 * honest)

    def context_tokens(self) -> int:
        """Longest prompt + completion the model attends to: the embedded model's ``max_positions``,
        else a generous fixed bound (a user checkpoint's own limit is read only where it is loaded)."""
        return self.model.embedded.max_positions if self.model.path is None else USER_CONTEXT_TOKENS


# ---------------------------------------------------------------------------------------------------
# loading: one loader for the run config and the plan / simulate scenarios, one error format

M = TypeVar("M", bound=BaseModel)

# `--task NAME`: the embedded default of each task, as overrides under the user's own; an environment's
# are its declaration's (``Environment.preset``), after the ``task.name`` that selects it
TASK_PRESETS: dict[str, list[str]] = {
    "arithmetic": ["task.name=arithmetic"],
    "math": ["task.name=math"],
    **{env.name: [f"task.name={env.name}", *env.preset] for env in ENVIRONMENTS},
}


def _parse_value(text: str) -> Any:
    """An override's value is read as a TOML value when it is one (``3``, ``1e-4``, ``true``,
    ``"x"``, ``[1, 2]``), else taken as a bare string (``arithmetic``)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file as a dict; ConfigError naming the file when it is missing or not valid TOML."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} {'is not a file' if p.exists() else 'does not exist'}")
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {p} is not valid TOML (invalid TOML syntax: {exc})") from exc


def _index(items: list[Any], part: str, label: str) -> int:
    if not part.isdigit() or int(part) >= len(items):
        raise ConfigError(f"override {label!r}: {part!r} is not an index of a list of {len(items)}")
    return int(part)


def _assign(tree: dict[str, Any], key: str, value: Any, label: str) -> None:
    """Set the dotted ``key`` in a nested dict, creating sections; a number indexes a list."""
    *parents, last = key.split(".")
    node: Any = tree
    for part in parents:
        node = node[_index(node, part, label)] if isinstance(node, list) else node.setdefault(part, {})
        if not isinstance(node, dict | list):
            raise ConfigError(f"override {label!r}: {part!r} is a value, not a section")
    if isinstance(node, list):
        node[_index(node, last, label)] = value
    else:
        node[last] = value


def apply_override(tree: dict[str, Any], assignment: str) -> None:
    """Apply ``a.b.c=value`` to a nested dict in place (``workers.0.name=x``: a number indexes a list)."""
    key, sep, raw = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {assignment!r} must look like section.field=value")
    _assign(tree, key, _parse_value(raw.strip()), assignment)


def _format_validation_error(
    exc: ValidationError, what: str = "config", path: str | Path | None = None, inline: str | None = None
) -> str:
    """The one error format of every loader: ``invalid <what> [<file>]: field.path: message (got value);
    ...`` (a rule of the whole model has no field path; ``inline``, a field flattened into the file,
    is left out of the paths)."""
    problems = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"] if not str(p).startswith("function-after")]
        if inline is not None and loc[:1] == [inline]:
            loc = loc[1:]
        problem = err["msg"].removeprefix("Value error, ")
        got = err.get("input")
        if not isinstance(got, dict | list | tuple | BaseModel):
            shown = repr(got)
            problem += f" (got {shown if len(shown) <= 60 else shown[:57] + '...'})"
        problems.append(f"{'.'.join(loc)}: {problem}" if loc else problem)
    where = what if path is None else f"{what} {path}"
    return f"invalid {where}: " + "; ".join(problems)


def load_model(
    model: type[M],
    path: str | Path | None = None,
    overrides: Iterable[str] | Mapping[str, Any] | None = None,
    *,
    what: str = "config",
    tree: dict[str, Any] | None = None,
    inline: str | None = None,
) -> M:
    """Defaults <- the TOML file at ``path`` <- overrides, validated once by ``model``; the one loader of
    the run config (:func:`load_config`), ``echo2 plan``'s and ``echo2 simulate``'s scenarios.

    ``overrides`` are ``"a.b.c=value"`` strings (the value read as TOML, else a bare string) or a
    mapping ``{"a.b.c": value}``; a number in a path indexes a list (``workers.0.usd_per_hour``).
    ``tree`` is the file's content when the caller has read (and reshaped) it; ``path`` then only names
    it. ``inline`` is a field whose sections sit at the top level of the file (a simulate config's plan
    sections): every key that is no other field of ``model`` goes under it, and error paths leave it out.
    Raises ConfigError: a missing file, invalid TOML, a malformed override, or
    ``invalid <what> <file>: field.path: message (got value); ...`` naming every bad field.
    """
    if tree is None:
        tree = read_toml(path) if path is not None else {}
    tree = copy.deepcopy(tree)  # overrides never write into the caller's dict
    if isinstance(overrides, Mapping):
        for key, value in overrides.items():
            _assign(tree, key, value, f"{key}={value!r}")
    else:
        for assignment in overrides or ():
            apply_override(tree, assignment)
    if inline is not None:
        own = model.model_fields.keys() - {inline}
        tree = {inline: {k: v for k, v in tree.items() if k not in own}} | {
            k: v for k, v in tree.items() if k in own
        }
    try:
        return model.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, what, path, inline)) from None


def task_preset(name: str) -> list[str]:
    """The overrides of ``--task NAME``; ConfigError names the known tasks."""
    if name not in TASK_PRESETS:
        raise ConfigError(f"--task {name!r}: unknown task; choose one of {', '.join(TASK_PRESETS)}")
    return list(TASK_PRESETS[name])


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- TOML file <- ``key=value`` overrides, validated once; raises ConfigError."""
    return load_model(Config, path, overrides)
