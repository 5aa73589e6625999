"""The worker registry of the learner node: who is a member, with which credential, holding which version.

The one list the HTTP API (authentication, heartbeats) and the broadcast plane (who may join the
snapshot topology) both consult. The run's join token is exchanged once for a per-worker bearer
credential; only the credential's SHA-256 is kept, in ``workers.json`` of the run directory, so
credentials survive a learner restart and a leaked registry file grants nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from echo2.protocol import RegisterRequest

log = logging.getLogger(__name__)

DEFAULT_RATE = 1.0  # rollouts/s assumed for a worker that registers without an estimate
REGISTRY_FILE = "workers.json"


@dataclass
class WorkerRecord:
    """A registered worker, as the learner knows it (persisted without the credential)."""

    worker_id: str  # unique id the learner assigned
    name: str  # the name the worker gave (host name, ...)
    credential_sha256: str  # hex digest of its bearer credential
    usd_per_hour: float  # its price c_i
    hardware: str  # free-text description (GPU model, ...)
    rollouts_per_s: float  # its own estimate at registration (the controller's prior)
    installed_version: int = -1  # newest snapshot it reported installed
    install_s: float = 0.0  # seconds its last install took, as it reported (not persisted)
    rollouts: int = 0  # rollouts it has had admitted
    quarantined: str = ""  # why its credential was revoked ("" while it is trusted)
    last_seen_s: float = 0.0  # clock time of its last authenticated call (not persisted)


class WorkerRegistry:
    """Membership, credentials and installed versions, persisted in ``run_path / workers.json``."""

    def __init__(
        self, run_path: Path, join_token: str, clock: Callable[[], float], max_workers: int = 64
    ) -> None:
        self.path = run_path / REGISTRY_FILE
        self.join_token = join_token
        self.clock = clock
        self.max_workers = max_workers  # registrations the join token allows in this run
        self._records: dict[str, WorkerRecord] = {}
        self._by_cred: dict[str, str] = {}  # credential sha -> worker id

    def __iter__(self) -> Iterator[WorkerRecord]:
        return iter(list(self._records.values()))

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, worker_id: str) -> WorkerRecord:
        return self._records[worker_id]

    def token_ok(self, token: str) -> bool:
        """Constant-time check of a join token."""
        return hmac.compare_digest(token.encode(), self.join_token.encode())

    @property
    def full(self) -> bool:
        """The join token has made all the registrations it may (quarantined workers count too)."""
        return len(self._records) >= self.max_workers

    def register(self, req: RegisterRequest) -> tuple[WorkerRecord, str]:
        """Enroll a worker whose token was checked (and :attr:`full` was not); returns its record and
        its new credential."""
        credential = secrets.token_urlsafe(32)
        rec = WorkerRecord(
            worker_id=f"w{len(self._records)}-{secrets.token_hex(3)}",
            name=req.name,
            credential_sha256=_sha(credential),
            usd_per_hour=req.usd_per_hour,
            hardware=req.hardware,
            rollouts_per_s=req.rollouts_per_s or DEFAULT_RATE,
            last_seen_s=self.clock(),
        )
        self._index(rec)
        self.save()
        log.info(
            "registered %s (%s, %s, $%.2f/h)", rec.worker_id, rec.name, rec.hardware or "?", rec.usd_per_hour
        )
        return rec, credential

    def authenticate(self, credential: str) -> WorkerRecord | None:
        """The worker holding ``credential`` (its last-seen time updated; check ``quarantined``), or
        None."""
        wid = self._by_cred.get(_sha(credential))
        if wid is None:
            return None
        rec = self._records[wid]
        if not rec.quarantined:
            rec.last_seen_s = self.clock()
        return rec

    def may_join_broadcast(self, worker_id: str, credential: object) -> bool:
        """Only registered, trusted workers join the snapshot topology, and only under their own id."""
        return (
            isinstance(credential, str)
            and self._by_cred.get(_sha(credential)) == worker_id
            and not self._records[worker_id].quarantined
        )

    def revoke(self, worker_id: str, reason: str) -> None:
        """Quarantine a worker: its credential opens nothing any more (persisted, so a restart keeps it
        out); the record stays, with the reason, for the registry's history."""
        rec = self._records[worker_id]
        if not rec.quarantined:
            rec.quarantined = reason
            self.save()
            log.warning("quarantined %s (%s): %s", worker_id, rec.name, reason)

    def seen_within(self, seconds: float) -> list[str]:
        """Workers heard from in the last ``seconds``."""
        now = self.clock()
        return [w for w, r in self._records.items() if now - r.last_seen_s <= seconds and not r.quarantined]

    # ---- persistence ---------------------------------------------------------------------------------
    def save(self) -> None:
        data = [
            {k: v for k, v in asdict(r).items() if k not in ("last_seen_s", "install_s")}
            for r in self._records.values()
        ]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self.path)

    def load(self) -> list[WorkerRecord]:
        """Restore the workers of an earlier learner process (each gets one heartbeat timeout to come
        back); returns them."""
        if not self.path.is_file():
            return []
        restored = [WorkerRecord(**d) for d in json.loads(self.path.read_text())]
        for rec in restored:
            rec.last_seen_s = self.clock()
            self._index(rec)
        log.info("restored %d registered workers from %s", len(restored), self.path)
        return restored

    def _index(self, rec: WorkerRecord) -> None:
        self._records[rec.worker_id] = rec
        self._by_cred[rec.credential_sha256] = rec.worker_id


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
