"""Strangers' machines against the learner: what each attack gets, what the checks cost.

Three studies, each on real `echo2 run` processes (the embedded default, TLS on, one honest local
worker) with the attackers of `echo2_bench/adversary.py` joining over the wire with the run's join
string and token, set up exactly as a real worker sets up:

- **attacks**: for every sampled-check attack (another model, tampered log-probs, best-of-n
  cherry-picking, an inflated version) ``--trials`` fresh identities each submit until quarantined
  (budget 30 submissions); for every deterministic one (forged reward, foreign prompt, deflated
  version, replay) a few identities submit and every submission must be refused. Afterwards the
  store's ledger says how many of each attacker's groups were trained on, purged or refused.
  Targets, fixed here: sampled attacks quarantined within 5 submissions (median over trials) at the
  default check fraction; deterministic attacks 100% refused and 0 of their groups trained on (for
  replay: 0 replayed copies, its first submissions being its own honest work). The forged groups a
  sampled attacker got trained on before it was caught are reported (ledger "trained"). A trial
  whose identity the pool stopped leasing to (a surplus worker, released by the controller) before
  it was caught is counted apart ("released_before_caught") and left out of the median.
- **honest**: every completion of every submission re-run (``security.check_fraction = 1``, all
  samples) on honest workers until >= 10,000 trajectories were checked. Target: 0 quarantines.
- **cost**: interleaved pairs of runs, the sampled check off (``security.check_fraction = 0``) and
  at its default, the same seed, steps, cores and cached warm start: mean learner step time over
  steps [WARMUP, STEPS) and the held-out accuracy at the end. Target: median on/off <= 1.05; the
  accuracy difference is reported with its t-interval (not inferior: the interval's lower end above
  -5 points). The per-submission checks (prompt tokens, rewards, shape, version) are on in both.

Writes results/adversary.json and results/adversary.png.

    python benchmarks/adversary.py                       # all three studies
    python benchmarks/adversary.py --study attacks --trials 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from echo2.runtime.rundir import read_metrics  # noqa: E402

TARGET_QUARANTINE = 5  # submissions, median over trials
TARGET_COST = 1.05
HONEST_CHECKED = 10_000
WARMUP = 20
BUDGET = 30  # submissions one sampled-attack identity may make before the trial counts as not caught
ATTACKER_PROMPTS = 2  # prompts per attacker lease (its generations stay short beside the run)
CORES = sorted(os.sched_getaffinity(0))


def start_run(run_dir: Path, *sets: str, steps: int = 100_000) -> subprocess.Popen[bytes]:
    args = ["run", "--seed", "0", "--steps", str(steps), "--run-dir", str(run_dir), "--no-progress"]
    args += ["--set", "train.max_minutes=60", "--set", "runtime.dashboard=false"]
    for s in sets:
        args += ["--set", s]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.with_suffix(".log").open("w")
    return subprocess.Popen(
        [sys.executable, "-m", "echo2.cli", *args],
        stdout=log,
        stderr=log,
        preexec_fn=lambda: os.sched_setaffinity(0, CORES),
    )


def wait_ready(run_dir: Path, proc: subprocess.Popen[bytes], timeout: float = 600) -> dict[str, Any]:
    """learner.json once the learner serves and has published (its first step logged)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"echo2 run exited {proc.returncode}; see {run_dir.with_suffix('.log')}")
        info = run_dir / "learner.json"  # this process's, not an earlier run's left in the directory
        if info.is_file() and (run_dir / "metrics.jsonl").is_file():
            got = dict(json.loads(info.read_text()))
            if got.get("pid") == proc.pid:
                return got
        time.sleep(0.5)
    raise RuntimeError("the learner never became ready")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()


def ledger(run_dir: Path, worker_ids: list[str]) -> dict[str, int]:
    """Groups of these workers' leases: trained on (a learner step), purged, buffered; and their leases."""
    if not worker_ids:
        return {"trained": 0, "purged": 0, "buffered": 0, "leases": 0}
    db = sqlite3.connect(run_dir / "store.sqlite")
    marks = ",".join("?" * len(worker_ids))
    rows = db.execute(
        "SELECT g.consumed_step FROM rollout_groups g JOIN leases l USING (lease_id) "
        f"WHERE l.worker_id IN ({marks})",
        worker_ids,
    ).fetchall()
    (leases,) = db.execute(f"SELECT COUNT(*) FROM leases WHERE worker_id IN ({marks})", worker_ids).fetchone()
    db.close()
    steps = [r[0] for r in rows]
    return {
        "trained": sum(1 for s in steps if s is not None and s >= 1),
        "purged": sum(1 for s in steps if s == -2),
        "buffered": sum(1 for s in steps if s is None),
        "leases": int(leases),
    }


async def attack(info: dict[str, Any], token: str, kinds: list[str], trials: int) -> list[dict[str, Any]]:
    import aiohttp

    from echo2_bench.adversary import DETERMINISTIC, Attacker, attack_until_caught

    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for kind in kinds:
            att = Attacker(info["join"], token, kind, session, max_prompts=ATTACKER_PROMPTS)
            await att.start()
            n = max(3, trials // 4) if kind in DETERMINISTIC else trials
            budget = 3 if kind in DETERMINISTIC else BUDGET
            t0 = time.perf_counter()
            got = await attack_until_caught(att, n, budget)
            await att.close()
            out += [{**vars(t), "seconds": (time.perf_counter() - t0) / n} for t in got]
            caught = [t.quarantined_after for t in got]
            print(f"{kind}: {caught} {[t.outcomes[-1] if t.outcomes else None for t in got]}", flush=True)
    return out


def study_attacks(out: Path, trials: int) -> dict[str, Any]:
    from echo2_bench.adversary import ATTACKS, DETERMINISTIC, SAMPLED

    run_dir = out / "adversary_runs" / "attacks"
    proc = start_run(run_dir, "runtime.workers=1", "security.max_workers=1000")
    try:
        info = wait_ready(run_dir, proc)
        token = (run_dir / "join_token").read_text().strip()
        trials_out = asyncio.run(attack(info, token, list(ATTACKS), trials))
    finally:
        stop(proc)
    per_kind: dict[str, Any] = {}
    for kind in ATTACKS:
        ts = [t for t in trials_out if t["kind"] == kind]
        outcomes = [o for t in ts for o in t["outcomes"]]
        caught = [t["quarantined_after"] for t in ts]
        entry: dict[str, Any] = {
            "trials": len(ts),
            "submissions": len(outcomes),
            "outcomes": {o: outcomes.count(o) for o in sorted(set(outcomes))},
            "quarantined_after": caught,
            "ledger": ledger(run_dir, [t["worker_id"] for t in ts]),
            "seconds_per_trial": statistics.fmean(t["seconds"] for t in ts),
        }
        if kind in SAMPLED:
            # a trial the pool released (no lease for a minute) before it was caught is not a detection
            # trial: it is counted apart and left out of the median
            released = [t for t in ts if t["released"] and t["quarantined_after"] is None]
            judged = [t["quarantined_after"] for t in ts if t not in released]
            never = sum(1 for c in judged if c is None)
            entry["median_quarantined_after"] = statistics.median(
                c if c is not None else BUDGET + 1 for c in judged
            )
            entry["not_caught_within_budget"] = never
            entry["released_before_caught"] = len(released)
            entry["met"] = entry["median_quarantined_after"] <= TARGET_QUARANTINE
        else:
            entry["refused_share"] = 1 - outcomes.count("admitted") / max(1, len(outcomes))
            # a replayer's first submission of each lease is its own honest work (admitted, and in the
            # ledger); what it replays is refused and never stored (group ids are unique)
            poisoned = 0 if kind == "replay" else entry["ledger"]["trained"]
            entry["met"] = entry["refused_share"] == 1.0 and poisoned == 0
        per_kind[kind] = entry
    metrics = [r for r in read_metrics(run_dir) if "security/checked_submissions" in r]
    return {
        "kinds": per_kind,
        "trials_per_sampled_kind": trials,
        "deterministic_kinds": list(DETERMINISTIC),
        "budget": BUDGET,
        "attacker_prompts_per_lease": ATTACKER_PROMPTS,
        "run_security_metrics": {k: v for k, v in metrics[-1].items() if k.startswith("security/")}
        if metrics
        else {},
        "honest_worker_quarantined": _honest_quarantined(run_dir),
        "target": f"sampled attacks: median submissions until quarantined <= {TARGET_QUARANTINE}; "
        "deterministic: 100% refused, 0 groups trained on",
    }


def _honest_quarantined(run_dir: Path) -> int:
    workers = json.loads((run_dir / "workers.json").read_text())
    return sum(1 for w in workers if w["quarantined"] and not w["name"].startswith("attacker-"))


def study_honest(out: Path, steps: int) -> dict[str, Any]:
    run_dir = out / "adversary_runs" / "honest"
    proc = start_run(run_dir, "security.check_fraction=1.0", "security.check_samples=1000000", steps=steps)
    try:
        if proc.wait(3600) != 0:
            raise RuntimeError(f"echo2 run failed; see {run_dir.with_suffix('.log')}")
    finally:
        stop(proc)
    last = [r for r in read_metrics(run_dir) if "security/checked_trajectories" in r][-1]
    sec = {k: v for k, v in last.items() if k.startswith("security/")}
    checked = int(sec["security/checked_trajectories"])
    return {
        "steps": steps,
        "security": sec,
        "checked_trajectories": checked,
        "quarantined": int(sec["security/quarantined"]),
        "met": checked >= HONEST_CHECKED and sec["security/quarantined"] == 0,
        "target": f">= {HONEST_CHECKED} honest trajectories re-run, 0 quarantined",
    }


def cost_run(run_dir: Path, on: bool, steps: int, seed: int) -> dict[str, Any]:
    sets = ["train.eval_every=100", "train.eval_size=512"]
    if not on:
        sets.append("security.check_fraction=0")
    args = ["run", "--seed", str(seed), "--steps", str(steps), "--run-dir", str(run_dir), "--no-progress"]
    args += ["--set", "train.max_minutes=30", "--set", "runtime.dashboard=false"]
    for s in sets:
        args += ["--set", s]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with run_dir.with_suffix(".log").open("w") as log:
        rc = subprocess.run(
            [sys.executable, "-m", "echo2.cli", *args],
            stdout=log,
            stderr=log,
            preexec_fn=lambda: os.sched_setaffinity(0, CORES),
        ).returncode
    if rc != 0:
        raise RuntimeError(f"echo2 run failed; see {run_dir.with_suffix('.log')}")
    rows = read_metrics(run_dir)
    steps_rows = [r for r in rows if "learner/step_wall_s" in r][WARMUP:steps]
    acc = [r["reward/accuracy"] for r in rows if r.get("reward/accuracy") is not None]
    sec = [r for r in rows if "security/checked_trajectories" in r]
    return {
        "step_s": statistics.fmean(r["learner/step_wall_s"] for r in steps_rows),
        "update_s": statistics.fmean(r["learner/update_s"] for r in steps_rows),
        "final_accuracy": acc[-1],
        "checked_trajectories": sec[-1]["security/checked_trajectories"] if sec else 0,
        "quarantined": sec[-1]["security/quarantined"] if sec else 0,
    }


def study_cost(out: Path, pairs: int, steps: int) -> dict[str, Any]:
    from scipy import stats

    runs = out / "adversary_runs"
    rows = []
    for i in range(pairs):
        off = cost_run(runs / f"off_{i}", False, steps, seed=i)
        on = cost_run(runs / f"on_{i}", True, steps, seed=i)
        rows.append({"off": off, "on": on, "ratio": on["step_s"] / off["step_s"]})
        on_acc, off_acc = on["final_accuracy"], off["final_accuracy"]
        print(f"cost pair {i}: {rows[-1]['ratio']:.3f}x, accuracy {on_acc:.3f} vs {off_acc:.3f}", flush=True)

    def interval(xs: list[float]) -> list[float]:
        m = statistics.fmean(xs)
        if len(xs) < 2:
            return [m, m]
        half = float(stats.t.ppf(0.975, len(xs) - 1)) * statistics.stdev(xs) / len(xs) ** 0.5
        return [m - half, m + half]

    ratios = [r["ratio"] for r in rows]
    dacc = [r["on"]["final_accuracy"] - r["off"]["final_accuracy"] for r in rows]
    return {
        "pairs": rows,
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "mean_ratio_ci95": interval(ratios),
        "accuracy_diff_mean": statistics.fmean(dacc),
        "accuracy_diff_ci95": interval(dacc),
        "steps": steps,
        "warmup": WARMUP,
        "met": statistics.median(ratios) <= TARGET_COST,
        "target": f"median over pairs of on/off mean step time <= {TARGET_COST}",
        "cores": CORES,
    }


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    att = res.get("attacks", {}).get("kinds", {})
    sampled = [k for k, v in att.items() if "median_quarantined_after" in v]
    if sampled:
        data = [[c if c is not None else BUDGET + 1 for c in att[k]["quarantined_after"]] for k in sampled]
        axes[0].boxplot(data, tick_labels=sampled)
        axes[0].axhline(TARGET_QUARANTINE, ls="--", c="r", label=f"target median <= {TARGET_QUARANTINE}")
        axes[0].set_ylabel("submissions until quarantined")
        axes[0].set_title("sampled checks (default check fraction)")
        axes[0].legend()
    cost = res.get("cost")
    if cost:
        axes[1].bar(range(len(cost["ratios"])), cost["ratios"])
        axes[1].axhline(TARGET_COST, ls="--", c="r", label=f"target <= {TARGET_COST}")
        axes[1].set_ylim(0.8, max(1.2, max(cost["ratios"]) + 0.05))
        axes[1].set_xlabel("pair")
        axes[1].set_ylabel("step time, checks on / off")
        axes[1].set_title("cost of the sampled generation check")
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", choices=["attacks", "honest", "cost", "all"], default="all")
    p.add_argument("--trials", type=int, default=20, help="identities per sampled-check attack")
    p.add_argument("--honest-steps", type=int, default=60, help="steps of the all-checked honest run")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=300, help="steps of each cost-study run")
    p.add_argument("--out", type=Path, default=ROOT / "results")
    a = p.parse_args()
    subprocess.run([sys.executable, "-m", "echo2.cli", "warmstart"], check=True, capture_output=True)
    path = a.out / "adversary.json"
    res: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    studies = ["attacks", "honest", "cost"] if a.study == "all" else [a.study]
    for s in studies:
        if s == "attacks":
            res["attacks"] = study_attacks(a.out, a.trials)
        elif s == "honest":
            res["honest"] = study_honest(a.out, a.honest_steps)
        else:
            res["cost"] = study_cost(a.out, a.pairs, a.steps)
        a.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1))
    plot(res, a.out / "adversary.png")
    print(
        json.dumps(
            {k: {kk: vv for kk, vv in v.items() if kk not in ("pairs",)} for k, v in res.items()},
            indent=1,
            default=str,
        )[:6000]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
