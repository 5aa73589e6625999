"""The README's main job, measured: `echo2 run` with every default, as a newcomer runs it.

One fresh `echo2 run` process (learner + 2 local worker processes, S = 3, the embedded model on
arithmetic), timed from launch to exit, with an empty warm-start cache so the time includes building
the warm start, as on a fresh clone. Targets (fixed here, before the run): the command finishes in
under 10 minutes, held-out accuracy rises by at least 25 points over the warm start, and the
observed staleness is never above S; and no waste: of the rollouts that reached the learner, at least
95% trained (``store/yield`` at the end; the shares lost by cause are reported beside it), no prompt
given up (``data/prompts_skipped``), and at most one WARNING line in any minute of the run's log.

Writes results/default_run.json and results/default_run.png (the run's own run.png).

    python benchmarks/default_run.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MAX_MINUTES = 10.0  # the whole command, warm start included
MIN_GAIN_POINTS = 25.0  # held-out accuracy gain over the warm start
MIN_YIELD = 0.95  # of the rollouts received, the share trained
MAX_WARNINGS_PER_MINUTE = 1


def warnings_per_minute(log: str) -> tuple[int, int, list[str]]:
    """WARNING lines of the run's log (``HH:MM:SS WARNING name: ...``): in all, the most in any clock
    minute, and the lines themselves (the first 20, cut at 200 characters)."""
    per: dict[str, int] = {}
    lines = []
    for line in log.splitlines():
        parts = line.split(" ", 2)
        if len(parts) > 1 and parts[1] == "WARNING":
            per[parts[0][:5]] = per.get(parts[0][:5], 0) + 1
            lines.append(line[:200])
    return sum(per.values()), max(per.values(), default=0), lines[:20]


def last_record(run_dir: Path, key: str) -> float | None:
    """The last value of ``key`` in the run's metrics.jsonl (None if no record has it)."""
    got = None
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if key in rec:
            got = rec[key]
    return got


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "results")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a config override for a variant's reading (the README's row is read with none)",
    )  # fmt: skip
    a = p.parse_args()
    sets = [x for kv in a.set for x in ("--set", kv)]
    run_dir = a.out / "default_run_runs" / "latest"
    with tempfile.TemporaryDirectory(prefix="echo2-cache-") as cache:
        env = {**os.environ, "ECHO2_CACHE": cache}
        t0 = time.perf_counter()
        res = subprocess.run(
            [sys.executable, "-m", "echo2.cli", "run", "--run-dir", str(run_dir), "--no-progress", *sets],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.stderr.write(res.stderr[-4000:])
        return 1
    s = json.loads((run_dir / "summary.json").read_text())
    gain = 100 * (s["final_accuracy"] - s["initial_accuracy"])
    store = s["store"]
    warned, warned_peak, warned_lines = warnings_per_minute(res.stderr)
    skipped = last_record(run_dir, "data/prompts_skipped") or 0
    out = {
        "command": "echo2 run (every default; empty warm-start cache)",
        "overrides": a.set,
        "command_wall_s": wall,
        "steps": s["steps"],
        "loop_s": s["wall_s"],
        "initial_accuracy": s["initial_accuracy"],
        "final_accuracy": s["final_accuracy"],
        "best_accuracy": s["best_accuracy"],
        "gain_points": gain,
        "bubble_ratio": s["bubble_ratio"],
        "bubble": s["bubble"],
        "staleness_max": s["staleness_max"],
        "staleness_budget": s["staleness_budget"],
        "activation_decisions": s["activation_decisions"],
        "yield": store.get("store/yield"),
        "yield_lost": {k.split("/")[-1]: v for k, v in store.items() if k.startswith("store/yield_lost/")},
        "trained": store["store/trained"],
        "prompts_given_up": skipped,
        # the generation check of the workers' submissions (None: a metric this code does not report)
        "check": {
            key.split("/")[-1]: last_record(run_dir, key)
            for key in (
                "security/checked_submissions",
                "security/check_latency_s",
                "security/waits_for_checks",
                "security/held_behind",
                "security/dropped_behind",
            )
        },
        "warning_lines": warned,
        "warning_lines_peak_minute": warned_peak,
        "warning_lines_first": warned_lines,
        "targets": {
            "minutes": MAX_MINUTES,
            "min_gain_points": MIN_GAIN_POINTS,
            "staleness": "never above S",
            "min_yield": MIN_YIELD,
            "prompts_given_up": 0,
            "max_warning_lines_per_minute": MAX_WARNINGS_PER_MINUTE,
        },
    }
    out["met"] = {
        "time": wall <= 60 * MAX_MINUTES,
        "gain": gain >= MIN_GAIN_POINTS,
        "staleness": s["staleness_max"] <= s["staleness_budget"],
        "yield": (store.get("store/yield") or 0.0) >= MIN_YIELD,
        "given_up": skipped == 0,
        "warnings": warned_peak <= MAX_WARNINGS_PER_MINUTE,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "default_run.json").write_text(json.dumps(out, indent=1))
    shutil.copy(run_dir / "run.png", a.out / "default_run.png")
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, dict | list)}, indent=1))
    print(json.dumps(out["met"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
