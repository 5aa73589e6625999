"""The shape of the house, checked: import layers, one definition per formula, small process code."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "echo2"


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text())) for p in sorted(SRC.rglob("*.py"))]


def test_import_contracts_hold():
    """pyproject.toml's import-linter contracts: layers, no cycles, loading never trains."""
    exe = shutil.which(
        "lint-imports", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    )
    if exe is None:
        pytest.fail("lint-imports is missing: install the dev extra (pip install -e '.[dev]')")
    res = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]


ONE_DEFINITION = (  # each rule or formula of SPEC §2-§4 lives in exactly one function
    "kappa_from_staleness",
    "admission_floor",
    "is_admissible",
    "install_quorum",
    "bubble_ratio",
    "knee",
    "lower_bound",
    "mu_min",
    "mu_target",
    "n_min",
)


@pytest.mark.parametrize("name", ONE_DEFINITION)
def test_each_formula_is_defined_once(name):
    where = [
        f"{p.relative_to(SRC)}:{node.lineno}"
        for p, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name == name
    ]
    assert len(where) == 1, where


def test_gamma_has_one_default():
    """The provisioning slack 1.1 is written once (physics/rules.py); pipelined.py's RATE_MATCH = 1.1
    is a different constant (stream-rate slack), named as such."""
    found = [
        f"{p.relative_to(SRC)}:{node.lineno}"
        for p, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value == 1.1
    ]
    assert sorted(found) == sorted(
        [
            "physics/rules.py:" + _line("physics/rules.py", "DEFAULT_GAMMA = 1.1"),
            "broadcast/pipelined.py:" + _line("broadcast/pipelined.py", "RATE_MATCH = 1.1"),
        ]
    )


def _line(rel: str, text: str) -> str:
    lines = (SRC / rel).read_text().splitlines()
    return str(next(i for i, line in enumerate(lines, 1) if line.startswith(text)))


PROCESS_CODE = ["runtime/*.py", "rollout/worker.py", "rollout/client.py"]
MAX_LINES = 60


def test_no_function_of_the_learner_node_or_worker_is_long():
    long = []
    for pattern in PROCESS_CODE:
        for p in sorted(SRC.glob(pattern)):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    n = (node.end_lineno or node.lineno) - node.lineno + 1
                    if n > MAX_LINES:
                        long.append(f"{p.relative_to(SRC)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long
