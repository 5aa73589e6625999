import json

import pytest

from echo2.config import load_config
from echo2.errors import CheckpointError, TrainingDivergedError
from echo2.learner.trainer import GRPOTrainer
from echo2.models.policy import load_checkpoint
from echo2.observe.rundir import RunDir, read_metrics
from echo2.runtime.local import train
from echo2.tasks.warm_cache import starting_checkpoint, warmstart_checkpoint


def test_missing_and_invalid_checkpoint_dirs(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        load_checkpoint(tmp_path / "empty")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="cannot load"):
        load_checkpoint(broken)


def test_warmstart_is_cached_and_loads_like_any_checkpoint(tiny_overrides):
    cfg = load_config(overrides=tiny_overrides)
    path = warmstart_checkpoint(cfg)
    info = json.loads((path / "warmstart.json").read_text())
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert warmstart_checkpoint(cfg) == path  # cached: not retrained
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert info["steps"] <= 20
    policy = load_checkpoint(path)
    assert policy.model.config.model_type == "qwen3"
    # a user pointing model.path at the same directory takes the same code path
    user = load_config(overrides=[*tiny_overrides, f"model.path={str(path)!r}"])
    assert starting_checkpoint(user) == path and starting_checkpoint(cfg) == path
    same = load_checkpoint(starting_checkpoint(user))
    assert same.source == str(path)


def test_a_warm_start_short_of_its_target_says_so(tiny_overrides, caplog):
    """A warm start that used up max_steps under its target is one WARNING (a grader that rewards nothing
    looks exactly like this: found when a task's rewards all failed during the warm start)."""
    cfg = load_config(overrides=[*tiny_overrides, "model.warmstart.max_steps=10"])
    with caplog.at_level("WARNING"):
        path = warmstart_checkpoint(cfg)
    info = json.loads((path / "warmstart.json").read_text())
    said = [r.getMessage() for r in caplog.records if "under its target" in r.getMessage()]
    assert info["steps"] == 10 and info["validation_accuracy"] < 0.9
    assert said == [f"warm start stopped after 10 steps (model.warmstart.max_steps) at validation accuracy "
                    f"{info['validation_accuracy']:.3f}, under its target 0.90: check that the task's grader "
                    "rewards its own reference answers"]  # fmt: skip


def test_sync_loop_writes_run_dir_with_spec_metric_names(tiny_overrides, tmp_path):
    cfg = load_config(overrides=[*tiny_overrides, "train.steps=6"])
    summary = train(cfg)
    assert summary.steps == 6
    records = read_metrics(summary.run_dir)
    assert records[0]["step"] == 0 and "reward/accuracy" in records[0]
    step = records[1]
    for name in (
        "learner/loss",
        "learner/kl",
        "learner/clipfrac",
        "learner/grad_norm",
        "learner/t_train_s",
        "learner/bubble_ratio",
        "learner/version",
        "store/admitted",
        "store/dropped_stale",
        "store/staleness_max",
        "reward/mean",
        "learner/step_wall_s",
        "learner/idle_s/wait",
        "learner/idle_s/eval",
        "learner/idle_s/other",
    ):
        assert name in step, name
    # the bubble is every non-update second of the step (the loop's own clock around the update, which
    # holds the trainer's t_train_s): in the synchronous loop generation is "wait"
    assert step["learner/bubble_ratio"] == pytest.approx(
        1 - step["learner/update_s"] / step["learner/step_wall_s"], rel=1e-9
    )
    assert step["learner/t_train_s"] <= step["learner/update_s"] < step["learner/step_wall_s"]
    assert step["learner/idle_s/wait"] >= step["rollout/t_gen_s"]
    assert [r["learner/version"] for r in records[1:]] == [1, 2, 3, 4, 5, 6]
    run = tmp_path / "run"
    assert json.loads((run / "config.json").read_text())["batch"]["group_size"] == 4
    assert (run / "checkpoints" / "step_000006" / "model.safetensors").is_file()
    assert json.loads((run / "summary.json").read_text())["steps"] == 6


def test_a_second_run_in_the_same_directory_replaces_the_first(tiny_overrides, tmp_path):
    train(load_config(overrides=[*tiny_overrides, "train.steps=6"]))
    (tmp_path / "run" / "notes.txt").write_text("mine")
    summary = train(load_config(overrides=[*tiny_overrides, "train.steps=2"]))
    records = read_metrics(summary.run_dir)
    assert [r["step"] for r in records] == [0, 1, 2]  # nothing of the first run
    assert not (tmp_path / "run" / "checkpoints" / "step_000006").exists()
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"  # only a run's own outputs go


def test_run_dir_resume_keeps_the_metrics_and_a_fresh_one_does_not(tmp_path):
    first = RunDir(tmp_path, {})
    first.log({"step": 1})
    (first.checkpoint_dir("step_000001")).mkdir(parents=True)
    first.close()
    resumed = RunDir(tmp_path, {}, resume=True)
    resumed.log({"step": 2})
    resumed.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert (tmp_path / "checkpoints" / "step_000001").is_dir()
    RunDir(tmp_path, {}).close()
    assert read_metrics(tmp_path) == [] and not (tmp_path / "checkpoints").exists()


def test_divergence_keeps_last_good_checkpoint(tiny_overrides, tmp_path, monkeypatch):
    real_update = GRPOTrainer.update

    def update(self, trajectories):
        if self.version == 3:
            raise TrainingDivergedError("loss is nan at version 3, minibatch 0")
        return real_update(self, trajectories)

    monkeypatch.setattr(GRPOTrainer, "update", update)
    cfg = load_config(overrides=[*tiny_overrides, "train.steps=10"])
    with pytest.raises(TrainingDivergedError, match="last good weights saved"):
        train(cfg)
    good = tmp_path / "run" / "checkpoints" / "last_good"
    assert json.loads((good / "trainer_state.json").read_text())["version"] == 3
    assert load_checkpoint(good).model is not None
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "loss is nan" in summary["error"]


def test_warmstart_is_deterministic_in_the_seed(tiny_overrides, tmp_path):
    from safetensors.torch import load_file

    def weights(cache: str, seed: int):
        cfg = load_config(overrides=[*tiny_overrides, f"model.warmstart.cache_dir={cache!r}", f"seed={seed}"])
        return load_file(warmstart_checkpoint(cfg) / "model.safetensors")

    a = weights(str(tmp_path / "a"), 0)
    b = weights(str(tmp_path / "b"), 0)  # rebuilt from scratch in another cache
    c = weights(str(tmp_path / "c"), 1)
    assert a.keys() == b.keys()
    assert all(a[k].equal(b[k]) for k in a)
    assert any(not a[k].equal(c[k]) for k in a)


def test_the_cache_keyword_is_the_one_the_installed_transformers_reads(tiny_policy):
    """The check and the HF engine pass the key-value cache by ``cache_kwarg``: with the installed
    transformers it is a parameter of the decoder's forward, it draws no deprecation warning, and the
    cache is really read (two chunks through it give the hidden states of one pass)."""
    import inspect
    import warnings

    import torch
    from transformers import DynamicCache

    from echo2.models.policy import cache_kwarg

    decoder = tiny_policy.model.get_decoder()
    key = cache_kwarg(decoder)
    assert key == cache_kwarg(tiny_policy.model)
    assert key in inspect.signature(decoder.forward).parameters
    ids = torch.tensor([[3, 5, 7, 9, 11, 13]])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # a deprecated keyword fails the test
        whole = decoder(input_ids=ids).last_hidden_state
        cache = DynamicCache()
        first = decoder(input_ids=ids[:, :4], use_cache=True, **{key: cache}).last_hidden_state
        second = decoder(input_ids=ids[:, 4:], use_cache=True, **{key: cache}).last_hidden_state
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole)


def test_the_cache_keyword_of_a_model_before_the_rename():
    from echo2.models.policy import cache_kwarg

    class Old:
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs): ...

    class New:
        def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs): ...

    assert (cache_kwarg(Old()), cache_kwarg(New())) == ("past_key_values", "cache")
