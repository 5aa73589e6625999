"""`echo2 simulate` through its Command object, and the experiment drivers on small settings."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from echo2.cli.simulate import SIMULATE
from echo2.errors import ConfigError
from echo2.observe.rundir import read_metrics
from echo2.sim import experiments
from echo2.sim.config import load_sim_scenario

ROOT = Path(__file__).resolve().parents[2]


def _run(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    SIMULATE.add_arguments(p)
    return SIMULATE.run(p.parse_args(argv))


def test_run_writes_spec_metrics_jsonl_and_png(tmp_path: Path) -> None:
    assert _run(["paper_qwen3_8b", "--steps", "12", "--out", str(tmp_path)]) == 0
    metrics = read_metrics(tmp_path / "paper_qwen3_8b_metrics.jsonl")
    assert len(metrics) == 12
    assert {"learner/bubble_ratio", "store/staleness_max", "pool/mu_pool", "cost/usd_total"} <= set(
        metrics[0]
    )
    assert (tmp_path / "paper_qwen3_8b_run.png").stat().st_size > 1000
    summary = json.loads((tmp_path / "paper_qwen3_8b.json").read_text())["summary"]
    assert summary["steps"] == 12


def test_bcast_sweep_cli(tmp_path: Path) -> None:
    assert _run(["fig4_bcast", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "fig4_bcast_sim.json").read_text())
    star = r["sim"]["star-limited"]
    # Star-Limited grows ~linearly: 1000 workers x 16.38 GB / 62.5 MB/s (500 Mbit/s) = 262,080 s
    assert star[-1] == pytest.approx(1000 * 16.38e9 / 62.5e6, rel=1e-6)
    assert r["tree_over_lower_bound_max"] <= 1.10
    assert (tmp_path / "fig4_bcast_sim.png").exists()


def test_bubble_sweep_small() -> None:
    sc, _ = load_sim_scenario("fig3c_bubble")
    sc = experiments.with_overrides(sc, **{"experiment.staleness": [3], "sim.steps": 24})
    c = experiments.bubble_sweep(sc)["curves"]["3"]
    # 2x RTX 5090 workers: mu_min = 4096 / (3262.4 - ~1438) = 2.245 -> N_min = ceil(2.245/0.64) = 4
    assert c["n_min"] == 4 and c["n_gamma"] == 5
    assert c["bubble_at_n_gamma"] <= 0.02
    assert c["bubble_at_n_min_minus_2"] >= 0.20
    assert abs(c["knee"] - c["n_min"]) <= 1
    assert max(c["staleness_max"]) <= 3


def test_ablation_orders_the_rows() -> None:
    sc, _ = load_sim_scenario("table2_ablation")
    sc = experiments.with_overrides(sc, **{"sim.steps": 16, "experiment.seeds": 3})
    r = experiments.ablation(sc)["rows"]
    assert r["full"]["usd_per_step"] < r["no_p2p"]["usd_per_step"]
    assert r["full"]["usd_per_step"] < r["no_cost_aware"]["usd_per_step"]
    assert r["no_p2p"]["t_bcast_s"] > r["full"]["t_bcast_s"]
    assert r["full"]["wait_per_step_s"] <= 1.0
    # "+ deltas" (the config's measured patch_ratio): smaller publications, a smaller pool, cheaper
    assert r["full_deltas"]["t_bcast_s"] < r["full"]["t_bcast_s"] / 2
    assert r["full_deltas"]["machines"] < r["full"]["machines"]
    assert r["full_deltas"]["usd_per_step"] < r["full"]["usd_per_step"]


def test_bad_configs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no config named"):
        _run(["does_not_exist"])
    bad = tmp_path / "bad.toml"
    text = (ROOT / "configs" / "sim_paper_qwen3_8b.toml").read_text()
    bad.write_text(text.replace("usd_per_hour = 0.35", "usd_per_hour = -0.35"))
    with pytest.raises(ConfigError, match=r"workers\.0\.usd_per_hour"):
        _run([str(bad)])
    bad.write_text(text.replace("[sim]\n", "[sim]\nfixed_workers = { rtx9999 = 3 }\n"))
    with pytest.raises(ConfigError, match="unknown worker type 'rtx9999'"):
        _run([str(bad)])
    bad.write_text(text.replace("heartbeat_timeout_s = 120", "enabled = true\nheartbeat_timeout_s = 120"))
    with pytest.raises(ConfigError, match=r"controller.enabled is now sim.controller"):
        _run([str(bad)])
    bad.write_text(text.replace('strategy = "tree-pipelined"', 'strategy = "tree_pipelined"'))
    with pytest.raises(
        ConfigError, match=r"network.strategy: Input should be 'star-unlimited', 'star-limited'"
    ):
        _run([str(bad)])
    with pytest.raises(ConfigError, match="--steps"):
        _run(["paper_qwen3_8b", "--steps", "0", "--out", str(tmp_path)])


def test_the_simulator_ships_a_lora_runs_adapter() -> None:
    """[model.lora]: the simulator's publications are the adapter's bytes (the planner's one ModelSpec)."""
    sc, _ = load_sim_scenario("paper_qwen3_8b")
    whole = experiments.setup(sc).params
    lora = experiments.with_overrides(sc, **{"plan.model.shape": "8B", "plan.model.lora": {"rank": 16}})
    params = experiments.setup(lora).params
    assert whole.snapshot_bytes == pytest.approx(16.38e9)
    assert params.snapshot_bytes == pytest.approx(2 * 43_646_976) and params.patch_ratio is None


def test_a_scale_case_without_recorded_metrics_writes_its_summary(tmp_path: Path) -> None:
    # `record_metrics = false` (the scale cases) left no metric to plot and ended in matplotlib's traceback
    assert _run(["speed_100k", "--steps", "3", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "speed_100k.json").read_text())["summary"]["steps"] == 3
    assert not (tmp_path / "speed_100k_run.png").exists()
