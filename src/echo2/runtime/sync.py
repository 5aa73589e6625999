"""``echo2 train``: the synchronous loop (S = 0) in one process — generate, reward, update.

Each step samples ``batch.prompts`` training prompts, draws ``batch.group_size`` completions of each
with the current weights (version ``v``), grades them with the task adapter, and makes one GRPO
update (``v -> v + 1``). Held-out greedy accuracy is measured every ``eval_every`` steps and at the
end. Everything lands in the run directory (config.json, metrics.jsonl, checkpoints, summary.json).

In this synchronous loop the learner is idle while rollouts are generated: the SPEC §3 bubble
``1 - update seconds / wall seconds`` counts generation as its ``wait`` cause, and evaluation,
checkpointing and logging as theirs (``observe/bubble.py``), exactly as the asynchronous learner does.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from echo2.config import Config
from echo2.errors import TrainingDivergedError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainSummary:
    run_dir: str  # where config.json, metrics.jsonl and checkpoints are
    steps: int  # learner updates done
    wall_s: float  # seconds of the loop (warm start and the initial evaluation excluded)
    initial_accuracy: float  # held-out greedy accuracy of the starting checkpoint
    final_accuracy: float  # held-out greedy accuracy at the end
    best_accuracy: float  # best held-out accuracy seen at any evaluation
    bubble_ratio: float  # 1 - update seconds / wall seconds of the loop
    last_checkpoint: str  # the checkpoint directory written last
    score: str  # what the held-out numbers measure (Task.score: "accuracy"; "return", "chips" per episode)


def run_sync(cfg: Config, progress: bool = True) -> TrainSummary:
    return SyncLearner(cfg, progress).run()


class SyncLearner:
    def __init__(self, cfg: Config, progress: bool = True) -> None:
        self.cfg = cfg.model_copy(deep=True)
        self.cfg.staleness.S = 0  # the synchronous case by construction; config.json says so
        self.cfg.staleness.kappa = 1
        self.progress = progress

    def run(self) -> TrainSummary:
        from echo2.observe.view import ProgressView

        self.setup()
        view = ProgressView(self.cfg.train, "echo2 train", self.progress)
        try:
            self.main_loop(view.update)
            if self.steps % self.cfg.train.checkpoint_every:  # the last step was not saved in the loop
                self.last_ckpt = self.core.save(f"step_{self.steps:06d}")
        except TrainingDivergedError as exc:  # raised before the optimizer stepped: weights are good
            raise self.core.diverged(exc, self.core.save("last_good"), steps=self.steps) from exc
        finally:
            view.close()
            self.run_dir.close()
        return self.summary()

    def setup(self) -> None:
        """The learner core (run directory, policy, task, trainer, engine: ``core.py``) and the
        starting checkpoint's held-out score."""
        from echo2.models.policy import configure_torch
        from echo2.runtime.core import LearnerCore

        cfg = self.cfg
        configure_torch(cfg)
        core = self.core = LearnerCore.load(cfg, Path(cfg.train.run_dir))
        self.run_dir, self.policy, self.task = core.run_dir, core.policy, core.task
        self.trainer = core.trainer
        self.engine = core.engine  # rollouts are generated on the trainer's own weights (S = 0)
        self.rng = random.Random(f"train:{cfg.seed}")
        first = core.evaluate()
        log.info("starting checkpoint %s: held-out accuracy %.3f", self.policy.source, first.accuracy)
        self.run_dir.log(
            {
                "step": 0,
                "time_s": 0.0,
                "learner/version": 0,
                "reward/accuracy": first.accuracy,
                "reward/eval_unparsed": first.unparsed,
            }
        )
        self.steps, self.last_ckpt = 0, ""

    def main_loop(self, on_step: Any) -> None:
        from echo2.observe.bubble import BubbleMeter

        cfg = self.cfg
        self.meter = BubbleMeter()
        deadline = time.perf_counter() + (cfg.train.max_minutes or math.inf) * 60
        while self.steps < cfg.train.steps:
            record = self.step()
            out_of_time = time.perf_counter() >= deadline
            if self.steps % cfg.train.eval_every == 0 or self.steps == cfg.train.steps or out_of_time:
                with self.meter.idle("eval"):
                    ev = self.core.evaluate()
                record.update({"reward/accuracy": ev.accuracy, "reward/eval_unparsed": ev.unparsed})
            if self.steps % cfg.train.checkpoint_every == 0:
                with self.meter.idle("checkpoint"):
                    self.last_ckpt = self.core.save(f"step_{self.steps:06d}")
            record.update({"time_s": self.meter.timer() - self.meter.start, **self.meter.close_step()})
            with self.meter.idle("log"):
                self.run_dir.log(record)
                on_step(record)
            if out_of_time:
                log.info("time budget of %g min reached after %d steps", cfg.train.max_minutes, self.steps)
                break

    def step(self) -> dict[str, Any]:
        """Generate and grade one batch with the current weights (the learner waits), then update."""
        from echo2.types import Bounds

        cfg, step = self.cfg, self.steps + 1
        with self.meter.idle("wait"):
            batch = self.task.collect(
                self.policy.codec,
                self.engine,
                self.task.sample_train(self.rng, cfg.batch.prompts),
                cfg.batch.group_size,
                seed=cfg.seed * 1_000_003 + step,
                policy_version=self.trainer.version,
                group_prefix=str(step),
                bounds=Bounds.of(cfg),
            )
        with self.meter.training():
            stats = self.trainer.update(batch.trajectories)
        self.steps = step
        rewards = [t.reward for t in batch.trajectories]
        return {
            "step": step,
            **stats.metrics(),
            "store/admitted": len(batch.trajectories),
            "store/dropped_stale": 0,
            "store/rejected": 0,
            "store/staleness_mean": 0.0,
            "store/staleness_max": 0,
            "rollout/t_gen_s": batch.t_gen_s,
            "rollout/tokens": batch.tokens,
            "reward/mean": sum(rewards) / len(rewards),
            "reward/unparsed": batch.unparsed,
        }

    def summary(self) -> TrainSummary:
        window = self.meter.summary()
        summary = TrainSummary(
            run_dir=str(self.run_dir.path),
            steps=self.steps,
            wall_s=float(window["window_s"]),  # type: ignore[arg-type]
            initial_accuracy=self.core.first_acc,
            final_accuracy=self.core.last_acc,
            best_accuracy=self.core.best_acc,
            bubble_ratio=float(window["bubble_ratio"]),
            last_checkpoint=self.last_ckpt,  # type: ignore[arg-type]
            score=self.task.score,
        )
        self.run_dir.write_summary({**asdict(summary), "bubble": window})
        return summary
