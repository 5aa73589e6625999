"""What the broadcast-plan tests read off a plan (``test_broadcast_plan.py``, ``test_relay_tree.py``) or an
announcement as it came off the wire."""

from __future__ import annotations

from typing import Any

from echo2.broadcast.strategy import LEARNER, Plan
from echo2.broadcast.wire import parse_announcement
from echo2.weights.frames import AnnounceFrame, parse_frame
from echo2.weights.manifest import Manifest


def announced(header: dict[str, Any]) -> list[tuple[str, list[int]]]:
    """The pull streams an ``announce`` header gives its member, as the member reads them (strides
    expanded by ``wire.parse_announcement``)."""
    frame = parse_frame(header, AnnounceFrame)
    return parse_announcement(frame, Manifest.from_dict(frame.manifest).n_chunks, tls=False).sources


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
