"""`echo2 train`, `echo2 warmstart`, `echo2 eval`. Module level imports stay light (stdlib only)."""

from __future__ import annotations

import argparse
import json

from echo2.cli import Command


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """The config flags every training-related command shares."""
    p.add_argument(
        "--config", "-c", help="TOML config file (defaults are the embedded tiny model on arithmetic)"
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config field, e.g. --set grpo.lr=3e-4 (repeatable)",
    )
    p.add_argument("--seed", type=int, help="shorthand for --set seed=N")
    p.add_argument("--run-dir", help="shorthand for --set train.run_dir=PATH")
    p.add_argument("--model", help="shorthand for --set model.path=DIR (a local HF checkpoint)")


def load_from_args(args: argparse.Namespace):  # -> Config
    from echo2.config import load_config

    overrides = list(args.overrides)
    if args.seed is not None:
        overrides.append(f"seed={args.seed}")
    if args.run_dir is not None:
        overrides.append(f"train.run_dir={json.dumps(args.run_dir)}")
    if args.model is not None:
        overrides.append(f"model.path={json.dumps(args.model)}")
    return load_config(args.config, overrides)


def _train_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--steps", type=int, help="shorthand for --set train.steps=N")
    p.add_argument("--max-minutes", type=float, help="shorthand for --set train.max_minutes=M")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _train(args: argparse.Namespace) -> int:
    if args.steps is not None:
        args.overrides.append(f"train.steps={args.steps}")
    if args.max_minutes is not None:
        args.overrides.append(f"train.max_minutes={args.max_minutes}")
    cfg = load_from_args(args)
    from echo2.runtime.sync import run_sync

    s = run_sync(cfg, progress=not args.no_progress)
    print(
        f"\necho2 train: {s.steps} steps in {s.wall_s:.0f} s; held-out accuracy "
        f"{s.initial_accuracy:.1%} -> {s.final_accuracy:.1%} (best {s.best_accuracy:.1%})\n"
        f"run directory: {s.run_dir}  (metrics.jsonl, config.json, summary.json)\n"
        f"last checkpoint: {s.last_checkpoint}"
    )
    return 0


def _warmstart(args: argparse.Namespace) -> int:
    cfg = load_from_args(args)
    from echo2.models.policy import configure_torch
    from echo2.models.warmstart import warmstart_checkpoint

    configure_torch(cfg)
    path = warmstart_checkpoint(cfg)
    print(path)
    print((path / "warmstart.json").read_text())
    return 0


def _eval_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--size", type=int, default=None, help="held-out prompts (default train.eval_size)")


def _eval(args: argparse.Namespace) -> int:
    cfg = load_from_args(args)
    from echo2.data.tasks.base import build_task
    from echo2.models.policy import configure_torch, load_policy
    from echo2.rollout.engines.hf import HFEngine
    from echo2.rollout.evaluate import evaluate

    configure_torch(cfg)
    policy = load_policy(cfg)
    task = build_task(cfg.task, cfg.seed)
    engine = HFEngine(policy.model, policy.eos_id, policy.pad_id, cfg.sampling)
    res = evaluate(policy, engine, task, task.eval_prompts(args.size or cfg.train.eval_size))
    print(
        json.dumps(
            {"checkpoint": policy.source, "accuracy": res.accuracy, "unparsed": res.unparsed, "n": res.n}
        )
    )
    return 0


TRAIN = Command(
    help="synchronous GRPO training (S = 0) in one process; writes a run directory",
    add_arguments=_train_arguments,
    run=_train,
)
WARMSTART = Command(
    help="build (or find in the cache) the embedded model's warm-started checkpoint and print its path",
    add_arguments=add_config_arguments,
    run=_warmstart,
)
EVAL = Command(
    help="held-out greedy accuracy of the configured checkpoint",
    add_arguments=_eval_arguments,
    run=_eval,
)
