"""Discrete-event simulator of the whole ECHO-2 system (SPEC sections 2-5), on a small heap queue.

What is simulated (one event loop, times in seconds, deterministic under ``seed``):
- learner: drops every buffered rollout that fails the admission rule ``v >= v_t - S``
  (:func:`echo2.physics.rules.is_admissible`), waits until the store holds R rollouts, takes the R
  *oldest* by arrival (whole groups, first in first out, as the real ``TrajectoryStore.take_batch``
  does), trains ``T_train``, bumps ``v``; publishes a snapshot when ``v mod kappa == 0``.
- workers: generate GRPO groups of ``group_size`` rollouts with the newest installed version; a
  group takes ``group_size / mu_i`` times a mean-one lognormal noise, times ``straggler_factor``
  with probability ``straggler_prob`` (normalized so mu_i stays the mean delivered rate).
  By default a worker stops starting groups at a publication and resumes once the new snapshot is
  installed: the serialized cycle that SPEC section 3's overlap condition (1) describes
  (``overlap_generation=True`` lets workers keep generating with the old version instead).
- broadcast: per-worker completion times from :mod:`echo2.physics.broadcast` plus ``reload_s``
  (bytes and bytes/s); ``T_bcast`` is read when ``install_quorum(N, gamma)`` workers installed.
- controller: :class:`echo2.planner.controller.PoolController` fed with heartbeats every
  ``control_interval_s``; its decisions activate / release workers (an activated worker downloads
  the latest snapshot straight from the learner before generating).
- churn: active workers leave after exponential lifetimes; new idle workers join as a Poisson
  process and become controller candidates.
- cost: the learner and every active worker are billed per second.

Invariants checked every step (``SimulationInvariantError``): observed staleness <= S; at the end,
the maximum observed staleness <= ``kappa + ceil((T_bcast_all + d_max + W_max) / T_train) - 1``
(:func:`echo2.planner.capacity.staleness_bound_after`) with the run's slowest complete dissemination,
longest group and longest wait of a taken group in the FIFO store. SPEC section 3's conservative form
(``R/mu_pool`` instead of the store wait) assumes no backlog of older rollouts; it is reported, not
asserted.

SimPy was not used: every process here is a one-shot timer, and a bare ``heapq`` loop runs the
1,000-worker x 500-step case several times faster than generator processes would. At 100,000 workers
nothing may touch every worker at every step, so: a publication is one vectorised computation and one
close event (each worker's install time sits in an array; a worker applies the installs due by now
when it next acts, and an event wakes it only if it is waiting for one: lazy installs); workers held
back by backpressure wait in a FIFO queue; the pool's rate and size are kept as running sums. The
controller's heartbeats and the churn's leaves remain per worker (the controller observes every
active worker each ``control_interval_s``).
"""

from __future__ import annotations

import heapq
import logging
import math
import random
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from echo2.errors import ConfigError
from echo2.physics.broadcast import (
    completion_times,
    star_unlimited_times,
)
from echo2.physics.rules import bubble_ratio, install_quorum, is_admissible
from echo2.planner import capacity
from echo2.planner.activation import Candidate
from echo2.planner.controller import Heartbeat, PoolController
from echo2.sim.params import _W, SimParams, SimResult, SimulationInvariantError, SimWorker, _Pub

log = logging.getLogger(__name__)
_TWO_PI = 2.0 * math.pi  # random.gauss's TWOPI

_DONE, _TRAINED, _WAKE, _CLOSE, _UNBLOCK, _CONTROL, _LEAVE, _JOIN = range(8)


def simulate(params: SimParams, workers: Sequence[SimWorker], active_ids: Sequence[str]) -> SimResult:
    """Run one simulation; ``active_ids`` are the workers running (with version 0) at t = 0."""
    return _Sim(params, workers, active_ids).run()


class _Sim:
    def __init__(self, p: SimParams, workers: Sequence[SimWorker], active_ids: Sequence[str]) -> None:
        self.p = p
        self.rng = random.Random(p.seed)
        self.useful_rng = random.Random(f"{p.seed}:useful")  # which groups a batch can use (useful_share)
        self.zero_variance = 0  # rollouts of delivered groups no batch can use, over the run
        self.delivered = 0  # rollouts delivered, over the run
        self.gauss_next: float | None = None  # the second normal of the last Box-Muller pair (_gauss)
        g = p.group_size
        self.ws: dict[str, _W] = {
            w.worker_id: _W(w, i, group_s=g / w.rollouts_per_s) for i, w in enumerate(workers)
        }
        if len(self.ws) != len(workers):
            raise ConfigError("worker ids must be unique")
        self.rows: list[_W] = list(self.ws.values())  # row -> worker
        self.specs: list[SimWorker] = list(workers)  # join templates
        # per-worker arrays (grown by doubling when workers join)
        size = max(16, len(workers))
        self.inst = np.full(size, -1, dtype=np.int64)  # newest installed version (-1: none)
        self.links = np.zeros(size)  # B_i, bytes/s
        self.links[: len(workers)] = [w.link_bytes_per_s for w in workers]
        self.on = np.zeros(size, dtype=bool)  # active and present: the targets of a publication
        self.left_at = np.full(size, math.inf)  # when a worker left (inf: present)
        self.private: dict[int, tuple[int, float]] = {}  # row -> (version, due) of a direct download
        self.open: list[_Pub] = []  # publications not yet installed everywhere, oldest first
        self.n_active = 0  # workers active (billed)
        self.rate_counts: dict[float, int] = {}  # mu_i -> active and present workers of that rate
        for w in active_ids:
            if w not in self.ws:
                raise ConfigError(f"unknown worker id {w!r} in the initial active set")
        self.q: list[tuple[float, int, int, Any, int]] = []
        self.seq = 0
        self.now = 0.0
        # learner
        self.version = 0
        self.waiting = True
        self.wait_start = 0.0
        self.step = 0
        self.step_start = 0.0
        self.store: dict[int, int] = {}  # version -> rollouts buffered (admission bookkeeping)
        # (version, arrival time) per group: take order; entries of dropped versions are skipped lazily
        self.fifo: deque[tuple[int, float]] = deque()
        self.wait_max = 0.0  # longest a taken group sat in the store (for the FIFO staleness invariant)
        self.store_total = 0
        self.in_flight = 0  # rollouts of groups being generated
        # idle workers held back by backpressure, first come first served: rows and enqueue tickets
        self.bq = np.empty(size, dtype=np.int64)
        self.bq_seq = np.empty(size, dtype=np.int64)
        self.bq_n = 0
        self.ticket = np.full(size, -1, dtype=np.int64)  # row -> its live ticket in the queue (-1: none)
        self.n_tickets = 0
        self.priv_due = np.zeros(size)  # due time of a row's direct download (0: none)
        self.unblock_at = math.inf  # a pending _UNBLOCK event
        self.cap = math.inf if p.buffer_steps is None else p.buffer_steps * p.rollouts_per_step
        self.admitted = 0
        self.dropped = 0
        self.batch_stats = (0, 0.0)
        self.t_bcast: list[float] = []
        self.install_p90: list[float] = []
        self.t_bcast_all: list[float] = []
        self.group_s_max = 0.0  # longest group generation seen (for the discrete staleness bound)
        self.bcast_cache: dict[tuple[Any, ...], np.ndarray] = {}
        self.n_pubs = 0  # publications so far (anchors and patches alternate by count)
        # cost
        self.rate_usd_h = p.learner_usd_per_hour
        self.usd = 0.0
        self.last_bill = 0.0
        self.usd_at_last_step = 0.0
        # noise normalization: E[duration multiplier] = 1
        s = p.noise_sigma
        self.ln_mu = -0.5 * s * s
        self.strag_norm = 1.0 + p.straggler_prob * (p.straggler_factor - 1.0)
        # the hot path's constants (_start), read once
        self.sigma, self.strag_p, self.strag_f = p.noise_sigma, p.straggler_prob, p.straggler_factor
        self.group_size, self.overlap = p.group_size, p.overlap_generation
        self.metrics: list[dict[str, Any]] = []
        self.idle_per_step: list[float] = []
        self.step_len: list[float] = []
        self.mu_pool_per_step: list[float] = []
        self.staleness_max = 0
        self.joined = 0
        self.left = 0
        self.decision_counts: dict[str, int] = {}  # "action/reason" -> count
        self.ctl: PoolController | None = None
        if p.controller is not None:
            assert p.mu_target is not None
            self.ctl = PoolController(p.mu_target, p.controller)
            for w in self.ws.values():
                self.ctl.add_candidate(self._cand(w.spec))
            self.ctl.activate_initial(active_ids, 0.0)
        for wid in active_ids:
            self._activate(self.ws[wid], installed=0)

    # ---- helpers ------------------------------------------------------------------------------------
    @staticmethod
    def _cand(s: SimWorker) -> Candidate:
        return Candidate(s.worker_id, s.type_name, s.usd_per_hour, s.rollouts_per_s)

    def _push(self, t: float, kind: int, obj: Any, token: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.q, (t, self.seq, kind, obj, token))

    def _bill(self) -> None:
        self.usd += self.rate_usd_h * (self.now - self.last_bill) / 3600.0
        self.last_bill = self.now

    def _pool_add(self, w: _W, sign: int) -> None:
        """Running pool sums: ``sign`` = +1 when w becomes active and present, -1 when it stops being."""
        r = w.spec.rollouts_per_s
        self.rate_counts[r] = self.rate_counts.get(r, 0) + sign
        self.on[w.idx] = sign > 0

    def _activate(self, w: _W, installed: int) -> None:
        self._bill()
        w.active = True
        self.n_active += 1
        self._pool_add(w, +1)
        self.rate_usd_h += w.spec.usd_per_hour
        if self.p.churn_mean_lifetime_s:
            self._push(self.now + self.rng.expovariate(1 / self.p.churn_mean_lifetime_s), _LEAVE, w, w.token)
        if installed >= 0:
            self.inst[w.idx] = max(int(self.inst[w.idx]), installed)
            self._start(w)
        else:  # fetch the newest snapshot straight from the learner
            v = self._published()
            dt = float(star_unlimited_times(self.p.snapshot_bytes, [w.spec.link_bytes_per_s])[0])
            self.private[w.idx] = (v, self.now + dt + self.p.reload_s)
            self.priv_due[w.idx] = self.now + dt + self.p.reload_s
            self._start(w)  # it waits for that download: schedules its wake-up

    def _deactivate(self, w: _W) -> None:
        if not w.active:
            return
        self._bill()
        w.active = False
        self.n_active -= 1
        if w.present:
            self._pool_add(w, -1)
        if w.busy:
            self.in_flight -= self.p.group_size
        w.busy = False
        w.token += 1
        w.wake_at = math.inf
        for pub in self.open:  # a released worker drops what it was receiving (it re-downloads if recalled)
            pub.cancelled.add(w.idx)
        self.ticket[w.idx] = -1  # its entry in the queue is void
        self.rate_usd_h -= w.spec.usd_per_hour

    def _published(self) -> int:
        return (self.version // self.p.kappa) * self.p.kappa

    def _sync(self, i: int) -> tuple[int, int, float]:
        """Apply the installs due by now to worker row ``i`` (lazy installs); returns the version it
        holds, and the newest version it still waits for and when it will hold it (``-1, inf``: none)."""
        have = self.inst.item(i)
        was = have
        wait_v, wait_t = -1, math.inf
        for pub in self.open:
            if pub.version <= have or i in pub.cancelled:
                continue
            due = pub.due.item(i)
            if due <= self.now:
                have = pub.version
            elif due < math.inf:
                wait_v, wait_t = pub.version, due
        got = self.private.get(i)
        if got is not None:
            v, due = got
            if due <= self.now:
                have = max(have, v)
                del self.private[i]
                self.priv_due[i] = 0.0
            elif v > have and v > wait_v:
                wait_v, wait_t = v, due
        if have != was:
            self.inst[i] = have
        return (have, wait_v, wait_t) if wait_v > have else (have, -1, math.inf)

    def _start(self, w: _W) -> None:
        """Start w's next group if it may: active, idle, holding the snapshot it must generate with
        (installs applied lazily, :meth:`_sync`), and under the backpressure cap. The hot path of the
        engine (once per group): it reads no numpy array unless a publication or a download is open."""
        if not w.active or w.busy:
            return
        i = w.idx
        if self.open or i in self.private:  # an install may be due or awaited: apply what is due
            installed, wait_v, wait_t = self._sync(i)
            if installed < 0 or (not self.overlap and wait_v > installed):
                if wait_t < w.wake_at:  # wake it when the install it waits for is due
                    w.wake_at = wait_t
                    self._push(wait_t, _WAKE, w, w.token)
                return
        else:  # nothing in flight to this worker: what it holds is all there is (the common case)
            installed = self.inst.item(i)
            if installed < 0:
                return
        if self.store_total + self.in_flight >= self.cap:
            self._enqueue(i)
            return
        self.in_flight += self.group_size
        mult = math.exp(self.ln_mu + self._gauss() * self.sigma) if self.sigma > 0 else 1.0
        if self.strag_p > 0 and self.rng.random() < self.strag_p:
            mult *= self.strag_f
        dur = w.group_s * mult / self.strag_norm
        w.busy = True
        if dur > self.group_s_max:
            self.group_s_max = dur
        self.seq += 1  # _push, inlined
        heapq.heappush(self.q, (self.now + dur, self.seq, _DONE, (w, installed, dur), w.token))

    def _gauss(self) -> float:
        """A standard normal draw: ``random.gauss``'s Box-Muller pair, drawn from ``self.rng`` exactly as
        it draws them (the same numbers from the same seed), without its call per group."""
        z = self.gauss_next
        if z is None:
            x2pi = self.rng.random() * _TWO_PI
            g2rad = math.sqrt(-2.0 * math.log(1.0 - self.rng.random()))
            z = math.cos(x2pi) * g2rad
            self.gauss_next = math.sin(x2pi) * g2rad
        else:
            self.gauss_next = None
        return z

    def _enqueue(self, row: int) -> None:
        if self.ticket[row] >= 0:
            return
        if self.bq_n >= self.bq.size:
            self.bq = np.concatenate([self.bq, np.empty(self.bq.size, dtype=np.int64)])
            self.bq_seq = np.concatenate([self.bq_seq, np.empty(self.bq_seq.size, dtype=np.int64)])
        self.bq[self.bq_n] = row
        self.bq_seq[self.bq_n] = self.ticket[row] = self.n_tickets
        self.n_tickets += 1
        self.bq_n += 1

    def _waiting_until(self, rows: np.ndarray) -> np.ndarray:
        """Vectorised over queued rows: when each can generate (<= now: now; inf: no version yet)."""
        inst = self.inst[rows]
        newest = np.full(rows.size, -math.inf)  # due of the newest publication targeting the row
        have = inst >= 0
        for pub in self.open:
            d = pub.due[rows]
            targeted = (d < math.inf) & (pub.version > inst)
            newest = np.where(targeted, d, newest)
            have |= d <= self.now
        ready_at = newest if not self.p.overlap_generation else np.where(have, -math.inf, newest)
        ready_at = np.maximum(ready_at, self.priv_due[rows])
        return np.where(have | (ready_at > self.now), ready_at, math.inf)

    def _unblock(self) -> None:
        """Start held-back workers while the backpressure cap allows: the longest-queued of those that
        hold their newest snapshot first (one vectorised pass over the queue, not one event per worker);
        if some wait for an install, look again when the first of those is due."""
        free = self.cap - (self.store_total + self.in_flight)
        if self.bq_n == 0 or free <= 0:
            return
        rows, seqs = self.bq[: self.bq_n], self.bq_seq[: self.bq_n]
        valid = self.ticket[rows] == seqs
        ready_at = self._waiting_until(rows)
        ready = valid & (ready_at <= self.now)
        take = np.flatnonzero(ready)[: math.ceil(free / self.p.group_size)]
        keep = valid.copy()
        keep[take] = False
        later = keep & (ready_at < math.inf) & (ready_at > self.now)
        if take.size < math.ceil(free / self.p.group_size) and later.any():
            t = float(ready_at[later].min())
            if t < self.unblock_at:
                self.unblock_at = t
                self._push(t, _UNBLOCK, None)
        started = rows[take].tolist()
        m = int(keep.sum())
        self.bq[:m], self.bq_seq[:m] = rows[keep], seqs[keep]
        self.bq_n = m
        self.ticket[started] = -1
        for row in started:
            self._start(self.rows[row])

    # ---- learner ------------------------------------------------------------------------------------
    def _deliver(self, version: int) -> None:
        """A group generated by ``version`` arrives at the store (appended: arrival order is take order)."""
        g = self.group_size
        self.delivered += g
        if self.p.useful_share < 1.0 and self.useful_rng.random() >= self.p.useful_share:
            self.zero_variance += g  # all its rewards equal: left out, and its room in the buffer freed
            self._unblock()
            return
        self.store[version] = self.store.get(version, 0) + g
        self.fifo.append((version, self.now))
        self.store_total += g
        self.admitted += g

    def _drop_stale(self) -> None:
        stale = [v for v in self.store if not is_admissible(v, self.version, self.p.staleness)]
        for v in stale:
            c = self.store.pop(v)
            self.store_total -= c
            self.dropped += c
        # the dropped versions' entries stay in the FIFO and are skipped when reached (_try_train): a
        # version dropped is never admissible again, so an entry counts iff its version is in the store
        self._unblock()

    def _try_train(self) -> None:
        if not self.waiting or self.step >= self.p.steps:
            return
        self._drop_stale()  # what is left is admissible
        r = self.p.rollouts_per_step
        if self.store_total < r:
            return
        g, store, popleft = self.p.group_size, self.store, self.fifo.popleft
        taken: dict[int, int] = {}  # version -> groups taken
        first = math.inf  # arrival of the first group taken: the longest-waiting one (FIFO)
        for _ in range(r // g):  # the R/g earliest-arrived admissible groups (TrajectoryStore.take_batch)
            v, arrived = popleft()
            while v not in store:  # a dropped version's group (_drop_stale)
                v, arrived = popleft()
            taken[v] = taken.get(v, 0) + 1
            if first == math.inf:
                first = arrived
        for v, n in taken.items():  # each version's store entry holds at least its groups in the FIFO
            left = store[v] - n * g
            if left:
                store[v] = left
            else:
                del store[v]
        oldest = min(taken)
        stale_sum = float(sum((self.version - v) * n * g for v, n in taken.items()))
        self.wait_max = max(self.wait_max, self.now - first)
        self.store_total -= r
        self._unblock()
        delta = self.version - oldest
        if delta > self.p.staleness:
            raise SimulationInvariantError(
                f"step {self.step}: staleness {delta} exceeds S = {self.p.staleness} (admission broken)"
            )
        self.staleness_max = max(self.staleness_max, delta)
        self.batch_stats = (delta, stale_sum / r)
        self.waiting = False
        self.idle_per_step.append(self.now - self.wait_start)
        self._push(self.now + self.p.t_train_s, _TRAINED, None)

    def _trained(self) -> None:
        p = self.p
        self.version += 1
        self.step += 1
        self._bill()
        idle = self.idle_per_step[-1]
        length = self.now - self.step_start
        self.step_len.append(length)
        mu_pool = math.fsum(r * c for r, c in self.rate_counts.items())
        self.mu_pool_per_step.append(mu_pool)
        if p.record_metrics:
            n_active = self.n_active
            m: dict[str, Any] = {
                "step": self.step,
                "time_s": self.now,
                "learner/version": self.version,
                "learner/t_train_s": p.t_train_s,
                "learner/t_idle_s": idle,
                "learner/bubble_ratio": bubble_ratio(p.t_train_s, length),
                "store/size": self.store_total,
                "store/admitted": self.admitted,
                "store/dropped_stale": self.dropped,
                "store/staleness_mean": self.batch_stats[1],
                "store/staleness_max": self.batch_stats[0],
                "broadcast/t_bcast_s": self.t_bcast[-1] if self.t_bcast else None,
                "broadcast/bytes": p.snapshot_bytes,
                "broadcast/install_p90_s": self.install_p90[-1] if self.install_p90 else None,
                "pool/mu_pool": mu_pool,
                "pool/mu_target": p.mu_target,
                "pool/active_workers": n_active,
                "cost/usd_per_step": self.usd - self.usd_at_last_step,
                "cost/usd_total": self.usd,
            }
            if self.ctl is not None:
                m["pool/mu_pool_measured"] = self.ctl.mu_pool(self.now)
            self.metrics.append(m)
        self.usd_at_last_step = self.usd
        self.admitted = 0
        self.dropped = 0
        self.step_start = self.now
        if self.version % p.kappa == 0:
            self._publish()
        self.waiting = True
        self.wait_start = self.now
        self._try_train()

    def _publish(self) -> None:
        p, v = self.p, self.version
        n_rows = len(self.rows)
        targets = np.flatnonzero(self.on[:n_rows])
        if targets.size == 0:
            return
        links = self.links[targets]
        size = p.snapshot_bytes  # an anchor; with deltas every other publication is a patch
        if p.patch_ratio is not None and self.n_pubs % p.anchor_every:
            size = p.patch_ratio * p.snapshot_bytes
        self.n_pubs += 1
        order = np.argsort(links, kind="stable")
        lo, hi = float(links[order[0]]), float(links[order[-1]])
        # equal links: the key needs no sort of the links (a 100,000-worker pool publishes in O(N))
        key = (p.strategy, size, links.size, lo) if lo == hi else (p.strategy, size, links[order].tobytes())
        cached = self.bcast_cache.get(key)
        if cached is None:
            cached = completion_times(
                p.strategy, size, links[order], p.b0_bytes_per_s, p.chunk_bytes, p.hop_latency_s
            )
            self.bcast_cache[key] = cached
        due = np.full(self.inst.size, math.inf)
        due[targets[order]] = self.now + cached + p.reload_s
        self.open.append(_Pub(v, self.now, targets, due))
        self._push(self.now + float(cached[-1]) + p.reload_s, _CLOSE, self.open[-1])
        # workers waiting for nothing but generation are stopped lazily, when they next act

    def _close(self, pub: _Pub) -> None:
        """Every target's install is due: record T_bcast over those that did not leave before theirs,
        and mark the version installed on every present target."""
        due = pub.due[pub.targets]
        got = np.sort(due[self.left_at[pub.targets] >= due]) - pub.t0
        present = pub.targets[self.on[pub.targets]]
        if pub.cancelled:
            present = present[~np.isin(present, list(pub.cancelled))]
        self.inst[present] = np.maximum(self.inst[present], pub.version)
        self.open.remove(pub)
        k = got.size
        if not k:
            return
        self.t_bcast.append(float(got[install_quorum(k, self.p.gamma) - 1]))  # fraction q = 1/gamma
        self.t_bcast_all.append(float(got[-1]))  # dissemination complete: the last worker installed
        self.install_p90.append(float(got[max(0, math.ceil(0.9 * k) - 1)]))

    def _wake(self, w: _W) -> None:
        w.wake_at = math.inf
        self._start(w)

    # ---- control and churn --------------------------------------------------------------------------
    def _control(self) -> None:
        assert self.ctl is not None
        for w in self.ws.values():
            if w.active and w.present:
                self.ctl.observe(Heartbeat(w.spec.worker_id, self.now, w.rollouts_since, w.busy_since))
            w.rollouts_since = 0
            w.busy_since = 0.0
        for d in self.ctl.decide(self.now):
            key = f"{d.action}/{d.reason}"
            self.decision_counts[key] = self.decision_counts.get(key, 0) + 1
            w = self.ws[d.worker_id]
            if d.action == "activate" and w.present and not w.active:
                self._activate(w, installed=-1)
            elif d.action == "release":
                self._deactivate(w)
                if not w.present:
                    self.ctl.remove_candidate(d.worker_id)
        self._push(self.now + self.p.control_interval_s, _CONTROL, None)

    def _leave(self, w: _W) -> None:
        self.left += 1
        self._deactivate(w)
        w.present = False
        self.left_at[w.idx] = self.now  # its pending installs never happen: _close leaves them out
        self.private.pop(w.idx, None)
        self.priv_due[w.idx] = 0.0

    def _join(self) -> None:
        assert self.p.join_interval_s is not None
        tmpl = self.specs[self.rng.randrange(len(self.specs))]
        self.joined += 1
        spec = SimWorker(
            f"{tmpl.type_name}-join{self.joined}",
            tmpl.type_name,
            tmpl.usd_per_hour,
            tmpl.rollouts_per_s,
            tmpl.link_bytes_per_s,
        )
        row = len(self.rows)
        if row >= self.inst.size:  # grow the per-worker arrays by doubling
            extra = self.inst.size
            self.inst = np.concatenate([self.inst, np.full(extra, -1, dtype=np.int64)])
            self.links = np.concatenate([self.links, np.zeros(extra)])
            self.on = np.concatenate([self.on, np.zeros(extra, dtype=bool)])
            self.left_at = np.concatenate([self.left_at, np.full(extra, math.inf)])
            self.ticket = np.concatenate([self.ticket, np.full(extra, -1, dtype=np.int64)])
            self.priv_due = np.concatenate([self.priv_due, np.zeros(extra)])
            for pub in self.open:
                pub.due = np.concatenate([pub.due, np.full(extra, math.inf)])
        self.links[row] = spec.link_bytes_per_s
        w = _W(spec, row, group_s=self.p.group_size / spec.rollouts_per_s)
        self.ws[spec.worker_id] = w
        self.rows.append(w)
        self.specs.append(spec)
        if self.ctl is not None:
            self.ctl.add_candidate(self._cand(spec))
        self._push(self.now + self.rng.expovariate(1 / self.p.join_interval_s), _JOIN, None)

    # ---- loop ---------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        p = self.p
        wall0 = time.perf_counter()
        if self.ctl is not None:
            self._push(p.control_interval_s, _CONTROL, None)
        if p.join_interval_s:
            self._push(self.rng.expovariate(1 / p.join_interval_s), _JOIN, None)
        q = self.q
        pop = heapq.heappop
        events = 0
        stall_s = max(200.0 * p.t_train_s, 1e6)
        last_step_t, last_step = 0.0, 0
        while q and self.step < p.steps:
            t, _, kind, obj, token = pop(q)
            self.now = t
            if self.step != last_step:
                last_step, last_step_t = self.step, t
            elif t - last_step_t > stall_s:
                break
            events += 1
            if kind == _DONE:
                w, v, dur = obj
                if token != w.token:
                    continue
                w.busy = False
                g = p.group_size
                self.in_flight -= g
                w.rollouts_since += g
                w.busy_since += dur
                self._deliver(v)
                self._start(w)
                if self.waiting:
                    self._try_train()
            elif kind == _TRAINED:
                self._trained()
            elif kind == _WAKE:
                if token == obj.token:
                    self._wake(obj)
            elif kind == _CLOSE:
                self._close(obj)
            elif kind == _UNBLOCK:
                self.unblock_at = math.inf
                self._unblock()
            elif kind == _CONTROL:
                self._control()
            elif kind == _LEAVE:
                if token == obj.token and obj.active:
                    self._leave(obj)
            elif kind == _JOIN:
                self._join()
        if self.step < p.steps:
            raise SimulationInvariantError(
                f"the run stalled at step {self.step}/{p.steps}: no active worker left to produce rollouts"
            )
        return SimResult(self.metrics, self._summary(events, time.perf_counter() - wall0), list(self.t_bcast))

    def _summary(self, events: int, wall_s: float) -> dict[str, Any]:
        p = self.p
        warm = p.warmup_steps if p.warmup_steps is not None else 2 * p.kappa + 2
        warm = min(warm, max(0, p.steps - 1))
        idle = self.idle_per_step[warm:]
        idle_total = math.fsum(idle)
        train_total = p.t_train_s * len(idle)
        mu_min_obs = min(self.mu_pool_per_step[warm:]) if self.mu_pool_per_step[warm:] else 0.0
        t_bcast_max = max(self.t_bcast) if self.t_bcast else 0.0
        bound: int | None = None
        bound_discrete: int | None = None
        if mu_min_obs > 0:
            # SPEC section 3 form, with the run's worst measured T_bcast (fraction q) and slowest pool
            bound = capacity.staleness_bound_conservative(
                kappa=p.kappa,
                t_train=p.t_train_s,
                t_bcast=t_bcast_max,
                rollouts=p.rollouts_per_step,
                mu_pool=mu_min_obs,
            )
            # what this run guarantees, FIFO store included: a rollout of version v was started before
            # v + kappa was installed (at most T_bcast complete after its publication), took at most
            # the longest group to generate, then waited in the store until taken; so the learner was
            # at most kappa + ceil((T_all + group + wait) / T_train) - 1 versions ahead of it
            t_all = max(self.t_bcast_all) if self.t_bcast_all else 0.0
            bound_discrete = capacity.staleness_bound_after(
                kappa=p.kappa, t_train=p.t_train_s, latency=t_all + self.group_s_max + self.wait_max
            )
            if self.staleness_max > bound_discrete:
                raise SimulationInvariantError(
                    f"observed staleness {self.staleness_max} exceeds the bound {bound_discrete} "
                    f"(T_bcast complete {t_all:.1f} s + one group {self.group_s_max:.1f} s "
                    f"+ longest store wait {self.wait_max:.1f} s)"
                )
        steady = self.step_len[warm:] or [0.0]
        usd_steady = None
        if self.metrics and len(self.metrics) > warm:
            usd_steady = float(np.mean([m["cost/usd_per_step"] for m in self.metrics[warm:]]))
        return {
            "steps": self.step,
            "sim_time_s": self.now,
            "wall_s": wall_s,
            "events": events,
            "warmup_steps": warm,
            "bubble_ratio": bubble_ratio(train_total, idle_total + train_total),
            "idle_per_step_s": idle_total / max(1, len(idle)),
            "step_s_mean": float(np.mean(steady)),
            "staleness_max": self.staleness_max,
            "staleness_budget": p.staleness,
            "staleness_bound_conservative": bound,
            "staleness_bound_conservative_discrete": bound_discrete,
            "staleness_within_spec_bound": bound is None or self.staleness_max <= bound,
            "store_wait_max_s": self.wait_max,
            "t_bcast_mean_s": float(np.mean(self.t_bcast)) if self.t_bcast else None,
            "t_bcast_max_s": t_bcast_max if self.t_bcast else None,
            "usd_total": self.usd,
            "usd_per_step_steady": usd_steady,
            "active_workers_final": self.n_active,
            "mu_pool_min": mu_min_obs,
            "controller_decisions": self.ctl.decisions_made if self.ctl else 0,
            "workers_joined": self.joined,
            "workers_left": self.left,
            "controller_decisions_by_reason": dict(sorted(self.decision_counts.items())),
            "useful_share_measured": 1 - self.zero_variance / self.delivered if self.delivered else None,
            "zero_variance_rollouts": self.zero_variance,
        }
