"""The worker's protocol client against a stand-in learner on loopback: what it retries and what it
reports."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from echo2.protocol import API, encode_chain
from echo2.rollout import client as client_mod
from echo2.rollout.client import LearnerClient, Refused


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
