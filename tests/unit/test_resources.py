"""A full descriptor table or disk never ends the run (echo2/resources.py): writes that matter wait it out,
then give up only what can be given up (a publication is served from memory, a checkpoint is left to
the next step), and the descriptor limit is raised to what the system allows."""

from __future__ import annotations

import errno
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from echo2.config import SnapshotConfig
from echo2.resources import descriptor_limits, is_exhausted, raise_descriptor_limit, retry_exhausted
from echo2.weights import publication
from echo2.weights.publication import PublishedChain


def _failing(errs: list[int]) -> Any:
    """A callable that raises OSError(errno) for each of ``errs``, then returns "done"."""
    left = list(errs)

    def fn() -> str:
        if left:
            code = left.pop(0)
            raise OSError(code, errno.errorcode[code])
        return "done"

    return fn


def test_retry_exhausted_waits_out_exhaustion_and_nothing_else() -> None:
    waits: list[float] = []
    shed: list[int] = []
    got = retry_exhausted(
        _failing([errno.EMFILE, errno.ENOSPC]),
        "a write",
        (0.1, 0.2, 0.3),
        lambda: shed.append(1),
        waits.append,
    )
    assert got == "done" and waits == [0.1, 0.2] and len(shed) == 2
    with pytest.raises(OSError) as caught:  # exhausted every wait: the last failure propagates
        retry_exhausted(_failing([errno.ENFILE] * 5), "a write", (0.1, 0.2), sleep=waits.append)
    assert caught.value.errno == errno.ENFILE
    with pytest.raises(PermissionError):  # not exhaustion: at once, no wait
        retry_exhausted(_failing([errno.EACCES]), "a write", (0.1,), sleep=lambda s: pytest.fail("waited"))
    assert is_exhausted(OSError(errno.EDQUOT, "quota")) and not is_exhausted(ValueError("x"))


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one() -> None:
    soft = raise_descriptor_limit(64)
    now_soft, hard = descriptor_limits()
    assert soft == now_soft and (now_soft == hard or hard == -1)


@pytest.mark.parametrize(
    ("hard", "workers", "level"), [(20000, 64, "INFO"), (1024, 64, "INFO"), (1024, 1000, "WARNING")]
)
def test_a_cut_connection_cap_warns_only_where_the_fleet_may_not_fit(
    monkeypatch: Any, caplog: Any, hard: int, workers: int, level: str
) -> None:
    """The default caps (16,384 a port) need more descriptors than most hard limits: the cut is logged,
    and at WARNING only when a port may hold fewer than two connections for each of the token's workers."""
    from echo2.config import load_config
    from echo2.runtime import learner

    monkeypatch.setattr(learner, "raise_descriptor_limit", lambda need: hard)
    cfg = load_config(overrides=[f"security.max_workers={workers}"])
    with caplog.at_level("INFO", logger=learner.log.name):
        limits = learner._perimeter_limits(cfg)
    cut = [r for r in caplog.records if "connection caps" in r.getMessage()]
    assert limits.max_connections < cfg.security.perimeter.max_connections
    assert [r.levelname for r in cut] == [level], caplog.text


def test_a_publication_that_cannot_be_spilled_is_served_from_memory(tmp_path: Path, monkeypatch: Any) -> None:
    chain = PublishedChain(SnapshotConfig(), tmp_path, 1, "")

    def full(path: Path, blob: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(publication, "spill_file", full)
    monkeypatch.setattr(publication, "retry_exhausted", lambda fn, what: fn())
    blob = b"x" * 100
    assert chain.spill(3, blob) is blob and chain.spill_failures == 1
    assert not list(tmp_path.glob("v*.bin"))  # nothing half-written left behind
    monkeypatch.setattr(
        publication, "spill_file", lambda path, b: (_ for _ in ()).throw(PermissionError("no"))
    )
    with pytest.raises(PermissionError):  # another error is no exhaustion: raised
        chain.spill(4, blob)


def test_a_checkpoint_that_cannot_be_written_is_skipped_and_the_run_goes_on(monkeypatch: Any) -> None:
    from echo2.runtime.loop import LearnerLoop

    calls: list[str] = []

    def save(name: str) -> str:
        calls.append(name)
        raise OSError(errno.EMFILE, "Too many open files")

    loop = SimpleNamespace(save=save, last_ckpt="step_000010", checkpoints_failed=0)
    ok = LearnerLoop._checkpoint(loop, "step_000020", (0.0, 0.0))  # type: ignore[arg-type]
    assert ok is False and loop.checkpoints_failed == 1 and loop.last_ckpt == "step_000010"
    assert calls == ["step_000020"] * 3  # tried, then after each of the two waits
    loop.save = lambda name: f"/ckpt/{name}"
    assert LearnerLoop._checkpoint(loop, "step_000030", ()) is True  # type: ignore[arg-type]
    assert loop.last_ckpt == "/ckpt/step_000030"


def test_collection_paused_nests_across_threads_and_restores_what_it_found() -> None:
    import gc
    import threading

    from echo2.resources import collection_paused, paused

    assert gc.isenabled()
    inside = threading.Event()
    leave = threading.Event()

    def hold() -> None:
        with collection_paused():
            inside.set()
            leave.wait(5)

    t = threading.Thread(target=hold)
    t.start()
    inside.wait(5)
    with collection_paused():  # a second holder, in another thread
        assert not gc.isenabled()
    assert not gc.isenabled()  # the first still holds it
    leave.set()
    t.join()
    assert gc.isenabled()
    assert paused(gc.isenabled) is False and gc.isenabled()
    gc.disable()  # disabled by someone else: left so
    try:
        with collection_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_gc_clock_counts_the_collectors_pauses_and_its_full_collections() -> None:
    import gc

    from echo2.resources import GcClock

    clock = GcClock()
    try:
        junk = [[i] for i in range(200_000)]  # something for a full collection to traverse
        gc.collect(0)
        young = clock.full
        gc.collect()
        assert clock.full == young + 1 and clock.seconds > 0.0
        del junk
    finally:
        clock.close()
    assert clock._on not in gc.callbacks
    before = clock.full
    gc.collect()
    assert clock.full == before  # closed: no longer counting
