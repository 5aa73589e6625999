"""The asynchronous runtime with real processes on loopback: `echo2 run`, and `echo2 learner` +
`echo2 worker` under faults (a worker killed, the learner killed and resumed)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import http.client
import json
import math
import os
import re
import signal
import socket
import sqlite3
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from waiting import free_ports, last_step, wait_for

from echo2.observe.rundir import read_metrics

pytestmark = pytest.mark.integration

P, G = 4, 4  # prompts per step and group size of the tiny overrides


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _echo2(*args: str, env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen[bytes]:
    out = log.open("ab") if log is not None else subprocess.DEVNULL
    return subprocess.Popen(
        [sys.executable, "-m", "echo2.cli", *args], stdout=out, stderr=subprocess.STDOUT, env=env
    )


def test_echo2_run_end_to_end(tiny_overrides, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "echo2.cli",
        "run",
        *_sets(tiny_overrides),
        "--set",
        "runtime.lease_prompts=4",
    ]
    cmd += ["--steps", "30", "--workers", "2", "--no-progress"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "echo2 run:" in res.stdout
    rows = [r for r in read_metrics(run_dir) if "learner/t_train_s" in r]
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert all(r["store/staleness_max"] <= 3 for r in rows)  # S = 3 by default, checked at every step
    assert all(r["store/rejected"] == 0 for r in rows)
    assert all(r["learner/gc_pause_s"] >= 0 and r["learner/gc_full_collections"] >= 0 for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["version"] == 30 and summary["staleness_max"] <= 3
    assert (run_dir / "run.png").stat().st_size > 0
    assert len(list((run_dir / "workers").glob("*.log"))) == 2
    reports = [
        json.loads(next(x for x in reversed(log.read_text().splitlines()) if x.startswith("{")))
        for log in (run_dir / "workers").glob("*.log")
    ]  # each worker left cleanly with its report
    assert sum(r["rollouts_submitted"] for r in reports) > 0
    for report in reports:  # a worker that started after the 30 fast steps were done may have none
        if report["rollouts_submitted"]:
            assert report["installs"] > 0 and 0 < report["install_cpu_s"] <= report["install_s"] + 0.05
    publications = [r for r in rows if "broadcast/publish_cpu_s" in r]
    assert publications and all(r["broadcast/publish_cpu_s"] > 0 for r in publications)


def test_worker_killed_and_learner_restarted_lose_nothing(tiny_overrides, tmp_path):
    """Kill one worker, then kill -9 the learner and resume it: training finishes, every accepted
    group is accounted for exactly once, and every learner step trained on exactly P groups."""
    run_dir = tmp_path / "run"
    steps = 120
    http, bcast = free_ports(2)
    args = [*_sets(tiny_overrides), "--steps", str(steps), "--no-progress"]
    args += _sets([
        f"runtime.port={http}", f"runtime.broadcast_port={bcast}", "runtime.lease_prompts=2",
        "runtime.lease_ttl_s=2", "runtime.heartbeat_s=0.5", "controller.heartbeat_timeout_s=3",
        "train.checkpoint_every=8", "train.eval_every=1000",
    ])  # fmt: skip
    learner = _echo2("learner", *args, log=tmp_path / "learner.log")
    started = [learner]
    try:
        wait_for(lambda: (run_dir / "learner.json").is_file(), 120, "the learner")
        env = {**os.environ, "ECHO2_JOIN_TOKEN": (run_dir / "join_token").read_text().strip()}
        url = json.loads((run_dir / "learner.json").read_text())["join"]  # https + the certificate's pin
        workers = [
            _echo2(
                "worker",
                "--join",
                url,
                "--name",
                f"w{i}",
                "--max-rollouts-per-s",
                "150",
                env=env,
                log=tmp_path / f"worker{i}.log",
            )
            for i in range(2)
        ]
        started += workers
        wait_for(lambda: last_step(run_dir) >= 20, 120, "step 20")
        workers[1].kill()  # a worker dies holding leases: they expire and their prompts are issued again
        wait_for(lambda: last_step(run_dir) >= 50, 120, "step 50 with one worker")
        learner.kill()  # the learner dies between checkpoints
        learner.wait(10)
        crashed_at = last_step(run_dir)
        learner = _echo2("learner", *args, "--resume", log=tmp_path / "learner.log")
        started.append(learner)
        assert learner.wait(180) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        assert workers[0].wait(30) == 0  # the surviving worker followed the restart and left cleanly
        report = json.loads((tmp_path / "worker0.log").read_text().strip().splitlines()[-1])
        # its first weights and the restarted learner's came by broadcast (it joins before installing;
        # it re-joined as a latecomer of the new anchor), not over HTTP: 2 fetches before; one allowed
        # for a loaded machine where the re-join outlasts the follower's 3 s catch-up window
        assert report["http_installs"] <= 1, report
        # the resumed learner waited for its fleet to re-join before announcing (runtime.gather_s)
        assert re.search(r"[12] of 2 workers re-joined the broadcast", (tmp_path / "learner.log").read_text())
    finally:
        for p in started:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
    rows = [r for r in read_metrics(run_dir) if "learner/t_train_s" in r]
    resumed = [r["step"] for r in rows][[r["step"] for r in rows].index(crashed_at) + 1 :]
    assert resumed[0] <= crashed_at + 1 and resumed[0] % 8 == 1  # right after its last checkpoint
    if crashed_at % 8:  # the steps after that checkpoint were lost: their groups went back to the buffer,
        # and so did those of a step the kill caught after it took its batch but before it logged a record
        lost, text = crashed_at - resumed[0] + 1, (tmp_path / "learner.log").read_text()
        assert any(f"{P * k} groups put back" in text for k in (lost, lost + 1)), text[-3000:]
    assert resumed[-1] == steps
    assert all(r["store/staleness_max"] <= 3 for r in rows)
    db = sqlite3.connect(run_dir / "store.sqlite")
    admitted = db.execute("SELECT value FROM counters WHERE name = 'admitted'").fetchone()[0]
    stored = db.execute("SELECT COALESCE(SUM(n_traj), 0) FROM rollout_groups").fetchone()[0]
    per_step = dict(db.execute("SELECT consumed_step, COUNT(*) FROM rollout_groups WHERE consumed_step > 0 "
                               "GROUP BY consumed_step").fetchall())  # fmt: skip
    expired = db.execute("SELECT value FROM counters WHERE name = 'leases_expired'").fetchone()
    db.close()
    assert admitted == stored  # every accepted trajectory is in the ledger: none lost
    assert per_step == {s: P for s in range(1, steps + 1)}  # each group under one step: none twice
    assert expired is not None and expired[0] >= 1  # the dead worker's leases expired


def _post_any(
    url: str, body: object, cred: str | None = None, tls: ssl.SSLContext | None = None
) -> tuple[int, dict]:  # type: ignore[type-arg]
    """POST raw bytes, or ``body`` as JSON (over ``tls`` for an https URL); (status, decoded JSON reply)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()  # NaN stays NaN: hostile JSON
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    if cred is not None:
        req.add_header("Authorization", f"Bearer {cred}")
    try:
        with urllib.request.urlopen(req, timeout=30, context=tls) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except (urllib.error.URLError, ConnectionError, http.client.HTTPException):
        return 0, {}  # no reply: the learner is gone (finished or died: the test tells which), or it
        # dropped the connection, which the test counts as no answer, not as the status it wants


def _payload(le: dict, version: int = 0, token: int = 5, reward: float = 1.0, n: int = G) -> dict:  # type: ignore[type-arg]
    """A submission for lease ``le``, well formed unless an argument says otherwise."""
    sample = {"prompt_ids": [token], "completion_ids": [token], "sampler_logprobs": [-1.0], "reward": reward}
    groups = [{"prompt_id": p["prompt_id"], "samples": [sample] * n} for p in le["prompts"]]
    return {"lease_id": le["lease_id"], "policy_version": version, "groups": groups}


def _hostile(
    api: str,
    token: str,
    broadcast: tuple[str, int],
    one_round: threading.Event,
    done: threading.Event,
    tls: ssl.SSLContext,
    epoch: int = 0,
) -> dict[str, int]:
    """A registered worker that sends every kind of garbage, round after round, until ``done`` (sets
    ``one_round`` after its first whole round); the status codes it got, counted."""
    got: dict[str, int] = {}
    _post = functools.partial(_post_any, tls=tls)

    def note(what: str, status: int) -> None:
        if status:  # 0: the learner has finished and is gone
            key = f"{what}:{status}"
            got[key] = got.get(key, 0) + 1

    status, reg = _post(f"{api}/register", {"name": "hostile", "usd_per_hour": 0.01}, token)
    assert status == 200, reg
    cred = reg["credential"]
    while not done.is_set():
        note("forged", _post(f"{api}/lease", {}, cred="forged")[0])
        note("no_credential", _post(f"{api}/submit", {})[0])
        note("not_json", _post(f"{api}/submit", b"\x00\xff{oops", cred)[0])
        note("oversized", _post(f"{api}/submit", b"x" * (2 << 20), cred)[0])
        future = {"rollouts": 1, "busy_s": 0.1, "installed_version": 10**6}
        note("future_heartbeat", _post(f"{api}/heartbeat", future, cred)[0])
        with contextlib.suppress(OSError), socket.create_connection(broadcast, timeout=5) as s:
            s.sendall(b"\xde\xad\xbe\xef" * 4096)  # junk on the broadcast port
        lease_req = {"max_prompts": 2, "installed_version": 0, "installed_epoch": epoch}  # learner.json's
        status, le = _post(f"{api}/lease", lease_req, cred)
        if status != 200 or not le.get("lease_id"):
            time.sleep(0.2)
            continue

        sub = f"{api}/submit"
        note("token_range", _post(sub, _payload(le, token=10**6), cred)[0])
        note("future_version", _post(sub, _payload(le, version=10**6), cred)[0])
        note("nan_reward", _post(sub, _payload(le, reward=math.nan), cred)[0])
        note("group_size", _post(sub, _payload(le, n=G - 1), cred)[0])
        # well formed, but not the leased prompt's tokens and a reward nobody earned: refused, and the
        # lease stays open, so the same body again is refused the same way (not a replay)
        note("foreign_prompt", _post(sub, _payload(le), cred)[0])
        note("again", _post(sub, _payload(le), cred)[0])
        one_round.set()
    return got


def test_a_hostile_worker_cannot_crash_or_stall_the_learner(tiny_overrides, tmp_path):
    """A registered worker floods every endpoint with garbage while an honest worker trains: each
    piece gets its 4xx and is counted, and the learner finishes every step."""
    run_dir = tmp_path / "run"
    steps = 40
    (http,) = free_ports(1)
    args = [*_sets(tiny_overrides), "--steps", str(steps), "--no-progress"]
    args += _sets([f"runtime.port={http}", "runtime.lease_prompts=2", "runtime.max_request_mb=1",
                   "train.eval_every=1000"])  # fmt: skip
    learner = _echo2("learner", *args, log=tmp_path / "learner.log")
    started = [learner]
    one_round, done = threading.Event(), threading.Event()
    try:
        wait_for(lambda: (run_dir / "learner.json").is_file(), 120, "the learner")
        info = json.loads((run_dir / "learner.json").read_text())
        token = (run_dir / "join_token").read_text().strip()
        api = f"https://127.0.0.1:{http}/v1"
        assert info["join"].startswith(f"https://127.0.0.1:{http}#sha256=")  # TLS is the default
        tls = ssl.create_default_context(cadata=(run_dir / "tls_cert.pem").read_text())  # the only CA
        tls.check_hostname = False  # trusting exactly the run's certificate is the check
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            hostile = pool.submit(
                _hostile, api, token, tuple(info["broadcast"]), one_round, done, tls, info["epoch"]
            )
            assert one_round.wait(60), "the hostile worker never got a lease"  # then the honest one joins
            env = {**os.environ, "ECHO2_JOIN_TOKEN": token}
            honest = _echo2("worker", "--join", info["join"], "--name", "honest", env=env,
                            log=tmp_path / "worker.log")  # fmt: skip
            started.append(honest)
            rc = learner.wait(240)
            done.set()
            got = hostile.result(60)
        assert rc == 0, (tmp_path / "learner.log").read_text()[-3000:]
        assert honest.wait(30) == 0
    finally:
        done.set()
        for p in started:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
    want = {"forged": 403, "no_credential": 401, "not_json": 400, "oversized": 413, "future_heartbeat": 422,
            "token_range": 422, "future_version": 422, "nan_reward": 422, "group_size": 422,
            "foreign_prompt": 422, "again": 422}  # fmt: skip
    assert {k.split(":")[0]: int(k.split(":")[1]) for k in got} == want, got  # each got its one status
    rows = [r for r in read_metrics(run_dir) if "learner/t_train_s" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # training went on, every step
    last = rows[-1]
    counted = ("auth", "malformed", "oversized", "future_version", "token_range", "reward", "prompt_mismatch")
    for reason in counted:
        assert last[f"store/rejected/{reason}"] >= 1, reason  # counted by reason
    assert "Traceback" not in (tmp_path / "learner.log").read_text()
