"""``echo2 run``: a learner in this process and N rollout worker processes on this machine.

Workers are ordinary ``echo2 worker`` processes (the same command a remote machine runs) started
with the learner's join string (its URL and, over TLS, the fingerprint of its certificate) and the
join token in their environment; their logs go to
``<run_dir>/workers/<name>.log``. The launcher tracks them by pid and stops only those. A live view
(``observe/view.py``) shows version, reward, accuracy, bubble ratio, staleness, active workers and $/h;
at the end a summary and ``run.png`` land in the run directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from echo2.config import Config
from echo2.errors import Echo2Error
from echo2.rollout.engines.base import ENGINE_SETTINGS
from echo2.runtime.learner import AsyncLearner, Endpoints, LearnerSummary
from echo2.transport import JOIN_TOKEN_ENV

log = logging.getLogger(__name__)


def worker_command(join: str, name: str, cfg: Config, hardware: str = "local-cpu") -> list[str]:
    """argv of one ``echo2 worker`` joining with ``join`` (``https://host:port#sha256=<hex>``: a
    fingerprint is no secret; the token travels in the environment, not argv), labelled ``hardware``."""
    rt = cfg.runtime
    cmd = [sys.executable, "-m", "echo2.cli", "worker", "--join", join, "--name", name]
    cmd += ["--usd-per-hour", str(rt.worker_usd_per_hour), "--hardware", hardware, "--engine", rt.engine]
    for name in ENGINE_SETTINGS:  # runtime.engine_<name> -> --engine-<name> (unset: the engine's default)
        value = getattr(rt, f"engine_{name}")
        if value is not None:
            cmd += [f"--engine-{name.replace('_', '-')}", str(value)]
    if rt.worker_max_rollouts_per_s:
        cmd += ["--max-rollouts-per-s", str(rt.worker_max_rollouts_per_s)]
    return [*cmd, "--trust-run-code"]  # the run's own workers: its code is their operator's


class LocalWorkers:
    """The worker processes this launcher started (by pid)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs = Path(cfg.train.run_dir) / "workers"

    def start(self, ep: Endpoints) -> None:
        logs = self.logs
        logs.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, JOIN_TOKEN_ENV: ep.token}
        for i in range(self.cfg.runtime.workers):
            name = f"local-{i}"
            with (logs / f"{name}.log").open("ab") as fh:
                self.procs.append(
                    subprocess.Popen(
                        worker_command(ep.join, name, self.cfg),
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                    )
                )
        log.info("started %d local workers: pids %s", len(self.procs), [p.pid for p in self.procs])

    def check(self) -> None:
        """Raise when every local worker has exited (nothing would ever feed the learner)."""
        if self.procs and all(p.poll() is not None for p in self.procs):
            codes = [p.returncode for p in self.procs]
            raise Echo2Error(f"all {len(self.procs)} local workers exited (codes {codes}); see {self.logs}")

    def stop(self, grace_s: float = 15.0) -> list[int | None]:
        """The learner has ended: every worker still running is told to leave at once (SIGTERM: a worker
        lands nothing more, ends the generation in hand and leaves the broadcast, exit 0; one already
        past its event loop, leaving on its own, ends with -SIGTERM), and those still running after
        ``grace_s`` (one deadline for all, not one each) are killed. Their exit codes."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        codes: list[int | None] = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        return codes


def run_local(cfg: Config, progress: bool = True, resume: bool = False) -> LearnerSummary:
    """Run the learner here and ``runtime.workers`` worker processes; returns the learner's summary."""
    from echo2.observe.report import plot_run
    from echo2.observe.view import ProgressView

    workers = LocalWorkers(cfg)

    async def main(learner: AsyncLearner) -> LearnerSummary:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signal.SIGINT, learner.stop.set)
            loop.add_signal_handler(signal.SIGTERM, learner.stop.set)
        return await learner.run()

    try:
        with ProgressView(cfg.train, "echo2 run", progress) as view:  # closed before the summary prints
            learner = AsyncLearner(
                cfg, resume=resume, on_ready=workers.start, on_step=view.update, on_tick=workers.check
            )
            summary = asyncio.run(main(learner))
    finally:
        codes = workers.stop()
        if any(c not in (0, None, -signal.SIGTERM) for c in codes):  # -SIGTERM: it left when told
            log.warning("worker exit codes %s (logs in %s)", codes, workers.logs)
    plot_run(Path(summary.run_dir))
    return summary
