"""Real-length answers through the asynchronous system: is any prompt skipped, and is what is trained as
long as what is generated?

`echo2 run` (learner + 2 local workers, S = 3, the defaults otherwise) on the embedded model and the
`math` task over a generated GSM8K-style file: "Add 12, 7, 30 and 5." answered "12+7=19; 19+30=49;
49+5=54 #### 54", 2 to 12 numbers, so the worked answers run from ~15 to ~130 characters (tokens:
the embedded tokenizer has one per character) with completions of up to ``MAX_NEW`` = 160 tokens. The
warm start fits those answers first (supervised, ``WARM_STEPS`` steps), so completions have real
lengths from the start.

Reported, from the run's own records (targets fixed here, before the run):
* prompts given up (``data/prompts_skipped``; each counted with a reason): target 0;
* the mean completion length of what was trained against what was admitted (``data/completion_tokens_
  trained`` / ``..._generated``, weighted by trajectories over the run): target within 5%;
* grade timeouts (``reward/grade_timeouts``), leases answered after they expired and leases never
  answered (the store's ledger): reported;
* the epochs leased, the stale drops and what was leased again.

Writes results/math_run.json and results/math_run.png.

    python benchmarks/math_run.py             # about 10 minutes here

With ``--algorithm NAME`` every run takes that ``grpo.algorithm`` preset and writes
results/math_run_NAME.json (and .png) instead; beside the above it reports the run's yield split by
cause (``store/yield_lost/*``) and the zero-variance share of what was received: with ``dapo`` the
groups whose rewards are all equal are left out (a reading, no target: what the filter changes in the
share trained, read against ``--algorithm grpo`` on the same day and budget).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_NEW = 160
ROWS = 4000
MINUTES = 6.0
WARM_STEPS = 150  # supervised steps (32 answers each) on the worked answers: their format and length
MAX_LENGTH_GAP = 0.05
MAX_SKIPPED = 0


def dataset(path: Path, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as fh:
        for _ in range(ROWS):
            xs = [rng.randint(1, 60) for _ in range(rng.randint(2, 12))]
            steps, total = [], xs[0]
            for x in xs[1:]:
                steps.append(f"{total}+{x}={total + x}")
                total += x
            q = "Add " + ", ".join(map(str, xs[:-1])) + f" and {xs[-1]}."
            fh.write(json.dumps({"question": q, "answer": "; ".join(steps) + f" #### {total}"}) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "results")
    p.add_argument("--minutes", type=float, default=MINUTES)
    p.add_argument("--algorithm", default=None, help="a grpo.algorithm preset (writes math_run_<it>.json)")
    a = p.parse_args()
    name = f"math_run_{a.algorithm}" if a.algorithm else "math_run"
    run_dir = a.out / "math_run_runs" / (a.algorithm or "latest")
    with tempfile.TemporaryDirectory(prefix="echo2-math-") as tmp:
        data = Path(tmp) / "sums.jsonl"
        dataset(data)
        sets = [
            "task.name=math", f"task.train_path={str(data)!r}", "task.prompt_template='{question} Answer: '",
            f"sampling.max_new_tokens={MAX_NEW}", "model.embedded.max_positions=256",
            "model.warmstart.eval_size=64", f"model.warmstart.max_steps={WARM_STEPS}",
            "model.warmstart.batch_size=32", "train.eval_size=128",
            f"train.max_minutes={a.minutes}",
            *([f"grpo.algorithm={a.algorithm}"] if a.algorithm else []),
        ]  # fmt: skip
        env = {**os.environ, "ECHO2_CACHE": str(Path(tmp) / "cache")}
        cmd = [sys.executable, "-m", "echo2.cli", "run", "--run-dir", str(run_dir), "--no-progress"]
        t0 = time.perf_counter()
        res = subprocess.run(
            [*cmd, *(x for s in sets for x in ("--set", s))], env=env, capture_output=True, text=True
        )
        wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.stderr.write(res.stderr[-4000:])
        return 1
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in records if "learner/t_train_s" in r]
    last = steps[-1]
    trained = sum(r["data/completion_tokens_trained"] for r in steps) / len(steps)  # equal batches
    # each record's generated mean covers what was admitted since the record before: weight it by that
    admitted = [r["store/admitted"] for r in steps]
    weights = [admitted[0], *(b - a for a, b in itertools.pairwise(admitted))]
    pairs = [(r["data/completion_tokens_generated"], w) for r, w in zip(steps, weights, strict=True)
             if "data/completion_tokens_generated" in r and w > 0]  # fmt: skip
    generated = sum(g * w for g, w in pairs) / sum(w for _, w in pairs)
    db = sqlite3.connect(run_dir / "store.sqlite")
    late = db.execute("SELECT COUNT(*) FROM leases WHERE late = 1").fetchone()[0]
    never = db.execute("SELECT COUNT(*) FROM leases WHERE state = 'expired'").fetchone()[0]
    leases = db.execute("SELECT COUNT(*) FROM leases").fetchone()[0]
    db.close()
    out = {
        "command": "python benchmarks/math_run.py"
        + (f" --algorithm {a.algorithm}" if a.algorithm else "")
        + (f" --minutes {a.minutes:g}" if a.minutes != MINUTES else ""),
        "algorithm": a.algorithm or "grpo (the default)",
        "yield": last.get("store/yield"),
        "yield_lost": {
            k.removeprefix("store/yield_lost/"): v
            for k, v in last.items()
            if k.startswith("store/yield_lost/")
        },
        "zero_variance_trajectories_left_out": last.get("store/zero_variance"),
        "zero_variance_share_trained_mean": sum(r.get("learner/zero_variance_share", 0.0) for r in steps)
        / len(steps),
        "command_wall_s": wall,
        "max_new_tokens": MAX_NEW,
        "rows": ROWS,
        "steps": len(steps),
        "epochs": last.get("data/epoch"),
        "prompts_skipped": last["data/prompts_skipped"],
        "prompts_requeued": last["data/prompts_requeued"],
        "dropped_stale_trajectories": last["store/dropped_stale"],
        "admitted_trajectories": last["store/admitted"],
        "mean_completion_tokens_generated": generated,
        "mean_completion_tokens_trained": trained,
        "trained_vs_generated": trained / generated - 1,
        "grade_timeouts": sum(r.get("reward/grade_timeouts", 0) for r in steps),
        "leases": leases,
        "leases_answered_late": late,
        "leases_never_answered": never,
        "held_out_start": next(r["reward/accuracy"] for r in records if "reward/accuracy" in r),
        "held_out_end": [r["reward/accuracy"] for r in records if "reward/accuracy" in r][-1],
        "staleness_max": max(r["store/staleness_max"] for r in steps),
        "targets": {
            "prompts_skipped": f"<= {MAX_SKIPPED}",
            "length_gap": f"|trained / generated - 1| <= {MAX_LENGTH_GAP}",
        },
    }
    out["met"] = {
        "prompts_skipped": out["prompts_skipped"] <= MAX_SKIPPED,
        "length_gap": abs(out["trained_vs_generated"]) <= MAX_LENGTH_GAP,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{name}.json").write_text(json.dumps(out, indent=1))
    plot(steps, out, a.out / f"{name}.png")
    print(json.dumps(out, indent=1))
    return 0


def plot(steps: list[dict], out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4))
    xs = [r["step"] for r in steps]
    ax.plot(
        xs, [r["data/completion_tokens_trained"] for r in steps], label="trained (the step's batch)", lw=0.8
    )
    gen = [
        (r["step"], r["data/completion_tokens_generated"])
        for r in steps
        if "data/completion_tokens_generated" in r
    ]
    ax.plot(
        [s for s, _ in gen], [g for _, g in gen], label="generated (admitted since the last step)", lw=0.8
    )
    ax.set_xlabel("learner step")
    ax.set_ylabel("mean completion tokens")
    ax.set_title(f"trained vs generated: {out['trained_vs_generated']:+.1%}")
    ax.legend()
    bx.plot(xs, [r["data/prompts_requeued"] for r in steps], label="prompts leased again")
    bx.plot(xs, [r["store/dropped_stale"] / 8 for r in steps], label="groups dropped as stale")
    bx.plot(xs, [r["data/prompts_skipped"] for r in steps], label="prompts given up")
    bx.set_xlabel("learner step")
    bx.set_title(f"epochs leased: {out['epochs']:.2f}")
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
