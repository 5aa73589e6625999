"""Secrets stay with the learner (SPEC §10, ARCHITECTURE): no field of any wire type can carry what grades
a completion. Every request and reply model of ``echo2.protocol`` and every broadcast frame of
``echo2.weights.frames`` is walked recursively (through lists, tuples, unions, dicts, nested models,
dataclasses and the config models a reply carries): a field fails if it is marked a grading secret
(``types.SECRET``: ``Prompt.answer``), is named like one, or is open (``Any``, ``object``, an untyped
dict) without a reason below why nothing secret reaches it. A walker that found nothing would prove
nothing: the last tests inject each kind of leak and see it caught, and build the leases of every
registered task to find no answer in them."""

from __future__ import annotations

import dataclasses
import inspect
import json
import types
import typing
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

import pytest
from pydantic import BaseModel

from echo2 import protocol
from echo2.types import SECRET, Prompt
from echo2.weights import frames

SECRET_NAMES = frozenset(
    {"answer", "answers", "gold", "solution", "solutions", "reference", "expected", "tests", "test_cases",
     "rubric", "info", "grader"}
)  # fmt: skip
# open fields (they could carry anything), by the model that declares them, each with the reason no
# grading secret reaches it
OPEN_ALLOWED = {
    "SampleWire.meta": "worker -> learner: what a worker sends (no learner secret flows this way); the "
    "store keeps it as sent and sends it to no worker",
    "SubmitRequest.next_lease": "worker -> learner: a LeaseRequest, parsed as one",
    "LeasedPrompt.meta": "Prompt.meta, public by contract (data/tasks/base.py: a task keeps no grading "
    "secret there); test_every_tasks_leases_carry_no_answer builds them",
    "VersionReply.manifest": "a signed snapshot manifest (weights.manifest): versions, sizes, digests",
    "AnnounceFrame.manifest": "a signed snapshot manifest (weights.manifest)",
    "AnnounceFrame.credential": "a pull credential (broadcast.access): member ids, versions, expiry",
    "GetFrame.cred": "a pull credential (broadcast.access), sent back by the puller",
    "GetCredentials.cred": "the same credential, read alone by a server's gate",
}


def _models() -> list[type]:
    mods = (protocol, frames)
    return [
        c for m in mods for _, c in inspect.getmembers(m, inspect.isclass)
        if issubclass(c, BaseModel) and c.__module__ == m.__name__
    ]  # fmt: skip


def _fields(tp: type) -> list[tuple[str, Any, bool]]:
    """(name, annotation, marked secret) of a model's or a dataclass's fields."""
    if issubclass(tp, BaseModel):
        out = []
        for name, f in tp.model_fields.items():
            extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
            out.append((name, f.annotation, bool(extra.get(SECRET))))
        return out
    hints = get_type_hints(tp, include_extras=True)
    return [(f.name, hints[f.name], bool(f.metadata.get(SECRET))) for f in dataclasses.fields(tp)]


def leaks(tp: Any, path: str, seen: set[Any] | None = None, field: str = "") -> list[str]:
    """Every place under ``tp`` (reached as ``path``, in the field ``Model.name`` when one) that can
    carry a grading secret."""
    seen = set() if seen is None else seen
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any or tp is object:
        return (
            [] if field in OPEN_ALLOWED else [f"{path}: an open type (anything can travel in it) [{field}]"]
        )
    if origin is Annotated:
        return leaks(args[0], path, seen, field)
    if origin is Literal or tp in (str, int, float, bool, bytes, type(None)):
        return []
    if origin in (Union, types.UnionType):
        return [p for a in args for p in leaks(a, path, seen, field)]
    if origin in (list, tuple, set, frozenset, typing.Sequence):
        return [p for a in args if a is not Ellipsis for p in leaks(a, f"{path}[]", seen, field)]
    if origin is dict or tp is dict:
        if not args or args[1] is Any:
            return (
                []
                if field in OPEN_ALLOWED
                else [f"{path}: an open dict (anything can travel in it) [{field}]"]
            )
        return leaks(args[1], f"{path}[]", seen, field)
    if isinstance(tp, type) and (issubclass(tp, BaseModel) or dataclasses.is_dataclass(tp)):
        if tp in seen:
            return []
        seen.add(tp)
        out = []
        for name, ann, secret in _fields(tp):
            where = f"{path}.{name}"
            if secret or name.lower() in SECRET_NAMES:
                out.append(f"{where}: a grading secret ({tp.__name__}.{name})")
            out += leaks(ann, where, seen, f"{tp.__name__}.{name}")
        return out
    if isinstance(tp, type):  # an enum, a Path, a tensor dtype: values, not containers
        return []
    raise AssertionError(f"{path}: the walker does not know {tp!r}")


def test_no_wire_type_can_carry_a_grading_secret():
    models = _models()
    assert {"LeaseGrant", "LeasedPrompt", "SubmitRequest", "RegisterReply", "AnnounceFrame", "GetFrame"} <= {
        m.__name__ for m in models
    }
    found = [p for m in models for p in leaks(m, m.__name__)]
    assert found == []
    reached: set[Any] = set()
    for m in models:
        leaks(m, m.__name__, reached)
    # the walk went into what replies carry: the task's config a worker is sent, the sampling settings
    assert {"MathTaskConfig", "PokerTaskConfig", "SamplingConfig", "LeasedPrompt"} <= {
        c.__name__ for c in reached
    }


def test_the_allowed_open_fields_exist():
    """Every reason above names a field the walker reaches (a renamed field cannot keep an old pass)."""
    saved = dict(OPEN_ALLOWED)
    OPEN_ALLOWED.clear()
    try:
        reached = {p.rsplit("[", 1)[1].rstrip("]") for m in _models() for p in leaks(m, m.__name__)}
    finally:
        OPEN_ALLOWED.update(saved)
    assert set(OPEN_ALLOWED) == reached


class _Inner(BaseModel):
    note: str
    deep: dict[str, list[Prompt]]  # a learner-side prompt, answer and all, three levels down


class _LeakByType(BaseModel):
    prompts: list[Prompt]


class _LeakByName(BaseModel):
    gold: str


class _LeakOpen(BaseModel):
    extra: dict[str, Any]


class _LeakNested(BaseModel):
    items: list[_Inner] | None = None


@pytest.mark.parametrize(
    ("model", "expect"),
    [
        (_LeakByType, "_LeakByType.prompts[].answer: a grading secret (Prompt.answer)"),
        (_LeakByName, "_LeakByName.gold: a grading secret"),
        (_LeakOpen, "_LeakOpen.extra: an open dict"),
        (_LeakNested, "_LeakNested.items[].deep[][].answer: a grading secret (Prompt.answer)"),
    ],
)
def test_the_walker_catches_an_injected_secret(model, expect):
    found = leaks(model, model.__name__)
    assert any(p.startswith(expect) for p in found), found


def test_the_walker_catches_a_secret_put_back_on_the_lease(monkeypatch):
    """The lease as it was: ``LeaseGrant.prompts: list[Prompt]`` (the gold answer leased)."""

    class OldLeaseGrant(protocol.LeaseGrant):
        prompts: list[Prompt]  # type: ignore[assignment]

    assert any("prompts[].answer" in p for p in leaks(OldLeaseGrant, "LeaseGrant"))


@pytest.mark.parametrize("task", ["arithmetic", "math", "guess", "poker"])
def test_every_tasks_leases_carry_no_answer(task):
    """The leased form of every registered task's prompts: no answer key, no meta value that is the
    answer, and what a worker rebuilds from it has no answer to grade with."""
    import random

    from echo2.config import TASK_PRESETS, load_config
    from echo2.tasks.registry import build_task

    built = build_task(load_config(overrides=TASK_PRESETS[task]).task, 0)
    prompts = built.sample_train(random.Random(0), 16)
    grant = protocol.LeaseGrant(
        lease_id="L",
        prompts=[protocol.LeasedPrompt.of(p) for p in prompts],
        group_size=2,
        min_version=0,
        expires_in_s=1.0,
        seed=1,
    )
    wire = json.loads(grant.model_dump_json())
    for p, sent in zip(prompts, wire["prompts"], strict=True):
        assert set(sent) == {"prompt_id", "text", "meta"}
        if p.answer:
            assert p.answer not in [str(v) for v in sent["meta"].values()]
    back = protocol.LeaseGrant.model_validate(wire)
    assert all(lp.prompt().answer == "" for lp in back.prompts)
