"""What echo2 reads of the verifiers package (v1, the ``verifiers`` extra; ``import verifiers.v1 as vf``),
shared by the single-turn taskset adapter (``data/tasks/verifiers_env.py``) and the multi-turn
environment bridge (``envs/verifiers_bridge.py``): importing a user's taskset or env by name, what of a
task the learner cannot score alone, and scoring a trace with the task's own reward functions.

verifiers is imported on first use, never at module import (the config tree imports ``envs/``).
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import importlib.util
import inspect
import logging
import math
import sys
from collections.abc import Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import Field

from echo2.errors import ConfigError

RUNTIME_HOOKS = ("setup", "finalize", "stage_verifier")  # Task methods that prepare state in a runtime
SCORE_TIMEOUT_S = 120.0  # one trace's scoring at most, unless the task's config says otherwise
CALLS_A_JUDGE = "calls a judge model"  # how unscorable() names a judge the run did not say to call
JUDGES_HINT = ' (set task.judges = "learner" to have the learner call its judges)'
T = TypeVar("T")
log = logging.getLogger(__name__)


# The ``[task]`` knobs of a verifiers task's plugged judges, single-turn and multi-turn alike
Judges = Annotated[
    Literal["refuse", "learner"],
    Field(
        description="a task's plugged judges (an LLM judge at an OpenAI-compatible endpoint, in the task "
        "config's judges): 'refuse' the taskset at load, or 'learner': the learner calls every judge for "
        "every completion or episode it scores (the endpoint and its key's variable are the taskset's; a "
        "worker never calls a judge, nor holds its key)",
    ),
]
ScoreTimeout = Annotated[
    float,
    Field(
        gt=0.0,
        le=3600.0,
        description="one completion's or episode's scoring (its rewards and judge calls) at most: past it "
        "the completion or episode scores 0, counted as an error",
    ),
]


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """``coro`` to completion on an event loop of its own: in this thread, or, when this thread already
    runs one (the learner's warm start and evaluation may be called from its loop), in a fresh thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1, thread_name_prefix="echo2-score") as pool:
        return pool.submit(asyncio.run, coro).result()


def vf() -> Any:
    """``verifiers.v1``, or a :class:`ConfigError` naming the extra to install."""
    try:
        return importlib.import_module("verifiers.v1")
    except ImportError as exc:
        raise ConfigError(
            f"a verifiers task needs the verifiers package (pip install 'echo2[verifiers]'): {exc}"
        ) from None


def load_object(spec: str, field: str = "task.env") -> Any:
    """The object ``spec`` names: ``package.module:name`` or ``path/to/file.py:name`` (``field`` names
    the setting in errors)."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ConfigError(f"{field} = {spec!r}: expected 'package.module:name' or 'path/to/file.py:name'")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise ConfigError(f"{field} = {spec!r}: no file {path}")
            mod_name = f"echo2_env_{abs(hash(path.resolve()))}"
            spec_ = importlib.util.spec_from_file_location(mod_name, path)
            if spec_ is None or spec_.loader is None:
                raise ConfigError(f"{field} = {spec!r}: {path} cannot be imported")
            module = importlib.util.module_from_spec(spec_)
            sys.modules[mod_name] = module  # pydantic models of the file resolve their own names
            spec_.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as exc:  # the user's module: whatever it raises is its own error, named
        raise ConfigError(
            f"{field} = {spec!r}: importing {where} failed ({type(exc).__name__}: {exc})"
        ) from None
    try:
        return getattr(module, name)
    except AttributeError:
        raise ConfigError(f"{field} = {spec!r}: {where} has no {name!r}") from None


def load_taskset(spec: str, args: dict[str, Any]) -> Any:
    """The ``vf.Taskset`` ``spec`` names (``data/tasks/verifiers_env.py``), built with ``args``: an
    installed taskset package's id (no ``:``; found and built as verifiers finds and builds it, ``args``
    its config's fields), or what :func:`load_object` reads."""
    v = vf()
    if ":" not in spec:
        from verifiers.v1.utils.loaders import taskset_class, taskset_config_type

        try:
            cls = taskset_class(spec)
        except Exception as exc:  # not installed, or not a taskset package: verifiers' own words
            raise ConfigError(
                f"task.env = {spec!r} is no installed verifiers taskset ({type(exc).__name__}: {exc}); "
                "name one by its id, or 'package.module:name' / 'path/to/file.py:name'"
            ) from None
        try:
            return cls(taskset_config_type(spec)(id=spec, **args))
        except Exception as exc:  # its config refused args, or building it failed
            raise ConfigError(
                f"task.env = {spec!r}: building it failed ({type(exc).__name__}: {exc})"
            ) from None
    obj: Any = load_object(spec)
    try:
        if inspect.isclass(obj) and issubclass(obj, v.Taskset):
            build: Any = obj  # a Taskset subclass: built with its own config class
            obj = build(config_type(obj, v.TasksetConfig)(**args))
        elif callable(obj) and not isinstance(obj, (v.Taskset, v.Env)):
            obj = obj(**args)
        elif args:
            raise ConfigError(f"task.env = {spec!r} is already built: task.env_args = {args} cannot apply")
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"task.env = {spec!r}: building it failed ({type(exc).__name__}: {exc})") from None
    if isinstance(obj, v.Env):
        obj = obj.taskset
    if not isinstance(obj, v.Taskset):
        raise ConfigError(f"task.env = {spec!r} gives a {type(obj).__name__}, not a verifiers Taskset or Env")
    return obj


def config_type(cls: type, base: type, origin: type | None = None) -> type:
    """The config class a verifiers ``Taskset`` or ``Env`` subclass declares (its generic argument),
    else ``base``."""
    from verifiers.v1.utils.generic import concrete_type

    return concrete_type(cls, base, origin=origin) or base


def unscorable(task: Any, taskset: Any, judges: bool = False) -> list[str]:
    """What of ``task`` the learner cannot score from a trace alone, one phrase each: a reward, metric or
    judge that needs a runtime, judges unless ``judges`` (a judge model is a network call the learner
    makes only when the run says so), tool servers, a container, hooks that prepare state in a runtime,
    or no reward at all."""
    v = vf()
    why = []

    def needs_runtime(fn: Any) -> bool:
        param = inspect.signature(fn).parameters.get("runtime")
        return param is not None and param.default is inspect.Parameter.empty

    for kind in ("reward", "metric"):
        why += [f"{kind} {fn.__name__!r} needs a runtime" for fn in task.hooks(kind) if needs_runtime(fn)]
    plugged = task.plugged_judges()
    for j in plugged:
        if needs_runtime(j.score):
            why.append(f"judge {j.reward_name!r} needs a runtime")
        elif not judges:
            model = f"{j.config.model} at {j.config.base_url}"
            why.append(f"judge {j.reward_name!r} {CALLS_A_JUDGE} ({model})")
    if getattr(type(task), "NEEDS_CONTAINER", False):
        why.append("it needs a container (NEEDS_CONTAINER)")
    if type(task).toolsets(task.config) or type(taskset).toolsets(taskset.config):
        why.append("it serves tools (toolsets)")
    for hook in RUNTIME_HOOKS:
        if getattr(type(task), hook) is not getattr(v.Task, hook):
            why.append(f"it overrides {hook}() (state prepared in a runtime)")
    if not task.hooks("reward") and not plugged:
        why.append("it has no @reward function")
    return why


def judges_hint(why: Sequence[str]) -> str:
    """The switch to name after :func:`unscorable`'s reasons when one of them is a judge not called."""
    return JUDGES_HINT if any(CALLS_A_JUDGE in w for w in why) else ""


def judge_names(task: Any) -> str:
    """``task``'s plugged judges, each as "name (model at endpoint, key $variable)"."""
    return ", ".join(
        f"{c.name or c.id} ({c.model} at {c.base_url}, key ${c.api_key_var})" for c in task.config.judges
    )


def say_judges(env: str, tasks: Sequence[Any], scored: str = "completion") -> None:
    """One line per distinct judge the learner will call (its model and endpoint), and a warning for one
    with no key here (verifiers then sends "EMPTY": a local endpoint may need none, a hosted one refuses
    every call, which would score every ``scored`` 0)."""
    seen = set()
    from verifiers.v1.configs.client import resolve_api_key

    for task in tasks:
        for c in task.config.judges:
            key = (c.name or c.id, c.model, c.base_url, c.api_key_var)
            if key in seen:
                continue
            seen.add(key)
            log.info("task.env = %r: the learner calls judge %r (%s at %s) for every %s it scores",
                     env, key[0], c.model, c.base_url, scored)  # fmt: skip
            if resolve_api_key(c) == "EMPTY":  # verifiers' own reading: the variable, or Prime's CLI config
                log.warning(
                    "judge %r of task.env = %r reads its key from $%s, which is not set here: its requests "
                    "go without a key (a hosted endpoint refuses them: every %s would score 0)",
                    key[0], env, c.api_key_var, scored,
                )  # fmt: skip


def probe_judges(env: str, task: Any, trace: Any, timeout_s: float) -> None:
    """``task``'s judges asked once about ``trace`` (a reply to it) at load, its rewards left out (a
    multi-turn reward may read what only a played episode records): a judge that cannot be reached,
    refuses the key, hangs past ``timeout_s`` or answers no verdict stops the run here, naming it, rather
    than scoring everything 0."""
    if not task.config.judges:
        return
    from verifiers.v1.utils.decorators import invoke_all

    async def ask() -> None:
        async with asyncio.timeout(timeout_s):
            await invoke_all([j.score for j in task.plugged_judges()], {"task": task.data, "trace": trace})

    try:
        run_async(ask())
    except TimeoutError:
        raise ConfigError(
            f"task.env = {env!r}: asking the judges of task {task.key[:12]} at load: no answer within "
            f"{timeout_s:g} s; check the judges: {judge_names(task)}"
        ) from None
    except Exception as exc:
        raise ConfigError(
            f"task.env = {env!r}: asking the judges of task {task.key[:12]} at load failed "
            f"({type(exc).__name__}: {str(exc)[:300]}); check the judges: {judge_names(task)}"
        ) from None


def without_judges(task: Any) -> Any:
    """``task`` with no plugged judges (a shallow copy; ``task`` itself when it has none): what a worker
    scores, and the learner's replay before it adds the judges."""
    if not task.config.judges:
        return task
    clone = copy.copy(task)
    clone.config = task.config.model_copy(update={"judges": []})
    return clone


def new_trace(task: Any, messages: Sequence[Any] = ()) -> Any:
    """A ``vf.Trace`` of ``task`` holding ``messages`` (``(message, sampled)`` pairs) as its one branch."""
    v = vf()
    trace = v.Trace(
        task=v.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=v.AgentInfo(config=v.AgentConfig()),
        nodes=[],
    )
    for message, sampled in messages:
        append(trace, message, sampled)
    return trace


def append(trace: Any, message: Any, sampled: bool) -> None:
    """``message`` as the next node of ``trace``'s one branch (``sampled``: the model wrote it)."""
    parent = len(trace.nodes) - 1 if trace.nodes else None
    trace.nodes.append(vf().MessageNode(message=message, parent=parent, sampled=sampled))


async def score(task: Any, trace: Any, timeout_s: float = SCORE_TIMEOUT_S) -> float:
    """The task's reward of the finished ``trace`` (every ``@reward`` without a runtime and every plugged
    judge, scored here, on top of what the environment recorded on it): ``trace.reward``; NaN when a
    reward function did not run. A scoring that has not returned after ``timeout_s`` (a judge endpoint
    that hangs: verifiers' own client waits without a read timeout) is cancelled and raises
    :class:`TimeoutError`; a reward's synchronous code is not interrupted (only its awaits are)."""
    trace.is_completed = trace.ok = True
    bound = asyncio.timeout(timeout_s)
    try:
        async with bound:
            await task.score(trace)
    except TimeoutError:
        if not bound.expired():
            raise  # the reward's own
        raise TimeoutError(f"scoring did not return within {timeout_s:g} s") from None
    if any(r is None for r in trace.rewards.values()):
        return math.nan
    return float(trace.reward)


async def scored_all(
    calls: Sequence[Coroutine[Any, Any, float] | None], at_once: int
) -> list[tuple[float, str] | None]:
    """Await each scoring in ``calls`` (:func:`score` and the like), at most ``at_once`` in flight: its
    reward and ``""``, or ``0.0`` and why it failed (an exception of the user's reward code or a judge, a
    timeout, a reward that is not finite); None where the call is None."""
    slots = asyncio.Semaphore(at_once)

    async def one(call: Coroutine[Any, Any, float] | None) -> tuple[float, str] | None:
        if call is None:
            return None
        async with slots:
            try:
                got = float(await call)
            except Exception as exc:  # the user's code or its judge: the scoring's 0, said why
                return 0.0, f"{type(exc).__name__}: {exc}"
        return (got, "") if math.isfinite(got) else (0.0, f"a reward that is not finite ({got})")

    return list(await asyncio.gather(*(one(c) for c in calls)))
