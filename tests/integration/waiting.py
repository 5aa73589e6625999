"""Waiting on real processes from the integration tests (imported by them: pytest puts this directory
on the path)."""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from echo2.observe.rundir import read_metrics


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free on ``host`` now, all bound at once while they are picked, and taken below
    the system's ephemeral range: a port the system hands out itself (``bind(0)``, or the local end of a
    connection: a torchrun rank's gloo sockets, a worker's client) could be handed out again before the
    learner binds it, and twice a learner restarted on its ports found one already in use."""
    low = _ephemeral_low()
    rng = random.Random()
    socks: list[socket.socket] = []
    try:
        while len(socks) < n:
            s = socket.socket()
            try:
                s.bind((host, rng.randrange(max(1024, low - 12_000), low)))
            except OSError:
                s.close()  # taken: another
                continue
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _ephemeral_low() -> int:
    """The lowest port of the system's ephemeral range (Linux's default when it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


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
