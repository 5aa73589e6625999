"""Does `echo2 train` learn on a 2-core CPU, and what does one GRPO update cost?

1. Learning: runs `echo2 train` (the real CLI, a fresh process per seed) on the embedded default for
   each seed and records held-out greedy accuracy against wall-clock time. Targets: each seed gains
   >= 25 points over its starting checkpoint within 10 minutes, the median gain >= 40 points.
2. Update cost: on one batch of R real rollouts, times `GRPOTrainer.update` against a bare PyTorch
   forward + backward + AdamW step of the same model on the same tokens (interleaved repetitions,
   ratio of medians). Target: <= 1.5x.

Writes results/learning.json and results/learning.png.

    python benchmarks/learning.py                 # 3 seeds, the default time budget
    python benchmarks/learning.py --quick         # smoke run (tiny budget), for checking the script

3. The loss presets (``--presets``): each ``grpo.algorithm`` preset (and the config's own defaults,
   ``default``) through `echo2 run` on the embedded default (the learner and its 2 local workers,
   staleness S = 3: the presets differ in how they treat off-policy tokens, and a synchronous loop
   is on-policy, where CISPO's and clip-higher's gradients equal PPO's), the same seeds, the same budget in
   updates (``--preset-steps``, no wall-clock limit: every arm trains as many versions on as many
   prompts, whatever the machine's speed), the same warm start per seed. Read: the held-out gain (the
   last evaluation minus the first), its mean over the seeds with a 95% t interval, and each preset's
   gain minus the default's on the same seed (paired: same warm start, same held-out set) with its
   interval; an interval that holds 0 is reported as no difference. Beside it the mean entropy and
   zero-variance share of the updates, the run's yield (``store/yield``), the wall seconds. A reading:
   no target.
   Writes results/learning_presets.json and .png.

    python benchmarks/learning.py --presets       # 6 arms x 3 seeds x 200 updates, ~1 hour here
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_seed(seed: int, out: Path, extra: list[str], name: str = "", command: str = "train") -> dict:
    run_dir = out / f"{name}seed{seed}"
    cmd = [
        sys.executable,
        "-m",
        "echo2.cli",
        command,
        "--seed",
        str(seed),
        "--run-dir",
        str(run_dir),
        "--no-progress",
        *extra,
    ]
    # warm start outside the timed run: it is the "pretrained model" (cached), not RL
    subprocess.run(
        [sys.executable, "-m", "echo2.cli", "warmstart", "--seed", str(seed), *_config_only(extra)],
        check=True,
        capture_output=True,
    )
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - t0
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    curve = [(r["time_s"], r["reward/accuracy"]) for r in records if "reward/accuracy" in r]
    start = curve[0][1]
    return {
        "seed": seed,
        "process_wall_s": wall,
        "steps": records[-1]["step"],
        "initial_accuracy": start,
        "final_accuracy": curve[-1][1],
        "best_accuracy": max(a for _, a in curve),
        "gain_final": curve[-1][1] - start,
        "curve_time_s": [t for t, _ in curve],
        "curve_accuracy": [a for _, a in curve],
        # per update, over the run: the policy's entropy and the share of groups with no signal
        "entropy_mean": _mean_of(records, "learner/entropy"),
        "zero_variance_share_mean": _mean_of(records, "learner/zero_variance_share"),
        "yield": records[-1].get("store/yield"),  # echo2 run's: the share of received rollouts trained
    }


def _mean_of(records: list[dict], key: str) -> float | None:
    xs = [r[key] for r in records if isinstance(r.get(key), (int, float)) and r[key] == r[key]]
    return statistics.fmean(xs) if xs else None


def _t95(xs: list[float]) -> dict:
    """Mean and 95% Student-t interval of ``xs`` (runtime.t_interval; unbounded for one value)."""
    from runtime import t_interval  # benchmarks/runtime.py, as the other studies read theirs

    if len(xs) < 2:
        return {"mean": statistics.fmean(xs), "lo": -math.inf, "hi": math.inf, "n": len(xs)}
    mean, lo, hi = t_interval(xs)
    return {"mean": mean, "lo": lo, "hi": hi, "n": len(xs)}


PRESET_ARMS = ["default", "grpo", "dr_grpo", "dapo", "gspo", "cispo"]


def study_presets(
    seeds: list[int],
    steps: int,
    out: Path,
    extra: list[str],
    arms_run: list[str] | None = None,
    earlier: dict | None = None,
) -> dict:
    """Every arm of ``arms_run`` (``PRESET_ARMS`` by default; the default config is always one, the
    pairing base) x ``seeds`` (arms interleaved within a seed), ``steps`` updates each; with ``earlier``
    (a results file of this study with the same budget), its runs of these arms on other seeds join the
    statistics (their curves are not redrawn)."""
    runs = out / "learning_runs"
    budget = ["--set", f"train.steps={steps}", "--set", "train.max_minutes=1000", *extra]
    chosen = ["default", *[a for a in (arms_run or PRESET_ARMS) if a != "default"]]
    rows: dict[str, list[dict]] = {arm: [] for arm in chosen}
    if earlier is not None:
        if earlier["budget"]["updates"] != steps:
            raise SystemExit(f"--with: its runs had {earlier['budget']['updates']} updates, not {steps}")
        for arm in chosen:
            rows[arm] += [r for r in earlier["arms"][arm]["runs"] if r["seed"] not in seeds]
    for seed in seeds:
        for arm in chosen:
            algo = [] if arm == "default" else ["--set", f"grpo.algorithm={arm!r}"]
            r = run_seed(seed, runs, [*budget, *algo], name=f"preset_{arm}_", command="run")
            rows[arm].append(r)
            print(f"{arm} seed {seed}: {r['initial_accuracy']:.3f} -> {r['final_accuracy']:.3f}, "
                  f"{r['steps']} steps in {r['process_wall_s']:.0f} s", flush=True)  # fmt: skip
    base = {r["seed"]: r["gain_final"] for r in rows["default"]}
    arms = {}
    for arm, rs in rows.items():
        gains = [r["gain_final"] for r in rs]
        paired = _t95([r["gain_final"] - base[r["seed"]] for r in rs]) if arm != "default" else None
        arms[arm] = {
            "gain": _t95(gains),
            "gain_minus_default": paired,
            "differs_from_default": None if paired is None else not (paired["lo"] <= 0 <= paired["hi"]),
            "entropy_mean": _mean_or_none([r["entropy_mean"] for r in rs]),
            "zero_variance_share_mean": _mean_or_none([r["zero_variance_share_mean"] for r in rs]),
            "wall_s_mean": statistics.fmean(r["process_wall_s"] for r in rs),
            "yield_mean": _mean_or_none([r["yield"] for r in rs]),
            "runs": [{k: v for k, v in r.items() if not k.startswith("curve_")} for r in rs],
            "curves": [[r["curve_time_s"], r["curve_accuracy"]] for r in rs if "curve_time_s" in r],
        }
    return {
        "source": "runtime: echo2 run (the learner and 2 local workers, S = 3: off-policy as users run it), "
        "embedded default, one run at a time",
        "budget": {
            "updates": steps,
            "seeds": sorted({r["seed"] for rs in rows.values() for r in rs}),
            "seeds_run_here": seeds,
            "extra_args": extra,
        },
        "gain_definition": "held-out greedy accuracy at the last evaluation minus at the first (step 0)",
        "interval": "95% Student t over the seeds; paired by seed against the default config",
        "target": None,
        "arms": arms,
    }


def _points(iv: dict) -> str:
    return f"{iv['mean'] * 100:+.1f} points [{iv['lo'] * 100:+.1f}, {iv['hi'] * 100:+.1f}]"


def _mean_or_none(xs: list[float | None]) -> float | None:
    ys = [x for x in xs if x is not None]
    return statistics.fmean(ys) if ys else None


def plot_presets(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = result["arms"]
    names = list(arms)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, name in enumerate(names):
        g = arms[name]["gain"]
        lo, hi = (g["mean"] - g["lo"]) * 100, (g["hi"] - g["mean"]) * 100
        ax.errorbar([i], [g["mean"] * 100], yerr=[[lo], [hi]], fmt="o", capsize=5, color="C0")
        seeds = [r["gain_final"] * 100 for r in arms[name]["runs"]]
        ax.scatter([i] * len(seeds), seeds, color="grey", s=12, zorder=3)
    ax.set_xticks(range(len(names)), names)
    ax.axhline(0, color="black", lw=0.5)
    ax.set_ylabel("held-out gain (points): mean, 95% t interval, each seed")
    ax.set_title(f"echo2 run, embedded default: {result['budget']['updates']} updates per run")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _config_only(extra: list[str]) -> list[str]:
    """The flags of `extra` that `echo2 warmstart` also takes (config, --set)."""
    out, it = [], iter(extra)
    for flag in it:
        if flag in ("--set", "--config", "-c"):
            out += [flag, next(it)]
    return out


def update_cost(seed: int, reps: int, extra: list[str]) -> dict:
    import random

    import torch

    from echo2.cli.common import add_config_arguments, load_from_args
    from echo2.learner.logprobs import completion_logprobs, pack
    from echo2.learner.trainer import GRPOTrainer
    from echo2.models.policy import configure_torch, load_checkpoint
    from echo2.rollout.collect import collect_groups
    from echo2.rollout.engines.hf import HFEngine
    from echo2.tasks.registry import build_task
    from echo2.tasks.warm_cache import starting_checkpoint

    # resolve the config exactly as `echo2 train` does for the same flags
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    cfg = load_from_args(parser.parse_args([*_config_only(extra), "--seed", str(seed)]))
    configure_torch(cfg)
    policy = load_checkpoint(starting_checkpoint(cfg))
    task = build_task(cfg.task, seed)
    engine = HFEngine(policy.model, policy.eos_id, policy.pad_id, cfg.sampling)
    rollouts = collect_groups(
        policy.codec,
        engine,
        task,
        task.sample_train(random.Random(seed), cfg.batch.prompts),
        cfg.batch.group_size,
        seed=seed,
        policy_version=0,
        group_prefix="bench",
    )
    # fixed mixed rewards so every group carries signal, whatever the sampled completions were
    trajs = [replace(t, reward=float(i % 3 == 0)) for i, t in enumerate(rollouts.trajectories)]
    model = policy.model
    trainer = GRPOTrainer(model, cfg.grpo, cfg.sampling, policy.pad_id, task.token_mask)
    masks = [task.token_mask(t.completion_ids, t.meta) for t in trajs]
    bare_opt = torch.optim.AdamW(model.parameters(), lr=1e-12)
    batch = pack(trajs, masks, policy.pad_id)

    def bare() -> None:
        # the floor: forward, a token log-likelihood loss on the completion tokens, backward, AdamW
        logp = completion_logprobs(model, batch, 1.0)
        loss = -(logp * batch.mask_BT).sum() / batch.mask_BT.sum()
        bare_opt.zero_grad(set_to_none=True)
        loss.backward()
        bare_opt.step()

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    for _ in range(3):  # warm-up both paths
        bare()
        trainer.update(trajs)
    t_bare, t_grpo = [], []
    for _ in range(reps):
        t_bare.append(timed(bare))
        t_grpo.append(timed(lambda: trainer.update(trajs)))
    return {
        "rollouts": len(trajs),
        "tokens": int(batch.mask_BT.sum()),
        "bare_median_s": statistics.median(t_bare),
        "grpo_update_median_s": statistics.median(t_grpo),
        "ratio": statistics.median(t_grpo) / statistics.median(t_bare),
        "reps": reps,
        "kl_beta": cfg.grpo.kl_beta,
        "num_minibatches": cfg.grpo.num_minibatches,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2.2, 1]})
    for r in result["seeds"]:
        ax.plot([t / 60 for t in r["curve_time_s"]], r["curve_accuracy"], label=f"seed {r['seed']}")
    ax.axvline(10, color="grey", ls=":", label="10 min")
    ax.set_xlabel("wall clock (min)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("echo2 train, embedded default, 2-core CPU")
    ax.set_ylim(0, 1)
    ax.legend()
    u = result["update_cost"]
    bx.bar(
        ["bare fwd+bwd+opt", "GRPO update"],
        [u["bare_median_s"] * 1e3, u["grpo_update_median_s"] * 1e3],
        color=["#999", "#1f77b4"],
    )
    bx.set_ylabel("median ms / step")
    bx.set_title(f"update cost: {u['ratio']:.2f}x bare (target <= 1.5x)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--reps", type=int, default=30, help="timed repetitions of each update path")
    ap.add_argument("--quick", action="store_true", help="tiny budget: checks the script, not the claim")
    ap.add_argument("--presets", action="store_true", help="the loss presets study (3.) instead of 1. and 2.")
    ap.add_argument("--preset-steps", type=int, default=200, help="updates per run of the presets study")
    ap.add_argument("--arms", nargs="+", choices=PRESET_ARMS, help="the presets study's arms (default: all)")
    ap.add_argument("--label", default="learning_presets", help="the presets study's results file name")
    ap.add_argument("--with", dest="earlier", type=Path, help="an earlier presets results file to join")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="flags passed to `echo2 train` after --")
    args = ap.parse_args()
    extra = [x for x in args.extra if x != "--"]
    out = Path(args.out)
    if args.presets:
        out.mkdir(parents=True, exist_ok=True)
        steps = 20 if args.quick else args.preset_steps
        quick = ["--set", "train.eval_every=10"] if args.quick else []
        earlier = json.loads(args.earlier.read_text()) if args.earlier else None
        res = study_presets(args.seeds, steps, out, [*extra, *quick], args.arms, earlier)
        name = f"{args.label}_quick" if args.quick else args.label
        (out / f"{name}.json").write_text(json.dumps(res, indent=2))
        plot_presets(res, out / f"{name}.png")
        for arm, a in res["arms"].items():
            d = a["gain_minus_default"]
            vs = "" if d is None else f"; minus the default's {_points(d)}"
            print(f"{arm:8s} gain {_points(a['gain'])}{vs}")
        return 0
    if args.quick:
        extra = ["--max-minutes", "0.2", "--set", "train.eval_every=10", *extra]
        args.reps = 3
    runs = out / "learning_runs"
    runs.mkdir(parents=True, exist_ok=True)
    seeds = [run_seed(s, runs, extra) for s in args.seeds]
    gains = [r["gain_final"] for r in seeds]
    result = {
        "seeds": seeds,
        "median_gain": statistics.median(gains),
        "min_gain": min(gains),
        "max_process_wall_s": max(r["process_wall_s"] for r in seeds),
        "targets": {"each_gain": 0.25, "median_gain": 0.40, "wall_s": 600, "update_ratio": 1.5},
        "update_cost": update_cost(args.seeds[0], args.reps, extra),
        "extra_args": extra,
    }
    result["met"] = {
        "each_gain": result["min_gain"] >= 0.25,
        "median_gain": result["median_gain"] >= 0.40,
        "wall": result["max_process_wall_s"] <= 600,
        "update_ratio": result["update_cost"]["ratio"] <= 1.5,
    }
    (out / "learning.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "learning.png")
    print(json.dumps({k: v for k, v in result.items() if k != "seeds"}, indent=2))
    for r in seeds:
        print(
            f"seed {r['seed']}: {r['initial_accuracy']:.3f} -> {r['final_accuracy']:.3f} "
            f"(+{r['gain_final'] * 100:.1f} pts) in {r['process_wall_s']:.0f} s, {r['steps']} steps"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
