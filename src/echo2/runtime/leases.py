"""The lease broker of the learner node: which prompts go to which worker, and when to say no.

A lease is granted only (in this order of refusal reasons):
- while the run is not finished                          [finished]
- to a worker the pool controller has active              [inactive]
- whose installed version is still admissible (``>= v_t - S``), so it never generates what the
  learner would discard                                   [stale_weights]
- and not newer than ``v_t``: such weights were published by a learner process that crashed after
  its last checkpoint, and this one will publish other weights under the same number  [rolled_back]
- while leased-but-unsubmitted plus buffered rollouts stay within
  ``min(max_inflight_batches, S + 1) * R``                [buffer_full]
- and the worker holds fewer than ``max_leases_per_worker`` open leases   [too_many_leases]
  (so one worker ties up at most ``max_leases_per_worker * lease_prompts * G`` of the in-flight budget)

Each lease assigns a fresh random sampling seed (the worker samples with seeded Gumbel-max under it,
so the learner can re-derive any sampled token, ``runtime/verify.py``) and records the version the
worker said it held (a submission claiming an older one is refused).

Prompts of expired leases are leased again first, then fresh draws from the task. The learner's
version is read from one provider (the trainer), never pushed in.
"""

from __future__ import annotations

import random
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from echo2.config import BatchConfig, RuntimeConfig, StalenessConfig
from echo2.data.store import TrajectoryStore
from echo2.data.tasks.base import Task
from echo2.physics.rules import admission_floor
from echo2.protocol import LeaseGrant, LeaseRefusal, LeaseRequest
from echo2.types import Prompt

SEED_BITS = 53  # lease seeds stay exact in any JSON reader


class PromptSource:
    """Training prompts for leases: prompts of expired leases first, then fresh draws from the task."""

    def __init__(self, task: Task, seed: int) -> None:
        self.task = task
        self.rng = random.Random(f"leases:{seed}")
        self.reissue: deque[Prompt] = deque()

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps so a resumed run draws on where it was (JSON)."""
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss], "reissue": [asdict(p) for p in self.reissue]}

    def restore(self, state: dict[str, Any] | None) -> None:
        """Continue from :meth:`state` (None: a checkpoint written before it was kept: start over)."""
        if state is None:
            return
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.reissue = deque(Prompt(**p) for p in state["reissue"])

    def take(self, n: int) -> list[Prompt]:
        out = [self.reissue.popleft() for _ in range(min(n, len(self.reissue)))]
        if len(out) < n:
            out += self.task.sample_train(self.rng, n - len(out))
        return out


class LeaseBroker:
    def __init__(
        self,
        store: TrajectoryStore,
        prompts: PromptSource,
        batch: BatchConfig,
        staleness: StalenessConfig,
        runtime: RuntimeConfig,
        version: Callable[[], int],
        is_active: Callable[[str], bool],
        clock: Callable[[], float],
    ) -> None:
        self.store = store
        self.prompts = prompts
        self.batch = batch
        self.S = staleness.S
        self.rt = runtime
        self.version = version  # the learner's v_t (the trainer's, read on every call)
        self.is_active = is_active  # the pool controller's say
        self.clock = clock
        self.inflight_cap = int(min(runtime.max_inflight_batches, self.S + 1) * batch.rollouts)
        self.finished = False  # the run is over: no more leases

    @property
    def min_version(self) -> int:
        """Oldest generating version still admissible: ``v_t - S`` (SPEC §2)."""
        return admission_floor(self.version(), self.S)

    def grant(self, worker_id: str, req: LeaseRequest) -> LeaseGrant | LeaseRefusal:
        """A lease of up to ``max_prompts`` prompts, or why not (and when to ask again)."""
        n = min(req.max_prompts, self.rt.lease_prompts)
        refusal = self._refusal(worker_id, req.installed_version, n)
        if refusal is not None:
            return refusal
        prompts = self.prompts.take(n)
        seed = secrets.randbits(SEED_BITS)  # not the run's seed: workers know that one
        lease_id = self.store.issue_lease(
            worker_id, prompts, self.clock(), self.rt.lease_ttl_s, seed, req.installed_version
        )
        return LeaseGrant(
            lease_id=lease_id,
            prompts=prompts,
            group_size=self.batch.group_size,
            min_version=self.min_version,
            expires_in_s=self.rt.lease_ttl_s,
            seed=seed,
        )

    def _refusal(self, worker_id: str, installed: int, n: int) -> LeaseRefusal | None:
        retry = self.rt.heartbeat_s / 4
        if self.finished:
            return LeaseRefusal(reason="finished", retry_after_s=retry)
        if not self.is_active(worker_id):
            return LeaseRefusal(reason="inactive", retry_after_s=retry * 4)
        if installed < self.min_version:
            return LeaseRefusal(reason="stale_weights", retry_after_s=retry, min_version=self.min_version)
        if installed > self.version():  # weights of a learner process that was rolled back to a checkpoint
            return LeaseRefusal(reason="rolled_back", retry_after_s=retry, min_version=self.min_version)
        if self.store.outstanding_rollouts() + n * self.batch.group_size > self.inflight_cap:
            return LeaseRefusal(reason="buffer_full", retry_after_s=retry)
        if self.store.open_leases(worker_id) >= self.rt.max_leases_per_worker:
            return LeaseRefusal(reason="too_many_leases", retry_after_s=retry)
        return None

    def expire(self) -> int:
        """Leases past their deadline give their prompts back for re-issue; returns how many prompts."""
        prompts = self.store.expire_leases(self.clock())
        self.prompts.reissue.extend(prompts)
        return len(prompts)
