"""The code task's sandbox, measured (runtime figures: real bubblewrap runs on this machine).

Studies (targets fixed here, before running):

- **capacity**: the bundled sample's reference solutions and broken copies of them (half each), graded
  through the learner's verifier path (``CodeTask.grade`` on ``grade_threads`` threads) at 1 and 2
  threads: sandboxed test runs per second, and per core (the planner's grading capacity). A reading.
- **hostile**: the learner's update loop (``GRPOTrainer.update`` on the embedded default's batch, R
  rollouts) timed while the verifier grades, without pause, a clean batch (reference solutions) or a
  hostile one (the issue's programs: fork bomb, infinite loop, 10 GB allocation, sleeping past the
  limit, printing 1 GB, writing outside tmp, opening a socket, reading the learner's files), 3
  interleaved pairs of ``--window`` seconds each. Targets: every hostile program scored 0 with its
  outcome; the median update rate during a hostile batch >= 0.8x that during a clean one; no process
  of the sandbox's user left running after the study, nothing written outside the sandbox.
- **run**: ``echo2 run --task code`` (the embedded model, the bundled sample) for ``--minutes`` of
  learner loop: held-out pass rate at the start and at the end, gradings by outcome. A reading (the
  issue: report it honestly if a tiny model cannot learn code).

Writes results/code_task.json and results/code_task.png.

    python benchmarks/code_task.py                    # every study
    python benchmarks/code_task.py --study hostile --window 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MIN_RATE_RATIO = 0.8  # update rate during a hostile batch / during a clean one (median of the pairs)
PAIRS = 3

HOSTILE = {
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "infinite_loop": "while True: pass",
    "allocate_10gb": "x = bytearray(10 * 1024 ** 3)",
    "sleep_past_limit": "import time; time.sleep(600)",
    "print_1gb": "import sys\nb = 'x' * (1 << 20)\nfor _ in range(1024): sys.stdout.write(b)",
    "write_outside_tmp": "open('{outside}', 'w').write('x')",
    "open_socket": "import socket; socket.create_connection(('127.0.0.1', 22), timeout=1)",
    "read_learner_files": "print(open('{secret}').read())",
}


def _task(**cfg: Any) -> Any:
    from echo2.config import CodeTaskConfig
    from echo2.data.tasks.code import CodeTask

    return CodeTask(CodeTaskConfig(**cfg))


def _prompts(task: Any) -> list[Any]:
    return [p for split in task.splits().values() for p in split]


def study_capacity(n: int) -> dict[str, Any]:
    from echo2.data.tasks.base import grade_all

    out: dict[str, Any] = {"programs": n, "threads": {}}
    for threads in (1, 2):
        task = _task(grade_threads=threads)
        prompts = _prompts(task)
        jobs = []
        for i in range(n):
            p = prompts[i % len(prompts)]
            ref = task.reference(p)
            jobs.append((p, ref if i % 2 == 0 else ref.replace("return ", "return 1 + ")))
        task.grade(*jobs[0])  # the sandbox's probe and first start
        t0 = time.perf_counter()
        grades = grade_all(task, jobs)  # the verifier's grading step alone
        wall = time.perf_counter() - t0
        right = sum(g.reward == (i % 2 == 0) for i, g in enumerate(grades))
        out["threads"][threads] = {"seconds": wall, "per_s": n / wall, "per_s_per_core": n / wall / threads,
                                   "graded_as_expected": right}  # fmt: skip
        print(
            f"capacity: {threads} thread(s): {n / wall:.1f} gradings/s, {right}/{n} as expected", flush=True
        )
    return out


def _trainer() -> tuple[Any, list[Any]]:
    """The embedded default's trainer and one batch of its real rollouts (rewards fixed to mixed values)."""
    import random
    from dataclasses import replace

    from echo2.config import load_config
    from echo2.learner.trainer import GRPOTrainer
    from echo2.models.policy import configure_torch, load_checkpoint
    from echo2.rollout.collect import collect_groups
    from echo2.rollout.engines.hf import HFEngine
    from echo2.tasks.registry import build_task
    from echo2.tasks.warm_cache import starting_checkpoint

    cfg = load_config()
    configure_torch(cfg)
    policy = load_checkpoint(starting_checkpoint(cfg))
    task = build_task(cfg.task, 0)
    engine = HFEngine(policy.model, policy.eos_id, policy.pad_id, cfg.sampling)
    prompts = task.sample_train(random.Random(0), cfg.batch.prompts)
    got = collect_groups(policy.codec, engine, task, prompts, cfg.batch.group_size, seed=0,
                         policy_version=0, group_prefix="bench")  # fmt: skip
    trajs = [replace(t, reward=float(i % 3 == 0)) for i, t in enumerate(got.trajectories)]
    return GRPOTrainer(policy.model, cfg.grpo, cfg.sampling, policy.pad_id, task.token_mask), trajs


def _nobody_processes() -> int:
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            uid = next((line.split()[1] for line in status.splitlines() if line.startswith("Uid:")), "")
            n += uid == "65534"
    return n


def study_hostile(window_s: float) -> dict[str, Any]:
    from echo2.data.tasks.base import grade_all

    task = _task()
    prompts = _prompts(task)
    here = Path(tempfile.mkdtemp(prefix="echo2-code-bench-"))
    secret, outside = here / "learner_secret.txt", here / "written_by_sandbox.txt"
    secret.write_text("the learner's secret")
    hostile = {k: v.format(secret=secret, outside=outside) for k, v in HOSTILE.items()}
    # each hostile program once, graded one by one: its outcome and time
    outcomes: dict[str, Any] = {}
    for name, code in hostile.items():
        before = task.outcome_counts()
        t0 = time.perf_counter()
        grade = task.grade(prompts[0], code)
        after = task.outcome_counts()
        outcome = next(k for k in after if after[k] != before.get(k, 0))
        outcomes[name] = {"reward": grade.reward, "outcome": outcome, "seconds": time.perf_counter() - t0}
        print(
            f"hostile {name}: reward {grade.reward}, {outcome}, {outcomes[name]['seconds']:.2f} s", flush=True
        )
    batches = {
        "clean": [(p, task.reference(p)) for p in prompts[:64]],
        "hostile": [(prompts[i % len(prompts)], code) for i, code in enumerate(list(hostile.values()) * 8)],
    }
    trainer, trajs = _trainer()
    for _ in range(3):
        trainer.update(trajs)

    def window(kind: str) -> dict[str, Any]:
        stop = threading.Event()
        graded = [0]

        def grade_forever() -> None:
            while not stop.is_set():
                graded[0] += len(grade_all(task, batches[kind]))

        thread = threading.Thread(target=grade_forever, daemon=True)
        thread.start()
        time.sleep(1.0)  # the grading under way
        t0, updates = time.perf_counter(), 0
        while time.perf_counter() - t0 < window_s:
            trainer.update(trajs)
            updates += 1
        rate = updates / (time.perf_counter() - t0)
        stop.set()
        thread.join()
        print(f"hostile study, {kind} batch: {rate:.3f} updates/s, {graded[0]} graded", flush=True)
        return {"updates_per_s": rate, "graded": graded[0]}

    pairs = [{kind: window(kind) for kind in ("clean", "hostile")} for _ in range(PAIRS)]
    ratios = [p["hostile"]["updates_per_s"] / p["clean"]["updates_per_s"] for p in pairs]
    time.sleep(2.0)
    left = _nobody_processes()
    return {
        "programs": outcomes,
        "pairs": pairs,
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "window_s": window_s,
        "processes_left": left,
        "written_outside": outside.exists(),
        "target": f"every hostile program 0 with its outcome; median update-rate ratio >= {MIN_RATE_RATIO}; "
        "nothing left running or written outside",
        "met": all(o["reward"] == 0 for o in outcomes.values())
        and statistics.median(ratios) >= MIN_RATE_RATIO
        and left == 0
        and not outside.exists(),
    }


def study_run(minutes: float, out: Path) -> dict[str, Any]:
    run_dir = out / "code_task_runs" / "latest"
    cmd = [sys.executable, "-m", "echo2.cli", "run", "--task", "code", "--run-dir", str(run_dir),
           "--no-progress", "--set", f"train.max_minutes={minutes}"]  # fmt: skip
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        return {"error": res.stderr[-3000:], "command": " ".join(cmd[2:])}
    s = json.loads((run_dir / "summary.json").read_text())
    outcomes: dict[str, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        for k, v in json.loads(line).items():
            if k.startswith("reward/outcomes/"):
                outcomes[k.rsplit("/", 1)[1]] = outcomes.get(k.rsplit("/", 1)[1], 0) + v
    return {
        "command": "echo2 run --task code --set train.max_minutes=" + str(minutes),
        "wall_s": time.perf_counter() - t0,
        "steps": s["steps"],
        "initial_pass_rate": s["initial_accuracy"],
        "final_pass_rate": s["final_accuracy"],
        "best_pass_rate": s["best_accuracy"],
        "gain_points": 100 * (s["final_accuracy"] - s["initial_accuracy"]),
        "learner_gradings_by_outcome": outcomes,
        "yield": s["store"].get("store/yield"),
    }


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    if "hostile" in res:
        h = res["hostile"]
        axes[0].bar(range(len(h["ratios"])), h["ratios"], color="#4c72b0")
        axes[0].axhline(MIN_RATE_RATIO, color="red", ls="--", label=f"target {MIN_RATE_RATIO}")
        axes[0].set_title("update rate, hostile / clean batch graded")
        axes[0].set_xlabel("pair")
        axes[0].legend()
    if "capacity" in res:
        c = res["capacity"]["threads"]
        ks = sorted(c, key=int)
        axes[1].bar([str(k) for k in ks], [c[k]["per_s"] for k in ks], color="#55a868")
        axes[1].set_title("sandboxed gradings / s")
        axes[1].set_xlabel("grading threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", choices=["capacity", "hostile", "run", "all"], default="all")
    p.add_argument("--programs", type=int, default=200, help="programs of the capacity study")
    p.add_argument("--window", type=float, default=20.0, help="seconds of each hostile-study window")
    p.add_argument("--minutes", type=float, default=6.0, help="learner-loop minutes of the run study")
    p.add_argument("--out", type=Path, default=ROOT / "results")
    a = p.parse_args()
    path = a.out / "code_task.json"
    res: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    studies = {"capacity": lambda: study_capacity(a.programs), "hostile": lambda: study_hostile(a.window),
               "run": lambda: study_run(a.minutes, a.out)}  # fmt: skip
    for name in studies if a.study == "all" else [a.study]:
        res[name] = studies[name]()
        a.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1))
    plot(res, a.out / "code_task.png")
    print(json.dumps({k: v.get("met", "-") for k, v in res.items() if isinstance(v, dict)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
