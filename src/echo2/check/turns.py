"""The update comes first: the learner's update and its background work take turns.

The generation check (``tasks/verify.py``) runs on a thread of its own beside the update. On a machine
whose cores the update keeps busy, niceness alone does not keep it out of the update's way: a check
computing on one core holds up the update's compute threads at every parallel region they share
(measured on two cores: 1.13x the update's time with the checker at niceness 19,
results/check_scale.json). So a background job gives its turn back between chunks of its work:

- while an update runs (:meth:`Turns.updating`), after a chunk that took ``w`` seconds it waits
  ``w x (1 / duty - 1)`` seconds, or until the update ends if that comes first: it computes at most
  ``duty`` of the update's time (``security.check_duty``);
- between updates (waiting for a batch, publishing, evaluating) it is never held;
- a piece of work that is due (its ``due()`` says so when it pauses: a new identity's check, or one
  whose held groups the next update would leave behind) is never held.

``duty = 1``: never held (the thread's niceness alone); ``duty = 0``: held until the update ends (a job
that may starve while updates run back to back). One background job at a time calls :meth:`begin` and
:meth:`pause` (the checker's thread); any thread may hold :meth:`updating`.

A chunk's time is its work's, not its launch's: a job on a GPU queues kernels and returns long before
they have run, so it hands :meth:`begin` a ``sync`` (its CUDA stream's ``synchronize``) that a pause
calls before it reads the clock, when it is about to hold the job (an update running, the work not
due); on the CPU there is none and a pause reads the clock alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Turns:
    """Turns between the learner's update and one background job (see the module's docstring)."""

    def __init__(self, duty: float = 1.0) -> None:
        if not 0.0 <= duty <= 1.0:
            raise ValueError(f"duty: {duty!r} is not a share of time in [0, 1]")
        self.duty = duty
        self._idle = threading.Event()  # set: no update is running
        self._idle.set()
        self._updates = 0  # updates running now (a sharded learner's ranks may overlap theirs)
        self._lock = threading.Lock()
        self._since = time.perf_counter()  # when the job's current chunk began
        self._due: Callable[[], bool] | None = None  # whether the job's current work can no longer wait
        self._sync: Callable[[], None] | None = None  # waits until the job's queued device work has run
        self.held_s = 0.0  # seconds the job waited for updates, in all
        self.pauses = 0  # times it waited (counted as the wait begins)

    @contextmanager
    def updating(self) -> Iterator[None]:
        """The enclosed seconds are an update's: the background job computes at most ``duty`` of them."""
        with self._lock:
            self._updates += 1
            self._idle.clear()
        try:
            yield
        finally:
            with self._lock:
                self._updates -= 1
                if self._updates == 0:
                    self._idle.set()

    @property
    def update_running(self) -> bool:
        return not self._idle.is_set()

    def begin(self, due: Callable[[], bool] | None = None, sync: Callable[[], None] | None = None) -> None:
        """The background job starts a piece of work (``due``: whether it can no longer wait, asked at
        each pause; ``sync``: waits until the job's queued device work has run, or None on the CPU): its
        first chunk begins now."""
        self._since = time.perf_counter()
        self._due = due
        self._sync = sync

    def pause(self) -> None:
        """A chunk of the background job ended: wait for the update's turn if one is running (the chunk's
        time read after its device work has run, when the job has a ``sync``)."""
        if self.duty < 1.0 and not self._idle.is_set() and not (self._due is not None and self._due()):
            if self._sync is not None:
                self._sync()
            now = time.perf_counter()
            worked = now - self._since
            self.pauses += 1
            self._idle.wait(None if self.duty == 0.0 else worked * (1.0 / self.duty - 1.0))
            self.held_s += time.perf_counter() - now
        self._since = time.perf_counter()
