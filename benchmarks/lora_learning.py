"""Does `echo2 run --lora` learn on the embedded default, against full fine-tuning in the same time?

For each seed, two `echo2 run` processes (the real CLI, the embedded default: the learner, 2 local
workers, TLS, checks), one training every weight and one with `--lora` (the `[lora]` defaults: rank 16
on the attention and MLP projections, alpha 32; the same `[grpo]` settings, learning rate included:
nothing is tuned for either arm), each with the same wall-clock budget (`--max-minutes`), run one after
the other in alternating order (full first for even seeds, LoRA first for odd ones) so both see the
machine alike. Read from each run's summary.json: held-out greedy accuracy at the start and at the end
(`initial_accuracy`, `final_accuracy`), and the steps taken.

Reported, with no target (fixed here before running): the per-seed gains (final - initial), the
paired difference LoRA - full per seed, its mean and a 95% t-interval over the seeds (3 seeds: t =
4.303); an interval that contains 0 is reported as no difference measured. The embedded model has
0.8M parameters, so a rank-16 adapter is about a fifth of it; what this says about LoRA on a real
model is little: it checks that the LoRA path learns end to end.

Writes results/lora_learning.json and results/lora_learning.png.

    python benchmarks/lora_learning.py                        # 3 seeds x 2 arms x 4 minutes
    python benchmarks/lora_learning.py --minutes 0.5 --seeds 0  # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}  # two-sided 95% t quantiles by df


def run_arm(seed: int, lora: bool, minutes: float, out: Path) -> dict[str, Any]:
    run_dir = out / f"seed{seed}_{'lora' if lora else 'full'}"
    cmd = [sys.executable, "-m", "echo2.cli", "run", "--seed", str(seed), "--run-dir", str(run_dir)]
    cmd += ["--max-minutes", str(minutes), "--steps", "100000", "--no-progress"]
    if lora:
        cmd.append("--lora")
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=minutes * 60 + 600)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {res.returncode}: {res.stderr[-2000:]}")
    s = json.loads((run_dir / "summary.json").read_text())
    return {
        "seed": seed,
        "arm": "lora" if lora else "full",
        "initial_accuracy": s["initial_accuracy"],
        "final_accuracy": s["final_accuracy"],
        "best_accuracy": s["best_accuracy"],
        "gain": s["final_accuracy"] - s["initial_accuracy"],
        "steps": s["steps"],
        "wall_s": time.perf_counter() - t0,
    }


def interval(xs: list[float]) -> dict[str, float | None]:
    """Mean and two-sided 95% t-interval (None with one value)."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return {"mean": m, "lo": None, "hi": None}
    half = T95[len(xs) - 1] * statistics.stdev(xs) / math.sqrt(len(xs))
    return {"mean": m, "lo": m - half, "hi": m + half}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for arm, color in (("full", "C0"), ("lora", "C1")):
        rows = [r for r in result["runs"] if r["arm"] == arm]
        ax.plot([r["seed"] for r in rows], [r["gain"] for r in rows], "o", color=color, label=arm)
    ax.axhline(0, color="grey", lw=0.5)
    d = result["difference"]
    ax.set(xlabel="seed", ylabel="held-out accuracy gain", title=(
        f"echo2 run, {result['minutes']:g} min each: LoRA - full = {d['mean']:+.3f}"
        + (f" [{d['lo']:+.3f}, {d['hi']:+.3f}]" if d["lo"] is not None else "")
    ))  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--minutes", type=float, default=4.0, help="wall-clock budget of every run")
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    a = ap.parse_args()
    subprocess.run([sys.executable, "-m", "echo2.cli", "warmstart"], check=True, capture_output=True)
    work = a.out / "lora_learning_runs"
    runs = []
    for seed in a.seeds:
        for lora in (False, True) if seed % 2 == 0 else (True, False):
            r = run_arm(seed, lora, a.minutes, work)
            print(json.dumps(r), flush=True)
            runs.append(r)
    by = {(r["seed"], r["arm"]): r for r in runs}
    diffs = [by[(s, "lora")]["gain"] - by[(s, "full")]["gain"] for s in a.seeds]
    d = interval(diffs)
    result = {
        "command": "python benchmarks/lora_learning.py " + " ".join(sys.argv[1:]),
        "minutes": a.minutes,
        "seeds": a.seeds,
        "runs": runs,
        "gain": {arm: interval([by[(s, arm)]["gain"] for s in a.seeds]) for arm in ("full", "lora")},
        "difference_per_seed": diffs,
        "difference": d,
        "no_difference_measured": d["lo"] is not None and d["lo"] <= 0 <= d["hi"],
        "target": "none (a reading): LoRA - full held-out gain, mean and 95% t-interval over the seeds",
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "lora_learning.json").write_text(json.dumps(result, indent=1))
    plot(result, a.out / "lora_learning.png")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
