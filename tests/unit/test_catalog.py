"""The metrics catalog (observe/catalog.py) is the one definition of every metrics.jsonl key: what a run
writes is in it, what the code spells as a key is in it, the Prometheus names are unique and valid, the
report's panels, the dashboard's charts and the docs' table come from it."""

from __future__ import annotations

import ast
import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from echo2.broadcast.api import BroadcastStats, PublisherCounters
from echo2.broadcast.factory import get_strategy, open_publisher
from echo2.config import load_config
from echo2.data.store import TrajectoryStore
from echo2.observe import catalog, report
from echo2.observe.bubble import CAUSES, BubbleMeter
from echo2.observe.catalog import METRICS, NAMESPACES, PROMETHEUS
from echo2.observe.rundir import RunDir, read_metrics
from echo2.observe.sinks import MemorySink
from echo2.runtime.local import train
from echo2.runtime.members import WorkerRegistry
from echo2.runtime.node import assemble, worker_settings
from echo2.runtime.routes import Identity
from echo2.tasks.registry import build_task
from echo2.weights.manifest import new_signing_key

ROOT = Path(__file__).resolve().parents[2]
_NS = "|".join(NAMESPACES)
KEY = re.compile(rf"(?:{_NS})/[a-z0-9_]+(?:/[a-z0-9_]+)?")  # a metric key's shape
PREFIX = re.compile(rf"(?:{_NS})/(?:[a-z0-9_]+/)?")  # what an f-string key starts with
FAMILIES = {m.prefix for m in METRICS if m.family}
# f-strings whose only fixed part is the namespace: the keys they make are checked where they are made
NAMESPACE_FSTRINGS = {
    "src/echo2/broadcast/api.py": "PublisherCounters.metrics (test_what_the_learner_node_writes_...)",
}


def _uncatalogued(keys: Any) -> list[str]:
    return catalog.unknown(keys)


# ---- (a) what a run writes is in the catalog -------------------------------------------------------
def test_every_key_a_short_train_run_writes_is_in_the_catalog(tiny_overrides, tmp_path):
    cfg = load_config(overrides=[*tiny_overrides, "train.steps=2", "train.eval_every=1"])
    records = read_metrics(train(cfg).run_dir)
    keys = {k for r in records for k in r}
    assert len(records) == 3 and {"learner/loss", "reward/accuracy", "learner/idle_s/wait"} <= keys
    assert _uncatalogued(keys) == []
    assert all("train" in catalog.find(k).writers for k in keys)  # type: ignore[union-attr]


class _Failing(MemorySink):
    name = "flaky"

    def log(self, record: dict[str, Any]) -> None:
        raise OSError("no")


def test_the_run_directory_writes_only_catalogued_keys_of_its_own(tmp_path):
    rd = RunDir(tmp_path / "run", {}, sinks=[_Failing()])
    for step in (1, 2):  # a sink's failures are counted in the records after them
        rd.log({"step": step, "time_s": 0.5 * step, **BubbleMeter().close_step()})
    rd.close()
    last = read_metrics(tmp_path / "run")[-1]
    assert "sinks/failures/flaky" in last
    assert {f"learner/idle_s/{c}" for c in (*CAUSES, "other")} <= set(last)
    assert _uncatalogued(last) == []


def test_what_the_learner_node_writes_each_step_is_in_the_catalog(tmp_path, tiny_policy):
    """The parts AsyncLearner._log merges into every step record (store, snapshots with a real
    publication, pool, intake, lease standings), the broadcast measurement and the publisher's
    counters, as the real node assembles them."""
    cfg = load_config(overrides=["batch.prompts=4", "batch.group_size=2", "staleness.S=2"])
    store = TrajectoryStore(tmp_path / "store.sqlite", cfg.staleness.S, cfg.batch.group_size)
    key = new_signing_key()
    registry = WorkerRegistry(tmp_path, "join-token-for-tests-0123456789", time.time)
    publisher = open_publisher("memory", key, get_strategy("star-limited"), 1 << 10)
    identity = Identity(worker_settings(cfg), key.verifier().to_text(), ("127.0.0.1", 1), {})
    parts = assemble(
        cfg, registry, store, build_task(cfg.task, 0), publisher, identity, 100, lambda: 0, time.time
    )
    store.record_rejection("schema")

    async def publish() -> None:
        await parts.snapshots.publish_model(0, tiny_policy.model)
        await parts.snapshots.flush()

    try:
        asyncio.run(publish())
        written = {
            **store.stats().metrics(),
            **parts.snapshots.metrics(),
            **parts.pool.metrics(),
            **parts.intake.metrics(),
            **parts.metrics(),
        }
    finally:
        store.close()
    measured = BroadcastStats(version=0, n_workers=1, total_size=8, install_s={"w": 0.1}, learner_bytes=8)
    written |= measured.metrics(1.1) | PublisherCounters().metrics()
    assert {"store/rejected/schema", "broadcast/publication_bytes", "broadcast/stall_reports"} <= set(written)
    assert {"leases/benched", "security/quarantined", "pool/active_workers"} <= set(written)
    assert _uncatalogued(written) == []


def _source_files() -> list[Path]:
    return [
        p
        for d in ("src/echo2", "benchmarks", "examples", "scripts")
        for p in sorted((ROOT / d).rglob("*.py"))
    ]


def test_every_key_spelled_in_the_code_is_in_the_catalog():
    """Writers that still spell a key as a literal (the learner's own record, the simulator, the
    benchmarks that read results) are checked here: any string shaped like a metric key, and any
    f-string that builds one, must name a catalogued key or family."""
    unknown, seen = [], 0
    for path in _source_files():
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and KEY.fullmatch(node.value):
                seen += 1
                if catalog.find(node.value) is None:
                    unknown.append(f"{rel}:{node.lineno} {node.value!r}")
            head = node.values[0] if isinstance(node, ast.JoinedStr) and node.values else None
            if (
                isinstance(head, ast.Constant)
                and isinstance(head.value, str)
                and PREFIX.fullmatch(head.value)
            ):
                if head.value.count("/") == 1:  # only the namespace fixed
                    if rel not in NAMESPACE_FSTRINGS:
                        unknown.append(f"{rel}:{node.lineno} f{head.value!r}...: name a family")
                elif head.value not in FAMILIES:
                    unknown.append(f"{rel}:{node.lineno} f{head.value!r}...: not a family's prefix")
    assert seen > 100  # the scan sees the keys (learner, simulator, benchmarks)
    assert not unknown, unknown


def test_each_key_is_catalogued_once_and_spelled_like_one():
    keys = [m.key for m in METRICS]
    assert len(keys) == len(set(keys))
    for m in METRICS:
        assert (
            m.key in ("step", "time_s")
            or KEY.fullmatch(m.key)
            or re.fullmatch(r"[a-z_]+/[a-z_]+/<[a-z]+>", m.key)
        )
        assert m.help and m.unit and m.writers and set(m.writers) <= {"run", "train", "sim"}
        drawn = bool(m.report or m.dashboard)  # labelled iff drawn (a family's members label themselves)
        assert (m.label is not None) == (drawn and not m.family), m.key
    assert catalog.find("learner/idle_s/wait") is catalog.LEARNER_IDLE_S
    assert catalog.find("store/rejected") is catalog.STORE_REJECTED  # the total is not the family
    assert catalog.find("store/rejected/") is None and catalog.find("reward/nope") is None


# ---- (b) the Prometheus names ------------------------------------------------------------------------
def test_prometheus_names_are_unique_and_valid():
    names = [p.name for p in PROMETHEUS]
    assert len(names) == len(set(names)) == len(PROMETHEUS)
    wire: dict[str, str] = {}  # sample name -> its family: no two families may put one name on the wire
    for p in PROMETHEUS:
        assert re.fullmatch(r"echo2_[a-z][a-z0-9_]*", p.name), p.name
        assert p.kind in ("gauge", "counter", "histogram") and p.help
        assert not p.name.endswith(("_total", "_bucket", "_sum", "_count", "_created")), p.name
        for label in p.labels:
            assert re.fullmatch(r"[a-z][a-z0-9_]*", label) and label not in ("le", "quantile"), label
        suffixes = {"gauge": ("",), "counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
        for suffix in suffixes[p.kind]:
            assert wire.setdefault(p.name + suffix, p.name) == p.name, p.name + suffix
    assert not set(wire) & (set(names) - set(wire.values()))


# ---- (c) the docs ------------------------------------------------------------------------------------
def test_docs_metrics_page_is_the_generated_table():
    page = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    assert catalog.render_into(page) == page, (
        "regenerate: python -m echo2.observe.catalog --write docs/metrics.md"
    )
    block = page.split(catalog.BEGIN, 1)[1].split(catalog.END, 1)[0]
    assert block == "\n" + catalog.markdown()
    for m in METRICS:
        assert f"| `{m.key}` |" in block
    for p in PROMETHEUS:
        assert p.name in block


def test_the_generator_prints_and_writes_the_table(tmp_path, capsys):
    assert catalog.main(["--markdown"]) == 0
    assert capsys.readouterr().out == catalog.markdown()
    page = tmp_path / "page.md"
    page.write_text(f"# title\n\n{catalog.BEGIN}\nstale\n{catalog.END}\n\nafter\n")
    assert catalog.main(["--write", str(page)]) == 0
    assert page.read_text() == f"# title\n\n{catalog.BEGIN}\n{catalog.markdown()}{catalog.END}\n\nafter\n"
    page.write_text("no markers")
    with pytest.raises(ValueError, match="no generated block"):
        catalog.main(["--write", str(page)])


def test_every_key_the_docs_name_is_in_the_catalog():
    spans = [
        (p.name, span)
        for p in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
        for span in re.findall(r"`([^`\n]+)`", p.read_text(encoding="utf-8"))
    ]
    named = [
        (page, s) for page, s in spans if KEY.fullmatch(s) or re.fullmatch(r"[a-z_]+/[a-z_]+/<[a-z]+>", s)
    ]
    assert len(named) > 100
    assert [(page, s) for page, s in named if catalog.find(s) is None and s not in catalog.BY_KEY] == []


# ---- the consumers draw what the catalog says -----------------------------------------------------------
def _every_key_run(path: Path) -> report.Run:
    """A run directory whose every step record holds every catalogued key (families: a member each)."""
    path.mkdir()
    rows = []
    for step in range(1, 4):
        rec: dict[str, Any] = {}
        for m in METRICS:
            members = (*CAUSES, "other") if m is catalog.LEARNER_IDLE_S else ("x",)
            for k in [m.of(c) for c in members] if m.family else [m.key]:
                rec[k] = float(step)
        rec.update({"step": step, "time_s": 0.5 * step})
        rows.append(rec)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "config.json").write_text('{"staleness": {"S": 3}}')
    return report.load_run(path)


PANELS = {
    "learning": report.learning_panel,
    "bubble": report.bubble_panel,
    "idle": report.idle_panel,
    "staleness": report.staleness_panel,
    "pool": report.pool_panel,
    "usd_rate": report.usd_rate_panel,
    "bcast": report.bcast_panel,
}


@pytest.mark.parametrize("panel", sorted(PANELS))
def test_each_report_panel_draws_the_catalogs_metrics_under_their_labels(tmp_path, panel):
    from matplotlib.figure import Figure

    fig = Figure()
    PANELS[panel](fig.subplots(), _every_key_run(tmp_path / "run"))
    drawn = [
        artist.get_label()
        for ax in fig.axes
        for artist in (*ax.get_lines(), *ax.containers)
        if not artist.get_label().startswith(("_", "S = "))  # matplotlib's own; the budget line
    ]
    expected = catalog.in_report(panel)  # type: ignore[arg-type]
    assert expected, panel
    if panel == "idle":  # the family: one bar per cause
        assert drawn == [*CAUSES, "other"]
        return
    labels = [m.label.replace("$", r"\$") for m in expected]  # type: ignore[union-attr]
    assert len(drawn) == len(labels) and all(d.startswith(x) for d, x in zip(drawn, labels, strict=True)), (
        drawn
    )


def test_the_dashboard_page_charts_exactly_the_catalogs_series():
    from importlib import resources

    page = resources.files("echo2.observe").joinpath("static", "dashboard.html").read_text(encoding="utf-8")
    charts = dict(re.findall(r'chart\("c-(\w+)", "lg-\w+", xs, \[(.*?)\n    \]', page, re.S))
    assert set(charts) == {m.dashboard for m in METRICS if m.dashboard}
    for chart, body in charts.items():
        assert re.findall(r'\bs\["([^"]+)"\]', body) == [m.key for m in catalog.in_dashboard(chart)], chart  # type: ignore[arg-type]


def test_the_terminal_view_columns_come_from_the_catalog():
    from echo2.observe import view

    assert [name for name, _, _ in view._FIELDS] == [
        "v",
        "reward",
        "acc",
        "bubble",
        "stale",
        "workers",
        "usd/h",
    ]
    assert [key for _, key, _ in view._FIELDS] == [c.metric.key for c in catalog.VIEW]
    assert all(catalog.find(c.metric.key) is c.metric for c in catalog.VIEW)
