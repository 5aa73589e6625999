"""Figures for simulated (and real) runs. Metric plots read the SPEC section 7 per-step dicts, so the
same code draws a real run's metrics.jsonl and a simulated one."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from echo2.physics.rules import KNEE_THRESHOLD


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> Path:
    """Lay out, write the PNG, and free the figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_metrics(
    metrics: Sequence[dict[str, Any]],
    path: Path,
    keys: Sequence[str] = (
        "learner/bubble_ratio",
        "store/staleness_max",
        "pool/active_workers",
        "pool/mu_pool",
        "broadcast/t_bcast_s",
        "cost/usd_total",
    ),
    title: str = "",
) -> Path:
    """One panel per metric key against ``step``; keys missing from the dicts are skipped."""
    plt = _plt()
    keys = [k for k in keys if any(m.get(k) is not None for m in metrics)]
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 1.8 * len(keys)), sharex=True, squeeze=False)
    steps = [m.get("step", i + 1) for i, m in enumerate(metrics)]
    for ax, k in zip(axes[:, 0], keys, strict=True):
        ys = [m.get(k) for m in metrics]
        ax.plot(steps, [float("nan") if y is None else y for y in ys], lw=1)
        if k == "pool/mu_pool" and any(m.get("pool/mu_target") for m in metrics):
            ax.plot(
                steps,
                [m.get("pool/mu_target") or float("nan") for m in metrics],
                "k--",
                lw=0.8,
                label="pool/mu_target",
            )
            ax.legend(fontsize=7)
        ax.set_ylabel(k, fontsize=7)
        ax.ticklabel_format(axis="y", useOffset=False)
    axes[-1, 0].set_xlabel("step")
    if title:
        fig.suptitle(title, fontsize=9)
    return _save(plt, fig, path)


def plot_bubble(result: dict[str, Any], path: Path, title: str = "") -> Path:
    """Fig. 3c: bubble ratio vs workers, one curve per S (markers: simulated; dashed: cycle model;
    grey line: the knee threshold of :func:`echo2.physics.rules.knee`)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (s, c) in enumerate(result["curves"].items()):
        if not c.get("feasible"):
            continue
        color = f"C{i}"
        ax.plot(c["ns"], c["bubble_sim"], "o-", color=color, ms=3, label=f"S={s} (kappa={c['kappa']}) sim")
        ax.plot(c["ns"], c["bubble_analytic"], "--", color=color, lw=0.8)
        ax.axvline(c["n_min"], color=color, ls=":", lw=1)
        ax.annotate(f"N_min={c['n_min']}", (c["n_min"], 0.9 - 0.07 * i), color=color, fontsize=7)
    ax.axhline(KNEE_THRESHOLD, color="gray", lw=0.5)
    ax.set_xlabel("workers")
    ax.set_ylabel("learner/bubble_ratio (steady state)")
    ax.set_ylim(-0.02, 1.0)
    ax.legend(fontsize=7)
    ax.set_title(title or "Bubble ratio vs workers (dashed: cycle model; dotted: N_min)", fontsize=9)
    return _save(plt, fig, path)


def plot_bcast(result: dict[str, Any], path: Path, title: str = "") -> Path:
    """Fig. 4: T_bcast vs N for the strategies of the sweep (log x), with the lower bound T*."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (k, ys) in enumerate(result["sim"].items()):
        ax.plot(result["ns"], ys, "o-", color=f"C{i}", ms=3, label=k)
    ax.plot(result["ns"], result["lower_bound"], "k:", label="T* + reload")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("workers N")
    ax.set_ylabel("broadcast/t_bcast_s (last worker)")
    ax.legend(fontsize=7)
    ax.set_title(
        title
        or f"T_bcast vs N: G={result['snapshot_gb']} GB, B0={result['b0_mbps']} Mbps, "
        f"B_w={result['bw_mbps']} Mbps",
        fontsize=9,
    )
    return _save(plt, fig, path)


def plot_ablation(result: dict[str, Any], path: Path) -> Path:
    """Table 2 as grouped bars: cost per step relative to the full system, ours vs the paper."""
    plt = _plt()
    rows = list(result["rows"])
    ours = [result["rows"][r]["cost_vs_full"] for r in rows]
    paper_rows = [r for r in rows if r in result["paper"]]  # the "+ deltas" rows are not in the paper
    paper = [result["paper"][r]["cost_vs_full"] for r in paper_rows]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], ours, 0.4, label="simulated")
    ax.bar([rows.index(r) + 0.2 for r in paper_rows], paper, 0.4, label="paper (Table 2)")
    ax.set_xticks(list(x), rows, fontsize=7)
    ax.set_ylim(min([0.9, *ours]) * 0.98, max(ours + paper) * 1.05)
    ax.set_ylabel("cost per step / full")
    ax.legend(fontsize=8)
    ax.set_title("Ablation: cost per step relative to the full system", fontsize=9)
    return _save(plt, fig, path)
