"""The learner node's network API for rollout workers (aiohttp), SPEC §1-§3 and §5.

Endpoints (JSON; every one but ``register`` needs ``Authorization: Bearer <credential>``):

    POST /v1/register   {token, name, usd_per_hour, hardware, rollouts_per_s}
                        -> {worker_id, credential, config, public_key, broadcast, heartbeat_s}
    POST /v1/heartbeat  {rollouts, busy_s, installed_version} -> {active, version, min_version}
    POST /v1/lease      {max_prompts, installed_version} -> {lease_id, prompts, group_size, min_version}
                        or {lease_id: null, reason, retry_after_s}
    POST /v1/submit     the payload of data/submission.py -> {admitted, dropped_stale}
    GET  /v1/version    -> {version, manifest}          GET /v1/snapshot -> safetensors bytes
    GET  /v1/model      -> {files: {name: text}} (config + tokenizer: the skeleton a worker builds on)

The run's join token is exchanged once for a per-worker credential (only its SHA-256 is kept, in
``workers.json`` of the run directory, so credentials survive a learner restart). A missing credential
gets 401, a wrong one 403. Bodies are parsed by strict pydantic models (``RegisterBody``,
``HeartbeatBody``, ``LeaseBody``; submissions by ``data/submission.py``); a refusal names the field.
Every rejection is counted by reason in the store (``store/rejected/*``).

Work in flight is capped: a lease is granted only while leased-but-unsubmitted plus buffered rollouts
stay within ``min(max_inflight_batches, S + 1) * R``, and only to a worker whose installed version
is still admissible (``>= v_t - S``), so workers never generate what the learner would discard.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import random
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

from aiohttp import web
from pydantic import BaseModel, Field

from echo2.config import Config
from echo2.data.store import TrajectoryStore
from echo2.data.submission import (
    STRICT,
    M,
    Rejected,
    SubmissionLimits,
    parse_model,
    validate_submission,
)
from echo2.data.tasks.base import Task
from echo2.planner.activation import Candidate
from echo2.planner.controller import ControllerConfig, Heartbeat, PoolController
from echo2.types import Prompt

log = logging.getLogger(__name__)

API = "/v1"
DEFAULT_RATE = 1.0  # rollouts/s assumed for a worker that registers without an estimate


Version = Annotated[int, Field(ge=-1)]  # a snapshot version; -1 = none installed yet
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class RegisterBody(BaseModel):
    """``POST /v1/register`` (the token is checked first, so a stranger learns nothing of the schema)."""

    model_config = STRICT

    token: str
    name: Annotated[str, Field(min_length=1, max_length=64)] = "worker"
    hardware: Annotated[str, Field(max_length=128)] = ""
    usd_per_hour: NonNegFloat = 0.0
    rollouts_per_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None


class HeartbeatBody(BaseModel):
    """``POST /v1/heartbeat``: rollouts generated and seconds busy since the last one."""

    model_config = STRICT

    rollouts: Annotated[int, Field(ge=0)]
    busy_s: NonNegFloat
    installed_version: Version


class LeaseBody(BaseModel):
    """``POST /v1/lease``, or the ``next_lease`` of a submission."""

    model_config = STRICT

    max_prompts: Annotated[int, Field(ge=1)]
    installed_version: Version


@dataclass
class WorkerRecord:
    """A registered worker, as the learner knows it (persisted without the credential)."""

    worker_id: str  # unique id the learner assigned
    name: str  # the name the worker gave (host name, ...)
    credential_sha256: str  # hex digest of its bearer credential
    usd_per_hour: float  # its price c_i
    hardware: str  # free-text description (GPU model, ...)
    rollouts_per_s: float  # its own estimate at registration (the controller's prior)
    installed_version: int = -1  # newest snapshot it reported installed
    rollouts: int = 0  # rollouts it has had admitted
    last_seen_s: float = 0.0  # monotonic time of its last authenticated call


class PromptSource:
    """Training prompts for leases: prompts of expired leases first, then fresh draws from the task."""

    def __init__(self, task: Task, seed: int) -> None:
        self.task = task
        self.rng = random.Random(f"leases:{seed}")
        self.reissue: deque[Prompt] = deque()

    def take(self, n: int) -> list[Prompt]:
        out = [self.reissue.popleft() for _ in range(min(n, len(self.reissue)))]
        if len(out) < n:
            out += self.task.sample_train(self.rng, n - len(out))
        return out


class LearnerService:
    """State and handlers of the learner's API. Runs on the learner's event loop thread, which is
    the only thread that touches the store."""

    def __init__(
        self,
        cfg: Config,
        store: TrajectoryStore,
        task: Task,
        run_path: Path,
        join_token: str,
        public_key: str,
        broadcast_addr: tuple[str, int],
        skeleton: dict[str, str],
        vocab_size: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.prompts = PromptSource(task, cfg.seed)
        self.run_path = run_path
        self.join_token = join_token
        self.public_key = public_key
        self.broadcast_addr = broadcast_addr
        self.skeleton = skeleton
        self.clock = clock
        rt, S = cfg.runtime, cfg.async_.staleness
        self.limits = SubmissionLimits(
            vocab_size=vocab_size,
            group_size=cfg.grpo.group_size,
            max_prompt_tokens=_max_prompt_tokens(cfg),
            max_completion_tokens=cfg.sampling.max_new_tokens,
            max_groups=rt.lease_prompts,
        )
        self.inflight_cap = int(min(rt.max_inflight_batches, S + 1) * cfg.grpo.rollouts_per_step)
        self.version = 0  # learner version v_t (set by the learner loop)
        self.finished = False  # the run is over: workers are told to stop
        self.published: tuple[int, dict[str, Any], bytes] | None = None  # version, manifest, blob
        self.workers: dict[str, WorkerRecord] = {}
        self._by_cred: dict[str, str] = {}  # credential sha -> worker id
        self.controller = PoolController(
            mu_target=1.0,
            config=ControllerConfig(
                heartbeat_timeout_s=rt.heartbeat_timeout_s,
                rate_halflife_s=max(5.0, 10 * rt.heartbeat_s),
                sustain_s=rt.sustain_s,
                cooldown_s=rt.cooldown_s,
                replace_prior=True,  # registration estimates are rough; the first heartbeat measures
            ),
        )
        self.target_known = False  # until T_train is measured every live worker is active
        self.data_ready: Callable[[], None] = lambda: None  # the learner loop's wake-up
        self.decisions: list[dict[str, Any]] = []  # activation log (also in the run directory)
        self._load_registry()

    # ---- state the learner loop drives ---------------------------------------------------------------
    def set_published(self, version: int, manifest: dict[str, Any], blob: bytes) -> None:
        self.published = (version, manifest, blob)

    @property
    def min_version(self) -> int:
        """Oldest generating version still admissible: ``v_t - S`` (SPEC §2)."""
        return self.version - self.cfg.async_.staleness

    def active_ids(self) -> list[str]:
        now = self.clock()
        if not self.target_known:
            timeout = self.cfg.runtime.heartbeat_timeout_s
            return [w for w, r in self.workers.items() if now - r.last_seen_s <= timeout]
        return [w for w in self.controller.active_ids() if self.controller.is_alive(w, now)]

    def set_target(self, mu_target: float) -> None:
        """Start cost-aware activation at ``mu_target`` rollouts/s (workers seen alive start active)."""
        self.controller.set_target(mu_target)
        self.target_known = True

    def control(self) -> None:
        """One controller tick: carry out its decisions (the worker learns at its next call)."""
        if not self.target_known:
            return
        for d in self.controller.decide(self.clock()):
            entry = {"time_s": round(time.time(), 3), **asdict(d)}
            self.decisions.append(entry)
            log.info("pool: %s %s (%s)", d.action, d.worker_id, d.reason)
            with (self.run_path / "activation.jsonl").open("a") as fh:
                fh.write(json.dumps(entry) + "\n")

    def expire_leases(self) -> int:
        prompts = self.store.expire_leases(time.time())
        self.prompts.reissue.extend(prompts)
        return len(prompts)

    def usd_per_hour(self) -> float:
        """Learner plus every active worker, $/h."""
        ids = self.active_ids()
        return self.cfg.runtime.learner_usd_per_hour + math.fsum(self.workers[w].usd_per_hour for w in ids)

    # ---- app ---------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        max_bytes = int(self.cfg.runtime.max_request_mb * (1 << 20))
        app = web.Application(client_max_size=max_bytes, middlewares=[self._count_errors])
        app.add_routes(
            [
                web.post(f"{API}/register", self.register),
                web.post(f"{API}/heartbeat", self.heartbeat),
                web.post(f"{API}/lease", self.lease),
                web.post(f"{API}/submit", self.submit),
                web.get(f"{API}/version", self.get_version),
                web.get(f"{API}/snapshot", self.get_snapshot),
                web.get(f"{API}/model", self.get_model),
            ]
        )
        return app

    async def serve(self, host: str, port: int) -> tuple[web.AppRunner, int]:
        """Start serving the API on ``host:port`` (0 = any free port); returns the runner (call its
        ``cleanup()`` to stop) and the bound port."""
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        return runner, int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    @web.middleware
    async def _count_errors(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            ours = getattr(exc, "echo2_reason", None)
            reason = ours or _REASON_BY_STATUS.get(exc.status, f"http_{exc.status}")
            self.store.record_rejection(reason)
            log.warning(
                "%s %s from %s: %d %s", request.method, request.path, request.remote, exc.status, exc.text
            )
            if ours is not None:
                raise
            # raised by aiohttp itself (body too large, no such route, ...): the same JSON shape as ours
            keep = {k: v for k, v in exc.headers.items() if k.lower() not in _BODY_HEADERS}
            return web.json_response({"error": reason, "detail": exc.text}, status=exc.status, headers=keep)

    # ---- helpers -----------------------------------------------------------------------------------
    def _auth(self, request: web.Request) -> WorkerRecord:
        header = request.headers.get("Authorization", "")
        if not header.startswith("Bearer ") or not header[7:].strip():
            raise _error(web.HTTPUnauthorized, "auth", "missing bearer credential")
        wid = self._by_cred.get(_sha(header[7:].strip()))
        if wid is None:
            raise _error(web.HTTPForbidden, "auth", "unknown credential")
        rec = self.workers[wid]
        rec.last_seen_s = self.clock()
        return rec

    async def _json(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise _error(web.HTTPBadRequest, "malformed", f"body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise _error(web.HTTPBadRequest, "malformed", "body must be a JSON object")
        return body

    @staticmethod
    def _parse(model: type[M], body: dict[str, Any]) -> M:
        try:
            return parse_model(model, body)
        except Rejected as exc:
            raise _error(web.HTTPUnprocessableEntity, exc.reason, exc.detail) from None

    def authorize_broadcast(self, worker_id: str, credential: object) -> bool:
        """Only registered workers join the snapshot topology, under their own id."""
        if not isinstance(credential, str):
            return False
        return self._by_cred.get(_sha(credential)) == worker_id

    # ---- handlers ----------------------------------------------------------------------------------
    async def register(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        token = body.get("token")
        if not isinstance(token, str) or not token:
            raise _error(web.HTTPUnauthorized, "auth", "register needs the run's join token")
        if not hmac.compare_digest(token.encode(), self.join_token.encode()):
            raise _error(web.HTTPForbidden, "auth", "wrong join token")
        req = self._parse(RegisterBody, body)
        credential = secrets.token_urlsafe(32)
        wid = f"w{len(self.workers)}-{secrets.token_hex(3)}"
        rec = WorkerRecord(
            wid,
            req.name,
            _sha(credential),
            req.usd_per_hour,
            req.hardware,
            req.rollouts_per_s or DEFAULT_RATE,
            last_seen_s=self.clock(),
        )
        self._enroll(rec)
        self._save_registry()
        log.info("registered %s (%s, %s, $%.2f/h)", wid, rec.name, rec.hardware or "?", rec.usd_per_hour)
        return web.json_response(
            {
                "worker_id": wid,
                "credential": credential,
                "config": self.cfg.to_dict(),
                "public_key": self.public_key,
                "broadcast": list(self.broadcast_addr),
                "heartbeat_s": self.cfg.runtime.heartbeat_s,
            }
        )

    async def heartbeat(self, request: web.Request) -> web.Response:
        rec = self._auth(request)
        hb = self._parse(HeartbeatBody, await self._json(request))
        if self.published is not None and hb.installed_version > self.published[0]:
            raise _error(
                web.HTTPUnprocessableEntity,
                "future_version",
                f"installed_version: {hb.installed_version} was never published",
            )
        rec.installed_version = hb.installed_version
        self.controller.observe(Heartbeat(rec.worker_id, self.clock(), hb.rollouts, hb.busy_s))
        self.control()
        return web.json_response(
            {
                "active": rec.worker_id in self.active_ids(),
                "version": self.version,
                "min_version": self.min_version,
                "finished": self.finished,
            }
        )

    async def lease(self, request: web.Request) -> web.Response:
        rec = self._auth(request)
        return web.json_response(self._grant(rec, self._parse(LeaseBody, await self._json(request))))

    def _grant(self, rec: WorkerRecord, req: LeaseBody) -> dict[str, Any]:
        """A lease of up to ``max_prompts`` prompts, or why not (and when to ask again)."""
        n, installed = min(req.max_prompts, self.cfg.runtime.lease_prompts), req.installed_version
        retry = self.cfg.runtime.heartbeat_s / 4
        G = self.cfg.grpo.group_size
        if self.finished:
            return {"lease_id": None, "reason": "finished", "retry_after_s": retry}
        if rec.worker_id not in self.active_ids():
            return {"lease_id": None, "reason": "inactive", "retry_after_s": retry * 4}
        if installed < self.min_version:
            return {
                "lease_id": None,
                "reason": "stale_weights",
                "min_version": self.min_version,
                "retry_after_s": retry,
            }
        if self.store.outstanding_rollouts() + n * G > self.inflight_cap:
            return {"lease_id": None, "reason": "buffer_full", "retry_after_s": retry}
        if self.store.open_leases(rec.worker_id) >= self.cfg.runtime.max_leases_per_worker:
            return {"lease_id": None, "reason": "too_many_leases", "retry_after_s": retry}
        prompts = self.prompts.take(n)
        lease_id = self.store.issue_lease(rec.worker_id, prompts, time.time(), self.cfg.runtime.lease_ttl_s)
        return {
            "lease_id": lease_id,
            "prompts": [asdict(p) for p in prompts],
            "group_size": G,
            "min_version": self.min_version,
            "expires_in_s": self.cfg.runtime.lease_ttl_s,
        }

    async def submit(self, request: web.Request) -> web.Response:
        """A submission, optionally carrying ``next_lease`` (a lease request answered in the same round
        trip: over a WAN link that halves the requests a worker makes per generation)."""
        rec = self._auth(request)
        body = await self._json(request)
        next_lease = body.pop("next_lease", None)
        latest = self.published[0] if self.published is not None else -1
        try:
            sub = validate_submission(body, self.limits, latest)
            result = self.store.submit(sub, rec.worker_id, self.version, time.time())
        except Rejected as exc:
            self.store.record_rejection(exc.reason)
            log.warning("submission from %s rejected: %s", rec.worker_id, exc)
            return web.json_response({"error": exc.reason, "detail": exc.detail}, status=exc.http_status)
        rec.rollouts += result.admitted
        if result.admitted:
            self.data_ready()
        reply: dict[str, Any] = {"admitted": result.admitted, "dropped_stale": result.dropped_stale}
        if next_lease is not None:  # the submission stands even if this part is bad
            try:
                reply["next_lease"] = self._grant(rec, parse_model(LeaseBody, next_lease))
            except Rejected as exc:
                self.store.record_rejection(exc.reason)
                reply["next_lease"] = {"error": exc.reason, "detail": f"next_lease: {exc.detail}"}
        return web.json_response(reply)

    async def get_version(self, request: web.Request) -> web.Response:
        self._auth(request)
        if self.published is None:
            return web.json_response({"version": None, "manifest": None})
        return web.json_response({"version": self.published[0], "manifest": self.published[1]})

    async def get_snapshot(self, request: web.Request) -> web.Response:
        self._auth(request)
        if self.published is None:
            raise _error(web.HTTPServiceUnavailable, "not_ready", "no snapshot published yet")
        v, _, blob = self.published
        return web.Response(
            body=blob, content_type="application/octet-stream", headers={"X-Echo2-Version": str(v)}
        )

    async def get_model(self, request: web.Request) -> web.Response:
        self._auth(request)
        return web.json_response({"files": self.skeleton})

    # ---- the registry --------------------------------------------------------------------------------
    def _enroll(self, rec: WorkerRecord) -> None:
        """Index a registered (or restored) worker and offer it to the controller, active."""
        self.workers[rec.worker_id] = rec
        self._by_cred[rec.credential_sha256] = rec.worker_id
        self.controller.add_candidate(
            Candidate(rec.worker_id, rec.hardware or "worker", rec.usd_per_hour, rec.rollouts_per_s),
            active=True,
            now_s=self.clock(),
        )

    def _registry_path(self) -> Path:
        return self.run_path / "workers.json"

    def _save_registry(self) -> None:
        data = [{k: v for k, v in asdict(r).items() if k != "last_seen_s"} for r in self.workers.values()]
        tmp = self._registry_path().with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self._registry_path())

    def _load_registry(self) -> None:
        path = self._registry_path()
        if not path.is_file():
            return
        for d in json.loads(path.read_text()):
            rec = WorkerRecord(**d)
            rec.last_seen_s = self.clock()  # give it one heartbeat timeout to come back
            self._enroll(rec)
        log.info("restored %d registered workers from %s", len(self.workers), path)


_BODY_HEADERS = ("content-type", "content-length")
_REASON_BY_STATUS = {
    400: "malformed",
    401: "auth",
    403: "auth",
    404: "not_found",
    405: "method",
    413: "oversized",
}


def _error(cls: type[web.HTTPException], reason: str, detail: str) -> web.HTTPException:
    exc = cls(text=json.dumps({"error": reason, "detail": detail}), content_type="application/json")
    exc.echo2_reason = reason  # type: ignore[attr-defined]  # the counted rejection reason
    return exc


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _max_prompt_tokens(cfg: Config) -> int:
    """Longest prompt a worker may send: the model's context minus the completion budget when the
    embedded model is used, else a generous fixed bound."""
    if cfg.model.path is None:
        return max(1, cfg.model.embedded.max_positions - cfg.sampling.max_new_tokens)
    return 32768
