"""Pinned environment packages: what a worker must run an environment's episodes with.

A multi-turn environment's episodes are played on the worker and replayed by the learner from their
seed and actions (``envs/base.py``); the two agree only if both run the same environment code. An
environment declares the distributions its episodes import (``Environment.packages``, poker's
``pokerkit``); the learner sends each one's pin with the run's settings at registration (over the
connection the worker's join string pins): its version and a digest of its installed files. A worker
whose installed package differs refuses to run, with one line naming the package, both versions and
what to install, instead of generating episodes the learner's replay refuses.

The digest is a SHA-256 over the distribution's own files (path and content; its ``.dist-info``
metadata, byte code and anything not listed left out), so two installs of one release agree whatever
the installer or the location, and a locally patched copy of the same version does not. Files installed
outside the package's root (console scripts, whose first line names this machine's interpreter) and
``.pth`` files are left out too: an editable install lists only those, so it is pinned by its version.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path

from echo2.errors import Echo2Error


class PinMismatch(Echo2Error):
    """This machine's copy of a pinned package is not the run's; the message says which and how."""


def package_pin(name: str) -> dict[str, str]:
    """``{"name", "version", "digest"}`` of the installed distribution ``name``; PinMismatch when it is
    not installed."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        raise PinMismatch(f"package {name!r} is not installed") from None
    return {"name": name, "version": dist.version, "digest": _digest(dist)}


def _digest(dist: metadata.Distribution) -> str:
    """SHA-256 over (path, SHA-256 of content) of the distribution's own files, sorted by path."""
    h = hashlib.sha256()
    for path in sorted(dist.files or (), key=str):
        parts = path.parts
        if any(p.endswith((".dist-info", ".egg-info")) or p == "__pycache__" for p in parts):
            continue
        if path.suffix in (".pyc", ".pyo", ".pth") or (parts and parts[0] == ".."):
            continue  # byte code; an editable install's pointer to its source and console scripts
            # (outside the package's root): both name this machine's paths, not what the package runs
        try:
            data = Path(path.locate()).read_bytes()
        except OSError:
            continue  # listed but absent (an install that pruned it): not part of what runs
        h.update(str(path).encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()


def check_pins(pins: Iterable[Mapping[str, str]]) -> None:
    """PinMismatch, one line, unless every pinned package is installed here at the pinned version with
    the pinned digest."""
    for pin in pins:
        name, version, digest = pin["name"], pin["version"], pin["digest"]
        try:
            here = package_pin(name)
        except PinMismatch:
            raise PinMismatch(
                f"the run pins {name} {version} for its environment and it is not installed here: "
                f"pip install '{name}=={version}'"
            ) from None
        if here["version"] != version:
            raise PinMismatch(
                f"the run pins {name} {version} for its environment; this machine has {here['version']}: "
                f"pip install '{name}=={version}'"
            )
        if here["digest"] != digest:
            raise PinMismatch(
                f"the run pins {name} {version} with files digest {digest[:12]}; this machine's {name} "
                f"{version} has {here['digest'][:12]} (a modified copy): reinstall it "
                f"(pip install --force-reinstall '{name}=={version}')"
            )
