import pytest

from echo2.config import Config, load_config
from echo2.errors import ConfigError


def test_defaults_validate_and_couple_kappa_to_staleness():
    cfg = load_config()
    assert cfg.task.name == "arithmetic"
    assert cfg.grpo.rollouts_per_step == cfg.grpo.prompts_per_step * cfg.grpo.group_size
    # the default S = 3 with kappa = max(1, S - 1): S = 3 -> 2, S = 0 -> 1
    assert cfg.async_.staleness == 3 and cfg.async_.effective_kappa == 2
    assert load_config(overrides=["async.staleness=0"]).async_.effective_kappa == 1


def test_toml_then_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('seed = 3\n[grpo]\nlr = 1e-3\n[task]\nmax_value = 9\noperators = "+*"\n')
    cfg = load_config(f, ["grpo.lr=2e-4", "train.run_dir=somewhere/else"])
    assert cfg.seed == 3 and cfg.grpo.lr == 2e-4 and cfg.task.max_value == 9
    assert cfg.task.operators == "+*" and cfg.train.run_dir == "somewhere/else"


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("grpo.group_size=1", "grpo.group_size"),
        ("sampling.top_p=1.5", "sampling.top_p"),
        ("grpo.is_cap=0.5", "grpo.is_cap"),
        ("async.kappa=0", "async.kappa"),
        ("grpo.lr=-1", "grpo.lr"),
        ("grpo.bogus=1", "grpo.bogus"),
        ('task.operators="+/"', "operators may only contain"),
        ("grpo.num_minibatches=3", "divisible by num_minibatches"),
        ("task.name=chess", "task"),
        ("grpo.loss_agg=sum", "grpo.loss_agg"),
        ("grpo.clip_anchor=learner", "grpo.clip_anchor"),
    ],
)
def test_invalid_values_name_the_field(override, needle):
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=[override])
    assert needle in str(exc.value)


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


def test_config_round_trips_through_json():
    cfg = load_config(overrides=["async.staleness=4"])
    again = Config.model_validate(cfg.to_dict())
    assert again == cfg and "async" in cfg.to_dict()
