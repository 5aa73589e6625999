"""The perimeter study of the adversary benchmark (``benchmarks/adversary.py --study perimeter``).

One ``echo2 run`` (the learner and one honest local worker throttled to ``HONEST_RATE`` rollouts/s,
every default: TLS, the default perimeter) under a descriptor limit of ``FD_LIMIT`` (soft = hard, so
raising the soft limit to the hard one gains nothing). After a warm-up the windows alternate: quiet,
then one attack (:mod:`echo2_bench.perimeter`, one process held to ``ATTACKER_CORES``), then quiet again,
and so on. An attack's **step rate ratio** is its window's step rate over the mean of the quiet windows
on either side; the step rate of a window is (steps completed in it - 1) / (seconds between the first and
the last completion), from the learner's ``metrics.jsonl`` polled every 0.25 s.

Declared before it ran (``TARGETS``): every attack's ratio >= 0.8; the learner exits 0 at its time
budget; no ``Too many open files`` in its log; strangers get 0 bytes of any version; a quarantined
member's broadcast connection closes within 1 s. Read alongside: the learner's descriptors (the most
seen in each window), the perimeter's counters, and each attacker's own CPU (measured, not assumed).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from echo2_bench.adversary_runs import last_step, records, sets, stop, wait_ready, wait_step

FD_LIMIT = 1024  # the learner's descriptor limit, soft and hard (the issue: "at a 1,024 soft limit")
HONEST_RATE = 300.0  # rollouts/s of the honest worker (as the liveness study)
ATTACKER_CORES = 0.1  # each attacker's CPU share (measured and reported)
WINDOW_S = 60.0  # a quiet or attack window
LONG_WINDOW_S = 240.0  # the windows of the 10,000-connection attacks (they need the time to make them)
WARM_S = 90.0  # after the first step, before the first window (the step rate climbs in the first minute)
TARGET_RATIO = 0.8
QUARANTINE_CUT_S = 1.0
# (name, attacker kind, its arguments, window seconds)
ATTACKS: list[tuple[str, str, list[str], float]] = [
    ("idle_api_1k", "idle_api", ["--attempts", "1000", "--open", "1000"], WINDOW_S),
    ("idle_api_10k", "idle_api", ["--attempts", "10000", "--open", "2000"], LONG_WINDOW_S),
    ("idle_broadcast_10k", "idle_broadcast", ["--attempts", "10000", "--open", "2000"], LONG_WINDOW_S),
    ("slowloris", "slowloris", ["--open", "500"], WINDOW_S),
    ("oversized_preauth", "oversized", [], WINDOW_S),
    ("handshake_flood", "handshake_flood", [], WINDOW_S),
    ("joins_and_pulls", "joins_pulls", [], WINDOW_S),
    ("quarantined_member", "quarantined", [], 2 * WINDOW_S),  # several identities caught
    ("sybil_budgets", "sybil", ["--open", "63"], WINDOW_S),
]
TARGETS = (
    f"every attack's step rate >= {TARGET_RATIO} x the mean of the quiet windows beside it (each attacker "
    f"held to {ATTACKER_CORES} cores, measured); the learner exits 0 at its time budget under a "
    f"{FD_LIMIT}-descriptor limit (soft = hard) with no 'Too many open files'; 0 payload bytes to "
    f"strangers; a quarantined member's broadcast connection closed within {QUARANTINE_CUT_S} s"
)


class StepClock:
    """Polls ``metrics.jsonl``: when each step's record appeared (wall clock), and the learner's open
    descriptors (``/proc/PID/fd``) at each poll."""

    def __init__(self, run_dir: Path, pid: int) -> None:
        self.run_dir, self.pid = run_dir, pid
        self.seen: dict[int, float] = {}  # step -> when its record was first seen
        self.fds: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.25):
            now, step = time.time(), last_step(self.run_dir)
            for s in range(max(self.seen, default=0) + 1, step + 1):
                self.seen[s] = now
            with contextlib.suppress(OSError):
                self.fds.append((now, len(os.listdir(f"/proc/{self.pid}/fd"))))

    def rate(self, t0: float, t1: float) -> float:
        """Steps per second completed in [t0, t1): (k - 1) / (last - first) over its k completions."""
        times = sorted(t for t in self.seen.values() if t0 <= t < t1)
        if len(times) < 2:
            return 0.0
        return (len(times) - 1) / (times[-1] - times[0])

    def max_fds(self, t0: float, t1: float) -> int:
        return max((n for t, n in self.fds if t0 <= t < t1), default=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0)))


def _attacker(
    kind: str, args: list[str], target: Path, broadcast: list[Any], seconds: float, log: Path
) -> Any:
    cmd = [sys.executable, "-m", "echo2_bench.perimeter", kind, "--target", str(target)]
    cmd += ["--broadcast", str(broadcast[0]), str(broadcast[1]), "--seconds", str(seconds)]
    cmd += ["--cores", str(ATTACKER_CORES), *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])}
    return subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("wb"), env=env, text=True
    )


def run_study(
    out: Path, quiet_s: float = WINDOW_S, only: list[str] | None = None, scale: float = 1.0
) -> dict[str, Any]:
    """The study (module docstring); ``only`` some attacks, every window ``scale`` times as long (a
    smoke run: the figures of a shorter run are not the study's)."""
    run_dir = out / "adversary_runs" / "perimeter"
    attacks = [(n, k, x, s * scale) for n, k, x, s in ATTACKS if only is None or n in only]
    quiet_s *= scale
    schedule_s = WARM_S + quiet_s * (len(attacks) + 1) + sum(a[3] for a in attacks) + 60 * len(attacks)
    minutes = schedule_s / 60 + 3
    args = ["run", "--seed", "0", "--steps", "1000000", "--run-dir", str(run_dir), "--no-progress"]
    args += sets(
        f"train.max_minutes={minutes:.1f}", "runtime.dashboard=false", "runtime.workers=1",
        f"runtime.worker_max_rollouts_per_s={HONEST_RATE}", "train.eval_every=100000",
    )  # fmt: skip
    log = run_dir.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    fh = log.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "echo2.cli", *args], stdout=fh, stderr=fh, preexec_fn=_limit_fds
    )
    windows: list[dict[str, Any]] = []
    try:
        info = wait_ready(run_dir, proc)
        token = (run_dir / "join_token").read_text().strip()
        target = run_dir.parent / "perimeter_target.json"
        target.write_text(json.dumps({"api": info["url"], "join": info["join"], "token": token}))
        wait_step(run_dir, proc, 1)
        clock = StepClock(run_dir, int(info["pid"]))
        time.sleep(WARM_S)
        windows.append(_quiet(clock, quiet_s, run_dir))
        for name, kind, extra, seconds in attacks:
            windows.append(_attack(clock, name, kind, extra, seconds, target, info, run_dir))
            windows.append(_quiet(clock, quiet_s, run_dir))
            print(f"perimeter {name}: {windows[-2]['step_rate']:.3f} steps/s", flush=True)
        clock.close()
        rc = proc.wait(timeout=minutes * 60 + 600)  # it stops at its own time budget
    finally:
        stop(proc)
    return _verdict(windows, rc, log.read_text(errors="replace"), run_dir)


def _quiet(clock: StepClock, seconds: float, run_dir: Path) -> dict[str, Any]:
    t0 = time.time()
    time.sleep(seconds)
    t1 = time.time()
    return {
        "name": "quiet",
        "t0": t0,
        "t1": t1,
        "step_rate": clock.rate(t0, t1),
        "max_fds": clock.max_fds(t0, t1),
    }


def _attack(
    clock: StepClock,
    name: str,
    kind: str,
    extra: list[str],
    seconds: float,
    target: Path,
    info: dict[str, Any],
    run_dir: Path,
) -> dict[str, Any]:
    attacker = _attacker(
        kind, extra, target, info["broadcast"], seconds, run_dir.parent / f"perimeter_{name}.log"
    )
    assert attacker.stdout is not None and attacker.stdin is not None
    line = attacker.stdout.readline()  # its setup runs outside any window
    if line.strip() != "ready":
        raise RuntimeError(f"attacker {name} did not start: {line!r}; see its log")
    t0 = time.time()
    attacker.stdin.write("go\n")
    attacker.stdin.flush()
    result = json.loads(attacker.stdout.readline())
    attacker.wait(60)
    t1 = time.time()
    counters = {k: v for r in records(run_dir)[-1:] for k, v in r.items() if k.startswith("perimeter/")}
    return {
        "name": name, "kind": kind, "t0": t0, "t1": t1, "step_rate": clock.rate(t0, t1),
        "max_fds": clock.max_fds(t0, t1), "attacker": result, "perimeter": counters,
        "loadavg_1m": os.getloadavg()[0],
    }  # fmt: skip


def _verdict(windows: list[dict[str, Any]], rc: int | None, log_text: str, run_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"windows": windows, "learner_exit": rc, "fd_limit": FD_LIMIT, "targets": TARGETS}
    ok = rc == 0 and "Too many open files" not in log_text
    for i in range(1, len(windows), 2):
        w, before, after = windows[i], windows[i - 1], windows[i + 1]
        quiet = (before["step_rate"] + after["step_rate"]) / 2
        ratio = w["step_rate"] / quiet if quiet > 0 else 0.0
        strangers_got = w["attacker"]["bytes_received"] if w["kind"] not in ("sybil", "quarantined") else 0
        met = ratio >= TARGET_RATIO and strangers_got == 0
        if w["kind"] == "quarantined":
            cuts = w["attacker"].get("cut_after_s") or [None]
            met = met and all(c is not None and c <= QUARANTINE_CUT_S for c in cuts)
            met = met and not any(w["attacker"].get("versions_after") or [])
        out[w["name"]] = {
            "ratio": ratio, "quiet_step_rate": quiet, "attack_step_rate": w["step_rate"], "met": met,
            "attacker_cores": w["attacker"]["cores"], "learner_max_fds": w["max_fds"],
        }  # fmt: skip
        ok = ok and met
    out["too_many_open_files"] = log_text.count("Too many open files")
    out["tracebacks"] = log_text.count("Traceback")
    out["met"] = ok
    return out


if __name__ == "__main__":
    json.dump(run_study(Path(sys.argv[1])), sys.stdout, indent=1)


def plot(result: dict[str, Any], path: Path, alone: tuple[dict[str, Any], ...] = ()) -> None:
    """Each attack's step rate ratio (bars, the 0.8 target dashed; attacks re-read alone, ``alone``,
    added below as "<name> (alone)") and the learner's most descriptors in each window of the study (the
    1,024 limit dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(n, result[n]) for n in (w["name"] for w in result["windows"][1::2])]
    rows += [(f"{w['name']} (alone)", r[w["name"]]) for r in alone for w in r["windows"][1::2]]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    ax.barh([n for n, _ in rows], [v["ratio"] for _, v in rows],
            color=["tab:green" if v["met"] else "tab:red" for _, v in rows])  # fmt: skip
    ax.axvline(TARGET_RATIO, ls="--", c="k", lw=1)
    ax.set_xlabel("step rate under attack / quiet windows beside it")
    ax.invert_yaxis()
    wins = result["windows"]
    bx.plot(range(len(wins)), [w["max_fds"] for w in wins], "o-")
    bx.set_xticks(range(len(wins)), [w["name"] for w in wins], rotation=70, fontsize=7)
    bx.axhline(result["fd_limit"], ls="--", c="k", lw=1)
    bx.set_ylabel("learner descriptors (most seen)")
    fig.suptitle(f"perimeter: each attacker <= {ATTACKER_CORES} cores; learner exit {result['learner_exit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
