"""What every `echo2` subcommand shares: the :class:`Command` record and the config flags.

Modules in this package import nothing heavier than the standard library at module level, so
`echo2 --help` stays instant; each command defers its imports into its ``run``. Nothing in the
product imports this package back.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from echo2.config import Config


@dataclass(frozen=True)
class Command:
    """One `echo2 <name>` subcommand."""

    help: str  # one line shown by `echo2 --help`
    add_arguments: Callable[[argparse.ArgumentParser], None]  # declares the subcommand's flags
    run: Callable[[argparse.Namespace], int]  # runs it; returns the process exit code


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
    p.add_argument(
        "--task",
        help="the embedded default of a task: arithmetic (default), math, code, verifiers, poker, guess, "
        "verifiers_env (--set wins over it)",
    )
    p.add_argument("--seed", type=int, help="shorthand for --set seed=N")
    p.add_argument("--run-dir", help="shorthand for --set train.run_dir=PATH")
    p.add_argument("--model", help="shorthand for --set model.path=DIR (a local HF checkpoint)")


def add_budget_arguments(p: argparse.ArgumentParser) -> None:
    """How long a training command runs."""
    p.add_argument("--steps", type=int, help="shorthand for --set train.steps=N")
    p.add_argument("--max-minutes", type=float, help="shorthand for --set train.max_minutes=M")
    p.add_argument(
        "--lora",
        action="store_true",
        help="train a LoRA adapter on the frozen model (shorthand for --set lora.enabled=true; [lora])",
    )
    p.add_argument(
        "--report-to",
        metavar="TRACKERS",
        help="also log metrics to tensorboard,wandb,trackio,mlflow (comma list; shorthand for "
        '--set train.report_to=["wandb"]; "" for none)',
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no live status area: a plain status line every 10 s instead (also when stdout is not a tty)",
    )
    p.add_argument(
        "--quiet",
        "-q",
        action="store_true",
        help="--no-progress plus log level WARNING: only the plain status lines and warnings (-v wins)",
    )


SHORTHANDS = (  # flag attribute -> config key
    ("seed", "seed"),
    ("steps", "train.steps"),
    ("max_minutes", "train.max_minutes"),
    ("workers", "runtime.workers"),
    ("staleness", "staleness.S"),
)
PATH_SHORTHANDS = (("run_dir", "train.run_dir"), ("model", "model.path"))


def load_from_args(args: argparse.Namespace) -> Config:
    """Defaults <- ``--config`` <- ``--set`` <- shorthand flags, validated once."""
    from echo2.config import load_config, task_preset

    overrides = (
        [*task_preset(args.task), *args.overrides] if getattr(args, "task", None) else list(args.overrides)
    )
    for flag, key in SHORTHANDS:
        if getattr(args, flag, None) is not None:
            overrides.append(f"{key}={getattr(args, flag)}")
    for flag, key in PATH_SHORTHANDS:
        if getattr(args, flag, None) is not None:
            overrides.append(f"{key}={json.dumps(getattr(args, flag))}")
    if getattr(args, "lora", False):
        overrides.append("lora.enabled=true")
    if getattr(args, "report_to", None) is not None:  # "tensorboard,wandb" -> a TOML list
        names = [n.strip() for n in args.report_to.split(",") if n.strip()]
        overrides.append(f"train.report_to={json.dumps(names)}")
    return load_config(args.config, overrides)
