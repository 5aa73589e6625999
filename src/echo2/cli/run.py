"""`echo2 run`, `echo2 learner`, `echo2 worker`."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

from echo2.cli.common import Command, add_budget_arguments, add_config_arguments, load_from_args
from echo2.errors import ConfigError
from echo2.resources import raise_descriptor_limit
from echo2.transport import JOIN_TOKEN_ENV, parse_join


def _run_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    g = p.add_argument_group(
        "a sharded learner (FSDP2; started as torchrun starts any PyTorch job: rank 0 is the learner node)"
    )
    g.add_argument("--nproc-per-node", type=int, default=1, help="learner ranks on this machine (1 per GPU)")
    g.add_argument("--nnodes", type=int, default=1, help="machines of the learner")
    g.add_argument("--node-rank", type=int, default=0, help="this machine's rank among them (0: the node)")
    g.add_argument("--master-addr", help="address of the machine of node rank 0 (several machines)")
    g.add_argument("--master-port", type=int, default=29500, help="its rendezvous port (default 29500)")
    add_budget_arguments(p)
    p.add_argument("--workers", type=int, help="shorthand for --set runtime.workers=N")
    p.add_argument("--staleness", "-S", type=int, help="shorthand for --set staleness.S=S")
    p.add_argument("--resume", action="store_true", help="continue from the run directory's last checkpoint")


def held_out(s: Any) -> str:
    """The held-out line of a run summary, in the unit of its task's score (NaN: never scored, a stop
    during the first evaluation)."""
    a, b, best = s.initial_accuracy, s.final_accuracy, s.best_accuracy
    if math.isnan(a):
        return "held-out score not read (stopped during the starting evaluation)"
    if s.score == "chips":  # poker: the mean chip change per hand, in big blinds
        return f"held-out mean return {a:+.3f} -> {b:+.3f} big blinds per hand (best {best:+.3f})"
    if s.score == "return":  # an environment's held-out score is its mean episodic return, not a share
        return f"held-out mean return {a:+.3f} -> {b:+.3f} (best {best:+.3f})"
    return f"held-out accuracy {a:.1%} -> {b:.1%} (best {best:.1%})"


def _print_summary(command: str, s: Any) -> None:
    print(
        f"\n{command}: {s.steps} learner steps (version {s.version}) in {s.wall_s:.0f} s; {held_out(s)}\n"
        f"bubble ratio {s.bubble_ratio:.1%}, max staleness {s.staleness_max}\n"
        f"run directory: {s.run_dir}  (metrics.jsonl, summary.json, run.png, workers/)\n"
        f"last checkpoint: {s.last_checkpoint}"
    )


def live_view(args: argparse.Namespace) -> bool:
    """The live status area unless ``--no-progress`` or ``--quiet`` (plain status lines instead)."""
    return not (args.no_progress or args.quiet)


def torchrun_argv(args: argparse.Namespace, argv: list[str]) -> list[str] | None:
    """The ``torchrun`` command that starts this command's ranks (``argv``: this command's own
    arguments, which each rank gets again), or None: one rank, or already a rank that torchrun started."""
    if args.nproc_per_node < 1 or args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(
            f"--nproc-per-node {args.nproc_per_node} --nnodes {args.nnodes} --node-rank {args.node_rank}: "
            "need at least one rank per node, one node, and 0 <= node rank < nodes"
        )
    if args.nproc_per_node * args.nnodes == 1 or "TORCHELASTIC_RUN_ID" in os.environ:
        return None
    if args.nnodes > 1 and not args.master_addr:
        raise ConfigError("a learner on several machines needs --master-addr (the machine of node rank 0)")
    if args.nnodes == 1 and not args.master_addr:
        where = ["--standalone"]  # a free port on this machine
    else:
        where = [f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}",
                 f"--master-addr={args.master_addr}", f"--master-port={args.master_port}"]  # fmt: skip
    return [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc-per-node={args.nproc_per_node}",
            "-m", "echo2.cli", *argv]  # fmt: skip


def _ranks_or_none(args: argparse.Namespace) -> int | None:
    """Start this command's ranks under torchrun (this process becomes its agent), or follow rank 0 when
    this process is a rank other than 0; None: this process is the learner node (one rank, or rank 0)."""
    argv = torchrun_argv(args, sys.argv[1:])
    if argv is not None:
        sys.stdout.flush()
        os.execv(argv[0], argv)
    if int(os.environ.get("RANK", "0")) > 0:
        from echo2.models.policy import configure_torch
        from echo2.runtime.core import Follower

        for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides when the ranks stop (after a checkpoint)
            signal.signal(sig, signal.SIG_IGN)
        cfg = load_from_args(args)
        configure_torch(cfg)
        Follower.load(cfg).run()
        return 0
    return None


def _run(args: argparse.Namespace) -> int:
    if (followed := _ranks_or_none(args)) is not None:
        return followed
    cfg = load_from_args(args)
    from echo2.rollout.engines import require_engine
    from echo2.runtime.launcher import run_local

    if cfg.runtime.workers:
        require_engine(cfg.runtime.engine)  # before the warm start, not when the workers start
    summary = run_local(cfg, progress=live_view(args), resume=args.resume)
    _print_summary("echo2 run", summary)
    if cfg.task.name == "poker" and summary.last_checkpoint:
        _poker_report(cfg, summary)
    return 0


def _poker_report(cfg: Any, summary: Any) -> None:
    """After a poker run: Table 4 of its last checkpoint against the rule-based players and the
    checkpoint it started from, printed and kept in the run directory (matchups.json / .png)."""
    import json
    from pathlib import Path

    from echo2.rollout.matchups import evaluate_checkpoint, format_table, plot_table
    from echo2.tasks.warm_cache import starting_checkpoint

    run_dir = Path(summary.run_dir)
    rows = evaluate_checkpoint(cfg, summary.last_checkpoint, {"start": starting_checkpoint(cfg)})
    print(
        "\nchip change per hand of the last checkpoint (duplicate deals, from every seat):\n"
        + format_table(rows)
    )
    out = {"checkpoint": str(summary.last_checkpoint), "matchups": [m.to_dict() for m in rows]}
    (run_dir / "matchups.json").write_text(json.dumps(out, indent=2))
    plot_table(rows, run_dir / "matchups.png")


def _learner(args: argparse.Namespace) -> int:
    args.overrides.append("runtime.workers=0")
    if (followed := _ranks_or_none(args)) is not None:
        return followed
    cfg = load_from_args(args)
    from echo2.observe.view import ProgressView
    from echo2.runtime.learner import AsyncLearner, Endpoints

    def ready(ep: Endpoints) -> None:
        token = "<runtime.join_token>" if cfg.runtime.join_token else f"$(cat {ep.run_dir}/join_token)"
        print("learner ready. On each rollout machine run:", flush=True)
        print(f"  {JOIN_TOKEN_ENV}={token} echo2 worker --join '{ep.join}'", flush=True)
        if ep.dashboard:
            print(f"live dashboard (and Prometheus /metrics): {ep.dashboard}", flush=True)

    async def main(learner: AsyncLearner) -> Any:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, learner.stop.set)
        loop.add_signal_handler(signal.SIGTERM, learner.stop.set)
        return await learner.run()

    with ProgressView(cfg.train, "echo2 learner", live_view(args)) as view:
        summary = asyncio.run(
            main(AsyncLearner(cfg, resume=args.resume, on_ready=ready, on_step=view.update))
        )
    _print_summary("echo2 learner", summary)
    return 0


def _worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--join",
        required=True,
        metavar="URL",
        help="the learner's join string as `echo2 learner` printed it: https://HOST:PORT#sha256=FINGERPRINT "
        "(the worker talks only to the certificate with that fingerprint), or http://HOST:PORT on a "
        "trusted network (security.tls = false)",
    )
    p.add_argument("--token", help=f"the run's join token (default: ${JOIN_TOKEN_ENV})")
    p.add_argument("--name", help="name shown in the learner's registry (default: host name)")
    p.add_argument("--usd-per-hour", type=float, default=0.35, help="this machine's price ($/h)")
    p.add_argument("--hardware", default="", help="free-text hardware description")
    p.add_argument("--rollouts-per-s", type=float, help="own throughput estimate (the controller's prior)")
    p.add_argument("--max-rollouts-per-s", type=float, help="throttle to emulate slower hardware")
    p.add_argument(
        "--uplink-mbps",
        type=float,
        help="this machine's upload link in Mbit/s: declared, the relay trees put the fast workers near "
        "the root (default: not declared; the trees then take every link as equal)",
    )
    p.add_argument(
        "--trust-run-code",
        action="store_true",
        help="play an environment the run names by 'module:name' or a file (the learner then chooses code "
        "that runs here); without it such a run is refused, and only installed env packages are played",
    )
    p.add_argument("--advertise-host", help="address peers reach this worker's chunk server at")
    p.add_argument(
        "--relay-port", type=int, default=0, help="port of this worker's chunk server (default: any free one)"
    )
    p.add_argument(
        "--advertise-port",
        type=int,
        help="port peers dial, when a router forwards it to --relay-port (NAT); default: --relay-port",
    )
    p.add_argument(
        "--lora-base",
        help="a LoRA run's base checkpoint on this machine: read it instead of receiving the base with "
        "the first link of the weights chain (checked against the run's digest)",
    )
    p.add_argument("--engine", default="hf", help="rollout engine: hf (default) or vllm (docs/engines.md)")
    # --engine-<name> for each of rollout/engines/base.ENGINE_SETTINGS, unset: EngineOptions' default
    p.add_argument(  # literals: the parser imports nothing heavy (config.FloatDtype, EngineOptions)
        "--engine-dtype",
        choices=["float32", "bfloat16", "float16"],
        help="compute dtype of the engine (default float32; bfloat16 needs the run's "
        "security.engine_precision = bfloat16)",
    )
    p.add_argument(
        "--engine-memory",
        type=float,
        help="share of GPU memory (host memory on CPU) the vLLM engine may claim (default 0.3)",
    )
    p.add_argument(
        "--engine-device",
        help="where the HF engine computes: auto (CUDA when present, default), cpu, cuda or cuda:N",
    )
    p.add_argument(
        "--engine-batch-tokens",
        type=int,
        help="HF engine: rows x (prompt + new tokens) per forward batch (default: one batch per lease)",
    )


def engine_options(args: argparse.Namespace) -> Any:
    """The ``EngineOptions`` of ``echo2 worker``'s ``--engine-<name>`` flags, one per
    ``rollout/engines/base.ENGINE_SETTINGS`` (unset: EngineOptions' default), checked."""
    from echo2.config import DEVICE_PATTERN
    from echo2.rollout.engines.base import ENGINE_SETTINGS, EngineOptions

    given = {n: getattr(args, f"engine_{n}") for n in ENGINE_SETTINGS}
    engine = EngineOptions(**{n: v for n, v in given.items() if v is not None})
    if not 0.0 < engine.memory <= 1.0:
        raise ConfigError(f"--engine-memory {engine.memory}: must be in (0, 1]")
    if not re.match(DEVICE_PATTERN, engine.device):
        raise ConfigError(f"--engine-device {engine.device!r}: choose auto, cpu, cuda or cuda:N")
    if engine.batch_tokens is not None and engine.batch_tokens < 16:
        raise ConfigError(f"--engine-batch-tokens {engine.batch_tokens}: must be >= 16")
    return engine


def _registration_flags(args: argparse.Namespace) -> None:
    """``--usd-per-hour``, ``--hardware``, ``--rollouts-per-s`` and ``--uplink-mbps`` checked by the model
    the learner checks a registration with (``protocol.RegisterRequest``), before anything starts: one
    line naming the flag, not a traceback at registration."""
    from pydantic import ValidationError

    from echo2.protocol import RegisterRequest

    try:
        RegisterRequest(
            usd_per_hour=args.usd_per_hour, hardware=args.hardware, rollouts_per_s=args.rollouts_per_s,
            uplink_mbps=args.uplink_mbps,
        )  # fmt: skip
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        flag = "--" + str(err["loc"][0]).replace("_", "-")
        raise ConfigError(f"{flag} {err['input']!r}: {err['msg']}") from None


def _worker(args: argparse.Namespace) -> int:
    from typing import get_args

    from echo2.config import EngineName
    from echo2.rollout.engines import require_engine
    from echo2.rollout.worker import RolloutWorker, WorkerOptions
    from echo2.tasks.registry import build_task

    parse_join(args.join)  # a bad join string (https without its fingerprint) is refused before anything
    token = args.token or os.environ.get(JOIN_TOKEN_ENV)
    if not token:
        raise ConfigError(f"echo2 worker needs the run's join token: --token or ${JOIN_TOKEN_ENV}")
    if args.engine not in get_args(EngineName):
        raise ConfigError(f"--engine {args.engine!r}: choose one of {list(get_args(EngineName))}")
    engine = engine_options(args)
    _registration_flags(args)
    if args.lora_base is not None and not Path(args.lora_base).expanduser().is_dir():
        raise ConfigError(f"--lora-base {args.lora_base}: no such checkpoint directory")
    if not 0 <= args.relay_port <= 65535:
        raise ConfigError(f"--relay-port {args.relay_port}: not a TCP port (1-65535, or 0: any free one)")
    if args.advertise_port is not None and not 1 <= args.advertise_port <= 65535:
        raise ConfigError(f"--advertise-port {args.advertise_port}: not a TCP port (1-65535)")
    require_engine(args.engine)  # a missing or broken engine package fails here, before registering
    if engine.dtype != "float32":
        print(
            f"echo2 worker: warning: --engine-dtype {engine.dtype}: the learner's generation check "
            f"must expect it (security.engine_precision = {engine.dtype!r} in the run's config: it "
            "then computes in it); measured passing for the HF engine, not for a bf16 vLLM engine "
            "(docs/security.md, 'bf16 engines')",
            file=sys.stderr,
        )
    opts = WorkerOptions(
        join_url=args.join,
        token=token,
        usd_per_hour=args.usd_per_hour,
        hardware=args.hardware,
        rollouts_per_s=args.rollouts_per_s,
        max_rollouts_per_s=args.max_rollouts_per_s,
        uplink_mbps=args.uplink_mbps,
        advertise_host=args.advertise_host,
        relay_port=args.relay_port,
        advertise_port=args.advertise_port,
        engine=args.engine,
        engine_options=engine,
        lora_base=Path(args.lora_base).expanduser() if args.lora_base else None,
        trust_run_code=args.trust_run_code,
        **({"name": args.name} if args.name else {}),
    )
    worker = RolloutWorker(opts, build_task)

    raise_descriptor_limit()  # its chunk relay serves peers: as many descriptors as the system allows

    async def main() -> Any:
        task = asyncio.ensure_future(worker.run())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            return await task
        except asyncio.CancelledError:
            return worker.counters

    print(json.dumps(vars(asyncio.run(main()))))
    return 0


RUN = Command(
    help="asynchronous training: a learner and runtime.workers local rollout workers (S = 3 by default)",
    add_arguments=_run_arguments,
    run=_run,
)
LEARNER = Command(
    help="the learner node alone: API + broadcast + GRPO loop; workers join with `echo2 worker`",
    add_arguments=_run_arguments,
    run=_learner,
)
WORKER = Command(
    help="a rollout worker: joins a learner by URL and token, generates, submits, relays snapshots",
    add_arguments=_worker_arguments,
    run=_worker,
)
