"""How a sharded learner starts (cli/run.py: torchrun_argv) and what one rank does with the rank
protocol (learner/sharded.py: Ranks): nothing."""

from __future__ import annotations

import argparse
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
