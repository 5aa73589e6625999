"""The worker registry of the learner node: who is a member, with which credential, holding which version.

The one ledger of members and installed versions. The HTTP API consults it (authentication) and the
broadcast publisher is handed it at construction as its ``broadcast.api.MemberLedger``: who may join
the snapshot topology (:meth:`WorkerRegistry.may_join`), who is a target of a publication
(:meth:`WorkerRegistry.is_target`: trusted identities only, so a revoked or retired worker whose TCP
connection is still open is planned nothing more). The pool and the dashboard read it too.

**Installed versions have one writer**, :meth:`WorkerRegistry.installed`, for every channel that says
which version a worker holds: its heartbeat, a lease granted for the version it named, and an install
ack the broadcast publisher counted (a refused ack is never written). The rule is monotonic: a report
of an older version than the one recorded (a late ack, a lease asked before the install) is ignored,
except the worker's heartbeat, which says what it serves now (after a learner rolled back to an older
checkpoint, its workers re-fetch older weights).

The run's join token is exchanged once for a per-worker bearer credential; only the credential's
SHA-256 is kept, in ``workers.json`` of the run directory, so credentials survive a learner restart
and a leaked registry file grants nothing. A change a restart must keep (a registration, a quarantine,
a retirement) is appended to ``workers.journal`` at once, and ``workers.json`` is written whole at most
once a second (``WRITE_EVERY_S``; at the end of the run every time): registering a fleet of N costs
O(N), not O(N^2). A restart reads the file, then the journal (the newer record wins); a reader of the
file alone may see the run up to a second late.

**Registration slots.** The join token opens ``max_workers`` slots at a time, and ``max_identities``
identities over the whole run (every record the file keeps counts: a quarantined identity that registers
again spends one more). An identity holds one while it is
trusted and was heard from (an authenticated API call) within ``slot_idle_s``, or for ``slot_idle_s``
after it was quarantined (the time is persisted, so a restart keeps it). A trusted identity silent
longer is **retired**: it frees its slot, and its credential opens nothing any more (the API answers
403 ``retired``; the stock worker registers again). An identity restored after a learner restart counts
as heard from at the restart: the learner's downtime is not the worker's silence. Quarantined and
retired records stay in the file, for the registry's history.

Every string of a peer that is hashed or compared here (a join token, a credential, as JSON or from a
header, where they may carry lone surrogates) is encoded with ``surrogatepass``: a check of garbage is
False, never an exception.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from echo2.observe.rundir import write_atomic
from echo2.protocol import MAX_HEARTBEAT_S, RegisterRequest
from echo2.resources import is_exhausted
from echo2.runtime.standing import Standing

log = logging.getLogger(__name__)

DEFAULT_RATE = 1.0  # rollouts/s assumed for a worker that registers without an estimate
DEFAULT_SLOT_IDLE_S = 600.0  # = security.slot_idle_s's default (the learner passes the configured value)
REGISTRY_FILE = "workers.json"
JOURNAL_FILE = "workers.journal"  # records changed since workers.json was last written, one JSON line each
ATTEMPT_TTL_S = 600.0  # how long a registration's attempt id gets its identity back when sent again
WRITE_EVERY_S = 1.0  # workers.json is written whole at most this often (the journal holds the rest)
# a record's fields that live with this learner process only (and a record read back without them)
_NOT_PERSISTED = frozenset(
    {"last_seen_s", "install_s", "checks_waiting", "relay_demoted", "standing", "rate_window", "mismatch_kl"}
)


@dataclass
class WorkerRecord:
    """A registered worker, as the learner knows it (persisted without the credential)."""

    worker_id: str  # unique id the learner assigned
    name: str  # the name the worker gave (host name, ...)
    credential_sha256: str  # hex digest of its bearer credential
    usd_per_hour: float  # its price c_i
    hardware: str  # free-text description (GPU model, ...)
    rollouts_per_s: float  # its own estimate at registration (the controller's prior)
    uplink_mbps: float | None = None  # its upload link as it declared it (None: not declared)
    installed_version: int = -1  # newest snapshot it reported installed (never decreases: installed())
    install_s: float = 0.0  # seconds its newest install took: its heartbeat's figure, or from publication
    #                         to its counted broadcast ack, whichever came last (a metric; not persisted)
    rollouts: int = 0  # rollouts it has had admitted
    checks_passed: int = 0  # of its submissions, those whose generation check passed
    checks_waiting: int = 0  # of its submissions, those drawn and waiting for the check (not persisted)
    relay_demoted: bool = False  # the broadcast publisher no longer plans it as a relay (not persisted:
    #                              a restarted learner's publisher starts every member relaying again)
    mismatch_kl: float | None = None  # k3 KL(its sampler || the learner) over its fresh sequences in the
    #                                   latest update that had any (None: none yet; not persisted)
    # its record with leases (standing.py: probation, strikes, the bench; the lease broker's view) and the
    # pool's window of its admitted rollouts (since, busy seconds, admitted then; the measured rate's):
    # neither persisted (a restarted learner starts every worker on probation, its rate from a new window)
    standing: Standing = field(default_factory=Standing)
    rate_window: tuple[float, float, int] | None = None
    quarantined: str = ""  # why its credential was revoked ("" while it is trusted)
    quarantined_s: float = 0.0  # clock time it was quarantined (its slot frees slot_idle_s later)
    retired_s: float | None = None  # clock time it was retired for silence (None: not retired)
    last_seen_s: float = 0.0  # clock time of its last authenticated call (not persisted)

    @property
    def trusted(self) -> bool:
        """Neither quarantined nor retired: its credential opens the API and the broadcast."""
        return not self.quarantined and self.retired_s is None


class WorkerRegistry:
    """Membership, credentials and installed versions, persisted in ``run_path / workers.json``."""

    def __init__(
        self,
        run_path: Path,
        join_token: str,
        clock: Callable[[], float],
        max_workers: int = 64,
        slot_idle_s: float = DEFAULT_SLOT_IDLE_S,
        max_identities: int | None = None,
    ) -> None:
        self.path = run_path / REGISTRY_FILE
        self.join_token = join_token
        self.clock = clock  # wall-clock seconds (quarantine times are persisted)
        self.max_workers = max_workers  # registration slots of the join token (security.max_workers)
        self.slot_idle_s = slot_idle_s  # silence that retires an identity (security.slot_idle_s)
        # identities the join token may register over the run (security.max_identities; None: no bound)
        self.max_identities = max_identities
        self._records: dict[str, WorkerRecord] = {}
        self._by_cred: dict[str, str] = {}  # credential sha -> worker id
        self._watchers: list[Callable[[str], None]] = []  # told when an identity stops being trusted
        self.journal = run_path / JOURNAL_FILE
        self._written = -math.inf  # clock time workers.json was last written whole
        self._dirty = False  # records changed since (in the journal, not yet in workers.json)
        self._slots = (-math.inf, 0, 0)  # slots_held's last count: (clock, slots held, records then)
        self._attempts: dict[str, tuple[str, float]] = {}  # attempt sha -> (identity, when): retried()

    def __iter__(self) -> Iterator[WorkerRecord]:
        return iter(list(self._records.values()))

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, worker_id: str) -> WorkerRecord:
        return self._records[worker_id]

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._records.get(worker_id)

    def token_ok(self, token: str) -> bool:
        """Constant-time check of a join token (False for any string that is not it, lone surrogates
        included)."""
        return hmac.compare_digest(_bytes(token), _bytes(self.join_token))

    def slots_held(self) -> int:
        """Identities holding a registration slot now (see the module docstring); retires the trusted
        ones silent longer than ``slot_idle_s`` first. The count over every record is made at most once
        every ``WRITE_EVERY_S`` and the registrations since are added to it (a registration asks, so a
        fleet arriving at once would scan the registry N times): a slot that frees meanwhile is seen
        up to a second late, never one too many handed out."""
        now = self.clock()
        if now - self._slots[0] >= WRITE_EVERY_S:
            self._retire_silent()
            held = sum(
                1
                for r in self._records.values()
                if r.trusted or (r.quarantined and now - r.quarantined_s < self.slot_idle_s)
            )
            self._slots = (now, held, len(self._records))
        _, held, seen = self._slots
        return held + len(self._records) - seen  # + the registrations since the count

    @property
    def spent(self) -> bool:
        """The join token's identity budget is spent: every registration the run kept (``workers.json``:
        quarantined and retired identities too) counts against ``max_identities``, so re-registering
        after a quarantine does not reset what an attacker may do."""
        return self.max_identities is not None and len(self._records) >= self.max_identities

    @property
    def full(self) -> bool:
        """Every registration slot of the join token is held."""
        return self.slots_held() >= self.max_workers

    def retried(self, req: RegisterRequest) -> tuple[WorkerRecord, str] | None:
        """A registration sent again (its ``attempt`` seen within ``ATTEMPT_TTL_S``, its identity still
        trusted and its credential never used: the reply that carried it was lost): that identity with
        a new credential (the lost one opens nothing any more), no slot or identity spent; None for a
        registration not seen. An identity whose credential was used is never handed out again, so an
        attempt id that leaks (or a client that picks a guessable one) gives nobody a working identity."""
        if req.attempt is None:
            return None
        key, now = _sha(req.attempt), self.clock()
        seen = self._attempts.get(key)
        if seen is None or now - seen[1] > ATTEMPT_TTL_S:
            return None
        rec = self._records.get(seen[0])
        if rec is None or not rec.trusted or rec.last_seen_s > seen[1]:  # quarantined, retired or used
            return None
        credential = secrets.token_urlsafe(32)
        self._by_cred.pop(rec.credential_sha256, None)
        rec.credential_sha256 = _sha(credential)
        self._by_cred[rec.credential_sha256] = rec.worker_id
        rec.last_seen_s = now  # handed out now, unused since (a reply lost again may be sent again)
        del self._attempts[key]
        self._attempts[key] = (rec.worker_id, now)  # at the end: the dict stays in time order
        self._changed(rec)
        log.info("registration of %s sent again: the same identity, a new credential", rec.worker_id)
        return rec, credential

    def register(self, req: RegisterRequest) -> tuple[WorkerRecord, str]:
        """Enroll a worker whose token was checked (and :attr:`full` was not; a retried registration is
        :meth:`retried`'s); returns its record and its new credential."""
        credential = secrets.token_urlsafe(32)
        rec = WorkerRecord(
            worker_id=f"w{len(self._records)}-{secrets.token_hex(3)}",
            name=req.name,
            credential_sha256=_sha(credential),
            usd_per_hour=req.usd_per_hour,
            hardware=req.hardware,
            rollouts_per_s=req.rollouts_per_s or DEFAULT_RATE,
            uplink_mbps=req.uplink_mbps,
            last_seen_s=self.clock(),
        )
        self._index(rec)
        self._changed(rec)
        if req.attempt is not None:  # its retries get this identity back (retried)
            now = self.clock()
            while self._attempts and now - next(iter(self._attempts.values()))[1] > ATTEMPT_TTL_S:
                del self._attempts[next(iter(self._attempts))]  # oldest first: insertion order
            self._attempts[_sha(req.attempt)] = (rec.worker_id, now)
        log.info(
            "registered %s (%r, %r, $%.2f/h)", rec.worker_id, rec.name, rec.hardware or "?", rec.usd_per_hour
        )
        return rec, credential

    def authenticate(self, credential: str) -> WorkerRecord | None:
        """The worker holding ``credential``, or None. Check ``quarantined`` and ``retired_s``: a
        trusted identity silent longer than ``slot_idle_s`` is retired here; a trusted one's last-seen
        time is updated."""
        wid = self._by_cred.get(_sha(credential))
        if wid is None:
            return None
        rec = self._records[wid]
        if self._retire_if_silent(rec):
            self._changed(rec)
        if rec.trusted:
            rec.last_seen_s = self.clock()
        return rec

    def installed(
        self, worker_id: str, version: int, install_s: float | None = None, *, holds_now: bool = False
    ) -> None:
        """``worker_id`` holds ``version``, installed in ``install_s`` seconds (None: not said): the one
        writer of the installed version the dashboard and the run report read, for every
        channel (heartbeat, lease request, counted broadcast ack). Monotonic: an older version than the
        recorded one is ignored (a late ack), unless ``holds_now`` (the worker's heartbeat, its own
        statement of what it serves: after a learner rolled back, it re-fetched older weights); an
        unknown id is ignored."""
        rec = self._records.get(worker_id)
        if rec is None or (version < rec.installed_version and not holds_now):
            return
        rec.installed_version = version
        if install_s is not None:
            rec.install_s = install_s

    def may_join(self, worker_id: str, credential: object) -> bool:
        """Only registered, trusted workers join the snapshot topology, and only under their own id."""
        if not isinstance(credential, str) or self._by_cred.get(_sha(credential)) != worker_id:
            return False
        return self._trusted_now(self._records[worker_id])

    def is_target(self, worker_id: str) -> bool:
        """Whether a connected member is planned and announced a publication: a registered identity
        that is still trusted (not quarantined, not retired for silence)."""
        rec = self._records.get(worker_id)
        return rec is not None and self._trusted_now(rec)

    def _trusted_now(self, rec: WorkerRecord) -> bool:
        """``rec.trusted``, after retiring it if it has been silent longer than ``slot_idle_s``."""
        if self._retire_if_silent(rec):
            self._changed(rec)
        return rec.trusted

    def watch(self, on_untrusted: Callable[[str], None]) -> None:
        """Call ``on_untrusted(worker_id)`` when an identity stops being trusted (quarantined, retired),
        right when it happens (the broadcast publisher closes its connections: ``MemberLedger.watch``)."""
        self._watchers.append(on_untrusted)

    def standing(self, worker_id: str) -> Standing | None:
        """A member's record with leases (the lease broker's view, ``standing.Standings``)."""
        rec = self._records.get(worker_id)
        return rec.standing if rec is not None else None

    def uplink(self, worker_id: str) -> float | None:
        """The upload rate ``worker_id`` declared at registration, bytes/s (None: not declared, or not
        a member): the relay trees put the fast ones near the root (``MemberLedger.uplink``)."""
        rec = self._records.get(worker_id)
        return None if rec is None or rec.uplink_mbps is None else rec.uplink_mbps * 1e6 / 8

    def relay_conduct(self, worker_id: str, demoted: bool) -> None:
        """The broadcast publisher's verdict on a member as a relay (``MemberLedger.relay_conduct``),
        kept on its record for the pool table and ``/metrics``."""
        rec = self._records.get(worker_id)
        if rec is not None:
            rec.relay_demoted = demoted

    def mismatch(self, worker_id: str, kl: float) -> None:
        """The mismatch KL an update read on ``worker_id``'s fresh sequences (``trainer.mismatch_by``),
        kept on its record for the pool table and ``/metrics``."""
        rec = self._records.get(worker_id)
        if rec is not None:
            rec.mismatch_kl = kl

    def _untrusted(self, worker_id: str) -> None:
        for watcher in self._watchers:
            watcher(worker_id)

    def revoke(self, worker_id: str, reason: str) -> None:
        """Quarantine a worker, the one call a quarantine takes: its credential opens nothing any more
        (persisted, with the time, so a restart keeps it out and frees its slot ``slot_idle_s`` after
        the catch), and the watchers are told at once, a worker retired before included (the node's
        watcher then drops it from the pool and purges what it left untrained, ``node.py``; the
        broadcast publisher's closes its connections); the record stays, with the reason, for the
        registry's history."""
        rec = self._records[worker_id]
        if not rec.quarantined:
            rec.quarantined = reason
            rec.quarantined_s = self.clock()
            self._changed(rec)
            log.warning("quarantined %s (%r): %s", worker_id, rec.name, reason)
            self._untrusted(worker_id)

    def heard_from(self, worker_id: str, seconds: float) -> bool:
        """Whether ``worker_id`` is trusted and was heard from in the last ``seconds``."""
        rec = self._records.get(worker_id)
        return rec is not None and rec.trusted and self.clock() - rec.last_seen_s <= seconds

    def seen_within(self, seconds: float) -> list[str]:
        """Workers heard from in the last ``seconds`` (:meth:`heard_from`)."""
        return [w for w in self._records if self.heard_from(w, seconds)]

    def _retire_if_silent(self, rec: WorkerRecord) -> bool:
        """Retire ``rec`` if it is trusted and was not heard from within ``slot_idle_s`` (True: it was
        retired now; the caller saves)."""
        now = self.clock()
        if not rec.trusted or now - rec.last_seen_s <= self.slot_idle_s:
            return False
        rec.retired_s = now
        silent = now - rec.last_seen_s
        log.info("retired %s (%r): silent for %.0f s (security.slot_idle_s)", rec.worker_id, rec.name, silent)
        self._untrusted(rec.worker_id)
        return True

    def _retire_silent(self) -> None:
        for rec in list(self._records.values()):
            if self._retire_if_silent(rec):
                self._changed(rec)

    # ---- persistence ---------------------------------------------------------------------------------
    def _changed(self, rec: WorkerRecord) -> None:
        """``rec`` changed in a way a restart must keep (registered, quarantined, retired): one line
        appended to the journal now, and ``workers.json`` written whole when it was not for
        ``WRITE_EVERY_S`` (else at the next :meth:`flush_due` or :meth:`save`). A registration costs
        O(1), not a rewrite of every record (a fleet of N registering wrote O(N^2) bytes)."""
        self._dirty = True
        if self.clock() - self._written >= WRITE_EVERY_S:
            self.save()
            return
        try:
            with self.journal.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(_persisted(rec)) + "\n")
        except OSError as exc:
            if not is_exhausted(exc):
                raise
            log.error("%s not written (%s): the next change writes it", self.journal, exc.strerror)

    def flush_due(self) -> None:
        """Write ``workers.json`` whole if records changed since and it was not for ``WRITE_EVERY_S`` (the
        node's housekeeping, about once a second)."""
        if self._dirty and self.clock() - self._written >= WRITE_EVERY_S:
            self.save()

    def save(self) -> None:
        """Write ``workers.json`` whole (then the journal is empty: everything is in it). A descriptor
        table or disk that is full is no request's failure: the registry stays right in memory and the
        next save writes it all (logged; never an error reply)."""
        data = [_persisted(r) for r in self._records.values()]
        try:
            write_atomic(self.path, json.dumps(data, indent=1))
            self.journal.unlink(missing_ok=True)
        except OSError as exc:
            if not is_exhausted(exc):
                raise
            log.error("%s not written (%s): the next change writes it", self.path, exc.strerror)
            return
        self._written, self._dirty = self.clock(), False

    def load(self) -> list[WorkerRecord]:
        """Restore the workers of an earlier learner process; returns the trusted ones (those that may
        come back, for the pool). Each counts as heard from now: it gets the pool's heartbeat timeout
        to come back before it is taken for lost, and ``slot_idle_s`` before it is retired (the
        learner's downtime is not its silence). Quarantine and retirement times are kept as saved."""
        saved = json.loads(self.path.read_text()) if self.path.is_file() else []
        by_id = {d["worker_id"]: d for d in saved}
        later = _journal_lines(self.journal)  # changed after that write: the newer record wins
        by_id.update((d["worker_id"], d) for d in later)
        if not by_id:
            return []
        restored = [WorkerRecord(**d) for d in by_id.values()]
        for rec in restored:
            rec.last_seen_s = self.clock()
            self._index(rec)
        log.info(
            "restored %d registered workers from %s (%d changed after it, from its journal)",
            len(restored), self.path, len(later),
        )  # fmt: skip
        if later:
            self.save()  # one file again
        return [r for r in restored if r.trusted]

    def _index(self, rec: WorkerRecord) -> None:
        self._records[rec.worker_id] = rec
        self._by_cred[rec.credential_sha256] = rec.worker_id


class Cadence:
    """How often the fleet is asked to call, stretched as it grows so that its control traffic stays
    near ``per_s`` heartbeats a second: with ``n`` identities holding slots the factor is
    ``f = max(1, n / (per_s x heartbeat_s))``, and

    - the heartbeat period is ``heartbeat_s x f`` (every heartbeat reply says it; the stock worker
      sleeps what the last reply said);
    - a refused lease asks the worker back after ``heartbeat_s / 4 x f x min(f, 4)``: a quarter of
      the heartbeat period in a small fleet (as before), the whole period from f = 4 on, so idle
      workers' lease polls cost no more than their heartbeats;
    - the windows that read silence as absence (the controller's heartbeat timeout, the lease broker's
      "still asking" for the probation queue and the pool's "working") are stretched by ``f``.

    Below ``per_s x heartbeat_s`` identities (200 at the defaults) nothing changes. The count is the
    registry's slot count (:meth:`WorkerRegistry.slots_held`: made at most once a second)."""

    def __init__(self, heartbeat_s: float, per_s: float, members: Callable[[], int]) -> None:
        self.heartbeat_s = heartbeat_s
        self.per_s = per_s
        self.members = members

    def factor(self) -> float:
        return max(1.0, self.members() / (self.per_s * self.heartbeat_s))

    def silence(self, window_s: float) -> float:
        """A window that reads silence as absence (``window_s`` in a small fleet), stretched by the
        factor: the one rule for the controller's heartbeat timeout and the pool's "working"."""
        return window_s * self.factor()

    def heartbeat(self) -> float:
        """Seconds between one worker's heartbeats now (at most an hour: the protocol's bound)."""
        return min(MAX_HEARTBEAT_S, self.heartbeat_s * self.factor())

    def retry(self) -> float:
        """Seconds a refused lease asks the worker to wait (idle refusals: nothing to lease it now)."""
        f = self.factor()
        return min(MAX_HEARTBEAT_S, self.heartbeat_s / 4 * f * min(f, 4.0))


def _persisted(rec: WorkerRecord) -> dict[str, Any]:
    """The fields of ``rec`` a restart keeps, as ``workers.json`` and its journal hold them."""
    return {f.name: getattr(rec, f.name) for f in fields(rec) if f.name not in _NOT_PERSISTED}


def _journal_lines(path: Path) -> list[dict[str, Any]]:
    """The records of the registry's journal, oldest first; a line that is not a whole record (the
    last one, cut by a crash while it was written) is skipped, with one warning."""
    if not path.is_file():
        return []
    out, torn = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            d = json.loads(line)
            WorkerRecord(**d)  # every field there and known
        except (ValueError, TypeError):
            torn += 1
            continue
        out.append(d)
    if torn:
        log.warning("%s: %d line(s) not a whole record, skipped (a write cut short)", path, torn)
    return out


def _bytes(text: str) -> bytes:
    """UTF-8 of ``text``, lone surrogates (from a JSON escape, or a header's undecodable bytes) passed
    through: never raises."""
    return text.encode("utf-8", "surrogatepass")


def _sha(text: str) -> str:
    return hashlib.sha256(_bytes(text)).hexdigest()
