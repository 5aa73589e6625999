"""Processes and studies of the adversary benchmark (``benchmarks/adversary.py``): real ``echo2 run``,
``echo2 learner`` and ``echo2 worker`` processes on loopback, started and stopped by pid, with the
attackers of ``adversary.py`` (this package) joining over the wire like any worker.

- :func:`liveness_run`: one ``echo2 run`` with one honest local worker throttled to a fixed rate; after a
  warm-up, a condition's attackers join (a rate liar, K hoarders, a stalling relay) and the learner's
  steps are counted over a fixed window. The study compares each condition's step rate with the
  baseline's (no attackers) run by run.
- :func:`poison_run`: ``echo2 learner`` + one honest ``echo2 worker``; identities submit groups whose
  every sampler log-prob is poison (-100, -1e4, -1e30) while the learner trains to its time budget;
  then ``echo2 learner --resume`` on the same run directory (after a kill -9 when the door is open, so
  the resumed process puts back groups, poison among them, that the lost steps had trained on).
- :func:`restart_run`: ``echo2 learner`` + one honest worker; identities hold a lease and the weights
  of the learner process, which is killed and resumed (the next run epoch); then each submits its old
  lease and asks for a lease with its old weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

CORES = sorted(os.sched_getaffinity(0))
CHECKPOINT_EVERY = 10  # learner steps between the poison study's checkpoints (a crash loses fewer)


def echo2(
    *args: str, log: Path, env: dict[str, str] | None = None, append: bool = False
) -> subprocess.Popen[bytes]:
    """An ``echo2`` command as its own process (this machine's cores), output to ``log`` (a new one,
    unless ``append``: the resumed learner writes after the one it resumes)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    fh = log.open("ab" if append else "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "echo2.cli", *args],
        stdout=fh,
        stderr=fh,
        env=env,
        preexec_fn=lambda: os.sched_setaffinity(0, CORES),
    )


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sets(*overrides: str) -> list[str]:
    return [a for s in overrides for a in ("--set", s)]


def start_run(
    run_dir: Path, *overrides: str, steps: int = 100_000, minutes: float = 60
) -> subprocess.Popen[bytes]:
    """``echo2 run`` (seed 0, no dashboard) into ``run_dir``, its log beside it."""
    args = ["run", "--seed", "0", "--steps", str(steps), "--run-dir", str(run_dir), "--no-progress"]
    args += sets(f"train.max_minutes={minutes}", "runtime.dashboard=false", *overrides)
    return echo2(*args, log=run_dir.with_suffix(".log"))


def wait_ready(run_dir: Path, proc: subprocess.Popen[bytes], timeout: float = 600) -> dict[str, Any]:
    """learner.json once the learner serves and has published (its first record logged)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"echo2 exited {proc.returncode}; see {run_dir.with_suffix('.log')}")
        info = run_dir / "learner.json"  # this process's, not an earlier run's left in the directory
        if info.is_file() and (run_dir / "metrics.jsonl").is_file():
            got = dict(json.loads(info.read_text()))
            if got.get("pid") == proc.pid:
                return got
        time.sleep(0.5)
    raise RuntimeError("the learner never became ready")


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGINT, timeout: float = 120) -> int | None:
    """Stop a process we started (SIGINT: a clean stop; SIGKILL: a crash); its exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def records(run_dir: Path) -> list[dict[str, Any]]:
    from echo2.observe.rundir import read_metrics

    try:
        return read_metrics(run_dir)
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def last_step(run_dir: Path) -> int:
    return max((r["step"] for r in records(run_dir) if "learner/t_train_s" in r), default=0)


def wait_step(run_dir: Path, proc: subprocess.Popen[bytes], step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while last_step(run_dir) < step:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"no step {step} (exit {proc.poll()}); see {run_dir.with_suffix('.log')}")
        time.sleep(0.25)


def ledger(run_dir: Path, worker_ids: list[str]) -> dict[str, int]:
    """Groups of these workers' leases: trained on (a learner step), purged, buffered; and their leases."""
    if not worker_ids:
        return {"trained": 0, "purged": 0, "buffered": 0, "leases": 0}
    db = sqlite3.connect(run_dir / "store.sqlite")
    marks = ",".join("?" * len(worker_ids))
    rows = db.execute(
        "SELECT g.consumed_step FROM rollout_groups g JOIN leases l USING (lease_id) "
        f"WHERE l.worker_id IN ({marks})",
        worker_ids,
    ).fetchall()
    (leases,) = db.execute(f"SELECT COUNT(*) FROM leases WHERE worker_id IN ({marks})", worker_ids).fetchone()
    db.close()
    steps = [r[0] for r in rows]
    return {
        "trained": sum(1 for s in steps if s is not None and s >= 1),
        "purged": sum(1 for s in steps if s == -2),
        "buffered": sum(1 for s in steps if s is None),
        "leases": int(leases),
    }


# ---- liveness: the learner's step rate beside attackers that never submit a forgery ---------------------
Attack = Callable[[dict[str, Any], str, Path, asyncio.Event], Awaitable[dict[str, Any]]]


def liveness_run(
    run_dir: Path, attack: Attack | None, warm_s: float, window_s: float, rate: float
) -> dict[str, Any]:
    """One ``echo2 run`` with one honest worker at ``rate`` rollouts/s: ``warm_s`` after its first step
    ``attack`` starts (None: the baseline), then the learner's steps are counted over ``window_s``."""
    proc = start_run(
        run_dir, "runtime.workers=1", f"runtime.worker_max_rollouts_per_s={rate}", "train.eval_every=100000"
    )
    try:
        info = wait_ready(run_dir, proc)
        token = (run_dir / "join_token").read_text().strip()
        wait_step(run_dir, proc, 1)
        time.sleep(warm_s)
        wall = [0.0, 0.0]  # the window's start and end, clock seconds (the learner stamps leases so)

        async def window() -> tuple[int, int, float, dict[str, Any]]:
            stop_ev = asyncio.Event()
            task = asyncio.ensure_future(attack(info, token, run_dir, stop_ev)) if attack else None
            await asyncio.sleep(0)  # attackers start at the window's start
            t0, s0, wall[0] = time.monotonic(), last_step(run_dir), time.time()
            await asyncio.sleep(window_s)
            s1, dt, wall[1] = last_step(run_dir), time.monotonic() - t0, time.time()
            stop_ev.set()
            got = await asyncio.wait_for(task, 120) if task else {}
            return s0, s1, dt, got

        s0, s1, dt, got = asyncio.run(window())
        if proc.poll() is not None:
            raise RuntimeError(f"the learner exited {proc.returncode} in the window; see its log")
    finally:
        rc = stop(proc)
    out = {"steps": s1 - s0, "seconds": dt, "step_rate": (s1 - s0) / dt, "attack": got, "exit": rc}
    return {**out, "window_wall": wall}


async def liar_attack(
    info: dict[str, Any], token: str, run_dir: Path, stop_ev: asyncio.Event
) -> dict[str, Any]:
    import aiohttp

    from echo2_bench.adversary import Liar

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        liar = Liar(info["join"], token, session)
        tally = await liar.run(stop_ev)
    return {
        "worker_id": liar.worker_id,
        "errors": tally.errors,
        "state": _pool_state(run_dir, liar.worker_id),
    }


def hoard_attack(k: int) -> Attack:
    async def attack(
        info: dict[str, Any], token: str, run_dir: Path, stop_ev: asyncio.Event
    ) -> dict[str, Any]:
        import aiohttp

        from echo2_bench.adversary import Hoarder

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            hoarders = [Hoarder(info["join"], token, session, f"hoarder{i}") for i in range(k)]
            tallies = await asyncio.gather(*(h.run(stop_ev) for h in hoarders))
        return {
            "identities": k,
            "grants": sum(t.grants for t in tallies),
            "prompts": sum(t.prompts for t in tallies),
            "refusals": _sum_counts([t.refusals for t in tallies]),
            "errors": _sum_counts([t.errors for t in tallies]),
        }

    return attack


def _sum_counts(tables: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in tables:
        for k, v in t.items():
            out[k] = out.get(k, 0) + v
    return out


def _pool_state(run_dir: Path, worker_id: str) -> str:
    """What workers.json says of one worker (quarantined or not) at the end of the window."""
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        for w in json.loads((run_dir / "workers.json").read_text()):
            if w["worker_id"] == worker_id:
                return "quarantined" if w["quarantined"] else "registered"
    return "unknown"


# ---- poison: log-probs no sampler can produce, and a resume on the poisoned run directory ------------
def resumable_learner(run_dir: Path, *overrides: str) -> list[str]:
    """``echo2 learner`` arguments that ``--resume`` can repeat: fixed ports (a worker finds the resumed
    process where it left the first), checkpoints every ``CHECKPOINT_EVERY`` steps, no evaluations."""
    ports = [f"runtime.port={free_port()}", f"runtime.broadcast_port={free_port()}"]
    common = sets(
        "runtime.dashboard=false", "train.eval_every=100000", f"train.checkpoint_every={CHECKPOINT_EVERY}",
        "security.max_workers=100", *ports, *overrides,
    )  # fmt: skip
    return ["learner", "--seed", "0", "--run-dir", str(run_dir), "--no-progress", *common]


def poison_run(
    run_dir: Path, door_open: bool, minutes: float, resume_minutes: float, rate: float
) -> dict[str, Any]:
    """``echo2 learner`` + one honest worker; poison attackers submit while the learner trains to its
    time budget (door closed: the validator's log-prob bound on), or until a kill -9 right after a
    step trained on poison (door open: ``security.min_logprob`` at -1e308, so poison reaches the loss);
    then ``--resume`` on the same directory to its own time budget."""
    from echo2_bench.adversary import POISONS

    door = ["security.min_logprob=-1e308"] if door_open else []
    args = resumable_learner(run_dir, *door)
    log = run_dir.with_suffix(".log")
    learner = echo2(*args, *sets(f"train.max_minutes={minutes}"), log=log)
    started = [learner]
    try:
        info = wait_ready(run_dir, learner)
        token = (run_dir / "join_token").read_text().strip()
        env = {**os.environ, "ECHO2_JOIN_TOKEN": token}

        def honest_worker(append: bool = False) -> subprocess.Popen[bytes]:
            return echo2(
                "worker", "--join", info["join"], "--name", "honest", "--max-rollouts-per-s", str(rate),
                env=env, log=run_dir.parent / f"{run_dir.name}_worker.log", append=append,
            )  # fmt: skip

        worker = honest_worker()
        started.append(worker)
        wait_step(run_dir, learner, CHECKPOINT_EVERY + 2)  # a checkpoint to resume from
        trials = asyncio.run(_poison_attacks(info["join"], token, list(POISONS)))
        poisoners = [t["worker_id"] for t in trials]
        crashed_at = None
        if door_open:  # crash right after a step that trained poison, past the last checkpoint
            deadline = time.monotonic() + 120
            while _poison_after_checkpoint(run_dir, poisoners) == 0 and time.monotonic() < deadline:
                time.sleep(0.5)
            crashed_at = last_step(run_dir)
            stop(learner, signal.SIGKILL)
        rc = learner.wait(60 * minutes + 300) if not door_open else None
        before = ledger(run_dir, poisoners)
        first = records(run_dir)
        resumed = echo2(*args, "--resume", *sets(f"train.max_minutes={resume_minutes}"), log=log, append=True)
        started.append(resumed)
        if worker.poll() is not None:  # it left with the learner that finished: a worker for the resume
            wait_ready(run_dir, resumed)
            worker = honest_worker(append=True)
            started.append(worker)
        rc_resume = resumed.wait(60 * resume_minutes + 300)
        stop(worker)
    finally:
        for p in started:
            stop(p, signal.SIGKILL, timeout=10)
    text = log.read_text(errors="replace")
    rows = [r for r in records(run_dir) if "learner/t_train_s" in r]
    return {
        "door_open": door_open,
        "trials": trials,
        "learner_exit": rc,
        "crashed_at_step": crashed_at,
        "steps_before_resume": max((r["step"] for r in first if "learner/t_train_s" in r), default=0),
        "resume_exit": rc_resume,
        "steps_after_resume": rows[-1]["step"] if rows else 0,
        "time_budget_reached": text.count("time budget of"),
        "put_back": [line.split("; ")[-1] for line in text.splitlines() if "groups put back" in line],
        "non_finite_in_log": sum(
            1 for line in text.splitlines() if "loss is nan" in line or "loss is inf" in line
        ),
        "tracebacks": text.count("Traceback"),
        "ledger_before_resume": before,
        "ledger_after_resume": ledger(run_dir, poisoners),
        "poisoned_groups_purged": int(rows[-1].get("store/poisoned", 0)) if rows else 0,
        "excluded_groups": sum(int(r.get("learner/excluded_groups", 0)) for r in rows),
        "loss_finite": all(r["learner/loss"] == r["learner/loss"] for r in rows),
    }


async def _poison_attacks(
    join: str, token: str, kinds: list[str], identities: int = 3, budget: int = 3
) -> list[dict[str, Any]]:
    import aiohttp

    from echo2_bench.adversary import Attacker, attack_until_caught

    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for kind in kinds:
            att = Attacker(join, token, kind, session, max_prompts=2)
            await att.start()
            for t in await attack_until_caught(att, identities, budget):
                out.append({"kind": kind, "worker_id": t.worker_id, "outcomes": t.outcomes})
            await att.close()
    return out


def _poison_after_checkpoint(run_dir: Path, worker_ids: list[str]) -> int:
    """Poison groups trained on by a step after the newest checkpoint (the ones a crash loses)."""
    from echo2.observe.rundir import STATE_FILE, latest_checkpoint

    ckpt = latest_checkpoint(run_dir)
    through = json.loads((ckpt / STATE_FILE).read_text())["version"] if ckpt else 0
    db = sqlite3.connect(run_dir / "store.sqlite")
    marks = ",".join("?" * len(worker_ids))
    (n,) = db.execute(
        "SELECT COUNT(*) FROM rollout_groups g JOIN leases l USING (lease_id) "
        f"WHERE l.worker_id IN ({marks}) AND g.consumed_step > ?",
        [*worker_ids, through],
    ).fetchone()
    db.close()
    return int(n)


async def staller_attack(
    info: dict[str, Any], token: str, run_dir: Path, stop_ev: asyncio.Event
) -> dict[str, Any]:
    """A registered identity whose broadcast node accepts pulls and sends nothing, acking every install."""
    import aiohttp

    from echo2.protocol import RegisterRequest
    from echo2.rollout.client import LearnerClient
    from echo2.weights.manifest import key_from_text
    from echo2_bench.stalling import StallingNode

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        client = LearnerClient(info["join"], session, reconnect_s=30.0)
        reg = await client.register(RegisterRequest(name="staller", usd_per_hour=0.01), token)
        node = StallingNode(
            reg.worker_id, tuple(reg.broadcast), key_from_text(reg.public_key),  # type: ignore[arg-type]
            credential=reg.credential, pin=client.pin,
        )  # fmt: skip
        await node.start()
        await stop_ev.wait()
        await node.close()
    return {"worker_id": reg.worker_id, **vars(node.counters)}


def broadcast_counters(run_dir: Path) -> dict[str, Any]:
    """The newest ``broadcast/`` metrics of a run (the publisher's stall reports, demotions, refused
    acks, T_bcast)."""
    rows = [r for r in records(run_dir) if "learner/t_train_s" in r]
    return {k: v for k, v in (rows[-1] if rows else {}).items() if k.startswith("broadcast/")}


# ---- restart: leases and weights of the learner process before a crash ----------------------------------
def restart_run(run_dir: Path, holders: int, rate: float, steps_after: int) -> dict[str, Any]:
    """``echo2 learner`` + one honest ``echo2 worker``; ``holders`` honest identities each install the
    current weights, take a lease and generate its groups, then the learner is killed (SIGKILL) and
    resumed on the same run directory (the next run epoch). Each holder then submits its old lease's
    groups and asks for a lease with its old weights, and finally catches up (installs the new epoch's
    anchor) and works honestly. The resumed learner trains ``steps_after`` steps past the crash."""
    args = resumable_learner(run_dir, "train.max_minutes=30")
    log = run_dir.with_suffix(".log")
    learner = echo2(*args, log=log)
    started = [learner]
    crash: dict[str, Any] = {}
    try:
        info = wait_ready(run_dir, learner)
        token = (run_dir / "join_token").read_text().strip()
        env = {**os.environ, "ECHO2_JOIN_TOKEN": token}
        worker = echo2(
            "worker", "--join", info["join"], "--name", "honest", "--max-rollouts-per-s", str(rate),
            env=env, log=run_dir.parent / f"{run_dir.name}_worker.log",
        )  # fmt: skip
        started.append(worker)
        wait_step(run_dir, learner, CHECKPOINT_EVERY + 2)  # a checkpoint to resume from

        def kill_and_resume() -> None:
            crash["epoch_before"] = json.loads((run_dir / "learner.json").read_text())["epoch"]
            crash["step"] = last_step(run_dir)
            stop(learner, signal.SIGKILL)
            resumed = echo2(*args, "--resume", log=log, append=True)
            started.append(resumed)
            crash["epoch_after"] = wait_ready(run_dir, resumed)["epoch"]
            crash["resumed"] = resumed

        held = asyncio.run(_hold_across_restart(info["join"], token, holders, kill_and_resume))
        resumed = crash.pop("resumed")
        wait_step(run_dir, resumed, crash["step"] + steps_after, timeout=600)
        rc = stop(resumed)
        stop(worker)
    finally:
        for p in started:
            stop(p, signal.SIGKILL, timeout=10)
    db = sqlite3.connect(run_dir / "store.sqlite")
    (twice,) = db.execute(
        "SELECT COUNT(*) FROM (SELECT 1 FROM rollout_groups GROUP BY lease_id, prompt_id HAVING COUNT(*) > 1)"
    ).fetchone()
    old = [h["old_lease"] for h in held]
    (old_stored,) = db.execute(
        f"SELECT COUNT(*) FROM rollout_groups WHERE lease_id IN ({','.join('?' * len(old))})", old
    ).fetchone()
    db.close()
    last = [r for r in records(run_dir) if "learner/t_train_s" in r][-1]
    return {
        **crash,
        "holders": held,
        "resume_exit": rc,
        "steps_after_resume": int(last["step"]),
        "rejected_stale_epoch": int(last.get("store/rejected/stale_epoch", 0)),
        "groups_admitted_twice": int(twice),
        "old_lease_groups_stored": int(old_stored),
        "tracebacks": log.read_text(errors="replace").count("Traceback"),
    }


async def _hold_across_restart(
    join: str, token: str, n: int, kill_and_resume: Callable[[], None]
) -> list[dict[str, Any]]:
    import aiohttp

    from echo2.protocol import LeaseGrant, LeaseRequest, SubmitRequest, group_to_wire
    from echo2_bench.adversary import Attacker

    out: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        holders = [Attacker(join, token, "honest", session, max_prompts=2) for _ in range(n)]
        held = []
        for h in holders:
            await h.start()
            for _ in range(120):  # a lease with the weights it installed (the pool may make it wait)
                await h.w._follower().fetch()
                req = LeaseRequest(
                    max_prompts=2, installed_version=h.w.installed, installed_epoch=h.w._follower().epoch
                )
                lease = await h.w.client.lease(req)
                if isinstance(lease, LeaseGrant):
                    break
                await asyncio.sleep(min(lease.retry_after_s, 1.0))
            else:
                raise RuntimeError("a holder never got a lease before the crash")
            groups = await asyncio.to_thread(h._generate, lease)
            body = SubmitRequest(
                lease_id=lease.lease_id,
                policy_version=h.w.installed,
                groups=[group_to_wire(g) for g in groups],
            )
            held.append((h, lease, req, body))
        await asyncio.to_thread(kill_and_resume)
        for h, lease, req, body in held:
            stale_submit = await h._submit(body)  # the old process's lease and version
            again = await h.w.client.lease(req)  # a lease for the old process's weights
            stale_lease = "granted" if isinstance(again, LeaseGrant) else again.reason
            after = []
            while len(after) < 30 and (not after or after[-1] in ("no_lease", "inactive", "benched")):
                after.append(await h.submit_one())  # installs the new epoch's anchor first
            out.append(
                {
                    "worker_id": h.w.worker_id,
                    "old_lease": lease.lease_id,
                    "old_epoch": req.installed_epoch,
                    "old_version": req.installed_version,
                    "stale_submit": stale_submit,
                    "stale_lease": stale_lease,
                    "caught_up_epoch": h.w._follower().epoch,
                    "then": after[-1] if after else None,
                }
            )
        for h in holders:
            await h.close()
    return out
