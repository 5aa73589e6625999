"""A resumed learner's first announcement waits while its fleet re-joins the broadcast
(``runtime/snapshots.gather``): until every expected member is back, or nobody joined for a quiet spell
(nobody coming at all included), and never longer than its window."""

from __future__ import annotations

import asyncio
import time

from echo2.runtime.snapshots import gather


class Joining:
    """A publisher's ``members()`` as members join at the given seconds after its start."""

    def __init__(self, at: list[float]) -> None:
        self.at, self.t0 = sorted(at), time.monotonic()

    def members(self) -> list[str]:
        now = time.monotonic() - self.t0
        return [f"w{i}" for i, t in enumerate(self.at) if t <= now]


def _gather(at: list[float], expected: int, window_s: float, quiet_s: float) -> tuple[int, float]:
    async def go() -> tuple[int, float]:
        pub = Joining(at)
        got = await gather(pub, expected, window_s, quiet_s)  # type: ignore[arg-type]
        return got, time.monotonic() - pub.t0

    return asyncio.run(go())


def test_it_ends_when_every_expected_member_is_back() -> None:
    got, took = _gather([0.05 * i for i in range(10)], 10, window_s=5.0, quiet_s=1.0)
    assert got == 10 and 0.45 <= took < 0.8


def test_it_ends_after_a_quiet_spell_and_when_nobody_comes() -> None:
    got, took = _gather([0.0, 0.1, 0.2], 10, window_s=5.0, quiet_s=0.3)  # 7 of 10 never come back
    assert got == 3 and 0.5 <= took < 0.9
    got, took = _gather([], 10, window_s=5.0, quiet_s=0.3)
    assert got == 0 and 0.3 <= took < 0.6


def test_it_never_waits_past_its_window() -> None:
    got, took = _gather([0.1 * i for i in range(100)], 100, window_s=0.5, quiet_s=0.3)  # a steady trickle
    assert 4 <= got <= 7 and 0.5 <= took < 0.8
