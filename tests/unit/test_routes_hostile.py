"""The learner's HTTP API against a peer's worst bytes (runtime/routes.py, runtime/members.py): deep
JSON, lone surrogates, what aiohttp's parser refuses, short bodies, prices near zero, identities that
hold registration slots, request floods and snapshot pulls past the byte budget. The rule each test
holds: never a 500; every refusal a counted 4xx in the ErrorReply JSON shape (or a counted dropped
connection), and a hostile identity costs only its own work."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from test_routes import JOIN, TOKEN, make_node, register, run

from echo2.broadcast.access import BUDGET_SLACK_CHUNKS, SERVE_BUDGET, ByteBudget, Gate, ServeCounters
from echo2.perimeter import RequestRate
from echo2.protocol import HeartbeatRequest, RegisterRequest
from echo2.runtime.members import WorkerRegistry
from echo2.weights.manifest import new_signing_key

DEEP = 50_000  # nesting of the deep bodies (Python's json recursed out of its stack at ~1,000)
DEEP_REGISTER = 2_000  # ... of a registration's (its body is read up to 4 KiB only)


def serve(node: Any, fn: Any) -> tuple[Any, Any]:
    """Serve the node the way the learner does (``Routes.serve``: aiohttp's protocol with our
    refusals, plain TCP on loopback) with version 0 published; ``fn(port)``'s result and the store's
    final stats."""

    async def main() -> Any:
        await node.snapshots.publish(0, b"blob")
        runner, port = await node.routes.serve("127.0.0.1", 0)
        try:
            return await fn(port)
        finally:
            await runner.cleanup()

    try:
        return asyncio.run(main()), node.store.stats()
    finally:
        node.store.close()


async def raw(port: int, request: bytes, timeout: float = 5.0) -> tuple[int, dict[str, str], Any]:
    """Send raw bytes, read until the server closes; (status, headers, decoded JSON body or the raw
    text). 0 for a connection dropped without an answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    if not data:
        return 0, {}, None
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    try:
        parsed: Any = json.loads(body)
    except ValueError:
        parsed = body.decode("latin-1")
    return int(lines[0].split()[1]), headers, parsed


def post(path: str, body: bytes, *extra: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {len(body)}", "Connection: close", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


# ---- 1. deep JSON ------------------------------------------------------------------------------------
def test_deep_json_is_400_malformed_on_every_endpoint(tmp_path):
    """A body nested 50,000 deep (2,000 on register, whose body is read up to 4 KiB only): 400
    malformed (Python's json raised RecursionError out of register, a 500); the request models' parser
    bounds nesting too."""
    deep_list = "[" * DEEP + "]" * DEEP
    deep_register = "[" * DEEP_REGISTER + "]" * DEEP_REGISTER
    deep_name = '{"name": ' + '{"a": ' * 500 + "1" + "}" * 500 + ', "usd_per_hour": 1.0}'

    async def body(client: TestClient) -> list[tuple[int, str]]:
        out = []
        for raw_body in (deep_register, deep_name):
            resp = await client.post("/v1/register", data=raw_body, headers=JOIN)
            out.append((resp.status, (await resp.json())["error"]))
        auth = await register(client)
        for endpoint in ("heartbeat", "lease", "submit"):
            resp = await client.post(f"/v1/{endpoint}", data=deep_list, headers=auth)
            out.append((resp.status, (await resp.json())["error"]))
        nested_lease = '{"lease_id": "x", "policy_version": 0, "groups": [], "next_lease": '
        nested_lease += '{"a": ' * DEEP + "1" + "}" * DEEP + "}"
        resp = await client.post("/v1/submit", data=nested_lease, headers=auth)
        out.append((resp.status, (await resp.json())["error"]))
        return out

    got, stats = run(body, make_node(tmp_path))
    assert got == [(400, "malformed")] * 6
    assert stats.rejected_by_reason == {"malformed": 6}


# ---- 2. lone surrogates ------------------------------------------------------------------------------
def test_lone_surrogates_in_tokens_and_credentials_are_refused(tmp_path):
    """A join token "\\ud800" (a JSON escape) made token_ok raise UnicodeEncodeError (a 500); a bearer
    credential of undecodable bytes (aiohttp decodes them to lone surrogates) did the same in the
    credential hash. Now: 400 malformed (the parser refuses lone surrogates in a body), 403 auth (a
    token or credential of such bytes is a wrong one)."""

    async def go(port: int) -> list[tuple[int, str]]:
        out = []
        for name in ('"\\ud800"', '"\\udcff"', '"a\\udfff"'):
            body = f'{{"name": {name}, "usd_per_hour": 1.0}}'.encode()
            status, _, reply = await raw(port, post("/v1/register", body, f"Authorization: Bearer {TOKEN}"))
            out.append((status, reply["error"]))
        for cred in (b"\xed\xa0\x80", b"\xff\xfe", b"ok\x80"):
            for path in (b"GET /v1/version", b"POST /v1/register"):
                req = path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer " + cred
                status, _, reply = await raw(port, req + b"\r\nContent-Length: 0\r\n\r\n")
                out.append((status, reply["error"]))
        return out

    node = make_node(tmp_path)
    got, stats = serve(node, go)
    assert got == [(400, "malformed")] * 3 + [(403, "auth")] * 6
    assert stats.rejected_by_reason == {"malformed": 3, "auth": 6}


def test_the_registry_compares_and_hashes_any_string(tmp_path):
    """token_ok, authenticate and may_join (the broadcast port hands it a JSON string, which
    may hold a lone surrogate) answer False/None for garbage, never raise."""
    reg = WorkerRegistry(tmp_path, TOKEN, time.time)
    rec, credential = reg.register(RegisterRequest(usd_per_hour=1.0))
    for garbage in ("\ud800", "\udcff\udcfe", TOKEN + "\udfff", ""):
        assert not reg.token_ok(garbage)
        assert reg.authenticate(garbage) is None
        assert not reg.may_join(rec.worker_id, garbage)
    assert reg.token_ok(TOKEN) and reg.authenticate(credential) is rec
    assert reg.may_join(rec.worker_id, credential)


# ---- 3. aiohttp's own refusals -------------------------------------------------------------------------
HTTP_GARBAGE = [  # what aiohttp's parser refuses before any handler or middleware runs
    ("nul_in_header", b"GET /v1/version HTTP/1.1\r\nHost: x\r\nX-Evil: a\x00b\r\n\r\n"),
    (
        "length_and_chunked",
        b"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\n",
    ),
    ("bad_request_line", b"GARBAGE\r\n\r\n"),
    ("long_header", b"GET /v1/version HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 20_000 + b"\r\n\r\n"),
    (
        "bad_chunk_size",
        b"POST /v1/register HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n\r\n",
    ),
    ("non_ascii_path", b"GET /v1/\xff HTTP/1.1\r\nHost: x\r\n\r\n"),
]


def test_aiohttps_own_refusals_are_errorreply_json_and_counted(tmp_path):
    """Before: text/plain bodies, uncounted, each logged with a traceback. Now: the ErrorReply shape,
    reason bad_http, counted; and the learner keeps serving."""

    async def go(port: int) -> tuple[list[tuple[int, str, Any]], int]:
        out = []
        for _, request in HTTP_GARBAGE:
            status, headers, reply = await raw(port, request)
            out.append((status, headers.get("Content-Type", ""), reply))
        after, _, _ = await raw(port, post("/v1/register", b'{"token": "nope"}'))
        return out, after

    node = make_node(tmp_path)
    (got, after), stats = serve(node, go)
    for (what, _), (status, ctype, reply) in zip(HTTP_GARBAGE, got, strict=True):
        assert status == 400 and ctype.startswith("application/json"), (what, status, ctype, reply)
        assert isinstance(reply, dict) and reply["error"] == "bad_http" and reply["detail"], (what, reply)
    assert after == 401  # still serving
    assert stats.rejected_by_reason == {"bad_http": len(HTTP_GARBAGE), "auth": 1}


def test_a_handler_bug_is_a_json_500_with_its_traceback(tmp_path, caplog):
    """A 500 is a bug of ours, never a peer's bytes: same JSON shape, counted internal, and the log
    keeps the traceback."""
    node = make_node(tmp_path)

    async def broken(request: Any) -> Any:
        raise RuntimeError("a bug")

    node.routes.model = broken

    async def go(port: int) -> tuple[int, Any]:
        status, _, reply = await raw(port, b"GET /v1/model HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return status, reply

    (status, reply), stats = serve(node, go)
    assert status == 500 and reply["error"] == "internal"
    assert stats.rejected_by_reason == {"internal": 1}
    assert any(r.exc_info and "a bug" in str(r.exc_info[1]) for r in caplog.records)


# ---- 4. short bodies -----------------------------------------------------------------------------------
def test_a_body_shorter_than_its_length_is_408_and_the_connection_closes(tmp_path):
    """Content-Length 100 and 5 bytes sent: before, the handler waited forever; now 408 slow_body
    after security.body_timeout_s, the connection closed at once, counted. A peer that hangs up
    mid-body is counted dropped."""

    async def go(port: int) -> tuple[Any, ...]:
        head = f"POST /v1/register HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n".encode()
        head += b"Content-Length: 100\r\n\r\n"
        t0 = time.monotonic()
        slow = await raw(port, head + b'{"tok', timeout=5.0)
        took = time.monotonic() - t0
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head + b'{"tok')
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()  # hangs up mid-body
        await asyncio.sleep(0.2)
        after, _, _ = await raw(port, post("/v1/register", b'{"token": "nope"}'))
        return slow, took, after

    node = make_node(tmp_path, "security.body_timeout_s=0.3")
    ((status, headers, reply), took, after), stats = serve(node, go)
    assert status == 408 and reply["error"] == "slow_body" and "body_timeout_s" in reply["detail"]
    assert headers.get("Connection") == "close" and 0.3 <= took < 2.0  # closed without lingering
    assert after == 401
    assert stats.rejected_by_reason == {"slow_body": 1, "dropped": 1, "auth": 1}


def test_a_body_still_arriving_when_the_learner_stops_serving_is_answered(tmp_path):
    """The learner stops its HTTP server (``AppRunner.cleanup``) while a request's body is half sent:
    aiohttp dropped the rest of the body once shutdown began, so the handler waited out the body
    timeout and the peer got nothing for 30 s (a worker's 2 MiB submission, seen in CI). Now the body
    still arrives, the peer gets its answer and the server stops at once."""
    register = json.dumps({"usd_per_hour": -1.0}).encode() + b" " * 3000  # under its 4 KiB, then 422

    async def in_flight(port: int, runner: Any, request: bytes) -> tuple[int, str, float]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        half = len(request) // 2
        writer.write(request[:half])
        await writer.drain()
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        stopping = asyncio.ensure_future(runner.cleanup())
        await asyncio.sleep(0.2)  # the shutdown has begun: connections marked closing
        try:
            writer.write(request[half:])
            await writer.drain()
            data = await asyncio.wait_for(reader.read(), 10.0)
        except ConnectionResetError:  # answered and closed before the client finished writing
            data = b"0 0\r\n\r\n" + json.dumps({"error": "reset"}).encode()
        await asyncio.wait_for(stopping, 10.0)
        writer.close()
        head = data.partition(b"\r\n\r\n")
        return int(head[0].split()[1]), json.loads(head[2])["error"], time.monotonic() - t0

    async def main(node: Any) -> list[tuple[int, str, float]]:
        await node.snapshots.publish(0, b"blob")
        got = []
        join = f"Authorization: Bearer {TOKEN}"
        for request in (post("/v1/register", register, join), post("/v1/heartbeat", b"x" * (2 << 20))):
            runner, port = await node.routes.serve("127.0.0.1", 0)
            got.append(await in_flight(port, runner, request))
        return got

    node = make_node(tmp_path, "security.body_timeout_s=5", "runtime.max_request_mb=1")
    try:
        (reg, big) = asyncio.run(main(node))
    finally:
        node.store.close()
    assert reg[:2] == (422, "schema")  # answered, not timed out
    # refused (no credential: 401) before its end arrived: the stopping server does not linger to read
    # the rest, so the peer sees the answer or, if it was still writing, a reset connection (never a
    # silent one)
    assert big[:2] in {(401, "auth"), (0, "reset")}
    assert reg[2] < 3.0 and big[2] < 3.0  # and the server stopped without waiting out the body timeout


# ---- 5. the price floor --------------------------------------------------------------------------------
def test_prices_below_the_floor_are_invalid_price(tmp_path):
    async def body(client: TestClient) -> list[tuple[int, str]]:
        out = []
        for price in (1e-300, 5e-324, 0.0099, 0.01):
            resp = await client.post("/v1/register", json={"usd_per_hour": price}, headers=JOIN)
            out.append((resp.status, (await resp.json()).get("error", "ok")))
        auth = await register(client)
        hb = {"rollouts": 0, "busy_s": 0.0, "installed_version": 0, "install_s": 1e308}
        resp = await client.post("/v1/heartbeat", json=hb, headers=auth)
        out.append((resp.status, (await resp.json()).get("error", "ok")))
        return out

    got, stats = run(body, make_node(tmp_path))
    assert got == [(422, "invalid_price")] * 3 + [(200, "ok"), (422, "schema")]
    assert stats.rejected_by_reason == {"invalid_price": 3, "schema": 1}
    assert HeartbeatRequest.model_fields["install_s"].metadata  # the bound lives in the protocol


# ---- 6. registration slots -----------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def _registry(tmp_path: Any, clock: Clock, slots: int = 2, idle: float = 100.0) -> WorkerRegistry:
    return WorkerRegistry(tmp_path, TOKEN, clock, max_workers=slots, slot_idle_s=idle)


def _join(reg: WorkerRegistry, name: str) -> tuple[Any, str]:
    assert not reg.full, f"no slot for {name}"
    return reg.register(RegisterRequest(name=name, usd_per_hour=1.0))


def test_a_quarantined_identity_frees_its_slot_slot_idle_s_after_the_catch(tmp_path):
    """Before: quarantined identities held their slots forever, so one token holder that got caught
    twice locked every replacement out. Now the slot frees slot_idle_s after the quarantine, and the
    time is persisted: a restarted learner keeps it."""
    clock = Clock()
    reg = _registry(tmp_path, clock)
    a, _ = _join(reg, "a")
    b, b_cred = _join(reg, "b")
    reg.revoke(a.worker_id, "reward_mismatch: caught")
    reg.revoke(b.worker_id, "forged_generation: caught")
    assert reg.full and reg.slots_held() == 2
    clock.t += 99.0
    assert reg.full  # the catch is still fresh: its slot is held
    restarted = _registry(tmp_path, clock)
    assert restarted.load() == []  # nobody trusted to come back
    assert restarted.full and restarted[a.worker_id].quarantined_s == pytest.approx(clock.t - 99.0)
    clock.t += 2.0
    assert not restarted.full and restarted.slots_held() == 0
    assert restarted.authenticate(b_cred).quarantined  # still refused as quarantined, not retired
    _join(restarted, "replacement")


def test_a_silent_identity_is_retired_and_frees_its_slot(tmp_path):
    """A trusted identity not heard from within slot_idle_s is retired: its slot frees, its credential
    opens neither the API (the route answers 403 retired) nor the broadcast, and a restart keeps it
    retired; an identity heard from keeps its slot."""
    clock = Clock()
    reg = _registry(tmp_path, clock)
    silent, silent_cred = _join(reg, "silent")
    alive, alive_cred = _join(reg, "alive")
    assert reg.full
    for _ in range(3):
        clock.t += 60.0
        assert reg.authenticate(alive_cred) is alive  # heard from every minute
    assert not reg.full  # 180 s of silence > 100 s: retired
    rec = reg.authenticate(silent_cred)
    assert rec is silent and rec.retired_s is not None and not rec.trusted
    assert not reg.may_join(silent.worker_id, silent_cred)
    assert reg.may_join(alive.worker_id, alive_cred)
    assert silent.worker_id not in reg.seen_within(1e9)
    restarted = _registry(tmp_path, clock)
    assert [r.worker_id for r in restarted.load()] == [alive.worker_id]  # what the pool is offered
    assert not restarted[silent.worker_id].trusted


def test_identities_restored_after_a_restart_get_slot_idle_s_to_come_back(tmp_path):
    """The learner's downtime is not a worker's silence: after a restart 10 x slot_idle_s later, the
    restored identities hold their slots for slot_idle_s more, then the silent ones are retired."""
    clock = Clock()
    reg = _registry(tmp_path, clock)
    a, a_cred = _join(reg, "a")
    b, _ = _join(reg, "b")
    clock.t += 1000.0  # the learner was down
    restarted = _registry(tmp_path, clock)
    assert len(restarted.load()) == 2 and restarted.full
    clock.t += 90.0
    assert restarted.authenticate(a_cred).trusted  # a came back in time
    assert restarted.full
    clock.t += 20.0  # b did not
    assert not restarted.full and restarted.slots_held() == 1
    assert not restarted[b.worker_id].trusted and restarted[a.worker_id].trusted


def test_the_api_refuses_a_retired_credential_and_lets_a_replacement_in(tmp_path):
    clock = Clock()
    node = make_node(tmp_path, "security.max_workers=1", "security.slot_idle_s=100")
    node.registry.clock = clock

    async def body(client: TestClient) -> list[tuple[int, str]]:
        first = await register(client, "first")
        hb = {"rollouts": 0, "busy_s": 0.0, "installed_version": 0}
        out = []
        for _ in range(2):
            resp = await client.post("/v1/register", json={"usd_per_hour": 1.0}, headers=JOIN)
            out.append((resp.status, (await resp.json()).get("error", "ok")))
            clock.t += 101.0
        resp = await client.post("/v1/heartbeat", json=hb, headers=first)
        out.append((resp.status, (await resp.json()).get("error", "ok")))
        return out

    got, stats = run(body, node)
    # the cap, then (first silent past slot_idle_s) a replacement; first's credential is retired
    assert got == [(403, "registration_cap"), (200, "ok"), (403, "retired")]
    assert stats.rejected_by_reason == {"registration_cap": 1, "retired": 1}


def test_the_join_tokens_identity_budget_is_finite_and_survives_a_restart(tmp_path):
    """One slot, an identity budget of 3: identities that are retired (or quarantined) free their slot but
    not their place in the budget, so re-registering does not reset what a token holder may do: the
    fourth registration is refused (identity_budget) with the slot free, and after a restart too."""
    clock = Clock()
    node = make_node(
        tmp_path, "security.max_workers=1", "security.slot_idle_s=100", "security.max_identities=3"
    )
    node.registry.clock = clock

    async def body(client: TestClient) -> list[tuple[int, str]]:
        out = []
        for _ in range(4):
            resp = await client.post("/v1/register", json={"usd_per_hour": 1.0}, headers=JOIN)
            out.append((resp.status, (await resp.json()).get("error", "ok")))
            clock.t += 101.0  # silent past slot_idle_s: retired, its slot free
        return out

    got, stats = run(body, node)
    assert got == [(200, "ok"), (200, "ok"), (200, "ok"), (403, "identity_budget")]
    assert stats.rejected_by_reason == {"identity_budget": 1}
    restarted = WorkerRegistry(tmp_path, TOKEN, clock, max_workers=1, slot_idle_s=100.0, max_identities=3)
    restarted.load()
    assert restarted.spent and not restarted.full


# ---- 7. the request rate -------------------------------------------------------------------------------
def test_the_token_bucket_by_hand():
    t = [0.0]
    rate = RequestRate(rate=5.0, burst=10.0, clock=lambda: t[0])
    assert [rate.take("a") for _ in range(10)] == [0.0] * 10  # the burst: 2 x 5 requests/s
    assert rate.take("a") == pytest.approx(0.2)  # empty: one token in 1/5 s
    assert rate.take("b") == 0.0  # another identity has its own bucket
    t[0] += 0.1
    assert rate.take("a") == pytest.approx(0.1)  # half a token there
    t[0] += 0.1
    assert rate.take("a") == 0.0
    t[0] += 100.0
    assert [rate.take("a") for _ in range(11)].count(0.0) == 10  # refilled to the burst, no further
    rate.forget("a")
    assert len(rate) == 1


def test_full_buckets_are_swept_so_the_table_stays_bounded():
    t = [0.0]
    rate = RequestRate(rate=5.0, burst=10.0, clock=lambda: t[0])
    rate.SWEEP_EVERY = 100
    for i in range(99):
        rate.take(f"id{i}")  # 99 identities, one request each
    assert len(rate) == 99
    t[0] += 0.2  # one token back each: 10 - 1 + 1 = full again
    rate.take("late")
    assert len(rate) == 1  # only the bucket just used is left


def test_a_request_flood_gets_429_rate_limited_with_retry_after(tmp_path):
    t = [0.0]
    node = make_node(tmp_path, "security.max_requests_per_s=5")
    node.routes.rate.clock = lambda: t[0]  # frozen: no token comes back during the flood

    async def body(client: TestClient) -> tuple[list[int], dict[str, Any], str | None, int, int]:
        flooder, other = await register(client, "flooder"), await register(client, "other")
        hb = {"rollouts": 0, "busy_s": 0.0, "installed_version": 0}

        async def beat(auth: dict[str, str]) -> int:
            return (await client.post("/v1/heartbeat", json=hb, headers=auth)).status

        statuses = [await beat(flooder) for _ in range(25)]
        refused = await client.get("/v1/model", headers=flooder)
        reply, retry = await refused.json(), refused.headers.get("Retry-After")
        other_ok = await beat(other)
        t[0] += 0.2
        later = await beat(flooder)
        return statuses, reply, retry, other_ok, later

    (statuses, reply, retry, other_ok, later), stats = run(body, node)
    assert statuses == [200] * 10 + [429] * 15  # a burst of 2 x 5, then nothing
    assert reply["error"] == "rate_limited" and "max_requests_per_s" in reply["detail"] and retry == "1"
    assert other_ok == 200 and later == 200  # a flood costs only the flooder
    assert stats.rejected_by_reason == {"rate_limited": 16}


# ---- 8. the snapshot byte budget -----------------------------------------------------------------------
def test_the_byte_budget_by_hand_and_the_gate_uses_it():
    budget = ByteBudget()
    # 1000 bytes in chunks of 100: 3 x 1000 + 4 x 100 = 3400 bytes per member and version
    assert budget.limit(1000, 100) == SERVE_BUDGET * 1000 + BUDGET_SLACK_CHUNKS * 100 == 3400
    assert [budget.book("m", 1, 1000, 1000, 100) for _ in range(4)] == [True, True, True, False]
    assert budget.sent("m", 1) == 3000 and budget.book("m", 1, 400, 1000, 100)  # exactly the limit
    assert not budget.book("m", 1, 1, 1000, 100) and budget.book("m", 2, 1, 1000, 100)
    budget.forget_before(2)
    assert budget.sent("m", 1) == 0 and len(budget) == 1
    gate = Gate(new_signing_key(), None, ServeCounters())
    assert isinstance(gate.budget, ByteBudget)  # one definition of the rule, for both planes


def test_snapshot_pulls_past_the_budget_are_429_over_budget(tmp_path):
    """Before: no budget (one identity pulled GBs a second). Now each link's bytes are booked to
    (identity, link version) under the broadcast port's rule; past it 429 over_budget before a byte
    is streamed; another identity, or a newer version, has its own budget; old versions are forgotten."""
    blob = bytes(range(256)) * 256  # 64 KiB; the test node's chunks are 1 KiB: 3 x 64 + 4 KiB per version
    node = make_node(tmp_path)

    async def body(client: TestClient) -> tuple[list[int], dict[str, Any], int, list[int]]:
        await node.snapshots.publish(1, blob)
        hog, other = await register(client, "hog"), await register(client, "other")
        pulls = []
        for _ in range(5):
            resp = await client.get("/v1/snapshot?have=-1", headers=hog)
            pulls.append(resp.status)
            last = await resp.read()
        other_status = (await client.get("/v1/snapshot?have=-1", headers=other)).status
        await node.snapshots.publish(2, blob[::-1])  # a new anchor: a new budget
        after = [(await client.get("/v1/snapshot?have=-1", headers=hog)).status for _ in range(4)]
        return pulls, json.loads(last), other_status, after

    (pulls, refusal, other_status, after), stats = run(body, node)
    assert pulls == [200, 200, 200, 429, 429]
    assert refusal["error"] == "over_budget" and "v1" in refusal["detail"]
    assert other_status == 200 and after == [200, 200, 200, 429]
    assert stats.rejected_by_reason == {"over_budget": 3}
    assert len(node.routes.budget) == 1  # (hog, v2): v1 is no longer served, its entries are forgotten


# ---- 9. the perimeter: before anyone is known --------------------------------------------------------
def test_requests_no_identity_vouches_for_pass_a_bucket_per_address(tmp_path):
    """Registrations and requests with a missing or bad credential take from their address's bucket
    (security.perimeter.requests_per_s, request_burst): past it 429 rate_limited with Retry-After and
    the connection closed; a trusted identity's requests are not charged to it."""
    node = make_node(
        tmp_path, "security.perimeter.requests_per_s=0.001", "security.perimeter.request_burst=4"
    )

    async def body(client: TestClient) -> tuple[list[int], int, str | None]:
        auth = await register(client)  # the registration itself takes one
        hb = {"rollouts": 0, "busy_s": 0.0, "installed_version": 0}
        wrong = {"Authorization": "Bearer nope"}
        statuses = [(await client.post("/v1/heartbeat", json=hb, headers=wrong)).status for _ in range(5)]
        member = await client.post("/v1/heartbeat", json=hb, headers=auth)
        refused = await client.post("/v1/register", json={"usd_per_hour": 1.0}, headers=JOIN)
        return statuses, member.status, refused.headers.get("Retry-After")

    (statuses, member, retry), stats = run(body, node)
    assert statuses == [403, 403, 403, 429, 429] and member == 200 and int(retry) >= 1
    assert stats.rejected_by_reason == {"auth": 3, "rate_limited": 3}


def test_a_registration_is_refused_before_its_body_is_read(tmp_path):
    """A wrong join token with an 8 MiB body announced (a few bytes sent): 403 at once, the connection
    closed, nothing waited for (before: the body was read and parsed to find the token in it)."""

    async def go(port: int) -> list[tuple[int, float]]:
        out = []
        for token in ("nope", TOKEN):  # the right token: the body is read only up to 4 KiB (413)
            head = (
                f"POST /v1/register HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                f"Content-Length: {8 << 20}\r\n\r\n"
            )
            t0 = time.monotonic()
            status, _, _ = await raw(port, head.encode() + b'{"usd_per_hour": 1')
            out.append((status, time.monotonic() - t0))
        return out

    got, stats = serve(make_node(tmp_path, "security.body_timeout_s=10"), go)
    assert [s for s, _ in got] == [403, 413] and all(took < 2.0 for _, took in got)
    assert stats.rejected_by_reason == {"auth": 1, "oversized": 1}


def test_the_join_tokens_copies_by_hand():
    from echo2.runtime.http import CopyBudget

    t = [0.0]
    budget = CopyBudget(burst=2, per_hour=4, clock=lambda: t[0])
    assert budget.take("base", 100, 100) == 0.0 and budget.take("base", 100, 100) == 0.0  # the burst
    assert budget.take("base", 100, 100) == pytest.approx(900.0)  # a copy every 3600 / 4 s
    assert budget.take("base", 10, 100) == pytest.approx(90.0)  # a tenth of a copy: a tenth of the wait
    assert budget.take("model", 100, 100) == 0.0  # each kind of object has its own
    t[0] += 900.0
    assert budget.take("base", 100, 100) == 0.0 and budget.level("base") == pytest.approx(0.0)
    t[0] += 1e6
    assert budget.level("base") == 2.0  # refilled to the burst, no further


def test_every_byte_serving_route_is_bounded_per_token_across_identities(tmp_path):
    """Sybils of one join token share its copies: with a burst of 3 copies (max_workers = 3) and 1 an
    hour, three identities get the model files once each, then a fourth fetch is 429 token_budget with
    the seconds until a copy is back (the client waits that out); one identity is also held to
    SERVE_BUDGET copies of its own (429 over_budget, which stands)."""
    node = make_node(tmp_path, "security.max_workers=3", "security.token_copies_per_hour=1")

    async def body(client: TestClient) -> list[tuple[int, str, int]]:
        auths = [await register(client, n) for n in "abc"]
        out = []
        for auth, path in [(a, "/v1/model") for a in [*auths, auths[0]]] + [(auths[1], "/v1/version")] * 4:
            resp = await client.get(path, headers=auth)
            error = (await resp.json()).get("error", "ok")
            out.append((resp.status, error, int(resp.headers.get("Retry-After", 0))))
        return out

    got, stats = run(body, node)
    assert [g[:2] for g in got[:4]] == [(200, "ok")] * 3 + [(429, "token_budget")]
    assert 3500 < got[3][2] <= 3600  # a whole copy at 1 an hour
    assert [g[:2] for g in got[4:]] == [(200, "ok")] * 3 + [(429, "over_budget")]
    assert stats.rejected_by_reason == {"token_budget": 1, "over_budget": 1}


def test_a_caught_identity_knocking_again_is_counted_every_time_and_logged_now_and_then(tmp_path, caplog):
    """Before: every request with a quarantined credential wrote a WARNING (seen live: a caught attacker's
    heartbeats, one line a second, for as long as it kept sending them). Its catch is logged once where
    it happens; what it sends after is counted, each refusal (the perimeter's rate limit takes over once
    its address's bucket is empty: a revoked credential vouches for nothing), and logged at most every
    LOG_EVERY_S a reason."""
    node = make_node(tmp_path)

    async def body(client: TestClient) -> list[str]:
        liar = await register(client, "liar")
        (wid,) = [r.worker_id for r in node.registry]
        node.registry.revoke(wid, "forged_generation: caught")
        hb = {"rollouts": 0, "busy_s": 0.0, "installed_version": 0}
        out = []
        for _ in range(30):
            resp = await client.post("/v1/heartbeat", json=hb, headers=liar)
            out.append(f"{resp.status} {(await resp.json())['error']}")
        return out

    with caplog.at_level("WARNING", logger="echo2.runtime.routes"):
        got, stats = run(body, node)
    assert set(got) <= {"403 quarantined", "429 rate_limited"} and got[0] == "403 quarantined"
    assert stats.rejected_by_reason == {
        "quarantined": got.count("403 quarantined"),
        "rate_limited": got.count("429 rate_limited"),
    }
    assert got.count("403 quarantined") > 1  # more than one reached the route: the sampling is what is tested
    lines = [r.getMessage() for r in caplog.records if r.name == "echo2.runtime.routes"]
    assert len([m for m in lines if "quarantined" in m]) == 1, lines
