"""The typed config tree of a training run (pydantic). No torch import here.

A run's config comes from defaults, then an optional TOML file, then ``--set key.sub=value``
overrides, and is validated once, before anything starts: a bad value fails with the field's dotted
path and the rule it breaks (:class:`echo2.errors.ConfigError`).

The paper's constraints live in validators: ``kappa >= 1`` and the default coupling
``kappa = max(1, S - 1)`` (SPEC §2), group size ``>= 2`` (GRPO needs a group to normalise against),
``0 < top_p <= 1``, ``C >= 1`` for truncated importance sampling.

The tree is split by concern, and every name is importable from ``echo2.config``: ``base`` (strict
sections, run-wide constants), ``model`` (``[model]``, ``[task]``), ``training`` (sampling, batch,
staleness, controller, GRPO, learner, LoRA, train, snapshot), ``security`` (``[security]``,
``[security.perimeter]``), ``runtime`` (``[runtime]``), ``loader`` (the TOML reader, the override
grammar, the one error format); the root ``Config`` and :func:`load_config` here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, model_validator

from echo2.config.base import (
    DEVICE_PATTERN,
    REQUEST_BYTES_PER_TOKEN,
    USER_CONTEXT_TOKENS,
    EngineName,
    FloatDtype,
    _Section,
)
from echo2.config.loader import apply_override, load_settings, read_toml
from echo2.config.model import (
    SINGLE_TURN_TASKS,
    TASK_MODELS,
    TASK_PRESETS,
    ArithmeticTaskConfig,
    CodeTaskConfig,
    EmbeddedModelConfig,
    GuessTaskConfig,
    MathTaskConfig,
    ModelConfig,
    PokerTaskConfig,
    TaskConfig,
    VerifiersTaskConfig,
    WarmstartConfig,
    runs_named_code,
)
from echo2.config.runtime import RuntimeConfig
from echo2.config.security import ENGINE_TOLERANCES, PerimeterConfig, SecurityConfig
from echo2.config.training import (
    BatchConfig,
    ControllerConfig,
    GRPOConfig,
    LearnerConfig,
    LoRAConfig,
    SamplingConfig,
    SinkName,
    SnapshotConfig,
    StalenessConfig,
    TrainConfig,
)
from echo2.errors import ConfigError

__all__ = [
    "DEVICE_PATTERN",
    "ENGINE_TOLERANCES",
    "REQUEST_BYTES_PER_TOKEN",
    "SINGLE_TURN_TASKS",
    "TASK_MODELS",
    "TASK_PRESETS",
    "USER_CONTEXT_TOKENS",
    "ArithmeticTaskConfig",
    "BatchConfig",
    "CodeTaskConfig",
    "Config",
    "ControllerConfig",
    "EmbeddedModelConfig",
    "EngineName",
    "FloatDtype",
    "GRPOConfig",
    "GuessTaskConfig",
    "LearnerConfig",
    "LoRAConfig",
    "MathTaskConfig",
    "ModelConfig",
    "PerimeterConfig",
    "PokerTaskConfig",
    "RuntimeConfig",
    "SamplingConfig",
    "SecurityConfig",
    "SinkName",
    "SnapshotConfig",
    "StalenessConfig",
    "TaskConfig",
    "TrainConfig",
    "VerifiersTaskConfig",
    "WarmstartConfig",
    "apply_override",
    "load_config",
    "load_settings",
    "read_toml",
    "runs_named_code",
    "task_preset",
]  # fmt: skip


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


def task_preset(name: str) -> list[str]:
    """The overrides of ``--task NAME``; ConfigError names the known tasks."""
    if name not in TASK_PRESETS:
        raise ConfigError(f"--task {name!r}: unknown task; choose one of {', '.join(TASK_PRESETS)}")
    return list(TASK_PRESETS[name])


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- TOML file <- ``key=value`` overrides, validated once; raises ConfigError."""
    return load_settings(Config, path, overrides)
