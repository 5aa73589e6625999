"""broadcast.access: what a pull credential binds, the gate's checks, the byte budget, bounded chunk lists."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import pytest

from echo2.broadcast.access import (
    BUDGET_SLACK_CHUNKS,
    SERVE_BUDGET,
    AccessError,
    Credential,
    Gate,
    ServeCounters,
    check_credential,
    issue,
    issue_batch,
    pull_request,
    run_id,
)
from echo2.broadcast.buffer import check_chunk_list
from echo2.broadcast.wire import ProtocolError
from echo2.transport import make_identity
from echo2.weights.frames import GetFrame, decode_chunk_list, encode_chunk_list, parse_frame
from echo2.weights.manifest import HmacKey, new_signing_key

KEY = new_signing_key()
PUBLIC = KEY.verifier()  # what a relaying worker holds
SERVER = make_identity(["127.0.0.1"])  # the node asked for chunks
MEMBER = make_identity(["127.0.0.1"])  # the member asking


def _header(*args: Any) -> dict[str, Any]:
    """The header of ``access.pull_request``'s get (what the gate reads)."""
    return pull_request(*args)[0]


def test_a_credential_checks_with_the_public_key_alone():
    cred = issue(KEY, 7, "w1", MEMBER.fingerprint)
    assert cred.run == run_id(KEY) == run_id(PUBLIC)  # the learner and every worker name the run alike
    check_credential(PUBLIC, cred, 7, "w1")
    assert Credential.from_dict(cred.to_dict()) == cred  # survives the wire


@pytest.mark.parametrize(
    ("change", "version", "member", "needle"),
    [
        ({}, 8, "w1", "for v8"),  # another version
        ({}, 7, "w2", "presented by 'w2'"),  # another member presenting w1's credential
        ({"member": "w2"}, 7, "w2", "fails the learner's signature"),  # w1's credential renamed
        ({"version": 8}, 8, "w1", "fails the learner's signature"),  # ... or re-versioned
        ({"cert": "00" * 32}, 7, "w1", "fails the learner's signature"),  # ... or re-bound
        ({"expires": time.time() + 10**6}, 7, "w1", "fails the learner's signature"),  # ... or extended
        ({"run": "0123456789abcdef"}, 7, "w1", "another run"),
    ],
)
def test_a_changed_or_misused_credential_is_refused(change, version, member, needle):
    cred = dataclasses.replace(issue(KEY, 7, "w1", MEMBER.fingerprint), **change)
    with pytest.raises(AccessError, match=needle):
        check_credential(PUBLIC, cred, version, member)


def test_forged_and_expired_credentials_are_refused():
    forged = issue(new_signing_key(), 7, "w1", MEMBER.fingerprint)  # a worker's own key pair
    with pytest.raises(AccessError, match="another run"):
        check_credential(PUBLIC, forged, 7, "w1")
    forged = dataclasses.replace(forged, run=run_id(KEY))  # even under the right run id
    with pytest.raises(AccessError, match="signature"):
        check_credential(PUBLIC, forged, 7, "w1")
    with pytest.raises(AccessError, match="expired"):
        check_credential(PUBLIC, issue(KEY, 7, "w1", "", ttl=-1.0), 7, "w1")
    with pytest.raises(AccessError, match="no credential"):
        Credential.from_dict(None)
    with pytest.raises(AccessError, match="missing"):
        Credential.from_dict({"run": "x"})
    with pytest.raises(AccessError, match="types"):
        Credential.from_dict({**issue(KEY, 7, "w1", "").to_dict(), "version": "7"})


def test_one_signature_covers_a_batch_and_each_member_checks_alone():
    """An announcement's batch is signed once: every member's credential carries the same signature and
    its own path (at most ceil(log2 n) steps), and checks with the public key alone."""
    for n in (1, 2, 3, 37, 256):
        members = {f"w{i}": MEMBER.fingerprint if i % 2 else "" for i in range(n)}
        creds = issue_batch(KEY, 9, members)
        assert list(creds) == list(members) and len({c.sig for c in creds.values()}) == 1
        for w, c in creds.items():
            assert c.member == w and c.cert == members[w] and len(c.path) <= 65 * math.ceil(math.log2(n))
            check_credential(PUBLIC, Credential.from_dict(c.to_dict()), 9, w)
    assert issue_batch(KEY, 9, {}) == {}


def test_a_batch_credential_cannot_be_moved_to_another_member_or_reshaped():
    """A member of a batch cannot present its path for another id or certificate (the other's leaf leads
    elsewhere), nor take a batch-mate's path; a path whose steps are flipped, cut, or not steps at all
    is refused."""
    creds = issue_batch(KEY, 9, {f"w{i}": MEMBER.fingerprint for i in range(5)})
    c3, c4 = creds["w3"], creds["w4"]
    flipped = ("R" if c3.path[0] == "L" else "L") + c3.path[1:]
    for change in (
        {"member": "w4"},  # w3's credential renamed to a batch-mate
        {"member": "w9"},  # ... or to a stranger
        {"cert": "00" * 32},  # ... or re-bound to another certificate
        {"path": c4.path},  # w3 with w4's path
        {"path": flipped},  # a step's side flipped
        {"path": c3.path[:65]},  # cut short
        {"path": c3.path + c3.path[:65]},  # a step too many
    ):
        cred = dataclasses.replace(c3, **change)
        with pytest.raises(AccessError, match="fails the learner's signature"):
            check_credential(PUBLIC, cred, 9, cred.member)
    for path, needle in (("X" + "0" * 64, "not L or R"), ("L" + "zz" * 32, "not hex")):
        with pytest.raises(AccessError, match=needle):
            check_credential(PUBLIC, dataclasses.replace(c3, path=path), 9, "w3")
    for path in ("L00", "L" + "0" * 64 * 41):
        with pytest.raises(AccessError, match="not whole steps"):
            Credential.from_dict({**c3.to_dict(), "path": path})
    with pytest.raises(AccessError, match="missing 'path'"):
        Credential.from_dict({k: v for k, v in c3.to_dict().items() if k != "path"})


def test_the_gate_verifies_a_batchs_signature_once(monkeypatch):
    """Pulls of one batch's credentials cost the server one signature check; a forged credential is
    still refused, whatever was verified before."""
    calls = []
    verify = type(PUBLIC).verify
    monkeypatch.setattr(type(PUBLIC), "verify", lambda self, *a: calls.append(1) or verify(self, *a))
    gate, counters = _gate(me=None)
    creds = issue_batch(KEY, 3, {f"w{i}": "" for i in range(6)})
    for w, c in creds.items():
        assert gate.authenticate(_header(c, [0], False, "", None)) == (w, 3)
    assert len(calls) == 1
    forged = dataclasses.replace(creds["w1"], member="w7")
    with pytest.raises(AccessError, match="signature"):
        gate.authenticate(_header(forged, [0], False, "", None))
    assert counters.refused_requests == 1


def test_hmac_runs_issue_credentials_too():
    key = HmacKey(b"s" * 32)
    check_credential(key, issue(key, 1, "w0", ""), 1, "w0")


def _gate(me=SERVER) -> tuple[Gate, ServeCounters]:
    counters = ServeCounters()
    return Gate(PUBLIC, me, counters), counters


def test_the_gate_admits_a_member_with_its_credential_and_proof():
    gate, counters = _gate()
    req = _header(issue(KEY, 3, "w1", MEMBER.fingerprint), [0, 1], False, SERVER.fingerprint, MEMBER)
    assert gate.authenticate(req) == ("w1", 3)
    gate.require(True, "w1", 3)
    assert counters == ServeCounters()
    with pytest.raises(AccessError, match="not a member this node serves"):
        gate.require(False, "w1", 3)
    assert counters.refused_requests == 1


def test_the_gate_refuses_what_is_not_the_member_itself():
    gate, counters = _gate()
    cred = issue(KEY, 3, "w1", MEMBER.fingerprint)
    thief = make_identity(["127.0.0.1"])
    cases = [
        ("no credential", {"op": "get", "v": 3, "chunks": [0], "from": "w1"}),
        # w1's credential, shown by someone with another certificate
        ("not the one its credential names", _header(cred, [0], False, SERVER.fingerprint, thief)),
        # w1's certificate (public) with a proof the thief signed
        (
            "not signed by its certificate's key",
            {**_header(cred, [0], False, SERVER.fingerprint, thief), "cert": MEMBER.cert_der.hex()},
        ),
        # a genuine request of w1's, made for another server, replayed here
        ("not signed by its certificate's key", _header(cred, [0], False, "ab" * 32, MEMBER)),
        # over TLS a request without certificate and proof is refused
        ("carries the member's certificate", _header(cred, [0], False, SERVER.fingerprint, None)),
    ]
    for needle, req in cases:
        with pytest.raises(AccessError, match=needle):
            gate.authenticate(req)
    assert counters.refused_requests == len(cases)


def test_without_tls_the_gate_checks_the_credential_only():
    gate, _ = _gate(me=None)
    assert gate.authenticate(_header(issue(KEY, 3, "w1", ""), [0], False, "", None)) == ("w1", 3)


def test_the_budget_caps_bytes_per_member_and_version():
    gate, counters = _gate()
    total, chunk = 1000, 100
    book = gate.charge("w1", 3, total, chunk)
    limit = SERVE_BUDGET * total + BUDGET_SLACK_CHUNKS * chunk
    sent = 0
    while book(chunk):
        sent += chunk
    assert limit - chunk < sent <= limit and counters.over_budget == 1
    assert gate.charge("w2", 3, total, chunk)(chunk)  # another member has its own budget
    assert not gate.charge("w1", 3, total, chunk)(chunk)  # a new stream does not reset it
    gate.forget_before(4)
    assert gate.charge("w1", 4, total, chunk)(chunk)


@pytest.mark.parametrize(
    ("chunks", "needle"),
    [
        ([0] * 1000, "1 to 8 chunk indices"),  # the attack of the issue: 1000 copies of chunk 0
        ([0, 1, 1], "same chunk more than once"),
        (list(range(9)), "1 to 8"),  # more than the snapshot has
        ([8], r"in \[0, 8\)"),
    ],
)
def test_chunk_lists_are_bounded(chunks, needle):
    """A get's chunk list, as a server reads it from the payload: against the snapshot's chunk count."""
    with pytest.raises(ProtocolError, match=needle):
        check_chunk_list(decode_chunk_list(encode_chunk_list(chunks)), 8)


@pytest.mark.parametrize(
    ("n", "needle"),
    [
        (-4, "greater than or equal to 4"),
        (0, "greater than or equal to 4"),
        (6, "multiple of 4"),
        (True, "a valid integer"),
        ("8", "a valid integer"),
    ],
)
def test_what_no_get_may_announce_as_its_chunk_list(n, needle):
    """Its model (weights.frames.GetFrame) refuses a payload length that is no whole, non-empty list."""
    with pytest.raises(ProtocolError, match=rf"'get' frame: field 'n': .*{needle}"):
        parse_frame({**_get(), "n": n}, GetFrame)


def test_a_bounded_chunk_list_passes():
    header, payload = pull_request(issue(KEY, 3, "w1", ""), [7, 0, 3], False, "", None)
    assert parse_frame({**header, "n": len(payload)}, GetFrame).n == 12
    assert check_chunk_list(decode_chunk_list(payload), 8) == [7, 0, 3]
    assert check_chunk_list(list(range(8)), 8) == list(range(8))


def _get() -> dict:
    return _header(issue(KEY, 3, "w1", ""), [0], False, "", None)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"from": 5}, r"'get' frame: field 'from': Input should be a valid string, got 5"),
        ({"from": ""}, r"'get' frame: field 'from': String should have at least 1 character"),
        ({"v": "3"}, r"'get' frame: field 'v': Input should be a valid integer, got '3'"),
        ({"v": True}, r"'get' frame: field 'v': Input should be a valid integer, got True"),
        ({"v": -1}, r"'get' frame: field 'v': Input should be greater than or equal to 0"),
        ({"cred": []}, r"'get' frame: field 'cred': Input should be a valid dictionary"),
        ({"cred": None}, "no credential"),
        ({"cred": {"run": 5}}, "credential is missing 'version'"),
        ({"cert": 5}, r"'get' frame: field 'cert': Input should be a valid string"),
    ],
)
def test_the_gate_reads_a_gets_credential_fields_strictly(change, needle):
    """Whatever else a get holds, a malformed member, version, credential or certificate is the gate's
    refusal (``refused_requests``), naming the field, before the rest of the frame is read."""
    gate, counters = _gate(me=None)
    with pytest.raises(AccessError, match=needle):
        gate.authenticate({**_get(), **change, "chunks": "all", "extra": 1})
    with pytest.raises(AccessError, match="'get' frame: field 'from' is missing"):
        gate.authenticate({k: v for k, v in _get().items() if k != "from"})
    assert counters == ServeCounters(refused_requests=2)
