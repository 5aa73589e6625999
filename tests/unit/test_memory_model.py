"""The learner's memory model (planner/memory_model.py; docs/learner.md): hand-worked parts and shapes, and
`echo2 plan` reporting whether a GPU holds the learner."""

from __future__ import annotations

import json

import pytest

from echo2.planner.memory_model import (
    GIB,
    QWEN3_SHAPES,
    ModelShape,
    autocast_copies,
    fits,
    learner_memory,
    load_peak_bytes,
    older_versions,
)


def test_qwen3_shapes_count_the_released_parameters():
    # the released checkpoints' totals (tied embeddings up to 4B, an untied head at 8B)
    assert QWEN3_SHAPES["0.6B"].params == 596_049_920
    assert QWEN3_SHAPES["1.7B"].params == 1_720_574_976
    assert QWEN3_SHAPES["4B"].params == 4_022_468_096
    assert QWEN3_SHAPES["8B"].params == 8_190_735_360


def test_bytes_per_parameter_by_part():
    shape = QWEN3_SHAPES["1.7B"]
    m = learner_memory(shape, "bf16-mixed")  # S = 3, kappa = 2, checks on, bf16 publications
    assert (m.weights, m.gradients, m.optimizer) == (4, 4, 8) and m.training == 16  # SPEC §9's floor
    # the newest publication (the next patch's base), whole; the one older admissible version (8 of 8,
    # 10) as an undo of the 5% of elements a publication changes: bf16 values + a bit mask (1/8 < 4 f)
    assert m.sampler_copy_count == 1 and m.sampler_copies == 2
    assert m.older_versions == pytest.approx(2 * 0.05 + 1 / 8) and m.check_transient == 2
    assert m.update_peak == pytest.approx(18.225) and m.check_model == 0 and m.reference == 0
    sparse = learner_memory(shape, "fp32", changed_fraction=0.01).older_versions
    assert sparse == pytest.approx(0.01 * (2 + 4))  # int32 positions are smaller below f = 1/32
    assert learner_memory(shape, "fp32", checks=False).update_peak == 18  # no older version kept
    assert learner_memory(shape, "fp32", on_disk=False).sampler_copies == 4  # the anchor in memory
    assert learner_memory(shape, "fp32", changed_fraction=0.95).older_versions == 2  # never above a copy
    assert learner_memory(shape, "fp32", kl_reference=True).reference == 4
    assert learner_memory(shape, "bf16-mixed", kl_reference=True).reference == 2
    gpu = learner_memory(shape, "bf16-mixed", gpu=True)
    assert gpu.device == pytest.approx(16 + 2 + gpu.autocast_copies)  # a check model of bf16 weights
    assert learner_memory(shape, "fp32", gpu=True).device == 16 + 2  # nothing cast in fp32
    assert gpu.host == pytest.approx(2 + 0.225 + 2 + 4)  # copy, undo, a rebuilt version, a publication
    assert older_versions(0, 1, True) == 0  # S = 0: only the newest version is admissible
    assert older_versions(6, 1, True) == 6  # kappa = 1: every one of the 7 admissible versions
    assert older_versions(3, 2, False) == 0


def test_autocasts_bf16_weight_copies_hand_worked():
    """bf16-mixed casts each fp32 weight at its use; autograd keeps the cast for the backward. Qwen3-1.7B:
    a decoder layer is 2 x 2048 x 16 x 128 (q, o) + 2 x 2048 x 8 x 128 (k, v) + 2 x 128 (q / k norms) +
    3 x 2048 x 6144 (MLP) + 2 x 2048 (norms) = 50,336,000 parameters; the LM head (tied) 151,936 x 2048
    = 311,164,928. Without checkpointing every layer's casts and the head's: 2 x (28 x 50,336,000 +
    311,164,928) / 1,720,574,976 = 2.00 bytes / param; with it, the larger of one layer's and the
    head's: 2 x 311,164,928 / P = 0.36."""
    s = QWEN3_SHAPES["1.7B"]
    assert s.layer_params() == 50_336_000 and s.root_params() == 151_936 * 2048 + 2048
    assert s.largest_tensor() == 151_936 * 2048
    off = 2 * (28 * 50_336_000 + 311_164_928) / 1_720_574_976
    assert autocast_copies(s, "bf16-mixed") == pytest.approx(off) and off == pytest.approx(2.0, abs=0.01)
    assert autocast_copies(s, "bf16-mixed", checkpointing=True) == pytest.approx(2 * 311_164_928 / s.params)
    assert autocast_copies(s, "fp32") == 0
    m = learner_memory(s, "bf16-mixed")
    assert m.update_peak == pytest.approx(18.225)  # read at the optimizer step: the casts are freed by then
    assert m.table()["autocast_copies"] == pytest.approx(off)


def test_four_b_with_checkpointing_fits_80_gib_only_without_autocasts_cache():
    """The README's "4B with activation checkpointing fits 80 GiB": 16 B/param + the check's bf16 model
    (18 x 4.02B = 67.4 GiB), one 8,192-token micro-batch's kept layer inputs, the LM head's chunk and
    the head's bf16 cast: 76.5 GiB. With autocast's cache (every decoder layer's cast held until the
    forward ends; the update turns it off) it would need 2 x 36 x 100.9M more, less the one layer
    counted: 83.3 GiB, over 80."""
    s = QWEN3_SHAPES["4B"]
    f = fits(s, 80, checkpointing=True)
    assert f["fits"] is True and 75 < f["need_gib"] < 80
    cached = 2 * (s.layers * s.layer_params() + s.vocab * s.hidden) - f["autocast_gib"] * GIB
    assert f["need_gib"] + cached / GIB > 83


def test_loading_a_sharded_learner_holds_a_shard_and_two_pieces():
    """Each rank holds its shard of the fp32 weights (4 P / K; with a bf16 KL reference 6 P / K) and at
    most two 4 MiB pieces in flight: Qwen3-8B at K = 8, 8,190,735,360 x 4 / 8 + 2 x 4 MiB = 3.81 GiB +
    8 MiB. The loading before it (every rank the whole fp32 model, then a deep copy for the reference)
    held 8 P on every GPU: 61 GiB, more than the 48 GiB card that fits() approves at K = 8 with
    activation checkpointing."""
    s = QWEN3_SHAPES["8B"]
    want = 8_190_735_360 * 4 / 8 + 2 * 4 * 2**20
    assert load_peak_bytes(s, 8) == pytest.approx(want)
    assert load_peak_bytes(s, 8, kl_reference=True) == pytest.approx(want + 2 * s.params / 8)
    assert load_peak_bytes(s, 1) == pytest.approx(4 * s.params + 2 * 4 * 2**20)
    k8 = fits(s, 48, world_size=8, checkpointing=True)
    assert k8["fits"] is True and k8["load_gib"] == pytest.approx(want / GIB)
    assert k8["load_gib"] < k8["need_gib"] < 8 * s.params / GIB  # the old load would not have fit
    # a sharded update holds the gathered fp32 root (embedding + untied head + norm) and two layers too
    gathered = 4 * (s.root_params() + 2 * s.layer_params())
    one_rank_more = fits(s, 48, world_size=8, checkpointing=True)["activations_gib"] * GIB
    assert one_rank_more >= gathered


def test_activation_bytes_per_token_hand_worked():
    s = ModelShape.qwen3(128, 384, 4, 4, 2, 32, 100, tied=True)  # the embedded default's shape
    # per layer: 6 * 128 + (4 * 4 + 5 * 2) * 32 + 4 * 384 = 768 + 832 + 1536 = 3136 elements
    assert s.activation_elements_per_token() == 4 * 3136
    assert s.activation_elements_per_token(checkpointing=True) == 4 * 128
    assert learner_memory(s, "fp32").activation_per_token == 4 * 4 * 3136
    assert learner_memory(s, "bf16-mixed").activation_per_token == 2 * 4 * 3136


def test_which_gpu_holds_which_model():
    assert fits(QWEN3_SHAPES["1.7B"], 141)["fits"] is True
    eight = fits(QWEN3_SHAPES["8B"], 80)
    assert eight["fits"] is False and eight["params_gib"] == pytest.approx(8_190_735_360 * 18 / 2**30)
    assert fits(QWEN3_SHAPES["8B"], 80, world_size=8, micro_batch_tokens=2048)["fits"] is True
    # sharded: weights + grads + AdamW (16) divided over the ranks, the bf16 check model (2) whole on rank 0
    assert fits(QWEN3_SHAPES["8B"], 80, world_size=8)["bytes_per_param"] == pytest.approx(16 / 8 + 2)


def test_plan_reports_the_learner_memory(capsys):
    from echo2.cli import main

    assert main(["plan", "paper_qwen3_8b", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    mem = plan["learner_memory"]
    assert mem["shape"] == "8B" and mem["one_gpu"]["fits"] is False  # 8B does not fit one 80 GB A100
    assert mem["per_gpu_sharded"]["device_gib"] == 80 and mem["ranks"] > 1
    assert main(["plan", "paper_qwen3_8b"]) == 0
    text = capsys.readouterr().out
    assert "learner memory (Qwen3-8B, one GPU): 18 B/param" in text and "does NOT fit" in text
    assert main(["plan", "paper_qwen3_8b", "--model-size", "0.6B", "--gpu-gib", "141", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["learner_memory"]["one_gpu"]["fits"] is True


def test_a_lora_learner_holds_the_frozen_base_and_the_adapters_states():
    """Qwen3-8B, r = 16: the adapter is 43.6M parameters (a = 0.53%), trained in fp32 with AdamW; the
    base frozen in bf16 under bf16-mixed is the only whole-model part besides the check's expanded
    matrices. Per base parameter: 2 + 16 a to train, 4 t for the check model (merged in float32 for
    native vLLM LoRA, the default; 2 t with lora.vllm = "merged")."""
    shape = QWEN3_SHAPES["8B"]
    a = 43_646_976 / shape.params
    t = shape.targeted_params() / shape.params
    # the 8B model's projections: 36 layers x 4096 x (2 x 4096 + 2 x 1024 + 3 x 12288)
    assert shape.targeted_params() == 36 * 4096 * (2 * 4096 + 2 * 1024 + 3 * 12288)
    m = learner_memory(shape, "bf16-mixed", lora_rank=16)
    assert m.weights == pytest.approx(2 + 4 * a) and m.gradients == pytest.approx(4 * a)
    assert m.optimizer == pytest.approx(8 * a) and m.reference == 0
    assert m.training == pytest.approx(2 + 16 * a)
    assert m.sampler_copies == pytest.approx(2 * a)  # the adapter; the base copy is the frozen bf16 base
    assert m.check_model == pytest.approx(4 * t) and m.publication == pytest.approx(4 * a)
    assert learner_memory(
        shape, "bf16-mixed", lora_rank=16, lora_merged_bytes=2
    ).check_model == pytest.approx(2 * t)
    assert learner_memory(shape, "fp32", lora_rank=16).sampler_copies == pytest.approx(2 * a + 2)
    one = fits(shape, 80, lora_rank=16, micro_batch_tokens=2048)
    assert one["bytes_per_param"] == pytest.approx(2 + 16 * a + 4 * t) and one["fits"] is True
    assert fits(shape, 80, micro_batch_tokens=2048)["fits"] is False  # whole weights: 18 B/param
    assert fits(shape, 24, lora_rank=16)["fits"] is False  # ~4 B/param of 8.2B parameters: 31 GiB
    # the 235M shape of benchmarks/lora.py --study memory (the trainer alone: 2.48 measured)
    bench = ModelShape.qwen3(1024, 3072, 16, 16, 8, 64, 32768, tied=True)
    assert learner_memory(bench, "bf16-mixed", lora_rank=16).training == pytest.approx(2.34, abs=0.01)
