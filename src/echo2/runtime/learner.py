"""The learner node: API service + broadcast publisher + the asynchronous GRPO loop (SPEC §1-§3).

Each step waits until the store holds ``P`` admissible GRPO groups (``R = P * G`` trajectories with
``v >= v_t - S``; the wait is the bubble ``T_idle``), makes one update (``v -> v + 1``) and, when
``v mod kappa == 0``, publishes a snapshot through the broadcast plane. Staleness
``Delta(t) = v_t - min_v(batch)`` is checked at every step against ``S`` and logged.

Durability: the store is SQLite (WAL); a group is marked consumed by step ``t`` before step ``t``
trains on it. A checkpoint at version ``v`` holds weights, optimizer state and ``v``; on restart the
learner reloads it, and every group consumed by a step after ``v`` (whose update was lost) is put
back, so no accepted trajectory is lost and none is trained into the weights twice.

Cost-aware activation: after ``warmup_steps`` the measured ``T_train`` (mean) and ``T_bcast`` (last
measured) give ``mu_target = gamma * mu_min(kappa)``, and the pool controller activates / releases
workers by ``rho_i = c_i / mu_i`` from their heartbeats.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from echo2.config import Config
from echo2.errors import Echo2Error, InfeasibleError, TrainingDivergedError
from echo2.planner import capacity
from echo2.runtime.rundir import OPTIM_FILE, STATE_FILE, latest_checkpoint

log = logging.getLogger(__name__)

WARMUP_STEPS = 3  # steps of T_train measured before the controller gets a target


@dataclass(frozen=True)
class Endpoints:
    """Where workers reach a running learner."""

    url: str  # HTTP API base, e.g. http://127.0.0.1:8765
    broadcast: tuple[str, int]  # snapshot broadcast TCP address
    token: str  # the run's join token
    run_dir: str  # the learner's run directory


@dataclass(frozen=True)
class LearnerSummary:
    run_dir: str  # run directory
    steps: int  # learner updates made in this process
    version: int  # final policy version
    resumed_from: int | None  # checkpoint version this process started from (None = fresh)
    wall_s: float  # seconds from the first step to the end
    initial_accuracy: float  # held-out accuracy when this process started
    final_accuracy: float  # held-out accuracy at the end
    best_accuracy: float  # best held-out accuracy seen
    bubble_ratio: float  # total idle / (idle + train) over the run
    staleness_max: int  # max Delta(t) over all steps (never above S)
    last_checkpoint: str  # newest checkpoint directory


class AsyncLearner:
    def __init__(
        self,
        cfg: Config,
        resume: bool = False,
        on_ready: Callable[[Endpoints], None] | None = None,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        on_tick: Callable[[], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.resume = resume
        self.on_ready = on_ready
        self.on_step = on_step
        self.on_tick = on_tick  # called about once a second (the launcher checks its workers; may raise)
        self.stop = asyncio.Event()

    async def run(self) -> LearnerSummary:
        import torch

        from echo2.broadcast.publisher import TcpPublisher
        from echo2.broadcast.registry import get_strategy
        from echo2.data.store import TrajectoryStore
        from echo2.data.tasks.base import build_task
        from echo2.learner.trainer import GRPOTrainer
        from echo2.models.policy import configure_torch, load_checkpoint, load_policy
        from echo2.models.snapshot import skeleton_files, snapshot_blob
        from echo2.rollout.engines.hf import HFEngine
        from echo2.rollout.evaluate import evaluate
        from echo2.runtime.rundir import RunDir
        from echo2.runtime.service import LearnerService

        cfg, rt = self.cfg, self.cfg.runtime
        S, kappa = cfg.async_.staleness, cfg.async_.effective_kappa
        P, G = cfg.grpo.prompts_per_step, cfg.grpo.group_size
        R = P * G
        run_path = Path(cfg.train.run_dir)
        strategy = get_strategy(rt.strategy)  # fail on a bad name before anything starts
        configure_torch(cfg)

        ckpt = latest_checkpoint(run_path) if self.resume else None
        if self.resume and ckpt is None:
            raise Echo2Error(f"--resume: no checkpoint with {STATE_FILE} under {run_path / 'checkpoints'}")
        run = RunDir(run_path, cfg.to_dict(), resume=self.resume)  # a fresh run clears the earlier one's
        policy = load_checkpoint(ckpt, cfg.model.chat_template) if ckpt else load_policy(cfg)
        version0 = json.loads((ckpt / STATE_FILE).read_text())["version"] if ckpt else 0
        trainer = GRPOTrainer(
            policy.model, cfg.grpo, cfg.sampling.temperature, policy.pad_id, version=version0
        )
        if ckpt is not None and (ckpt / OPTIM_FILE).is_file():
            trainer.optimizer.load_state_dict(torch.load(ckpt / OPTIM_FILE, weights_only=True))
        task = build_task(cfg.task, cfg.seed)
        engine = HFEngine(policy.model, policy.eos_id, policy.pad_id, cfg.sampling)
        eval_prompts = task.eval_prompts(cfg.train.eval_size)

        store = TrajectoryStore(run_path / "store.sqlite", S, G)
        if ckpt is not None:
            requeued = store.requeue_after(version0)
            log.info("resuming at version %d from %s; %d groups put back", version0, ckpt, requeued)
        key = _persistent_key(run_path)
        token = rt.join_token or _persistent_token(run_path)
        service_box: list[LearnerService] = []
        publisher = TcpPublisher(
            key, strategy, rt.chunk_kb << 10, host=rt.host, port=rt.broadcast_port,
            advertise_host=rt.advertise_host, authorize=lambda w, c: service_box[0].authorize_broadcast(w, c),
        )  # fmt: skip
        await publisher.start()
        service = LearnerService(
            cfg, store, task, run_path, token, key.verifier().to_text(), publisher.address,
            skeleton_files(policy.source, policy.model, policy.tokenizer, run_path / "skeleton"),
            vocab_size=int(policy.model.config.vocab_size),
        )  # fmt: skip
        service_box.append(service)
        service.version = version0
        ready = asyncio.Event()
        service.data_ready = ready.set
        runner, port = await service.serve(rt.host, rt.port)
        url = f"http://{rt.advertise_host or rt.host}:{port}"
        endpoints = Endpoints(url, publisher.address, token, str(run_path))
        public = {"url": url, "broadcast": list(publisher.address), "pid": os.getpid()}  # no token here
        (run_path / "learner.json").write_text(json.dumps(public))
        log.info(
            "learner API at %s, broadcast at %s:%d; join token in %s",
            url,
            *publisher.address,
            run_path / "join_token",
        )

        bcast: dict[str, float] = {}  # latest broadcast metrics
        tasks: set[asyncio.Task[None]] = set()

        async def publish(v: int) -> None:
            blob = snapshot_blob(policy.model)
            manifest = await publisher.publish(v, blob)
            service.set_published(v, manifest.to_dict(), blob)
            members = len(publisher.members())
            if members:
                t = asyncio.ensure_future(measure(v, members))
                tasks.add(t)
                t.add_done_callback(tasks.discard)

        async def measure(v: int, members: int) -> None:
            need = max(1, math.ceil(members / cfg.async_.gamma - 1e-9))
            stats = await publisher.wait_installed(v, count=need, timeout=120.0)
            m = stats.metrics(cfg.async_.gamma)
            if math.isfinite(m["broadcast/t_bcast_s"]):
                bcast.update(m)

        def save(name: str) -> str:
            return run.save_checkpoint(name, policy, trainer.version, trainer.optimizer)

        await publish(version0)
        if self.on_ready is not None:
            self.on_ready(endpoints)
        first = await asyncio.to_thread(evaluate, policy, engine, task, eval_prompts)
        run.log(
            {"step": version0, "time_s": 0.0, "learner/version": version0, "reward/accuracy": first.accuracy}
        )
        best = last_acc = first.accuracy
        budget_s = cfg.train.max_minutes * 60 if cfg.train.max_minutes else math.inf
        t_start = last_end = time.perf_counter()
        idle_total = train_total = usd_total = 0.0
        t_trains: list[float] = []
        staleness_max = 0
        steps = 0
        last_ckpt = str(ckpt or "")
        last_tick = 0.0
        try:
            while trainer.version < cfg.train.steps and not self.stop.is_set():
                # ---- wait for R admissible trajectories: the bubble ------------------------------------
                t_wait = time.perf_counter()
                batch = None
                while batch is None:
                    if time.perf_counter() - last_tick >= 1.0:  # housekeeping, busy or not
                        service.expire_leases()
                        service.control()
                        if self.on_tick is not None:
                            self.on_tick()
                        last_tick = time.perf_counter()
                    batch = store.take_batch(P, trainer.version, step=trainer.version + 1)
                    if batch is not None or self.stop.is_set() or time.perf_counter() - t_start >= budget_s:
                        break
                    ready.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(ready.wait(), 0.25)
                if batch is None:
                    break
                t_idle = time.perf_counter() - t_wait
                flat = [t for group in batch for t in group]
                v_t = trainer.version
                versions = [t.policy_version for t in flat]
                delta = v_t - min(versions)
                if delta > S:  # admission makes this impossible; if it happens it is a bug, stop loudly
                    raise Echo2Error(f"staleness {delta} > S = {S} at step {v_t + 1}: admission failed")
                staleness_max = max(staleness_max, delta)
                masks = [task.token_mask(t.completion_ids, t.meta) for t in flat]
                # ---- one update ------------------------------------------------------------------------
                stats = await asyncio.to_thread(trainer.update, flat, masks)
                steps += 1
                service.version = stats.version
                idle_total += t_idle
                train_total += stats.t_train_s
                t_trains.append(stats.t_train_s)
                if stats.version % kappa == 0:
                    await publish(stats.version)
                if len(t_trains) == WARMUP_STEPS or (
                    len(t_trains) > WARMUP_STEPS and len(t_trains) % 20 == 0
                ):
                    self._retarget(service, kappa, t_trains, bcast, R)
                now = time.perf_counter()
                step_wall, last_end = now - last_end, now
                usd_h = service.usd_per_hour()
                usd_step = usd_h * step_wall / 3600
                usd_total += usd_step
                st = store.stats()
                rewards = [t.reward for t in flat]
                record: dict[str, Any] = {
                    "step": stats.version,
                    "time_s": now - t_start,
                    **stats.metrics(),
                    "learner/t_idle_s": t_idle,
                    "learner/bubble_ratio": capacity.bubble_ratio(t_idle, stats.t_train_s),
                    **st.metrics(),
                    "store/staleness_mean": v_t - sum(versions) / len(versions),
                    "store/staleness_max": delta,
                    **bcast,
                    "pool/mu_pool": service.controller.mu_pool(service.clock()),
                    "pool/mu_target": service.controller.mu_target if service.target_known else None,
                    "pool/active_workers": len(service.active_ids()),
                    "cost/usd_per_step": usd_step,
                    "cost/usd_total": usd_total,
                    "cost/usd_per_hour": usd_h,
                    "reward/mean": sum(rewards) / len(rewards),
                    "reward/unparsed": sum(1 for t in flat if not t.meta.get("parsed", True)),
                }
                out_of_time = now - t_start >= budget_s
                done = stats.version >= cfg.train.steps or out_of_time or self.stop.is_set()
                if steps % cfg.train.eval_every == 0 or done:
                    ev = await asyncio.to_thread(evaluate, policy, engine, task, eval_prompts)
                    last_acc, best = ev.accuracy, max(best, ev.accuracy)
                    record["reward/accuracy"] = ev.accuracy
                    record["reward/eval_unparsed"] = ev.unparsed
                if stats.version % cfg.train.checkpoint_every == 0:
                    last_ckpt = await asyncio.to_thread(save, f"step_{stats.version:06d}")
                    store.prune_consumed(stats.version)  # trained into a saved checkpoint: never requeued
                run.log(record)
                if self.on_step is not None:
                    self.on_step(record)
                if out_of_time:
                    log.info(
                        "time budget of %g min reached at version %d", cfg.train.max_minutes, stats.version
                    )
                    break
        except TrainingDivergedError as exc:
            good = await asyncio.to_thread(save, "last_good")
            run.write_summary({"error": str(exc), "last_good_checkpoint": good, "version": trainer.version})
            raise TrainingDivergedError(f"{exc}; last good weights saved to {good}") from exc
        finally:
            if steps and trainer.version % cfg.train.checkpoint_every:  # the loop did not save this one
                last_ckpt = await asyncio.to_thread(save, f"step_{trainer.version:06d}")
            service.finished = True
            await asyncio.sleep(
                min(1.0, 2 * rt.heartbeat_s)
            )  # let workers hear "finished" on their next call
            for t in list(tasks):
                t.cancel()
            await publisher.close()
            await runner.cleanup()
            final_stats = store.stats()
            store.close()
            run.close()
        wall = time.perf_counter() - t_start
        summary = LearnerSummary(
            run_dir=str(run_path),
            steps=steps,
            version=trainer.version,
            resumed_from=version0 if ckpt else None,
            wall_s=wall,
            initial_accuracy=first.accuracy,
            final_accuracy=last_acc,
            best_accuracy=best,
            bubble_ratio=capacity.bubble_ratio(idle_total, train_total) if train_total else 0.0,
            staleness_max=staleness_max,
            last_checkpoint=str(last_ckpt),
        )
        extra = {
            "store": final_stats.metrics(),
            "usd_total": usd_total,
            "t_train_mean_s": sum(t_trains) / len(t_trains) if t_trains else None,
            "staleness_budget": S,
            "kappa": kappa,
            "activation_decisions": service.decisions,
        }
        (run_path / "summary.json").write_text(json.dumps({**asdict(summary), **extra}, indent=2))
        return summary

    @staticmethod
    def _retarget(service: Any, kappa: int, t_trains: list[float], bcast: dict[str, float], R: int) -> None:
        """mu_target = gamma * mu_min(kappa) from the measured T_train and T_bcast (SPEC §3)."""
        recent = t_trains[-20:]
        t_train = sum(recent) / len(recent)
        t_bcast = bcast.get("broadcast/t_bcast_s", 0.0)
        try:
            mu = capacity.mu_min(kappa=kappa, t_train=t_train, t_bcast=t_bcast, rollouts=R)
        except InfeasibleError as exc:
            log.warning("capacity model: %s; keeping every worker active", exc)
            return
        target = capacity.mu_target(mu, service.cfg.async_.gamma)
        if not service.target_known:
            log.info(
                "measured T_train %.3f s, T_bcast %.3f s: mu_target %.1f rollouts/s", t_train, t_bcast, target
            )
        service.set_target(target)


def _persistent_key(run_path: Path) -> Any:
    """The run's manifest signing key, kept in the run directory so a restarted learner signs with
    the key its workers already trust."""
    from echo2.broadcast.manifest import key_from_text, new_signing_key

    return key_from_text(_persistent_secret(run_path / "learner_key", lambda: new_signing_key().to_text()))


def _persistent_token(run_path: Path) -> str:
    return _persistent_secret(run_path / "join_token", lambda: secrets.token_urlsafe(24))


def _persistent_secret(path: Path, make: Callable[[], str]) -> str:
    """The secret stored at ``path``, or a new one from ``make`` written there owner-only."""
    if path.is_file():
        return path.read_text().strip()
    text = make()
    path.touch(mode=0o600)
    path.write_text(text)
    return text
