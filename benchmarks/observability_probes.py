"""Two probes behind the observability design (docs/observability.md), each a side-by-side reading:

- **placement**: where the trackers should run. A stand-in for a learner step on a small model (a
  single-threaded AdamW loop over eight 64x64 layers: mostly Python, like the embedded model's
  update), timed with nothing else running, with the four trackers fed one record per 0.35 s from a
  *thread* of the same process (how echo2 fed them before), and from the *tracker process*
  (observe/trackers.py, how it feeds them now). Rounds interleave the three; each reading is the mean
  iteration time, reported as a ratio to that round's "none".
- **page**: what the live dashboard costs the machine it is open on. A real `echo2 run` with the
  dashboard, headless Chromium (the benchmark's flags) polling it; over 40 s: the CPU of Chromium's
  processes, its redraws, and Chrome's own main-thread counters per redraw (Performance.getMetrics);
  then the same 40 s with the page closed (about:blank), the browser's floor.

Writes results/observability_probes.json.

    python benchmarks/observability_probes.py                 # both
    python benchmarks/observability_probes.py --probe placement --rounds 6
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from observability import CHROMIUM_ARGS, SINKS, chromium, free_port, open_dashboard  # noqa: E402

RECORD_EVERY_S = 0.35  # about the embedded default's learner step on this machine
METRICS_PER_RECORD = 45  # about what a learner record holds
TICK = os.sysconf("SC_CLK_TCK")


def _record(step: int) -> dict[str, Any]:
    return {"step": step, "time_s": step * RECORD_EVERY_S} | {
        f"group{i // 8}/metric{i}": random.random() for i in range(METRICS_PER_RECORD)
    }


def _stand_in_step_s(iterations: int = 300) -> float:
    """Mean seconds of 20 AdamW steps of a small MLP (the first 20 iterations are warm-up)."""
    import torch

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters())
    x, times = torch.randn(32, 64), []
    for _ in range(iterations):
        t0 = time.perf_counter()
        for _ in range(20):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.fmean(times[20:])


def _feed(log: Any, stop: threading.Event) -> None:
    step = 0
    while not stop.wait(RECORD_EVERY_S):
        log(_record(step))
        step += 1


def placement_reading(mode: str) -> float:
    """One stand-in reading with the trackers nowhere, on a thread, or in the tracker process."""
    from echo2.observe.sinks import GuardedSink, open_sinks
    from echo2.observe.trackers import start_trackers

    if mode == "none":
        return _stand_in_step_s()
    run = Path(tempfile.mkdtemp(prefix="echo2-probe-"))
    names = SINKS.split(",")
    opener = open_sinks if mode == "thread" else start_trackers
    sinks = opener(names, run, "probe", {})
    guarded = [GuardedSink(s) for s in sinks]
    for g in guarded:
        g.open()
    stop = threading.Event()
    feeder = threading.Thread(target=_feed, args=(lambda r: [g.log(r) for g in guarded], stop))
    feeder.start()
    time.sleep(5)  # the trackers' stores are open and their first writes done
    try:
        return _stand_in_step_s()
    finally:
        stop.set()
        feeder.join()
        for g in guarded:
            g.close()


def probe_placement(rounds: int) -> dict[str, Any]:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    readings: dict[str, list[float]] = {"none": [], "thread": [], "process": []}
    for r in range(rounds):
        for mode in readings:  # one fresh interpreter per reading: nothing carries over
            out = subprocess.run(
                [sys.executable, __file__, "--placement-reading", mode],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("reading ")]  # trackers print
            readings[mode].append(float(line.split()[1]))
        shown = ", ".join(f"{m} {v[-1] * 1e3:.2f} ms" for m, v in readings.items())
        print(f"round {r}: {shown}", flush=True)
    base = readings["none"]
    ratios = {m: [v / n for v, n in zip(readings[m], base, strict=True)] for m in ("thread", "process")}
    return {
        "what": "mean seconds of 20 AdamW steps of an 8x64x64 MLP, 1 torch thread; ratio to the round's none",
        "trackers": SINKS,
        "record_every_s": RECORD_EVERY_S,
        "readings_s": readings,
        "ratios": ratios,
        "median_ratio": {m: statistics.median(v) for m, v in ratios.items()},
    }


def _cpu_s(pids: set[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(f[11]) + int(f[12])) / TICK
        except (OSError, IndexError):
            pass
    return total


def _descendants(root: int) -> set[int]:
    parent = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            with contextlib.suppress(OSError, IndexError):
                parent[int(p)] = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
    found, grew = {root}, True
    while grew:
        new = {pid for pid, pp in parent.items() if pp in found and pid not in found}
        found |= new
        grew = bool(new)
    return found - {root}


def _window(page: Any, cdp: Any, browser_pids: Any, seconds: float) -> dict[str, float]:
    def metrics() -> dict[str, float]:
        return {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}

    renders = "window.echo2Renders || 0"
    m0, c0, r0, t0 = metrics(), _cpu_s(browser_pids()), page.evaluate(renders), time.monotonic()
    time.sleep(seconds)
    m1, c1, r1, t1 = metrics(), _cpu_s(browser_pids()), page.evaluate(renders), time.monotonic()
    n = max(1, r1 - r0)
    out = {"seconds": t1 - t0, "redraws": r1 - r0, "browser_core_share": (c1 - c0) / (t1 - t0)}
    for key in ("TaskDuration", "ScriptDuration", "LayoutDuration", "RecalcStyleDuration"):
        out[f"{key}_ms_per_redraw"] = 1000 * (m1[key] - m0[key]) / n
    return out


def probe_page(seconds: float = 40.0) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    port, run = free_port(), Path(tempfile.mkdtemp(prefix="echo2-probe-run-"))
    args = ["run", "--steps", "1000", "--run-dir", str(run), "--no-progress"]
    args += ["--set", "runtime.dashboard=true", "--set", f"runtime.dashboard_port={port}"]
    learner = subprocess.Popen(
        [sys.executable, "-m", "echo2.cli", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    me = os.getpid()
    try:
        with sync_playwright() as pw:
            browser, page = open_dashboard(pw, f"http://127.0.0.1:{port}/", learner)
            cdp = page.context.new_cdp_session(page)
            cdp.send("Performance.enable")
            time.sleep(20)  # the run is past its start-up

            def browser_pids() -> set[int]:
                return _descendants(me) - _descendants(learner.pid) - {learner.pid}

            open_page = _window(page, cdp, browser_pids, seconds)
            page.goto("about:blank")
            closed = _window(page, cdp, browser_pids, seconds)
            browser.close()
    finally:
        learner.kill()
        learner.wait()
    floor = {"browser_core_share": closed["browser_core_share"]}
    return {"flags": CHROMIUM_ARGS, "open": open_page, "closed": floor}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--probe", choices=["placement", "page", "both"], default="both")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "observability_probes.json")
    p.add_argument("--placement-reading", choices=["none", "thread", "process"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.placement_reading:
        print(f"reading {placement_reading(a.placement_reading)}")
        return 0
    res: dict[str, Any] = json.loads(a.out.read_text()) if a.out.is_file() else {}
    res["cores"] = sorted(os.sched_getaffinity(0))
    if a.probe in ("placement", "both"):
        res["placement"] = probe_placement(a.rounds)
    if a.probe in ("page", "both"):
        if chromium() is None:
            sys.exit("the page probe needs chromium from the distribution's packages")
        res["page"] = probe_page()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    print(
        json.dumps(
            {k: v for k, v in res.items() if k != "placement"}
            | {"placement_median_ratio": res.get("placement", {}).get("median_ratio")},
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
