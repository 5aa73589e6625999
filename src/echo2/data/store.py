"""The versioned trajectory store of the data plane (SPEC §1, §2): leases, admission, FIFO batches.

Durable on one SQLite file in WAL mode with ``synchronous=FULL``: every method that changes state runs
in one ``BEGIN IMMEDIATE`` transaction and returns only after it is committed to disk, so a learner
restart (a new ``TrajectoryStore`` on the same file) loses no accepted group, lease or counter.

**Threading.** One connection, used from the thread that created the store (SQLite's
``check_same_thread`` guard enforces it): a server funnels store calls through one thread.

**Schema** (``PRAGMA user_version = 6``; an older store gains the missing columns on open)::

    leases(lease_id PK, worker_id, state IN ('open','expired','submitted'), issued_at, expires_at,
           submitted_at NULL, n_prompts, prompts, seed, installed_version, late (answered after expiry),
           epoch (the run epoch of the learner process that issued it; 0 for an older store's))
        prompts: JSON [[prompt_id, text, answer, meta], ...] in lease order
        seed: the sampling seed the lease assigned; installed_version: what the worker said it held
    rollout_groups(seq INTEGER PK AUTOINCREMENT, group_id UNIQUE, lease_id, prompt_id, policy_version,
           n_traj, consumed_step NULL, data)
        one row per GRPO group, kept whole; seq is the arrival order (FIFO key, never reused);
        consumed_step is NULL while buffered, -1 once discarded as stale, -2 once purged (its worker
        was quarantined), -3 when its rewards were all equal and the run drops such groups
        (``drop_flat``: admitted, counted ``zero_variance``, never trained), else the learner step that
        trained on it; rows are never deleted (the ledger), only the samples of pruned / dropped /
        purged / flat ones;
        data: the group as the protocol codec encodes it (echo2.protocol.encode_group)
    counters(name PK, value)      admitted, dropped_stale, zero_variance, purged (trajectories),
                                  poisoned (groups), leases_expired (leases), rejected/<reason> (submissions)
    settings(name PK, value)      group_size (checked on reopen), staleness (informational)

**Admission** (SPEC §2). At learner version ``v_t`` with budget ``S`` a group of version ``v`` is
admissible iff ``v >= v_t - S``. A submission older than that is accepted but discarded
(``dropped_stale``); a buffered group that becomes older than that is discarded at the next
``take_batch``, never trained on. Consumed groups are kept until :meth:`TrajectoryStore.prune_consumed`
(call it once a checkpoint covering their step is durable) so that :meth:`~TrajectoryStore.requeue_after`
can hand them back after a restart.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from echo2.data.store_schema import READABLE_VERSIONS, SCHEMA_VERSION, migrate
from echo2.data.store_types import (
    Lease,
    StoreStats,
    SubmitResult,
    decode_prompts,
    encode_prompts,
    lease_prompts,
)
from echo2.data.submission import Rejected, Submission, is_reason_label
from echo2.errors import ConfigError
from echo2.physics.rules import admission_floor
from echo2.protocol import decode_group, encode_group
from echo2.types import Prompt, Trajectory

log = logging.getLogger(__name__)

DROPPED = -1  # consumed_step of a group discarded as stale at take time (kept in the ledger)
PURGED = -2  # consumed_step of a group purged untrained because its worker was quarantined
FLAT = -3  # consumed_step of a group whose rewards are all equal, left out untrained (drop_flat)
REJECTION_FLUSH = 256  # rejections counted in memory are written at the next transaction or at this many
BUSY_TIMEOUT_MS = 10_000


class TrajectoryStore:
    """Durable, versioned buffer of GRPO groups with leases and bounded-staleness admission.

    ``staleness`` is the budget ``S``; ``group_size`` the samples per GRPO group. Single-threaded: use
    the store only from the thread that created it.
    """

    def __init__(self, path: str | Path, staleness: int, group_size: int, drop_flat: bool = False) -> None:
        if staleness < 0:
            raise ConfigError(f"staleness: {staleness} must be >= 0")
        if group_size < 1:
            raise ConfigError(f"group_size: {group_size} must be >= 1")
        self.path = str(path)  # the SQLite file (":memory:" for a throwaway store)
        self.staleness = staleness  # S: admissible iff policy_version >= v_t - S
        self.group_size = group_size  # samples per GRPO group
        self.drop_flat = drop_flat  # leave out admitted groups whose rewards are all equal (no signal)
        self._floor: int | None = None  # v_t - S at the last learner version seen; None: none seen yet
        self._rejections: dict[str, int] = {}  # counted, not yet written (the next transaction does)
        # prompts whose groups were discarded untrained (dropped as stale, purged), to be leased again;
        # in memory: the lease broker takes them (take_redo) each time it looks, so none is lost but by a
        # crash, after which --resume requeues from the checkpoint's lease state
        self._redo: list[tuple[Prompt, str]] = []
        self.waits_for_checks = 0  # take_batch calls that waited for a check of a group at the floor
        self.taken_at: int | None = None  # learner version of the last batch taken (its update under way
        # until the version moves on)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
        try:
            self._open()
        except BaseException:
            self._db.close()
            raise

    def _open(self) -> None:
        db = self._db
        db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode != "wal" and self.path != ":memory:":
            log.warning("%s: journal_mode is %s, not wal (still durable, slower)", self.path, mode)
        db.execute("PRAGMA synchronous = FULL")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version not in READABLE_VERSIONS:
            raise ConfigError(
                f"{self.path}: store schema version {version}, this echo2 reads {SCHEMA_VERSION}; "
                "start a fresh run (without --resume) or use the echo2 that wrote it"
            )
        with self._tx():
            migrate(db, version)
            settings = dict(db.execute("SELECT name, value FROM settings").fetchall())
            if "group_size" in settings and int(settings["group_size"]) != self.group_size:
                raise ConfigError(
                    f"{self.path}: store holds groups of {settings['group_size']} samples, "
                    f"opened with group_size={self.group_size}"
                )
            if "staleness" in settings and int(settings["staleness"]) != self.staleness:
                log.info("%s: staleness changed %s -> %d", self.path, settings["staleness"], self.staleness)
            db.executemany(
                "INSERT OR REPLACE INTO settings (name, value) VALUES (?, ?)",
                [("group_size", str(self.group_size)), ("staleness", str(self.staleness))],
            )

    @contextmanager
    def _tx(self) -> Iterator[None]:
        """One write transaction: committed on success, rolled back on any exception. Rejections counted
        since the last one are written with it."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
            for reason, n in self._rejections.items():
                self._bump(f"rejected/{reason}", n)
            self._db.execute("COMMIT")
            self._rejections.clear()
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise

    def _bump(self, name: str, delta: int) -> None:
        if delta:
            self._db.execute(
                "INSERT INTO counters (name, value) VALUES (?, ?) "
                "ON CONFLICT (name) DO UPDATE SET value = value + excluded.value",
                (name, delta),
            )

    def _drop_stale(self, learner_version: int) -> int:
        """Delete buffered groups with ``policy_version < learner_version - S``; trajectories dropped. The
        prompts of the dropped groups are to be leased again (:meth:`take_redo`), but for a lease answered
        after it expired (its prompts were leased again when it expired)."""
        floor = admission_floor(learner_version, self.staleness)
        self._floor = floor
        rows = self._db.execute(
            "SELECT g.n_traj, g.prompt_id, l.prompts, COALESCE(l.late, 0) = 0 "
            "FROM rollout_groups g LEFT JOIN leases l USING (lease_id) "
            "WHERE g.consumed_step IS NULL AND g.policy_version < ?",
            (floor,),
        ).fetchall()
        n = sum(int(r[0]) for r in rows)
        if n:
            self._db.execute(
                f"UPDATE rollout_groups SET consumed_step = {DROPPED}, data = '' "
                "WHERE consumed_step IS NULL AND policy_version < ?",
                (floor,),
            )
            self._bump("dropped_stale", n)
            self._bump("stale_buffered", n)
            self._redo += lease_prompts([(pid, text) for _, pid, text, on_time in rows if on_time], "stale")
            log.debug("dropped %d stale trajectories (policy_version < %d)", n, floor)
        return int(n)

    def take_redo(self) -> list[tuple[Prompt, str]]:
        """The prompts whose groups were discarded untrained since the last call, with the reason
        (``stale``: admitted, then dropped as too old before an update took them; ``late``: already too
        old when the answer came; ``purged``: their worker was quarantined; ``poisoned``: their loss or
        gradient was not finite; ``unchecked``: their check could not run), to lease again."""
        out, self._redo = self._redo, []
        return out

    # --- leases ---------------------------------------------------------------------------------------

    def issue_lease(
        self,
        worker_id: str,
        prompts: Sequence[Prompt],
        now: float,
        ttl_s: float,
        seed: int = 0,
        installed_version: int = -1,
        epoch: int = 0,
    ) -> str:
        """Lease ``prompts`` to ``worker_id`` until ``now + ttl_s``; returns a new lease id (uuid4 hex).

        The lease is ``open`` and valid while ``now < expires_at``; its prompts, the sampling ``seed`` it
        assigns, the ``installed_version`` the worker said it held and the run ``epoch`` of the learner
        process that issued it are stored with it.
        """
        if not prompts:
            raise ValueError("a lease needs at least one prompt")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s: {ttl_s} must be > 0")
        lease_id = uuid.uuid4().hex
        with self._tx():
            self._db.execute(
                "INSERT INTO leases (lease_id, worker_id, state, issued_at, expires_at, n_prompts, prompts, "
                "seed, installed_version, epoch) VALUES (?, ?, 'open', ?, ?, ?, ?, ?, ?, ?)",
                (
                    lease_id,
                    worker_id,
                    now,
                    now + ttl_s,
                    len(prompts),
                    encode_prompts(prompts),
                    seed,
                    installed_version,
                    epoch,
                ),
            )
        return lease_id

    def lease(self, lease_id: str) -> Lease | None:
        """The lease ``lease_id``, or None if it was never issued."""
        row = self._db.execute(
            "SELECT worker_id, state, issued_at, prompts, seed, installed_version, epoch FROM leases "
            "WHERE lease_id = ?",
            (lease_id,),
        ).fetchone()
        if row is None:
            return None
        owner, state, issued, prompts, seed, installed, epoch = row
        return Lease(
            lease_id,
            str(owner),
            str(state),
            float(issued),
            decode_prompts(prompts),
            int(seed),
            int(installed),
            int(epoch),
        )

    def purge_worker(self, worker_id: str) -> tuple[int, list[Prompt]]:
        """Take back everything ``worker_id`` holds (it was quarantined): its buffered groups are purged
        untrained (counted ``purged``, in trajectories; kept in the ledger without samples), its open
        leases expire. Returns the trajectories purged and the prompts of those leases, to lease again.
        Groups already trained on stay trained on (their step is in the ledger)."""
        with self._tx():
            held = self._db.execute(
                "SELECT g.n_traj, g.prompt_id, l.prompts FROM rollout_groups g "
                "JOIN leases l USING (lease_id) WHERE g.consumed_step IS NULL AND l.worker_id = ?",
                (worker_id,),
            ).fetchall()
            n = sum(int(r[0]) for r in held)
            self._redo += lease_prompts([(pid, text) for _, pid, text in held], "purged")
            self._db.execute(
                f"UPDATE rollout_groups SET consumed_step = {PURGED}, data = '' WHERE consumed_step IS NULL "
                "AND lease_id IN (SELECT lease_id FROM leases WHERE worker_id = ?)",
                (worker_id,),
            )
            self._bump("purged", int(n))
            rows = self._db.execute(
                "SELECT lease_id, prompts FROM leases WHERE state = 'open' AND worker_id = ? "
                "ORDER BY issued_at",
                (worker_id,),
            ).fetchall()
            self._db.executemany(
                "UPDATE leases SET state = 'expired' WHERE lease_id = ?", [(r[0],) for r in rows]
            )
            self._bump("leases_expired", len(rows))
        log.warning("purged %d buffered trajectories and %d open leases of %s", n, len(rows), worker_id)
        return int(n), [p for _, text in rows for p in decode_prompts(text)]

    def purge_groups(self, group_ids: Sequence[str]) -> list[str]:
        """Purge these groups untrained wherever they are (buffered, or consumed by a step whose update
        left them out): counted ``purged`` (trajectories) and ``poisoned`` (groups), kept in the ledger
        without samples, so :meth:`requeue_after` never hands them back. Returns the workers whose
        leases they answered (each once)."""
        if not group_ids:
            return []
        marks = ",".join("?" * len(group_ids))
        with self._tx():
            rows = self._db.execute(
                f"SELECT g.n_traj, l.worker_id, g.prompt_id, l.prompts FROM rollout_groups g "
                f"JOIN leases l USING (lease_id) WHERE g.group_id IN ({marks}) AND g.data != ''",
                list(group_ids),
            ).fetchall()
            self._redo += lease_prompts([(pid, text) for _, _, pid, text in rows], "poisoned")
            (taken,) = self._db.execute(  # those an update had taken: not trained after all
                f"SELECT COALESCE(SUM(n_traj), 0) FROM rollout_groups WHERE group_id IN ({marks}) "
                "AND data != '' AND consumed_step >= 0",
                list(group_ids),
            ).fetchone()
            self._bump("trained", -int(taken))
            self._db.execute(
                f"UPDATE rollout_groups SET consumed_step = {PURGED}, data = '' WHERE group_id IN ({marks})",
                list(group_ids),
            )
            self._bump("purged", sum(int(r[0]) for r in rows))
            self._bump("poisoned", len(rows))
        log.warning("purged %d groups whose loss or gradient was not finite", len(rows))
        return sorted({str(r[1]) for r in rows})

    def workers_of(self, group_ids: Sequence[str]) -> dict[str, str]:
        """The worker each of ``group_ids`` answered a lease of (the store's record, never a submission's
        claim); groups it does not know are left out."""
        if not group_ids:
            return {}
        marks = ",".join("?" * len(group_ids))
        rows = self._db.execute(
            f"SELECT g.group_id, l.worker_id FROM rollout_groups g JOIN leases l USING (lease_id) "
            f"WHERE g.group_id IN ({marks})",
            list(group_ids),
        ).fetchall()
        return {str(g): str(w) for g, w in rows}

    def open_leases(self, worker_id: str) -> int:
        """Leases issued to ``worker_id`` that are still ``open`` (neither submitted nor expired)."""
        (n,) = self._db.execute(
            "SELECT COUNT(*) FROM leases WHERE state = 'open' AND worker_id = ?", (worker_id,)
        ).fetchone()
        return int(n)

    def expire_lease(self, lease_id: str) -> list[Prompt]:
        """Expire one ``open`` lease now (its answer was refused); its prompts, to lease again ([] if it
        is not open). A later answer is still accepted, as for any expired lease."""
        with self._tx():
            row = self._db.execute(
                "SELECT prompts FROM leases WHERE lease_id = ? AND state = 'open'", (lease_id,)
            ).fetchone()
            if row is None:
                return []
            self._db.execute("UPDATE leases SET state = 'expired' WHERE lease_id = ?", (lease_id,))
            self._bump("leases_expired", 1)
        return decode_prompts(row[0])

    def held_by_worker(self) -> dict[str, int]:
        """Trajectories waiting for their generation check (held, buffered), per worker holding any."""
        rows = self._db.execute(
            "SELECT l.worker_id, SUM(g.n_traj) FROM rollout_groups g JOIN leases l USING (lease_id) "
            "WHERE g.held = 1 AND g.consumed_step IS NULL GROUP BY l.worker_id"
        ).fetchall()
        return {str(w): int(n) for w, n in rows}

    def open_prompts_by_worker(self) -> dict[str, int]:
        """Prompts of the open leases, per worker holding any."""
        rows = self._db.execute(
            "SELECT worker_id, SUM(n_prompts) FROM leases WHERE state = 'open' GROUP BY worker_id"
        ).fetchall()
        return {str(w): int(n) for w, n in rows}

    def expire_leases(self, now: float) -> list[Prompt]:
        """Mark open leases with ``expires_at <= now`` as ``expired``; returns their prompts to lease again.

        A late submission of an expired lease is still accepted (see :meth:`submit`).
        """
        return [p for _, ps, _ in self.expire_leases_by_worker(now) for p in ps]

    def expire_leases_by_worker(self, now: float) -> list[tuple[str, list[Prompt], float]]:
        """:meth:`expire_leases`, saying whose each expired lease was and how long it was held:
        ``(worker_id, its prompts, time to live)`` per lease, oldest first."""
        with self._tx():
            rows = self._db.execute(
                "SELECT lease_id, prompts, worker_id, expires_at - issued_at FROM leases "
                "WHERE state = 'open' AND expires_at <= ? ORDER BY issued_at",
                (now,),
            ).fetchall()
            if rows:
                self._db.executemany(
                    "UPDATE leases SET state = 'expired' WHERE lease_id = ?", [(r[0],) for r in rows]
                )
                self._bump("leases_expired", len(rows))
        if rows:
            log.info("expired %d leases", len(rows))
        return [(str(w), decode_prompts(text), float(ttl)) for _, text, w, ttl in rows]

    # --- ingest ---------------------------------------------------------------------------------------

    def submit(
        self, sub: Submission, worker_id: str, learner_version: int, now: float, hold: bool = False
    ) -> SubmitResult:
        """Accept a validated submission for its lease, in one transaction; or raise :class:`Rejected`.

        Checks, in order: the lease exists [unknown_lease], was issued to ``worker_id`` [wrong_worker],
        is not already ``submitted`` [replay; an ``expired`` lease is accepted late], and the groups'
        prompt ids equal the lease's, in order [prompt_mismatch]. Then admission at ``v_t =
        learner_version``: if ``sub.policy_version < v_t - S`` every trajectory is dropped (counted
        ``dropped_stale``), else every group is stored (counted ``admitted``). The lease becomes
        ``submitted`` either way. ``hold``: the stored groups are not trainable until :meth:`release`
        (their generation check passed) or :meth:`drop_held` (it could not run).

        A rejected submission changes nothing. Rejections are *not* counted here: the caller counts
        each one, from here or the validator, with :meth:`record_rejection` (one place, no double count).
        """
        with self._tx():
            row = self._db.execute(
                "SELECT worker_id, state, prompts FROM leases WHERE lease_id = ?", (sub.lease_id,)
            ).fetchone()
            if row is None:
                raise Rejected("unknown_lease", f"lease_id: {sub.lease_id!r} was never issued")
            owner, state, prompts_json = row
            if owner != worker_id:
                raise Rejected("wrong_worker", f"lease_id: {sub.lease_id!r} was issued to another worker")
            if state == "submitted":
                raise Rejected("replay", f"lease_id: {sub.lease_id!r} was already submitted")
            want = [p[0] for p in json.loads(prompts_json)]
            got = [g[0].prompt_id if g else "" for g in sub.groups]
            if got != want:
                if len(got) != len(want):
                    detail = f"groups: {len(got)} groups for a lease of {len(want)} prompts"
                else:
                    i = next(k for k, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
                    detail = f"groups[{i}].prompt_id: {got[i]!r}, the lease has {want[i]!r}"
                raise Rejected("prompt_mismatch", detail)
            for i, g in enumerate(sub.groups):
                if len(g) != self.group_size:
                    raise Rejected(
                        "group_size", f"groups[{i}].samples: {len(g)} samples, expected {self.group_size}"
                    )
            n = sum(len(g) for g in sub.groups)
            floor = admission_floor(learner_version, self.staleness)
            self._floor = floor
            if sub.policy_version < floor:
                self._bump("dropped_stale", n)
                if state == "open":  # an expired lease's prompts were leased again when it expired
                    # "late": the answer's own lateness (a strike for its worker), not the learner's pace
                    self._redo += [(p, "late") for p in decode_prompts(prompts_json)]
                result = SubmitResult(admitted=0, dropped_stale=n)
            else:
                flat = [self.drop_flat and len({t.reward for t in g}) == 1 for g in sub.groups]
                self._db.executemany(
                    "INSERT INTO rollout_groups (group_id, lease_id, prompt_id, policy_version, n_traj, "
                    "data, held, consumed_step) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [
                        (
                            g[0].group_id,
                            sub.lease_id,
                            g[0].prompt_id,
                            sub.policy_version,
                            len(g),
                            "" if f else encode_group(g),
                            int(hold),  # a flat group's check still runs: it vouches for the rest
                            FLAT if f else None,
                        )
                        for g, f in zip(sub.groups, flat, strict=True)
                    ],
                )
                n_flat = sum(len(g) for g, f in zip(sub.groups, flat, strict=True) if f)
                self._bump("admitted", n)
                self._bump("zero_variance", n_flat)
                self._bump("admitted_tokens", sum(len(t.completion_ids) for g in sub.groups for t in g))
                result = SubmitResult(
                    admitted=n, dropped_stale=0, held=n if hold else 0, zero_variance=n_flat
                )
            self._db.execute(
                "UPDATE leases SET state = 'submitted', submitted_at = ?, late = ? WHERE lease_id = ?",
                (now, int(state == "expired"), sub.lease_id),
            )
        if result.dropped_stale:
            log.debug(
                "lease %s: %d stale trajectories dropped (v=%d < %d - %d)",
                sub.lease_id,
                n,
                sub.policy_version,
                learner_version,
                self.staleness,
            )
        return result

    def release(self, lease_id: str) -> int:
        """The groups of ``lease_id`` held for their generation check become trainable (it passed);
        returns the trajectories released (0 when they were purged or dropped meanwhile)."""
        with self._tx():
            (n,) = self._db.execute(
                "SELECT COALESCE(SUM(n_traj), 0) FROM rollout_groups "
                "WHERE lease_id = ? AND held = 1 AND consumed_step IS NULL",
                (lease_id,),
            ).fetchone()
            self._db.execute(
                "UPDATE rollout_groups SET held = 0 WHERE lease_id = ? AND held = 1", (lease_id,)
            )
        return int(n)

    def drop_held(self, lease_id: str | None = None) -> int:
        """Discard untrained the groups held for a check that cannot run (``lease_id``'s; None: every
        held group, those of a learner process that stopped before their checks ran), counted
        ``unchecked_dropped`` (trajectories); their prompts are leased again. Returns the trajectories."""
        one = lease_id is not None
        args = (lease_id,) if one else ()
        with self._tx():
            rows = self._db.execute(
                "SELECT g.n_traj, g.prompt_id, l.prompts FROM rollout_groups g LEFT JOIN leases l "
                "USING (lease_id) WHERE g.held = 1 AND g.consumed_step IS NULL"
                + (" AND g.lease_id = ?" if one else ""),
                args,
            ).fetchall()
            n = sum(int(r[0]) for r in rows)
            self._redo += lease_prompts([(pid, text) for _, pid, text in rows], "unchecked")
            self._db.execute(
                f"UPDATE rollout_groups SET consumed_step = {PURGED}, data = '' "
                "WHERE held = 1 AND consumed_step IS NULL" + (" AND lease_id = ?" if one else ""),
                args,
            )
            self._bump("unchecked_dropped", n)
        return n

    def record_rejection(self, reason: str, count: int = 1) -> None:
        """Count one rejected submission (``count``: that many) under ``rejected/<reason>``.

        Counted in memory and written with the next transaction (or once :data:`REJECTION_FLUSH` are
        pending, or at :meth:`close`): a flood of bad requests never costs a disk sync each. A crash
        loses at most the counts since the last write, never an accepted group.

        ``reason`` is a :class:`Rejected` code, or one of the HTTP layer's own (``auth``, ``malformed``);
        any short lower-case identifier is accepted, anything else raises ValueError (it is a label).
        """
        if not is_reason_label(reason):
            raise ValueError(f"rejection reason {reason!r} is not a short lower-case identifier")
        self._rejections[reason] = self._rejections.get(reason, 0) + count
        if sum(self._rejections.values()) >= REJECTION_FLUSH:
            self.flush()

    def flush(self) -> None:
        """Write the rejection counts held in memory (one transaction)."""
        if self._rejections:
            with self._tx():
                pass

    # --- learner side ---------------------------------------------------------------------------------

    def take_batch(
        self, n_groups: int, learner_version: int, step: int
    ) -> list[tuple[Trajectory, ...]] | None:
        """The ``n_groups`` oldest admissible groups, marked consumed by ``step``; None if too few.

        First every buffered group with ``policy_version < learner_version - S`` is discarded (counted
        ``dropped_stale``, in trajectories; committed even when None is returned). While a group held for
        its generation check claims ``learner_version - S`` (this update would leave it behind unchecked),
        None: the learner waits for that check (counted ``waits_for_checks``). Then, if at least
        ``n_groups`` buffered groups remain, the ``n_groups`` earliest to arrive are returned whole (each
        a tuple of ``group_size`` trajectories, sample order preserved) and never returned again (unless
        :meth:`requeue_after`); otherwise nothing is consumed.
        """
        if n_groups < 1:
            raise ValueError(f"n_groups: {n_groups} must be >= 1")
        with self._tx():
            self._drop_stale(learner_version)
            if self._checks_at_floor(learner_version):
                self.waits_for_checks += 1
                return None
            rows = self._db.execute(
                "SELECT seq, group_id, prompt_id, policy_version, data FROM rollout_groups "
                "WHERE consumed_step IS NULL AND held = 0 ORDER BY seq LIMIT ?",
                (n_groups,),
            ).fetchall()
            if len(rows) < n_groups:
                return None
            self._db.executemany(
                "UPDATE rollout_groups SET consumed_step = ? WHERE seq = ?", [(step, r[0]) for r in rows]
            )
            self._bump("trained", len(rows) * self.group_size)  # every group is whole
        self.taken_at = learner_version
        return [decode_group(data, gid, v) for _, gid, _pid, v, data in rows]

    def _checks_at_floor(self, learner_version: int) -> bool:
        """Whether a group held for its generation check claims the oldest admissible version: the update
        this batch is for would leave it behind, unchecked. The learner then waits (the check runs
        meanwhile, not yielding to any update), so a drawn submission's check never expires for the
        learner's pace: the share drawn is re-run, whatever the load."""
        floor = admission_floor(learner_version, self.staleness)
        return (
            self._db.execute(
                "SELECT 1 FROM rollout_groups WHERE held = 1 AND consumed_step IS NULL "
                "AND policy_version <= ? LIMIT 1",
                (floor,),
            ).fetchone()
            is not None
        )

    def requeue_after(self, step: int) -> int:
        """Groups consumed by a step ``> step`` become buffered again; returns how many.

        For a learner restarting from its checkpoint at ``step``: the updates that used those groups were
        lost, so they must be trained on (once). They keep their arrival order, so they come first.
        """
        with self._tx():
            (back,) = self._db.execute(
                "SELECT COALESCE(SUM(n_traj), 0) FROM rollout_groups WHERE consumed_step > ? AND data != ''",
                (step,),
            ).fetchone()
            n = self._db.execute(
                "UPDATE rollout_groups SET consumed_step = NULL WHERE consumed_step > ? AND data != ''",
                (step,),
            ).rowcount
            self._bump("trained", -int(back))
        if n:
            log.info("requeued %d groups consumed after step %d", n, step)
        return int(n)

    def prune_consumed(self, through_step: int) -> int:
        """Free the samples of groups consumed by a step ``<= through_step``; returns how many.

        Call once a checkpoint at ``through_step`` is durable: those groups can never be requeued. The
        row stays (without its samples) as the ledger of which step trained on which group.
        """
        with self._tx():
            n = self._db.execute(
                "UPDATE rollout_groups SET data = '' WHERE consumed_step BETWEEN 1 AND ? AND data != ''",
                (through_step,),
            ).rowcount
        return int(n)

    def consumed_per_step(self) -> dict[int, int]:
        """The ledger: learner step -> groups it trained on (each group counts under one step only)."""
        rows = self._db.execute(
            "SELECT consumed_step, COUNT(*) FROM rollout_groups "
            "WHERE consumed_step >= 0 GROUP BY consumed_step"
        ).fetchall()
        return {int(step): int(n) for step, n in rows}

    # --- observation ----------------------------------------------------------------------------------

    def _buffered(self, held_only: bool = False) -> int:
        floor = -(2**62) if self._floor is None else self._floor
        return int(
            self._db.execute(
                "SELECT COALESCE(SUM(n_traj), 0) FROM rollout_groups "
                "WHERE consumed_step IS NULL AND policy_version >= ?"
                + (" AND held = 1" if held_only else ""),
                (floor,),
            ).fetchone()[0]
        )

    def stats(self) -> StoreStats:
        """Counters and sizes; ``size`` counts buffered groups admissible at the last learner version
        passed to :meth:`submit` or :meth:`take_batch` (all buffered groups before any such call)."""
        counters: dict[str, Any] = dict(self._db.execute("SELECT name, value FROM counters").fetchall())
        by_reason = {k.split("/", 1)[1]: int(v) for k, v in counters.items() if k.startswith("rejected/")}
        for reason, n in self._rejections.items():
            by_reason[reason] = by_reason.get(reason, 0) + n
        (leases_open,) = self._db.execute("SELECT COUNT(*) FROM leases WHERE state = 'open'").fetchone()
        return StoreStats(
            size=self._buffered(),
            admitted=int(counters.get("admitted", 0)),
            dropped_stale=int(counters.get("dropped_stale", 0)),
            rejected=sum(by_reason.values()),
            rejected_by_reason=by_reason,
            purged=int(counters.get("purged", 0)),
            poisoned=int(counters.get("poisoned", 0)),
            leases_open=int(leases_open),
            leases_expired=int(counters.get("leases_expired", 0)),
            admitted_tokens=int(counters.get("admitted_tokens", 0)),
            held=self._buffered(held_only=True),
            unchecked_dropped=int(counters.get("unchecked_dropped", 0)),
            zero_variance=int(counters.get("zero_variance", 0)),
            trained=int(counters.get("trained", 0)),
            stale_buffered=int(counters.get("stale_buffered", 0)),
        )

    def outstanding_rollouts(self) -> int:
        """Trajectories in flight: ``group_size x (prompts of open leases) + buffered trajectories``.

        Buffered is :attr:`StoreStats.size`. The learner caps the work it leases out with this number.
        """
        (leased,) = self._db.execute(
            "SELECT COALESCE(SUM(n_prompts), 0) FROM leases WHERE state = 'open'"
        ).fetchone()
        return int(leased) * self.group_size + self._buffered()

    def close(self) -> None:
        """Write the pending rejection counts and close the connection (everything accepted is already
        on disk)."""
        try:
            self.flush()
        finally:
            self._db.close()

    def __enter__(self) -> TrajectoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
