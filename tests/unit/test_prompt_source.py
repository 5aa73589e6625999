"""Epochs without silent skips (runtime/prompts.py, data/store.py): a finite training split is leased as
seeded permutations, one prompt once per epoch; a prompt whose groups were discarded untrained (stale,
purged, poison) is leased again first, and one that keeps going stale is given up and counted."""

from __future__ import annotations

import json
import sqlite3

from echo2.config import MathTaskConfig, load_config
from echo2.data.store import TrajectoryStore
from echo2.data.submission import Submission
from echo2.observe import catalog as m
from echo2.runtime.prompts import MAX_REDO, PromptSource
from echo2.tasks.registry import build_task
from echo2.types import Prompt, Trajectory


def _math(tmp_path, n: int = 60):
    path = tmp_path / "train.jsonl"
    path.write_text(
        "".join(
            json.dumps({"question": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n" for i in range(n)
        )
    )
    return build_task(MathTaskConfig(train_path=str(path)), 0)


def test_a_finite_split_is_leased_in_epochs_each_prompt_once(tmp_path):
    task = _math(tmp_path)
    train = task.train_prompts()
    assert train is not None and len(train) > 20
    src = PromptSource(task, seed=1)
    first = src.take(len(train))
    assert sorted(p.prompt_id for p in first) == sorted(p.prompt_id for p in train)  # each once
    assert src.metrics()[m.DATA_EPOCH.key] == 1.0
    second = src.take(len(train))
    assert sorted(p.prompt_id for p in second) == sorted(p.prompt_id for p in train)
    assert [p.prompt_id for p in second] != [p.prompt_id for p in first]  # another permutation
    assert src.epoch == 2
    # a resumed run continues the epoch where the checkpoint left it
    a = PromptSource(task, seed=1)
    a.take(7)
    b = PromptSource(task, seed=1)
    b.restore(json.loads(json.dumps(a.state())))
    assert b.take(len(train)) == a.take(len(train))  # the rest of epoch 1, then epoch 2, alike
    # a stream (arithmetic) draws as before
    arith = PromptSource(build_task(load_config().task, 0), seed=1)
    assert arith.split is None and len(arith.take(5)) == 5 and m.DATA_EPOCH.key not in arith.metrics()


def test_discarded_prompts_come_back_first_and_a_prompt_always_stale_is_given_up(tmp_path):
    task = _math(tmp_path)
    src = PromptSource(task, seed=0)
    p, q = src.take(2)
    src.redo([(p, "stale"), (q, "purged")])
    assert src.take(2) == [p, q]
    for _ in range(MAX_REDO - 2):
        src.redo([(p, "stale")])
        assert src.take(1) == [p]
    src.redo([(p, "stale")])  # the MAX_REDO-th time: given up
    assert src.take(1) != [p]
    got = src.metrics()
    assert got[m.DATA_PROMPTS_SKIPPED.key] == 1 and got[m.DATA_PROMPTS_REQUEUED.key] == 1 + 1 + (MAX_REDO - 2)
    assert json.loads(json.dumps(src.state()))["skipped"] == {"stale": 1}


def test_a_prompt_answered_late_again_and_again_is_never_given_up(tmp_path):
    """Stale hoarders lease a prompt and answer it too stale, over and over: the prompt comes back every
    time and is never skipped (only the learner's own pace, admitted groups dropped stale, counts)."""
    src = PromptSource(_math(tmp_path), seed=0)
    (p,) = src.take(1)
    for _ in range(5 * MAX_REDO):
        src.redo([(p, "late")])
        assert src.take(1) == [p]
    assert src.metrics()[m.DATA_PROMPTS_SKIPPED.key] == 0


def _group(prompt: Prompt, lease: str, version: int, n: int = 2, length: int = 3) -> tuple[Trajectory, ...]:
    return tuple(
        Trajectory(
            prompt.prompt_id,
            f"{lease}:{prompt.prompt_id}",
            (1, 2),
            (5,) * length,
            (-1.0,) * length,
            0.0,
            version,
        )
        for _ in range(n)
    )


def test_the_store_reports_every_prompt_it_discards_untrained_and_counts_admitted_tokens():
    store = TrajectoryStore(":memory:", staleness=1, group_size=2)
    a, b, c, d = (Prompt(f"p{i}", f"q{i}", "1") for i in range(4))
    lease = store.issue_lease("w", [a, b], now=0.0, ttl_s=100)
    store.submit(Submission(lease, 0, (_group(a, lease, 0), _group(b, lease, 0))), "w", 0, 1.0)
    assert store.stats().admitted_tokens == 4 * 3
    assert store.take_batch(5, learner_version=3, step=4) is None  # v 0 < 3 - 1: both groups dropped
    assert sorted((p.prompt_id, why) for p, why in store.take_redo()) == [("p0", "stale"), ("p1", "stale")]
    assert store.take_redo() == []  # each reported once
    # a submission already too old when it arrives: the open lease's prompts come back, as late
    lease = store.issue_lease("w", [c], now=0.0, ttl_s=100)
    store.submit(Submission(lease, 0, (_group(c, lease, 0),)), "w", 5, 2.0)
    assert [(p.prompt_id, why) for p, why in store.take_redo()] == [("p2", "late")]
    # an answer after its lease expired (its prompts were leased again then) is not redone twice
    lease = store.issue_lease("w", [d], now=0.0, ttl_s=1)
    assert [p.prompt_id for p in store.expire_leases(5.0)] == ["p3"]
    store.submit(Submission(lease, 5, (_group(d, lease, 5),)), "w", 5, 6.0)
    assert store.take_batch(5, learner_version=9, step=10) is None
    assert store.take_redo() == []
    # a quarantined worker's buffered groups, and poison
    lease = store.issue_lease("x", [a], now=10.0, ttl_s=100)
    store.submit(Submission(lease, 9, (_group(a, lease, 9),)), "x", 9, 11.0)
    store.purge_worker("x")
    assert [(p.prompt_id, why) for p, why in store.take_redo()] == [("p0", "purged")]
    lease = store.issue_lease("y", [b], now=10.0, ttl_s=100)
    store.submit(Submission(lease, 9, (_group(b, lease, 9),)), "y", 9, 11.0)
    store.purge_groups([f"{lease}:p1"])
    assert [(p.prompt_id, why) for p, why in store.take_redo()] == [("p1", "poisoned")]


def test_a_store_written_by_the_previous_schema_opens(tmp_path):
    path = tmp_path / "store.sqlite"
    with TrajectoryStore(path, 1, 2) as store:
        store.issue_lease("w", [Prompt("p", "q", "1")], now=0.0, ttl_s=5)
    db = sqlite3.connect(path)
    db.execute("ALTER TABLE leases DROP COLUMN late")
    db.execute("PRAGMA user_version = 3")
    db.commit()
    db.close()
    with TrajectoryStore(path, 1, 2) as store:  # migrated: the column is back, the lease kept
        assert store.open_leases("w") == 1
        assert store.expire_leases(10.0)[0].prompt_id == "p"


def test_prompts_given_up_in_a_burst_are_one_log_line_a_minute_with_the_count(tmp_path, caplog):
    """416 prompts given up in a few minutes were 416 WARNING lines over the status line: now one line
    a minute at most, saying how many more and the running count (the count is the metric)."""
    import logging

    src = PromptSource(_math(tmp_path), seed=0)
    with caplog.at_level(logging.WARNING, logger="echo2.runtime.prompts"):
        for i in range(50):
            p = Prompt(f"p{i}", "1+1=", "2")
            src.redo([(p, "stale")] * MAX_REDO)
    lines = [r.getMessage() for r in caplog.records if "dropped as stale" in r.getMessage()]
    assert len(lines) == 1 and "data/prompts_skipped: 1 so far" in lines[0]
    assert src.metrics()[m.DATA_PROMPTS_SKIPPED.key] == 50
