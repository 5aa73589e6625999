"""A verifiers (v1) taskset as an echo2 task (``data/tasks/verifiers_env.py``): its prompts leased without
the task data, every completion scored on the learner by the task's own reward functions, and the tasks
the learner cannot score by itself refused at load. The tasksets here are written locally, as a user would
(nothing downloaded)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verifiers.v1", reason="needs the verifiers extra (pip install 'echo2[verifiers]')")

from echo2.config import VerifiersTaskConfig
from echo2.data.tasks.verifiers_env import VerifiersTask, load_taskset
from echo2.errors import ConfigError, DataError
from echo2.protocol import LeasedPrompt
from echo2.types import Prompt

HEADER = """
import verifiers.v1 as vf


class QA(vf.TaskData):
    answer: str
"""


def _env(tmp_path: Path, *bodies: str, load: str = "") -> str:
    """A module of ``bodies`` (each dedented); ``load``: the body of the last ``load()`` they open."""
    path = tmp_path / "envs.py"
    text = "\n".join(textwrap.dedent(body) for body in bodies)
    path.write_text(HEADER + text + textwrap.indent(textwrap.dedent(load), " " * 8))
    return str(path)


def _task(env: str, **fields: Any) -> VerifiersTask:
    return VerifiersTask(VerifiersTaskConfig(env=env, **fields))


def _all(task: VerifiersTask) -> list[Prompt]:
    s = task.splits()
    return [*s["train"], *s["validation"], *s["test"]]


# a single-turn task with two weighted rewards, one reading the gold answer, a system prompt and a metric
TWO_REWARDS = """
class Task(vf.Task[QA, vf.State, vf.TaskConfig]):
    @vf.reward(weight=0.75)
    async def exact(self, trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.reward(weight=0.25)
    async def short(self, task, trace) -> float:
        return float(len(trace.last_reply) <= len(task.answer))

    @vf.metric
    async def length(self, trace) -> float:
        return float(len(trace.last_reply))


class Set(vf.Taskset[Task, vf.TasksetConfig]):
    def load(self):
        for i in range(40):
            data = QA(prompt=f"say {i * 7}", answer=str(i * 7), system_prompt="Be terse.")
            yield Task(data, self.config.task)
"""


def test_prompts_are_leased_without_the_task_data_and_split_by_task(tmp_path: Path) -> None:
    task = _task(_env(tmp_path, TWO_REWARDS) + ":Set")
    s = task.splits()
    assert sum(len(v) for v in s.values()) == 40 and all(s.values())
    ids = [{p.prompt_id for p in v} for v in s.values()]
    assert not (ids[0] & ids[1]) and not (ids[0] & ids[2]) and not (ids[1] & ids[2])
    for p in _all(task):
        wire = LeasedPrompt.of(p).model_dump_json()
        gold = p.text.removeprefix("say ").strip()
        assert p.meta == {"system": "Be terse."} and p.text == f"say {gold}\n"
        assert p.answer == p.prompt_id  # the key only: the task data stays in the learner's process
        assert '"answer"' not in wire and "QA" not in wire


def test_a_completion_is_scored_by_the_tasks_own_weighted_rewards(tmp_path: Path) -> None:
    task = _task(_env(tmp_path, TWO_REWARDS) + ":Set")
    p = next(p for p in _all(task) if p.text == "say 21\n")
    assert task.grade(p, "21").reward == pytest.approx(1.0)  # 0.75 exact + 0.25 short
    assert task.grade(p, " 21 \n").reward == pytest.approx(1.0)  # last_reply is stripped
    assert task.grade(p, "22").reward == pytest.approx(0.25)
    assert task.grade(p, "the answer is 21").reward == 0.0
    assert task.outcome_counts() == {"scored": 4}


def test_the_bundled_sums_taskset_scores_its_gold_answer_and_imitates_it() -> None:
    task = VerifiersTask(VerifiersTaskConfig(env_args={"n": 300}))
    prompts = _all(task)
    assert len(prompts) == 300 and all(p.text.endswith("=\n") and p.meta == {} for p in prompts)
    p = prompts[0]
    a, b = (int(x) for x in p.text.strip().rstrip("=").split("+"))
    assert task.reference(p) == str(a + b)
    assert task.grade(p, str(a + b)).reward == 1.0 and task.grade(p, str(a + b + 1)).reward == 0.0


def test_scoring_works_from_inside_a_running_event_loop() -> None:
    """The learner's warm start and evaluation may grade from a thread that runs an event loop (asyncio.run
    there raises): the score is still the reward, not a counted error."""
    import asyncio

    task = VerifiersTask(VerifiersTaskConfig(env_args={"n": 50}))
    p = _all(task)[0]

    async def inside() -> float:
        return task.grade(p, task.reference(p)).reward

    assert asyncio.run(inside()) == 1.0 and task.outcome_counts() == {"scored": 1}


def test_a_reward_that_raises_or_is_not_finite_scores_zero_counted(tmp_path: Path, caplog: Any) -> None:
    env = _env(
        tmp_path,
        """
        class Task(vf.Task[QA, vf.State, vf.TaskConfig]):
            @vf.reward
            async def fragile(self, trace) -> float:
                if trace.last_reply == "boom":
                    raise RuntimeError("the user's bug")
                return float("nan") if trace.last_reply == "nan" else 1.0


        class Set(vf.Taskset[Task, vf.TasksetConfig]):
            def load(self):
                for i in range(20):
                    yield Task(QA(prompt=f"q{i}", answer="a"), self.config.task)
        """,
    )
    task = _task(env + ":Set", prompt_template="{prompt}")
    p = _all(task)[0]
    assert [task.grade(p, text).reward for text in ("ok", "boom", "nan")] == [1.0, 0.0, 0.0]
    assert not task.grade(p, "boom").parsed
    assert task.outcome_counts() == {"scored": 1, "error": 3}
    # logged once a minute per kind of failure, with the running count
    said = [r.getMessage() for r in caplog.records if "scoring a completion" in r.getMessage()]
    assert len(said) == 2 and "RuntimeError: the user's bug" in said[0] and "not finite" in said[1]


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (  # a reward that reads a runtime (a sandbox, a container's files)
            """
            class Task(vf.Task[QA, vf.State, vf.TaskConfig]):
                @vf.reward
                async def ran(self, trace, runtime) -> float:
                    return 1.0
            """,
            "reward 'ran' needs a runtime",
        ),
        (  # setup prepares state in a runtime
            """
            class Task(vf.Task[QA, vf.State, vf.TaskConfig]):
                async def setup(self, trace, runtime):
                    return None

                @vf.reward
                async def r(self, trace) -> float:
                    return 1.0
            """,
            "overrides setup()",
        ),
        (  # a container task
            """
            class Task(vf.Task[QA, vf.State, vf.TaskConfig]):
                NEEDS_CONTAINER = True

                @vf.reward
                async def r(self, trace) -> float:
                    return 1.0
            """,
            "needs a container",
        ),
        (  # nothing to score with
            """
            class Task(vf.Task[QA, vf.State, vf.TaskConfig]):
                pass
            """,
            "no @reward function",
        ),
    ],
)
def test_a_task_the_learner_cannot_score_alone_is_refused_naming_why(
    tmp_path: Path, body: str, error: str
) -> None:
    env = _env(
        tmp_path,
        body,
        """
        class Set(vf.Taskset[Task, vf.TasksetConfig]):
            def load(self):
                yield Task(QA(prompt="q", answer="a"), self.config.task)
        """,
    )
    with pytest.raises(ConfigError, match="cannot be scored on the learner") as caught:
        _task(env + ":Set").splits()
    assert error in str(caught.value)


# a task that always scores 1, in a taskset whose load() the test completes with its prompt
ALWAYS_ONE = """
class Task(vf.Task[QA, vf.State, vf.TaskConfig]):
    @vf.reward
    async def r(self, trace) -> float:
        return 1.0


class Set(vf.Taskset[Task, vf.TasksetConfig]):
    def load(self):
"""


def test_a_multi_turn_prompt_is_refused(tmp_path: Path) -> None:
    env = _env(
        tmp_path,
        ALWAYS_ONE,
        load="""
                turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                         {"role": "user", "content": "again"}]
                yield Task(QA(prompt=turns, answer="a"), self.config.task)
        """,
    )
    with pytest.raises(DataError, match="'assistant' message beyond one user turn"):
        _task(env + ":Set").splits()


def test_an_image_in_the_prompt_is_refused_not_dropped(tmp_path: Path) -> None:
    env = _env(
        tmp_path,
        ALWAYS_ONE,
        load="""
                parts = [{"type": "text", "text": "what is this?"},
                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]
                yield Task(QA(prompt=[{"role": "user", "content": parts}], answer="a"), self.config.task)
        """,
    )
    with pytest.raises(DataError, match=r"non-text parts \(\['image_url'\]\)"):
        _task(env + ":Set").splits()


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("echo2_no_such_taskset", "is no installed verifiers taskset .*not found"),
        (
            "json",
            "is no installed verifiers taskset .*exports no Taskset subclass",
        ),  # a package, not a taskset
        ("echo2_no_such_module:x", "importing echo2_no_such_module failed"),
        ("echo2.data.tasks.verifiers_example:nothing", "has no 'nothing'"),
        ("missing.py:Set", "no file missing.py"),
        ("echo2.data.tasks.verifiers_example:_INTEGER", "not a verifiers Taskset or Env"),
    ],
)
def test_a_bad_env_spec_is_one_line_naming_it(spec: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        load_taskset(spec, {})


def test_env_args_reach_the_function_and_bad_ones_are_named() -> None:
    ts = load_taskset("echo2.data.tasks.verifiers_example:load_taskset", {"n": 5})
    assert len(list(ts)) == 5
    with pytest.raises(ConfigError, match="building it failed"):
        load_taskset("echo2.data.tasks.verifiers_example:load_taskset", {"colour": "red"})
    with pytest.raises(ConfigError, match="building it failed"):  # a Taskset class: its config's fields
        load_taskset("echo2.data.tasks.verifiers_example:SumTaskset", {"n": "many"})


def test_an_installed_taskset_package_is_named_by_its_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A taskset package (what `prime env install` or pip gives: its Taskset subclass in `__all__`) is
    found by its id as verifiers finds it, `task.env_args` its config's fields."""
    pkg = tmp_path / "echo2_test_squares"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        textwrap.dedent(
            """
            import verifiers.v1 as vf

            __all__ = ["SquareTaskset"]


            class QA(vf.TaskData):
                answer: str


            class Task(vf.Task[QA, vf.State, vf.TaskConfig]):
                @vf.reward
                async def exact(self, trace) -> float:
                    return float(trace.last_reply == self.data.answer)


            class SquaresConfig(vf.TasksetConfig):
                n: int = 10


            class SquareTaskset(vf.Taskset[Task, SquaresConfig]):
                def load(self):
                    for i in range(self.config.n):
                        yield Task(QA(prompt=f"{i}^2=", answer=str(i * i)), self.config.task)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    task = _task("echo2-test-squares", env_args={"n": 30})  # dashes for underscores, as verifiers reads ids
    prompts = _all(task)
    assert len(prompts) == 30
    p = next(p for p in prompts if p.text == "7^2=\n")
    assert task.grade(p, "49").reward == 1.0 and task.grade(p, "48").reward == 0.0
    with pytest.raises(ConfigError, match="'echo2_test_squares': building it failed"):
        load_taskset("echo2_test_squares", {"n": "many"})


def test_a_workers_reward_is_never_believed_every_completion_is_scored_here(tmp_path: Path) -> None:
    """The verifier re-scores every completion with the task's rewards: a worker claiming 1.0 for a wrong
    answer gets 0, an honest one gets its reward whatever it claimed."""
    from echo2.data.store import Lease
    from echo2.data.submission import Submission
    from echo2.models.embedded import build_tokenizer
    from echo2.models.policy import TextCodec
    from echo2.tasks.verify import Verifier
    from echo2.types import Trajectory

    task = VerifiersTask(VerifiersTaskConfig(env_args={"n": 50}))
    p = _all(task)[0]
    gold = task.reference(p)
    codec = TextCodec(build_tokenizer(), False)
    verifier = Verifier(codec, task, eos_id=1, max_new_tokens=8)
    prompt_ids = tuple(codec.encode(p))
    texts, claimed = [gold, "0", "x", gold + "9"], [0.0, 1.0, 1.0, 1.0]
    ids = [(*codec.tokenizer(text, add_special_tokens=False)["input_ids"], 1) for text in texts]
    group = tuple(
        Trajectory(p.prompt_id, f"L:{i}", prompt_ids, c, (-0.5,) * len(c), reward, 0)
        for i, (c, reward) in enumerate(zip(ids, claimed, strict=True))
    )
    got = verifier.check(Lease("L", "w", "open", 0.0, [p], 0, 0), Submission("L", 0, (group,)))
    assert [t.reward for t in got.groups[0]] == [1.0, float(gold == "0"), 0.0, 0.0]
