"""A stop asked for while the learner runs its held-out evaluation (a Ctrl-C at step 0 or at the end of a
run) ends that evaluation at its next generation step instead of waiting for it: at real answer lengths on
a CPU one evaluation takes minutes."""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import torch

from echo2.learner.sharded import Ranks

MAX_NEW_TOKENS = 1024


def test_a_halt_ends_a_generation_at_its_next_step_and_says_so():
    ranks = Ranks()
    assert not ranks.all_done(torch.tensor([True, False])) and not ranks.halted
    ranks.halt.set()
    assert ranks.all_done(torch.tensor([True, False])) and ranks.halted  # cut short
    ranks.halted = False
    assert ranks.all_done(torch.tensor([True, True])) and not ranks.halted  # it had ended anyway


def test_a_stop_during_the_held_out_evaluation_cuts_it_short(user_checkpoint, tmp_path):
    from echo2.config import load_config
    from echo2.runtime.core import LearnerCore
    from echo2.runtime.loop import LearnerLoop

    cfg = load_config(
        overrides=[
            f"model.path={str(user_checkpoint)!r}",
            "task.name=math",
            f"sampling.max_new_tokens={MAX_NEW_TOKENS}",
            "train.eval_size=16",
        ]
    )
    core = LearnerCore.load(cfg, tmp_path / "run")
    steps = []
    agree = core.engine.all_done
    core.engine.all_done = lambda done_B: steps.append(1) or agree(done_B)  # the engine's steps, counted
    store = SimpleNamespace(stats=lambda: SimpleNamespace(admitted=0, admitted_tokens=0))
    loop = LearnerLoop(core, store, feed=None)  # type: ignore[arg-type]

    async def stopped_midway() -> tuple[object, float]:
        evaluation = asyncio.ensure_future(loop.evaluate())
        while not steps:  # the generation under way
            await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        loop.stop.set()
        return await evaluation, time.perf_counter() - t0

    try:
        ev, waited = asyncio.run(stopped_midway())
        cut = len(steps)
        assert ev is None, ev  # no score from a cut evaluation
        assert waited < 5.0 and math.isnan(core.first_acc) and math.isnan(core.last_acc)
        assert not core.ranks.halt.is_set()  # the next evaluation is whole
        steps.clear()
        loop.stop.clear()
        ev = asyncio.run(loop.evaluate())
        assert ev is not None and ev.n == len(core.plane.eval_prompts) and core.first_acc == ev.accuracy
        assert cut < len(steps) / 4, (cut, len(steps))  # the whole one ran on: the stop cut the first
    finally:
        core.run_dir.close()


def test_a_run_stopped_during_its_first_evaluation_says_its_score_was_not_read():
    from echo2.cli.run import held_out

    def summary(a: float, b: float, score: str = "accuracy") -> SimpleNamespace:
        return SimpleNamespace(initial_accuracy=a, final_accuracy=b, best_accuracy=max(a, b), score=score)

    assert held_out(summary(0.25, 0.5)) == "held-out accuracy 25.0% -> 50.0% (best 50.0%)"
    assert held_out(summary(math.nan, math.nan)) == (
        "held-out score not read (stopped during the starting evaluation)"
    )  # not "nan% -> nan%"
