"""Seeded Gumbel-max sampling (rollout/sampling.py) and the learner's re-run of it (tasks/verify.py):
an honest worker's completions pass, every kind of forgery fails."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch

from echo2.check.rerun import GenerationCheck
from echo2.config import SamplingConfig, SecurityConfig
from echo2.data.store import Lease
from echo2.data.submission import Rejected, Submission
from echo2.models.snapshot import alias_weights, aliasing_model, install_weights
from echo2.rollout.engines.hf import HFEngine
from echo2.rollout.sampling import GUMBEL_MAX, GUMBEL_MIN, gumbel_draw, gumbel_noise, min_drawn_logprob
from echo2.types import Prompt, Trajectory
from echo2.weights.delta import sampler_copy

G = 4


def test_gumbel_noise_is_a_function_of_seed_row_step_token_alone():
    a = gumbel_noise(7, torch.tensor([0, 1, 2]), 5, 50)
    b = gumbel_noise(7, torch.tensor([2]), 5, 50)  # the same row in another batch
    assert torch.equal(a[2], b[0])
    assert not torch.equal(a[0], a[1])  # rows differ
    assert not torch.equal(a[0], gumbel_noise(7, torch.tensor([0]), 6, 50)[0])  # steps differ
    assert not torch.equal(a[0], gumbel_noise(8, torch.tensor([0]), 5, 50)[0])  # seeds differ
    assert not torch.equal(a[0], gumbel_noise(7 + 2**32, torch.tensor([0]), 5, 50)[0])  # high bits count
    assert torch.isfinite(a).all()
    with pytest.raises(ValueError):
        gumbel_noise(-1, torch.tensor([0]), 0, 4)


@pytest.mark.parametrize("block", [None, 1000, 64])
@pytest.mark.parametrize("vocab", [50, 4099, 151_936])
def test_the_noise_computed_in_blocks_is_the_plain_formula_bit_for_bit(monkeypatch, block, vocab):
    """Blocks of whole rows, a row split into blocks, every step of one row in one call (the check's
    shape): the same bits as the formula computed whole. The draw is a protocol: a worker and the
    learner must agree whichever way each computes it."""
    from echo2.rollout import sampling
    from echo2_bench.noise_study import plain  # the formula computed whole (the code before the blocks)

    if block is not None:
        monkeypatch.setattr(sampling, "CPU_BLOCK", block)
    rows, steps = torch.arange(7), torch.arange(5, 12)
    assert torch.equal(gumbel_noise(11, rows, 3, vocab), plain(11, rows, 3, vocab))
    one_row = torch.full((7,), 2)
    assert torch.equal(
        gumbel_noise(2**40 + 5, one_row, steps, vocab), plain(2**40 + 5, one_row, steps, vocab)
    )
    assert gumbel_noise(11, rows[:0], 3, vocab).shape == (0, vocab)


def test_the_draw_is_pinned():
    """The noise is a protocol between workers and the learner of any version: its 23-bit uniforms for a
    fixed (seed, rows, step), pinned. A change to the hash (or to how its blocks are cut) that moves them
    would have every honest worker of another release quarantined."""
    pinned = [  # seed 2**40 + 7, step 3, rows 0, 1 and 5, tokens 0-5
        [7514665, 5029701, 459591, 3726935, 4669774, 1907748],
        [3809744, 5175438, 2821811, 7585002, 1597261, 220304],
        [5048832, 4731446, 1086715, 7457951, 7874515, 7850509],
    ]
    u = (torch.tensor(pinned, dtype=torch.float32) + 0.5) / 2**23
    assert torch.equal(gumbel_noise(2**40 + 7, torch.tensor([0, 1, 5]), 3, 6), -torch.log(-torch.log(u)))


def test_gumbel_max_draws_from_the_tempered_nucleus_distribution():
    """20,000 seeded draws over a 5-token distribution: frequencies within 4 standard errors of the
    probabilities; tokens outside the top-p nucleus are never drawn."""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.07, 0.03])
    logits = torch.log(probs)[None].repeat(20_000, 1)
    rows = torch.arange(20_000)
    drawn = torch.cat([gumbel_draw(logits[:1000], 1.0, seed, rows[:1000], 0) for seed in range(20)])
    freq = torch.bincount(drawn, minlength=5).float() / drawn.numel()
    se = (probs * (1 - probs) / drawn.numel()).sqrt()
    assert ((freq - probs).abs() <= 4 * se).all(), (freq, probs)
    nucleus = gumbel_draw(logits[:5000], 0.85, 3, rows[:5000], 1)  # .4 + .3 + .2 reaches .85
    assert set(nucleus.tolist()) == {0, 1, 2}


def test_gumbel_noise_is_finite_at_every_uniform_and_bounded():
    """The extreme uniforms give finite noise (with 24 bits the top one rounded to 1.0 in float32 and
    its noise was +inf: a token drawn whatever its probability); the bounds are the ones stated."""
    from echo2.rollout import sampling

    bits = torch.tensor([0, 1, 2**sampling._BITS - 2, 2**sampling._BITS - 1])
    u = (bits.to(torch.float32) + 0.5) * sampling._U_SCALE
    assert (u < 1.0).all() and (u > 0.0).all()
    noise = -torch.log(-torch.log(u))
    assert torch.isfinite(noise).all()
    assert noise.min() == pytest.approx(GUMBEL_MIN, abs=1e-5)
    assert noise.max() == pytest.approx(GUMBEL_MAX, abs=1e-5)
    wide = gumbel_noise(3, torch.arange(64), 0, 50_000)  # 3.2M draws: every one within the bounds
    assert float(wide.min()) >= GUMBEL_MIN - 1e-5 and float(wide.max()) <= GUMBEL_MAX + 1e-5


def test_no_drawn_token_is_less_likely_than_the_bound():
    """Adversarial logits (one token far ahead, the rest spread over 40 nats) at vocabularies of 50 and
    50,000: the log-prob of every drawn token is above min_drawn_logprob(V) (a worst case: it needs the
    largest noise on the drawn token and the smallest on the favourite, so typical minima sit well above)."""
    gen = torch.Generator().manual_seed(0)
    lowest = {}
    for vocab in (50, 50_000):
        logits = torch.rand((256, vocab), generator=gen) * -40.0
        logits[:, 0] = 0.0  # a clear favourite: every other draw needs a large noise gap
        logp = torch.log_softmax(logits, dim=-1)
        drawn = torch.cat([gumbel_draw(logits, 1.0, seed, torch.arange(256), 0) for seed in range(8)])
        got = logp.repeat(8, 1).gather(-1, drawn[:, None]).squeeze(-1)
        lowest[vocab] = float(got.min())
        assert lowest[vocab] >= min_drawn_logprob(vocab), (vocab, lowest[vocab])
    assert min_drawn_logprob(151_936) == pytest.approx(-32.378, abs=1e-3)
    assert lowest[50_000] < lowest[50]  # rarer tokens get drawn at a larger vocabulary
    with pytest.raises(ValueError):
        min_drawn_logprob(0)


@pytest.fixture(scope="module")
def setup(tiny_policy_module):
    """An honest worker's generations with version 1's published (bf16) weights, a check holding the
    weights of versions 1 and 2 (2 = after a real perturbation of every weight)."""
    policy = tiny_policy_module
    sampling = SamplingConfig(temperature=1.0, top_p=0.95, max_new_tokens=8)
    v1 = sampler_copy(policy.model, "bfloat16")
    worker = copy.deepcopy(policy.model)
    install_weights(worker, v1)
    engine = HFEngine(worker, policy.eos_id, policy.pad_id, sampling)
    other = copy.deepcopy(policy.model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    v2 = sampler_copy(other, "bfloat16")
    # the learner's check model: it reads the kept bf16 copies in place (models/snapshot.py)
    check = GenerationCheck(aliasing_model(policy.model), sampling, SecurityConfig(), rng=random.Random(0))
    check.keep(1, v1)
    check.keep(2, v2)
    prompts = [Prompt(f"p{i}", f"{i}+{i}=", str(2 * i)) for i in range(3)]
    encoded = [policy.encode_prompt(p.text) for p in prompts]
    seed = 123456789
    samples = engine.generate([ids for ids in encoded for _ in range(G)], seed=seed)
    groups = tuple(
        tuple(
            Trajectory(
                prompts[i].prompt_id,
                f"L:{i}",
                tuple(encoded[i]),
                samples[i * G + j].completion_ids,
                samples[i * G + j].logprobs,
                0.0,
                1,
            )
            for j in range(G)
        )
        for i in range(len(prompts))
    )
    lease = Lease("L", "w", "open", 0.0, prompts, seed, 1)
    return check, lease, Submission("L", 1, groups), engine, encoded


ALL = [(i, j) for i in range(3) for j in range(G)]


def test_honest_completions_pass(setup):
    check, lease, sub, _, _ = setup
    verdicts = check.check(lease, sub, ALL)
    assert len(verdicts) == len(ALL) and all(v.misses == 0 for v in verdicts)
    assert max(v.max_logprob_error for v in verdicts) < 1e-3  # batched vs unbatched kernels only


def test_a_check_gives_a_running_update_its_turn_and_its_verdict_is_unchanged(setup):
    """With security.check_duty = 0 a check started during an update waits, between its chunks, until the
    update ends; then it finishes with the same verdicts (honest passes, a forgery fails). Next to the
    honest test: later tests change what the module's check holds."""
    import threading
    import time

    from echo2.check.turns import Turns

    check, lease, sub, _, _ = setup
    alone = check.check(lease, sub, ALL[:2])
    turns = Turns(0.0)
    check.turns = turns
    got: list = []
    try:
        with turns.updating():
            th = threading.Thread(target=lambda: got.append(check.check(lease, sub, ALL[:2])))
            th.start()
            time.sleep(0.5)
            assert th.is_alive() and not got and turns.pauses >= 1  # held at its first chunk's end
        th.join(60)
        assert [v.misses for v in got[0]] == [v.misses for v in alone]
        assert [v.max_logprob_error for v in got[0]] == [v.max_logprob_error for v in alone]
        t = sub.groups[0][0]
        bad = _forged(sub, 0, 0, sampler_logprobs=tuple(lp - 0.5 for lp in t.sampler_logprobs))
        with pytest.raises(Rejected, match="forged_generation"):
            check.check(lease, bad, [(0, 0)])
    finally:
        check.turns = Turns()


def _forged(sub: Submission, i: int, j: int, **change) -> Submission:
    groups = [list(g) for g in sub.groups]
    groups[i][j] = dataclasses.replace(groups[i][j], **change)
    return dataclasses.replace(sub, groups=tuple(tuple(g) for g in groups))


def test_tampered_logprobs_fail(setup):
    check, lease, sub, _, _ = setup
    t = sub.groups[0][1]
    bad = _forged(sub, 0, 1, sampler_logprobs=tuple(lp - 0.5 for lp in t.sampler_logprobs))
    with pytest.raises(Rejected, match=r"forged_generation: groups\[0\]\.samples\[1\]"):
        check.check(lease, bad, [(0, 1)])
    check.check(lease, bad, [(0, 0)])  # the untouched sample still passes: the check is per completion


def test_another_model_or_an_inflated_version_fails(setup):
    check, lease, sub, _, _ = setup
    inflated = dataclasses.replace(sub, policy_version=2)  # sampled with 1, claimed 2
    with pytest.raises(Rejected, match="forged_generation"):
        check.check(lease, inflated, ALL)


def test_cherry_picking_and_another_seed_fail(setup):
    """Best-of-n: the worker samples other draws (another seed) and submits them as the lease's."""
    check, lease, sub, engine, encoded = setup
    redraw = engine.generate([encoded[0]] * G, seed=lease.seed + 1)
    picked = _forged(sub, 0, 2, completion_ids=redraw[2].completion_ids, sampler_logprobs=redraw[2].logprobs)
    if picked.groups[0][2].completion_ids == sub.groups[0][2].completion_ids:
        pytest.skip("the redraw happens to coincide")  # vanishingly unlikely with 8-token completions
    with pytest.raises(Rejected, match="forged_generation"):
        check.check(lease, picked, [(0, 2)])


def test_a_version_not_held_is_refused_never_passed_and_old_ones_are_forgotten(setup, tiny_policy_module):
    """A claim of a version whose weights the check does not hold cannot be re-run: it is refused
    (unchecked_version), never waved through as checked. Versions below the admission floor are
    forgotten, except one a drawn submission pinned until its check ran."""
    check, lease, sub, _, _ = setup
    assert not check.holds(7) and check.holds(sub.policy_version)
    checked = check.checked
    with pytest.raises(Rejected, match="unchecked_version"):
        check.check(lease, dataclasses.replace(sub, policy_version=7), ALL)
    assert check.checked == checked
    model = aliasing_model(tiny_policy_module.model)
    fresh = GenerationCheck(model, check.sampling, SecurityConfig(), rng=random.Random(0))
    weights = sampler_copy(tiny_policy_module.model, "bfloat16")
    for v in range(5):
        name = sorted(weights)[0]
        weights = {**weights, name: weights[name] + 1} if v else weights
        fresh.keep(v, weights)
    assert fresh.pin(1) and not fresh.pin(9)  # a drawn submission's version, and one never held
    fresh.forget_below(3)  # the learner moved on while that check waited: 1 stays, and 2 to rebuild it
    assert fresh.versions() == [1, 2, 3, 4] and fresh.holds(1)
    assert fresh.pin(1)  # a second drawn claim of it
    fresh.unpin(1)
    assert fresh.versions() == [1, 2, 3, 4]
    fresh.unpin(1)  # the last check of it ran: what only it kept goes
    assert fresh.versions() == [3, 4] and fresh.holds(3) and not fresh.holds(2)
    assert not fresh.pin(2)
    with pytest.raises(ValueError, match="not newer"):
        fresh.keep(4, weights)


def test_an_older_version_is_rebuilt_for_its_check_and_not_kept(setup):
    """The check keeps the newest copy whole and older admissible versions as undos: a claim of the
    older version (1) is re-run with weights rebuilt bit for bit, and the check model goes back to the
    newest copy after it (no rebuilt copy outlives the check)."""
    check, lease, sub, _, _ = setup
    assert check.versions() == [1, 2] and sub.policy_version == 1
    undo = check._undos[1]
    assert 0 < check.held_bytes() == undo.nbytes <= sum(t.nbytes for t in check._newest[1].values())
    rebuilds = check.rebuilds
    check.check(lease, sub, ALL)
    assert check.rebuilds == rebuilds + 1 and check._loaded == 2


def test_pick_draws_the_configured_fraction(setup):
    _, _, sub, _, _ = setup
    check = GenerationCheck(setup[0].model, setup[0].sampling, SecurityConfig(check_fraction=0.25))
    check.rng = random.Random(1)
    picks = [check.pick(sub) for _ in range(2000)]
    drawn = sum(1 for p in picks if p)
    # by default every completion of a drawn submission is re-run (check_samples = 0)
    assert 0.2 < drawn / 2000 < 0.3 and all(p == ALL for p in picks if p)
    some = GenerationCheck(setup[0].model, setup[0].sampling, SecurityConfig(check_samples=4))
    assert all(len(p) == 4 and set(p) <= set(ALL) for p in (some.pick(sub, 1.0, 1.0) for _ in range(20)))
    never = GenerationCheck(setup[0].model, setup[0].sampling, SecurityConfig(check_fraction=0.0))
    assert all(never.pick(sub) == [] for _ in range(100))
    # a new identity's draw (full = 1): every submission, unless the queue's share declines it
    assert all(check.pick(sub, 1.0, 1.0) for _ in range(100))
    declined = check.declined
    assert all(check.pick(sub, 0.0, 1.0) == [] for _ in range(100)) and check.declined == declined + 100


def test_noise_for_every_step_of_one_row_in_one_call_is_the_same_noise():
    steps = torch.arange(6)
    together = gumbel_noise(99, torch.full((6,), 3), steps, 40)
    one_by_one = torch.cat([gumbel_noise(99, torch.tensor([3]), int(n), 40) for n in steps])
    assert torch.equal(together, one_by_one)


def test_a_batched_rerun_gives_the_single_reruns_verdicts(setup):
    check, lease, sub, _, _ = setup
    picks = [(0, 0), (1, 2), (2, 3)]
    batched = check.check(lease, sub, picks)
    alias_weights(check.model, check._weights_of(1))  # the check settled back on the newest (2)
    check._loaded = 1
    single = [check.rerun(sub.groups[i][j], lease.seed, i * G + j) for i, j in picks]
    assert [v.misses for v in batched] == [v.misses for v in single] == [0, 0, 0]
    assert all(
        abs(a.max_logprob_error - b.max_logprob_error) < 1e-4 for a, b in zip(batched, single, strict=True)
    )


def test_the_check_model_is_built_without_a_full_precision_twin():
    """``aliasing_model`` builds its architecture with the parameters on the meta device: building the
    check model of a 25M-parameter Qwen3 raises the process's peak resident memory by less than 0.25
    bytes a parameter (a float32 random init, the way before, held 4, and its cast to the compute
    dtype 2 more). The peak is read from ``VmHWM`` after resetting it (``/proc/self/clear_refs``)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    config = Qwen3Config(vocab_size=1024, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64)  # fmt: skip
    with torch.device("meta"):  # only its config and device are read
        model = Qwen3ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    model.to_empty(device="cpu")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("needs /proc/self/clear_refs to reset the peak")
    before = status("VmRSS")
    twin = aliasing_model(model, "bfloat16")
    grew = status("VmHWM") - before
    assert params > 25e6 and grew / params < 0.25, grew / params
    assert sum(p.numel() for p in twin.parameters()) == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_check_model_reads_the_kept_copies_in_place_and_computes_as_the_worker(tiny_policy, dtype):
    """The learner's check model (``aliasing_model``) owns no weights: after a version is loaded, each
    of its parameters is a kept bf16 tensor itself, read in the engines' compute dtype at each use; its
    logits are those of a worker's engine computing in that dtype (the same model holding the same
    rounded values, cast whole as ``HFEngine.from_skeleton`` casts it) bit for bit."""
    from echo2.errors import CheckpointError

    weights = sampler_copy(tiny_policy.model, "bfloat16")
    twin = aliasing_model(tiny_policy.model, dtype)
    assert sum(p.numel() for p in twin.parameters()) == 0  # nothing loaded yet: no weight bytes at all
    alias_weights(twin, weights)
    kept = {t.untyped_storage().data_ptr() for t in weights.values()}
    assert {p.untyped_storage().data_ptr() for p in twin.parameters()} <= kept  # no copy
    worker = copy.deepcopy(tiny_policy.model).to(getattr(torch, dtype))
    install_weights(worker, weights)
    ids = torch.tensor([[5, 9, 3, 17, 4, 11], [8, 2, 6, 6, 13, 1]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    with torch.no_grad():
        assert torch.equal(
            twin(input_ids=ids, attention_mask=mask).logits, worker(input_ids=ids, attention_mask=mask).logits
        )
    head, embed = twin.get_output_embeddings(), twin.get_input_embeddings()
    if tiny_policy.model.config.tie_word_embeddings:  # one kept tensor read by both modules
        assert head.parametrizations.weight.original is embed.parametrizations.weight.original
    bad = dict(weights)
    name = next(iter(bad))
    bad[name] = bad[name][:1]
    with pytest.raises(CheckpointError, match=name):
        alias_weights(twin, bad)
    with pytest.raises(CheckpointError, match="lacks"):
        alias_weights(twin, {k: v for k, v in weights.items() if k != name})


def test_a_bf16_engine_passes_at_the_declared_precision_and_forgeries_still_fail(setup, tiny_policy_module):
    """A bfloat16 engine's honest completions pass a check whose tolerances come from the run's
    declared engine precision; tampered log-probs and another version's tokens still fail it."""
    policy = tiny_policy_module
    check32, lease, sub, engine, encoded = setup
    bf16 = HFEngine(
        copy.deepcopy(engine.model).to(torch.bfloat16), policy.eos_id, policy.pad_id, engine.sampling
    )
    samples = bf16.generate([ids for ids in encoded for _ in range(G)], seed=lease.seed)
    groups = tuple(
        tuple(
            dataclasses.replace(t, completion_ids=s.completion_ids, sampler_logprobs=s.logprobs)
            for t, s in zip(g, samples[i * G : (i + 1) * G], strict=True)
        )
        for i, g in enumerate(sub.groups)
    )
    honest = dataclasses.replace(sub, groups=groups)
    declared = SecurityConfig(engine_precision="bfloat16")
    check = GenerationCheck(  # as the learner builds it: computing in the declared precision
        aliasing_model(policy.model, "bfloat16"), check32.sampling, declared, rng=random.Random(0)
    )
    in_float32 = GenerationCheck(check32.model, check32.sampling, declared, rng=random.Random(0))
    assert declared.tolerances() == (0.6, 0.5)
    assert SecurityConfig(engine_precision="bfloat16", logprob_tolerance=0.1).tolerances() == (0.1, 0.5)
    for v, w in ((1, check32._weights_of(1)), (2, check32._weights_of(2))):
        check.keep(v, {k: t.clone() for k, t in w.items()})
        in_float32.keep(v, {k: t.clone() for k, t in w.items()})
    verdicts = check.check(lease, honest, ALL)
    assert all(v.misses == 0 for v in verdicts)
    worst = max(v.max_logprob_error for v in verdicts)
    assert worst < max(v.max_logprob_error for v in in_float32.check(lease, honest, ALL))  # closer
    t = honest.groups[1][2]
    tampered = _forged(honest, 1, 2, sampler_logprobs=tuple(lp - 1.0 for lp in t.sampler_logprobs))
    with pytest.raises(Rejected, match="forged_generation"):
        check.check(lease, tampered, [(1, 2)])
    with pytest.raises(Rejected, match="forged_generation"):
        check.check(lease, dataclasses.replace(honest, policy_version=2), ALL)


def test_the_workers_engine_dtype_must_be_the_checks_declared_precision():
    from echo2.config import Config

    with pytest.raises(ValueError, match=r"security.engine_precision = 'bfloat16'"):
        Config.model_validate({"runtime": {"engine_dtype": "bfloat16"}})
    Config.model_validate(
        {"runtime": {"engine_dtype": "bfloat16"}, "security": {"engine_precision": "bfloat16"}}
    )
