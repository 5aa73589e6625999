"""The end-of-run plot of an asynchronous run: ``run.png`` beside ``metrics.jsonl``."""

from __future__ import annotations

from pathlib import Path

from echo2.runtime.rundir import read_metrics


def plot_run(run_dir: Path) -> Path:
    """Reward and held-out accuracy, bubble ratio, staleness and active workers over wall-clock time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    rows = [r for r in records if "learner/t_train_s" in r]
    evals = [r for r in records if r.get("reward/accuracy") is not None]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    t = [r["time_s"] for r in rows]
    ax = axes[0]
    ax.plot(t, [r["reward/mean"] for r in rows], lw=0.8, alpha=0.6, label="train reward")
    ax.plot(
        [r["time_s"] for r in evals], [r["reward/accuracy"] for r in evals], "o-", label="held-out accuracy"
    )
    ax.set(xlabel="wall clock (s)", ylabel="reward / accuracy", title="learning")
    ax.legend()
    ax = axes[1]
    ax.plot(t, [r["learner/bubble_ratio"] for r in rows], lw=0.8, label="bubble ratio (per step)")
    ax.plot(t, [r["store/staleness_max"] for r in rows], lw=0.8, label="staleness max")
    ax.set(xlabel="wall clock (s)", title="bubble and staleness")
    ax.legend()
    ax = axes[2]
    ax.plot(t, [r["pool/active_workers"] for r in rows], lw=1.0, label="active workers")
    ax2 = ax.twinx()
    ax2.plot(t, [r["cost/usd_total"] for r in rows], color="C3", lw=1.0, label="$ total")
    ax.set(xlabel="wall clock (s)", ylabel="active workers", title="pool and cost")
    ax2.set_ylabel("$ total (at catalogue prices)")
    fig.tight_layout()
    out = run_dir / "run.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
