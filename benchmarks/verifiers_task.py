"""A verifiers taskset trained end to end: `echo2 run --task verifiers` (learner + 2 local worker
processes, the embedded model, the bundled sums taskset `echo2.data.tasks.verifiers_example`, a plain
verifiers v1 taskset whose `@reward` reads each task's gold answer) for a few minutes. Runtime reading.

Targets (fixed here, before the run): the run ends by itself (exit 0); every completion trained was
scored on the learner by the taskset's reward (`reward/outcomes/scored` >= the trajectories admitted,
`reward/outcomes/error` = 0); the generation check re-ran submissions and refused none
(`security/checked_submissions` > 0, `store/rejected` = 0); and held-out accuracy rose (a reading: the
gain is reported, with the step count, no threshold).

Writes results/verifiers_task.json.

    python benchmarks/verifiers_task.py [--minutes 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from default_run import last_record

ROOT = Path(__file__).resolve().parents[1]


def summed(run_dir: Path, prefix: str) -> dict[str, float]:
    """Per-step counts under ``prefix`` in the run's metrics.jsonl, summed over the run."""
    out: dict[str, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        for k, v in json.loads(line).items():
            if k.startswith(prefix) and isinstance(v, (int, float)):
                name = k.removeprefix(prefix)
                out[name] = out.get(name, 0) + v
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=4.0, help="the run's training budget")
    p.add_argument("--out", type=Path, default=ROOT / "results")
    args = p.parse_args()
    run_dir = args.out / "verifiers_task_runs" / "latest"
    cmd = [sys.executable, "-m", "echo2.cli", "run", "--task", "verifiers", "--run-dir", str(run_dir),
           "--no-progress", "--set", f"train.max_minutes={args.minutes}"]  # fmt: skip
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        print(res.stderr[-3000:], file=sys.stderr)
        return 1
    s = json.loads((run_dir / "summary.json").read_text())
    # how the warm start ended (a reading, no target): its last log line, or that a cached one was used
    warm = [line for line in res.stderr.splitlines() if "warm start" in line or "warm-start" in line]
    outcomes = summed(run_dir, "reward/outcomes/")
    admitted = last_record(run_dir, "store/admitted") or 0
    checked = last_record(run_dir, "security/checked_submissions") or 0
    rejected = last_record(run_dir, "store/rejected") or 0
    met = {
        "exit_0": True,
        "every_trained_completion_scored_on_the_learner": outcomes.get("scored", 0) >= admitted > 0,
        "no_scoring_error": outcomes.get("error", 0) == 0,
        "checks_ran_and_passed": checked > 0 and rejected == 0,
    }
    out = {
        "command": f"python benchmarks/verifiers_task.py --minutes {args.minutes:g}",
        "source": "runtime (echo2 run: learner + 2 worker processes, this machine)",
        "wall_s": round(wall, 1),
        "steps": s["steps"],
        "initial_accuracy": s["initial_accuracy"],
        "final_accuracy": s["final_accuracy"],
        "gain_points": round(100 * (s["final_accuracy"] - s["initial_accuracy"]), 1),
        "admitted": admitted,
        "learner_scorings_by_outcome": outcomes,
        "checked_submissions": checked,
        "rejected": rejected,
        "yield": s["store"].get("store/yield"),
        "warm_start_log": warm[-2:],
        "met": met,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "verifiers_task.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0 if all(met.values()) else 2


if __name__ == "__main__":
    raise SystemExit(main())
