"""A verifiers multi-turn env whose tasks plug a judge (``--task verifiers_env``, ``task.judges =
"learner"``), against a judge served on loopback here: refused by default naming the switch; a worker
plays and scores its episodes without the judge (it never calls one, nor holds its key), and the learner's
replay checks that claim, then adds the judge's verdict to every finished episode, calling the judges of
a submission at once; the held-out evaluation scores the same way; a judge that fails at load stops the
run naming it, and one that fails later scores its episode 0, counted."""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Any

import pytest

pytest.importorskip("verifiers.v1", reason="needs the verifiers extra (pip install 'echo2[verifiers]')")

from echo2.config import SamplingConfig
from echo2.data.store import Lease
from echo2.data.submission import Rejected, Submission
from echo2.data.tasks.environment import EnvironmentTask
from echo2.envs.verifiers_turns import VerifiersEnvSpec, VerifiersEnvTaskConfig
from echo2.errors import ConfigError
from echo2.rollout.episodes import collect_episodes, evaluate_episodes
from echo2.tasks.episodic import Episodic
from echo2.tasks.verify import EpisodeReplay
from echo2_bench.judge import LoopbackJudge

KEY_VAR = "ECHO2_TEST_JUDGE_KEY"  # the conftest judge fixture sets it
SAMPLING = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=4)
G = 4


def _spec(url: str, **fields: Any) -> VerifiersEnvSpec:
    """The bundled higher-or-lower env, a reference judge at ``url`` plugged into its tasks."""
    args = {"judge_url": url, "judge_model": "judge-1", "judge_key_var": KEY_VAR, "n": 64}
    env = "echo2.data.tasks.verifiers_example:load_judged_probe"
    cfg = VerifiersEnvTaskConfig(env=env, env_args=args, teacher="echo2_vf_probe:probe_teacher", **fields)
    return VerifiersEnvSpec(cfg)


def _play(spec: VerifiersEnvSpec, seed: int, guess: str | None = None) -> tuple[Any, float]:
    """An episode played to its end by the teacher (binary search: it finds the number), or by guessing
    ``guess`` every turn; the env and the last step's reward."""
    env = spec.make(None)  # type: ignore[arg-type]
    env.reset(seed)
    while True:
        step = env.step(spec.teacher(env) if guess is None else guess)
        if step.done:
            return env, step.reward


def test_a_judged_env_is_refused_by_default_naming_the_switch(judge: LoopbackJudge) -> None:
    with pytest.raises(ConfigError, match="cannot be scored on the learner") as caught:
        _spec(judge.url).loaded()
    said = str(caught.value)
    assert "judge 'reference' calls a judge model (judge-1 at " in said
    assert 'task.judges = "learner"' in said
    assert judge.calls == []


def test_a_worker_plays_without_the_judge_and_the_learner_adds_its_verdict(judge: LoopbackJudge) -> None:
    spec = _spec(judge.url, judges="learner")
    found, r_found = _play(spec, 0)
    wrong, r_wrong = _play(spec, 1, guess="99")
    unfinished = spec.make(None)  # type: ignore[arg-type]
    unfinished.reset(2)
    assert (r_found, r_wrong) == (1.0, 0.0)  # the task's own @reward alone: what a worker claims
    assert judge.calls == []  # playing (a worker's part) never calls the judge
    assert spec.judged([found, wrong, unfinished]) == [2.0, 0.0, None]  # the judge's 1 on top of the 1
    assert len(judge.calls) == 2 and {c["auth"] for c in judge.calls} == {"Bearer sk-the-learners-own"}
    assert all(c["body"]["model"] == "judge-1" for c in judge.calls)


@pytest.mark.parametrize("mode", ["hang", "nonsense", "down"])
def test_a_judge_that_fails_at_load_stops_the_run_there_and_later_scores_zero_counted(
    judge: LoopbackJudge, mode: str
) -> None:
    spec = _spec(judge.url, judges="learner", score_timeout_s=1.0)
    spec.ready_judges()  # the judge answers: the probe passes
    assert len(judge.calls) == 1
    env, _ = _play(spec, 0)
    before = spec.outcome_counts()
    judge.mode = mode
    if mode == "down":
        judge.close()
    t0 = time.monotonic()
    assert spec.judged([env]) == [0.0]  # the right guess: only the judge's failure scores it 0
    assert spec.outcome_counts() == {**before, "judge_error": before.get("judge_error", 0) + 1}
    with pytest.raises(ConfigError, match=r"asking the judges of task \w+ at load") as caught:
        spec.ready_judges()
    assert time.monotonic() - t0 < 8.0  # every hang cut at score_timeout_s
    assert f"reference (judge-1 at {judge.url}, key ${KEY_VAR})" in str(caught.value)


def test_the_judges_of_a_batch_are_called_at_once_up_to_grade_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(KEY_VAR, "k")
    with LoopbackJudge(delay_s=0.3) as judge:
        spec = _spec(judge.url, judges="learner", grade_threads=4)
        envs = [_play(spec, s)[0] for s in range(8)]
        t0 = time.monotonic()
        assert spec.judged(envs) == [2.0] * 8
        took = time.monotonic() - t0
    assert judge.most_in_flight == 4 and len(judge.calls) == 8
    assert took < 1.8, took  # two waves of 0.3 s, against 2.4 s one by one


def test_the_replay_checks_the_workers_claim_then_adds_the_judges_and_so_does_the_evaluation(
    monkeypatch: pytest.MonkeyPatch, tiny_policy_module: Any, published_engine: Any
) -> None:
    """Episodes of the tiny model, played as a worker plays them (no judge called), replayed by the
    learner with a judge that approves every reply: each finished episode trains on its own reward + 1;
    a claimed reward the task does not give is still refused; the evaluation's returns carry the + 1."""
    monkeypatch.setenv(KEY_VAR, "k")
    policy = tiny_policy_module
    _, engine = published_engine(policy, SAMPLING)
    with LoopbackJudge(mode="approve") as judge:
        task = EnvironmentTask(_spec(judge.url, judges="learner", max_turns=3))
        prompts = task.sample_train(random.Random(1), 2)
        batch = collect_episodes(
            policy.codec, engine, task, prompts, G, seed=5, policy_version=1, group_prefix="L",
            max_context=128, max_new_tokens=SAMPLING.max_new_tokens,
        )  # fmt: skip
        assert judge.calls == []  # the worker's part
        groups = tuple(tuple(batch.trajectories[i * G : (i + 1) * G]) for i in range(len(prompts)))
        lease, sub = Lease("L", "w", "open", 0.0, prompts, 5, 1), Submission("L", 1, groups)
        episodic = Episodic(task)
        episodic.batch_metrics([])  # what this process judged before (other tests)
        replay = EpisodeReplay(policy.codec, task, policy.eos_id, SAMPLING.max_new_tokens, 128)
        assert len(judge.calls) == 1  # the probe, at the verifier's construction
        taken = replay.check(lease, sub)
        claimed = [t for g in sub.groups for t in g]
        finished = [not t.meta.get("cut") and "env_error" not in t.meta for t in claimed]
        assert any(finished)
        assert [t.reward for g in taken.groups for t in g] == [
            t.reward + 1.0 if done else t.reward for t, done in zip(claimed, finished, strict=True)
        ]
        assert len(judge.calls) == 1 + sum(finished)
        metrics = episodic.batch_metrics([])  # the judged episodes since the call before the replay
        assert metrics["reward/outcomes/judged"] == sum(finished)
        assert metrics.get("reward/outcomes/judge_error", 0.0) == 0.0
        t = sub.groups[0][0]
        forged = [list(g) for g in sub.groups]
        forged[0][0] = dataclasses.replace(t, reward=t.reward + 1.0)  # the judge's part, claimed
        with pytest.raises(Rejected, match="reward_mismatch"):
            replay.check(lease, dataclasses.replace(sub, groups=tuple(tuple(g) for g in forged)))
        returns, _, _ = evaluate_episodes(
            policy.codec, engine, task, prompts, max_context=128, max_new_tokens=SAMPLING.max_new_tokens
        )
        assert all(r >= 1.0 for r in returns), returns  # every greedy episode ends within max_turns
        assert len(judge.calls) == 1 + sum(finished) + len(prompts)
