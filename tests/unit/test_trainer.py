import dataclasses
import math

import pytest
import torch

from echo2.config import GRPOConfig, LearnerConfig, SamplingConfig
from echo2.errors import TrainingDivergedError
from echo2.learner.logprobs import completion_logprobs, pack
from echo2.learner.trainer import GRPOTrainer, mismatch_by
from echo2.types import Trajectory


def _batch(policy, rewards, version=0, logp=None):
    out = []
    prompt = tuple(policy.encode_prompt("1+1="))
    for i, r in enumerate(rewards):
        completion = (5 + i % 3, policy.eos_id)
        out.append(
            Trajectory(
                prompt_id="1+1",
                group_id=f"g{i // 4}",
                prompt_ids=prompt,
                completion_ids=completion,
                sampler_logprobs=logp[i] if logp else (-1.0, -1.0),
                reward=r,
                policy_version=version,
            )
        )
    return out


SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=8)


def test_pack_aligns_prompt_and_completion(tiny_policy):
    trajs = _batch(tiny_policy, [1, 0, 0, 1])
    b = pack(trajs, [[1.0, 1.0]] * len(trajs), tiny_policy.pad_id)
    p = len(trajs[0].prompt_ids)
    assert b.start_B.tolist() == [p] * 4
    assert b.input_ids_BL[0, p:].tolist() == list(trajs[0].completion_ids)
    assert b.targets_BT[1].tolist() == list(trajs[1].completion_ids)


def test_update_bumps_version_and_moves_weights(tiny_policy):
    trainer = GRPOTrainer(tiny_policy.model, GRPOConfig(lr=1e-2), SAMPLING, tiny_policy.pad_id)
    trajs = _batch(tiny_policy, [1, 0, 0, 0, 0, 0, 1, 1])
    before = [p.detach().clone() for p in tiny_policy.model.parameters()]
    stats = trainer.update(trajs)
    assert stats.version == 1 == trainer.version
    assert stats.t_train_s > 0 and stats.tokens == 16
    assert any(not torch.equal(a, b) for a, b in zip(before, tiny_policy.model.parameters(), strict=True))


def test_update_raises_rewarded_completion_probability(tiny_policy):
    """A few updates must make the rewarded completion more likely than the unrewarded one."""
    trainer = GRPOTrainer(tiny_policy.model, GRPOConfig(lr=1e-2), SAMPLING, tiny_policy.pad_id)
    trajs = _batch(tiny_policy, [1.0, 0.0, 0.0, 1.0])  # tokens 5 and 8 rewarded, 6 and 7 not
    b = pack(trajs, [[1.0, 1.0]] * len(trajs), tiny_policy.pad_id)
    with torch.no_grad():
        lp0 = completion_logprobs(tiny_policy.model, b, 1.0)[:, 0]
    for _ in range(5):
        on_policy = [
            Trajectory(**{**t.__dict__, "sampler_logprobs": tuple(lp.tolist())})
            for t, lp in zip(trajs, completion_logprobs(tiny_policy.model, b, 1.0).detach(), strict=True)
        ]
        trainer.update(on_policy)
    with torch.no_grad():
        lp1 = completion_logprobs(tiny_policy.model, b, 1.0)[:, 0]
    gain = lp1 - lp0
    assert gain[0] > 0 and gain[1] < 0


def test_minibatches_and_kl_reference(tiny_policy):
    cfg = GRPOConfig(lr=1e-3, kl_beta=0.1, num_minibatches=2)
    trainer = GRPOTrainer(tiny_policy.model, cfg, SAMPLING, tiny_policy.pad_id)
    assert trainer.reference is not None
    trajs = _batch(tiny_policy, [1, 0, 0, 1, 0, 1, 1, 0])
    stats = trainer.update(trajs)
    assert stats.kl >= 0.0 and stats.version == 1


def test_nan_loss_stops_before_touching_weights(tiny_policy):
    trainer = GRPOTrainer(tiny_policy.model, GRPOConfig(), SAMPLING, tiny_policy.pad_id)
    trajs = _batch(tiny_policy, [1, 0, 0, 1], logp=[(float("nan"), -1.0)] * 4)
    before = [p.detach().clone() for p in tiny_policy.model.parameters()]
    with pytest.raises(TrainingDivergedError, match="loss is nan"):
        trainer.update(trajs)
    assert all(torch.equal(a, b) for a, b in zip(before, tiny_policy.model.parameters(), strict=True))
    assert trainer.version == 0


def test_groups_not_divisible_into_minibatches_rejected(tiny_policy):
    cfg = GRPOConfig(num_minibatches=2)
    trainer = GRPOTrainer(tiny_policy.model, cfg, SAMPLING, tiny_policy.pad_id)
    trajs = _batch(tiny_policy, [1, 0, 0, 1] * 3)  # three groups of 4 for two minibatches
    with pytest.raises(ValueError, match="3 groups cannot be split into 2"):
        trainer.update(trajs)


def test_uneven_groups_rejected(tiny_policy):
    trainer = GRPOTrainer(tiny_policy.model, GRPOConfig(), SAMPLING, tiny_policy.pad_id)
    trajs = _batch(tiny_policy, [1, 0, 0, 1, 1])  # groups of 4 and 1
    with pytest.raises(ValueError, match="whole groups"):
        trainer.update(trajs)


def test_the_task_mask_is_the_one_place_loss_weights_come_from(tiny_policy):
    """Tokens the task masks out get no gradient: with every token masked the update moves nothing."""
    masked = GRPOTrainer(
        tiny_policy.model,
        GRPOConfig(lr=1e-2),
        SAMPLING,
        tiny_policy.pad_id,
        token_mask=lambda ids, meta: [0.0] * len(ids),
    )
    trajs = _batch(tiny_policy, [1, 0, 0, 1])
    before = [p.detach().clone() for p in tiny_policy.model.parameters()]
    stats = masked.update(trajs)
    assert stats.tokens == 0
    assert all(torch.equal(a, b) for a, b in zip(before, tiny_policy.model.parameters(), strict=True))


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("minibatches", [1, 3])
def test_isolate_leaves_out_the_poisoned_group_and_trains_on_the_rest(tiny_policy, minibatches):
    """A group whose reward overflows float32 (1e39: the advantages are nan) makes the loss nan; with
    isolate=True the update leaves that group out, reports it, and trains on the others exactly as an
    update without it would (checked against a second trainer that never saw it)."""
    import copy

    from echo2.learner.trainer import PoisonedBatch

    rewards = [1, 0, 0, 1, 1e39, 0, 1, 0, 0, 0, 1, 1]  # group g1 (rows 4-7) is the poison
    clean = rewards[:4] + rewards[8:]
    cfg = GRPOConfig(lr=1e-2, num_minibatches=minibatches)
    poisoned_model, clean_model = copy.deepcopy(tiny_policy.model), copy.deepcopy(tiny_policy.model)
    trainer = GRPOTrainer(poisoned_model, cfg, SAMPLING, tiny_policy.pad_id, isolate=True)
    trajs = _batch(tiny_policy, rewards)
    with pytest.raises(TrainingDivergedError, match="loss is nan"):  # without isolation: it stops
        GRPOTrainer(copy.deepcopy(tiny_policy.model), cfg, SAMPLING, tiny_policy.pad_id).update(trajs)
    stats = trainer.update(trajs)
    assert stats.excluded == ("g1",) and stats.version == 1 and stats.tokens == 16
    assert stats.metrics()["learner/excluded_groups"] == 1
    kept = [t for t in _batch(tiny_policy, rewards) if t.group_id != "g1"]
    assert [t.reward for t in kept] == clean
    if minibatches == 1:  # the same update as one that never saw the poison
        reference = GRPOTrainer(clean_model, GRPOConfig(lr=1e-2), SAMPLING, tiny_policy.pad_id)
        reference.update(kept)
        for a, b in zip(_weights(poisoned_model), _weights(clean_model), strict=True):
            assert torch.allclose(a, b, atol=1e-6)
    # every group poisoned: no step at all, the weights untouched, the groups named
    before = _weights(poisoned_model)
    with pytest.raises(PoisonedBatch) as info:
        trainer.update(_batch(tiny_policy, [1e39, 0, 0, 1] * 3))
    assert info.value.excluded == ("g0", "g1", "g2") and trainer.version == 1
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(poisoned_model), strict=True))


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "dapo", "gspo", "cispo"])
def test_every_preset_trains_and_reports_the_menus_metrics(tiny_policy, algorithm):
    """Each recipe runs an update through the trainer and the update reports the share of groups with
    no signal, the clip split and the engines' mismatch KL, read on the rows sampled at its version."""
    trainer = GRPOTrainer(
        tiny_policy.model, GRPOConfig(algorithm=algorithm, lr=1e-3), SAMPLING, tiny_policy.pad_id
    )
    b = pack(_batch(tiny_policy, [0.0] * 8), [[1.0, 1.0]] * 8, tiny_policy.pad_id)
    with torch.no_grad():
        learner = completion_logprobs(tiny_policy.model, b, 1.0)
    # group g0 (rows 0-3) at the learner's version, sampled 0.1 nats off; g1 (rows 4-7) flat rewards
    logp = [tuple((lp - 0.1).tolist()) for lp in learner]
    trajs = _batch(tiny_policy, [1, 0, 0, 1, 1, 1, 1, 1], logp=logp)
    m = trainer.update(trajs).metrics()
    assert m["learner/zero_variance_share"] == 0.5
    want = -float(learner[:, :2].mean())  # every completion 2 tokens: the mean -log pi of them
    assert m["learner/entropy"] == pytest.approx(want, rel=1e-4)
    # every token 0.1 nats off: k3 = e^0.1 - 1 - 0.1 = 0.005171
    assert m["learner/mismatch_kl"] == pytest.approx(0.005171, abs=1e-4)
    assert m["learner/clipfrac"] == pytest.approx(m["learner/clipfrac_low"] + m["learner/clipfrac_high"])
    assert trainer.version == 1


def test_the_mismatch_kl_is_read_per_worker_across_minibatches_and_micro_batches(tiny_policy):
    """Each worker's fresh sequences give its own k3 (the pool table's column): worker a's group g0 has its
    tokens 0.1 nats off (k3 = e^0.1 - 1.1 = 0.005171), worker b's g2 0.3 (e^0.3 - 1.3 = 0.049859), in the
    second minibatch and split over micro-batches of two rows; a stale row (another version) is not read,
    nor a group no worker is known for."""
    cfg = GRPOConfig(num_minibatches=2, clip_anchor="proximal", lr=1e-3)
    trainer = GRPOTrainer(
        tiny_policy.model, cfg, SAMPLING, tiny_policy.pad_id, learner=LearnerConfig(micro_batch_tokens=16)
    )
    b = pack(_batch(tiny_policy, [0.0] * 16), [[1.0, 1.0]] * 16, tiny_policy.pad_id)
    with torch.no_grad():
        learner = completion_logprobs(tiny_policy.model, b, 1.0)
    off = [0.1] * 4 + [0.2] * 4 + [0.3] * 4 + [0.2] * 4
    logp = [tuple((lp - d).tolist()) for lp, d in zip(learner, off, strict=True)]
    trajs = _batch(tiny_policy, [1, 0, 0, 1] * 4, logp=logp)
    trajs[3] = dataclasses.replace(trajs[3], policy_version=-1)  # stale: no fresh tokens
    by_group = trainer.update(trajs).mismatch_by_group
    assert set(by_group) == {"g0", "g1", "g2", "g3"} and by_group["g0"][1] == 3 * 2  # 3 fresh rows, 2 tokens
    by_worker = mismatch_by({"g0": "a", "g2": "b"}.get, by_group)
    assert set(by_worker) == {"a", "b"}
    assert by_worker["a"] == pytest.approx(math.exp(0.1) - 1.1, abs=1e-4)
    assert by_worker["b"] == pytest.approx(math.exp(0.3) - 1.3, abs=1e-4)


def test_overlong_handling_masks_cut_completions_or_penalises_long_ones_dapo_eq_13(tiny_policy):
    """DAPO: overlong filtering (``mask_truncated``: a completion without its EOS carries no loss) and
    the soft overlong penalty (``overlong_buffer`` L_cache under L_max = max_new_tokens = 8:
    ``R_len = min(0, (L_max - L_cache - n) / L_cache)``, -1 at L_max), and a length penalty."""
    from echo2.errors import ConfigError

    eos = (tiny_policy.eos_id,)
    shaping = GRPOTrainer(
        tiny_policy.model, GRPOConfig(overlong_buffer=4, length_penalty=0.1), SAMPLING, tiny_policy.pad_id
    )
    # n = 4: inside L_max - L_cache, no penalty; 6: (4 - 6) / 4 = -0.5; 8: -1; each minus 0.1 n / 8
    got = [shaping.length_shaping(n) for n in (4, 6, 8)]
    assert got == pytest.approx([-0.05, -0.5 - 0.075, -1.0 - 0.1])
    masking = GRPOTrainer(
        tiny_policy.model, GRPOConfig(mask_truncated=True), SAMPLING, tiny_policy.pad_id, eos_ids=eos
    )
    trajs = _batch(tiny_policy, [1, 0, 0, 1])
    cut = Trajectory(**{**trajs[0].__dict__, "completion_ids": (5, 6), "sampler_logprobs": (-1.0, -1.0)})
    assert masking.truncated(cut) and not masking.truncated(trajs[1])
    assert masking.update([cut, *trajs[1:]]).tokens == 6  # 2 tokens of each of the three whole ones
    with pytest.raises(ConfigError, match="EOS ids"):
        GRPOTrainer(tiny_policy.model, GRPOConfig(mask_truncated=True), SAMPLING, tiny_policy.pad_id)
    with pytest.raises(ConfigError, match="overlong_buffer = 8 must be below"):
        GRPOTrainer(tiny_policy.model, GRPOConfig(overlong_buffer=8), SAMPLING, tiny_policy.pad_id)
    with pytest.raises(ValueError, match="choose one"):
        GRPOConfig(mask_truncated=True, overlong_buffer=2)
