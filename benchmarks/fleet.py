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

Targets (fixed here, before the first run; the issue's): at N = 10,000, at most 1 s of learner CPU for
the control plane of a publication (the first) and no frame over 1 MiB. Baseline: the same study on the
code before the change (``--label before`` run with that checkout's ``src`` first on ``PYTHONPATH``),
in the same session.

Writes results/fleet.json (the study's readings under their ``--label``) and results/fleet.png.

    python benchmarks/fleet.py --study publish --label after
    git worktree add ../echo2-before 0c4427b
    PYTHONPATH=../echo2-before/src python benchmarks/fleet.py --study publish --label before
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
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
    sinks = {}
    for i in range(n):
        w = f"member-{i:05d}-{os.urandom(3).hex()}"  # ids of a registry's length
        sinks[w] = Sink()
        pub._members[w] = _Member(
            w, (f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}", 40000), "ab" * 32, sinks[w]
        )  # type: ignore[arg-type]
    blob = os.urandom(n_chunks * CHUNK)
    cpu0 = time.process_time()
    build_manifest(blob, 1, CHUNK, pub.key, None)  # what publish spends on the manifest, read apart
    manifest_cpu = time.process_time() - cpu0
    first = await _timed(pub, 1, blob, sinks, manifest_cpu)
    again = await _timed(pub, 2, os.urandom(n_chunks * CHUNK), sinks, manifest_cpu)  # the same fleet
    return {"n": n, "n_chunks": n_chunks, "manifest_cpu_s": manifest_cpu, **first, "next": again}


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
        for which, r in (("first", row), ("next", row["next"])):
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


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for label, got in sorted(res.get("publish", {}).items()):
        ns = [r["n"] for r in got["rows"]]
        axes[0].plot(ns, [r["cpu_s"] for r in got["rows"]], "o-", label=label)
        axes[0].plot(ns, [r["next"]["cpu_s"] for r in got["rows"]], "x--", label=f"{label}, next version")
        axes[1].plot(ns, [r["largest_frame"] / 1e3 for r in got["rows"]], "o-", label=label)
        axes[2].plot(ns, [r["loop_max_stall_s"] for r in got["rows"]], "o-", label=label)
    axes[0].axhline(MAX_CPU_S, ls=":", c="k")
    axes[1].axhline(MAX_FRAME / 1e3, ls=":", c="k")
    titles = ("learner CPU s per publication", "largest announce frame (KB)", "longest event-loop stall (s)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("members N")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(
        "One publication's control plane (1.2 GB anchor's chunk count), runtime publisher", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", choices=["publish", "probation", "register", "links"], default="publish")
    p.add_argument("--ns", type=int, nargs="+", default=[1_000, 3_000, 10_000], help="members per reading")
    p.add_argument("--label", default="after", help="whose code this is (the before/after readings)")
    p.add_argument("--out", type=Path, default=ROOT / "results")
    a = p.parse_args()
    path = a.out / "fleet.json"
    res: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    studies = {"publish": study_publish, "probation": study_probation, "register": study_register}
    study = {**studies, "links": study_links}[a.study]
    res.setdefault(a.study, {})[a.label] = study(a.ns, a.label)
    path.write_text(json.dumps(res, indent=1) + "\n")
    plot(res, a.out / "fleet.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
