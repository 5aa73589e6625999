"""A verifiers (v1) multi-turn environment as an echo2 text environment (``envs/base.TextEnv``).

verifiers writes a multi-turn environment as ``Env.run(task, agents)``: a coroutine that opens the
player's interaction (``agents.player.interaction(task)``), takes its replies (``await
interaction.turn(message)`` returns a ``Segment`` whose ``last_reply`` is the model's text) and answers
host-side (a game engine, a local Python tool), until it returns; the task's ``@reward`` functions then
score the trace. echo2 runs that same coroutine with the policy as the player, one turn at a time:
:meth:`VerifiersTextEnv.reset` starts ``run()`` on an event loop of the episode's own and returns what it
shows the player first; :meth:`VerifiersTextEnv.step` hands ``run()`` the policy's reply and returns its
next message, or, once ``run()`` returned, the trace's reward (``trace.reward``: what the environment
recorded plus every ``@reward`` of the task, scored here). So the episode is the adapter's like any other
(``rollout/episodes.py``): the worker plays it with its engine under the lease's seed, and the learner
replays it from the task and the submitted replies, re-scoring it with the task's own rewards on the
trace it rebuilt (``tasks/verify.EpisodeReplay``), and re-running the replies in the generation check.

**What is played.** The player is the environment's one agent (an env whose config declares more, such as
a user simulator or a judge, needs a model echo2 does not run and is refused at load). Its reply is the
policy's whole text for the turn (the ``null`` harness's chat loop); an agent pinned to another harness
(bash, a coding agent: code run in a runtime) is refused. A turn's message is text (a string, or messages
whose parts are text). After ``max_turns`` replies the next ``turn()`` comes back ``terminated``, as a
verifiers turn limit does, so ``run()`` ends and the episode is scored.

**Judges.** Wherever an episode is played its reward leaves out the task's plugged judges (a worker never
calls one); with ``task.judges = "learner"`` the learner adds them to every finished episode it scores
(:meth:`VerifiersTextEnv.judge`, called by ``VerifiersEnvSpec.judged`` for a submission or an
evaluation at once), after its replay checked the worker's claim.

**What is refused at load**, naming why: what ``envs/verifiers_load.unscorable`` refuses of a task
(runtimes, judges unless ``task.judges = "learner"``, tool servers, containers), an env overriding
``finalize`` (cross-agent judgement), ``start``/``stop`` (shared servers), an env of several agents.

Every episode's run has an event loop of its own, run only inside ``reset``/``step`` (which the adapter
calls on its environment thread, with its step timeout; called from a thread that runs an event loop,
such as the learner's warm start, on a thread of its own); a cut episode's loop is closed by ``close``
(the adapter calls it), an abandoned one's when the next episode starts or the environment is collected.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import math
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from echo2.envs.base import EnvError, EnvStep
from echo2.envs.verifiers_load import (
    SCORE_TIMEOUT_S,
    append,
    config_type,
    judges_hint,
    load_object,
    new_trace,
    score,
    unscorable,
    vf,
    without_judges,
)
from echo2.errors import ConfigError, DataError

ENV_HOOKS = ("finalize", "start", "stop")  # Env methods echo2 does not run (cross-agent judgement, servers)
Teacher = Callable[[Sequence[str], Sequence[str]], str]  # (messages so far, replies so far) -> next reply


@dataclass(frozen=True)
class Loaded:
    """A verifiers environment read for echo2: the env, the tasks its episodes are (episode seed =
    index), the agent the policy plays."""

    env: Any
    tasks: tuple[Any, ...]
    agent: str
    where: str  # task.env, for messages


_CACHE: dict[str, Loaded] = {}
_CACHE_LOCK = threading.Lock()


def load(
    env: str,
    env_args: dict[str, Any],
    taskset_args: dict[str, Any],
    agent: str | None,
    limit: int,
    judges: bool = False,
) -> Loaded:
    """The environment ``env`` names, its first ``limit`` tasks checked (cached per settings); tasks with
    plugged judges only when ``judges`` (the run has the learner call them)."""
    key = json.dumps([env, env_args, taskset_args, agent, limit, judges], sort_keys=True, default=str)
    with _CACHE_LOCK:
        got = _CACHE.get(key)
        if got is None:
            got = _CACHE[key] = _load(env, env_args, taskset_args, agent, limit, judges)
    return got


def _build(env: str, env_args: dict[str, Any], taskset_args: dict[str, Any]) -> Any:
    v = vf()
    try:
        if ":" not in env:  # an installed env package: built as verifiers builds it
            from verifiers.v1.utils.loaders import environment_class

            cls = environment_class(env)
            cfg = config_type(cls, v.EnvConfig, origin=v.Env)(taskset={"id": env, **taskset_args}, **env_args)
            return cls(cfg)
        obj = load_object(env)
        if inspect.isclass(obj):
            raise ConfigError(
                f"task.env = {env!r} is a class: name an env package's id, an Env instance or a function "
                "returning one"
            )
        if callable(obj) and not isinstance(obj, v.Env):
            return obj(**env_args)
        if env_args or taskset_args:
            raise ConfigError(
                f"task.env = {env!r} is already built: task.env_args / taskset_args cannot apply"
            )
        return obj
    except ConfigError:
        raise
    except Exception as exc:  # the user's env: whatever building it raises is its error, named
        raise ConfigError(f"task.env = {env!r}: building it failed ({type(exc).__name__}: {exc})") from None


def _load(
    env: str,
    env_args: dict[str, Any],
    taskset_args: dict[str, Any],
    agent: str | None,
    limit: int,
    judges: bool,
) -> Loaded:
    v = vf()
    built = _build(env, env_args, taskset_args)
    if not isinstance(built, v.Env):
        raise ConfigError(f"task.env = {env!r} gives a {type(built).__name__}, not a verifiers Env")
    from verifiers.v1.configs.agent import agent_config_fields

    agents = agent_config_fields(built.config)
    if len(agents) != 1 or (agent is not None and agent not in agents):
        raise ConfigError(
            f"task.env = {env!r} declares the agents {sorted(agents)}: echo2 plays one agent with the "
            f"policy (task.agent = {agent!r}); the others (a user simulator, a judge) would need a model the "
            "learner does not run to replay an episode"
        )
    name = next(iter(agents))
    harness = agents[name].harness
    if harness is not None and harness.id != "null":
        raise ConfigError(
            f"task.env = {env!r}: agent {name!r} is pinned to the harness {harness.id!r}; echo2 plays the "
            "agent as a chat (the null harness): a harness running code or tools in a runtime is unsupported"
        )
    for hook in ENV_HOOKS:
        if getattr(type(built), hook) is not getattr(v.Env, hook):
            raise ConfigError(
                f"task.env = {env!r} overrides Env.{hook}(): cross-agent judgement and env-owned servers "
                "are not run by echo2 (the learner must replay an episode from its task and replies alone)"
            )
    tasks = []
    for task in built.taskset.take(limit):
        why = unscorable(task, built.taskset, judges)
        if why:
            raise ConfigError(
                f"task.env = {env!r}: task {task.key[:12]} ({type(task).__name__}) cannot be scored on the "
                f"learner: {'; '.join(why)}{judges_hint(why)}"
            )
        tasks.append(task)
    if not tasks:
        raise DataError(f"task.env = {env!r}: its taskset has no tasks")
    return Loaded(built, tuple(tasks), name, env)


@functools.cache
def load_teacher(spec: str) -> Teacher:
    """The function ``task.teacher`` names (imported once: the warm start asks it for every action)."""
    fn = load_object(spec, "task.teacher")
    if not callable(fn):
        raise ConfigError(f"task.teacher = {spec!r} is a {type(fn).__name__}, not a function")
    return fn  # type: ignore[no-any-return]


def _drive(loop: asyncio.AbstractEventLoop, aw: Any) -> None:
    """Run ``loop`` until ``aw`` is done: in this thread, or, when this thread already runs an event loop
    (the learner's warm start and evaluation may be called from its loop), in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        loop.run_until_complete(aw)
        return
    with ThreadPoolExecutor(1, thread_name_prefix="echo2-vf-episode") as pool:
        pool.submit(loop.run_until_complete, aw).result()


def _text(message: Any) -> str:
    """A turn's message as text (a string, or messages whose parts are all text)."""
    if isinstance(message, str):
        return message
    parts = []
    for m in message if isinstance(message, list) else [message]:
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
        if isinstance(content, str):
            parts.append(content)
            continue
        for p in content or []:
            p = p if isinstance(p, dict) else p.model_dump()
            if p.get("type") != "text":
                raise EnvError(f"the environment sent a {p.get('type')!r} part: text-only models here")
            parts.append(str(p["text"]))
    return "\n\n".join(parts)


class VerifiersTextEnv:
    """Implements :class:`echo2.envs.base.TextEnv` over a verifiers ``Env`` (module docstring)."""

    def __init__(self, loaded: Loaded, max_turns: int, score_timeout_s: float = SCORE_TIMEOUT_S) -> None:
        self.loaded = loaded
        self.max_turns = max_turns
        self.score_timeout_s = score_timeout_s  # the episode's scoring at most (then an environment error)
        self.observations: list[str] = []  # what the environment showed the player, in order
        self.actions: list[str] = []  # the player's replies, in order
        self.done = True
        self._loop: asyncio.AbstractEventLoop | None = None
        self._run: asyncio.Task[float] | None = None
        self._asked: asyncio.Future[str] | None = None  # the environment waits for a turn: its message
        self._reply: asyncio.Future[str] | None = None  # what the player answers it
        self._trace: Any = None  # the player's trace, as the environment reads it
        self._played: Any = None  # the task the player's interaction was opened with (what is scored)
        self._opened = False
        self._scored = False  # run() returned and the trace was scored (without the task's judges)

    # ---- TextEnv ------------------------------------------------------------------------------------
    def reset(self, seed: int) -> str:
        self.close()
        tasks = self.loaded.tasks
        if not 0 <= seed < len(tasks):
            raise EnvError(
                f"episode seed {seed} is not a task of {self.loaded.where!r} (0..{len(tasks) - 1})"
            )
        self.observations, self.actions, self.done = [], [], False
        self._trace, self._opened, self._scored = None, False, False
        self._loop = asyncio.new_event_loop()
        self._asked = self._loop.create_future()
        self._run = self._loop.create_task(self._episode(tasks[seed]))
        got = self._advance()
        if got is None:
            raise EnvError("run() returned without asking the player anything")
        return got

    def step(self, action: str) -> EnvStep:
        if self.done or self._reply is None:
            raise RuntimeError("step() after the episode ended; call reset()")
        assert self._loop is not None
        self.actions.append(action)
        self._asked = self._loop.create_future()  # what the environment asks next
        self._reply.set_result(action)
        got = self._advance()
        if got is None:
            assert self._run is not None
            reward = self._run.result()
            self.close()
            return EnvStep("", reward, True)
        return EnvStep(got, 0.0, False)

    def close(self) -> None:
        """Stop an unfinished episode's run and close its loop (idempotent)."""
        loop, run = self._loop, self._run
        self._loop = self._run = self._asked = self._reply = None
        self.done = True
        if loop is None or loop.is_closed():
            return
        try:
            if run is not None and not run.done():
                run.cancel()
                _drive(loop, asyncio.gather(run, return_exceptions=True))
            loop.close()
        except RuntimeError:  # collected while another loop runs in this thread: leave it to the collector
            pass

    def __del__(self) -> None:
        self.close()

    # ---- the episode's coroutine ----------------------------------------------------------------------
    def _advance(self) -> str | None:
        """Run the episode until the environment asks for a turn (its message) or ``run()`` ends (None)."""
        assert self._loop is not None and self._run is not None and self._asked is not None
        asked = self._asked
        waits: set[asyncio.Future[Any]] = {self._run, asked}
        _drive(self._loop, asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED))
        if asked.done():
            message = asked.result()
            self.observations.append(message)
            return message
        exc = self._run.exception()
        if exc is not None:
            self.close()
            said = str(exc) if isinstance(exc, EnvError) else f"{type(exc).__name__}: {exc}"
            raise EnvError(said[:500]) from None
        self.done = True
        return None

    async def _episode(self, task: Any) -> float:
        env = self.loaded.env
        agents = vf().Agents(env.config, lambda name, spec: _Player(self, name))
        await env.setup(agents)
        await env.run(task, agents)
        if self._trace is None:
            raise EnvError("run() opened no interaction with the player")
        played = without_judges(self._played)  # the judges are the learner's: judge()
        reward = await score(played, self._trace, self.score_timeout_s)
        if not math.isfinite(reward):
            raise EnvError(f"the task's reward is not finite ({reward})")
        self._scored = True
        return reward

    def judge(self, timeout_s: float) -> Coroutine[Any, Any, float] | None:
        """The finished episode's whole reward, its task's judges called too (on the caller's event loop;
        the learner's alone: its rewards again and every plugged judge, on the trace played), or None when
        the episode did not finish or its task has no judges (its reward is the one ``step`` gave)."""
        if not self._scored or not self._played.config.judges:
            return None
        return score(self._played, self._trace, timeout_s)

    async def _turn(self, message: str | None) -> Any:
        """One turn of the player: show ``message`` (or the task's prompt), wait for the reply."""
        v = vf()
        if len(self.actions) >= self.max_turns:
            return v.Segment(messages=[], terminated=True)
        assert self._loop is not None
        if message is None:
            data = self._played.data
            shown = "\n\n".join(t for t in (data.system_prompt, data.prompt_text) if t)
        else:
            shown = message
            append(self._trace, v.UserMessage(content=message), False)
        self._reply = self._loop.create_future()
        assert self._asked is not None
        self._asked.set_result(shown)
        reply = await self._reply
        said = v.AssistantMessage(content=reply)
        append(self._trace, said, True)
        return v.Segment(messages=[said])

    @asynccontextmanager
    async def _interaction(self, task: Any) -> AsyncIterator[_Interaction]:
        if self._opened:
            raise EnvError("run() opened a second interaction: echo2 plays one per episode")
        self._opened, self._played = True, task
        v = vf()
        prompt = task.data.prompt
        first = [] if prompt is None else [(v.UserMessage(content=task.data.prompt_text), False)]
        system = (
            [(v.SystemMessage(content=task.data.system_prompt), False)] if task.data.system_prompt else []
        )
        self._trace = new_trace(task, [*system, *first])
        yield _Interaction(self, prompt is not None)


class _Interaction:
    """The part of ``vf.Interaction`` an environment's ``run()`` uses: ``turn`` and ``trace``."""

    def __init__(self, env: VerifiersTextEnv, prompted: bool) -> None:
        self._env = env
        self._prompted = prompted
        self._started = False

    @property
    def trace(self) -> Any:
        return self._env._trace

    async def turn(self, message: Any = None) -> Any:
        opening = self._prompted and not self._started
        if (message is None) != opening:
            raise EnvError(
                "a prompted task's first turn() takes no message, and every later turn() one "
                "(verifiers' Interaction.turn)"
            )
        self._started = True
        return await self._env._turn(None if message is None else _text(message))


class _Player:
    """The policy as the environment's agent: ``interaction(task)`` is all it offers."""

    def __init__(self, env: VerifiersTextEnv, name: str) -> None:
        self._env = env
        self.name = name
        self.trainable = True

    def interaction(self, task: Any, **_: Any) -> Any:
        return self._env._interaction(task)
