"""A user's own HF checkpoint (not the embedded one): a BPE tokenizer with a chat template and a
Qwen3 model saved with save_pretrained, trained by `echo2 train` on the `math` task."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_train_a_user_checkpoint_on_math(user_checkpoint, tmp_path):
    run = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "echo2.cli",
            "train",
            "--model",
            str(user_checkpoint),
            "--run-dir",
            str(run),
            "--steps",
            "2",
            "--no-progress",
            "--set",
            "task.name=math",
            "--set",
            "model.chat_template=true",
            "--set",
            "batch.prompts=2",
            "--set",
            "batch.group_size=2",
            "--set",
            "sampling.max_new_tokens=6",
            "--set",
            "train.eval_size=8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["path"] == str(user_checkpoint) and config["task"]["name"] == "math"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["learner/version"] == 2
    assert [r["reward/grade_timeouts"] for r in records if "reward/mean" in r] == [0.0, 0.0]  # math's counter
    assert (run / "checkpoints" / "step_000002" / "tokenizer.json").is_file()


def test_chat_template_requested_but_missing_is_a_clear_error(tmp_path):
    from echo2.config import EmbeddedModelConfig
    from echo2.errors import CheckpointError
    from echo2.models.embedded import build_model, build_tokenizer
    from echo2.models.policy import load_checkpoint

    tok = build_tokenizer()
    build_model(
        EmbeddedModelConfig(hidden_size=16, intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=1),
        tok,
        0,
    ).save_pretrained(tmp_path / "c")
    tok.save_pretrained(tmp_path / "c")
    with pytest.raises(CheckpointError, match="no chat template"):
        load_checkpoint(tmp_path / "c", chat_template=True)
