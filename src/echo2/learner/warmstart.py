"""Warm start recipes: short supervised training of the embedded model on its task.

Real post-training starts from a pretrained model that solves the task sometimes. The embedded
model starts from random weights, so echo2 first fits it: on reference answers for a single-turn task
(:func:`supervised`: teacher forcing, loss on answer tokens only), on a scripted teacher's episodes for
an environment (:func:`imitate`); both stop at the first evaluation on the task's *validation* split
(never the test split runs report) that reaches ``warmstart.target_accuracy``. Each task picks its
recipe (``echo2.tasks``); ``echo2/tasks/warm_cache.py`` caches the result under a key derived from the
seed and the configs, so every run with the same settings starts from the same weights.

Loading a model (``models/policy.py``) never trains one.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo2.config import Config
from echo2.data.tasks.base import WritesReference
from echo2.data.tasks.environment import EnvironmentTask
from echo2.types import Prompt

if TYPE_CHECKING:
    from echo2.data.tasks.base import Adapter

log = logging.getLogger(__name__)


def supervised(cfg: Config, policy: Any, task: Adapter, out: Path) -> dict[str, float | int | str]:
    """Warm start of a single-turn task: teacher-forced steps on its reference answers until the greedy
    validation accuracy reaches ``warmstart.target_accuracy`` (or ``max_steps``); saved under ``out``."""
    import torch

    from echo2.rollout.engines.hf import HFEngine
    from echo2.rollout.evaluate import evaluate_text

    ws = cfg.model.warmstart
    model = policy.model
    reference = task.reference if isinstance(task, WritesReference) else (lambda p: p.answer)
    engine = HFEngine(model, policy.eos_id, policy.pad_id, cfg.sampling)
    val_prompts = task.validation_prompts(ws.eval_size)  # never the test split (task.eval_prompts)
    rng = random.Random(f"warmstart:{cfg.seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr)
    log.info("warm start: supervised training until validation accuracy >= %.2f", ws.target_accuracy)
    t0 = time.perf_counter()
    accuracy = evaluate_text(policy.codec, engine, task, val_prompts).accuracy
    step = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        while accuracy < ws.target_accuracy and step < ws.max_steps:
            loss = _sft_step(policy, opt, task.sample_train(rng, ws.batch_size), reference)
            step += 1
            if step % ws.eval_every == 0:
                accuracy = evaluate_text(policy.codec, engine, task, val_prompts).accuracy
                log.info("warm start step %d: loss %.3f, validation accuracy %.3f", step, loss, accuracy)
    _short_of_target("accuracy", accuracy, ws.target_accuracy, step)
    policy.save(out)
    return {"steps": step, "validation_accuracy": accuracy, "seconds": round(time.perf_counter() - t0, 2)}


def imitate(cfg: Config, policy: Any, task: EnvironmentTask, out: Path) -> dict[str, float | int | str]:
    """Warm start of an environment task: imitate its scripted teacher (``EnvSpec.teacher``) on whole
    episodes the teacher plays, loss on the policy's turns only, until the model's greedy choice agrees
    with the teacher on ``warmstart.target_accuracy`` of the validation episodes' decisions (teacher-
    forced: the model predicts each of the teacher's actions given the teacher's transcript so far)."""
    import torch

    ws = cfg.model.warmstart
    codec, eos, limit = policy.codec, policy.eos_id, cfg.context_tokens()
    val = [teacher_transcript(codec, eos, task, p, limit) for p in task.validation_prompts(ws.eval_size)]
    rng = random.Random(f"warmstart:{cfg.seed}")
    opt = torch.optim.AdamW(policy.model.parameters(), lr=ws.lr)
    log.info("warm start: imitating the teacher until validation agreement >= %.2f", ws.target_accuracy)
    t0 = time.perf_counter()
    agreement, step = _agreement(policy, val), 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        while agreement < ws.target_accuracy and step < ws.max_steps:
            prompts = task.sample_train(rng, ws.batch_size)
            loss = _fit(policy, opt, [teacher_transcript(codec, eos, task, p, limit) for p in prompts])
            step += 1
            if step % ws.eval_every == 0:
                agreement = _agreement(policy, val)
                log.info("warm start step %d: loss %.3f, validation agreement %.3f", step, loss, agreement)
    _short_of_target("agreement", agreement, ws.target_accuracy, step)
    policy.save(out)
    return {"steps": step, "validation_agreement": agreement, "seconds": round(time.perf_counter() - t0, 2)}


def _short_of_target(what: str, got: float, target: float, steps: int) -> None:
    """One WARNING when the warm start used up ``max_steps`` under its target: RL then starts from a model
    that the task's grader rarely rewards, which is as often a grader that rewards nothing (a reward that
    raises, reads the wrong field) as a task too hard for the embedded model."""
    if got < target:
        log.warning(
            "warm start stopped after %d steps (model.warmstart.max_steps) at validation %s %.3f, under its "
            "target %.2f: check that the task's grader rewards its own reference answers",
            steps, what, got, target,
        )  # fmt: skip


def teacher_transcript(
    codec: Any, eos_id: int, task: EnvironmentTask, prompt: Prompt, max_context: int
) -> tuple[list[int], list[int]]:
    """The episode of ``prompt`` played by the teacher, as one row of (token ids, 1 on the teacher's
    action tokens and EOS): the transcript format of ``rollout/episodes.py``. A self-play prompt is
    played against the teacher's own style instead (the warm start has no earlier snapshot)."""
    spec = task.spec
    if prompt.meta.get("opponent") == "selfplay":
        prompt = task.prompt(int(prompt.meta["seed"]), spec.fixed_meta(0))
    env = spec.make(prompt)
    ids = codec.encode_prompt(env.reset(int(prompt.meta["seed"])))
    flags = [0] * len(ids)
    for _ in range(spec.max_turns):
        action = [*codec.encode_prompt(spec.teacher(env)), eos_id]
        step = env.step(codec.decode_completion(action))
        ids += action
        flags += [1] * len(action)
        if step.done:
            break
        obs = codec.encode_prompt(step.observation)
        if len(ids) + len(obs) + len(action) > max_context:
            break
        ids += obs
        flags += [0] * len(obs)
    return ids, flags


def _agreement(policy: Any, rows: list[tuple[list[int], list[int]]]) -> float:
    """Share of the teacher's actions (runs of flagged tokens) whose every token is the model's argmax."""
    import torch

    model = policy.model
    was = model.training
    model.eval()
    hits = total = 0
    with torch.no_grad():
        for i in range(0, len(rows), 64):
            chunk = rows[i : i + 64]
            ids, _, attn = _padded(chunk, policy.pad_id)
            pred = model(input_ids=ids, attention_mask=attn).logits.argmax(-1)
            for b, (x, m) in enumerate(chunk):
                ok = True
                for j in range(1, len(x)):
                    if m[j]:
                        ok = ok and bool(pred[b, j - 1] == ids[b, j])
                    if m[j] and (j + 1 == len(x) or not m[j + 1]):  # the action ends here
                        hits += ok
                        total += 1
                        ok = True
    model.train(was)
    return hits / max(total, 1)


def _sft_step(policy: Any, opt: Any, prompts: list[Prompt], reference: Callable[[Prompt], str]) -> float:
    """One teacher-forced step on reference answers (loss on the answer tokens and EOS only)."""
    rows = []
    for p in prompts:
        x, y = policy.codec.encode(p), [*policy.encode_prompt(reference(p)), policy.eos_id]
        rows.append((x + y, [0] * len(x) + [1] * len(y)))
    return _fit(policy, opt, rows)


def _padded(rows: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[Any, Any, Any]:
    """(ids, labels, attention) of rows of (token ids, 1 where the token is a target), right-padded."""
    import torch

    L = max(len(x) for x, _ in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), L), -100, dtype=torch.long)
    attn = torch.zeros((len(rows), L), dtype=torch.long)
    for i, (x, m) in enumerate(rows):
        t = torch.tensor(x)
        ids[i, : len(x)] = t
        labels[i, : len(x)] = torch.where(torch.tensor(m, dtype=torch.bool), t, -100)
        attn[i, : len(x)] = 1
    return ids, labels, attn


def _fit(policy: Any, opt: Any, rows: list[tuple[list[int], list[int]]]) -> float:
    """One teacher-forced step: loss on the flagged tokens of each row only."""
    import torch

    model = policy.model
    model.train()
    ids, labels, attn = _padded(rows, policy.pad_id)
    loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.detach())
