"""A verifiers taskset's plugged judges (an LLM judge at an OpenAI-compatible endpoint) called by the
learner when the run says so (``task.judges = "learner"``), against a judge served on loopback here:
refused by default naming the switch, the verdict is the reward, the key comes from the learner's
environment, and a judge that hangs, answers nonsense or is down scores 0, counted, within the bound."""

from __future__ import annotations

import json
import socket
import textwrap
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

pytest.importorskip("verifiers.v1", reason="needs the verifiers extra (pip install 'echo2[verifiers]')")

from echo2.config import VerifiersTaskConfig
from echo2.data.tasks.verifiers_env import VerifiersTask
from echo2.errors import ConfigError
from echo2.types import Prompt

KEY_VAR = "ECHO2_TEST_JUDGE_KEY"

# a taskset whose one reward is a plugged reference judge at ``url`` (no @reward of its own)
JUDGED = """
import verifiers.v1 as vf
from verifiers.v1.judges import ReferenceJudgeConfig


class QA(vf.TaskData):
    answer: str


class Task(vf.Task[QA, vf.State, vf.TaskConfig]):
    pass


class Set(vf.Taskset[Task, vf.TasksetConfig]):
    def load(self):
        judge = ReferenceJudgeConfig(base_url=self.url, api_key_var="{key_var}", model="judge-1")
        cfg = vf.TaskConfig(judges=[judge])
        for i in range(20):
            yield Task(QA(prompt=f"what is {{i}} + {{i}}?", answer=str(2 * i)), cfg)


def make(url: str) -> Set:
    s = Set(vf.TasksetConfig())
    s.url = url
    return s
"""


class Judge(BaseHTTPRequestHandler):
    """An OpenAI-style chat endpoint: "yes" when the response block equals the reference block; in
    ``mode`` "hang" it never answers in time, in "nonsense" it answers neither label."""

    mode: ClassVar[str] = "judge"
    calls: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Judge.calls.append({"auth": self.headers.get("Authorization"), "body": body})
        if Judge.mode == "hang":
            time.sleep(30)
            return
        text = body["messages"][-1]["content"]
        blocks = text.split("```")  # task, reference, response: the template's fenced blocks
        verdict = "yes" if blocks[3].strip() == blocks[5].strip() else "no"
        if Judge.mode == "nonsense":
            verdict = "perhaps"
        reply = {
            "id": "c1", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": verdict}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
        }  # fmt: skip
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def judge(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv(KEY_VAR, "sk-the-learners-own")
    Judge.mode, Judge.calls = "judge", []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def _task(tmp_path: Path, url: str, **fields: Any) -> VerifiersTask:
    path = tmp_path / "judged.py"
    path.write_text(textwrap.dedent(JUDGED.format(key_var=KEY_VAR)))
    return VerifiersTask(VerifiersTaskConfig(env=f"{path}:make", env_args={"url": url}, **fields))


def _prompt(task: VerifiersTask, i: int) -> Prompt:
    s = task.splits()
    return next(p for p in [*s["train"], *s["validation"], *s["test"]] if p.text == f"what is {i} + {i}?\n")


def test_a_plugged_judge_is_refused_by_default_naming_the_switch(tmp_path: Path, judge: str) -> None:
    with pytest.raises(ConfigError, match="cannot be scored on the learner") as caught:
        _task(tmp_path, judge).splits()
    said = str(caught.value)
    assert "judge 'reference' calls a judge model (judge-1 at " in said
    assert 'task.judges = "learner"' in said
    assert Judge.calls == []  # nothing called at load


def test_the_learner_calls_the_judge_with_its_own_key_and_the_verdict_is_the_reward(
    tmp_path: Path, judge: str, caplog: pytest.LogCaptureFixture
) -> None:
    task = _task(tmp_path, judge, judges="learner")
    with caplog.at_level("INFO", "echo2.data.tasks.verifiers_env"):
        p = _prompt(task, 7)
    said = [r.getMessage() for r in caplog.records]
    assert sum("the learner calls judge 'reference' (judge-1 at http://127.0.0.1:" in m for m in said) == 1
    assert not any("not set here" in m for m in said)  # its key is in the environment
    assert task.grade(p, "14").reward == 1.0
    assert task.grade(p, "15").reward == 0.0
    assert task.grade(p, "").reward == 0.0  # an empty reply: the judge is not asked
    assert task.outcome_counts() == {"scored": 3}
    assert len(Judge.calls) == 2
    assert {c["auth"] for c in Judge.calls} == {"Bearer sk-the-learners-own"}
    assert all(c["body"]["model"] == "judge-1" for c in Judge.calls)
    # the lease carries the question only: the reference answer is the learner's
    assert p.answer == p.prompt_id and "14" not in p.text and p.meta == {}


@pytest.mark.parametrize("mode", ["hang", "nonsense", "down"])
def test_a_judge_that_hangs_answers_nonsense_or_is_down_scores_zero_counted_within_the_bound(
    tmp_path: Path, judge: str, mode: str
) -> None:
    url = judge
    if mode == "down":  # a port nothing listens on
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    Judge.mode = mode
    task = _task(tmp_path, url, judges="learner", score_timeout_s=1.0)
    p = _prompt(task, 3)
    t0 = time.monotonic()
    grade = task.grade(p, "6")  # the right answer: only the judge's failure can score it 0
    took = time.monotonic() - t0
    assert grade.reward == 0.0 and not grade.parsed
    assert task.outcome_counts() == {"error": 1}
    assert took < 5.0, took  # the hang is cut at score_timeout_s, not verifiers' unbounded read
    assert len(Judge.calls) == (0 if mode == "down" else 1)


def test_a_judge_without_a_key_here_is_warned_of_at_load(
    tmp_path: Path, judge: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(KEY_VAR)
    task = _task(tmp_path, judge, judges="learner")
    task.splits()
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and f"reads its key from ${KEY_VAR}, which is not set here" in said[0]
