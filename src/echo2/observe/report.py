"""A run directory drawn for people: ``run.png`` at the end of `echo2 run`, and the page of
`echo2 report RUN_DIR` (``report.html``).

Both read the directory the same way (:func:`load_run`) and draw with the same panel functions, so
the PNG and the page agree. The page is one file that opens offline: CSS inline, every plot a base64
PNG data URI, nothing fetched. It reports a finished run or a running one (whatever is on disk now:
without ``summary.json`` the headline numbers are computed from ``metrics.jsonl`` so far). What a run
did not write (an `echo2 train` run has no pool, a run killed early has no ``summary.json``) reads
"not recorded"; a directory without ``metrics.jsonl`` is not a run directory (:class:`Echo2Error`).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from echo2.errors import DataError, Echo2Error
from echo2.observe.bubble import CAUSES as MEASURED_CAUSES
from echo2.observe.catalog import (
    BROADCAST_T_BCAST_S,
    COST_USD_PER_HOUR,
    COST_USD_TOTAL,
    LEARNER_BUBBLE_RATIO,
    LEARNER_IDLE_S,
    LEARNER_STEP_WALL_S,
    LEARNER_T_TRAIN_S,
    LEARNER_UPDATE_S,
    LEARNER_VERSION,
    POOL_ACTIVE_WORKERS,
    REWARD_ACCURACY,
    REWARD_MEAN,
    STEP,
    STORE_ADMITTED,
    STORE_DROPPED_STALE,
    STORE_REJECTED,
    STORE_REJECTED_BY,
    STORE_STALENESS_MAX,
    STORE_STALENESS_MEAN,
    TIME_S,
    Metric,
    in_report,
)
from echo2.observe.rundir import write_atomic
from echo2.physics.rules import bubble_ratio

CAUSES = (*MEASURED_CAUSES, "other")  # the bubble's causes, as the keys learner/idle_s/<cause> name them
NOT_RECORDED = "not recorded"
REPORT_FILE = "report.html"
WALL = "wall clock (s)"
TREND_POINTS = 50  # a per-step line of more than 2x this many steps also gets a running mean
IDLE_BARS = 60  # at most this many stacked bars of idle time by cause

Record = dict[str, Any]
STALE = STORE_STALENESS_MAX.key


# ---- reading a run directory -----------------------------------------------------------------------
@dataclass
class Run:
    """A run directory as it is on disk now; a file the run did not write is None."""

    path: Path  # the run directory
    records: list[Record]  # metrics.jsonl, time_s made continuous across resumed processes
    summary: dict[str, Any] | None  # summary.json: written when the run finished (or stopped on an error)
    workers: list[dict[str, Any]] | None  # workers.json: the registry (asynchronous runs only)
    decisions: list[Record] | None  # activation.jsonl: the pool controller's decisions
    config: dict[str, Any] | None  # config.json: the resolved config
    unreadable: dict[str, str] = field(default_factory=dict)  # file name -> why it could not be read

    @cached_property
    def steps(self) -> list[Record]:
        """The records of learner updates (the starting evaluation is not one)."""
        return [r for r in self.records if LEARNER_T_TRAIN_S.key in r]

    def has(self, *keys: str) -> bool:
        """Whether any record holds a value under one of ``keys``."""
        return any(r.get(k) is not None for r in self.records for k in keys)


def load_run(run_dir: str | Path) -> Run:
    """Read ``run_dir``; only ``metrics.jsonl`` is required. An optional file that is there but cannot
    be read is left out and named in ``Run.unreadable`` (a running run may be writing it)."""
    path = Path(run_dir)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        what = "does not exist" if not path.exists() else "holds no metrics.jsonl"
        raise Echo2Error(f"{path} is not a run directory: it {what}")
    unreadable: dict[str, str] = {}

    def optional(name: str, read: Callable[[Path], Any]) -> Any:
        p = path / name
        if not p.is_file():
            return None
        try:
            return read(p)
        except (OSError, ValueError) as exc:  # JSONDecodeError and DataError are ValueErrors
            unreadable[name] = str(exc)
            return None

    return Run(
        path=path,
        records=_continuous_time(_read_jsonl(metrics)),
        summary=optional("summary.json", lambda p: _read_json(p, dict)),
        workers=optional("workers.json", lambda p: _read_json(p, list)),
        decisions=optional("activation.jsonl", _read_jsonl),
        config=optional("config.json", lambda p: _read_json(p, dict)),
        unreadable=unreadable,
    )


def _read_json(path: Path, kind: type) -> Any:
    value = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(value, kind):
        raise DataError(f"{path}: expected a JSON {kind.__name__}, got {type(value).__name__}")
    return value


def _read_jsonl(path: Path) -> list[Record]:
    """One JSON object a line; a last line without its newline is a record being written: skipped."""
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    out: list[Record] = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == len(lines):  # no newline after it yet
                continue
            raise DataError(f"{path}:{i}: not a JSON record ({exc.msg})") from None
        if not isinstance(rec, dict):
            raise DataError(f"{path}:{i}: a record must be a JSON object, got {type(rec).__name__}")
        out.append(rec)
    return out


def _continuous_time(records: list[Record]) -> list[Record]:
    """A resumed run appends a process whose ``time_s`` starts again at 0: shift it to follow on."""
    out, offset, last = [], 0.0, 0.0
    for rec in records:
        t = rec.get(TIME_S.key)
        if isinstance(t, int | float):
            if t + offset < last:
                offset = last
            last = t + offset
            rec = {**rec, TIME_S.key: last}
        out.append(rec)
    return out


# ---- the headline numbers --------------------------------------------------------------------------
def summarize(run: Run) -> dict[str, Any]:
    """The run's headline numbers: ``summary.json``'s where it has them, the rest computed from the
    records so far; ``status`` is ``(label, note)``, ``from_summary`` the keys summary.json gave."""
    rows = run.steps
    acc = [r[REWARD_ACCURACY.key] for r in run.records if r.get(REWARD_ACCURACY.key) is not None]
    derived: dict[str, Any] = {
        "steps": len(rows),
        "version": _last(run.records, LEARNER_VERSION.key),
        "resumed_from": None,
        "wall_s": rows[-1].get(TIME_S.key) if rows else None,
        "initial_accuracy": acc[0] if acc else None,
        "final_accuracy": acc[-1] if acc else None,
        "best_accuracy": max(acc) if acc else None,
        "bubble": _bubble_block(rows),
        "staleness_max": max((r[STALE] for r in rows if _isnum(r.get(STALE))), default=None),
        "staleness_budget": staleness_budget(run),
        "usd_total": _last(rows, COST_USD_TOTAL.key),
    }
    summary = run.summary or {}
    given = {k: summary[k] for k in derived if summary.get(k) is not None}
    if not isinstance(given.get("bubble"), dict):
        given.pop("bubble", None)
    out = {**derived, **given, "from_summary": sorted(given), "status": _status(run, summary)}
    out["bubble_ratio"] = (out["bubble"] or {}).get("bubble_ratio")
    out["asynchronous"] = run.has(POOL_ACTIVE_WORKERS.key) or run.workers is not None
    return out


def _last(records: Sequence[Record], key: str) -> Any:
    return next((r[key] for r in reversed(records) if r.get(key) is not None), None)


def _bubble_block(rows: Sequence[Record]) -> dict[str, Any] | None:
    """The ``bubble`` block of summary.json, summed over the step records (their windows tile the loop)."""
    wall_key, update_key = LEARNER_STEP_WALL_S.key, LEARNER_UPDATE_S.key
    timed = [r for r in rows if _isnum(r.get(wall_key)) and _isnum(r.get(update_key))]
    wall = sum(r[wall_key] for r in timed)
    if wall <= 0:
        return None
    train = sum(r[update_key] for r in timed)
    idle = {c: sum(r.get(LEARNER_IDLE_S.of(c)) or 0.0 for r in timed) for c in CAUSES}
    return {
        "window_s": wall,
        "train_s": train,
        "bubble_ratio": bubble_ratio(min(train, wall), wall),
        "idle_s_by_cause": idle,
    }


def _status(run: Run, summary: dict[str, Any]) -> tuple[str, str]:
    if run.summary is None:
        age = time.time() - (run.path / "metrics.jsonl").stat().st_mtime
        return "running", (
            f"no summary.json yet, so the numbers are metrics.jsonl's so far (last record written "
            f"{age:.0f} s ago; a run stopped before its end looks the same)"
        )
    if "error" in summary:
        return "stopped", f"stopped with an error: {summary['error']}"
    return "finished", ""


# ---- plot panels: one function per panel, shared by run.png and the page ---------------------------
Panel = Callable[[Any, Run], None]  # draws on a matplotlib Axes


def _xy(rows: Sequence[Record], key: str, x: str = TIME_S.key) -> tuple[list[float], list[float]]:
    pairs = [(r[x], r[key]) for r in rows if r.get(key) is not None and r.get(x) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _legend(*axes: Any) -> None:
    handles = [h for ax in axes for h in ax.get_legend_handles_labels()[0]]
    if handles:
        axes[0].legend(handles=handles, fontsize="small")


def learning_panel(ax: Any, run: Run) -> None:
    evals = [r for r in run.records if r.get(REWARD_ACCURACY.key) is not None]
    _per_step(ax, run.steps, REWARD_MEAN)
    ax.plot(*_xy(evals, REWARD_ACCURACY.key), "o-", ms=3, label=_label(REWARD_ACCURACY))
    ax.set(xlabel=WALL, ylabel="reward / accuracy", title="learning")
    _legend(ax)


def _label(m: Metric, suffix: str = "") -> str:
    """The metric's legend label (the catalog's), escaped for matplotlib (a bare $ starts mathtext)."""
    return ((m.label or m.key) + suffix).replace("$", r"\$")


def _per_step(ax: Any, rows: Sequence[Record], m: Metric, suffix: str = "") -> None:
    """A per-step series; past ``2 * TREND_POINTS`` steps drawn faint under its running mean over
    ``len / TREND_POINTS`` steps, so a long run's trend stays readable."""
    xs, ys = _xy(rows, m.key)
    label = _label(m, suffix)
    k = len(ys) // TREND_POINTS
    if k < 2:
        ax.plot(xs, ys, lw=0.8, label=label)
        return
    (line,) = ax.plot(xs, ys, lw=0.5, alpha=0.3)
    sums = [0.0]
    for y in ys:
        sums.append(sums[-1] + y)
    trend = [(sums[i + 1] - sums[max(0, i + 1 - k)]) / min(k, i + 1) for i in range(len(ys))]
    ax.plot(xs, trend, lw=1.2, color=line.get_color(), label=f"{label} (mean of {k} steps)")


def bubble_panel(ax: Any, run: Run) -> None:
    _per_step(ax, run.steps, LEARNER_BUBBLE_RATIO, " per step")
    ax.set(xlabel=WALL, ylabel="bubble ratio", title="bubble")
    ax.set_ylim(bottom=0)
    _legend(ax)


def idle_panel(ax: Any, run: Run) -> None:
    """Idle seconds by cause, stacked: one bar per step, or per ``width`` steps in a long run."""
    rows = run.steps
    width = max(1, math.ceil(len(rows) / IDLE_BARS))
    bins = [rows[i : i + width] for i in range(0, len(rows), width)]
    x = [b[0].get(STEP.key, j * width + 1) for j, b in enumerate(bins)]
    bottom = [0.0] * len(bins)
    for cause in CAUSES:
        h = [sum(r.get(LEARNER_IDLE_S.of(cause)) or 0.0 for r in b) for b in bins]
        ax.bar(x, h, width=width, bottom=bottom, align="edge", lw=0, label=cause)
        bottom = [a + b for a, b in zip(bottom, h, strict=True)]
    per = "per step" if width == 1 else f"per {width} steps"
    ax.set(xlabel="learner step", ylabel=f"idle seconds {per}", title="idle time by cause")
    _legend(ax)


def staleness_panel(ax: Any, run: Run, mean: bool = True) -> None:
    _per_step(ax, run.steps, STORE_STALENESS_MAX)
    if mean:
        _per_step(ax, run.steps, STORE_STALENESS_MEAN)
    budget = staleness_budget(run)
    if budget is not None:
        ax.axhline(budget, ls="--", lw=0.8, color="grey", label=f"S = {budget}")
    ax.set(xlabel=WALL, ylabel="versions behind", title="staleness of the trained batch")
    _legend(ax)


def staleness_budget(run: Run) -> Any:
    """The staleness budget S from config.json (None when it was not recorded)."""
    staleness = (run.config or {}).get("staleness")
    return staleness.get("S") if isinstance(staleness, dict) else None


def bubble_and_staleness_panel(ax: Any, run: Run) -> None:
    bubble_panel(ax, run)
    staleness_panel(ax, run, mean=False)
    ax.autoscale(axis="y")  # bubble_panel fixed the top at 1; staleness goes up to S
    ax.set_ylim(bottom=0)
    ax.set(ylabel="", title="bubble and staleness")


def pool_panel(ax: Any, run: Run) -> None:
    from matplotlib.ticker import MaxNLocator

    active = POOL_ACTIVE_WORKERS
    ax.plot(*_xy(run.steps, active.key), lw=1.0, drawstyle="steps-post", label=_label(active))
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax2 = ax.twinx()
    ax2.plot(*_xy(run.steps, COST_USD_TOTAL.key), color="C3", lw=1.0, label=_label(COST_USD_TOTAL))
    ax.set(xlabel=WALL, ylabel="active workers", title="pool and cost")
    ax2.set_ylabel(r"\$ total (at catalogue prices)")
    _legend(ax, ax2)


def usd_rate_panel(ax: Any, run: Run) -> None:
    ax.plot(*_xy(run.steps, COST_USD_PER_HOUR.key), color="C3", lw=1.0, label=_label(COST_USD_PER_HOUR))
    ax.set(xlabel=WALL, ylabel=r"\$/h (learner + active workers)", title="cost rate")
    ax.set_ylim(bottom=0)
    _legend(ax)


def bcast_panel(ax: Any, run: Run) -> None:
    for m in in_report("bcast"):
        ax.plot(*_xy(run.steps, m.key), lw=1.0, drawstyle="steps-post", label=_label(m))
    ax.set(xlabel=WALL, ylabel="seconds", title="broadcast (last measured publication)")
    _legend(ax)


def _figure(run: Run, panels: Sequence[Panel], width: float = 5.0, height: float = 4.0) -> Any:
    """One row of panels on a matplotlib Figure (no pyplot: no global state, no display needed)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * len(panels), height))
    for ax, panel in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels, strict=True):
        panel(ax, run)
    fig.tight_layout()
    return fig


def plot_run(run_dir: Path) -> Path:
    """``run.png``: learning, bubble and staleness, pool and cost over wall-clock time."""
    run = load_run(run_dir)
    out = run.path / "run.png"
    _figure(run, (learning_panel, bubble_and_staleness_panel, pool_panel)).savefig(out, dpi=110)
    return out


# ---- the page --------------------------------------------------------------------------------------
PLOTS: tuple[tuple[str, str, tuple[str, ...], tuple[Panel, ...]], ...] = (
    # section id, heading, keys one of which must be recorded, panels
    ("learning", "Learning", (REWARD_MEAN.key, REWARD_ACCURACY.key), (learning_panel,)),
    ("bubble", "Bubble", (LEARNER_BUBBLE_RATIO.key,), (bubble_panel, idle_panel)),
    ("staleness", "Staleness", (STALE,), (staleness_panel,)),
    (
        "cost",
        "Active workers and cost",
        (POOL_ACTIVE_WORKERS.key, COST_USD_TOTAL.key),
        (pool_panel, usd_rate_panel),
    ),
    ("broadcast", "Broadcast", (BROADCAST_T_BCAST_S.key,), (bcast_panel,)),
)
CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#222;max-width:1200px;
margin:1.5em auto;padding:0 1em}
h1{font-size:1.5em;margin-bottom:.1em}h2{border-bottom:1px solid #ddd;padding-bottom:.15em;margin-top:1.6em}
nav a{margin-right:.9em}table{border-collapse:collapse;margin:.5em 0}
th,td{border:1px solid #ddd;padding:.2em .6em;text-align:left;vertical-align:top}th{background:#f5f5f5}
td.n{text-align:right;font-variant-numeric:tabular-nums}img{max-width:100%}.muted{color:#777}
.status{display:inline-block;padding:.05em .5em;border-radius:.3em;background:#e8f0fe}
.status.finished{background:#e6f4ea}.status.stopped{background:#fce8e6}code,pre{font-size:.92em}
"""


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the page of ``run_dir`` to ``out`` (default ``<run_dir>/report.html``); returns its path."""
    run = load_run(run_dir)
    path = Path(out) if out is not None else run.path / REPORT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, render_report(run))  # a reader reloading the page never sees half of it
    return path


def render_report(run: Run) -> str:
    """The whole page, one string."""
    s = summarize(run)
    label, note = s["status"]
    sections = [("summary", "Summary", _summary_html(s))]
    sections += [(sid, title, _plot_html(run, keys, panels)) for sid, title, keys, panels in PLOTS]
    sections += [
        ("pool", "Pool", _pool_html(run)),
        ("decisions", "Controller decisions", _decisions_html(run)),
        ("rejections", "Rejections", _rejections_html(run)),
        ("config", "Resolved config", _config_html(run)),
    ]
    nav = " ".join(f'<a href="#{sid}">{_e(title)}</a>' for sid, title, _ in sections)
    body = "\n".join(f'<section id="{sid}"><h2>{_e(t)}</h2>\n{b}</section>' for sid, t, b in sections)
    made = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>echo2 report: {_e(run.path.name)}</title><style>{CSS}</style></head><body>\n"
        f"<h1>echo2 run report</h1>\n<p><code>{_e(run.path.resolve())}</code> "
        f'<span class="status {_e(label)}">{_e(label)}</span> <span class="muted">{_e(note)}</span><br>'
        f'<span class="muted">report made {made}</span></p>\n<nav>{nav}</nav>\n{body}\n</body></html>\n'
    )


def _summary_html(s: dict[str, Any]) -> str:
    acc = "{} → {} (best {})".format(
        *(_pct(s[k]) for k in ("initial_accuracy", "final_accuracy", "best_accuracy"))
    )
    budget = f" (S = {s['staleness_budget']})" if s["staleness_budget"] is not None else ""
    version = _fmt(s["version"])
    if s["resumed_from"] is not None:
        version += f" (resumed from {s['resumed_from']})"
    rows = [
        ("status", s["status"][0]),
        ("loop", "asynchronous (echo2 run / learner)" if s["asynchronous"] else "synchronous (echo2 train)"),
        ("learner steps", _fmt(s["steps"])),
        ("policy version", version),
        ("wall time of the loop", _secs(s["wall_s"])),
        ("held-out accuracy", acc),
        ("bubble ratio", _pct(s["bubble_ratio"])),
        ("max staleness", _fmt(s["staleness_max"]) + budget),
        ("$ total (at catalogue prices)", _usd(s["usd_total"])),
    ]
    source = ", ".join(s["from_summary"]) if s["from_summary"] else "none (computed from metrics.jsonl)"
    out = _table(("", "value"), rows) + f'<p class="muted">from summary.json: {_e(source)}</p>\n'
    return out + "<h3>Bubble by cause</h3>\n" + _bubble_html(s["bubble"])


def _bubble_html(bubble: dict[str, Any] | None) -> str:
    if not bubble or not _isnum(bubble.get("window_s")):
        return _missing(f"no step record holds {LEARNER_STEP_WALL_S.key}")
    window = bubble["window_s"]
    idle = bubble.get("idle_s_by_cause") or {}
    share = (lambda v: _pct(v / window)) if window > 0 else (lambda v: NOT_RECORDED)
    rows = [(f"idle: {c}", _secs(idle.get(c)), share(idle.get(c) or 0.0)) for c in CAUSES]
    rows.append(("inside updates", _secs(bubble.get("train_s")), share(bubble.get("train_s") or 0.0)))
    rows.append(("window", _secs(window), share(window)))
    return _table(("", "seconds", "share of the window"), rows, numeric=(1, 2))


def _plot_html(run: Run, keys: Sequence[str], panels: Sequence[Panel]) -> str:
    if not run.has(*keys):
        return _missing(f"no record holds {' or '.join(keys)}")
    fig = _figure(run, panels, width=6.0, height=3.8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img alt="{_e(", ".join(keys))}" src="{uri}">\n'


def _pool_html(run: Run) -> str:
    if run.workers is None:
        return _absent(run, "workers.json")
    rows = [
        (
            w.get("worker_id"),
            w.get("name"),
            w.get("hardware") or "",
            _usd(w.get("usd_per_hour")),
            _fmt(w.get("rollouts_per_s")),
            "none reported" if w.get("installed_version") in (None, -1) else _fmt(w["installed_version"]),
            _fmt(w.get("rollouts")),
        )
        for w in run.workers
        if isinstance(w, dict)
    ]
    head = ("worker", "name", "hardware", "$/h", "own estimate (rollouts/s)", "installed version", "admitted")
    return (
        _table(head, rows, numeric=(3, 4, 5, 6))
        + '<p class="muted">as last saved in workers.json (it may lag the run)</p>\n'
    )


def _decisions_html(run: Run) -> str:
    """activation.jsonl, else summary.json's copy (the file appears only at the first decision)."""
    summary = run.summary or {}
    decisions = run.decisions
    if decisions is None and isinstance(summary.get("activation_decisions"), list):
        decisions = summary["activation_decisions"]
    if decisions is None:
        return _absent(run, "activation.jsonl")
    if not decisions:
        return "<p>none: the controller kept the pool as it was</p>\n"
    names = {w.get("worker_id"): w.get("name") for w in run.workers or () if isinstance(w, dict)}
    start = (summary.get("bubble") or {}).get("start_unix")  # the loop's start, unix time
    rows = []
    for d in decisions:
        if not isinstance(d, dict):
            continue
        wid = d.get("worker_id")
        who = f"{wid} ({names[wid]})" if wid in names else wid
        rows.append((_clock(d.get("time_s"), start), d.get("action"), who, d.get("reason")))
    return _table(("time", "action", "worker", "reason"), rows)


def _rejections_html(run: Run) -> str:
    """``store/rejected/<reason>`` of the store's final counts (summary.json), else of the last record."""
    final = (run.summary or {}).get("store")
    if isinstance(final, dict) and STORE_REJECTED.key in final:
        src, where = final, "the store's final counts (summary.json)"
    else:
        src = next((r for r in reversed(run.records) if STORE_REJECTED.key in r), None)
        where = "the last record of metrics.jsonl"
    if src is None:
        return _missing(f"no record holds {STORE_REJECTED.key}")
    reasons = [
        (k.removeprefix(STORE_REJECTED_BY.prefix), _fmt(v))
        for k, v in src.items()
        if STORE_REJECTED_BY.matches(k)
    ]
    counts = ", ".join(
        f"{k.removeprefix('store/')} {_fmt(src.get(k))}"
        for k in (STORE_ADMITTED.key, STORE_DROPPED_STALE.key)
    )
    table = _table(
        ("reason", "rejected"), [*sorted(reasons), ("total", _fmt(src[STORE_REJECTED.key]))], numeric=(1,)
    )
    top = table if reasons else f"<p>none ({_fmt(src[STORE_REJECTED.key])} rejected)</p>\n"
    return top + f'<p>{_e(counts)} <span class="muted">(from {_e(where)})</span></p>\n'


def _config_html(run: Run) -> str:
    if not isinstance(run.config, dict):
        return _absent(run, "config.json")
    rows = list(_flatten(run.config))
    table = _table(("key", "value"), rows)
    return f"<details><summary>config.json ({len(rows)} fields)</summary>\n{table}</details>\n"


def _flatten(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    for key, value in sorted(tree.items()):
        if isinstance(value, dict) and value:
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", json.dumps(value)


# ---- formatting ------------------------------------------------------------------------------------
def _e(value: Any) -> str:
    """Escaped for HTML: worker names, hardware and reasons come from peers."""
    return html.escape(str(value), quote=True)


def _missing(detail: str) -> str:
    return f'<p class="muted">{NOT_RECORDED} ({_e(detail)})</p>\n'


def _absent(run: Run, name: str) -> str:
    """An optional file of the run directory that is not there, or could not be read."""
    if name in run.unreadable:
        return _missing(f"{name} could not be read: {run.unreadable[name]}")
    return _missing(f"no {name} in the run directory")


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]], numeric: Sequence[int] = ()) -> str:
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    trs = "".join(
        "<tr>"
        + "".join(f"<td{' class=n' if i in numeric else ''}>{_e(c)}</td>" for i, c in enumerate(row))
        + "</tr>\n"
        for row in rows
    )
    return f"<table><tr>{th}</tr>\n{trs}</table>\n"


def _isnum(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _fmt(v: Any) -> str:
    if v is None:
        return NOT_RECORDED
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _pct(v: Any) -> str:
    return f"{v:.1%}" if _isnum(v) else _fmt(v)


def _secs(v: Any) -> str:
    return f"{v:.2f} s" if _isnum(v) else _fmt(v)


def _usd(v: Any) -> str:
    if not _isnum(v):
        return _fmt(v)
    return f"${v:,.2f}" if abs(v) >= 1 else f"${v:.3g}"


def _clock(t: Any, start: Any) -> str:
    if not _isnum(t):
        return _fmt(t)
    wall = time.strftime("%H:%M:%S UTC", time.gmtime(t))
    return f"{wall} (loop +{t - start:.1f} s)" if _isnum(start) else wall
