"""The worker registry as the one ledger of members and installed versions (``runtime/members.py``,
``broadcast.api.MemberLedger``): who may join the broadcast, who is a target of a publication, and the
one monotonic writer of installed versions, fed by the publisher's counted acks (over loopback, the
real ``TcpPublisher``) and by the in-memory hub. Each test well under a second."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from plans import announced

from echo2.broadcast.access import Credential, pull_request
from echo2.broadcast.api import MemberLedger, OpenLedger
from echo2.broadcast.in_memory import InMemoryHub
from echo2.broadcast.pipelined import TreePipelined
from echo2.broadcast.publisher import TcpPublisher
from echo2.broadcast.strategy import LEARNER
from echo2.broadcast.wire import read_header, read_payload, write_frame
from echo2.protocol import RegisterRequest
from echo2.runtime.members import WorkerRegistry
from echo2.weights.frames import JoinFrame, to_wire
from echo2.weights.manifest import new_signing_key

TOKEN = "join-token-for-tests-0123456789"
KEY = new_signing_key()
CHUNK = 4096
BLOB = bytes(range(256)) * 64  # 16384 bytes: 4 chunks
N_CHUNKS = 4


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _registry(tmp_path: Path, clock: Clock | None = None, slot_idle_s: float = 600.0) -> WorkerRegistry:
    return WorkerRegistry(tmp_path, TOKEN, clock or time.time, max_workers=8, slot_idle_s=slot_idle_s)


def _join(reg: WorkerRegistry, name: str) -> tuple[str, str]:
    rec, credential = reg.register(RegisterRequest(name=name, usd_per_hour=1.0))
    return rec.worker_id, credential


# -- the registry's rules, by hand ----------------------------------------------------------------------
def test_the_registry_is_a_member_ledger(tmp_path: Path) -> None:
    reg: MemberLedger = _registry(tmp_path)  # mypy checks the protocol; OpenLedger is the default one
    open_: MemberLedger = OpenLedger()
    assert open_.may_join("anyone", None) and open_.is_target("anyone")
    assert reg.is_target("nobody") is False  # an id the registry never issued


def test_installed_is_monotonic_and_ignores_strangers(tmp_path: Path) -> None:
    reg = _registry(tmp_path)
    wid, _ = _join(reg, "a")
    reg.installed(wid, 3, 1.5)
    assert (reg[wid].installed_version, reg[wid].install_s) == (3, 1.5)
    reg.installed(wid, 2, 9.0)  # a late ack of an older version: ignored, install time included
    assert (reg[wid].installed_version, reg[wid].install_s) == (3, 1.5)
    reg.installed(wid, 3, 0.25)  # the same version reported again (its heartbeat): the newer figure
    assert (reg[wid].installed_version, reg[wid].install_s) == (3, 0.25)
    reg.installed(wid, 5)  # a granted lease names the version, not an install time
    assert (reg[wid].installed_version, reg[wid].install_s) == (5, 0.25)
    reg.installed("ghost", 7, 1.0)  # unknown id: nothing happens, nothing raises
    assert [r.installed_version for r in reg] == [5]


def test_a_relay_demotion_is_on_the_members_record_for_this_process_only(tmp_path: Path) -> None:
    """The publisher's verdict on a relay (``relay_conduct``) is on the member's record, read by the pool
    table and /metrics; a restarted learner's publisher starts every member relaying, so it is not
    persisted."""
    reg = _registry(tmp_path)
    wid, _ = _join(reg, "a")
    reg.relay_conduct(wid, True)
    reg.relay_conduct("ghost", True)  # unknown id: nothing happens, nothing raises
    assert [r.relay_demoted for r in reg] == [True]
    reg.save()  # as any later change of the registry saves it
    again = _registry(tmp_path)
    again.load()
    assert [r.relay_demoted for r in again] == [False]
    reg.relay_conduct(wid, False)
    assert not reg[wid].relay_demoted


def test_only_trusted_identities_are_targets(tmp_path: Path) -> None:
    clock = Clock()
    reg = _registry(tmp_path, clock, slot_idle_s=100.0)
    good, good_cred = _join(reg, "good")
    bad, bad_cred = _join(reg, "bad")
    silent, silent_cred = _join(reg, "silent")
    assert all(reg.is_target(w) for w in (good, bad, silent))
    assert reg.may_join(bad, bad_cred) and not reg.may_join(bad, good_cred)  # own id only
    reg.revoke(bad, "caught lying")
    assert not reg.is_target(bad) and not reg.may_join(bad, bad_cred)
    clock.t += 60.0
    assert reg.authenticate(good_cred) is reg[good]  # heard from
    clock.t += 60.0  # silent for 120 s > 100 s: retired by the check itself
    assert reg.is_target(good) and not reg.is_target(silent)
    assert reg[silent].retired_s is not None and not reg.may_join(silent, silent_cred)


# -- the TCP publisher over the registry -----------------------------------------------------------------
async def _member(addr: tuple[str, int], worker: str, credential: str) -> tuple[Any, Any]:
    reader, writer = await asyncio.open_connection(*addr)
    join = {"op": "join", "worker": worker, "host": "127.0.0.1", "port": 9, "credential": credential}
    await write_frame(writer, join)
    return reader, writer


async def _pull_learner(addr: tuple[str, int], ann: dict[str, Any]) -> dict[str, int]:
    """Pull the chunks the plan puts on the learner, as a member would; the receipts of a member that
    stored every planned chunk."""
    chunks = [i for s, ch in announced(ann) if s == LEARNER for i in ch]
    reader, writer = await asyncio.open_connection(*addr)
    await write_frame(writer, *pull_request(Credential.from_dict(ann["credential"]), chunks, False, "", None))
    for _ in chunks:
        await read_payload(reader, await read_header(reader), CHUNK)
    writer.close()
    got: dict[str, int] = {}
    for s, ch in announced(ann):
        got[s] = got.get(s, 0) + len(ch)
    return got


def test_a_revoked_member_is_disconnected_at_once_and_is_no_target(tmp_path: Path) -> None:
    """Revoked after it joined: its control connection is closed at once (within 1 s), the next
    publication neither plans nor announces it, and it is not among the publisher's members (the
    T_bcast quorum's count)."""
    reg = _registry(tmp_path)
    (good, good_cred), (bad, bad_cred) = _join(reg, "good"), _join(reg, "bad")

    async def go() -> None:
        pub = TcpPublisher(KEY, TreePipelined(), chunk_size=CHUNK, ledger=reg)
        await pub.start()
        ctl = {
            good: await _member(pub.address, good, good_cred),
            bad: await _member(pub.address, bad, bad_cred),
        }
        await pub.wait_members(2, 5)
        assert sorted(pub.members()) == sorted([good, bad])
        t0 = time.monotonic()
        reg.revoke(bad, "caught lying")
        assert await asyncio.wait_for(ctl[bad][0].read(), 1.0) == b""  # closed by the learner ...
        assert time.monotonic() - t0 < 1.0 and pub.counters.members_expelled == 1
        assert pub.members() == [good]
        await pub.publish(1, BLOB)
        ann = await asyncio.wait_for(read_header(ctl[good][0]), 5)
        assert ann["op"] == "announce" and [s for s, _ in announced(ann)] == [LEARNER]  # planned alone
        assert bad not in ann["peers"]
        assert pub.stats(1).n_workers == 1
        assert pub.stats(1).install_s == {} and reg[bad].installed_version == -1
        # ... and a join under its credential is refused from now on
        r, w = await asyncio.open_connection(*pub.address)
        await write_frame(w, to_wire(JoinFrame(worker=bad, host="127.0.0.1", port=9, credential=bad_cred)))
        assert (await asyncio.wait_for(read_header(r), 5))["op"] == "error"
        w.close()
        for _, writer in ctl.values():
            writer.close()
        await pub.close()

    asyncio.run(go())


def test_a_counted_ack_is_written_to_the_registry_and_a_refused_one_is_not(tmp_path: Path) -> None:
    reg = _registry(tmp_path)
    (a, a_cred), (b, b_cred) = _join(reg, "a"), _join(reg, "b")

    async def go() -> None:
        pub = TcpPublisher(KEY, TreePipelined(), chunk_size=CHUNK, ledger=reg)
        await pub.start()
        ctl = {a: await _member(pub.address, a, a_cred)}
        await pub.wait_members(1, 5)
        ctl[b] = await _member(pub.address, b, b_cred)
        await pub.wait_members(2, 5)
        await pub.publish(1, BLOB)
        ann = {w: await asyncio.wait_for(read_header(ctl[w][0]), 5) for w in ctl}
        got = await _pull_learner(pub.address, ann[a])
        await write_frame(ctl[a][1], {"op": "installed", "v": 1, "got": got})  # receipts add up: counted
        # b claims every chunk from the learner, which served it none: refused
        await write_frame(ctl[b][1], {"op": "installed", "v": 1, "got": {LEARNER: N_CHUNKS}})
        stats = await pub.wait_installed(1, timeout=5)
        assert set(stats.install_s) == {a} and pub.counters.acks_refused == 1
        assert (reg[a].installed_version, reg[a].install_s) == (1, stats.install_s[a])
        assert reg[b].installed_version == -1
        for _, writer in ctl.values():
            writer.close()
        await pub.close()

    asyncio.run(go())


# -- the in-memory hub over the same ledger --------------------------------------------------------------
def test_the_in_memory_hub_targets_and_records_through_the_ledger(tmp_path: Path) -> None:
    reg = _registry(tmp_path)
    (good, _), (bad, _) = _join(reg, "good"), _join(reg, "bad")

    async def go() -> None:
        hub = InMemoryHub(KEY, CHUNK, ledger=reg)
        rx = {w: hub.receiver(w) for w in (good, bad)}
        reg.revoke(bad, "caught lying")
        assert hub.members() == [good]
        await hub.publish(1, BLOB)
        for w in (good, bad):
            await rx[w].report_installed(1)
        stats = await hub.wait_installed(1, timeout=1)
        assert stats.n_workers == 1 and set(stats.install_s) == {good}
        assert (reg[good].installed_version, reg[bad].installed_version) == (1, -1)
        await hub.close()

    asyncio.run(go())


# -- the door: the registry, from an empty one and a restored one ------------------------------------------
async def _refused_join(addr: tuple[str, int], worker: str, credential: str | None) -> bool:
    """A join is refused: one error frame, then the connection closes."""
    reader, writer = await asyncio.open_connection(*addr)
    frame: dict[str, Any] = {"op": "join", "worker": worker, "host": "127.0.0.1", "port": 9}
    if credential is not None:
        frame["credential"] = credential
    await write_frame(writer, frame)
    header = await asyncio.wait_for(read_header(reader), 5)
    closed = await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    return header["op"] == "error" and closed


def test_a_publisher_over_an_empty_registry_admits_nobody_unregistered(tmp_path: Path) -> None:
    """The publisher built while the registry is still empty (as the learner builds it): an empty
    registry is falsy (``len`` 0), which once made the publisher fall back to an open ledger. A made-up
    id, with no credential or any, is refused; nothing is announced to it; a registered identity joins."""
    reg = _registry(tmp_path)
    assert len(reg) == 0

    async def go() -> tuple[list[str], dict[str, Any]]:
        pub = TcpPublisher(KEY, TreePipelined(), chunk_size=CHUNK, ledger=reg)
        await pub.start()
        assert await _refused_join(pub.address, "made-up", None)
        assert await _refused_join(pub.address, "made-up", "any-credential")
        wid, cred = _join(reg, "late")  # registered after the publisher was built
        assert await _refused_join(pub.address, wid, "not-its-credential")
        ctl = await _member(pub.address, wid, cred)
        await pub.wait_members(1, 5)
        members = pub.members()
        await pub.publish(1, BLOB)
        ann = await asyncio.wait_for(read_header(ctl[0]), 5)
        ctl[1].close()
        await pub.close()
        return members, ann

    members, ann = asyncio.run(go())
    assert (
        members == [next(iter(r.worker_id for r in reg))]
        and ann["members"] == 1
        and set(ann["peers"]) == {LEARNER}
    )


def test_a_restored_registry_keeps_its_members_and_its_quarantines(tmp_path: Path) -> None:
    first = _registry(tmp_path)
    (good, good_cred), (bad, bad_cred) = _join(first, "good"), _join(first, "bad")
    first.revoke(bad, "caught")
    reg = _registry(tmp_path)
    reg.load()  # a restarted learner

    async def go() -> list[str]:
        pub = TcpPublisher(KEY, TreePipelined(), chunk_size=CHUNK, ledger=reg)
        await pub.start()
        assert await _refused_join(pub.address, bad, bad_cred)
        ctl = await _member(pub.address, good, good_cred)
        await pub.wait_members(1, 5)
        members = pub.members()
        ctl[1].close()
        await pub.close()
        return members

    assert asyncio.run(go()) == [good]


def test_a_quarantine_cuts_a_pull_in_progress_and_tells_the_relays(tmp_path: Path) -> None:
    """A member pulling from the learner (its uplink slowed so the stream lasts) is quarantined: the
    stream ends within 1 s having sent a fraction of the version, its control connection closes, and
    the members told to serve it in that version are sent ``revoke``."""
    from echo2.broadcast.wire import Pacer
    from echo2.weights.frames import RevokeFrame, parse_frame

    reg = _registry(tmp_path)
    members = [_join(reg, f"m{i}") for i in range(3)]
    big = bytes(range(256)) * 4096  # 1 MiB: 256 chunks, at 64 KiB/s a 16 s stream

    async def go() -> tuple[float, int, int]:
        pub = TcpPublisher(KEY, TreePipelined(), chunk_size=CHUNK, ledger=reg, uplink=Pacer(64 << 10))
        await pub.start()
        ctl = {w: await _member(pub.address, w, c) for w, c in members}
        await pub.wait_members(3, 5)
        await pub.publish(1, big)
        ann = {w: await asyncio.wait_for(read_header(ctl[w][0]), 5) for w in ctl}
        victim = next(w for w in ann if any(s == LEARNER for s, _ in announced(ann[w])))
        relays = [w for w in ann if victim in ann[w].get("serve", [])]
        chunks = [i for s, ch in announced(ann[victim]) if s == LEARNER for i in ch]
        r, w = await asyncio.open_connection(*pub.address)
        await write_frame(
            w, *pull_request(Credential.from_dict(ann[victim]["credential"]), chunks, False, "", None)
        )
        await read_payload(r, await asyncio.wait_for(read_header(r), 5), CHUNK)  # the stream runs
        t0 = time.monotonic()
        reg.revoke(victim, "caught")
        got = CHUNK
        try:
            while True:
                got += len(await asyncio.wait_for(read_payload(r, await read_header(r), CHUNK), 2))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        cut_s = time.monotonic() - t0
        told = [parse_frame(await asyncio.wait_for(read_header(ctl[x][0]), 5), RevokeFrame) for x in relays]
        assert all(f.member == victim for f in told)
        for _, writer in ctl.values():
            writer.close()
        await pub.close()
        return cut_s, got, len(told)

    cut_s, got, told = asyncio.run(go())
    assert cut_s < 1.0 and got < len(big) // 2 and told >= 1


def test_a_relay_told_revoke_serves_the_member_nothing_more() -> None:
    """A worker's control connection gets ``revoke``: the member is never served again there and the
    streams it has open are closed (against a fake learner: the frame alone)."""
    from echo2.broadcast.receiver import TcpWorkerNode
    from echo2.weights.frames import RevokeFrame

    async def go() -> tuple[set[str], bool]:
        joined: asyncio.Queue[asyncio.StreamWriter] = asyncio.Queue()

        async def learner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_header(reader)
            await joined.put(writer)
            await asyncio.sleep(30)

        server = await asyncio.start_server(learner, "127.0.0.1", 0)
        node = TcpWorkerNode("relay", server.sockets[0].getsockname()[:2], KEY.verifier())
        await node.start()
        ctl = await asyncio.wait_for(joined.get(), 5)
        cut = asyncio.Event()

        class Stream:  # a stream the member has open here
            class transport:
                @staticmethod
                def abort() -> None:
                    cut.set()

        node._streams["w9"] = {Stream()}  # type: ignore[arg-type]
        await write_frame(ctl, to_wire(RevokeFrame(member="w9")))
        await asyncio.wait_for(cut.wait(), 5)
        revoked = set(node._revoked)
        await node.close()
        server.close()
        return revoked, "w9" not in node._streams

    revoked, dropped = asyncio.run(go())
    assert revoked == {"w9"} and dropped


def test_changes_go_to_a_journal_and_the_file_is_written_whole_once_a_second(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A fleet registering at once rewrites no file per registration: the first change writes
    ``workers.json``, the changes within the next second are appended to ``workers.journal`` (one line
    each), and the housekeeping's ``flush_due`` writes the file whole a second later (the journal then
    gone). A restart reads both, the journal's newer record winning (a quarantine there too), skips a
    line a crash cut short, with one warning, and writes one file again."""
    from echo2.runtime.members import JOURNAL_FILE, WRITE_EVERY_S

    clock = Clock()
    reg = _registry(tmp_path, clock)
    creds = [_join(reg, f"w{i}") for i in range(5)]
    saved = _saved(tmp_path)
    journal = (tmp_path / JOURNAL_FILE).read_text().splitlines()
    assert [d["name"] for d in saved] == ["w0"] and len(journal) == 4
    reg.revoke(creds[1][0], "caught")  # a quarantine within the second: journaled
    reg.flush_due()
    assert len(_saved(tmp_path)) == 1  # not yet
    clock.t += WRITE_EVERY_S
    reg.flush_due()
    assert len(_saved(tmp_path)) == 5 and not (tmp_path / JOURNAL_FILE).exists()
    clock.t += WRITE_EVERY_S
    more = [_join(reg, f"x{i}") for i in range(3)]  # the first is written whole, 2 journaled
    reg.revoke(more[0][0], "caught later")  # journaled: the file still says it is trusted
    with (tmp_path / JOURNAL_FILE).open("a") as fh:
        fh.write('{"worker_id": "w9-torn", "na')  # a crash mid-line
    caplog.set_level(logging.WARNING)
    again = _registry(tmp_path, clock)
    trusted = {r.worker_id for r in again.load()}
    assert len(again) == 8 and trusted == {w for w, _ in creds + more} - {creds[1][0], more[0][0]}
    assert again[more[0][0]].quarantined == "caught later" and again.authenticate(more[2][1]) is not None
    assert "1 line(s) not a whole record, skipped" in caplog.text
    assert len(_saved(tmp_path)) == 8 and not (tmp_path / JOURNAL_FILE).exists()


def _saved(run: Path) -> list[dict[str, object]]:
    """The records ``workers.json`` holds."""
    from echo2.runtime.members import REGISTRY_FILE

    return list(json.loads((run / REGISTRY_FILE).read_text()))


def test_a_declared_upload_rate_is_kept_and_bounded(tmp_path: Path) -> None:
    """A worker may declare its upload link at registration (Mbit/s); the ledger hands the publisher
    bytes/s, kept across a restart; one that declares none, or is not a member, has None; a rate that is
    not a positive finite number up to 400 Gbit/s is refused by the request's model."""
    from pydantic import ValidationError

    from echo2.protocol import RegisterRequest

    reg = _registry(tmp_path)
    fast, _ = reg.register(RegisterRequest(name="fast", usd_per_hour=1.0, uplink_mbps=1000.0))
    quiet, _ = _join(reg, "quiet")
    assert reg.uplink(fast.worker_id) == 125e6 and reg.uplink(quiet) is None and reg.uplink("nobody") is None
    reg.save()
    again = _registry(tmp_path)
    again.load()
    assert again.uplink(fast.worker_id) == 125e6
    for bad in (0.0, -5.0, 4e5 + 1, float("nan"), "100"):
        with pytest.raises(ValidationError):
            RegisterRequest.model_validate({"name": "x", "usd_per_hour": 1.0, "uplink_mbps": bad})


def test_a_registration_is_got_back_only_by_its_attempt_while_fresh_and_trusted(tmp_path):
    from echo2.protocol import RegisterRequest
    from echo2.runtime.members import ATTEMPT_TTL_S, WorkerRegistry

    now = [0.0]
    reg = WorkerRegistry(tmp_path, "t" * 20, lambda: now[0], 10)
    req = RegisterRequest(name="w", usd_per_hour=0.35, attempt="x" * 16)
    rec, cred = reg.register(req)
    assert reg.retried(RegisterRequest(name="w", usd_per_hour=0.35)) is None  # no attempt: a new one
    assert reg.retried(req.model_copy(update={"attempt": "y" * 16})) is None
    now[0] = 1.0
    again, cred2 = reg.retried(req)  # type: ignore[misc]
    assert again is rec and cred2 != cred and reg.authenticate(cred) is None
    now[0] = 2.0
    again, cred3 = reg.retried(req)  # type: ignore[misc]  # that reply lost too: sent a third time
    assert again is rec and cred3 != cred2 and reg.authenticate(cred2) is None
    now[0] = 3.0
    assert reg.authenticate(cred3) is rec  # used: the reply arrived; the attempt opens nothing any more
    assert reg.retried(req) is None
    other = RegisterRequest(name="v", usd_per_hour=0.35, attempt="z" * 16)
    rec2, _ = reg.register(other)
    now[0] += ATTEMPT_TTL_S + 1  # too late: a registration of its own
    assert reg.retried(other) is None
    now[0] = 4.0
    reg.revoke(rec2.worker_id, "caught")  # a quarantined identity is not handed back
    assert reg.retried(other) is None and len(reg) == 2
