"""A verifiers (v1) taskset as an echo2 task: its single-turn tasks are leased as prompts, and every
completion is scored **on the learner** by the task's own ``@reward`` functions (the ``verifiers`` extra;
``import verifiers.v1 as vf``).

**What is read.** ``task.env`` names the taskset: ``package.module:name`` or ``path/to/file.py:name``,
where ``name`` is a ``vf.Taskset`` subclass (built with its config class from ``task.env_args``), a
``vf.Taskset``, an ``Env`` (its taskset is taken), or a function returning one of those (called with
``task.env_args``). Up to ``task.limit`` tasks are read, on first use (a worker never reads them).

**What a lease carries.** A task's prompt (``TaskData.prompt``: a text, or messages of which one user
turn, with at most one system message) as ``Prompt.text`` through ``task.prompt_template``, and its
system prompt (``TaskData.system_prompt`` or the system message) in ``meta["system"]``. Nothing else of
the task data: the rest (a gold answer, tests, a rubric's inputs) stays in the learner's process, keyed by
the prompt id (the task's ``key``); ``Prompt.answer`` holds that key only.

**How a completion is scored.** The learner builds a ``vf.Trace`` of the task's data, the prompt's
messages and the completion as the one sampled assistant message, and runs ``Task.score`` on it without
a runtime; the reward is ``trace.reward`` (the weighted sum of the reward functions). A worker's claimed
reward is never read (the verifier replaces it, ``tasks/verify.py``), and workers need no verifiers at all.
A scoring that raises, one that has not returned after ``task.score_timeout_s`` (cancelled), or a
reward that is not finite, scores 0 and is counted (``reward/outcomes/error``); ``scored`` counts the rest.

**Judges.** A task's plugged judges (``TaskConfig.judges``: an LLM judge at an OpenAI-compatible endpoint,
e.g. verifiers' ``reference`` or ``rubric``) are network calls: with ``task.judges = "learner"`` the
learner makes them, for every completion it scores, with the endpoint, model and key variable the
taskset's config names (the key is read from the learner's environment; nothing of it goes to a worker).
verifiers' client waits on a judge without a read timeout: ``task.score_timeout_s`` bounds it. A judge
that fails (unreachable, no verdict) scores its completion 0, counted (watch ``reward/outcomes/error``):
a group scored all 0 by a judge outage has no advantage, so it trains nothing but its KL term
(``grpo.drop_zero_variance`` leaves it out), while a single failed call among good ones is a wrong 0 in
its group. Judge calls are slow next to a local reward: ``task.grade_threads`` is how many are in flight
at once for a submission or an evaluation (``grade_many``: one event loop).

**What is refused.** A task the learner cannot score by itself on the trace alone, at load time, with a
line naming what: a reward, metric or judge that needs a runtime, plugged judges unless ``task.judges =
"learner"``, tool servers (``toolsets``), a container (``NEEDS_CONTAINER``), and
``setup`` / ``finalize`` / ``stage_verifier`` hooks (they prepare state in a runtime). Multi-turn
environments, tools and a worker-side harness are not built: this adapter is single-turn.

The three splits are disjoint by task key (``file_splits``: a stable hash of the key).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo2.data.tasks.base import FileSplitsAccess, Grade, Split, file_splits, full_mask
from echo2.envs.verifiers_load import (
    judges_hint,
    load_taskset,
    new_trace,
    probe_judges,
    run_async,
    say_judges,
    score,
    scored_all,
    unscorable,
    vf,
)
from echo2.errors import ConfigError, DataError
from echo2.logs import SampledLog
from echo2.types import Prompt

if TYPE_CHECKING:
    from echo2.config import VerifiersTaskConfig

log = logging.getLogger(__name__)
__all__ = ["VerifiersTask", "load_taskset"]
OUTCOMES = ("scored", "error")


class VerifiersTask(FileSplitsAccess):
    name = "verifiers"

    def __init__(self, cfg: VerifiersTaskConfig, seed: int = 0) -> None:
        self.cfg = cfg
        self.grade_threads = cfg.grade_threads
        self._tasks: dict[str, Any] = {}  # prompt id (the task's key) -> the vf.Task: the grading secret
        self._messages: dict[str, list[Any]] = {}  # prompt id -> the prompt's messages, as the trace has them
        self._counts: Counter[str] = Counter()
        self._counts_lock = threading.Lock()
        self._failed = SampledLog(log, every_s=60.0)  # a line a minute per kind of failure (under the lock)
        super().__init__()

    # ---- data ---------------------------------------------------------------------------------------
    def _read_splits(self) -> dict[Split, list[Prompt]]:
        cfg = self.cfg
        taskset = load_taskset(cfg.env, cfg.env_args)
        tasks = []
        for task in taskset.take(cfg.limit):
            why = unscorable(task, taskset, judges=cfg.judges == "learner")
            if why:
                raise ConfigError(
                    f"task.env = {cfg.env!r}: task {task.key[:12]} ({type(task).__name__}) cannot be scored "
                    f"on the learner: {'; '.join(why)}{judges_hint(why)}. echo2 scores every reward itself; "
                    "this adapter takes single-turn tasks whose rewards read the task data and the trace"
                )
            tasks.append(task)
        if not tasks:
            raise DataError(f"task.env = {cfg.env!r}: the taskset has no tasks")
        say_judges(cfg.env, tasks)
        prompts = [self._prompt(task) for task in tasks]
        self._probe_judges(tasks[0])
        env = Path(cfg.env.rpartition(":")[0])
        return file_splits(
            prompts, None, lambda p: p.prompt_id, "verifiers",
            cfg.eval_fraction, cfg.validation_fraction, (env, None),
        )  # fmt: skip

    def _prompt(self, task: Any) -> Prompt:
        v = vf()
        data = task.data
        key = task.key
        if key in self._tasks:
            raise DataError(
                f"task.env = {self.cfg.env!r}: two tasks have the key {key[:12]} (keys are unique)"
            )
        system, user = data.system_prompt, None
        messages = [{"role": "user", "content": data.prompt}] if isinstance(data.prompt, str) else data.prompt
        for m in messages or []:
            role = m["role"] if isinstance(m, dict) else getattr(m, "role", None)
            content = m["content"] if isinstance(m, dict) else getattr(m, "content", None)
            if not isinstance(content, str):
                parts = [p if isinstance(p, dict) else p.model_dump() for p in content or []]
                if any(p.get("type") != "text" for p in parts):
                    raise DataError(
                        f"task.env = {self.cfg.env!r}: task {key[:12]}'s {role} message has non-text parts "
                        f"({sorted({str(p.get('type')) for p in parts} - {'text'})}): text-only models here"
                    )
            text = content if isinstance(content, str) else "\n".join(str(p["text"]) for p in parts)
            if role == "system" and system is None:
                system = text
            elif role == "user" and user is None:
                user = text
            else:
                raise DataError(
                    f"task.env = {self.cfg.env!r}: task {key[:12]}'s prompt has a {role!r} message beyond "
                    "one user turn (and one system message): this adapter leases single-turn prompts"
                )
        if user is None:
            raise DataError(f"task.env = {self.cfg.env!r}: task {key[:12]} has no user prompt")
        self._tasks[key] = task
        self._messages[key] = [
            *([v.SystemMessage(content=system)] if system is not None else []),
            v.UserMessage(content=user),
        ]
        return Prompt(
            prompt_id=key,
            text=self.cfg.prompt_template.format(prompt=user),
            answer=key,
            meta={} if system is None else {"system": system},
        )

    def _probe_judges(self, task: Any) -> None:
        """One scoring of ``task`` at load when it has judges, its reference answer (or a word) as the
        reply (``verifiers_load.probe_judges``)."""
        field = self.cfg.reference_field
        reply = str(getattr(task.data, field, None) or "probe") if field else "probe"
        probe_judges(
            self.cfg.env, task, _trace(task, self._messages[task.key], reply), self.cfg.score_timeout_s
        )

    def reference(self, prompt: Prompt) -> str:
        """The task data's ``reference_field`` as text (what the embedded model's warm start imitates)."""
        field = self.cfg.reference_field
        task = self._task(prompt)
        value = getattr(task.data, field, None) if field else None
        if value is None:
            raise ConfigError(
                f"the embedded model's warm start needs a reference answer: task.reference_field = {field!r} "
                f"is not a field of {type(task.data).__name__} (set it, or train a model.path)"
            )
        return str(value)

    def _task(self, prompt: Prompt) -> Any:
        self.splits()  # the tasks are read with the splits
        task = self._tasks.get(prompt.prompt_id)
        if task is None:
            raise DataError(f"prompt {prompt.prompt_id[:12]} is not a task of {self.cfg.env!r}")
        return task

    # ---- reward -------------------------------------------------------------------------------------
    def grade(self, prompt: Prompt, completion: str) -> Grade:
        """The task's reward of ``completion`` as its one sampled assistant turn, scored here (any thread:
        on an event loop of its own)."""
        return self.grade_many([(prompt, completion)])[0]

    def grade_many(self, todo: Sequence[tuple[Prompt, str]]) -> list[Grade]:
        """:meth:`grade` of every ``(prompt, completion)``, in order, on one event loop with up to
        ``task.grade_threads`` scorings in flight (a judged task waits on its judge: the calls overlap)."""
        tasks = [self._task(p) for p, _ in todo]
        return run_async(self._grades(tasks, todo))

    async def _grades(self, tasks: Sequence[Any], todo: Sequence[tuple[Prompt, str]]) -> list[Grade]:
        timeout_s = self.cfg.score_timeout_s
        calls = [
            self._score(t, self._messages[p.prompt_id], c, timeout_s)
            for t, (p, c) in zip(tasks, todo, strict=True)
        ]
        grades = []
        for (prompt, _), got in zip(todo, await scored_all(calls, self.grade_threads), strict=True):
            assert got is not None  # every call is one
            reward, why = got
            self._count(prompt, why)
            grades.append(Grade(reward, not why))
        return grades

    def _count(self, prompt: Prompt, why: str) -> None:
        with self._counts_lock:
            self._counts["error" if why else "scored"] += 1
            if why:
                self._failed.log(
                    why[:80], "scoring a completion of task %s failed, scored 0 (%s); %d such so far",
                    prompt.prompt_id[:12], why[:300], self._counts["error"],
                )  # fmt: skip

    @staticmethod
    async def _score(task: Any, messages: Sequence[Any], completion: str, timeout_s: float) -> float:
        return await score(task, _trace(task, messages, completion), timeout_s)

    def outcome_counts(self) -> dict[str, int]:
        with self._counts_lock:
            return dict(self._counts)

    def token_mask(self, completion_ids: Sequence[int], meta: dict[str, object]) -> list[float]:
        return full_mask(completion_ids, meta)


def _trace(task: Any, messages: Sequence[Any], reply: str) -> Any:
    """A verifiers trace of ``task``: the prompt's ``messages`` (not sampled), then ``reply`` as the one
    sampled assistant turn."""
    return new_trace(task, [(m, False) for m in messages] + [(vf().AssistantMessage(content=reply), True)])
