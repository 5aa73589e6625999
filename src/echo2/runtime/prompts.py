"""The training prompts the learner leases out: epochs over a finite training split, nothing skipped
silently.

Order of what :meth:`PromptSource.take` hands out:

1. **Prompts to do again**, oldest first: those of leases that expired unanswered (or whose answer was
   refused), and those whose groups were discarded untrained — dropped as too stale, purged with a
   quarantined worker, or left out of an update as poison (the store reports them:
   ``TrajectoryStore.take_redo``). A prompt whose admitted groups were dropped as stale ``MAX_REDO``
   times (the learner never got to them in time: its completions are always the slow ones) is given up:
   counted in ``data/prompts_skipped``, with the reason, and logged. An answer already too stale when it
   came (``late``) never counts toward that: it is its worker's lateness (a strike), and a worker that
   hoards leases to answer them stale cannot make the run give up a prompt.
2. **The epoch**: for a task whose training split is finite (a dataset file: ``Task.train_prompts``),
   a seeded permutation of the whole split, each prompt once per epoch; the next epoch is another
   permutation (of seed and epoch number: a resumed run continues the same epoch at the same place).
   For a stream (synthetic problems, environment seeds), fresh draws of ``Task.sample_train``.

So every training prompt of an epoch is leased until it is trained on once (an answer that comes after
its lease expired, and was leased again, is trained as well), or it is counted as skipped with a reason.
"""

from __future__ import annotations

import logging
import random
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from echo2.logs import SampledLog
from echo2.observe import catalog as m
from echo2.tasks.base import Task
from echo2.types import Prompt

log = logging.getLogger(__name__)

MAX_REDO = 3  # a prompt whose groups were dropped as stale this many times is given up (counted)


class PromptSource:
    """Training prompts for leases (module docstring)."""

    def __init__(self, task: Task, seed: int) -> None:
        self.task = task
        self.seed = seed
        self.rng = random.Random(f"leases:{seed}")  # a stream's draws
        self.reissue: deque[Prompt] = deque()  # prompts to lease again first
        self.split: Sequence[Prompt] | None = task.train_prompts()  # None: a stream
        self.epoch = 0  # the epoch in progress (1 = the first); 0 before the first prompt
        self.cursor = 0  # prompts of the epoch handed out
        self._order: list[int] = []
        self.redo_counts: Counter[str] = Counter()  # prompt id -> times its groups were dropped as stale
        self.requeued: Counter[str] = Counter()  # reason -> prompts put back
        self.skipped: Counter[str] = Counter()  # reason -> prompts given up
        self._given_up = SampledLog(log, every_s=60.0, per_window=1)  # a summary line, not one a prompt

    # ---- what is handed out ----------------------------------------------------------------------------
    def take(self, n: int) -> list[Prompt]:
        out = [self.reissue.popleft() for _ in range(min(n, len(self.reissue)))]
        if len(out) < n:
            out += self._fresh(n - len(out))
        return out

    def _fresh(self, n: int) -> list[Prompt]:
        if self.split is None:
            return self.task.sample_train(self.rng, n)
        out = []
        while len(out) < n:
            if self.cursor >= len(self._order) or self.epoch == 0:
                self._start_epoch(self.epoch + 1)
            out.append(self.split[self._order[self.cursor]])
            self.cursor += 1
        return out

    def _start_epoch(self, epoch: int, cursor: int = 0) -> None:
        assert self.split is not None
        self.epoch, self.cursor = epoch, cursor
        self._order = list(range(len(self.split)))
        random.Random(f"epoch:{self.seed}:{epoch}").shuffle(self._order)

    # ---- what comes back ---------------------------------------------------------------------------------
    def again(self, prompts: Sequence[Prompt]) -> None:
        """Prompts of leases that expired or whose answer was refused: leased again first."""
        self.reissue.extend(prompts)
        if prompts:
            self.requeued["expired"] += len(prompts)

    def redo(self, items: Sequence[tuple[Prompt, str]]) -> None:
        """Prompts whose groups were discarded untrained (``TrajectoryStore.take_redo``): leased again
        first, but a prompt whose admitted groups were dropped as stale ``MAX_REDO`` times is given up
        and counted (``late`` answers never count: module docstring)."""
        for prompt, reason in items:
            if reason == "stale":
                self.redo_counts[prompt.prompt_id] += 1
                if self.redo_counts[prompt.prompt_id] >= MAX_REDO:
                    del self.redo_counts[prompt.prompt_id]
                    self.skipped["stale"] += 1
                    self._given_up.log(  # one line a minute at most: the count is the metric
                        "given_up",
                        "prompt %s: its groups were dropped as stale %d times; skipped (counted in "
                        "data/prompts_skipped: %d so far)",
                        prompt.prompt_id,
                        MAX_REDO,
                        self.skipped["stale"],
                    )
                    continue
            self.reissue.append(prompt)
            self.requeued[reason] += 1

    # ---- metrics, checkpoints ----------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {
            m.DATA_PROMPTS_REQUEUED.key: float(sum(self.requeued.values())),
            m.DATA_PROMPTS_SKIPPED.key: float(sum(self.skipped.values())),
        }
        if self.split is not None and self.epoch:
            out[m.DATA_EPOCH.key] = self.epoch - 1 + self.cursor / max(1, len(self.split))
        return out

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps so a resumed run draws on where it was (JSON)."""
        version, internal, gauss = self.rng.getstate()
        return {
            "rng": [version, list(internal), gauss],
            "reissue": [asdict(p) for p in self.reissue],
            "epoch": self.epoch,
            "cursor": self.cursor,
            "redo_counts": dict(self.redo_counts),
            "requeued": dict(self.requeued),
            "skipped": dict(self.skipped),
        }

    def restore(self, state: dict[str, Any] | None) -> None:
        """Continue from :meth:`state` (None: a checkpoint written before it was kept: start over)."""
        if state is None:
            return
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.reissue = deque(Prompt(**p) for p in state["reissue"])
        if self.split is not None and state.get("epoch"):
            self._start_epoch(int(state["epoch"]), int(state.get("cursor", 0)))
        self.redo_counts = Counter(state.get("redo_counts", {}))
        self.requeued = Counter(state.get("requeued", {}))
        self.skipped = Counter(state.get("skipped", {}))
