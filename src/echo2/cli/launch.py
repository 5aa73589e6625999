"""`echo2 launch ray`: the learner and N rollout workers placed on an existing Ray cluster (the optional
`[ray]` extra; ``runtime/ray_launch.py``). Module imports stay stdlib-only."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from echo2.cli.common import Command, add_budget_arguments, add_config_arguments, load_from_args
from echo2.errors import ConfigError

# the launcher's own flags (with a value each); everything else on the command line is the learner's
# (and --run-dir: the launcher gives the learner the run directory as an absolute path)
_LAUNCH_FLAGS = ("--address", "--workers", "--worker-cpus", "--worker-gpus", "--learner-cpus",
                 "--learner-gpus", "--learner-ranks", "--max-restarts", "--hardware",
                 "--run-dir")  # fmt: skip


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("where", choices=["ray"], help="the cluster manager (ray: an existing Ray cluster)")
    add_config_arguments(p)
    add_budget_arguments(p)
    g = p.add_argument_group("placement on the Ray cluster")
    g.add_argument("--address", default="auto", help="the Ray cluster (default auto: this machine's)")
    g.add_argument("--workers", type=int, default=2, help="rollout workers to place (default 2)")
    g.add_argument("--worker-cpus", type=float, default=1.0, help="CPUs per worker (default 1)")
    g.add_argument("--worker-gpus", type=float, default=0.0, help="GPUs per worker (default 0)")
    g.add_argument("--learner-cpus", type=float, default=1.0, help="CPUs per learner rank (default 1)")
    g.add_argument("--learner-gpus", type=float, default=0.0, help="GPUs per learner rank (default 0)")
    g.add_argument("--learner-ranks", type=int, default=1, help="a learner sharded over K ranks on one node")
    g.add_argument("--max-restarts", type=int, default=3, help="restarts of a worker that dies (default 3)")
    g.add_argument("--hardware", default="ray", help="the workers' hardware label (default ray)")
    p.add_argument("--resume", action="store_true", help="continue from the run directory's last checkpoint")


def learner_arguments(argv: list[str]) -> list[str]:
    """The command line minus the launcher's own flags (and ``launch ray``, ``--resume``): what the
    learner's ``echo2 learner`` gets."""
    out, skip = [], False
    own = ("launch", "ray")
    for i, tok in enumerate(argv):
        dropped = tok.split("=", 1)[0] in _LAUNCH_FLAGS or tok == "--resume" or (i < 2 and tok in own)
        if skip:
            skip = False
        elif tok in _LAUNCH_FLAGS:
            skip = True
        elif not dropped:
            out.append(tok)
    return out


def _run(args: argparse.Namespace) -> int:
    from echo2.observe.view import ProgressView
    from echo2.runtime.ray_launch import RayLaunch, RayOptions, require_ray

    require_ray()  # a missing extra fails here, in one line
    if args.workers < 0 or args.max_restarts < 0 or args.learner_ranks < 1:
        raise ConfigError(
            f"--workers {args.workers} --max-restarts {args.max_restarts} --learner-ranks "
            f"{args.learner_ranks}: workers and restarts must be >= 0, ranks >= 1"
        )
    cfg = load_from_args(args)
    opts = RayOptions(
        address=args.address,
        workers=args.workers,
        worker_cpus=args.worker_cpus,
        worker_gpus=args.worker_gpus,
        learner_cpus=args.learner_cpus,
        learner_gpus=args.learner_gpus,
        learner_ranks=args.learner_ranks,
        max_restarts=args.max_restarts,
        hardware=args.hardware,
        resume=args.resume,
        learner_args=learner_arguments(sys.argv[1:]),
    )
    with ProgressView(cfg.train, "echo2 launch ray", not (args.no_progress or args.quiet)) as view:
        summary: dict[str, Any] = RayLaunch(cfg, opts).run(on_record=view.update)

    def score(key: str) -> str:  # null: never read (a stop during the first evaluation)
        v = summary.get(key)
        return "n/a" if v is None else f"{v:.3f}"

    print(
        f"\necho2 launch ray: {summary.get('steps')} learner steps (version {summary.get('version')}); "
        f"held-out {score('initial_accuracy')} -> {score('final_accuracy')}; "
        f"max staleness {summary.get('staleness_max')}\nrun directory: {summary.get('run_dir')}"
    )
    return 0


LAUNCH = Command(
    help="place the learner and rollout workers on an existing Ray cluster (the [ray] extra)",
    add_arguments=_add_arguments,
    run=_run,
)
