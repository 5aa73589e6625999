import pytest
import torch

from echo2.config import SamplingConfig
from echo2.learner.grpo import token_logprobs
from echo2.rollout.engines.hf import HFEngine
from echo2.rollout.sampling import top_p_filter


def test_top_p_keeps_smallest_nucleus():
    # probs .5 .3 .15 .05 ; top_p .7 -> keep .5 and .3 (mass before .3 is .5 < .7, before .15 is .8)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(top_p_filter(logits, 0.7))
    assert kept.tolist() == [[True, True, False, False]]
    assert torch.isfinite(top_p_filter(logits, 0.01)).sum() == 1  # the argmax always stays
    assert torch.equal(top_p_filter(logits, 1.0), logits)


def test_engine_is_deterministic_under_seed(tiny_policy):
    engine = HFEngine(
        tiny_policy.model, tiny_policy.eos_id, tiny_policy.pad_id, SamplingConfig(max_new_tokens=6)
    )
    prompts = [tiny_policy.encode_prompt("12+3="), tiny_policy.encode_prompt("7-5=")] * 3
    a = engine.generate(prompts, seed=7)
    b = engine.generate(prompts, seed=7)
    c = engine.generate(prompts, seed=8)
    assert a == b
    assert a != c
    for s in a:
        assert len(s.completion_ids) == len(s.logprobs) <= 6
        assert all(lp <= 0 for lp in s.logprobs)
        assert s.finished == (s.completion_ids[-1] == tiny_policy.eos_id)


def test_sampler_logprobs_match_learner_recompute(tiny_policy):
    """Batched, left-padded, KV-cached sampling must give the log-probs the learner recomputes
    on the unpadded sequence; otherwise on-policy IS weights would not be 1."""
    temp = 0.8
    engine = HFEngine(
        tiny_policy.model,
        tiny_policy.eos_id,
        tiny_policy.pad_id,
        SamplingConfig(temperature=temp, max_new_tokens=5),
    )
    prompts = [tiny_policy.encode_prompt("1+2="), tiny_policy.encode_prompt("345+67=")]
    for prompt, s in zip(prompts, engine.generate(prompts, seed=3), strict=True):
        ids = torch.tensor([prompt + list(s.completion_ids)])
        with torch.no_grad():
            logits = tiny_policy.model(input_ids=ids).logits[:, len(prompt) - 1 : -1]
        recomputed = token_logprobs(logits, torch.tensor([s.completion_ids]), temp)[0]
        assert recomputed.tolist() == pytest.approx(list(s.logprobs), abs=1e-4)


def test_greedy_ignores_seed_and_empty_prompt_rejected(tiny_policy):
    engine = HFEngine(
        tiny_policy.model, tiny_policy.eos_id, tiny_policy.pad_id, SamplingConfig(max_new_tokens=4)
    )
    p = [tiny_policy.encode_prompt("9+9=")]
    assert engine.generate(p, seed=1, greedy=True) == engine.generate(p, seed=2, greedy=True)
    assert engine.generate([], seed=0) == []
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]], seed=0)
