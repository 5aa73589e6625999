"""The tracker process (observe/trackers.py) that hosts the experiment-tracker sinks for a run, as real
child processes (the sinks themselves: tests/unit/test_sinks.py)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from echo2.errors import ConfigError
from echo2.observe.rundir import RunDir, read_metrics
from echo2.observe.trackers import NICENESS, TrackerProcess, start_trackers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the sinks' records and fixture
from test_sinks import CONFIG, LOSS, RECORDS, _offline  # noqa: F401  (_offline: autouse)

pytestmark = pytest.mark.integration


def _niceness(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def test_all_four_trackers_write_from_a_child_process_at_lower_priority(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    (proc,) = start_trackers(["tensorboard", "wandb", "trackio", "mlflow"], run, "test-run", CONFIG)
    pid = proc._proc.pid
    assert pid != os.getpid() and _niceness(pid) == _niceness(os.getpid()) + NICENESS
    rd = RunDir(run, CONFIG, sinks=[proc], background=True)  # as the learner opens it
    for record in RECORDS:
        rd.log(record)
    rd.close()
    assert proc._proc.returncode == 0 and rd.sinks[0].failure_counts() == {}
    assert len(read_metrics(run)) == len(RECORDS)
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("learner/loss")] == LOSS
    client = MlflowClient(f"sqlite:///{(run / 'mlruns' / 'mlflow.db').resolve()}")
    (mlrun,) = client.search_runs([client.get_experiment_by_name("echo2").experiment_id])
    assert mlrun.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, "learner/loss")] == LOSS
    assert (run / "trackio" / "echo2.db").stat().st_size > 0  # written by a fresh trackio: in the run
    assert list((run / "wandb").glob("offline-run-*/run-*.wandb"))


def test_a_tracker_failing_in_the_process_is_counted_in_the_next_records(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "tensorboard").write_text("a file where TensorBoard wants its directory")
    (proc,) = start_trackers(["tensorboard"], run, "r", CONFIG)
    rd = RunDir(run, CONFIG, sinks=[proc], background=True)
    step = 0
    while not proc.failure_counts():  # every write fails; the child reports the count back
        rd.log({"step": step, "time_s": float(step), "learner/loss": 1.0})
        step += 1
        assert step < 400, "no failure was reported"
        time.sleep(0.05)
    rd.log({"step": step, "time_s": float(step)})
    rd.close()
    records = read_metrics(run)
    assert len(records) == step + 1  # the run's own record is whole
    assert records[-1]["sinks/failures/tensorboard"] >= 1


def test_the_run_goes_on_when_the_tracker_process_dies(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (proc,) = start_trackers(["tensorboard"], run, "r", CONFIG)
    rd = RunDir(run, CONFIG, sinks=[proc])
    rd.log({"step": 0, "time_s": 0.0})
    os.kill(proc._proc.pid, signal.SIGKILL)
    proc._proc.wait(10)
    for step in range(1, 6):
        rd.log({"step": step, "time_s": float(step)})
    rd.close()  # returns: nothing to wait for
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(6))
    assert [r.get("sinks/failures/trackers", 0) for r in records] == [0, 0, 1, 2, 3, 3]  # then disabled


def test_a_tracker_that_is_installed_but_broken_is_one_line_naming_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "site"
    (fake / "wandb").mkdir(parents=True)
    (fake / "wandb" / "__init__.py").write_text("raise ImportError('its protobuf is too old')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(fake), *sys.path]))  # the child imports this
    with pytest.raises(ConfigError) as err:
        TrackerProcess(["wandb"], tmp_path / "run", "r", CONFIG)
    assert str(err.value) == (
        "--report-to wandb needs the wandb package: pip install 'echo2[wandb]' "
        "(importing it failed: its protobuf is too old)"
    )
