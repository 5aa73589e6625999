"""A worker's follower of the published weights: the broadcast receiver and the HTTP catch-up behind
one object, with its own locks.

The worker asks it for three things between generations, and for nothing about how snapshots travel:

- ``install_pending()`` (any thread): install what the broadcast delivered, as far as the chain
  reaches, and ack it to the broadcast plane;
- ``with serving() as version:`` hold the weights still for one generation (an install waits for it,
  and the broadcast installs at once only while no generation holds them);
- ``await catch_up(min_version)``: wait for the broadcast to deliver ``min_version`` (briefly, or for as
  long as a transfer of newer weights makes progress), else fetch the chain over HTTP
  (``GET /v1/snapshot?have=V``; ``fetch()`` does that at once).

In the background ``follow()`` keeps a broadcast receiver joined (re-joining after a learner restart
or a new identity, :meth:`WeightFollower.rejoin`), collects what it delivers and, when the broadcast
handed it a version its weights cannot reach (it missed a link), fetches the chain from what it holds.
``forget()`` drops the weights held (an earlier learner process's: another run epoch) and waits for the
learner's like ``catch_up``: after a restart the publisher attaches each re-joining member to the new
anchor under members that hold or receive it (``broadcast/publisher.py``, "Latecomers"), so the fleet
does not pull the model N times through the learner's uplink. Versions are ordered within their run
epoch (the signed manifest's ``lineage.epoch``), epochs first: a delivered version of an earlier epoch is
ignored, one of a newer epoch replaces everything held.

Every install goes through :class:`echo2.weights.chain.WeightChain`: staged on a copy, checked against
the digest the learner signed, loaded into the engine between two generations, and only then swapped
in; a link that does not fit leaves the old version serving (``install_failures``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from echo2.errors import CheckpointError, Echo2Error
from echo2.rollout.client import Refused
from echo2.weights.chain import Blob, ChainError, WeightChain, verified_links
from echo2.weights.delta import DeltaError
from echo2.weights.manifest import Manifest, ManifestError, ManifestKey

if TYPE_CHECKING:
    import torch

    from echo2.broadcast.api import InstalledSnapshot, SnapshotReceiver
    from echo2.broadcast.factory import PublisherAddress
    from echo2.models.lora import BaseSlot
    from echo2.rollout.engines.base import Engine

log = logging.getLogger(__name__)


class Learner(Protocol):
    """What the follower needs of the learner's API (``rollout.client.LearnerClient``)."""

    credential: str | None  # this worker's credential, presented when it joins the broadcast
    pin: str | None  # the learner certificate's fingerprint (None: plain TCP), pinned there too

    async def snapshot_chain(
        self, have: int, base_held: bool = False
    ) -> list[tuple[dict[str, Any], memoryview]]:
        """The signed links from ``have`` to the newest, unverified (``GET /v1/snapshot``), in a LoRA run
        led by the link that carries the base unless ``base_held``."""
        ...


class InstallCounters(Protocol):
    """What the follower counts, in the worker's counters (its exit report)."""

    installs: int  # snapshots installed (any path)
    http_installs: int  # of which fetched over HTTP (bootstrap, catch-up, a gap in the chain)
    install_failures: int  # staged versions refused (digest, base, malformed): the old one kept serving
    install_s: float  # seconds building (decode / patch / digest) and loading installed versions
    last_install_s: float  # of which the last install (reported in heartbeats)
    install_cpu_s: float  # CPU seconds the installing thread spent on them (install_s is wall time)


class WeightFollower:
    """The weights a worker serves, kept current from the broadcast plane and, where it falls short,
    over HTTP. Made once the engine exists (``RolloutWorker.setup``), on the running event loop."""

    def __init__(
        self,
        client: Learner,
        engine: Engine,
        key: ManifestKey,
        broadcast: PublisherAddress,
        member: str,
        counters: InstallCounters,
        *,
        finished: Callable[[], bool],
        host: str = "127.0.0.1",
        advertise_host: str | None = None,
        port: int = 0,
        advertise_port: int | None = None,
        reconnect_s: float = 120.0,
        catchup_s: float = 3.0,
        stall_s: float = 30.0,
        on_install: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
        model_base: str = "",
        base: BaseSlot | None = None,
    ) -> None:
        self.client = client  # the HTTP catch-up, and the credential and pin the broadcast join presents
        self.engine = engine
        self.key = key  # the learner's manifest verification key
        self.broadcast = broadcast  # where the receiver joins (the learner's host and port, or a hub)
        self.member = member  # the worker id it joins under
        self.counters = counters
        self.finished = finished  # the worker is stopping: stop re-joining and waiting
        self.host, self.advertise_host = host, advertise_host  # where its chunk server binds, what peers dial
        self.port, self.advertise_port = port, advertise_port  # the same for ports (0: any free one)
        self.reconnect_s = reconnect_s  # give up a join after this long (and try again)
        self.catchup_s = catchup_s  # wait this long for the broadcast before fetching over HTTP
        self.stall_s = stall_s  # ... and beyond it while a transfer stores a chunk at least this often
        self.on_install = on_install  # told each installed version's weights (a self-play pool)
        self.model_base = model_base  # a LoRA run's: digest of the base held; every manifest must state it
        self.base = base  # ... and where its engines find the base (filled by the chain's first link)
        self.chain = WeightChain()  # the published weights being served, and staged installs
        self.node: SnapshotReceiver | None = None  # the broadcast receiver while joined
        self._received: dict[int, InstalledSnapshot] = {}  # delivered, not yet installed
        self._stage_lock = threading.Lock()  # one staging at a time (it reads and then swaps the weights)
        self._engine_lock = threading.Lock()  # held while generating: weights change only between them
        self._loop = asyncio.get_running_loop()  # where acks of installs made in threads are sent from
        self._gap: asyncio.Future[None] | None = None  # the HTTP fetch of a missed link, while running
        self._seen_epoch = 0  # the newest run epoch a delivered manifest carried

    @property
    def installed(self) -> int:
        """The version served (-1 before the first install)."""
        return self.chain.version

    @property
    def epoch(self) -> int:
        """The run epoch of the weights served: a version number names weights only within it."""
        return self.chain.epoch

    def _ahead(self, manifest: Manifest) -> bool:
        """Whether ``manifest`` names weights newer than those served (epoch first, then version)."""
        return (manifest.lineage.epoch, manifest.version) > (self.epoch, self.installed)

    # ---- between generations -----------------------------------------------------------------------
    @contextmanager
    def serving(self) -> Iterator[int]:
        """Hold the weights still for one generation; yields the version that generates it."""
        with self._engine_lock:
            yield self.installed

    def install_pending(self) -> None:
        """Install what the broadcast delivered, as far as the chain reaches (any thread), and ack it; if
        it delivered a version the chain cannot reach (a link was missed), fetch the chain over HTTP."""
        links = [(s.manifest, s.data) for s in list(self._received.values()) if self._ahead(s.manifest)]
        if links and self._install(links) and (node := self.node) is not None:
            v = self.installed
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(node.report_installed(v)))
        if any(self._ahead(s.manifest) for s in list(self._received.values())):
            self._loop.call_soon_threadsafe(self._fetch_gap)

    def _fetch_gap(self) -> None:
        """One HTTP fetch of the chain at a time for a gap (on the loop; install_pending may run often)."""
        if self._gap is None or self._gap.done():
            self._gap = asyncio.ensure_future(self.fetch())
            self._gap.add_done_callback(_report_failure)

    async def catch_up(self, min_version: int) -> None:
        """Wait for the broadcast to deliver ``min_version``: ``catchup_s``, and beyond that for as long as
        the broadcast is receiving newer weights than those held and stores a chunk at least every
        ``stall_s`` (an anchor from peers costs the learner nothing; the same over HTTP costs it the
        whole model); then fetch what is still missing over HTTP."""
        deadline = time.monotonic() + self.catchup_s
        while not self.finished():
            await asyncio.to_thread(self.install_pending)
            if self.installed >= min_version:
                return
            if time.monotonic() >= deadline and not self._receiving():
                break
            await asyncio.sleep(0.02 if time.monotonic() < deadline else 0.25)
        await self.fetch()

    def _receiving(self) -> bool:
        """Whether the broadcast is receiving weights newer than those held, and storing chunks."""
        got = self.node.receiving() if self.node is not None else None
        if got is None or got.idle_s > self.stall_s:
            return False
        return (got.epoch, got.version) > (self.epoch, self.installed)

    async def fetch(self) -> None:
        """Fetch the links from the installed version to the newest over HTTP (the patches after it, or
        the latest anchor and its patches), verify each against its signed manifest, and install."""
        # weights of an earlier run epoch are no base for this one's patches: the whole chain then
        have = self.installed if self.epoch >= self._seen_epoch else -1
        try:
            held = self.base is None or self.base.held is not None
            links = verified_links(await self.client.snapshot_chain(have, held), self.key)
        except (ChainError, ManifestError) as exc:
            self.counters.install_failures += 1
            log.warning("snapshot chain over HTTP refused: %s", exc)
            return
        except Refused as exc:
            if exc.reply.error != "over_budget":  # this identity pulled the version 3x already
                raise
            self.counters.install_failures += 1
            log.warning("snapshot chain over HTTP: %s", exc)
            return
        if not links:
            return
        if await asyncio.to_thread(self._install, links, True):
            log.info("installed v%d over HTTP (%d links)", self.installed, len(links))

    async def forget(self) -> None:
        """The weights held are of an earlier learner process (another run epoch, or a learner rolled
        back to a checkpoint below them): their version number names other weights now. Drop them and
        install the learner's latest anchor and chain: from the broadcast when it brings them
        (:meth:`catch_up`), else over HTTP."""
        log.warning(
            "the weights held (v%d of run epoch %d) are not the learner's now; fetching its weights",
            self.installed,
            self.epoch,
        )
        with self._stage_lock:
            self.chain = WeightChain()
            self._received.clear()
        await self.catch_up(0)  # the new learner's anchor, from peers where the broadcast brings it

    def _install(self, links: Sequence[tuple[Manifest, Blob]], over_http: bool = False) -> bool:
        """Stage ``links`` on a copy of the weights, load the result between two generations, swap it
        in (any thread). A link that does not fit leaves the old version serving. The counters move
        before the new version shows (``installed``), so a reader that sees it sees them."""
        with self._stage_lock:
            t0, cpu0 = time.perf_counter(), time.thread_time()
            try:
                for manifest, _ in links:  # a LoRA run's adapters fit one base: the one held
                    if manifest.lineage.model_base != self.model_base:
                        raise CheckpointError(
                            f"v{manifest.version} applies to the base model "
                            f"{manifest.lineage.model_base[:16] or '(none: whole weights)'}, this worker "
                            f"holds {self.model_base[:16] or 'none'}"
                        )
                # adapters before any base (a late joiner's broadcast): a gap the chain over HTTP fills
                if self.base is not None and self.base.held is None and no_base(links):
                    return False
                staged = self.chain.stage(links)
                if staged is None:
                    return False
                with self._engine_lock:
                    if staged.frozen is not None and self.base is not None and self.base.held is None:
                        self.base.fill(staged.frozen)  # the first link: the base (one already held stays)
                        log.info(
                            "LoRA base installed from the chain's first link (%d tensors)", len(staged.frozen)
                        )
                    self.engine.install(staged.tensors)
            except (DeltaError, CheckpointError) as exc:
                self.counters.install_failures += 1
                log.warning("install refused; v%d keeps serving: %s", self.installed, exc)
                return False
            if self.on_install is not None:
                self.on_install(staged.version, staged.tensors)
            self.counters.installs += 1
            self.counters.http_installs += int(over_http)
            self.counters.last_install_s = time.perf_counter() - t0
            self.counters.install_s += self.counters.last_install_s
            self.counters.install_cpu_s += time.thread_time() - cpu0
            self.chain.commit(staged)
            return True

    # ---- the broadcast plane ---------------------------------------------------------------------------
    async def follow(self) -> None:
        """Keep a broadcast receiver joined (re-joining after a learner restart) and collect snapshots."""
        from echo2.broadcast.factory import open_receiver

        while not self.finished():
            node = open_receiver(
                self.broadcast,
                self.member,
                self.key,
                credential=self.client.credential,
                host=self.host,
                advertise_host=self.advertise_host,
                port=self.port,
                advertise_port=self.advertise_port,
                pin=self.client.pin,  # the learner's certificate: the broadcast presents the API's
                held=(self.epoch, self.installed) if self.installed >= 0 else None,
            )
            try:
                await node.start(join_timeout=self.reconnect_s)
            except Echo2Error as exc:
                log.warning("broadcast join failed: %s", exc)
                await asyncio.sleep(1.0)
                continue
            self.node = node
            async for snap in node.snapshots():
                await self._delivered(snap)
            self.node = None
            if not self.finished():
                log.info("broadcast connection lost; re-joining")
                await asyncio.sleep(1.0)

    async def _delivered(self, snap: InstalledSnapshot) -> None:
        """Keep ``snap`` (on this loop only: installs run in threads and just read what is kept) and
        install it now if no generation holds the weights; else the generator installs it when the
        generation ends (``install_pending``: a snapshot that arrives mid-generation is not a gap, and
        is not fetched again over HTTP). Either install fetches the chain over HTTP if the weights held
        cannot reach what was delivered."""
        epoch, newest = snap.manifest.lineage.epoch, max(self.epoch, self._seen_epoch)
        if epoch < newest:  # a version of an earlier learner process: never
            log.info("v%d of run epoch %d ignored: epoch %d is newer", snap.manifest.version, epoch, newest)
            return
        self._seen_epoch = epoch
        # only this epoch's versions; nothing already installed, and nothing older than an anchor
        floor = snap.manifest.version if snap.manifest.lineage.anchor else 0
        if epoch == self.epoch and not snap.manifest.lineage.anchor:
            floor = self.installed + 1
        self._received = {
            v: s for v, s in self._received.items() if s.manifest.lineage.epoch == epoch and v >= floor
        }
        self._received[snap.manifest.version] = snap
        if not self._engine_lock.locked():  # idle: switch now, else the generator switches next
            await asyncio.to_thread(self.install_pending)
        if self._gap is not None and not self._gap.done():  # a missed link: fetched before the next
            await asyncio.wait([self._gap])

    async def rejoin(self, member: str) -> None:
        """Join again under ``member`` (a new identity after the learner refused the old credential)."""
        self.member = member
        if self.node is not None:
            await self.node.close()

    async def close(self) -> None:
        """Leave the broadcast plane."""
        if self.node is not None:
            await self.node.close()


def _report_failure(task: asyncio.Future[None]) -> None:
    """A gap's fetch that failed is logged (the next delivery or catch-up tries again)."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("fetching a missed link over HTTP failed: %s", exc)


def no_base(links: Sequence[tuple[Manifest, Blob]]) -> bool:
    """Whether none of ``links`` carries a LoRA run's base (a ``base`` anchor)."""
    return all(m.kind != "base" for m, _ in links)
