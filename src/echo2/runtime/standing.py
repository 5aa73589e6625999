"""What each worker's record with leases entitles it to: probation, slow start, strikes, the bench.

A worker is a stranger's machine, and a lease ties up learner budget (``runtime.max_inflight_batches``
of R rollouts, leased plus buffered) until it is answered or expires. So the budget follows what a
worker has *returned*, never what it claims (the lease broker, ``leases.py``, asks this ledger):

- **probation**: a worker that has returned no lease yet (a new identity), or none since its last
  strike, gets leases of ``security.probation_prompts`` prompts, one open at a time, and all
  workers on probation together hold at most ``security.probation_share`` of the in-flight budget
  (their open leases and their groups waiting for a check), an allowance beside it (the lease broker
  does not count probation leases against the others' budget). So K identities that lease and never
  submit hold at most that share, whatever K is, and an honest worker that has delivered keeps the
  whole budget; nor can a fast delivering worker keep a newcomer from its first lease by filling the
  budget. Workers with a strike on their record hold at most half of the probation share, so once a
  flood of new identities has left its first leases unreturned, the other half is there for new
  workers.
- **slow start**: past probation a worker may hold ``1 + returned`` open leases (leases it returned
  since its last strike), up to ``runtime.max_leases_per_worker``: holding many leases takes a
  record of returning them.
- **strikes**: every lease that expires unreturned is a strike, and so is an answer too stale to admit
  and a drawn submission whose check expired (its version left the admissible window first). A strike
  sends the worker back to probation, and each strike in a row halves its next leases' time to live
  (``lease_ttl_s / 2**strikes``), so a hoarder's leases come back sooner; ``security.max_unreturned``
  strikes in a row bench it (no leases) for ``BENCH_TTLS`` lease times to live. Only a lease returned
  with admitted work clears the strikes: an answer's groups admitted (a drawn one's once its check
  passed), in time (a late answer to an expired lease returns nothing).

Every number here is counted (``leases/unreturned``, ``leases/stale_answers``, ``leases/benched``) and
kept in memory only: a restarted learner starts every worker on probation again, which costs an honest
worker one small lease. In the learner node each worker's :class:`Standing` is part of its member record
(``members.WorkerRecord.standing``): :class:`Standings` is the lease broker's view of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from echo2.observe.catalog import LEASES_BENCHED, LEASES_STALE_ANSWERS, LEASES_UNRETURNED

BENCH_TTLS = 4.0  # a benched worker gets no lease for this many runtime.lease_ttl_s


@dataclass
class Standing:
    """One worker's record with leases."""

    returned: int = 0  # leases returned with admitted work since its last strike
    strikes: int = 0  # unreturned leases in a row
    benched_until: float = -math.inf  # clock time its bench ends
    last_asked: float = -math.inf  # clock time of its last lease request (granted or not)


class Standings:
    """The lease record of every worker (event loop only; no I/O). ``book``: where a worker's
    :class:`Standing` is kept (the node's member records: ``WorkerRegistry.standing``; None for an id it
    does not know); without one, here."""

    def __init__(
        self,
        max_unreturned: int,
        lease_ttl_s: float,
        book: Callable[[str], Standing | None] | None = None,
    ) -> None:
        self.max_unreturned = max_unreturned
        self.lease_ttl_s = lease_ttl_s
        self._own: dict[str, Standing] | None = None  # the standings kept here, without a book
        if book is None:
            self._own = {}
            book = self._own.get
        self._book = book
        self.unreturned = 0  # leases that expired unanswered, all workers
        self.stale_answers = 0  # answers too stale to admit, all workers
        self.benched = 0  # times a worker was benched

    def _rec(self, worker_id: str) -> Standing:
        """The standing to write (one the book does not keep, for an id it does not know)."""
        found = self._book(worker_id)
        if found is None:
            found = Standing()
            if self._own is not None:
                self._own[worker_id] = found
        return found

    def asked(self, worker_id: str, now: float) -> None:
        """A lease request arrived (granted or refused): the worker is working, or trying to."""
        self._rec(worker_id).last_asked = now

    def asked_within(self, worker_id: str, now: float, seconds: float) -> bool:
        rec = self._book(worker_id)
        return rec is not None and now - rec.last_asked <= seconds

    def returned_lease(self, worker_id: str) -> None:
        """A lease of this worker came back with admitted work (trainable: a drawn one once its check
        passed); a stale or late answer is no return."""
        rec = self._rec(worker_id)
        rec.returned += 1
        rec.strikes = 0

    def expired(self, worker_id: str, now: float) -> None:
        """A lease of this worker expired unanswered: a strike (:meth:`strike`)."""
        self.unreturned += 1
        self.strike(worker_id, now)

    def stale(self, worker_id: str, now: float) -> None:
        """An answer of this worker was too stale to admit: it returned nothing, a strike."""
        self.stale_answers += 1
        self.strike(worker_id, now)

    def strike(self, worker_id: str, now: float) -> None:
        """A strike: back to probation; benched at the ``max_unreturned``-th strike in a row."""
        rec = self._rec(worker_id)
        rec.returned = 0
        rec.strikes += 1
        if rec.strikes >= self.max_unreturned:
            rec.benched_until = now + BENCH_TTLS * self.lease_ttl_s
            rec.strikes = self.max_unreturned - 1  # after the bench, one more strike benches it again
            self.benched += 1

    def on_probation(self, worker_id: str) -> bool:
        rec = self._book(worker_id)
        return rec is None or rec.returned == 0

    def struck(self, worker_id: str) -> bool:
        """On probation with an unreturned lease on its record (its last lease expired unanswered)."""
        rec = self._book(worker_id)
        return rec is not None and rec.strikes > 0

    def bench_left(self, worker_id: str, now: float) -> float:
        """Seconds of bench left (0 when not benched)."""
        rec = self._book(worker_id)
        return max(0.0, rec.benched_until - now) if rec is not None else 0.0

    def max_open(self, worker_id: str, cap: int) -> int:
        """Open leases the worker may hold: 1 on probation, then 1 + returned, at most ``cap``."""
        rec = self._book(worker_id)
        return 1 if rec is None else max(1, min(cap, 1 + rec.returned))

    def ttl(self, worker_id: str) -> float:
        """Its next lease's time to live: ``lease_ttl_s / 2**strikes``."""
        rec = self._book(worker_id)
        return self.lease_ttl_s / 2 ** (rec.strikes if rec is not None else 0)

    def metrics(self) -> dict[str, float]:
        return {
            LEASES_UNRETURNED.key: self.unreturned,
            LEASES_STALE_ANSWERS.key: self.stale_answers,
            LEASES_BENCHED.key: self.benched,
        }
