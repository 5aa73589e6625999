"""Readings of a benchmark study kept across runs: a re-run never erases what an earlier run read."""

from __future__ import annotations

from typing import Any


def on_record(earlier: dict[str, Any] | None, new: dict[str, Any], reading: str) -> dict[str, Any]:
    """``new``, with every earlier reading of the same study kept (the newest first) and what changed
    since the last one (``reading``, a ``--reading`` argument)."""
    if earlier:
        older = earlier.pop("earlier_readings", [])
        new["earlier_readings"] = [earlier, *older]
        if reading:
            new["reading"] = reading
    return new
