"""Warm start: short supervised training of the embedded model on its task, cached on disk.

Real post-training starts from a pretrained model that solves the task sometimes. The embedded
model starts from random weights, so echo2 first fits it on reference answers (teacher forcing,
loss on answer tokens only) and stops at the first held-out evaluation whose greedy accuracy reaches
``warmstart.target_accuracy``. The result is deterministic in the seed and the configs, and cached
under a key derived from them, so every run with the same settings starts from the same weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

from echo2.config import Config

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when the recipe changes, so old caches are not reused


def cache_root(cfg: Config) -> Path:
    if cfg.model.warmstart.cache_dir:
        return Path(cfg.model.warmstart.cache_dir).expanduser()
    base = os.environ.get("ECHO2_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "echo2")
    return Path(base)


def cache_key(cfg: Config) -> str:
    ws = cfg.model.warmstart.model_dump(exclude={"cache_dir"})
    blob = json.dumps(
        {
            "format": FORMAT_VERSION,
            "seed": cfg.seed,
            "embedded": cfg.model.embedded.model_dump(),
            "warmstart": ws,
            "task": cfg.task.model_dump(),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def warmstart_checkpoint(cfg: Config) -> Path:
    """The cached warm-started checkpoint directory for ``cfg``, training it first if absent."""
    target = cache_root(cfg) / "warmstart" / cache_key(cfg)
    if (target / "warmstart.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        info = _train(cfg, tmp)
        (tmp / "warmstart.json").write_text(json.dumps(info, indent=2))
        try:
            tmp.rename(target)
        except OSError:  # another process finished the same key first; theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _train(cfg: Config, out: Path) -> dict[str, float | int | str]:
    import torch

    from echo2.data.tasks.base import build_task
    from echo2.models.embedded import build_model, build_tokenizer
    from echo2.models.policy import Policy
    from echo2.rollout.engines.hf import HFEngine
    from echo2.rollout.evaluate import evaluate

    ws = cfg.model.warmstart
    tokenizer = build_tokenizer()
    model = build_model(cfg.model.embedded, tokenizer, seed=cfg.seed)
    policy = Policy(model, tokenizer, tokenizer.eos_token_id, tokenizer.pad_token_id, False, "embedded")
    task = build_task(cfg.task, cfg.seed)
    engine = HFEngine(model, policy.eos_id, policy.pad_id, cfg.sampling)
    eval_prompts = task.eval_prompts(ws.eval_size)
    rng = random.Random(f"warmstart:{cfg.seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr)
    log.info(
        "warm start: supervised training of the embedded model until held-out accuracy >= %.2f",
        ws.target_accuracy,
    )
    t0 = time.perf_counter()
    accuracy = evaluate(policy, engine, task, eval_prompts).accuracy
    step = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        while accuracy < ws.target_accuracy and step < ws.max_steps:
            model.train()
            prompts = task.sample_train(rng, ws.batch_size)
            rows = [
                (policy.encode_prompt(p.text), [*policy.encode_prompt(p.answer), policy.eos_id])
                for p in prompts
            ]
            L = max(len(x) + len(y) for x, y in rows)
            ids = torch.full((len(rows), L), policy.pad_id, dtype=torch.long)
            labels = torch.full((len(rows), L), -100, dtype=torch.long)
            attn = torch.zeros((len(rows), L), dtype=torch.long)
            for i, (x, y) in enumerate(rows):
                ids[i, : len(x) + len(y)] = torch.tensor(x + y)
                labels[i, len(x) : len(x) + len(y)] = torch.tensor(y)
                attn[i, : len(x) + len(y)] = 1
            loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            if step % ws.eval_every == 0:
                accuracy = evaluate(policy, engine, task, eval_prompts).accuracy
                log.info(
                    "warm start step %d: loss %.3f, held-out accuracy %.3f",
                    step,
                    float(loss.detach()),
                    accuracy,
                )
    policy.save(out)
    info: dict[str, float | int | str] = {
        "steps": step,
        "heldout_accuracy": accuracy,
        "seconds": round(time.perf_counter() - t0, 2),
        "key": cache_key(cfg),
    }
    log.info("warm start done: %s", info)
    return info
