"""`echo2 plan`: capacity plan from a TOML scenario and/or flags (module imports stay stdlib-only)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from echo2.cli.common import Command
from echo2.errors import ConfigError, InfeasibleError
from echo2.physics.rules import DEFAULT_GAMMA  # stdlib-only module: keeps `echo2 --help` light

if TYPE_CHECKING:
    from echo2.planner.scenario import PlanScenario


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
    p.add_argument(
        "--model-size", choices=("0.6B", "1.7B", "4B", "8B"), help="Qwen3 shape: report the learner's memory"
    )
    p.add_argument("--gpu-gib", type=float, help="memory of one learner GPU, GiB (does the learner fit?)")
    p.add_argument("--gpus", type=int, help="GPUs of the learner (its ranks when sharded)")
    p.add_argument("--t-train-gpus", type=int, help="GPUs --t-train was measured on, when not --gpus")
    p.add_argument(
        "--scaling-efficiency",
        type=float,
        help="stated scaling from --t-train-gpus to --gpus: r times the GPUs change the update rate by r x e",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        help="plan a LoRA run (publications: the adapter of this rank, from --model-size) and show the "
        "whole-weights pool beside it",
    )
    p.add_argument(
        "--lora-patch-ratio",
        type=float,
        help="bytes of an adapter patch / the adapter (benchmarks/lora.py); default: whole adapters",
    )
    p.add_argument(
        "--useful-share",
        type=float,
        help="share of generated rollouts a batch can use (1 - the zero-variance share when such groups "
        "are left out; a run reports it as pool/useful_share): the pool is sized for R / it",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")


# flag -> scenario field: each flag that is set becomes one override on top of the file, as
# `--set a.b=value` does for a run (workers.0: the one homogeneous pool)
_FIELDS = (
    ("t_train", "learner.t_train_s"),
    ("learner_price", "learner.usd_per_hour"),
    ("t_bcast", "network.t_bcast_s"),
    ("b0_mbps", "network.b0_mbps"),
    ("strategy", "network.strategy"),
    ("staleness", "staleness.S"),
    ("kappa", "staleness.kappa"),
    ("gamma", "staleness.gamma"),
    ("snapshot_gb", "model.snapshot_gb"),
    ("group_size", "batch.group_size"),
    ("activation", "activation"),
    ("useful_share", "useful_share"),
    ("model_size", "model.shape"),
    ("lora_rank", "model.lora.rank"),
    ("lora_patch_ratio", "model.lora.patch_ratio"),
    ("gpu_gib", "learner.gpu_gib"),
    ("gpus", "learner.gpus"),
    ("t_train_gpus", "learner.t_train_gpus"),
    ("scaling_efficiency", "learner.scaling_efficiency"),
    ("worker_rate", "workers.0.rollouts_per_s"),
    ("worker_price", "workers.0.usd_per_hour"),
    ("bw_mbps", "workers.0.bandwidth_mbps"),
)


def _flags_only(args: argparse.Namespace) -> dict[str, Any]:
    """Without a config file: one worker type, ``worker``, that the flags describe."""
    missing = [f for f, v in (("--t-train", args.t_train), ("--worker-rate", args.worker_rate)) if v is None]
    if missing:
        raise ConfigError(f"without a config file, give {' and '.join(missing)}")
    if args.t_bcast is None and args.snapshot_gb is None:
        raise ConfigError("without a config file, give --t-bcast (seconds) or --snapshot-gb (for the model)")
    return {"workers": [{"name": "worker"}]}


def _scenario(args: argparse.Namespace) -> PlanScenario:
    """The config file (or a flags-only pool) <- the flags as overrides, through the one loader."""
    from echo2.config import BatchConfig, load_settings
    from echo2.planner.scenario import PlanScenario, find_config, read_scenario

    path = find_config(args.config, "plan") if args.config else None
    tree = read_scenario(path) if path is not None else _flags_only(args)
    workers = tree.get("workers", [])
    if args.worker_type is not None:  # a selection, not a value: it narrows the catalog first
        names = [w.get("name") for w in workers if isinstance(w, dict)]
        tree["workers"] = workers = [
            w for w in workers if isinstance(w, dict) and w.get("name") == args.worker_type
        ]
        if not workers:
            raise ConfigError(
                f"unknown worker type {args.worker_type!r} (--worker-type); the catalog has {names}"
            )
    overrides = {key: getattr(args, flag) for flag, key in _FIELDS if getattr(args, flag) is not None}
    if any(key.startswith("workers.0.") for key in overrides) and len(workers) != 1:
        raise ConfigError(
            f"--worker-rate/--worker-price/--bw-mbps set one homogeneous pool but the catalog has "
            f"{len(workers)} types; pick one with --worker-type"
        )
    unpriced = [i for i, w in enumerate(workers) if isinstance(w, dict) and "usd_per_hour" not in w]
    if unpriced and args.worker_price is None:  # placeholder prices; costs print as n/a
        overrides |= {f"workers.{i}.usd_per_hour": 1.0 for i in unpriced} | {"priced": False}
    if args.rollouts_per_step is not None:  # R -> batch.prompts = R / batch.group_size
        r, batch = args.rollouts_per_step, tree.get("batch")
        g = overrides.get("batch.group_size", batch.get("group_size") if isinstance(batch, dict) else None)
        g = BatchConfig.model_fields["group_size"].default if g is None else g
        if not (isinstance(g, int) and g >= 1 and r >= 1 and r % g == 0):
            raise ConfigError(
                f"--rollouts-per-step {r} must be a positive multiple of the group size "
                f"(batch.group_size = {g}); set --group-size to one that divides it"
            )
        overrides["batch.prompts"] = r // g
    return load_settings(
        PlanScenario, path, overrides, what="scenario" if path else "scenario from flags", tree=tree
    )


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
        f"mu_min = {plan['mu_min']:.4f} rollouts/s   mu_target = {plan['mu_target']:.4f} rollouts/s"
        + (f"   (for R / useful share {plan['useful_share']:g})" if plan["useful_share"] < 1 else ""),
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
    whole = plan.get("whole_weights")
    if whole is not None:
        lines.append(
            f"LoRA rank {plan['lora_rank']}: publications of {plan['publication_gb']:.4g} GB (adapter "
            f"{plan['adapter_gb']:.4g} GB) instead of {_fmt(plan['snapshot_gb'], '.4g')} GB"
        )
        if whole.get("feasible"):
            wactive = ", ".join(f"{n} x {k}" for k, n in whole["active_set"].items())
            lines.append(
                f"  whole weights instead: T_bcast {whole['t_bcast_s']:.1f} s, {wactive} = "
                f"{whole['active_workers']} workers, step {whole['step_s']:.1f} s, "
                f"cost/step ${_fmt(whole['usd_per_step'], '.3f')}"
            )
            wmem = whole.get("learner_memory")
            if wmem:
                lines.append(_memory_line("  whole weights' learner memory (one GPU)", wmem["one_gpu"]))
        else:
            lines.append(f"  whole weights instead: no feasible plan ({whole['reason']})")
    mem = plan.get("learner_memory")
    if mem:
        lora = f", LoRA r = {mem['lora_rank']}" if mem.get("lora_rank") else ""
        lines.append(_memory_line(f"learner memory (Qwen3-{mem['shape']}{lora}, one GPU)", mem["one_gpu"]))
        if "sharded" in mem:
            lines.append(f"  {mem['sharded']}")
        if "per_gpu_sharded" in mem:
            lines.append(
                _memory_line(f"  largest rank, sharded over {mem['ranks']} GPUs", mem["per_gpu_sharded"])
            )
    return "\n".join(lines)


def _memory_line(label: str, m: dict[str, Any]) -> str:
    verdict = "" if m["fits"] is None else (" -> fits" if m["fits"] else " -> does NOT fit")
    return (
        f"{label}: {m['bytes_per_param']:g} B/param on the device = {m['params_gib']:.1f} GiB + activations "
        f"{m['activations_gib']:.1f} GiB = {m['need_gib']:.1f} GiB "
        f"(GPU {_fmt(m['device_gib'] or None, 'g')} GiB){verdict}"
    )


def _run(args: argparse.Namespace) -> int:
    from echo2.planner.plan import infeasible_plan, make_plan

    sc = _scenario(args)
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
