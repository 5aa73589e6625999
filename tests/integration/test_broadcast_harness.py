"""The loopback harness with real processes: app-paced links, a relay killed or frozen mid-broadcast."""

from __future__ import annotations

import pytest

from echo2_bench.faults import Faults
from echo2_bench.harness import Harness, Scenario

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_loopback_paced_tree_and_relay_faults() -> None:
    common = dict(size=1_500_000, chunk=16 << 10, b0_bps=120e6, bw_bps=40e6, stall_timeout=1.0, timeout=60)
    with Harness("loopback", 4) as h:
        base = h.run(Scenario("tree-pipelined", 4, **common))
        killed = h.run(Scenario("tree-pipelined", 4, faults={1: Faults(die_at=0.5)}, **common))
        frozen = h.run(Scenario("tree-pipelined", 4, faults={2: Faults(stall_at=0.5)}, **common))
        workdir = h.workdir
    assert not workdir.exists()  # the harness removes what it made
    for res in (base, killed, frozen):
        assert res.t_all() < float("inf") and res.bad_installs() == 0
    assert base.learner_bytes == base.size  # peer-assisted: G leaves the learner once
    assert set(killed.install_s) == {"w000", "w002", "w003"}  # every survivor installed
    assert "w001" not in killed.workers  # the victim really died (no report)
    assert {"w000", "w001", "w003"} <= set(frozen.install_s)
    # survivors repaired the victim's stripe elsewhere, in well under 2x the fault-free time + detection
    assert killed.t_all() <= 2.0 * base.t_all() + 1.0
    assert frozen.t_all() <= 2.0 * base.t_all() + 2 * 1.0
    assert killed.counter("repaired_chunks") > 0 and frozen.counter("stream_failures") > 0
