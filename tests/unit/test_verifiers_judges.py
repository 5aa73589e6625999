"""A verifiers taskset's plugged judges (an LLM judge at an OpenAI-compatible endpoint) called by the
learner when the run says so (``task.judges = "learner"``), against a judge served on loopback here:
refused by default naming the switch, the verdict is the reward, the key comes from the learner's
environment, and a judge that hangs, answers nonsense or is down scores 0, counted, within the bound."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest

pytest.importorskip("verifiers.v1", reason="needs the verifiers extra (pip install 'echo2[verifiers]')")

from echo2.config import VerifiersTaskConfig
from echo2.data.tasks.verifiers_env import VerifiersTask
from echo2.errors import ConfigError
from echo2.types import Prompt
from echo2_bench.judge import LoopbackJudge

KEY_VAR = "ECHO2_TEST_JUDGE_KEY"  # the conftest judge fixture sets it


def _task(url: str, **fields: Any) -> VerifiersTask:
    """The bundled judged sums (no reward of their own: a reference judge at ``url``)."""
    env = "echo2.data.tasks.verifiers_example:load_judged_taskset"
    args = {"judge_url": url, "judge_model": "judge-1", "judge_key_var": KEY_VAR, "n": 50}
    return VerifiersTask(VerifiersTaskConfig(env=env, env_args=args, **fields))


def _prompt(task: VerifiersTask) -> tuple[Prompt, int]:
    """A task's prompt ("a+b=") and its sum."""
    p = task.splits()["train"][0]
    a, b = (int(x) for x in p.text.strip().rstrip("=").split("+"))
    return p, a + b


def test_a_plugged_judge_is_refused_by_default_naming_the_switch(judge: LoopbackJudge) -> None:
    with pytest.raises(ConfigError, match="cannot be scored on the learner") as caught:
        _task(judge.url).splits()
    said = str(caught.value)
    assert "judge 'reference' calls a judge model (judge-1 at " in said
    assert 'task.judges = "learner"' in said
    assert judge.calls == []  # nothing called at load


def test_the_learner_calls_the_judge_with_its_own_key_and_the_verdict_is_the_reward(
    judge: LoopbackJudge, caplog: pytest.LogCaptureFixture
) -> None:
    task = _task(judge.url, judges="learner")
    with caplog.at_level("INFO", "echo2.envs.verifiers_load"):
        p, right = _prompt(task)
    said = [r.getMessage() for r in caplog.records]
    assert sum("the learner calls judge 'reference' (judge-1 at http://127.0.0.1:" in m for m in said) == 1
    assert not any("not set here" in m for m in said)  # its key is in the environment
    assert task.grade(p, str(right)).reward == 1.0
    assert task.grade(p, str(right + 1)).reward == 0.0
    assert task.grade(p, "").reward == 0.0  # an empty reply: the judge is not asked
    assert task.outcome_counts() == {"scored": 3}
    assert len(judge.calls) == 3  # the probe at load, then two
    assert {c["auth"] for c in judge.calls} == {"Bearer sk-the-learners-own"}
    assert all(c["body"]["model"] == "judge-1" for c in judge.calls)
    # the lease carries the question only: the reference answer is the learner's
    assert p.answer == p.prompt_id and p.text.endswith("=\n") and p.meta == {}


@pytest.mark.parametrize("mode", ["hang", "nonsense", "down"])
def test_a_judge_that_fails_at_load_stops_the_run_there_naming_it(judge: LoopbackJudge, mode: str) -> None:
    url = judge.url
    if mode == "down":  # a port nothing listens on
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    judge.mode = mode
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"asking the judges of task \w+ at load") as caught:
        _task(url, judges="learner", score_timeout_s=1.0).splits()
    assert time.monotonic() - t0 < 5.0  # a hang is cut at score_timeout_s
    said = str(caught.value)
    assert f"reference (judge-1 at {url}, key ${KEY_VAR})" in said
    why = {"hang": "no answer within 1 s", "nonsense": "no yes/no verdict", "down": "Connection error"}
    assert why[mode] in said, said


@pytest.mark.parametrize("mode", ["hang", "nonsense", "down"])
def test_a_judge_that_hangs_answers_nonsense_or_is_down_later_scores_zero_counted_within_the_bound(
    judge: LoopbackJudge, mode: str
) -> None:
    task = _task(judge.url, judges="learner", score_timeout_s=1.0)
    p, right = _prompt(task)  # loaded while the judge answers (its probe passed)
    assert len(judge.calls) == 1 and task.outcome_counts() == {}  # the probe is not a scoring
    if mode == "down":
        judge.close()
    judge.mode = mode
    t0 = time.monotonic()
    grade = task.grade(p, str(right))  # the right answer: only the judge's failure can score it 0
    took = time.monotonic() - t0
    assert grade.reward == 0.0 and not grade.parsed
    assert task.outcome_counts() == {"error": 1}
    assert took < 5.0, took  # the hang is cut at score_timeout_s, not verifiers' unbounded read
    assert len(judge.calls) == (1 if mode == "down" else 2)


def test_a_judge_without_a_key_here_is_warned_of_at_load(
    judge: LoopbackJudge, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(KEY_VAR)
    _task(judge.url, judges="learner").splits()
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and f"reads its key from ${KEY_VAR}, which is not set here" in said[0]


def test_judge_calls_overlap_up_to_grade_threads_in_a_submission_and_an_evaluation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A judge answers in 0.3 s: 16 completions with task.grade_threads = 8 are two waves of 8 calls in
    flight (about 0.6 s, against 4.8 s one by one), graded as the verifier grades a submission
    (``grade_all``) and as the held-out evaluation does (``evaluate_text``, a stub engine's replies)."""
    from types import SimpleNamespace

    from echo2.data.tasks.base import grade_all
    from echo2.rollout.evaluate import evaluate_text

    class Engine:
        def generate(self, prompts: list[Any], seed: int, greedy: bool) -> list[Any]:
            return [SimpleNamespace(completion_ids=(7,)) for _ in prompts]

    codec = SimpleNamespace(encode=lambda p: [0], decode_completion=lambda ids: "0")
    monkeypatch.setenv(KEY_VAR, "k")
    for how in ("submission", "evaluation"):
        with LoopbackJudge(delay_s=0.3) as judge:
            task = _task(judge.url, judges="learner", grade_threads=8)
            prompts = task.splits()["train"][:16]
            t0 = time.monotonic()
            if how == "submission":
                assert len(grade_all(task, [(p, "0") for p in prompts])) == 16
            else:
                assert evaluate_text(codec, Engine(), task, prompts).n == 16  # type: ignore[arg-type]
            took = time.monotonic() - t0
        assert task.outcome_counts() == {"scored": 16} and len(judge.calls) == 1 + 16, how  # with the probe
        assert judge.most_in_flight == 8, (how, judge.most_in_flight)
        assert took < 2.4, (how, took)  # half the one-by-one time at the least
