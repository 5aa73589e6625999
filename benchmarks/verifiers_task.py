"""A verifiers taskset or environment trained end to end, learner + 2 local worker processes, the
embedded model, for a few minutes. Runtime reading.

- default: `echo2 run --task verifiers` on the bundled sums taskset `echo2.data.tasks.verifiers_example`
  (a plain verifiers v1 taskset whose `@reward` reads each task's gold answer). Targets (fixed before the
  run): exit 0; every completion trained was scored on the learner by the taskset's reward
  (`reward/outcomes/scored` >= the trajectories admitted, `reward/outcomes/error` = 0); the generation
  check re-ran submissions and refused none (`security/checked_submissions` > 0, `store/rejected` = 0).
  Writes results/verifiers_task.json.
- `--env ID` (`echo2-vf-probe`, `echo2-vf-adder`): `echo2 run --task verifiers_env --set task.env=ID` on a
  bundled multi-turn verifiers env (its own `Env.run`, played by the workers, every episode replayed and
  re-scored by the task's rewards on the learner, `envs/verifiers_bridge.py`). Targets (fixed before the
  run): exit 0; episodes admitted (`store/admitted` > 0) with none refused (`store/rejected` = 0: every
  submitted episode's replay agreed with the worker's turns, mask and reward); the generation check
  re-ran submissions (`security/checked_submissions` > 0); 0 environment errors in the trained batches
  (`env/errors`). Writes results/verifiers_env_<ID>.json.

- `--judge`: the default run on the same sums graded by an LLM judge instead of an `@reward`
  (`verifiers_example:load_judged_taskset`, verifiers' plugged `reference` judge, `task.judges = "learner"`),
  the judge a stand-in served on loopback by this script (`echo2_bench/judge.py`: "yes" when the reply's
  first integer is the sum; no model). Targets (fixed before the run): those of the default, plus the
  judge called (> 0 calls), every call with the key the learner's environment holds. Before the run, a
  reading (no target): the learner's CPU per scoring, judged against the plain `@reward` sums, 256
  scorings at 16 in flight, 3 repeats, in this process (the grading thread's CPU time: the loopback
  judge's own threads excluded). Writes results/verifiers_judge.json.
- `--env echo2-vf-probe --judge`: the probe env whose tasks plug the same reference judge (asked whether
  the last guess is the hidden number; `verifiers_example:load_judged_probe`, `task.judges = "learner"`):
  workers play and claim the reward without the judge, the learner's replay checks it and adds the
  judge's verdict. Targets (fixed before the run): those of `--env`, plus the judge called, every call
  with the learner's key, episodes judged on the learner (`reward/outcomes/judged` > 0) and none failed
  (`reward/outcomes/judge_error` = 0). Writes results/verifiers_env_echo2_vf_probe_judge.json.

All: held-out accuracy (for an env, the mean reward of a greedy episode) is a reading: the gain is
reported, with the step count, no threshold.

    python benchmarks/verifiers_task.py [--minutes 4] [--env echo2-vf-probe|echo2-vf-adder] [--judge]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

from default_run import last_record
from echo2_bench.judge import LoopbackJudge

ROOT = Path(__file__).resolve().parents[1]
TEACHERS = {
    "echo2-vf-probe": "echo2_vf_probe:probe_teacher",
    "echo2-vf-adder": "echo2_vf_adder:adder_teacher",
}
ENV_SETTINGS = {  # 2,048 tasks, so that the held-out evaluation reads 256 episodes; the adder's replies
    # need "add 12 7" and EOS, 4 of them
    "echo2-vf-probe": ("task.taskset_args={n = 2048}",),
    "echo2-vf-adder": ("task.taskset_args={n = 2048}", "sampling.max_new_tokens=10", "task.max_turns=4"),
}


def summed(run_dir: Path, prefix: str) -> dict[str, float]:
    """Per-step counts under ``prefix`` in the run's metrics.jsonl, summed over the run."""
    out: dict[str, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        for k, v in json.loads(line).items():
            if k.startswith(prefix) and isinstance(v, (int, float)):
                name = k.removeprefix(prefix)
                out[name] = out.get(name, 0) + v
    return out


def scoring_cpu_ms(judge_url: str, key_var: str, repeats: int = 3, n: int = 256) -> dict[str, float]:
    """The grading thread's CPU milliseconds per scoring (median of ``repeats`` batches of ``n``), for the
    plain sums (their ``@reward``) and the judged ones (a judge call each)."""
    import statistics

    from echo2.config import VerifiersTaskConfig
    from echo2.data.tasks.base import grade_all
    from echo2.data.tasks.verifiers_env import VerifiersTask

    env = "echo2.data.tasks.verifiers_example:load_judged_taskset"
    tasks = {
        "plain": VerifiersTask(VerifiersTaskConfig(grade_threads=16)),
        "judged": VerifiersTask(VerifiersTaskConfig(
            env=env, env_args={"judge_url": judge_url, "judge_key_var": key_var},
            judges="learner", grade_threads=16,
        )),
    }  # fmt: skip
    out = {}
    for name, task in tasks.items():
        todo = [(p, "12") for p in task.splits()["train"][:n]]
        grade_all(task, todo[:16])  # warm
        per = []
        for _ in range(repeats):
            t0 = time.thread_time()  # grade_all scores on this thread's own event loop
            grade_all(task, todo)
            per.append((time.thread_time() - t0) / n * 1e3)
        out[name] = round(statistics.median(per), 2)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=4.0, help="the run's training budget")
    p.add_argument("--out", type=Path, default=ROOT / "results")
    p.add_argument("--env", choices=sorted(TEACHERS), help="a bundled multi-turn verifiers env instead")
    p.add_argument(
        "--judge",
        action="store_true",
        help="graded by a judge on loopback (the sums, or the probe env's episodes)",
    )
    args = p.parse_args()
    if args.judge and args.env not in (None, "echo2-vf-probe"):
        p.error("--judge grades the sums, or with --env echo2-vf-probe the probe's episodes")
    name = "verifiers_task" if args.env is None else f"verifiers_env_{args.env.replace('-', '_')}"
    name = f"{name.replace('_task', '')}_judge" if args.judge else name
    run_dir = args.out / f"{name}_runs" / "latest"
    task = ["--task", "verifiers"] if args.env is None else [
        "--task", "verifiers_env", "--set", f"task.env={args.env}",
        "--set", f"task.teacher={TEACHERS[args.env]}",
        *(x for kv in ENV_SETTINGS.get(args.env, ()) for x in ("--set", kv)),
    ]  # fmt: skip
    judge, key = LoopbackJudge() if args.judge else None, secrets.token_hex(8)
    if judge is not None:
        judged = "load_judged_taskset" if args.env is None else "load_judged_probe"
        n = "" if args.env is None else ", n = 2048"
        env_args = f'{{judge_url = "{judge.url}", judge_key_var = "ECHO2_JUDGE_KEY"{n}}}'
        task += ["--set", f"task.env=echo2.data.tasks.verifiers_example:{judged}",
                 "--set", f"task.env_args={env_args}",
                 "--set", "task.judges=learner", "--set", "task.grade_threads=16"]  # fmt: skip
    cpu_ms = None
    if judge is not None and args.env is None:
        os.environ["ECHO2_JUDGE_KEY"] = key
        cpu_ms = scoring_cpu_ms(judge.url, "ECHO2_JUDGE_KEY")
        judge.calls.clear()  # the run's calls from here
    cmd = [sys.executable, "-m", "echo2.cli", "run", *task, "--run-dir", str(run_dir),
           "--no-progress", "--set", f"train.max_minutes={args.minutes}"]  # fmt: skip
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "ECHO2_JUDGE_KEY": key})
    finally:
        if judge is not None:
            judge.close()
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
    env_errors = summed(run_dir, "env/").get("errors", 0)
    judged_ok = outcomes.get("judged", 0) > 0 and outcomes.get("judge_error", 0) == 0
    judge_met = (
        {
            "judge_called": len(judge.calls) > 0,
            "every_call_with_the_learners_key": {c["auth"] for c in judge.calls} == {f"Bearer {key}"},
        }
        if judge is not None
        else {}
    )
    met = (
        {
            "exit_0": True,
            "every_trained_completion_scored_on_the_learner": outcomes.get("scored", 0) >= admitted > 0,
            "no_scoring_error": outcomes.get("error", 0) == 0,
            "checks_ran_and_passed": checked > 0 and rejected == 0,
            **judge_met,
        }
        if args.env is None
        else {
            "exit_0": True,
            "episodes_admitted_every_replay_agreed": admitted > 0 and rejected == 0,
            "checks_ran": checked > 0,
            "no_environment_error": env_errors == 0,
            **({**judge_met, "episodes_judged_none_failed": judged_ok} if judge is not None else {}),
        }
    )
    out = {
        "command": f"python benchmarks/verifiers_task.py --minutes {args.minutes:g}"
        + (f" --env {args.env}" if args.env else "")
        + (" --judge" if args.judge else ""),
        **({"judge_calls": len(judge.calls)} if judge is not None else {}),
        **(
            {
                "learner_cpu_ms_per_scoring": cpu_ms,
                "cpu_source": "in-process, the grading thread, this machine",
            }
            if cpu_ms is not None
            else {}
        ),
        "source": "runtime (echo2 run: learner + 2 worker processes, this machine)",
        "wall_s": round(wall, 1),
        "steps": s["steps"],
        "initial_accuracy": s["initial_accuracy"],
        "final_accuracy": s["final_accuracy"],
        "gain_points": round(100 * (s["final_accuracy"] - s["initial_accuracy"]), 1),
        "admitted": admitted,
        "learner_scorings_by_outcome": outcomes,
        "env_errors": env_errors,
        "env_turns_mean_last": last_record(run_dir, "env/turns_mean"),
        "checked_submissions": checked,
        "rejected": rejected,
        "yield": s["store"].get("store/yield"),
        "warm_start_log": warm[-2:],
        "met": met,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0 if all(met.values()) else 2


if __name__ == "__main__":
    raise SystemExit(main())
