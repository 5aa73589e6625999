"""The asynchronous runtime measured: real runs on this machine, each study writing JSON + PNG.

    python benchmarks/runtime.py --study overlap     # echo2 run (S=3) vs echo2 train, same budget, 3 seeds
    python benchmarks/runtime.py --study staleness   # accuracy vs S; S = 3 vs S = 0 on 3 seeds, with a CI
    python benchmarks/runtime.py --study bubble      # measured bubble vs N, planner N_min, simulator beside
    python benchmarks/runtime.py --study bubble --bubble-algorithm dapo   # zero-variance groups left out
    python benchmarks/runtime.py --study worker      # a worker's delivered rollouts/s vs a bare HF loop
    python benchmarks/runtime.py --study all

Every run is a real `echo2` process (learner + worker processes on loopback) on the embedded
default; nothing here is copied from anywhere. Run it alone on the machine: the studies compare
wall-clock numbers.

Fairness, stated once for every comparison here: both sides run as child processes with the same CPU
affinity (the benchmark's own, every core of this machine; ``os.sched_setaffinity``), each with its
default thread setting, on the same embedded model, task and seeds; the warm start (the "pretrained"
checkpoint) is built once per seed before either side runs, so neither pays for it; held-out accuracy
is measured on the same test split, which shares no canonical problem with training or validation.

Targets, thresholds and sidedness are the constants below, fixed before any run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from echo2.observe.bubble import CAUSES  # noqa: E402
from echo2.observe.rundir import read_metrics  # noqa: E402
from echo2.physics.rules import KNEE_THRESHOLD, bubble_ratio  # noqa: E402
from echo2.physics.rules import knee as knee_of  # noqa: E402
from echo2.planner import capacity  # noqa: E402
from echo2_bench.record import on_record  # noqa: E402

log = logging.getLogger("runtime_bench")


REUSE = False  # --reuse: keep finished runs (a summary.json in the run directory) instead of rerunning
CORES = sorted(os.sched_getaffinity(0))  # every side of every comparison runs on exactly these cores

# targets, fixed before the runs (see each study's docstring)
OVERLAP_TARGET = "async reaches sync's end-point accuracy within the same budget (median time over seeds)"
STALENESS_TOLERANCE_POINTS = 5.0  # S = 3 may cost at most this many points of held-out accuracy ...
STALENESS_SIDEDNESS = "one-sided (non-inferiority): the 95% CI lower bound of mean(S3 - S0) >= -5 points"
STALENESS_LAST_K = 3  # ... measured as the mean of each run's last 3 evaluations
KNEE_WITHIN = 1  # the measured bubble knee within this many workers of the planner's N_min
SIM_WITHIN = 0.1  # the simulator's bubble within this of the measured one, at every N
WORKER_RATIO = 0.9  # a worker delivers at least this share of a bare engine loop's rollouts/s


def echo2(*args: str, log_to: Path) -> None:
    """Run one echo2 command to completion (its output goes to a log file)."""
    run_dir = Path(args[args.index("--run-dir") + 1])
    if REUSE and (run_dir / "summary.json").is_file():
        log.info("reusing %s", run_dir)
        return
    log_to.parent.mkdir(parents=True, exist_ok=True)
    with log_to.open("w") as fh:
        t0, launched = time.perf_counter(), time.time()
        rc = subprocess.call(
            [sys.executable, "-m", "echo2.cli", *args, "--no-progress"],
            stdout=fh,
            stderr=fh,
            preexec_fn=lambda: os.sched_setaffinity(0, CORES),
        )
    log.info("echo2 %s -> rc %d in %.0f s", " ".join(args[:1]), rc, time.perf_counter() - t0)
    if rc != 0:
        raise RuntimeError(f"echo2 {' '.join(args)} failed (rc {rc}); see {log_to}")
    (run_dir / "launched.json").write_text(json.dumps({"launched_unix": launched}))


def scored_run(d: Path, steps: int, seed: int, *extra: str) -> Path:
    """``echo2 run`` for a fixed number of steps, scored the way the accuracy studies score it: an
    evaluation of 512 held-out problems every 50 steps (see :func:`smoothed_final`); ``extra`` are
    further arguments. Returns the run directory."""
    echo2(
        "run",
        "--steps",
        str(steps),
        "--seed",
        str(seed),
        "--run-dir",
        str(d),
        "--set",
        "train.max_minutes=30",
        "--set",
        "train.eval_every=50",
        "--set",
        "train.eval_size=512",
        *extra,
        log_to=d.with_suffix(".log"),
    )
    return d


def warm_start(seed: int) -> None:
    """Build (or find) the seed's warm-started checkpoint before either side of a comparison runs."""
    subprocess.run(
        [sys.executable, "-m", "echo2.cli", "warmstart", "--seed", str(seed)], check=True, capture_output=True
    )


def setup_s(run_dir: Path) -> float:
    """Seconds from process launch to the start of the learner's main loop (imports, model load, the
    initial evaluation; for echo2 run also starting the API, the broadcast and the worker processes)."""
    launched = json.loads((run_dir / "launched.json").read_text())["launched_unix"]
    return float(json.loads((run_dir / "summary.json").read_text())["bubble"]["start_unix"] - launched)


def evals(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir) if r.get("reward/accuracy") is not None]


def steps_of(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir) if "learner/t_train_s" in r]


def smoothed_final(run_dir: Path, k: int = STALENESS_LAST_K) -> float:
    """Mean of the last k held-out evaluations (one evaluation of 256 prompts moves by ~3 points)."""
    ev = evals(run_dir)
    return statistics.fmean(r["reward/accuracy"] for r in ev[-k:])


def _plt():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ---- (1) overlap pays ------------------------------------------------------------------------------------
def study_overlap(out: Path, minutes: float, seeds: list[int]) -> dict[str, Any]:
    """echo2 run (S = 3) against echo2 train (S = 0), each with the same budget of ``minutes`` of its
    learner loop, per seed, interleaved (drift in the machine's load hits both alike). Curves are on
    the wall clock since process launch, so each side is charged its own setup. Judged: the median
    over seeds of the first time async's 3-evaluation running mean reaches the accuracy sync ended
    with (its mean of the last 3 evaluations) is within the budget; the end points beside it."""
    runs = out / "runtime_runs"
    res: dict[str, Any] = {
        "minutes": minutes,
        "seeds": seeds,
        "cores": CORES,
        "target": OVERLAP_TARGET,
        "clock": "seconds since process launch (setup included; warm start cached)",
        "sync": [],
        "async": [],
    }
    for seed in seeds:
        warm_start(seed)
        for kind, cmd in (("sync", "train"), ("async", "run")):
            d = runs / f"overlap_{kind}_s{seed}"
            echo2(
                cmd,
                "--seed",
                str(seed),
                "--max-minutes",
                str(minutes),
                "--run-dir",
                str(d),
                log_to=d.with_suffix(".log"),
            )
            summary, offset = json.loads((d / "summary.json").read_text()), setup_s(d)
            res[kind].append(
                {
                    "seed": seed,
                    "steps": summary["steps"],
                    "setup_s": offset,
                    "initial_accuracy": summary["initial_accuracy"],
                    "final_accuracy": summary["final_accuracy"],
                    "final_smoothed": smoothed_final(d),
                    "bubble_ratio": summary["bubble_ratio"],
                    "curve": [(offset + r["time_s"], r["reward/accuracy"]) for r in evals(d)],
                }
            )
    for kind in ("sync", "async"):
        res[f"{kind}_median_final"] = statistics.median(r["final_accuracy"] for r in res[kind])
        res[f"{kind}_median_smoothed"] = statistics.median(r["final_smoothed"] for r in res[kind])
        res[f"{kind}_median_steps"] = statistics.median(r["steps"] for r in res[kind])
        res[f"{kind}_median_setup_s"] = statistics.median(r["setup_s"] for r in res[kind])
    res["met_end_point"] = res["async_median_smoothed"] >= res["sync_median_smoothed"]
    pairs = list(zip(res["sync"], res["async"], strict=True))
    reach = [time_to_accuracy(a["curve"], s["final_smoothed"]) for s, a in pairs]
    budget_s = statistics.median(s["curve"][-1][0] for s, _ in pairs)  # sync's whole run, launch to end
    res["sync_median_run_s"] = budget_s
    res["async_time_to_sync_final_s"] = reach
    res["async_median_time_to_sync_final_s"] = statistics.median(reach)
    res["met_time_to_accuracy"] = res["async_median_time_to_sync_final_s"] <= budget_s
    res["at_time"] = {
        str(t): {k: statistics.median(acc_at(r["curve"], t) for r in res[k]) for k in ("sync", "async")}
        for t in range(30, int(budget_s) + 1, 30)
    }
    res["met"] = res["met_time_to_accuracy"]
    plot_overlap(res, out / "runtime_overlap.png")
    return res


def running_mean(curve: list[tuple[float, float]], k: int = 3) -> list[tuple[float, float]]:
    accs = [a for _, a in curve]
    return [(t, statistics.fmean(accs[max(0, i - k + 1) : i + 1])) for i, (t, _) in enumerate(curve)]


def time_to_accuracy(curve: list[tuple[float, float]], target: float) -> float:
    """First time the 3-evaluation running mean reaches ``target`` (inf if it never does)."""
    return next((t for t, a in running_mean(curve) if a >= target), math.inf)


def acc_at(curve: list[tuple[float, float]], t: float, window_s: float = 20.0) -> float:
    """Mean accuracy of the evaluations in (t - window, t] (both loops evaluate every 25 steps)."""
    xs = [a for tt, a in curve if t - window_s < tt <= t + 1.0]
    return statistics.fmean(xs) if xs else math.nan


def plot_overlap(res: dict[str, Any], path: Path) -> None:
    """Held-out accuracy vs wall clock of every run of the overlap study (also from a saved JSON), and
    the medians over seeds at matched times."""
    plt = _plt()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = {"sync": "echo2 train (sync)", "async": "echo2 run (S=3)"}
    for kind, color in (("sync", "C0"), ("async", "C3")):
        for i, r in enumerate(res[kind]):
            t, a = zip(*r["curve"], strict=True)
            ax.plot(t, a, color=color, alpha=0.7, lw=1, label=names[kind] if i == 0 else None)
        if "at_time" in res:
            ts = [float(t) for t in res["at_time"]]
            ax2.plot(ts, [v[kind] for v in res["at_time"].values()], "o-", color=color, label=names[kind])
    for t in res.get("async_time_to_sync_final_s", []):
        ax.axvline(t, color="C3", ls=":", lw=0.8)
    ax.set(
        xlabel="seconds since process launch",
        ylabel="held-out accuracy",
        title=f"every run, {len(res['seeds'])} seeds (dotted: async reaches sync's final)",
    )
    ax2.set(
        xlabel="seconds since process launch",
        ylabel="median held-out accuracy",
        title="medians at matched times",
    )
    for a in (ax, ax2):
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- (2) staleness sweep (Fig. 3b) -----------------------------------------------------------------------
def t_interval(xs: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """Mean and the two-sided ``level`` Student-t interval of the mean of ``xs`` (n >= 2)."""
    from scipy import stats

    n, mean = len(xs), statistics.fmean(xs)
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * statistics.stdev(xs) / math.sqrt(n)
    return mean, mean - half, mean + half


def study_staleness(
    out: Path, steps: int, values: list[int], seed: int, extra_seeds: list[int]
) -> dict[str, Any]:
    """Accuracy after ``steps`` learner steps for each S in ``values`` (seed 0: the curves), and S = 3
    against S = 0 on every seed. Per run the score is the mean of its last STALENESS_LAST_K evaluations
    (512 held-out problems each); per seed the difference S3 - S0 in points; over seeds the mean and
    its 95% t-interval. Met (declared before running, STALENESS_SIDEDNESS): the interval's lower bound
    is at least -STALENESS_TOLERANCE_POINTS."""
    runs = out / "runtime_runs"
    res: dict[str, Any] = {
        "steps": steps,
        "seeds": [seed, *extra_seeds],
        "runs": {},
        "tolerance_points": STALENESS_TOLERANCE_POINTS,
        "sidedness": STALENESS_SIDEDNESS,
        "score": f"mean of the last {STALENESS_LAST_K} evaluations (512 problems each)",
    }

    def staleness_run(S: int, run_seed: int) -> Path:
        d = runs / (f"staleness_S{S}" if run_seed == seed else f"staleness_S{S}_seed{run_seed}")
        return scored_run(d, steps, run_seed, "--staleness", str(S))

    for S in values:
        warm_start(seed)
        d = staleness_run(S, seed)
        rows = steps_of(d)
        res["runs"][str(S)] = {
            "final_accuracy": evals(d)[-1]["reward/accuracy"],
            "final_smoothed": smoothed_final(d),
            "staleness_max": max(r["store/staleness_max"] for r in rows),
            "staleness_mean": statistics.fmean(r["store/staleness_mean"] for r in rows),
            "bubble_ratio": json.loads((d / "summary.json").read_text())["bubble_ratio"],
            "wall_s": rows[-1]["time_s"],
            "reward_curve": [(r["step"], r["reward/mean"]) for r in rows],
            "accuracy_curve": [(r["step"], r["reward/accuracy"]) for r in evals(d)],
        }
    runs_ = res["runs"]
    if "0" in runs_ and "3" in runs_:
        scores = {seed: {S: runs_[str(S)]["final_smoothed"] for S in (0, 3)}}
        for extra in extra_seeds:
            warm_start(extra)
            scores[extra] = {S: smoothed_final(staleness_run(S, extra)) for S in (0, 3)}
        diffs = [100 * (sc[3] - sc[0]) for sc in scores.values()]
        mean, lo, hi = t_interval(diffs)
        res["scores_per_seed"] = {str(k): v for k, v in scores.items()}
        res["s3_minus_s0_points_per_seed"] = diffs
        res["s3_minus_s0_points_mean"] = mean
        res["s3_minus_s0_points_ci95"] = [lo, hi]
        res["met"] = lo >= -STALENESS_TOLERANCE_POINTS
        res["within_two_sided_band"] = lo >= -STALENESS_TOLERANCE_POINTS and hi <= STALENESS_TOLERANCE_POINTS
    res["staleness_never_exceeds_S"] = all(r["staleness_max"] <= int(S) for S, r in runs_.items())
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for S, r in runs_.items():
        st, rw = zip(*r["reward_curve"], strict=True)
        k = 25  # moving average over steps
        smooth = [statistics.fmean(rw[max(0, i - k) : i + 1]) for i in range(len(rw))]
        axes[0].plot(st, smooth, label=f"S = {S}")
        axes[1].plot(*zip(*r["accuracy_curve"], strict=True), "o-", label=f"S = {S}")
    axes[0].set(
        xlabel="learner step", ylabel="train reward (25-step mean)", title="Reward vs staleness (Fig. 3b)"
    )
    axes[1].set(xlabel="learner step", ylabel="held-out accuracy", title="Held-out accuracy")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "runtime_staleness.png", dpi=110)
    return res


# ---- (3) bubble vs workers (Fig. 3c), planner N_min, simulator beside ----------------------------------
def study_bubble(
    out: Path,
    ns: list[int],
    throttle: float,
    minutes: float,
    warmup: int,
    task: str | None = None,
    overrides: tuple[str, ...] = (),
    tag: str = "",
) -> dict[str, Any]:
    """``task``: run the study on another task's embedded default (``--task``), e.g. poker; ``tag``: a
    suffix of the run directories and the plot (``runtime_bubble_<tag>.png``);
    ``overrides``: config fields set for every run of the study (``--set``), e.g. ``grpo.algorithm=dapo``.
    The planner's N_min is for the rollouts a batch can use: ``mu_min / useful``, ``useful`` the runs'
    measured ``pool/useful_share`` (1 when nothing is left out; below it with zero-variance filtering)."""
    from echo2.config import load_config, task_preset
    from echo2.sim.engine import SimParams, SimWorker, simulate

    cfg = load_config(overrides=[*(task_preset(task) if task else []), *overrides])
    task_args = ["--task", task] if task else []
    task_args += [x for o in overrides for x in ("--set", o)]
    R, S, kappa = cfg.batch.rollouts, cfg.staleness.S, cfg.staleness.effective_kappa
    lease = cfg.runtime.lease_prompts * cfg.batch.group_size
    runs = out / "runtime_runs"
    rows_out = []
    for n in ns:
        d = runs / f"bubble{'_' + task if task else ''}{'_' + tag if tag else ''}_N{n}"
        echo2(
            "run",
            *task_args,
            "--workers",
            str(n),
            "--max-minutes",
            str(minutes),
            "--run-dir",
            str(d),
            "--set",
            f"runtime.worker_max_rollouts_per_s={throttle}",
            "--set",
            "controller.sustain_s=1e9",  # keep all N active: this study measures the pool as given
            "--set",
            "train.eval_every=100000",
            log_to=d.with_suffix(".log"),
        )
        rows = steps_of(d)[warmup:-1]  # the last step holds the end-of-run evaluation
        wall = sum(r["learner/step_wall_s"] for r in rows)
        update = sum(r["learner/update_s"] for r in rows)
        bc = [r["broadcast/t_bcast_s"] for r in rows if r.get("broadcast/t_bcast_s") is not None]
        mu = [r["pool/mu_pool"] / n for r in rows[len(rows) // 2 :]]
        useful = [r["pool/useful_share"] for r in rows[len(rows) // 2 :] if r.get("pool/useful_share")]
        rows_out.append(
            {
                "n": n,
                "steps": len(rows),
                "bubble_measured": bubble_ratio(update, wall),
                "idle_share_by_cause": {
                    c: sum(r[f"learner/idle_s/{c}"] for r in rows) / wall for c in CAUSES
                },
                "t_train_s": update / len(rows),
                "t_bcast_s": statistics.median(bc) if bc else 0.0,
                "mu_worker": statistics.median(mu),
                "useful_share": statistics.median(useful) if useful else 1.0,
                "zero_variance_share": statistics.mean(
                    r.get("learner/zero_variance_share", 0.0) for r in rows
                ),
            }
        )
    # planner inputs measured on the real runs: medians over all runs
    t_train = statistics.median(r["t_train_s"] for r in rows_out)
    t_bcast = statistics.median(r["t_bcast_s"] for r in rows_out)
    mu_w = statistics.median(r["mu_worker"] for r in rows_out)
    useful = statistics.median(r["useful_share"] for r in rows_out)
    mu_min = capacity.mu_min(kappa=kappa, t_train=t_train, t_bcast=t_bcast, rollouts=R)
    n_min = capacity.n_min(mu_min / useful, mu_w)
    n_min_all_trained = capacity.n_min(mu_min, mu_w)  # what the planner said before the yield counted
    for r in rows_out:  # the simulator, fed with each run's own measured T_train and the shared rates
        params = SimParams(
            rollouts_per_step=R,
            group_size=lease,
            t_train_s=r["t_train_s"],
            staleness=S,
            kappa=kappa,
            learner_usd_per_hour=cfg.runtime.learner_usd_per_hour,
            snapshot_bytes=3.2e6,
            b0_bytes_per_s=1.25e10,
            strategy="tree-pipelined",
            steps=max(60, r["steps"] + warmup),
            reload_s=r["t_bcast_s"],
            noise_sigma=0.05,
            straggler_prob=0.0,
            overlap_generation=True,
            warmup_steps=warmup,
            buffer_steps=min(cfg.runtime.max_inflight_batches, S + 1),
            record_metrics=False,
            useful_share=useful,  # the groups a batch can use, as the runs measured it (1: every group)
        )
        workers = [SimWorker(f"w{i}", "cpu", 0.35, mu_w, 1.25e10) for i in range(r["n"])]
        r["bubble_sim"] = simulate(params, workers, [w.worker_id for w in workers]).summary["bubble_ratio"]
        r["abs_diff"] = abs(r["bubble_sim"] - r["bubble_measured"])
    knee = knee_of([r["n"] for r in rows_out], [r["bubble_measured"] for r in rows_out])
    res = {
        "throttle_rollouts_per_s": throttle,
        "minutes_per_run": minutes,
        "warmup_steps": warmup,
        "R": R,
        "kappa": kappa,
        "staleness": S,
        "max_inflight_batches": cfg.runtime.max_inflight_batches,
        "t_train_s": t_train,
        "t_bcast_s": t_bcast,
        "mu_worker": mu_w,
        "mu_min": mu_min,
        "useful_share": useful,
        "n_min": n_min,
        "n_min_if_every_rollout_trained": n_min_all_trained,
        "overrides": list(overrides),
        "knee_measured": knee,
        "knee_rule": f"smallest N with bubble ratio <= {KNEE_THRESHOLD:.0%} (echo2.physics.rules.knee)",
        "knee_sim": knee_of([r["n"] for r in rows_out], [r["bubble_sim"] for r in rows_out]),
        "bubble_definition": "1 - update s / wall s over steps [warmup, last), every cause counted",
        "runs": rows_out,
        "knee_within_one": knee is not None and abs(knee - n_min) <= KNEE_WITHIN,
        "sim_within_0_1": all(r["abs_diff"] <= SIM_WITHIN for r in rows_out),
    }
    res["met"] = res["knee_within_one"] and res["sim_within_0_1"]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(ns, [r["bubble_measured"] for r in rows_out], "o-", label="measured (echo2 run)")
    ax.plot(ns, [r["bubble_sim"] for r in rows_out], "s--", label="simulator, same inputs")
    ax.axvline(n_min, color="k", ls=":", label=f"planner N_min = {n_min}")
    ax.set(
        xlabel="rollout workers N",
        ylabel="learner bubble ratio",
        title=f"Bubble vs workers (S = {S}, kappa = {kappa})",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{task + '_' if task else 'runtime_'}bubble{'_' + tag if tag else ''}.png", dpi=110)
    return res


# ---- (4) worker overhead vs a bare HF-engine loop ------------------------------------------------------
T_TRAIN_S = 0.2  # the embedded default's measured seconds per update (results/learning.json)


async def _serve_drain(
    cfg: Any, seconds: float, warmup: float, tmp: Path, tls: bool = False, t_train_s: float = T_TRAIN_S
) -> dict[str, Any]:
    """A learner node without training: the real parts (``runtime.node.assemble``: registry, pool,
    lease broker, intake, snapshots, routes), store and TCP broadcast, and a loop that takes each batch
    as soon as it is complete, while versions advance every ``t_train_s`` and a snapshot is published
    every kappa versions, the cadence of the real learner: the worker installs and relays snapshots as
    often as in a run, but never waits for the learner to consume. ``tls``: both planes under a run
    certificate the worker pins (``echo2.transport``), as a real learner serves them by default."""
    import time as _time

    from echo2.broadcast.factory import get_strategy, open_publisher
    from echo2.data.store import TrajectoryStore
    from echo2.models.policy import load_checkpoint
    from echo2.models.snapshot import skeleton_files, snapshot_blob
    from echo2.runtime.members import WorkerRegistry
    from echo2.runtime.node import assemble, worker_settings
    from echo2.runtime.routes import Identity
    from echo2.tasks.registry import build_task
    from echo2.tasks.warm_cache import starting_checkpoint
    from echo2.transport import join_string, run_identity
    from echo2.weights.manifest import new_signing_key

    policy = load_checkpoint(starting_checkpoint(cfg))
    cert = run_identity(tmp, ["127.0.0.1"]) if tls else None
    key, token, version = new_signing_key(), "bench-token-0123456789abcdef", [0]
    store = TrajectoryStore(tmp / "store.sqlite", cfg.staleness.S, cfg.batch.group_size)
    registry = WorkerRegistry(tmp, token, _time.time)
    pub = open_publisher("tcp", key, get_strategy("tree-pipelined"), 256 << 10, ledger=registry, tls=cert)
    broadcast = await pub.start()
    skeleton = skeleton_files(policy.source, policy.model, policy.tokenizer, tmp / "skeleton")
    identity = Identity(worker_settings(cfg), key.verifier().to_text(), broadcast, skeleton)
    parts = assemble(
        cfg,
        registry,
        store,
        build_task(cfg.task, cfg.seed),
        pub,
        identity,
        int(policy.model.config.vocab_size),
        lambda: version[0],
        _time.time,
        data_ready=(ready := asyncio.Event()).set,  # set on every admitted submission, as the learner waits
    )
    blob = snapshot_blob(policy.model)
    await parts.snapshots.publish(0, blob)
    runner, port = await parts.routes.serve("127.0.0.1", 0, cert.server_context() if cert else None)
    env = {**os.environ, "ECHO2_JOIN_TOKEN": token}
    cmd = [
        sys.executable,
        "-m",
        "echo2.cli",
        "worker",
        "--join",
        join_string(f"{'https' if cert else 'http'}://127.0.0.1:{port}", cert.fingerprint if cert else None),
        "--name",
        "bench",
    ]
    with (tmp / "worker.log").open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=fh, env=env)
    last_pub = time.perf_counter()
    k, taken, taken_mark = 0, 0, 0
    t_warm: float | None = None
    t_mark: float | None = None
    t_end = math.inf
    try:
        while time.perf_counter() < t_end:
            if time.perf_counter() - last_pub >= t_train_s:  # versions advance at the learner's pace
                last_pub = time.perf_counter()
                version[0] += 1
                if version[0] % cfg.staleness.effective_kappa == 0:
                    await parts.snapshots.publish(version[0], blob)
            batch = store.take_batch(cfg.batch.prompts, version[0], step=k + 1)
            if batch is None:
                ready.clear()
                with contextlib.suppress(TimeoutError):  # until data lands or the next version is due
                    await asyncio.wait_for(ready.wait(), t_train_s - (time.perf_counter() - last_pub))
                continue
            k += 1
            taken += sum(len(g) for g in batch)
            now = time.perf_counter()
            if t_warm is None and version[0] >= 3:  # the worker is up and installs snapshots
                t_warm = now + warmup
            if t_mark is None and t_warm is not None and now >= t_warm:
                t_mark, taken_mark = now, taken
                t_end = t_mark + seconds
        t_stop = time.perf_counter()  # the counting window ends here, before the shutdown below
    finally:
        parts.broker.finished = True
        await asyncio.sleep(1.0)
        proc.terminate()
        proc.wait(10)
        await parts.snapshots.close()
        await runner.cleanup()
        store.close()
    assert t_mark is not None
    return {"delivered_rollouts": taken - taken_mark, "seconds": t_stop - t_mark, "versions": version[0]}


def _bare_loop(cfg: Any, seconds: float) -> dict[str, Any]:
    """The worker's rollout function (``rollout.episodes.collect``: single-turn groups, or episodes with
    the same self-play pool a worker keeps) on the same model with the worker's batch (one lease),
    back to back."""
    import copy
    import random

    from echo2.models.policy import configure_torch, load_checkpoint
    from echo2.rollout.engines.hf import HFEngine
    from echo2.rollout.opponents import SelfPlayPool
    from echo2.tasks.registry import build_task
    from echo2.tasks.warm_cache import starting_checkpoint
    from echo2.types import Bounds
    from echo2.weights.delta import sampler_copy

    configure_torch(cfg)
    policy = load_checkpoint(starting_checkpoint(cfg))
    task = build_task(cfg.task, cfg.seed)
    engine = HFEngine(policy.model, policy.eos_id, policy.pad_id, cfg.sampling)
    pool = None
    if "selfplay" in getattr(cfg.task, "opponents", ()):
        opp = HFEngine(copy.deepcopy(policy.model), policy.eos_id, policy.pad_id, cfg.sampling)
        pool = SelfPlayPool(
            opp, policy.codec, cfg.task.selfplay_every, cfg.task.selfplay_pool, cfg.sampling.max_new_tokens
        )
        pool.offer(0, sampler_copy(policy.model, cfg.snapshot.dtype))
    rng = random.Random(0)
    n, k = 0, 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        prompts = task.sample_train(rng, cfg.runtime.lease_prompts)
        b = task.collect(
            policy.codec,
            engine,
            prompts,
            cfg.batch.group_size,
            seed=k,
            policy_version=0,
            group_prefix=str(k),
            bounds=Bounds.of(cfg),
            opponent_policy=pool.policy_for if pool is not None else None,
        )
        n += len(b.trajectories)
        k += 1
    return {"rollouts": n, "seconds": time.perf_counter() - t0}


def study_worker(
    out: Path,
    seconds: float,
    trials: int,
    overrides: tuple[str, ...] = (),
    name: str = "runtime_worker",
    t_train_s: float = T_TRAIN_S,
) -> dict[str, Any]:
    """``trials`` interleaved pairs (served worker, then bare loop, ``seconds`` each); the ratio of each
    pair and their median, so drift in the shared machine's load hits both sides of a pair alike."""
    import tempfile

    from echo2.config import load_config

    cfg = load_config(overrides=["controller.sustain_s=1e9", *overrides])
    pairs = []
    for _ in range(trials):
        with tempfile.TemporaryDirectory() as tmp:
            served = asyncio.run(_serve_drain(cfg, seconds, 3.0, Path(tmp), t_train_s=t_train_s))
        bare = _bare_loop(cfg, seconds)
        worker_rate = served["delivered_rollouts"] / served["seconds"]
        bare_rate = bare["rollouts"] / bare["seconds"]
        pairs.append(
            {
                "worker_delivered_rollouts_per_s": worker_rate,
                "bare_loop_rollouts_per_s": bare_rate,
                "ratio": worker_rate / bare_rate,
                "served": served,
                "bare": bare,
            }
        )
        log.info("worker pair %d: %.3f x", len(pairs), pairs[-1]["ratio"])
    ratio = statistics.median(p["ratio"] for p in pairs)
    worker_rate = statistics.median(p["worker_delivered_rollouts_per_s"] for p in pairs)
    res = {
        "seconds": seconds,
        "trials": trials,
        "batch_rollouts": cfg.runtime.lease_prompts * cfg.batch.group_size,
        "ratios": [p["ratio"] for p in pairs],
        "ratio": ratio,
        "worker_delivered_rollouts_per_s": worker_rate,
        "bare_loop_rollouts_per_s": statistics.median(p["bare_loop_rollouts_per_s"] for p in pairs),
        "pairs": pairs,
        "target": f">= {WORKER_RATIO} x the bare loop (median of interleaved pairs)",
        "met": ratio >= WORKER_RATIO,
    }
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(1, trials + 1)
    ax.plot(xs, [p["bare_loop_rollouts_per_s"] for p in pairs], "o-", color="C0", label="bare HF loop")
    ax.plot(
        xs,
        [p["worker_delivered_rollouts_per_s"] for p in pairs],
        "o-",
        color="C3",
        label="echo2 worker (delivered, end to end)",
    )
    ax.plot(xs, [0.9 * p["bare_loop_rollouts_per_s"] for p in pairs], ":", color="k", label="0.9 x bare")
    ax.set(
        xlabel="interleaved pair",
        ylabel="rollouts / s",
        title=f"Worker throughput: median {ratio:.2f} x bare ({trials} pairs)",
        xticks=list(xs),
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=110)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", choices=["overlap", "staleness", "bubble", "worker", "all"], default="all")
    p.add_argument("--reading", default="", help="what changed since the study's last reading (kept with it)")
    p.add_argument("--out", type=Path, default=ROOT / "results")
    p.add_argument("--overlap-minutes", type=float, default=3.0)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--staleness-steps", type=int, default=300)
    p.add_argument("--staleness-values", type=int, nargs="+", default=[0, 1, 3, 6, 11])
    p.add_argument("--bubble-ns", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    p.add_argument("--bubble-throttle", type=float, default=400.0, help="rollouts/s per worker")
    p.add_argument("--bubble-minutes", type=float, default=1.0)
    p.add_argument(
        "--bubble-algorithm", default=None, help="a grpo.algorithm preset for every run (dapo: zero-variance "
        "groups left out; writes runtime_bubble_dapo.json)",
    )  # fmt: skip
    p.add_argument("--worker-seconds", type=float, default=20.0)
    p.add_argument("--worker-trials", type=int, default=5, help="interleaved worker / bare-loop pairs")
    p.add_argument("--reuse", action="store_true", help="analyse finished runs under OUT/runtime_runs again")
    a = p.parse_args()
    global REUSE
    REUSE = a.reuse
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    a.out.mkdir(parents=True, exist_ok=True)
    studies = ["worker", "bubble", "staleness", "overlap"] if a.study == "all" else [a.study]
    for study in studies:
        if study == "overlap":
            res = study_overlap(a.out, a.overlap_minutes, a.seeds)
        elif study == "staleness":
            res = study_staleness(a.out, a.staleness_steps, a.staleness_values, a.seeds[0], a.seeds[1:])
        elif study == "bubble":
            tag = a.bubble_algorithm or ""
            sets = (f"grpo.algorithm={tag}",) if tag else ()
            res = study_bubble(
                a.out, a.bubble_ns, a.bubble_throttle, a.bubble_minutes, warmup=10, overrides=sets, tag=tag
            )
            study = f"bubble_{tag}" if tag else study
        else:
            res = study_worker(a.out, a.worker_seconds, a.worker_trials)
        path = a.out / f"runtime_{study}.json"
        earlier = json.loads(path.read_text()) if path.exists() else None
        path.write_text(json.dumps(on_record(earlier, res, a.reading), indent=1))  # earlier readings kept
        summary = {k: v for k, v in res.items() if not isinstance(v, list | dict)}
        log.info("%s: %s", study, json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
