"""The perimeter of a listening port (echo2/perimeter.py) over real loopback sockets: connection caps
per address and in all, eviction of the oldest unauthenticated connection of the address that holds the
most, the accept rate per address, the TLS handshake and first-request deadlines, vouching; and the
limits cut to a descriptor limit. Clients dial from several loopback addresses (127.0.0.0/8 is all
loopback on Linux), as strangers on many machines would."""

from __future__ import annotations

import asyncio
import ssl
import time
from typing import Any

import pytest

from echo2.config import PerimeterConfig
from echo2.perimeter import Limits, Perimeter, port_limits, streams
from echo2.resources import RESERVED_FDS
from echo2.transport import client_context, make_identity


def limits(**kw: Any) -> Limits:
    base = dict(
        max_connections=8, max_per_address=3, pre_auth_share=0.5, accepts_per_s=1000.0, accept_burst=1000.0,
        accepts_total=1000.0, handshake_s=5.0, header_s=5.0, requests_per_s=10.0, request_burst=20.0,
    )  # fmt: skip
    return Limits(**{**base, **kw})


async def serve(perimeter: Perimeter, tls: ssl.SSLContext | None = None) -> tuple[asyncio.Server, int]:
    """A port that vouches for a connection whose first line is ``auth``, answers ``ok`` to each line
    and holds the connection until the peer closes it."""

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                if line.startswith(b"auth"):
                    perimeter.vouch(writer.transport)
                writer.write(b"ok\n")
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await perimeter.serve(lambda: streams(on_connect), "127.0.0.1", 0, tls)
    return server, server.sockets[0].getsockname()[1]


async def dial(port: int, source: str, line: bytes | None = None, tls: bool = False) -> Any:
    """A connection from ``source``; with ``line``, sent and its answer awaited."""
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, local_addr=(source, 0), ssl=client_context() if tls else None,
        server_hostname="" if tls else None,
    )  # fmt: skip
    if line is not None:
        writer.write(line)
        await writer.drain()
        assert await asyncio.wait_for(reader.readline(), 5) == b"ok\n"
    return reader, writer


async def closed(conn: Any, within: float = 2.0) -> bool:
    """Whether the server closed (or reset) ``conn`` within ``within`` seconds."""
    reader, _ = conn
    try:
        return await asyncio.wait_for(reader.read(), within) == b""
    except (ConnectionError, ssl.SSLError):
        return True
    except TimeoutError:
        return False


async def settle() -> None:
    await asyncio.sleep(0.05)


def test_caps_per_address_and_in_all_evict_the_oldest_stranger_of_the_address_holding_most() -> None:
    async def go() -> Perimeter:
        p = Perimeter("test", limits())
        server, port = await serve(p)
        members = [await dial(port, "127.0.0.2", b"auth\n") for _ in range(3)]  # its address is full ...
        refused = await dial(port, "127.0.0.2")
        assert await closed(refused)  # ... of members: refused at accept, nobody evicted
        assert not any([await closed(m, 0.1) for m in members])
        strangers = [await dial(port, "127.0.0.3") for _ in range(3)]
        await settle()
        fourth = await dial(port, "127.0.0.3")  # its address is full of strangers: its oldest goes
        assert await closed(strangers[0]) and not await closed(fourth, 0.1)
        lone = await dial(port, "127.0.0.4")  # 3 + 1 strangers: the unauthenticated share (4) is full
        await settle()
        newcomer = await dial(port, "127.0.0.5")  # evicts the oldest stranger of .3, which holds most
        assert await closed(strangers[1])
        assert not await closed(lone, 0.1) and not await closed(newcomer, 0.1)
        assert p.open <= p.limits.max_connections and p.pre_auth <= p.limits.max_pre_auth
        server.close()
        return p

    p = asyncio.run(go())
    c = p.counters
    assert (c.refused_address, c.evicted, c.vouched) == (1, 2, 3)


def test_new_connections_from_one_address_pass_a_token_bucket() -> None:
    async def go() -> Perimeter:
        p = Perimeter("test", limits(accepts_per_s=0.5, accept_burst=2.0, max_per_address=8))
        server, port = await serve(p)
        ok = [await dial(port, "127.0.0.6") for _ in range(2)]
        third = await dial(port, "127.0.0.6")
        other = await dial(port, "127.0.0.7")  # another address has its own bucket
        assert await closed(third) and not await closed(other, 0.1)
        assert not any([await closed(c, 0.1) for c in ok])
        server.close()
        return p

    assert asyncio.run(go()).counters.refused_rate == 1


def test_a_stranger_is_closed_at_header_s_and_a_member_is_not() -> None:
    async def go() -> Perimeter:
        p = Perimeter("test", limits(header_s=0.3))
        server, port = await serve(p)
        t0 = time.monotonic()
        idle = await dial(port, "127.0.0.8")
        talker = await dial(port, "127.0.0.8", b"hello\n")  # a request, but nobody vouched for it
        member = await dial(port, "127.0.0.8", b"auth\n")
        assert await closed(idle) and await closed(talker)
        assert 0.25 < time.monotonic() - t0 < 2.0
        assert not await closed(member, 0.5)  # well past header_s
        assert p.open == 1 and p.pre_auth == 0
        server.close()
        return p

    assert asyncio.run(go()).counters.header_timeouts == 2


def test_tls_a_silent_handshake_is_cut_and_data_right_after_the_handshake_arrives() -> None:
    """A TCP connection that never sends its ClientHello is closed at handshake_s (counted); a client
    whose first line follows the handshake at once is served (the TLS layer reads it while finishing
    the handshake, before the application's protocol exists: it is kept, not dropped)."""
    ident = make_identity(["127.0.0.1"])

    async def go() -> Perimeter:
        p = Perimeter("test", limits(handshake_s=0.3))
        server, port = await serve(p, ident.server_context())
        silent = await dial(port, "127.0.0.9")  # plain TCP: no ClientHello ever
        for _ in range(5):
            await dial(port, "127.0.0.9", b"auth\n", tls=True)  # each answered: nothing lost
        assert await closed(silent)
        server.close()
        return p

    p = asyncio.run(go())
    assert p.counters.handshake_failed == 1 and p.counters.vouched == 5


def test_connection_counts_are_given_back_however_a_connection_ends() -> None:
    async def go() -> Perimeter:
        p = Perimeter("test", limits(max_connections=64, max_per_address=64))
        server, port = await serve(p)
        conns = [await dial(port, f"127.0.1.{i % 4 + 1}", b"auth\n" if i % 2 else None) for i in range(20)]
        await settle()
        assert p.open == 20
        for _, writer in conns:
            writer.close()
        for _ in range(50):
            await settle()
            if p.open == 0:
                break
        server.close()
        return p

    p = asyncio.run(go())
    assert p.open == 0 and p.pre_auth == 0 and not p._per_addr and not p._pre and p._most == 0
    assert not p._vouched


@pytest.mark.parametrize(("descriptors", "cap"), [(1024, 307), (20_000, 7897), (1 << 20, 16384), (200, 16)])
def test_the_caps_fit_the_descriptor_limit(descriptors: int, cap: int) -> None:
    got = port_limits(PerimeterConfig(), descriptors)
    assert got.max_connections == cap
    if descriptors > 1024:
        assert 2 * got.max_connections + RESERVED_FDS <= descriptors  # both ports and the files fit
    assert got.max_per_address <= got.max_connections and got.max_pre_auth == cap // 2


def test_new_connections_from_all_addresses_pass_a_bucket_of_their_own() -> None:
    """A flood from many addresses, each under its own rate, is held to the port's total; an address a
    member is connected from is not (its pulls and reconnections pass)."""

    async def go() -> Perimeter:
        p = Perimeter("test", limits(accepts_total=1.0, max_connections=64, max_per_address=8))  # bursts of 2
        server, port = await serve(p)
        member = await dial(port, "127.0.3.1", b"auth\n")  # takes one of the burst
        conns = [await dial(port, f"127.0.2.{i + 1}") for i in range(3)]
        shut = [await closed(c, 0.3) for c in conns]
        again = [await dial(port, "127.0.3.1") for _ in range(3)]  # the member's address: not held
        assert shut == [False, True, True] and not any([await closed(c, 0.1) for c in [member, *again]])
        server.close()
        return p

    assert asyncio.run(go()).counters.refused_rate == 2


def test_tls_clients_that_send_a_request_and_close_at_once_leave_no_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Over TLS, a request and the peer's close can reach the perimeter together, before the
    application's protocol exists: the request is handed on, the connection closed once. Closed twice,
    an asyncio TLS transport drops its TLS layer and aiohttp, starting that request, failed on it with
    an exception no task retrieved (a traceback in the learner's log, once in a few hundred such peers);
    and asyncio warned at every such EOF."""
    from aiohttp import web

    from echo2.runtime.http import PerimeterSite, Runner

    ident = make_identity(["127.0.0.1"])
    request = b"GET /x HTTP/1.1\r\nHost: learner\r\n\r\n"

    async def ok(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def go() -> tuple[list[dict[str, Any]], Perimeter]:
        failures: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: failures.append(ctx))
        app = web.Application()
        app.router.add_get("/x", ok)
        runner = Runner(app, on_refusal=lambda _reason: None)
        await runner.setup()
        p = Perimeter("api", limits(max_connections=64, max_per_address=64))
        site = PerimeterSite(runner, "127.0.0.1", 0, ident.server_context(), p)
        await site.start()

        async def rude(i: int) -> None:
            try:
                _, writer = await asyncio.open_connection(
                    "127.0.0.1", site.port, ssl=client_context(), server_hostname="",
                    local_addr=(f"127.0.{i % 50 + 1}.{i % 5 + 2}", 0),
                )  # fmt: skip
            except (ConnectionError, ssl.SSLError):  # evicted during its handshake (64 connections held)
                return
            writer.write(request)
            writer.close()

        for start in range(0, 600, 100):
            await asyncio.gather(*(rude(i) for i in range(start, start + 100)))
        await asyncio.sleep(0.5)
        await runner.cleanup()
        return failures, p

    with caplog.at_level("WARNING", logger="asyncio"):
        failures, p = asyncio.run(go())
    assert p.counters.accepted == 600
    assert not failures, [str(f.get("exception")) for f in failures[:3]]
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text[:500]


def test_a_connection_cancelled_by_a_stop_ends_without_an_error_logged():
    """A process stopping while a peer is connected cancels that connection's task; on Python 3.11
    asyncio then logged 'Exception in callback ... CancelledError' with a traceback (seen on a learner
    stopped with a worker connected to its broadcast port). Through ``streams`` it ends quietly."""
    errors: list[dict[str, Any]] = []

    async def run() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: errors.append(ctx))
        waiting = asyncio.Event()

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            waiting.set()
            await reader.readline()  # a peer that sends nothing: waits until cancelled

        server = await Perimeter("test", limits()).serve(lambda: streams(on_connect), "127.0.0.1", 0, None)
        conn = await dial(server.sockets[0].getsockname()[1], "127.0.0.1")
        await asyncio.wait_for(waiting.wait(), 5)
        handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in handlers:
            t.cancel()  # what asyncio.run does to the tasks left when the process stops
        await asyncio.sleep(0.1)
        assert handlers and all(t.done() for t in handlers)
        conn[1].close()
        server.close()

    asyncio.run(run())
    assert errors == [], [e.get("message") for e in errors]
