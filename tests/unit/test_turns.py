"""The learner's update and its background work take turns (check/turns.py)."""

from __future__ import annotations

import threading
import time

import pytest

from echo2.check.turns import Turns
from echo2.config import SecurityConfig
from echo2.errors import ConfigError


def _pause_in_thread(turns: Turns) -> tuple[threading.Thread, list[float]]:
    took: list[float] = []

    def job() -> None:
        t0 = time.perf_counter()
        turns.pause()
        took.append(time.perf_counter() - t0)

    th = threading.Thread(target=job)
    th.start()
    return th, took


def test_between_updates_a_job_is_never_held():
    turns = Turns(0.0)
    turns.begin()
    time.sleep(0.05)
    t0 = time.perf_counter()
    turns.pause()
    assert time.perf_counter() - t0 < 0.02
    assert turns.pauses == 0 and turns.held_s == 0.0


def test_at_duty_zero_a_job_waits_for_the_update_to_end():
    turns = Turns(0.0)
    with turns.updating():
        assert turns.update_running
        th, took = _pause_in_thread(turns)
        time.sleep(0.3)
        assert th.is_alive()  # held while the update runs
    th.join(5)
    assert not th.is_alive() and 0.25 <= took[0] < 2.0
    assert turns.pauses == 1 and turns.held_s >= 0.25
    assert not turns.update_running


def test_a_job_computes_at_most_its_duty_of_an_update():
    """A chunk of 0.1 s at duty 0.25 waits 0.3 s more, though the update goes on."""
    turns = Turns(0.25)
    with turns.updating():
        turns.begin()
        time.sleep(0.1)  # the chunk
        t0 = time.perf_counter()
        turns.pause()
        waited = time.perf_counter() - t0
    assert 0.28 <= waited < 0.6


def test_a_gpu_jobs_chunk_counts_its_device_work_not_its_launch():
    """A chunk on a GPU returns once its kernels are queued; its work runs after. The pause synchronises
    (the job's ``sync``) before it reads the clock, so a chunk whose launch took nothing and whose device
    work took 0.1 s waits 0.3 s at duty 0.25, as a CPU chunk of 0.1 s does; without the sync it would
    not wait at all."""
    turns = Turns(0.25)
    syncs = []

    def sync() -> None:  # the queued device work of the chunk, done when this returns
        syncs.append(time.perf_counter())
        time.sleep(0.1)

    with turns.updating():
        turns.begin(sync=sync)  # the chunk's launches take no time
        t0 = time.perf_counter()
        turns.pause()
        took = time.perf_counter() - t0
    assert len(syncs) == 1 and 0.1 + 0.28 <= took < 0.8  # its 0.1 s of device work, then 0.3 s held
    assert 0.28 <= turns.held_s < 0.6


def test_the_sync_costs_nothing_when_the_job_is_not_held():
    """Between updates, at duty 1, and for due work, a pause never synchronises (no cost on the CPU,
    where there is no sync at all, nor on a GPU when nothing is held)."""
    calls = []
    for duty, running, due in ((0.25, False, False), (1.0, True, False), (0.25, True, True)):
        turns = Turns(duty)
        turns.begin(lambda due=due: due, sync=lambda: calls.append(1))
        if running:
            with turns.updating():
                turns.pause()
        else:
            turns.pause()
    assert calls == []


def test_overlapping_updates_hold_the_job_until_the_last_ends():
    turns = Turns(0.0)
    first, second = turns.updating(), turns.updating()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert turns.update_running
    th, _ = _pause_in_thread(turns)
    time.sleep(0.1)
    assert th.is_alive()
    second.__exit__(None, None, None)
    th.join(5)
    assert not th.is_alive()


def test_work_that_is_due_is_never_held():
    """A check whose held groups the next update would leave behind does not wait; asked at each pause."""
    turns = Turns(0.0)
    due = [True]
    with turns.updating():
        turns.begin(lambda: due[0])
        t0 = time.perf_counter()
        turns.pause()
        assert time.perf_counter() - t0 < 0.02 and turns.pauses == 0
        due[0] = False
        th, _ = _pause_in_thread(turns)
        time.sleep(0.1)
        assert th.is_alive()  # no longer due: held
    th.join(5)
    assert not th.is_alive()


def test_at_duty_one_a_job_is_never_held():
    turns = Turns(1.0)
    with turns.updating():
        t0 = time.perf_counter()
        turns.pause()
        assert time.perf_counter() - t0 < 0.02


@pytest.mark.parametrize("duty", [-0.1, 1.5])
def test_a_duty_that_is_no_share_of_time_is_refused(duty):
    with pytest.raises(ValueError, match="duty"):
        Turns(duty)
    with pytest.raises((ConfigError, ValueError), match="check_duty"):
        SecurityConfig(check_duty=duty)


def test_the_learner_core_holds_the_turns_during_its_update(user_checkpoint, tmp_path):
    """The learner's update (LearnerCore.update) is what the check gives the cores to, at the configured
    duty; outside it the check is never held."""
    from echo2.config import load_config
    from echo2.runtime.core import LearnerCore

    cfg = load_config(
        overrides=[f"model.path={str(user_checkpoint)!r}", "task.name=math", "security.check_duty=0.1"]
    )
    core = LearnerCore.load(cfg, tmp_path / "run")
    try:
        assert core.turns.duty == 0.1 and not core.turns.update_running
        seen = []

        def update(batch):
            seen.append(core.turns.update_running)
            if not batch:
                raise RuntimeError("no batch")
            return "stats"

        core.plane.trainer.update = update
        assert core.update(["t"]) == "stats"
        with pytest.raises(RuntimeError, match="no batch"):  # a failed update ends its turn too
            core.update([])
        assert seen == [True, True] and not core.turns.update_running
    finally:
        core.run_dir.close()
