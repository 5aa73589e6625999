"""Log lines that cannot flood: what a stranger, a user's code or a long run can repeat at will is
logged a line per kind at most every so often, and the counts live in the metrics."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any


class SampledLog:
    """Warnings a stranger can cause at will (a refused connection, a malformed first frame), logged
    without a flood: a line per key at most every ``every_s`` seconds, and at most ``per_window`` lines
    in all in that time; a line says how many like it were left out since (the counts are metrics)."""

    def __init__(
        self, logger: logging.Logger, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
        per_window: int = 20,
    ) -> None:  # fmt: skip
        self.logger, self.every_s, self.clock, self.per_window = logger, every_s, clock, per_window
        self._last: dict[str, tuple[float, int]] = {}  # key -> (when logged, left out since)
        self._window: tuple[float, int] = (-math.inf, 0)  # (start, lines logged in it)

    def log(self, key: str, fmt: str, *args: Any) -> None:
        now = self.clock()
        at, skipped = self._last.get(key, (-math.inf, 0))
        start, lines = self._window
        if now - start >= self.every_s:
            start, lines = now, 0
        if now - at < self.every_s or lines >= self.per_window:
            self._last[key] = (at, skipped + 1)
            return
        if len(self._last) > 4 * self.per_window:  # keys seen long ago: forgotten
            self._last = {k: v for k, v in self._last.items() if now - v[0] < self.every_s}
        self._last[key] = (now, 0)
        self._window = (start, lines + 1)
        more = f" (and {skipped} more like it in {now - at:.0f} s)" if skipped and math.isfinite(at) else ""
        self.logger.warning(fmt + "%s", *args, more)
