"""The broadcast benchmark: the Fig. 4 sweep plus relay-chain, fault and corruption checks.

Run by ``benchmarks/broadcast.py``. Every number in the JSON is measured by the harness in this run;
the ``targets`` block compares them to the issue's thresholds.
"""

from __future__ import annotations

import json
import logging
import math
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from echo2.physics.broadcast import homogeneous_time, lower_bound
from echo2.physics.rules import DEFAULT_GAMMA
from echo2_bench.faults import Faults
from echo2_bench.harness import Harness, Scenario, ScenarioResult
from echo2_bench.netns import netns_available

log = logging.getLogger(__name__)
STRATEGIES = ("star-unlimited", "star-limited", "tree-pipelined")
DRIP_GAP = 0.8  # the drip-feeding relay's gap between two chunks to one child, in stall timeouts
DRIP_TARGET = 2.0  # its honest peers' T_all over the fault-free run's: at most this (fixed before running)


@dataclass(frozen=True)
class BenchConfig:
    """Knobs of one benchmark run (defaults: the scaled-down paper regime that fits 2 cores)."""

    mode: str = "auto"  # "netns" (tbf-shaped links, root), "loopback" (app pacing), or "auto"
    ns: tuple[int, ...] = (4, 8, 16, 32)  # worker counts N of the sweep
    size: int = 8_000_000  # G in bytes (synthetic safetensors blob)
    chunk: int = 16 << 10  # chunk size in bytes
    bw_mbps: float = 8.0  # B_w, per-worker link (both directions), Mbit/s
    ratio: float = 3.0  # B0 / B_w (the paper's regime: 3 or 8)
    pace: float = 0.95  # netns: nodes pace their uplink at this fraction of their link rate
    stall_timeout: float = 3.0  # seconds without data before a worker abandons a source
    gamma: float = DEFAULT_GAMMA  # T_bcast is measured at install_quorum(N, gamma) workers installed
    fault_n: int = 8  # N for the kill / corruption scenarios
    relay_size: int = 64_000_000  # G for the unshaped loopback relay-chain probe
    relay_chunk: int = 1 << 20  # chunk size for the relay-chain probe
    relay_paced_mbps: float = 200.0  # also probe the chain at this app-paced rate (below CPU limits)
    strategies: tuple[str, ...] = STRATEGIES  # strategies of the sweep
    faults: bool = True  # run the kill / stall / corruption scenarios
    relay: bool = True  # run the loopback relay-chain probe
    timeout: float = 300.0  # per-scenario timeout (s)


@dataclass
class _Report:
    config: dict[str, Any]
    sweep: list[dict[str, Any]] = field(default_factory=list)
    relay: dict[str, Any] = field(default_factory=dict)
    faults: dict[str, Any] = field(default_factory=dict)
    targets: dict[str, Any] = field(default_factory=dict)


def _row(res: ScenarioResult, cfg: BenchConfig, b0: float, bw: float) -> dict[str, Any]:
    sc = res.scenario
    g = res.size
    t_star = lower_bound(g, b0, bw, sc.n_workers)
    times = sorted(res.install_s.values())
    return {
        "strategy": sc.strategy,
        "n": sc.n_workers,
        "t_all_s": res.t_all(),
        "t_bcast_s": res.t_bcast(cfg.gamma),
        "install_p90_s": res.t_fraction(0.9),
        "t_first_s": times[0] if times else math.inf,
        "t_star_s": t_star,
        "t_all_over_t_star": res.t_all() / t_star,
        "star_limited_ideal_s": homogeneous_time("star-limited", g, b0, bw, sc.n_workers),
        "learner_bytes": res.learner_bytes,
        "learner_bytes_over_g": res.learner_bytes / g,
        "stream_failures": res.counter("stream_failures"),
        "repaired_chunks": res.counter("repaired_chunks"),
        "ancestor_repairs": res.counter("ancestor_repairs"),  # asked of a stripe ancestor, not the learner
        "bad_installs": res.bad_installs(),
    }


def resolve_mode(mode: str) -> str:
    if mode == "auto":
        return "netns" if netns_available() is None else "loopback"
    return mode


def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    """Run everything ``cfg`` asks for and return the JSON-ready report."""
    mode = resolve_mode(cfg.mode)
    bw = cfg.bw_mbps * 1e6
    b0 = bw * cfg.ratio
    bw_b, b0_b = bw / 8, b0 / 8  # bytes/s
    rep = _Report(config={**asdict(cfg), "mode": mode, "host": platform.node(), "started": time.time()})
    shaped = dict(size=cfg.size, chunk=cfg.chunk, b0_bps=b0, bw_bps=bw, stall_timeout=cfg.stall_timeout,
                  timeout=cfg.timeout, pace=cfg.pace)  # fmt: skip
    n_max = max([*cfg.ns, cfg.fault_n if cfg.faults else 0])
    with Harness(mode, n_max) as h:
        for strategy in cfg.strategies:
            for n in cfg.ns:
                res = h.run(Scenario(strategy, n, **shaped))  # type: ignore[arg-type]
                row = _row(res, cfg, b0_b, bw_b)
                rep.sweep.append(row)
                log.info(
                    "%s N=%d: T_all %.2fs = %.2f T*", strategy, n, row["t_all_s"], row["t_all_over_t_star"]
                )
        if cfg.faults:
            rep.faults = _faults(h, cfg, shaped, b0_b, bw_b)
    if cfg.relay:
        rep.relay = _relay(cfg)
    rep.targets = _targets(rep, cfg, b0_b, bw_b)
    rep.config["finished"] = time.time()
    return asdict(rep)


def _faults(h: Harness, cfg: BenchConfig, shaped: dict[str, Any], b0: float, bw: float) -> dict[str, Any]:
    n = cfg.fault_n
    base = h.run(Scenario("tree-pipelined", n, **shaped))
    victim = n // 2  # a relay in the middle of the membership: every other worker pulls its stripe from it
    killed = h.run(Scenario("tree-pipelined", n, faults={victim: Faults(die_at=0.5)}, **shaped))
    stalled = h.run(Scenario("tree-pipelined", n, faults={victim: Faults(stall_at=0.5)}, **shaped))
    corrupt = h.run(
        Scenario(
            "tree-pipelined", n, faults={victim: Faults(corrupt_every=7)}, max_bad_chunks=10**9, **shaped
        )
    )
    # a relay that sends each of its n - 1 children a chunk every DRIP_GAP stall timeouts (never a stall)
    drip_bps = (n - 1) * cfg.chunk * 8 / (DRIP_GAP * cfg.stall_timeout)
    drip = h.run(Scenario("tree-pipelined", n, faults={victim: Faults(drip_bps=drip_bps)}, **shaped))
    honest = [w for w in drip.survivors if w != f"w{victim:03d}"]
    drip_t_all = max(drip.install_s.get(w, math.inf) for w in honest)
    injected = corrupt.injected("corrupted_sent")
    detected = corrupt.counter("corrupt_detected")
    return {
        "n": n,
        "fault_free_t_all_s": base.t_all(),
        "kill_at_50pct": {**_row(killed, cfg, b0, bw), "over_fault_free": killed.t_all() / base.t_all()},
        "stall_at_50pct": {**_row(stalled, cfg, b0, bw), "over_fault_free": stalled.t_all() / base.t_all()},
        "drip": {
            **_row(drip, cfg, b0, bw),
            "drip_bps": drip_bps,
            "honest_t_all_s": drip_t_all,
            "over_fault_free": drip_t_all / base.t_all(),
            "stalls_reported": sum(r["counters"]["stalls_reported"] for r in drip.workers.values()),
        },
        "corruption": {
            **_row(corrupt, cfg, b0, bw),
            "injected": injected,
            "detected": detected,
            "detected_fraction": detected / injected if injected else math.nan,
            "installs": sum(len(r.get("installs", [])) for r in corrupt.workers.values()),
        },
    }


def _relay(cfg: BenchConfig) -> dict[str, Any]:
    """Loopback, unshaped: a 4-hop relay chain vs one direct transfer of the same snapshot."""
    out: dict[str, Any] = {}
    common = dict(size=cfg.relay_size, chunk=cfg.relay_chunk, b0_bps=None, timeout=cfg.timeout, load=False)
    with Harness("loopback", 4) as h:
        for label, rate in (("unshaped", None), ("paced", cfg.relay_paced_mbps * 1e6)):
            direct = h.run(Scenario("relay-chain", 1, bw_bps=rate, **common))  # type: ignore[arg-type]
            chain = h.run(Scenario("relay-chain", 4, bw_bps=rate, **common))  # type: ignore[arg-type]
            g = direct.size
            out[label] = {
                "link_mbps": None if rate is None else rate / 1e6,
                "direct_t_s": direct.t_all(),
                "chain4_t_s": chain.t_all(),
                "direct_mb_per_s": g / direct.t_all() / 1e6,
                "chain4_mb_per_s": g / chain.t_all() / 1e6,
                "chain_over_direct": direct.t_all() / chain.t_all(),
            }
    return out


def _targets(rep: _Report, cfg: BenchConfig, b0: float, bw: float) -> dict[str, Any]:
    t: dict[str, Any] = {}
    tree = {r["n"]: r for r in rep.sweep if r["strategy"] == "tree-pipelined"}
    if tree:
        core = {n: tree[n]["t_all_over_t_star"] for n in (4, 8, 16) if n in tree}
        t["tree_t_all_le_1.25_t_star_n4_8_16"] = {
            "values": core,
            "met": all(v <= 1.25 for v in core.values()),
        }
        t["tree_t_all_over_t_star_all_n"] = {n: r["t_all_over_t_star"] for n, r in tree.items()}
        if 4 in tree:
            n_big = max(tree)
            growth = tree[n_big]["t_all_s"] / tree[4]["t_all_s"] - 1
            t["tree_growth_n4_to_largest_le_15pct"] = {
                "largest_n": n_big,
                "growth": growth,
                "met": growth <= 0.15,
            }
            below = [n for n in tree if n <= 16]
            if below:
                g16 = tree[max(below)]["t_all_s"] / tree[4]["t_all_s"] - 1
                t["tree_growth_n4_to_16"] = {"largest_n": max(below), "growth": g16, "met": g16 <= 0.15}
    lim = [r for r in rep.sweep if r["strategy"] == "star-limited" and r["n"] * bw > b0]
    if lim:
        dev = {r["n"]: r["t_all_s"] / (r["n"] * cfg.size / b0) - 1 for r in lim}
        t["star_limited_within_15pct_of_NG_over_B0"] = {
            "deviation": dev,
            "met": all(abs(d) <= 0.15 for d in dev.values()),
        }
    if rep.relay:
        r = rep.relay["unshaped"]["chain_over_direct"]
        t["relay_chain4_ge_0.8_direct_unshaped"] = {"value": r, "met": r >= 0.8}
        t["relay_chain4_over_direct_paced"] = {"value": rep.relay["paced"]["chain_over_direct"]}
    if rep.faults:
        k = rep.faults["kill_at_50pct"]["over_fault_free"]
        t["kill_relay_at_50pct_survivors_within_2x"] = {"value": k, "met": k <= 2.0}
        d = rep.faults["drip"]["over_fault_free"]
        t[f"drip_relay_honest_within_{DRIP_TARGET}x"] = {"value": d, "met": d <= DRIP_TARGET}
        c = rep.faults["corruption"]
        t["corruption_100pct_detected_0_bad_installs"] = {
            "injected": c["injected"], "detected": c["detected"], "bad_installs": c["bad_installs"],
            "met": c["injected"] > 0 and c["detected"] == c["injected"] and c["bad_installs"] == 0,
        }  # fmt: skip
    return t


def write_outputs(report: dict[str, Any], json_path: Path, png_path: Path | None) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2, default=str))
    if png_path is not None:
        plot(report, png_path)


def plot(report: dict[str, Any], path: Path) -> None:
    """Fig. 4 style: T_bcast and T_all vs N for each strategy, with the lower bound T* drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    styles = {"star-unlimited": "tab:green", "star-limited": "tab:red", "tree-pipelined": "tab:blue"}
    rows = report["sweep"]
    for strategy, color in styles.items():
        pts = sorted((r["n"], r["t_bcast_s"], r["t_all_s"]) for r in rows if r["strategy"] == strategy)
        if pts:
            ns = [p[0] for p in pts]
            ax.plot(ns, [p[1] for p in pts], "o-", color=color, label=f"{strategy} (T_bcast, q=1/γ)")
            ax.plot(
                ns, [p[2] for p in pts], "x:", color=color, alpha=0.7, label=f"{strategy} (all installed)"
            )
    star = sorted({(r["n"], r["t_star_s"]) for r in rows})
    if star:
        ax.plot([s[0] for s in star], [s[1] for s in star], "k--", label="T* lower bound")
    c = report["config"]
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    ax.set_xscale("log", base=2)
    all_ns = sorted({r["n"] for r in rows})
    ax.set_xticks(all_ns)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_yscale("log")
    ax.set_xlabel("workers N")
    ax.set_ylabel("seconds")
    ax.set_title(
        f"G={c['size'] / 1e6:.0f} MB, B_w={c['bw_mbps']:g} Mbit/s, B0/B_w={c['ratio']:g} ({c['mode']})",
        fontsize=10,
    )
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
