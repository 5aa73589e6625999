"""Simulation scenario: a planning scenario (echo2.planner.scenario) plus [sim], [controller], [churn]
and [experiment] tables. Loaded from TOML by the run config's one loader (echo2.config.load_settings):
errors are one-line ConfigErrors naming the file and the field.

``[batch]``, ``[staleness]`` and ``[controller]`` are the run config's own section models
(:mod:`echo2.config`); ``sim.controller = true`` turns the closed loop on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from echo2.config import ControllerConfig, load_settings
from echo2.physics.broadcast import StrategyName
from echo2.planner.scenario import PlanScenario, find_config


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SimSection(_Model):
    """How one run behaves."""

    steps: int = Field(default=60, ge=1)  # learner steps per run
    seed: int = 0  # RNG seed
    noise_sigma: float = Field(default=0.15, ge=0)  # lognormal sigma of a group's duration
    straggler_prob: float = Field(default=0.02, ge=0, le=1)  # chance a group straggles
    straggler_factor: float = Field(default=3.0, ge=1)  # slowdown of a straggling group
    overlap_generation: bool = False  # keep generating with the old version during broadcasts
    strategy: StrategyName | None = None  # broadcast strategy; default network.strategy
    warmup_steps: int | None = Field(default=None, ge=0)  # left out of steady-state stats
    fixed_workers: dict[str, int] | None = None  # type -> count active at t=0; None: the plan's set
    control_interval_s: float = Field(default=30.0, gt=0)  # heartbeat + decision period
    controller: bool = False  # run the closed-loop controller with the [controller] thresholds
    # backpressure: no new group while stored + in flight >= this x R (the runtime's max_inflight_batches)
    buffer_steps: float | None = Field(default=None, gt=0)
    record_metrics: bool = True  # keep the per-step metric dicts (off for scale runs)


class ChurnSection(_Model):
    """Workers leaving and joining."""

    mean_lifetime_s: float | None = Field(default=None, gt=0)  # exponential lifetime of an active worker
    join_interval_s: float | None = Field(default=None, gt=0)  # mean gap between new idle workers


class ExperimentSection(_Model):
    """What `echo2 simulate` runs with this scenario."""

    kind: Literal["run", "bubble_sweep", "bcast_sweep", "ablation"] = "run"  # which experiment
    staleness: list[int] = [2, 3, 4, 6]  # bubble_sweep: one curve per S
    n_max: int | None = Field(default=None, ge=1)  # bubble_sweep: largest pool (default 2*N_min+2)
    ns: list[int] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000]  # bcast_sweep: pool sizes
    seeds: int = Field(default=5, ge=1)  # ablation: seeds averaged per row (random policy)
    # ablation: add "+ deltas" rows publishing patches of this size / G (benchmarks/deltas.py measures it)
    patch_ratio: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)


class SimScenario(_Model):
    """A planning scenario plus the simulator's own sections (in the file, the plan's sections sit at the
    top level next to ``[sim]``, ``[controller]``, ``[churn]`` and ``[experiment]``)."""

    plan: PlanScenario  # model, learner, batch, staleness, network, workers, baselines
    sim: SimSection = SimSection()  # run behaviour
    controller: ControllerConfig = Field(default_factory=ControllerConfig)  # closed-loop thresholds
    churn: ChurnSection = ChurnSection()  # leaving / joining
    experiment: ExperimentSection = ExperimentSection()  # what to run

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        ctl = data.get("controller") if isinstance(data, dict) else None
        if isinstance(ctl, dict) and "enabled" in ctl:
            raise ValueError("controller.enabled is now sim.controller (put controller = true under [sim])")
        return data

    @model_validator(mode="after")
    def _fixed_workers_in_catalog(self) -> SimScenario:
        counts = {w.name: w.count for w in self.plan.workers}
        for name, n in (self.sim.fixed_workers or {}).items():
            if name not in counts:
                raise ValueError(
                    f"sim.fixed_workers: unknown worker type {name!r}; the catalog has {list(counts)}"
                )
            if not 0 <= n <= counts[name]:
                raise ValueError(f"sim.fixed_workers.{name} = {n} must be in 0..{counts[name]} (its count)")
        return self


def load_sim_scenario(
    name_or_path: str, overrides: Iterable[str] | Mapping[str, Any] | None = None
) -> tuple[SimScenario, Path]:
    """Load ``configs/sim_<name>.toml`` or a path, then ``a.b=value`` overrides in the file's own layout
    (``sim.steps=30``, ``staleness.S=4``), through the one loader (:func:`echo2.config.load_settings`)."""
    path = find_config(name_or_path, "sim")
    return load_settings(SimScenario, path, overrides, what="scenario", inline="plan"), path
