"""The API served by a front process (runtime/front.py, ``runtime.api_processes``): the learner's routes
answer on a unix socket, a real front process holds the public port. The routes' own tests run through
it unchanged (it must be transparent: the same replies, the same counted refusals), then what is the
front's own: heartbeats and lease requests in batches, a stranger's large body never read, internal
paths never reachable, a peer's forged address header never believed, the learner gone answered 503,
nothing left running."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
import test_routes
from test_routes import make_node, register

from echo2.config import PerimeterConfig
from echo2.runtime import http
from echo2.runtime.front import Fronts, FrontSpec

pytestmark = pytest.mark.integration


def spec(path: str, max_request_bytes: int, batch_s: float = 0.1) -> FrontSpec:
    return FrontSpec(
        name="front-0",
        host="127.0.0.1",
        port=0,
        upstream=path,
        perimeter=PerimeterConfig().model_dump(),
        idle_s=30.0,
        body_timeout_s=2.0,
        max_request_bytes=max_request_bytes,
        batch_s=batch_s,
        parent=os.getpid(),
    )


def run_fronted(coro_fn: Any, node: Any, fronts_n: int = 1, **kw: Any) -> tuple[Any, Any]:
    """``test_routes.run``, the node served through one front process: ``coro_fn(client)`` with a
    session on the front's port; its result and the store's stats once the front has stopped (its last
    batch carries its counts)."""

    async def main() -> Any:
        await node.snapshots.publish(0, b"blob")
        with tempfile.TemporaryDirectory(prefix="echo2-api-") as where:
            path = os.path.join(where, "api.sock")
            runner = await node.routes.serve_internal(path)
            fronts = Fronts()
            try:
                port = await fronts.start(fronts_n, spec(path, node.routes.max_request_bytes, **kw))
                node.front_pid = fronts.procs[0].pid
                async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as client:
                    node.port = port
                    return await coro_fn(client)
            finally:
                await fronts.aclose()
                await runner.cleanup()

    try:
        return asyncio.run(main()), node.store.stats()
    finally:
        node.store.close()


@pytest.mark.parametrize(
    "name",
    [
        "test_register_needs_the_join_token",
        "test_every_worker_endpoint_needs_a_credential",
        "test_lease_submit_and_rejections_are_counted",
        "test_oversized_body_is_413_and_the_learner_keeps_serving",
        "test_heartbeat_validates_and_reports_activity",
        "test_snapshot_route_serves_the_chain_from_the_callers_version",
    ],  # (not the over-long numbers' test: its 5,000-byte header passes the test server, whose header
    # limit is aiohttp's default, where the front's, as the learner's own port, is 400 bad_http)
)
def test_the_routes_tests_pass_through_a_front(name, tmp_path, monkeypatch):
    monkeypatch.setattr(test_routes, "run", run_fronted)
    getattr(test_routes, name)(tmp_path)


def test_heartbeats_reach_the_learner_in_batches(tmp_path):
    """60 members' heartbeats at once, then their lease requests: every one answered as the in-process
    route answers (its own ``active``, the learner's version; a grant or a refusal), in a handful of
    batch requests, not 120."""
    # 60 registrations from one address: past the per-address rate a stranger's requests have
    rate = ("security.perimeter.requests_per_s=1000", "security.perimeter.request_burst=1000")
    node = make_node(tmp_path, *rate)
    calls: list[int] = []
    batch = node.routes.batch

    async def counted(request: Any) -> Any:
        calls.append(1)
        return await batch(request)

    node.routes.batch = counted

    async def go(client: aiohttp.ClientSession) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
        auths = [await register(client, f"w{i}") for i in range(60)]
        calls.clear()
        beat = {"rollouts": 0, "busy_s": 0.0, "installed_version": 0}
        ask = {"max_prompts": 1, "installed_version": 0}

        async def one(path: str, body: dict[str, Any], auth: dict[str, str]) -> dict[str, Any]:
            resp = await client.post(path, json=body, headers=auth)
            assert resp.status == 200, await resp.text()
            return dict(await resp.json())

        beats = await asyncio.gather(*(one("/v1/heartbeat", beat, a) for a in auths))
        heard = len(calls)
        leases = await asyncio.gather(*(one("/v1/lease", ask, a) for a in auths))
        return list(beats), list(leases), heard

    (beats, leases, heard), _ = run_fronted(go, node, batch_s=0.3)
    assert len(beats) == 60 and all(r["version"] == 0 and not r["finished"] for r in beats)
    assert 1 <= heard <= 6, heard  # ~0.3 s of arrivals a batch
    # every lease answered as the route answers: grants while prompts last, the rest refusals naming why
    kinds = {r["kind"] for r in leases}
    assert len(leases) == 60 and kinds <= {"grant", "refusal"} and "grant" in kinds
    assert all(r["lease_id"] for r in leases if r["kind"] == "grant")
    assert 2 <= len(calls) <= 12, len(calls)


def test_a_strangers_large_body_is_never_read_and_internal_paths_are_not_served(tmp_path):
    """A submission announcing 4 MiB with an unknown credential is refused 403 before its body is sent
    (the front asked the learner about the credential first); the learner's internal paths are 404 on
    the public port; 100 strangers' 4 KiB heartbeats in a member's batch cost it nothing; a peer's own
    address header is not what the learner sees."""
    node = make_node(tmp_path)
    peers: list[str | None] = []
    admit = node.routes._admit

    def watched(credential: Any, peer: Any) -> Any:
        peers.append(peer)
        return admit(credential, peer)

    node.routes._admit = watched

    async def go(client: aiohttp.ClientSession) -> dict[str, Any]:
        out: dict[str, Any] = {}
        reader, writer = await asyncio.open_connection("127.0.0.1", node.port)
        head = (
            "POST /v1/submit HTTP/1.1\r\nHost: x\r\nContent-Length: 4194304\r\n"
            "Authorization: Bearer not-a-credential\r\nContent-Type: application/json\r\n\r\n"
        )
        writer.write(head.encode())  # and no body at all
        await writer.drain()
        t0 = time.monotonic()
        data = await asyncio.wait_for(reader.read(), 5.0)  # answered and closed without the body
        out["stranger"] = (data.split(b"\r\n", 1)[0], time.monotonic() - t0)
        writer.close()
        auth = await register(client)
        for path in (http.FRONT_BATCH, http.FRONT_AUTH):
            resp = await client.post(path, data=b'{"front": "x", "items": []}', headers=auth)
            out[path] = resp.status
        # strangers' heartbeats of 4 KiB each in the honest member's batch: it is answered all the same
        junk = b'{"rollouts": 0, "pad": "' + b"x" * 4000 + b'"}'
        beat = {"rollouts": 0, "busy_s": 0.0, "installed_version": 0}
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{node.port}") as them:
            strangers = [
                them.post("/v1/heartbeat", data=junk, headers={"Authorization": f"Bearer nobody{i}"})
                for i in range(100)
            ]  # (past the perimeter's accept rate for one address their connections are cut: refused too)
            got = await asyncio.gather(
                client.post("/v1/heartbeat", json=beat, headers=auth), *strangers, return_exceptions=True
            )
        out["member"] = got[0].status
        out["strangers"] = [r if isinstance(r, Exception) else r.status for r in got[1:]]
        peers.clear()
        forged = {**auth, http.PEER_HEADER: "203.0.113.9"}
        resp = await client.post("/v1/lease", json={"max_prompts": 1, "installed_version": 0}, headers=forged)
        out["lease"] = resp.status
        return out

    out, stats = run_fronted(go, node)
    assert out["stranger"][0].split()[1] == b"403" and out["stranger"][1] < 2.0
    assert out[http.FRONT_BATCH] == out[http.FRONT_AUTH] == 404  # the front has no such route
    assert out["lease"] == 200 and peers == ["127.0.0.1"]
    answered = [r for r in out["strangers"] if isinstance(r, int)]
    assert out["member"] == 200 and set(answered) <= {403, 429} and len(answered) >= 10, out
    assert all(isinstance(r, (int, aiohttp.ClientError)) for r in out["strangers"])
    refused = stats.rejected_by_reason.get("auth", 0) + stats.rejected_by_reason.get("rate_limited", 0)
    assert refused == 1 + len(answered)


def test_the_learner_gone_is_503_with_retry_after_and_the_front_stops_with_its_parent(tmp_path):
    node = make_node(tmp_path)

    async def go(client: aiohttp.ClientSession) -> list[tuple[int, str | None, str]]:
        auth = await register(client)
        runner = node.routes._test_runner  # stop the learner's side, keep the front
        await runner.cleanup()
        out = []
        beat = {"rollouts": 0, "busy_s": 0.0, "installed_version": 0}
        ask = {"max_prompts": 1, "installed_version": 0}
        for path, body in (("/v1/heartbeat", beat), ("/v1/lease", ask)):
            resp = await client.post(path, json=body, headers=auth)
            out.append((resp.status, resp.headers.get("Retry-After"), (await resp.json())["error"]))
        return out

    serve_internal = node.routes.serve_internal

    async def kept(path: str) -> Any:
        runner = node.routes._test_runner = await serve_internal(path)
        return runner

    node.routes.serve_internal = kept
    out, _ = run_fronted(go, node)
    assert out == [(503, "1", "unavailable"), (503, "1", "unavailable")]
    with pytest.raises(ProcessLookupError):
        os.kill(node.front_pid, 0)  # gone once closed (and reaped)


def test_two_fronts_share_the_port_and_both_report(tmp_path):
    """``api_processes = 2``: both fronts listen on the one port (SO_REUSEPORT), members' requests on
    fresh connections are answered, and each front's perimeter reaches the learner's metrics."""
    rate = ("security.perimeter.requests_per_s=1000", "security.perimeter.request_burst=1000")
    node = make_node(tmp_path, *rate)

    async def go(client: aiohttp.ClientSession) -> list[int]:
        auth = await register(client)
        beat = {"rollouts": 0, "busy_s": 0.0, "installed_version": 0}
        statuses = []
        for _ in range(40):  # a connection each: the kernel spreads them over the fronts
            async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{node.port}") as fresh:
                statuses.append((await fresh.post("/v1/heartbeat", json=beat, headers=auth)).status)
        await asyncio.sleep(1.5)  # every front reports at least once a second
        return statuses

    statuses, _ = run_fronted(go, node, fronts_n=2)
    assert statuses == [200] * 40
    assert set(node.routes._fronts) == {"front-0", "front-1"}
    accepted = [m["perimeter/api/accepted"] for m in node.routes._fronts.values()]
    assert sum(accepted) >= 41 and min(accepted) >= 1, accepted


def test_a_peer_leaving_mid_chain_costs_the_front_nothing(tmp_path):
    """A member that closes its connection a few bytes into a 16 MiB snapshot chain: counted
    ``dropped``, and the front serves the next request as before (no 503, no traceback)."""
    node = make_node(tmp_path)

    async def go(client: aiohttp.ClientSession) -> tuple[int, int]:
        auth = await register(client)
        await node.snapshots.publish(1, bytes(range(256)) * (64 << 10))  # 16 MiB: many writes
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{node.port}") as leaver:
            resp = await leaver.get("/v1/snapshot?have=-1", headers=auth)
            first = resp.status
            await resp.content.read(1024)
            resp.close()  # gone mid-chain
        await asyncio.sleep(0.5)
        beat = {"rollouts": 0, "busy_s": 0.0, "installed_version": 0}
        after = await client.post("/v1/heartbeat", json=beat, headers=auth)
        return first, after.status

    (first, after), stats = run_fronted(go, node)
    assert (first, after) == (200, 200)
    assert stats.rejected_by_reason.get("dropped", 0) >= 1, stats.rejected_by_reason
