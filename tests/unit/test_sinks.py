"""Experiment-tracker sinks (observe/sinks.py): each tracker writes for real, offline, through
``RunDir(..., sinks=...)``, and is read back with the tool's own reader. The tracker process that hosts
them for a run (observe/trackers.py), as real child processes: tests/integration/test_trackers.py."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, get_args

import pytest

from echo2.config import SinkName, load_config
from echo2.errors import ConfigError
from echo2.observe.rundir import RunDir, read_metrics
from echo2.observe.sinks import SINKS, MemorySink, open_sinks
from echo2.observe.trackers import start_trackers

CONFIG = {
    "seed": 0,
    "grpo": {"lr": 2e-4, "loss_agg": "token-mean"},
    "model": {"path": None},
    "runtime": {"join_token": "do-not-upload-this-token"},
}
# What a learner logs: a step-0 evaluation, then updates; None, text and NaN are not sent to trackers.
RECORDS: list[dict[str, Any]] = [
    {"step": 0, "time_s": 0.0, "learner/version": 0, "reward/accuracy": 0.25},
    {"step": 1, "time_s": 1.5, "learner/loss": 0.5, "store/staleness_max": 2, "reward/accuracy": None},
    {"step": 2, "time_s": 3.0, "learner/loss": 0.25, "cost/usd_total": 0.01, "learner/kl": float("nan")},
    {"step": 3, "time_s": 4.5, "learner/loss": 0.125, "pool/active_workers": 2, "note": "text"},
]
LOSS = [(1, 0.5), (2, 0.25), (3, 0.125)]  # (step, learner/loss) every tracker must give back


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Nothing reaches the network or the home directory."""
    home = tmp_path / "home"
    for var in ("WANDB_MODE", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)  # the sinks' own defaults are under test
    for var in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):
        monkeypatch.delenv(var, raising=False)  # trackio: local store, no Space
    monkeypatch.setenv("TRACKIO_DIR", "unset-below")  # recorded, so the sink's setting is undone after
    monkeypatch.delenv("TRACKIO_DIR")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # even a wrong mode could not upload
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "HF_HOME"):
        monkeypatch.setenv(var, str(home / var.lower()))
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "1")


def _run(run: Path, names: list[SinkName]) -> list[Any]:
    """A fresh run directory that logs RECORDS through ``names``; returns the sinks (closed)."""
    sinks = open_sinks(names, run, "test-run", CONFIG)
    rd = RunDir(run, CONFIG, sinks=sinks)
    for record in RECORDS:
        rd.log(record)
    rd.close()
    assert len(read_metrics(run)) == len(RECORDS)  # metrics.jsonl is untouched by the sinks
    assert all(s.failures == 0 for s in rd.sinks)
    return sinks


def test_tensorboard_scalars_and_hparams_read_back_by_event_accumulator(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    run = tmp_path / "run"
    _run(run, ["tensorboard"])
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("learner/loss")] == LOSS
    assert [(e.step, e.value) for e in acc.Scalars("reward/accuracy")] == [(0, 0.25)]  # None skipped
    assert [(e.step, e.value) for e in acc.Scalars("pool/active_workers")] == [(3, 2.0)]
    tags = set(acc.Tags()["scalars"])
    assert {"store/staleness_max", "cost/usd_total", "time_s"} <= tags
    assert not {"learner/kl", "note", "step"} & tags  # NaN, text and the step itself are not scalars
    # the config, once, as HParams (flattened, the secret masked)
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hp = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hp["grpo.lr"].number_value == pytest.approx(2e-4)
    assert hp["grpo.loss_agg"].string_value == "token-mean"
    assert hp["runtime.join_token"].string_value == "<redacted>"


def test_wandb_offline_run_read_back_by_wandb_leet_inspect(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _run(run, ["wandb"])  # WANDB_MODE unset: the sink chooses offline itself
    (log_file,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log_file)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    records = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [(h["_step"], h["learner/loss"]) for h in history if "learner/loss" in h] == LOSS
    assert [h["_step"] for h in history] == [0, 1, 2, 3]
    assert history[0]["reward/accuracy"] == 0.25 and "reward/accuracy" not in history[1]
    assert not any("learner/kl" in h or "note" in h for h in history)
    (meta,) = [r["run"] for r in records if r["type"] == "run"]
    assert meta["project"] == "echo2" and meta["display_name"] == "test-run"
    config = meta["config"]["update"]
    assert config["grpo"]["lr"] == pytest.approx(2e-4)
    assert config["runtime"]["join_token"] == "<redacted>"


def test_trackio_local_store_read_back_by_its_sqlite_storage(tmp_path: Path) -> None:
    run = tmp_path / "run"
    imported_before = "trackio" in sys.modules
    (sink,) = _run(run, ["trackio"])
    import trackio

    if not imported_before:  # trackio reads TRACKIO_DIR once, at import: then it is the run directory
        assert sink.store == (run / "trackio").resolve()
        assert (run / "trackio" / "echo2.db").is_file()
    logs = trackio.SQLiteStorage.get_logs("echo2", "test-run")
    assert [(r["step"], r["learner/loss"]) for r in logs if "learner/loss" in r] == LOSS
    assert [r["step"] for r in logs] == [0, 1, 2, 3]
    assert not any("learner/kl" in r or "note" in r for r in logs)
    config = trackio.SQLiteStorage.get_run_config("echo2", "test-run")
    assert config["grpo"]["lr"] == pytest.approx(2e-4)
    assert config["runtime"]["join_token"] == "<redacted>"


def test_mlflow_sqlite_store_read_back_by_mlflow_client(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    run = tmp_path / "run"
    _run(run, ["mlflow"])
    client = MlflowClient(f"sqlite:///{(run / 'mlruns' / 'mlflow.db').resolve()}")
    exp = client.get_experiment_by_name("echo2")
    (mlrun,) = client.search_runs([exp.experiment_id])
    assert mlrun.info.run_name == "test-run" and mlrun.info.status == "FINISHED"
    history = client.get_metric_history(mlrun.info.run_id, "learner/loss")
    assert [(m.step, m.value) for m in history] == LOSS
    assert [(m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, "time_s")] == [
        (0, 0.0), (1, 1.5), (2, 3.0), (3, 4.5),
    ]  # fmt: skip
    assert not {"learner/kl", "note", "step"} & set(mlrun.data.metrics)
    assert mlrun.data.params["grpo.lr"] == "0.0002"
    assert mlrun.data.params["runtime.join_token"] == "<redacted>"


def test_the_sync_loop_mirrors_every_numeric_metric_to_tensorboard(
    tiny_overrides: list[str], tmp_path: Path
) -> None:
    """``train.report_to`` end to end through ``echo2 train``'s loop (runtime/loop.py, runtime/local.py)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from echo2.runtime.local import train

    cfg = load_config(overrides=[*tiny_overrides, "train.steps=3", 'train.report_to=["tensorboard"]'])
    summary = train(cfg)
    records = read_metrics(summary.run_dir)
    acc = EventAccumulator(str(Path(summary.run_dir) / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    numeric = {k for r in records for k, v in r.items() if isinstance(v, int | float) and k != "step"}
    assert set(acc.Tags()["scalars"]) == numeric
    loss = [(r["step"], r["learner/loss"]) for r in records if r.get("learner/loss") is not None]
    assert [(e.step, pytest.approx(e.value)) for e in acc.Scalars("learner/loss")] == loss


@pytest.mark.parametrize("opener", [open_sinks, start_trackers], ids=["in-process", "tracker-process"])
@pytest.mark.parametrize("name", get_args(SinkName))
def test_a_missing_package_is_one_line_naming_the_extra(
    name: SinkName, opener: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, name, None)  # what `import <name>` sees when it is not installed
    with pytest.raises(ConfigError) as err:
        opener([name], tmp_path / "run", "r", CONFIG)
    assert str(err.value) == f"--report-to {name} needs the {name} package: pip install 'echo2[{name}]'"


def test_the_registry_names_every_sink_once() -> None:
    assert set(SINKS) == set(get_args(SinkName))


def test_report_to_is_validated_by_the_config_and_set_by_the_flag() -> None:
    assert load_config().train.report_to == []
    with pytest.raises(ConfigError, match=r"train\.report_to"):
        load_config(None, ['train.report_to=["neptune"]'])
    from echo2.cli.common import add_budget_arguments, add_config_arguments, load_from_args

    p = argparse.ArgumentParser()
    add_config_arguments(p)
    add_budget_arguments(p)
    cfg = load_from_args(p.parse_args(["--report-to", "tensorboard, wandb"]))
    assert cfg.train.report_to == ["tensorboard", "wandb"]
    assert load_from_args(p.parse_args(["--report-to", ""])).train.report_to == []
    with pytest.raises(ConfigError, match=r"train\.report_to"):
        load_from_args(p.parse_args(["--report-to", "tensorbord"]))


class _Broken:
    name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    def log(self, record: dict[str, Any]) -> None:
        self.calls += 1
        raise OSError("disk full")

    def close(self) -> None:
        raise RuntimeError("cannot close either")


def test_a_failing_sink_never_stops_the_run_and_is_disabled_after_three_failures(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken, memory = _Broken(), MemorySink()
    rd = RunDir(tmp_path / "run", CONFIG, sinks=[broken, memory])
    with caplog.at_level(logging.WARNING, logger="echo2.observe.sinks"):
        for step in range(6):
            rd.log({"step": step, "time_s": float(step), "learner/loss": 1.0 / (step + 1)})
        rd.close()  # the broken close is logged, not raised
    assert broken.calls == 3  # disabled after its third failure
    assert [r["step"] for r in memory.records] == list(range(6)) and memory.closed
    records = read_metrics(tmp_path / "run")
    assert len(records) == 6
    assert [r.get("sinks/failures/broken", 0) for r in records] == [0, 1, 2, 3, 3, 3]  # counted
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3, warnings  # first failure, disabled, close
    assert "OSError: disk full" in warnings[0] and "disabled after 3 failures" in warnings[1]


class _SlowToOpen(MemorySink):
    """A tracker whose store is unreachable when the run starts, then comes back."""

    name = "flaky"

    def __init__(self) -> None:
        super().__init__()
        self.opened = False
        self.attempts = 0

    def open(self) -> None:
        self.attempts += 1
        if self.attempts == 1:
            raise ConnectionError("tracker unreachable")
        self.opened = True

    def log(self, record: dict[str, Any]) -> None:
        if not self.opened:
            self.open()
        super().log(record)


def test_a_sink_that_cannot_open_at_start_is_counted_and_opens_on_the_next_record(tmp_path: Path) -> None:
    flaky = _SlowToOpen()
    rd = RunDir(tmp_path / "run", CONFIG, sinks=[flaky])  # RunDir opens it: the first attempt fails
    for step in range(3):
        rd.log({"step": step, "time_s": float(step)})
    rd.close()
    assert flaky.attempts == 2 and [r["step"] for r in flaky.records] == [0, 1, 2]
    assert [r.get("sinks/failures/flaky", 0) for r in read_metrics(tmp_path / "run")] == [1, 1, 1]


def test_a_fresh_run_clears_the_trackers_stores_and_a_resumed_one_keeps_them(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for name in ("tensorboard", "wandb", "trackio", "mlruns"):
        (run / name).mkdir(parents=True)
        (run / name / "old").write_text("an earlier run")
    RunDir(run, CONFIG, resume=True).close()
    assert (run / "wandb" / "old").is_file()
    RunDir(run, CONFIG).close()
    assert not any((run / name).exists() for name in ("tensorboard", "wandb", "trackio", "mlruns"))


def test_background_sinks_get_every_record_in_order_and_close_drains_them(tmp_path: Path) -> None:
    """The learner feeds its trackers from a thread of their own: a slow tracker does not lengthen a
    step, and closing the run directory waits until every record reached every sink."""
    import threading

    class Slow(MemorySink):
        name = "slow"

        def log(self, record: dict[str, Any]) -> None:
            time.sleep(0.02)
            self.thread = threading.current_thread().name
            super().log(record)

    slow = Slow()
    rd = RunDir(tmp_path / "run", {}, sinks=[slow], background=True)
    t0 = time.perf_counter()
    for step in range(10):
        rd.log({"step": step, "time_s": float(step), "learner/loss": 1.0 / (step + 1)})
    assert time.perf_counter() - t0 < 0.1  # ten 20 ms logs did not run on this thread
    rd.close()
    assert [r["step"] for r in slow.records] == list(range(10)) and slow.thread == "echo2-sinks"


def test_a_checkpoint_is_whole_on_disk_or_absent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints are written to a temporary directory, fsynced and renamed: a save that dies midway
    leaves the previous checkpoint the newest, and its leftover is cleared by the next save."""

    from echo2.observe.rundir import STATE_FILE, latest_checkpoint

    class Policy:
        def save(self, path: Path) -> None:
            path.mkdir(parents=True, exist_ok=True)
            (path / "model.safetensors").write_bytes(b"weights")

    class Dies:
        def state_dict(self) -> dict[str, Any]:
            raise OSError("disk full")

    synced: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(str(fd)), real_fsync(fd))[1])
    run = tmp_path / "run"
    rd = RunDir(run, {})
    first = Path(rd.save_checkpoint("step_000010", Policy(), 10))
    assert latest_checkpoint(run) == first and (first / STATE_FILE).is_file()
    assert len(synced) >= 4  # two files, the checkpoint directory, its parent after the rename
    with pytest.raises(OSError, match="disk full"):
        rd.save_checkpoint("step_000020", Policy(), 20, optimizer=Dies())
    assert latest_checkpoint(run) == first  # the torn save is not a checkpoint
    assert not (run / "checkpoints" / "step_000020").exists()
    assert any(p.name.startswith(".tmp-") for p in (run / "checkpoints").iterdir())
    rd.save_checkpoint("step_000030", Policy(), 30)
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step_000010", "step_000030"]  # the leftover is gone
    rd.close()
