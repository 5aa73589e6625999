"""echo2.pins: an environment's packages pinned by version and files; a worker with others refuses."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from echo2.config import load_config
from echo2.pins import PinMismatch, check_pins, package_pin
from echo2.protocol import PackagePin
from echo2.runtime.node import worker_settings


def _install(root: Path, version: str, body: str, installer: str) -> None:
    """A distribution ``fakeenv`` as an installer leaves it under ``root`` (files and dist-info)."""
    pkg, info = root / "fakeenv", root / f"fakeenv-{version}.dist-info"
    pkg.mkdir(parents=True)
    info.mkdir()
    (pkg / "__init__.py").write_text(body)
    (pkg / "rules.py").write_text("PAYOUT = 2\n")
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "rules.cpython-311.pyc").write_bytes(installer.encode())  # byte code differs
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakeenv\nVersion: {version}\n")
    (info / "INSTALLER").write_text(installer + "\n")
    (info / "RECORD").write_text(
        "fakeenv/__init__.py,,\nfakeenv/rules.py,,\nfakeenv/__pycache__/rules.cpython-311.pyc,,\n"
        f"fakeenv-{version}.dist-info/METADATA,,\nfakeenv-{version}.dist-info/INSTALLER,,\n"
        f"fakeenv-{version}.dist-info/RECORD,,\n"
    )


@pytest.fixture
def on_path(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    def put(root: Path) -> None:
        monkeypatch.setattr(sys, "path", [str(root), *[p for p in sys.path if "fakeenv" not in p]])

    return put


def test_two_installs_of_one_release_agree_and_a_patched_copy_does_not(tmp_path, on_path):
    """The digest reads the distribution's own files (path and content): another location, installer
    or byte code gives the same pin; an edited file, or another version, gives a refusal naming the
    package, both versions and what to install; a package that is not there, likewise."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    _install(a, "1.0", "SEAT = 6\n", "pip")
    _install(b, "1.0", "SEAT = 6\n", "uv")
    _install(c, "1.0", "SEAT = 9\n", "pip")  # the same version, a file edited
    on_path(a)
    pin = package_pin("fakeenv")
    assert pin["version"] == "1.0" and len(pin["digest"]) == 64
    on_path(b)
    assert package_pin("fakeenv") == pin
    check_pins([pin])
    on_path(c)
    with pytest.raises(
        PinMismatch, match=r"pins fakeenv 1\.0 with files digest .*a modified copy.*reinstall"
    ):
        check_pins([pin])
    on_path(a)
    with pytest.raises(
        PinMismatch, match=r"pins fakeenv 2\.0 .*this machine has 1\.0: pip install 'fakeenv==2\.0'"
    ):
        check_pins([{**pin, "version": "2.0"}])
    with pytest.raises(PinMismatch, match=r"pins nosuchenv 1\.0 .*not installed here"):
        check_pins([{**pin, "name": "nosuchenv"}])


def test_paths_of_this_machine_are_not_part_of_the_pin(tmp_path, on_path):
    """A console script (its first line names the interpreter) and an editable install's ``.pth`` (the
    source's path) differ between two machines installing the same release: neither is in the digest."""
    pins = []
    for name in ("a", "b"):
        root = tmp_path / name / "site-packages"
        _install(root, "1.0", "SEAT = 6\n", "pip")
        (root / "__editable__.fakeenv-1.0.pth").write_text(f"{tmp_path / name}/src\n")
        (tmp_path / name / "bin").mkdir()
        (tmp_path / name / "bin" / "fakeenv").write_text(f"#!{tmp_path / name}/bin/python\n")
        record = root / "fakeenv-1.0.dist-info" / "RECORD"
        record.write_text(record.read_text() + "__editable__.fakeenv-1.0.pth,,\n../bin/fakeenv,,\n")
        on_path(root)
        pins.append(package_pin("fakeenv"))
    assert pins[0] == pins[1]


def test_an_environment_run_pins_its_packages_and_a_single_turn_run_none():
    """Poker's episodes run on pokerkit: its run sends the worker pokerkit's pin; a math run's worker
    only generates, so it is sent none."""
    poker = worker_settings(load_config(overrides=["task.name=poker"]))
    assert [p.name for p in poker.packages] == ["pokerkit"]
    assert poker.packages[0].model_dump() == package_pin("pokerkit")
    assert worker_settings(load_config()).packages == []


def test_a_worker_with_another_copy_refuses_before_it_starts(tmp_path, on_path, registered_worker):
    """The worker checks the pins of its registration reply before anything else (no heartbeat, no
    engine): a differing copy ends it with the one line."""
    _install(tmp_path / "w", "1.0", "SEAT = 9\n", "pip")
    on_path(tmp_path / "w")
    settings = worker_settings(load_config()).model_copy(
        update={"packages": [PackagePin(name="fakeenv", version="1.0", digest="ab" * 32)]}
    )
    worker = registered_worker(settings)
    with pytest.raises(PinMismatch, match=r"pins fakeenv 1\.0 with files digest abababababab"):
        asyncio.run(worker.setup())
    assert worker._heartbeat_task is None
