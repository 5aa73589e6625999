"""What people watching a run cost the thread that serves its fleet (``benchmarks/fleet.py --study viewers``).

Runtime code, in-process: the real registry, pool and ``NodeStatus`` of N delivered members (as the
``state`` study builds them) under the real ``Dashboard``'s handlers on an event loop, as the learner
serves them. Watching is ``V`` open pages (each polls ``/api/state`` once a second, more often than
``dashboard.html``'s 1.5 s) and one Prometheus scrape of ``/metrics`` a second, spread evenly over each
second, for ``SECONDS`` seconds after one of warm-up; beside them a ticker on the same loop (every 1
ms) reads how long the loop was held. Per second: the serving (loop) thread's CPU seconds, the whole
process's (threads included), the longest hold and the slowest request. The code before (a snapshot and
an exposition on the serving thread at every request) runs the same study from its checkout
(``PYTHONPATH=<checkout before>/src``; its ``Dashboard`` takes no age).

Targets (fixed here before the reading on this code ran; a first version of this study, which timed
the handlers back to back with the snapshot's age as the only difference, read 1.61x against the 1.5x
below and showed the scrape's exposition, about 1 s at 10,000 members, as the cost): at N = 10,000 with
16 pages and a scrape a second, the loop held at most ``MAX_HOLD_S`` at a time, and the serving
thread's CPU a second at most ``TARGET`` x its CPU with one page and a scrape.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

VIEWERS = (1, 4, 16)
SECONDS = 5  # seconds of watching read per reading, after one of warm-up
TARGET = 1.5
MAX_HOLD_S = 0.1
TICK_S = 0.001


@contextlib.contextmanager
def node_status(n: int) -> Iterator[Any]:
    """A ``NodeStatus`` over the real registry and pool with ``n`` members, each delivered (a candidate
    of the controller with a measured rate) and the target known; its broadcast part a stand-in
    publisher with no member."""
    from types import SimpleNamespace

    from echo2.config import load_config
    from echo2.protocol import RegisterRequest
    from echo2.runtime.members import WorkerRegistry
    from echo2.runtime.pool import Pool
    from echo2.runtime.status import NodeStatus

    cfg = load_config()
    with tempfile.TemporaryDirectory() as tmp:
        reg = WorkerRegistry(Path(tmp), "t" * 20, time.time, n + 10)
        pool = Pool(reg, cfg.controller, cfg.staleness, cfg.batch.rollouts, 12.24, Path(tmp), time.time)
        for _ in range(n):
            rec, _ = reg.register(RegisterRequest(name="w", usd_per_hour=0.35, rollouts_per_s=1.0))
            rec.rollouts = 64  # delivered: a candidate of the controller, as a restored worker enrols
            pool.enroll(rec)
        pool.retarget(t_train_s=10.0, t_bcast_s=1.0)
        publisher = SimpleNamespace(members=lambda: [])
        snapshots = SimpleNamespace(version=-1, publisher=publisher, bcast={}, publication=None)
        yield NodeStatus(reg, pool, snapshots, cfg.staleness.S, 2, lambda: 10)  # type: ignore[arg-type]


def _dashboard(status: Any) -> Any:
    """The dashboard as this checkout builds it (the code before takes no snapshot age)."""
    from echo2.observe.dashboard import Dashboard

    return Dashboard(status, None)


async def _watch(status: Any, viewers: int) -> dict[str, float]:
    """``viewers`` pages and one scrape a second, spread over each second, with the ticker beside them."""
    dash = _dashboard(status)
    held, slowest, done = [0.0], [0.0], asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(TICK_S)
            now = time.perf_counter()
            held[0], last = max(held[0], now - last - TICK_S), now

    async def ask(handler: Any) -> None:
        t = time.perf_counter()
        await handler(None)
        slowest[0] = max(slowest[0], time.perf_counter() - t)

    tick = asyncio.ensure_future(ticker())
    asks: list[asyncio.Future[None]] = []
    start = time.perf_counter()
    for s in range(SECONDS + 1):
        if s == 1:  # the warm-up second over: read from here
            await asyncio.gather(*asks)
            asks, held[0], slowest[0] = [], 0.0, 0.0
            cpu0, loop0, start = time.process_time(), time.thread_time(), time.perf_counter()
        for k in range(viewers + 1):
            await asyncio.sleep(
                max(0.0, start + (s - (s > 0)) + (k + 0.5) / (viewers + 1) - time.perf_counter())
            )
            asks.append(asyncio.ensure_future(ask(dash.state if k < viewers else dash.metrics)))
    await asyncio.gather(*asks)
    await asyncio.sleep(max(0.0, start + SECONDS - time.perf_counter()))
    wall, loop_cpu, cpu = time.perf_counter() - start, time.thread_time() - loop0, time.process_time() - cpu0
    done.set()
    await tick
    return {"loop_cpu_s_a_second": loop_cpu / wall, "process_cpu_s_a_second": cpu / wall,
            "longest_hold_s": held[0], "slowest_request_s": slowest[0]}  # fmt: skip


def study_viewers(ns: list[int], label: str) -> dict[str, Any]:
    from echo2.observe.dashboard import Dashboard

    shares = "max_age_s" in inspect.signature(Dashboard).parameters  # this code: one snapshot a second
    rows = []
    for n in ns:
        with node_status(n) as status:
            for viewers in VIEWERS:
                got = asyncio.run(_watch(status, viewers))
                rows.append({"n": n, "viewers": viewers, **got})
                print(f"{label} viewers N={n} V={viewers}: loop CPU {got['loop_cpu_s_a_second']:.3f} s/s, "
                      f"process {got['process_cpu_s_a_second']:.3f} s/s, longest hold "
                      f"{got['longest_hold_s'] * 1e3:.0f} ms, slowest request "
                      f"{got['slowest_request_s'] * 1e3:.0f} ms", flush=True)  # fmt: skip
    top = max(ns)
    at = {r["viewers"]: r for r in rows if r["n"] == top}
    ratio = hold = None
    if 1 in at and max(VIEWERS) in at:
        ratio = at[max(VIEWERS)]["loop_cpu_s_a_second"] / at[1]["loop_cpu_s_a_second"]
        hold = at[max(VIEWERS)]["longest_hold_s"]
    return {
        "label": label, "rows": rows, "shared_snapshot": shares,
        "source": "runtime dashboard handlers on an event loop, in-process",
        "target": f"at N = {top:,} with {max(VIEWERS)} pages and a scrape a second: the serving loop held at "
        f"most {MAX_HOLD_S} s at a time, its thread's CPU at most {TARGET}x that with one page and a scrape",
        "loop_cpu_ratio_16_to_1": ratio, "longest_hold_s_16": hold,
        "met": ratio is not None and hold is not None and ratio <= TARGET and hold <= MAX_HOLD_S,
    }  # fmt: skip


def plot(readings: dict[str, Any], path: Path) -> None:
    """The loop's longest hold and its thread's CPU a second against the pages open, per N and reading."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, got in sorted(readings.items()):
        if "loop_cpu_s_a_second" not in got["rows"][0]:
            continue  # the first version of the study read other quantities (kept in the JSON)
        for n in sorted({r["n"] for r in got["rows"]}):
            rows = [r for r in got["rows"] if r["n"] == n]
            vs = [r["viewers"] for r in rows]
            axes[0].plot(vs, [1e3 * r["longest_hold_s"] for r in rows], "o-", label=f"{label}, N={n:,}")
            axes[1].plot(vs, [r["loop_cpu_s_a_second"] for r in rows], "o-", label=f"{label}, N={n:,}")
    axes[0].axhline(1e3 * MAX_HOLD_S, ls=":", c="k")
    for ax, title in zip(
        axes, ("longest hold of the serving loop (ms)", "serving thread CPU s a second"), strict=True
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("open pages (each polling once a second), plus a scrape a second")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle("What watching a run costs the thread serving its fleet (runtime, in-process)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
