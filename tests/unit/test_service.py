"""The learner's HTTP API (runtime/service.py) against a real store, through a real aiohttp server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from echo2.config import load_config
from echo2.data.store import StoreStats, TrajectoryStore
from echo2.data.tasks.base import build_task
from echo2.runtime.service import LearnerService

TOKEN = "join-token-for-tests-0123456789"
VOCAB = 100


def make_service(tmp_path, *overrides: str) -> LearnerService:
    cfg = load_config(
        overrides=[
            "grpo.prompts_per_step=4",
            "grpo.group_size=2",
            "runtime.lease_prompts=2",
            "sampling.max_new_tokens=4",
            "async.staleness=1",
            *overrides,
        ]
    )
    store = TrajectoryStore(tmp_path / "store.sqlite", cfg.async_.staleness, cfg.grpo.group_size)
    svc = LearnerService(
        cfg, store, build_task(cfg.task, 0), tmp_path, TOKEN, "ed25519-pub:00", ("127.0.0.1", 1),
        {"config.json": "{}"}, vocab_size=VOCAB,
    )  # fmt: skip
    svc.set_published(0, {"version": 0}, b"blob")
    return svc


def run(coro_fn, svc: LearnerService) -> tuple[Any, StoreStats]:
    """Serve ``svc`` on loopback, run the client coroutine; its result and the store's final stats."""

    async def main() -> Any:
        async with TestClient(TestServer(svc.app())) as client:
            return await coro_fn(client)

    try:
        return asyncio.run(main()), svc.store.stats()
    finally:
        svc.store.close()


async def register(client: TestClient, name: str = "w") -> dict[str, str]:
    resp = await client.post("/v1/register", json={"token": TOKEN, "name": name, "usd_per_hour": 0.35})
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
        wrong = await client.post("/v1/register", json={"token": "nope", "name": "x"})
        bad_price = await client.post("/v1/register", json={"token": TOKEN, "name": "x", "usd_per_hour": -1})
        ok = await client.post("/v1/register", json={"token": TOKEN, "name": "x"})
        return missing.status, wrong.status, bad_price.status, ok.status, await ok.json()

    svc = make_service(tmp_path)
    (missing, wrong, bad_price, ok, data), _ = run(body, svc)
    assert (missing, wrong, bad_price, ok) == (401, 403, 422, 200)
    assert data["credential"] and data["config"]["grpo"]["group_size"] == 2
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

    svc = make_service(tmp_path)
    results, stats = run(body, svc)
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

    svc = make_service(tmp_path)
    (statuses, reply), stats = run(body, svc)
    assert statuses == {
        "future": 422,
        "vocab": 422,
        "not_json": 400,
        "not_object": 400,
        "ok": 200,
        "replay": 409,
    }
    assert reply == {"admitted": 4, "dropped_stale": 0}
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

    svc = make_service(tmp_path, "runtime.max_request_mb=1")
    (statuses, big, nowhere), stats = run(body, svc)
    assert statuses == (413, 404, 200)
    assert big["error"] == "oversized" and "1048576" in big["detail"]  # aiohttp's refusal, in our JSON
    assert nowhere["error"] == "not_found"
    assert stats.rejected_by_reason["oversized"] == 1 and stats.rejected_by_reason["not_found"] == 1


def test_other_workers_lease_is_forbidden(tmp_path):
    async def body(client):
        a, b = await register(client, "a"), await register(client, "b")
        le = await lease(client, a)
        return (await client.post("/v1/submit", json=payload(le), headers=b)).status

    assert run(body, make_service(tmp_path))[0] == 403


def test_lease_caps_work_in_flight_and_refuses_stale_weights(tmp_path):
    # R = 4 prompts x 2 = 8 rollouts; cap = min(max_inflight_batches 2, S + 1 = 2) * R = 16 rollouts,
    # and a lease of 2 prompts x 2 is 4 rollouts: four leases fit, the fifth does not
    async def body(client):
        auth = await register(client)
        leases = [await lease(client, auth) for _ in range(5)]
        svc.version = 3  # learner moved on: version 1 weights are older than v_t - S = 2
        stale = await lease(client, auth, installed=1)
        return leases, stale

    svc = make_service(tmp_path)
    (leases, stale), stats = run(body, svc)
    assert all(le["lease_id"] for le in leases[:4]) and stats.leases_open == 4
    assert leases[4] == {"lease_id": None, "reason": "buffer_full", "retry_after_s": pytest.approx(0.25)}
    assert stale["reason"] == "stale_weights" and stale["min_version"] == 2


def test_one_worker_cannot_hold_more_than_its_share_of_leases(tmp_path):
    async def body(client):
        greedy, other = await register(client, "greedy"), await register(client, "other")
        hoard = [await lease(client, greedy) for _ in range(3)]
        return hoard, await lease(client, other)

    svc = make_service(tmp_path, "runtime.max_leases_per_worker=2")
    (hoard, other), stats = run(body, svc)
    assert [bool(le["lease_id"]) for le in hoard] == [True, True, False]
    assert hoard[2]["reason"] == "too_many_leases" and other["lease_id"] and stats.leases_open == 3


def test_heartbeat_validates_and_reports_activity(tmp_path):
    async def body(client):
        auth = await register(client)
        good = await client.post(
            "/v1/heartbeat", json={"rollouts": 8, "busy_s": 0.5, "installed_version": 0}, headers=auth
        )
        future = await client.post(
            "/v1/heartbeat", json={"rollouts": 8, "busy_s": 0.5, "installed_version": 9}, headers=auth
        )
        garbage = await client.post("/v1/heartbeat", json={"rollouts": -1, "busy_s": "x"}, headers=auth)
        return await good.json(), future.status, garbage.status

    svc = make_service(tmp_path)
    (good, future, garbage), _ = run(body, svc)
    assert good["active"] is True and good["finished"] is False
    assert (future, garbage) == (422, 422)
    wid = next(iter(svc.workers))
    assert svc.controller.measured_rate(wid) == pytest.approx(16.0)  # first measurement replaces the prior


BAD_BODIES = [  # endpoint, body, (field named first in the detail, what it says of it)
    ("register", {"token": TOKEN, "name": ""}, ("name", "at least 1 character")),
    ("register", {"token": TOKEN, "usd_per_hour": -1}, ("usd_per_hour", "greater than or equal to 0")),
    ("register", {"token": TOKEN, "usd_per_hour": True}, ("usd_per_hour", "a valid number")),
    ("register", {"token": TOKEN, "rollouts_per_s": 0}, ("rollouts_per_s", "greater than 0")),
    ("register", {"token": TOKEN, "hardware": "x" * 129}, ("hardware", "at most 128 characters")),
    ("register", {"token": TOKEN, "gpu": "H100"}, ("gpu", "Extra inputs are not permitted")),
    ("heartbeat", {"rollouts": -1, "busy_s": 0.5, "installed_version": 0}, ("rollouts", "greater than")),
    ("heartbeat", {"rollouts": True, "busy_s": 0.5, "installed_version": 0}, ("rollouts", "a valid integer")),
    ("heartbeat", {"rollouts": 8, "busy_s": "x", "installed_version": 0}, ("busy_s", "a valid number")),
    ("heartbeat", {"rollouts": 8, "busy_s": 0.5}, ("installed_version", "Field required")),
    ("lease", {"max_prompts": 0, "installed_version": 0}, ("max_prompts", "greater than or equal to 1")),
    ("lease", {"max_prompts": 2, "installed_version": 0.5}, ("installed_version", "a valid integer")),
    ("lease", {"max_prompts": 2, "installed_version": -2}, ("installed_version", "equal to -1")),
]


@pytest.mark.parametrize(("endpoint", "bad", "detail"), BAD_BODIES)
def test_bad_bodies_get_422_naming_the_field(tmp_path, endpoint, bad, detail):
    async def body(client):
        auth = await register(client)
        resp = await client.post(f"/v1/{endpoint}", json=bad, headers=auth)
        ok = await client.post("/v1/lease", json={"max_prompts": 1, "installed_version": 0}, headers=auth)
        return resp.status, await resp.json(), ok.status

    svc = make_service(tmp_path)
    (status, reply, ok), stats = run(body, svc)
    assert status == 422 and reply["error"] == "schema"
    field, says = detail
    assert reply["detail"].startswith(f"{field}: ") and says in reply["detail"], reply["detail"]
    assert stats.rejected_by_reason["schema"] == 1 and ok == 200  # counted, and the learner keeps serving
    assert len(svc.workers) == 1  # a refused registration enrols nobody


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

    svc = make_service(tmp_path)
    (first, second), stats = run(body, svc)
    assert first["admitted"] == 4 and first["next_lease"]["error"] == "schema"
    assert first["next_lease"]["detail"].startswith("next_lease: max_prompts: Input should be a valid int")
    assert second["admitted"] == 4 and second["next_lease"]["lease_id"]
    assert stats.rejected_by_reason["schema"] == 1 and stats.admitted == 8


def test_registry_survives_a_restart(tmp_path):
    async def first(client):
        return await register(client)

    auth, _ = run(first, make_service(tmp_path))

    async def second(client):
        return (
            await client.post("/v1/lease", json={"max_prompts": 1, "installed_version": 0}, headers=auth)
        ).status

    assert run(second, make_service(tmp_path))[0] == 200


def test_broadcast_membership_needs_the_workers_own_credential(tmp_path):
    async def body(client):
        resp = await client.post("/v1/register", json={"token": TOKEN, "name": "a"})
        return await resp.json()

    svc = make_service(tmp_path)
    reg, _ = run(body, svc)
    wid, cred = reg["worker_id"], reg["credential"]
    assert svc.authorize_broadcast(wid, cred)
    assert not svc.authorize_broadcast(wid, None) and not svc.authorize_broadcast(wid, "forged")
    assert not svc.authorize_broadcast("someone-else", cred)  # a credential is bound to its worker id
