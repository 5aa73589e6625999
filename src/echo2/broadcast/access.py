"""Who may pull which chunks: per-member, per-version credentials and the checks made before a chunk moves.

The publisher issues every member, with each version it announces, a :class:`Credential`: the
learner's signature (the manifest key, ``weights/manifest.py``) over the run, the version, an expiry
time and the root of a Merkle tree whose leaves are the (member id, SHA-256 fingerprint of the member's
relay certificate) pairs of a batch of members (:func:`issue_batch`), with the member's path from its
leaf to that root. One signature covers a batch (an announcement's batch of up to
``publisher.ANNOUNCE_BATCH`` members), so a publication to 10,000 members signs ~40 times, not 10,000;
a batch of one is the tree of one leaf (an empty path). A leaf and an inner node hash with different
prefixes, so no path can pass an inner node off as a member: naming a member the batch did not hold
needs a second preimage of SHA-256. A server (the publisher, or a relaying peer, which holds the
learner's public key and so needs no call to the learner) admits a pull request only if it carries:

- a credential whose signature checks under the run's key, issued for this run, for the version
  asked, to the member id the request names, and not expired;
- over TLS, the member's certificate (its fingerprint must be the one the credential names) and a
  proof of possession: the member's ECDSA signature, by that certificate's key, over
  ``(this server's certificate fingerprint, member, version)``. A proof is good for one server only
  (the client pinned that server's certificate), so a peer that saw a request cannot replay it
  elsewhere, and a stolen credential is useless without the member's key;
- a member id the server was told to serve for that version: the publisher serves the members it
  announced the version to; a relay, the members the plan has pulling from it (``serve`` in its
  announcement);

and a chunk list that is bounded (:func:`~echo2.broadcast.buffer.check_chunk_list`: in range, no
duplicates, no more than the snapshot's chunk count). A server sends one member at most
``SERVE_BUDGET`` times the version's size plus ``BUDGET_SLACK_CHUNKS`` chunks (:class:`ByteBudget`,
the one definition of that rule: the learner's HTTP catch-up route books its chains to one too), so
nobody re-downloads a version endlessly. Every refusal is counted (:class:`ServeCounters`) and ends
the connection before any chunk byte is sent.

The frames are those of ``echo2.weights.frames``: :func:`pull_request` builds a ``GetFrame`` and sends
``to_wire`` of it, with the chunk list as its payload; :meth:`Gate.authenticate` reads a received
``get``'s credential fields through ``frames.parse_get_credentials`` (strict; a malformed one is
refused, and counted, as having no valid credential), before the rest of the header is parsed
(``wire.parse_pull``, from ``store.serve_pull``) and before the payload is read at all.

With the HMAC scheme (a secret every worker holds) any worker could mint credentials: that scheme
suits only a fleet whose workers trust each other, as for manifests.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from echo2.broadcast.wire import ProtocolError
from echo2.transport import TlsIdentity, fingerprint, signed_by
from echo2.weights.frames import GetCredentials, GetFrame, encode_chunk_list, parse_get_credentials, to_wire
from echo2.weights.manifest import ManifestKey

CREDENTIAL_TTL_S = 3600.0  # a credential is good for this long after issue (covers clock skew between hosts)
SERVE_BUDGET = 3.0  # bytes one server sends one member for one version <= this x the version's size ...
BUDGET_SLACK_CHUNKS = 4  # ... plus this many chunks (streams cut mid-chunk, small snapshots)
MAX_CERT_BYTES = 4096  # a member certificate in a request is at most this long (DER; frames.MAX_CERT_HEX)


class AccessError(ProtocolError):
    """A pull request without a valid credential, proof or schedule entry; the message says which."""


MAX_PATH = 40  # a credential's Merkle path has at most this many steps (batches of up to 2**40 members)
MAX_VERIFIED = 1024  # signed batches a server remembers as verified (cleared when full)
_STEP = 65  # one step of a path: "L" or "R" (the side the sibling is on) and the sibling's hex SHA-256


@dataclass(frozen=True)
class Credential:
    """The learner's permission for ``member`` to pull ``version`` of run ``run``."""

    run: str  # the run's id (:func:`run_id` of the learner's key)
    version: int  # the snapshot version it admits pulls of
    member: str  # the worker id it was issued to
    cert: str  # SHA-256 fingerprint of the member's relay certificate ("" without TLS)
    expires: float  # unix time after which servers refuse it
    sig: str  # the learner's signature (or MAC) over the run, version, expiry and the batch's root
    path: str = ""  # the member's leaf to the batch's root: steps of ``_STEP`` characters ("": alone)

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, "version": self.version, "member": self.member, "cert": self.cert,
                "expires": self.expires, "sig": self.sig, "path": self.path}  # fmt: skip

    @classmethod
    def from_dict(cls, d: object) -> Credential:
        """Parse an untrusted object; AccessError naming the bad field (the signature is not checked)."""
        if not isinstance(d, Mapping):
            raise AccessError("no credential: a pull request needs the learner's credential for the version")
        try:
            cred = cls(
                run=d["run"], version=d["version"], member=d["member"], cert=d["cert"],
                expires=d["expires"], sig=d["sig"], path=d["path"],
            )  # fmt: skip
        except KeyError as exc:
            raise AccessError(f"credential is missing {exc}") from None
        ok = (
            all(isinstance(x, str) for x in (cred.run, cred.member, cred.cert, cred.sig, cred.path))
            and isinstance(cred.version, int)
            and not isinstance(cred.version, bool)
            and isinstance(cred.expires, int | float)
        )
        if not ok:
            raise AccessError("credential fields have the wrong types")
        if len(cred.path) % _STEP or len(cred.path) > MAX_PATH * _STEP:
            raise AccessError(
                f"credential path of {len(cred.path)} characters is not whole steps (at most {MAX_PATH})"
            )
        return cred


def run_id(key: ManifestKey) -> str:
    """A short id of the run: a digest of the learner's verification key (the same on every node)."""
    return hashlib.sha256(b"echo2-run\0" + key.verifier().to_text().encode()).hexdigest()[:16]


def _leaf(member: str, cert: str) -> bytes:
    """A member's leaf in a batch's tree (prefix 0: never an inner node's hash)."""
    return hashlib.sha256(b"\0" + json.dumps([member, cert], separators=(",", ":")).encode()).digest()


def _node(left: bytes, right: bytes) -> bytes:
    """An inner node of a batch's tree (prefix 1)."""
    return hashlib.sha256(b"\1" + left + right).digest()


def _root(leaf: bytes, path: str) -> bytes:
    """The root ``path`` leads ``leaf`` to; AccessError if a step is not a side and a hex digest."""
    h = leaf
    for i in range(0, len(path), _STEP):
        side, sibling = path[i], path[i + 1 : i + _STEP]
        try:
            other = bytes.fromhex(sibling)
        except ValueError:
            raise AccessError("credential path holds a step that is not hex") from None
        if side == "L":
            h = _node(other, h)
        elif side == "R":
            h = _node(h, other)
        else:
            raise AccessError(f"credential path step names side {side!r}, not L or R")
    return h


def _signed(run: str, version: int, root: bytes, expires: float) -> bytes:
    body = {"what": "echo2-pull", "run": run, "v": version, "root": root.hex(), "exp": expires}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def issue_batch(
    key: ManifestKey, version: int, members: Mapping[str, str], ttl: float = CREDENTIAL_TTL_S
) -> dict[str, Credential]:
    """The publisher's credentials for ``members`` (member id -> its relay certificate's fingerprint)
    to pull ``version``: one signature over the root of their leaves' tree, each with its path. A level
    of odd length carries its last node up unpaired (no step for it)."""
    run, expires = run_id(key), round(time.time() + ttl, 3)
    ids = list(members)
    level = [_leaf(w, members[w]) for w in ids]
    paths: list[list[str]] = [[] for _ in ids]
    under = [[i] for i in range(len(ids))]  # the members under each node of the level
    while len(level) > 1:
        up, up_under = [], []
        for j in range(0, len(level) - 1, 2):
            left, right = level[j], level[j + 1]
            for i in under[j]:
                paths[i].append("R" + right.hex())
            for i in under[j + 1]:
                paths[i].append("L" + left.hex())
            up.append(_node(left, right))
            up_under.append(under[j] + under[j + 1])
        if len(level) % 2:
            up.append(level[-1])
            up_under.append(under[-1])
        level, under = up, up_under
    if not level:
        return {}
    sig = key.sign(_signed(run, version, level[0], expires))
    return {
        w: Credential(run, version, w, members[w], expires, sig, "".join(paths[i])) for i, w in enumerate(ids)
    }


def issue(
    key: ManifestKey, version: int, member: str, cert: str, ttl: float = CREDENTIAL_TTL_S
) -> Credential:
    """The publisher's credential for ``member`` (relay certificate ``cert``) to pull ``version``: a
    batch of one."""
    return issue_batch(key, version, {member: cert}, ttl)[member]


def proof_payload(server_cert: str, member: str, version: int) -> bytes:
    """What a member signs to pull ``version`` from the server whose certificate is ``server_cert``."""
    return f"echo2-get\0{server_cert}\0{member}\0{version}".encode()


def pull_request(
    credential: Credential, chunks: list[int], repair: bool, server_cert: str, me: TlsIdentity | None
) -> tuple[dict[str, Any], bytes]:
    """The ``get`` frame a member sends a server: its header (``to_wire`` of its ``GetFrame``) and its
    payload, the chunk list (``server_cert`` "" and ``me`` None without TLS)."""
    proof = None if me is None else me.sign(proof_payload(server_cert, credential.member, credential.version))
    payload = encode_chunk_list(chunks)
    frame = GetFrame(
        v=credential.version, member=credential.member, repair=repair,
        cred=credential.to_dict(), cert=None if me is None else me.cert_der.hex(),
        proof=None if proof is None else proof.hex(), n=len(payload),
    )  # fmt: skip
    return to_wire(frame), payload


def check_credential(
    key: ManifestKey, cred: Credential, version: int, member: str, verified: set[bytes] | None = None
) -> None:
    """AccessError unless ``cred`` is the learner's unexpired credential for ``member`` and ``version``.
    ``verified``: signed payloads (with their signature) already found good; the signature of one in
    it is not checked again, and a good one is added (a server's pulls of one batch verify it once)."""
    if cred.member != member or cred.version != version:
        raise AccessError(
            f"credential of {cred.member!r} for v{cred.version} presented by {member!r} for v{version}"
        )
    if cred.run != run_id(key):
        raise AccessError(f"credential of another run ({cred.run})")
    payload = _signed(cred.run, cred.version, _root(_leaf(cred.member, cred.cert), cred.path), cred.expires)
    seen = payload + b"\0" + cred.sig.encode()
    if verified is None or seen not in verified:
        if not key.verify(payload, cred.sig):
            raise AccessError(f"credential of {member!r} for v{version} fails the learner's signature")
        if verified is not None:
            if len(verified) >= MAX_VERIFIED:
                verified.clear()
            verified.add(seen)
    if cred.expires < time.time():
        raise AccessError(f"credential of {member!r} for v{version} expired")


@dataclass
class ServeCounters:
    """What a server (publisher or relay) refused; every refusal also ends its connection."""

    refused_requests: int = 0  # pulls without a valid credential / proof, or from a member not served here
    bad_requests: int = 0  # pulls with a malformed or out-of-bounds chunk list, or of an unknown version
    over_budget: int = 0  # pulls stopped at the per-member byte budget of a version


class Gate:
    """A server's check of pull requests: ``authenticate`` and ``require`` before serving, ``charge``
    for every chunk."""

    def __init__(self, key: ManifestKey, me: TlsIdentity | None, counters: ServeCounters) -> None:
        self.key = key  # the learner's key (its public half on a relay)
        self.me = me  # this server's TLS identity (its fingerprint is in every proof); None = plain
        self.counters = counters
        self.budget = ByteBudget()  # payload bytes sent per (member, version)
        self.verified: set[bytes] = set()  # credential batches whose signature checked (check_credential)

    def authenticate(self, header: Mapping[str, Any]) -> tuple[str, int]:
        """(member, version) of a ``get`` whose credential (and, over TLS, certificate and proof)
        check; AccessError, counted, otherwise. Whether this node serves that member is
        :meth:`require`'s question. The header's credential fields are read strictly
        (``frames.parse_get_credentials``): a malformed one (a member id that is no string, a version
        that is no integer, ...) is refused here by name, whatever the rest of the frame holds."""
        try:
            try:
                asked = parse_get_credentials(header)
            except ProtocolError as exc:
                raise AccessError(str(exc)) from None
            cred = Credential.from_dict(asked.cred)
            check_credential(self.key, cred, asked.v, asked.member, self.verified)
            if self.me is not None:
                self._check_proof(asked, cred)
        except AccessError:
            self.counters.refused_requests += 1
            raise
        return asked.member, asked.v

    def require(self, scheduled: bool, member: str, version: int) -> None:
        """AccessError, counted, unless ``member`` is ``scheduled`` to pull ``version`` from this node."""
        if not scheduled:
            self.counters.refused_requests += 1
            raise AccessError(f"{member!r} is not a member this node serves v{version} to")

    def _check_proof(self, asked: GetCredentials, cred: Credential) -> None:
        assert self.me is not None
        if asked.cert is None or asked.proof is None:  # their lengths are bounded by the frame's model
            raise AccessError("a pull request over TLS carries the member's certificate and proof")
        try:
            der, sig = bytes.fromhex(asked.cert), bytes.fromhex(asked.proof)
        except ValueError:
            raise AccessError("certificate and proof must be hex") from None
        if not cred.cert or fingerprint(der) != cred.cert:
            raise AccessError(f"the certificate {cred.member!r} presents is not the one its credential names")
        if not signed_by(der, proof_payload(self.me.fingerprint, cred.member, cred.version), sig):
            raise AccessError(f"{cred.member!r}'s proof is not signed by its certificate's key for this node")

    def charge(self, member: str, version: int, total_size: int, chunk_size: int) -> Callable[[int], bool]:
        """A callback that books ``n`` bytes to ``member``'s budget for ``version`` and says whether
        they may still be sent (counted when not)."""

        def book(n: int) -> bool:
            if self.budget.book(member, version, n, total_size, chunk_size):
                return True
            self.counters.over_budget += 1
            return False

        return book

    def forget_before(self, version: int) -> None:
        """Drop the budgets of versions older than ``version`` (no longer served)."""
        self.budget.forget_before(version)


class ByteBudget:
    """Bytes one server has sent each member of each version, against the rule: a member gets at most
    ``SERVE_BUDGET x total_size + BUDGET_SLACK_CHUNKS x chunk_size`` bytes of one version (the slack
    covers streams cut mid-chunk and snapshots of a few chunks), from this server, ever. A booking that
    would pass the limit is refused whole and books nothing. Entries of versions no longer served are
    dropped with :meth:`forget_before`, so the ledger holds members x versions served at most."""

    def __init__(self) -> None:
        self._sent: dict[tuple[str, int], int] = {}  # (member, version) -> bytes booked

    @staticmethod
    def limit(total_size: int, chunk_size: int) -> float:
        """The most bytes of a version of ``total_size`` bytes in chunks of ``chunk_size`` one member
        may be sent."""
        return SERVE_BUDGET * total_size + BUDGET_SLACK_CHUNKS * chunk_size

    def sent(self, member: str, version: int) -> int:
        """Bytes booked to ``member`` for ``version`` so far."""
        return self._sent.get((member, version), 0)

    def fits(self, member: str, version: int, n: int, total_size: int, chunk_size: int) -> bool:
        """Whether ``n`` more bytes of ``version`` stay within ``member``'s limit (nothing booked)."""
        return self.sent(member, version) + n <= self.limit(total_size, chunk_size)

    def book(self, member: str, version: int, n: int, total_size: int, chunk_size: int) -> bool:
        """Book ``n`` bytes of ``version`` to ``member`` if they fit (True), else book nothing (False)."""
        if not self.fits(member, version, n, total_size, chunk_size):
            return False
        self._sent[(member, version)] = self.sent(member, version) + n
        return True

    def forget_before(self, version: int) -> None:
        """Drop the entries of versions older than ``version``."""
        for key in [k for k in self._sent if k[1] < version]:
            del self._sent[key]

    def __len__(self) -> int:
        return len(self._sent)
