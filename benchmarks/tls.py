"""What transport security costs the two planes: broadcast T_all and a worker's rollouts/s, with and
without TLS, side by side (docs/broadcast.md and docs/runtime.md, "Transport security").

    sudo nice -n 19 .venv/bin/python benchmarks/tls.py                     # both studies, netns links
    python benchmarks/tls.py --study broadcast --mode loopback              # no root: app-paced links
    python benchmarks/tls.py --study worker --worker-trials 6               # as committed

``broadcast``: the broadcast harness (``echo2_bench``: a learner process and N worker processes, the
product classes) runs the same scenario plain and under TLS (the learner's run certificate pinned by
every worker, each relay under its own pinned certificate, credentials and proofs on every pull),
interleaved, ``--reps`` times, in two regimes: WAN links (``--bw-mbps``, B0/B_w = ``--ratio``,
Tree-Pipelined, N = ``--ns``: the regime the plane is built for) and unshaped loopback (no link limit:
what the CPU pays for encryption shows in full). Writes ``results/tls_broadcast.json`` and ``.png``.

``worker``: ``runtime.py``'s served worker (a learner node without training, a real ``echo2 worker``
process) delivering rollouts end to end, plain and under TLS, interleaved pairs of ``--worker-seconds``.
Writes ``results/tls_worker.json``.

Target, fixed before the runs: TLS slows neither plane by more than 5 %: median T_all(TLS) / T_all(plain)
<= 1.05 per WAN scenario, and median rollouts/s(TLS) / rollouts/s(plain) >= 0.95. The unshaped
regime has no target (no deployment runs without a link limit); it is reported as the CPU cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

log = logging.getLogger("tls_bench")
TARGET_SLOWDOWN = 1.05  # TLS may cost at most 5 % on either plane


def study_broadcast(args: argparse.Namespace) -> dict[str, Any]:
    from echo2_bench.broadcast_bench import resolve_mode
    from echo2_bench.harness import Harness, Scenario

    mode = resolve_mode(args.mode)
    bw = args.bw_mbps * 1e6
    regimes = [("wan", n, int(args.size_mb * 1e6), args.ratio * bw, bw) for n in args.ns] + [
        ("unshaped", args.unshaped_n, int(args.unshaped_size_mb * 1e6), None, None)
    ]
    rows = []
    with Harness(mode, max([*args.ns, args.unshaped_n])) as h:
        for regime, n, size, b0, bwr in regimes:
            times: dict[str, list[float]] = {"plain": [], "tls": []}
            for rep in range(args.reps):
                for side in ("plain", "tls") if rep % 2 == 0 else ("tls", "plain"):  # alternate the order
                    sc = Scenario(
                        "tree-pipelined", n, size, args.chunk_kib << 10, b0, bwr, tls=side == "tls",
                        seed=rep, pace=0.95 if mode == "netns" and bwr else 0.0, timeout=args.timeout,
                    )  # fmt: skip
                    res = h.run(sc)
                    if res.bad_installs() or res.counter("stream_failures"):
                        log.warning("%s %s N=%d rep %d: %d bad installs, %d stream failures", regime, side,
                                    n, rep, res.bad_installs(), res.counter("stream_failures"))  # fmt: skip
                    times[side].append(res.t_all())
                    log.info("%s N=%d %s rep %d: T_all %.3f s", regime, n, side, rep, res.t_all())
            plain, tls = statistics.median(times["plain"]), statistics.median(times["tls"])
            ratio = tls / plain
            rows.append({
                "regime": regime, "n": n, "size": size, "b0_bps": b0, "bw_bps": bwr,
                "t_all_plain_s": times["plain"], "t_all_tls_s": times["tls"],
                "median_plain_s": plain, "median_tls_s": tls, "ratio_tls_over_plain": ratio,
                "target": f"<= {TARGET_SLOWDOWN}" if regime == "wan" else None,
                "met": ratio <= TARGET_SLOWDOWN if regime == "wan" else None,
            })  # fmt: skip
    return {
        "mode": mode,
        "host": platform.node(),
        "started": time.time(),
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "func")},
        "rows": rows,
        "met": all(r["met"] for r in rows if r["met"] is not None),
    }


def plot_broadcast(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    labels = [f"{r['regime']}\nN={r['n']}, {r['size'] / 1e6:.0f} MB" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([x - 0.2 for x in xs], [r["median_plain_s"] for r in rows], 0.4, label="plain TCP", color="C0")
    ax.bar(
        [x + 0.2 for x in xs], [r["median_tls_s"] for r in rows], 0.4, label="TLS + credentials", color="C3"
    )
    for x, r in zip(xs, rows, strict=True):
        ax.text(x + 0.2, r["median_tls_s"], f"x{r['ratio_tls_over_plain']:.3f}", ha="center", va="bottom")
    ax.set(
        xticks=list(xs),
        xticklabels=labels,
        ylabel="T_all (s), median",
        title=f"Broadcast with and without TLS ({res['mode']}, Tree-Pipelined)",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def study_worker(args: argparse.Namespace) -> dict[str, Any]:
    import runtime as rt
    from echo2.config import load_config

    cfg = load_config(overrides=["controller.sustain_s=1e9"])
    rt.warm_start(cfg.seed)
    pairs = []
    for k in range(args.worker_trials):
        rates = {}
        for side in ("plain", "tls") if k % 2 == 0 else ("tls", "plain"):
            with tempfile.TemporaryDirectory() as tmp:
                served = asyncio.run(
                    rt._serve_drain(cfg, args.worker_seconds, 3.0, Path(tmp), tls=side == "tls")
                )
            rates[side] = served["delivered_rollouts"] / served["seconds"]
        pairs.append({**rates, "ratio_tls_over_plain": rates["tls"] / rates["plain"]})
        log.info("worker pair %d: plain %.1f, tls %.1f rollouts/s", k + 1, rates["plain"], rates["tls"])
    ratio = statistics.median(p["ratio_tls_over_plain"] for p in pairs)
    return {
        "host": platform.node(),
        "started": time.time(),
        "seconds": args.worker_seconds,
        "pairs": pairs,
        "median_plain_rollouts_per_s": statistics.median(p["plain"] for p in pairs),
        "median_tls_rollouts_per_s": statistics.median(p["tls"] for p in pairs),
        "ratio_tls_over_plain": ratio,
        "target": f">= {1 / TARGET_SLOWDOWN:.3f} (at most 5 % slower)",
        "met": ratio >= 1 / TARGET_SLOWDOWN,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", choices=["broadcast", "worker", "all"], default="all")
    p.add_argument("--mode", choices=["auto", "netns", "loopback"], default="auto")
    p.add_argument("--ns", type=int, nargs="+", default=[4, 8], help="worker counts of the WAN regime")
    p.add_argument("--size-mb", type=float, default=8.0, help="G of the WAN regime, MB")
    p.add_argument("--bw-mbps", type=float, default=8.0, help="B_w, Mbit/s")
    p.add_argument("--ratio", type=float, default=3.0, help="B0/B_w")
    p.add_argument(
        "--chunk-kib", type=int, default=256, help="chunk size (runtime.chunk_kb's default when measured)"
    )
    p.add_argument("--unshaped-n", type=int, default=4)
    p.add_argument("--unshaped-size-mb", type=float, default=64.0)
    p.add_argument("--reps", type=int, default=3, help="interleaved plain / TLS repetitions per scenario")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--worker-seconds", type=float, default=15.0)
    p.add_argument("--worker-trials", type=int, default=4, help="interleaved plain / TLS pairs")
    p.add_argument("--out", type=Path, default=ROOT / "results")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    if args.study in ("broadcast", "all"):
        res = study_broadcast(args)
        (args.out / "tls_broadcast.json").write_text(json.dumps(res, indent=2))
        plot_broadcast(res, args.out / "tls_broadcast.png")
        keys = ("regime", "n", "median_plain_s", "median_tls_s", "ratio_tls_over_plain")
        print(json.dumps([{k: r[k] for k in keys} for r in res["rows"]], indent=1))
    if args.study in ("worker", "all"):
        res = study_worker(args)
        (args.out / "tls_worker.json").write_text(json.dumps(res, indent=2))
        print(json.dumps({k: v for k, v in res.items() if k != "pairs"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
