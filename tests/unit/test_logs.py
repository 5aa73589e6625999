"""``logs.SampledLog``: a line per kind at most every ``every_s``, at most ``per_window`` lines in all in
that time, and a line says how many like it were left out."""

from __future__ import annotations

import logging

from echo2.logs import SampledLog


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_kind_is_logged_once_a_window_and_says_how_many_were_left_out(caplog):
    clock = _Clock()
    sampled = SampledLog(logging.getLogger("t"), every_s=60.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="t"):
        for i in range(5):
            clock.now = 10.0 * i  # 0 .. 40 s: one line, four left out
            sampled.log("boom", "failed: %s", "boom")
        sampled.log("other", "failed: %s", "other")  # another kind: its own line
        clock.now = 61.0
        sampled.log("boom", "failed: %s", "boom")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["failed: boom", "failed: other", "failed: boom (and 4 more like it in 61 s)"]


def test_at_most_per_window_lines_in_all_whatever_the_kinds(caplog):
    clock = _Clock()
    sampled = SampledLog(logging.getLogger("t"), every_s=10.0, clock=clock, per_window=3)
    with caplog.at_level(logging.WARNING, logger="t"):
        for k in range(50):
            sampled.log(f"kind {k}", "kind %d", k)
        assert len(caplog.records) == 3
        clock.now = 10.0
        sampled.log("kind 0", "kind %d", 0)
    assert len(caplog.records) == 4
