"""The live terminal view of a run: one status line refreshed per learner step (tqdm).

It follows whichever limit binds, the wall-clock budget (seconds) or the step count, and shows the
step's headline metrics when the record has them: version, train reward, the last held-out accuracy,
bubble ratio, staleness, active workers and $/h.
"""

from __future__ import annotations

from typing import Any

from echo2.config import TrainConfig

_FIELDS = (  # postfix name, metric key, format
    ("v", "learner/version", "{}"),
    ("reward", "reward/mean", "{:.2f}"),
    ("acc", "reward/accuracy", "{:.2f}"),
    ("bubble", "learner/bubble_ratio", "{:.2f}"),
    ("stale", "store/staleness_max", "{}"),
    ("workers", "pool/active_workers", "{}"),
    ("usd_h", "cost/usd_per_hour", "{:.2f}"),
)


class ProgressView:
    def __init__(self, train: TrainConfig, desc: str, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.budget = train.max_minutes * 60 if train.max_minutes else None
        self.last: dict[str, Any] = {}  # newest value of each field (accuracy is not in every record)
        self.bar = tqdm(
            total=round(self.budget) if self.budget else train.steps,
            unit="s" if self.budget else "step",
            bar_format="{l_bar}{bar}| {n:.0f}/{total} s [{elapsed}<{remaining}{postfix}]"
            if self.budget
            else None,
            disable=not enabled,
            desc=desc,
            dynamic_ncols=True,
        )

    def update(self, record: dict[str, Any]) -> None:
        if self.budget:
            self.bar.update(min(record["time_s"], self.bar.total) - self.bar.n)
        else:
            self.bar.update(1)
        for name, key, fmt in _FIELDS:
            if record.get(key) is not None:
                self.last[name] = fmt.format(record[key])
        self.bar.set_postfix(self.last)

    def close(self) -> None:
        self.bar.close()
