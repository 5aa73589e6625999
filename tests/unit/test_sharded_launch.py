"""How a sharded learner starts (cli/run.py: torchrun_argv) and what one rank does with the rank
protocol (learner/sharded.py: Ranks): nothing."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from echo2.cli.run import torchrun_argv
from echo2.errors import ConfigError
from echo2.learner.sharded import Ranks


def _args(**kw) -> argparse.Namespace:
    base = {"nproc_per_node": 1, "nnodes": 1, "node_rank": 0, "master_addr": None, "master_port": 29500}
    return argparse.Namespace(**{**base, **kw})


def test_one_rank_starts_no_torchrun(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert torchrun_argv(_args(), ["learner"]) is None


def test_one_machine_is_standalone_and_each_rank_gets_the_same_command(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    argv = torchrun_argv(_args(nproc_per_node=2), ["learner", "--steps", "5", "--nproc-per-node", "2"])
    assert argv == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    "-m", "echo2.cli", "learner", "--steps", "5", "--nproc-per-node", "2"]  # fmt: skip


def test_several_machines_name_the_rendezvous(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    args = _args(nproc_per_node=8, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29400)
    argv = torchrun_argv(args, ["learner"])
    assert argv is not None
    assert argv[3:8] == ["--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1", "--master-port=29400",
                         "--nproc-per-node=8"]  # fmt: skip


def test_a_rank_torchrun_started_does_not_start_it_again(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert torchrun_argv(_args(nproc_per_node=2), ["learner"]) is None


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"nproc_per_node": 0}, "at least one rank per node"),
        ({"nnodes": 2, "node_rank": 2, "master_addr": "h"}, "node rank < nodes"),
        ({"nnodes": 2}, "--master-addr"),
    ],
)
def test_bad_launch_flags_are_named(monkeypatch, kw, says):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(ConfigError, match=says):
        torchrun_argv(_args(**kw), ["learner"])


def test_one_rank_announces_nothing_and_shares_its_own_values(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ranks = Ranks.from_env("cpu", 60.0)
    assert (ranks.rank, ranks.world, ranks.sharded, ranks.leader) == (0, 1, False, True)
    assert ranks.share(("path", True)) == ("path", True)
    ranks.announce("update", [1, 2])  # no process group: nothing to send, nothing raised
    ranks.keepalive()
    ranks.close()


def test_echo2_train_under_torchrun_is_refused(monkeypatch, capsys):
    from echo2.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train"]) == 2
    assert "echo2 train runs in one process" in capsys.readouterr().err


def test_at_one_rank_every_collective_is_the_identity(monkeypatch):
    """The collectives a trainer and an engine do through ``Ranks`` (learner/sharded.py), at one rank:
    no process group, the value itself (their two-rank meaning: tests/integration/test_ranks.py)."""
    import torch

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ranks = Ranks.from_env("cpu", 60.0)
    t = torch.tensor([1.0, 2.0])
    assert ranks.sum(2.5) == 2.5 and ranks.sum_(t) is t and t.tolist() == [1.0, 2.0]
    assert ranks.any(True) and not ranks.any(False)
    assert ranks.gather({"a": 1}) == [{"a": 1}]
    assert ranks.share_of([[1], [2], [3]], pad=[]) == [[1], [2], [3]]
    assert ranks.all_done(torch.tensor([True, True])) and not ranks.all_done(torch.tensor([True, False]))
    one = Ranks.of(torch.nn.Linear(2, 2))  # a model no process group shards: one rank
    assert (one.rank, one.world, one.sharded) == (0, 1, False)


def test_the_collective_operations_are_one_table_of_the_planes_methods():
    """Rank 0 announces a collective by the name it is registered under and the other ranks replay it
    from the same table (runtime/core.py): a method not registered cannot be led, an unknown name
    cannot be followed."""
    from echo2.errors import Echo2Error
    from echo2.runtime.core import COLLECTIVES, Plane

    ops = {"update": Plane.update, "evaluate": Plane.evaluate, "weights": Plane.weights}
    assert dict(COLLECTIVES) == {**ops, "save_states": Plane.save_states}
    plane = Plane.__new__(Plane)
    plane.ranks = Ranks()
    with pytest.raises(AssertionError, match="not a registered collective"):
        plane.lead(Plane.lead)  # type: ignore[arg-type]
    with pytest.raises(Echo2Error, match="unknown operation 'train'"):
        plane.follow("train", ())


def test_a_rank_leaves_with_its_code_and_its_output_flushed(tmp_path):
    """``sharded.leave``: the status given, what was printed and logged but not yet flushed written out
    (the interpreter's teardown, skipped, would have flushed them)."""
    log = tmp_path / "rank.log"
    program = (
        "import logging, sys\n"
        f"logging.basicConfig(filename={str(log)!r}, level=logging.INFO)\n"
        "logging.getLogger('r').info('logged')\n"
        "sys.stdout.write('printed')\n"
        "from echo2.learner.sharded import leave\n"
        "leave(3)\n"
        "print('not reached')\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "printed"
    assert "logged" in log.read_text()
