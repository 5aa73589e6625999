"""The simulator's inputs and records: a simulated worker, the parameters of a run, its result, and the
engine's per-worker and per-publication state."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from echo2.config import ControllerConfig
from echo2.errors import ConfigError
from echo2.physics.broadcast import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_HOP_LATENCY_S,
    StrategyName,
    strategy_name,
)
from echo2.physics.rules import DEFAULT_GAMMA


class SimulationInvariantError(AssertionError):
    """A simulated run broke a guarantee of the system (a bug, not bad input)."""


@dataclass(frozen=True)
class SimWorker:
    """One worker of the simulated marketplace."""

    worker_id: str  # unique id
    type_name: str  # catalog type
    usd_per_hour: float  # c_i
    rollouts_per_s: float  # mu_i: true mean delivered rate
    link_bytes_per_s: float  # B_i in bytes/s, both directions


@dataclass(frozen=True)
class SimParams:
    """Everything one simulated run needs besides the workers."""

    rollouts_per_step: int  # R
    group_size: int  # rollouts per GRPO group (one generation unit of a worker)
    t_train_s: float  # T_train
    staleness: int  # S: admission v >= v_t - S
    kappa: int  # publication period
    learner_usd_per_hour: float  # learner node price
    snapshot_bytes: float  # G, bytes
    b0_bytes_per_s: float  # learner uplink B0, bytes/s
    strategy: StrategyName  # broadcast strategy
    steps: int  # learner steps to simulate
    seed: int = 0  # RNG seed: same seed, same run
    reload_s: float = 0.0  # snapshot reload on a worker after download
    chunk_bytes: float = DEFAULT_CHUNK_BYTES  # relay chunk (chain strategies)
    hop_latency_s: float = DEFAULT_HOP_LATENCY_S  # per-hop WAN latency (chain strategies)
    patch_ratio: float | None = None  # delta publications: patch bytes / G; None = every one full
    anchor_every: int = 20  # with deltas, a full anchor every this many publications
    gamma: float = DEFAULT_GAMMA  # q = 1/gamma: T_bcast is measured when this fraction has installed
    noise_sigma: float = 0.15  # lognormal sigma of one group's duration
    straggler_prob: float = 0.02  # chance a group straggles
    straggler_factor: float = 3.0  # how much longer a straggling group takes
    overlap_generation: bool = False  # keep generating with the old version during a broadcast
    warmup_steps: int | None = None  # steps left out of steady-state statistics (default 2*kappa+2)
    mu_target: float | None = None  # controller target (rollouts/s); None with no controller
    controller: ControllerConfig | None = None  # closed loop on; None: the pool stays as given
    control_interval_s: float = 30.0  # heartbeat + decision period
    churn_mean_lifetime_s: float | None = None  # mean time an active worker stays; None: no churn
    join_interval_s: float | None = None  # mean time between new idle workers joining; None: none
    record_metrics: bool = True  # keep the per-step metric dicts (off for speed runs)
    buffer_steps: float | None = None  # backpressure: no new group while stored + in-flight >= this x R
    # the share of delivered groups a batch can use (the rest zero-variance, left out as with
    # grpo.drop_zero_variance); each group is useful with this probability, drawn from a stream of its
    # own (1: every one, no draw)
    useful_share: float = 1.0

    def __post_init__(self) -> None:
        if self.rollouts_per_step < 1 or self.group_size < 1:
            raise ConfigError("rollouts_per_step and group_size must be >= 1")
        if self.rollouts_per_step % self.group_size:
            raise ConfigError(
                f"rollouts_per_step ({self.rollouts_per_step}) must be a multiple of "
                f"group_size ({self.group_size})"
            )
        if self.steps < 1:
            raise ConfigError(f"steps must be >= 1, got {self.steps}")
        if not 0.0 < self.useful_share <= 1.0:
            raise ConfigError(f"useful_share must be in (0, 1], got {self.useful_share!r}")
        if self.staleness < 0 or self.kappa < 1:
            raise ConfigError(f"need S >= 0 and kappa >= 1, got S={self.staleness}, kappa={self.kappa}")
        if self.controller is not None and self.mu_target is None:
            raise ConfigError("a controller needs mu_target")
        strategy_name(self.strategy)  # a bad name fails here, listing the choices


@dataclass
class _W:
    spec: SimWorker
    idx: int  # row of this worker in the engine's per-worker arrays
    active: bool = False
    present: bool = True
    busy: bool = False
    token: int = 0  # bumps on release/leave: invalidates in-flight events
    wake_at: float = math.inf  # a pending wake-up for an install it waits for (inf: none)
    rollouts_since: int = 0
    busy_since: float = 0.0
    group_s: float = 0.0  # group_size / rollouts_per_s: one group's mean seconds before noise


@dataclass
class _Pub:
    """One publication: every target's install time in one array (lazy installs: nothing per worker)."""

    version: int  # the policy version published
    t0: float  # publication time
    targets: np.ndarray  # worker rows targeted (active and present at publication)
    due: np.ndarray  # (rows,) absolute install time per worker row; inf: not a target
    cancelled: set[int] = field(default_factory=set)  # rows released meanwhile: their install is void


@dataclass
class SimResult:
    """Per-step metrics (SPEC section 7 names) and run summary."""

    metrics: list[dict[str, Any]]  # one namespaced dict per learner step
    summary: dict[str, Any]  # run-level numbers
    t_bcast_s: list[float] = field(default_factory=list)  # per publication, fraction q installed
