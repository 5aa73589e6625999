"""The learner loop (SPEC §1-§3): the one loop of both learner processes, ``echo2 train`` and the node of
``echo2 run`` / ``echo2 learner``.

Each step takes the ``P`` oldest admissible GRPO groups from the trajectory store (``R = P * G``
trajectories with ``v >= v_t - S``; the store's admission rule), checks the batch's staleness
``Delta(t) = v_t - min_v(batch)`` against ``S``, makes one update (``v -> v + 1``) and then lets its
:class:`Feed` act on the new version (publish every ``kappa`` versions, retarget the pool), evaluates
every ``eval_every`` steps, checkpoints every ``checkpoint_every`` and writes the step's record. Every
second of the loop that is not an update is bubble, counted by cause (``observe/bubble.py``): waiting
for the batch is ``wait`` whether the batch is generated here (``echo2 train``) or by workers.

What differs between the two processes is only the :class:`Feed`: where the store's groups come from
and what a step does around the update. ``echo2 train`` is this loop at ``S = 0`` with a feed that
generates each batch with the trainer's own weights (``local.py``); the node's feed serves workers over
HTTP and publishes snapshots (``learner.py``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from echo2.errors import Echo2Error, TrainingDivergedError
from echo2.observe import catalog as m
from echo2.observe.bubble import BubbleMeter
from echo2.resources import RETRY_DELAYS_S, is_exhausted, retry_exhausted
from echo2.types import Trajectory

if TYPE_CHECKING:
    from echo2.data.store import TrajectoryStore
    from echo2.observe.bubble import BubbleMeter
    from echo2.rollout.evaluate import EvalResult
    from echo2.runtime.core import LearnerCore

log = logging.getLogger(__name__)

FINAL_RETRY_DELAYS_S = (*RETRY_DELAYS_S, 5.0, 10.0, 20.0)  # the run's last checkpoint waits longer


@dataclass(frozen=True)
class LearnerSummary:
    run_dir: str  # run directory
    steps: int  # learner updates made in this process
    version: int  # final policy version
    resumed_from: int | None  # checkpoint version this process started from (None = fresh)
    wall_s: float  # seconds of the main loop (setup and the initial evaluation excluded)
    initial_accuracy: float  # held-out accuracy when this process started
    final_accuracy: float  # held-out accuracy at the end
    best_accuracy: float  # best held-out accuracy seen
    bubble_ratio: float  # 1 - update seconds / wall seconds of the main loop (every cause counts)
    staleness_max: int  # max Delta(t) over all steps (never above S)
    last_checkpoint: str  # newest checkpoint directory
    score: str  # what the held-out numbers measure (Task.score: "accuracy"; "return", "chips" per episode)


class Feed(Protocol):
    """What a learner process adds to the loop: the source of the store's groups and the step's
    surroundings."""

    def housekeeping(self) -> None:
        """Called each time the loop looks into the store, busy or not (the node's lease expiry and
        controller rounds, about once a second)."""

    async def refill(self, version: int) -> None:
        """Make progress towards a batch for a learner at ``version`` when the store holds too few
        groups (generate one, or wait a moment for workers' submissions); the loop then looks again."""

    def poisoned(self, group_ids: tuple[str, ...]) -> None:
        """Groups an update left out (non-finite loss or gradient): purge them for good and deal with
        their senders."""

    def mismatch(self, by_group: dict[str, tuple[float, float]]) -> None:
        """An update's fresh sequences per group, (k3 sum, tokens) (``UpdateStats.mismatch_by_group``):
        the node reads the mismatch KL per worker from them (the pool table)."""

    async def after_update(self, version: int, t_trains: Sequence[float], meter: BubbleMeter) -> None:
        """What a new version triggers (publication, the pool's target), timed by ``meter``'s causes."""

    def metrics(self, step_wall_s: float) -> dict[str, float]:
        """The feed's part of the step record (its parts' metrics; a step of ``step_wall_s`` seconds)."""

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the feed (a resumed run draws on from there)."""

    async def finish(self) -> None:
        """The run is over: tell whoever is listening."""

    def summary(self) -> dict[str, Any]:
        """The feed's part of ``summary.json``."""


class LearnerLoop:
    """The loop over a :class:`~echo2.runtime.core.LearnerCore`, its trajectory store and a feed.

    ``watchers`` get every record ``metrics.jsonl`` gets (the initial evaluation's too); ``stop`` ends
    the loop at the next step boundary."""

    def __init__(
        self,
        core: LearnerCore,
        store: TrajectoryStore,
        feed: Feed,
        watchers: Sequence[Callable[[dict[str, Any]], None]] = (),
        stop: asyncio.Event | None = None,
        last_checkpoint: str = "",
    ) -> None:
        self.core, self.store, self.feed = core, store, feed
        self.cfg = core.cfg
        self.watchers = tuple(watchers)
        self.stop = stop or asyncio.Event()
        self.steps = self.staleness_max = 0  # what this process did, for the summary
        self.t_trains: list[float] = []
        self.last_ckpt = last_checkpoint
        self.checkpoints_failed = 0  # checkpoints a full descriptor table or disk kept from being written
        stats = store.stats()
        self._admitted_seen = (stats.admitted, stats.admitted_tokens)  # for the generated length

    @property
    def version(self) -> int:
        return self.core.version

    async def run(self) -> LearnerSummary:
        """The starting evaluation, the loop, the last checkpoint; a diverged update leaves the last
        good weights (saved before the optimizer stepped) and a summary naming the error."""
        await self.start()
        try:
            await self.main_loop()
        except TrainingDivergedError as exc:
            good = await asyncio.to_thread(self.save, "last_good")
            raise self.core.diverged(exc, good, version=self.version) from exc
        finally:
            await self.finish()
        return self.summary()

    async def start(self) -> None:
        """The starting checkpoint's held-out score: the record of step ``v`` at time 0."""
        record = {m.STEP.key: self.version, m.TIME_S.key: 0.0, m.LEARNER_VERSION.key: self.version}
        first = await self.evaluate()
        if first is not None:
            log.info("version %d: held-out %s %.3f", self.version, self.core.task.score, first.accuracy)
            record.update({m.REWARD_ACCURACY.key: first.accuracy, m.REWARD_EVAL_UNPARSED.key: first.unparsed})
        self._record(record)

    async def evaluate(self) -> EvalResult | None:
        """The held-out evaluation (``Core.evaluate``, on a thread); a stop asked for meanwhile (or
        before) cuts it short at its next generation step on every rank, instead of waiting for it
        (minutes at long answers on a CPU): None then, logged, and no score recorded."""

        async def halt_on_stop() -> None:
            await self.stop.wait()
            self.core.ranks.halt.set()

        watcher = asyncio.ensure_future(halt_on_stop())
        try:
            ev = await asyncio.to_thread(self.core.evaluate)
        finally:
            watcher.cancel()
            self.core.ranks.halt.clear()
        if ev is None:
            log.info("version %d: held-out evaluation stopped before its end (no score)", self.version)
        return ev

    async def main_loop(self) -> None:
        """Wait for a batch (the bubble), update, then the feed / evaluate / checkpoint / log."""

        self.meter = BubbleMeter()
        self.deadline = time.perf_counter() + (self.cfg.train.max_minutes or math.inf) * 60
        while not self._done():
            with self.meter.idle("wait"):
                batch = await self._wait_for_batch()
            if batch is None:
                break
            record = await self._update(batch)
            if record is not None:  # None: every group of the batch was poison, purged; wait again
                await self._after_update(record)
        if self._out_of_time():
            log.info("time budget of %g min reached at version %d", self.cfg.train.max_minutes, self.version)

    def _out_of_time(self) -> bool:
        return time.perf_counter() >= self.deadline

    def _done(self) -> bool:
        return self.version >= self.cfg.train.steps or self.stop.is_set() or self._out_of_time()

    async def _wait_for_batch(self) -> list[tuple[Trajectory, ...]] | None:
        """The ``P`` oldest admissible groups, once the store holds them (None: stopped or out of time)."""
        P = self.cfg.batch.prompts
        while True:
            self.feed.housekeeping()
            self.core.ranks.keepalive()  # a sharded learner's other ranks wait for its next operation
            batch = self.store.take_batch(P, self.version, step=self.version + 1)
            if batch is not None or self.stop.is_set() or self._out_of_time():
                return batch
            await self.feed.refill(self.version)

    async def _update(self, batch: list[tuple[Trajectory, ...]]) -> dict[str, Any] | None:
        """One GRPO update on the batch; its staleness is checked against S first. Groups the update
        left out (non-finite loss or gradient) go to the feed; None if that was every group (no update:
        the rest of the batch, if any, goes back to the buffer)."""
        from echo2.learner.trainer import PoisonedBatch

        flat = [t for group in batch for t in group]
        v_t, versions = self.version, [t.policy_version for t in flat]
        delta = v_t - min(versions)
        if delta > self.cfg.staleness.S:  # admission makes this impossible; if it happens it is a bug
            raise Echo2Error(
                f"staleness {delta} > S = {self.cfg.staleness.S} at step {v_t + 1}: admission failed"
            )
        with self.meter.training():
            try:
                stats = await asyncio.to_thread(self.core.update, flat)
            except PoisonedBatch as exc:
                self.feed.poisoned(exc.excluded)
                self.store.requeue_after(self.version)  # what this step took and did not train on
                return None
        if stats.excluded:
            self.feed.poisoned(stats.excluded)
        self.feed.mismatch(stats.mismatch_by_group)
        self.steps += 1
        self.staleness_max = max(self.staleness_max, delta)
        self.t_trains.append(stats.t_train_s)
        rewards = [t.reward for t in flat]
        return {
            m.STEP.key: stats.version,
            **stats.metrics(),
            m.STORE_STALENESS_MEAN.key: v_t - sum(versions) / len(versions),
            m.STORE_STALENESS_MAX.key: delta,
            m.REWARD_MEAN.key: sum(rewards) / len(rewards),
            m.REWARD_UNPARSED.key: sum(1 for t in flat if not t.meta.get("parsed", True)),
            m.DATA_TOKENS_TRAINED.key: sum(len(t.completion_ids) for t in flat) / len(flat),
            **self.core.task.batch_metrics(flat),
        }

    async def _after_update(self, record: dict[str, Any]) -> None:
        """The feed's turn (publication, retargeting), then evaluate, checkpoint and the record."""
        cfg, v = self.cfg, self.version
        await self.feed.after_update(v, self.t_trains, self.meter)
        if self.steps % cfg.train.eval_every == 0 or self._done():
            with self.meter.idle("eval"):
                ev = await self.evaluate()
            if ev is not None:
                record.update({m.REWARD_ACCURACY.key: ev.accuracy, m.REWARD_EVAL_UNPARSED.key: ev.unparsed})
        if v % cfg.train.checkpoint_every == 0:
            with self.meter.idle("checkpoint"):
                saved = await asyncio.to_thread(self._checkpoint, f"step_{v:06d}")
            if saved:
                self.store.prune_consumed(v)  # trained into a durable checkpoint: never requeued
        record[m.CHECKPOINT_FAILED.key] = self.checkpoints_failed
        step = self.meter.close_step()
        stats = self.store.stats()
        record.update(
            {
                m.TIME_S.key: self.meter.step_start - self.meter.start,
                **step,
                **stats.metrics(),
                **self._generated_length(stats.admitted, stats.admitted_tokens),
                **self.feed.metrics(step[m.LEARNER_STEP_WALL_S.key]),
            }
        )
        with self.meter.idle("log"):
            self._record(record)

    def _generated_length(self, admitted: int, tokens: int) -> dict[str, float]:
        """``data/completion_tokens_generated``: the mean completion length of what was admitted since the
        previous record (nothing when nothing was)."""
        n, t = admitted - self._admitted_seen[0], tokens - self._admitted_seen[1]
        self._admitted_seen = (admitted, tokens)
        return {m.DATA_TOKENS_GENERATED.key: t / n} if n > 0 else {}

    def _record(self, record: dict[str, Any]) -> None:
        self.core.run_dir.log(record)
        for watch in self.watchers:
            watch(record)

    def save(self, name: str) -> str:
        """A checkpoint of this version with the optimizer's state and the feed's."""
        return self.core.save(name, optimizer=True, state=self.feed.state())

    def _checkpoint(self, name: str, delays: tuple[float, ...] = RETRY_DELAYS_S) -> bool:
        """:meth:`save`, waiting out a full descriptor table or disk (``resources.retry_exhausted``);
        if it stays full the checkpoint is not written (counted in ``learner/checkpoint_failed``), the
        previous one stands and the trajectories since are kept for the next: the run goes on (any thread)."""
        try:
            self.last_ckpt = retry_exhausted(lambda: self.save(name), f"checkpoint {name}", delays)
        except OSError as exc:
            if not is_exhausted(exc):
                raise
            self.checkpoints_failed += 1
            log.error("checkpoint %s not written (%s); the run goes on from %s", name, exc, self.last_ckpt)
            return False
        return True

    async def finish(self) -> None:
        """Checkpoint what the loop did not, then the feed's end."""
        if self.steps and self.version % self.cfg.train.checkpoint_every:  # the last: try a while longer
            await asyncio.to_thread(self._checkpoint, f"step_{self.version:06d}", FINAL_RETRY_DELAYS_S)
        await self.feed.finish()
        self.final_store = self.store.stats().metrics()

    def summary(self) -> LearnerSummary:
        """The run's summary, also written to ``summary.json`` with the bubble by cause and the feed's."""
        window = self.meter.summary()
        core = self.core
        summary = LearnerSummary(
            run_dir=str(core.run_dir.path),
            steps=self.steps,
            version=self.version,
            resumed_from=core.resumed_from,
            wall_s=float(window["window_s"]),  # type: ignore[arg-type]
            initial_accuracy=core.first_acc,
            final_accuracy=core.last_acc,
            best_accuracy=core.best_acc,
            bubble_ratio=float(window["bubble_ratio"]),  # type: ignore[arg-type]
            staleness_max=self.staleness_max,
            last_checkpoint=self.last_ckpt,
            score=core.task.score,
        )
        extra = {
            "bubble": window,
            "store": self.final_store,
            "t_train_mean_s": sum(self.t_trains) / len(self.t_trains) if self.t_trains else None,
            "staleness_budget": self.cfg.staleness.S,
            "kappa": self.cfg.staleness.effective_kappa,
            **self.feed.summary(),
        }
        scored = {
            k: None if isinstance(v, float) and math.isnan(v) else v for k, v in asdict(summary).items()
        }
        core.run_dir.write_summary({**scored, **extra})  # a score never read is null, not NaN
        return summary
