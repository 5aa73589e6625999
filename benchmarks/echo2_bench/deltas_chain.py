"""Anchors and patches over the real TCP broadcast plane, checked bit for bit (in one process).

The learner's :class:`~echo2.runtime.snapshots.Snapshots` publishes a tiny model through a
``TcpPublisher`` (Tree-Pipelined, small chunks so a patch spans many and is relayed); each worker is a
``TcpWorkerNode`` feeding a :class:`~echo2.weights.chain.WeightChain`, exactly the worker's staging
path, and fetches the chain from the learner (through the HTTP body codec and the same verification
as ``echo2 worker``) whenever it finds a gap. The run contains every case a worker meets:

- anchors (every ``anchor_every``, and one forced by a large update) and chains of patches;
- a slow worker that misses versions (it sleeps after each install; the node hands it only the newest);
- a late joiner (joins mid-run, holds nothing: the anchor and the patches since);
- a relay killed while it holds half of a patch (its node closes; its children repair from the learner);
- a relay that corrupts one chunk in every five it serves (caught by the chunk digests, refetched).

Every install is compared with the learner's own digest of that version: ``bit_identical`` must equal
``installs``. In a LoRA run (``lora``) the first publication carries the frozen base (a ``base`` link):
the workers joined before it get it through the relays, the late joiner in its HTTP chain, and each
one's base is compared with the learner's (``base_identical``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from echo2.broadcast.api import OpenLedger
from echo2.broadcast.factory import get_strategy
from echo2.broadcast.publisher import TcpPublisher
from echo2.broadcast.receiver import TcpWorkerNode
from echo2.config import EmbeddedModelConfig, LoRAConfig, SnapshotConfig
from echo2.runtime.snapshots import Snapshots
from echo2.weights.chain import WeightChain, decode_chain, encode_chain, verified_links
from echo2.weights.delta import sampler_copy, weights_digest
from echo2.weights.manifest import new_signing_key
from echo2_bench.faults import Faults, FaultTap

SHAPE = EmbeddedModelConfig(hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4, num_kv_heads=2)


class _KillAtHalfOfAPatch:
    """A ChunkTap that closes its node once it holds half of the chunks of the first patch it receives
    after ``armed_from`` (the relay dies mid-patch, its sockets with it)."""

    def __init__(self, armed_from: int) -> None:
        self.node: TcpWorkerNode | None = None
        self.armed_from = armed_from
        self.killed_at: int | None = None
        self.closing: asyncio.Future[None] | None = None

    def on_received(self, index: int, fraction: float) -> None:
        node = self.node
        if node is None or self.killed_at is not None or node._transfer is None:
            return
        m = node._transfer.manifest
        if m.version >= self.armed_from and m.kind == "patch" and fraction >= 0.5 and m.n_chunks >= 4:
            self.killed_at = m.version
            self.closing = asyncio.ensure_future(node.close())

    def on_serve(self, index: int, payload: bytes | memoryview) -> bytes | memoryview:
        return payload


@dataclass
class _Worker:
    name: str
    node: TcpWorkerNode
    chain: WeightChain = field(default_factory=WeightChain)
    slow_s: float = 0.0  # sleep after each install (misses versions)
    installs: int = 0
    bit_identical: int = 0
    http_fetches: int = 0
    installed: list[int] = field(default_factory=list)
    digests: list[tuple[int, str]] = field(default_factory=list)  # (version, digest) of every install
    base: str | None = None  # a LoRA run's: the digest of the base it staged
    base_via: str = ""  # ... and how it came: "broadcast" or "http"


async def chain_over_tcp(
    publications: int = 24,
    anchor_every: int = 8,
    chunk: int = 1024,
    lr: float = 1e-4,
    seed: int = 0,
    lora: bool = False,
) -> dict[str, Any]:
    """``lora``: a LoRA run's publications (the adapter alone, its base pinned in every lineage; only
    the adapter moves between versions)."""
    import torch

    from echo2.models import lora as lora_mod
    from echo2.models.embedded import build_model, build_tokenizer

    key = new_signing_key()
    pub = TcpPublisher(key, get_strategy("tree-pipelined"), chunk_size=chunk, ledger=OpenLedger())
    await pub.start()
    model = build_model(SHAPE, build_tokenizer(), seed)
    model_base, frozen = "", None
    if lora:
        base = lora_mod.PublishedBase.of(model, "bfloat16", 2.0)
        model_base, frozen = base.digest, base.tensors
        lora_mod.attach(model, LoRAConfig(enabled=True, r=4, alpha=8.0))
        with torch.no_grad():  # an adapter that has trained a while (B is zero at init)
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(seed))
    snaps = Snapshots(
        pub, 1.1, SnapshotConfig(anchor_every=anchor_every), model_base=model_base, frozen=frozen
    )
    copy = (
        (lambda dtype: lora_mod.adapter_copy(model, dtype))
        if lora
        else (lambda dtype: sampler_copy(model, dtype))
    )
    published: dict[int, str] = {}  # version -> the learner's weights digest
    kinds: dict[int, str] = {}

    def node(name: str, tap: Any = None) -> TcpWorkerNode:
        return TcpWorkerNode(name, pub.address, key.verifier(), stall_timeout=0.5, tap=tap)

    killer = _KillAtHalfOfAPatch(armed_from=publications // 3)
    workers = [
        _Worker("steady", node("steady")),
        _Worker("relay-killed", node("relay-killed", killer)),
        _Worker("corrupting-relay", node("corrupting-relay", FaultTap(Faults(corrupt_every=5), "c"))),
        _Worker("slow", node("slow"), slow_s=0.35),
    ]
    killer.node = workers[1].node

    async def fetch(w: _Worker) -> list[Any]:
        held = not lora or w.base is not None
        body = encode_chain([(k.manifest, k.blob) for k in snaps.chain_from(w.chain.version, held)])
        w.http_fetches += 1
        return verified_links(decode_chain(body), key.verifier())

    def install(w: _Worker, links: list[Any], via: str = "broadcast") -> None:
        staged = w.chain.stage(links)
        if staged is None:
            return
        if staged.frozen is not None and w.base is None:
            w.base, w.base_via = weights_digest(staged.frozen), via
        w.chain.commit(staged)
        w.installs += 1
        w.installed.append(staged.version)
        # compared once the publications are over: a worker may install a version over HTTP before
        # this loop has written down its digest
        w.digests.append((staged.version, staged.digest))

    async def follow(w: _Worker) -> None:
        received: dict[int, Any] = {}
        async for snap in w.node.snapshots():
            received[snap.manifest.version] = (snap.manifest, snap.data)
            install(w, [link for v, link in received.items() if v > w.chain.version])
            if max(received) > w.chain.version:  # a gap: the chain from the learner
                install(w, await fetch(w), "http")
            received = {v: link for v, link in received.items() if v > w.chain.version}
            await w.node.report_installed(w.chain.version)
            if w.slow_s:
                await asyncio.sleep(w.slow_s)

    tasks: list[asyncio.Task[None]] = []
    try:
        for w in workers:
            await w.node.start()
            tasks.append(asyncio.create_task(follow(w)))
        await pub.wait_members(len(workers), 10)
        g = torch.Generator().manual_seed(seed)
        t0 = time.perf_counter()
        for v in range(publications):
            if v:
                step = 1.0 if v == publications // 2 else lr  # one update big enough to force an anchor
                with torch.no_grad():
                    for p in model.parameters():
                        if p.requires_grad:  # every weight, or a LoRA run's adapter alone
                            p.add_(torch.randn(p.shape, generator=g) * step)
            await snaps.publish_copy(v, copy)
            link = snaps.chain[-1]
            published[v] = link.manifest["lineage"]["weights_digest"]
            kinds[v] = link.manifest["lineage"]["kind"]
            if v == publications * 2 // 3:  # a late joiner: holds nothing, joins mid-chain
                late = _Worker("late-joiner", node("late-joiner"))
                await late.node.start()
                install(late, await fetch(late), "http")  # what `echo2 worker` does at start
                workers.append(late)
                tasks.append(asyncio.create_task(follow(late)))
            await asyncio.sleep(0.12)
        last = publications - 1
        deadline = time.monotonic() + 30
        alive = [w for w in workers if w.name != "relay-killed"]
        while time.monotonic() < deadline and any(w.chain.version < last for w in alive):
            await asyncio.sleep(0.1)
        for (
            w
        ) in alive:  # a worker whose last announcement was superseded asks the learner (as echo2 worker does)
            if w.chain.version < last:
                install(w, await fetch(w), "http")
        wall = time.perf_counter() - t0
        for w in workers:
            w.bit_identical = sum(d == published.get(v) for v, d in w.digests)
    finally:
        for t in tasks:
            t.cancel()
        for w in workers:
            with contextlib.suppress(Exception):
                await w.node.close()
        await pub.close()
    installs = sum(w.installs for w in workers)
    return {
        "lora": lora,
        "model_base_pinned": all(
            link.manifest["lineage"]["model_base"] == model_base for link in snaps.chain
        ),
        "publications": publications,
        "anchors": sum(k != "patch" for k in kinds.values()),
        "base_links": sum(k == "base" for k in kinds.values()),
        "patches": sum(k == "patch" for k in kinds.values()),
        "installs": installs,
        "bit_identical": sum(w.bit_identical for w in workers),
        "relay_killed_at_version": killer.killed_at,
        "corrupt_chunks_detected": sum(w.node.counters.corrupt_detected for w in workers),
        "repaired_chunks": sum(w.node.counters.repaired_chunks for w in workers),
        "wall_s": wall,
        "workers": {
            w.name: {
                "installs": w.installs,
                "bit_identical": w.bit_identical,
                "http_fetches": w.http_fetches,
                "final_version": w.chain.version,
                "base_identical": w.base == model_base if lora else None,
                "base_via": w.base_via,
                "versions_skipped": publications
                - len(set(w.installed))
                - (w.installed[0] if w.installed else 0),
            }
            for w in workers
        },
    }
