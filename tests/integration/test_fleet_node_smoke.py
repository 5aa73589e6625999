"""The fleet benchmark's node study (benchmarks/fleet.py --study node) on 8 members at a fast pace: CI
keeps the load generator speaking the protocol the real node serves (registration, heartbeats at the
learner's cadence, leases with the run's epoch, real-length submissions the node admits and trains)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCH = Path(__file__).parents[2] / "benchmarks"


def test_eight_simulated_members_register_lease_and_get_trained(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import fleet
    from echo2_bench import fleet_node

    monkeypatch.setattr(fleet_node, "PACE_S", 1.0)  # a lease "generated" in a second, not 20
    r = fleet._node_run(8, 20.0, tmp_path)
    assert r["exit"] == 0 and r["registered"] == 8 and r["errors"] == 0
    assert r["admitted"] > 0
    # trained on (in the run; a loaded machine may leave the short window itself without a step)
    from echo2.observe.rundir import read_metrics

    steps = [m for m in read_metrics(tmp_path / "fleet_runs" / "node_8") if "learner/t_train_s" in m]
    assert steps, "the learner never trained on the members' submissions"
    assert {"register", "heartbeat", "lease", "submit"} <= set(r["latency"])
    assert all(o == "200" for o in r["outcomes"]["submit"]), r["outcomes"]
