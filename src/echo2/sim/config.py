"""Simulation scenario: a planning scenario (echo2.planner.catalog) plus [sim], [controller], [churn]
and [experiment] tables. Loaded from TOML; errors are one-line ConfigErrors naming the field.

``[batch]``, ``[staleness]`` and ``[controller]`` are the run config's own section models
(:mod:`echo2.config`); ``sim.controller = true`` turns the closed loop on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from echo2.config import ControllerConfig
from echo2.errors import ConfigError
from echo2.physics.broadcast import StrategyName
from echo2.planner.catalog import PlanScenario, find_config, format_validation_error, read_toml


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
    """A planning scenario plus the simulator's own sections."""

    plan: PlanScenario  # model, learner, batch, staleness, network, workers, baselines
    sim: SimSection = SimSection()  # run behaviour
    controller: ControllerConfig = Field(default_factory=ControllerConfig)  # closed-loop thresholds
    churn: ChurnSection = ChurnSection()  # leaving / joining
    experiment: ExperimentSection = ExperimentSection()  # what to run


_SIM_KEYS = ("sim", "controller", "churn", "experiment")


def parse_sim_scenario(data: dict[str, Any], where: str = "scenario") -> SimScenario:
    """Split a TOML dict into plan sections and sim sections and validate both."""
    ctl = data.get("controller")
    if isinstance(ctl, dict) and "enabled" in ctl:
        raise ConfigError(
            f"{where}: controller.enabled is now sim.controller (put controller = true under [sim])"
        )
    plan = {k: v for k, v in data.items() if k not in _SIM_KEYS}
    rest = {k: v for k, v in data.items() if k in _SIM_KEYS}
    try:
        sc = SimScenario.model_validate({"plan": plan, **rest})
    except ValidationError as exc:
        msg = format_validation_error(exc, where).replace("plan.", "")
        raise ConfigError(msg) from None
    if sc.sim.fixed_workers:
        for name, n in sc.sim.fixed_workers.items():
            w = sc.plan.worker_type(name)
            if n < 0 or n > w.count:
                raise ConfigError(f"sim.fixed_workers.{name} = {n} must be in 0..{w.count} (its count)")
    return sc


def load_sim_scenario(name_or_path: str) -> tuple[SimScenario, Path]:
    """Load ``configs/sim_<name>.toml`` or a path."""
    path = find_config(name_or_path, "sim")
    return parse_sim_scenario(read_toml(path), str(path)), path
