"""The warm start cache: a run that starts from the embedded model starts from its task's warm start
(``Task.warm_start``: supervised answers, or a scripted teacher), trained once per settings and cached
on disk under a key derived from the seed and the configs, so every run with the same settings starts
from the same weights.

This is a learner-side step, called explicitly (:func:`starting_checkpoint`): loading a model
(``models/policy.py``) never trains it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from echo2.config import Config

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # bump when the recipe changes, so old caches are not reused (2: stop on validation)


def starting_checkpoint(cfg: Config) -> Path:
    """The checkpoint a run starts from: ``model.path`` when set, else the embedded model's warm start
    (trained now if it is not cached)."""
    if cfg.model.path is not None:
        return Path(cfg.model.path)
    return warmstart_checkpoint(cfg)


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
    """Build the embedded model from its seed and let the task warm it up into ``out``."""
    from echo2.models.embedded import build_model, build_tokenizer
    from echo2.models.policy import Policy
    from echo2.tasks.registry import build_task

    tokenizer = build_tokenizer()
    model = build_model(cfg.model.embedded, tokenizer, seed=cfg.seed)
    policy = Policy(model, tokenizer, tokenizer.eos_token_id, tokenizer.pad_token_id, False, "embedded")
    info = {**build_task(cfg.task, cfg.seed).warm_start(cfg, policy, out), "key": cache_key(cfg)}
    log.info("warm start done: %s", info)
    return info
