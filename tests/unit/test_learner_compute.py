"""How the learner computes an update (``[learner]``, learner/logprobs.py, learner/trainer.py): token-budget
micro-batches that change nothing but memory, log-probs from the LM head at completion positions only,
in chunks, on the model's device, in fp32 or bf16-mixed; and the HF engine's token-budget batches."""

from __future__ import annotations

import os
import platform
import random
import subprocess
import sys

import pytest
import torch

from echo2.config import Config, GRPOConfig, LearnerConfig, SamplingConfig
from echo2.errors import ConfigError
from echo2.learner.logprobs import completion_logits, completion_logprobs, lm_parts, micro_batches, pack
from echo2.learner.trainer import GRPOTrainer
from echo2.models.policy import resolve_device
from echo2.rollout.engines.hf import HFEngine
from echo2.types import Trajectory

SAMPLING = SamplingConfig(temperature=0.9, max_new_tokens=12)


def _trajectories(policy, groups: int = 4, G: int = 4, seed: int = 0) -> list[Trajectory]:
    """Whole groups of random prompts and completions of different lengths, mixed rewards."""
    rng = random.Random(seed)
    vocab = policy.model.config.vocab_size
    out = []
    for g in range(groups):
        prompt = tuple(rng.randrange(3, vocab) for _ in range(rng.randint(2, 9)))
        for i in range(G):
            n = rng.randint(1, SAMPLING.max_new_tokens)
            out.append(
                Trajectory(
                    prompt_id=f"p{g}",
                    group_id=f"g{g}",
                    prompt_ids=prompt,
                    completion_ids=tuple(rng.randrange(3, vocab) for _ in range(n)),
                    sampler_logprobs=tuple(-rng.uniform(0.5, 4.0) for _ in range(n)),
                    reward=float((i + g) % 3 == 0),
                    policy_version=0,
                )
            )
    return out


def _legacy_logprobs(model, batch, temperature):
    """The learner's log-probs before micro-batches: the whole ``[B, T, V]`` logits, then log-softmax."""
    logits_BTV = completion_logits(model, batch).float() / temperature
    logp_BTV = torch.log_softmax(logits_BTV, -1)
    out_BT = logp_BTV.gather(-1, batch.targets_BT[..., None]).squeeze(-1)
    T = batch.targets_BT.shape[1]
    return out_BT * (torch.arange(T)[None] < batch.length_B[:, None])


# ---- micro-batch plans ----------------------------------------------------------------------------------
def test_micro_batches_keep_the_budget_cover_every_row_once_and_are_deterministic():
    rng = random.Random(1)
    for _ in range(200):
        lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(1, 300)
        plan = micro_batches(lengths, budget)
        assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
        for mb in plan:
            assert len(mb) * max(lengths[i] for i in mb) <= budget or len(mb) == 1  # a long row goes alone
        assert plan == micro_batches(lengths, budget)
    assert micro_batches([3, 8, 5, 8], 16) == [[1, 3], [2, 0]]  # longest first: little padding
    with pytest.raises(ValueError, match="budget"):
        micro_batches([1], 0)


# ---- log-probs -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_chunked_logprobs_equal_the_whole_logits_path_values_and_gradients(tiny_policy, chunk):
    model = tiny_policy.model
    trajs = _trajectories(tiny_policy)
    batch = pack(trajs, [[1.0] * len(t.completion_ids) for t in trajs], tiny_policy.pad_id)
    parts = lm_parts(model)
    assert parts is not None  # Qwen3: logits are the head of the hidden states

    def grads(fn):
        model.zero_grad(set_to_none=True)
        logp = fn()
        (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
        return logp.detach(), [p.grad.clone() for p in model.parameters()]

    lp_chunk, g_chunk = grads(lambda: completion_logprobs(model, batch, 0.9, chunk=chunk, parts=parts))
    lp_whole, g_whole = grads(lambda: completion_logprobs(model, batch, 0.9, parts=None))
    lp_legacy, g_legacy = grads(lambda: _legacy_logprobs(model, batch, 0.9))
    torch.testing.assert_close(lp_chunk, lp_legacy, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lp_whole, lp_legacy, rtol=1e-6, atol=1e-6)
    for a, b, c in zip(g_chunk, g_whole, g_legacy, strict=True):  # float32 sums in another order
        scale = float(c.abs().max()) or 1.0
        torch.testing.assert_close(a, c, rtol=0, atol=1e-5 * scale)
        torch.testing.assert_close(b, c, rtol=0, atol=1e-5 * scale)
    assert (lp_chunk[batch.targets_BT.new_ones(1).bool().expand_as(lp_chunk) & (lp_chunk != 0)] < 0).all()


def test_a_model_whose_logits_are_not_its_head_of_hidden_falls_back(tiny_policy, caplog):
    class Scaled(torch.nn.Module):  # logits scaled after the head (Cohere / Granite style)
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def get_decoder(self):
            return self.inner.get_decoder()

        def get_output_embeddings(self):
            return self.inner.get_output_embeddings()

        def forward(self, **kw):
            out = self.inner(**kw)
            out.logits = out.logits * 0.5
            return out

    scaled = Scaled(tiny_policy.model)
    assert lm_parts(scaled) is None and "whole forward" in caplog.text
    trajs = _trajectories(tiny_policy, groups=2)
    batch = pack(trajs, [[1.0] * len(t.completion_ids) for t in trajs], tiny_policy.pad_id)
    with torch.no_grad():
        torch.testing.assert_close(
            completion_logprobs(scaled, batch, 0.9),
            _legacy_logprobs(scaled, batch, 0.9),
            rtol=1e-6,
            atol=1e-6,
        )


# ---- micro-batched updates ---------------------------------------------------------------------------
def _train(policy_factory, grpo: GRPOConfig, learner: LearnerConfig, steps: int = 3):
    policy = policy_factory()
    trainer = GRPOTrainer(policy.model, grpo, SAMPLING, policy.pad_id, learner=learner)
    stats = [trainer.update(_trajectories(policy, seed=s)) for s in range(steps)]
    return [p.detach().clone() for p in policy.model.parameters()], stats


@pytest.mark.parametrize(
    "grpo",
    [
        GRPOConfig(lr=1e-3),
        GRPOConfig(lr=1e-3, loss_agg="seq-mean-token-mean"),
        GRPOConfig(lr=1e-3, loss_agg="seq-mean-token-sum-norm"),
        GRPOConfig(lr=1e-3, kl_beta=0.05, clip_anchor="proximal", num_minibatches=2),
        GRPOConfig(lr=1e-3, algorithm="gspo", clip_eps_low=0.2, clip_eps_high=0.28),
        GRPOConfig(lr=1e-3, algorithm="cispo"),
        GRPOConfig(
            lr=1e-3,
            clip_anchor="proximal",
            is_mode="mask",
            is_level="geometric",
            num_minibatches=2,
            offpolicy_mask_delta=0.05,
        ),
    ],
    ids=[
        "token-mean",
        "seq-mean-token-mean",
        "sum-norm",
        "kl-proximal-2-minibatches",
        "gspo",
        "cispo",
        "masked-geometric-is-offpolicy-mask",
    ],
)
def test_a_micro_batched_update_is_the_unbatched_update(grpo, tiny_policy_factory):
    """The loss and the accumulated gradient of a minibatch at a budget of about 2 rows per micro-batch
    equal the unbatched ones within 1e-6 relative (fp32; the gradient as a whole vector), and three
    updates give the same weights (each tensor within 1e-5 of its norm: GSPO's after three steps differ by
    2e-6 on some CPUs, fp32 sums in another order) and statistics. A wrong normalisation is off by a
    factor, not 1e-5."""
    policy = tiny_policy_factory()
    trajs = _trajectories(policy)
    rows = list(range(len(trajs)))
    found = []
    for budget in (1 << 20, 40):
        trainer = GRPOTrainer(
            policy.model,
            grpo,
            SAMPLING,
            policy.pad_id,
            learner=LearnerConfig(micro_batch_tokens=budget, logprob_chunk=5),
        )
        batch = pack(trajs, [[1.0] * len(t.completion_ids) for t in trajs], policy.pad_id)
        rewards_PG = torch.tensor([t.reward for t in trajs]).view(-1, 4)
        from echo2.learner import grpo as grpo_fns

        adv = grpo_fns.group_advantages(rewards_PG).flatten()
        if grpo.clip_anchor == "proximal":
            from echo2.learner.logprobs import with_proximal

            batch = with_proximal(batch, trainer._frozen_logprobs(batch))
        loss, _, _ = trainer._evaluate(batch, adv, rows)
        grad = torch.cat([p.grad.flatten() for p in policy.model.parameters()])
        found.append((loss, grad.clone()))
        trainer.optimizer.zero_grad(set_to_none=True)
    (loss_w, grad_w), (loss_s, grad_s) = found
    assert loss_s == pytest.approx(loss_w, rel=1e-6, abs=1e-9)
    assert float((grad_s - grad_w).norm()) <= 1e-6 * float(grad_w.norm())

    whole, s_whole = _train(tiny_policy_factory, grpo, LearnerConfig(micro_batch_tokens=1 << 20))
    small, s_small = _train(tiny_policy_factory, grpo, LearnerConfig(micro_batch_tokens=40, logprob_chunk=5))
    for a, b in zip(whole, small, strict=True):
        assert float((b - a).norm()) <= 1e-5 * float(a.norm())
    for x, y in zip(s_whole, s_small, strict=True):
        assert y.loss == pytest.approx(x.loss, rel=1e-5, abs=1e-7)
        assert y.clipfrac == pytest.approx(x.clipfrac, abs=1e-6)
        assert y.kl == pytest.approx(x.kl, rel=1e-5, abs=1e-8)
        assert y.grad_norm == pytest.approx(x.grad_norm, rel=1e-5)
        assert y.tokens == x.tokens


def test_activation_checkpointing_changes_no_number(tiny_policy_factory):
    grpo = GRPOConfig(lr=1e-3)
    plain, _ = _train(tiny_policy_factory, grpo, LearnerConfig(micro_batch_tokens=64))
    ckpt, _ = _train(
        tiny_policy_factory, grpo, LearnerConfig(micro_batch_tokens=64, activation_checkpointing=True)
    )
    for a, b in zip(plain, ckpt, strict=True):
        assert float((b - a).norm()) <= 1e-6 * float(a.norm())


# ---- devices and precision -------------------------------------------------------------------------------
def test_every_tensor_of_an_update_is_made_on_the_models_device(tiny_policy):
    """The update runs with the process's default device set to ``meta`` while the model sits on the CPU:
    a tensor made without naming the model's device lands on ``meta``, and mixing it with the model's
    tensors fails. So the update builds everything on the model's device, as it must on a GPU."""
    trajs = _trajectories(tiny_policy)
    grpo = GRPOConfig(lr=1e-3, kl_beta=0.05, clip_anchor="proximal", num_minibatches=2)
    trainer = GRPOTrainer(
        tiny_policy.model, grpo, SAMPLING, tiny_policy.pad_id, learner=LearnerConfig(micro_batch_tokens=40)
    )
    with torch.device("meta"):
        assert torch.zeros(1).device.type == "meta"  # the trap is set
        stats = trainer.update(trajs)
    assert stats.version == 1 and stats.tokens > 0
    assert all(p.device.type == "cpu" for p in tiny_policy.model.parameters())


def test_bf16_mixed_trains_fp32_masters_with_bf16_compute(tiny_policy):
    trajs = _trajectories(tiny_policy)
    mixed = GRPOTrainer(
        tiny_policy.model,
        GRPOConfig(lr=1e-3),
        SAMPLING,
        tiny_policy.pad_id,
        learner=LearnerConfig(precision="bf16-mixed"),
    )
    batch = pack(trajs, [[1.0] * len(t.completion_ids) for t in trajs], tiny_policy.pad_id)
    with torch.no_grad():
        lp_fp32 = completion_logprobs(tiny_policy.model, batch, SAMPLING.temperature)
        lp_bf16 = mixed.logprobs(batch)
    assert lp_bf16.dtype == torch.float32
    diff = (lp_bf16 - lp_fp32).abs().max()
    assert 0 < diff < 0.1  # computed in bf16 (not bit-equal), close to fp32
    stats = mixed.update(trajs)
    assert stats.version == 1
    assert all(p.dtype == torch.float32 for p in tiny_policy.model.parameters())
    states = [t for s in mixed.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    assert states and all(t.dtype == torch.float32 for t in states)
    assert all(p.grad is None for p in tiny_policy.model.parameters())  # no gradient outlives an update


def test_bf16_mixed_keeps_the_kl_reference_in_bf16(tiny_policy):
    t = GRPOTrainer(
        tiny_policy.model,
        GRPOConfig(kl_beta=0.1),
        SAMPLING,
        tiny_policy.pad_id,
        learner=LearnerConfig(precision="bf16-mixed"),
    )
    assert t.reference is not None and {p.dtype for p in t.reference.parameters()} == {torch.bfloat16}
    assert t.update(_trajectories(tiny_policy)).kl >= 0


def test_device_settings_are_checked():
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu").type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"learner.device = 'cuda:1'.*no CUDA device"):
            resolve_device("cuda:1")
    with pytest.raises(ValueError, match=r"learner\.device"):
        Config.model_validate({"learner": {"device": "gpu"}})
    with pytest.raises(ValueError, match="precision"):
        Config.model_validate({"learner": {"precision": "fp16"}})
    with pytest.raises(ValueError, match="malloc_mmap_threshold"):
        Config.model_validate({"learner": {"malloc_mmap_threshold": 64 << 20}})  # glibc's bound: 32 MiB


_FREED_PAGES = """
import sys
from echo2.models.policy import return_freed_memory
set_ = return_freed_memory(int(sys.argv[1]))
import torch
def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096
t = torch.ones(1 << 21); del t  # 8 MiB, mapped: glibc's adaptive threshold rises past it
a = torch.ones(1 << 21); b = torch.ones(16)  # 8 MiB, then a small tensor above it
r1 = rss(); del a; r2 = rss()
print(set_, (r1 - r2) >> 20)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's")
@pytest.mark.parametrize(("threshold", "env", "expect"), [
    (LearnerConfig().malloc_mmap_threshold, {}, "True 8"),  # the default: the freed 8 MiB leave at once
    (0, {}, "False 0"),  # glibc's default: the heap keeps them
    # the environment wins (a threshold glibc accepts, <= 32 MiB; and no trimming of the heap's top,
    # which otherwise returned the freed tensor now and then, as the heap's layout fell: 7 MiB once)
    (1 << 20, {"MALLOC_MMAP_THRESHOLD_": str(16 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}, "False 0"),
])  # fmt: skip
def test_the_learners_mmap_threshold_returns_freed_tensors_to_the_system(threshold, env, expect):
    out = subprocess.run(
        [sys.executable, "-c", _FREED_PAGES, str(threshold)],
        capture_output=True, text=True, check=True, env={**os.environ, **env},
    )  # fmt: skip
    set_, freed = out.stdout.split()
    want_set, want_freed = expect.split()
    assert set_ == want_set
    # MiB returned when the 8 MiB tensor was freed: all of it, or none (give or take the interpreter's
    # own allocations between the two readings)
    assert abs(int(freed) - int(want_freed)) <= 1, out.stdout


_AUTOCAST_PEAK = """
import torch
from echo2.models.policy import return_freed_memory
return_freed_memory(256 << 10)  # the learner's: freed tensors leave the process at once
torch.set_num_threads(1)
from transformers import Qwen3Config, Qwen3ForCausalLM
from echo2.config import GRPOConfig, LearnerConfig, SamplingConfig
from echo2.learner.trainer import GRPOTrainer
from echo2.types import Trajectory
torch.manual_seed(0)
config = Qwen3Config(vocab_size=256, hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
    num_attention_heads=6, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
model = Qwen3ForCausalLM(config).float()
trainer = GRPOTrainer(model, GRPOConfig(lr=1e-5), SamplingConfig(max_new_tokens=8), 0,
    learner=LearnerConfig(precision="bf16-mixed", micro_batch_tokens=64, activation_checkpointing=True))
batch = [Trajectory(f"p{g}", f"g{g}", (5, 6, 7, 8), tuple(range(10, 18)), (-1.0,) * 8, float(i % 2), 0)
         for g in range(2) for i in range(4)]
def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
def peak():
    before = status("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")  # the peak from here
    trainer.update(batch)
    return (status("VmHWM") - before) / sum(p.numel() for p in model.parameters())
trainer.update(batch)  # AdamW's states exist from here
own = peak()
trainer.autocast = lambda cache=True: torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True)
print(own, peak())  # the trainer's update, then the same with autocast's weight cache on
"""


def _clear_refs_writable() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _clear_refs_writable(), reason="needs /proc/self/clear_refs to reset the peak")
def test_bf16_mixed_updates_cast_without_autocasts_weight_cache():
    """Under activation checkpointing the update's peak holds one layer's bf16 casts at a time, not every
    layer's (autocast's cache would keep each cast until the forward ends: 2 bytes a parameter of the
    decoder, planner/memory_model.py ``autocast_copies``): the peak of an update above the resident memory
    before it, per parameter, with the trainer's autocast and then with the cache on (a fresh process;
    read 4.4 and 5.7 here)."""
    out = subprocess.run([sys.executable, "-c", _AUTOCAST_PEAK], capture_output=True, text=True,
                         check=True, timeout=300)  # fmt: skip
    own, cached = (float(x) for x in out.stdout.split()[-2:])
    assert cached - own >= 0.8, (own, cached)  # 12.6M of the 12.8M parameters are in decoder layers


# ---- the engine's token budget ---------------------------------------------------------------------------
@pytest.mark.parametrize("greedy", [True, False])
def test_the_engine_in_token_budget_batches_draws_what_one_batch_draws(tiny_policy_module, greedy):
    p = tiny_policy_module
    prompts = [[3 + (i * 5 + j) % 20 for j in range(2 + i % 5)] for i in range(11)]
    one = HFEngine(p.model, p.eos_id, p.pad_id, SAMPLING)
    small = HFEngine(p.model, p.eos_id, p.pad_id, SAMPLING, max_batch_tokens=40)  # 2 rows a batch
    a = one.generate(prompts, seed=7, greedy=greedy)
    b = small.generate(prompts, seed=7, greedy=greedy)
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    for x, y in zip(a, b, strict=True):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
    rows, firsts = [5, 2, 9], [0, 3, 1]
    c = one.generate(prompts[:3], seed=7, greedy=greedy, rows=rows, first_steps=firsts)
    d = small.generate(prompts[:3], seed=7, greedy=greedy, rows=rows, first_steps=firsts)
    assert [s.completion_ids for s in c] == [s.completion_ids for s in d]
