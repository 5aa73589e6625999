"""Waiting on real processes from the integration tests (imported by them: pytest puts this directory
on the path)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from echo2.observe.rundir import read_metrics


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free on ``host`` now: all bound at once while they are picked (one at a
    time, the system may hand the same port out twice: a learner's API and broadcast ports collided)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``pred`` until it holds; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


def last_step(run_dir: Path) -> int:
    """The newest learner step in the run's metrics.jsonl (-1 before the first)."""
    try:
        rows = read_metrics(run_dir)
    except (FileNotFoundError, json.JSONDecodeError):
        return -1
    return max((r["step"] for r in rows), default=-1)


def echo2(*args: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``python -m echo2.cli ARGS`` with its output appended to ``log``."""
    return subprocess.Popen(
        [sys.executable, "-m", "echo2.cli", *args], stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env
    )


def kill_left(procs: Iterable[subprocess.Popen[bytes]]) -> None:
    """SIGKILL (and reap) each of ``procs`` still running: a test's cleanup, whatever it asserted."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()
