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


def _published_engine(policy, sampling):
    """``(weights, engine)``: the bf16 copy a run publishes of ``policy`` and a worker's HF engine on a
    model holding it (the policy itself untouched)."""
    import copy

    from echo2.models.snapshot import install_weights
    from echo2.rollout.engines.hf import HFEngine
    from echo2.weights.delta import sampler_copy

    weights = sampler_copy(policy.model, "bfloat16")
    model = copy.deepcopy(policy.model)
    install_weights(model, weights)
    return weights, HFEngine(model, policy.eos_id, policy.pad_id, sampling)


@pytest.fixture(scope="session")
def published_engine():
    """``published_engine(policy, sampling) -> (weights, engine)``: the bf16 copy a run publishes and a
    worker's HF engine holding it."""
    return _published_engine


CHAT_TEMPLATE = (  # ChatML; a template argument, think, adds a marker to the generation prompt
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if think is defined and not think %}"
    "Answer: {% endif %}{% endif %}"
)


@pytest.fixture
def user_checkpoint(tmp_path):
    """A user's checkpoint as a model hub ships it: a BPE tokenizer (trained here with ``tokenizers``) with
    a ChatML chat template (system messages allowed), a random Qwen3 model, and a generation config
    with two end-of-sequence ids (``<|im_end|>`` and ``<|endoftext|>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    corpus = [f"What is {a} times {b}? Answer: {a * b}" for a in range(12) for b in range(12)]
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(
        corpus,
        trainers.BpeTrainer(  # every byte, as a real byte-level tokenizer has, then merges
            vocab_size=400,
            special_tokens=["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>"
    )
    tok.chat_template = CHAT_TEMPLATE
    cfg = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
    )
    path = tmp_path / "user-ckpt"
    model = Qwen3ForCausalLM(cfg)
    model.generation_config.eos_token_id = [
        tok.convert_tokens_to_ids("<|im_end|>"),
        tok.convert_tokens_to_ids("<|endoftext|>"),
    ]
    model.save_pretrained(path)  # generation_config.json: two end-of-sequence ids, as Qwen3's has
    tok.save_pretrained(path)
    return path


def _registered_worker(settings):
    """A ``RolloutWorker`` whose registration answers with ``settings`` (no learner): what its
    ``setup()`` does with a run's settings before anything else starts."""
    from echo2.protocol import RegisterReply
    from echo2.rollout.worker import RolloutWorker, WorkerOptions

    reply = RegisterReply(
        worker_id="w1", credential="c", public_key="k", broadcast=("127.0.0.1", 1), settings=settings
    )
    worker = RolloutWorker(WorkerOptions(join_url="https://127.0.0.1:1", token="t"), lambda *a: None)

    async def register():
        return reply

    worker._register = register
    return worker


@pytest.fixture(scope="session")
def registered_worker():
    """``registered_worker(settings) -> RolloutWorker`` registered with ``settings``, no learner."""
    return _registered_worker


JUDGE_KEY_VAR = "ECHO2_TEST_JUDGE_KEY"  # the variable a test's judged tasks name for the judge's key


@pytest.fixture
def judge(monkeypatch):
    """An LLM judge stand-in served on loopback (``echo2_bench/judge.py``), its key in this process's
    environment as ``$ECHO2_TEST_JUDGE_KEY`` (the learner's side)."""
    from echo2_bench.judge import LoopbackJudge

    monkeypatch.setenv(JUDGE_KEY_VAR, "sk-the-learners-own")
    with LoopbackJudge() as j:
        yield j
