"""`echo2 simulate`: run a scenario's experiment and write JSON + PNG (module imports stay stdlib-only)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from echo2.cli.common import Command
from echo2.errors import ConfigError

log = logging.getLogger(__name__)

_NAMES = {
    "bubble_sweep": "fig3c_bubble",
    "bcast_sweep": "fig4_bcast_sim",
    "ablation": "table2_ablation",
}


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "config", help="scenario TOML, or a short name such as fig3c_bubble (configs/sim_<name>.toml)"
    )
    p.add_argument(
        "--out", default="results", help="directory for JSON / PNG / metrics.jsonl (default results/)"
    )
    p.add_argument("--steps", type=int, help="override sim.steps")
    p.add_argument("--seed", type=int, help="override sim.seed")
    p.add_argument("--json", action="store_true", help="print the result JSON to stdout")


def _run(args: argparse.Namespace) -> int:
    from echo2.sim import experiments, plots
    from echo2.sim.config import load_sim_scenario

    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    flags = {"sim.steps": args.steps, "sim.seed": args.seed}  # flag -> override of the scenario
    sc, path = load_sim_scenario(args.config, {k: v for k, v in flags.items() if v is not None})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kind = sc.experiment.kind
    stem = _NAMES.get(kind, path.stem.removeprefix("sim_"))
    files: list[Path] = []
    if kind == "run":
        res, plan = experiments.run(sc)
        if res.metrics:  # none where the scenario says `record_metrics = false` (the scale cases)
            metrics_path = out / f"{stem}_metrics.jsonl"
            with metrics_path.open("w") as f:
                for m in res.metrics:
                    f.write(json.dumps(m) + "\n")
            files.append(metrics_path)
            files.append(
                plots.plot_metrics(res.metrics, out / f"{stem}_run.png", title=f"simulated: {path.name}")
            )
        result: dict[str, Any] = {"config": str(path), "summary": res.summary, "plan": plan}
    elif kind == "bubble_sweep":
        result = experiments.bubble_sweep(sc)
        files.append(plots.plot_bubble(result, out / f"{stem}.png"))
    elif kind == "bcast_sweep":
        result = experiments.bcast_sweep(sc)
        files.append(plots.plot_bcast(result, out / f"{stem}.png"))
    else:
        result = experiments.ablation(sc)
        files.append(plots.plot_ablation(result, out / f"{stem}.png"))
    json_path = out / f"{stem}.json"
    json_path.write_text(json.dumps(result, indent=2))
    files.append(json_path)
    if args.json:
        print(json.dumps(result))
    else:
        print(_summary_line(kind, result))
        for written in files:
            print(f"wrote {written}")
    return 0


def _summary_line(kind: str, r: dict[str, Any]) -> str:
    if kind == "run":
        s = r["summary"]
        return (
            f"{s['steps']} steps in {s['wall_s']:.2f} s wall ({s['events']} events): "
            f"bubble {s['bubble_ratio']:.2%}, "
            f"staleness max {s['staleness_max']} (bound {s['staleness_bound_conservative']}), "
            f"T_bcast {s['t_bcast_mean_s'] or 0:.0f} s, ${s['usd_total']:.2f} total"
        )
    if kind == "bubble_sweep":
        parts = [
            f"S={k}: N_min {c['n_min']}, knee {c['knee']}"
            for k, c in r["curves"].items()
            if c.get("feasible")
        ]
        return "bubble sweep: " + "; ".join(parts)
    if kind == "bcast_sweep":
        return f"broadcast sweep: Tree-Pipelined <= {r['tree_over_lower_bound_max']:.3f} x (T* + reload)"
    rows = r["rows"]
    return "ablation (cost/step vs full): " + ", ".join(
        f"{k} {v['cost_vs_full']:.3f}" for k, v in rows.items()
    )


SIMULATE = Command(
    help="discrete-event simulation at paper scale: bubble vs workers, T_bcast vs N, ablation, single runs",
    add_arguments=_add_arguments,
    run=_run,
)
