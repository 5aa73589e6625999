"""Transport security on loopback: TLS on both planes pinned by the learner, pull credentials checked
by the publisher and by relays, bounded requests, and impostors (on the broadcast and the API) refused."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from echo2.broadcast.access import SERVE_BUDGET, issue, pull_request
from echo2.broadcast.api import OpenLedger
from echo2.broadcast.factory import get_strategy
from echo2.broadcast.publisher import TcpPublisher
from echo2.broadcast.receiver import TcpWorkerNode
from echo2.broadcast.wire import read_header, read_payload, write_frame
from echo2.protocol import RegisterRequest
from echo2.rollout.client import LearnerClient
from echo2.transport import PinError, TlsIdentity, join_string, make_identity, open_pinned
from echo2.weights.manifest import blob_ok, new_signing_key, synthetic_snapshot

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
KEY = new_signing_key()  # the learner's manifest key: it also signs pull credentials
PUBLIC = KEY.verifier()  # what workers hold
LEARNER = make_identity(["127.0.0.1"])  # the run's certificate
CHUNK = 8 << 10
BLOB = synthetic_snapshot(200_000, seed=5)
N_CHUNKS = -(-len(BLOB) // CHUNK)


async def _cluster(n: int, strategy: str = "tree-pipelined") -> tuple[TcpPublisher, list[TcpWorkerNode]]:
    pub = TcpPublisher(KEY, get_strategy(strategy), chunk_size=CHUNK, tls=LEARNER, ledger=OpenLedger())
    await pub.start()
    nodes = [
        TcpWorkerNode(f"w{i}", pub.address, PUBLIC, stall_timeout=1.0, pin=LEARNER.fingerprint)
        for i in range(n)
    ]
    for nd in nodes:
        await nd.start()
    await pub.wait_members(n, 10)
    return pub, nodes


async def _install_all(pub: TcpPublisher, nodes: list[TcpWorkerNode], version: int = 1) -> dict[str, bytes]:
    got: dict[str, bytes] = {}

    async def install(node: TcpWorkerNode) -> None:
        async for snap in node.snapshots():
            assert blob_ok(snap.manifest, snap.data)
            got[node.worker_id] = bytes(snap.data)
            await node.report_installed(snap.manifest.version)
            return

    tasks = [asyncio.create_task(install(nd)) for nd in nodes]
    await pub.publish(version, BLOB)
    await pub.wait_installed(version, count=len(nodes), timeout=30)
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    return got


async def _shutdown(pub: TcpPublisher, nodes: list[TcpWorkerNode]) -> None:
    for nd in nodes:
        await nd.close()
    await pub.close()


async def _ask(port: int, pin: str, frame: Any) -> list[dict[str, Any]]:
    """Send one pull request (a header, or ``access.pull_request``'s header and chunk list) over TLS
    pinned to ``pin``; every frame header that came back until the server closed the connection (chunk
    payloads read and dropped)."""
    reader, writer = await open_pinned("127.0.0.1", port, pin)
    header, payload = frame if isinstance(frame, tuple) else (frame, None)
    await write_frame(writer, header, payload)
    frames: list[dict[str, Any]] = []
    try:
        while True:
            header = await asyncio.wait_for(read_header(reader), 10)
            await read_payload(reader, header, CHUNK)
            frames.append(header)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    writer.close()
    return frames


def _refused(frames: list[dict[str, Any]], needle: str) -> bool:
    """The server sent no chunk, one error naming ``needle``, and closed."""
    return len(frames) == 1 and frames[0]["op"] == "error" and needle in frames[0]["reason"]


def _attacks(me: TlsIdentity, victim: TcpWorkerNode, server_fp: str) -> list[tuple[str, Any]]:
    """Pull requests for v1 that must all be refused, each with the reason a server gives."""
    thief = make_identity(["127.0.0.1"])  # a party that is not the victim
    genuine = issue(KEY, 1, victim.worker_id, me.fingerprint)
    forged = issue(new_signing_key(), 1, victim.worker_id, thief.fingerprint)
    stranger = issue(KEY, 1, "zz", thief.fingerprint)  # the learner's credential for someone never scheduled
    return [
        ("no credential", {"op": "get", "v": 1, "chunks": [0], "from": victim.worker_id}),
        ("another run", pull_request(forged, [0], False, server_fp, thief)),  # signed by another key
        ("not the one its credential names", pull_request(genuine, [0], False, server_fp, thief)),  # stolen
        ("for v2", {**pull_request(genuine, [0], False, server_fp, me)[0], "v": 2}),  # another version
        ("not a member this node serves", pull_request(stranger, [0], False, server_fp, thief)),
    ]


def test_tls_broadcast_installs_and_relays() -> None:
    """The normal path under TLS: every worker pins the learner, peers pin each other, chunks relay."""

    async def go() -> None:
        pub, nodes = await _cluster(4)
        got = await _install_all(pub, nodes)
        assert got == {f"w{i}": BLOB for i in range(4)}
        assert all(nd._ctl is not None and nd._ctl[1].get_extra_info("ssl_object") for nd in nodes)  # TLS
        assert pub.stats(1).learner_bytes == len(BLOB)  # the learner sent G once: the rest was relayed
        assert sum(nd.counters.bytes_relayed for nd in nodes) >= 3 * len(BLOB) - 4 * CHUNK
        assert all(nd.counters.stream_failures == 0 and nd.counters.pin_failures == 0 for nd in nodes)
        assert pub.refusals.refused_requests == 0 and all(nd.refusals.refused_requests == 0 for nd in nodes)
        await _shutdown(pub, nodes)

    asyncio.run(go())


def test_the_publisher_refuses_pulls_without_a_valid_credential() -> None:
    async def go() -> None:
        pub, nodes = await _cluster(2)
        await _install_all(pub, nodes)
        for needle, frame in _attacks(nodes[1].tls, nodes[1], LEARNER.fingerprint):  # type: ignore[arg-type]
            assert _refused(await _ask(pub.port, LEARNER.fingerprint, frame), needle), needle
        assert pub.refusals.refused_requests == 5
        # plain text on the TLS port: no handshake, nothing back
        reader, writer = await asyncio.open_connection("127.0.0.1", pub.port)
        await write_frame(writer, {"op": "get", "v": 1, "chunks": [0], "from": "w1"})
        assert await asyncio.wait_for(reader.read(), 20) == b""
        writer.close()
        await _shutdown(pub, nodes)

    asyncio.run(go())


def test_a_relay_refuses_pulls_without_a_valid_credential() -> None:
    async def go() -> None:
        pub, nodes = await _cluster(3)
        await _install_all(pub, nodes)
        relay, member = nodes[0], nodes[1]  # the plan has w1 pulling from w0
        assert relay.tls is not None and member.tls is not None
        for needle, frame in _attacks(member.tls, member, relay.tls.fingerprint):
            assert _refused(await _ask(relay.port, relay.tls.fingerprint, frame), needle), needle
        assert relay.refusals.refused_requests == 5
        # w1 itself, with its credential and proof, is served
        own = pull_request(
            issue(KEY, 1, "w1", member.tls.fingerprint), [0, 1], False, relay.tls.fingerprint, member.tls
        )
        frames = await _ask(relay.port, relay.tls.fingerprint, own)
        assert [(f["op"], f["i"]) for f in frames] == [("chunk", 0), ("chunk", 1)]
        await _shutdown(pub, nodes)

    asyncio.run(go())


@pytest.mark.parametrize("server", ["publisher", "relay"])
def test_bounded_requests_and_the_byte_budget(server: str) -> None:
    async def go() -> None:
        pub, nodes = await _cluster(3)
        await _install_all(pub, nodes)
        member = nodes[1]
        assert member.tls is not None and nodes[0].tls is not None
        if server == "publisher":
            port, fp, refusals = pub.port, LEARNER.fingerprint, pub.refusals
        else:
            port, fp, refusals = nodes[0].port, nodes[0].tls.fingerprint, nodes[0].refusals
        cred = issue(KEY, 1, "w1", member.tls.fingerprint)

        def ask(chunks: list[int]) -> Any:
            return _ask(port, fp, pull_request(cred, chunks, False, fp, member.tls))

        assert _refused(await ask([0] * 1000), "chunk indices")  # 1000 copies of chunk 0
        assert _refused(await ask([0, 1, 0]), "more than once")
        assert _refused(await ask(list(range(N_CHUNKS + 1))), "chunk indices")
        assert _refused(await ask([N_CHUNKS]), "chunk indices")
        assert refusals.bad_requests == 4
        # a member downloading the version again and again is cut off at a small multiple of its size
        rounds, frames = 0, [{"op": "chunk"}]
        while frames[-1]["op"] != "error" and rounds < 10:
            frames = await ask(list(range(N_CHUNKS)))
            rounds += 1
        assert "byte budget" in frames[-1]["reason"] and refusals.over_budget == 1
        assert rounds <= SERVE_BUDGET + 1
        await _shutdown(pub, nodes)

    asyncio.run(go())


def test_a_worker_pinned_to_another_certificate_refuses_the_learner() -> None:
    async def go() -> None:
        pub = TcpPublisher(
            KEY,
            get_strategy("tree-pipelined"),
            chunk_size=CHUNK,
            tls=make_identity(["127.0.0.1"]),
            ledger=OpenLedger(),
        )
        await pub.start()  # an impostor's publisher: its own certificate
        node = TcpWorkerNode("w0", pub.address, PUBLIC, pin=LEARNER.fingerprint)
        with pytest.raises(PinError, match=f"not the pinned {LEARNER.fingerprint}"):
            await node.start(join_timeout=5)
        await asyncio.sleep(0.1)
        assert pub.members() == []  # nothing was sent to it: no join
        await pub.close()

    asyncio.run(go())


def test_a_relay_whose_certificate_the_learner_did_not_announce_gets_no_request() -> None:
    """A member that joins naming one certificate and serves with another is never asked for a chunk
    (the pin fails right after the handshake); its stripe is repaired from the learner."""
    announced, actual = make_identity(["127.0.0.1"]), make_identity(["127.0.0.1"])

    async def go() -> None:
        pub, nodes = await _cluster(2)
        asked: list[bytes] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            asked.append(await reader.read(100))
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=actual.server_context())
        _, ctl = await open_pinned("127.0.0.1", pub.port, LEARNER.fingerprint)
        hello = {
            "op": "join",
            "worker": "zz",
            "host": "127.0.0.1",
            "port": server.sockets[0].getsockname()[1],
        }
        await write_frame(ctl, {**hello, "cert": announced.fingerprint})
        await pub.wait_members(3, 10)
        got = await _install_all(pub, nodes)
        assert got == {"w0": BLOB, "w1": BLOB}
        assert all(nd.counters.pin_failures >= 1 and nd.counters.repaired_chunks > 0 for nd in nodes)
        assert asked and set(asked) == {b""}  # each puller checked the pin and hung up without a byte
        ctl.close()
        server.close()
        await _shutdown(pub, nodes)

    asyncio.run(go())


async def _api(identity: TlsIdentity, seen: list[str]) -> tuple[web.AppRunner, int]:
    """A stand-in for the learner's API over TLS under ``identity``: notes every request it gets."""

    async def anything(request: web.Request) -> web.Response:
        seen.append(f"{request.method} {request.path} {await request.text()}")
        return web.json_response({"version": None, "manifest": None})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=identity.server_context())
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


def test_the_worker_client_talks_only_to_the_pinned_learner() -> None:
    """On-path key swap: an impostor serving the learner's API with its own certificate gets nothing,
    not even the register request that carries the join token; the real learner is reached."""

    async def go() -> None:
        impostor_seen: list[str] = []
        learner_seen: list[str] = []
        impostor, port = await _api(make_identity(["127.0.0.1"]), impostor_seen)
        real, real_port = await _api(LEARNER, learner_seen)
        async with aiohttp.ClientSession() as session:
            client = LearnerClient(
                join_string(f"https://127.0.0.1:{port}", LEARNER.fingerprint), session, 30.0
            )
            t0 = time.monotonic()
            with pytest.raises(PinError, match="refusing to talk to it"):
                await client.register(RegisterRequest(usd_per_hour=0.35), "the-join-token")
            assert time.monotonic() - t0 < 5  # refused at once, not retried like an unreachable learner
            client = LearnerClient(
                join_string(f"https://127.0.0.1:{real_port}", LEARNER.fingerprint), session, 5.0
            )
            assert (await client.version()).version is None
        assert impostor_seen == [] and learner_seen == ["GET /v1/version "]
        await impostor.cleanup()
        await real.cleanup()

    asyncio.run(go())


def test_echo2_worker_refuses_an_impostor_and_an_unpinned_https_join() -> None:
    async def go() -> None:
        seen: list[str] = []
        impostor, port = await _api(make_identity(["127.0.0.1"]), seen)
        env = {**os.environ, "ECHO2_JOIN_TOKEN": "the-join-token"}
        cases = [
            (join_string(f"https://127.0.0.1:{port}", LEARNER.fingerprint), "refusing to talk to it"),
            (f"https://127.0.0.1:{port}", "must end in #sha256="),
        ]
        for join, needle in cases:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "echo2.cli", "worker", "--join", join, env=env,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            _, err = await asyncio.wait_for(proc.communicate(), 40)
            assert proc.returncode == 2 and needle in err.decode() and "Traceback" not in err.decode(), err
        assert seen == []  # the token never reached the impostor
        await impostor.cleanup()

    asyncio.run(go())
