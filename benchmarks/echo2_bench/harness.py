"""Runs one broadcast scenario with real processes: netns (tbf-shaped links) or loopback (app pacing).

A scenario starts a learner process and N worker processes (``python -m echo2_bench.proc``, with
``benchmarks/`` added to their ``PYTHONPATH``), waits for the learner to report, stops every process it
started by pid, and returns a :class:`ScenarioResult`. The netns topology is built once for the largest
N and reshaped per scenario; it is always removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from echo2.broadcast.factory import get_strategy
from echo2.physics.rules import install_quorum
from echo2.transport import run_identity
from echo2.weights.manifest import new_signing_key, synthetic_snapshot
from echo2_bench import BENCHMARKS_DIR
from echo2_bench.faults import Faults
from echo2_bench.netns import HarnessError, NetnsTopology
from echo2_bench.proc import KEY_ENV

log = logging.getLogger(__name__)
PORT = 47000


@dataclass(frozen=True)
class Scenario:
    """One broadcast to measure."""

    strategy: str  # registry name
    n_workers: int  # N
    size: int  # G, bytes of safetensors payload to generate
    chunk: int  # chunk size in bytes
    b0_bps: float | None  # learner uplink in bits/s (None = uncapped)
    bw_bps: float | None  # per-worker link in bits/s, both directions (None = unshaped)
    faults: dict[int, Faults] = field(default_factory=dict)  # worker index -> injected faults
    stall_timeout: float = 3.0  # seconds without data before a worker abandons a source
    max_bad_chunks: int = 3  # corrupt chunks tolerated per source before dropping it
    timeout: float = 300.0  # give up on the scenario after this many seconds
    seed: int = 0  # synthetic snapshot seed
    load: bool = True  # workers parse the installed safetensors blob before acking
    rate_match: bool = True  # tell the learner B0 and B_w so tree strategies rate-match their stripes
    pace: float = 0.0  # netns: nodes also pace their uplink at pace * link rate in the app (0 = off)
    tls: bool = False  # TLS on every connection: the learner's run certificate, pinned; peers' ephemeral


@dataclass(frozen=True)
class ScenarioResult:
    """Measured outcome of one scenario (times in seconds from publication)."""

    scenario: Scenario  # what was run
    install_s: dict[str, float]  # worker -> install delay, as acked to the learner
    survivors: tuple[str, ...]  # workers without a kill/stall fault
    learner_bytes: int  # bytes the learner uploaded
    size: int  # exact G of the generated blob
    workers: dict[str, dict[str, Any]]  # worker -> its own report (installs, counters); absent if killed

    def t_all(self) -> float:
        """Seconds until every surviving worker installed (inf if one never did)."""
        times = [self.install_s.get(w, math.inf) for w in self.survivors]
        return max(times) if times else math.inf

    def t_fraction(self, q: float) -> float:
        """Seconds until ``ceil(q * N)`` surviving workers installed (p90: ``q = 0.9``)."""
        times = sorted(self.install_s.get(w, math.inf) for w in self.survivors)
        need = max(1, math.ceil(q * len(times) - 1e-9))
        return times[need - 1]

    def t_bcast(self, gamma: float) -> float:
        """T_bcast of SPEC §3: seconds until ``install_quorum(N, gamma)`` surviving workers installed."""
        times = sorted(self.install_s.get(w, math.inf) for w in self.survivors)
        return times[install_quorum(len(times), gamma) - 1]

    def bad_installs(self) -> int:
        return sum(1 for r in self.workers.values() for i in r.get("installs", []) if not i["digest_ok"])

    def counter(self, name: str) -> int:
        """A product ``NodeCounters`` field summed over the workers that reported."""
        return sum(int(r.get("counters", {}).get(name, 0)) for r in self.workers.values())

    def injected(self, name: str) -> int:
        """A fault-injection ground-truth count (``corrupted_sent``) summed over the workers."""
        return sum(int(r.get("injected", {}).get(name, 0)) for r in self.workers.values())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Harness:
    """Context manager owning the topology (netns mode) and every process it starts."""

    def __init__(
        self, mode: str, max_workers: int, workdir: str | None = None, keep_logs: bool = False
    ) -> None:
        if mode not in ("netns", "loopback"):
            raise HarnessError(f"harness mode must be 'netns' or 'loopback', got {mode!r}")
        self.mode = mode
        self.max_workers = max_workers
        self.topology: NetnsTopology | None = None
        self._procs: list[subprocess.Popen[bytes]] = []
        self.keep_logs = keep_logs or bool(os.environ.get("ECHO2_BCAST_KEEP_LOGS"))  # keep per-process logs
        self.workdir = Path(tempfile.mkdtemp(prefix=f"e2bcast{os.getpid()}-", dir=workdir))
        self._old_handlers: dict[int, Any] = {}

    def __enter__(self) -> Harness:
        # SIGINT too, explicitly: a process started as a background job of a non-interactive shell
        # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt of its own
        self._old_handlers = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            if self.mode == "netns":
                self.topology = NetnsTopology(self.max_workers + 1)
                self.topology.__enter__()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop_all()
        if self.topology is not None:
            self.topology.close()
            self.topology = None
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        self._old_handlers = {}
        if self.keep_logs:
            log.info("harness logs kept in %s", self.workdir)
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _stop_all(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()  # SIGKILL also ends a SIGSTOPped (stalled) worker
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("process %d did not exit after SIGKILL", p.pid)
        self._procs.clear()

    def _spawn(self, k: int, args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
        prefix = self.topology.exec_prefix(k) if self.topology is not None else []
        cmd = [*prefix, sys.executable, "-m", "echo2_bench.proc", *args]
        with open(log_path, "wb") as fh:
            p = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
        self._procs.append(p)
        return p

    def run(self, sc: Scenario) -> ScenarioResult:
        if sc.n_workers > self.max_workers:
            raise HarnessError(
                f"scenario needs {sc.n_workers} workers; harness was built for {self.max_workers}"
            )
        strategy = get_strategy(sc.strategy)
        run_dir = Path(tempfile.mkdtemp(prefix=f"{sc.strategy}-n{sc.n_workers}-", dir=self.workdir))
        signing = new_signing_key()  # per run: the learner signs, workers get only the public key
        pythonpath = os.pathsep.join(p for p in (str(BENCHMARKS_DIR), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, KEY_ENV: signing.to_text(), "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath}
        worker_env = {**env, KEY_ENV: signing.verifier().to_text()}
        expect_digest = hashlib.sha256(synthetic_snapshot(sc.size, seed=sc.seed)).hexdigest()
        b0 = sc.b0_bps if strategy.learner_uplink_capped else None
        topo = self.topology
        if topo is not None:
            host, port = topo.ip(0), PORT
            topo.shape(0, b0, None)
            for k in range(1, sc.n_workers + 1):
                topo.shape(k, sc.bw_bps, sc.bw_bps)
        else:
            host, port = "127.0.0.1", _free_port()
        common = ["--timeout", str(sc.timeout)]
        learner_args = [
            "learner", "--strategy", sc.strategy, "--workers", str(sc.n_workers), "--size", str(sc.size),
            "--chunk", str(sc.chunk), "--seed", str(sc.seed), "--host", host, "--port", str(port),
            "--out", str(run_dir / "learner.json"), *common,
        ]  # fmt: skip
        survivors = [
            f"w{i:03d}" for i in range(sc.n_workers) if not sc.faults.get(i, Faults()).removes_worker()
        ]
        learner_args += ["--expect", str(len(survivors))]
        if sc.rate_match and sc.b0_bps and sc.bw_bps:
            learner_args += ["--b0-bps", str(sc.b0_bps), "--bw-bps", str(sc.bw_bps)]
        if b0 and (topo is None or sc.pace):
            learner_args += ["--uplink-bps", str(b0 * (sc.pace if topo is not None else 1.0))]
        pin: list[str] = []
        if sc.tls:  # the run certificate is made here, so every worker can be handed its pin at start
            learner_args += ["--tls-dir", str(run_dir)]
            pin = ["--pin", run_identity(run_dir, [host]).fingerprint]
        t0 = time.monotonic()
        try:
            learner = self._spawn(0, learner_args, env, run_dir / "learner.log")
            for i in range(sc.n_workers):
                f = sc.faults.get(i, Faults())
                wargs = [
                    "worker", "--id", f"w{i:03d}", "--learner", f"{host}:{port}",
                    "--host", topo.ip(i + 1) if topo is not None else "127.0.0.1",
                    "--stall-timeout", str(sc.stall_timeout), "--max-bad-chunks", str(sc.max_bad_chunks),
                    "--die-at", str(f.die_at), "--stall-at", str(f.stall_at),
                    "--corrupt-every", str(f.corrupt_every), "--expect-digest", expect_digest,
                    "--out", str(run_dir / f"w{i:03d}.json"), *common, *pin,
                ]  # fmt: skip
                if sc.load:
                    wargs.append("--load")
                if topo is None and sc.bw_bps:
                    wargs += ["--uplink-bps", str(sc.bw_bps), "--downlink-bps", str(sc.bw_bps)]
                elif sc.pace and sc.bw_bps:
                    wargs += ["--uplink-bps", str(sc.bw_bps * sc.pace)]
                if f.drip_bps:  # the last --uplink-bps is the one the worker reads
                    wargs += ["--uplink-bps", str(f.drip_bps)]
                self._spawn(i + 1, wargs, worker_env, run_dir / f"w{i:03d}.log")
            try:
                rc = learner.wait(timeout=sc.timeout + 60)
            except subprocess.TimeoutExpired:
                raise HarnessError(
                    f"learner of {sc.strategy} N={sc.n_workers} timed out; logs in {run_dir}"
                ) from None
            if rc != 0:
                tail = (run_dir / "learner.log").read_text()[-2000:]
                raise HarnessError(f"learner exited with {rc}: {tail}")
            deadline = time.monotonic() + 15
            for p in self._procs[1:]:
                if p.poll() is None and not _is_stopped(p.pid):
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(timeout=max(0.1, deadline - time.monotonic()))
        finally:
            self._stop_all()
        lr = json.loads((run_dir / "learner.json").read_text())
        workers = {}
        for i in range(sc.n_workers):
            path = run_dir / f"w{i:03d}.json"
            if path.exists():
                workers[f"w{i:03d}"] = json.loads(path.read_text())
        res = ScenarioResult(sc, lr["install_s"], tuple(survivors), lr["learner_bytes"], lr["size"], workers)
        log.info(
            "%s N=%d: T_all=%.2fs (%.0fs wall)", sc.strategy, sc.n_workers, res.t_all(), time.monotonic() - t0
        )
        return res


def _is_stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "T"
    except OSError:
        return False


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
