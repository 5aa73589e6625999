"""The worker's follower of the published weights (rollout/follower.py) on the in-memory broadcast: it
bootstraps over HTTP, installs and acks what the broadcast delivers, fetches a missed link from the
version it holds, refuses a chain that fails verification (the old weights keep serving), re-joins
under a new identity, drops its weights on a rollback, and catches up over HTTP when the broadcast is
silent."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from echo2.broadcast.factory import get_strategy, open_publisher
from echo2.config import EmbeddedModelConfig, SnapshotConfig
from echo2.models.embedded import build_model, build_tokenizer
from echo2.rollout.follower import WeightFollower
from echo2.rollout.worker import WorkerCounters
from echo2.runtime.snapshots import Snapshots
from echo2.weights.chain import decode_chain, encode_chain
from echo2.weights.delta import sampler_copy, weights_digest
from echo2.weights.manifest import new_signing_key

TINY = EmbeddedModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1)


class Learner:
    """The learner's side as the follower sees it: the chain over HTTP (``LearnerClient``'s
    ``snapshot_chain``, through the real body codec), with a switch that serves tampered bytes."""

    credential = "credential"
    pin = None

    def __init__(self, snaps: Snapshots) -> None:
        self.snaps = snaps
        self.asked: list[int] = []  # the ``have`` of every chain fetched
        self.tamper = False

    async def snapshot_chain(
        self, have: int, base_held: bool = False
    ) -> list[tuple[dict[str, Any], memoryview]]:
        self.asked.append(have)
        links = [
            (link.manifest, b"junk" if self.tamper else link.blob)
            for link in self.snaps.chain_from(have, base_held)
        ]
        return decode_chain(encode_chain(links))


class Engine:
    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}

    def install(self, weights: dict[str, torch.Tensor]) -> None:
        self.loaded = dict(weights)


async def until(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def nudge(model: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-5)


def test_the_follower_keeps_the_weights_current_from_the_broadcast_and_over_http() -> None:
    asyncio.run(_follow())


async def _follow() -> None:
    key = new_signing_key()
    hub = open_publisher("memory", key, get_strategy("star-limited"), 4096)
    snaps = Snapshots(hub, 1.1, SnapshotConfig(anchor_every=10))
    model = build_model(TINY, build_tokenizer(), seed=0)
    learner, engine, counters = Learner(snaps), Engine(), WorkerCounters()
    offered: list[int] = []
    stop = False
    follower = WeightFollower(
        learner,
        engine,
        key.verifier(),
        hub,
        "w0",
        counters,
        finished=lambda: stop,
        catchup_s=0.2,
        on_install=lambda version, weights: offered.append(version),
    )

    async def publish(v: int) -> None:
        if v:
            nudge(model, v)
        await snaps.publish_model(v, model)

    await publish(0)
    await follower.fetch()  # bootstrap: the anchor over HTTP
    assert (follower.installed, counters.installs, counters.http_installs) == (0, 1, 1)
    with follower.serving() as version:  # what a generation is tagged with
        assert version == 0

    await publish(1)
    await publish(2)  # both before it joins: the broadcast hands it v2, a patch of v1 it never had
    following = asyncio.ensure_future(follower.follow())
    await until(lambda: follower.installed == 2)
    assert learner.asked == [-1, 0] and counters.http_installs == 2  # the chain from the version held

    await publish(3)  # over the broadcast, acked to it
    await until(lambda: follower.installed == 3)
    await until(lambda: "w0" in hub.stats(3).install_s)
    assert (counters.installs, counters.http_installs) == (3, 2)
    assert weights_digest(engine.loaded) == weights_digest(sampler_copy(model, "bfloat16"))

    await follower.rejoin("w1")  # a new identity: the receiver leaves and joins again under it
    await until(lambda: hub.members() == ["w1"])
    stop = True
    await follower.close()
    await following  # the follower leaves the broadcast for good once the worker is finished

    await follower.forget()  # the learner was rolled back: everything again, from the anchor
    assert learner.asked[-1] == -1 and follower.installed == 3 and counters.http_installs == 3

    await publish(4)  # nobody delivers it now
    learner.tamper = True  # a chain whose bytes fail their manifests: refused, v3 keeps serving
    await follower.fetch()
    assert (follower.installed, counters.install_failures) == (3, 1)
    learner.tamper = False
    # catch_up waits catchup_s for the broadcast, then fetches
    await follower.catch_up(4)
    assert follower.installed == 4 and learner.asked[-1] == 3 and counters.http_installs == 4
    assert offered == [0, 2, 3, 3, 4]
    assert counters.install_cpu_s > 0 and counters.install_s >= counters.last_install_s > 0
    await snaps.close()


def test_a_snapshot_delivered_during_a_generation_is_installed_after_it_without_http() -> None:
    asyncio.run(_busy())


async def _busy() -> None:
    """A delivery while a generation holds the weights is not a gap: the generator installs it when the
    generation ends and acks it, and nothing is fetched over HTTP. A real gap found then is fetched."""
    key = new_signing_key()
    hub = open_publisher("memory", key, get_strategy("star-limited"), 4096)
    snaps = Snapshots(hub, 1.1, SnapshotConfig(anchor_every=10))
    model = build_model(TINY, build_tokenizer(), seed=0)
    learner, engine, counters = Learner(snaps), Engine(), WorkerCounters()
    stop = False
    follower = WeightFollower(
        learner, engine, key.verifier(), hub, "w0", counters, finished=lambda: stop, catchup_s=0.2
    )
    await snaps.publish_model(0, model)
    following = asyncio.ensure_future(follower.follow())
    await until(lambda: follower.installed == 0)  # the hub hands a joining member the newest
    http0, asked0 = counters.http_installs, list(learner.asked)

    held = threading.Event()
    release = threading.Event()

    def generate() -> None:  # a generation: holds the weights until released, then installs
        with follower.serving():
            held.set()
            release.wait(20)
        follower.install_pending()

    generation = asyncio.ensure_future(asyncio.to_thread(generate))
    await asyncio.to_thread(held.wait, 20)
    nudge(model, 1)
    await snaps.publish_model(1, model)
    await until(lambda: 1 in follower._received)
    await asyncio.sleep(0.2)  # time for a fetch, were it to start
    assert follower.installed == 0 and learner.asked == asked0  # deferred, not fetched
    release.set()
    await generation
    assert follower.installed == 1 and counters.http_installs == http0 and learner.asked == asked0
    await until(lambda: "w0" in hub.stats(1).install_s)  # acked on the broadcast

    # a real gap during a generation: v2 is never delivered, v3 (a patch of v2) is
    held.clear()
    release.clear()
    generation = asyncio.ensure_future(asyncio.to_thread(generate))
    await asyncio.to_thread(held.wait, 20)
    nudge(model, 2)
    await snaps.publish_model(2, model)
    await until(lambda: 2 in follower._received)
    follower._received.pop(2)  # missed
    nudge(model, 3)
    await snaps.publish_model(3, model)
    await until(lambda: 3 in follower._received)
    release.set()
    await generation
    await until(lambda: follower.installed == 3)
    assert learner.asked == [*asked0, 1] and counters.http_installs == http0 + 1  # from the version held
    stop = True
    await follower.close()
    await following
    await snaps.close()


def test_after_a_restart_the_new_run_epoch_replaces_the_old_weights_whatever_their_numbers() -> None:
    asyncio.run(_restart())


async def _restart() -> None:
    """A worker holds v3 of run epoch 1; the learner restarts (epoch 2) from an earlier checkpoint and
    publishes v1 and v2 with other weights. The follower installs epoch 2's v2 (a lower number than the
    v3 it held), fetching epoch 2's whole chain (epoch 1's v3 is no base for its patches), and never
    goes back to an epoch-1 version delivered late."""
    key = new_signing_key()
    model = build_model(TINY, build_tokenizer(), seed=0)
    old = Snapshots(open_publisher("memory", key, get_strategy("star-limited"), 4096), 1.1, epoch=1)
    for v in range(4):
        nudge(model, v + 1)
        await old.publish_model(v, model)
    learner, counters, stop = Learner(old), WorkerCounters(), [False]
    follower = WeightFollower(
        learner, Engine(), key.verifier(), None, "w0", counters, finished=lambda: stop[0], catchup_s=0.2
    )  # type: ignore[arg-type]
    await follower.fetch()
    assert (follower.epoch, follower.installed) == (1, 3)

    hub = open_publisher("memory", key, get_strategy("star-limited"), 4096)
    new = Snapshots(hub, 1.1, epoch=2)  # the restarted learner
    nudge(model, 99)
    await new.publish_model(1, model)
    learner.snaps, follower.broadcast = new, hub
    following = asyncio.ensure_future(follower.follow())
    await until(lambda: hub.members() == ["w0"])
    nudge(model, 100)
    await new.publish_model(2, model)  # delivered: a patch of epoch 2's v1, which the follower lacks
    await until(lambda: (follower.epoch, follower.installed) == (2, 2))
    assert learner.asked[-1] == -1  # the whole chain of the new epoch, not "the links after v1"
    assert weights_digest(follower.engine.loaded) == weights_digest(sampler_copy(model, "bfloat16"))
    late = old.chain[-1]  # an epoch-1 version delivered after the restart: ignored
    from echo2.broadcast.api import InstalledSnapshot
    from echo2.weights.manifest import Manifest

    await follower._delivered(InstalledSnapshot(Manifest.from_dict(late.manifest), memoryview(late.blob)))
    follower.install_pending()
    assert (follower.epoch, follower.installed) == (2, 2)
    stop[0] = True
    await follower.close()
    await following
    await old.close()
    await new.close()


def test_catching_up_waits_for_a_transfer_that_progresses_before_it_fetches_over_http() -> None:
    """After ``catchup_s`` the follower goes on waiting while the broadcast receives newer weights and
    stores chunks (a restart's anchor from peers); it fetches over HTTP once that transfer stalls for
    ``stall_s``, at once after ``catchup_s`` when the transfer is of weights no newer than those held."""
    from echo2.broadcast.api import Receiving

    class Node:
        def __init__(self, version: int, stalls_after: float) -> None:
            self.version, self.t0, self.stalls_after = version, time.monotonic(), stalls_after

        def receiving(self) -> Receiving:
            age = time.monotonic() - self.t0
            return Receiving(self.version, 0, max(0.0, age - self.stalls_after))

    async def waited(node: Node) -> float:
        follower = WeightFollower(
            Learner(None), Engine(), new_signing_key().verifier(), ("127.0.0.1", 9), "w", WorkerCounters(),
            finished=lambda: False, catchup_s=0.1, stall_s=0.3,
        )  # fmt: skip
        follower.node = node  # type: ignore[assignment]
        fetched: list[float] = []

        async def fetch() -> None:
            fetched.append(time.monotonic())

        follower.fetch = fetch  # type: ignore[method-assign]
        t0 = node.t0 = time.monotonic()
        await follower.catch_up(3)
        return fetched[0] - t0

    progressing = asyncio.run(waited(Node(version=3, stalls_after=0.6)))
    assert 0.6 + 0.3 <= progressing < 3.0  # waited while chunks came, then stall_s more
    held_already = asyncio.run(waited(Node(version=-1, stalls_after=60.0)))  # nothing newer than held
    assert 0.1 <= held_already < 0.6
