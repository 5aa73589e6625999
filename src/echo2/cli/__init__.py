"""The `echo2` command line: the one entry-point package, thin commands, heavy imports deferred.

Every subcommand is a :class:`~echo2.cli.common.Command`: a module-level object with a help line, a
function that adds its arguments, and a function that runs it (``run.py``: run / learner / worker;
``train.py``: train / warmstart / eval; ``plan.py``; ``simulate.py``; ``report.py``; ``export.py``).
Modules here import nothing heavier than the standard library at module level, so `echo2 --help`
stays instant, and nothing in the product imports this package back (checked by the import
contracts in pyproject.toml).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from echo2.cli.common import Command
from echo2.errors import Echo2Error


def _commands() -> dict[str, Command]:
    from echo2.cli import export, launch, plan, report, run, simulate, train

    return {
        "run": run.RUN,
        "learner": run.LEARNER,
        "worker": run.WORKER,
        "train": train.TRAIN,
        "warmstart": train.WARMSTART,
        "eval": train.EVAL,
        "plan": plan.PLAN,
        "simulate": simulate.SIMULATE,
        "report": report.REPORT,
        "export": export.EXPORT,
        "launch": launch.LAUNCH,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="echo2",
        description="echo2: RL post-training with one GRPO learner and cheap remote rollout workers.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in _commands().items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(p)
        p.set_defaults(_run=command.run)
    return parser


def log_level(args: argparse.Namespace) -> int:
    """``-v``: DEBUG; else ``--quiet`` (training commands): WARNING; else INFO."""
    if args.verbose:
        return logging.DEBUG
    return logging.WARNING if getattr(args, "quiet", False) else logging.INFO


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=log_level(args),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )

    try:
        return int(args._run(args))
    except Echo2Error as exc:  # user-facing errors: one clear line, no traceback
        print(f"echo2 {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"echo2 {args.command}: interrupted", file=sys.stderr)
        return 130
