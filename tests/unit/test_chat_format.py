"""Chat models as they ship: a system message, the template's own arguments, and every end-of-sequence id
of the generation config ending a completion (models/policy.py; the engines, the learner's checks and the
worker agree on them)."""

from __future__ import annotations

import json

import pytest

from echo2.config import Config, load_config
from echo2.data.store import Lease
from echo2.data.submission import Rejected, Submission
from echo2.errors import CheckpointError
from echo2.models.policy import ChatFormat, TextCodec, generation_eos_ids, load_checkpoint
from echo2.rollout.engines.hf import HFEngine
from echo2.runtime.node import worker_settings
from echo2.tasks.verify import Verifier
from echo2.types import Prompt, Trajectory


def test_two_eos_ids_a_system_message_and_template_arguments(user_checkpoint):
    chat = ChatFormat.of(True, "Be brief.", {"think": False})
    policy = load_checkpoint(user_checkpoint, chat)
    tok = policy.tokenizer
    im_end, eot = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    assert policy.eos_ids == (im_end, eot)  # the tokenizer's, then the generation config's other one
    text = tok.decode(policy.codec.encode_prompt("What is 2 times 3?"))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\nAnswer: ")  # the template argument took effect
    plain = tok.decode(load_checkpoint(user_checkpoint, True).codec.encode_prompt("What is 2 times 3?"))
    assert "system" not in plain and plain.endswith("assistant\n")
    # a record's own system message wins over the configured one
    p = Prompt("q:1", "What is 2 times 3?", "6", {"system": "Think."})
    assert tok.decode(policy.codec.encode(p)).startswith("<|im_start|>system\nThink.<|im_end|>")


def test_a_completion_ends_at_any_eos_id_in_the_engine(user_checkpoint):
    policy = load_checkpoint(user_checkpoint, True)
    prompt = policy.codec.encode_prompt("What is 2 times 3?")
    free = HFEngine(policy.model, policy.eos_ids, policy.pad_id, _sampling(6))
    first = free.generate([prompt], seed=0, greedy=True)[0].completion_ids[0]  # what the random model says
    stop = HFEngine(policy.model, (policy.eos_id, first), policy.pad_id, _sampling(6))
    (s,) = stop.generate([prompt], seed=0, greedy=True)
    assert s.completion_ids == (first,) and s.finished  # the second id ended it at once


def test_the_learner_checks_accept_either_eos_and_nothing_after_it(user_checkpoint):
    policy = load_checkpoint(user_checkpoint, True)
    im_end, eot = policy.eos_ids
    task_cfg = load_config(overrides=["task.name=math"]).task
    from echo2.tasks.registry import build_task

    task = build_task(task_cfg, 0).data
    verifier = Verifier(policy.codec, task, policy.eos_ids, 6)
    prompt = Prompt("q:1", "What is 2 times 3?", "6")
    ids = tuple(policy.codec.encode(prompt))

    def submit(completion: tuple[int, ...]) -> None:
        t = Trajectory("q:1", "L:0", ids, completion, (-1.0,) * len(completion), 0.0, 0)
        lease = Lease("L", "w", "open", 0.0, (prompt,), 1, 0)
        verifier.check(lease, Submission("L", 0, ((t, t),)))

    submit((7, eot))  # the generation config's id ends it
    submit((7, im_end))  # the tokenizer's
    with pytest.raises(Rejected, match="tokens after EOS"):
        submit((7, eot, 9))


def test_bad_chat_settings_and_generation_configs_are_refused_in_one_line(user_checkpoint):
    with pytest.raises(ValueError, match="need chat_template = true"):
        Config.model_validate({"model": {"system_prompt": "x"}})
    with pytest.raises(ValueError, match="identifiers"):
        Config.model_validate({"model": {"chat_template": True, "chat_template_kwargs": {"a b": 1}}})
    with pytest.raises(ValueError, match="system_field"):
        Config.model_validate({"task": {"name": "math", "system_field": "sys"}})
    cfg = load_config(
        overrides=["model.chat_template=true", "model.chat_template_kwargs.enable_thinking=false"]
    )
    assert cfg.model.chat_template_kwargs == {"enable_thinking": False}
    (user_checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": ["x"]}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: eos_token_id"):
        load_checkpoint(user_checkpoint)
    (user_checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": 99999}))
    with pytest.raises(CheckpointError, match="outside the model's vocabulary"):
        load_checkpoint(user_checkpoint)
    (user_checkpoint / "generation_config.json").unlink()
    assert generation_eos_ids(user_checkpoint) == ()
    assert load_checkpoint(user_checkpoint).eos_ids == (load_checkpoint(user_checkpoint).eos_id,)
    # a template that cannot take a system message fails when the checkpoint loads, not mid-run
    no_system = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}x"
    jinja = user_checkpoint / "chat_template.jinja"  # where transformers 5 saves it; else in tokenizer_config
    if jinja.is_file():
        jinja.write_text(no_system)
    else:
        cfg_file = user_checkpoint / "tokenizer_config.json"
        cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "chat_template": no_system}))
    with pytest.raises(CheckpointError, match="chat template"):
        load_checkpoint(user_checkpoint, ChatFormat.of(True, "sys"))


def test_workers_are_told_the_eos_ids_and_the_chat_format():
    cfg = load_config(
        overrides=[
            "model.chat_template=true",
            "model.system_prompt='Be brief.'",
            "model.chat_template_kwargs.t=1",
        ]
    )
    st = worker_settings(cfg, (5, 7))
    assert st.eos_ids == [5, 7] and st.system_prompt == "Be brief." and st.chat_template_kwargs == {"t": 1}
    codec = TextCodec.of(object(), ChatFormat.of(st.chat_template, st.system_prompt, st.chat_template_kwargs))
    assert codec.chat == ChatFormat.of(True, "Be brief.", {"t": 1})


def _sampling(n: int):
    from echo2.config import SamplingConfig

    return SamplingConfig(max_new_tokens=n)
