"""The fleet benchmark's restart study (benchmarks/fleet.py --study restart) on 30 members at a fast
pace: CI keeps the harness measuring what the issue asks (the learner's uplink until every member holds
a restart's anchor again) against the real publisher and worker nodes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

BENCH = Path(__file__).parents[2] / "benchmarks"


def test_a_restart_of_thirty_members_costs_the_learner_one_copy(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import fleet

    monkeypatch.setattr(fleet, "RESTART_BW", 1 << 20)  # a copy in 0.25 s, not 8
    monkeypatch.setattr(fleet, "RESTART_B0", 10 << 20)
    monkeypatch.setattr(fleet, "RESTART_SPREAD_S", 0.5)
    r = asyncio.run(fleet.restart_once(30, 0.0, 0))
    assert r["installed_by_broadcast"] == 30 and r["http_fallbacks"] == 0 and r["unfinished"] == 0
    assert r["uplink_copies"] == 1.0 and r["latecomers_from_learner"] == 1
