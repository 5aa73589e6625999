"""How the learner node's serving parts are wired: one function, used by the learner, the tests and
the worker benchmark, so the parts are always assembled the same way.

The parts, one owner each: the worker registry (``members.py``: membership, credentials, installed
versions; each member's one record, of which the others keep their parts through narrow views: its
lease standing, its rate window, its checks, its relay conduct; a quarantine is its one call,
``revoke``), the pool (``pool.py``: cost-aware activation, $/h), the lease broker (``leases.py``:
prompts, in-flight cap, admissible-version gate), the intake (``intake.py``: validation + store
admission), the snapshot publisher (``snapshots.py``) and the HTTP routes (``routes.py``) that adapt
the wire protocol to them. They never reach into each other: each gets the callables it needs (the
learner's version, the newest published version, whether a worker is active, the clock)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from echo2.broadcast.api import SnapshotPublisher
from echo2.check.checker import keeper
from echo2.check.checker import waiting as check_waiting
from echo2.check.rerun import GenerationCheck
from echo2.config import Config
from echo2.data.store import TrajectoryStore
from echo2.observe.rundir import PUBLISHED_DIR
from echo2.perimeter import Limits
from echo2.pins import package_pin
from echo2.protocol import LoraSettings, PackagePin, WorkerSettings
from echo2.runtime.intake import Intake, submission_limits
from echo2.runtime.leases import LeaseBroker
from echo2.runtime.members import Cadence, WorkerRegistry
from echo2.runtime.pool import Pool
from echo2.runtime.prompts import PromptSource
from echo2.runtime.routes import Identity, Routes
from echo2.runtime.snapshots import Snapshots
from echo2.runtime.standing import Standings
from echo2.tasks.base import Task
from echo2.tasks.registry import worker_packages
from echo2.tasks.verify import Verifier


@dataclass
class NodeParts:
    registry: WorkerRegistry
    pool: Pool
    broker: LeaseBroker
    intake: Intake
    snapshots: Snapshots
    routes: Routes

    def housekeeping(self) -> None:
        """About once a second: expired leases go back (each a strike for its worker, and generating
        time that delivered nothing for the controller), then one controller round; the registry's
        changes written whole to ``workers.json`` (``WorkerRegistry.flush_due``)."""
        for worker_id, held_s in self.broker.expire():
            self.pool.unreturned(worker_id, held_s)
        self.pool.tick()
        self.registry.flush_due()

    def metrics(self) -> dict[str, float]:
        """``leases/`` metrics (what the lease standing ledger counted), ``data/`` (the epoch, the
        prompts leased again or given up) and ``perimeter/api/`` (what strangers held of the API port)."""
        return {
            **self.broker.standings.metrics(),
            **self.broker.prompts.metrics(),
            **self.routes.perimeter_metrics(),
        }


def worker_settings(
    cfg: Config, eos_ids: Sequence[int] = (), lora: LoraSettings | None = None
) -> WorkerSettings:
    """The part of the run's config a worker is sent at registration (never the whole tree), with the
    tokens that end a completion (the learner's policy's: engine, check and learner agree) and, in a
    LoRA run, the base its adapters apply to."""
    rt = cfg.runtime
    return WorkerSettings(
        seed=cfg.seed,
        task=cfg.task,
        sampling=cfg.sampling,
        group_size=cfg.batch.group_size,
        lease_prompts=rt.lease_prompts,
        chat_template=cfg.model.chat_template,
        system_prompt=cfg.model.system_prompt,
        chat_template_kwargs=cfg.model.chat_template_kwargs,
        eos_ids=list(eos_ids),
        threads=cfg.train.resolved_threads(embedded=cfg.model.path is None),
        heartbeat_s=rt.heartbeat_s,
        max_context=cfg.context_tokens(),
        lora=lora,
        packages=[PackagePin(**package_pin(name)) for name in worker_packages(cfg.task)],
    )


def assemble(
    cfg: Config,
    registry: WorkerRegistry,
    store: TrajectoryStore,
    task: Task,
    publisher: SnapshotPublisher,
    identity: Identity,
    vocab_size: int,
    version: Callable[[], int],
    clock: Callable[[], float],
    verifier: Verifier | None = None,
    generation: GenerationCheck | None = None,
    data_ready: Callable[[], None] = lambda: None,
    epoch: int = 0,
    perimeter: Limits | None = None,
    frozen: dict[str, Any] | None = None,
) -> NodeParts:
    """The serving parts of a learner node over ``store`` and ``registry`` (which the broadcast
    ``publisher`` consults too, so it is made first), publishing through ``publisher``; workers an
    earlier learner process registered in the registry's run directory are restored and offered to the
    pool. ``data_ready`` is called on every admitted submission (the learner loop's wake-up). ``epoch``
    is this learner process's run epoch (``observe.rundir.next_epoch``): its manifests and leases carry
    it, and leases of another refuse. ``perimeter``: the API port's limits before anyone is known (None:
    the defaults cut to the descriptor limit). ``frozen``: a LoRA run's base as workers hold it
    (``models/lora.PublishedBase.tensors``), the first link of the chain. Each part gets its
    collaborators when it is made; none is patched afterwards."""
    lora = identity.settings.lora  # a LoRA run: every publication pins the base its adapter applies to
    snapshots = Snapshots(
        publisher, cfg.staleness.gamma, cfg.snapshot, keeper(generation, cfg.staleness.S),
        spill_dir=registry.path.parent / PUBLISHED_DIR, epoch=epoch,
        model_base=lora.base_digest if lora else "", frozen=frozen,
    )  # fmt: skip
    pool, broker = _leasing(cfg, registry, store, task, snapshots, version, clock, epoch, generation)
    registry.watch(_on_quarantine(registry, pool, broker))  # a quarantine is one call: registry.revoke
    limits = submission_limits(cfg, task, vocab_size)
    intake = Intake(
        store=store,
        limits=limits,
        version=version,
        published=lambda: snapshots.version,
        clock=clock,
        verifier=verifier,
        generation=generation,
        is_published=lambda v: v in snapshots.published,
        returned=broker.returned,
        refused=broker.refused,
        struck=broker.struck,
        quarantine=lambda rec, exc: registry.revoke(rec.worker_id, f"{exc.reason}: {exc.detail}"),
        quarantined=lambda: sum(1 for r in registry if r.quarantined),  # persisted: restarts keep it
        data_ready=data_ready,
        epoch=epoch,
    )
    routes = Routes(
        registry, pool, broker, intake, snapshots, store, identity, cfg.request_cap_bytes(), cfg.security,
        perimeter=perimeter,
    )  # fmt: skip
    return NodeParts(registry, pool, broker, intake, snapshots, routes)


def _leasing(
    cfg: Config,
    registry: WorkerRegistry,
    store: TrajectoryStore,
    task: Task,
    snapshots: Snapshots,
    version: Callable[[], int],
    clock: Callable[[], float],
    epoch: int,
    generation: GenerationCheck | None = None,
) -> tuple[Pool, LeaseBroker]:
    """The pool (with the workers an earlier learner process registered, restored) and the lease
    broker, sharing one ledger of lease standings: a heartbeat keeps a worker alive in the pool only
    while it holds an open lease or asked for one within the heartbeat timeout. The pool is sized
    against what the generation check can re-run at its floor."""
    standings = Standings(cfg.security.max_unreturned, cfg.lease_ttl(), book=registry.standing)
    rt = cfg.runtime
    cadence = Cadence(rt.heartbeat_s, rt.heartbeats_per_s, registry.slots_held)
    timeout = cfg.controller.heartbeat_timeout_s

    def working(worker_id: str) -> bool:  # asked within the timeout, stretched as the fleet's cadence is
        asked = standings.asked_within(worker_id, clock(), cadence.silence(timeout))
        return asked or store.open_leases(worker_id) > 0

    pool = Pool(
        registry, cfg.controller, cfg.staleness, cfg.batch.rollouts, rt.learner_usd_per_hour,
        registry.path.parent, clock, working,
        check=(lambda: (generation.capacity()[0], generation.cfg.floor())) if generation else None,
        cadence=cadence,
    )  # fmt: skip
    for rec in registry.load():
        pool.enroll(rec)

    def waiting(worker_id: str) -> bool:  # a new identity whose submission waits for its check
        rec = registry.get(worker_id)
        return rec is not None and check_waiting(rec, cfg.security)

    broker = LeaseBroker(
        store=store, prompts=PromptSource(task, cfg.seed), batch=cfg.batch, staleness=cfg.staleness,
        runtime=rt, version=version, is_active=pool.is_active, clock=clock, security=cfg.security,
        standings=standings, published=lambda: snapshots.published, epoch=epoch, proving=waiting,
        cadence=cadence,
    )  # fmt: skip
    return pool, broker


def _on_quarantine(registry: WorkerRegistry, pool: Pool, broker: LeaseBroker) -> Callable[[str], None]:
    """What a quarantine does beyond the record (``WorkerRegistry.revoke``, the one call: evidence of
    lying, from the intake or the learner loop): the pool drops the worker for good, what it left
    untrained is purged and its leases' prompts go out again (its buffered groups' come via
    take_redo); the broadcast publisher, watching too, closes its connections. A worker retired for
    silence keeps what it delivered."""

    def on_untrusted(worker_id: str) -> None:
        rec = registry.get(worker_id)
        if rec is None or not rec.quarantined:  # retired: not a liar
            return
        pool.quarantine(worker_id, rec.quarantined.partition(":")[0])
        _, prompts = broker.store.purge_worker(worker_id)
        broker.prompts.again(prompts)

    return on_untrusted
