"""``echo2 train``: the learner loop (``loop.py``) at S = 0 in one process, fed by generation on the
trainer's own weights.

The loop is the node's: it takes ``batch.prompts`` groups from a trajectory store, checks their
staleness, updates, evaluates every ``eval_every`` steps, checkpoints every ``checkpoint_every`` and
writes every record to the run directory (config.json, metrics.jsonl, checkpoints, summary.json). Only
the feed differs: when the store is short of a batch, :class:`LocalFeed` samples ``batch.prompts``
training prompts, draws ``batch.group_size`` completions of each with the current weights (version
``v``: no copy of the weights travels, the engine runs on the trainer's own), grades them with the task
and submits them to the store under a lease of its own, through the same admission as a worker's. With
``S = 0`` the store admits only groups of the current version, so every update trains on its own
version's samples.

While generating, the learner is idle: the SPEC §3 bubble ``1 - update seconds / wall seconds`` counts
generation as its ``wait`` cause, and evaluation, checkpointing and logging as theirs
(``observe/bubble.py``), exactly as the node does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo2.config import Config
from echo2.observe import catalog as m
from echo2.runtime.loop import LearnerLoop, LearnerSummary
from echo2.runtime.prompts import PromptSource
from echo2.types import Bounds

if TYPE_CHECKING:
    from echo2.data.store import TrajectoryStore
    from echo2.observe.bubble import BubbleMeter
    from echo2.runtime.core import LearnerCore
    from echo2.types import Prompt

WORKER_ID = "local"  # the leases of the in-process generation
LEASE_TTL_S = 1e9  # never expires: nobody else could answer it


def train(cfg: Config, on_step: Callable[[dict[str, Any]], None] | None = None) -> LearnerSummary:
    """Run ``echo2 train`` on ``cfg`` (S and kappa forced to the synchronous case; config.json says so)."""
    return asyncio.run(_train(synchronous(cfg), on_step))


def synchronous(cfg: Config) -> Config:
    """``cfg`` at S = 0, kappa = 1: the only staleness generation on the trainer's own weights has."""
    cfg = cfg.model_copy(deep=True)
    cfg.staleness.S = 0
    cfg.staleness.kappa = 1
    return cfg


async def _train(cfg: Config, on_step: Callable[[dict[str, Any]], None] | None) -> LearnerSummary:
    from echo2.data.store import TrajectoryStore
    from echo2.models.policy import configure_torch
    from echo2.runtime.core import LearnerCore

    configure_torch(cfg)
    core = LearnerCore.load(cfg, Path(cfg.train.run_dir))
    store = TrajectoryStore(":memory:", cfg.staleness.S, cfg.batch.group_size, cfg.grpo.drop_zero_variance)
    try:
        watchers = [on_step] if on_step is not None else []
        return await LearnerLoop(core, store, LocalFeed(core, store), watchers).run()
    finally:
        store.close()
        core.run_dir.close()


class LocalFeed:
    """The :class:`~echo2.runtime.loop.Feed` of ``echo2 train``: each refill generates one batch with
    the trainer's weights and submits it to the store."""

    def __init__(self, core: LearnerCore, store: TrajectoryStore) -> None:

        self.core, self.store = core, store
        self.prompts = PromptSource(core.task, core.cfg.seed)  # the node's: epochs of a finite split
        self.last: dict[str, float] = {}  # the newest generation's rollout/ metrics

    def housekeeping(self) -> None:
        pass

    async def refill(self, version: int) -> None:
        """``batch.prompts`` prompts, ``batch.group_size`` samples each, at ``version`` (the learner
        waits: this is its ``wait``), admitted by the store like a worker's submission (the store is
        used on the loop's thread, generation on another)."""
        from echo2.data.submission import Submission

        cfg = self.core.cfg
        self.prompts.redo(self.store.take_redo())
        prompts = self.prompts.take(cfg.batch.prompts)
        lease_id = self.store.issue_lease(
            WORKER_ID, prompts, time.time(), ttl_s=LEASE_TTL_S, installed_version=version
        )
        batch = await asyncio.to_thread(self._generate, prompts, version, lease_id)
        G, ts = cfg.batch.group_size, batch.trajectories
        groups = tuple(tuple(ts[i : i + G]) for i in range(0, len(ts), G))
        self.store.submit(Submission(lease_id, version, groups), WORKER_ID, version, time.time())
        self.last = {m.ROLLOUT_T_GEN_S.key: batch.t_gen_s, m.ROLLOUT_TOKENS.key: batch.tokens}

    def _generate(self, prompts: list[Prompt], version: int, lease_id: str) -> Any:
        cfg = self.core.cfg
        return self.core.task.collect(
            self.core.policy.codec,
            self.core.engine,
            prompts,
            cfg.batch.group_size,
            seed=cfg.seed * 1_000_003 + version + 1,
            policy_version=version,
            group_prefix=lease_id,
            bounds=Bounds.of(cfg),
        )

    def poisoned(self, group_ids: tuple[str, ...]) -> None:
        """Never called: the trainer here does not isolate (a non-finite update ends the run, with the
        last good weights saved), so there is no sender to blame but the run itself."""
        self.store.purge_groups(group_ids)

    def mismatch(self, by_group: dict[str, tuple[float, float]]) -> None:
        pass  # one process samples and trains: no workers to tell apart

    async def after_update(self, version: int, t_trains: Sequence[float], meter: BubbleMeter) -> None:
        pass  # nothing to publish: the next generation runs on the trainer's weights

    def metrics(self, step_wall_s: float) -> dict[str, float]:
        return {**self.last, **self.prompts.metrics()}

    def state(self) -> dict[str, Any]:
        return {"leases": self.prompts.state()}

    async def finish(self) -> None:
        pass

    def summary(self) -> dict[str, Any]:
        return {}
