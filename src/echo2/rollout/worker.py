"""A rollout worker (SPEC §1 rollout plane): install -> generate -> push, plus heartbeats. It does not grade:
its leases carry no grading secret, and the learner grades every completion itself (SPEC §10).

The worker needs only the learner's join string (its URL and, over TLS, the fingerprint of its
certificate, which the worker pins on both the API and the broadcast plane) and the run's join token.
It registers (getting a
credential, the part of the run's config it needs, the learner's public manifest key and the
broadcast address), builds its engine on the model skeleton the learner serves, and hands the engine
to its one follower of the published weights (``rollout/follower.py``), which installs the current
snapshot over HTTP and then joins the broadcast plane, where it installs every newer snapshot and
relays chunks for its peers. Every call to the learner goes through the typed protocol client.

Generation runs in a thread so the event loop keeps relaying chunks, heartbeating, submitting the
previous batch and leasing the next one while the engine samples: the network round trips hide behind
generation. A new snapshot is installed between generations, never during one; every trajectory
carries the version that generated it. When the learner is unreachable the worker keeps its state and
retries; a learner restart is survived (credentials persist on the learner side).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import aiohttp

from echo2.config import USER_CONTEXT_TOKENS, EngineName, runs_named_code
from echo2.envs.base import EnvError
from echo2.errors import CheckpointError, ConfigError, Echo2Error
from echo2.models.snapshot import tokenizer_from_skeleton, write_skeleton
from echo2.pins import check_pins
from echo2.protocol import (
    HeartbeatRequest,
    LeaseGrant,
    LeaseRefusal,
    LeaseRequest,
    LoraSettings,
    RegisterRequest,
    SubmitRequest,
    group_to_wire,
)
from echo2.rollout.client import LearnerClient, LearnerGone, Refused
from echo2.rollout.engines.base import EngineOptions
from echo2.rollout.follower import WeightFollower
from echo2.types import Bounds
from echo2.weights.manifest import key_from_text

if TYPE_CHECKING:
    from echo2.config import TaskConfig
    from echo2.protocol import WorkerSettings
    from echo2.tasks.base import Task

log = logging.getLogger(__name__)

MAX_LEASES_IN_FLIGHT = 2  # one generating, one waiting: the generator never waits for a round trip


@dataclass(frozen=True)
class WorkerOptions:
    join_url: str  # the learner's API base URL
    token: str  # the run's join token
    name: str = field(default_factory=socket.gethostname)  # shown in the learner's registry
    usd_per_hour: float = 0.35  # this machine's price c_i
    hardware: str = "cpu"  # free-text description
    rollouts_per_s: float | None = None  # own throughput estimate (the controller's prior)
    uplink_mbps: float | None = None  # its upload link, Mbit/s, declared at registration (relay trees)
    max_rollouts_per_s: float | None = None  # throttle, to emulate slower hardware
    advertise_host: str | None = None  # address peers reach this worker's chunk server at
    relay_port: int = 0  # the port its chunk server binds (0: any free one)
    advertise_port: int | None = None  # the port peers dial, when not relay_port (NAT port forwarding)
    engine: EngineName = "hf"  # rollout engine (rollout/engines registry)
    engine_options: EngineOptions = field(default_factory=EngineOptions)  # max_context: the learner's
    reconnect_s: float = 120.0  # give up when the learner is unreachable this long
    catchup_s: float = 3.0  # wait this long for the broadcast before fetching a snapshot over HTTP
    lora_base: Path | None = None  # a LoRA run's base checkpoint held here (not the chain's first link)
    # play an environment the run's settings name by module:name or file (code the learner chooses runs
    # here); an installed env package needs no such trust (config.runs_named_code)
    trust_run_code: bool = False


@dataclass
class WorkerCounters:
    """What the worker did (also its exit report)."""

    rollouts_submitted: int = 0  # trajectories the learner admitted
    rollouts_dropped: int = 0  # trajectories it accepted but found stale
    submissions_rejected: int = 0  # submissions answered 4xx
    leases: int = 0  # leases worked on
    installs: int = 0  # snapshots installed (any path)
    http_installs: int = 0  # of which fetched over HTTP (bootstrap, catch-up, a gap in the chain)
    install_failures: int = 0  # staged versions refused (digest, base, malformed): the old one kept serving
    install_s: float = 0.0  # seconds building (decode / patch / digest) and loading installed versions
    last_install_s: float = 0.0  # of which the last install (reported in heartbeats)
    install_cpu_s: float = 0.0  # CPU seconds the installing thread spent on them (install_s is wall time)
    gen_s: float = 0.0  # seconds generating (throttle included)
    idle_s: float = 0.0  # seconds waiting for a lease
    env_failures: int = 0  # leases dropped because an environment failed to start (reset raised or hung)
    lease_refusals: dict[str, int] = field(default_factory=dict)  # lease requests refused, by reason


@dataclass(frozen=True)
class _Generated:
    """One finished generation, handed from the generator thread to the event loop."""

    lease_id: str  # the lease it answers
    version: int  # the installed version that generated it
    groups: list[list[Any]]  # trajectories, one list per leased prompt
    busy_s: float  # seconds it took (throttle included)


class RolloutWorker:
    def __init__(self, opts: WorkerOptions, build_task: Callable[[TaskConfig, int], Task]) -> None:
        self.opts = opts
        self.build_task = build_task  # the task registry's builder (echo2.tasks.registry.build_task)
        self.counters = WorkerCounters()
        self.finished = False
        self.follower: WeightFollower | None = None  # the published weights it serves (made in setup)
        self._hb_rollouts = 0
        self._hb_busy = 0.0
        self._leases: queue.SimpleQueue[LeaseGrant | None] = queue.SimpleQueue()  # to the generator
        self._results: asyncio.Queue[_Generated | BaseException] = asyncio.Queue()
        self.selfplay: Any = None  # rollout/opponents.SelfPlayPool, for a task with self-play opponents
        self._heartbeat_task: asyncio.Future[None] | None = None  # started as soon as registered
        self._inflight = 0  # leases handed to the generator and not yet back (read again when stopped)

    async def run(self) -> WorkerCounters:
        timeout = aiohttp.ClientTimeout(total=120, connect=10)
        self._loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession(timeout=timeout) as session:
            self.client = LearnerClient(
                self.opts.join_url, session, self.opts.reconnect_s, lambda: self.finished
            )
            following: asyncio.Future[None] | None = None
            try:
                await self.setup(bootstrap=False)
                assert self._heartbeat_task is not None and self.follower is not None
                following = asyncio.ensure_future(self.follower.follow())  # joined before the first install
                await self._bootstrap()
            except BaseException:
                self.finished = True
                for task in (self._heartbeat_task, following):
                    if task is not None:
                        task.cancel()
                raise
            bg = [following, self._heartbeat_task]
            generator = threading.Thread(target=self._generate_forever, name="echo2-generate", daemon=True)
            generator.start()
            try:
                await self._produce()
            except LearnerGone:
                if not self.finished:  # gone while the run was on: an error
                    raise
                log.info("the learner finished and closed")  # a request raced its shutdown: a clean end
            finally:
                await self._stop(generator, bg)
        return self.counters

    # ---- setup ---------------------------------------------------------------------------------------
    async def setup(self, bootstrap: bool = True) -> None:
        """Register, build the engine on the learner's model skeleton, make the follower that keeps the
        weights current, and (``bootstrap``) install the current snapshot over HTTP; ``run`` instead
        joins the broadcast first and installs what it brings (:meth:`_bootstrap`)."""
        import torch

        from echo2.models.policy import ChatFormat, TextCodec

        reg = await self._register()
        st = self.settings = reg.settings
        self._check_task(st)
        # heartbeats start now, not after the model is built: the controller must not take a worker
        # that is still loading for a lost one
        self._heartbeat_task = asyncio.ensure_future(self._heartbeats())
        if st.threads:
            torch.set_num_threads(st.threads)
        torch.manual_seed(st.seed)
        host, advertise_host = _local_address(reg.broadcast[0], self.opts.advertise_host)
        _can_bind(host, self.opts.relay_port)
        skeleton = await self.client.model()
        with tempfile.TemporaryDirectory(prefix="echo2-skeleton-") as tmp:
            write_skeleton(skeleton.files, Path(tmp))
            tokenizer = tokenizer_from_skeleton(Path(tmp))
            eos = _eos_ids(st.eos_ids, tokenizer)
            pad = tokenizer.pad_token_id
            pad = int(pad) if pad is not None else eos[0]
            eopts = self._engine_options(st)
            base = await self._lora_base(st.lora) if st.lora is not None else None
            self.engine = self._engine(Path(tmp), eos, pad, eopts, base)
            chat = ChatFormat.of(st.chat_template, st.system_prompt, st.chat_template_kwargs)
            self.codec = TextCodec.of(tokenizer, chat)
            if "selfplay" in getattr(st.task, "opponents", ()):  # earlier versions play the other seats
                from echo2.rollout.opponents import SelfPlayPool

                opp = self._engine(Path(tmp), eos, pad, eopts, base)
                every, size = st.task.selfplay_every, st.task.selfplay_pool  # type: ignore[union-attr]
                self.selfplay = SelfPlayPool(opp, self.codec, every, size, st.sampling.max_new_tokens)
        self.task = self.build_task(st.task, st.seed)
        self.follower = WeightFollower(
            self.client,
            self.engine,
            key_from_text(reg.public_key),
            reg.broadcast,
            self.worker_id,
            self.counters,
            finished=lambda: self.finished,
            host=host,
            advertise_host=advertise_host,
            port=self.opts.relay_port,
            advertise_port=self.opts.advertise_port,
            reconnect_s=self.opts.reconnect_s,
            catchup_s=self.opts.catchup_s,
            on_install=self.selfplay.offer if self.selfplay is not None else None,
            model_base=base.digest if base is not None else "",
            base=base,
        )
        if bootstrap:
            await self.follower.fetch()
            log.info("worker %s ready at v%d", self.worker_id, self.installed)

    def _check_task(self, st: WorkerSettings) -> None:
        """Refuse the run before anything starts when its environment's packages are not the learner's
        (``echo2.pins``) or it names code this worker's operator did not allow (``--trust-run-code``)."""
        check_pins(p.model_dump() for p in st.packages)
        named = runs_named_code(st.task)
        if named is not None and not self.opts.trust_run_code:
            raise ConfigError(
                f"the run's {named}: a worker plays only an installed environment package unless its "
                "operator trusts the run's code (echo2 worker --trust-run-code)"
            )

    async def _bootstrap(self) -> None:
        """The first install, with the broadcast joined: the newest anchor from members that hold or
        receive it (``broadcast/publisher.py``, "Latecomers"), over HTTP only when the broadcast brings
        nothing (``WeightFollower.catch_up``); over HTTP at once for a LoRA worker that holds the base (the
        adapter alone is small, the anchor on the broadcast carries the base)."""
        follower = self._follower()
        if follower.base is not None and follower.base.held is not None:
            await follower.fetch()
        else:
            await follower.catch_up(0)
        log.info("worker %s ready at v%d", self.worker_id, self.installed)

    async def _lora_base(self, lora: LoraSettings) -> Any:
        """A LoRA run's base slot (``models/lora.BaseSlot``): filled by the first link of the chain the
        worker installs, or now, with ``lora_base``, from the checkpoint this machine holds (cast to the
        published dtype, as the learner publishes it; checked against the run's digest), so no base
        crosses the network to it (the chain it fetches then leads with the adapter alone)."""
        from echo2.models.lora import BaseSlot, base_copy, merged_dtype
        from echo2.models.policy import load_model

        slot = BaseSlot(lora.base_digest, lora.scale, merged_dtype(lora.vllm))
        path = self.opts.lora_base
        if path is None:
            return slot
        t0 = time.perf_counter()
        where = f"the LoRA base at {path} (--lora-base, as {lora.dtype})"
        tensors = await asyncio.to_thread(
            lambda: base_copy(load_model(path, keep_bf16=lora.dtype == "bfloat16"), lora.dtype)
        )
        try:
            await asyncio.to_thread(slot.fill, tensors, where)
        except CheckpointError as exc:
            raise Echo2Error(str(exc)) from None
        log.info(
            "LoRA base installed (%d tensors) in %.1f s: %s", len(tensors), time.perf_counter() - t0, where
        )
        return slot

    def _engine_options(self, st: Any) -> Any:
        """This worker's engine options with the run's context, and in a LoRA run whose vLLM workers
        serve adapters natively (``lora.vllm``) the rank the engine reserves."""
        lora = st.lora
        native = lora is not None and lora.vllm == "native" and lora.rank is not None
        rank = lora.rank if native else None
        return dataclasses.replace(self.opts.engine_options, max_context=st.max_context, lora_rank=rank)

    def _engine(self, skeleton: Path, eos: Any, pad: int, options: Any, base: Any) -> Any:
        """The worker's engine on the skeleton; in a LoRA run (``base``) one that loads base + each
        published adapter (``AdapterEngine``)."""
        from echo2.rollout.engines import AdapterEngine, build_engine

        assert self.settings is not None
        engine = build_engine(self.opts.engine, skeleton, eos, pad, self.settings.sampling, options)
        if base is None:
            return engine
        adapted = AdapterEngine(engine, base)
        how = "served natively by the engine" if adapted.native else "merged into the base"
        log.info("LoRA adapters %s", how)
        return adapted

    async def _register(self) -> Any:
        o = self.opts
        req = RegisterRequest(
            name=o.name[:64],
            usd_per_hour=o.usd_per_hour,
            hardware=o.hardware,
            rollouts_per_s=o.rollouts_per_s,
            uplink_mbps=o.uplink_mbps,
        )
        try:
            reply = await self.client.register(req, o.token)
        except Refused as exc:
            raise Echo2Error(f"registration refused ({exc})") from None
        self.worker_id = reply.worker_id
        return reply

    @property
    def installed(self) -> int:
        """The version the worker serves (-1 before the first install)."""
        return self.follower.installed if self.follower is not None else -1

    # ---- the control loops ------------------------------------------------------------------------------
    async def _heartbeats(self) -> None:
        every = self.settings.heartbeat_s
        while not self.finished:
            req = HeartbeatRequest(
                rollouts=self._hb_rollouts,
                busy_s=self._hb_busy,
                installed_version=self.installed,
                install_s=self.counters.last_install_s,
            )
            self._hb_rollouts, self._hb_busy = 0, 0.0
            try:
                reply = await self.client.heartbeat(req)
                self.finished = self.finished or reply.finished
                every = reply.heartbeat_s or every  # the learner's cadence for its fleet now
            except LearnerGone as exc:
                log.error("%s", exc)
                self.finished = True
                break
            except Refused as exc:
                if exc.reply.error == "future_version":  # the learner never published what is held
                    await self._follower().forget()
                    continue
                if exc.reply.error == "quarantined":  # the learner caught this machine's output lying
                    log.error("the learner quarantined this worker: %s", exc.reply.detail)
                    self.finished = True
                    break
                if exc.status in (401, 403):
                    log.warning("credential refused (%s); registering again", exc.reply.detail)
                    await self._register()
                    if self.follower is not None:  # re-join the broadcast under the new id and credential
                        await self.follower.rejoin(self.worker_id)
                else:
                    log.warning("heartbeat refused: %s", exc)
            await asyncio.sleep(every)

    def _lease_request(self) -> LeaseRequest:
        return LeaseRequest(
            max_prompts=self.settings.lease_prompts,
            installed_version=self.installed,
            installed_epoch=self.follower.epoch if self.follower is not None else 0,
        )

    async def _lease(self) -> LeaseGrant | LeaseRefusal | None:
        """A lease or a refusal; None when the learner refused the request itself (asked again in 1 s)."""
        try:
            return await self.client.lease(self._lease_request())
        except Refused as exc:
            log.warning("lease request refused: %s", exc)
            return None

    async def _submit(self, done: _Generated, want_lease: bool) -> LeaseGrant | LeaseRefusal | None:
        """Submit one generation's groups; with ``want_lease`` the reply carries the next lease."""
        req = SubmitRequest(
            lease_id=done.lease_id,
            policy_version=done.version,
            groups=[group_to_wire(g) for g in done.groups],
            next_lease=self._lease_request().model_dump() if want_lease else None,
        )
        try:
            reply = await self.client.submit(req)
        except Refused as exc:
            if exc.status == 409:  # a retried submission that had landed before the connection broke
                log.info("lease %s was already submitted", done.lease_id)
            else:
                self.counters.submissions_rejected += 1
                log.warning("submission refused: %s", exc)
            return None
        self.counters.rollouts_submitted += reply.admitted
        self.counters.rollouts_dropped += reply.dropped_stale
        return reply.next_lease

    async def _produce(self) -> None:
        """Keep the generator fed with up to two leases (one generating, one waiting); submit each
        finished batch with the next lease request in one round trip (``_inflight``: leases out)."""
        retry_after = 0.0
        while not self.finished:
            t_wait = time.perf_counter()
            if retry_after and self._inflight == 0:  # refused and nothing generating: wait as told
                await asyncio.sleep(retry_after)
                self.counters.idle_s += time.perf_counter() - t_wait
                retry_after = 0.0
                continue
            if self._inflight < MAX_LEASES_IN_FLIGHT and self._results.empty() and not retry_after:
                lease = await self._lease()
            else:
                lease = await self._take_result()
            if isinstance(lease, LeaseGrant):
                if lease.min_version > self.installed:
                    await self._follower().catch_up(lease.min_version)
                self._leases.put(lease)
                self._inflight += 1
                retry_after = 0.0
                continue
            retry_after = await self._refused(lease)
            if self._inflight == 0:
                self.counters.idle_s += time.perf_counter() - t_wait

    async def _take_result(self) -> LeaseGrant | LeaseRefusal | None:
        """The next finished generation, submitted with a request for the next lease; that lease."""
        got = await self._results.get()
        self._inflight -= 1
        if isinstance(got, BaseException):
            raise got
        if not got.groups:  # dropped (an environment failed to start): the lease expires on the learner
            return await self._lease()
        self.counters.gen_s += got.busy_s
        self.counters.leases += 1
        self._hb_rollouts += sum(len(g) for g in got.groups)
        self._hb_busy += got.busy_s
        nxt = await self._submit(got, want_lease=True)
        return nxt if nxt is not None else await self._lease()

    async def _refused(self, refusal: LeaseRefusal | None) -> float:
        """Act on a refused lease; returns how long to wait before asking again (0: ask now)."""
        if refusal is None:
            return 1.0
        refused = self.counters.lease_refusals
        refused[refusal.reason] = refused.get(refusal.reason, 0) + 1
        if refusal.reason == "finished":
            self.finished = True
            return 0.0
        if refusal.reason in ("stale_weights", "unpublished_version") and refusal.min_version is not None:
            await self._follower().catch_up(refusal.min_version)  # unpublished: held since a learner restart
            return 0.0
        if refusal.reason in ("rolled_back", "stale_epoch"):  # weights of an earlier learner process
            await self._follower().forget()
            return 0.0
        return refusal.retry_after_s

    def _follower(self) -> WeightFollower:
        """The follower (set up: every caller runs after ``setup``)."""
        assert self.follower is not None, "the worker is not set up"
        return self.follower

    def _generate_forever(self) -> None:
        """The generator thread: leases in, graded version-tagged groups out, back to back; a newer
        snapshot is installed between two generations, never during one."""
        while (lease := self._leases.get()) is not None:
            try:  # the lease's seed: the learner re-derives the draws from it (check/rerun.py)
                item: _Generated | BaseException = self._generate(lease, seed=lease.seed)
            except Exception as exc:  # surfaces in the event loop, which stops the worker
                item = exc
            self._loop.call_soon_threadsafe(self._results.put_nowait, item)

    def _generate(self, lease: LeaseGrant, seed: int) -> _Generated:

        follower = self._follower()
        follower.install_pending()
        t0 = time.perf_counter()
        st = self.settings
        with follower.serving() as version:
            try:
                batch = self.task.collect(
                    self.codec,
                    self.engine,
                    [p.prompt() for p in lease.prompts],  # no answers: the learner grades
                    lease.group_size,
                    seed=seed,
                    policy_version=version,
                    group_prefix=lease.lease_id,
                    bounds=Bounds(st.max_context or USER_CONTEXT_TOKENS, st.sampling.max_new_tokens),
                    opponent_policy=self.selfplay.policy_for if self.selfplay is not None else None,
                    grade=False,
                )
            except EnvError as exc:  # an environment that cannot even start costs this lease only
                self.counters.env_failures += 1
                log.warning("lease %s dropped: %s", lease.lease_id, exc)
                return _Generated(lease.lease_id, version, [], time.perf_counter() - t0)
        follower.install_pending()  # a snapshot that arrived meanwhile goes in now, not after a pause
        if self.opts.max_rollouts_per_s:
            budget = len(batch.trajectories) / self.opts.max_rollouts_per_s
            time.sleep(max(0.0, budget - (time.perf_counter() - t0)))
        G, ts = lease.group_size, batch.trajectories
        groups = [ts[i : i + G] for i in range(0, len(ts), G)]
        return _Generated(lease.lease_id, version, groups, time.perf_counter() - t0)

    async def _stop(self, generator: threading.Thread, background: list[asyncio.Future[None]]) -> None:
        """What is being generated still lands (a lease not yet started is left to expire); the
        generator thread is joined, so the process never exits with it inside torch (which aborts:
        ``terminate called without an active exception``); then leave the broadcast and stop the
        background tasks. Also the path of SIGTERM, which cancels ``_produce`` wherever it is."""
        self.finished = True
        with contextlib.suppress(queue.Empty):
            while self._leases.get_nowait() is not None:  # not started: the learner re-issues it
                self._inflight -= 1
        self._leases.put(None)
        with contextlib.suppress(Exception):
            for _ in range(self._inflight):
                got = await asyncio.wait_for(self._results.get(), 30.0)
                if not isinstance(got, BaseException):
                    await asyncio.wait_for(self._submit(got, want_lease=False), 10.0)
        await asyncio.to_thread(generator.join, 1.0)
        if generator.is_alive():  # still generating (the learner expires that lease)
            log.info("waiting for the generation in progress to end")
            await asyncio.to_thread(generator.join)
        if self.follower is not None:
            await self.follower.close()
        for t in background:
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.gather(*background, return_exceptions=True)


def _local_address(learner_host: str, advertise: str | None) -> tuple[str, str]:
    """(bind, advertise) for the chunk server, bound to one interface, never to every one: the
    advertised address (``--advertise-host``) when it is one of this machine's, else the interface
    that routes to the learner (behind NAT the advertised address is the router's, which forwards)."""
    host = urlparse(f"//{learner_host}").hostname or learner_host
    if host in ("127.0.0.1", "localhost", "::1"):
        route = "127.0.0.1"
    else:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            route = s.getsockname()[0]
    if not advertise:
        return route, route
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((advertise, 0))  # succeeds only for an address of this machine
        return advertise, advertise
    except OSError:
        return route, advertise


def _can_bind(host: str, port: int) -> None:
    """A fixed relay port (``--relay-port``) this machine cannot listen on is refused at the start, in
    one line, instead of failing every broadcast join later."""
    if not port:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            why = exc.strerror or exc
            raise Echo2Error(f"--relay-port {port}: cannot listen on {host}:{port}: {why}") from None


def _eos_ids(ids: list[int], tokenizer: Any) -> tuple[int, ...]:
    """The tokens that end a completion: the learner's word (every id inside the tokenizer's vocabulary),
    else the tokenizer's own end-of-sequence token (a learner from before the field)."""
    if not ids:
        return (int(tokenizer.eos_token_id),)
    bad = [i for i in ids if not 0 <= i < len(tokenizer)]
    if bad:
        raise Echo2Error(f"settings.eos_ids: {bad} are outside the tokenizer's {len(tokenizer)} tokens")
    return tuple(ids)
