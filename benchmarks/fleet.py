"""The learner node at fleet size (issue: one learner node serving 1,000 to 10,000 members).

Study ``publish`` (in-process, the real publisher): what announcing one version to N broadcast members
costs the learner. A :class:`~echo2.broadcast.publisher.TcpPublisher` with the default strategy
(Tree-Pipelined) is handed N members whose control connections are in-process sinks (they count the
bytes of each frame and drop them: the data plane is not run), then publishes a version with the chunk
count of a 1.2 GB anchor at the automatic chunk size (``physics.broadcast.relay_chunk_bytes``): the
blob is that many 4 KiB chunks, so the manifest, the plan and every frame are those of the anchor while
hashing it costs little; the manifest's hashing and signing is read apart and taken off. Per N it
reports the publication's control plane: the learner's CPU seconds (process time, threads included)
and wall seconds until the last announcement is written, the bytes of all frames and of the largest,
and the longest the event loop went without running a 5 ms ticker meanwhile (what a lease, a heartbeat
or a submission would have waited); for the first publication to the fleet and (``next``, a reading
added after the first run) the next version to the same fleet. A figure of the runtime's publisher,
not of a model.

Study ``slow`` (in-process, the real publisher and nodes over loopback): a relay slower than its peers
but never cut (``echo2_bench/slow_relay.py``, its target there).

Targets (fixed here, before the first run; the issue's): at N = 10,000, at most 1 s of learner CPU for
the control plane of a publication (the first) and no frame over 1 MiB. Baseline: the same study on the
code before the change (``--label before`` run with that checkout's ``src`` first on ``PYTHONPATH``),
in the same session. Each N reads three publications: the first to the fleet, the next version to the
same fleet (``next``), and, from the third reading on, a version after 1% of the members left and as
many joined (``churned``: what a run of that size meets between most versions), each against the same
target.

Study ``node`` (the runtime, over the network): the real learner node (``echo2 run`` with no local
worker: the math task on sums, completions of up to 770 tokens, the generation check off, probation's
share 0.5, the join token's slots and identities set to the fleet's size) serving N simulated members
(``echo2_bench/fleet_node.py``: real TLS, registration, heartbeats at the learner's cadence, the stock
worker's lease loop, one lease of 8 real-length completions every 20 s +- 20%), the generator in this
process on the same cores. Per N, after a registration phase (until every member is registered, at most
``REGISTER_S``), a steady window of ``--window`` seconds: per-endpoint latency (p50 / p99 / max of the
answered calls, the client's own retries of 429 and 503 inside), outcomes by endpoint (refusals by
status and error, failed calls), lease refusals by reason, the learner's update seconds per 1,000
trained tokens (median over the window's steps), its steps, its CPU share and memory (the process and
its children), and the generator's own CPU share. Baseline: ``BASE_N`` members at the same pace (the
issue's 16-worker baseline: a fleet that loads the node little), read in the same invocation.
Targets (fixed here before the first run; the issue's): at N = 1,000 update time <= 1.05x the
baseline's, 0 errors (5xx or failed calls), p99 lease and submit latency <= 1 s (with ``--repeats``,
interleaved runs: the median ratio, every run's errors, the worst p99; the ratios' mean with its 95% t
interval beside it, added after the first readings); at N = 3,000 training
continues (a step in the window) and every member registered within 2 minutes; at N = 10,000 no 5xx and
p99 <= 2 s for registration, heartbeats and leases.
The API's fronts (``--set runtime.api_processes=1``; the rule fixed before their first reading): three
invocations at N = 1,000 with a front (``front_r1..3``) interleaved with three without (``inproc_r1..3``),
each against its own baseline run with the same setting; the targets above read on the median of each
three (every run's errors, the worst p99); ``runtime.api_processes`` defaults to 1 only if the fronted
three meet them and their median ratio is below the in-process three's.

Study ``restart`` (the runtime publisher and worker nodes, in-process on loopback with paced uplinks):
what a learner restart costs the learner's uplink before every member holds its anchor again. A fresh
publisher announces an anchor (a 256 KiB stand-in in 2 KiB chunks sent at a member's 32 KiB/s in 8 s,
as a 1.2 GB anchor at 100 Mbit/s takes 96 s; the learner's uplink ten times a member's) to the members
joined by then (``--present``: none after a restart), the others re-join at uniform times over 2 s
(every member and the publisher in this one process: a planned tree's 8 pull streams a member are
more than it hosts at 1,000 members, so ``--present`` runs at 200; a latecomer holds 2-6 connections);
a member
counts as fetching the anchor over HTTP (its bytes through the learner counted, the fetch not run) by
the follower's rule: nothing under way 3 s after it joined, or a transfer that stored nothing for 30 s.
Target (the issue's, fixed before the first run): at N = 1,000 the learner uploads at most 2x the model
until every member holds it. Baseline: the same study on the code before latecomers, same session.

Writes results/fleet.json (the study's readings under their ``--label``) and results/fleet.png.

    python benchmarks/fleet.py --study publish --label after
    git worktree add ../echo2-before 0c4427b
    PYTHONPATH=../echo2-before/src python benchmarks/fleet.py --study publish --label before
    python benchmarks/fleet.py --study node --ns 100 1000 --window 120
    python benchmarks/fleet.py --study restart --ns 1000 3000 --seeds 3 --label latecomers
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import json
import math
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

ANCHOR_BYTES = 1.2e9  # the anchor: its chunk count at the automatic chunk size
CHUNK = 4096  # bytes of each stand-in chunk (the count is the anchor's)
MAX_CPU_S = 1.0  # target at N = 10,000: learner CPU seconds of one publication's control plane
MAX_FRAME = 1 << 20  # target at N = 10,000: no frame over 1 MiB
TARGET_N = 10_000
TICK_S = 0.005
FLAT = 2.0  # target of the probation and register studies: N = 10,000 within this x N = 1,000's
BASE_N = 16  # the node study's baseline fleet
SHARED_CONNECTIONS = 16  # connections an address's members share where descriptors run short
REGISTER_S = 120.0  # the node study's registration phase, at most (the issue's: all within 2 minutes)
# the node study's model: a random-init Qwen3 of ~1.3M parameters (a character-level tokenizer, so a
# 770-token completion is 770 characters): an update of the window's batches takes seconds, not minutes
NODE_SHAPE = {"hidden": 128, "intermediate": 384, "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 32,
              "vocab": 1024}  # fmt: skip
NODE_TARGETS = {  # the node study's, fixed before its first run
    "n1000_update_ratio_max": 1.05,
    "n1000_errors_max": 0,
    "n1000_p99_lease_submit_s_max": 1.0,
    "n3000_steps_min": 1,
    "n3000_register_s_max": 120.0,
    "n10000_p99_control_s_max": 2.0,
}


class Sink:
    """A member's control connection that keeps only the sizes of what is written to it."""

    def __init__(self) -> None:
        self.frames: list[int] = []

    def write(self, data: bytes) -> None:
        self.frames.append(len(data))

    def writelines(self, pieces: list[bytes]) -> None:  # one frame in pieces
        self.frames.append(sum(map(len, pieces)))

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        return None

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


async def publish_once(n: int, n_chunks: int) -> dict[str, Any]:
    """One publication to ``n`` in-process members; the control plane's costs."""
    from echo2.broadcast.api import OpenLedger
    from echo2.broadcast.pipelined import TreePipelined
    from echo2.broadcast.publisher import TcpPublisher, _Member
    from echo2.weights.manifest import build_manifest, new_signing_key

    key = new_signing_key()
    pub = TcpPublisher(key, TreePipelined(), chunk_size=CHUNK, ledger=OpenLedger())
    sinks: dict[str, Sink] = {}

    def join(prefix: str, i: int, host: str) -> None:
        w = f"{prefix}-{i:05d}-{os.urandom(3).hex()}"  # ids of a registry's length
        sinks[w] = Sink()
        pub._members[w] = _Member(w, (host, 40000), "ab" * 32, sinks[w])  # type: ignore[arg-type]

    for i in range(n):
        join("member", i, f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}")
    blob = os.urandom(n_chunks * CHUNK)
    cpu0 = time.process_time()
    build_manifest(blob, 1, CHUNK, pub.key, None)  # what publish spends on the manifest, read apart
    manifest_cpu = time.process_time() - cpu0
    first = await _timed(pub, 1, blob, sinks, manifest_cpu)
    again = await _timed(pub, 2, os.urandom(n_chunks * CHUNK), sinks, manifest_cpu)  # the same fleet
    gone = random.Random(n).sample(sorted(sinks), max(1, n // 100))  # 1% leave, 1% join
    for w in gone:
        del pub._members[w], sinks[w]
    for i in range(len(gone)):
        join("joiner", i, f"10.255.{i >> 8 & 255}.{i & 255}")
    churned = await _timed(pub, 3, os.urandom(n_chunks * CHUNK), sinks, manifest_cpu)
    return {"n": n, "n_chunks": n_chunks, "manifest_cpu_s": manifest_cpu, **first, "next": again,
            "churned": churned}  # fmt: skip


async def _timed(
    pub: Any, version: int, blob: bytes, sinks: dict[str, Sink], manifest_cpu: float
) -> dict[str, Any]:
    """One publication: CPU and wall seconds until every announcement is written (``cpu_s``: the
    control plane, the manifest's ``manifest_cpu`` taken off), the frames' bytes, the longest the event
    loop went without running a 5 ms ticker meanwhile."""
    for sink in sinks.values():
        sink.frames.clear()
    gaps = [0.0]
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(TICK_S)
            now = time.perf_counter()
            gaps[0] = max(gaps[0], now - last - TICK_S)
            last = now

    tick = asyncio.ensure_future(ticker())
    gc.collect()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    await pub.publish(version, blob)
    while pub._tasks:  # every announcement written
        await asyncio.gather(*list(pub._tasks))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    done.set()
    await tick
    sizes = [s for sink in sinks.values() for s in sink.frames]
    assert len(sizes) == len(sinks), f"{len(sizes)} announcements for {len(sinks)} members"
    return {
        "cpu_s": cpu - manifest_cpu, "publish_cpu_s": cpu, "wall_s": wall, "frames": len(sizes),
        "bytes": sum(sizes), "largest_frame": max(sizes), "loop_max_stall_s": gaps[0],
    }  # fmt: skip


def study_publish(ns: list[int], label: str) -> dict[str, Any]:
    from echo2.physics.broadcast import relay_chunk_bytes

    chunk = relay_chunk_bytes(ANCHOR_BYTES)
    n_chunks = math.ceil(ANCHOR_BYTES / chunk)
    rows = []
    for n in ns:
        row = asyncio.run(publish_once(n, n_chunks))
        for which, r in (("first", row), ("next", row["next"]), ("churned", row["churned"])):
            print(
                f"{label} N={n} {which}: control-plane cpu {r['cpu_s']:.2f} s, wall {r['wall_s']:.2f} s, "
                f"{r['bytes'] / 1e6:.0f} MB, largest frame {r['largest_frame'] / 1e3:.0f} KB, "
                f"loop stall {r['loop_max_stall_s']:.2f} s",
                flush=True,
            )
        rows.append(row)
    at = next((r for r in rows if r["n"] == TARGET_N), None)
    return {
        "label": label, "anchor_bytes": ANCHOR_BYTES, "auto_chunk_bytes": chunk, "rows": rows,
        "cores": os.cpu_count(), "source": "runtime publisher, in-process members (data plane not run)",
        "target": f"N = {TARGET_N}: <= {MAX_CPU_S} s learner CPU, no frame over {MAX_FRAME} bytes",
        "met": None if at is None else at["cpu_s"] <= MAX_CPU_S and at["largest_frame"] <= MAX_FRAME,
        "met_next": None if at is None else at["next"]["cpu_s"] <= MAX_CPU_S,
        "met_churned": None if at is None else at["churned"]["cpu_s"] <= MAX_CPU_S,
    }  # fmt: skip


# the restart study (a stand-in anchor at a worker link's pace; the follower's rules for falling back to HTTP)
RESTART_G = 256 << 10  # bytes of the stand-in anchor ...
RESTART_CHUNK = 2 << 10  # ... in chunks of this many bytes (128: a hop of a tree takes 0.25-0.5 s)
RESTART_BW = 32 << 10  # each member's upload, bytes/s: the anchor takes 8 s to send once (a 1.2 GB anchor
RESTART_B0 = 10 * RESTART_BW  # at 100 Mbit/s takes 96 s); the learner's, ten times a member's
RESTART_SPREAD_S = 2.0  # members re-join at uniform times over this window after the anchor's announcement
CATCHUP_S, STALL_S = 3.0, 30.0  # the follower's: wait this long for an announcement, then while chunks come
MAX_UPLINK_COPIES = 2.0  # target: the learner uploads at most twice the model before every member holds it
GATHER_RATIO = 0.5  # target with --gather: every member holds the anchor in half the time, or less
RESTART_TIMEOUT_S = 600.0


async def restart_once(n: int, present: float, seed: int, gather_s: float = 0.0) -> dict[str, Any]:
    """One restart: a fresh publisher announces an anchor to the members joined by then (``present`` of
    ``n``; 0 after a learner restart, when nobody has re-joined yet), the others join at uniform times
    over ``RESTART_SPREAD_S`` (with ``gather_s``: from the restart on, and the announcement waits for
    them as a resumed learner's does, ``runtime.snapshots.gather``, at most ``gather_s``); each member
    installs what the broadcast delivers, and one that has no
    transfer under way ``CATCHUP_S`` after its join, or whose transfer stores nothing for ``STALL_S``,
    counts as fetching the anchor over HTTP (the follower's rule: the bytes through the learner are
    counted, the fetch is not run). Reads the learner's uplink bytes (chunks it served plus the HTTP
    fetches) until every member holds the anchor."""
    import dataclasses
    import inspect

    from echo2.broadcast.api import OpenLedger
    from echo2.broadcast.pipelined import TreePipelined
    from echo2.broadcast.publisher import TcpPublisher
    from echo2.broadcast.receiver import TcpWorkerNode
    from echo2.broadcast.wire import Pacer
    from echo2.perimeter import default_limits
    from echo2.weights.manifest import Lineage, new_signing_key

    rng = random.Random(seed)
    key = new_signing_key()
    wide = 1e9  # one loopback address for every member: the per-address limits are not what is measured
    limits = dataclasses.replace(
        default_limits(), max_connections=8 * n + 64, max_per_address=8 * n + 64, pre_auth_share=1.0,
        accepts_per_s=wide, accept_burst=wide, accepts_total=wide, requests_per_s=wide, request_burst=wide,
        header_s=60.0,
    )  # fmt: skip
    pub = TcpPublisher(
        key, TreePipelined(), chunk_size=RESTART_CHUNK, ledger=OpenLedger(), perimeter=limits,
        uplink=Pacer(RESTART_B0, burst=RESTART_CHUNK),
    )  # fmt: skip
    await pub.start()
    knows_held = "held" in inspect.signature(TcpWorkerNode).parameters  # the code before had no such field
    blob = random.Random(seed + 1).randbytes(RESTART_G)
    version = 8
    t0 = time.monotonic()
    joined: dict[str, float] = {}
    installed: dict[str, float] = {}
    http: dict[str, str] = {}
    nodes: list[Any] = []
    published = asyncio.Event()

    def under_way(node: Any) -> tuple[bool, float]:
        """Whether ``node`` receives something now, and how long since it stored a chunk."""
        if hasattr(node, "receiving"):
            got = node.receiving()
            return got is not None, (got.idle_s if got is not None else 0.0)
        return node._transfer is not None, 0.0  # the code before: no progress reading (no stall rule)

    async def member(name: str, at: float) -> None:
        await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
        kw = {"held": (1, 7)} if knows_held else {}  # it holds the earlier process's weights
        node = TcpWorkerNode(
            name, pub.address, key.verifier(), uplink=Pacer(RESTART_BW, burst=RESTART_CHUNK),
            perimeter=limits, **kw,
        )  # fmt: skip
        nodes.append(node)
        await node.start(join_timeout=60.0)
        joined[name] = time.monotonic()

        async def take() -> None:
            async for snap in node.snapshots():
                if snap.manifest.version == version:
                    installed[name] = time.monotonic()
                    await node.report_installed(version)
                    return

        taking = asyncio.ensure_future(take())
        await published.wait()  # one joined before the announcement waits for it like one after
        since = time.monotonic()
        while not taking.done():
            await asyncio.sleep(0.25)
            if name in installed or node.installed_version >= version:  # delivered (being handed over)
                continue
            busy, idle = under_way(node)
            if not busy and time.monotonic() - since >= CATCHUP_S:
                http[name] = "nothing announced"
            elif busy and idle > STALL_S:
                http[name] = "stalled"
            if name in http:
                taking.cancel()
                return

    names = [f"m{i:05d}" for i in range(n)]
    early = round(present * n)
    tasks = [asyncio.ensure_future(member(name, 0.0)) for name in names[:early]]
    if early:
        await pub.wait_members(early, 60.0)
    restart = time.monotonic()
    late = [(name, rng.uniform(0.0, RESTART_SPREAD_S)) for name in names[early:]]
    if gather_s:
        from echo2.runtime.snapshots import gather

        t0 = restart
        tasks += [asyncio.ensure_future(member(name, at)) for name, at in late]
        await gather(pub, n, gather_s)
    gathered = len(pub.members())
    await pub.publish(version, blob, Lineage(kind="full", epoch=2))
    published.set()
    announced = time.monotonic() - restart
    if not gather_s:
        t0 = time.monotonic()
        tasks += [asyncio.ensure_future(member(name, at)) for name, at in late]
    done = time.monotonic() + RESTART_TIMEOUT_S
    while len(installed) + len(http) < n and time.monotonic() < done:
        await asyncio.sleep(0.25)
    wall = time.monotonic() - t0
    stats = pub.stats(version)
    kinds = ("stream_failures", "repaired_chunks", "stalls_reported", "bytes_relayed")
    counters = {k: sum(getattr(x.counters, k) for x in nodes) for k in kinds}
    late_from_learner = getattr(pub.counters, "latecomers_from_learner", None)
    for task in tasks:
        task.cancel()
    for x in nodes:
        with contextlib.suppress(Exception):
            await x.close()
    await pub.close()
    took = sorted(installed[w] - max(joined.get(w, t0), t0) for w in installed)  # from join or announcement
    uplink = stats.learner_bytes + len(http) * RESTART_G
    return {
        "n": n, "present": present, "seed": seed, "anchor_bytes": RESTART_G, "chunk_bytes": RESTART_CHUNK,
        "member_uplink_bps": RESTART_BW, "learner_uplink_bps": RESTART_B0, "spread_s": RESTART_SPREAD_S,
        "installed_by_broadcast": len(installed), "http_fallbacks": len(http),
        "http_reasons": dict(collections.Counter(http.values())),
        "unfinished": n - len(installed) - len(http),
        "learner_chunk_bytes": stats.learner_bytes, "learner_uplink_bytes": uplink,
        "uplink_copies": uplink / RESTART_G, "latecomers_from_learner": late_from_learner,
        "install_s_p50": took[len(took) // 2] if took else None,
        "install_s_p90": took[int(0.9 * (len(took) - 1))] if took else None,
        "install_s_max": took[-1] if took else None, "wall_s": wall, **counters,
        "gather_s": gather_s, "members_announced": gathered, "announced_after_s": announced,
        "restart_to_all_s": max(installed.values()) - restart if len(installed) == n else None,
    }  # fmt: skip


def study_restart(
    ns: list[int], label: str, present: float = 0.0, seeds: int = 1, gather_s: float = 0.0
) -> dict[str, Any]:
    """Study ``restart`` (the runtime publisher and worker nodes, in-process on loopback, paced links): the
    learner's uplink before every member holds a restart's anchor again. Target (the issue's, fixed
    before the first run): at N = 1,000, at most ``MAX_UPLINK_COPIES`` times the model. Baseline: the
    same study on the code before latecomers (``PYTHONPATH=<that checkout>/src``), same session.

    With ``gather_s`` (the announcement waits while the fleet re-joins), a second target, fixed before its
    first run: at N = 1,000 the seconds from the restart until every member holds the anchor
    (``restart_to_all_s``) at most ``GATHER_RATIO`` x the same study's without gathering (latecomers),
    run in the same session, median over the seeds; the uplink target as before."""
    import logging

    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # the nodes' serving tasks cut at the end
    rows = []
    for n in ns:
        for seed in range(seeds):
            row = asyncio.run(restart_once(n, present, seed, gather_s))
            rows.append(row)
            print(
                f"{label} restart N={n} present={present:.0%} seed {seed}: learner uplink "
                f"{row['uplink_copies']:.2f}x the model ({row['http_fallbacks']} HTTP fallbacks "
                f"{row['http_reasons']}, {row['installed_by_broadcast']} by broadcast, "
                f"{row['unfinished']} unfinished), install p50 {row['install_s_p50']} s max "
                f"{row['install_s_max']} s, wall {row['wall_s']:.0f} s, {row['stalls_reported']} stall "
                f"reports, {row['repaired_chunks']} chunks repaired",
                flush=True,
            )
    at = [r for r in rows if r["n"] == 1_000]
    return {
        "label": label, "rows": rows, "present": present, "cores": os.cpu_count(),
        "source": "runtime publisher and worker nodes, in-process on loopback, paced uplinks; the "
        "follower's HTTP fallback counted by its rule, not run",
        "target": f"N = 1,000: learner uplink <= {MAX_UPLINK_COPIES}x the model until every member holds it",
        "met": None if not at else all(r["uplink_copies"] <= MAX_UPLINK_COPIES and not r["unfinished"]
                                         for r in at),
        "gather_s": gather_s, "gather_target": f"N = 1,000: restart_to_all_s <= {GATHER_RATIO}x the same "
        "session's reading without gathering (median over seeds)" if gather_s else None,
    }  # fmt: skip


def study_probation(ns: list[int], label: str) -> dict[str, Any]:
    """Study ``probation`` (in-process, the real lease broker and store): N newcomers asking for their
    first lease while the probation share is full (a fleet arriving at once), each asking in turn; the
    broker's seconds per request (the refusal path: every newcomer waits its turn), read over the last
    round of asks after N - 1 are already waiting. Target (fixed before the first run): the time per
    request at N = 10,000 within 2x of N = 1,000's (O(1) in the newcomers waiting)."""
    rows = []
    for n in ns:
        per, granted = _probation_round(n)
        rows.append({"n": n, "s_per_request": per, "granted_first_round": granted})
        print(f"{label} probation N={n}: {per * 1e6:.0f} us a request ({granted} granted first)", flush=True)
    return _flat(label, rows, "s_per_request", "runtime lease broker, in-process", "seconds per request")


def _flat(label: str, rows: list[dict[str, Any]], key: str, source: str, what: str) -> dict[str, Any]:
    """A study of a per-request cost that should not grow with N: met when ``key`` at N = 10,000 is
    within ``FLAT`` times N = 1,000's."""
    by = {r["n"]: r[key] for r in rows}
    ratio = by[10_000] / by[1_000] if 10_000 in by and 1_000 in by else None
    return {
        "label": label, "rows": rows, "ratio_10k_to_1k": ratio, "source": source,
        "target": f"{what} at N = 10,000 within {FLAT}x of N = 1,000's",
        "met": None if ratio is None else ratio <= FLAT,
    }  # fmt: skip


def _probation_round(n: int) -> tuple[float, int]:
    """N newcomers ask once (a share's worth granted), then each asks again: seconds a request of the
    second round, and how many the first granted."""
    import tempfile

    from echo2.config import load_config
    from echo2.data.store import TrajectoryStore
    from echo2.protocol import LeaseRequest, RegisterRequest
    from echo2.runtime.leases import LeaseBroker
    from echo2.runtime.members import WorkerRegistry
    from echo2.runtime.pool import Pool
    from echo2.runtime.prompts import PromptSource
    from echo2.runtime.standing import Standings
    from echo2.tasks.registry import build_task

    cfg = load_config()
    now = [1000.0]

    def clock() -> float:
        return now[0]

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        store = TrajectoryStore(run / "store.sqlite", cfg.staleness.S, cfg.batch.group_size)
        registry = WorkerRegistry(run, "t" * 20, clock, n + 10)
        registry.save = lambda: None  # type: ignore[method-assign]  # not this study's cost
        pool = Pool(registry, cfg.controller, cfg.staleness, cfg.batch.rollouts, 0.0, run, clock)
        standings = Standings(cfg.security.max_unreturned, cfg.runtime.lease_ttl_s)
        broker = LeaseBroker(
            store=store, prompts=PromptSource(build_task(cfg.task, 0), 0), batch=cfg.batch,
            staleness=cfg.staleness, runtime=cfg.runtime, version=lambda: 10, is_active=pool.is_active,
            clock=clock, security=cfg.security, standings=standings, published=lambda: {10},
        )  # fmt: skip
        ids = []
        for i in range(n):
            rec, _ = registry.register(RegisterRequest(name=f"new{i}", usd_per_hour=0.35))
            pool.enroll(rec)
            ids.append(rec.worker_id)
        req = LeaseRequest(max_prompts=8, installed_version=10)

        def ask(w: str) -> bool:
            registry[w].last_seen_s = clock()
            now[0] += 0.0001
            return not hasattr(broker.grant(w, req), "reason")

        granted = sum(ask(w) for w in ids)  # the share fills, then everyone waits
        t0 = time.perf_counter()
        for w in ids:  # every newcomer asks again, in turn
            ask(w)
        per = (time.perf_counter() - t0) / n
        store.close()
    return per, granted


def study_register(ns: list[int], label: str) -> dict[str, Any]:
    """Study ``register`` (in-process, the real registry on a run directory on disk): N workers register
    one after another, as a fleet arriving at once does, each checked against the join token's slots
    and identity budget first as the route checks it; the seconds of the last 100 registrations, per
    registration (what the N-th costs the serving thread), and of all N. Target (fixed before the first
    run): the last registrations at N = 10,000 within 2x of N = 1,000's (O(1) in the fleet)."""
    rows = []
    for n in ns:
        last, whole, worst = _register_fleet(n)
        row = {"n": n, "last_100_s_each": last, "all_s": whole, "slowest_s": worst}
        rows.append(row)
        print(
            f"{label} register N={n}: the last 100 {last * 1e3:.2f} ms each, "
            f"the slowest {worst * 1e3:.1f} ms, all {whole:.1f} s",
            flush=True,
        )
    return _flat(label, rows, "last_100_s_each", "runtime registry, in-process", "the last registrations")


def _register_fleet(n: int) -> tuple[float, float, float]:
    """N registrations, each after the route's checks: seconds each of the last 100, seconds of all,
    the slowest one (a whole ``workers.json`` written, once a second)."""
    import tempfile

    from echo2.protocol import RegisterRequest
    from echo2.runtime.members import WorkerRegistry

    with tempfile.TemporaryDirectory() as tmp:
        reg = WorkerRegistry(Path(tmp), "t" * 20, time.time, n + 10)
        req = RegisterRequest(name="w", usd_per_hour=0.35)
        stamps, worst = [time.perf_counter()], 0.0
        for i in range(n):
            t = time.perf_counter()
            assert not reg.full and not reg.spent  # as the route checks, then enrols
            reg.register(req)
            worst = max(worst, time.perf_counter() - t)
            if i == n - 101:
                stamps.append(time.perf_counter())
        stamps.append(time.perf_counter())
    return (stamps[2] - stamps[1]) / 100, stamps[2] - stamps[0], worst


def study_state(ns: list[int], label: str) -> dict[str, Any]:
    """Study ``state`` (in-process, the real registry, pool and node status): with N workers registered,
    each delivered (a candidate of the controller with a measured rate) and the target known, the
    seconds of one ``/api/state`` snapshot (``NodeStatus.state``, what ``/metrics`` reads too) and of its
    JSON, best of 3, per member. The broadcast part reads a stand-in publisher with no member (the
    publisher's own cost is the publish study's). Target (fixed before the first run; the issue's "O(N)
    at most"): the seconds per member at N = 10,000 within 2x of N = 1,000's."""
    rows = []
    for n in ns:
        per, whole = _state_of(n)
        rows.append({"n": n, "state_s": whole, "state_s_per_member": per})
        print(f"{label} state N={n}: {whole * 1e3:.1f} ms ({per * 1e6:.2f} us a member)", flush=True)
    return _flat(
        label, rows, "state_s_per_member", "runtime node status, in-process", "a snapshot's cost a member"
    )


def _state_of(n: int) -> tuple[float, float]:
    from echo2_bench.viewers import node_status

    with node_status(n) as status:
        best = math.inf
        for _ in range(3):
            t = time.perf_counter()
            json.dumps(status.state())
            best = min(best, time.perf_counter() - t)
    return best / n, best


MIX = ((200.0, 0.60), (100.0, 0.25), (1000.0, 0.15))  # the link mix: Mbit/s, share of the fleet
B0_MBPS = 1000.0  # the learner's uplink
LINK_RATIO = 1.5  # target of the links study: the 1 Gbit workers' median within this x the model's


def study_links(ns: list[int], label: str) -> dict[str, Any]:
    """Study ``links`` (the runtime's trees, timed by the model): on the issue's mix of upload links
    (60% 200, 25% 100, 15% 1,000 Mbit/s; the learner 1 Gbit/s; a 1.2 GB anchor at the automatic chunk
    size), the install time of every worker over the trees the runtime's Tree-Pipelined builds
    (``RelayTree.layout`` handed to ``physics.broadcast.relay_times``), against the model's own trees
    over the same links: the runtime before declared rates reached it (every link equal), with every
    worker's rate declared at registration, and after churn (5% of the members left and 5% joined since
    the trees were built: joiners attached where there is room); and (a reading added after the first
    run) the last worker's install, the whole broadcast, against the model's. A model figure of the
    runtime's topology, not a transfer. Target (the issue's, fixed before the first run): with declared
    rates, the 1 Gbit workers' median install within 1.5x of the model's at N = 1,000."""
    import numpy as np

    from echo2.broadcast.pipelined import TreePipelined
    from echo2.broadcast.strategy import plan_with_leaves
    from echo2.physics import broadcast as pb

    mbit = 1e6 / 8
    rows = []
    for n in ns:
        rng = np.random.default_rng(n)
        rates, shares = zip(*MIX, strict=True)
        ids = [f"w{i}" for i in range(n)]
        links = {w: float(rng.choice(rates, p=shares)) * mbit for w in ids}
        b0, chunk = B0_MBPS * mbit, pb.relay_chunk_bytes(ANCHOR_BYTES)

        model_fast, model_last = _times(None, ids, links, b0, chunk)
        blind = TreePipelined()
        blind.plan(ids, 64)
        linked = TreePipelined()
        plan_with_leaves(linked, ids, frozenset(), 64, links, b0)
        declared_fast, declared_last = _times(linked._cache.tree, ids, links, b0, chunk)
        row = {
            "n": n, "model_fast_median_s": model_fast,
            "equal_links_fast_median_s": _times(blind._cache.tree, ids, links, b0, chunk)[0],
            "declared_fast_median_s": declared_fast,
            # the whole broadcast (the last worker's install), a reading added after the first run
            "declared_slowest_ratio": declared_last / model_last,
        }  # fmt: skip
        gone = set(rng.choice(ids, n // 20, replace=False).tolist())
        churned = [w for w in ids if w not in gone] + [f"j{i}" for i in range(n // 20)]
        links.update({w: float(rng.choice(rates, p=shares)) * mbit for w in churned[n - n // 20 :]})
        plan_with_leaves(linked, churned, frozenset(), 64, links, b0)
        churned_fast, churned_last = _times(linked._cache.tree, churned, links, b0, chunk)
        churned_model_fast, churned_model_last = _times(None, churned, links, b0, chunk)
        row["churned_fast_median_s"] = churned_fast
        row["churned_model_fast_median_s"] = churned_model_fast
        for key in ("equal_links", "declared"):
            row[f"{key}_ratio"] = row[f"{key}_fast_median_s"] / model_fast
        row["churned_ratio"] = churned_fast / churned_model_fast
        row["churned_slowest_ratio"] = churned_last / churned_model_last
        rows.append(row)
        print(
            f"{label} links N={n}: 1 Gbit median, model {row['model_fast_median_s']:.1f} s; runtime with "
            f"equal links {row['equal_links_ratio']:.2f}x, declared {row['declared_ratio']:.2f}x, "
            f"after 5% churn {row['churned_ratio']:.2f}x (last install {row['churned_slowest_ratio']:.3f}x)",
            flush=True,
        )
    at = next((r for r in rows if r["n"] == 1_000), None)
    return {
        "label": label, "rows": rows, "mix_mbps_share": MIX, "b0_mbps": B0_MBPS,
        "source": "the runtime's trees (TreePipelined) timed by the model (physics.broadcast.relay_times)",
        "target": f"declared rates: the 1 Gbit workers' median <= {LINK_RATIO}x the model's, N = 1,000",
        "met": None if at is None else at["declared_ratio"] <= LINK_RATIO,
    }  # fmt: skip


def _times(
    tree: Any, members: list[str], links: dict[str, float], b0: float, chunk: int
) -> tuple[float, float]:
    """The model's median install time of the 1 Gbit workers and the last worker's install (the whole
    broadcast), over ``tree`` (the runtime's trees; None: the model's own over the same links)."""
    import numpy as np

    from echo2.physics import broadcast as pb

    b = np.array([links[w] for w in members])
    layout = tree.layout(members) if tree is not None else None
    t = pb.relay_times(ANCHOR_BYTES, b, b0, chunk, layout=layout)
    return float(np.median(t[b == 1000.0 * 1e6 / 8])), float(t.max())


def _node_run(n: int, window_s: float, out: Path, sets: tuple[str, ...] = ()) -> dict[str, Any]:
    """One run of the node study: a fresh ``echo2 run`` serving ``n`` simulated members, each over
    connections of its own where the descriptor limit holds two a member on both sides, else the members
    of an address sharing a pool of connections (``SHARED_CONNECTIONS``; said in the row); ``sets``:
    config fields set on the learner besides the study's own (``--set``), last so they win."""
    import shutil
    import sys

    import psutil

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from echo2_bench.adversary_length import write_model, write_questions
    from echo2_bench.adversary_runs import last_step, records, start_run, stop, wait_ready
    from echo2_bench.fleet_node import Codec, Tally, fleet, quantiles
    from echo2_bench.perimeter import SOURCES

    limit = _descriptors(6 * n + 1024)  # the learner (a child) inherits it
    shared = 0 if limit >= 6 * n + 1024 else SHARED_CONNECTIONS
    per_address = max(64, 4 * math.ceil(n / len(SOURCES)))  # 253 addresses stand in for N machines
    runs = out / "fleet_runs"
    data = write_questions(runs / "sums.jsonl", 4000)
    model = write_model(runs / "model_node", NODE_SHAPE)
    run_dir = runs / f"node_{n}"
    shutil.rmtree(run_dir, ignore_errors=True)
    prompts, group = 8, 8
    proc = start_run(
        run_dir, f"model.path={str(model)!r}", "runtime.workers=0", "task.name=math",
        f"task.train_path={str(data)!r}", "sampling.max_new_tokens=770", f"batch.prompts={prompts}",
        f"batch.group_size={group}", "runtime.lease_prompts=1", "train.eval_every=1000000",
        "train.eval_size=8", "security.check_fraction=0",
        "security.check_first=0", "security.probation_share=0.5", f"security.max_workers={n + 64}",
        f"security.max_identities={n + 64}", f"security.perimeter.max_per_address={per_address}", *sets,
        minutes=60,
    )  # fmt: skip
    learner = psutil.Process(proc.pid)

    def summed(read: Any) -> float:  # ``read`` of the learner's process and its children, summed
        total = 0.0
        for p in [learner, *learner.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                total += read(p)
        return total

    def cpu() -> float:  # CPU seconds
        return summed(lambda p: sum(p.cpu_times()[:2]))  # user + system

    def rss() -> int:
        return int(summed(lambda p: p.memory_info().rss))

    try:
        info = wait_ready(run_dir, proc)
        token = (run_dir / "join_token").read_text().strip()

        async def go() -> dict[str, Any]:
            codec = await Codec.fetch(info["join"], token)
            tally, stop_ev = Tally(), asyncio.Event()
            t0 = time.perf_counter()
            task = asyncio.ensure_future(
                fleet(info["join"], token, n, codec, run_dir, stop_ev, tally, shared)
            )
            while len(tally.registered_at) < n and time.perf_counter() - t0 < REGISTER_S:
                await asyncio.sleep(0.5)
            registered = len(tally.registered_at)
            s0, c0, g0, w0 = last_step(run_dir), cpu(), time.process_time(), time.perf_counter()
            await asyncio.sleep(window_s)
            s1, c1, g1, dt = last_step(run_dir), cpu(), time.process_time(), time.perf_counter() - w0
            mem = rss()
            stop_ev.set()
            await asyncio.wait_for(task, 90)
            return {"tally": tally, "registered_in_phase": registered, "steps": (s0, s1), "window_s": dt,
                    "learner_cpu": (c1 - c0) / dt, "generator_cpu": (g1 - g0) / dt,
                    "learner_rss": mem}  # fmt: skip

        got = asyncio.run(go())
        rc = stop(proc)
    finally:
        stop(proc)
    tally: Any = got["tally"]
    s0, s1 = got["steps"]
    per_k, gc_s, gc_full = [], 0.0, 0.0
    for r in records(run_dir):
        if s0 < r.get("step", 0) <= s1:  # the collector's pauses in the window (none written: None)
            gc_s += r.get("learner/gc_pause_s", math.nan)
            gc_full += r.get("learner/gc_full_collections", math.nan)
        if (
            s0 < r.get("step", 0) <= s1
            and "learner/t_train_s" in r
            and r.get("data/completion_tokens_trained")
        ):
            per_k.append(
                r["learner/t_train_s"] / (prompts * group * r["data/completion_tokens_trained"] / 1000)
            )
    errors = sum(
        c
        for table in tally.outcomes.values()
        for o, c in table.items()
        if o.startswith(("5", "failed", "crashed"))
    )
    reg = sorted(tally.registered_at)
    return {
        "n": n,
        "exit": rc,
        "connections_per_address": shared or "one pool a member",
        "registered": len(reg),
        "registered_in_phase": got["registered_in_phase"],
        "register_all_s": reg[-1] if len(reg) == n else None,
        "register_p50_s": reg[len(reg) // 2] if reg else None,
        "window_s": got["window_s"],
        "steps_in_window": s1 - s0,
        "update_s_per_1k_tokens": statistics.median(per_k) if per_k else None,
        "update_s_per_1k_tokens_each": per_k,
        "learner_cpu_share": got["learner_cpu"],
        "gc_pause_s": None if math.isnan(gc_s) else gc_s,
        "gc_full_collections": None if math.isnan(gc_full) else gc_full,
        "learner_rss_bytes": got["learner_rss"],
        "generator_cpu_share": got["generator_cpu"],
        "latency": {k: quantiles(v) for k, v in tally.latency.items()},
        "outcomes": tally.outcomes,
        "errors": errors,
        "lease_refusals": tally.refusals,
        "granted_prompts": tally.granted_prompts,
        "admitted": tally.admitted,
        "dropped_stale": tally.dropped_stale,
    }


def _descriptors(need: int) -> int:
    """This process's descriptor limit (and so the learner's, its child's) to at least ``need``: the soft
    limit to the hard one, and the hard one too where the machine lets it (root), as a deployment would
    set ``LimitNOFILE=``; otherwise what there is (the learner then cuts its connection caps, and says so)."""
    import resource

    from echo2.resources import raise_descriptor_limit

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        with contextlib.suppress(ValueError, OSError):  # a container may not let even root raise it
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, need))
    return raise_descriptor_limit(need)


def study_node(
    ns: list[int], label: str, window_s: float, repeats: int = 1, sets: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The baseline fleet, then each N (module docstring), ``repeats`` times interleaved (each N's update
    ratio read against its own repeat's baseline); the readings against ``NODE_TARGETS``. With repeats,
    the verdict reads the median ratio, the worst p99 and every repeat's errors, and the ratios' mean
    comes with its 95% t interval (``runtime.t_interval``): whether a ratio's distance from the target
    is inside the run-to-run noise."""
    from runtime import t_interval  # benchmarks/runtime.py, as the other studies read theirs

    runs: list[list[dict[str, Any]]] = []
    for i in range(repeats):
        rows = []
        for n in [BASE_N, *ns]:
            print(f"node study: N = {n} (repeat {i + 1} of {repeats})", flush=True)
            rows.append(_node_run(n, window_s, ROOT / "results", sets))
            r = rows[-1]
            shown = ("n", "registered", "register_all_s", "steps_in_window", "update_s_per_1k_tokens",
                     "learner_cpu_share", "generator_cpu_share", "errors", "latency")  # fmt: skip
            print(json.dumps({k: r[k] for k in shown}), flush=True)
        base = rows[0]["update_s_per_1k_tokens"]
        for r in rows:
            u = r["update_s_per_1k_tokens"]
            r["update_ratio"] = u / base if u is not None and base else None
        runs.append(rows)
    rows = runs[0]
    spread: dict[str, Any] = {}
    if repeats > 1:
        for n in ns:
            got = [r for rows_i in runs for r in rows_i if r["n"] == n]
            ratios = [r["update_ratio"] for r in got if r["update_ratio"] is not None]
            mean, lo, hi = t_interval(ratios) if ratios else (math.nan, math.nan, math.nan)
            spread[str(n)] = {
                "ratios": ratios, "median_ratio": statistics.median(ratios) if ratios else None,
                "mean_ratio": mean, "ci95": [lo, hi], "errors": sum(r["errors"] for r in got),
                "p99_lease_submit_s": max(_p99(r, ("lease", "submit")) for r in got),
            }  # fmt: skip
    by_n = {r["n"]: r for r in rows}
    t = NODE_TARGETS
    verdict: dict[str, Any] = {}
    if "1000" in spread:  # repeats: the median ratio, every repeat's errors, the worst p99
        sp = spread["1000"]
        verdict["n1000"] = (
            sp["median_ratio"] is not None
            and sp["median_ratio"] <= t["n1000_update_ratio_max"]
            and sp["errors"] <= t["n1000_errors_max"]
            and sp["p99_lease_submit_s"] <= t["n1000_p99_lease_submit_s_max"]
        )
    elif 1000 in by_n:
        r = by_n[1000]
        p99 = _p99(r, ("lease", "submit"))
        verdict["n1000"] = (
            r["update_ratio"] is not None
            and r["update_ratio"] <= t["n1000_update_ratio_max"]
            and r["errors"] <= t["n1000_errors_max"]
            and p99 <= t["n1000_p99_lease_submit_s_max"]
        )
    if 3000 in by_n:
        r = by_n[3000]
        verdict["n3000"] = r["steps_in_window"] >= t["n3000_steps_min"] and (
            r["register_all_s"] is not None and r["register_all_s"] <= t["n3000_register_s_max"]
        )
    if 10000 in by_n:
        r = by_n[10000]
        fives = sum(c for tb in r["outcomes"].values() for o, c in tb.items() if o.startswith("5"))
        p99 = _p99(r, ("register", "heartbeat", "lease"))
        verdict["n10000"] = fives == 0 and p99 <= t["n10000_p99_control_s_max"]
    out = {"label": label, "window_s": window_s, "base_n": BASE_N, "rows": rows, "targets": t,
           "met": verdict, "cpus": os.cpu_count(), "sets": list(sets)}  # fmt: skip
    if repeats > 1:
        out.update(repeats=repeats, repeat_rows=runs[1:], spread=spread)
    return out


def _p99(row: dict[str, Any], endpoints: tuple[str, ...]) -> float:
    """The worst p99 latency of ``endpoints`` in a node run's row (inf for one that answered nothing)."""
    return max(row["latency"].get(k, {}).get("p99", math.inf) for k in endpoints)


# the publish study's readings the figure shows (the rest stay in the JSON): the first reading's before
# and after, this study's code at the start of the session of the later readings, its reading then, and
# the last pair (the collector paused while planning and encoding; before and after, interleaved)
PLOTTED_PUBLISH = ("before", "after", "before_r1", "batched_r1", "gc_before_r1", "gc_paused_r1")
PLOTTED_RESTART = ("before", "latecomers", "before_half_present", "latecomers_half_present")


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(21, 3.8))
    published = res.get("publish", {})
    shown = [k for k in PLOTTED_PUBLISH if k in published] or sorted(published)
    for label, got in ((k, published[k]) for k in shown):
        ns = [r["n"] for r in got["rows"]]
        axes[0].plot(ns, [r["cpu_s"] for r in got["rows"]], "o-", label=label)
        axes[0].plot(ns, [r["next"]["cpu_s"] for r in got["rows"]], "x--", label=f"{label}, next version")
        if all("churned" in r for r in got["rows"]):
            axes[0].plot(ns, [r["churned"]["cpu_s"] for r in got["rows"]], "s:", label=f"{label}, 1% churned")
        axes[1].plot(ns, [r["largest_frame"] / 1e3 for r in got["rows"]], "o-", label=label)
        axes[2].plot(ns, [r["loop_max_stall_s"] for r in got["rows"]], "o-", label=label)
    axes[0].axhline(MAX_CPU_S, ls=":", c="k")
    axes[1].axhline(MAX_FRAME / 1e3, ls=":", c="k")
    for label, got in sorted(res.get("node", {}).items()):  # the node study: update time against the baseline
        rows = [r for r in got["rows"] if r["update_ratio"] is not None]
        pts = [(r["n"], r["update_ratio"]) for r in rows]
        if "spread" in got:  # repeats: the median ratio at each N (the baseline's 1.0 first)
            pts = [(BASE_N, 1.0)] + [(int(n), sp["median_ratio"]) for n, sp in got["spread"].items()]
            label = f"{label} (median of {got['repeats']})"
        axes[3].plot(*zip(*pts, strict=True), "o-", label=f"node: {label}")
    axes[3].axhline(NODE_TARGETS["n1000_update_ratio_max"], ls=":", c="k")
    titles = ("learner CPU s per publication", "largest announce frame (KB)", "longest event-loop stall (s)")
    for ax, title in zip(axes[:3], titles, strict=True):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("members N")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    axes[3].set_xscale("log")
    axes[3].set_xlabel("simulated members N")
    axes[3].set_title(f"node: update s per 1k tokens / N = {BASE_N}'s", fontsize=10)
    axes[3].legend(fontsize=8)
    restart = res.get("restart", {})
    restarts = [(f"{k}\nN={n}", [r["uplink_copies"] for r in restart[k]["rows"] if r["n"] == n])
                for k in PLOTTED_RESTART if k in restart
                for n in sorted({r["n"] for r in restart[k]["rows"]})]  # fmt: skip
    for i, (_, copies) in enumerate(restarts):
        axes[4].bar(i, max(copies), color="tab:blue" if max(copies) <= MAX_UPLINK_COPIES else "tab:red")
        axes[4].text(i, max(copies), f"{max(copies):.1f}x", ha="center", va="bottom", fontsize=7)
    axes[4].set_xticks(range(len(restarts)), [name for name, _ in restarts], fontsize=6)
    axes[4].axhline(MAX_UPLINK_COPIES, ls=":", c="k")
    axes[4].set_yscale("log")
    axes[4].set_title("restart: learner uplink / model until all hold it (worst run)", fontsize=10)
    fig.suptitle(
        "One publication's control plane (1.2 GB anchor's chunk count), runtime publisher; the real node "
        "serving N simulated members (loopback, TLS)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--study",
        choices=["publish", "probation", "register", "links", "node", "state", "viewers", "restart", "slow"],
        default="publish",
    )
    p.add_argument("--present", type=float, default=0.0, help="restart: share joined before the anchor")
    p.add_argument("--seeds", type=int, default=1, help="restart: runs per N")
    p.add_argument("--gather", type=float, default=0.0, help="restart: the announcement waits for the fleet")
    p.add_argument("--window", type=float, default=120.0, help="node: seconds of the steady window")
    p.add_argument("--ns", type=int, nargs="+", default=[1_000, 3_000, 10_000], help="members per reading")
    p.add_argument("--repeats", type=int, default=1, help="node: the baseline and each N, this often")
    p.add_argument("--label", default="after", help="whose code this is (the before/after readings)")
    p.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="node: a learner config field"
    )
    p.add_argument("--out", type=Path, default=ROOT / "results")
    a = p.parse_args()
    path = a.out / "fleet.json"
    res: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    studies = {"publish": study_publish, "probation": study_probation, "register": study_register,
               "state": study_state}  # fmt: skip
    if a.study == "node":
        res.setdefault("node", {})[a.label] = study_node(a.ns, a.label, a.window, a.repeats, tuple(a.set))
    elif a.study == "restart":
        res.setdefault("restart", {})[a.label] = study_restart(a.ns, a.label, a.present, a.seeds, a.gather)
    else:
        from echo2_bench.slow_relay import study_slow
        from echo2_bench.viewers import plot as plot_viewers
        from echo2_bench.viewers import study_viewers

        study = {**studies, "links": study_links, "slow": study_slow, "viewers": study_viewers}[a.study]
        res.setdefault(a.study, {})[a.label] = study(a.ns, a.label)
        if a.study == "viewers":
            plot_viewers(res["viewers"], a.out / "fleet_viewers.png")
    path.write_text(json.dumps(res, indent=1) + "\n")
    plot(res, a.out / "fleet.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
