"""``echo2 train``: the synchronous loop (S = 0) in one process — generate, reward, update.

Each step samples ``prompts_per_step`` training prompts, draws ``group_size`` completions of each
with the current weights (version ``v``), grades them with the task adapter, and makes one GRPO
update (``v -> v + 1``). Held-out greedy accuracy is measured every ``eval_every`` steps and at the
end. Everything lands in the run directory (config.json, metrics.jsonl, checkpoints, summary.json).

In this synchronous loop the learner is idle while rollouts are generated, so the SPEC §3 bubble
ratio ``T_idle / (T_idle + T_train)`` is the share of step time spent generating.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from echo2.config import Config
from echo2.errors import TrainingDivergedError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainSummary:
    run_dir: str  # where config.json, metrics.jsonl and checkpoints are
    steps: int  # learner updates done
    wall_s: float  # seconds from the first step to the end (warm start excluded)
    initial_accuracy: float  # held-out greedy accuracy of the starting checkpoint
    final_accuracy: float  # held-out greedy accuracy at the end
    best_accuracy: float  # best held-out accuracy seen at any evaluation
    last_checkpoint: str  # the checkpoint directory written last


def run_sync(cfg: Config, progress: bool = True) -> TrainSummary:
    from tqdm.auto import tqdm

    from echo2.data.tasks.base import build_task
    from echo2.learner.trainer import GRPOTrainer
    from echo2.models.policy import configure_torch, load_policy
    from echo2.rollout.collect import collect_groups
    from echo2.rollout.engines.hf import HFEngine
    from echo2.rollout.evaluate import evaluate
    from echo2.runtime.rundir import RunDir

    cfg = cfg.model_copy(deep=True)
    cfg.async_.staleness = 0  # this loop is the synchronous case by construction; say so in config.json
    cfg.async_.kappa = 1
    configure_torch(cfg)
    policy = load_policy(cfg)
    run = RunDir(cfg.train.run_dir, cfg.to_dict())
    task = build_task(cfg.task, cfg.seed)
    engine = HFEngine(policy.model, policy.eos_id, policy.pad_id, cfg.sampling)
    trainer = GRPOTrainer(policy.model, cfg.grpo, cfg.sampling.temperature, policy.pad_id)
    rng = random.Random(f"train:{cfg.seed}")
    eval_prompts = task.eval_prompts(cfg.train.eval_size)
    P, G = cfg.grpo.prompts_per_step, cfg.grpo.group_size
    budget_s = cfg.train.max_minutes * 60 if cfg.train.max_minutes else float("inf")

    def save(name: str) -> str:
        return run.save_checkpoint(name, policy, trainer.version)

    first = evaluate(policy, engine, task, eval_prompts)
    log.info("starting checkpoint %s: held-out accuracy %.3f", policy.source, first.accuracy)
    run.log(
        {
            "step": 0,
            "time_s": 0.0,
            "learner/version": 0,
            "reward/accuracy": first.accuracy,
            "reward/eval_unparsed": first.unparsed,
        }
    )
    best = last_acc = first.accuracy
    last_ckpt = ""
    t_start = time.perf_counter()
    t_eval_total = 0.0
    # the bar follows whichever limit binds: the wall-clock budget (seconds) or the step count
    timed_bar = budget_s < float("inf")
    bar = tqdm(
        total=round(budget_s) if timed_bar else cfg.train.steps,
        unit="s" if timed_bar else "step",
        bar_format="{l_bar}{bar}| {n:.0f}/{total} s [{elapsed}<{remaining}{postfix}]" if timed_bar else None,
        disable=not progress,
        desc="echo2 train",
        dynamic_ncols=True,
    )
    step = 0
    try:
        for step in range(1, cfg.train.steps + 1):
            batch = collect_groups(
                policy,
                engine,
                task,
                task.sample_train(rng, P),
                G,
                seed=cfg.seed * 1_000_003 + step,
                policy_version=trainer.version,
                group_prefix=str(step),
            )
            trajectories, t_gen = batch.trajectories, batch.t_gen_s
            stats = trainer.update(trajectories, batch.masks)
            rewards = [t.reward for t in trajectories]
            record: dict[str, Any] = {
                "step": step,
                "time_s": time.perf_counter() - t_start,
                **stats.metrics(),
                "learner/bubble_ratio": t_gen / (t_gen + stats.t_train_s),
                "store/admitted": len(trajectories),
                "store/dropped_stale": 0,
                "store/rejected": 0,
                "store/staleness_mean": 0.0,
                "store/staleness_max": 0,
                "rollout/t_gen_s": t_gen,
                "rollout/tokens": batch.tokens,
                "reward/mean": sum(rewards) / len(rewards),
                "reward/unparsed": batch.unparsed,
            }
            out_of_time = time.perf_counter() - t_start >= budget_s
            if step % cfg.train.eval_every == 0 or step == cfg.train.steps or out_of_time:
                t0 = time.perf_counter()
                ev = evaluate(policy, engine, task, eval_prompts)
                t_eval_total += time.perf_counter() - t0
                last_acc, best = ev.accuracy, max(best, ev.accuracy)
                record["reward/accuracy"] = ev.accuracy
                record["reward/eval_unparsed"] = ev.unparsed
            run.log(record)
            if step % cfg.train.checkpoint_every == 0:
                last_ckpt = save(f"step_{step:06d}")
            bar.update(min(record["time_s"], bar.total) - bar.n if timed_bar else 1)
            bar.set_postfix(
                step=step, v=stats.version, reward=f"{record['reward/mean']:.2f}", acc=f"{last_acc:.2f}"
            )
            if out_of_time:
                log.info("time budget of %g min reached after %d steps", cfg.train.max_minutes, step)
                break
    except TrainingDivergedError as exc:
        # the update raised before the optimizer stepped: the weights are still the last good ones
        good = save("last_good")
        run.write_summary({"error": str(exc), "last_good_checkpoint": good, "steps": step - 1})
        run.close()
        raise TrainingDivergedError(f"{exc}; last good weights saved to {good}") from exc
    finally:
        bar.close()
    if step % cfg.train.checkpoint_every:  # the last step was not already checkpointed in the loop
        last_ckpt = save(f"step_{step:06d}")
    summary = TrainSummary(
        run_dir=str(run.path),
        steps=step,
        wall_s=time.perf_counter() - t_start,
        initial_accuracy=first.accuracy,
        final_accuracy=last_acc,
        best_accuracy=best,
        last_checkpoint=last_ckpt,
    )
    run.write_summary({**asdict(summary), "eval_s": t_eval_total})
    run.close()
    return summary
