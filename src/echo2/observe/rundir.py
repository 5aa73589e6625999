"""A run directory: ``config.json``, ``metrics.jsonl`` (one namespaced dict per learner step, SPEC
§7), ``checkpoints/`` and ``summary.json``. Always on; experiment trackers (``observe/sinks.py``) are
optional sinks fed each record right after it is written."""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import shutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from echo2.errors import ConfigError
from echo2.observe.catalog import SINK_FAILURES
from echo2.observe.sinks import TRACKER_DIRS, GuardedSink, MetricSink
from echo2.types import MAX_EPOCH

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"  # {"version": v}: the policy version the checkpoint's weights are
OPTIM_FILE = "optimizer.pt"  # optimizer state, for a learner that resumes
PUBLISHED_DIR = "published"  # the bytes of the published chain (``[snapshot] on_disk``), one file a link
EPOCH_FILE = "epoch"  # the run epoch of the newest learner process on the directory (kept by fresh runs too)
# What one run writes into its directory. A fresh run in a used directory starts without them, so two
# runs never share a metrics.jsonl; a resumed run keeps them (the join token and the signing key stay
# either way: workers of the directory's earlier run can still join).
RUN_FILES = (
    "metrics.jsonl",
    "summary.json",
    "run.png",
    "report.html",
    "activation.jsonl",
    "workers.json",
    "store.sqlite",
    "store.sqlite-wal",
    "store.sqlite-shm",
)
RUN_DIRS = ("checkpoints", "workers", *TRACKER_DIRS)
SINK_DRAIN_S = 60.0  # at close, wait this long for the trackers to take the records still queued


TMP_PREFIX = ".tmp-"  # a checkpoint being written (never matched by ``step_*``)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed into place: a reader (a worker
    polling ``learner.json``, a browser reloading a page) sees the old file or the new one, never a
    truncated one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def next_epoch(run_dir: Path) -> int:
    """The run epoch of a learner process starting on ``run_dir``: one more than the last one started
    there (1 on a new directory), recorded before it is used (fsynced), so no two learner processes on
    a directory ever share one, whether the run resumes or starts fresh. Its versions, leases and
    manifests carry it; those of an earlier process are refused by it."""
    path = run_dir / EPOCH_FILE
    last = 0
    if path.is_file():
        text = path.read_text(encoding="utf-8").strip()
        if not text.isdigit() or int(text) >= MAX_EPOCH:
            raise ConfigError(f"{path}: not a run epoch (a whole number below 2^53): {text[:40]!r}")
        last = int(text)
    write_atomic(path, f"{last + 1}\n")
    _fsync_dir(run_dir)
    return last + 1


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory (children before parents)."""
    dirs = [root]
    for p in sorted(root.rglob("*")):
        if p.is_dir():
            dirs.append(p)
        else:
            with p.open("rb") as fh:
                os.fsync(fh.fileno())
    for d in reversed(dirs):
        _fsync_dir(d)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest ``checkpoints/step_*`` with a trainer state, if any."""
    found = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / STATE_FILE).is_file())
    return found[-1] if found else None


class RunDir:
    def __init__(
        self,
        path: str | Path,
        config: dict[str, Any],
        keep_checkpoints: int = 2,
        resume: bool = False,
        sinks: Sequence[MetricSink] = (),
        background: bool = False,
    ) -> None:
        """Open ``path`` for a run: a fresh one (the default) first removes an earlier run's outputs
        (:data:`RUN_FILES`, :data:`RUN_DIRS`); with ``resume`` they stay and metrics are appended.
        ``sinks`` get every record after ``metrics.jsonl`` does; one that fails cannot stop the run
        (:class:`GuardedSink`). With ``background`` they are fed from one thread of their own, in
        order, so a tracker's latency never lengthens a learner step (``close`` drains the queue)."""
        self.path = Path(path)
        if not resume:
            clear_run(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.keep_checkpoints = keep_checkpoints
        (self.path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        self._metrics = (self.path / "metrics.jsonl").open("a", encoding="utf-8")
        self.sinks = [GuardedSink(s) for s in sinks]
        for sink in self.sinks:  # after clearing: a tracker's store starts with this run
            sink.open()
        self._queue: queue.SimpleQueue[dict[str, Any] | None] | None = None
        if background and self.sinks:
            self._queue = queue.SimpleQueue()
            self._feeder = threading.Thread(target=self._feed, name="echo2-sinks", daemon=True)
            self._feeder.start()

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def log(self, record: dict[str, Any]) -> None:
        """Append one record, then hand it to the sinks; non-finite floats are written as null (JSON
        has no NaN). A sink's failures so far are counted as ``sinks/failures/<name>``."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        for sink in self.sinks:
            clean.update({SINK_FAILURES.of(name): n for name, n in sink.failure_counts().items()})
        self._metrics.write(json.dumps(clean) + "\n")
        self._metrics.flush()
        if self._queue is not None:
            self._queue.put(clean)
            return
        for sink in self.sinks:
            sink.log(clean)

    def _feed(self) -> None:
        assert self._queue is not None
        while (record := self._queue.get()) is not None:
            for sink in self.sinks:
                sink.log(record)

    def checkpoint_dir(self, name: str) -> Path:
        return self.checkpoints / name

    def save_checkpoint(
        self,
        name: str,
        policy: Any,
        version: int,
        optimizer: Any = None,
        state: dict[str, Any] | None = None,
        write: Callable[[Path], None] | None = None,
    ) -> str:
        """Weights + tokenizer, the version and ``state`` (and the optimizer state when given) under
        ``checkpoints/<name>``, crash-consistently: written to a temporary directory, every file and
        the directory fsynced, then renamed into place and the parent fsynced, so a checkpoint either
        exists whole on disk or not at all (the caller prunes the trajectories it covers only after
        this returns). ``write`` writes the model's files into the temporary directory instead of
        ``policy.save`` (a sharded learner's states). Older ``step_*`` directories are pruned. Returns
        the path."""
        path = self.checkpoint_dir(name)
        tmp = self.checkpoints / f"{TMP_PREFIX}{name}"
        shutil.rmtree(tmp, ignore_errors=True)  # a crash's leftover of this very name
        tmp.mkdir(parents=True)
        (write or policy.save)(tmp)
        if optimizer is not None:
            import torch

            torch.save(optimizer.state_dict(), tmp / OPTIM_FILE)
        (tmp / STATE_FILE).write_text(json.dumps({**(state or {}), "version": version}) + "\n")
        _fsync_tree(tmp)
        if path.exists():  # the same name again (a resumed run saving the step it resumed from)
            shutil.rmtree(path)
        os.replace(tmp, path)
        _fsync_dir(self.checkpoints)
        self.prune_checkpoints()
        return str(path)

    def prune_checkpoints(self, protect: str = "last_good") -> None:
        """Keep the newest ``keep_checkpoints`` ``step_*`` directories (and ``protect``)."""
        steps = sorted(p for p in self.checkpoints.glob("step_*") if p.is_dir())
        for old in steps[: -self.keep_checkpoints]:
            if old.name != protect:
                shutil.rmtree(old, ignore_errors=True)
        for torn in self.checkpoints.glob(f"{TMP_PREFIX}*"):  # checkpoints a crash left half-written
            shutil.rmtree(torn, ignore_errors=True)

    def write_summary(self, summary: dict[str, Any]) -> None:
        (self.path / "summary.json").write_text(json.dumps(summary, indent=2))

    def close(self) -> None:
        self._metrics.close()
        if self._queue is not None:
            self._queue.put(None)
            self._feeder.join(timeout=SINK_DRAIN_S)
        for sink in self.sinks:
            sink.close()


def clear_run(path: Path) -> None:
    """Remove what an earlier run wrote into ``path`` (nothing else there is touched)."""
    found = [n for n in RUN_FILES if (path / n).is_file()] + [n for n in RUN_DIRS if (path / n).is_dir()]
    if not found:
        return
    log.info("%s held an earlier run; starting fresh (removing %s)", path, ", ".join(found))
    for name in found:
        if name in RUN_DIRS:
            shutil.rmtree(path / name, ignore_errors=True)
        else:
            (path / name).unlink(missing_ok=True)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (the run directory or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    with p.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
