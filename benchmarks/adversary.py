"""Strangers' machines against the learner: what each attack gets, what the checks cost.

Studies, each on real ``echo2 run`` / ``echo2 learner`` + ``echo2 worker`` processes (the embedded
default, TLS on) with the attackers of `echo2_bench/adversary.py` joining over the wire with the run's
join string and token, set up exactly as a real worker sets up. Targets, thresholds and sidedness are
fixed here, before any run:

- **attacks**: for every sampled-check attack (another model, tampered log-probs, best-of-n
  cherry-picking, an inflated version) ``--trials`` fresh identities each submit until quarantined
  (budget 30 submissions); for every deterministic one (forged reward, foreign prompt, deflated
  version, replay, log-prob poison at -100 / -1e4 / -1e30, a version never published) 7 identities
  submit 3 times each and every submission must be refused. Every identity is scored: one the pool
  released (a surplus worker, no lease for a minute) before it was caught counts as not caught (budget
  + 1 in the median). Targets: sampled attacks quarantined within a median of <= 5 submissions;
  deterministic attacks 100% refused and 0 of their groups trained on (for replay: 0 replayed copies,
  its first submissions being its own honest work). Since the learner grades every completion itself
  (no grading secret on the wire), forged rewards are no longer refused: their target is 0 groups stored
  with a reward that is not the task's grade.
- **tasks** (added with the verifiers adapter; targets fixed before its first run): the reward forger,
  best-of-n cherry-picking and the foreign prompt against a run of ``--task verifiers`` (the bundled
  taskset's reward functions) and one of ``--task code`` (unit tests in the sandbox), with the targets
  above: 0 stored rewards that are not the task's grade, best-of-n quarantined within a median of <= 5
  submissions, every foreign prompt refused and none trained. ``--task verifiers_env`` (the bundled
  multi-turn env; added with it, the same targets, an episode's grade being the learner's replay's
  return; ``--tasks`` picks the tasks). ``verifiers_judge`` and ``verifiers_env_judge`` (added with
  judges on the learner, the same targets; not in the default ``--tasks``): the judged sums
  (``verifiers_example:load_judged_taskset``) and the judged probe env (``load_judged_probe``), graded by a
  reference judge stand-in this process serves on loopback (``echo2_bench/judge.py``), ``task.judges =
  "learner"``; the attackers run in this process, whose environment holds the judge's key too (a
  cherry-picker of the sums may call the judge itself: a stranger with its own judge).
- **honest**: every completion of every submission re-run (``security.check_fraction = 1``, a check
  queue that declines none) on honest workers until >= 10,000 trajectories were checked. Target: 0
  quarantines.
- **honest_bf16** (added with ``security.engine_precision``, target fixed before its first run): the
  same with the workers' HF engines computing in bfloat16 and the run declaring it
  (``runtime.engine_dtype = security.engine_precision = "bfloat16"``). Target: >= 10,000 re-run, 0
  quarantines.
- **honest_bf16_vllm** (added after honest_bf16, target fixed before its first run): the same with
  the workers' vLLM engines in bfloat16 (``runtime.engine = "vllm"``; needs scripts/install-vllm.sh).
  Target: >= 10,000 re-run, 0 quarantines.
- **bf16_errors** (a reading, no target): honest bf16 HF-engine completions of the warm-started
  embedded default re-run by a check computing in float32 and by one computing in bfloat16 (the
  engines' dtype: what the learner's check does since), every error kept: median, p99, max.
- **restart** (added with run epochs; target fixed before its first run): ``echo2 learner`` + an
  honest worker; 4 identities each install the weights, take a lease and generate its groups; the
  learner is killed (SIGKILL) and resumed on its run directory (the next epoch); each identity then
  submits its old lease's groups and asks for a lease with its old weights, then catches up and works.
  Targets: every stale submission and lease request refused ``stale_epoch`` (the submissions counted
  under ``store/rejected/stale_epoch``), 0 groups admitted twice, 0 groups of the old leases stored,
  every identity admitted after catching up, the resumed learner 10 steps past the crash, 0
  tracebacks.
- **cost**: interleaved pairs of runs, the sampled check off and at its default: median on/off step
  time <= 1.05; the accuracy difference is reported with its t-interval.
- **poison**: ``echo2 learner`` + one honest worker while identities submit groups whose every sampler
  log-prob is -100, -1e4 or -1e30, twice: as configured (the validator's bound refuses them), and with
  the door open (``security.min_logprob = -1e308``: the poison reaches the loss), killed with SIGKILL
  right after a step that trained poison. Then ``--resume`` on the same run directory. Targets: every
  poison submission refused or harmless; both learners and both resumes exit 0, the first at its time
  budget, with no non-finite loss.
- **liveness**: one honest worker at 300 rollouts/s (``runtime.worker_max_rollouts_per_s``); after a
  warm-up the attackers of a condition join for a 60 s window: a rate liar (10,000 rollouts/s claimed
  at $0.01/h, heartbeats only), 2 / 4 / 8 hoarders (lease all they may, never answer), a stalling relay
  (joins the broadcast, accepts pulls, sends nothing, acks every install). Step rate = learner steps in
  the window / its seconds; each condition's rate over the baseline's (no attackers) of the same
  repeat, 3 interleaved repeats. Targets: median ratio >= 0.8 for the liar and the hoarders, >= 0.9
  for the stalling relay.
- **length_honest**, **length_honest_bf16**, **length_honest_bf16_vllm**, **length_attacks**,
  **stale_flood**: at real answer lengths, with attackers that adapt (``echo2_bench/length_studies.py``
  states their targets); they write results/adversary_length.json (the honest ones gathered a shard a
  run, results/adversary_length_shards/).
- **garbage**: the garbage suite (`echo2_bench/garbage.py`: deep JSON bodies and tokens, lone
  surrogates, NUL in a header, Content-Length with Transfer-Encoding, a short body, a price of
  1e-300, an install_s of 1e308, a 5,000-deep broadcast frame header, over-budget snapshot pulls, a
  request flood) against a learner with an honest worker. Targets: 0 responses with status 500,
  every item its expected refusal, 0 tracebacks in the learner's log.

Writes results/adversary.json and results/adversary.png.

    python benchmarks/adversary.py                       # every study
    python benchmarks/adversary.py --study attacks --trials 20
    python benchmarks/adversary.py --study liveness --repeats 3
    python benchmarks/adversary.py --study perimeter      # strangers at both ports
    python benchmarks/adversary.py --study preauth_cost   # what an unauthenticated request costs the loop
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from echo2.observe.rundir import read_metrics  # noqa: E402
from echo2_bench import length_studies as ls  # noqa: E402
from echo2_bench import perimeter_study, preauth_cost  # noqa: E402
from echo2_bench.adversary_runs import CORES, ledger, start_run, stop, wait_ready  # noqa: E402
from echo2_bench.record import on_record  # noqa: E402

# length_attacks last: it leaves this process at the workers' niceness and torch on one thread
# (adversary_length_runs.attacks_run), which a study run after it in `--study all` would inherit
LENGTH_STUDIES = ("length_honest", "length_honest_bf16", "length_honest_bf16_vllm", "stale_flood",
                  "length_attacks")  # fmt: skip

TARGET_QUARANTINE = 5  # submissions, median over trials
TARGET_COST = 1.05
TARGET_LIVENESS = 0.8  # step rate with a rate liar or hoarders / without, median of the repeats
TARGET_STALLER = 0.9  # the same with a stalling relay in the topology
HONEST_CHECKED = 10_000
WARMUP = 20
BUDGET = 30  # submissions one sampled-attack identity may make before the trial counts as not caught
ATTACKER_PROMPTS = 2  # prompts per attacker lease (its generations stay short beside the run)
HONEST_RATE = 300.0  # rollouts/s of the liveness study's honest worker
HONEST_RATE_RESTART = 100.0  # rollouts/s of the restart study's honest worker
RESTART_STEPS_AFTER = 10  # learner steps the resumed process must train past the crash
LIVENESS_WARM_S = 20.0  # after the first step: T_train measured, the controller has its target
LIVENESS_WINDOW_S = 60.0
CONDITIONS = ("baseline", "rate_lie", "hoard_2", "hoard_4", "hoard_8", "staller")


async def attack(info: dict[str, Any], token: str, kinds: list[str], trials: int) -> list[dict[str, Any]]:
    import aiohttp

    from echo2_bench.adversary import DETERMINISTIC, REGRADED, Attacker, attack_until_caught

    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for kind in kinds:
            att = Attacker(info["join"], token, kind, session, max_prompts=ATTACKER_PROMPTS)
            await att.start()
            few = kind in DETERMINISTIC + REGRADED
            n = max(3, (trials + 2) // 3) if few else trials  # 7 x 3 >= 20 submissions
            budget = 3 if few else BUDGET
            t0 = time.perf_counter()
            got = await attack_until_caught(att, n, budget)
            await att.close()
            out += [{**vars(t), "seconds": (time.perf_counter() - t0) / n} for t in got]
            caught = [t.quarantined_after for t in got]
            print(f"{kind}: {caught} {[t.outcomes[-1] if t.outcomes else None for t in got]}", flush=True)
    return out


def study_attacks(
    out: Path,
    trials: int,
    task: str | None = None,
    kinds: tuple[str, ...] | None = None,
    overrides: tuple[str, ...] = (),
    name: str | None = None,
) -> dict[str, Any]:
    """``task``: the run's task preset (``--task``; the embedded default when None), ``overrides`` on top
    of it (``name`` its runs' directory then); ``kinds``: the attacks run (every one when None)."""
    from echo2.config import task_preset
    from echo2_bench.adversary import ATTACKS, DETERMINISTIC, REGRADED, SAMPLED
    from echo2_bench.adversary_length import regrade

    kinds = kinds or ATTACKS
    name = name or task
    run_dir = out / "adversary_runs" / ("attacks" + (f"_{name}" if name else ""))
    preset = task_preset(task) if task else []
    proc = start_run(run_dir, *preset, *overrides, "runtime.workers=1", "security.max_workers=1000")
    try:
        info = wait_ready(run_dir, proc)
        token = (run_dir / "join_token").read_text().strip()
        trials_out = asyncio.run(attack(info, token, list(kinds), trials))
    finally:
        stop(proc)
    per_kind: dict[str, Any] = {}
    for kind in kinds:
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
        if kind in REGRADED:  # nothing refused: what is stored must be the learner's grades, not its claims
            entry["stored_rewards_not_the_grade"] = regrade(run_dir, [t["worker_id"] for t in ts])
            entry["met"] = entry["stored_rewards_not_the_grade"] == 0
        elif kind in SAMPLED:
            # every identity is scored: one not caught (within the budget, or before the pool released
            # it) counts as BUDGET + 1; the median of the identities the pool kept is the old reading
            released = [t for t in ts if t["released"] and t["quarantined_after"] is None]
            score = [c if c is not None else BUDGET + 1 for c in caught]
            judged = [
                c if c is not None else BUDGET + 1
                for t, c in zip(ts, caught, strict=True)
                if t not in released
            ]
            entry["median_quarantined_after"] = statistics.median(score)
            entry["median_quarantined_after_released_left_out"] = (
                statistics.median(judged) if judged else None
            )
            entry["not_caught"] = sum(1 for c in caught if c is None)
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


# what a stranger could send to raise its reward on a task whose grader is not arithmetic: a claimed
# reward (replaced by the learner's grade), best-of-n completions (the generation check), another prompt
TASK_ATTACKS = ("reward", "cherry", "prompt")


REWARD_TASKS = ("verifiers", "code", "verifiers_env")
JUDGED_TASKS = {  # a judged task: (its task preset, the loader of the bundled judged taskset or env)
    "verifiers_judge": ("verifiers", "load_judged_taskset"),
    "verifiers_env_judge": ("verifiers_env", "load_judged_probe"),
}
JUDGE_KEY_VAR = "ECHO2_JUDGE_KEY"


def study_tasks(out: Path, trials: int, tasks: tuple[str, ...] = REWARD_TASKS) -> dict[str, Any]:
    """The attacks of ``TASK_ATTACKS`` against a run of each task whose reward is computed by code the
    learner runs: ``verifiers`` (the bundled taskset's reward functions), ``code`` (unit tests in the
    sandbox) and ``verifiers_env`` (the bundled multi-turn env, its episodes replayed and re-scored),
    with the targets of the attacks study: 0 stored rewards that are not the task's grade (an episode's:
    the replay's return), best-of-n caught within a median of TARGET_QUARANTINE submissions, every
    foreign prompt refused. A task of ``JUDGED_TASKS`` runs against a judge stand-in served here."""
    import secrets

    from echo2_bench.judge import LoopbackJudge

    res: dict[str, Any] = {}
    with LoopbackJudge() as judge:
        os.environ[JUDGE_KEY_VAR] = secrets.token_hex(8)  # the learner's (and this process's) key
        for task in tasks:
            if task not in JUDGED_TASKS:
                res[task] = study_attacks(out, trials, task, TASK_ATTACKS)
                continue
            preset, loader = JUDGED_TASKS[task]
            n = ", n = 2048" if preset == "verifiers_env" else ""
            judged = (
                f"task.env=echo2.data.tasks.verifiers_example:{loader}",
                f'task.env_args={{judge_url = "{judge.url}", judge_key_var = "{JUDGE_KEY_VAR}"{n}}}',
                "task.judges=learner",
                "task.grade_threads=16",
            )
            before = len(judge.calls)
            res[task] = study_attacks(out, trials, preset, TASK_ATTACKS, judged, task)
            res[task]["judge_calls"] = len(judge.calls) - before
    res["met"] = all(all(k["met"] for k in res[t]["kinds"].values()) for t in tasks)
    return res


def _honest_quarantined(run_dir: Path) -> int:
    workers = json.loads((run_dir / "workers.json").read_text())
    return sum(1 for w in workers if w["quarantined"] and not w["name"].startswith("attacker-"))


def study_honest(out: Path, steps: int, precision: str = "float32", engine: str = "hf") -> dict[str, Any]:
    """Every completion of every submission re-run, the workers' engines (``engine``) computing in
    ``precision`` and the run declaring it (``security.engine_precision``: the check's tolerances follow
    it); the check queue is sized so that no drawn submission is declined."""
    name = (
        "honest"
        + ("" if precision == "float32" else f"_{precision}")
        + ("" if engine == "hf" else f"_{engine}")
    )
    run_dir = out / "adversary_runs" / name
    proc = start_run(
        run_dir,
        "security.check_fraction=1.0",
        "security.check_samples=1000000",
        "security.check_queue=100000",
        f"runtime.engine={engine}",
        f"runtime.engine_dtype={precision}",
        f"security.engine_precision={precision}",
        steps=steps,
    )
    try:
        code = proc.wait(3600)  # non-zero when every worker was quarantined: still a reading
    finally:
        stop(proc)
    last = [r for r in read_metrics(run_dir) if "security/checked_trajectories" in r][-1]
    sec = {k: v for k, v in last.items() if k.startswith("security/")}
    checked = int(sec["security/checked_trajectories"])
    return {
        "steps": steps,
        "steps_done": int(last.get("step", 0)),
        "run_exit": code,
        "engine_precision": precision,
        "engine": engine,
        "security": sec,
        "checked_trajectories": checked,
        "quarantined": int(sec["security/quarantined"]),
        "met": checked >= HONEST_CHECKED and sec["security/quarantined"] == 0,
        "target": f">= {HONEST_CHECKED} honest trajectories re-run, 0 quarantined",
    }


def study_bf16_errors(rounds: int) -> dict[str, Any]:
    """The generation check's error on honest bf16 samples, checked in float32 and in bfloat16 (the
    engines' compute dtype, ``security.engine_precision``): the warm-started embedded default, an HF
    engine computing in bfloat16 with the published bf16 weights, ``rounds`` x 16 arithmetic prompts x
    4 samples under the seeded sampler; each completion re-run by a check computing in each dtype with
    no tolerance (every error kept). A reading that motivates a design, no target: the verdicts are
    the honest_bf16 study's."""
    import copy
    import random

    import torch

    from echo2.check.rerun import GenerationCheck
    from echo2.config import SecurityConfig, load_config
    from echo2.data.store import Lease
    from echo2.data.submission import Submission
    from echo2.models.policy import load_checkpoint
    from echo2.models.snapshot import aliasing_model, install_weights
    from echo2.rollout.engines.hf import HFEngine
    from echo2.tasks.warm_cache import warmstart_checkpoint
    from echo2.types import Prompt, Trajectory
    from echo2.weights.delta import sampler_copy

    cfg = load_config()
    policy = load_checkpoint(warmstart_checkpoint(cfg))
    weights = sampler_copy(policy.model, "bfloat16")
    engine_model = copy.deepcopy(policy.model).to(torch.bfloat16)
    install_weights(engine_model, weights)
    engine = HFEngine(engine_model, policy.eos_ids, policy.pad_id, cfg.sampling)
    loose = SecurityConfig(logprob_tolerance=1e9, gumbel_tolerance=1e9)  # every error kept, none refused
    checks = {
        dtype: GenerationCheck(aliasing_model(policy.model, dtype), cfg.sampling, loose, rng=random.Random(0))
        for dtype in ("float32", "bfloat16")
    }
    for check in checks.values():
        check.keep(1, weights)
    rng, groups_of = random.Random(1), 4
    errors: dict[str, list[float]] = {dtype: [] for dtype in checks}
    for _ in range(rounds):
        prompts = [Prompt(f"p{i}", f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=", "0") for i in range(16)]
        encoded = [policy.encode_prompt(p.text) for p in prompts]
        seed = rng.getrandbits(62)
        samples = engine.generate([ids for ids in encoded for _ in range(groups_of)], seed=seed)
        groups = tuple(
            tuple(
                Trajectory(p.prompt_id, "L", tuple(ids), s.completion_ids, s.logprobs, 0.0, 1)
                for s in samples[i * groups_of : (i + 1) * groups_of]
            )
            for i, (p, ids) in enumerate(zip(prompts, encoded, strict=True))
        )
        lease, sub = Lease("L", "w", "open", 0.0, tuple(prompts), seed, 1), Submission("L", 1, groups)
        picks = [(i, j) for i in range(len(prompts)) for j in range(groups_of)]
        for dtype, check in checks.items():
            errors[dtype] += [v.max_logprob_error for v in check.check(lease, sub, picks)]
    lp_tol, _ = SecurityConfig(engine_precision="bfloat16").tolerances()

    def summary(errs: list[float]) -> dict[str, Any]:
        errs = sorted(errs)
        return {
            "completions": len(errs),
            "median": statistics.median(errs),
            "p99": errs[int(0.99 * len(errs))],
            "max": errs[-1],
            "over_bf16_logprob_tolerance": sum(e > lp_tol for e in errs),
        }

    by_dtype = {dtype: summary(errs) for dtype, errs in errors.items()}
    return {
        "what": "per completion, the largest |claimed - recomputed| sampler log-prob of an honest bf16 HF "
        "engine's completion, the check computing in each dtype",
        "bf16_logprob_tolerance": lp_tol,
        "check_dtype": by_dtype,
        "median_ratio_float32_over_bfloat16": by_dtype["float32"]["median"]
        / max(by_dtype["bfloat16"]["median"], 1e-12),
    }


def study_restart(out: Path, holders: int) -> dict[str, Any]:
    """Leases and weights of a learner process that crashed, used against the one resumed after it."""
    from echo2_bench.adversary_runs import restart_run

    run_dir = out / "adversary_runs" / "restart"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    got = restart_run(run_dir, holders, HONEST_RATE_RESTART, RESTART_STEPS_AFTER)
    hs = got["holders"]
    met = (
        got["epoch_after"] == got["epoch_before"] + 1
        and all(h["stale_submit"] == "stale_epoch" and h["stale_lease"] == "stale_epoch" for h in hs)
        and got["rejected_stale_epoch"] >= len(hs)
        and got["groups_admitted_twice"] == 0
        and got["old_lease_groups_stored"] == 0
        and all(h["then"] in ("admitted", "pending_check") for h in hs)
        and got["steps_after_resume"] >= got["step"] + RESTART_STEPS_AFTER
        and got["tracebacks"] == 0
    )
    return {
        **got,
        "target": "every stale lease and version refused stale_epoch (counted), 0 groups admitted twice, "
        "0 groups of the old leases stored, every holder admitted after catching up, the resumed "
        f"learner {RESTART_STEPS_AFTER} steps past the crash, 0 tracebacks",
        "met": met,
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
    from runtime import t_interval  # benchmarks/runtime.py, as the other studies read theirs

    runs = out / "adversary_runs"
    rows = []
    for i in range(pairs):
        off = cost_run(runs / f"off_{i}", False, steps, seed=i)
        on = cost_run(runs / f"on_{i}", True, steps, seed=i)
        rows.append({"off": off, "on": on, "ratio": on["step_s"] / off["step_s"]})
        on_acc, off_acc = on["final_accuracy"], off["final_accuracy"]
        print(f"cost pair {i}: {rows[-1]['ratio']:.3f}x, accuracy {on_acc:.3f} vs {off_acc:.3f}", flush=True)

    def interval(xs: list[float]) -> list[float]:
        if len(xs) < 2:
            return [statistics.fmean(xs)] * 2
        _, lo, hi = t_interval(xs)
        return [lo, hi]

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


def study_poison(out: Path, minutes: float, resume_minutes: float) -> dict[str, Any]:
    """Poison refused (as configured) and harmless (door open); a resume on each run directory."""
    from echo2_bench.adversary_runs import poison_run

    runs = {}
    for door_open in (False, True):
        name = "door_open" if door_open else "as_configured"
        got = poison_run(
            out / "adversary_runs" / f"poison_{name}", door_open, minutes, resume_minutes, HONEST_RATE
        )
        outcomes = [o for t in got["trials"] for o in t["outcomes"]]
        got["outcomes"] = {o: outcomes.count(o) for o in sorted(set(outcomes))}
        got["met"] = (
            got["resume_exit"] == 0
            and (door_open or got["learner_exit"] == 0)
            and (door_open or got["time_budget_reached"] >= 1)
            and got["non_finite_in_log"] == 0
            and got["tracebacks"] == 0
            and got["loss_finite"]
            and (door_open or outcomes.count("admitted") == 0)
        )
        runs[name] = got
        print(f"poison {name}: {got['outcomes']}, met {got['met']}", flush=True)
    return {
        "runs": runs,
        "met": all(r["met"] for r in runs.values()),
        "target": "every poison submission refused (as configured) or harmless (door open); the learner "
        "exits 0 at its time budget (as configured), no non-finite loss, and --resume on the same "
        "directory exits 0 at its own",
    }


def study_liveness(out: Path, repeats: int, window_s: float) -> dict[str, Any]:
    """Step rate beside attackers that never submit a forgery, over the baseline's, run by run."""
    from echo2_bench import adversary_runs as ar

    attacks = {
        "baseline": None, "rate_lie": ar.liar_attack, "hoard_2": ar.hoard_attack(2),
        "hoard_4": ar.hoard_attack(4), "hoard_8": ar.hoard_attack(8), "staller": ar.staller_attack,
    }  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONDITIONS}
    for i in range(repeats):  # interleaved: every condition once per repeat
        for cond in CONDITIONS:
            run_dir = out / "adversary_runs" / f"live_{cond}_{i}"
            got = ar.liveness_run(run_dir, attacks[cond], LIVENESS_WARM_S, window_s, HONEST_RATE)
            got["broadcast"] = ar.broadcast_counters(run_dir)
            runs[cond].append(got)
            print(f"liveness {cond} #{i}: {got['step_rate']:.3f} steps/s", flush=True)
    result: dict[str, Any] = {
        "runs": runs,
        "window_s": window_s,
        "warm_s": LIVENESS_WARM_S,
        "repeats": repeats,
    }
    for cond in CONDITIONS[1:]:
        ratios = [a["step_rate"] / b["step_rate"] for a, b in zip(runs[cond], runs["baseline"], strict=True)]
        target = TARGET_STALLER if cond == "staller" else TARGET_LIVENESS
        med = statistics.median(ratios)
        result[cond] = {"ratios": ratios, "median_ratio": med, "target": target, "met": med >= target}
    result["baseline_step_rates"] = [r["step_rate"] for r in runs["baseline"]]
    result["met"] = all(result[c]["met"] for c in CONDITIONS[1:])
    result["target"] = (
        f"median over repeats of step rate (condition) / step rate (baseline of the same repeat) >= "
        f"{TARGET_LIVENESS} for the rate liar and 2 / 4 / 8 hoarders, >= {TARGET_STALLER} for a stalling "
        "relay"
    )
    return result


def study_garbage(out: Path) -> dict[str, Any]:
    """The garbage suite against a learner with an honest worker; 500s and tracebacks counted."""
    from echo2_bench import garbage
    from echo2_bench.adversary_runs import last_step, wait_step

    run_dir = out / "adversary_runs" / "garbage"
    proc = start_run(run_dir, "runtime.workers=1", "security.max_workers=1000")
    try:
        wait_ready(run_dir, proc)
        wait_step(run_dir, proc, 3)
        blank = garbage.target_of_run(run_dir, "")
        credential = asyncio.run(garbage.register(blank.api, blank.cert_pem, blank.token))
        step0 = last_step(run_dir)
        outcomes = asyncio.run(garbage.run_garbage(garbage.target_of_run(run_dir, credential)))
        time.sleep(5)
        steps_during = last_step(run_dir) - step0
        rc = stop(proc)
    finally:
        stop(proc)
    text = run_dir.with_suffix(".log").read_text(errors="replace")
    statuses = [s for o in outcomes.values() for s in o.statuses]
    bad = garbage.problems(outcomes)
    return {
        "items": {
            k: {"statuses": sorted(set(o.statuses)), "n": len(o.statuses)} for k, o in outcomes.items()
        },
        "responses": len(statuses),
        "status_500": sum(1 for s in statuses if s >= 500),
        "tracebacks": text.count("Traceback"),
        "problems": bad,
        "steps_during": steps_during,
        "learner_exit": rc,
        "met": not bad
        and not any(s >= 500 for s in statuses)
        and "Traceback" not in text
        and steps_during > 0,
        "target": "0 responses with status 500, every item its expected refusal, 0 tracebacks in the "
        "learner's log, training goes on",
    }


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
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
    live = res.get("liveness")
    if live:
        conds = [c for c in CONDITIONS[1:] if c in live]
        for i, c in enumerate(conds):
            axes[2].scatter([i] * len(live[c]["ratios"]), live[c]["ratios"], c="k", s=12)
            axes[2].hlines(live[c]["target"], i - 0.3, i + 0.3, colors="r", linestyles="--")
        axes[2].set_xticks(range(len(conds)), conds)
        axes[2].set_ylim(0.5, 1.2)
        axes[2].set_ylabel("step rate / baseline's (same repeat)")
        axes[2].set_title("attackers that never forge (red: target)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    studies = [
        "attacks", "tasks", "honest", "honest_bf16", "honest_bf16_vllm", "bf16_errors", "restart", "cost",
        "poison", "liveness", "garbage", "perimeter", "preauth_cost", *LENGTH_STUDIES,
    ]  # fmt: skip
    p.add_argument("--study", choices=[*studies, "all"], default="all")
    p.add_argument("--repeats", type=int, default=3, help="repeats of every liveness condition")
    p.add_argument("--window", type=float, default=LIVENESS_WINDOW_S, help="seconds of the liveness window")
    p.add_argument(
        "--perimeter-only",
        default="",
        help="comma-separated attacks of the perimeter study to run alone (recorded as perimeter_<names>)",
    )
    p.add_argument("--poison-minutes", type=float, default=2.0, help="time budget of each poison learner")
    p.add_argument("--trials", type=int, default=20, help="identities per sampled-check attack")
    p.add_argument(
        "--tasks",
        nargs="+",
        choices=[*REWARD_TASKS, *JUDGED_TASKS],
        default=list(REWARD_TASKS),
        help="the tasks study's tasks",
    )
    p.add_argument("--honest-steps", type=int, default=60, help="steps of the all-checked honest run")
    p.add_argument("--reading", default="", help="what changed since the study's last reading (kept with it)")
    p.add_argument("--bf16-rounds", type=int, default=20, help="rounds of 16 x 4 completions (bf16_errors)")
    p.add_argument("--holders", type=int, default=4, help="identities holding leases across the restart")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=300, help="steps of each cost-study run")
    p.add_argument("--length", type=int, default=256, help="completion tokens of the length_* studies")
    p.add_argument("--length-n", type=int, default=10_000, help="completions re-run by length_honest(_bf16)")
    p.add_argument(
        "--length-minutes",
        type=float,
        default=0.0,
        help="stop length_honest(_bf16) or length_attacks after this",
    )
    p.add_argument(
        "--length-shard", type=int, default=None, help="length_honest(_bf16): the shard (default: next)"
    )
    p.add_argument(
        "--length-rows", type=int, default=ls.SHARD_ROWS, help="length_honest(_bf16): a batch's rows"
    )
    p.add_argument(
        "--length-pool", action="store_true", help="length_honest(_bf16): pool the shards, run none"
    )
    p.add_argument(
        "--flood-width", type=int, default=6, help="flooding identities at a time (length_attacks)"
    )
    p.add_argument(
        "--length-kinds",
        default="",
        help="length_attacks: some attackers alone, comma-separated (default: all)",
    )
    p.add_argument("--out", type=Path, default=ROOT / "results")
    a = p.parse_args()
    subprocess.run([sys.executable, "-m", "echo2.cli", "warmstart"], check=True, capture_output=True)
    path = a.out / "adversary.json"
    res: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}

    def honest_shard(dtype: str, engine: str = "hf") -> dict[str, Any]:  # length_honest(_bf16)(_vllm)
        return ls.study_length_honest(a.out, dtype, a.length_n, a.length, a.length_minutes, a.length_shard,
                                      a.length_rows, engine, a.length_pool)  # fmt: skip

    run = {
        "attacks": lambda: study_attacks(a.out, a.trials),
        "tasks": lambda: study_tasks(a.out, a.trials, tuple(a.tasks)),
        "honest": lambda: study_honest(a.out, a.honest_steps),
        "honest_bf16": lambda: study_honest(a.out, a.honest_steps, "bfloat16"),
        "honest_bf16_vllm": lambda: study_honest(a.out, a.honest_steps, "bfloat16", "vllm"),
        "bf16_errors": lambda: study_bf16_errors(a.bf16_rounds),
        "restart": lambda: study_restart(a.out, a.holders),
        "cost": lambda: study_cost(a.out, a.pairs, a.steps),
        "poison": lambda: study_poison(a.out, a.poison_minutes, a.poison_minutes / 2),
        "liveness": lambda: study_liveness(a.out, a.repeats, a.window),
        "garbage": lambda: study_garbage(a.out),
        "perimeter": lambda: perimeter_study.run_study(a.out),  # echo2_bench/perimeter_study.py
        "preauth_cost": lambda: preauth_cost.run_cost(),  # echo2_bench/preauth_cost.py
        "length_honest": lambda: honest_shard("float32"),
        "length_honest_bf16": lambda: honest_shard("bfloat16"),
        "length_honest_bf16_vllm": lambda: honest_shard("bfloat16", "vllm"),
        "length_attacks": lambda: ls.study_length_attacks(
            a.out,
            a.length,
            a.flood_width,
            a.length_minutes,
            a.length_kinds.split(",") if a.length_kinds else None,
        ),
        "stale_flood": lambda: ls.study_stale_flood(a.out, a.repeats, a.window, LIVENESS_WARM_S, HONEST_RATE),
    }
    for s in studies if a.study == "all" else [a.study]:
        if s in LENGTH_STUDIES:  # a results file of their own: results/adversary_length.json
            ls.record(a.out, s, run[s](), a.reading)
            continue
        if s == "perimeter" and a.perimeter_only:  # some attacks alone: a record of their own
            only = a.perimeter_only.split(",")
            key = "perimeter_" + "_".join(only)
            res[key] = on_record(res.get(key), perimeter_study.run_study(a.out, only=only), a.reading)
            path.write_text(json.dumps(res, indent=1))
            continue
        res[s] = on_record(res.get(s), run[s](), a.reading)  # every earlier reading kept
        a.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1))
    plot(res, a.out / "adversary.png")
    if "perimeter" in res:
        alone = tuple(v for k, v in res.items() if k.startswith("perimeter_"))  # attacks re-read alone
        perimeter_study.plot(res["perimeter"], a.out / "adversary_perimeter.png", alone)
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
