"""``[runtime]``: the asynchronous three-plane runtime (``echo2 run``, ``learner``, ``worker``)."""

from __future__ import annotations

from pydantic import Field

from echo2.config.base import (
    DEVICE_PATTERN,
    EngineName,
    FloatDtype,
    _Section,
)
from echo2.physics.broadcast import StrategyName


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
    gather_s: float = Field(
        10.0,
        ge=0.0,
        description="a resumed run's first announcement waits at most this long while the workers the "
        "registry trusts re-join the broadcast (until all are back, or none joined for 1 s), so one striped "
        "plan covers them instead of a tree of latecomers; 0 = announce at once",
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
    heartbeats_per_s: float = Field(
        200.0,
        gt=0.0,
        allow_inf_nan=False,
        description="the fleet's heartbeats a second the learner plans for: past heartbeats_per_s x "
        "heartbeat_s members the heartbeat period, the pause a refused lease asks for and the windows "
        "that read silence as absence stretch with the fleet (runtime/members.py: Cadence)",
    )
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
    api_processes: int = Field(
        0,
        ge=0,
        le=64,
        description="processes that serve the API's port in front of the learner (TLS, the perimeter, "
        "HTTP parsing, heartbeats and lease requests in batches: runtime/front.py), so the fleet's "
        "requests do not share the update's process; 0 = the learner's event loop serves it",
    )
    front_batch_s: float = Field(
        0.1,
        gt=0.0,
        le=2.0,
        description="with api_processes: a front sends the heartbeats and lease requests it received to "
        "the learner as one request this often (each waits up to this long for its answer)",
    )
    join_token: str | None = Field(None, min_length=16, description="run join token; unset = generated")
