"""A rollout worker (SPEC §1 rollout plane): install -> generate -> reward -> push, plus heartbeats.

The worker needs only the learner's URL and the run's join token. It registers (getting a
credential, the run config, the learner's public manifest key and the broadcast address), builds
the model skeleton the learner serves, installs the current snapshot over HTTP, and then joins the
broadcast topology, where it installs every newer snapshot and relays chunks for its peers.

Generation runs in a worker thread so the event loop keeps relaying chunks, heartbeating, submitting
the previous batch and leasing the next one while the model samples: the network round trips hide
behind generation. A new snapshot is switched in between generations, never during one; every
trajectory carries the version that generated it. When the learner is unreachable the worker keeps
its state and retries; a learner restart is survived (credentials persist on the learner side).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import socket
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp

from echo2.errors import Echo2Error

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerOptions:
    join_url: str  # the learner's API base URL
    token: str  # the run's join token
    name: str = field(default_factory=socket.gethostname)  # shown in the learner's registry
    usd_per_hour: float = 0.35  # this machine's price c_i
    hardware: str = "cpu"  # free-text description
    rollouts_per_s: float | None = None  # own throughput estimate (the controller's prior)
    max_rollouts_per_s: float | None = None  # throttle, to emulate slower hardware
    advertise_host: str | None = None  # address peers reach this worker's chunk server at
    reconnect_s: float = 120.0  # give up when the learner is unreachable this long
    catchup_s: float = 3.0  # wait this long for the broadcast before fetching a snapshot over HTTP


@dataclass
class WorkerCounters:
    """What the worker did (also its exit report)."""

    rollouts_submitted: int = 0  # trajectories the learner admitted
    rollouts_dropped: int = 0  # trajectories it accepted but found stale
    submissions_rejected: int = 0  # submissions answered 4xx
    leases: int = 0  # leases worked on
    installs: int = 0  # snapshots installed (any path)
    http_installs: int = 0  # of which fetched over HTTP (bootstrap, catch-up)
    gen_s: float = 0.0  # seconds generating (throttle included)
    idle_s: float = 0.0  # seconds waiting for a lease


class LearnerGone(Echo2Error):
    """The learner stayed unreachable past ``reconnect_s``."""


class RolloutWorker:
    def __init__(self, opts: WorkerOptions) -> None:
        self.opts = opts
        self.base = opts.join_url.rstrip("/") + "/v1"
        self.counters = WorkerCounters()
        self.installed = -1
        self.finished = False
        self._pending: Any = None  # newest InstalledSnapshot from the broadcast plane not yet loaded
        self._hb_rollouts = 0
        self._hb_busy = 0.0
        self._cred: str | None = None
        self._session: aiohttp.ClientSession | None = None
        self._retry_after = 0.5  # seconds to wait after a refused lease
        self.node: Any = None  # the broadcast node while joined (a TcpWorkerNode)
        self._model_lock = threading.Lock()  # held while generating: weights change only between generations
        self._leases: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()  # to the generator
        self._results: asyncio.Queue[tuple[str, int, Any, float] | BaseException] = asyncio.Queue()

    # ---- HTTP -------------------------------------------------------------------------------------------
    async def _call(
        self, method: str, path: str, body: dict[str, Any] | None = None, raw: bool = False
    ) -> tuple[int, Any]:
        assert self._session is not None
        headers = {"Authorization": f"Bearer {self._cred}"} if self._cred else {}
        deadline = time.monotonic() + self.opts.reconnect_s
        while True:
            try:
                async with self._session.request(
                    method, self.base + path, json=body, headers=headers
                ) as resp:
                    if raw and resp.status == 200:
                        return resp.status, (await resp.read(), dict(resp.headers))
                    try:
                        data = await resp.json(content_type=None)
                    except ValueError:
                        data = {"error": "non-json", "detail": (await resp.text())[:200]}
                    return resp.status, data
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                if time.monotonic() >= deadline or self.finished:
                    raise LearnerGone(
                        f"learner at {self.base} unreachable for {self.opts.reconnect_s:.0f}s: {exc}"
                    ) from None
                await asyncio.sleep(0.5)

    async def _register(self) -> dict[str, Any]:
        o = self.opts
        body = {"token": o.token, "name": o.name[:64], "usd_per_hour": o.usd_per_hour, "hardware": o.hardware}
        if o.rollouts_per_s:
            body["rollouts_per_s"] = o.rollouts_per_s
        self._cred = None
        status, data = await self._call("POST", "/register", body)
        if status != 200:
            raise Echo2Error(f"registration refused ({status}): {data.get('detail', data)}")
        self._cred = data["credential"]
        return data

    # ---- snapshots ------------------------------------------------------------------------------------
    async def _fetch_snapshot(self) -> None:
        """Install the latest snapshot over HTTP, verified against the signed manifest."""
        from echo2.broadcast.manifest import Manifest, blob_ok, verify_manifest

        status, info = await self._call("GET", "/version")
        if status != 200 or info.get("manifest") is None:
            raise Echo2Error(f"learner has no snapshot to fetch ({status}): {info}")
        manifest = Manifest.from_dict(info["manifest"])
        verify_manifest(manifest, self.key)
        if manifest.version <= self.installed:
            return
        status, got = await self._call("GET", "/snapshot", raw=True)
        if status != 200:
            raise Echo2Error(f"snapshot download failed ({status}): {got}")
        blob, headers = got
        if int(headers.get("X-Echo2-Version", -1)) != manifest.version or not blob_ok(manifest, blob):
            log.warning(
                "HTTP snapshot does not match manifest v%d (a newer one was published?)", manifest.version
            )
            return
        if await asyncio.to_thread(self._install, blob, manifest.version):
            self.counters.http_installs += 1
            log.info("installed v%d over HTTP", manifest.version)

    def _install(self, blob: Any, version: int) -> bool:
        """Load ``version`` unless something newer is already in (any thread; waits for a generation)."""
        from echo2.models.snapshot import install_blob

        with self._model_lock:
            if version <= self.installed:
                return False
            install_blob(self.policy.model, blob)
            self.installed = version
            self.counters.installs += 1
            return True

    def _install_pending(self) -> None:
        """Switch to the newest snapshot the broadcast delivered, if any (any thread), and ack it."""
        snap = self._pending
        if snap is None or not self._install(snap.data, snap.manifest.version):
            return
        node = self.node
        if node is not None:
            v = snap.manifest.version
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(node.report_installed(v)))

    async def _maybe_install(self) -> None:
        await asyncio.to_thread(self._install_pending)

    async def _follow_broadcast(self) -> None:
        """Keep a broadcast node joined (re-joining after a learner restart) and collect snapshots."""
        from echo2.broadcast.worker import TcpWorkerNode

        while not self.finished:
            node = TcpWorkerNode(
                self.worker_id, self.broadcast_addr, self.key, host=self.bind_host,
                advertise_host=self.advertise_host, credential=self._cred,
            )  # fmt: skip
            try:
                await node.start(join_timeout=self.opts.reconnect_s)
            except Echo2Error as exc:
                log.warning("broadcast join failed: %s", exc)
                await asyncio.sleep(1.0)
                continue
            self.node = node
            async for snap in node.snapshots():
                self._pending = snap
                if not self._model_lock.locked():  # idle: switch now, else the generator switches next
                    await self._maybe_install()
            self.node = None
            if not self.finished:
                log.info("broadcast connection lost; re-joining")
                await asyncio.sleep(1.0)

    # ---- loops ------------------------------------------------------------------------------------------
    async def _heartbeats(self, every: float) -> None:
        while not self.finished:
            body = {
                "rollouts": self._hb_rollouts,
                "busy_s": self._hb_busy,
                "installed_version": self.installed,
            }
            self._hb_rollouts, self._hb_busy = 0, 0.0
            try:
                status, data = await self._call("POST", "/heartbeat", body)
            except LearnerGone as exc:
                log.error("%s", exc)
                self.finished = True
                break
            if status == 200:
                self.finished = self.finished or bool(data.get("finished"))
            elif status in (401, 403):
                log.warning("credential refused (%s); registering again", data.get("detail"))
                self.worker_id = (await self._register())["worker_id"]
                if self.node is not None:  # re-join the broadcast under the new id and credential
                    await self.node.close()
            await asyncio.sleep(every)

    async def _lease(self) -> dict[str, Any]:
        status, data = await self._call("POST", "/lease", self._lease_request())
        if status != 200:
            return {
                "lease_id": None,
                "reason": f"http {status}: {data.get('detail', data)}",
                "retry_after_s": 1.0,
            }
        return data

    def _lease_request(self) -> dict[str, Any]:
        return {"max_prompts": self.cfg.runtime.lease_prompts, "installed_version": self.installed}

    async def _submit(
        self, lease_id: str, version: int, batch: Any, want_lease: bool
    ) -> dict[str, Any] | None:
        """Submit one generation's groups; with ``want_lease`` the reply carries the next lease."""
        G = self.cfg.grpo.group_size
        ts = batch.trajectories
        groups = [
            {
                "prompt_id": ts[i].prompt_id,
                "samples": [
                    {
                        "prompt_ids": list(t.prompt_ids),
                        "completion_ids": list(t.completion_ids),
                        "sampler_logprobs": list(t.sampler_logprobs),
                        "reward": t.reward,
                        "meta": t.meta,
                    }
                    for t in ts[i : i + G]
                ],
            }
            for i in range(0, len(ts), G)
        ]
        body: dict[str, Any] = {"lease_id": lease_id, "policy_version": version, "groups": groups}
        if want_lease:
            body["next_lease"] = self._lease_request()
        status, data = await self._call("POST", "/submit", body)
        if status == 200:
            self.counters.rollouts_submitted += int(data["admitted"])
            self.counters.rollouts_dropped += int(data["dropped_stale"])
            nxt = data.get("next_lease")
            return nxt if isinstance(nxt, dict) and "error" not in nxt else None
        if status == 409:  # a retried submission that had landed before the connection broke
            log.info("lease %s was already submitted", lease_id)
        else:
            self.counters.submissions_rejected += 1
            log.warning("submission refused (%d): %s", status, data)
        return None

    async def _submit_then_lease(self, lease_id: str, version: int, batch: Any) -> dict[str, Any]:
        nxt = await self._submit(lease_id, version, batch, want_lease=True)
        return nxt if nxt is not None else await self._lease()

    async def run(self) -> WorkerCounters:
        from echo2.broadcast.manifest import key_from_text
        from echo2.config import Config
        from echo2.data.tasks.base import build_task
        from echo2.models.policy import Policy, configure_torch
        from echo2.models.snapshot import build_from_skeleton
        from echo2.rollout.engines.hf import HFEngine

        timeout = aiohttp.ClientTimeout(total=120, connect=10)
        self._loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession(timeout=timeout) as session:
            self._session = session
            reg = await self._register()
            self.worker_id = reg["worker_id"]
            self.cfg = cfg = Config.model_validate(reg["config"])
            configure_torch(cfg)
            self.key = key_from_text(reg["public_key"])
            self.broadcast_addr = (reg["broadcast"][0], int(reg["broadcast"][1]))
            self.bind_host, self.advertise_host = _local_address(
                self.broadcast_addr[0], self.opts.advertise_host
            )
            status, skel = await self._call("GET", "/model")
            if status != 200:
                raise Echo2Error(f"cannot fetch the model skeleton ({status}): {skel}")
            with tempfile.TemporaryDirectory(prefix="echo2-skeleton-") as tmp:
                model, tokenizer = build_from_skeleton(skel["files"], Path(tmp))
            eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
            self.policy = Policy(
                model,
                tokenizer,
                int(eos),
                int(pad if pad is not None else eos),
                cfg.model.chat_template,
                self.base,
            )
            engine = HFEngine(model, self.policy.eos_id, self.policy.pad_id, cfg.sampling)
            task = build_task(cfg.task, cfg.seed)
            await self._fetch_snapshot()
            log.info("worker %s ready at v%d", self.worker_id, self.installed)
            bg = [
                asyncio.ensure_future(self._follow_broadcast()),
                asyncio.ensure_future(self._heartbeats(float(reg["heartbeat_s"]))),
            ]
            gen_thread = threading.Thread(
                target=self._generate_forever, args=(engine, task), name="echo2-generate", daemon=True
            )
            gen_thread.start()
            inflight = 0  # leases handed to the generator and not yet back
            try:
                inflight = await self._produce()
            finally:
                self.finished = True
                with contextlib.suppress(Exception):  # what is generated still lands
                    for _ in range(inflight):
                        got = await asyncio.wait_for(self._results.get(), 30.0)
                        if not isinstance(got, BaseException):
                            await asyncio.wait_for(self._submit(*got[:3], want_lease=False), 10.0)
                self._leases.put(None)
                if self.node is not None:
                    await self.node.close()
                for t in bg:
                    t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.gather(*bg, return_exceptions=True)
        return self.counters

    async def _produce(self) -> int:
        """Keep the generator thread fed with up to two leases (one generating, one waiting), submit
        each finished batch with the next lease request in one round trip; returns leases in flight."""
        inflight, refused = 0, False
        while not self.finished:
            t_wait = time.perf_counter()
            if inflight < 2 and self._results.empty() and not refused:
                lease = await self._lease()
            elif inflight > 0:
                got = await self._results.get()
                inflight -= 1
                if isinstance(got, BaseException):
                    raise got
                lease_id, version, batch, busy = got
                self.counters.gen_s += busy
                self.counters.leases += 1
                self._hb_rollouts += len(batch.trajectories)
                self._hb_busy += busy
                lease = await self._submit_then_lease(lease_id, version, batch)
            else:  # refused and nothing generating: wait as told
                await asyncio.sleep(self._retry_after)
                self.counters.idle_s += time.perf_counter() - t_wait
                refused = False
                continue
            refused = lease.get("lease_id") is None
            if refused:
                if lease.get("reason") == "finished":
                    self.finished = True
                    break
                if lease.get("reason") == "stale_weights":
                    await self._catch_up(int(lease["min_version"]))
                    refused = False
                self._retry_after = float(lease.get("retry_after_s", 0.5))
                if inflight == 0:
                    self.counters.idle_s += time.perf_counter() - t_wait
                continue
            if int(lease["min_version"]) > self.installed:
                await self._catch_up(int(lease["min_version"]))
            self._leases.put(lease)
            inflight += 1
        return inflight

    def _generate_forever(self, engine: Any, task: Any) -> None:
        """The generator thread: leases in, graded version-tagged batches out, back to back; a newer
        snapshot is switched in between two generations, never during one."""
        from echo2.rollout.collect import collect_groups
        from echo2.types import Prompt

        n = 0
        while (lease := self._leases.get()) is not None:
            try:
                self._install_pending()
                n += 1
                prompts = [Prompt(**p) for p in lease["prompts"]]
                t0 = time.perf_counter()
                with self._model_lock:
                    version = self.installed
                    batch = collect_groups(
                        self.policy, engine, task, prompts, int(lease["group_size"]),
                        seed=zlib.crc32(f"{self.worker_id}:{n}".encode()), policy_version=version,
                        group_prefix=lease["lease_id"],
                    )  # fmt: skip
                self._install_pending()  # a snapshot that arrived meanwhile goes in now, not after a pause
                if self.opts.max_rollouts_per_s:
                    time.sleep(
                        max(
                            0.0,
                            len(batch.trajectories) / self.opts.max_rollouts_per_s
                            - (time.perf_counter() - t0),
                        )
                    )
                item: tuple[str, int, Any, float] | BaseException = (
                    lease["lease_id"], version, batch, time.perf_counter() - t0,
                )  # fmt: skip
            except Exception as exc:  # surfaces in the event loop, which stops the worker
                item = exc
            self._loop.call_soon_threadsafe(self._results.put_nowait, item)

    async def _catch_up(self, min_version: int) -> None:
        """Wait briefly for the broadcast to deliver ``min_version``; else fetch it over HTTP."""
        deadline = time.monotonic() + self.opts.catchup_s
        while time.monotonic() < deadline and not self.finished:
            await self._maybe_install()
            if self.installed >= min_version:
                return
            await asyncio.sleep(0.02)
        await self._fetch_snapshot()


def _local_address(learner_host: str, advertise: str | None) -> tuple[str, str]:
    """(bind, advertise) for the chunk server: the interface that routes to the learner."""
    if advertise:
        return "0.0.0.0", advertise
    host = urlparse(f"//{learner_host}").hostname or learner_host
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1", "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        addr = s.getsockname()[0]
    return "0.0.0.0", addr
