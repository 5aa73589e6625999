"""`echo2 run`, `echo2 learner`, `echo2 worker`. Module level imports stay light (stdlib only)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal

from echo2.cli import Command
from echo2.learner.cli import add_config_arguments, load_from_args


def _run_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--workers", type=int, help="shorthand for --set runtime.workers=N")
    p.add_argument("--staleness", "-S", type=int, help="shorthand for --set async.staleness=S")
    p.add_argument("--steps", type=int, help="shorthand for --set train.steps=N")
    p.add_argument("--max-minutes", type=float, help="shorthand for --set train.max_minutes=M")
    p.add_argument("--resume", action="store_true", help="continue from the run directory's last checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no live view")


def _config(args: argparse.Namespace):  # -> Config
    for flag, key in (("workers", "runtime.workers"), ("staleness", "async.staleness"),
                      ("steps", "train.steps"), ("max_minutes", "train.max_minutes")):  # fmt: skip
        if getattr(args, flag, None) is not None:
            args.overrides.append(f"{key}={getattr(args, flag)}")
    return load_from_args(args)


def _print_summary(s) -> None:  # type: ignore[no-untyped-def]
    print(
        f"\n{s.steps} learner steps (version {s.version}) in {s.wall_s:.0f} s; held-out accuracy "
        f"{s.initial_accuracy:.1%} -> {s.final_accuracy:.1%} (best {s.best_accuracy:.1%})\n"
        f"bubble ratio {s.bubble_ratio:.1%}, max staleness {s.staleness_max}\n"
        f"run directory: {s.run_dir}  (metrics.jsonl, summary.json, run.png, workers/)\n"
        f"last checkpoint: {s.last_checkpoint}"
    )


def _run(args: argparse.Namespace) -> int:
    cfg = _config(args)
    from echo2.runtime.launcher import run_local

    s = run_local(cfg, progress=not args.no_progress, resume=args.resume)
    print("\necho2 run:", end="")
    _print_summary(s)
    return 0


def _learner(args: argparse.Namespace) -> int:
    args.overrides.append("runtime.workers=0")
    cfg = _config(args)
    from echo2.runtime.learner import AsyncLearner, Endpoints

    def ready(ep: Endpoints) -> None:
        token = "<runtime.join_token>" if cfg.runtime.join_token else f"$(cat {ep.run_dir}/join_token)"
        print("learner ready. On each rollout machine run:", flush=True)
        print(f"  ECHO2_JOIN_TOKEN={token} echo2 worker --join {ep.url}", flush=True)

    learner = AsyncLearner(cfg, resume=args.resume, on_ready=ready)

    async def main():  # type: ignore[no-untyped-def]
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, learner.stop.set)
        loop.add_signal_handler(signal.SIGTERM, learner.stop.set)
        return await learner.run()

    s = asyncio.run(main())
    print("\necho2 learner:", end="")
    _print_summary(s)
    return 0


def _worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--join", required=True, metavar="URL", help="the learner's API URL")
    p.add_argument("--token", help="the run's join token (default: $ECHO2_JOIN_TOKEN)")
    p.add_argument("--name", help="name shown in the learner's registry (default: host name)")
    p.add_argument("--usd-per-hour", type=float, default=0.35, help="this machine's price ($/h)")
    p.add_argument("--hardware", default="", help="free-text hardware description")
    p.add_argument("--rollouts-per-s", type=float, help="own throughput estimate (the controller's prior)")
    p.add_argument("--max-rollouts-per-s", type=float, help="throttle to emulate slower hardware")
    p.add_argument("--advertise-host", help="address peers reach this worker's chunk server at")


def _worker(args: argparse.Namespace) -> int:
    from echo2.errors import ConfigError
    from echo2.rollout.worker import RolloutWorker, WorkerOptions

    token = args.token or os.environ.get("ECHO2_JOIN_TOKEN")
    if not token:
        raise ConfigError("echo2 worker needs the run's join token: --token or $ECHO2_JOIN_TOKEN")
    opts = WorkerOptions(
        join_url=args.join, token=token, usd_per_hour=args.usd_per_hour, hardware=args.hardware,
        rollouts_per_s=args.rollouts_per_s, max_rollouts_per_s=args.max_rollouts_per_s,
        advertise_host=args.advertise_host, **({"name": args.name} if args.name else {}),
    )  # fmt: skip
    worker = RolloutWorker(opts)

    async def main():  # type: ignore[no-untyped-def]
        task = asyncio.ensure_future(worker.run())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            return await task
        except asyncio.CancelledError:
            return worker.counters

    counters = asyncio.run(main())
    print(json.dumps(vars(counters)))
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
