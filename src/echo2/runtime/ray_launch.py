"""``echo2 launch ray``: the parts of a run a team owns placed on its Ray cluster (the optional ``[ray]``
extra): the learner on one actor, N rollout workers on others, each actor running the very command a
machine would run by hand (``echo2 learner``; ``echo2 worker`` with the join string and token), so a
Ray-placed worker joins over the public protocol exactly as a stranger's does and the learner checks
it the same way. Ray only places, restarts and stops them; untrusted workers never become members of
the cluster (a Ray cluster runs its members' code): they join from outside with the join string.

Lifecycle: a worker actor that dies (or whose worker process fails) is restarted by Ray up to
``max_restarts`` times and its new process joins again; when the learner's process ends (the run is
over, or it failed), or on Ctrl-C, the launcher stops every actor it started, and nothing else. The
run directory is the learner's (on the learner's node): ``learner.log``, ``workers/ray-<i>.log`` (on
each worker's node: the same path when the nodes share a filesystem) and ``ray_actors.json`` (each
actor's node, pid and its process's pid, restarts seen).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from echo2.config import Config
from echo2.errors import ConfigError, Echo2Error
from echo2.transport import JOIN_TOKEN_ENV

log = logging.getLogger(__name__)
STOP_WAIT_S = 60.0  # how long a stopped learner gets to write its last checkpoint


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """The child gets SIGKILL when its actor process dies (Linux), so a killed actor leaves nothing."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Proc:
    """A Ray actor that runs one echo2 command as its child process (``ray.remote(Proc)``). When the
    child fails on its own the actor exits too, so Ray restarts it (and with it the command) within the
    actor's ``max_restarts``; :meth:`stop` ends the child on purpose and nothing is restarted."""

    def __init__(
        self, argv: list[str] | None, log_path: str, env: dict[str, str], cwd: str | None = None
    ) -> None:
        self.stopping = False
        self.child: subprocess.Popen[bytes] | None = None
        if argv is not None:  # else started by :meth:`start` (a learner rank: once its peers are placed)
            self.start(argv, log_path, env, cwd)

    def start(self, argv: list[str], log_path: str, env: dict[str, str], cwd: str | None = None) -> None:
        import ray

        node = ray.util.get_node_ip_address()
        argv = [a.replace("{node}", node) for a in argv]  # e.g. the learner binds its own node's address
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            self.child = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                cwd=cwd if cwd and Path(cwd).is_dir() else None,  # the launcher's: relative paths as typed
                preexec_fn=_die_with_parent,
            )
        threading.Thread(target=self._watch, daemon=True).start()

    def free_port(self) -> int:
        """A free TCP port on this actor's node (the learner's rendezvous, on its rank 0's node)."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def _watch(self) -> None:
        assert self.child is not None
        code = self.child.wait()
        if code != 0 and not self.stopping:
            os._exit(1)  # the command failed: Ray restarts this actor (and so the command) if it may

    def where(self) -> dict[str, Any]:
        import ray

        pid = self.child.pid if self.child is not None else None
        return {"node": ray.util.get_node_ip_address(), "actor_pid": os.getpid(), "pid": pid}

    def poll(self) -> int | None:
        return self.child.poll() if self.child is not None else None

    def runs(self, pid: int) -> bool:
        """Whether ``pid`` is this actor's command or one of its descendants (a sharded learner's rank 0
        is a child of the torchrun agent the command became)."""
        while pid > 1 and self.child is not None:
            if pid == self.child.pid:
                return True
            try:
                pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                return False
        return False

    def read(self, path: str, offset: int = 0, lines: bool = True) -> tuple[str, int] | None:
        """Text of ``path`` on this actor's node from byte ``offset`` (whole lines only, unless
        ``lines`` is false), and the offset after it; None when the file is not there yet."""
        p = Path(path)
        if not p.is_file():
            return None
        with p.open("rb") as f:
            f.seek(offset)
            data = f.read()
        end = data.rfind(b"\n") + 1 if lines else len(data)
        return data[:end].decode(errors="replace"), offset + end

    def stop(self, timeout: float) -> int | None:
        """SIGTERM to the command (a learner checkpoints and stops; a worker leaves), SIGKILL after
        ``timeout`` seconds; its exit code."""
        self.stopping = True
        if self.child is None:
            return None
        if self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)
            try:
                self.child.wait(timeout)
            except subprocess.TimeoutExpired:
                self.child.kill()
        return self.child.wait()


@dataclass
class RayOptions:
    """What ``echo2 launch ray`` places, and where."""

    address: str = "auto"
    workers: int = 2
    worker_cpus: float = 1.0
    worker_gpus: float = 0.0
    learner_cpus: float = 1.0  # per rank
    learner_gpus: float = 0.0  # per rank
    learner_ranks: int = 1  # > 1: the learner sharded over K ranks, one actor each (a placement group)
    max_restarts: int = 3
    hardware: str = "ray"
    resume: bool = False
    learner_args: list[str] = field(default_factory=list)  # the config arguments, for `echo2 learner`


def require_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ConfigError("echo2 launch ray needs Ray: pip install 'echo2[ray]'") from exc
    return ray


class RayLaunch:
    """The actors one ``echo2 launch ray`` started (and stops)."""

    def __init__(self, cfg: Config, opts: RayOptions) -> None:
        self.cfg, self.opts = cfg, opts
        self.ray = require_ray()
        self.run_dir = Path(cfg.train.run_dir).resolve()
        self.learner: Any = None  # the learner's rank 0 (the node)
        self.ranks: list[Any] = []  # its other ranks
        self.workers: list[Any] = []
        self.seen: dict[str, dict[str, Any]] = {}  # actor name -> where it runs (pids), restarts

    def run(self, on_record: Any = None) -> dict[str, Any]:
        """Connect, place the learner, wait for its join string, place the workers, follow the run until
        the learner's process ends; always stop what was started. The learner's summary."""
        ray = self.ray
        ray.init(address=self.opts.address, log_to_driver=False, logging_level=logging.WARNING)
        try:
            self._start_learner()
            join, token = self._wait_for_join()
            self._start_workers(join, token)
            code = self._follow(on_record)
            if code != 0:
                raise Echo2Error(f"the learner exited with code {code}; see {self.run_dir / 'learner.log'}")
            got = ray.get(self.learner.read.remote(str(self.run_dir / "summary.json"), 0, False))
            return json.loads(got[0]) if got else {}
        finally:
            self.stop()
            ray.shutdown()

    def _remote(self, cpus: float, gpus: float, restarts: int, **placement: Any) -> Any:
        return self.ray.remote(Proc).options(
            num_cpus=cpus, num_gpus=gpus, max_restarts=restarts, max_task_retries=0, **placement
        )

    def _start_learner(self) -> None:
        """The learner: one actor, or one per rank in a placement group of K bundles (packed onto as few
        nodes as hold them); rank 0's command binds its node's address (workers on other nodes dial it)
        and writes the run directory there. The ranks find each other as torchrun's would (``RANK``,
        ``WORLD_SIZE``, ``MASTER_ADDR`` / ``MASTER_PORT`` on rank 0's node); each rank's GPU is the one
        Ray gives its actor (``LOCAL_RANK`` 0 of its visible devices)."""
        argv = [sys.executable, "-m", "echo2.cli", "learner", *self.opts.learner_args]
        argv += ["--set", f"train.run_dir={json.dumps(str(self.run_dir))}", "--set", "runtime.host={node}"]
        argv += ["--no-progress"] + (["--resume"] if self.opts.resume else [])
        self.run_dir.mkdir(parents=True, exist_ok=True)
        k, cpus, gpus = self.opts.learner_ranks, self.opts.learner_cpus, self.opts.learner_gpus
        if k > 1:
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            bundle = {"CPU": cpus, "GPU": gpus} if gpus else {"CPU": cpus}
            group = placement_group([bundle] * k, strategy="PACK")
            self.ray.get(group.ready(), timeout=600)
            places = [{"scheduling_strategy": PlacementGroupSchedulingStrategy(group, i)} for i in range(k)]
        else:
            places = [{}]
        actors = [self._remote(cpus, gpus, 0, **p).remote(None, os.devnull, {}) for p in places]
        self.learner, self.ranks = actors[0], actors[1:]
        first = self.ray.get(self.learner.where.remote())
        env = {}
        if k > 1:
            port = self.ray.get(self.learner.free_port.remote())
            env = {"WORLD_SIZE": str(k), "MASTER_ADDR": first["node"], "MASTER_PORT": str(port),
                   "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": f"echo2-ray-{port}"}  # fmt: skip
        for i, actor in enumerate(actors):
            log_path = self.run_dir / ("learner.log" if i == 0 else f"learner-rank{i}.log")
            rank_env = {**env, "RANK": str(i)} if k > 1 else {}
            actor.start.remote(argv, str(log_path), rank_env, os.getcwd())
        for i, actor in enumerate(actors):
            self._note("learner" if i == 0 else f"learner-rank{i}", self.ray.get(actor.where.remote()))

    def _wait_for_join(self, timeout: float = 600.0) -> tuple[str, str]:
        """The join string and token the learner wrote (read on its node), once its API is up."""
        deadline = time.monotonic() + timeout
        info_path = self.run_dir / "learner.json"
        while time.monotonic() < deadline:
            if self.ray.get(self.learner.poll.remote()) is not None:
                raise Echo2Error(f"the learner exited before it was ready; see {self.run_dir}/learner.log")
            got = self.ray.get(self.learner.read.remote(str(info_path), 0, False))
            # written atomically once the API is up, by the command (or its rank 0); an earlier run's
            # (--resume) names a process that is not ours
            info = json.loads(got[0]) if got and got[0].strip() else {}
            if "pid" in info and self.ray.get(self.learner.runs.remote(int(info["pid"]))):
                join = info["join"]
                token = self.ray.get(self.learner.read.remote(str(self.run_dir / "join_token"), 0, False))
                return join, token[0].strip() if token else ""
            time.sleep(0.5)
        raise Echo2Error(f"the learner was not ready within {timeout:.0f} s; see {self.run_dir}/learner.log")

    def _start_workers(self, join: str, token: str) -> None:
        from echo2.runtime.launcher import worker_command

        remote = self._remote(self.opts.worker_cpus, self.opts.worker_gpus, self.opts.max_restarts)
        for i in range(self.opts.workers):
            name = f"ray-{i}"
            argv = worker_command(join, name, self.cfg, hardware=self.opts.hardware)
            logf = str(self.run_dir / "workers" / f"{name}.log")
            self.workers.append(remote.remote(argv, logf, {JOIN_TOKEN_ENV: token}, os.getcwd()))
        for i, actor in enumerate(self.workers):
            self._note(f"ray-{i}", self.ray.get(actor.where.remote()))
        log.info("placed the learner and %d workers on the Ray cluster", len(self.workers))

    def _note(self, name: str, where: dict[str, Any]) -> None:
        """Record where an actor runs; a changed actor pid is a restart (logged, counted). The file is
        written when something changed (the launcher looks every 2 s)."""
        before = self.seen.get(name)
        restarts = (before or {}).get("restarts", 0)
        if before is not None and before["actor_pid"] != where["actor_pid"]:
            restarts += 1
            log.info("%s restarted by Ray (pid %d -> %d)", name, before["actor_pid"], where["actor_pid"])
        now = {**where, "restarts": restarts}
        if now == before:
            return
        self.seen[name] = now
        tmp = self.run_dir / "ray_actors.json.tmp"
        tmp.write_text(json.dumps(self.seen, indent=1))
        os.replace(tmp, self.run_dir / "ray_actors.json")

    def _follow(self, on_record: Any) -> int:
        """Until the learner's process ends: its new metrics records to ``on_record``, the workers'
        places checked (restarts) about every 2 s. The learner's exit code."""
        offset, next_check = 0, 0.0
        metrics = str(self.run_dir / "metrics.jsonl")
        while True:
            code = self.ray.get(self.learner.poll.remote())
            got = self.ray.get(self.learner.read.remote(metrics, offset))
            if got:
                text, offset = got
                for line in text.splitlines():
                    if on_record is not None and line.strip():
                        on_record(json.loads(line))
            if code is not None:
                return int(code)
            if time.monotonic() >= next_check:
                for i, actor in enumerate(self.workers):
                    with contextlib.suppress(Exception):  # restarting: asked again next time
                        self._note(f"ray-{i}", self.ray.get(actor.where.remote(), timeout=5))
                next_check = time.monotonic() + 2.0
            time.sleep(0.5)

    def stop(self) -> None:
        """Stop every actor this launcher started (workers first, then the learner, which checkpoints)."""
        ray = self.ray
        stops = [a.stop.remote(10.0) for a in self.workers]
        if self.learner is not None:  # rank 0 first: it checkpoints and tells its other ranks to stop
            stops.append(self.learner.stop.remote(STOP_WAIT_S))
        with contextlib.suppress(Exception):
            ray.wait(stops, num_returns=len(stops), timeout=STOP_WAIT_S + 10)
        rest = [a.stop.remote(10.0) for a in self.ranks]  # gone by now, unless rank 0 died first
        with contextlib.suppress(Exception):
            ray.wait(rest, num_returns=len(rest), timeout=20)
        for actor in [*self.workers, *self.ranks, *([self.learner] if self.learner is not None else [])]:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self.workers, self.ranks, self.learner = [], [], None
