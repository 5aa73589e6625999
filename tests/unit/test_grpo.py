"""GRPO math against values worked by hand."""

import math

import pytest
import torch

from echo2.learner import grpo


def test_group_advantages_by_hand():
    # group 1: rewards 0, 1 -> mean 0.5, population std 0.5 -> advantages -1, +1
    # group 2: rewards 1, 1 -> mean 1, std 0 -> advantages 0, 0 (no signal)
    rewards_PG = torch.tensor([[0.0, 1.0], [1.0, 1.0]])
    adv = grpo.group_advantages(rewards_PG, scale_by_std=True, eps=0.0 + 1e-12)
    assert adv[0].tolist() == pytest.approx([-1.0, 1.0], abs=1e-6)
    assert adv[1].tolist() == [0.0, 0.0]


def test_group_advantages_without_std_is_centred_reward():
    # rewards 0, 0, 3 -> mean 1 -> -1, -1, 2 (Dr. GRPO keeps the scale)
    adv = grpo.group_advantages(torch.tensor([[0.0, 0.0, 3.0]]), scale_by_std=False)
    assert adv.tolist() == [[-1.0, -1.0, 2.0]]


def test_group_advantages_rejects_singleton_groups():
    with pytest.raises(ValueError, match="G >= 2"):
        grpo.group_advantages(torch.tensor([[1.0], [0.0]]))


def test_truncated_is_weights_cap():
    # exp(0 - log 0.5) = 2 -> capped at 1.5; exp(log .5 - 0) = .5 stays
    prox = torch.tensor([[0.0, math.log(0.5)]])
    sampler = torch.tensor([[math.log(0.5), 0.0]])
    w = grpo.truncated_is_weights(prox, sampler, cap=1.5)
    assert w.flatten().tolist() == pytest.approx([1.5, 0.5])


def test_kl_k3_zero_at_equal_and_positive_otherwise():
    logp = torch.tensor([[math.log(0.5)]])
    assert grpo.kl_k3(logp, logp).item() == pytest.approx(0.0)
    # d = log .25 - log .5 = -log 2 -> exp(d) - d - 1 = 0.5 + 0.693147 - 1 = 0.193147
    assert grpo.kl_k3(logp, torch.tensor([[math.log(0.25)]])).item() == pytest.approx(0.193147, abs=1e-6)


def test_aggregate_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # token-mean: (1+2+3+4) / 4 = 2.5
    assert grpo.aggregate(loss, mask, "token-mean").item() == pytest.approx(2.5)
    # seq-mean-token-mean: mean(6/3, 4/1) = 3
    assert grpo.aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)
    # seq-mean-token-sum-norm: 10 / (2 * T_max); T_max is a constant, not the batch width 3
    assert grpo.aggregate(loss, mask, "seq-mean-token-sum-norm", max_tokens=3).item() == pytest.approx(10 / 6)
    assert grpo.aggregate(loss, mask, "seq-mean-token-sum-norm", max_tokens=8).item() == pytest.approx(
        10 / 16
    )
    with pytest.raises(ValueError, match="constant max_tokens"):
        grpo.aggregate(loss, mask, "seq-mean-token-sum-norm")  # the batch width is not a constant
    with pytest.raises(ValueError, match="constant max_tokens"):
        grpo.aggregate(loss, mask, "seq-mean-token-sum-norm", max_tokens=2)
    with pytest.raises(ValueError, match="loss_agg"):
        grpo.aggregate(loss, mask, "sum")


def test_grpo_loss_on_policy_gradient_is_advantage_weighted_score():
    # On-policy (logp == prox == sampler): ratio = 1, w = 1, no clipping, and
    # d loss / d logp_t = -A / n_tokens for token-mean.
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]], requires_grad=True)
    same = logp.detach().clone()
    adv = torch.tensor([1.0, -2.0])
    mask = torch.ones(2, 2)
    loss, stats = grpo.grpo_loss(logp, same, same, adv, mask, clip_eps=0.2, is_cap=2.0)
    # loss = -(1*1 + 1*1 + (-2) + (-2)) / 4 = 0.5
    assert loss.item() == pytest.approx(0.5)
    loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-0.25, -0.25, 0.5, 0.5])
    assert stats.clipfrac == 0.0 and stats.is_weight_mean == pytest.approx(1.0)


def test_grpo_loss_clips_ratio_for_positive_advantage():
    # ratio = exp(log 1.5) = 1.5 > 1 + eps = 1.2 and A = +1: surrogate = min(1.5, 1.2) = 1.2,
    # so the token is clipped (zero gradient) and the loss is -1.2.
    prox = torch.tensor([[0.0]])
    logp = torch.tensor([[math.log(1.5)]], requires_grad=True)
    loss, stats = grpo.grpo_loss(
        logp, prox, prox, torch.tensor([1.0]), torch.ones(1, 1), clip_eps=0.2, is_cap=2.0
    )
    assert loss.item() == pytest.approx(-1.2)
    assert stats.clipfrac == 1.0
    loss.backward()
    assert logp.grad.item() == 0.0


def test_grpo_loss_stale_sample_is_weighted_and_kl_added():
    # sampler logp = log .25, prox = log .5 -> w = min(2, C=1.5) = 1.5 (truncated)
    # on-policy ratio 1, A = 1 -> pg = -1.5 ; ref logp = log .25 -> k3 = 0.193147 ; beta = .1
    prox = torch.tensor([[math.log(0.5)]])
    logp = prox.clone().requires_grad_(True)
    sampler = torch.tensor([[math.log(0.25)]])
    ref = torch.tensor([[math.log(0.25)]])
    loss, stats = grpo.grpo_loss(
        logp,
        prox,
        sampler,
        torch.tensor([1.0]),
        torch.ones(1, 1),
        clip_eps=0.2,
        is_cap=1.5,
        kl_beta=0.1,
        logp_ref_BT=ref,
        clip_anchor="proximal",
    )
    assert loss.item() == pytest.approx(-1.5 + 0.1 * 0.193147, abs=1e-6)
    assert stats.is_truncated_frac == 1.0
    assert stats.kl == pytest.approx(0.193147, abs=1e-6)


def test_coupled_clip_stops_pushing_a_stale_token_the_learner_already_moved():
    # sampler p = .25, learner (prox = current, one minibatch) p = .5: ratio to the sampler 2 > 1.2.
    # Decoupled: ratio to prox is 1, so the token is still pushed, with weight min(2, C).
    # Coupled: the clip against the sampler is active and A > 0, so no gradient.
    sampler = torch.tensor([[math.log(0.25)]])
    grads = {}
    for anchor in ("proximal", "sampler"):
        logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
        loss, stats = grpo.grpo_loss(
            logp, logp.detach(), sampler, torch.tensor([1.0]), torch.ones(1, 1),
            clip_eps=0.2, is_cap=2.0, clip_anchor=anchor,
        )  # fmt: skip
        loss.backward()
        grads[anchor] = logp.grad.item()
        if anchor == "sampler":
            assert loss.item() == pytest.approx(-1.2) and stats.clipfrac == 1.0
    assert grads == {"proximal": pytest.approx(-2.0), "sampler": 0.0}


def test_coupled_dual_clip_bounds_negative_advantage():
    # A = -1, ratio to the sampler e^2 ~ 7.4: plain PPO would give loss 7.4 with a growing gradient;
    # the dual clip caps the loss at C * |A| = 3 with no gradient.
    logp = torch.tensor([[0.0]], requires_grad=True)
    sampler = torch.tensor([[-2.0]])
    loss, _ = grpo.grpo_loss(
        logp, logp.detach(), sampler, torch.tensor([-1.0]), torch.ones(1, 1),
        clip_eps=0.2, is_cap=3.0, clip_anchor="sampler",
    )  # fmt: skip
    assert loss.item() == pytest.approx(3.0)
    loss.backward()
    assert logp.grad.item() == 0.0
    # a moderately stale token (ratio 1.5 < C) with A < 0 keeps the PPO gradient -A * ratio
    logp2 = torch.tensor([[math.log(1.5)]], requires_grad=True)
    loss2, _ = grpo.grpo_loss(
        logp2, logp2.detach(), torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1),
        clip_eps=0.2, is_cap=3.0, clip_anchor="sampler",
    )  # fmt: skip
    loss2.backward()
    assert loss2.item() == pytest.approx(1.5) and logp2.grad.item() == pytest.approx(1.5)


def test_anchors_agree_on_fresh_data():
    torch.manual_seed(0)
    base = torch.randn(3, 4)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([1.0, -0.5, 0.0])
    out = []
    for anchor in grpo.CLIP_ANCHORS:
        logp = base.clone().requires_grad_(True)
        loss, _ = grpo.grpo_loss(logp, base, base, adv, mask, clip_eps=0.2, is_cap=2.0, clip_anchor=anchor)
        loss.backward()
        out.append((loss.item(), logp.grad.clone()))
    assert out[0][0] == pytest.approx(out[1][0])
    assert torch.allclose(out[0][1], out[1][1])
    with pytest.raises(ValueError, match="clip_anchor"):
        grpo.grpo_loss(base, base, base, adv, mask, clip_eps=0.2, is_cap=2.0, clip_anchor="learner")


def test_grpo_loss_masked_tokens_do_not_count():
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    same = logp.detach().clone()
    mask = torch.tensor([[1.0, 0.0]])
    loss, _ = grpo.grpo_loss(logp, same, same, torch.tensor([2.0]), mask, clip_eps=0.2, is_cap=2.0)
    loss.backward()
    assert loss.item() == pytest.approx(-2.0)
    assert logp.grad.flatten().tolist() == pytest.approx([-2.0, 0.0])


def test_kl_needs_reference():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="logp_ref"):
        grpo.grpo_loss(x, x, x, torch.zeros(1), torch.ones(1, 1), clip_eps=0.2, is_cap=2.0, kl_beta=0.1)


def test_token_logprobs_matches_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5)
    targets = torch.randint(0, 5, (2, 3))
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, targets[..., None]).squeeze(-1)
    assert torch.allclose(grpo.token_logprobs(logits, targets, 0.7), expected, atol=1e-6)


@pytest.mark.parametrize("anchor", grpo.CLIP_ANCHORS)
def test_poisoned_sampler_logprobs_cannot_make_the_loss_or_its_gradient_non_finite(anchor):
    """A worker's sampler log-probs of -100, -1e4, -1e30 or -inf on some tokens (A = 0 rows included:
    unclamped, exp overflows float32 and inf * 0 is nan): the loss and its gradient stay finite, and at
    -100 they equal the unclamped loss computed in float64, where exp(100) is finite."""
    torch.manual_seed(1)
    base = torch.randn(4, 5) - 1.0  # learner log-probs
    adv = torch.tensor([1.0, -1.0, 0.0, 0.5])
    mask = torch.ones(4, 5)
    sampler = base + 0.1 * torch.randn(4, 5)
    results = {}
    for poison in (-100.0, -1e4, -1e30, -math.inf):
        s = sampler.clone()
        s[:, 1] = poison  # every row, A = 0 included
        logp = base.clone().requires_grad_(True)
        loss, stats = grpo.grpo_loss(logp, base, s, adv, mask, clip_eps=0.2, is_cap=3.0, clip_anchor=anchor)
        loss.backward()
        assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all(), (poison, loss)
        assert math.isfinite(stats.is_weight_mean)
        results[poison] = (loss.item(), logp.grad.clone())
    # the float64 reference without the clamp: the same loss and gradient at -100
    s64 = sampler.double()
    s64[:, 1] = -100.0
    logp64 = base.double().requires_grad_(True)
    A = adv.double()[:, None]
    if anchor == "sampler":
        ratio = torch.exp(logp64 - s64)
        surr = torch.minimum(ratio * A, ratio.clamp(0.8, 1.2) * A)
        pg = -torch.where(A < 0, torch.maximum(surr, 3.0 * A), surr)
    else:
        w = torch.exp(base.double() - s64).clamp(max=3.0)
        ratio = torch.exp(logp64 - base.double())
        pg = -w * torch.minimum(ratio * A, ratio.clamp(0.8, 1.2) * A)
    ref = pg.mean()
    ref.backward()
    assert results[-100.0][0] == pytest.approx(ref.item(), rel=1e-5)
    assert torch.allclose(results[-100.0][1].double(), logp64.grad, atol=1e-6)
    for poison in (-1e4, -1e30, -math.inf):  # deeper poison is clipped the same way
        assert results[poison][0] == pytest.approx(results[-100.0][0], rel=1e-6)
        assert torch.allclose(results[poison][1], results[-100.0][1])


# ---- the loss menu, each term against its paper's equation worked by hand ---------------------------


def test_clip_higher_splits_the_clip_as_dapo_eq_10():
    # coupled anchor (ratio to the sampler). Token 1: ratio 1.25, A = +1; token 2: ratio 0.7, A = -1.
    # DAPO eps_low 0.2 / eps_high 0.28: clip(1.25) = 1.25 -> not clipped, pg = -1.25, d/dlogp = -1.25;
    # clip(0.7) = 0.8 -> min(-0.7, -0.8) = -0.8: clipped low, pg = 0.8, no gradient.
    # token-mean over 2 tokens: loss = (-1.25 + 0.8) / 2 = -0.225; gradient (-0.625, 0).
    sampler = torch.tensor([[0.0], [0.0]])
    logp = torch.tensor([[math.log(1.25)], [math.log(0.7)]], requires_grad=True)
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 1)
    split = grpo.Objective(clip_eps_low=0.2, clip_eps_high=0.28, is_cap=3.0)
    loss, stats = grpo.grpo_loss(logp, sampler, sampler, adv, mask, objective=split)
    assert loss.item() == pytest.approx(-0.225)
    loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-0.625, 0.0])
    assert (stats.clipfrac, stats.clipfrac_low, stats.clipfrac_high) == (0.5, 0.5, 0.0)
    # symmetric 0.2: token 1 is clipped high too (min(1.25, 1.2) = 1.2): loss (-1.2 + 0.8) / 2 = -0.2
    loss, stats = grpo.grpo_loss(logp, sampler, sampler, adv, mask, clip_eps=0.2, is_cap=3.0)
    assert loss.item() == pytest.approx(-0.2)
    assert (stats.clipfrac, stats.clipfrac_low, stats.clipfrac_high) == (1.0, 0.5, 0.5)


def test_gspo_sequence_ratio_is_the_length_normalised_geometric_mean_eq_7():
    # one sequence of 2 tokens, log-ratios log 1.1 and log 0.9: s = exp((log 1.1 + log 0.9) / 2)
    # = sqrt(0.99) = 0.994987; eps 3e-4 / 4e-4 -> clip(s) = 0.9997.
    # A = +1: min(s, 0.9997) = s, loss -s (seq-mean-token-mean), d(-s)/dlogp_t = -s / 2 = -0.497494.
    # A = -1: min(-s, -0.9997) = -0.9997: clipped low, loss 0.9997, no gradient.
    old = torch.zeros(1, 2)
    s = math.sqrt(0.99)
    gspo = grpo.Objective(
        clip_eps_low=3e-4,
        clip_eps_high=4e-4,
        ratio_level="sequence",
        loss_agg="seq-mean-token-mean",
        is_cap=3.0,
    )
    for a, want_loss, want_grad, low in ((1.0, -s, -s / 2, 0.0), (-1.0, 1 - 3e-4, 0.0, 1.0)):
        logp = torch.tensor([[math.log(1.1), math.log(0.9)]], requires_grad=True)
        loss, stats = grpo.grpo_loss(logp, old, old, torch.tensor([a]), torch.ones(1, 2), objective=gspo)
        assert loss.item() == pytest.approx(want_loss, abs=1e-6)
        loss.backward()
        assert logp.grad.flatten().tolist() == pytest.approx([want_grad, want_grad], abs=1e-6)
        assert stats.clipfrac_low == low
    ratio = grpo.policy_ratio(torch.tensor([[math.log(1.1), math.log(0.9), 5.0]]), torch.zeros(1, 3),
                              torch.tensor([[1.0, 1.0, 0.0]]), "sequence")  # fmt: skip
    assert ratio.flatten().tolist() == pytest.approx([s, s, s])  # a masked token is not in the mean


def test_cispo_weighs_every_tokens_logprob_by_its_clipped_ratio_minimax_m1_eq_4():
    # coupled anchor. Token 1: sampler p 0.4, learner p 0.6 -> ratio 1.5, clipped to 1 + 0.28 = 1.28;
    # token 2: sampler 0.5, learner 0.25 -> ratio 0.5 (eps_low 1: no lower bound). A = +1 both.
    # pg_t = -sg(clip(r_t)) * A * logp_t; token-mean: loss = -(1.28 log .6 + 0.5 log .25) / 2 = 0.673502;
    # d/dlogp = (-1.28 / 2, -0.5 / 2) = (-0.64, -0.25): the clipped token still pushes (PPO: 0).
    sampler = torch.tensor([[math.log(0.4), math.log(0.5)]])
    logp = torch.tensor([[math.log(0.6), math.log(0.25)]], requires_grad=True)
    cispo = grpo.Objective(policy_loss="cispo", clip_eps_low=1.0, clip_eps_high=0.28)
    loss, stats = grpo.grpo_loss(
        logp, sampler, sampler, torch.tensor([1.0]), torch.ones(1, 2), objective=cispo
    )
    assert loss.item() == pytest.approx(0.673502, abs=1e-6)
    loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-0.64, -0.25])
    assert (stats.clipfrac_high, stats.clipfrac_low) == (0.5, 0.0)


def test_masked_importance_sampling_at_token_sequence_and_geometric_level():
    # rho = exp(prox - sampler) = (3, 0.25, 1.5), C = 2.
    # token: truncate min(rho, 2) = (2, .25, 1.5); mask keeps rho in [0.5, 2] = (0, 0, 1.5)
    # sequence: rho = 3 * .25 * 1.5 = 1.125 at every token; geometric: 1.125 ** (1/3) = 1.040042
    prox = torch.zeros(1, 3)
    sampler = -torch.tensor([[math.log(3.0), math.log(0.25), math.log(1.5)]])
    mask = torch.ones(1, 3)
    want = {
        ("truncate", "token"): [2.0, 0.25, 1.5],
        ("mask", "token"): [0.0, 0.0, 1.5],
        ("truncate", "sequence"): [1.125] * 3,
        ("mask", "sequence"): [1.125] * 3,
        ("mask", "geometric"): [1.125 ** (1 / 3)] * 3,
    }
    for (mode, level), w in want.items():
        got = grpo.is_weights(prox, sampler, mask, 2.0, mode, level)
        assert got.flatten().tolist() == pytest.approx(w, abs=1e-6), (mode, level)
        # decoupled, fresh update (logp = prox): ratio 1, pg_t = -w_t * A; token-mean with A = 1
        obj = grpo.Objective(clip_anchor="proximal", is_mode=mode, is_level=level, is_cap=2.0)
        logp = prox.clone().requires_grad_(True)
        loss, stats = grpo.grpo_loss(logp, prox, sampler, torch.tensor([1.0]), mask, objective=obj)
        assert loss.item() == pytest.approx(-sum(w) / 3, abs=1e-6)
    _, stats = grpo.grpo_loss(prox, prox, sampler, torch.tensor([1.0]), mask,
                              objective=grpo.Objective(clip_anchor="proximal", is_mode="mask"))  # fmt: skip
    assert stats.is_truncated_frac == pytest.approx(2 / 3)  # two of three tokens masked
    assert grpo.is_weights(prox, sampler, mask, 1e8, "mask", "sequence").flatten().tolist() == pytest.approx(
        [1.125] * 3
    )


def test_offpolicy_sequence_masking_leaves_out_negative_drifted_sequences_deepseek_v32_eq_9():
    # three sequences of one token, on the learner (logp) at 0; sampler log-probs 0.5, 0.1, 0.5.
    # mean(logp_sampler - logp) = 0.5, 0.1, 0.5 against delta 0.3; A = -1, -1, +1:
    # sequence 1 (A < 0, drift 0.5 > 0.3) is left out; 2 (drift 0.1) and 3 (A > 0) stay.
    # on-policy ratio... coupled: ratio = exp(0 - s) = (e^-.5, e^-.1, e^-.5);
    # pg = -min(rA, clip(r)A) per token: seq 2: r = .904837, A = -1: min(-.904837, -.904837) -> .904837;
    # seq 3: r = .606531 < .8, A = +1: min(.606531, .8) = .606531 -> -.606531. token-mean over 3:
    # loss = (0 + .904837 - .606531) / 3 = 0.099435
    logp = torch.zeros(3, 1)
    sampler = torch.tensor([[0.5], [0.1], [0.5]])
    obj = grpo.Objective(offpolicy_delta=0.3, is_cap=3.0)
    loss, stats = grpo.grpo_loss(logp, logp, sampler, torch.tensor([-1.0, -1.0, 1.0]), torch.ones(3, 1),
                                 objective=obj)  # fmt: skip
    assert loss.item() == pytest.approx((math.exp(-0.1) - math.exp(-0.5)) / 3, abs=1e-6)
    assert stats.masked_seq_frac == pytest.approx(1 / 3)


def test_the_mismatch_kl_and_the_entropy_read_fresh_tokens_only():
    # fresh row: prox - sampler = log 2 -> k3 = 2 - 1 - log 2 = 0.306853; the stale row (log 8) is not read.
    # entropy: mean -logp_prox over the fresh tokens, the Monte-Carlo estimate -E[log pi(y)], y ~ pi
    ent = torch.tensor([[math.log(0.25)], [math.log(0.5)]])
    _, est = grpo.grpo_loss(ent, ent, ent, torch.zeros(2), torch.ones(2, 1), clip_eps=0.2, is_cap=2.0,
                            fresh_B=torch.tensor([True, False]))  # fmt: skip
    assert est.entropy == pytest.approx(math.log(4.0)) and est.mismatch_kl == pytest.approx(0.0)
    prox = torch.zeros(2, 1)
    sampler = -torch.tensor([[math.log(2.0)], [math.log(8.0)]])
    _, stats = grpo.grpo_loss(prox, prox, sampler, torch.zeros(2), torch.ones(2, 1), clip_eps=0.2,
                              is_cap=2.0, fresh_B=torch.tensor([True, False]))  # fmt: skip
    assert stats.mismatch_kl == pytest.approx(2 - 1 - math.log(2.0), abs=1e-6) and stats.fresh_tokens == 1
    ((row, k3, n),) = stats.seq_mismatch  # per fresh sequence (read per worker by the trainer)
    assert (row, n) == (0, 1.0) and k3 == pytest.approx(2 - 1 - math.log(2.0), abs=1e-6)
    _, none = grpo.grpo_loss(prox, prox, sampler, torch.zeros(2), torch.ones(2, 1), clip_eps=0.2, is_cap=2.0)
    assert math.isnan(none.mismatch_kl)


def test_presets_carry_their_papers_settings_and_explicit_fields_win():
    from pydantic import ValidationError

    from echo2.config import GRPOConfig

    dapo = GRPOConfig(algorithm="dapo")
    assert (dapo.eps_low, dapo.eps_high, dapo.kl_beta, dapo.loss_agg) == (0.2, 0.28, 0.0, "token-mean")
    gspo = GRPOConfig(algorithm="gspo", kl_beta=0.01)
    assert (gspo.ratio_level, gspo.eps_low, gspo.eps_high, gspo.kl_beta) == ("sequence", 3e-4, 4e-4, 0.01)
    assert GRPOConfig(algorithm="grpo").kl_beta == 0.04 and not GRPOConfig(algorithm="dr_grpo").scale_by_std
    assert GRPOConfig(algorithm="cispo").loss == "cispo" and GRPOConfig(algorithm="cispo").eps_low == 1.0
    assert GRPOConfig(algorithm="dapo", clip_eps=0.1).eps_high == 0.1  # a clip given sets both sides
    assert GRPOConfig().eps_low == GRPOConfig().eps_high == 0.2  # no preset: the defaults as before
    for bad, match in (
        ({"is_mode": "mask"}, 'clip_anchor = "proximal"'),
        ({"loss": "cispo", "ratio_level": "sequence"}, "choose one"),
        ({"clip_eps_high": 1.5}, "is_cap=2 must exceed 1 \\+ clip_eps_high"),
        ({"algorithm": "ppo2"}, "algorithm"),
    ):
        with pytest.raises(ValidationError, match=match):
            GRPOConfig(**bad)
