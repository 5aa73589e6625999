"""`echo2 plan`: capacity plan from a TOML scenario and/or flags (module imports stay stdlib-only)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from echo2.cli.common import Command
from echo2.physics.rules import DEFAULT_GAMMA  # stdlib-only module: keeps `echo2 --help` light


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "config",
        nargs="?",
        help="scenario TOML, or a short name such as paper_qwen3_8b (configs/plan_<name>.toml)",
    )
    p.add_argument("--t-train", type=float, help="seconds per learner update (T_train)")
    p.add_argument("--t-bcast", type=float, help="measured T_bcast in seconds (skips the broadcast model)")
    p.add_argument(
        "--rollouts-per-step",
        type=int,
        help="rollouts per update R = prompts x group size (prompts = R / batch.group_size)",
    )
    p.add_argument("--group-size", type=int, help="rollouts per prompt (batch.group_size, >= 2)")
    p.add_argument("--staleness", type=int, help="staleness budget S (kappa defaults to max(1, S-1))")
    p.add_argument("--kappa", type=int, help="publication period kappa (overrides the S-1 default)")
    p.add_argument(
        "--gamma", type=float, help=f"scheduler slack: mu_target = gamma * mu_min (default {DEFAULT_GAMMA:g})"
    )
    p.add_argument("--worker-rate", type=float, help="rollouts/s of one worker, for a homogeneous pool")
    p.add_argument("--worker-price", type=float, help="$/h of one worker, for a homogeneous pool")
    p.add_argument("--worker-type", help="plan with this catalog type only (homogeneous pool)")
    p.add_argument("--learner-price", type=float, help="$/h of the learner node")
    p.add_argument("--snapshot-gb", type=float, help="snapshot size G in GB (for the T_bcast model)")
    p.add_argument("--b0-mbps", type=float, help="learner uplink B0 in Mbit/s")
    p.add_argument("--bw-mbps", type=float, help="worker link B_w in Mbit/s")
    p.add_argument(
        "--strategy",
        help="broadcast strategy whose T_bcast estimate feeds mu_min (network.strategy, e.g. tree-pipelined; "
        "an unknown name lists the choices)",
    )
    p.add_argument("--activation", choices=("greedy", "greedy_prefix", "exact", "random"))
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")


def _scenario_dict(args: argparse.Namespace) -> dict[str, Any]:
    from echo2.errors import ConfigError
    from echo2.planner.catalog import find_config, read_toml

    if args.config:
        data = read_toml(find_config(args.config, "plan"))
        where = str(find_config(args.config, "plan"))
    else:
        missing = [
            f for f, v in (("--t-train", args.t_train), ("--worker-rate", args.worker_rate)) if v is None
        ]
        if missing:
            raise ConfigError(f"without a config file, give {' and '.join(missing)}")
        if args.t_bcast is None and args.snapshot_gb is None:
            raise ConfigError(
                "without a config file, give --t-bcast (seconds) or --snapshot-gb (for the model)"
            )
        data = {
            "learner": {"t_train_s": args.t_train},
            "workers": [{"name": "worker", "rollouts_per_s": 1.0}],
        }
        where = "flags"
    sim_only = ("sim", "controller", "churn", "experiment")  # a simulate config plans too
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items() if k not in sim_only}
    for section in ("learner", "batch", "staleness", "network", "model"):
        data.setdefault(section, {})
    workers = [dict(w) for w in data.get("workers", [])]
    if args.worker_type is not None:
        keep = [w for w in workers if w.get("name") == args.worker_type]
        if not keep:
            names = [w.get("name") for w in workers]
            raise ConfigError(
                f"unknown worker type {args.worker_type!r} (--worker-type); the catalog has {names}"
            )
        workers = keep
    if args.worker_rate is not None or args.worker_price is not None or args.bw_mbps is not None:
        if len(workers) != 1:
            raise ConfigError(
                f"--worker-rate/--worker-price/--bw-mbps set one homogeneous pool but the catalog has "
                f"{len(workers)} types; pick one with --worker-type"
            )
        if args.worker_rate is not None:
            workers[0]["rollouts_per_s"] = args.worker_rate
        if args.worker_price is not None:
            workers[0]["usd_per_hour"] = args.worker_price
        if args.bw_mbps is not None:
            workers[0]["bandwidth_mbps"] = args.bw_mbps
    if any("usd_per_hour" not in w for w in workers):
        for w in workers:
            w.setdefault("usd_per_hour", 1.0)
        data["priced"] = False
    data["workers"] = workers
    overrides = {
        ("learner", "t_train_s"): args.t_train,
        ("learner", "usd_per_hour"): args.learner_price,
        ("network", "t_bcast_s"): args.t_bcast,
        ("network", "b0_mbps"): args.b0_mbps,
        ("network", "strategy"): args.strategy,
        ("staleness", "S"): args.staleness,
        ("staleness", "kappa"): args.kappa,
        ("staleness", "gamma"): args.gamma,
        ("model", "snapshot_gb"): args.snapshot_gb,
    }
    for (section, key), value in overrides.items():
        if value is not None:
            data[section][key] = value
    if args.group_size is not None:
        data["batch"]["group_size"] = args.group_size
    if args.rollouts_per_step is not None:
        from echo2.config import BatchConfig

        g = data["batch"].get("group_size", BatchConfig.model_fields["group_size"].default)
        r = args.rollouts_per_step
        if not (isinstance(g, int) and g >= 1 and r >= 1 and r % g == 0):
            raise ConfigError(
                f"--rollouts-per-step {r} must be a positive multiple of the group size "
                f"(batch.group_size = {g}); set --group-size to one that divides it"
            )
        data["batch"]["prompts"] = r // g
    if args.activation is not None:
        data["activation"] = args.activation
    if not data["model"]:
        del data["model"]
    data["_where"] = where
    return data


def _fmt(x: float | None, spec: str = ".4g") -> str:
    return "n/a" if x is None else format(x, spec)


def _report(plan: dict[str, Any]) -> str:
    lines = [
        f"model {plan['model'] or '-'}   R = {plan['rollouts_per_step']} rollouts/step   "
        f"T_train = {plan['t_train_s']:g} s",
        f"staleness S = {plan['staleness']}   kappa = {plan['kappa']}   gamma = {plan['gamma']:g}",
    ]
    est = plan["t_bcast_estimates_s"]
    if est:
        lines.append(
            "T_bcast estimates (s, reload incl.): "
            + "   ".join(f"{k} {v:.0f}" for k, v in est.items())
            + f"   (for N = {plan['active_workers']})"
        )
    lines += [
        f"T_bcast used = {plan['t_bcast_s']:.1f} s from {plan['t_bcast_source']}",
        f"mu_min = {plan['mu_min']:.4f} rollouts/s   mu_target = {plan['mu_target']:.4f} rollouts/s",
    ]
    for name, t in plan["per_type"].items():
        lines.append(
            f"  {name}: {t['rollouts_per_s']:g} rollouts/s, ${t['usd_per_hour']:g}/h, rho {t['rho']:.3f}"
            f"  -> N_min = {t['n_min']}, N at target = {t['n_target']}"
        )
    active = ", ".join(f"{n} x {k}" for k, n in plan["active_set"].items())
    lines.append(
        f"active set ({plan['activation']}): {active}  = {plan['active_workers']} workers, "
        f"mu_pool {plan['mu_pool']:.4f} rollouts/s, ${_fmt(plan['workers_usd_per_hour'], '.3f')}/h"
    )
    lines.append(
        f"step time {plan['step_s']:.1f} s (expected bubble {plan['bubble_ratio_expected']:.1%})   "
        f"cost/step ${_fmt(plan['usd_per_step'], '.3f')}   total ${_fmt(plan['usd_per_hour'], '.3f')}/h"
    )
    lines.append(
        f"staleness bound: max Delta <= {plan['staleness_bound']} "
        f"(conservative {plan['staleness_bound_conservative']}, tight {plan['staleness_bound_tight']}, "
        f"budget S = {plan['staleness']})"
    )
    for name, b in plan["baselines"].items():
        lines.append(f"vs {name}: ${b['usd_per_step']:.3f}/step -> saving {b['saving']:.1%}")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    from echo2.errors import InfeasibleError
    from echo2.planner.catalog import parse_scenario
    from echo2.planner.plan import infeasible_plan, make_plan

    data = _scenario_dict(args)
    where = data.pop("_where")
    sc = parse_scenario(data, where)
    try:
        plan = make_plan(sc)
    except InfeasibleError as exc:
        if args.json:
            print(json.dumps(infeasible_plan(sc, exc)))
            sys.stdout.flush()
        raise
    print(json.dumps(plan, indent=None if args.json else 2) if args.json else _report(plan))
    return 0


PLAN = Command(
    help="capacity plan: kappa, T_bcast, mu_min, N_min, the active set, cost per step, staleness bound",
    add_arguments=_add_arguments,
    run=_run,
)
