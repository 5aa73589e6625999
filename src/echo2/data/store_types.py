"""What the trajectory store hands back: the fate of a submission, a lease as kept, the store's counters."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from echo2.observe import catalog
from echo2.types import Prompt


@dataclass(frozen=True)
class SubmitResult:
    """What became of an accepted submission."""

    admitted: int  # trajectories stored for training
    dropped_stale: int  # trajectories accepted but discarded: policy_version < v_t - S
    held: int = 0  # of the admitted, trajectories not trainable until their generation check passes
    zero_variance: int = 0  # of the admitted, trajectories of groups whose rewards are all equal, not trained


@dataclass(frozen=True)
class Lease:
    """A lease as the store keeps it."""

    lease_id: str
    worker_id: str  # the worker it was issued to
    state: str  # open, expired or submitted
    issued_at: float  # clock time it was issued
    prompts: list[Prompt]  # in lease order
    seed: int  # the sampling seed it assigned (row i*G + j samples prompt i's j-th completion)
    installed_version: int  # the version the worker said it held when it asked for the lease
    epoch: int = 0  # the run epoch of the learner process that issued it


@dataclass(frozen=True)
class StoreStats:
    """Store counters; ``admitted``, ``dropped_stale`` and ``size`` count trajectories."""

    size: int  # buffered: admissible unconsumed trajectories (at the last learner version seen)
    admitted: int  # trajectories ever stored for training
    dropped_stale: int  # trajectories discarded as too old, at submit or at take_batch
    rejected: int  # submissions rejected, all reasons
    rejected_by_reason: dict[str, int]  # submissions rejected, per reason code
    purged: int  # trajectories purged untrained because their worker was quarantined
    poisoned: int  # groups purged because their loss or gradient was not finite (of those purged)
    leases_open: int  # leases issued and neither submitted nor expired
    leases_expired: int  # leases ever expired
    admitted_tokens: int = 0  # completion tokens of the trajectories ever stored for training
    held: int = 0  # of ``size``, trajectories waiting for their generation check (not yet trainable)
    unchecked_dropped: int = 0  # trajectories discarded because their generation check could not run
    zero_variance: int = 0  # admitted trajectories of groups whose rewards were all equal, never trained
    trained: int = 0  # trajectories updates have taken (less those a restart handed back or poison purged)
    stale_buffered: int = 0  # of ``dropped_stale``, those admitted first and dropped before an update

    def useful_share(self) -> float:
        """Of the admitted trajectories, the share a batch can use (not left out as zero-variance)."""
        return 1.0 - self.zero_variance / self.admitted if self.admitted else 1.0

    def received(self) -> int:
        """Trajectories that reached the learner's store: admitted, or dropped as stale on arrival."""
        return self.admitted + self.dropped_stale - self.stale_buffered

    def yield_metrics(self) -> dict[str, float]:
        """The run's yield: of the trajectories received, the share trained, and the shares lost by
        cause (stale, zero variance, purged with a quarantined worker or as poison, unchecked) or still
        waiting (buffered)."""
        n = self.received()
        if not n:
            return {}
        return {
            catalog.STORE_YIELD.key: self.trained / n,
            catalog.STORE_YIELD_LOST.of("stale"): self.dropped_stale / n,
            catalog.STORE_YIELD_LOST.of("zero_variance"): self.zero_variance / n,
            catalog.STORE_YIELD_LOST.of("purged"): self.purged / n,
            catalog.STORE_YIELD_LOST.of("unchecked"): self.unchecked_dropped / n,
            catalog.STORE_YIELD_LOST.of("buffered"): self.size / n,
        }

    def metrics(self) -> dict[str, float]:
        """SPEC §7 keys ``store/size``, ``store/admitted``, ``store/dropped_stale``, ``store/rejected``,
        plus ``store/rejected/<reason>``."""
        out: dict[str, float] = {
            catalog.STORE_SIZE.key: self.size,
            catalog.STORE_ADMITTED.key: self.admitted,
            catalog.STORE_DROPPED_STALE.key: self.dropped_stale,
            catalog.STORE_ZERO_VARIANCE.key: self.zero_variance,
            catalog.STORE_REJECTED.key: self.rejected,
            catalog.STORE_PURGED.key: self.purged,
            catalog.STORE_POISONED.key: self.poisoned,
            catalog.STORE_HELD.key: self.held,
            catalog.STORE_UNCHECKED_DROPPED.key: self.unchecked_dropped,
            catalog.STORE_TRAINED.key: self.trained,
            **self.yield_metrics(),
        }
        for reason, n in sorted(self.rejected_by_reason.items()):
            out[catalog.STORE_REJECTED_BY.of(reason)] = n
        return out


# prompts as a lease keeps them (one JSON text)
_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def encode_prompts(prompts: Sequence[Prompt]) -> str:
    return _JSON.encode([[p.prompt_id, p.text, p.answer, p.meta] for p in prompts])


def decode_prompts(text: str) -> list[Prompt]:
    return [Prompt(prompt_id=i, text=t, answer=a, meta=m) for i, t, a, m in json.loads(text)]


def lease_prompts(groups: Sequence[tuple[str, str | None]], reason: str) -> list[tuple[Prompt, str]]:
    """The prompt of each ``(prompt_id, its lease's prompts)`` (one per group; a group with no lease
    row, or whose prompt the lease lacks, has none), with ``reason``."""
    out = []
    for pid, text in groups:
        by_id = {p.prompt_id: p for p in decode_prompts(text)} if text else {}
        if pid in by_id:
            out.append((by_id[pid], reason))
    return out
