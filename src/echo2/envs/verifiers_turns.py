"""A verifiers (v1) multi-turn environment as an echo2 task: ``--task verifiers_env``, its ``[task]``
config, its spec and its preset (``envs/base.py``'s one-place declaration, listed in
``envs/roster.ENVIRONMENTS``).

The environment runs through ``envs/verifiers_bridge.py`` (which imports verifiers, the ``verifiers``
extra, on first use): an episode is one of the env's tasks (the episode seed is the task's index among
the first ``limit``), played on the worker and replayed and re-scored on the learner
(``tasks/verify.EpisodeReplay``). The env's package and verifiers are pinned for the run (``echo2.pins``):
a worker with another version or other files refuses to run.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import Counter
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from echo2.envs.base import Environment, EnvironmentFields, EnvKnobs, EnvScore, TextEnv
from echo2.envs.verifiers_load import SCORE_TIMEOUT_S, Judges, ScoreTimeout
from echo2.errors import ConfigError
from echo2.logs import SampledLog

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from echo2.envs.verifiers_bridge import Loaded
    from echo2.types import Prompt

log = logging.getLogger(__name__)


class VerifiersEnvTaskConfig(EnvironmentFields):
    """A verifiers (v1) multi-turn environment (``envs/verifiers_bridge.py``): its ``Env.run`` played
    with the policy as its one agent, every episode replayed and re-scored by the task's own rewards on
    the learner (and its plugged judges, called by the learner, with ``judges = "learner"``). The default
    is the bundled ``echo2-vf-probe`` (higher or lower)."""

    name: Literal["verifiers_env"] = "verifiers_env"
    env: str = Field(
        "echo2-vf-probe",
        min_length=1,
        description="an installed verifiers env's id (its package's name) or 'package.module:name' / "
        "'path/to/file.py:name' naming a vf.Env or a function returning one",
    )
    env_args: dict[str, str | int | float | bool | None] = Field(
        default_factory=dict, description="the env config's fields (an id), or the function's arguments"
    )
    taskset_args: dict[str, str | int | float | bool | None] = Field(
        default_factory=dict, description="the taskset config's fields (an id; e.g. {n = 100})"
    )
    agent: str | None = Field(None, description="the env's agent the policy plays (default: its only one)")
    limit: int = Field(4096, ge=1, le=1_000_000, description="tasks read from the taskset: the episodes")
    teacher: str | None = Field(
        None,
        description="'module:function' (messages so far, replies so far) -> reply: the scripted expert the "
        "embedded model's warm start imitates (a model.path needs none)",
    )
    max_turns: int = Field(8, ge=1, le=64, description="replies per episode; the next turn() is terminated")
    judges: Judges = "refuse"
    score_timeout_s: ScoreTimeout = SCORE_TIMEOUT_S
    grade_threads: int = Field(
        4,
        ge=1,
        le=256,
        description="episodes whose judges the learner calls at once (a submission's, an evaluation's: on "
        "one event loop); tasks without judges are scored as they are played",
    )

    def runs_named_code(self) -> str | None:
        """What code of the learner's choosing a worker would run for this task, or None when it plays
        an installed env package (an id whose distribution is installed here: pinned, and installed by
        the worker's own operator). ``module:name`` and a file are the learner's choice of code."""
        if ":" in self.env:
            return f"task.env = {self.env!r} names a function, an object or a file to run"
        if not self._distributions():
            return f"task.env = {self.env!r} is the package of no installed distribution"
        return None

    def packages(self) -> tuple[str, ...]:
        """The distributions a worker plays these episodes with: verifiers and the env's own package
        (an env id's, or the one the named module belongs to; none for a file, and none for the envs
        bundled with echo2, whose agreement with the learner is echo2's own)."""
        return ("verifiers", *sorted(set(self._distributions()) - {"verifiers", "echo2"}))

    def _distributions(self) -> list[str]:
        """The installed distributions providing the env's top-level module (an id is its package's
        name, dashes for underscores; ``module:name``'s module; none for a file)."""
        where = self.env.rpartition(":")[0] if ":" in self.env else self.env.replace("-", "_").lower()
        if where.endswith(".py"):
            return []
        return list(metadata.packages_distributions().get(where.split(".")[0], []))


@dataclass(frozen=True)
class VerifiersEnvSpec(EnvKnobs):
    """What the task adapter asks of a verifiers environment (``data/tasks/environment.EnvSpec``)."""

    cfg: VerifiersEnvTaskConfig
    score: EnvScore = "return"  # held out: the mean reward of a greedy episode

    def loaded(self) -> Loaded:
        from echo2.envs.verifiers_bridge import load

        c = self.cfg
        return load(c.env, c.env_args, c.taskset_args, c.agent, c.limit, c.judges == "learner")

    @property
    def episodes(self) -> int:
        """One episode per task read."""
        return len(self.loaded().tasks)

    def make(self, prompt: Prompt, opponent_policy: Callable[[str], str] | None = None) -> TextEnv:
        from echo2.envs.verifiers_bridge import VerifiersTextEnv

        return VerifiersTextEnv(self.loaded(), self.cfg.max_turns, self.cfg.score_timeout_s)

    def ready_judges(self) -> None:
        """On the learner, before it scores an episode: each judge it will call named, and probed once (a
        reply of "probe" to the first task): one that fails stops the run here, naming it."""
        from echo2.envs.verifiers_load import new_trace, probe_judges, say_judges, vf

        c, tasks = self.cfg, self.loaded().tasks
        judged = [t for t in tasks if t.config.judges]
        if not judged:
            return
        say_judges(c.env, judged, "episode")
        task = judged[0]
        v = vf()
        first = [
            (v.UserMessage(content=task.data.prompt_text or ""), False),
            (v.AssistantMessage(content="probe"), True),
        ]
        probe_judges(c.env, task, new_trace(task, first), c.score_timeout_s)

    def judged(self, envs: Sequence[TextEnv]) -> list[float | None]:
        """Each finished episode's whole reward with its task's judges (the learner's calls, up to
        ``task.grade_threads`` at once, each bounded by ``task.score_timeout_s``); None where there is
        nothing to add. A scoring that fails gives 0, logged and counted (:meth:`outcome_counts`)."""
        from echo2.envs.verifiers_bridge import VerifiersTextEnv
        from echo2.envs.verifiers_load import run_async, scored_all

        calls = [e.judge(self.cfg.score_timeout_s) if isinstance(e, VerifiersTextEnv) else None for e in envs]
        if all(c is None for c in calls):
            return [None] * len(envs)

        judged = []
        for got in run_async(scored_all(calls, self.cfg.grade_threads)):
            if got is not None:
                _judge_counted(self.cfg.env, got[1])
            judged.append(None if got is None else got[0])
        return judged

    def outcome_counts(self) -> dict[str, int]:
        """Episodes judged by this process so far: ``judged``, and ``judge_error`` (scored 0)."""
        with _JUDGE_LOCK:
            return {o: n for (env, o), n in JUDGED.items() if env == self.cfg.env}

    def draw_meta(self, rng: random.Random) -> dict[str, Any]:
        return {}

    def fixed_meta(self, index: int) -> dict[str, Any]:
        return {}

    def teacher(self, env: TextEnv) -> str:
        from echo2.envs.verifiers_bridge import VerifiersTextEnv, load_teacher

        if self.cfg.teacher is None:
            raise ConfigError(
                "the embedded model's warm start imitates a scripted expert: set task.teacher = "
                "'module:function' ((messages so far, replies so far) -> reply), or train a model.path"
            )
        assert isinstance(env, VerifiersTextEnv)
        return str(load_teacher(self.cfg.teacher)(list(env.observations), list(env.actions)))


JUDGED = Counter[tuple[str, str]]()  # (task.env, "judged" | "judge_error") -> episodes, this process
_JUDGE_LOCK = threading.Lock()
_JUDGE_FAILED = SampledLog(log, every_s=60.0)  # a line a minute per kind of failure (called under the lock)


def _judge_counted(env: str, why: str) -> None:
    """One judged scoring of an episode of ``env``: ``why`` it failed (scored 0), or "" (it did not)."""
    with _JUDGE_LOCK:
        JUDGED[env, "judge_error" if why else "judged"] += 1
        if why:
            _JUDGE_FAILED.log(
                why[:80], "judging an episode of task.env = %r failed, scored 0 (%s); %d such so far",
                env, why[:300], JUDGED[env, "judge_error"],
            )  # fmt: skip


VERIFIERS_ENV = Environment(
    VerifiersEnvTaskConfig,
    VerifiersEnvSpec,
    preset=(
        "task.teacher=echo2_vf_probe:probe_teacher",  # the default env's binary search
        "task.max_turns=5",
        "sampling.max_new_tokens=3",  # up to two digits and EOS
        "model.warmstart.target_accuracy=0.5",
    ),
    packages=("verifiers",),
)
