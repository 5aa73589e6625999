"""The learner core under the one learner loop (``loop.py``) of both learner processes (``echo2
train``, ``local.py``; the node of ``echo2 run`` / ``echo2 learner``, ``learner.py``): the run
directory and its trackers, the policy (a checkpoint to resume, else the starting checkpoint: the
user's, or the embedded model's warm start), the task, the GRPO trainer and an engine on the
trainer's own weights; held-out evaluation and its running first / best / last readings;
checkpoints; and what a diverged update leaves behind (the last good weights, a summary naming the error).

What differs between the two processes is the loop's feed: where the store's groups come from
(generated in-process with the current weights, or submitted by workers) and what a step does around
the update (publish, retarget the pool).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo2.config import Config
from echo2.errors import TrainingDivergedError
from echo2.observe.rundir import OPTIM_FILE, STATE_FILE, RunDir
from echo2.tasks.base import Task
from echo2.types import Bounds

log = logging.getLogger(__name__)
TOY_LR_FLOOR = 1e-4  # a learning rate at least this large with a user's checkpoint is warned about

if TYPE_CHECKING:
    from echo2.learner.trainer import GRPOTrainer
    from echo2.models.policy import Policy
    from echo2.rollout.engines.hf import HFEngine
    from echo2.rollout.evaluate import EvalResult


@dataclass
class LearnerCore:
    """The learning plane of one learner process (:meth:`load` builds it)."""

    cfg: Config
    run_dir: RunDir
    policy: Policy
    task: Task
    trainer: GRPOTrainer
    engine: HFEngine  # greedy evaluation on the trainer's own weights
    resumed_from: int | None  # the checkpoint version this process resumed (None: a fresh run)
    eval_prompts: list[Any] = field(default_factory=list)
    first_acc: float = math.nan  # held-out score when this process started
    best_acc: float = math.nan  # best held-out score seen
    last_acc: float = math.nan  # newest held-out score

    @classmethod
    def load(
        cls, cfg: Config, run_path: Path, ckpt: Path | None = None, *, isolate: bool = False
    ) -> LearnerCore:
        """Trackers first (a missing package fails before the warm start), then the run directory (a
        fresh run clears an old run's outputs, a resumed one keeps them), the policy from ``ckpt`` (with
        its version and optimizer state) or the starting checkpoint, the task, the trainer (``isolate``:
        a non-finite group is left out of an update instead of ending it) and the engine."""
        import torch

        from echo2.learner.sharded import load_states
        from echo2.learner.trainer import GRPOTrainer
        from echo2.models.policy import DCP_DIR, chat_format, load_checkpoint, resolve_device
        from echo2.observe.trackers import start_trackers
        from echo2.rollout.engines.hf import HFEngine
        from echo2.tasks.registry import build_task
        from echo2.tasks.warmstart import starting_checkpoint

        sinks = start_trackers(cfg.train.report_to, run_path, run_path.resolve().name, cfg.to_dict())
        run_dir = RunDir(run_path, cfg.to_dict(), resume=ckpt is not None, sinks=sinks, background=True)
        device = resolve_device(cfg.learner.device)
        if cfg.model.path is not None and cfg.grpo.lr >= TOY_LR_FLOOR:
            log.warning(
                "grpo.lr = %g is the embedded toy model's learning rate; RL on a pretrained LLM usually "
                "uses 1e-6 to 3e-6 (configs/math_qwen3.toml): set grpo.lr",
                cfg.grpo.lr,
            )
        policy = load_checkpoint(ckpt or starting_checkpoint(cfg), chat_format(cfg))
        policy.model.to(device)
        version0 = json.loads((ckpt / STATE_FILE).read_text())["version"] if ckpt else 0
        task = build_task(cfg.task, cfg.seed)
        trainer = GRPOTrainer(
            policy.model,
            cfg.grpo,
            cfg.sampling,
            policy.pad_id,
            task.token_mask,
            version0,
            isolate=isolate,
            learner=cfg.learner,
        )
        if ckpt is not None and (ckpt / DCP_DIR).is_dir():  # a sharded learner's: any world size loads it
            load_states(ckpt / DCP_DIR, policy.model, trainer.optimizer)
        elif ckpt is not None and (ckpt / OPTIM_FILE).is_file():
            state = torch.load(ckpt / OPTIM_FILE, weights_only=True, map_location=device)
            trainer.optimizer.load_state_dict(state)
        engine = HFEngine.on_policy(policy, cfg.sampling, cfg.learner.micro_batch_tokens)
        core = cls(cfg, run_dir, policy, task, trainer, engine, version0 if ckpt else None)
        core.eval_prompts = task.eval_prompts(cfg.train.eval_size)
        return core

    @property
    def version(self) -> int:
        """The learner's ``v_t`` (the trainer is its one provider)."""
        return self.trainer.version

    def evaluate(self) -> EvalResult:
        """The task's greedy held-out score of the current weights, in the update's precision and in
        batches of at most ``learner.micro_batch_tokens`` tokens; the running readings follow it (the
        first call sets the starting one)."""
        with (
            self.trainer.autocast()
        ):  # the update's precision (entered in this thread: autocast is per thread)
            ev = self.task.evaluate(self.policy.codec, self.engine, self.eval_prompts, Bounds.of(self.cfg))
        if math.isnan(self.first_acc):
            self.first_acc = self.best_acc = ev.accuracy
        self.last_acc, self.best_acc = ev.accuracy, max(self.best_acc, ev.accuracy)
        return ev

    def save(self, name: str, optimizer: bool = False, state: dict[str, Any] | None = None) -> str:
        """A crash-consistent checkpoint of the weights at this version (the optimizer's state too when
        asked, and ``state``) under ``checkpoints/<name>``; returns its path."""
        opt = self.trainer.optimizer if optimizer else None
        return self.run_dir.save_checkpoint(name, self.policy, self.version, opt, state)

    def diverged(self, exc: TrainingDivergedError, good: str, **summary: Any) -> TrainingDivergedError:
        """What a diverged update leaves: the summary names the error and the last good weights (saved
        by the caller as ``good``, before the optimizer stepped); the error to raise says where they are."""
        self.run_dir.write_summary({"error": str(exc), "last_good_checkpoint": good, **summary})
        return TrainingDivergedError(f"{exc}; last good weights saved to {good}")
