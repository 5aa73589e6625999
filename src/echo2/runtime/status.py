"""What a running learner node looks like from outside: one snapshot of its state, read by the live
dashboard (``/api/state``) and the Prometheus endpoint (``/metrics``) alike, so the two always agree.

Built from the parts themselves at the moment it is asked for (the registry, the pool, the snapshot
publisher) plus what the learner's metric records say (fed by :meth:`NodeStatus.record`, the same
records ``metrics.jsonl`` gets). Nothing here runs per step beyond appending a record.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from echo2.observe import catalog
from echo2.observe.bubble import CAUSES
from echo2.runtime.members import WorkerRegistry
from echo2.runtime.pool import Pool
from echo2.runtime.snapshots import Snapshots

SERIES = catalog.DASHBOARD_SERIES  # per-step values the dashboard draws: step, time_s, its charts' keys
MAX_POINTS = 300  # past this the series is thinned to every other point (the whole run stays drawn)
DECISIONS_SHOWN = 20
ROWS_A_SLICE = 500  # pool rows built between two turns of the event loop (state_sliced)


class NodeStatus:
    def __init__(
        self,
        registry: WorkerRegistry,
        pool: Pool,
        snapshots: Snapshots,
        staleness: int,
        kappa: int,
        version: Callable[[], int],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.registry, self.pool, self.snapshots = registry, pool, snapshots
        self.S, self.kappa, self.version, self.clock = staleness, kappa, version, clock
        self.started = clock()
        self.finished = False
        self.series: dict[str, list[Any]] = {k: [] for k in SERIES}
        self._stride, self._seen = 1, 0
        self.last: dict[str, Any] = {}  # the newest step record
        self.accuracy: float | None = None  # the newest held-out accuracy
        self.staleness_counts = [0] * (staleness + 1)  # steps by their max staleness 0..S
        self.staleness_sum = 0
        self.update_s = 0.0  # seconds inside updates, whole loop
        self.idle_s = dict.fromkeys((*CAUSES, "other"), 0.0)  # idle seconds by cause, whole loop

    def record(self, r: dict[str, Any]) -> None:
        """Take one learner step record (the one ``metrics.jsonl`` gets)."""
        if r.get(catalog.REWARD_ACCURACY.key) is not None:
            self.accuracy = r[catalog.REWARD_ACCURACY.key]
        if catalog.LEARNER_UPDATE_S.key not in r:  # the initial evaluation's record
            return
        self.last = r
        self.update_s += r[catalog.LEARNER_UPDATE_S.key]
        for cause in self.idle_s:
            self.idle_s[cause] += r.get(catalog.LEARNER_IDLE_S.of(cause), 0.0)
        stale = int(r[catalog.STORE_STALENESS_MAX.key])
        self.staleness_counts[min(stale, self.S)] += 1
        self.staleness_sum += stale
        self._seen += 1
        if self._seen % self._stride == 0:
            for k in SERIES:
                self.series[k].append(_finite(r.get(k)))
            if len(self.series[catalog.STEP.key]) > MAX_POINTS:
                self.series = {k: v[::2] for k, v in self.series.items()}
                self._stride *= 2

    def _row(self, rec: Any, now: float) -> dict[str, Any]:
        """One registered worker's row of the pool table, as of ``now``."""
        mu = self.pool.rate(rec.worker_id)
        return {
            "worker_id": rec.worker_id,
            "name": rec.name,
            "hardware": rec.hardware,
            "usd_per_hour": rec.usd_per_hour,
            "mu": mu,
            "rho": rec.usd_per_hour / mu if mu > 0 else None,
            "state": self.pool.state(rec.worker_id),
            "reason": self.pool.last_reason.get(rec.worker_id, ""),
            "installed_version": rec.installed_version,
            "install_s": rec.install_s,
            "relay_demoted": rec.relay_demoted,
            "mismatch_kl": rec.mismatch_kl,
            "rollouts": rec.rollouts,
            "last_seen_s": round(now - rec.last_seen_s, 3),
        }

    def broadcast(self) -> dict[str, Any]:
        """The newest publication: how many of the workers joined at publication installed it so far."""
        v = self.snapshots.version
        out: dict[str, Any] = {"version": v, "members": len(self.snapshots.publisher.members())}
        if v >= 0:
            st = self.snapshots.publisher.stats(v)
            out.update(
                {
                    "targets": st.n_workers,
                    "installed": len(st.install_s),
                    "bytes": st.total_size,
                    "learner_bytes": st.learner_bytes,
                }
            )
        out["t_bcast_s"] = self.snapshots.bcast.get(catalog.BROADCAST_T_BCAST_S.key)
        pub = self.snapshots.publication
        if pub:
            out["kind"] = "anchor" if pub[catalog.BROADCAST_ANCHOR.key] else "patch"
            out["full_bytes"] = pub[catalog.BROADCAST_FULL_BYTES.key]
        return out

    def state(self) -> dict[str, Any]:
        """Everything at once, JSON-ready (``/api/state``)."""
        out: dict[str, Any] = {}
        for _ in self._build(out):
            pass
        return out

    async def state_sliced(self) -> dict[str, Any]:
        """:meth:`state`, built in slices with the event loop free between them (``ROWS_A_SLICE`` pool
        rows, then each whole-pool figure): the thread that serves the fleet is never held for the whole
        of it. Each row is one moment's; rows a slice apart are milliseconds apart."""
        out: dict[str, Any] = {}
        for _ in self._build(out):
            await asyncio.sleep(0)
        return out

    def _build(self, out: dict[str, Any]) -> Iterator[None]:
        """Fill ``out`` with the state, yielding between its slices (the caller decides what runs there)."""
        records, now = list(self.registry), self.clock()
        rows: list[dict[str, Any]] = []
        for k in range(0, len(records), ROWS_A_SLICE):
            rows += [self._row(rec, now) for rec in records[k : k + ROWS_A_SLICE]]
            yield
        usd_per_hour = self.pool.usd_per_hour()
        yield
        active = len(self.pool.active_ids())
        yield
        n_min = self.pool.planned_n_min()
        yield
        wall = self.update_s + sum(self.idle_s.values())
        last = self.last
        out |= {
            "time": self.clock(),
            "elapsed_s": self.clock() - self.started,
            "finished": self.finished,
            "learner": {
                "version": self.version(),
                "staleness_budget": self.S,
                "kappa": self.kappa,
                "steps": self._seen,
                "accuracy": self.accuracy,
                "bubble_ratio": 1 - self.update_s / wall if wall > 0 else None,
                "update_s": self.update_s,
                "idle_s": dict(self.idle_s),
                "step_s": last.get(catalog.LEARNER_STEP_WALL_S.key),
                "t_train_s": last.get(catalog.LEARNER_T_TRAIN_S.key),
            },
            "store": {k.split("/", 1)[1]: v for k, v in last.items() if k.startswith("store/")},
            "security": {k.split("/", 1)[1]: v for k, v in last.items() if k.startswith("security/")},
            "cost": {"usd_per_hour": usd_per_hour, "usd_total": last.get(catalog.COST_USD_TOTAL.key, 0.0)},
            "pool": {
                "workers": rows,
                "active": active,
                "mu_pool": self.pool.controller.mu_pool(self.clock()),
                "mu_target": self.pool.controller.mu_target if self.pool.target_known else None,
                "mu_min": self.pool.mu_min,
                "n_min": n_min,
            },
            "decisions": self.pool.decisions[-DECISIONS_SHOWN:],
            "broadcast": self.broadcast(),
            "series": {k: list(v) for k, v in self.series.items()},  # a copy: a snapshot read off-thread
        }


def _finite(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v
