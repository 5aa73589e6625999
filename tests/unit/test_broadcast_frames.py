"""echo2.weights.frames: every broadcast frame kind survives the wire unchanged (byte for byte what the
nodes sent before the models), each is refused as a ProtocolError naming the op and the field for a
missing field, a wrong type, a value out of range, an extra key or an unknown op; and through the real
publisher and node, a malformed frame costs only its sender's connection (or stream, or announcement),
counted where it was counted before."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from echo2.broadcast import access
from echo2.broadcast.access import AccessError, Credential, Gate, ServeCounters, issue, pull_request
from echo2.broadcast.api import OpenLedger
from echo2.broadcast.buffer import SnapshotBuffer, serve_get, serve_pull
from echo2.broadcast.pipelined import TreePipelined
from echo2.broadcast.publisher import TcpPublisher
from echo2.broadcast.receiver import TcpWorkerNode
from echo2.broadcast.strategy import LEARNER
from echo2.broadcast.wire import ProtocolError as WireProtocolError
from echo2.broadcast.wire import (
    encode,
    parse_announcement,
    parse_header,
    read_header,
    read_payload,
    write_frame,
)
from echo2.protocol import MAX_INT
from echo2.transport import make_identity
from echo2.weights import frames, manifest
from echo2.weights.frames import (
    KINDS,
    MAX_CHUNKS,
    MAX_ID,
    MAX_REASON,
    MAX_VERSION,
    AnnounceFrame,
    ChunkFrame,
    ErrorFrame,
    GetFrame,
    InstalledFrame,
    JoinFrame,
    LeaveFrame,
    ProtocolError,
    RejectedFrame,
    RevokeFrame,
    ServeFrame,
    ShutdownFrame,
    StalledFrame,
    Stride,
    decode_chunk_list,
    encode_chunk_list,
    parse_frame,
    to_wire,
    version_or_none,
)
from echo2.weights.manifest import build_manifest, new_signing_key

KEY = new_signing_key()
PUBLIC = KEY.verifier()
CHUNK = 4096
BLOB = bytes(range(256)) * 40  # 10240 bytes: 3 chunks
MANIFEST = build_manifest(BLOB, 5, CHUNK, KEY)
CRED = issue(KEY, 5, "w1", "")
FP = "ab" * 32  # a certificate fingerprint

# Each kind as the nodes built it by hand before the models (same keys, same order), and its model.
BY_HAND: dict[str, tuple[dict[str, Any], frames.Frame]] = {
    "join": (
        {"op": "join", "worker": "w1", "host": "10.0.0.1", "port": 4242, "cert": FP, "credential": "c"},
        JoinFrame(worker="w1", host="10.0.0.1", port=4242, cert=FP, credential="c"),
    ),
    "installed": (
        {"op": "installed", "v": 5, "got": {LEARNER: 2, "w2": 1}, "pace": {"w2": 0.8}},
        InstalledFrame(v=5, got={LEARNER: 2, "w2": 1}, pace={"w2": 0.8}),
    ),
    "stalled": ({"op": "stalled", "v": 5, "source": "w2"}, StalledFrame(v=5, source="w2")),
    "rejected": ({"op": "rejected", "v": 5, "reason": "stale"}, RejectedFrame(v=5, reason="stale")),
    "leave": ({"op": "leave"}, LeaveFrame()),
    "announce": (
        {
            "op": "announce",
            "manifest": MANIFEST.to_dict(),
            "sources": [[LEARNER, [0, 2]], ["w2", [1]]],
            "peers": {
                "w2": ["10.0.0.2", 4243, FP],
                "w7": ["10.0.0.7", 4243, FP],
                LEARNER: ["10.0.0.9", 7000, FP],
            },
            "stall_hint": 0.25,
            "serve": ["w3"],
            "repair": {"w2": "w7"},
            "credential": CRED.to_dict(),
        },
        AnnounceFrame(
            manifest=MANIFEST.to_dict(),
            sources=[(LEARNER, [0, 2]), ("w2", [1])],
            peers={
                "w2": ("10.0.0.2", 4243, FP),
                "w7": ("10.0.0.7", 4243, FP),
                LEARNER: ("10.0.0.9", 7000, FP),
            },
            stall_hint=0.25,
            serve=["w3"],
            repair={"w2": "w7"},
            credential=CRED.to_dict(),
        ),
    ),
    "shutdown": ({"op": "shutdown"}, ShutdownFrame()),
    "revoke": ({"op": "revoke", "member": "w3"}, RevokeFrame(member="w3")),
    "serve": ({"op": "serve", "v": 5, "member": "w3"}, ServeFrame(v=5, member="w3")),
    "error": ({"op": "error", "reason": "unknown version 9"}, ErrorFrame(reason="unknown version 9")),
    "get": (  # its chunk list is its payload (8 bytes: two indices), its length n the framing's
        {"op": "get", "v": 5, "from": "w1", "repair": False, "cred": CRED.to_dict()},
        GetFrame(v=5, member="w1", repair=False, cred=CRED.to_dict(), n=8),
    ),
    "chunk": ({"op": "chunk", "v": 5, "i": 2}, ChunkFrame(v=5, i=2)),
}


def test_every_kind_has_a_case_here() -> None:
    assert sorted(BY_HAND) == sorted(KINDS)


def on_wire(header: dict[str, Any]) -> dict[str, Any]:
    """A header as the peer reads it: JSON, so a tuple to_wire leaves as it is arrives as a list."""
    return parse_header(encode(header)[4:])


@pytest.mark.parametrize("op", sorted(BY_HAND))
def test_every_kind_round_trips_byte_for_byte(op: str) -> None:
    by_hand, model = BY_HAND[op]
    n = getattr(model, "n", 0)  # a payload's length: the framing's (wire.encode), never to_wire's
    wire = to_wire(model)
    assert list(wire) == list(by_hand)  # the same keys in the same order ...
    assert encode(wire, n) == encode(by_hand, n)  # ... so the same bytes on the wire
    received = parse_header(encode(wire, n)[4:])  # what the peer's read_header returns
    assert parse_frame(received) == model
    assert on_wire(to_wire(parse_frame(received))) == by_hand


def test_what_to_wire_leaves_out() -> None:
    # an optional field at None is not sent (a join without a credential, a get without TLS) ...
    assert to_wire(JoinFrame(worker="w", host="h", port=1)) == {
        "op": "join", "worker": "w", "host": "h", "port": 1, "cert": "",
    }  # fmt: skip
    # ... but a required one is, null included (a rejection of a manifest that names no version)
    assert to_wire(RejectedFrame(v=None, reason="garbage")) == {
        "op": "rejected",
        "v": None,
        "reason": "garbage",
    }
    # a chunk's payload length is the framing's (wire.encode), so it travels once, after the rest
    header = parse_header(encode(to_wire(ChunkFrame(v=5, i=1)), 4096)[4:])
    assert header == {"op": "chunk", "v": 5, "i": 1, "n": 4096}
    assert parse_frame(header) == ChunkFrame(v=5, i=1, n=4096)
    # an announced peer without a fingerprint (plain TCP) stays a pair
    ann = {**BY_HAND["announce"][0], "peers": {LEARNER: ["h", 1]}}
    assert on_wire(to_wire(parse_frame(ann)))["peers"] == {LEARNER: ["h", 1]}


def test_a_get_over_tls_round_trips_and_matches_what_access_builds() -> None:
    me, server = make_identity(["127.0.0.1"]), make_identity(["127.0.0.1"])
    cred = issue(KEY, 5, "w1", me.fingerprint)
    sent, payload = pull_request(cred, [1], True, server.fingerprint, me)
    model = parse_frame(parse_header(encode(sent, len(payload))[4:]), GetFrame)
    assert model.member == "w1" and model.repair and model.cert == me.cert_der.hex() and model.n == 4
    assert encode(to_wire(model)) == encode(sent) and decode_chunk_list(payload) == [1]
    by_hand = {  # the keys, in their order, of the get's header
        "op": "get", "v": 5, "from": "w1", "repair": True, "cred": cred.to_dict(),
        "cert": me.cert_der.hex(), "proof": sent["proof"],
    }  # fmt: skip
    assert encode(sent) == encode(by_hand)
    header, payload = pull_request(CRED, [0, 2], False, "", None)
    assert header == BY_HAND["get"][0] and payload == encode_chunk_list([0, 2])  # without TLS: no cert


def test_a_gets_header_stays_small_whatever_its_chunk_list() -> None:
    """What a stranger can make a server parse is the header alone: a get of a million chunks has the
    header of a get of one (its list is the payload, read after the credential checked)."""
    me, server = make_identity(["127.0.0.1"]), make_identity(["127.0.0.1"])
    cred = issue(KEY, 5, "w1", me.fingerprint)
    one, _ = pull_request(cred, [0], False, server.fingerprint, me)
    many, payload = pull_request(cred, list(range(MAX_CHUNKS)), False, server.fingerprint, me)
    assert len(encode(many, len(payload))) < frames.PRE_AUTH_HEADER and len(payload) == 4 * MAX_CHUNKS
    assert abs(len(encode(one)) - len(encode(many))) <= 8  # an ECDSA proof varies by a few bytes


def test_a_get_with_a_batch_credential_fits_what_a_stranger_may_send() -> None:
    """A credential from an announcement's batch carries its Merkle path (8 steps for 256 members): the
    get that presents it still fits the pre-authentication limits on size and items."""
    from echo2.broadcast.access import issue_batch
    from echo2.broadcast.publisher import ANNOUNCE_BATCH

    me, server = make_identity(["127.0.0.1"]), make_identity(["127.0.0.1"])
    cred = issue_batch(KEY, 5, {f"member-{i:05d}-abcdef": me.fingerprint for i in range(ANNOUNCE_BATCH)})
    header, payload = pull_request(cred["member-00000-abcdef"], [0, 1], False, server.fingerprint, me)
    raw = encode(header, len(payload))
    assert len(cred["member-00000-abcdef"].path) == 65 * 8
    assert len(raw) < frames.PRE_AUTH_HEADER
    assert raw.count(b",") + raw.count(b"[") + raw.count(b"{") <= frames.PRE_AUTH_ITEMS


def test_an_announcement_naming_a_repair_source_without_an_address_is_refused() -> None:
    frame = parse_frame({**BY_HAND["announce"][0], "repair": {"w2": "w9"}}, AnnounceFrame)
    with pytest.raises(WireProtocolError, match="a source without an address"):
        parse_announcement(frame, 3, True)
    ok = parse_announcement(parse_frame(BY_HAND["announce"][0], AnnounceFrame), 3, True)
    assert ok.repair == {"w2": "w7"}


def test_a_stride_is_read_as_its_chunks_and_one_past_the_last_is_refused() -> None:
    """A pull stream may name its chunks as a stride (every step-th from start to the version's last, as
    a relay tree's stripe): the member reads the list it stands for; a stride that names no chunk of the
    version, or steps by 0, is refused naming the field."""
    base = BY_HAND["announce"][0]
    frame = parse_frame({**base, "sources": [["w2", {"start": 1, "step": 3}]]}, AnnounceFrame)
    assert parse_announcement(frame, 11, False).sources == [("w2", [1, 4, 7, 10])]
    with pytest.raises(WireProtocolError, match="names a stride past chunk 0"):
        parse_announcement(frame, 1, False)
    with pytest.raises(ProtocolError, match=r"field 'sources\.0\.1\.step': Input should be greater than or"):
        parse_frame({**base, "sources": [["w2", {"start": 1, "step": 0}]]}, AnnounceFrame)
    with pytest.raises(ProtocolError, match=r"sources\.0\.1"):
        parse_frame({**base, "sources": [["w2", {"start": 1}]]}, AnnounceFrame)


def test_an_announcement_the_publisher_sends_parses_to_its_model() -> None:
    async def go() -> dict[str, Any]:
        pub = TcpPublisher(KEY, TreePipelined(), chunk_size=CHUNK, ledger=OpenLedger())
        await pub.start()
        r, w = await asyncio.open_connection(*pub.address)
        await write_frame(w, to_wire(JoinFrame(worker="w1", host="127.0.0.1", port=9)))
        await pub.wait_members(1, 5)
        await pub.publish(1, BLOB)
        header = await asyncio.wait_for(read_header(r), 5)
        w.close()
        await pub.close()
        return header

    header = asyncio.run(go())
    frame = parse_frame(header, AnnounceFrame)
    assert frame.sources == [(LEARNER, Stride(start=0, step=1))]  # all 3 chunks, as a stride
    assert parse_announcement(frame, 3, tls=False).sources == [(LEARNER, [0, 1, 2])]
    assert set(frame.peers) == {LEARNER} and frame.members == 1
    assert on_wire(to_wire(frame)) == header


def test_announce_writes_what_the_models_wire_form_holds() -> None:
    """The publisher writes announcements without building their model (``frames.announce``): the same
    header ``to_wire`` of the model gives, the model's defaults for fields left out, and an unknown or
    a missing field refused by name."""
    from echo2.weights.frames import announce

    parts = {"manifest": {"v": 1}, "sources": [("learner", {"start": 0, "step": 1})],
             "peers": {"learner": ("h", 1)}, "credential": {"member": "w1"}}  # fmt: skip
    for extra in ({}, {"stall_hint": 2.5, "serve": ["w2"], "repair": {"w2": "w3"}, "members": 4}):
        assert announce(**parts, **extra) == to_wire(AnnounceFrame.model_construct(**parts, **extra))
    assert "members" not in announce(**parts)  # None: not sent, as to_wire leaves it out
    with pytest.raises(TypeError, match="no field"):
        announce(**parts, colour="red")
    with pytest.raises(TypeError, match="needs"):
        announce(manifest={}, sources=[], peers={})


# -- refusals -----------------------------------------------------------------------------------------
# Per kind with fields: a field to leave out, a wrong type, a value out of range (field, value).
GOOD = {op: by_hand for op, (by_hand, _) in BY_HAND.items()}
GOOD["get"] = {**GOOD["get"], "n": 8}  # as read off the wire: with its payload's length
REFUSALS: list[tuple[str, str, str, object, str]] = [  # (op, case, field path, value, what the message says)
    ("join", "missing", "port", None, "is missing"),
    ("join", "type", "port", "4242", "should be a valid integer"),
    ("join", "type", "port", True, "should be a valid integer"),
    ("join", "range", "port", 65536, "less than or equal to 65535"),
    ("join", "range", "worker", "w" * (MAX_ID + 1), f"at most {MAX_ID} characters"),
    ("join", "range", "host", "", "at least 1 character"),
    ("installed", "missing", "got", None, "is missing"),
    ("installed", "type", "v", 5.0, "should be a valid integer"),
    ("installed", "type", "got", [1], "should be a valid dictionary"),
    ("installed", "range", "got.learner", {LEARNER: -1}, "greater than or equal to 0"),
    ("installed", "range", "v", -1, "greater than or equal to 0"),
    ("installed", "range", "pace.w2", {"w2": 0.0}, "greater than 0"),
    ("installed", "range", "pace.w2", {"w2": 2e6}, "less than or equal to 1000000"),
    ("installed", "type", "pace.w2", {"w2": "fast"}, "should be a valid number"),
    ("stalled", "missing", "source", None, "is missing"),
    ("stalled", "type", "source", 5, "should be a valid string"),
    ("stalled", "range", "v", MAX_VERSION + 1, f"less than or equal to {MAX_VERSION}"),
    ("rejected", "missing", "v", None, "is missing"),
    ("rejected", "type", "v", "x", "should be a valid integer"),
    ("rejected", "range", "reason", "r" * (MAX_REASON + 1), f"at most {MAX_REASON} characters"),
    ("announce", "missing", "credential", None, "is missing"),
    ("announce", "type", "manifest", [1, 2], "should be a valid dictionary"),
    ("announce", "type", "sources", {LEARNER: [0]}, "should be a valid list"),
    ("announce", "type", "stall_hint", True, "should be a valid number"),
    ("announce", "type", "serve.0", [1], "should be a valid string"),
    ("announce", "range", "stall_hint", -1.0, "greater than or equal to 0"),
    ("announce", "range", "sources.0.1.0", [[LEARNER, [MAX_CHUNKS]]], f"less than {MAX_CHUNKS}"),
    ("announce", "range", "peers.learner.1", {LEARNER: ["h", 0]}, "greater than or equal to 1"),
    ("revoke", "missing", "member", None, "is missing"),
    ("revoke", "type", "member", 5, "should be a valid string"),
    ("revoke", "range", "member", "", "at least 1 character"),
    ("serve", "missing", "v", None, "is missing"),
    ("serve", "type", "member", 5, "should be a valid string"),
    ("serve", "range", "v", -1, "greater than or equal to 0"),
    ("join", "range", "held", [1, 2, 3], "at most 2 items"),
    ("error", "missing", "reason", None, "is missing"),
    ("error", "type", "reason", {"why": 1}, "should be a valid string"),
    ("error", "range", "reason", "r" * (MAX_REASON + 1), f"at most {MAX_REASON} characters"),
    ("get", "missing", "from", None, "is missing"),
    ("get", "type", "repair", "yes", "should be a valid boolean"),
    ("get", "type", "n", "8", "should be a valid integer"),
    ("get", "range", "n", 6, "multiple of 4"),
    ("chunk", "missing", "i", None, "is missing"),
    ("chunk", "type", "i", False, "should be a valid integer"),  # False == 0: the old check let it pass
    ("chunk", "range", "n", 1 << 30, "less than or equal to 67108864"),
]


def _refused(header: dict[str, Any], needle: str) -> str:
    with pytest.raises(ProtocolError) as caught:
        parse_frame(header)
    assert needle in str(caught.value), str(caught.value)
    return str(caught.value)


@pytest.mark.parametrize(("op", "case", "path", "value", "what"), REFUSALS)
def test_each_kind_is_refused_naming_its_op_and_field(
    op: str, case: str, path: str, value: object, what: str
) -> None:
    header, field = dict(GOOD[op]), path.split(".")[0]
    if case == "missing":
        del header[field]
    else:
        header[field] = value
    message = _refused(header, what)
    assert message.startswith(f"{op!r} frame: field {path!r}")
    assert case == "missing" or ", got " in message  # the offending value, shown


def test_each_kind_with_fields_has_a_missing_a_wrong_type_and_an_out_of_range_case() -> None:
    fieldless = {"leave", "shutdown"}  # only an extra key or a wrong op can be wrong with these
    for op in sorted(set(KINDS) - fieldless):
        assert {case for o, case, *_ in REFUSALS if o == op} == {"missing", "type", "range"}, op


@pytest.mark.parametrize("op", sorted(BY_HAND))
def test_each_kind_refuses_an_extra_key(op: str) -> None:
    extra = "member" if op not in ("revoke", "serve") else "worker"  # a field of another kind, by name
    _refused({**GOOD[op], extra: "w1"}, f"{op!r} frame: unknown field {extra!r}")


@pytest.mark.parametrize("op", ["dance", "JOIN", "", 5, None, ["get"]])
def test_an_unknown_op_is_refused(op: object) -> None:
    _refused({"op": op, "v": 1}, "unknown frame op")


def test_where_a_kind_is_not_expected_it_is_refused_naming_the_sender() -> None:
    with pytest.raises(
        ProtocolError, match=r"unexpected 'announce' frame from 'w1' \(expected 'installed', 'leave'\)"
    ):
        parse_frame(GOOD["announce"], InstalledFrame, LeaveFrame, sender="w1")
    with pytest.raises(ProtocolError, match=r"'installed' frame from 'w1': field 'v'"):
        parse_frame({**GOOD["installed"], "v": "1"}, InstalledFrame, sender="w1")
    assert parse_frame(GOOD["stalled"], InstalledFrame, StalledFrame) == BY_HAND["stalled"][1]


def test_one_error_type_shared_with_the_wire_and_the_gate() -> None:
    assert WireProtocolError is ProtocolError and issubclass(AccessError, ProtocolError)
    with pytest.raises(ProtocolError):  # a peer's frame that is not even JSON: the same class
        parse_header(b"{{{")


def test_the_limits_agree_with_the_modules_that_own_them() -> None:
    # echo2.weights sits below echo2.broadcast and cannot import these; this keeps one rule each
    assert frames.MAX_CHUNKS == manifest.MAX_CHUNKS and frames.MAX_CHUNK_BYTES == manifest.MAX_CHUNK_SIZE
    assert frames.MAX_CERT_HEX == 2 * access.MAX_CERT_BYTES and frames.MAX_VERSION == MAX_INT
    assert len(MANIFEST.to_dict()) <= frames.MAX_FIELDS and len(CRED.to_dict()) <= frames.MAX_FIELDS


def test_version_or_none() -> None:
    assert [version_or_none(x) for x in (0, 7, MAX_VERSION, -1, MAX_VERSION + 1, True, 1.0, "1", None)] == [
        0, 7, MAX_VERSION, None, None, None, None, None, None,
    ]  # fmt: skip


def test_frames_are_frozen() -> None:
    frame = StalledFrame(v=1, source="w2")
    with pytest.raises(ValueError, match="frozen"):
        frame.v = 2  # type: ignore[misc]


# -- through the real publisher and node --------------------------------------------------------------
def test_publisher_drops_a_malformed_control_frame_and_refuses_a_malformed_pull(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A joined member's malformed control frame drops only its connection (``bad_frames``); a pull
    with a valid credential but a malformed field gets an error frame naming the field, and counts as a
    bad request (``bad_requests``) and a bad frame, like a chunk list out of bounds; the port serves on."""

    async def go() -> TcpPublisher:
        pub = TcpPublisher(KEY, TreePipelined(), chunk_size=CHUNK, ledger=OpenLedger())
        await pub.start()
        bad_r, bad_w = await asyncio.open_connection(*pub.address)
        await write_frame(bad_w, to_wire(JoinFrame(worker="bad", host="127.0.0.1", port=9)))
        good_r, good_w = await asyncio.open_connection(*pub.address)
        await write_frame(good_w, to_wire(JoinFrame(worker="good", host="127.0.0.1", port=9)))
        await pub.wait_members(2, 5)
        await write_frame(bad_w, {**GOOD["installed"], "extra": 1})
        assert await asyncio.wait_for(bad_r.read(), 5) == b""  # dropped ...
        await asyncio.sleep(0.01)
        assert pub.members() == ["good"]  # ... and no longer a member; the other stays

        await pub.publish(1, BLOB)
        ann = parse_frame(await asyncio.wait_for(read_header(good_r), 5), AnnounceFrame)
        cred = Credential.from_dict(ann.credential)
        r, w = await asyncio.open_connection(*pub.address)
        header, payload = pull_request(cred, [0], False, "", None)
        await write_frame(w, {**header, "repair": "yes", "n": len(payload)})  # the header alone
        refusal = parse_frame(await asyncio.wait_for(read_header(r), 5), ErrorFrame)
        assert "'get' frame: field 'repair'" in refusal.reason and await r.read() == b""
        r, w = await asyncio.open_connection(*pub.address)  # a well-formed pull is served as ever
        await write_frame(w, *pull_request(cred, [0, 1, 2], False, "", None))
        for i in range(3):
            header = await asyncio.wait_for(read_header(r), 5)
            assert parse_frame(header, ChunkFrame).i == i
            await read_payload(r, header, CHUNK)
        good_w.close()
        await pub.close()
        return pub

    pub = asyncio.run(go())
    assert pub.counters.bad_frames == 2 and pub.counters.peer_errors == 0
    assert pub.refusals.bad_requests == 1 and pub.refusals.refused_requests == 0
    assert caplog.text.count("dropping connection") == 2
    assert not [rec for rec in caplog.records if rec.exc_info]


def test_node_refuses_a_malformed_announcement_and_repairs_a_malformed_chunk(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Against a fake learner: announcements with an extra key or a negative stall hint are refused
    (``rejected``, naming the field; ``rejected_manifests``) and the node stays; a chunk frame whose
    index is ``false`` (equal to 0 in Python, so the old hand check let it through) fails its stream,
    which is repaired from the learner, and the node installs the exact blob."""
    caplog.set_level(logging.INFO)

    async def go() -> TcpWorkerNode:
        buffer = SnapshotBuffer(MANIFEST, BLOB)
        joined: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter, dict[str, Any]]] = (
            asyncio.Queue()
        )
        gets: list[GetFrame] = []

        async def learner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            header = await read_header(reader)
            if header["op"] != "get":
                await joined.put((reader, writer, header))
                return
            gets.append(parse_frame(header, GetFrame))
            chunks = decode_chunk_list(await reader.readexactly(gets[-1].n))
            if len(gets) == 1:  # the first pull: a malformed chunk frame
                await write_frame(writer, {"op": "chunk", "v": 5, "i": False}, BLOB[:CHUNK])
            else:
                await serve_get(gets[-1], chunks, writer, lambda v: buffer if v == 5 else None, None, 5.0)
            writer.close()

        server = await asyncio.start_server(learner, "127.0.0.1", 0)
        addr = server.sockets[0].getsockname()[:2]
        node = TcpWorkerNode("w1", addr, PUBLIC, stall_timeout=2.0)
        await node.start()
        ctl_r, ctl_w, hello = await asyncio.wait_for(joined.get(), 5)
        assert parse_frame(hello, JoinFrame) == JoinFrame(worker="w1", host="127.0.0.1", port=node.port)
        good = {
            **GOOD["announce"], "sources": [[LEARNER, [0, 1, 2]]],
            "peers": {LEARNER: [*addr, ""]}, "serve": [], "stall_hint": 0.0, "repair": {},
        }  # fmt: skip
        for bad, field in (
            ({**good, "extra": 1}, "unknown field 'extra'"),
            ({**good, "stall_hint": -1.0}, "stall_hint"),
        ):
            await write_frame(ctl_w, bad)
            rejected = parse_frame(await asyncio.wait_for(read_header(ctl_r), 5), RejectedFrame)
            assert rejected.v == 5 and "'announce' frame from 'learner'" in rejected.reason
            assert field in rejected.reason
        await write_frame(ctl_w, good)
        snap = await asyncio.wait_for(node.snapshots().__anext__(), 10)
        assert snap.manifest.version == 5 and bytes(snap.data) == BLOB
        assert [g.repair for g in gets] == [False, True]  # the malformed stream's chunks came again
        await node.close()
        server.close()
        return node

    node = asyncio.run(go())
    assert node.counters.rejected_manifests == 2 and node.counters.bad_frames == 0
    assert node.counters.stream_failures == 1 and node.counters.repaired_chunks == 3
    assert node.counters.peer_errors == 0
    assert "'chunk' frame from 'learner': field 'i'" in caplog.text
    assert not [rec for rec in caplog.records if rec.exc_info]


# -- a malformed pull costs its connection, nothing else -------------------------------------------------
GET, GET_CHUNKS = pull_request(CRED, [0, 1, 2], False, "", None)  # w1's pull of all of v5, well formed
GET = {**GET, "n": len(GET_CHUNKS)}  # the header as sent: with its payload's length
# (a get with w1's valid credential, what the server says): refused by its model (the header alone is
# sent: the server reads no payload of it) or by the snapshot (the payload, the chunk list, follows)
MALFORMED_GETS: list[tuple[dict[str, Any], bytes, str]] = [
    ({k: v for k, v in GET.items() if k != "n"}, b"", "'get' frame: field 'n' is missing"),
    ({**GET, "member": "w1"}, b"", "'get' frame: unknown field 'member'"),
    (
        {**GET, "repair": "yes"},
        b"",
        "'get' frame: field 'repair': Input should be a valid boolean, got 'yes'",
    ),
    ({**GET, "n": 6}, b"", "'get' frame: field 'n': Input should be a multiple of 4"),
    ({**GET, "n": 0}, b"", "'get' frame: field 'n': Input should be greater than or equal to 4"),
    ({**GET, "n": 16}, b"", "'chunks' must be a list of 1 to 3 chunk indices, got 4"),  # longer than v5
    ({**GET, "n": 8}, encode_chunk_list([0, 3]), "'chunks' must hold chunk indices in [0, 3)"),
    ({**GET, "n": 8}, encode_chunk_list([1, 1]), "'chunks' asks for the same chunk more than once"),
]
MODEL_REFUSALS = 5  # the first five: refused before the snapshot is looked at
# ... and with a malformed credential field: the gate's refusal, whatever else is wrong
REFUSED_GETS: list[tuple[dict[str, Any], bytes, str]] = [
    ({**GET, "from": 5, "n": 6}, b"", "refused: 'get' frame: field 'from': Input should be a valid str"),
    ({**GET, "v": "5", "extra": 1}, b"", "refused: 'get' frame: field 'v': Input should be a valid integer"),
    ({k: v for k, v in GET.items() if k != "from"}, b"", "refused: 'get' frame: field 'from' is missing"),
    ({k: v for k, v in GET.items() if k != "cred"}, b"", "refused: no credential"),
]


async def _refusal(address: tuple[str, int], header: dict[str, Any], payload: bytes = b"") -> str:
    """Send one get; the reason of the one error frame that comes back, after which the server closed."""
    r, w = await asyncio.open_connection(*address)
    w.write(encode(header) + payload)  # the header as given (its own n), then the payload
    await w.drain()
    reason = parse_frame(await asyncio.wait_for(read_header(r), 5), ErrorFrame).reason
    assert await asyncio.wait_for(r.read(), 5) == b""  # closed, nothing after the error
    w.close()
    return reason


async def _pull_all(address: tuple[str, int], header: dict[str, Any], payload: bytes) -> bytes:
    r, w = await asyncio.open_connection(*address)
    w.write(encode(header) + payload)
    await w.drain()
    got = b""
    for i in range(3):
        header = await asyncio.wait_for(read_header(r), 5)
        frame = parse_frame(header, ChunkFrame)
        assert (frame.v, frame.i) == (5, i)
        got += await read_payload(r, header, CHUNK)
    w.close()
    return got


def test_a_malformed_pull_is_refused_by_name_and_costs_the_server_nothing_else() -> None:
    """At the store (``serve_pull`` with a real gate, as the publisher and a relay run it): each
    malformed get gets one error frame naming its fault and its connection closed; one refused by its
    model never reaches ``admit`` and books no byte; the gate counts each once (``bad_requests``, or
    ``refused_requests`` for a malformed credential field); another member's pull, and w1's own next
    one, are served in full."""
    counters = ServeCounters()
    gate = Gate(PUBLIC, None, counters)
    buffer = SnapshotBuffer(MANIFEST, BLOB)
    admitted: list[tuple[str, int]] = []
    sent: list[tuple[str, int]] = []
    dropped: list[str] = []

    async def admit(member: str, v: int) -> Any:
        admitted.append((member, v))
        return (buffer if v == 5 else None), True, None

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            header = await read_header(reader, frames.PRE_AUTH_HEADER)
            await serve_pull(
                gate, header, reader, writer, admit, None, 5.0, lambda m, v, n: sent.append((m, n))
            )
        except ProtocolError as exc:  # AccessError too: what a node logs and counts, then closes
            dropped.append(type(exc).__name__)
        finally:
            writer.close()

    async def go() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        address = server.sockets[0].getsockname()[:2]
        for header, payload, needle in [*MALFORMED_GETS, *REFUSED_GETS]:
            reason = await _refusal(address, header, payload)
            assert needle in reason, (needle, reason)
        assert sent == [] and gate.budget.sent("w1", 5) == 0  # no chunk byte left, none booked
        assert admitted == [("w1", 5)] * 3  # only the three the snapshot's bounds refused
        w2, w2_chunks = pull_request(issue(KEY, 5, "w2", ""), [0, 1, 2], False, "", None)
        assert await _pull_all(address, {**w2, "n": 12}, w2_chunks) == BLOB  # the store serves on ...
        assert await _pull_all(address, GET, GET_CHUNKS) == BLOB  # ... the member that sent garbage too
        server.close()

    asyncio.run(go())
    assert counters == ServeCounters(refused_requests=len(REFUSED_GETS), bad_requests=len(MALFORMED_GETS))
    assert dropped == ["ProtocolError"] * len(MALFORMED_GETS) + ["AccessError"] * len(REFUSED_GETS)
    assert [m for m, _ in sent] == ["w2"] * 3 + ["w1"] * 3


@pytest.mark.parametrize("server", ["publisher", "relay"])
def test_a_node_refuses_a_malformed_pull_at_once_and_serves_on(server: str) -> None:
    """Through the real publisher and a real relay's port: each malformed get with a valid credential
    is refused by name at once (the relay does not wait for an announcement of the version first),
    counted in ``bad_requests`` and ``bad_frames``, its connection closed; the port serves on."""

    async def go() -> tuple[Any, float]:
        pub = TcpPublisher(KEY, TreePipelined(), chunk_size=CHUNK, ledger=OpenLedger())
        await pub.start()
        node = TcpWorkerNode("w2", pub.address, PUBLIC, stall_timeout=5.0)
        await node.start()
        target = pub if server == "publisher" else node
        address = pub.address if server == "publisher" else ("127.0.0.1", node.port)
        started = time.monotonic()
        for header, payload, needle in MALFORMED_GETS[:MODEL_REFUSALS]:  # no snapshot needed
            reason = await _refusal(address, header, payload)
            assert needle in reason, (needle, reason)
        took = time.monotonic() - started
        await pub.wait_members(1, 5)
        assert pub.members() == ["w2"]  # the member on it is untouched
        await node.close()
        await pub.close()
        return target, took

    target, took = asyncio.run(go())
    assert took < 2.5  # five refusals, none of which waited out the relay's 5 s for an announcement
    assert target.refusals == type(target.refusals)(bad_requests=5)
    assert target.counters.bad_frames == 5 and target.counters.peer_errors == 0
