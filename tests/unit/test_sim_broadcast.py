"""The simulator's bandwidth model for the three broadcast strategies (SPEC section 4)."""

from __future__ import annotations

import numpy as np
import pytest

from echo2.errors import ConfigError
from echo2.planner import dissemination
from echo2.sim.broadcast import completion_times, star_limited, star_unlimited, tree_pipelined

G8B = 16.38e9  # Qwen3-8B bf16 snapshot, bytes


def test_star_unlimited_is_g_over_own_link() -> None:
    # 1 byte = 8 bits over 2 and 4 bit/s -> 4 s and 2 s
    assert star_unlimited(1.0, [2.0, 4.0]).tolist() == [4.0, 2.0]


def test_star_limited_water_filling_by_hand() -> None:
    # G = 8 bits, B0 = 6 bit/s, links [1, 4, 4]. Max-min share: flow 0 capped at 1, flows 1-2 get
    # (6 - 1)/2 = 2.5 each -> done at 8/2.5 = 3.2 s; flow 0 has 8 - 3.2 = 4.8 bits left at its cap
    # of 1 bit/s -> done at 3.2 + 4.8 = 8.0 s.
    t = star_limited(1.0, [1.0, 4.0, 4.0], 6.0)
    assert t.tolist() == pytest.approx([8.0, 3.2, 3.2])


def test_star_limited_homogeneous_is_linear_in_n() -> None:
    for n in (1, 5, 50, 500):
        t = star_limited(G8B, np.full(n, 100e6), 500e6)
        expect = dissemination.star_limited(g_bytes=G8B, b0_bps=500e6, bw_bps=100e6, n=n)
        assert t.max() == pytest.approx(expect, rel=1e-9)


def test_tree_pipelined_near_lower_bound_and_flat_in_n() -> None:
    worst = []
    for n in (1, 8, 64, 512, 1000):
        t = tree_pipelined(G8B, np.full(n, 100e6), 500e6)
        lb = dissemination.lower_bound(g_bytes=G8B, b0_bps=500e6, bw_bps=100e6, n=n)
        worst.append(t.max() / lb)
    assert max(worst) <= 1.10  # within 10% of T* up to 1,000 workers
    assert worst[-1] - worst[0] <= 0.10  # nearly flat in N
    # homogeneous links: the simulator's chain model matches the planner's closed form within 1%
    sim = tree_pipelined(G8B, np.full(100, 100e6), 500e6).max()
    ana = dissemination.tree_pipelined(g_bytes=G8B, b0_bps=500e6, bw_bps=100e6, n=100).seconds
    assert sim == pytest.approx(ana, rel=0.01)


def test_tree_puts_slow_links_at_the_tails() -> None:
    # 10 fast (100 Mbit/s) and 2 slow (20 Mbit/s) workers: the slow ones throttle only themselves
    links = [100e6] * 10 + [20e6] * 2
    t = tree_pipelined(G8B, links, 500e6)
    fast, slow = t[:10].max(), t[10:].min()
    assert fast <= 1.05 * G8B * 8 / 100e6
    assert slow >= G8B * 8 / 20e6


def test_errors() -> None:
    with pytest.raises(ConfigError, match="strategy"):
        completion_times("gossip", 1.0, [1.0], 1.0)
    with pytest.raises(ConfigError, match="links"):
        star_unlimited(1.0, [0.0])
    with pytest.raises(ConfigError, match="snapshot"):
        tree_pipelined(0.0, [1.0], 1.0)
