"""The learner node's HTTP API (runtime/routes.py) over its real parts (registry, pool, lease broker,
intake, snapshots) and a real store, through a real aiohttp server."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from echo2.broadcast.factory import get_strategy, open_publisher
from echo2.config import load_config
from echo2.data.store import StoreStats, TrajectoryStore
from echo2.protocol import LoraSettings
from echo2.runtime.members import WorkerRegistry
from echo2.runtime.node import assemble, worker_settings
from echo2.runtime.routes import Identity
from echo2.tasks.registry import build_task
from echo2.weights.delta import weights_digest
from echo2.weights.manifest import new_signing_key

TOKEN = "join-token-for-tests-0123456789"
JOIN = {"Authorization": f"Bearer {TOKEN}"}  # what registration sends: the join token as its bearer
VOCAB = 100


def make_node(tmp_path, *overrides: str, verifier: Any = None, frozen: dict | None = None) -> SimpleNamespace:
    """The parts of a learner node wired as ``runtime/learner.py`` wires them (in-memory broadcast,
    no model); ``node.v`` is the learner version the parts read."""
    cfg = load_config(
        overrides=[
            "batch.prompts=4",
            "batch.group_size=2",
            "runtime.lease_prompts=2",
            "sampling.max_new_tokens=4",
            "staleness.S=1",
            "security.probation_prompts=2",  # full leases and no shared cap: probation is test_leases.py's
            "security.probation_share=1.0",
            *overrides,
        ]
    )
    n = SimpleNamespace(cfg=cfg, v=0)
    n.store = TrajectoryStore(tmp_path / "store.sqlite", cfg.staleness.S, cfg.batch.group_size)
    key = new_signing_key()
    sec = cfg.security
    registry = WorkerRegistry(
        tmp_path, TOKEN, time.time, sec.max_workers, sec.slot_idle_s, sec.max_identities
    )
    publisher = open_publisher("memory", key, get_strategy("star-limited"), 1 << 10)
    lora = LoraSettings(scale=2.0, base_digest=weights_digest(frozen)) if frozen is not None else None
    identity = Identity(
        worker_settings(cfg, lora=lora), key.verifier().to_text(), ("127.0.0.1", 1), {"config.json": "{}"}
    )
    n.task = build_task(cfg.task, 0)
    parts = assemble(
        cfg, registry, n.store, n.task, publisher, identity, VOCAB, lambda: n.v, time.time, verifier,
        frozen=frozen,
    )  # fmt: skip
    n.__dict__.update(vars(parts))
    return n


def run(coro_fn, node: SimpleNamespace) -> tuple[Any, StoreStats]:
    """Serve the node on loopback with version 0 published, run the client coroutine; its result and
    the store's final stats."""

    async def main() -> Any:
        await node.snapshots.publish(0, b"blob")
        async with TestClient(TestServer(node.routes.app())) as client:
            return await coro_fn(client)

    try:
        return asyncio.run(main()), node.store.stats()
    finally:
        node.store.close()


async def register(client: TestClient, name: str = "w") -> dict[str, str]:
    resp = await client.post("/v1/register", headers=JOIN, json={"name": name, "usd_per_hour": 0.35})
    assert resp.status == 200, await resp.text()
    data = await resp.json()
    return {"Authorization": f"Bearer {data['credential']}"}


def payload(lease: dict[str, Any], version: int = 0, token: int = 5) -> dict[str, Any]:
    return {
        "lease_id": lease["lease_id"],
        "policy_version": version,
        "groups": [
            {
                "prompt_id": p["prompt_id"],
                "samples": [
                    {
                        "prompt_ids": [3, 4],
                        "completion_ids": [token, 1],
                        "sampler_logprobs": [-0.5, -0.1],
                        "reward": float(j),
                    }
                    for j in range(lease["group_size"])
                ],
            }
            for p in lease["prompts"]
        ],
    }


async def lease(client: TestClient, auth: dict[str, str], installed: int = 0) -> dict[str, Any]:
    resp = await client.post(
        "/v1/lease", json={"max_prompts": 2, "installed_version": installed}, headers=auth
    )
    assert resp.status == 200
    return await resp.json()


def test_register_needs_the_join_token(tmp_path):
    async def body(client):
        missing = await client.post("/v1/register", json={"name": "x"})
        wrong = await client.post(
            "/v1/register", json={"name": "x"}, headers={"Authorization": "Bearer nope"}
        )
        bad_price = await client.post("/v1/register", headers=JOIN, json={"name": "x", "usd_per_hour": -1})
        ok = await client.post("/v1/register", headers=JOIN, json={"name": "x", "usd_per_hour": 0.35})
        return missing.status, wrong.status, bad_price.status, ok.status, await ok.json()

    node = make_node(tmp_path)
    (missing, wrong, bad_price, ok, data), _ = run(body, node)
    assert (missing, wrong, bad_price, ok) == (401, 403, 422, 200)
    assert data["credential"] and data["settings"]["group_size"] == 2
    assert "grpo" not in data["settings"] and "runtime" not in data["settings"]  # only what a worker needs
    assert json.loads((tmp_path / "workers.json").read_text())[0]["worker_id"] == data["worker_id"]
    assert data["credential"] not in (tmp_path / "workers.json").read_text()  # only its hash is kept


def test_every_worker_endpoint_needs_a_credential(tmp_path):
    async def body(client):
        out = []
        posts = [("POST", f"/v1/{p}") for p in ("heartbeat", "lease", "submit")]
        gets = [("GET", f"/v1/{p}") for p in ("version", "snapshot", "model")]
        for method, path in posts + gets:
            none = await client.request(method, path, json={})
            bad = await client.request(method, path, json={}, headers={"Authorization": "Bearer forged"})
            out.append((path, none.status, bad.status))
        return out

    node = make_node(tmp_path)
    results, stats = run(body, node)
    for path, none, bad in results:
        assert (none, bad) == (401, 403), path
    assert stats.rejected_by_reason["auth"] == 12


def test_lease_submit_and_rejections_are_counted(tmp_path):
    async def body(client):
        auth = await register(client)
        le = await lease(client, auth)
        statuses = {}
        statuses["future"] = (
            await client.post("/v1/submit", json=payload(le, version=7), headers=auth)
        ).status
        statuses["vocab"] = (
            await client.post("/v1/submit", json=payload(le, token=VOCAB), headers=auth)
        ).status
        statuses["not_json"] = (await client.post("/v1/submit", data=b"{oops", headers=auth)).status
        statuses["not_object"] = (await client.post("/v1/submit", json=[1, 2], headers=auth)).status
        ok = await client.post("/v1/submit", json=payload(le), headers=auth)
        statuses["ok"] = ok.status
        statuses["replay"] = (await client.post("/v1/submit", json=payload(le), headers=auth)).status
        reply = await ok.json()
        return statuses, reply

    node = make_node(tmp_path)
    (statuses, reply), stats = run(body, node)
    assert statuses == {
        "future": 422,
        "vocab": 422,
        "not_json": 400,
        "not_object": 400,
        "ok": 200,
        "replay": 409,
    }
    assert reply == {
        "admitted": 4,
        "dropped_stale": 0,
        "pending_check": 0,
        "next_lease": None,
        "next_lease_error": None,
    }
    by = stats.rejected_by_reason
    assert by["future_version"] == 1 and by["token_range"] == 1 and by["malformed"] == 2 and by["replay"] == 1


def test_oversized_body_is_413_and_the_learner_keeps_serving(tmp_path):
    async def body(client):
        auth = await register(client)
        big = await client.post("/v1/submit", data=b"x" * (2 << 20), headers=auth)
        nowhere = await client.post("/v1/nowhere", json={}, headers=auth)
        le = await lease(client, auth)
        ok = await client.post("/v1/submit", json=payload(le), headers=auth)
        return (big.status, nowhere.status, ok.status), await big.json(), await nowhere.json()

    node = make_node(tmp_path, "runtime.max_request_mb=1")
    (statuses, big, nowhere), stats = run(body, node)
    assert statuses == (413, 404, 200)
    assert big["error"] == "oversized" and "1048576" in big["detail"]  # aiohttp's refusal, in our JSON
    assert nowhere["error"] == "not_found"
    assert stats.rejected_by_reason["oversized"] == 1 and stats.rejected_by_reason["not_found"] == 1


def test_other_workers_lease_is_forbidden(tmp_path):
    async def body(client):
        a, b = await register(client, "a"), await register(client, "b")
        le = await lease(client, a)
        return (await client.post("/v1/submit", json=payload(le), headers=b)).status

    assert run(body, make_node(tmp_path))[0] == 403


def test_lease_caps_work_in_flight_and_refuses_stale_weights(tmp_path):
    # R = 4 prompts x 2 = 8 rollouts; cap = min(max_inflight_batches 2, S + 1 = 2) * R = 16 rollouts,
    # and a lease of 2 prompts x 2 is 4 rollouts. Two workers return a lease each (8 buffered), the
    # first then holds two more (16 in flight): the next lease would pass the cap
    async def body(client):
        auths = [await register(client, f"w{i}") for i in range(2)]
        for auth in auths:  # past probation (its leases have an allowance of their own)
            resp = await client.post("/v1/submit", json=payload(await lease(client, auth)), headers=auth)
            assert resp.status == 200, await resp.text()
        leases = [await lease(client, auths[0]) for _ in range(2)] + [await lease(client, auths[1])]
        node.v = 3  # learner moved on: version 1 weights are older than v_t - S = 2
        stale = await lease(client, auths[0], installed=1)
        return leases, stale

    node = make_node(tmp_path)
    (leases, stale), stats = run(body, node)
    assert all(le["kind"] == "grant" for le in leases[:2]) and stats.leases_open == 2
    assert leases[2] == {
        "kind": "refusal",
        "reason": "buffer_full",
        "retry_after_s": 0.25,
        "min_version": None,
    }
    assert stale["reason"] == "stale_weights" and stale["min_version"] == 2


def test_one_worker_cannot_hold_more_than_its_share_of_leases(tmp_path):
    """A worker holds one open lease until it returns one, then one more per lease returned, up to
    runtime.max_leases_per_worker."""

    async def body(client):
        greedy, other = await register(client, "greedy"), await register(client, "other")
        hoard = [await lease(client, greedy) for _ in range(2)]
        resp = await client.post("/v1/submit", json=payload(hoard[0]), headers=greedy)
        assert resp.status == 200, await resp.text()
        hoard += [await lease(client, greedy) for _ in range(3)]
        return hoard, await lease(client, other)

    node = make_node(tmp_path, "runtime.max_leases_per_worker=2")
    (hoard, other), stats = run(body, node)
    assert [le["kind"] for le in hoard] == ["grant", "refusal", "grant", "grant", "refusal"]
    assert hoard[1]["reason"] == hoard[4]["reason"] == "too_many_leases"
    assert other["kind"] == "grant" and stats.leases_open == 3


def test_heartbeat_validates_and_reports_activity(tmp_path):
    async def body(client):
        auth = await register(client)
        hb = {"rollouts": 8, "busy_s": 0.5, "installed_version": 0, "install_s": 0.25}
        good = await client.post("/v1/heartbeat", json=hb, headers=auth)
        future = await client.post(
            "/v1/heartbeat", json={"rollouts": 8, "busy_s": 0.5, "installed_version": 9}, headers=auth
        )
        garbage = await client.post("/v1/heartbeat", json={"rollouts": -1, "busy_s": "x"}, headers=auth)
        return await good.json(), future.status, garbage.status

    node = make_node(tmp_path)
    (good, future, garbage), _ = run(body, node)
    assert good["active"] is True and good["finished"] is False
    assert good["heartbeat_s"] == 1.0  # a fleet of one: the configured period
    assert (future, garbage) == (422, 422)
    rec = next(iter(node.registry))
    wid = rec.worker_id
    assert rec.install_s == 0.25  # what the worker's last install took (a metric, trusted for nothing)
    # the heartbeat's claim of 8 rollouts is not believed: no rollout was admitted, it stays on
    # probation, no candidate of the controller, with no rate
    assert wid in node.pool.probation and wid not in node.pool.controller.known()
    assert node.pool.rate(wid) == 0.0


BAD_BODIES = [  # endpoint, body, (field named first in the detail, what it says of it)
    ("register", {"usd_per_hour": 1.0, "name": ""}, ("name", "at least 1 character")),
    ("register", {"usd_per_hour": 0}, ("usd_per_hour", "greater than 0")),
    ("register", {"usd_per_hour": True}, ("usd_per_hour", "a valid number")),
    (
        "register",
        {"usd_per_hour": 1.0, "rollouts_per_s": 0},
        ("rollouts_per_s", "greater than 0"),
    ),
    (
        "register",
        {"usd_per_hour": 1.0, "hardware": "x" * 129},
        ("hardware", "at most 128 characters"),
    ),
    (
        "register",
        {"usd_per_hour": 1.0, "gpu": "H100"},
        ("gpu", "Extra inputs are not permitted"),
    ),
    ("heartbeat", {"rollouts": -1, "busy_s": 0.5, "installed_version": 0}, ("rollouts", "greater than")),
    ("heartbeat", {"rollouts": True, "busy_s": 0.5, "installed_version": 0}, ("rollouts", "a valid integer")),
    ("heartbeat", {"rollouts": 8, "busy_s": "x", "installed_version": 0}, ("busy_s", "a valid number")),
    ("heartbeat", {"rollouts": 8, "busy_s": 0.5}, ("installed_version", "Field required")),
    (
        "heartbeat",
        {"rollouts": 8, "busy_s": 0.5, "installed_version": 0, "install_s": -1},
        ("install_s", "greater than or equal to 0"),
    ),
    ("lease", {"max_prompts": 0, "installed_version": 0}, ("max_prompts", "greater than or equal to 1")),
    ("lease", {"max_prompts": 2, "installed_version": 0.5}, ("installed_version", "a valid integer")),
    ("lease", {"max_prompts": 2, "installed_version": -2}, ("installed_version", "equal to -1")),
]


@pytest.mark.parametrize(("endpoint", "bad", "detail"), BAD_BODIES)
def test_bad_bodies_get_422_naming_the_field(tmp_path, endpoint, bad, detail):
    async def body(client):
        auth = await register(client)
        resp = await client.post(
            f"/v1/{endpoint}", json=bad, headers=JOIN if endpoint == "register" else auth
        )
        ok = await client.post("/v1/lease", json={"max_prompts": 1, "installed_version": 0}, headers=auth)
        return resp.status, await resp.json(), ok.status

    node = make_node(tmp_path)
    (status, reply, ok), stats = run(body, node)
    assert status == 422 and reply["error"] == "schema"
    field, says = detail
    assert reply["detail"].startswith(f"{field}: ") and says in reply["detail"], reply["detail"]
    assert stats.rejected_by_reason["schema"] == 1 and ok == 200  # counted, and the learner keeps serving
    assert len(node.registry) == 1  # a refused registration enrols nobody


def test_a_bad_next_lease_keeps_the_submission(tmp_path):
    async def body(client):
        auth = await register(client)
        le = await lease(client, auth)
        bad = {**payload(le), "next_lease": {"max_prompts": "two", "installed_version": 0}}
        first = await (await client.post("/v1/submit", json=bad, headers=auth)).json()
        le2 = await lease(client, auth)
        good = {**payload(le2), "next_lease": {"max_prompts": 2, "installed_version": 0}}
        second = await (await client.post("/v1/submit", json=good, headers=auth)).json()
        return first, second

    node = make_node(tmp_path)
    (first, second), stats = run(body, node)
    assert (
        first["admitted"] == 4
        and first["next_lease"] is None
        and first["next_lease_error"]["error"] == "schema"
    )
    assert first["next_lease_error"]["detail"].startswith(
        "next_lease: max_prompts: Input should be a valid int"
    )
    assert second["admitted"] == 4 and second["next_lease"]["kind"] == "grant"
    assert stats.rejected_by_reason["schema"] == 1 and stats.admitted == 8


def test_registry_survives_a_restart(tmp_path):
    async def first(client):
        return await register(client)

    auth, _ = run(first, make_node(tmp_path))

    async def second(client):
        return (
            await client.post("/v1/lease", json={"max_prompts": 1, "installed_version": 0}, headers=auth)
        ).status

    assert run(second, make_node(tmp_path))[0] == 200


def test_every_channel_writes_the_installed_version_through_the_registry(tmp_path):
    """A granted lease records the version it was asked for; a refused lease records nothing; a
    heartbeat says what the worker serves now, older or not (after a rollback it re-fetched)."""

    async def body(client):
        auth = await register(client)
        rec = next(iter(node.registry))
        first = rec.installed_version
        refused = await lease(client, auth, installed=-1)  # stale weights: refused, nothing recorded
        after_refusal = rec.installed_version
        granted = await lease(client, auth, installed=0)
        after_grant = rec.installed_version
        hb = {"rollouts": 0, "busy_s": 0.0, "installed_version": -1, "install_s": 0.5}
        resp = await client.post("/v1/heartbeat", json=hb, headers=auth)
        assert resp.status == 200
        return first, refused["kind"], after_refusal, granted["kind"], after_grant, rec

    node = make_node(tmp_path)
    (first, refused, after_refusal, granted, after_grant, rec), _ = run(body, node)
    assert (first, refused, after_refusal) == (-1, "refusal", -1)
    assert (granted, after_grant) == ("grant", 0)
    assert rec.installed_version == -1 and rec.install_s == 0.5  # its own word on what it serves


def test_broadcast_membership_needs_the_workers_own_credential(tmp_path):
    async def body(client):
        resp = await client.post("/v1/register", headers=JOIN, json={"name": "a", "usd_per_hour": 1.0})
        return await resp.json()

    node = make_node(tmp_path)
    reg, _ = run(body, node)
    wid, cred, may_join = reg["worker_id"], reg["credential"], node.registry.may_join
    assert may_join(wid, cred)
    assert not may_join(wid, None) and not may_join(wid, "forged")
    assert not may_join("someone-else", cred)  # a credential is bound to its worker id


def test_the_protocol_models_parse_every_reply_the_routes_send(tmp_path):
    """The worker's typed client parses exactly what the server sends: one protocol, both ends."""
    from echo2.protocol import (
        LEASE_REPLY,
        HeartbeatReply,
        ModelReply,
        RegisterReply,
        SubmitReply,
        VersionReply,
    )

    async def body(client):
        reg = await client.post("/v1/register", headers=JOIN, json={"name": "w", "usd_per_hour": 1.0})
        parsed = RegisterReply.model_validate_json(await reg.read())
        auth = {"Authorization": f"Bearer {parsed.credential}"}
        hb = await client.post(
            "/v1/heartbeat", json={"rollouts": 0, "busy_s": 0.0, "installed_version": 0}, headers=auth
        )
        le = await client.post("/v1/lease", json={"max_prompts": 2, "installed_version": 0}, headers=auth)
        grant = LEASE_REPLY.validate_json(await le.read())
        sub = await client.post("/v1/submit", json=payload(json.loads(grant.model_dump_json())), headers=auth)
        ver = await client.get("/v1/version", headers=auth)
        model = await client.get("/v1/model", headers=auth)
        return (
            parsed,
            HeartbeatReply.model_validate_json(await hb.read()),
            grant,
            SubmitReply.model_validate_json(await sub.read()),
            VersionReply.model_validate_json(await ver.read()),
            ModelReply.model_validate_json(await model.read()),
        )

    (reg, hb, grant, sub, ver, model), _ = run(body, make_node(tmp_path))
    assert (
        reg.settings.group_size == 2
        and reg.settings.lease_prompts == 2
        and hb.version == 0
        and hb.min_version == -1
    )
    assert grant.kind == "grant" and len(grant.prompts) == 2 and grant.prompts[0].text.endswith("=")
    assert sub.admitted == 4 and ver.version == 0 and ver.manifest["version"] == 0
    assert model.files == {"config.json": "{}"}


def test_snapshot_route_serves_the_chain_from_the_callers_version(tmp_path):
    from echo2.weights.chain import decode_chain

    node = make_node(tmp_path)

    async def go(client: TestClient) -> None:
        auth = await register(client)
        await node.snapshots.publish(1, b"newer blob")  # raw bytes: a full snapshot, the chain restarts
        for have in ("-1", "0"):
            resp = await client.get(f"/v1/snapshot?have={have}", headers=auth)
            assert resp.status == 200
            links = decode_chain(await resp.read())
            assert [(m["version"], bytes(b)) for m, b in links] == [(1, b"newer blob")]
        resp = await client.get("/v1/snapshot?have=1", headers=auth)
        assert decode_chain(await resp.read()) == []
        resp = await client.get("/v1/snapshot?have=latest", headers=auth)
        assert resp.status == 400 and "have" in (await resp.json())["detail"]

    run(go, node)


def test_prompt_tokens_and_rewards_are_checked_not_believed(tmp_path):
    """A lease carries no grading secret, so the learner grades every completion itself: a worker's
    claimed reward is never stored (a forged one is replaced by the task's grade), its prompt tokens must
    be the leased prompt's (a foreign prompt refuses the submission, counted), and a single-turn
    completion may carry no turn mask with 0s (it would train fewer tokens than the grade reads:
    evidence, the worker is quarantined)."""
    import json

    from echo2.models.embedded import build_tokenizer
    from echo2.models.policy import TextCodec
    from echo2.protocol import decode_group
    from echo2.tasks.verify import Verifier
    from echo2.types import Prompt

    codec = TextCodec(build_tokenizer(), False)
    task = build_task(load_config().task, 0)
    node = make_node(tmp_path, verifier=Verifier(codec, task, eos_id=1, max_new_tokens=4))

    def honest(lease: dict[str, Any], reward: float = 0.0) -> dict[str, Any]:
        body = payload(lease)
        for g, p in zip(body["groups"], lease["prompts"], strict=True):
            assert set(p) == {"prompt_id", "text", "meta"}  # no answer, nothing that grades
            ids = codec.encode_prompt(p["text"])
            for j, sample in enumerate(g["samples"]):
                completion = codec.tokenizer(str(j), add_special_tokens=False)["input_ids"] + [1]
                sample.update(
                    prompt_ids=ids, completion_ids=completion, sampler_logprobs=[-0.5] * len(completion)
                )
                sample["reward"] = reward  # what the worker claims: the learner does not read it
        return body

    async def go(client: TestClient) -> list[tuple[int, str]]:
        auth, other = await register(client), await register(client, "other")
        out = []
        first = await lease(client, auth)  # refused with a foreign prompt, then answered honestly
        for forge in ("prompt", None, "reward", "mask", "after"):
            le = (
                first
                if forge in ("prompt", None)
                else await lease(client, other if forge == "after" else auth)
            )
            body = honest(le, reward=1e6 if forge == "reward" else 0.0)
            if forge == "prompt":
                body["groups"][0]["samples"][1]["prompt_ids"] = [5, 6, 7]
            elif forge == "mask":  # the grade reads 2 tokens, the loss would train 1
                body["groups"][1]["samples"][0]["turn_mask"] = [1, 0]
            resp = await client.post("/v1/submit", json=body, headers=other if forge == "after" else auth)
            out.append((resp.status, (await resp.json()).get("error", "ok")))
        refused = await client.post(
            "/v1/lease", json={"max_prompts": 1, "installed_version": 0}, headers=auth
        )
        out.append((refused.status, (await refused.json())["error"]))
        return out

    got, stats = run(go, node)
    assert got == [
        (422, "prompt_mismatch"),
        (200, "ok"),
        (200, "ok"),  # a forged reward is not refused: it is not what is stored
        (422, "turn_mask"),
        (200, "ok"),
        (403, "quarantined"),
    ]
    assert stats.rejected_by_reason == {"prompt_mismatch": 1, "turn_mask": 1, "quarantined": 1}
    assert stats.admitted == 12 and stats.purged == 8  # the liar's groups are purged untrained
    liar = next(r for r in node.registry if r.name == "w")
    assert liar.quarantined.startswith("turn_mask") and node.pool.state(liar.worker_id) == "quarantined"
    import sqlite3

    db = sqlite3.connect(tmp_path / "store.sqlite")
    rows = db.execute(
        "SELECT g.group_id, g.data, l.prompts FROM rollout_groups g JOIN leases l USING (lease_id)"
    )
    graded = 0
    for gid, data, prompts in rows:
        if not data:
            continue  # purged
        by_id = {i: Prompt(i, t, a, m) for i, t, a, m in json.loads(prompts)}
        for t in decode_group(data, gid, 0):
            want = task.grade(by_id[t.prompt_id], codec.decode_completion(t.completion_ids))
            assert t.reward == want.reward and t.meta["parsed"] == want.parsed and t.turn_mask == ()
            graded += 1
    assert graded == 4 and stats.size == 4  # what is left to train on is the other worker's, as graded here


def test_registrations_prices_and_rates_are_bounded(tmp_path):
    """One join token makes at most security.max_workers registrations; a price must be > 0 and under
    the run's limit, a claimed rate under its limit; every refusal is counted and enrols nobody."""

    async def body(client):
        async def reg(**fields: Any) -> tuple[int, str]:
            resp = await client.post("/v1/register", headers=JOIN, json={"usd_per_hour": 0.5, **fields})
            return resp.status, (await resp.json()).get("error", "ok")

        return [
            await reg(usd_per_hour=0.0),
            await reg(usd_per_hour=1e6),
            await reg(rollouts_per_s=1e15),
            await reg(name="a"),
            await reg(name="b"),
            await reg(name="c"),
        ]

    node = make_node(tmp_path, "security.max_workers=2", "security.max_usd_per_hour=50")
    got, stats = run(body, node)
    assert got == [
        (422, "schema"),
        (422, "invalid_price"),
        (422, "invalid_rate"),
        (200, "ok"),
        (200, "ok"),
        (403, "registration_cap"),
    ]
    assert len(node.registry) == 2
    assert stats.rejected_by_reason == {
        "schema": 1,
        "invalid_price": 1,
        "invalid_rate": 1,
        "registration_cap": 1,
    }


def test_throughput_comes_from_admitted_rollouts_not_heartbeats(tmp_path):
    """A heartbeat claiming 1e15 rollouts moves nothing; admitted rollouts over the generating time it
    reports (never less than half the wall time since the last sample) make the measured rate."""
    clock = [1000.0]

    async def body(client):
        liar, honest = await register(client, "liar"), await register(client, "honest")
        big = {"rollouts": 10**15, "busy_s": 1e-9, "installed_version": 0}
        await client.post("/v1/heartbeat", json=big, headers=liar)
        le = await lease(client, honest)
        resp = await client.post("/v1/submit", json=payload(le), headers=honest)
        assert resp.status == 200, await resp.text()
        clock[0] += 4.0
        hb = {"rollouts": 0, "busy_s": 0.5, "installed_version": 0}  # claims 0.5 s for 4 rollouts
        await client.post("/v1/heartbeat", json=hb, headers=honest)
        await client.post("/v1/heartbeat", json=big, headers=liar)

    node = make_node(tmp_path, "controller.replace_prior=true")
    node.pool.clock = node.registry.clock = lambda: clock[0]
    run(body, node)
    rates = {r.name: node.pool.rate(r.worker_id) for r in node.registry}
    liar = next(r.worker_id for r in node.registry if r.name == "liar")
    assert rates["liar"] == 0.0 and liar in node.pool.probation  # nothing of it admitted: no candidate
    assert rates["honest"] == pytest.approx(4 / 2.0)  # 4 admitted over max(0.5 claimed, 0.5 * 4 s wall)


def test_claimed_versions_and_completion_shapes_are_checked(tmp_path):
    """A version older than the worker held at lease time, and a completion that is neither EOS-ended
    nor max_new_tokens long, are refused (not evidence: nobody is quarantined for them)."""
    from echo2.models.embedded import build_tokenizer
    from echo2.models.policy import TextCodec
    from echo2.tasks.verify import Verifier

    codec = TextCodec(build_tokenizer(), False)
    task = build_task(load_config().task, 0)

    async def body(client):
        out = []
        for case in ("deflated", "truncated", "after_eos"):  # an identity each: a refused lease stays open
            auth = await register(client, case)
            await client.post(
                "/v1/heartbeat", json={"rollouts": 0, "busy_s": 0.0, "installed_version": 1}, headers=auth
            )
            le = await lease(client, auth, installed=1)
            sub = payload(le, version=0 if case == "deflated" else 1)
            for g, p in zip(sub["groups"], le["prompts"], strict=True):
                for s in g["samples"]:
                    s["prompt_ids"] = codec.encode_prompt(p["text"])
                    s["completion_ids"] = {"truncated": [5, 6], "after_eos": [5, 1, 6]}.get(case, [5, 1])
                    s["sampler_logprobs"] = [-0.5] * len(s["completion_ids"])
                    s["reward"] = 0.0
            resp = await client.post("/v1/submit", json=sub, headers=auth)
            out.append((resp.status, (await resp.json()).get("error", "ok")))
        return out

    node = make_node(tmp_path, verifier=Verifier(codec, task, eos_id=1, max_new_tokens=4))
    node.v = 1

    async def publish_1(client):
        await node.snapshots.publish(1, b"blob1")
        return await body(client)

    got, _ = run(publish_1, node)
    assert got == [(422, "version_mismatch"), (422, "completion_shape"), (422, "completion_shape")]
    assert not any(r.quarantined for r in node.registry)


def test_the_prompt_source_resumes_where_the_checkpoint_left_it():
    """A resumed run draws the prompts it would have drawn next (not the run's first ones again), and
    the prompts of expired leases waiting to be re-issued are kept."""
    from echo2.runtime.prompts import PromptSource

    task = build_task(load_config().task, 0)
    a = PromptSource(task, seed=3)
    a.take(5)
    a.reissue.extend(a.take(2))
    saved = json.loads(json.dumps(a.state()))  # what the checkpoint's state.json holds
    b = PromptSource(task, seed=3)
    b.restore(saved)
    assert b.take(6) == a.take(6)  # the two re-issued prompts, then the same fresh draws
    fresh = PromptSource(task, seed=3)
    fresh.restore(None)  # a checkpoint from before the state was kept
    assert fresh.take(3) == PromptSource(task, seed=3).take(3)


def test_weights_newer_than_the_learner_are_refused_as_rolled_back(tmp_path):
    """After a learner restarts from an older checkpoint, a worker still holding a version published
    before the crash is told to drop it: the same number will name other weights."""

    async def body(client):
        auth = await register(client)
        resp = await client.post("/v1/lease", json={"max_prompts": 1, "installed_version": 5}, headers=auth)
        return await resp.json()

    node = make_node(tmp_path)
    node.v = 3
    refusal, _ = run(body, node)
    assert refusal["kind"] == "refusal" and refusal["reason"] == "rolled_back"


def test_over_long_numbers_get_a_counted_4xx_on_every_endpoint(tmp_path):
    """A 5,000-digit integer (beyond what JSON parsers convert) or a 30-digit version: a 4xx naming the
    problem, never a 500, on the unauthenticated register too (whose body past 4 KiB is not even read:
    413, and whose over-long join token is just a wrong one: 403)."""
    big = "9" * 5000

    async def body(client):
        out = []
        out.append(
            (await client.post("/v1/register", data=f'{{"usd_per_hour": {big}}}', headers=JOIN)).status
        )
        out.append(
            (await client.post("/v1/register", data="{}", headers={"Authorization": "Bearer " + big})).status
        )
        auth = await register(client)
        hb = f'{{"rollouts": {big}, "busy_s": 1, "installed_version": 0}}'
        out.append((await client.post("/v1/heartbeat", data=hb, headers=auth)).status)
        sub = json.dumps(payload(await lease(client, auth)))
        for v in (big, "9" * 30):
            raw = sub.replace('"policy_version": 0', f'"policy_version": {v}')
            out.append((await client.post("/v1/submit", data=raw, headers=auth)).status)
        return out

    got, stats = run(body, make_node(tmp_path))
    assert got == [413, 403, 400, 400, 422]
    assert stats.rejected_by_reason == {"oversized": 1, "auth": 1, "malformed": 2, "future_version": 1}


def test_a_lora_runs_base_is_the_first_link_of_the_chain_and_pinned_in_every_manifest(tmp_path):
    """GET /v1/snapshot in a LoRA run: the chain of a worker holding no base (``base=0``, the default)
    leads with the link that carries it; one holding it (``base=1``) gets that version's adapter alone,
    signed the same; ``base`` is 0 or 1 (400 naming it); the link is booked to the identity's budget
    like any (429 ``over_budget`` after SERVE_BUDGET copies); every manifest pins the base."""
    import torch

    from echo2.weights.chain import decode_chain, verified_links
    from echo2.weights.manifest import key_from_text

    frozen = {"model.w.weight": torch.ones(64, 64, dtype=torch.bfloat16)}
    node = make_node(tmp_path / "lora", frozen=frozen)
    adapter = {"model.w.lora_A.default.weight": torch.ones(2, 64, dtype=torch.bfloat16)}

    async def served(client: TestClient) -> None:
        resp = await client.post("/v1/register", headers=JOIN, json={"name": "w", "usd_per_hour": 0.35})
        reply = await resp.json()
        digest = weights_digest(frozen)
        assert reply["settings"]["lora"] == {
            "scale": 2.0, "base_digest": digest, "dtype": "bfloat16", "rank": None, "vllm": "merged",
        }  # fmt: skip
        auth = {"Authorization": f"Bearer {reply['credential']}"}
        key = key_from_text(reply["public_key"])
        await node.snapshots.publish_copy(1, lambda dtype: adapter)  # (v0 is run()'s bytes)
        await node.snapshots.publish_copy(2, lambda dtype: {n: t + 1 for n, t in adapter.items()})

        async def chain(query: str) -> list:
            resp = await client.get(f"/v1/snapshot?{query}", headers=auth)
            assert resp.status == 200, await resp.text()
            return verified_links(decode_chain(await resp.read()), key)

        bare, held = await chain("have=-1"), await chain("have=-1&base=1")
        assert [(m.version, m.kind) for m, _ in bare] == [(1, "base"), (2, "patch")]
        assert [(m.version, m.kind) for m, _ in held] == [(1, "full"), (2, "patch")]
        assert len(bare[0][1]) > 64 * 64 * 2 > len(held[0][1])  # the base crosses only with base=0
        assert all(m.lineage.model_base == digest for m, _ in bare + held)
        resp = await client.get("/v1/snapshot?have=-1&base=yes", headers=auth)
        assert resp.status == 400 and "base must be 0 or 1" in (await resp.json())["detail"]
        for _ in range(2):  # the second and third copy of the base for this identity (with the twin's)
            await chain("have=-1")
        resp = await client.get("/v1/snapshot?have=-1", headers=auth)
        assert resp.status == 429 and (await resp.json())["error"] == "over_budget"
        assert (await client.get("/v1/base", headers=auth)).status == 404  # no side channel

    run(served, node)


def test_a_quarantine_is_one_call_on_the_members_record(tmp_path):
    """``registry.revoke`` alone (what the intake and the learner loop call on evidence of lying) does
    the whole quarantine: the record, the pool's candidate and rate window, the admitted groups purged,
    the open leases' prompts out again; a worker retired for silence before it was caught included.
    A retirement alone purges nothing: a silent worker is no liar."""
    node = make_node(tmp_path)

    async def go(client: TestClient) -> tuple[str, str, int, list[int]]:
        liar, quiet, retired = (
            await register(client, "liar"),
            await register(client, "quiet"),
            await register(client, "r"),
        )
        for auth in (liar, quiet, retired):
            le = await lease(client, auth)
            resp = await client.post("/v1/submit", json=payload(le), headers=auth)
            assert resp.status == 200, await resp.text()
        await lease(client, liar)  # an open lease: its prompts go out again at the quarantine
        ids = {r.name: r.worker_id for r in node.registry}
        node.registry[ids["r"]].retired_s = time.time()  # retired for silence, then found out
        node.registry._untrusted(ids["r"])
        node.registry[ids["quiet"]].retired_s = time.time()  # retired only
        node.registry._untrusted(ids["quiet"])
        before = node.store.stats().purged
        node.registry.revoke(ids["liar"], "reward_mismatch: caught")
        node.registry.revoke(ids["r"], "forged_generation: caught")
        open_after = [node.store.open_leases(ids[n]) for n in ("liar", "r")]
        return ids["liar"], ids["r"], node.store.stats().purged - before, open_after

    (liar, retired, purged, open_after), stats = run(go, node)
    G = node.cfg.batch.group_size
    assert purged == 2 * 2 * G and stats.admitted == 3 * 2 * G  # the two liars' groups; quiet's stay
    assert open_after == [0, 0]
    for wid, why in ((liar, "reward_mismatch"), (retired, "forged_generation")):
        assert node.pool.state(wid) == "quarantined" and node.pool.last_reason[wid] == f"quarantined: {why}"
        assert node.registry[wid].rate_window is None


def test_a_registration_sent_again_gets_its_identity_back_not_a_second_one(tmp_path):
    """A reply lost or too late: the client sends the same registration again (the same ``attempt``).
    It gets the identity that landed, with a new credential (the lost one opens nothing), even with
    every slot held; a registration of its own still meets the cap. Without it, a fleet registering
    under load burnt a slot and an identity for every retry that had landed (415 of 10,064 at 10,000)."""
    attempt = "a" * 16

    async def body(client):
        async def reg(**fields: Any) -> dict[str, Any]:
            resp = await client.post("/v1/register", headers=JOIN, json={"usd_per_hour": 0.5, **fields})
            return {"status": resp.status, **(await resp.json())}

        first = await reg(name="a", attempt=attempt)
        again = await reg(name="a", attempt=attempt)
        other = await reg(name="b", attempt="b" * 16)
        beat = {"rollouts": 0, "busy_s": 0.0, "installed_version": 0}
        old = await client.post(
            "/v1/heartbeat", json=beat, headers={"Authorization": f"Bearer {first['credential']}"}
        )
        new = await client.post(
            "/v1/heartbeat", json=beat, headers={"Authorization": f"Bearer {again['credential']}"}
        )
        return first, again, other, old.status, new.status

    node = make_node(tmp_path, "security.max_workers=1")
    (first, again, other, old, new), _ = run(body, node)
    assert first["status"] == again["status"] == 200 and again["worker_id"] == first["worker_id"]
    assert again["credential"] != first["credential"] and old in (401, 403) and new == 200
    assert (other["status"], other["error"]) == (403, "registration_cap")
    assert len(node.registry) == 1
