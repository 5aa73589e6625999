"""Typed planning scenario: worker catalog, learner, batch, staleness, network, baselines (pydantic).

A scenario is what `echo2 plan` reads from TOML (and what `echo2 simulate` extends). The ``[batch]`` and
``[staleness]`` sections are the run config's own models (:class:`echo2.config.BatchConfig`,
:class:`echo2.config.StalenessConfig`), so a run, a plan and a simulation read them the same way.
Scenarios load through the run config's one loader (:func:`echo2.config.load_settings`), so a bad value
fails the same way everywhere: one :class:`echo2.errors.ConfigError` line naming the file, the field
and the rule.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from echo2.config import BatchConfig, StalenessConfig, load_settings, read_toml
from echo2.errors import ConfigError
from echo2.physics.broadcast import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_HOP_LATENCY_S,
    StrategyName,
    mbps_to_bytes_per_s,
)
from echo2.planner.memory_model import QWEN3_SHAPES


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorkerType(_Model):
    """One rentable worker type of the catalog."""

    name: str = Field(min_length=1)  # catalog key, e.g. "rtx5090"
    usd_per_hour: float = Field(gt=0, allow_inf_nan=False)  # c_i: rental price of one worker, $/h
    rollouts_per_s: float = Field(gt=0, allow_inf_nan=False)  # mu_i: delivered rollouts/s of one worker
    bandwidth_mbps: float = Field(default=100.0, gt=0, allow_inf_nan=False)  # B_w: link, both ways, Mbit/s
    count: int = Field(default=1000, ge=0)  # availability: how many of this type can be rented now

    @property
    def link_bytes_per_s(self) -> float:
        """B_w in bytes/s (the unit of :mod:`echo2.physics.broadcast`)."""
        return mbps_to_bytes_per_s(self.bandwidth_mbps)


class LoraSpec(_Model):
    """A LoRA run ([lora]): publications are the adapter alone (docs/learner.md)."""

    rank: int = Field(ge=1)  # lora.r, on every attention and MLP projection
    # bytes of an adapter patch / the adapter's (measured: benchmarks/lora.py); None = the whole adapter
    patch_ratio: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)


class ModelSpec(_Model):
    """The policy being trained (only what a publication ships matters here)."""

    name: str = "model"  # display name, e.g. "Qwen3-8B"
    snapshot_gb: float = Field(gt=0, allow_inf_nan=False)  # G: bytes per snapshot / 1e9 (bf16: 2 x params)
    # delta publications: bytes of a patch / G (measured: benchmarks/deltas.py); None = full snapshots
    patch_ratio: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    anchor_every: int = Field(default=20, ge=1)  # with deltas, a full anchor every this many publications
    # a Qwen3 shape (planner/memory_model.py:QWEN3_SHAPES) for the learner's memory need; None: not reported
    shape: Literal["0.6B", "1.7B", "4B", "8B"] | None = None
    lora: LoraSpec | None = None  # a LoRA run: the adapter's bytes (from ``shape``) instead of G

    @model_validator(mode="after")
    def _lora_needs_a_shape(self) -> ModelSpec:
        if self.lora is not None and self.shape is None:
            raise ValueError("model.lora needs model.shape (the adapter's size comes from the architecture)")
        return self

    @property
    def snapshot_bytes(self) -> float:
        """G in bytes: the whole model in bf16."""
        return self.snapshot_gb * 1e9

    @property
    def anchor_bytes(self) -> float:
        """What an anchor ships: G, or a LoRA run's whole adapter (bf16, 2 bytes a parameter)."""
        if self.lora is None:
            return self.snapshot_bytes

        assert self.shape is not None
        return 2.0 * QWEN3_SHAPES[self.shape].lora_params(self.lora.rank)

    @property
    def delta_ratio(self) -> float | None:
        """Bytes of a patch / an anchor's (the adapter's patches in a LoRA run); None: anchors only."""
        return self.lora.patch_ratio if self.lora is not None else self.patch_ratio

    def bytes_of_publication(self, index: int) -> float:
        """Bytes publication number ``index`` (0 = the first) ships: an anchor (:attr:`anchor_bytes`), or
        ``delta_ratio`` of it for a patch (``[snapshot]`` of a run: an anchor every ``anchor_every``)."""
        ratio = self.delta_ratio
        if ratio is None or index % self.anchor_every == 0:
            return self.anchor_bytes
        return ratio * self.anchor_bytes

    @property
    def publication_bytes(self) -> float:
        """Mean bytes per publication over an anchor period (G without deltas or LoRA): what T_bcast in
        the capacity model is computed from."""
        ratio = self.delta_ratio
        if ratio is None:
            return self.anchor_bytes
        k = self.anchor_every
        return self.anchor_bytes * (1 + (k - 1) * ratio) / k


class LearnerSpec(_Model):
    """The centralized learner. ``t_train_s`` is T_train on ``gpus`` GPUs, unless it was measured (or is
    stated) on ``t_train_gpus``: then T_train on ``gpus`` follows a stated scaling, each change of the
    GPU count by a factor ``r`` changing the update rate by ``r * scaling_efficiency`` (``r > 1``) or
    ``r / scaling_efficiency`` (``r < 1``) (:attr:`t_train`)."""

    name: str = "learner"  # display name, e.g. "4x A100-80GB"
    usd_per_hour: float | None = Field(default=None, gt=0, allow_inf_nan=False)  # node $/h; None: no costs
    t_train_s: float = Field(gt=0, allow_inf_nan=False)  # T_train: seconds per update (on t_train_gpus)
    gpus: int = Field(default=1, ge=1)  # accelerators of the learner (its ranks when sharded)
    t_train_gpus: int | None = Field(default=None, ge=1)  # GPUs t_train_s is for; None: gpus
    scaling_efficiency: float | None = Field(default=None, gt=0, le=1)  # stated; needed when they differ
    gpu_gib: float | None = Field(default=None, gt=0, allow_inf_nan=False)  # memory of one, GiB
    precision: Literal["fp32", "bf16-mixed"] = "bf16-mixed"  # the learner's [learner] precision
    micro_batch_tokens: int = Field(default=8192, ge=16)  # the learner's [learner] micro_batch_tokens

    @model_validator(mode="after")
    def _scaling_stated(self) -> LearnerSpec:
        if self.t_train_gpus not in (None, self.gpus) and self.scaling_efficiency is None:
            raise ValueError(
                f"learner.t_train_s is for {self.t_train_gpus} GPUs and the learner has {self.gpus}: state "
                "learner.scaling_efficiency (0 < e <= 1; 1 = linear scaling)"
            )
        return self

    @property
    def t_train(self) -> float:
        """T_train per update on ``gpus`` GPUs (class docstring)."""
        measured_on = self.t_train_gpus or self.gpus
        if measured_on == self.gpus:
            return self.t_train_s
        r, e = self.gpus / measured_on, self.scaling_efficiency or 1.0
        return self.t_train_s / (r * e if r > 1 else r / e)


class NetworkSpec(_Model):
    """Links and the broadcast strategy whose T_bcast feeds the provisioning rule."""

    b0_mbps: float = Field(default=500.0, gt=0, allow_inf_nan=False)  # learner uplink B0, Mbit/s
    reload_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)  # snapshot reload time on a worker
    chunk_mb: float = Field(default=DEFAULT_CHUNK_BYTES / 2**20, gt=0, allow_inf_nan=False)  # chunk, MiB
    hop_latency_s: float = Field(default=DEFAULT_HOP_LATENCY_S, ge=0, allow_inf_nan=False)  # per relay hop
    strategy: StrategyName = "tree-pipelined"  # whose T_bcast estimate the plan uses
    t_bcast_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)  # measured T_bcast override

    @property
    def b0_bytes_per_s(self) -> float:
        """B0 in bytes/s."""
        return mbps_to_bytes_per_s(self.b0_mbps)

    @property
    def chunk_bytes(self) -> float:
        """Relay chunk in bytes (``chunk_mb`` MiB)."""
        return self.chunk_mb * 2**20


class Baseline(_Model):
    """A centralized cluster to compare against (e.g. verl-sync on 8x A100)."""

    name: str = Field(min_length=1)  # e.g. "verl-sync"
    usd_per_hour: float = Field(gt=0, allow_inf_nan=False)  # whole cluster, $/h
    step_s: float = Field(gt=0, allow_inf_nan=False)  # seconds per training step


class PlanScenario(_Model):
    """Everything `echo2 plan` needs."""

    model: ModelSpec | None = None  # the policy (snapshot size); needed unless network.t_bcast_s is set
    learner: LearnerSpec  # learner price and T_train
    batch: BatchConfig = Field(default_factory=BatchConfig)  # R = prompts x group_size
    staleness: StalenessConfig = Field(default_factory=StalenessConfig)  # S, kappa, gamma
    network: NetworkSpec = NetworkSpec()  # B0, reload, strategy
    workers: tuple[WorkerType, ...] = ()  # the catalog (an empty one is refused, naming [[workers]])
    baselines: tuple[Baseline, ...] = ()  # centralized clusters to compare with
    activation: Literal["greedy", "greedy_prefix", "exact", "random"] = "greedy"  # active-set policy
    # the share of received rollouts a batch can use (below 1 when zero-variance groups are left out:
    # grpo.drop_zero_variance; a run measures it as pool/useful_share): the pool is sized for R / it
    useful_share: float = Field(1.0, gt=0.0, le=1.0)
    priced: bool = True  # False when worker prices are placeholders (flags-only plan without prices)

    @model_validator(mode="after")
    def _unique_types(self) -> PlanScenario:
        names = [w.name for w in self.workers]
        if not names:
            raise ValueError("the worker catalog is empty; add at least one [[workers]] entry")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate worker type names: {dup}")
        if self.model is None and self.network.t_bcast_s is None:
            raise ValueError("give the snapshot size ([model] snapshot_gb) or a measured network.t_bcast_s")
        return self

    def worker_type(self, name: str) -> WorkerType:
        """The catalog entry called ``name``; ConfigError naming the known types otherwise."""
        for w in self.workers:
            if w.name == name:
                return w
        raise ConfigError(f"unknown worker type {name!r}; the catalog has {[w.name for w in self.workers]}")


# a simulate config's own tables (sim/config.py's SimScenario fields besides `plan`): a plan skips them
SIM_SECTIONS = ("sim", "controller", "churn", "experiment")


def read_scenario(path: Path) -> dict[str, Any]:
    """A scenario file's planning sections as a dict (so a simulate config plans too)."""
    return {k: v for k, v in read_toml(path).items() if k not in SIM_SECTIONS}


def parse_scenario(data: dict[str, Any], where: str = "scenario") -> PlanScenario:
    """Validate a plain dict as a :class:`PlanScenario` (the one loader,
    :func:`echo2.config.load_settings`); ConfigError ``invalid <where>: field.path: message`` on failure."""
    return load_settings(PlanScenario, tree=data, what=where)


def find_config(name_or_path: str, prefix: str) -> Path:
    """Resolve a config path, or a short name like ``paper_qwen3_8b`` to ``configs/<prefix>_<name>.toml``
    (then ``plan_<name>`` / ``sim_<name>``, so `echo2 plan` also takes simulate configs).

    Looks in ``./configs`` and in the repository's ``configs/`` next to ``src/``.
    """
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        return p
    repo_configs = Path(__file__).resolve().parents[3] / "configs"
    stems = list(
        dict.fromkeys(
            [name_or_path, f"{prefix}_{name_or_path}", f"plan_{name_or_path}", f"sim_{name_or_path}"]
        )
    )
    for d in (Path.cwd() / "configs", repo_configs):
        for stem in stems:
            cand = d / f"{stem}.toml"
            if cand.exists():
                return cand
    raise ConfigError(
        f"no config named {name_or_path!r}: not a file, and no configs/{prefix}_{name_or_path}.toml "
        f"in ./configs or {repo_configs}"
    )
