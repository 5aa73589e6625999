"""Experiment-tracker sinks: the one metrics path (:meth:`RunDir.log` -> ``metrics.jsonl``) mirrored to
TensorBoard, W&B, trackio or MLflow (``train.report_to`` / ``--report-to``).

``metrics.jsonl`` stays the record of a run; a sink gets every record right after it is written there
and logs each finite number under its exact name (``learner/loss``, ``reward/accuracy``, ...) at the
record's ``step``, plus the run's config once, when it opens. Each tracker writes under the run
directory unless the user pointed it elsewhere through the tool's own environment variables:

| sink | store | the tool's own override |
|---|---|---|
| tensorboard | ``<run_dir>/tensorboard/`` event files | |
| wandb | ``<run_dir>/wandb/offline-run-*`` (offline mode) | ``WANDB_MODE``, ``WANDB_PROJECT`` |
| trackio | ``<run_dir>/trackio/echo2.db`` (SQLite) | ``TRACKIO_DIR`` (read at import), ``TRACKIO_SPACE_ID`` |
| mlflow | ``<run_dir>/mlruns/mlflow.db`` (SQLite) | ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME`` |

A sink imports its library when it is built, so a missing package fails before training starts (one
line naming the pip extra), but opens its store only when :class:`RunDir` calls its ``open()`` (or on
the first record): the run directory is built after its sinks and first clears an earlier run's
outputs, these stores included (:data:`TRACKER_DIRS`).

A run (``echo2 run``, ``echo2 train``) does not build these in its own process: it starts
:class:`~echo2.observe.trackers.TrackerProcess`, a child that builds them there and is fed the
records down a pipe, so no tracker holds the learner's interpreter lock.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from echo2.config import SinkName
from echo2.errors import ConfigError

log = logging.getLogger(__name__)

PROJECT = "echo2"  # W&B project, trackio project and MLflow experiment, unless the user's env says otherwise
TRACKER_DIRS = ("tensorboard", "wandb", "trackio", "mlruns")  # what the sinks write under a run directory
MAX_FAILURES = 3  # a sink that fails this many times is disabled for the rest of the run
_SECRET = re.compile(r"(token|secret|password|api_key)$")  # config fields never sent to a tracker


class MetricSink(Protocol):
    """Where a run's metric records go besides ``metrics.jsonl``. A record always has ``step`` (the
    learner version) and ``time_s`` (seconds since the loop started); other values may be None.
    A sink whose store is slow to open may also have ``open()``: :class:`RunDir` calls it once, after
    preparing the directory and before the learner serves workers (else it opens on the first record)."""

    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class MemorySink:
    """Keeps the records in a list: the in-memory sink for tests and notebooks."""

    name = "memory"

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.closed = False

    def log(self, record: dict[str, Any]) -> None:
        self.records.append(dict(record))

    def close(self) -> None:
        self.closed = True


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's finite numbers (bools as 0/1) under their names, without ``step``."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, int | float) and math.isfinite(v)
    }


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"grpo": {"lr": 2e-4}}`` -> ``{"grpo.lr": 2e-4}``, with secrets (``runtime.join_token``) masked."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = _mask(key, value)
    return out


def public_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config as a nested dict, secrets masked (for tools that take nested config)."""
    return {k: public_config(v) if isinstance(v, dict) else _mask(k, v) for k, v in config.items()}


def _mask(key: str, value: Any) -> Any:
    return "<redacted>" if value is not None and _SECRET.search(key) else value


def _require(name: SinkName, module: str | None = None) -> Any:
    """Import the tracker's package (each is named like its sink and its extra), then ``module`` if
    given; a missing one fails with one line naming the pip extra."""
    try:
        importlib.import_module(name)
        return importlib.import_module(module or name)
    except ImportError as exc:
        missing = isinstance(exc, ModuleNotFoundError) and exc.name == name
        why = "" if missing else f" (importing it failed: {exc})"  # installed but broken: say how
        raise ConfigError(
            f"--report-to {name} needs the {name} package: pip install 'echo2[{name}]'{why}"
        ) from None


@contextlib.contextmanager
def _stdout_to_log(tool: str) -> Iterator[None]:
    """Some trackers print banners; route them through ``logging`` so the live view stays clean."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            yield
    finally:
        for line in buf.getvalue().splitlines():
            if line.strip():
                log.info("%s: %s", tool, line.strip())


class TensorBoardSink:
    """Scalars via ``torch.utils.tensorboard.SummaryWriter`` into ``<run_dir>/tensorboard/``; the
    config as HParams (flattened, ``grpo.lr``)."""

    name: SinkName = "tensorboard"

    def __init__(self, run_path: Path, run_name: str, config: dict[str, Any]) -> None:
        self._tb = _require(self.name, "torch.utils.tensorboard")
        self.dir = Path(run_path) / "tensorboard"
        self._config = config
        self._writer: Any = None

    def _open(self, step: int) -> Any:
        from torch.utils.tensorboard.summary import hparams

        # purge_step: a resumed run hides what a crashed one logged at or after its first step
        writer = self._tb.SummaryWriter(log_dir=str(self.dir), purge_step=step, flush_secs=10)
        hp = {
            k: v if isinstance(v, int | float | str | bool) else str(v)
            for k, v in flat_config(self._config).items()
        }
        for summary in hparams(hp, {}):
            writer.file_writer.add_summary(summary)
        return writer

    def log(self, record: dict[str, Any]) -> None:
        """One event per record holding all its scalars (``add_scalar`` writes one event per value;
        TensorBoard reads both alike)."""
        if self._writer is None:
            self._writer = self._open(record["step"])
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=k, simple_value=v) for k, v in scalars(record).items()]
        self._writer.file_writer.add_summary(Summary(value=values), global_step=record["step"])

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class WandbSink:
    """``wandb.init(mode="offline", dir=<run_dir>)``: files under ``<run_dir>/wandb/``; upload later
    with ``wandb sync``. ``WANDB_MODE=online`` (or any W&B env setting) is the user's to choose."""

    name: SinkName = "wandb"

    def __init__(self, run_path: Path, run_name: str, config: dict[str, Any]) -> None:
        self._wandb = _require(self.name)
        self.run_path, self.run_name, self._config = Path(run_path), run_name, config
        self._run: Any = None

    def open(self) -> None:
        if self._run is None:
            self.run_path.mkdir(parents=True, exist_ok=True)
            self._run = self._wandb.init(
                project=os.environ.get("WANDB_PROJECT") or PROJECT,
                name=self.run_name,
                dir=str(self.run_path),
                config=public_config(self._config),
                mode=None if os.environ.get("WANDB_MODE") else "offline",
            )

    def log(self, record: dict[str, Any]) -> None:
        self.open()
        self._run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()


class TrackioSink:
    """``trackio.init/log/finish`` into trackio's local SQLite store. trackio reads its directory
    (``TRACKIO_DIR``) once, when it is first imported: echo2 points it at ``<run_dir>/trackio/`` when
    the user has not set it and trackio is not imported yet (true for ``echo2 run`` / ``echo2 train``);
    otherwise metrics go to the store trackio already uses (:attr:`store`, logged)."""

    name: SinkName = "trackio"

    def __init__(self, run_path: Path, run_name: str, config: dict[str, Any]) -> None:
        wanted = Path(run_path) / "trackio"
        point = "trackio" not in sys.modules and not os.environ.get("TRACKIO_DIR")
        if point:
            os.environ["TRACKIO_DIR"] = str(wanted.resolve())
        try:
            self._trackio = _require(self.name)
        except ConfigError:
            if point:
                os.environ.pop("TRACKIO_DIR", None)
            raise
        self.store = Path(self._trackio.TRACKIO_DIR)  # where it really writes (<project>.db)
        if self.store.resolve() != wanted.resolve():
            log.info(
                "trackio writes to its store %s, not %s (set before echo2 opened it)", self.store, wanted
            )
        self.run_name, self._config = run_name, config
        self._run: Any = None

    def open(self) -> None:
        if self._run is None:
            with _stdout_to_log("trackio"):
                self._run = self._trackio.init(
                    project=PROJECT,
                    name=self.run_name,
                    config=public_config(self._config),
                    embed=False,
                    auto_log_cpu=False,  # only echo2's metrics; no sampler thread on the learner's cores
                    auto_log_gpu=False,
                )

    def log(self, record: dict[str, Any]) -> None:
        self.open()
        self._run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        if self._run is not None:
            with _stdout_to_log("trackio"):
                self._run.finish()


class MlflowSink:
    """``MlflowClient(tracking_uri)``: a SQLite store at ``<run_dir>/mlruns/mlflow.db`` (MLflow 3
    refuses the plain file store) unless ``MLFLOW_TRACKING_URI`` is set; one MLflow run per echo2 run,
    the flattened config as params. The client, not ``mlflow.set_tracking_uri``: no process-global
    state, so a user's own MLflow use in the same process is left alone."""

    name: SinkName = "mlflow"
    _PARAMS_PER_BATCH = 100  # MLflow's log_batch limits
    _METRICS_PER_BATCH = 1000
    _PARAM_CHARS = 6000  # MLflow's longest param value

    def __init__(self, run_path: Path, run_name: str, config: dict[str, Any]) -> None:
        self._mlflow = _require(self.name)
        self.dir = Path(run_path) / "mlruns"
        self.run_name, self._config = run_name, config
        self.tracking_uri = (
            os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{self.dir.resolve()}/mlflow.db"
        )
        self._client: Any = None
        self.run_id: str | None = None

    def open(self) -> None:
        if self._client is not None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        client = self._mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or PROJECT
        exp = client.get_experiment_by_name(name)
        local = not os.environ.get("MLFLOW_TRACKING_URI")
        exp_id = (
            exp.experiment_id
            if exp is not None
            else client.create_experiment(
                name, artifact_location=(self.dir / "artifacts").resolve().as_uri() if local else None
            )
        )
        run_id = client.create_run(exp_id, run_name=self.run_name).info.run_id
        Param = self._mlflow.entities.Param
        params = [Param(k, str(v)[: self._PARAM_CHARS]) for k, v in flat_config(self._config).items()]
        for i in range(0, len(params), self._PARAMS_PER_BATCH):
            client.log_batch(run_id, params=params[i : i + self._PARAMS_PER_BATCH])
        self._client, self.run_id = client, run_id

    def log(self, record: dict[str, Any]) -> None:
        self.log_many([record])

    def log_many(self, records: list[dict[str, Any]]) -> None:
        """All the records' metrics in as few ``log_batch`` calls as MLflow allows (the SQLite store
        costs less per record in larger batches)."""
        self.open()
        now_ms, Metric = int(time.time() * 1000), self._mlflow.entities.Metric
        metrics = [Metric(k, v, now_ms, int(r["step"])) for r in records for k, v in scalars(r).items()]
        for i in range(0, len(metrics), self._METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + self._METRICS_PER_BATCH])

    def close(self) -> None:
        if self._client is not None:
            self._client.set_terminated(self.run_id)


SinkFactory = Callable[[Path, str, dict[str, Any]], MetricSink]  # (run_path, run_name, config)
SINKS: dict[SinkName, SinkFactory] = {
    "tensorboard": TensorBoardSink,
    "wandb": WandbSink,
    "trackio": TrackioSink,
    "mlflow": MlflowSink,
}


def open_sinks(
    names: Iterable[SinkName], run_path: str | Path, run_name: str, config: dict[str, Any]
) -> list[MetricSink]:
    """One sink per name (repeats once), in order; a missing library raises :class:`ConfigError`."""
    return [SINKS[name](Path(run_path), run_name, config) for name in dict.fromkeys(names)]


class GuardedSink:
    """Fault tolerance is the point here: a tracker only mirrors ``metrics.jsonl``, so a tracker that
    breaks (disk, network, a library bug) must not stop training. Its failures are caught, warned
    about once, counted (``sinks/failures/<name>`` in the next records) and after
    :data:`MAX_FAILURES` the sink is disabled for the rest of the run."""

    def __init__(self, sink: MetricSink, max_failures: int = MAX_FAILURES) -> None:
        self.sink = sink
        self.name = str(getattr(sink, "name", type(sink).__name__))
        self.max_failures = max_failures
        self.failures = 0
        self._closed = False

    @property
    def enabled(self) -> bool:
        return self.failures < self.max_failures

    def open(self) -> None:
        """Open the sink's store now if it has ``open()``; a failure counts and it retries on a record."""
        opener = getattr(self.sink, "open", None)
        if opener is None or not self.enabled:
            return
        try:
            opener()
        except Exception as exc:
            self._failed(exc, "opening")

    def log(self, record: dict[str, Any]) -> None:
        self.log_many([record])

    def log_many(self, records: list[dict[str, Any]]) -> None:
        """One write of ``records`` (in one call when the sink has ``log_many``); a failure counts once."""
        if not self.enabled or not records:
            return
        try:
            many = getattr(self.sink, "log_many", None)
            if many is not None:
                many(records)
            else:
                for record in records:
                    self.sink.log(record)
        except Exception as exc:
            steps = [r.get("step") for r in records]
            self._failed(exc, f"step {steps[0]}" + (f"-{steps[-1]}" if len(steps) > 1 else ""))

    def failure_counts(self) -> dict[str, int]:
        """Failed writes so far by sink name: this sink's, and those a sink hosting others reports
        (:class:`~echo2.observe.trackers.TrackerProcess`)."""
        hosted = getattr(self.sink, "failure_counts", None)
        counts = dict(hosted()) if hosted is not None else {}
        if self.failures:
            counts[self.name] = self.failures
        return counts

    def _failed(self, exc: Exception, where: str) -> None:
        self.failures += 1
        if self.failures == 1:
            log.warning(
                "metric sink %s failed at %s (%s: %s); training goes on, metrics.jsonl has every "
                "record, and the sink is disabled after %d failures",
                self.name,
                where,
                type(exc).__name__,
                exc,
                self.max_failures,
            )
        if not self.enabled:
            log.warning("metric sink %s disabled after %d failures", self.name, self.failures)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.sink.close()
        except Exception as exc:  # closing must not hide the run's own outcome
            log.warning("metric sink %s failed to close (%s: %s)", self.name, type(exc).__name__, exc)
