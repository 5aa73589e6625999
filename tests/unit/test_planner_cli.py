"""`echo2 plan` through its Command object: the paper config, flags, --json, and bad input."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from echo2.cli.plan import PLAN
from echo2.errors import ConfigError, InfeasibleError

ROOT = Path(__file__).resolve().parents[2]
PAPER = str(ROOT / "configs" / "plan_paper_qwen3_8b.toml")


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    p = argparse.ArgumentParser()
    PLAN.add_arguments(p)
    assert PLAN.run(p.parse_args(argv)) == 0
    return capsys.readouterr().out


def test_paper_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    plan = json.loads(_run([PAPER, "--json"], capsys))
    for key in ("kappa", "mu_min", "n_min", "staleness_bound", "feasible"):
        assert key in plan
    # S = 3 -> kappa 2; mu_min = 4096 / (3262.4 - 1437) = 2.2439; target 2.4683 / 0.32 = 7.7 -> 8 workers
    assert plan["kappa"] == 2 and plan["feasible"] is True
    assert plan["mu_min"] == pytest.approx(2.24389, abs=1e-5)
    assert plan["active_workers"] == 8 and plan["n_min"] == 8
    # (12.24 + 2.80) x 1631.2 / 3600 = 6.8148 $/step; savings 33.6% (sync), 36.7% (async)
    assert plan["usd_per_step"] == pytest.approx(6.81479, abs=1e-4)
    assert plan["baselines"]["verl-sync"]["saving"] == pytest.approx(0.3355, abs=1e-4)
    assert plan["baselines"]["verl-async"]["saving"] == pytest.approx(0.3666, abs=1e-4)
    assert plan["staleness_bound"] == 3
    est = plan["t_bcast_estimates_s"]
    assert set(est) == {"star-unlimited", "star-limited", "tree-pipelined", "lower_bound"}
    # 8 workers on 100 Mbit/s = 12.5 MB/s links, 16.38 GB, B0 = 62.5 MB/s -> relay trees with k = 8 stripes
    # at r = B_w/8, depth 2 (each worker roots one stripe and feeds the 7 others). 3906 chunks of 4 MiB
    # dealt over 8 stripes: the first two hold 489, so G_s = G x 489/3906; the last worker holds them at
    # G_s/r + (2 - 1) x c/r + 2 x 0.05 + reload 127 = 1312.413 + 2.684 + 0.1 + 127 = 1442.197 s
    g_s, r = 16.38e9 * 489 / 3906, 12.5e6 / 8
    assert est["tree-pipelined"] == pytest.approx(g_s / r + 4 * 2**20 / r + 0.1 + 127, rel=1e-9)
    # Star-Limited: 8 x 16.38e9 / 62.5e6 = 2096.64 s + 127
    assert est["star-limited"] == pytest.approx(2096.64 + 127, rel=1e-9)


def test_the_pool_is_planned_for_the_rollouts_a_batch_can_use(capsys: pytest.CaptureFixture[str]) -> None:
    """--useful-share 0.5 (half the groups left out as zero-variance): mu_min = kappa R / (kappa T_train -
    T_bcast) / 0.5. kappa 2, R 1000: 2000 / 150 = 13.333 -> 26.667; N_min = ceil(26.667 / 2.5) = 11."""
    argv = ["--t-train", "100", "--t-bcast", "50", "--rollouts-per-step", "1000", "--staleness", "3",
            "--worker-rate", "2.5", "--useful-share", "0.5", "--json"]  # fmt: skip
    plan = json.loads(_run(argv, capsys))
    assert plan["mu_min"] == pytest.approx(2000 / 150 / 0.5) and plan["n_min"] == 11
    assert plan["useful_share"] == 0.5 and plan["overlap_holds"]


def test_short_name_and_text_report(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(["paper_qwen3_8b"], capsys)
    assert "mu_min = 2.2439" in out and "8 x rtx5090" in out and "saving 33.6%" in out


def test_flags_only_homogeneous(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--t-train",
        "100",
        "--t-bcast",
        "50",
        "--rollouts-per-step",
        "1000",
        "--staleness",
        "3",
        "--worker-rate",
        "2.5",
        "--gamma",
        "1.2",
        "--json",
    ]
    plan = json.loads(_run(argv, capsys))
    # kappa 2: mu_min = 2000 / (200 - 50) = 13.333; N_min = ceil(13.333 / 2.5) = ceil(5.33) = 6
    # target 1.2 x 13.333 = 16 -> ceil(16 / 2.5) = ceil(6.4) = 7 workers
    assert plan["mu_min"] == pytest.approx(13.3333, abs=1e-4)
    assert plan["n_min"] == 6 and plan["active_workers"] == 7
    assert plan["usd_per_step"] is None  # no prices given
    plan = json.loads(_run([*argv[:-1], "--kappa", "1", "--json"], capsys))
    # kappa 1: 1000 / (100 - 50) = 20 -> N_min 8
    assert plan["kappa"] == 1 and plan["n_min"] == 8


@pytest.mark.parametrize(
    ("argv", "exc", "match"),
    [
        ([PAPER, "--worker-rate", "-1"], ConfigError, "rollouts_per_s"),
        ([PAPER, "--worker-price", "0"], ConfigError, "usd_per_hour"),
        ([PAPER, "--worker-type", "rtx9999"], ConfigError, "unknown worker type 'rtx9999'"),
        ([PAPER, "--kappa", "1", "--t-bcast", "2000"], InfeasibleError, "raise kappa"),
        ([PAPER, "--t-train", "-3"], ConfigError, "t_train_s"),
        (["--t-train", "100"], ConfigError, "--worker-rate"),
        (["nope_not_a_config"], ConfigError, "no config named"),
        # Star-Limited: T_bcast grows with N faster than the extra workers help -> no fixed point
        (["table2_ablation", "--strategy", "star-limited"], InfeasibleError, "no self-consistent plan"),
        # one spelling of the strategy names everywhere; a wrong one lists the choices
        (
            [PAPER, "--strategy", "tree_pipelined"],
            ConfigError,
            "'star-unlimited', 'star-limited', 'tree-pipelined'",
        ),
        (
            ["--t-train", "100", "--t-bcast", "5", "--worker-rate", "1", "--rollouts-per-step", "100"],
            ConfigError,
            r"multiple of the group size \(batch.group_size = 8\)",
        ),
    ],
)
def test_bad_input_raises_user_errors(argv: list[str], exc: type[Exception], match: str) -> None:
    p = argparse.ArgumentParser()
    PLAN.add_arguments(p)
    with pytest.raises(exc, match=match):
        PLAN.run(p.parse_args(argv))


def test_catalog_errors(tmp_path: Path) -> None:
    base = (ROOT / "configs" / "plan_paper_qwen3_8b.toml").read_text()
    head = base.split("[[workers]]")[0]
    p = argparse.ArgumentParser()
    PLAN.add_arguments(p)
    empty = tmp_path / "empty.toml"
    empty.write_text(head)
    with pytest.raises(ConfigError, match="catalog is empty"):
        PLAN.run(p.parse_args([str(empty)]))
    small = tmp_path / "small.toml"
    small.write_text(
        head.replace("t_bcast_s = 1437", "t_bcast_s = 1437")
        + '[[workers]]\nname = "x"\nusd_per_hour = 0.3\nrollouts_per_s = 0.3\ncount = 2\n'
    )
    with pytest.raises(InfeasibleError, match="exceeds the whole catalog"):
        PLAN.run(p.parse_args([str(small)]))
    bad = tmp_path / "bad.toml"
    bad.write_text("[[workers]\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        PLAN.run(p.parse_args([str(bad)]))


def test_infeasible_json_still_prints_an_object(capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser()
    PLAN.add_arguments(p)
    with pytest.raises(InfeasibleError):
        PLAN.run(p.parse_args([PAPER, "--kappa", "1", "--t-bcast", "2000", "--json"]))
    obj = json.loads(capsys.readouterr().out)
    assert obj["feasible"] is False and obj["kappa"] == 1 and "raise kappa" in obj["reason"]


def test_cli_modules_import_light() -> None:
    code = (
        "import sys, echo2.cli, echo2.cli.plan, echo2.cli.simulate, echo2.cli.run, echo2.cli.train; "
        "echo2.cli.build_parser(); "
        "heavy = [m for m in ('torch', 'numpy', 'scipy', 'pydantic', 'matplotlib') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_value_flag_is_one_override_of_the_scenario() -> None:
    from echo2.cli.plan import _FIELDS

    p = argparse.ArgumentParser()
    PLAN.add_arguments(p)
    # the rest: the file, a selection of the catalog, R (-> batch.prompts), the output format
    assert set(vars(p.parse_args([]))) == {f for f, _ in _FIELDS} | {
        "config",
        "worker_type",
        "rollouts_per_step",
        "json",
    }


def test_a_pool_flag_reaches_the_type_picked_from_a_mixed_catalog(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "table2_ablation",
        "--worker-type",
        "rtx4090",
        "--worker-rate",
        "0.5",
        "--bw-mbps",
        "200",
        "--json",
    ]
    plan = json.loads(_run(argv, capsys))
    assert set(plan["per_type"]) == {"rtx4090"} and plan["per_type"]["rtx4090"]["rollouts_per_s"] == 0.5
    assert set(plan["active_set"]) == {"rtx4090"}


def test_flags_only_prices_and_group_size(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--t-train", "100", "--t-bcast", "5", "--worker-rate", "1", "--json"]
    unpriced = json.loads(_run([*base, "--rollouts-per-step", "64", "--group-size", "4"], capsys))
    assert unpriced["rollouts_per_step"] == 64 and unpriced["usd_per_step"] is None
    priced = json.loads(_run([*base, "--worker-price", "0.5", "--learner-price", "2"], capsys))
    assert priced["usd_per_step"] is not None and priced["usd_per_hour"] > 2


def test_plan_reads_simulate_configs_by_short_name(capsys: pytest.CaptureFixture[str]) -> None:
    plan = json.loads(_run(["table2_ablation", "--activation", "exact", "--json"], capsys))
    # mixed pool: the optimum reaching 2.468/s is 3 x 5090 + 4 x 4090 + 2 x L40S = $4.23/h
    assert plan["active_workers"] == 9
    assert plan["workers_usd_per_hour"] == pytest.approx(3 * 0.35 + 4 * 0.40 + 2 * 0.79)


def test_t_train_follows_a_stated_scaling_to_the_learners_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--t-train", "100", "--t-bcast", "50", "--rollouts-per-step", "64", "--worker-rate", "1"]
    base += ["--json"]
    same = json.loads(_run([*base, "--gpus", "4"], capsys))
    assert same["t_train_s"] == 100 and same["learner_gpus"] == 4  # measured as configured: as given
    # measured on 1 GPU, the learner sharded over 4 at 80% efficiency: 100 / (4 x 0.8) = 31.25 s
    scaled = ["--scaling-efficiency", "0.8", "--t-train-gpus"]
    four = json.loads(_run([*base, "--gpus", "4", *scaled, "1"], capsys))
    assert four["t_train_s"] == pytest.approx(31.25) and "stated scaling" in four["t_train_source"]
    # and back down, the inverse: measured on 8, run on 2 at 0.8: 100 x (8 / 2) x 0.8 = 320 s
    two = json.loads(_run([*base, "--gpus", "2", *scaled, "8"], capsys))
    assert two["t_train_s"] == pytest.approx(320.0)
    assert four["mu_min"] > same["mu_min"]  # a faster learner needs more rollouts per second
    with pytest.raises(ConfigError, match=r"state learner\.scaling_efficiency"):
        _run([*base, "--gpus", "4", "--t-train-gpus", "1"], capsys)


def test_a_lora_plan_ships_the_adapter_and_shows_the_whole_weights_pool_beside_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Qwen3-8B, rank 16 on the attention and MLP projections: 43,646,976 adapter parameters (PEFT's
    count for this model), 87.3 MB in bf16; over 100 Mbit/s links whole weights cannot be hidden at
    kappa = 2, the adapter can. A measured T_bcast (of whole weights) is not taken for the adapter's."""
    from echo2.planner.memory_model import QWEN3_SHAPES

    assert QWEN3_SHAPES["8B"].lora_params(16) == 43_646_976
    flags = ["--t-train", "60", "--worker-rate", "0.5", "--worker-price", "0.3", "--snapshot-gb", "16"]
    flags += ["--b0-mbps", "1000", "--bw-mbps", "100", "--model-size", "8B", "--lora-rank", "16"]
    plan = json.loads(_run([*flags, "--lora-patch-ratio", "0.5", "--json"], capsys))
    assert plan["adapter_gb"] == pytest.approx(2 * 43_646_976 / 1e9)
    k = 20  # anchor_every: one whole adapter, then 19 patches of half of it
    assert plan["publication_gb"] == pytest.approx(plan["adapter_gb"] * (1 + (k - 1) * 0.5) / k)
    assert plan["feasible"] and plan["learner_memory"]["lora_rank"] == 16
    assert plan["learner_memory"]["one_gpu"]["bytes_per_param"] < 6  # the frozen base, not 16 + of AdamW
    assert (
        plan["whole_weights"]["feasible"] is False and "cannot be hidden" in plan["whole_weights"]["reason"]
    )
    paper = json.loads(_run(["paper_qwen3_8b", "--model-size", "8B", "--lora-rank", "16", "--json"], capsys))
    assert paper["t_bcast_source"].startswith("model (tree-pipelined), the adapter's bytes")
    assert paper["whole_weights"]["t_bcast_s"] == 1437.0  # the measured one, for whole weights
    assert paper["active_workers"] < paper["whole_weights"]["active_workers"]
    whole_mem, lora_mem = (
        paper["whole_weights"]["learner_memory"]["one_gpu"],
        paper["learner_memory"]["one_gpu"],
    )
    assert whole_mem["bytes_per_param"] == pytest.approx(18) and lora_mem["bytes_per_param"] < 6
    text = _run(["paper_qwen3_8b", "--model-size", "8B", "--lora-rank", "16"], capsys)
    assert "LoRA rank 16: publications of 0.08729 GB" in text and "whole weights instead" in text
    assert "learner memory (Qwen3-8B, LoRA r = 16, one GPU)" in text
    text = _run(["paper_qwen3_8b", "--model-size", "8B", "--lora-rank", "16", "--gpus", "4"], capsys)
    assert "LoRA on the sharded learner is not built" in text
    with pytest.raises(ConfigError, match=r"model\.lora needs model\.shape"):
        _run(["--t-train", "60", "--worker-rate", "0.5", "--snapshot-gb", "16", "--lora-rank", "16"], capsys)
