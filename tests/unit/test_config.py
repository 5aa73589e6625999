import subprocess
import sys
from pathlib import Path

import pytest

from echo2.config import BatchConfig, Config, ControllerConfig, StalenessConfig, load_config
from echo2.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_defaults_validate_and_couple_kappa_to_staleness():
    cfg = load_config()
    assert cfg.task.name == "arithmetic"
    assert cfg.batch.rollouts == cfg.batch.prompts * cfg.batch.group_size == 32 * 8
    # the default S = 3 with kappa = max(1, S - 1): S = 3 -> 2, S = 0 -> 1
    assert cfg.staleness.S == 3 and cfg.staleness.effective_kappa == 2
    assert load_config(overrides=["staleness.S=0"]).staleness.effective_kappa == 1
    assert cfg.staleness.gamma == 1.1


def test_toml_then_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('seed = 3\n[grpo]\nlr = 1e-3\n[task]\nmax_value = 9\noperators = "+*"\n')
    cfg = load_config(f, ["grpo.lr=2e-4", "train.run_dir=somewhere/else"])
    assert cfg.seed == 3 and cfg.grpo.lr == 2e-4 and cfg.task.max_value == 9
    assert cfg.task.operators == "+*" and cfg.train.run_dir == "somewhere/else"


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("batch.group_size=1", "batch.group_size"),
        ("sampling.top_p=1.5", "sampling.top_p"),
        ("grpo.is_cap=0.5", "grpo.is_cap"),
        ("staleness.kappa=0", "staleness.kappa"),
        ("staleness.S=-1", "staleness.S"),
        ("staleness.gamma=0.9", "staleness.gamma"),
        ("grpo.lr=-1", "grpo.lr"),
        ("grpo.bogus=1", "grpo.bogus"),
        ('task.operators="+/"', "operators may only contain"),
        ("grpo.num_minibatches=3", "divisible by grpo.num_minibatches"),
        ("task.name=chess", "task"),
        ("grpo.loss_agg=sum", "grpo.loss_agg"),
        ("grpo.clip_anchor=learner", "grpo.clip_anchor"),
        ("controller.low_band=1.5", "controller.low_band"),
        ("runtime.engine=sglang", "runtime.engine"),
        # the old dialect names are refused, not silently ignored
        ("async.staleness=3", "async"),
        ("grpo.prompts_per_step=8", "grpo.prompts_per_step"),
        ("runtime.sustain_s=5", "runtime.sustain_s"),
    ],
)
def test_invalid_values_name_the_field(override, needle):
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=[override])
    assert needle in str(exc.value)


def test_a_dual_clip_that_cannot_act_is_refused():
    # sampler anchor: C is the dual-clip bound; at C <= 1 + eps it cuts inside the PPO clip
    with pytest.raises(ConfigError, match=r"is_cap=1.2 must exceed 1 \+ clip_eps = 1.2"):
        load_config(overrides=["grpo.is_cap=1.2", "grpo.clip_eps=0.2"])
    assert load_config(overrides=["grpo.is_cap=1.21", "grpo.clip_eps=0.2"]).grpo.is_cap == 1.21
    # the decoupled form uses C as a truncation cap, where C = 1 is meaningful
    assert load_config(overrides=["grpo.is_cap=1", "grpo.clip_anchor=proximal"]).grpo.is_cap == 1


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[grpo\nlr=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_malformed_override():
    with pytest.raises(ConfigError, match=r"section\.field=value"):
        load_config(overrides=["grpo.lr"])


def test_one_loader_one_error_format_for_run_plan_and_simulate(tmp_path):
    from echo2.config import load_settings
    from echo2.planner.scenario import PlanScenario
    from echo2.sim.config import load_sim_scenario

    run = tmp_path / "run.toml"
    run.write_text("[grpo]\nlr = -1\n")
    with pytest.raises(ConfigError) as exc:
        load_config(run)
    assert str(exc.value) == f"invalid config {run}: grpo.lr: Input should be greater than 0 (got -1)"
    plan = CONFIGS / "plan_paper_qwen3_8b.toml"
    with pytest.raises(ConfigError) as exc:
        load_settings(PlanScenario, plan, ["learner.t_train_s=-3"], what="scenario")
    assert (
        str(exc.value)
        == f"invalid scenario {plan}: learner.t_train_s: Input should be greater than 0 (got -3)"
    )
    # a simulate config's plan sections sit at the top level: the error path is the file's, not plan.*
    with pytest.raises(ConfigError) as exc:
        load_sim_scenario("paper_qwen3_8b", ["staleness.S=-1", "sim.steps=0"])
    msg = str(exc.value)
    assert msg.startswith(f"invalid scenario {CONFIGS / 'sim_paper_qwen3_8b.toml'}: ")
    assert "; sim.steps: Input should be greater than or equal to 1 (got 0)" in msg
    assert "staleness.S: Input should be greater than or equal to 0 (got -1)" in msg and "plan." not in msg
    # the same file errors for every model: a missing file, invalid TOML (named either way)
    bad = tmp_path / "bad.toml"
    bad.write_text("[[workers]\n")
    for load in (load_config, lambda f: load_settings(PlanScenario, f, what="scenario")):
        with pytest.raises(ConfigError, match=f"config file {bad} is not valid TOML .*invalid TOML"):
            load(bad)
        with pytest.raises(ConfigError, match=f"config file {tmp_path / 'nope.toml'} does not exist"):
            load(tmp_path / "nope.toml")


def test_overrides_as_strings_or_a_mapping_and_list_indices():
    from echo2.config import load_settings
    from echo2.planner.scenario import PlanScenario
    from echo2.sim.config import load_sim_scenario

    plan = CONFIGS / "plan_paper_qwen3_8b.toml"
    sc = load_settings(PlanScenario, plan, ["workers.0.rollouts_per_s=0.5"], what="scenario")
    assert sc.workers[0].rollouts_per_s == 0.5
    overrides = {"workers.0.usd_per_hour": 0.25, "staleness.S": 5}
    sc = load_settings(PlanScenario, plan, overrides, what="scenario")
    assert sc.workers[0].usd_per_hour == 0.25 and sc.staleness.S == 5 and sc.staleness.effective_kappa == 4
    with pytest.raises(
        ConfigError, match=r"override 'workers\.3\.count=2': '3' is not an index of a list of 1"
    ):
        load_settings(PlanScenario, plan, ["workers.3.count=2"], what="scenario")
    with pytest.raises(ConfigError, match=r"'lr' is a value, not a section"):
        load_config(overrides=["grpo.lr=1e-4", "grpo.lr.x=1"])
    sim, _ = load_sim_scenario("paper_qwen3_8b", {"sim.steps": 7, "staleness.S": 4})
    assert sim.sim.steps == 7 and sim.plan.staleness.S == 4


def test_the_planner_skips_exactly_the_simulators_own_sections():
    from echo2.planner.scenario import SIM_SECTIONS
    from echo2.sim.config import SimScenario

    assert set(SIM_SECTIONS) == set(SimScenario.model_fields) - {"plan"}


def test_config_round_trips_through_json():
    cfg = load_config(overrides=["staleness.S=4"])
    again = Config.model_validate(cfg.to_dict())
    assert again == cfg and cfg.to_dict()["staleness"]["S"] == 4


def test_the_training_config_in_configs_is_the_default_run():
    cfg = load_config(CONFIGS / "train_arithmetic.toml")
    assert cfg == load_config()  # every value it states is the default, so it documents them truthfully


def test_run_plan_and_simulate_configs_share_their_sections():
    from echo2.planner.scenario import PlanScenario
    from echo2.sim.config import SimScenario

    plan = PlanScenario.model_fields
    assert plan["batch"].annotation is BatchConfig and plan["staleness"].annotation is StalenessConfig
    assert Config.model_fields["controller"].annotation is ControllerConfig
    assert SimScenario.model_fields["controller"].annotation is ControllerConfig


def test_importing_the_config_does_not_import_torch():
    code = "import sys, echo2.config; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_lease_lifetime_and_request_cap_follow_the_completion_length():
    """A lease lives max(30 s, 0.1 s x max_new_tokens); the request cap is twice the largest honest
    submission (lease_prompts x group_size completions, 32 bytes a token + 16 KiB each), >= 8 MiB."""
    default = load_config()
    assert default.lease_ttl() == 30.0 and default.request_cap_bytes() == 8 << 20  # the embedded default
    long = load_config(
        overrides=["sampling.max_new_tokens=8192", "runtime.lease_prompts=8", "batch.group_size=16"]
    )
    assert long.lease_ttl() == pytest.approx(819.2)
    assert long.request_cap_bytes() == 2 * 8 * 16 * (32 * 8192 + 16384)  # 69.2 MB
    assert load_config(overrides=["runtime.max_request_mb=1"]).request_cap_bytes() == 1 << 20


def test_a_user_checkpoint_with_the_toy_learning_rate_is_warned_about(user_checkpoint, tmp_path, caplog):
    import logging

    from echo2.runtime.core import LearnerCore

    cfg = load_config(
        overrides=[f"model.path={str(user_checkpoint)!r}", "task.name=math", "train.eval_size=8"]
    )
    with caplog.at_level(logging.WARNING, logger="echo2.runtime.core"):
        core = LearnerCore.load(cfg, tmp_path / "run")
    core.run_dir.close()
    assert "grpo.lr = 0.0002 is the embedded toy model's learning rate" in caplog.text
