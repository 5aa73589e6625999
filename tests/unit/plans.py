"""What the broadcast-plan tests read off a plan (``test_broadcast_plan.py``, ``test_relay_tree.py``)."""

from __future__ import annotations

from echo2.broadcast.strategy import LEARNER, Plan


def sources(plan: Plan) -> dict[tuple[str, int], str]:
    """(worker, chunk) -> source; asserts each worker pulls each chunk exactly once, in ascending lists."""
    out: dict[tuple[str, int], str] = {}
    for w, pulls in plan.items():
        for a in pulls:
            assert list(a.chunks) == sorted(a.chunks)
            for i in a.chunks:
                assert (w, i) not in out, f"{w} pulls chunk {i} twice"
                out[(w, i)] = a.source
    return out


def depth(src: dict[tuple[str, int], str], w: str, i: int) -> int:
    """Hops from the learner to ``w`` for chunk ``i``; asserts there is no cycle."""
    d = 0
    while w != LEARNER:
        w = src[(w, i)]
        d += 1
        assert d < 100_000, "cycle"
    return d
