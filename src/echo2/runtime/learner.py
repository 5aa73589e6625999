"""The learner node (SPEC §1-§3): ``setup()`` wires the parts, then the one learner loop
(``loop.py``) trains over the node's feed (:class:`NodeFeed`).

The loop waits until the store holds ``P`` admissible GRPO groups (``R = P * G`` trajectories with
``v >= v_t - S``) that workers submitted, makes one update (``v -> v + 1``) and, when
``v mod kappa == 0``, the feed publishes a snapshot. Staleness ``Delta(t) = v_t - min_v(batch)`` is
checked against ``S`` at every step. Every second of the loop that is not an update is bubble, counted
by cause (``observe/bubble.py``).

The parts, one owner each: the worker registry (``members.py``), the pool controller and its costs
(``pool.py``), the lease broker (``leases.py``), the intake of submissions (``intake.py``), the
snapshot publisher (``snapshots.py``) and the HTTP routes (``routes.py``) that adapt the wire protocol
to them. The learner's version has one provider, the trainer; events are stamped by one injected clock.

Durability: the store is SQLite (WAL); a group is marked consumed by step ``t`` before step ``t``
trains on it. A checkpoint at version ``v`` holds weights, optimizer state and ``v``; on restart the
learner reloads it, and every group consumed by a step after ``v`` (whose update was lost) is put
back, so no accepted trajectory is lost and none is trained into the weights twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo2.config import Config
from echo2.errors import ConfigError, Echo2Error
from echo2.models.snapshot import aliasing_model, skeleton_files
from echo2.observe import catalog as m
from echo2.observe.rundir import STATE_FILE, latest_checkpoint, next_epoch, write_atomic
from echo2.resources import RESERVED_FDS, GcClock, raise_descriptor_limit
from echo2.runtime.loop import LearnerLoop, LearnerSummary
from echo2.transport import join_string, run_identity
from echo2.types import Bounds
from echo2.weights.manifest import key_from_text, new_signing_key

if TYPE_CHECKING:
    from echo2.data.store import TrajectoryStore
    from echo2.observe.bubble import BubbleMeter
    from echo2.runtime.node import NodeParts
    from echo2.runtime.status import NodeStatus

__all__ = ["AsyncLearner", "Endpoints", "LearnerSummary", "NodeFeed", "check_reachable"]

log = logging.getLogger(__name__)

WARMUP_STEPS = 3  # steps of T_train measured before the controller gets a target
RETARGET_EVERY = 20  # then re-measure every this many steps (mean of the last ones)
TICK_S = 1.0  # housekeeping period while waiting (lease expiry, controller, the launcher's check)


@dataclass(frozen=True)
class Endpoints:
    """Where workers reach a running learner."""

    url: str  # HTTP API base, e.g. https://127.0.0.1:8765
    broadcast: tuple[str, int]  # snapshot broadcast TCP address
    token: str  # the run's join token
    run_dir: str  # the learner's run directory
    join: str  # what a worker is given: the URL and the pinned certificate (https://h:p#sha256=<hex>)
    dashboard: str | None = None  # the live dashboard's URL (with ?token= when it needs one), if on


def check_reachable(cfg: Config) -> None:
    """A wildcard bind needs an address peers can dial: refuse ``0.0.0.0`` / ``::`` without
    ``runtime.advertise_host`` instead of telling workers to connect to a wildcard."""
    rt = cfg.runtime
    if rt.host in ("0.0.0.0", "::", "") and not rt.advertise_host:
        raise ConfigError(
            f"runtime.host = {rt.host!r} binds every interface, but workers need an address they can "
            "reach: set runtime.advertise_host to this machine's address as the workers see it "
            "(e.g. --set runtime.advertise_host=203.0.113.7)"
        )


class AsyncLearner:
    def __init__(
        self,
        cfg: Config,
        resume: bool = False,
        on_ready: Callable[[Endpoints], None] | None = None,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        on_tick: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        check_reachable(cfg)
        self.cfg = cfg
        self.resume = resume
        self.on_ready = on_ready
        self.on_step = on_step
        self.on_tick = on_tick  # called about once a second (the launcher checks its workers; may raise)
        self.clock = clock  # stamps leases, heartbeats and controller decisions
        self.stop = asyncio.Event()
        self.lora: Any = None  # a LoRA run's frozen base as workers hold it (models/lora.PublishedBase)
        self.gc_clock: GcClock | None = None  # the collector's pauses, from setup on

    async def run(self) -> LearnerSummary:
        """Set up the node, then the learner loop (``loop.py``) over its feed; what setup opened is
        closed in reverse when the loop ends, however it ends."""

        async with contextlib.AsyncExitStack() as self._resources:
            await self.setup()
            watchers = [self.status.record] + ([self.on_step] if self.on_step is not None else [])
            loop = LearnerLoop(self.core, self.store, self._feed(), watchers, self.stop, str(self.ckpt or ""))
            return await loop.run()

    @property
    def version(self) -> int:
        return self.core.version

    # ---- setup ---------------------------------------------------------------------------------------
    async def setup(self) -> None:
        """Load (or resume) the policy and its optimizer, open the store, start the API and the
        broadcast, publish the starting snapshot (the loop then measures the starting accuracy)."""
        from echo2.models.policy import configure_torch

        cfg = self.cfg
        configure_torch(cfg)
        self.run_path = Path(cfg.train.run_dir)
        self.ckpt = latest_checkpoint(self.run_path) if self.resume else None
        if self.resume and self.ckpt is None:
            raise Echo2Error(
                f"--resume: no checkpoint with {STATE_FILE} under {self.run_path / 'checkpoints'}"
            )
        self._load_learning_plane()
        await self._open_data_and_network()
        if self.ckpt is not None:  # resumed: the fleet re-joins the broadcast before the anchor goes out
            await self._gather()
        await self.snapshots.publish_copy(self.version, self.core.weights)
        # what setup built (the model, its libraries, the store, the registry) lives as long as the run:
        # out of every later collection, so a full one traverses only what serving the fleet made since
        gc.freeze()
        self._resources.callback(gc.unfreeze)
        self.gc_clock = GcClock()
        self._resources.callback(self.gc_clock.close)
        if self.on_ready is not None:
            self.on_ready(self.endpoints)

    async def _gather(self) -> None:
        """A resumed run's first announcement waits (``runtime.gather_s`` at most) while the workers the
        registry trusts re-join the broadcast (``snapshots.gather``)."""
        from echo2.runtime.snapshots import gather

        expected = sum(1 for rec in self.registry if rec.trusted)
        if expected and self.cfg.runtime.gather_s > 0:
            t0 = time.monotonic()
            got = await gather(self.snapshots.publisher, expected, self.cfg.runtime.gather_s)
            log.info(
                "%d of %d workers re-joined the broadcast in %.1f s", got, expected, time.monotonic() - t0
            )

    def _load_learning_plane(self) -> None:
        """The learner core (``core.py``): run directory, policy (a checkpoint to resume, else the
        starting checkpoint: the user's or the embedded model's warm start, trained here if it is not
        cached), task, trainer (isolating: a worker's non-finite group is left out, never fatal)."""
        from echo2.runtime.core import LearnerCore

        core = self.core = LearnerCore.load(self.cfg, self.run_path, self.ckpt, isolate=True)
        self._resources.callback(core.run_dir.close)
        self._resources.callback(core.close)  # a sharded learner's other ranks stop after the last checkpoint

    async def _open_data_and_network(self) -> None:
        """The store, the broadcast publisher and the parts that serve workers; then the API."""
        from echo2.runtime.members import WorkerRegistry
        from echo2.runtime.node import assemble

        cfg, rt, policy = self.cfg, self.cfg.runtime, self.core.policy
        limits = _perimeter_limits(cfg)
        self.epoch = next_epoch(self.run_path)  # this process's: its versions and leases are its own
        log.info("learner process of run epoch %d", self.epoch)
        self._open_store()
        key = _persistent_key(self.run_path)
        self.token = rt.join_token or _persistent_token(self.run_path)
        # the API and the broadcast consult it
        sec = cfg.security
        registry = WorkerRegistry(
            self.run_path, self.token, self.clock, sec.max_workers, sec.slot_idle_s, sec.max_identities
        )
        self._tls = run_identity(self.run_path, [rt.advertise_host or rt.host]) if cfg.security.tls else None
        publisher = self._publisher(key, registry, limits)
        broadcast = await publisher.start()
        identity = await self._identity(key, broadcast)
        self.data_ready = asyncio.Event()  # set on every admitted submission: the main loop's wake-up
        parts = assemble(
            cfg,
            registry,
            self.store,
            self.core.task,
            publisher,
            identity,
            int(policy.model.config.vocab_size),
            lambda: self.core.version,
            self.clock,
            *self._checks(),
            data_ready=self.data_ready.set,
            epoch=self.epoch,
            perimeter=limits,
            frozen=self.lora.tensors if self.lora is not None else None,
        )
        if self.ckpt is not None:
            parts.broker.prompts.restore(json.loads((self.ckpt / STATE_FILE).read_text()).get("leases"))
        self.parts = parts
        self.registry, self.pool = parts.registry, parts.pool
        self.broker, self.snapshots = parts.broker, parts.snapshots
        self._resources.push_async_callback(self.snapshots.close)
        self.intake = parts.intake
        self._resources.push_async_callback(self.intake.close)
        await self._serve(parts.routes, broadcast)
        await self._serve_dashboard(parts)

    def _publisher(self, key: Any, registry: Any, limits: Any) -> Any:
        """The broadcast's TCP publisher: its door the registry (``ledger``), its certificate the API's
        (workers pin one fingerprint for both planes), its port behind the perimeter."""
        from echo2.broadcast.factory import get_strategy, open_publisher

        rt = self.cfg.runtime
        return open_publisher(
            "tcp",
            key,
            get_strategy(rt.strategy),
            rt.chunk_kb << 10 if rt.chunk_kb else None,
            host=rt.host,
            port=rt.broadcast_port,
            advertise_host=rt.advertise_host,
            ledger=registry,
            tls=self._tls,
            perimeter=limits,
        )

    async def _identity(self, key: Any, broadcast: tuple[str, int]) -> Any:
        """What a worker is told at registration and served: the run's settings, the manifest key, the
        broadcast address, the model skeleton (a LoRA run's base rides the chain: ``assemble(frozen=)``)."""
        from echo2.runtime.node import worker_settings
        from echo2.runtime.routes import Identity

        policy = self.core.policy
        files = skeleton_files(policy.source, policy.model, policy.tokenizer, self.run_path / "skeleton")
        settings = worker_settings(self.cfg, policy.eos_ids, self._lora_base())
        return Identity(settings, key.verifier().to_text(), broadcast, files)

    def _lora_base(self) -> Any:
        """A LoRA run's frozen base as workers hold it (``models/lora.PublishedBase``: published as the
        first link of the chain, and kept for the generation check) and what they are told of it
        (``LoraSettings``); None otherwise."""
        from echo2.models import lora
        from echo2.protocol import LoraSettings

        model = self.core.policy.model
        if not lora.has_adapter(model):
            return None
        base = self.lora = lora.PublishedBase.of(
            model,
            self.cfg.snapshot.dtype,
            lora.lora_scale(self.cfg.lora),
            lora.merged_dtype(self.cfg.lora.vllm),
        )
        lc = self.cfg.lora
        return LoraSettings(
            scale=base.scale, base_digest=base.digest, dtype=self.cfg.snapshot.dtype, rank=lc.r, vllm=lc.vllm
        )

    def _open_store(self) -> None:
        """The trajectory store, less an earlier process's groups whose checks never ran, with the
        groups past a resumed checkpoint's version put back."""
        from echo2.data.store import TrajectoryStore

        cfg = self.cfg
        self.store = TrajectoryStore(
            self.run_path / "store.sqlite", cfg.staleness.S, cfg.batch.group_size, cfg.grpo.drop_zero_variance
        )
        self._resources.callback(self.store.close)
        unchecked = self.store.drop_held()
        if unchecked:
            log.info("%d trajectories held for a check by an earlier learner process dropped", unchecked)
        if self.ckpt is not None:
            n = self.store.requeue_after(self.version)
            log.info("resuming at version %d from %s; %d groups put back", self.version, self.ckpt, n)

    def _checks(self) -> tuple[Any, Any]:
        """What the learner checks of workers' submissions: every one's prompts, rewards and shape
        (``tasks/verify.py``); and the sampled re-run of generations on a model of its own
        (``check/rerun.py``; None when ``security.check_fraction`` is 0)."""
        from echo2.check.rerun import GenerationCheck

        cfg, policy = self.cfg, self.core.policy
        verifier = self.core.task.verifier(policy.codec, policy.eos_ids, Bounds.of(cfg))
        if cfg.security.check_fraction <= 0:
            return verifier, None

        check_model = aliasing_model(policy.model, cfg.security.engine_precision)  # as the engines compute
        # a LoRA run keeps the published adapters and re-runs base + adapter, expanded as workers do
        expand = self.lora.expand if self.lora is not None else None
        check = GenerationCheck(check_model, cfg.sampling, cfg.security, expand=expand, turns=self.core.turns)
        return verifier, check

    async def _serve(self, routes: Any, broadcast: tuple[str, int]) -> None:
        """Start the API (over TLS with the run's certificate unless ``security.tls`` is off); say where
        it is (``learner.json`` holds no secret: the token has its own file, a fingerprint is public)."""

        rt, tls = self.cfg.runtime, self._tls
        if rt.api_processes:
            port = await self._serve_fronts(routes)
        else:
            runner, port = await routes.serve(rt.host, rt.port, tls.server_context() if tls else None)
            self._resources.push_async_callback(runner.cleanup)
        url = f"{'https' if tls else 'http'}://{rt.advertise_host or rt.host}:{port}"
        join = join_string(url, tls.fingerprint if tls else None)
        self.endpoints = Endpoints(url, broadcast, self.token, str(self.run_path), join)
        public = {
            "url": url,
            "join": join,
            "broadcast": list(broadcast),
            "pid": os.getpid(),
            "epoch": self.epoch,
        }
        write_atomic(self.run_path / "learner.json", json.dumps(public))
        log.info(
            "learner API at %s, broadcast at %s:%d; workers join with %s; join token in %s",
            url,
            *broadcast,
            join,
            self.run_path / "join_token",
        )

    async def _serve_fronts(self, routes: Any) -> int:
        """The API served by ``runtime.api_processes`` fronts (``runtime/front.py``) on the API port, the
        learner answering them on a unix socket in a directory of its own (owner-only, removed at the
        end); the port."""
        import tempfile

        from echo2.runtime.front import Fronts, FrontSpec

        cfg, rt, tls = self.cfg, self.cfg.runtime, self._tls
        where = tempfile.TemporaryDirectory(prefix="echo2-api-")  # mode 0700
        self._resources.callback(where.cleanup)
        path = os.path.join(where.name, "api.sock")
        runner = await routes.serve_internal(path)
        self._resources.push_async_callback(runner.cleanup)
        fronts = Fronts()
        self._resources.push_async_callback(fronts.aclose)  # first out: before the socket closes
        spec = FrontSpec(
            name="front-0",
            host=rt.host,
            port=rt.port,
            upstream=path,
            perimeter=cfg.security.perimeter.model_dump(),
            idle_s=cfg.security.perimeter.idle_s,
            body_timeout_s=cfg.security.body_timeout_s,
            max_request_bytes=routes.max_request_bytes,
            batch_s=rt.front_batch_s,
            parent=os.getpid(),
            cert_pem=tls.cert_pem.decode() if tls else None,
            key_pem=tls.key_pem.decode() if tls else None,
        )
        port: int = await fronts.start(rt.api_processes, spec)
        log.info("the API served by %d front process(es) on port %d", rt.api_processes, port)
        return port

    async def _serve_dashboard(self, parts: Any) -> None:
        """The live dashboard and /metrics (``observe/dashboard.py``), on their own port; a view token
        when bound beyond loopback."""
        from echo2.observe.dashboard import Dashboard, needs_token
        from echo2.runtime.status import NodeStatus

        cfg, rt = self.cfg, self.cfg.runtime
        self.status = NodeStatus(
            parts.registry,
            parts.pool,
            parts.snapshots,
            cfg.staleness.S,
            cfg.staleness.effective_kappa,
            lambda: self.core.version,
            self.clock,
        )
        if not rt.dashboard:
            return
        token = _persistent_view_token(self.run_path) if needs_token(rt.dashboard_host) else None
        runner, port = await Dashboard(self.status, token).serve(rt.dashboard_host, rt.dashboard_port)
        self._resources.push_async_callback(runner.cleanup)
        wildcard = rt.dashboard_host in ("0.0.0.0", "::", "")
        host = (rt.advertise_host or rt.host) if wildcard else rt.dashboard_host
        url = f"http://{host}:{port}/"
        self.endpoints = dataclasses.replace(
            self.endpoints, dashboard=url + (f"?token={token}" if token else "")
        )
        info = json.loads((self.run_path / "learner.json").read_text())
        write_atomic(self.run_path / "learner.json", json.dumps({**info, "dashboard": url}))  # no token
        log.info("dashboard and /metrics at %s%s", url, " (view token in view_token)" if token else "")

    # ---- the node's feed ------------------------------------------------------------------------------
    def _feed(self) -> NodeFeed:
        copy = self.core.weights
        return NodeFeed(
            self.cfg, self.parts, self.store, self.status, copy, self.data_ready, self.on_tick, self.gc_clock
        )


class NodeFeed:
    """The node's :class:`~echo2.runtime.loop.Feed`: the store fills with workers' submissions (the
    intake sets ``data_ready`` on each admitted one); a new version is published every ``kappa`` and
    retargets the pool; each step's record gets the parts' metrics and the pool's cost."""

    def __init__(
        self,
        cfg: Config,
        parts: NodeParts,
        store: TrajectoryStore,
        status: NodeStatus,
        copy: Callable[[str], dict[str, Any]],
        data_ready: asyncio.Event,
        on_tick: Callable[[], None] | None,
        gc_clock: GcClock | None = None,
    ) -> None:
        self.cfg, self.parts, self.store, self.status = cfg, parts, store, status
        self.copy = copy  # the current weights as a publication's sampler copy (LearnerCore.weights)
        self.data_ready, self.on_tick = data_ready, on_tick
        self.gc_clock = gc_clock  # the collector's pauses (learner/gc_pause_s per step)
        self._gc_seen = (0.0, 0)  # its readings at the last step's metrics
        self.usd_total = 0.0
        self._next_tick = 0.0

    def housekeeping(self) -> None:
        """About once a second, busy or not: leases, the controller, the launcher's check."""
        if time.perf_counter() >= self._next_tick:
            self.parts.housekeeping()
            if self.on_tick is not None:
                self.on_tick()
            self._next_tick = time.perf_counter() + TICK_S

    async def refill(self, version: int) -> None:
        """Wait a moment (at most 0.25 s) for the next admitted submission."""
        self.data_ready.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.data_ready.wait(), 0.25)

    def poisoned(self, group_ids: tuple[str, ...]) -> None:
        """Groups whose loss or gradient was not finite: purged (never requeued, not even by --resume)
        and the workers that sent them quarantined (their other buffered groups purged too)."""
        from echo2.data.submission import Rejected

        records = {r.worker_id: r for r in self.parts.registry}
        for worker_id in self.store.purge_groups(group_ids):
            rec = records.get(worker_id)
            if rec is not None and not rec.quarantined:
                why = Rejected("poisoned_update", "a group it sent made the loss or gradient non-finite")
                self.store.record_rejection(why.reason)
                self.parts.intake.quarantine(rec, why)

    def mismatch(self, by_group: dict[str, tuple[float, float]]) -> None:
        """The mismatch KL of each worker that sent fresh groups (the store says whose lease each
        answered), kept on its record: the pool table's and ``/metrics``' per-worker column."""
        from echo2.learner.trainer import mismatch_by

        workers = self.store.workers_of(list(by_group))
        for worker_id, kl in mismatch_by(workers.get, by_group).items():
            self.parts.registry.mismatch(worker_id, kl)

    async def after_update(self, version: int, t_trains: Sequence[float], meter: BubbleMeter) -> None:
        """Publish every kappa versions; the pool's target from the measured T_train (after the warm-up
        steps, then every RETARGET_EVERY)."""
        if version % self.cfg.staleness.effective_kappa == 0:
            with meter.idle("publish"):
                await self.parts.snapshots.publish_copy(version, self.copy, wait=False)
        n = len(t_trains)
        if n == WARMUP_STEPS or (n > WARMUP_STEPS and n % RETARGET_EVERY == 0):
            recent = t_trains[-RETARGET_EVERY:]
            useful = self.store.stats().useful_share()  # < 1 when zero-variance groups are left out
            self.parts.pool.retarget(sum(recent) / len(recent), self.parts.snapshots.t_bcast_s, useful)

    def metrics(self, step_wall_s: float) -> dict[str, float]:
        """The broadcast, pool, intake and lease metrics, and what the step cost."""
        parts = self.parts
        usd_h = parts.pool.usd_per_hour()
        usd_step = usd_h * step_wall_s / 3600
        self.usd_total += usd_step
        clock = self.gc_clock
        gc_s, gc_full = (clock.seconds, clock.full) if clock is not None else (0.0, 0)
        seen, self._gc_seen = self._gc_seen, (gc_s, gc_full)
        return {
            **parts.snapshots.metrics(),
            **parts.pool.metrics(),
            **parts.intake.metrics(),
            **parts.metrics(),
            m.LEARNER_GC_PAUSE_S.key: gc_s - seen[0],
            m.LEARNER_GC_FULL.key: float(gc_full - seen[1]),
            m.COST_USD_PER_STEP.key: usd_step,
            m.COST_USD_TOTAL.key: self.usd_total,
            m.COST_USD_PER_HOUR.key: usd_h,
        }

    def state(self) -> dict[str, Any]:
        return {"leases": self.parts.broker.prompts.state()}  # a resumed run draws on, not from the start

    async def finish(self) -> None:
        """Tell workers the run is over (they hear it at their next call); keep the registry as it
        ended (installed versions, admitted counts)."""
        self.parts.broker.finished = True
        self.status.finished = True
        self.parts.registry.save()
        await asyncio.sleep(min(1.0, 2 * self.cfg.runtime.heartbeat_s))

    def summary(self) -> dict[str, Any]:
        return {"usd_total": self.usd_total, "activation_decisions": self.parts.pool.decisions}


def _perimeter_limits(cfg: Config) -> Any:
    """The limits of each of the learner's two ports (``echo2/perimeter.py``), after raising the soft
    descriptor limit to the hard one: ``security.perimeter`` cut so both ports together stay under it
    with ``resources.RESERVED_FDS`` kept for the learner's files."""
    from echo2.perimeter import port_limits

    per = cfg.security.perimeter
    need = 2 * per.max_connections + RESERVED_FDS
    soft = raise_descriptor_limit(need)
    limits = port_limits(per, soft)
    if limits.max_connections < per.max_connections:
        # a cut is news only where the token's fleet may not fit: two connections a member on a port
        members = 2 * cfg.security.max_workers
        short = limits.max_connections < members
        log.log(
            logging.WARNING if short else logging.INFO,
            "the connection caps may use %d descriptors but this process may open %d: each port's cap is "
            "cut to %d (%s %d for the token's %d workers; raise the hard limit, e.g. `ulimit -Hn 65536` "
            "or LimitNOFILE= in a systemd unit)",
            need,
            soft,
            limits.max_connections,
            "below the" if short else "above the",
            members,
            cfg.security.max_workers,
        )
    log.info(
        "descriptor limit %d: each port holds at most %d connections (%d per address, %d before "
        "authentication)",
        soft,
        limits.max_connections,
        limits.max_per_address,
        limits.max_pre_auth,
    )
    return limits


def _persistent_key(run_path: Path) -> Any:
    """The run's manifest signing key, kept in the run directory so a restarted learner signs with
    the key its workers already trust."""

    return key_from_text(_persistent_secret(run_path / "learner_key", lambda: new_signing_key().to_text()))


def _persistent_token(run_path: Path) -> str:
    return _persistent_secret(run_path / "join_token", lambda: secrets.token_urlsafe(24))


def _persistent_view_token(run_path: Path) -> str:
    """The read-only dashboard credential (never the join token: a viewer cannot enrol as a worker)."""
    return _persistent_secret(run_path / "view_token", lambda: secrets.token_urlsafe(24))


def _persistent_secret(path: Path, make: Callable[[], str]) -> str:
    """The secret stored at ``path``, or a new one from ``make`` written there owner-only."""
    if path.is_file():
        return path.read_text().strip()
    text = make()
    path.touch(mode=0o600)
    path.write_text(text)
    return text
