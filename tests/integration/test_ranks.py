"""The seam to the other ranks (learner/sharded.py ``Ranks``) at two gloo ranks on the CPU: each
collective a trainer or an engine does through it, and the announcements rank 0 sends the ranks that
follow it (keepalives skipped, stop ends the following). Its one-rank meaning, the identity:
tests/unit/test_sharded_launch.py."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from echo2.learner.sharded import Ranks

pytestmark = pytest.mark.integration


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    ranks = Ranks.from_env("cpu", 60.0)
    got: dict[str, object] = {
        "sum": ranks.sum(1.5 + rank),
        "sum_": ranks.sum_(torch.tensor([1.0, float(rank)])).tolist(),
        "any": [ranks.any(rank == 1), ranks.any(False)],
        "gather": ranks.gather({"rank": rank}),
        "share_of": ranks.share_of([[0], [1], [2]], pad=[]),
        "all_done": [ranks.all_done(torch.tensor([True, rank == 0])), ranks.all_done(torch.tensor([True]))],
    }
    if ranks.leader:  # a stop on rank 0 while both ranks have rows running: both end at this step
        ranks.halt.set()
    got["halt"] = [ranks.all_done(torch.tensor([False])), ranks.halted]
    if ranks.leader:
        ranks.announce("update", [1, 2])
        ranks.last_announced -= 60.0  # as if it waited a whole timeout for workers
        ranks.keepalive()
        ranks.announce("weights", "bfloat16")
        ranks.stop()
    else:
        got["followed"] = []
        while (announced := ranks.receive()) is not None:
            got["followed"].append(announced)  # type: ignore[attr-defined]
    ranks.close()
    Path(out, f"{rank}.json").write_text(json.dumps(got))


def test_two_ranks_agree_through_the_seam(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(port, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    zero, one = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    for got in (zero, one):
        assert got["sum"] == 4.0 and got["sum_"] == [2.0, 1.0]
        assert got["any"] == [True, False]  # True on rank 1 alone is True on both
        assert got["gather"] == [{"rank": 0}, {"rank": 1}]
        assert got["all_done"] == [False, True]  # rank 1 has a row running: neither stops
        assert got["halt"] == [True, True]  # rank 0's halt ends the generation on rank 1 too, cut short
    assert zero["share_of"] == [[0], [2]] and one["share_of"] == [[1], []]  # padded: as many passes
    # the keepalive is not an operation: the follower sees the two announced ones, then stops
    assert one["followed"] == [["update", [[1, 2]]], ["weights", ["bfloat16"]]]
