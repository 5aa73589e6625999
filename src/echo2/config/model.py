"""``[model]`` and ``[task]``: the policy to train and what it is trained on (single-turn tasks and the
declared environments)."""

from __future__ import annotations

import functools
import operator
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, Field, model_validator

from echo2.config.base import (
    _Section,
)
from echo2.envs.base import EnvironmentFields
from echo2.envs.guess import GuessTaskConfig as GuessTaskConfig  # re-exported: the name predates envs/
from echo2.envs.poker_task import PokerTaskConfig as PokerTaskConfig  # re-exported: the name predates envs/
from echo2.envs.roster import ENVIRONMENTS
from echo2.envs.verifiers_load import SCORE_TIMEOUT_S, Judges, ScoreTimeout


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


class _DatasetFields(_SingleTurnFields):
    """A single-turn task read from a user's dataset file: the file, the test file and the held-out
    shares (``data/tasks/base.file_splits``)."""

    train_path: str | None = Field(
        None,
        description="the task's records: .jsonl, .json, .parquet, .arrow or a datasets save_to_disk "
        "directory; unset = bundled sample",
    )
    eval_path: str | None = Field(
        None, description="test-split file (same formats); unset = a split of train_path"
    )
    eval_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="share of train_path held out as the test split if no eval_path"
    )
    validation_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="share of train_path held out as the validation split (warm start)"
    )

    @model_validator(mode="after")
    def _check_held_out(self) -> _DatasetFields:
        held = self.validation_fraction + (self.eval_fraction if self.eval_path is None else 0.0)
        if held >= 1.0:
            names = "validation_fraction" + (" + eval_fraction" if self.eval_path is None else "")
            raise ValueError(f"{names} = {held:g} must be < 1 to leave problems of train_path to train on")
        return self


class MathTaskConfig(_DatasetFields):
    """Question/answer records from a JSONL file, graded by a math-answer checker (math-verify)."""

    name: Literal["math"] = "math"
    question_field: str = Field("question", min_length=1, description="the records' question field")
    answer_field: str = Field("answer", min_length=1, description="the records' answer field")
    system_field: str | None = Field(
        None, min_length=1, description="a per-record system message field (chat template); unset = none"
    )
    prompt_template: str = Field("{question}\nAnswer: ", description="format string with a {question} slot")
    answer_rule: Literal["auto", "gsm8k", "boxed", "whole"] = Field(
        "auto",
        description="how the gold answer is read from a record's answer: the text after the last '####' "
        "(gsm8k), the last \\boxed{} (boxed), the whole string, or auto: gsm8k if '####' is there, else "
        "boxed if a \\boxed{ is, else whole",
    )


class CodeTaskConfig(_DatasetFields):
    """Programming problems with unit tests, graded by running the code in a bubblewrap sandbox."""

    name: Literal["code"] = "code"
    prompt_field: str = Field("prompt", min_length=1, description="the records' problem text")
    tests_field: str = Field(
        "tests",
        min_length=1,
        description="the records' tests: Python text (or a list of lines) run after the code",
    )
    entry_point_field: str | None = Field(
        "entry_point",
        min_length=1,
        description="the field naming the function the tests' check(candidate) is called with (optional)",
    )
    solution_field: str | None = Field(
        "solution",
        min_length=1,
        description="a reference solution per record (the embedded model's warm start)",
    )
    prompt_template: str = Field("{prompt}\n", description="format string with a {prompt} slot")
    prepend_prompt: bool = Field(
        False, description="grade the prompt's text followed by the completion (a function head to complete)"
    )
    timeout_s: float = Field(5.0, gt=0.0, le=300.0, description="wall-clock limit of one graded run")
    cpu_s: int = Field(3, ge=1, le=300, description="CPU-seconds limit of each process of a graded run")
    memory_mb: int = Field(512, ge=64, description="address-space limit of each process of a graded run, MiB")
    processes: int = Field(16, ge=4, description="processes and threads a graded run may have at once")
    output_kb: int = Field(1024, ge=1, description="output a graded run may print, KiB, then it is killed")
    python: str | None = Field(
        None,
        description="the interpreter graded code runs with; unset = /usr/bin/python3, else the learner's",
    )
    grade_threads: int = Field(
        0,
        ge=0,
        description="a submission's completions graded at once (each a sandboxed process); 0 = the cores",
    )

    @model_validator(mode="after")
    def _check(self) -> CodeTaskConfig:
        if "{prompt}" not in self.prompt_template:
            raise ValueError(f"prompt_template = {self.prompt_template!r} has no {{prompt}} slot")
        if self.cpu_s > self.timeout_s:
            raise ValueError(f"cpu_s = {self.cpu_s} must be <= timeout_s = {self.timeout_s:g}")
        return self


class VerifiersTaskConfig(_SingleTurnFields):
    """A verifiers (v1) taskset's single-turn tasks, every completion scored on the learner by the tasks'
    own ``@reward`` functions (``data/tasks/verifiers_env.py``; the ``verifiers`` extra)."""

    name: Literal["verifiers"] = "verifiers"
    env: str = Field(
        "echo2.data.tasks.verifiers_example:load_taskset",
        min_length=1,
        description="the taskset (default: a bundled sums taskset): an installed taskset package's id, or "
        "'package.module:name' / 'path/to/file.py:name' naming a Taskset class, a Taskset, or a function "
        "returning one (an Env's taskset is taken)",
    )
    env_args: dict[str, str | int | float | bool | None] = Field(
        default_factory=dict,
        description="keyword arguments of that function, or the fields of the Taskset's config (a class or "
        "an id) (they travel to workers with the run's settings: no secret belongs here)",
    )
    limit: int = Field(
        100_000, ge=1, description="tasks read from the taskset at most (an infinite one needs it)"
    )
    prompt_template: str = Field("{prompt}\n", description="format string with a {prompt} slot")
    reference_field: str | None = Field(
        "answer",
        min_length=1,
        description="the task data's field whose text the embedded model's warm start imitates (unset: none)",
    )
    eval_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="share of the tasks held out as the test split"
    )
    validation_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="share of the tasks held out as the validation split (warm start)"
    )
    grade_threads: int = Field(
        4,
        ge=1,
        le=256,
        description="completions scored at once (a submission's, an evaluation's: on one event loop; a "
        "judged task waits on its judge, so this is how many judge calls are in flight)",
    )
    judges: Judges = "refuse"
    score_timeout_s: ScoreTimeout = SCORE_TIMEOUT_S

    @model_validator(mode="after")
    def _check(self) -> VerifiersTaskConfig:
        if "{prompt}" not in self.prompt_template:
            raise ValueError(f"prompt_template = {self.prompt_template!r} has no {{prompt}} slot")
        if self.eval_fraction + self.validation_fraction >= 1.0:
            raise ValueError(
                f"eval_fraction + validation_fraction = {self.eval_fraction + self.validation_fraction:g} "
                "must be < 1 to leave tasks to train on"
            )
        return self


# The multi-turn environments are declared in their own modules (``envs/``: config model, spec,
# preset) and listed once in ``envs/roster.ENVIRONMENTS``; the ``[task]`` union and the presets
# below are derived from that list.
SINGLE_TURN_TASKS: tuple[type[_SingleTurnFields], ...] = (
    ArithmeticTaskConfig,
    MathTaskConfig,
    CodeTaskConfig,
    VerifiersTaskConfig,
)
# every ``[task]`` variant, in the order pydantic lists them: the single-turn tasks, then the environments
TASK_MODELS: tuple[type[BaseModel], ...] = (*SINGLE_TURN_TASKS, *(env.config for env in ENVIRONMENTS))

if TYPE_CHECKING:  # the checker's view: a single-turn task or any declared environment
    TaskConfig = (
        ArithmeticTaskConfig | MathTaskConfig | CodeTaskConfig | VerifiersTaskConfig | EnvironmentFields
    )
else:  # pydantic's: one variant per model, picked by its ``name`` literal
    TaskConfig = Annotated[functools.reduce(operator.or_, TASK_MODELS), Field(discriminator="name")]


# `--task NAME`: the embedded default of each task, as overrides under the user's own; an environment's
# are its declaration's (``Environment.preset``), after the ``task.name`` that selects it
TASK_PRESETS: dict[str, list[str]] = {
    "arithmetic": ["task.name=arithmetic"],
    "math": ["task.name=math"],
    "code": ["task.name=code", "sampling.max_new_tokens=40"],
    "verifiers": ["task.name=verifiers"],
    **{env.name: [f"task.name={env.name}", *env.preset] for env in ENVIRONMENTS},
}


def runs_named_code(cfg: TaskConfig) -> str | None:
    """What code of the learner's choosing a worker would run to play the task ``cfg`` names (a verifiers
    env named by ``module:name`` or a file: ``VerifiersEnvTaskConfig.runs_named_code``), or None: a worker
    refuses it unless its operator allows it (``echo2 worker --trust-run-code``)."""
    own = getattr(cfg, "runs_named_code", None)
    return own() if callable(own) else None
