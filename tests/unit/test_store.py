"""Submission validation (data/submission.py) and the durable trajectory store (data/store.py)."""

from __future__ import annotations

import copy
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from echo2.data.store import StoreStats, TrajectoryStore
from echo2.data.submission import Rejected, Submission, SubmissionLimits, validate_submission
from echo2.errors import ConfigError, Echo2Error
from echo2.types import Prompt

G = 4  # group size in these tests
LIMITS = SubmissionLimits(
    vocab_size=512,
    group_size=G,
    max_prompt_tokens=32,
    max_completion_tokens=16,
    max_groups=4,
    min_logprob=-30,
)


def prompts(*ids: str) -> list[Prompt]:
    return [Prompt(prompt_id=i, text=f"what is {i}?", answer=i.upper(), meta={"k": i}) for i in ids]


def body(lease_id: str, prompt_ids: list[str], version: int = 0, seed: int = 0) -> dict[str, Any]:
    """A valid payload: sample j of group i has distinct, recognisable contents."""
    return {
        "lease_id": lease_id,
        "policy_version": version,
        "groups": [
            {
                "prompt_id": pid,
                "samples": [
                    {
                        "prompt_ids": [1, 2, 3, (seed + i) % 512],
                        "completion_ids": [10 + j, 20 + i, (seed * 7 + j) % 512],
                        "sampler_logprobs": [-0.5, -1.25, -0.001 * (j + 1)],
                        "reward": float(j) + 0.5 * i,
                        "meta": {"parsed": j % 2 == 0, "worker": "w1", "len": 3},
                    }
                    for j in range(G)
                ],
            }
            for i, pid in enumerate(prompt_ids)
        ],
    }


@pytest.fixture
def store(tmp_path):
    s = TrajectoryStore(tmp_path / "store.db", staleness=2, group_size=G)
    yield s
    s.close()


def submit_lease(
    store: TrajectoryStore,
    ids: list[str],
    version: int = 0,
    learner_version: int = 0,
    worker: str = "w1",
    now: float = 0.0,
    seed: int = 0,
) -> tuple[str, Submission]:
    lease = store.issue_lease(worker, prompts(*ids), now=now, ttl_s=60.0)
    sub = validate_submission(body(lease, ids, version, seed), LIMITS, latest_published=max(version, 0))
    store.submit(sub, worker, learner_version=learner_version, now=now + 1)
    return lease, sub


# --- validation -------------------------------------------------------------------------------------------


def test_validate_accepts_good_payload():
    b = body("L1", ["a", "b"], version=3)
    b["groups"][0]["samples"][0]["reward"] = 1  # a JSON integer is a valid float
    del b["groups"][1]["samples"][0]["meta"]  # meta is optional
    sub = validate_submission(b, LIMITS, latest_published=3)
    assert sub.lease_id == "L1" and sub.policy_version == 3 and sub.n_trajectories == 2 * G
    assert [len(g) for g in sub.groups] == [G, G]
    t = sub.groups[1][2]
    assert t.group_id == "L1:1" and t.prompt_id == "b" and t.policy_version == 3
    assert t.prompt_ids == (1, 2, 3, 1) and t.completion_ids == (12, 21, 2)
    assert t.sampler_logprobs == (-0.5, -1.25, -0.003) and t.reward == 2.5
    assert t.meta == {"parsed": True, "worker": "w1", "len": 3}
    assert sub.groups[0][0].reward == 1.0 and isinstance(sub.groups[0][0].reward, float)
    assert sub.groups[1][0].meta == {}


def _set(path: str, value: Any):
    """A mutator setting ``groups.0.samples.1.reward``-style paths (``del`` as value deletes)."""

    def mutate(b: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = b
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        key: Any = int(last) if isinstance(node, list) else last
        if value == "del":
            del node[key]
        else:
            node[key] = value

    return mutate


BAD = [
    # (mutation, reason, text the detail must contain)
    (_set("policy_version", "3"), "schema", "policy_version"),
    (_set("lease_id", 7), "schema", "lease_id"),
    (_set("groups.0.samples.1.completion_ids.0", 3.0), "schema", "groups[0].samples[1].completion_ids[0]"),
    (_set("groups.0.samples.1.prompt_ids.0", True), "schema", "groups[0].samples[1].prompt_ids[0]"),
    (_set("groups.0.samples.1.reward", "1.0"), "schema", "groups[0].samples[1].reward"),
    (_set("groups.0.samples.1.completion_ids", "del"), "schema", "groups[0].samples[1].completion_ids"),
    (_set("groups.0.samples.1.bogus", 1), "schema", "groups[0].samples[1].bogus"),
    (_set("extra", 1), "schema", "extra"),
    (_set("groups.1.samples.0.meta", {"nested": {"a": 1}}), "schema", "groups[1].samples[0].meta"),
    (_set("groups.1.samples.0.meta", {"x": math.inf}), "schema", "meta['x']: float value inf is not finite"),
    (_set("groups.0", 5), "schema", "groups[0]: expected a JSON object"),
    (_set("groups.0.samples.0.prompt_ids", []), "schema", "empty prompt"),
    (_set("groups.0.samples.0.completion_ids", []), "schema", "empty completion"),
    (_set("groups", []), "schema", "groups"),
    (_set("policy_version", -1), "schema", "negative"),
    (_set("policy_version", 4), "future_version", "latest published 3"),
    (
        _set("groups.1.samples.2.completion_ids.2", 70000),
        "token_range",
        "groups[1].samples[2].completion_ids[2]",
    ),
    (_set("groups.0.samples.0.prompt_ids.1", -1), "token_range", "prompt_ids[1]: token id -1"),
    (_set("groups.0.samples.0.completion_ids.0", 512), "token_range", "outside vocabulary of 512"),
    (_set("groups.0.samples.3.reward", math.nan), "reward", "groups[0].samples[3].reward"),
    (_set("groups.0.samples.3.reward", -math.inf), "reward", "not finite"),
    (_set("groups.1.samples.0.sampler_logprobs.1", math.nan), "logprob", "sampler_logprobs[1]"),
    (_set("groups.1.samples.0.sampler_logprobs.2", 0.5), "logprob", "sampler_logprobs[2]: log-prob 0.5"),
    (_set("groups.1.samples.0.sampler_logprobs", [-0.1, -0.2]), "logprob", "2 log-probs for 3"),
    # below what seeded Gumbel-max can draw (the poison that overflowed exp in the loss)
    (_set("groups.1.samples.0.sampler_logprobs.0", -100.0), "logprob", "log-prob -100.0 is below -30"),
    (_set("groups.1.samples.0.sampler_logprobs.1", -1e30), "logprob", "sampler_logprobs[1]: log-prob -1e+30"),
    (_set("groups.1.samples.0.sampler_logprobs.1", -math.inf), "logprob", "not finite"),
    (_set("groups.1.samples.0.meta", {f"k{i}": i for i in range(17)}), "oversized", "17 items"),
    (_set("groups.1.samples.0.meta", {"note": "x" * 257}), "oversized", "257 characters"),
    (_set("groups.0.samples.0.completion_ids", [1] * 17), "oversized", "17 tokens > limit 16"),
    (_set("groups.0.samples.0.prompt_ids", [1] * 33), "oversized", "33 tokens > limit 32"),
]


@pytest.mark.parametrize(("mutate", "reason", "needle"), BAD)
def test_validate_rejects(mutate, reason, needle):
    b = body("L1", ["a", "b"], version=3)
    mutate(b)
    with pytest.raises(Rejected) as info:
        validate_submission(b, LIMITS, latest_published=3)
    assert info.value.reason == reason, str(info.value)
    assert needle in info.value.detail, str(info.value)
    assert str(info.value) == f"{reason}: {info.value.detail}"


def test_validate_exact_detail_and_error_count():
    b = body("L1", ["a", "b"], version=0)
    b["groups"][1]["samples"][2]["completion_ids"][1] = 70000
    with pytest.raises(Rejected) as info:
        validate_submission(b, LIMITS, latest_published=0)
    assert (
        info.value.detail
        == "groups[1].samples[2].completion_ids[1]: token id 70000 outside vocabulary of 512"
    )
    b = body("L1", ["a"], version=0)
    for s in b["groups"][0]["samples"]:
        s["reward"] = "high"
    with pytest.raises(Rejected) as info:
        validate_submission(b, LIMITS, latest_published=0)
    assert info.value.detail.endswith("(and 3 more errors)")
    # a body that is not an object is malformed (HTTP 400) wherever it is checked; broken JSON too
    with pytest.raises(Rejected, match=r"^malformed: body must be a JSON object") as info:
        validate_submission([1, 2], LIMITS, latest_published=0)
    assert info.value.http_status == 400
    with pytest.raises(Rejected, match=r"^malformed: body is not JSON"):
        validate_submission(b"{oops", LIMITS, latest_published=0)


@pytest.mark.parametrize("n", [G - 1, G + 1])
def test_validate_group_size(n):
    b = body("L1", ["a", "b"])
    samples = b["groups"][1]["samples"]
    b["groups"][1]["samples"] = samples[:n] if n < G else [*samples, copy.deepcopy(samples[0])]
    with pytest.raises(Rejected) as info:
        validate_submission(b, LIMITS, latest_published=0)
    assert info.value.reason == "group_size" and f"groups[1].samples: {n} samples, expected {G}" in str(
        info.value
    )


def test_validate_too_many_groups():
    with pytest.raises(Rejected) as info:
        validate_submission(body("L1", list("abcde")), LIMITS, latest_published=0)
    assert info.value.reason == "oversized" and "5 groups > limit 4" in info.value.detail
    assert info.value.http_status == 413


def test_rejected_http_status_and_label():
    codes = {r: Rejected(r, "x").http_status for r in ["replay", "wrong_worker", "unknown_lease", "schema"]}
    assert codes == {"replay": 409, "wrong_worker": 403, "unknown_lease": 404, "schema": 422}
    assert isinstance(Rejected("logprob", "x"), Echo2Error)
    with pytest.raises(ValueError):
        Rejected("Not A Label", "x")


# --- lease flow -------------------------------------------------------------------------------------------


def test_issue_submit_take_roundtrip(store):
    lease = store.issue_lease(
        "w1", prompts("a", "b"), now=0.0, ttl_s=60.0, seed=2**53 - 1, installed_version=3
    )
    info = store.lease(lease)
    assert info is not None and store.lease("nope") is None
    assert (info.worker_id, info.state, info.seed, info.installed_version) == ("w1", "open", 2**53 - 1, 3)
    assert info.prompts == prompts("a", "b")
    sub = validate_submission(body(lease, ["a", "b"], version=1), LIMITS, latest_published=1)
    res = store.submit(sub, "w1", learner_version=1, now=1.0)
    assert (res.admitted, res.dropped_stale) == (2 * G, 0)
    batch = store.take_batch(2, learner_version=1, step=1)
    assert batch == list(sub.groups)
    gids = [g[0].group_id for g in batch]  # whose lease each answered, by the store's record
    assert store.workers_of([*gids, "unknown"]) == dict.fromkeys(gids, "w1") and store.workers_of([]) == {}
    assert store.take_batch(1, learner_version=1, step=2) is None
    st = store.stats()
    assert (st.admitted, st.size, st.leases_open) == (2 * G, 0, 0)


def test_replay_rejected_counted_and_changes_nothing(store):
    _, sub = submit_lease(store, ["a"])
    before = store.stats()
    with pytest.raises(Rejected) as info:
        store.submit(sub, "w1", learner_version=0, now=2.0)
    assert info.value.reason == "replay" and info.value.http_status == 409
    store.record_rejection(info.value.reason)
    st = store.stats()
    assert (st.admitted, st.size) == (before.admitted, before.size) == (G, G)
    assert st.rejected == 1 and st.rejected_by_reason == {"replay": 1}
    assert st.metrics()["store/rejected/replay"] == 1 and st.metrics()["store/rejected"] == 1
    batch = store.take_batch(1, 0, 1)
    assert batch is not None and len(batch) == 1  # the group was stored once, not twice


def test_wrong_worker_unknown_lease_prompt_mismatch(store):
    lease = store.issue_lease("w1", prompts("a", "b"), now=0.0, ttl_s=60.0)
    sub = validate_submission(body(lease, ["a", "b"]), LIMITS, latest_published=0)
    with pytest.raises(Rejected) as info:
        store.submit(sub, "w2", learner_version=0, now=1.0)
    assert info.value.reason == "wrong_worker"
    ghost = validate_submission(body("0" * 32, ["a", "b"]), LIMITS, latest_published=0)
    with pytest.raises(Rejected) as info:
        store.submit(ghost, "w1", learner_version=0, now=1.0)
    assert info.value.reason == "unknown_lease"
    swapped = validate_submission(body(lease, ["b", "a"]), LIMITS, latest_published=0)
    with pytest.raises(Rejected, match=r"prompt_mismatch: groups\[0\].prompt_id: 'b', the lease has 'a'"):
        store.submit(swapped, "w1", learner_version=0, now=1.0)
    short = validate_submission(body(lease, ["a"]), LIMITS, latest_published=0)
    with pytest.raises(Rejected, match="prompt_mismatch: groups: 1 groups for a lease of 2 prompts"):
        store.submit(short, "w1", learner_version=0, now=1.0)
    # none of the rejections touched the lease: the right worker can still submit it
    st = store.stats()
    assert (st.admitted, st.leases_open) == (0, 1)
    assert store.submit(sub, "w1", learner_version=0, now=2.0).admitted == 2 * G


def test_submit_is_one_transaction(store):
    lease = store.issue_lease("w1", prompts("a", "b"), now=0.0, ttl_s=60.0)
    sub = validate_submission(body(lease, ["a", "b"]), LIMITS, latest_published=0)
    # a hand-made submission whose second group collides with the first: the insert fails midway
    dup = replace(
        sub, groups=(sub.groups[0], tuple(replace(t, group_id=f"{lease}:0") for t in sub.groups[1]))
    )
    with pytest.raises(Exception, match="UNIQUE"):
        store.submit(dup, "w1", learner_version=0, now=1.0)
    st = store.stats()
    assert (st.admitted, st.size, st.leases_open) == (0, 0, 1)
    assert store.submit(sub, "w1", learner_version=0, now=1.0).admitted == 2 * G


# --- staleness --------------------------------------------------------------------------------------------


def test_staleness_admission(store):
    # S = 2, v_t = 5: version 3 = v_t - S is admitted, version 2 = v_t - S - 1 is dropped
    lease3 = store.issue_lease("w1", prompts("a"), now=0.0, ttl_s=60.0)
    lease2 = store.issue_lease("w1", prompts("b", "c"), now=0.0, ttl_s=60.0)
    r3 = store.submit(
        validate_submission(body(lease3, ["a"], 3), LIMITS, 5), "w1", learner_version=5, now=1.0
    )
    r2 = store.submit(
        validate_submission(body(lease2, ["b", "c"], 2), LIMITS, 5), "w1", learner_version=5, now=1.0
    )
    assert (r3.admitted, r3.dropped_stale) == (G, 0)
    assert (r2.admitted, r2.dropped_stale) == (0, 2 * G)
    st = store.stats()
    assert (st.admitted, st.dropped_stale, st.size, st.leases_open) == (G, 2 * G, G, 0)
    assert st.metrics()["store/dropped_stale"] == 2 * G
    batch = store.take_batch(1, learner_version=5, step=5)
    assert batch is not None and batch[0][0].prompt_id == "a"


def test_stale_groups_dropped_at_take(store):
    submit_lease(store, ["a"], version=3, learner_version=5)
    submit_lease(store, ["b"], version=4, learner_version=5)
    # learner advances to 6: floor 4, the version-3 group is discarded, only one group is left
    assert store.take_batch(2, learner_version=6, step=6) is None
    st = store.stats()
    assert (st.dropped_stale, st.size) == (G, G)
    batch = store.take_batch(1, learner_version=6, step=6)
    assert batch is not None and batch[0][0].prompt_id == "b" and batch[0][0].policy_version == 4


# --- batches ----------------------------------------------------------------------------------------------


def test_fifo_and_groups_whole(store):
    _, s1 = submit_lease(store, ["a", "b"], seed=1)
    _, s2 = submit_lease(store, ["c"], seed=2)
    _, s3 = submit_lease(store, ["d", "e"], seed=3)
    first = store.take_batch(2, 0, step=1)
    second = store.take_batch(2, 0, step=2)
    assert first == [s1.groups[0], s1.groups[1]]
    assert second == [s2.groups[0], s3.groups[0]]
    for g in first + second:
        assert len(g) == G and len({t.group_id for t in g}) == 1
        assert [t.completion_ids[0] for t in g] == [10 + j for j in range(G)]  # sample order kept
    rest = store.take_batch(1, 0, step=3)
    assert rest == [s3.groups[1]]


def test_take_below_n_consumes_nothing(store):
    _, sub = submit_lease(store, ["a", "b"])
    assert store.take_batch(3, 0, step=1) is None
    assert store.stats().size == 2 * G
    assert store.take_batch(2, 0, step=1) == list(sub.groups)


# --- durability, restart ----------------------------------------------------------------------------------


def test_reopen_keeps_buffer_and_counters(tmp_path):
    path = tmp_path / "store.db"
    s = TrajectoryStore(path, staleness=2, group_size=G)
    _, sub_a = submit_lease(s, ["a", "b"], seed=1)
    _, sub_c = submit_lease(s, ["c"], seed=2)
    open_lease = s.issue_lease("w2", prompts("z"), now=0.0, ttl_s=60.0)
    assert s.take_batch(2, 0, step=1) == list(sub_a.groups)
    s.record_rejection("schema")
    s.record_rejection("auth")
    before = s.stats()
    s.close()

    s = TrajectoryStore(path, staleness=2, group_size=G)
    assert s.stats() == before
    assert before.rejected_by_reason == {"schema": 1, "auth": 1} and before.size == G
    reopened = s.lease(open_lease)
    assert reopened is not None and reopened.prompts == prompts("z") and reopened.worker_id == "w2"
    with pytest.raises(Rejected, match="replay"):
        s.submit(sub_a, "w1", learner_version=0, now=5.0)
    assert s.take_batch(1, 0, step=2) == list(sub_c.groups)  # consumed groups are not returned again
    assert s.take_batch(1, 0, step=3) is None
    s.close()
    with pytest.raises(ConfigError, match="group_size"):
        TrajectoryStore(path, staleness=2, group_size=G + 1)


def test_accepted_group_survives_a_killed_process(tmp_path):
    """No close(), no clean exit: the process dies right after submit returns."""
    path = tmp_path / "store.db"
    code = f"""
import os, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from test_store import TrajectoryStore, submit_lease, G
s = TrajectoryStore({str(path)!r}, staleness=2, group_size=G)
submit_lease(s, ["a", "b"])
os._exit(0)
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    s = TrajectoryStore(path, staleness=2, group_size=G)
    batch = s.take_batch(2, 0, step=1)
    assert batch is not None and [g[0].prompt_id for g in batch] == ["a", "b"]
    assert s.stats().admitted == 2 * G
    s.close()


def test_requeue_after(tmp_path):
    path = tmp_path / "store.db"
    s = TrajectoryStore(path, staleness=2, group_size=G)
    _, sub = submit_lease(s, ["a", "b", "c"])
    b1, b2, b3 = (s.take_batch(1, 0, step=k) for k in (1, 2, 3))
    assert s.take_batch(1, 0, step=4) is None
    s.close()
    # the learner restarts from its checkpoint at step 1: the updates of steps 2 and 3 were lost
    s = TrajectoryStore(path, staleness=2, group_size=G)
    assert s.requeue_after(1) == 2
    assert s.stats().size == 2 * G
    assert s.take_batch(2, 1, step=2) == [*b2, *b3] == list(sub.groups[1:3])
    assert s.requeue_after(3) == 0
    assert s.prune_consumed(1) == 1  # only step 1's group is beyond requeue now
    assert s.requeue_after(0) == 2 and s.take_batch(3, 1, step=2) is None  # a pruned group stays put
    assert b1 == [sub.groups[0]]
    assert s.consumed_per_step() == {1: 1}  # the ledger keeps pruned groups under their step
    s.close()


# --- leases over time -------------------------------------------------------------------------------------


def test_expire_leases_and_late_submission(store):
    lease = store.issue_lease("w1", prompts("a", "b"), now=0.0, ttl_s=10.0)
    other = store.issue_lease("w2", prompts("c"), now=5.0, ttl_s=10.0)
    assert store.expire_leases(now=9.9) == []
    assert store.expire_leases(now=10.0) == prompts("a", "b")
    assert store.expire_leases(now=11.0) == []  # expired once
    st = store.stats()
    assert (st.leases_expired, st.leases_open) == (1, 1)
    late = validate_submission(body(lease, ["a", "b"]), LIMITS, latest_published=0)
    assert store.submit(late, "w1", learner_version=0, now=12.0).admitted == 2 * G
    with pytest.raises(Rejected, match="replay"):
        store.submit(late, "w1", learner_version=0, now=13.0)
    assert store.expire_leases(now=100.0) == prompts("c")
    st = store.stats()
    assert (st.leases_expired, st.leases_open, st.admitted) == (2, 0, 2 * G)
    assert store.lease(other).worker_id == "w2"  # type: ignore[union-attr]


def test_outstanding_rollouts(store):
    assert store.outstanding_rollouts() == 0
    l1 = store.issue_lease("w1", prompts("a", "b", "c"), now=0.0, ttl_s=10.0)
    store.issue_lease("w2", prompts("d"), now=0.0, ttl_s=10.0)
    assert store.outstanding_rollouts() == (3 + 1) * G  # 16 leased
    store.submit(validate_submission(body(l1, ["a", "b", "c"]), LIMITS, 0), "w1", 0, now=1.0)
    assert store.outstanding_rollouts() == 1 * G + 3 * G  # 4 leased + 12 buffered
    assert store.take_batch(2, 0, step=1) is not None
    assert store.outstanding_rollouts() == 1 * G + 1 * G  # 4 leased + 4 buffered
    store.expire_leases(now=10.0)
    assert store.outstanding_rollouts() == 1 * G  # 4 buffered
    # buffered groups that are already too old for the learner do not count
    assert store.take_batch(5, learner_version=3, step=2) is None
    assert store.outstanding_rollouts() == 0 and store.stats().dropped_stale == G


def test_stats_metrics_keys(store):
    store.record_rejection("token_range")
    m = store.stats().metrics()
    assert set(m) == {
        "store/size",
        "store/admitted",
        "store/dropped_stale",
        "store/zero_variance",
        "store/trained",
        "store/rejected",
        "store/purged",
        "store/poisoned",
        "store/held",
        "store/unchecked_dropped",
        "store/rejected/token_range",
    }
    assert isinstance(store.stats(), StoreStats)
    with pytest.raises(ValueError):
        store.record_rejection("bad label!")


# --- groups held for their generation check -----------------------------------------------------------


def test_held_groups_are_never_trained_until_released(store):
    """A submission drawn for the generation check is stored held: counted in size and outstanding work,
    never returned by take_batch until its check passes (release); one whose check cannot run is
    dropped untrained, counted, its prompts leased again."""
    l1 = store.issue_lease("w1", prompts("a", "b"), now=0.0, ttl_s=10.0)
    l2 = store.issue_lease("w1", prompts("c"), now=0.0, ttl_s=10.0)
    r1 = store.submit(validate_submission(body(l1, ["a", "b"]), LIMITS, 0), "w1", 0, now=1.0, hold=True)
    store.submit(validate_submission(body(l2, ["c"]), LIMITS, 0), "w1", 0, now=1.0, hold=True)
    assert (r1.admitted, r1.held) == (2 * G, 2 * G) and store.stats().held == 3 * G
    assert store.stats().size == 3 * G and store.outstanding_rollouts() == 3 * G
    assert store.take_batch(1, 0, step=1) is None  # nothing trainable yet
    assert store.release(l1) == 2 * G and store.release(l1) == 0
    batch = store.take_batch(2, 0, step=1)
    assert batch is not None and [g[0].prompt_id for g in batch] == ["a", "b"]
    assert store.drop_held(l2) == G and store.stats().unchecked_dropped == G
    assert [(p.prompt_id, why) for p, why in store.take_redo()] == [("c", "unchecked")]
    assert store.take_batch(1, 0, step=2) is None and store.stats().held == 0


def test_the_learner_waits_for_a_check_its_update_would_leave_behind(store):
    """S = 2, the learner at version 4 (the floor 2): a held group claiming 2 would be left behind unchecked
    by the next update, so take_batch waits (None, counted) though trainable groups are there; a held
    group claiming 3 does not hold it up. Its check done (released or dropped), the learner goes on."""
    at_floor = store.issue_lease("w1", prompts("a"), now=0.0, ttl_s=10.0)
    newer = store.issue_lease("w1", prompts("b"), now=0.0, ttl_s=10.0)
    ready = store.issue_lease("w2", prompts("c", "d"), now=0.0, ttl_s=10.0)
    store.submit(
        validate_submission(body(at_floor, ["a"], version=2), LIMITS, 3), "w1", 4, now=1.0, hold=True
    )
    store.submit(validate_submission(body(newer, ["b"], version=3), LIMITS, 3), "w1", 4, now=1.0, hold=True)
    store.submit(validate_submission(body(ready, ["c", "d"], version=3), LIMITS, 3), "w2", 4, now=1.0)
    assert store.take_batch(1, 4, step=5) is None and store.waits_for_checks == 1
    store.release(at_floor)
    batch = store.take_batch(2, 4, step=5)  # the held group at 3 is next update's concern, not this one's
    assert batch is not None and [g[0].prompt_id for g in batch] == ["a", "c"]
    assert store.take_batch(1, 5, step=6) is None and store.waits_for_checks == 2  # at 5 the floor is 3: "b"
    assert store.drop_held(newer) == G  # its check could not run: dropped, and the learner goes on
    got = store.take_batch(1, 5, step=6)
    assert got is not None and [g[0].prompt_id for g in got] == ["d"]


def test_a_restarted_store_drops_what_an_earlier_process_held(tmp_path):
    first = TrajectoryStore(tmp_path / "s.db", staleness=2, group_size=G)
    lease = first.issue_lease("w1", prompts("a"), now=0.0, ttl_s=10.0)
    first.submit(validate_submission(body(lease, ["a"]), LIMITS, 0), "w1", 0, now=1.0, hold=True)
    first.close()
    again = TrajectoryStore(tmp_path / "s.db", staleness=2, group_size=G)
    assert again.stats().held == G and again.drop_held() == G  # the learner does this at start
    assert again.take_batch(1, 0, step=1) is None and again.stats().held == 0
    again.close()


# --- quarantine, rejection counting, migration ---------------------------------------------------------


def test_purge_worker_takes_back_its_buffered_groups_and_leases_only(store):
    submit_lease(store, ["a"], worker="liar")
    submit_lease(store, ["b"], worker="honest")
    submit_lease(store, ["c"], worker="liar")
    assert store.take_batch(1, 0, step=1) is not None  # "a" (the liar's) was trained on before the purge
    store.issue_lease("liar", prompts("d", "e"), now=0.0, ttl_s=60.0)
    purged, back = store.purge_worker("liar")
    assert purged == G and [p.prompt_id for p in back] == ["d", "e"]  # "c" purged, its open lease back
    st = store.stats()
    assert st.purged == G and st.leases_open == 0 and st.metrics()["store/purged"] == G
    batch = store.take_batch(1, 0, step=2)
    assert batch is not None and batch[0][0].prompt_id == "b"  # only the honest group is left
    assert store.take_batch(1, 0, step=3) is None
    assert store.requeue_after(0) == 2  # a restart requeues what was trained on, never what was purged
    assert store.purge_worker("nobody") == (0, [])


def test_purged_poison_groups_are_never_requeued_not_even_after_a_restart(tmp_path):
    """Groups the update left out (non-finite loss) are purged wherever they are, counted, and their
    workers named; reopening the store and requeueing (what --resume does) never brings them back."""
    path = tmp_path / "store.db"
    s = TrajectoryStore(path, staleness=2, group_size=G)
    submit_lease(s, ["a", "b"], worker="poisoner")
    submit_lease(s, ["c"], worker="honest")
    batch = s.take_batch(3, 0, step=1)
    assert batch is not None
    poison = [g[0].group_id for g in batch if g[0].prompt_id == "b"]
    assert s.purge_groups(poison) == ["poisoner"]
    assert s.purge_groups([]) == []
    st = s.stats()
    assert st.poisoned == 1 and st.purged == G and st.metrics()["store/poisoned"] == 1
    s.close()
    s = TrajectoryStore(path, staleness=2, group_size=G)  # the learner restarted before a checkpoint
    assert s.requeue_after(0) == 2  # "a" and "c" go back to be trained on; "b" never
    again = s.take_batch(2, 0, step=1)
    assert again is not None and sorted(g[0].prompt_id for g in again) == ["a", "c"]
    assert s.take_batch(1, 0, step=2) is None
    s.close()


def test_rejections_cost_no_transaction_each_and_survive_a_reopen(tmp_path, monkeypatch):
    s = TrajectoryStore(tmp_path / "store.db", staleness=2, group_size=G)
    begun = []
    real_tx = s._tx

    def counting_tx():
        begun.append(1)
        return real_tx()

    monkeypatch.setattr(s, "_tx", counting_tx)
    for _ in range(100):
        s.record_rejection("auth")
    assert begun == [] and s.stats().rejected_by_reason == {"auth": 100}  # counted, not yet written
    s.issue_lease("w", prompts("a"), now=0.0, ttl_s=1.0)  # the next transaction writes them
    assert len(begun) == 1
    s.record_rejection("malformed")
    s.close()  # and closing writes the rest
    reopened = TrajectoryStore(tmp_path / "store.db", staleness=2, group_size=G)
    assert reopened.stats().rejected_by_reason == {"auth": 100, "malformed": 1}
    reopened.close()


def test_a_version_2_store_gains_the_lease_columns(tmp_path):
    import sqlite3

    path = tmp_path / "old.db"
    s = TrajectoryStore(path, staleness=2, group_size=G)
    lease, _ = submit_lease(s, ["a"])
    s.close()
    db = sqlite3.connect(path)  # make it what the previous release wrote
    db.executescript(
        "CREATE TABLE l2 AS SELECT lease_id, worker_id, state, issued_at, expires_at, submitted_at, "
        "n_prompts, prompts FROM leases; DROP TABLE leases; ALTER TABLE l2 RENAME TO leases; "
        "ALTER TABLE rollout_groups DROP COLUMN held; PRAGMA user_version = 2;"
    )
    db.close()
    s = TrajectoryStore(path, staleness=2, group_size=G)
    info = s.lease(lease)
    assert info is not None and (info.seed, info.installed_version, info.state) == (0, -1, "submitted")
    assert info.epoch == 0  # a lease of an earlier store is of no run epoch a learner has now
    assert s.stats().admitted == G and s.stats().held == 0  # groups gained their held flag, unset
    s.close()


def test_a_version_5_store_gains_the_lease_epoch_and_leases_keep_theirs(tmp_path):
    import sqlite3

    path = tmp_path / "v5.db"
    s = TrajectoryStore(path, staleness=2, group_size=G)
    old = s.issue_lease("w", prompts("a"), now=0.0, ttl_s=5.0, epoch=4)
    assert s.lease(old).epoch == 4
    s.close()
    db = sqlite3.connect(path)
    db.executescript("ALTER TABLE leases DROP COLUMN epoch; PRAGMA user_version = 5;")
    db.close()
    s = TrajectoryStore(path, staleness=2, group_size=G)
    assert s.lease(old).epoch == 0
    assert s.lease(s.issue_lease("w", prompts("b"), now=0.0, ttl_s=5.0, epoch=5)).epoch == 5
    s.close()


def test_every_learner_process_on_a_run_directory_has_a_run_epoch_of_its_own(tmp_path):
    from echo2.errors import ConfigError
    from echo2.observe.rundir import EPOCH_FILE, clear_run, next_epoch

    assert [next_epoch(tmp_path) for _ in range(3)] == [1, 2, 3]
    clear_run(tmp_path)  # a fresh run in the same directory keeps counting: old workers may linger
    assert next_epoch(tmp_path) == 4
    (tmp_path / EPOCH_FILE).write_text("four\n")
    with pytest.raises(ConfigError, match="not a run epoch"):
        next_epoch(tmp_path)


def test_groups_with_equal_rewards_are_admitted_but_never_trained_and_the_batch_is_filled(tmp_path):
    """``drop_flat`` (grpo.drop_zero_variance, DAPO's dynamic sampling): a group whose rewards are all
    equal is admitted (its worker's work counts) and counted ``zero_variance``, never handed to the
    learner; a batch is R groups with signal, filled from what arrives next (never a smaller one). A
    drawn submission's flat groups stay held with the rest: its check still runs."""
    s = TrajectoryStore(tmp_path / "flat.db", staleness=2, group_size=G, drop_flat=True)
    try:
        lease = s.issue_lease("w1", prompts("a", "b", "c"), now=0.0, ttl_s=10.0)
        raw = body(lease, ["a", "b", "c"])
        for sample in raw["groups"][1]["samples"]:  # group b: every reward 1.0
            sample["reward"] = 1.0
        sub = validate_submission(raw, LIMITS, 0)
        result = s.submit(sub, "w1", 0, now=1.0)
        assert (result.admitted, result.zero_variance) == (3 * G, G)
        assert s.take_batch(3, 0, step=1) is None  # two groups with signal: not a batch of three
        got = s.take_batch(2, 0, step=1)
        assert got is not None and [g[0].prompt_id for g in got] == ["a", "c"]
        stats = s.stats()
        assert (stats.admitted, stats.zero_variance, stats.size) == (3 * G, G, 0)
        assert stats.metrics()["store/zero_variance"] == G
        assert stats.useful_share() == pytest.approx(2 / 3)  # what the pool is sized by
        held = s.issue_lease("w1", prompts("d"), now=2.0, ttl_s=10.0)
        flat = body(held, ["d"])
        for sample in flat["groups"][0]["samples"]:
            sample["reward"] = 0.0
        r = s.submit(validate_submission(flat, LIMITS, 0), "w1", 0, now=3.0, hold=True)
        assert (r.held, r.zero_variance) == (G, G)  # the check of a drawn submission still runs
        assert s.release(held) == 0  # and passing it trains nothing of a flat group
    finally:
        s.close()
    plain = TrajectoryStore(tmp_path / "plain.db", staleness=2, group_size=G)  # the default: trained
    try:
        lease = plain.issue_lease("w1", prompts("a"), now=0.0, ttl_s=10.0)
        raw = body(lease, ["a"])
        for sample in raw["groups"][0]["samples"]:
            sample["reward"] = 1.0
        assert plain.submit(validate_submission(raw, LIMITS, 0), "w1", 0, now=1.0).zero_variance == 0
        assert plain.take_batch(1, 0, step=1) is not None
    finally:
        plain.close()


def test_the_yield_counts_every_trajectory_that_reached_the_store_once(tmp_path):
    """``store/yield``: of the trajectories received (admitted, or stale on arrival), the share trained,
    and the shares lost by cause or still buffered, adding up to 1; a restart's requeue and a poisoned
    group taken back out are not trained."""
    s = TrajectoryStore(tmp_path / "y.db", staleness=1, group_size=G, drop_flat=True)
    try:
        a = s.issue_lease("w1", prompts("a", "b", "c", "d"), now=0.0, ttl_s=10.0)
        raw = body(a, ["a", "b", "c", "d"])
        for sample in raw["groups"][3]["samples"]:  # d: flat
            sample["reward"] = 0.0
        s.submit(validate_submission(raw, LIMITS, 0), "w1", 0, now=1.0)  # 4 groups, 1 flat
        got = s.take_batch(2, 0, step=1)  # a, b trained
        assert got is not None
        late = s.issue_lease("w1", prompts("e"), now=1.0, ttl_s=10.0)
        s.submit(validate_submission(body(late, ["e"]), LIMITS, 0), "w1", 5, now=2.0)  # stale on arrival
        assert s.take_batch(1, 2, step=2) is None  # c (v0 < 2 - 1) dropped stale from the buffer
        s.purge_groups([got[1][0].group_id])  # b left out as poison after its update took it
        st = s.stats()
        assert (st.received(), st.trained, st.dropped_stale, st.zero_variance) == (5 * G, G, 2 * G, G)
        m = st.metrics()
        assert m["store/yield"] == pytest.approx(1 / 5)
        lost = {k: v for k, v in m.items() if k.startswith("store/yield_lost/")}
        assert lost == pytest.approx({
            "store/yield_lost/stale": 2 / 5, "store/yield_lost/zero_variance": 1 / 5,
            "store/yield_lost/purged": 1 / 5, "store/yield_lost/unchecked": 0.0,
            "store/yield_lost/buffered": 0.0,
        })  # fmt: skip
        assert m["store/yield"] + sum(lost.values()) == pytest.approx(1.0)
        assert s.requeue_after(0) == 1 and s.stats().trained == 0  # a's update was lost in a restart
    finally:
        s.close()
