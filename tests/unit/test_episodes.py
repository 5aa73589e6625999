"""Multi-turn episodes (SPEC §8): the environment seam, the turn-aware mask, the episode runner's
fault handling, the learner's replay of a claimed episode, and the codec and store carrying it."""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import time

import pytest
import torch

from echo2.check.rerun import GenerationCheck
from echo2.config import GRPOConfig, GuessTaskConfig, SamplingConfig, SecurityConfig
from echo2.data.store import Lease
from echo2.data.submission import Rejected, Submission
from echo2.data.tasks.environment import EnvironmentTask
from echo2.envs.base import EnvStep
from echo2.envs.guess import GuessEnv
from echo2.envs.roster import GuessSpec
from echo2.learner.logprobs import completion_logprobs, pack
from echo2.learner.trainer import GRPOTrainer, loss_mask
from echo2.protocol import decode_group, encode_group
from echo2.rollout.engines.hf import HFEngine
from echo2.rollout.episodes import collect_episodes
from echo2.tasks.verify import EpisodeReplay
from echo2.types import Trajectory

G = 4
SAMPLING = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=3)


def test_guess_environment_is_deterministic_and_documents_its_fallback():
    cfg = GuessTaskConfig(max_value=15, max_turns=5)
    a, b = GuessEnv(cfg), GuessEnv(cfg)
    assert a.reset(3) == b.reset(3) == "guess 0-15>"
    hidden = a.hidden
    assert 0 <= hidden <= 15
    low = a.step(str(hidden - 1)) if hidden > 0 else a.step(str(hidden + 1))
    assert low.observation in ("higher>", "lower>") and low.reward == 0.0 and not low.done
    bad = a.step("x7")
    assert bad.illegal and bad.observation == "?>" and not bad.done
    won = a.step(str(hidden))
    assert won == EnvStep("", 1.0, True, False)
    # the teacher (binary search) always finds it within ceil(log2(16)) + 1 guesses
    for seed in range(50):
        env = GuessEnv(cfg)
        env.reset(seed)
        for _ in range(5):
            if env.step(env.expert_action()).done:
                break
        assert env.done and env.turn <= 5


def _task(max_turns: int = 5, **kw) -> EnvironmentTask:
    return EnvironmentTask(GuessSpec(GuessTaskConfig(max_value=15, max_turns=max_turns, discount=0.8, **kw)))


def test_episode_splits_are_disjoint_by_seed():
    task = _task()
    train = {p.meta["seed"] for p in task.sample_train(random.Random(0), 500)}
    val = {p.meta["seed"] for p in task.validation_prompts(50)}
    test = {p.meta["seed"] for p in task.eval_prompts(50)}
    assert not (train & val) and not (train & test) and not (val & test)
    assert task.eval_prompts(50) == task.eval_prompts(50)


@pytest.fixture(scope="module")
def played(tiny_policy_module, published_engine):
    """Two groups of G guess episodes from the tiny model's published bf16 weights."""
    policy = tiny_policy_module
    weights, engine = published_engine(policy, SAMPLING)
    task = _task()
    prompts = task.sample_train(random.Random(1), 2)
    seed = 987654321
    batch = collect_episodes(
        policy.codec,
        engine,
        task,
        prompts,
        G,
        seed=seed,
        policy_version=1,
        group_prefix="L",
        max_context=128,
        max_new_tokens=SAMPLING.max_new_tokens,
    )
    groups = tuple(tuple(batch.trajectories[i * G : (i + 1) * G]) for i in range(len(prompts)))
    lease = Lease("L", "w", "open", 0.0, prompts, seed, 1)
    return policy, task, weights, lease, Submission("L", 1, groups), batch


def test_an_episode_transcript_alternates_policy_and_environment_turns(played):
    policy, _, _, _, sub, batch = played
    assert batch.tokens > 0
    for t in (t for g in sub.groups for t in g):
        assert policy.codec.decode_completion(t.prompt_ids) == "guess 0-15>"
        assert len(t.turn_mask) == len(t.completion_ids) == len(t.sampler_logprobs)
        assert t.turn_mask[0] == 1
        runs, k = [], 0  # policy runs end with EOS or are max_new_tokens long; observations end in '>'
        while k < len(t.turn_mask):
            j = k
            while j < len(t.turn_mask) and t.turn_mask[j] == t.turn_mask[k]:
                j += 1
            runs.append((t.turn_mask[k], t.completion_ids[k:j]))
            k = j
        for m, ids in runs:
            if m:
                assert ids[-1] == policy.eos_id or len(ids) == SAMPLING.max_new_tokens
            else:
                assert policy.codec.decode_completion(ids)[-1] == ">"
        assert all(lp == 0.0 for lp, m in zip(t.sampler_logprobs, t.turn_mask, strict=True) if not m)
        assert t.meta["turns"] == sum(m for m, _ in runs)
        assert 0.0 <= t.reward <= 1.0


def test_mask_is_exact_on_a_hand_built_transcript(tiny_policy):
    """Only the policy's tokens carry loss: the mask of a hand-written three-turn transcript, and the
    gradient of the GRPO loss with respect to every environment token's logit is exactly zero."""
    codec, eos = tiny_policy.codec, tiny_policy.eos_id
    prompt = codec.encode_prompt("guess 0-15>")
    turns = [("7", True), ("higher>", False), ("11", True), ("lower>", False), ("9", True)]
    ids, mask = [], []
    for text, mine in turns:
        tok = codec.encode_prompt(text) + ([eos] if mine else [])
        ids += tok
        mask += [int(mine)] * len(tok)
    assert mask == [1, 1] + [0] * 7 + [1, 1, 1] + [0] * 6 + [1, 1]
    trajs = [
        Trajectory(
            "p",
            "g",
            tuple(prompt),
            tuple(ids),
            tuple(0.0 if not m else -1.0 for m in mask),
            r,
            0,
            turn_mask=tuple(mask),
        )
        for r in (1.0, 0.0)
    ]
    assert loss_mask(trajs[0]) == [float(m) for m in mask]
    batch = pack(trajs, [loss_mask(t) for t in trajs], tiny_policy.pad_id)
    model = tiny_policy.model
    logits = []

    def keep(mod, inp, out):
        out.retain_grad()
        logits.append(out)

    trainer = GRPOTrainer(model, GRPOConfig(), SAMPLING, tiny_policy.pad_id)  # its set-up probe runs unhooked
    hook = model.lm_head.register_forward_hook(keep)
    try:
        from echo2.learner import grpo

        logp = completion_logprobs(model, batch, SAMPLING.temperature)
        adv = grpo.group_advantages(torch.tensor([[1.0, 0.0]])).flatten()
        loss, _ = grpo.grpo_loss(
            logp, logp.detach(), logp.detach(), adv, batch.mask_BT, clip_eps=0.2, is_cap=2.0
        )
        loss.backward()
    finally:
        hook.remove()
    grad_BLV = logits[0].grad
    P = len(prompt)
    for b in range(2):
        for j, m in enumerate(mask):  # the logit at position P-1+j predicts completion token j
            g = grad_BLV[b, P - 1 + j].abs().sum()
            assert (g > 0) if m else (g == 0), (b, j, m, float(g))
    assert trainer.version == 0


class _Env:
    """An environment whose step misbehaves on request."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def reset(self, seed: int) -> str:
        if self.mode == "reset":
            raise RuntimeError("boom at reset")
        return "go>"

    def step(self, action: str):
        if self.mode == "raise":
            raise ValueError("boom")
        if self.mode == "hang":
            time.sleep(3)
        if self.mode == "nan":
            return EnvStep("", math.nan, True)
        if self.mode == "obs":
            return EnvStep(42, 0.0, False)  # type: ignore[arg-type]
        return EnvStep("", 1.0, True)


@dataclasses.dataclass(frozen=True)
class _BadSpec(GuessSpec):
    def make(self, prompt, opponent_policy=None):
        return _Env("ok" if prompt.meta["seed"] % 2 else self.cfg_mode)

    cfg_mode: str = "raise"


@pytest.mark.parametrize("mode", ["raise", "hang", "nan", "obs"])
def test_a_misbehaving_environment_costs_only_its_own_episode(tiny_policy_module, mode):
    policy = tiny_policy_module
    engine = HFEngine(policy.model, policy.eos_id, policy.pad_id, SAMPLING)
    spec = _BadSpec(GuessTaskConfig(step_timeout_s=0.3), cfg_mode=mode)
    task = EnvironmentTask(spec)
    prompts = [task.prompt(2, {}), task.prompt(3, {})]  # seed 2 misbehaves, seed 3 is fine
    t0 = time.perf_counter()
    batch = collect_episodes(
        policy.codec,
        engine,
        task,
        prompts,
        2,
        seed=1,
        policy_version=0,
        group_prefix="L",
        max_context=64,
        max_new_tokens=3,
    )
    assert time.perf_counter() - t0 < 2.5  # a hang is cut at the step timeout
    bad, good = batch.trajectories[:2], batch.trajectories[2:]
    assert all("env_error" in t.meta and t.reward == 0.0 for t in bad)
    assert all("env_error" not in t.meta and t.reward == 1.0 for t in good)


class _Endless:
    """Never ends an episode by itself; counts ``close()`` calls."""

    closed = 0

    def reset(self, seed: int) -> str:
        return "go>"

    def step(self, action: str):
        return EnvStep("more>", 0.0, False)

    def close(self) -> None:
        type(self).closed += 1


@dataclasses.dataclass(frozen=True)
class _EndlessSpec(GuessSpec):
    def make(self, prompt, opponent_policy=None):
        return _Endless()


def test_a_cut_episodes_environment_is_closed(tiny_policy_module):
    policy = tiny_policy_module
    engine = HFEngine(policy.model, policy.eos_id, policy.pad_id, SAMPLING)
    task = EnvironmentTask(_EndlessSpec(GuessTaskConfig(max_turns=2)))
    _Endless.closed = 0
    batch = collect_episodes(
        policy.codec, engine, task, [task.prompt(3, {})], 2, seed=1, policy_version=0, group_prefix="L",
        max_context=64, max_new_tokens=3,
    )  # fmt: skip
    assert len(batch.trajectories) == 2 and _Endless.closed == 2  # both cut at max_turns, both closed


def test_a_failing_reset_raises_env_error(tiny_policy_module):
    from echo2.envs.base import EnvError

    policy = tiny_policy_module
    engine = HFEngine(policy.model, policy.eos_id, policy.pad_id, SAMPLING)
    task = EnvironmentTask(_BadSpec(GuessTaskConfig(), cfg_mode="reset"))
    with pytest.raises(EnvError, match="boom at reset"):
        collect_episodes(
            policy.codec,
            engine,
            task,
            [task.prompt(2, {})],
            2,
            seed=1,
            policy_version=0,
            group_prefix="L",
            max_context=64,
            max_new_tokens=3,
        )


def _replay(played):
    policy, task, *_ = played
    return EpisodeReplay(policy.codec, task, policy.eos_id, SAMPLING.max_new_tokens, 128)


def _forge(sub: Submission, i: int, j: int, **change) -> Submission:
    groups = [list(g) for g in sub.groups]
    groups[i][j] = dataclasses.replace(groups[i][j], **change)
    return dataclasses.replace(sub, groups=tuple(tuple(g) for g in groups))


def test_replay_admits_honest_episodes_and_refuses_forged_ones(played):
    policy, _, _, lease, sub, _ = played
    replay = _replay(played)
    taken = replay.check(lease, sub)  # what the learner stores: the replay's masks and returns
    assert [(t.turn_mask, t.reward) for g in taken.groups for t in g] == [
        (t.turn_mask, t.reward) for g in sub.groups for t in g
    ]
    assert all(replay.graded_from(lease.prompts[0], t) == 0 for t in sub.groups[0])  # every action read
    t = sub.groups[1][2]
    with pytest.raises(Rejected, match="reward_mismatch"):
        replay.check(lease, _forge(sub, 1, 2, reward=t.reward + 1.0))
    env_at = t.turn_mask.index(0) if 0 in t.turn_mask else None
    if env_at is not None:  # an observation turn that is not the environment's
        ids = list(t.completion_ids)
        ids[env_at] = policy.codec.encode_prompt("x")[0]
        with pytest.raises(Rejected, match="episode_mismatch"):
            replay.check(lease, _forge(sub, 1, 2, completion_ids=tuple(ids)))
        flipped = list(t.turn_mask)  # environment tokens claimed as the policy's
        flipped[env_at] = 1
        with pytest.raises(Rejected):
            replay.check(lease, _forge(sub, 1, 2, turn_mask=tuple(flipped)))
    with pytest.raises(Rejected, match="episode_mismatch"):
        replay.check(lease, _forge(sub, 0, 0, prompt_ids=tuple(policy.codec.encode_prompt("guess 0-9>"))))


def test_generation_check_rederives_every_policy_token_of_an_episode(played):
    policy, _, weights, lease, sub, _ = played
    check = GenerationCheck(copy.deepcopy(policy.model), SAMPLING, SecurityConfig(), rng=random.Random(0))
    check.keep(1, weights)
    picks = [(i, j) for i in range(2) for j in range(G)]
    verdicts = check.check(lease, sub, picks)
    assert all(v.misses == 0 for v in verdicts)
    assert sum(v.tokens for v in verdicts) == sum(sum(t.turn_mask) for g in sub.groups for t in g)
    t = sub.groups[0][0]
    policy_at = [k for k, m in enumerate(t.turn_mask) if m]
    lps = list(t.sampler_logprobs)
    for k in policy_at:
        lps[k] -= 0.5
    with pytest.raises(Rejected, match="forged_generation"):
        check.check(lease, _forge(sub, 0, 0, sampler_logprobs=tuple(lps)), [(0, 0)])


def test_the_codec_and_the_store_carry_the_turn_mask(played):
    *_, sub, _ = played
    group = sub.groups[0]
    back = decode_group(encode_group(group), group[0].group_id, 1)
    assert back == group
    old_row = encode_group([dataclasses.replace(t, turn_mask=()) for t in group])
    assert all(t.turn_mask == () for t in decode_group(old_row, "g", 1))  # single-turn rows still decode
