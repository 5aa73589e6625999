"""The experiment trackers of a run, in a process of their own (``train.report_to``).

Why a process: a learner step on a small model is mostly Python, so any tracker work in the
learner's process holds the interpreter lock the update needs (benchmarks/observability_probes.py
measures a stand-in update loop both ways; benchmarks/observability.py the real run).
So the learner only writes each record down a pipe; :func:`main`, the child, does the rest:

- it imports the trackers (a missing or broken package is one line, before training starts),
- runs at a lower CPU priority (:data:`NICENESS`), so on a busy machine training comes first,
- writes at most once per :data:`FLUSH_S` whatever records have arrived (MLflow's store takes all of
  them in one transaction; TensorBoard one event per record),
- and on ``close`` (or when the learner's end of the pipe closes) writes the rest and closes them.

The pipe carries JSON lines. To the child: a header ``{"names", "run_path", "run_name", "config"}``,
then ``{"op": "open"}``, ``{"op": "log", "record": ...}`` and ``{"op": "close"}``. Back, on the
child's stdout: ``{"ready": true}`` or ``{"error": msg}``, ``{"failures": {name: n}}`` whenever a
tracker's count of failed writes changes, and ``{"log": [level, logger, msg]}`` for its log records.
Its stderr (tracker banners, a crash's traceback) is logged by the learner at INFO.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from echo2.config import SinkName
from echo2.errors import ConfigError

log = logging.getLogger(__name__)

NICENESS = 10  # the tracker process's nice increment: it yields to training on a saturated machine
FLUSH_S = 2.0  # the child writes at most this often (a batch of every record received meanwhile)
READY_S = 180.0  # how long the learner waits for the child to import its trackers
CLOSE_S = 60.0  # how long closing waits for the child to write what it holds and exit
STDERR_TAIL = 20  # lines of the child's stderr quoted when it dies


def _check_installed(name: SinkName) -> None:
    """The one-line error for a tracker that is not installed at all, without importing it (the
    child's import reports the rest: a package that is installed but broken)."""
    try:
        missing = importlib.util.find_spec(name) is None  # also when sys.modules[name] is None
    except (ImportError, ValueError):
        missing = True
    if missing:
        raise ConfigError(f"--report-to {name} needs the {name} package: pip install 'echo2[{name}]'")


class TrackerProcess:
    """The learner's end: a :class:`~echo2.observe.sinks.MetricSink` whose ``log`` writes one JSON
    line to the child. Built before the run directory (its trackers are checked first); ``open``
    tells the child to open the stores once the directory is prepared. A child that dies makes
    ``log`` raise, which :class:`~echo2.observe.sinks.GuardedSink` counts like any sink's failure."""

    name = "trackers"

    def __init__(
        self, names: Iterable[SinkName], run_path: str | Path, run_name: str, config: dict[str, Any]
    ) -> None:
        self.names = list(dict.fromkeys(names))
        for name in self.names:
            _check_installed(name)
        self._counts: dict[str, int] = {}
        self._stderr: deque[str] = deque(maxlen=STDERR_TAIL)
        self._answer: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "echo2.observe.trackers"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            encoding="utf-8",
        )
        self._readers = [
            threading.Thread(target=self._read_replies, name="echo2-trackers-out", daemon=True),
            threading.Thread(target=self._read_stderr, name="echo2-trackers-err", daemon=True),
        ]
        for t in self._readers:
            t.start()
        header = {"names": self.names, "run_path": str(run_path), "run_name": run_name, "config": config}
        try:
            self._send(header)
            reply = self._answer.get(timeout=READY_S)
        except (OSError, queue.Empty):
            reply = {"error": f"the tracker process did not start within {READY_S:.0f} s"}
        if "error" in reply:
            self._stop(5, warn=False)
            tail = "".join(f"\n  {line}" for line in self._stderr) if reply.get("exited") else ""
            raise ConfigError(f"{reply['error']}{tail}")

    def _send(self, message: dict[str, Any]) -> None:
        assert self._proc.stdin is not None
        with self._lock:
            self._proc.stdin.write(json.dumps(message) + "\n")
            self._proc.stdin.flush()

    def _read_replies(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "failures" in msg:
                self._counts = {str(k): int(v) for k, v in msg["failures"].items()}
            if "log" in msg:
                level, name, text = msg["log"]
                logging.getLogger(name).log(int(level), "%s", text)
            if "ready" in msg or "error" in msg:
                self._answer.put(msg)
        self._answer.put({"error": "the tracker process exited", "exited": True})

    def _read_stderr(self) -> None:
        assert self._proc.stderr is not None
        for line in self._proc.stderr:
            if line.strip():
                self._stderr.append(line.rstrip())
                log.info("tracker process: %s", line.rstrip())

    def failure_counts(self) -> dict[str, int]:
        """Failed writes per tracker so far, as the child last reported them."""
        return dict(self._counts)

    def open(self) -> None:
        self._send({"op": "open"})

    def log(self, record: dict[str, Any]) -> None:
        if self._proc.poll() is not None:
            raise RuntimeError(self._died())
        try:
            self._send({"op": "log", "record": record})
        except OSError as exc:
            raise RuntimeError(self._died()) from exc

    def _died(self) -> str:
        last = " | ".join(list(self._stderr)[-3:]) or "no output"
        return f"the tracker process exited with code {self._proc.poll()} ({last})"

    def close(self) -> None:
        """Ask the child to write what it holds and close its trackers; wait up to :data:`CLOSE_S`."""
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):
                self._send({"op": "close"})
        self._stop(CLOSE_S)

    def _stop(self, wait_s: float, warn: bool = True) -> None:
        with contextlib.suppress(OSError), self._lock:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
            if warn:
                log.warning(
                    "the tracker process did not finish within %.0f s and was stopped; the trackers "
                    "may miss the last records (metrics.jsonl has every one)",
                    wait_s,
                )
        for t in self._readers:
            t.join(timeout=5)


def start_trackers(
    names: Iterable[SinkName], run_path: str | Path, run_name: str, config: dict[str, Any]
) -> list[TrackerProcess]:
    """The sinks a run passes to :class:`~echo2.observe.rundir.RunDir`: one tracker process for all
    of ``names``, or none."""
    names = list(names)
    return [TrackerProcess(names, run_path, run_name, config)] if names else []


# ---- the child -------------------------------------------------------------------------------


class _Replies(logging.Handler):
    """The child's log records, sent to the learner's log."""

    def __init__(self, out: IO[str], lock: threading.Lock) -> None:
        super().__init__(logging.INFO)
        self.out, self.write_lock = out, lock  # not ``self.lock``: Handler.handle holds that one

    def emit(self, record: logging.LogRecord) -> None:
        _reply(self.out, self.write_lock, {"log": [record.levelno, record.name, record.getMessage()]})


def _reply(out: IO[str], lock: threading.Lock, message: dict[str, Any]) -> None:
    with lock, contextlib.suppress(OSError, ValueError):
        out.write(json.dumps(message) + "\n")
        out.flush()


def _read_lines(stream: IO[str], into: queue.SimpleQueue[dict[str, Any] | None]) -> None:
    for line in stream:
        with contextlib.suppress(json.JSONDecodeError):
            into.put(json.loads(line))
    into.put(None)  # the learner closed its end (or died): write what is held, then stop


def main() -> int:
    """The child: see the module docstring."""
    from echo2.observe.sinks import GuardedSink, open_sinks

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the learner's; it then closes us
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")  # replies; anything printed goes to stderr
    os.dup2(2, 1)
    lock = threading.Lock()
    root = logging.getLogger()
    root.addHandler(_Replies(out, lock))
    root.setLevel(logging.INFO)
    header = json.loads(sys.stdin.readline() or "{}")
    with contextlib.suppress(OSError):
        os.nice(NICENESS)
    try:
        built = open_sinks(header["names"], Path(header["run_path"]), header["run_name"], header["config"])
    except ConfigError as exc:
        _reply(out, lock, {"error": str(exc)})
        return 1
    sinks = [GuardedSink(s) for s in built]
    _reply(out, lock, {"ready": True})
    inbox: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
    threading.Thread(target=_read_lines, args=(sys.stdin, inbox), daemon=True).start()
    _serve(sinks, inbox, lambda m: _reply(out, lock, m))
    return 0


def _serve(sinks: list[Any], inbox: queue.SimpleQueue[dict[str, Any] | None], reply: Any) -> None:
    """Open, then write batches of records at most every :data:`FLUSH_S` until ``close`` or EOF (a
    record arriving later than that after the last write is written at once)."""
    counts: dict[str, int] = {}
    batch: list[dict[str, Any]] = []
    last_write, stop = 0.0, False
    while not stop:
        due = last_write + FLUSH_S
        try:  # None: the learner closed its end of the pipe, which ends the child like "close"
            msg = inbox.get(timeout=max(0.0, due - time.monotonic()) if batch else None) or {"op": "close"}
        except queue.Empty:
            msg = {"op": "flush"}
        stop = msg.get("op") == "close"
        if msg.get("op") == "open":
            for sink in sinks:
                sink.open()
        elif msg.get("op") == "log":
            batch.append(msg["record"])
        if batch and (stop or time.monotonic() >= due):
            for sink in sinks:
                sink.log_many(batch)
            batch, last_write = [], time.monotonic()
        if counts != (now := {s.name: s.failures for s in sinks if s.failures}):
            counts = now
            reply({"failures": counts})
    for sink in sinks:
        sink.close()


if __name__ == "__main__":
    sys.exit(main())
