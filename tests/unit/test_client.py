"""The worker's protocol client against a stand-in learner on loopback: what it retries and what it
reports; and the chain codec it decodes snapshot chains with, against hostile headers."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from echo2.protocol import API
from echo2.rollout import client as client_mod
from echo2.rollout.client import LearnerClient, Refused
from echo2.weights.chain import CHAIN_MAGIC, ChainError, decode_chain, encode_chain


def _serve_and_fetch(not_ready_replies: int, reconnect_s: float) -> tuple[list[int] | Exception, int]:
    """A learner that answers ``GET /snapshot`` with 503 not_ready ``not_ready_replies`` times, then an
    empty chain (a restarted learner before and after it republished); returns what the client got."""
    seen = {"n": 0}

    async def snapshot(request: web.Request) -> web.Response:
        seen["n"] += 1
        if seen["n"] <= not_ready_replies:
            reply = {"error": "not_ready", "detail": "no snapshot published yet"}
            return web.json_response(reply, status=503)
        return web.Response(body=encode_chain([]))

    async def main() -> list[int] | Exception:
        app = web.Application()
        app.router.add_get(API + "/snapshot", snapshot)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with aiohttp.ClientSession() as session:
                c = LearnerClient(f"http://127.0.0.1:{port}", session, reconnect_s=reconnect_s)
                try:
                    return [len(x) for x in await c.snapshot_chain(-1)]
                except Refused as exc:
                    return exc
        finally:
            await runner.cleanup()

    return asyncio.run(main()), seen["n"]


def test_a_learner_not_ready_yet_is_waited_for(monkeypatch):
    monkeypatch.setattr(client_mod, "RETRY_S", 0.01)
    got, calls = _serve_and_fetch(not_ready_replies=3, reconnect_s=10)
    assert got == [] and calls == 4  # three 503s retried, then the (empty) chain


def test_not_ready_past_the_reconnect_budget_is_reported(monkeypatch):
    monkeypatch.setattr(client_mod, "RETRY_S", 0.01)
    got, calls = _serve_and_fetch(not_ready_replies=10**6, reconnect_s=0.2)
    assert isinstance(got, Refused) and got.status == 503 and got.reply.error == "not_ready"
    assert calls > 1


def _serve_refusals(replies: list[tuple[int, dict[str, str], dict[str, str]]], reconnect_s: float) -> Any:
    """A learner that answers ``GET /version`` with ``replies`` in turn (status, ErrorReply, headers),
    then 200; (what the client got, the arrival times of the requests)."""
    seen: list[float] = []

    async def version(request: web.Request) -> web.Response:
        seen.append(time.monotonic())
        if len(seen) <= len(replies):
            status, reply, headers = replies[len(seen) - 1]
            return web.json_response(reply, status=status, headers=headers)
        return web.json_response({"version": 3, "manifest": None})

    async def main() -> Any:
        app = web.Application()
        app.router.add_get(API + "/version", version)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with aiohttp.ClientSession() as session:
                c = LearnerClient(f"http://127.0.0.1:{port}", session, reconnect_s=reconnect_s)
                try:
                    return (await c.version()).version
                except Refused as exc:
                    return exc
        finally:
            await runner.cleanup()

    return asyncio.run(main()), seen


LIMITED = (429, {"error": "rate_limited", "detail": "slow down"}, {"Retry-After": "0.2"})


def test_rate_limited_is_retried_after_retry_after():
    got, seen = _serve_refusals([LIMITED, LIMITED], reconnect_s=10)
    assert got == 3 and len(seen) == 3
    assert all(b - a >= 0.19 for a, b in itertools.pairwise(seen))  # waited Retry-After each time


def test_rate_limited_past_the_reconnect_budget_is_reported():
    got, seen = _serve_refusals([LIMITED] * 100, reconnect_s=0.5)
    assert isinstance(got, Refused) and got.status == 429 and got.reply.error == "rate_limited"
    assert 2 <= len(seen) <= 4  # bounded like the 503 retries: Retry-After apart, within reconnect_s


def test_over_budget_is_never_retried():
    over = (429, {"error": "over_budget", "detail": "v1: past the budget"}, {"Retry-After": "0"})
    got, seen = _serve_refusals([over] * 100, reconnect_s=10)
    assert isinstance(got, Refused) and got.reply.error == "over_budget" and len(seen) == 1


HOSTILE_HEADERS = [  # a snapshot chain header from a hostile (or broken) learner: ChainError, nothing else
    b"[" * 50_000 + b"]" * 50_000,
    b'{"links": ' + b"[" * 5_000 + b"]" * 5_000 + b"}",
    b'{"links": [{"manifest": ' + b'{"a": ' * 5_000 + b"1" + b"}" * 5_000 + b', "size": 0}]}',
    b'{"links": [{"manifest": {"digest": "\\ud800"}, "size": 0}]}',
    b'{"links": [{"manifest": {}, "size": ' + b"9" * 5_000 + b"}]}",
    b'{"links": [{"manifest": {}, "size": 1e999}]}',
    b'{"links": [{"manifest": {}, "size": true}]}',
    b'{"links": ["x"]}',
    b'{"links": 7}',
    b'"links"',
    b"\xff\xfe",
    b"",
]


@pytest.mark.parametrize("header", HOSTILE_HEADERS, ids=range(len(HOSTILE_HEADERS)))
def test_decode_chain_refuses_hostile_headers_with_chain_error(header):
    body = CHAIN_MAGIC + len(header).to_bytes(8, "big") + header
    with pytest.raises(ChainError, match="snapshot chain"):
        decode_chain(body)


def test_decode_chain_refuses_short_bodies():
    for body in (b"", CHAIN_MAGIC, CHAIN_MAGIC + b"\x00" * 7):
        with pytest.raises(ChainError, match="snapshot chain"):
            decode_chain(body)
