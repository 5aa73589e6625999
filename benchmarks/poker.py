"""Poker, measured: does `echo2 run --task poker` learn on this CPU, and what does the runtime cost?

    python benchmarks/poker.py --study train        # echo2 run --task poker, then Table 4 of start vs end
    python benchmarks/poker.py --study throughput   # a worker's delivered episodes/s vs a bare loop
    python benchmarks/poker.py --study bubble       # runtime.py's bubble study on the poker preset
    python benchmarks/poker.py --study all

**train.** One `echo2 run --task poker` (the embedded default: warm start by imitation of the tight-
aggressive player, then GRPO against tag / station / lag / self-play tables, 2 local workers), timed
from launch to exit (warm start and the run's own closing table included). Then, on the test split's
deals, each played from both seats (duplicate), ``EVAL_DEALS`` deals = ``2 x EVAL_DEALS`` hands per
opponent: the final checkpoint and the starting checkpoint each against tag, station and lag, and
the final checkpoint against the starting one. Both checkpoints play the *same* deals, so their
difference against an opponent is taken per deal (paired) with a 95% t-interval over deals.

Targets, fixed before the run (sidedness in words):
  * the run ends within ``TARGET_MINUTES`` of wall time (one-sided, upper);
  * the final checkpoint beats the starting one -- paired difference, 95% interval above 0 -- against
    at least ``MIN_IMPROVED`` of the 3 rule-based opponents (one-sided);
  * the final checkpoint wins against the starting checkpoint: 95% interval above 0 (one-sided);
  * its illegal-action rate over all those hands is below ``MAX_ILLEGAL`` (one-sided, upper).

**throughput.** ``benchmarks/runtime.py``'s worker study on the poker preset: interleaved pairs of
(a real worker served by a learner node, then the bare rollout function on the same model, lease size
and self-play pool), ``WORKER_RATIO`` of the bare loop's episodes/s at least (median of pairs).

**bubble.** ``benchmarks/runtime.py``'s bubble study on the poker preset: `echo2 run --task poker` with
N = 1 to 4 workers throttled to ``--bubble-throttle`` episodes/s each, all kept active; the measured
bubble's knee must lie within ``KNEE_WITHIN`` worker of the planner's N_min computed from the runs' own
T_train, T_bcast and per-worker rate (the single-turn study's target, unchanged).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

log = logging.getLogger("poker_bench")

TARGET_MINUTES = 15.0
EVAL_DEALS = 1000  # per opponent; x 2 seats = 2,000 hands
MIN_IMPROVED = 2  # of the 3 rule-based opponents
MAX_ILLEGAL = 0.01
WORKER_RATIO = 0.9
KNEE_WITHIN = 1
T_TRAIN_S = 2.75  # the poker run's median seconds per update (results/poker.json), when it is not at hand
RULE_STYLES = ("tag", "station", "lag")


def study_train(out: Path, seed: int, deals: int, overrides: list[str]) -> dict[str, Any]:
    from echo2.config import load_config, task_preset
    from echo2.rollout.matchups import evaluate_checkpoint, paired_difference
    from echo2.tasks.warm_cache import starting_checkpoint

    run_dir = out / "poker_run"
    sets = [x for o in overrides for x in ("--set", o)]
    cmd = [sys.executable, "-m", "echo2.cli", "run", "--task", "poker", "--seed", str(seed)]
    cmd += ["--run-dir", str(run_dir), "--no-progress", *sets]
    t0 = time.perf_counter()
    with (out / "poker_run.log").open("w") as fh:
        subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, check=True, env=os.environ.copy())
    wall_min = (time.perf_counter() - t0) / 60
    summary = json.loads((run_dir / "summary.json").read_text())
    cfg = load_config(overrides=[*task_preset("poker"), f"seed={seed}", *overrides])
    start, final = starting_checkpoint(cfg), summary["last_checkpoint"]
    t1 = time.perf_counter()
    fin = {m.opponent: m for m in evaluate_checkpoint(cfg, final, {"start": start}, deals)}
    base = {m.opponent: m for m in evaluate_checkpoint(cfg, start, {}, deals)}
    eval_s = time.perf_counter() - t1
    diffs = {}
    for style in RULE_STYLES:
        mean, ci = paired_difference(fin[style], base[style])
        diffs[style] = {"mean_bb": mean, "ci95": ci, "improved": ci[0] > 0}
    vs_start = fin["start"]
    decisions = sum(m.decisions for m in fin.values())
    illegal = sum(m.illegal_rate * m.decisions for m in fin.values()) / max(decisions, 1)
    improved = sum(d["improved"] for d in diffs.values())
    curve = [
        (r["step"], r["reward/accuracy"])
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "reward/accuracy" in r
    ]
    res = {
        "seed": seed,
        "overrides": overrides,
        "wall_minutes": wall_min,
        "eval_seconds": eval_s,
        "steps": summary["steps"],
        "bubble_ratio": summary["bubble_ratio"],
        "staleness_max": summary["staleness_max"],
        "t_train_s_median": statistics.median(
            r["learner/t_train_s"]
            for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "learner/t_train_s" in r
        ),
        "hands_per_opponent": fin["tag"].hands,
        "final": {k: _brief(m) for k, m in fin.items()},
        "start": {k: _brief(m) for k, m in base.items()},
        "improvement_vs_start_checkpoint": diffs,
        "final_illegal_rate": illegal,
        "heldout_return_curve": curve,
        "targets": {
            "wall_minutes": f"<= {TARGET_MINUTES}",
            "improved_opponents": f">= {MIN_IMPROVED} of {len(RULE_STYLES)} (paired 95% CI above 0)",
            "vs_start_checkpoint": "95% CI above 0",
            "illegal_rate": f"< {MAX_ILLEGAL}",
        },
        "met": {
            "wall_minutes": wall_min <= TARGET_MINUTES,
            "improved_opponents": improved >= MIN_IMPROVED,
            "vs_start_checkpoint": vs_start.ci95[0] > 0,
            "illegal_rate": illegal < MAX_ILLEGAL,
        },
    }
    _plot_train(res, out / "poker.png")
    return res


def _brief(m: Any) -> dict[str, Any]:
    d = m.to_dict()
    d.pop("per_deal")
    return d


def _plot_train(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    names = [*RULE_STYLES, "start"]
    for k, (label, side, color) in enumerate((("start checkpoint", "start", "C7"), ("final", "final", "C0"))):
        xs = [i + (k - 0.5) * 0.38 for i in range(len(names))]
        rows = [res[side].get(n) for n in names]
        means = [r["mean_bb"] if r else 0.0 for r in rows]
        errs = [
            [r["mean_bb"] - r["ci95"][0] if r else 0.0 for r in rows],
            [r["ci95"][1] - r["mean_bb"] if r else 0.0 for r in rows],
        ]
        ax.bar(xs, means, 0.38, yerr=errs, capsize=3, color=color, label=label)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(names)), ["tag", "station", "lag", "vs start ckpt"])
    ax.set(ylabel="chips / hand (bb), 95% CI", title=f"{res['hands_per_opponent']} hands per opponent")
    ax.legend()
    steps, vals = zip(*res["heldout_return_curve"], strict=True) if res["heldout_return_curve"] else ((), ())
    bx.plot(steps, vals, "o-")
    bx.axhline(0, color="k", lw=0.8)
    bx.set(xlabel="learner step", ylabel="held-out mean return (bb)", title="during the run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def study_throughput(out: Path, seconds: float, trials: int) -> dict[str, Any]:
    """Versions advance at the poker run's own pace (its median T_train, from ``poker.json`` when the
    train study has run, else ``T_TRAIN_S``): at the single-turn task's 0.2 s, a lease of 128 episodes
    would be stale before it lands."""
    from echo2.config import task_preset
    from runtime import study_worker

    trained = out / "poker.json"
    t_train = (
        json.loads(trained.read_text()).get("t_train_s_median", T_TRAIN_S) if trained.is_file() else T_TRAIN_S
    )
    res = study_worker(
        out,
        seconds,
        trials,
        overrides=tuple(task_preset("poker")),
        name="poker_throughput",
        t_train_s=t_train,
    )
    res["t_train_s"] = t_train
    res["target"] = f">= {WORKER_RATIO} x the bare loop's episodes/s (median of interleaved pairs)"
    res["met"] = res["ratio"] >= WORKER_RATIO
    return res


def study_bubble(
    out: Path, ns: list[int], throttle: float, minutes: float, overrides: list[str]
) -> dict[str, Any]:
    from runtime import study_bubble as runtime_bubble

    res = runtime_bubble(out, ns, throttle, minutes, warmup=5, task="poker", overrides=tuple(overrides))
    res["overrides"] = overrides
    res["target_poker"] = f"measured knee within {KNEE_WITHIN} worker of the planner's N_min"
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", choices=["train", "throughput", "bubble", "all"], default="all")
    p.add_argument("--out", type=Path, default=ROOT / "results")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deals", type=int, default=EVAL_DEALS)
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        help="config override for the runs (train, bubble)",
    )
    p.add_argument("--worker-seconds", type=float, default=60.0)
    p.add_argument("--worker-trials", type=int, default=3)
    p.add_argument("--bubble-ns", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--bubble-throttle", type=float, default=20.0, help="episodes/s per worker")
    p.add_argument("--bubble-minutes", type=float, default=2.5)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    a.out.mkdir(parents=True, exist_ok=True)
    if a.study in ("train", "all"):
        res = study_train(a.out, a.seed, a.deals, a.overrides)
        (a.out / "poker.json").write_text(json.dumps(res, indent=2))
        log.info("train: %s", res["met"])
    if a.study in ("throughput", "all"):
        res = study_throughput(a.out, a.worker_seconds, a.worker_trials)
        (a.out / "poker_throughput.json").write_text(json.dumps(res, indent=2))
        log.info("throughput: %.3f x (%s)", res["ratio"], res["met"])
    if a.study in ("bubble", "all"):
        res = study_bubble(a.out, a.bubble_ns, a.bubble_throttle, a.bubble_minutes, a.overrides)
        (a.out / "poker_bubble.json").write_text(json.dumps(res, indent=2))
        log.info("bubble: knee %s, N_min %s", res["knee_measured"], res["n_min"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
