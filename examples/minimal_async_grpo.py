"""Asynchronous GRPO with bounded staleness in one readable file: a learner and two rollout workers
in one process, joined by the real parts of echo2 (SPEC §1-§2).

    learner:  store --take the P oldest admissible groups--> GRPO update (v -> v+1)
              every kappa versions: weights --signed snapshot--> in-memory broadcast hub
    worker i: hub --verified snapshot--> its own engine (installed between generations)
              lease (prompts, no answers) --> G samples per prompt --codec + validation--> learner
    learner:  every completion graded by the task (a worker's reward is never read) --> store

The pieces are the ones `echo2 run` wires across processes and machines: the trajectory store with
its admission rule ``v >= v_t - S``, the lease broker with its in-flight cap, the broadcast seam
(here its in-memory implementation, through the same factory the runtime uses), the engine seam
(each worker builds its engine from the learner's model skeleton and gets every weight from
snapshots), the wire protocol's trajectory codec and the submission validator, and the GRPO trainer.
What `echo2 run` adds: HTTP and TCP between processes, credentials, heartbeats, cost-aware
activation, checkpoints, metrics. If this file and the system disagree, one of them has a bug.

    python examples/minimal_async_grpo.py --minutes 2
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time
import zlib
from pathlib import Path

from echo2.broadcast.factory import get_strategy, open_publisher, open_receiver
from echo2.config import load_config
from echo2.data.store import TrajectoryStore
from echo2.data.submission import validate_submission
from echo2.learner.trainer import GRPOTrainer
from echo2.models.policy import TextCodec, configure_torch, load_checkpoint
from echo2.models.snapshot import skeleton_files, snapshot_blob, tokenizer_from_skeleton, write_skeleton
from echo2.protocol import LeaseGrant, LeaseRequest, SubmitRequest, group_to_wire
from echo2.rollout.collect import collect_groups
from echo2.rollout.engines import build_engine
from echo2.rollout.engines.hf import HFEngine
from echo2.rollout.evaluate import evaluate_text
from echo2.runtime.intake import submission_limits
from echo2.runtime.leases import LeaseBroker
from echo2.runtime.prompts import PromptSource
from echo2.tasks.registry import build_task
from echo2.tasks.warm_cache import starting_checkpoint
from echo2.types import Bounds
from echo2.weights.delta import decode_full
from echo2.weights.manifest import new_signing_key


class Worker:
    """One rollout worker: its own engine (weights only from snapshots), a lease loop and an installer."""

    def __init__(self, name: str, hub, key, skeleton: Path, cfg) -> None:  # type: ignore[no-untyped-def]
        tok = tokenizer_from_skeleton(skeleton)
        self.name, self.cfg, self.codec = name, cfg, TextCodec(tok, cfg.model.chat_template)
        self.engine = build_engine("hf", skeleton, tok.eos_token_id, tok.pad_token_id, cfg.sampling)
        self.receiver = open_receiver(hub, name, key.verifier())
        self.task = build_task(cfg.task, cfg.seed)
        self.version, self.pending = -1, None
        self.lock = threading.Lock()  # held while generating: a snapshot goes in between generations

    async def follow_broadcast(self) -> None:
        """Every verified snapshot the hub delivers becomes the pending one."""
        async for snap in self.receiver.snapshots():
            self.pending = snap

    def install_pending(self) -> None:
        snap = self.pending
        if snap is not None and snap.manifest.version > self.version:
            with self.lock:
                self.engine.install(decode_full(snap.data))  # a full snapshot (no patches here)
                self.version = snap.manifest.version

    def generate(self, lease: LeaseGrant, seed: int):  # type: ignore[no-untyped-def]
        self.install_pending()
        with self.lock:
            version = self.version
            batch = collect_groups(
                self.codec,
                self.engine,
                self.task,
                lease.prompts,
                lease.group_size,
                seed=seed,
                policy_version=version,
                group_prefix=lease.lease_id,
                grade=False,  # the lease carries no answer: the learner grades (docs/security.md)
            )
        G, ts = lease.group_size, batch.trajectories
        return version, [ts[i : i + G] for i in range(0, len(ts), G)]

    async def run(
        self, broker: LeaseBroker, store: TrajectoryStore, verifier, limits, published, stop
    ) -> None:  # type: ignore[no-untyped-def]
        n = 0
        while not stop.is_set():
            await asyncio.to_thread(self.install_pending)
            lease = broker.grant(self.name, LeaseRequest(max_prompts=8, installed_version=self.version))
            if not isinstance(lease, LeaseGrant):  # buffer full or weights too old: ask again soon
                await asyncio.sleep(lease.retry_after_s)
                continue
            n += 1
            version, groups = await asyncio.to_thread(
                self.generate, lease, zlib.crc32(f"{self.name}:{n}".encode())
            )
            # what travels: the protocol's codec; what is admitted: the validator's, the task's grades
            # (the verifier checks the prompt tokens and shape, and grades every completion) and the store's
            body = SubmitRequest(
                lease_id=lease.lease_id, policy_version=version, groups=[group_to_wire(g) for g in groups]
            )
            sub = validate_submission(body, limits, published())
            sub = verifier.check(store.lease(lease.lease_id), sub)
            store.submit(sub, self.name, broker.version(), time.time())
            broker.returned(self.name)  # a returned lease earns the next, larger one (runtime/standing.py)


async def main(
    minutes: float, seed: int, staleness: int, steps: int = 10**9
) -> tuple[float, float, int, int]:
    cfg = load_config(overrides=[f"seed={seed}", f"staleness.S={staleness}"])
    configure_torch(cfg)
    policy = load_checkpoint(starting_checkpoint(cfg))  # the warm start, built and cached on first use
    task = build_task(cfg.task, cfg.seed)
    trainer = GRPOTrainer(policy.model, cfg.grpo, cfg.sampling, policy.pad_id, task.token_mask)
    store = TrajectoryStore(":memory:", cfg.staleness.S, cfg.batch.group_size)
    broker = LeaseBroker(
        store=store,
        prompts=PromptSource(task, cfg.seed),
        batch=cfg.batch,
        staleness=cfg.staleness,
        runtime=cfg.runtime,
        version=lambda: trainer.version,
        is_active=lambda w: True,
        clock=time.time,
    )
    key = new_signing_key()
    hub = open_publisher("memory", key, get_strategy("star-unlimited"), 1 << 20)
    await hub.publish(0, snapshot_blob(policy.model))
    published = [0]  # newest published version

    eval_engine = HFEngine(policy.model, policy.eos_id, policy.pad_id, cfg.sampling)
    held_out = task.eval_prompts(256)
    before = evaluate_text(policy.codec, eval_engine, task, held_out).accuracy
    print(f"start: held-out accuracy {before:.3f}", flush=True)

    skeleton = Path(tempfile.mkdtemp(prefix="echo2-skeleton-"))
    write_skeleton(skeleton_files(policy.source, policy.model, policy.tokenizer, skeleton), skeleton)
    workers = [Worker(f"w{i}", hub, key, skeleton, cfg) for i in range(2)]
    stop = asyncio.Event()
    limits = submission_limits(cfg, task, int(policy.model.config.vocab_size))
    verifier = task.verifier(policy.codec, policy.eos_ids, Bounds.of(cfg))
    tasks = [asyncio.ensure_future(w.follow_broadcast()) for w in workers]
    tasks += [
        asyncio.ensure_future(w.run(broker, store, verifier, limits, lambda: published[0], stop))
        for w in workers
    ]

    S, kappa, P = cfg.staleness.S, cfg.staleness.effective_kappa, cfg.batch.prompts
    t0, staleness_max = time.perf_counter(), 0
    while time.perf_counter() - t0 < minutes * 60 and trainer.version < steps:
        batch = store.take_batch(P, trainer.version, step=trainer.version + 1)  # drops v < v_t - S first
        if batch is None:
            await asyncio.sleep(0.01)  # the bubble: the learner waits for rollouts
            continue
        flat = [t for group in batch for t in group]
        staleness_max = max(staleness_max, trainer.version - min(t.policy_version for t in flat))
        assert staleness_max <= S, "admission let a too-stale trajectory through"
        stats = await asyncio.to_thread(trainer.update, flat)
        if stats.version % kappa == 0:  # publish: a signed snapshot through the broadcast seam
            await hub.publish(stats.version, snapshot_blob(policy.model))
            published[0] = stats.version
        if stats.version % 50 == 0:
            acc = evaluate_text(policy.codec, eval_engine, task, held_out).accuracy
            print(
                f"v {stats.version:4d}  {time.perf_counter() - t0:5.0f}s  held-out accuracy {acc:.3f}  "
                f"max staleness {staleness_max}",
                flush=True,
            )
    stop.set()
    await hub.close()
    await asyncio.gather(*tasks, return_exceptions=True)
    after = evaluate_text(policy.codec, eval_engine, task, held_out).accuracy
    print(
        f"end after {trainer.version} updates: held-out accuracy {after:.3f}, max staleness "
        f"{staleness_max} (S = {S}), admitted {store.stats().admitted}, dropped as stale "
        f"{store.stats().dropped_stale}",
        flush=True,
    )
    return before, after, trainer.version, staleness_max


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--steps", type=int, default=10**9, help="stop after this many updates")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--staleness", "-S", type=int, default=3)
    args = ap.parse_args()
    asyncio.run(main(args.minutes, args.seed, args.staleness, args.steps))
