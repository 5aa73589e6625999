"""What echo2 reads of the verifiers package (v1, the ``verifiers`` extra; ``import verifiers.v1 as vf``),
shared by the single-turn taskset adapter (``data/tasks/verifiers_env.py``) and the multi-turn
environment bridge (``envs/verifiers_bridge.py``): importing a user's taskset or env by name, what of a
task the learner cannot score alone, and scoring a trace with the task's own reward functions.

verifiers is imported on first use, never at module import (the config tree imports ``envs/``).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from echo2.errors import ConfigError

RUNTIME_HOOKS = ("setup", "finalize", "stage_verifier")  # Task methods that prepare state in a runtime
SCORE_TIMEOUT_S = 120.0  # one trace's scoring at most, unless the task's config says otherwise
T = TypeVar("T")


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
            why.append(f"judge {j.reward_name!r} calls a judge model ({model})")
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
