"""`echo2 report`: the offline HTML page of a run directory, built from synthetic run directories
written with the real metric names (no training here)."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest

from echo2.cli import main
from echo2.errors import Echo2Error
from echo2.observe.report import load_run, plot_run, summarize, write_report

CAUSES = ("wait", "publish", "eval", "checkpoint", "log", "other")
PNG = b"\x89PNG\r\n\x1a\n"


def _step(step: int, t: float, asynchronous: bool = True) -> dict:
    """One learner step's record as the learner writes it (wall 0.5 s, 0.4 s inside the update)."""
    rec = {
        "step": step,
        "learner/loss": 0.1,
        "learner/t_train_s": 0.4,
        "learner/version": step,
        "store/staleness_mean": 1.5 if asynchronous else 0.0,
        "store/staleness_max": (step % 3) if asynchronous else 0,
        "reward/mean": 0.1 * step,
        "time_s": t,
        "learner/bubble_ratio": 0.2,
        "learner/step_wall_s": 0.5,
        "learner/update_s": 0.4,
        "learner/idle_s/wait": 0.05,
        "learner/idle_s/publish": 0.02,
        "learner/idle_s/eval": 0.01,
        "learner/idle_s/checkpoint": 0.01,
        "learner/idle_s/log": 0.005,
        "learner/idle_s/other": 0.005,
        "store/admitted": 16 * step,
        "store/dropped_stale": 1,
        "store/rejected": 0,
    }
    if asynchronous:
        rec.update(
            {
                "store/size": 8,
                "store/rejected": 3,
                "store/rejected/schema": 2,
                "store/rejected/replay": 1,
                "broadcast/t_bcast_s": 0.05,
                "broadcast/bytes": 51328.0,
                "broadcast/install_p90_s": 0.06,
                "pool/mu_pool": 120.0,
                "pool/mu_target": None,
                "pool/active_workers": 2 if step < 4 else 1,
                "cost/usd_per_step": 0.001,
                "cost/usd_total": 0.001 * step,
                "cost/usd_per_hour": 12.94,
            }
        )
    return rec


def _write_run(path: Path, asynchronous: bool = True, summary: bool = True) -> Path:
    path.mkdir(parents=True)
    records = [{"step": 0, "time_s": 0.0, "learner/version": 0, "reward/accuracy": 0.25}]
    for step in range(1, 7):
        records.append(_step(step, 0.5 * step, asynchronous))
    records[3]["reward/accuracy"] = 0.6875
    records[6]["reward/accuracy"] = 0.71875
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = {"staleness": {"S": 3 if asynchronous else 0, "kappa": 2}, "batch": {"prompts": 4}, "seed": 0}
    (path / "config.json").write_text(json.dumps(config))
    if summary:
        idle = dict(zip(CAUSES, (0.3, 0.12, 0.06, 0.06, 0.03, 0.03), strict=True))  # 6 x the step's
        bubble = {"start_unix": 1_700_000_000.0, "window_s": 3.0, "train_s": 2.4, "bubble_ratio": 0.2}
        bubble["idle_s_by_cause"] = idle
        s = {"steps": 6, "wall_s": 3.0, "initial_accuracy": 0.25, "final_accuracy": 0.71875}
        s.update({"best_accuracy": 0.71875, "bubble_ratio": 0.2, "bubble": bubble})
        if asynchronous:
            s.update({"version": 6, "resumed_from": None, "staleness_max": 2, "usd_total": 0.006})
            s.update({"staleness_budget": 3, "store": {"store/admitted": 100, "store/dropped_stale": 1}})
            s["store"].update({"store/rejected": 3, "store/rejected/schema": 2, "store/rejected/replay": 1})
        (path / "summary.json").write_text(json.dumps(s))
    if asynchronous:
        workers = [
            {"worker_id": "w0-aaaaaa", "name": "local-0", "usd_per_hour": 0.35, "hardware": "rtx5090",
             "rollouts_per_s": 400.0, "installed_version": 6, "rollouts": 512},
            {"worker_id": "w1-bbbbbb", "name": "<b>bold</b>", "usd_per_hour": 0.79, "hardware": "l40s",
             "rollouts_per_s": 1.0, "installed_version": -1, "rollouts": 0},
        ]  # fmt: skip
        (path / "workers.json").write_text(json.dumps(workers))
        decision = {
            "time_s": 1_700_000_002.5,
            "action": "release",
            "worker_id": "w1-bbbbbb",
            "reason": "surplus",
        }
        (path / "activation.jsonl").write_text(json.dumps(decision) + "\n")
    return path


def _images(page: str) -> list[str]:
    return re.findall(r'<img[^>]*\bsrc="([^"]*)"', page)


def _assert_offline(page: str) -> None:
    assert "http://" not in page and "https://" not in page
    assert "<script" not in page and "<link" not in page and "@import" not in page
    for src in _images(page):
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(PNG)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, str]:
    run = _write_run(tmp_path_factory.mktemp("report") / "run")
    out = write_report(run)
    return out, out.read_text()


def test_a_finished_run_gives_one_offline_page(finished):
    out, page = finished
    assert out.name == "report.html" and out.stat().st_size > 10_000
    _assert_offline(page)
    assert len(_images(page)) == 5  # learning, bubble, staleness, workers and cost, broadcast
    for section in ("summary", "learning", "bubble", "staleness", "cost", "broadcast", "pool", "decisions"):
        assert f'<section id="{section}">' in page
    assert '<section id="rejections">' in page and '<section id="config">' in page


def test_the_summary_holds_the_run_numbers(finished):
    _, page = finished
    assert "finished" in page and "asynchronous" in page
    assert "25.0% → 71.9% (best 71.9%)" in page  # held-out accuracy: initial -> final (best)
    assert "<td>bubble ratio</td><td>20.0%</td>" in page
    assert "<td>max staleness</td><td>2 (S = 3)</td>" in page
    assert "$0.006" in page and "3.00 s" in page
    # the bubble by cause, from summary.json's bubble block: wait 0.30 s of a 3.00 s window
    assert "<td>idle: wait</td><td class=n>0.30 s</td><td class=n>10.0%</td>" in page
    assert "<td>inside updates</td><td class=n>2.40 s</td><td class=n>80.0%</td>" in page


def test_the_pool_decisions_and_rejections_are_tabled(finished):
    _, page = finished
    assert "<td>w0-aaaaaa</td><td>local-0</td><td>rtx5090</td><td class=n>$0.35</td>" in page
    assert "<td class=n>400</td><td class=n>6</td><td class=n>512</td>" in page
    assert "none reported" in page  # installed_version -1
    assert "&lt;b&gt;bold&lt;/b&gt;" in page and "<b>bold</b>" not in page  # names from peers are escaped
    assert "<td>release</td><td>w1-bbbbbb (&lt;b&gt;bold&lt;/b&gt;)</td><td>surplus</td>" in page
    assert "(loop +2.5 s)" in page  # decision time against the loop's start (summary.json)
    assert "<td>schema</td><td class=n>2</td>" in page and "<td>replay</td><td class=n>1</td>" in page
    assert "<details><summary>config.json" in page and "<td>staleness.S</td><td>3</td>" in page


def test_a_train_run_without_pool_files_says_not_recorded(tmp_path):
    run = _write_run(tmp_path / "train", asynchronous=False)
    page = write_report(run).read_text()
    _assert_offline(page)
    assert "synchronous (echo2 train)" in page
    assert "not recorded (no workers.json in the run directory)" in page
    assert "not recorded (no activation.jsonl in the run directory)" in page
    assert "not recorded (no record holds broadcast/t_bcast_s)" in page
    assert "<td>$ total (at catalogue prices)</td><td>not recorded</td>" in page
    assert "<p>none (0 rejected)</p>" in page
    assert len(_images(page)) == 3  # learning, bubble, staleness


def test_a_running_run_is_summarised_from_its_records(tmp_path):
    run = _write_run(tmp_path / "running", summary=False)
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 7, "learner/t_tr')  # a record being written: skipped
    s = summarize(load_run(run))
    assert s["status"][0] == "running" and s["from_summary"] == []
    assert s["steps"] == 6 and s["version"] == 6 and s["staleness_max"] == 2
    assert s["bubble"]["window_s"] == pytest.approx(3.0) and s["bubble_ratio"] == pytest.approx(0.2)
    assert s["bubble"]["idle_s_by_cause"]["wait"] == pytest.approx(0.3)
    assert (s["initial_accuracy"], s["final_accuracy"], s["best_accuracy"]) == (0.25, 0.71875, 0.71875)
    page = write_report(run, tmp_path / "out" / "page.html").read_text()
    assert "running" in page and "none (computed from metrics.jsonl)" in page
    (run / "activation.jsonl").write_text("{not json}\n")
    assert "activation.jsonl could not be read" in write_report(run).read_text()


def test_no_decisions_yet_reads_from_the_summary(tmp_path):
    run = _write_run(tmp_path / "run")
    (run / "activation.jsonl").unlink()  # the controller writes it at its first decision
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "activation_decisions": []}))
    (run / "workers.json").write_text("{}")  # not the registry's list
    page = write_report(run).read_text()
    assert "none: the controller kept the pool as it was" in page
    assert "workers.json could not be read" in page and "expected a JSON list" in page


def test_a_resumed_run_keeps_wall_time_going(tmp_path):
    run = _write_run(tmp_path / "resumed", summary=False)
    later = [{"step": 6, "time_s": 0.0, "learner/version": 6, "reward/accuracy": 0.7}, _step(7, 0.5)]
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in later))
    times = [r["time_s"] for r in load_run(run).records]
    assert times == sorted(times) and times[-1] == pytest.approx(3.5)


def test_a_directory_without_metrics_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(Echo2Error, match="not a run directory"):
        write_report(tmp_path)
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a run directory: it does not exist" in err


def test_the_command_writes_the_page(tmp_path, capsys):
    run = _write_run(tmp_path / "run", asynchronous=False)
    assert main(["report", str(run)]) == 0
    assert (run / "report.html").is_file() and "wrote" in capsys.readouterr().out
    assert main(["report", str(run), "--out", str(tmp_path / "elsewhere.html")]) == 0
    assert (tmp_path / "elsewhere.html").read_text().startswith("<!DOCTYPE html>")


def test_plot_run_still_writes_run_png(tmp_path):
    out = plot_run(_write_run(tmp_path / "run"))
    assert out.name == "run.png" and out.read_bytes().startswith(PNG)
