"""Sustained, durable ingest into the trajectory store: how many trajectories/s can the learner accept?

Each iteration is what the learner node does for one worker submission: issue a lease (8 prompts),
parse the JSON body a worker would send into the protocol's ``SubmitRequest`` (8 groups x 8 samples, ~10
prompt + ~8 completion tokens; JSON and schema in one pass, as the learner's route does),
validate it (``validate_submission``) and submit it (``TrajectoryStore.submit``, one fsynced
transaction). A learner is interleaved: whenever 16 groups are buffered it takes a batch
(``take_batch``), bumps its version, reads ``stats()`` and ``outstanding_rollouts()`` for its metrics,
prunes groups consumed 8 steps ago, and expires leases once a second. Submissions carry a version
0..S-1 behind the learner, so all are admitted. Target: >= 2,000 trajectories/s, everything included,
on the 2-core box, with SQLite in WAL mode and ``synchronous=FULL`` on the results disk.

Writes results/store_ingest.json and results/store_ingest.png.

    nice -n 19 python benchmarks/store_ingest.py                # ~10 s
    python benchmarks/store_ingest.py --seconds 3 --out /tmp/r  # quick check of the script
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from echo2.data.store import TrajectoryStore  # noqa: E402
from echo2.data.submission import SubmissionLimits, parse_model, validate_submission  # noqa: E402
from echo2.protocol import SubmitRequest  # noqa: E402
from echo2.types import Prompt  # noqa: E402

log = logging.getLogger("store_ingest")

TARGET_TRAJ_PER_S = 2000.0
GROUPS, GROUP_SIZE, STALENESS = 8, 8, 3
BATCH_GROUPS = 16  # learner batch: 16 prompts x 8 samples = 128 trajectories per step
LIMITS = SubmissionLimits(
    vocab_size=151_936,
    group_size=GROUP_SIZE,
    max_prompt_tokens=512,
    max_completion_tokens=512,
    max_groups=GROUPS,
)


def make_groups(rng: random.Random, prompt_ids: list[str]) -> list[dict[str, Any]]:
    """One submission's groups: prompt of 8-12 tokens shared by the group, completions of 6-10 tokens."""
    groups = []
    for pid in prompt_ids:
        prompt = [rng.randrange(LIMITS.vocab_size) for _ in range(rng.randint(8, 12))]
        samples = []
        for _ in range(GROUP_SIZE):
            n = rng.randint(6, 10)
            samples.append(
                {
                    "prompt_ids": prompt,
                    "completion_ids": [rng.randrange(LIMITS.vocab_size) for _ in range(n)],
                    "sampler_logprobs": [-rng.expovariate(2.0) for _ in range(n)],
                    "reward": float(rng.random() < 0.5),
                    "meta": {"parsed": True, "truncated": False, "worker": "w07"},
                }
            )
        groups.append({"prompt_id": pid, "samples": samples})
    return groups


def run(seconds: float, db_path: Path, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    store = TrajectoryStore(db_path, staleness=STALENESS, group_size=GROUP_SIZE)
    # a pool of distinct payloads (prompt ids p0..p7 of each template), reused round-robin
    templates = []
    for k in range(32):
        pids = [f"t{k}-p{i}" for i in range(GROUPS)]
        prompts = [
            Prompt(prompt_id=p, text=f"What is {k} + {i}?", answer=str(k + i)) for i, p in enumerate(pids)
        ]
        templates.append((prompts, make_groups(rng, pids)))
    learner_version, step = 0, 0
    t_lease = t_decode = t_validate = t_submit = t_learner = 0.0
    submit_lat: list[float] = []
    done_at: list[float] = []  # completion time of each submission (s since start)
    trained = admitted = 0
    next_expire = 1.0
    t0 = time.perf_counter()
    i = 0
    while (now := time.perf_counter() - t0) < seconds:
        prompts, groups = templates[i % len(templates)]
        i += 1
        a = time.perf_counter()
        lease = store.issue_lease("w07", prompts, now=now, ttl_s=60.0)
        b = time.perf_counter()
        version = max(0, learner_version - rng.randrange(STALENESS))
        raw = json.dumps({"lease_id": lease, "policy_version": version, "groups": groups}).encode()
        c = time.perf_counter()  # encoding above stands in for the worker; not timed
        body = parse_model(SubmitRequest, raw)  # JSON and schema in one pass, as the learner's route does
        d = time.perf_counter()
        sub = validate_submission(body, LIMITS, latest_published=learner_version)
        e = time.perf_counter()
        res = store.submit(sub, "w07", learner_version=learner_version, now=now)
        f = time.perf_counter()
        admitted += res.admitted
        t_lease += b - a
        t_decode += d - c
        t_validate += e - d
        t_submit += f - e
        submit_lat.append(f - e)
        # the learner, interleaved on the same thread
        g0 = time.perf_counter()
        while (batch := store.take_batch(BATCH_GROUPS, learner_version, step + 1)) is not None:
            step += 1
            learner_version += 1
            trained += sum(len(grp) for grp in batch)
            store.stats().metrics()
            store.outstanding_rollouts()
            if step > 8:
                store.prune_consumed(step - 8)
        if now >= next_expire:
            store.expire_leases(now)
            next_expire += 1.0
        t_learner += time.perf_counter() - g0
        done_at.append(time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    stats = store.stats()
    store.close()
    db_bytes = sum(p.stat().st_size for p in db_path.parent.iterdir() if p.name.startswith(db_path.name))

    per_sub = GROUPS * GROUP_SIZE
    n_traj = len(done_at) * per_sub
    timed = t_lease + t_decode + t_validate + t_submit + t_learner
    bins = [0] * int(seconds + 1)
    for t in done_at:
        bins[min(int(t), len(bins) - 1)] += per_sub
    full_bins = bins[: int(wall)]  # whole seconds only
    validate_only = n_traj / t_validate
    store_s = t_lease + t_submit + t_learner
    return {
        "submissions": len(done_at),
        "trajectories": n_traj,
        "wall_s": wall,
        "traj_per_s": n_traj / wall,
        "traj_per_s_timed_phases": n_traj / timed,
        "per_second_bins": bins,
        "min_full_second_traj": min(full_bins) if full_bins else None,
        "phases_s": {
            "issue_lease": t_lease,
            "json_decode": t_decode,
            "validate": t_validate,
            "submit": t_submit,
            "learner_take_stats_prune_expire": t_learner,
            "untimed_worker_side_encode": wall - timed,
        },
        "phase_us_per_traj": {
            "json_decode": 1e6 * t_decode / n_traj,
            "validate": 1e6 * t_validate / n_traj,
            "store": 1e6 * store_s / n_traj,
            "store_issue_lease": 1e6 * t_lease / n_traj,
            "store_submit": 1e6 * t_submit / n_traj,
            "store_learner_side": 1e6 * t_learner / n_traj,
        },
        "validate_only_traj_per_s": validate_only,
        "store_only_traj_per_s": n_traj / store_s,
        "submit_latency_ms": {
            "p50": 1e3 * statistics.median(submit_lat),
            "p99": 1e3 * sorted(submit_lat)[int(0.99 * (len(submit_lat) - 1))],
            "max": 1e3 * max(submit_lat),
        },
        "learner_steps": step,
        "trajectories_trained": trained,
        "store_stats": {
            "size": stats.size,
            "admitted": stats.admitted,
            "dropped_stale": stats.dropped_stale,
            "rejected": stats.rejected,
        },
        "admitted_matches": admitted == stats.admitted == n_traj,
        "db_bytes_at_end": db_bytes,
    }


def fsync_ms(directory: Path, n: int = 100) -> dict[str, float]:
    """Latency of a 4 KiB write + fsync on the disk under test: each store transaction costs one or two."""
    path = directory / "fsync_probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    lat = []
    try:
        for _ in range(n):
            os.write(fd, b"x" * 4096)
            t = time.perf_counter()
            os.fsync(fd)
            lat.append(time.perf_counter() - t)
    finally:
        os.close(fd)
        path.unlink()
    lat.sort()
    return {"p50": 1e3 * lat[n // 2], "p99": 1e3 * lat[int(0.99 * (n - 1))]}


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2.2, 1]})
    bins = r["per_second_bins"]
    full = int(r["wall_s"])
    xs = list(range(len(bins)))
    ax.bar(xs[:full], bins[:full], width=0.85, color="tab:blue", label="trajectories accepted per 1 s bin")
    if len(bins) > full:
        ax.bar(xs[full:], bins[full:], width=0.85, color="tab:blue", alpha=0.3, label="partial last bin")
    ax.axhline(TARGET_TRAJ_PER_S, color="tab:red", ls="--", label=f"target {TARGET_TRAJ_PER_S:,.0f}/s")
    ax.axhline(r["traj_per_s"], color="tab:green", ls=":", label=f"mean {r['traj_per_s']:,.0f}/s")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("trajectories / s")
    ax.set_title("durable ingest: lease + decode + validate + submit, learner interleaved")
    ax.set_ylim(0, 1.35 * max([*bins, TARGET_TRAJ_PER_S]))
    ax.legend(loc="upper center", ncol=2, fontsize=8)
    ph = r["phase_us_per_traj"]
    names = ["json_decode", "validate", "store_issue_lease", "store_submit", "store_learner_side"]
    ax2.barh(names, [ph[n] for n in names], color="tab:gray")
    ax2.set_xlabel("µs per trajectory")
    ax2.set_title(
        f"where the time goes\n(budget at target: {1e6 / TARGET_TRAJ_PER_S:.0f} µs/trajectory)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _repo_relative(path: Path) -> str:
    """``path`` relative to the repository (the JSON is committed: no machine paths in it)."""
    p = path.resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else "outside the repository"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0, help="length of the sustained run")
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix="store_ingest_") as tmp:
        r = run(args.seconds, Path(tmp) / "store.db", args.seed)
        disk_fsync = fsync_ms(Path(tmp))
    r["config"] = {
        "seconds": args.seconds,
        "groups_per_submission": GROUPS,
        "group_size": GROUP_SIZE,
        "staleness": STALENESS,
        "learner_batch_groups": BATCH_GROUPS,
        "prompt_tokens": "8-12",
        "completion_tokens": "6-10",
        "durability": "SQLite WAL, synchronous=FULL, one transaction per submission",
        "db_dir": _repo_relative(out),
    }
    r["machine"] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "niceness": os.nice(0),
        "disk_fsync_ms": disk_fsync,
    }
    r["targets"] = {"traj_per_s": TARGET_TRAJ_PER_S}
    r["met"] = {"traj_per_s": r["traj_per_s"] >= TARGET_TRAJ_PER_S}
    (out / "store_ingest.json").write_text(json.dumps(r, indent=2))
    plot(r, out / "store_ingest.png")
    print(json.dumps({k: v for k, v in r.items() if k != "per_second_bins"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
