"""The honest-completion study's sample gathered run by run (``benchmarks/echo2_bench/length_studies``):
every shard counted once, a shard never run twice, the first readings adopted as shard 0."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from echo2.check.positions import LogHistogram
from echo2_bench import length_studies as ls
from echo2_bench.adversary_length_runs import distribution


def _shard(shard: int, completions: int, errors: list[float], forged: int = 0) -> dict:
    h = LogHistogram()
    h.add(torch.tensor(errors))
    return {
        "dtype": "float32", "engine": "hf", "length": 256, "logprob_tolerance": 0.05, "draw_tolerance": 0.05,
        "shard": shard, "rows": 64, "completions": completions, "tokens": 256 * completions,
        "check_tokens": 256 * completions, "false_forgeries": forged, "graded_ties_whole_completion": 0,
        "near_ties": 1, "room_positions": 10, "logprob_error": distribution(h),
        "draw_deficit_where_not_the_draw": distribution(LogHistogram()), "top2_gap": distribution(h),
        "seconds": 5.0, "minutes_budget": 1.0, "commit": "c",
    }  # fmt: skip


def test_shards_pool_into_one_sample():
    pooled = ls.pool_honest([_shard(0, 6_000, [1e-6, 0.01]), _shard(1, 4_000, [0.2])])
    assert pooled["completions"] == 10_000 and pooled["near_ties"] == 2 and pooled["false_forgeries"] == 0
    assert pooled["logprob_error"]["positions"] == 3 and pooled["logprob_error"]["max"] == pytest.approx(0.2)
    assert pooled["near_ties_per_1024_tokens"] == pytest.approx(1024 * 2 / (256 * 10_000))
    assert [s["shard"] for s in pooled["shards"]] == [0, 1]
    with pytest.raises(SystemExit, match="length"):
        ls.pool_honest([_shard(0, 1, [0.0]), {**_shard(1, 1, [0.0]), "length": 512}])


def test_a_shard_is_never_run_twice_and_the_first_reading_is_shard_0(tmp_path: Path):
    first = {
        k: v
        for k, v in _shard(0, 592, [1e-6]).items()
        if k not in ("shard", "rows", "check_tokens", "commit")
    }
    (tmp_path / "adversary_length.json").write_text(json.dumps({"length_honest": first}))
    ls.adopt_first_reading(tmp_path, "length_honest", "float32")
    adopted = ls.read_shards(tmp_path / ls.SHARDS, "float32", 256)
    assert [(s["shard"], s["rows"], s["completions"]) for s in adopted] == [(0, 16, 592)]
    # a pooled reading written back later is not adopted again
    (tmp_path / "adversary_length.json").write_text(json.dumps({"length_honest": {"shards": [], **first}}))
    (tmp_path / ls.SHARDS / "float32_0.json").unlink()
    ls.adopt_first_reading(tmp_path, "length_honest", "float32")
    assert not (tmp_path / ls.SHARDS / "float32_0.json").exists()
    (tmp_path / ls.SHARDS / "float32_3.json").write_text(json.dumps(_shard(3, 1, [0.0])))
    with pytest.raises(SystemExit, match="run already"):
        ls.study_length_honest(tmp_path, "float32", 10_000, 256, 1.0, shard=3)


def test_the_attacks_study_renices_the_local_workers_and_not_the_learner():
    """``attacks_run``'s workers stand for machines of their own: a child running ``... worker`` of the
    given parent, every one of its threads, goes to the workers' niceness; a child that is not a worker
    (the learner's grading process, say) keeps its own."""
    import os
    import subprocess
    import sys

    from echo2_bench.adversary_length_runs import renice_workers

    sleep = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)"
    worker = subprocess.Popen([sys.executable, "-c", sleep, "worker"])
    other = subprocess.Popen([sys.executable, "-c", sleep, "grading"])
    try:
        time.sleep(0.5)  # both threads started
        target = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 7)  # lower than this test's own priority
        assert renice_workers(os.getpid(), target, wait_s=5) == [worker.pid]
        tasks = list(Path(f"/proc/{worker.pid}/task").iterdir())
        assert len(tasks) == 2 and {os.getpriority(os.PRIO_PROCESS, int(t.name)) for t in tasks} == {target}
        assert os.getpriority(os.PRIO_PROCESS, other.pid) == os.getpriority(os.PRIO_PROCESS, os.getpid())
    finally:
        for p in (worker, other):
            p.kill()
            p.wait()
