"""Process entry points of the broadcast harness: ``python -m echo2_bench.proc learner|worker ...``.

The harness (netns or loopback) starts one learner and N workers with these (``benchmarks/`` on
``PYTHONPATH``), reads the JSON each writes under ``--out``, and stops them by pid. The per-run key
travels in ``ECHO2_BCAST_KEY`` (the learner gets the Ed25519 key pair, workers only its public half),
not argv. Both ends use the product classes; the only benchmark logic is the fault flags, which plug a
:class:`~echo2_bench.faults.FaultTap` into the worker node. With ``--tls-dir`` (learner: the run
certificate there) and ``--pin`` (workers: its fingerprint) the plane runs under TLS, as in a run.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

from echo2.broadcast.api import OpenLedger
from echo2.broadcast.factory import get_strategy
from echo2.broadcast.publisher import TcpPublisher
from echo2.broadcast.receiver import TcpWorkerNode
from echo2.broadcast.wire import Pacer
from echo2.physics.rules import DEFAULT_GAMMA
from echo2.transport import run_identity
from echo2.weights.manifest import key_from_text, synthetic_snapshot
from echo2_bench.faults import Faults, FaultTap

KEY_ENV = "ECHO2_BCAST_KEY"  # key_from_text form: the learner gets the key pair, workers the public key
log = logging.getLogger(__name__)


def _pacer(bps: float) -> Pacer | None:
    return Pacer(bps / 8.0) if bps > 0 else None


async def run_learner(a: argparse.Namespace) -> dict:  # type: ignore[type-arg]
    key = key_from_text(os.environ[KEY_ENV])
    strategy = get_strategy(a.strategy)
    pub = TcpPublisher(
        key, strategy, a.chunk or None, host=a.host, port=a.port, uplink=_pacer(a.uplink_bps),
        serve_wait_timeout=a.timeout,
        link_rates=(a.b0_bps / 8, a.bw_bps / 8) if a.b0_bps and a.bw_bps else None,
        tls=run_identity(Path(a.tls_dir), [a.host]) if a.tls_dir else None, ledger=OpenLedger(),
    )  # fmt: skip
    await pub.start()
    blob = synthetic_snapshot(a.size, seed=a.seed)
    try:
        await pub.wait_members(a.workers, a.join_timeout)
        await asyncio.sleep(0.2)  # let every worker finish its join bookkeeping
        manifest = await pub.publish(1, blob)
        stats = await pub.wait_installed(1, count=a.expect or None, timeout=a.timeout)
    finally:
        await pub.close()
    return {
        "strategy": strategy.name,
        "n_workers": stats.n_workers,
        "size": manifest.total_size,
        "chunk": manifest.chunk_size,
        "n_chunks": manifest.n_chunks,
        "digest": manifest.digest,
        "install_s": stats.install_s,
        "learner_bytes": stats.learner_bytes,
        "metrics": stats.metrics(DEFAULT_GAMMA),
    }


async def run_worker(a: argparse.Namespace) -> dict:  # type: ignore[type-arg]
    key = key_from_text(os.environ[KEY_ENV])
    host, port = a.learner.rsplit(":", 1)
    faults = Faults(die_at=a.die_at, stall_at=a.stall_at, corrupt_every=a.corrupt_every)
    tap = FaultTap(faults, a.id) if faults != Faults() else None
    node = TcpWorkerNode(
        a.id, (host, int(port)), key, host=a.host, uplink=_pacer(a.uplink_bps),
        downlink=_pacer(a.downlink_bps), stall_timeout=a.stall_timeout, max_bad_chunks=a.max_bad_chunks,
        tap=tap, pin=a.pin or None,
    )  # fmt: skip
    await node.start(join_timeout=a.timeout)
    installs = []
    async for snap in node.snapshots():
        data = bytes(snap.data)
        if a.load:  # a worker ultimately loads the safetensors blob
            from safetensors.numpy import load

            load(data)
        ok = hashlib.sha256(data).hexdigest() == a.expect_digest if a.expect_digest else True
        await node.report_installed(snap.manifest.version)
        installs.append({"v": snap.manifest.version, "digest_ok": ok, "t": time.time()})
        del data
    await node.wait_closed()
    injected = {"corrupted_sent": tap.corrupted_sent if tap is not None else 0}
    return {"id": a.id, "installs": installs, "counters": vars(node.counters), "injected": injected}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m echo2_bench.proc")
    sub = p.add_subparsers(dest="role", required=True)
    lp = sub.add_parser("learner")
    lp.add_argument("--strategy", required=True)
    lp.add_argument("--workers", type=int, required=True)
    lp.add_argument("--expect", type=int, default=0, help="installs to wait for (0 = all live)")
    lp.add_argument("--size", type=int, required=True)
    lp.add_argument("--chunk", type=int, required=True, help="bytes; 0: chosen per snapshot")
    lp.add_argument("--seed", type=int, default=0)
    lp.add_argument("--port", type=int, default=0)
    lp.add_argument("--join-timeout", type=float, default=120.0)
    lp.add_argument("--b0-bps", type=float, default=0.0, help="known learner uplink (enables rate matching)")
    lp.add_argument("--bw-bps", type=float, default=0.0, help="known per-worker link (enables rate matching)")
    lp.add_argument("--tls-dir", default="", help="serve TLS with the run certificate in this directory")
    wp = sub.add_parser("worker")
    wp.add_argument("--id", required=True)
    wp.add_argument("--learner", required=True, help="host:port")
    wp.add_argument("--downlink-bps", type=float, default=0.0)
    wp.add_argument("--stall-timeout", type=float, default=5.0)
    wp.add_argument("--max-bad-chunks", type=int, default=3)
    wp.add_argument("--die-at", type=float, default=0.0)
    wp.add_argument("--stall-at", type=float, default=0.0)
    wp.add_argument("--corrupt-every", type=int, default=0)
    wp.add_argument("--expect-digest", default="")
    wp.add_argument("--load", action="store_true")
    wp.add_argument("--pin", default="", help="the learner certificate's SHA-256: TLS everywhere")
    for sp in (lp, wp):
        sp.add_argument("--host", default="127.0.0.1")
        sp.add_argument("--uplink-bps", type=float, default=0.0, help="application pacing, bits/s (0 = none)")
        sp.add_argument("--timeout", type=float, default=300.0)
        sp.add_argument("--out", required=True, help="JSON result path")
        sp.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(
        level=a.log_level, format=f"%(asctime)s %(levelname)s [{a.role}:{os.getpid()}] %(name)s: %(message)s"
    )
    result = asyncio.run(run_learner(a)) if a.role == "learner" else asyncio.run(run_worker(a))
    tmp = Path(a.out + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
