"""Shared fixtures. Tests track what they start by pid and leave no global state behind."""

from __future__ import annotations

import pytest


@pytest.fixture
def tiny_overrides(tmp_path) -> list[str]:
    """Config overrides for a very small embedded model whose warm start takes seconds."""
    return [
        "model.embedded.hidden_size=32",
        "model.embedded.intermediate_size=64",
        "model.embedded.num_layers=1",
        "model.embedded.num_heads=2",
        "model.embedded.num_kv_heads=1",
        "model.warmstart.max_steps=20",
        "model.warmstart.eval_every=10",
        "model.warmstart.eval_size=16",
        "model.warmstart.target_accuracy=0.9",
        f"model.warmstart.cache_dir={str(tmp_path / 'cache')!r}",
        "task.max_value=9",
        "batch.prompts=4",
        "batch.group_size=4",
        "train.eval_size=16",
        "train.eval_every=5",
        "train.checkpoint_every=5",
        f"train.run_dir={str(tmp_path / 'run')!r}",
        "train.threads=1",
    ]


def _tiny_policy():
    from echo2.config import EmbeddedModelConfig
    from echo2.models.embedded import build_model, build_tokenizer
    from echo2.models.policy import Policy

    tok = build_tokenizer()
    cfg = EmbeddedModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    model = build_model(cfg, tok, seed=0)
    return Policy(model, tok, tok.eos_token_id, tok.pad_token_id, False, "embedded")


@pytest.fixture
def tiny_policy_factory():
    """A function that builds a fresh tiny embedded policy, the same weights every call."""
    return _tiny_policy


@pytest.fixture
def tiny_policy():
    """A freshly initialised tiny embedded policy (no warm start)."""
    return _tiny_policy()


@pytest.fixture(scope="module")
def tiny_policy_module():
    """The same, shared by a module's tests (which must not change it)."""
    return _tiny_policy()
