"""The process's operating-system resources: the descriptor limit, and writes that survive exhaustion.

A learner serves two ports to strangers, so its descriptors are a resource they compete for. At start
it raises its soft ``RLIMIT_NOFILE`` to the hard limit (:func:`raise_descriptor_limit`) and hands each
port a connection cap well under it (``echo2.perimeter``), keeping :data:`RESERVED_FDS` descriptors for
its own files (the store, checkpoints, published spills, logs, the grading process's pipes). Should the
table fill anyway (another process's leak, a cap set too high), or the disk, a write that matters is
retried rather than ending the run (:func:`retry_exhausted`): the caller then decides what it gives up
(a publication served from memory instead of a file, a checkpoint left to the next step), never the run.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

log = logging.getLogger(__name__)

RESERVED_FDS = 256  # descriptors kept for the process's own files, whatever the connection caps
# errors that say a resource is exhausted (descriptors, the disk), not that the write is wrong
EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOSPC, errno.EDQUOT})
RETRY_DELAYS_S = (0.05, 0.2, 0.5, 1.0, 2.0)  # waits between the tries of :func:`retry_exhausted`

T = TypeVar("T")
_holders = 0  # holders of collection_paused(), over every thread
_resume = False  # whether the collector was enabled when the first holder paused it
_paused_lock = threading.Lock()


def descriptor_limits() -> tuple[int, int]:
    """(soft, hard) ``RLIMIT_NOFILE`` of this process; (1024, 1024) where the platform has none."""
    try:
        import resource
    except ImportError:  # not POSIX
        return 1024, 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return int(soft), int(hard)


def raise_descriptor_limit(need: int | None = None) -> int:
    """Raise the soft descriptor limit to the hard one (an unlimited hard limit: to ``need``, at least
    the soft one); returns the soft limit now in force. Whether that is enough is the caller's to say
    (the learner: ``runtime.learner._perimeter_limits``)."""
    soft, hard = descriptor_limits()
    try:
        import resource

        target = hard if hard != resource.RLIM_INFINITY else max(soft, need or soft)
        if target > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    except (ImportError, ValueError, OSError) as exc:  # a container may refuse; keep what there is
        log.info("descriptor limit stays at %d (%s)", soft, exc)
    return soft


def is_exhausted(exc: BaseException) -> bool:
    """Whether ``exc`` says a resource ran out (descriptors, disk space, quota)."""
    return isinstance(exc, OSError) and exc.errno in EXHAUSTED


def retry_exhausted(
    fn: Callable[[], T],
    what: str,
    delays: tuple[float, ...] = RETRY_DELAYS_S,
    on_exhausted: Callable[[], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``fn()``, tried again after each of ``delays`` while it fails because a resource is exhausted
    (:func:`is_exhausted`); ``on_exhausted`` is called before each wait (e.g. to shed connections). The
    last failure propagates, as does any other error at once. Blocking: call it from a worker thread."""
    for delay in (*delays, None):
        try:
            return fn()
        except OSError as exc:
            if delay is None or not is_exhausted(exc):
                raise
            log.warning("%s: %s; trying again in %.2f s", what, exc.strerror or exc, delay)
            if on_exhausted is not None:
                on_exhausted()
            sleep(delay)
    raise AssertionError("unreachable")  # the loop returns or raises


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a burst of short-lived containers is built (a broadcast
    plan and its announcements for 10,000 members allocate about a million: each full collection they
    trigger traverses every object of the learner, the model's included). Memory is still freed by
    reference counting; cycles wait for the collector, which runs again when the last holder leaves.
    Nested and concurrent holders (threads) are counted; one that found it disabled by someone else leaves
    it so. Measured: ``benchmarks/fleet.py --study publish``."""
    global _holders, _resume
    with _paused_lock:
        if _holders == 0:
            _resume = gc.isenabled()
            gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _paused_lock:
            _holders -= 1
            if _holders == 0 and _resume:
                gc.enable()


def paused(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` under :func:`collection_paused` (for ``asyncio.to_thread``)."""
    with collection_paused():
        return fn(*args)


class GcClock:
    """The cyclic collector's pauses in this process, from a ``gc.callbacks`` entry: seconds in all
    collections and the number of full (oldest-generation) ones since it started. Every thread waits on a
    collection (it holds the interpreter lock): in the learner, the update and the event loop that serves
    the fleet; a full one traverses every object the process holds."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._t0: float | None = None
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self.full += info.get("generation") == 2
            self._t0 = None

    def close(self) -> None:
        if self._on in gc.callbacks:
            gc.callbacks.remove(self._on)
