"""A relay slower than its peers, but never slow enough to be cut (``benchmarks/fleet.py --study slow``).

Runtime, in-process: the real TCP publisher (Tree-Pipelined, no declared links) and N real
``TcpWorkerNode`` members on loopback, every member's uplink paced at ``RATE`` (``wire.Pacer``), one
of them (``SLOW``, a relay of the link-blind trees) at a third of it: its children get its stripe at
about a third of their other sources' pace, above the lag rule's quarter (``wire.lagging``), so no
stall is ever reported. ``VERSIONS`` versions of one blob are published one after the other, each
waited for; per version the honest members' ``T_all`` (the slowest honest install) and how many members
the plan had pull from the slow one. The same fleet with every member at ``RATE`` is the baseline, run
just before. Target (fixed here before the first run): over the versions after the acks' paces are
read (version ``READ_AFTER + 2`` on), the median of the slow fleet's honest ``T_all`` over the
baseline's is at most ``TARGET``.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

READ_AFTER = 2  # conduct.READ_AFTER (the code before it has no conduct: the same versions are compared)
RATE = 800_000.0  # bytes/s of a member's uplink
SLOW_FACTOR = 3.0  # the slow relay's uplink: RATE / this
CHUNK = 8 << 10
STRIPE_CHUNKS = 20  # chunks of each stripe (8 stripes at N >= 8)
VERSIONS = 8
STALL_S = 1.0
SLOW = 3  # the slow member's index (a stripe's root in the link-blind trees)
TARGET = 1.25


async def _install(node: Any, version: int, at: dict[str, float]) -> None:
    async for snap in node.snapshots():
        if snap.manifest.version == version:
            at[node.worker_id] = time.monotonic()
            await node.report_installed(version)
            return


async def run_once(n: int, slow_factor: float, seed: int = 0) -> dict[str, Any]:
    """One fleet of ``n`` through ``VERSIONS`` versions; member ``SLOW`` paced at RATE / slow_factor."""
    from echo2.broadcast.api import OpenLedger
    from echo2.broadcast.pipelined import TreePipelined
    from echo2.broadcast.publisher import TcpPublisher
    from echo2.broadcast.receiver import TcpWorkerNode
    from echo2.broadcast.strategy import LEARNER
    from echo2.broadcast.wire import Pacer
    from echo2.weights.manifest import new_signing_key, synthetic_snapshot

    key = new_signing_key()
    pub = TcpPublisher(key, TreePipelined(), chunk_size=CHUNK, ledger=OpenLedger())
    await pub.start()
    ids = [f"w{i:03d}" for i in range(n)]
    nodes = [
        TcpWorkerNode(w, pub.address, key.verifier(), stall_timeout=STALL_S,
                      uplink=Pacer(RATE / (slow_factor if i == SLOW else 1.0), burst=CHUNK))
        for i, w in enumerate(ids)
    ]  # fmt: skip
    for nd in nodes:
        await nd.start()
    await pub.wait_members(n, 30)
    blob = synthetic_snapshot(8 * STRIPE_CHUNKS * CHUNK, seed=seed)
    rows = []
    for v in range(1, VERSIONS + 1):
        at: dict[str, float] = {}  # member -> when it installed v
        tasks = [asyncio.ensure_future(_install(nd, v, at)) for nd in nodes]
        t0 = time.monotonic()
        await pub.publish(v, blob)
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        plan = pub._rounds[v].plan  # the version's plan, as announced
        served = sum(any(a.source == ids[SLOW] for a in pulls) for pulls in plan.values())
        relays = {a.source for pulls in plan.values() for a in pulls} - {LEARNER}
        honest = max(t for w, t in at.items() if w != ids[SLOW]) - t0
        rows.append({"v": v, "honest_t_all_s": honest, "served_by_slow": served, "relays": len(relays)})
    reports = sum(nd.counters.stalls_reported for nd in nodes)
    conduct = getattr(pub, "conduct", None)  # the code before the acks' paces has none
    slow_found = conduct.slow() if conduct is not None else None
    for nd in nodes:
        await nd.close()
    await pub.close()
    return {
        "n": n,
        "slow_factor": slow_factor,
        "rows": rows,
        "stall_reports": reports,
        "slow_found": slow_found,
    }


def study_slow(ns: list[int], label: str) -> dict[str, Any]:
    """Per N: the baseline (every member at RATE), then the fleet with the slow relay."""
    out: dict[str, Any] = {"rate_bytes_per_s": RATE, "slow_factor": SLOW_FACTOR, "chunk": CHUNK,
                           "stripe_chunks": STRIPE_CHUNKS, "versions": VERSIONS, "target": TARGET,
                           "read_after": READ_AFTER, "rows": []}  # fmt: skip
    for n in ns:
        base = asyncio.run(run_once(n, 1.0))
        slow = asyncio.run(run_once(n, SLOW_FACTOR))
        ratios = [
            s["honest_t_all_s"] / b["honest_t_all_s"] for s, b in zip(slow["rows"], base["rows"], strict=True)
        ]
        after = ratios[READ_AFTER + 1 :]
        row = {"n": n, "baseline": base, "slow": slow, "ratio_by_version": ratios,
               "median_ratio_after_reading": statistics.median(after),
               "met": statistics.median(after) <= TARGET}  # fmt: skip
        out["rows"].append(row)
        served = [r["served_by_slow"] for r in slow["rows"]]
        print(f"{label} slow relay N={n}: honest T_all / baseline by version "
              f"{', '.join(f'{r:.2f}' for r in ratios)}; median from v{READ_AFTER + 2}: "
              f"{row['median_ratio_after_reading']:.2f} (target <= {TARGET}); served by the slow one "
              f"{served}; stall reports {slow['stall_reports']}", flush=True)  # fmt: skip
    out["met"] = all(r["met"] for r in out["rows"])
    return out
