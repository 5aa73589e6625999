"""Where the learner's seconds go: the bubble ratio of SPEC §3, broken down by cause.

Bubble = ``1 - (seconds inside updates) / (wall seconds of the window)``
(:func:`echo2.physics.rules.bubble_ratio`): every second the learner is not updating counts, by cause:

- ``wait``        waiting for R admissible trajectories (with the housekeeping done while waiting:
                  lease expiry, controller ticks); in the synchronous loop, generating them;
- ``publish``     serializing, hashing, signing and announcing a snapshot;
- ``eval``        held-out evaluation;
- ``checkpoint``  writing a checkpoint;
- ``log``         writing the step's metrics record and the live view;
- ``other``       whatever remains of the step's wall time (bookkeeping between the above).

A step's window runs from the end of the previous step's window to the moment its own record is
complete; writing that record is measured and counted under ``log`` in the next step's window, so
the windows tile the whole loop and the totals over a run are exact. Durations come from a
monotonic timer (``time.perf_counter``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from echo2.observe import catalog
from echo2.physics.rules import bubble_ratio

CAUSES = ("wait", "publish", "eval", "checkpoint", "log")  # measured causes; "other" is the remainder


class BubbleMeter:
    """Accumulates update seconds and idle seconds by cause, per step and over the whole window."""

    def __init__(self, timer: Callable[[], float] = time.perf_counter) -> None:
        self.timer = timer
        self.start = self.step_start = timer()
        self.start_unix = time.time()  # when the window began, for aligning runs of different processes
        self._train = 0.0
        self._idle = dict.fromkeys(CAUSES, 0.0)
        self.total_train = 0.0
        self.total_idle = dict.fromkeys((*CAUSES, "other"), 0.0)

    @contextmanager
    def idle(self, cause: str) -> Iterator[None]:
        """Count the enclosed seconds as bubble of ``cause``."""
        if cause not in self._idle:
            raise ValueError(f"unknown bubble cause {cause!r}; one of {CAUSES}")
        t0 = self.timer()
        try:
            yield
        finally:
            self._idle[cause] += self.timer() - t0

    @contextmanager
    def training(self) -> Iterator[None]:
        """Count the enclosed seconds as time inside an update."""
        t0 = self.timer()
        try:
            yield
        finally:
            self._train += self.timer() - t0

    def close_step(self) -> dict[str, float]:
        """End the current step's window: its metrics (``learner/bubble_ratio``, ``learner/step_wall_s``,
        ``learner/update_s`` (seconds inside the update, as the learner saw it), ``learner/idle_s/<cause>``),
        then start the next window."""
        now = self.timer()
        wall = now - self.step_start
        other = max(0.0, wall - self._train - sum(self._idle.values()))
        idle = {**self._idle, "other": other}
        out = {
            catalog.LEARNER_BUBBLE_RATIO.key: bubble_ratio(min(self._train, wall), wall),
            catalog.LEARNER_STEP_WALL_S.key: wall,
            catalog.LEARNER_UPDATE_S.key: self._train,
        }
        out.update({catalog.LEARNER_IDLE_S.of(c): s for c, s in idle.items()})
        self.total_train += self._train
        for c, s in idle.items():
            self.total_idle[c] += s
        self._train, self._idle, self.step_start = 0.0, dict.fromkeys(CAUSES, 0.0), now
        return out

    def summary(self) -> dict[str, object]:
        """The whole window: its wall and update seconds, bubble ratio, and idle seconds by cause."""
        wall = self.step_start - self.start
        return {
            "start_unix": self.start_unix,
            "window_s": wall,
            "train_s": self.total_train,
            "bubble_ratio": bubble_ratio(min(self.total_train, wall), wall),
            "idle_s_by_cause": dict(self.total_idle),
        }
