"""The `echo2` command line: thin entry points, heavy imports deferred into each command's `run`.

Every subcommand is a :class:`Command`: a module-level object with a help line, a function that adds
its arguments, and a function that runs it. Modules that define commands import nothing heavier than
the standard library at module level, so `echo2 --help` stays instant.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """One `echo2 <name>` subcommand."""

    help: str  # one line shown by `echo2 --help`
    add_arguments: Callable[[argparse.ArgumentParser], None]  # declares the subcommand's flags
    run: Callable[[argparse.Namespace], int]  # runs it; returns the process exit code


def _commands() -> dict[str, Command]:
    from echo2.broadcast import cli as broadcast_cli
    from echo2.learner import cli as learner_cli
    from echo2.planner import cli as planner_cli
    from echo2.runtime import cli as runtime_cli
    from echo2.sim import cli as sim_cli

    return {
        "run": runtime_cli.RUN,
        "learner": runtime_cli.LEARNER,
        "worker": runtime_cli.WORKER,
        "train": learner_cli.TRAIN,
        "warmstart": learner_cli.WARMSTART,
        "eval": learner_cli.EVAL,
        "plan": planner_cli.PLAN,
        "simulate": sim_cli.SIMULATE,
        "bench-broadcast": broadcast_cli.BENCH_BROADCAST,
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    from echo2.errors import Echo2Error

    try:
        return int(args._run(args))
    except Echo2Error as exc:  # user-facing errors: one clear line, no traceback
        print(f"echo2 {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"echo2 {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
