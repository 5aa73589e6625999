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


PROCESS_CODE = [
    "runtime/*.py",
    "observe/*.py",
    "rollout/worker.py",
    "rollout/follower.py",
    "rollout/client.py",
]
MAX_LINES = 60


def test_no_function_of_the_learner_node_or_worker_is_long():
    long = [
        f"{p.relative_to(SRC)}:{line} {name} ({n} lines)"
        for pattern in PROCESS_CODE
        for p in sorted(SRC.glob(pattern))
        for line, name, n in _long(ast.parse(p.read_text()), MAX_LINES)
    ]
    assert not long, long


MAX_MODULE_LINES = 700
DECLARED_TABLES = frozenset({"observe/catalog.py"})  # a table declared in one place: every metric
COMPONENT_CODE = ("runtime", "rollout", "learner", "check")
MAX_COMPONENT_FUNCTION_LINES = 80


def _long(tree: ast.Module, limit: int) -> list[tuple[int, str, int]]:
    """(line, name, length) of every function of ``tree`` longer than ``limit`` lines."""
    return [
        (n.lineno, n.name, (n.end_lineno or n.lineno) - n.lineno + 1)
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        and (n.end_lineno or n.lineno) - n.lineno >= limit
    ]


def test_no_module_is_long_but_a_declared_table():
    long = {
        str(p.relative_to(SRC)): n
        for p in sorted(SRC.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
        and str(p.relative_to(SRC)) not in DECLARED_TABLES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {long}"
    assert all((SRC / t).is_file() for t in DECLARED_TABLES)  # no stale exemption


def test_no_function_of_a_component_is_long():
    long = [
        f"{p.relative_to(SRC)}:{line} {name} ({n} lines)"
        for package in COMPONENT_CODE
        for p in sorted((SRC / package).rglob("*.py"))
        for line, name, n in _long(ast.parse(p.read_text()), MAX_COMPONENT_FUNCTION_LINES)
    ]
    assert not long, long


def test_the_length_rules_find_a_long_function_and_module():
    body = "\n".join(f"    x = {i}" for i in range(MAX_COMPONENT_FUNCTION_LINES))
    assert [(name, n) for _, name, n in _long(ast.parse(f"def f():\n{body}\n"), 80)] == [("f", 81)]
    assert _long(ast.parse("def g():\n    pass\n"), 80) == []
    assert max(len(p.read_text().splitlines()) for p in SRC.rglob("*.py")) > MAX_MODULE_LINES  # the table


TASK_PACKAGES = ("tasks", "data/tasks", "envs")  # where a task may know its own kind
KIND_CLASSES = frozenset(
    {"EnvironmentTask", "Episodic", "SingleTurn", "EnvironmentFields", "_SingleTurnFields", "EnvSpec"}
)
TASK_CONFIGS = frozenset({"ArithmeticTaskConfig", "MathTaskConfig", "PokerTaskConfig", "GuessTaskConfig"})


def _kind_branches(tree: ast.Module) -> list[tuple[int, str]]:
    """Where a module asks which kind of task it holds: an ``episodic`` flag, ``is_episodic``, or an
    ``isinstance`` against a kind (the environment adapter, the two task kinds, a union of task configs).
    A check for one named task (poker's Table 4 needs poker) is not a kind and is allowed."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("episodic", "is_episodic"):
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Name) and node.id == "is_episodic":
            found.append((node.lineno, "is_episodic"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            if len(node.args) < 2:
                continue
            names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            if names & KIND_CLASSES or len(names & TASK_CONFIGS) > 1:
                found.append((node.lineno, f"isinstance(..., {ast.unparse(node.args[1])})"))
    return found


def test_no_module_outside_the_task_package_branches_on_the_kind_of_task():
    """The task protocol (echo2/tasks/base.py) answers for every kind: the learner, the worker, the
    intake, the CLI, the config tree and the benchmarks never ask whether a task is an environment."""
    roots = [SRC, ROOT / "benchmarks", ROOT / "examples"]
    where = [
        f"{p.relative_to(ROOT)}:{line}: {what}"
        for root in roots
        for p in sorted(root.rglob("*.py"))
        if not any(p.is_relative_to(SRC / pkg) for pkg in TASK_PACKAGES)
        for line, what in _kind_branches(ast.parse(p.read_text()))
    ]
    assert where == [], where


def test_the_rule_finds_a_branch_on_the_kind():
    """The scan above is not vacuous: each form of asking is caught."""
    code = (
        "if cfg.episodic: pass\n"
        "if is_episodic(task): pass\n"
        "if isinstance(task, EnvironmentTask): pass\n"
        "if isinstance(cfg.task, PokerTaskConfig | GuessTaskConfig): pass\n"
        "if isinstance(cfg.task, PokerTaskConfig): pass\n"  # one named task: allowed
    )
    assert sorted(line for line, _ in _kind_branches(ast.parse(code))) == [1, 2, 3, 4]


LOOP_MODULE = "runtime/loop.py"  # the one learner loop: echo2 train (S = 0) and the node share it


def _loop_steps(tree: ast.Module) -> list[tuple[int, str]]:
    """Where a module does what only a learner loop does: make a GRPO update (``<...>trainer.update``,
    or the learner core's, ``<...>core.update``), take a batch from the store (``take_batch``) or start
    a bubble meter (``BubbleMeter(...)``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "update":
            owner = ast.unparse(node.value)
            if "trainer" in owner:
                found.append((node.lineno, "trainer.update"))  # called, or handed to a thread
            elif owner.endswith("core"):
                found.append((node.lineno, "core.update"))
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "take_batch":
            found.append((node.lineno, "take_batch"))
        elif isinstance(f, ast.Name | ast.Attribute) and ast.unparse(f).endswith("BubbleMeter"):
            found.append((node.lineno, "BubbleMeter"))
    return found


def test_there_is_one_learner_loop():
    """``echo2 train`` is the node's loop at S = 0 with another feed (runtime/local.py): no module but
    the loop updates (through the learner core, whose rank 0 and other ranks of a sharded learner are
    the one caller of the trainer's update), takes batches or meters the bubble, and the synchronous
    twin is gone."""
    assert not (SRC / "runtime" / "sync.py").exists()
    where = {
        f"{p.relative_to(SRC)}: {what}"
        for p, tree in _modules()
        if not str(p.relative_to(SRC)).startswith(("learner/", "data/store.py"))  # the trainer, the store
        for _, what in _loop_steps(tree)
    }
    assert where == {f"{LOOP_MODULE}: {w}" for w in ("core.update", "take_batch", "BubbleMeter")} | {
        "runtime/core.py: trainer.update"
    }


def test_the_rule_finds_a_loop():
    code = (
        "stats = self.trainer.update(flat)\n"
        "batch = store.take_batch(P, v, step=v + 1)\n"
        "meter = BubbleMeter()\n"
        "stats = await asyncio.to_thread(core.trainer.update, flat)\n"
        "record.update({'a': 1})\n"  # a dict's update is not a step
        "stats = await asyncio.to_thread(self.core.update, flat)\n"
    )
    assert sorted(line for line, _ in _loop_steps(ast.parse(code))) == [1, 2, 3, 4, 6]


TIER_MARKS = ("integration", "netns", "slow", "vllm")  # tiers other than the default (pyproject markers)


def _tier_marks(tree: ast.Module) -> list[str]:
    """The non-unit tier marks a test module carries (``@pytest.mark.X`` or ``pytestmark``)."""
    return sorted(
        {
            n.attr
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute)
            and n.attr in TIER_MARKS
            and isinstance(n.value, ast.Attribute)
            and n.value.attr == "mark"
        }
    )


def test_the_default_run_is_the_unit_tier_and_the_readme_runs_every_tier():
    """``python -m pytest`` runs tests/unit (fast, nothing marked for another tier); the README's test
    command, which CI runs verbatim, runs every tier."""
    import tomllib

    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert ini["testpaths"] == ["tests/unit"]
    marked = {
        p.name: m
        for p in sorted((ROOT / "tests" / "unit").glob("test_*.py"))
        if (m := _tier_marks(ast.parse(p.read_text())))
    }
    assert not marked, f"unit-tier modules with tests of another tier: {marked}"
    readme = (ROOT / "README.md").read_text()
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in line]
    assert len(ci) == 1 and ci[0].endswith("python -m pytest tests") and f"\n{ci[0]}\n" in readme


def test_the_tier_rule_finds_a_marked_test():
    tree = ast.parse("import pytest\n@pytest.mark.integration\ndef test_x():\n    pass\n")
    assert _tier_marks(tree) == ["integration"]
    assert _tier_marks(ast.parse("pytestmark = [pytest.mark.netns]")) == ["netns"]
    assert _tier_marks(ast.parse("x.integration = 1")) == []


RANKS_MODULE = "learner/sharded.py"  # the one seam to the other ranks (Ranks) and what FSDP2 needs


def _distributed_uses(tree: ast.Module) -> list[tuple[int, str]]:
    """Where a module reaches the other ranks itself: an import of ``torch.distributed`` (or of a
    module under it), or an attribute call through ``torch.distributed``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("torch.distributed")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            found.append((node.lineno, f"from {node.module}"))
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            found += [
                (node.lineno, "from torch import distributed") for a in node.names if a.name == "distributed"
            ]
        elif isinstance(node, ast.Attribute) and ast.unparse(node.value) == "torch.distributed":
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_only_the_ranks_seam_speaks_to_the_other_ranks():
    """Rank and world live in ``Ranks`` alone: the trainer, the engine, the learner core and everything
    else do their collectives through it (``sum``, ``any``, ``gather``, ``share_of``, ``all_done``, the
    announcements), never through ``torch.distributed`` directly."""
    where = [
        f"{p.relative_to(SRC)}:{line}: {what}"
        for p, tree in _modules()
        if p.relative_to(SRC).as_posix() != RANKS_MODULE
        for line, what in _distributed_uses(tree)
    ]
    assert where == [], where


def test_the_ranks_rule_finds_a_collective_outside_the_seam():
    """The scan above is not vacuous: each way of reaching the other ranks is caught."""
    code = (
        "import torch.distributed as dist\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "from torch import distributed\n"
        "torch.distributed.all_reduce(t)\n"
        "x = torch.cuda.device_count()\n"  # not the ranks: allowed
    )
    assert sorted(line for line, _ in _distributed_uses(ast.parse(code))) == [1, 2, 3, 4]


SHARED_NAMES = frozenset({"__init__.py", "base.py"})  # a package's marker and its protocol module


def _collisions(paths: list[str]) -> dict[str, list[str]]:
    """Module file names (relative to echo2/) held by two modules or more, but the shared ones and the
    CLI's, each named after the subcommand it runs (``cli/plan.py`` runs ``echo2 plan``)."""
    by_name: dict[str, list[str]] = {}
    for rel in paths:
        name = rel.rsplit("/", 1)[-1]
        if name not in SHARED_NAMES and not rel.startswith("cli/"):
            by_name.setdefault(name, []).append(rel)
    return {name: where for name, where in by_name.items() if len(where) > 1}


def test_no_two_modules_share_a_name():
    """One name per module, so a name in a log line, a traceback or a review says which module: no
    ``registry.py`` in four packages."""
    assert _collisions([p.relative_to(SRC).as_posix() for p, _ in _modules()]) == {}


def test_the_name_rule_finds_a_collision():
    """The scan above is not vacuous: two ``store.py`` collide; ``base.py`` and the CLI's do not."""
    paths = [
        "data/store.py",
        "broadcast/store.py",
        "tasks/base.py",
        "envs/base.py",
        "cli/plan.py",
        "planner/plan.py",
    ]
    assert _collisions(paths) == {"store.py": ["data/store.py", "broadcast/store.py"]}


def _protocols(tree: ast.Module) -> list[str]:
    """The classes a module declares as protocols (``class X(Protocol)``)."""
    return [
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("Protocol") for b in node.bases)
    ]


def test_no_two_protocols_share_a_name():
    """One ``Task`` protocol (``tasks/base.py``; the data adapters' is ``Adapter``), one of each seam."""
    seen: dict[str, list[str]] = {}
    for p, tree in _modules():
        for name in _protocols(tree):
            seen.setdefault(name, []).append(p.relative_to(SRC).as_posix())
    assert {n: w for n, w in seen.items() if len(w) > 1} == {}
    assert seen["Task"] == ["tasks/base.py"]


def test_the_protocol_scan_finds_protocols():
    """The scan above is not vacuous: both spellings of a protocol base are found, a plain class is not."""
    code = "class Task(Protocol): ...\nclass Adapter(typing.Protocol): ...\nclass Plain(Base): ...\n"
    assert _protocols(ast.parse(code)) == ["Task", "Adapter"]


IMPORT_FREE = ("echo2.errors", "echo2.types")  # modules that import nothing: deferring them saves nothing


def _deferred(tree: ast.Module, modules: tuple[str, ...]) -> list[tuple[int, str]]:
    """Imports of ``modules`` inside a function or class (not at the top, not under TYPE_CHECKING)."""
    typing_only = {
        id(m)
        for n in ast.walk(tree)
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
        for m in ast.walk(n)
    }
    return [
        (n.lineno, ast.unparse(n))
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom)
        and n not in tree.body
        and id(n) not in typing_only
        and (n.module or "") in modules
    ]


def test_an_import_is_deferred_only_where_it_saves_something():
    """A deferred import keeps a heavy or optional package (torch, transformers, vLLM, Ray, ...) out of
    start-up, or an import contract's cycle out; ``echo2.errors`` and ``echo2.types`` import nothing, so
    they are imported at the top."""
    where = [
        f"{p.relative_to(SRC)}:{line}: {what}"
        for p, tree in _modules()
        for line, what in _deferred(tree, IMPORT_FREE)
    ]
    assert where == [], where


def test_the_deferred_import_scan_finds_one():
    """The scan above is not vacuous: an import in a function is found, one at the top or under
    TYPE_CHECKING is not."""
    code = (
        "from echo2.errors import ConfigError\n"
        "if TYPE_CHECKING:\n    from echo2.types import Prompt\n"
        "def f():\n    from echo2.errors import Echo2Error\n"
    )
    assert [line for line, _ in _deferred(ast.parse(code), IMPORT_FREE)] == [5]
