"""`echo2 train`, `echo2 warmstart`, `echo2 eval`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo2.cli.common import Command, add_budget_arguments, add_config_arguments, load_from_args
from echo2.cli.run import held_out, live_view
from echo2.errors import ConfigError
from echo2.types import Bounds

if TYPE_CHECKING:
    from echo2.config import Config


def _train_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    add_budget_arguments(p)


def _train(args: argparse.Namespace) -> int:
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by torchrun: this command is one process
        raise ConfigError("echo2 train runs in one process; a sharded learner: echo2 run --nproc-per-node")
    cfg = load_from_args(args)
    from echo2.observe.view import ProgressView
    from echo2.runtime.local import train

    with ProgressView(cfg.train, "echo2 train", live_view(args)) as view:  # closed before the summary
        s = train(cfg, on_step=view.update)
    print(
        f"\necho2 train: {s.steps} steps in {s.wall_s:.0f} s; {held_out(s)}; "
        f"bubble ratio {s.bubble_ratio:.1%}\n"
        f"run directory: {s.run_dir}  (metrics.jsonl, config.json, summary.json)\n"
        f"last checkpoint: {s.last_checkpoint}"
    )
    return 0


def _warmstart(args: argparse.Namespace) -> int:
    cfg = load_from_args(args)
    from echo2.models.policy import configure_torch
    from echo2.tasks.warm_cache import warmstart_checkpoint

    configure_torch(cfg)
    path = warmstart_checkpoint(cfg)
    print(path)
    print((path / "warmstart.json").read_text())
    return 0


def _eval_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--size", type=int, default=None, help="held-out prompts (default train.eval_size)")
    p.add_argument(
        "--against",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="poker: also play a checkpoint (e.g. the warm start) as an opponent (repeatable)",
    )
    p.add_argument("--deals", type=int, help="poker: held-out deals per opponent (default task.eval_deals)")
    p.add_argument("--json", help="also write the result to this JSON file")


def _eval(args: argparse.Namespace) -> int:
    cfg = load_from_args(args)
    from echo2.models.policy import chat_format, configure_torch, load_checkpoint, resolve_device
    from echo2.rollout.engines.hf import HFEngine
    from echo2.tasks.registry import build_task
    from echo2.tasks.warm_cache import starting_checkpoint

    configure_torch(cfg)
    policy = load_checkpoint(starting_checkpoint(cfg), chat_format(cfg))
    policy.model.to(resolve_device(cfg.learner.device))
    task = build_task(cfg.task, cfg.seed)
    engine = HFEngine.on_policy(policy, cfg.sampling, cfg.learner.micro_batch_tokens)
    if cfg.task.name == "poker":  # poker's own report: Table 4 against its opponents
        out: dict[str, object] = {
            "checkpoint": policy.source,
            "matchups": _poker_table(cfg, args, policy, engine),
        }
    else:
        res = task.evaluate(
            policy.codec, engine, task.eval_prompts(args.size or cfg.train.eval_size), Bounds.of(cfg)
        )
        out = {"checkpoint": policy.source, "accuracy": res.accuracy, "unparsed": res.unparsed, "n": res.n}
        print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


def _poker_table(cfg: Config, args: argparse.Namespace, policy: Any, engine: Any) -> list[dict[str, Any]]:
    """Table 4 for ``policy`` (printed), against the rule-based styles and each ``--against`` checkpoint."""
    from echo2.rollout.matchups import evaluate_checkpoint, format_table

    against = {}
    for spec in args.against:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--against {spec!r} must look like NAME=DIR")
        against[name] = path
    rows = evaluate_checkpoint(cfg, policy.source, against, args.deals)
    print(format_table(rows))
    return [m.to_dict() for m in rows]


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
    help="held-out greedy accuracy of the configured checkpoint (poker: chip change per opponent, Table 4)",
    add_arguments=_eval_arguments,
    run=_eval,
)
