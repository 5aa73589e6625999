"""Anchors and patches through the real TCP broadcast plane: every install is bit-identical to what the
learner published, across chains, missed versions, a late joiner, a relay killed mid-patch and a relay
that corrupts chunks (benchmarks/echo2_bench/deltas_chain.py)."""

from __future__ import annotations

import asyncio

import pytest

from echo2_bench.deltas_chain import chain_over_tcp

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.mark.parametrize("lora", [False, True], ids=["whole-weights", "lora-adapter"])
def test_every_install_reproduces_the_published_weights_bit_for_bit(lora: bool) -> None:
    """Whole-weight publications, and a LoRA run's (the adapter alone, its base pinned in every signed
    lineage and carried by the first link): the same chains, faults and catch-ups, every install
    bit-identical, every worker's base the learner's."""
    r = asyncio.run(chain_over_tcp(publications=18, anchor_every=6, lora=lora))
    assert r["model_base_pinned"]
    w = r["workers"]
    assert r["anchors"] >= 3 and r["patches"] >= 12
    assert r["installs"] > 0 and r["bit_identical"] == r["installs"]
    assert r["relay_killed_at_version"] is not None  # the relay really died holding half a patch
    assert r["corrupt_chunks_detected"] > 0 and r["repaired_chunks"] > 0
    for name in ("steady", "corrupting-relay", "slow", "late-joiner"):
        assert w[name]["final_version"] == 17, name
    assert w["slow"]["http_fetches"] > 0 and w["slow"]["installs"] < 18  # it missed links and caught up
    assert w["late-joiner"]["http_fetches"] >= 1
    if lora:  # the base rode the first link: relayed to the workers joined before it, HTTP to the late one
        assert r["base_links"] == 1
        for name in ("steady", "corrupting-relay", "slow", "late-joiner"):
            assert w[name]["base_identical"], name
        assert w["late-joiner"]["base_via"] == "http"
        for name in ("steady", "relay-killed", "corrupting-relay", "slow"):  # joined before it: relayed
            assert w[name]["base_via"] == "broadcast", name
