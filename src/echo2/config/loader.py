"""The one loader of the run config and of ``echo2 plan``'s and ``echo2 simulate``'s scenarios: defaults <-
TOML file <- ``a.b.c=value`` overrides, validated once, one error format."""

from __future__ import annotations

import copy
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from echo2.errors import ConfigError

# ---------------------------------------------------------------------------------------------------
# loading: one loader for the run config and the plan / simulate scenarios, one error format

M = TypeVar("M", bound=BaseModel)


def _parse_value(text: str) -> Any:
    """An override's value is read as a TOML value when it is one (``3``, ``1e-4``, ``true``,
    ``"x"``, ``[1, 2]``), else taken as a bare string (``arithmetic``)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file as a dict; ConfigError naming the file when it is missing or not valid TOML."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} {'is not a file' if p.exists() else 'does not exist'}")
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {p} is not valid TOML (invalid TOML syntax: {exc})") from exc


def _index(items: list[Any], part: str, label: str) -> int:
    if not part.isdigit() or int(part) >= len(items):
        raise ConfigError(f"override {label!r}: {part!r} is not an index of a list of {len(items)}")
    return int(part)


def _assign(tree: dict[str, Any], key: str, value: Any, label: str) -> None:
    """Set the dotted ``key`` in a nested dict, creating sections; a number indexes a list."""
    *parents, last = key.split(".")
    node: Any = tree
    for part in parents:
        node = node[_index(node, part, label)] if isinstance(node, list) else node.setdefault(part, {})
        if not isinstance(node, dict | list):
            raise ConfigError(f"override {label!r}: {part!r} is a value, not a section")
    if isinstance(node, list):
        node[_index(node, last, label)] = value
    else:
        node[last] = value


def apply_override(tree: dict[str, Any], assignment: str) -> None:
    """Apply ``a.b.c=value`` to a nested dict in place (``workers.0.name=x``: a number indexes a list)."""
    key, sep, raw = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {assignment!r} must look like section.field=value")
    _assign(tree, key, _parse_value(raw.strip()), assignment)


def _format_validation_error(
    exc: ValidationError, what: str = "config", path: str | Path | None = None, inline: str | None = None
) -> str:
    """The one error format of every loader: ``invalid <what> [<file>]: field.path: message (got value);
    ...`` (a rule of the whole model has no field path; ``inline``, a field flattened into the file,
    is left out of the paths)."""
    problems = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"] if not str(p).startswith("function-after")]
        if inline is not None and loc[:1] == [inline]:
            loc = loc[1:]
        problem = err["msg"].removeprefix("Value error, ")
        got = err.get("input")
        if not isinstance(got, dict | list | tuple | BaseModel):
            shown = repr(got)
            problem += f" (got {shown if len(shown) <= 60 else shown[:57] + '...'})"
        problems.append(f"{'.'.join(loc)}: {problem}" if loc else problem)
    where = what if path is None else f"{what} {path}"
    return f"invalid {where}: " + "; ".join(problems)


def load_settings(
    model: type[M],
    path: str | Path | None = None,
    overrides: Iterable[str] | Mapping[str, Any] | None = None,
    *,
    what: str = "config",
    tree: dict[str, Any] | None = None,
    inline: str | None = None,
) -> M:
    """Defaults <- the TOML file at ``path`` <- overrides, validated once by ``model``; the one loader of
    the run config (:func:`load_config`), ``echo2 plan``'s and ``echo2 simulate``'s scenarios.

    ``overrides`` are ``"a.b.c=value"`` strings (the value read as TOML, else a bare string) or a
    mapping ``{"a.b.c": value}``; a number in a path indexes a list (``workers.0.usd_per_hour``).
    ``tree`` is the file's content when the caller has read (and reshaped) it; ``path`` then only names
    it. ``inline`` is a field whose sections sit at the top level of the file (a simulate config's plan
    sections): every key that is no other field of ``model`` goes under it, and error paths leave it out.
    Raises ConfigError: a missing file, invalid TOML, a malformed override, or
    ``invalid <what> <file>: field.path: message (got value); ...`` naming every bad field.
    """
    if tree is None:
        tree = read_toml(path) if path is not None else {}
    tree = copy.deepcopy(tree)  # overrides never write into the caller's dict
    if isinstance(overrides, Mapping):
        for key, value in overrides.items():
            _assign(tree, key, value, f"{key}={value!r}")
    else:
        for assignment in overrides or ():
            apply_override(tree, assignment)
    if inline is not None:
        own = model.model_fields.keys() - {inline}
        tree = {inline: {k: v for k, v in tree.items() if k not in own}} | {
            k: v for k, v in tree.items() if k in own
        }
    try:
        return model.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, what, path, inline)) from None
