"""A process's resident memory as the memory benchmarks read it (``memory.py``, ``lora.py``,
``check_scale.py``), and the allocator setting a learner process starts with."""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource


def trim() -> None:
    """Return freed heap pages to the system (glibc's ``malloc_trim``; elsewhere nothing)."""
    with contextlib.suppress(OSError):  # not glibc: resident memory is read untrimmed
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def rss() -> int:
    """Resident bytes of this process, after returning freed heap pages to the system."""
    trim()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """The largest resident bytes this process has had (``ru_maxrss``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak() -> None:
    """Start a new peak: ``VmHWM`` set to the resident memory now (Linux ``/proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_since_reset() -> int:
    """The largest resident bytes since :func:`reset_peak` (``VmHWM``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def as_the_learner(glibc_default: bool = False) -> None:
    """What every learner command does before it builds a model (``configure_torch``): glibc's mmap
    threshold fixed at ``learner.malloc_mmap_threshold`` (``glibc_default``: left as glibc has it)."""
    from echo2.config import LearnerConfig
    from echo2.models.policy import return_freed_memory

    if not glibc_default:
        return_freed_memory(LearnerConfig().malloc_mmap_threshold)
