"""The dashboard server (observe/dashboard.py) over a NodeStatus of real parts (registry, pool,
snapshots with the in-memory broadcast): the page is self-contained, /api/state carries what the page
reads, /metrics parses and agrees with it, and the view-token rule holds."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from importlib import resources
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from echo2.broadcast.factory import get_strategy, open_publisher
from echo2.config import load_config
from echo2.data.store import TrajectoryStore
from echo2.observe.dashboard import Dashboard, needs_token
from echo2.runtime.members import WorkerRegistry
from echo2.runtime.node import assemble, worker_settings
from echo2.runtime.routes import Identity
from echo2.runtime.status import SERIES, NodeStatus
from echo2.tasks.registry import build_task
from echo2.weights.manifest import new_signing_key

TOKEN = "join-token-for-tests-0123456789"
VIEW = "view-token-for-tests-0123456789"
PAGE = resources.files("echo2.observe").joinpath("static", "dashboard.html").read_text()
PAGE_READS = {  # section of /api/state ("" = top level) -> the keys dashboard.html reads from it
    "": ["time", "elapsed_s", "finished", "learner", "store", "cost", "pool", "decisions", "broadcast"],
    "learner": ["version", "staleness_budget", "kappa", "steps", "bubble_ratio", "update_s", "idle_s"],
    "cost": ["usd_per_hour", "usd_total"],
    "pool": ["workers", "active", "mu_pool", "mu_target", "n_min"],
    "broadcast": ["version", "members", "targets", "installed", "bytes", "learner_bytes", "t_bcast_s"],
}
HOSTILE = '<img src=x onerror="alert(1)">&'  # a worker may call itself anything


def _step(v: int) -> dict[str, Any]:
    """A learner step record with the keys NodeStatus reads (as learner.py logs them)."""
    return {
        "step": v, "time_s": 0.5 * v, "reward/mean": 0.1 * v, "reward/accuracy": 0.5 if v == 2 else None,
        "learner/update_s": 0.1, "learner/idle_s/wait": 0.3, "learner/idle_s/publish": 0.05,
        "learner/bubble_ratio": 0.75, "learner/step_wall_s": 0.45, "learner/t_train_s": 0.1,
        "store/staleness_max": v % 2, "store/staleness_mean": 0.5, "store/size": 3, "store/admitted": 8 * v,
        "store/dropped_stale": 0, "store/rejected": 0, "cost/usd_total": 0.001 * v,
        "cost/usd_per_hour": 1.05, "pool/active_workers": 2, "pool/mu_pool": 4.0, "pool/mu_target": None,
    }  # fmt: skip


def _serve(tmp_path, body, view_token: str | None = None) -> Any:  # type: ignore[no-untyped-def]
    """A node's parts (as ``runtime/node.py`` assembles them), two workers registered through the real
    API (one with a hostile name) and one of them heartbeating, two learner steps recorded; then
    ``body(client)`` against the dashboard's app."""
    cfg = load_config(overrides=["batch.prompts=4", "batch.group_size=2", "staleness.S=2"])
    store = TrajectoryStore(tmp_path / "store.sqlite", cfg.staleness.S, cfg.batch.group_size)
    key = new_signing_key()
    registry = WorkerRegistry(tmp_path, TOKEN, time.time)
    publisher = open_publisher("memory", key, get_strategy("star-limited"), 1 << 10)
    identity = Identity(
        worker_settings(cfg), key.verifier().to_text(), ("127.0.0.1", 1), {"config.json": "{}"}
    )
    parts = assemble(
        cfg, registry, store, build_task(cfg.task, 0), publisher, identity, 100, lambda: 2, time.time
    )
    status = NodeStatus(registry, parts.pool, parts.snapshots, cfg.staleness.S, 1, lambda: 2, time.time)

    async def main() -> Any:
        await parts.snapshots.publish(0, b"blob")
        async with TestClient(TestServer(parts.routes.app())) as api:
            creds = []
            for name, hw, usd in (("alpha", "RTX 5090", 0.35), (HOSTILE, HOSTILE, 0.29)):
                reg = {"name": name, "hardware": hw, "usd_per_hour": usd}
                resp = await api.post("/v1/register", json=reg, headers={"Authorization": f"Bearer {TOKEN}"})
                assert resp.status == 200, await resp.text()
                creds.append((await resp.json())["credential"])
            registry.relay_conduct(next(iter(registry)).worker_id, True)  # the publisher demoted one
            registry.mismatch(next(iter(registry)).worker_id, 0.0125)  # an update read its mismatch KL
            hb = {"rollouts": 5, "busy_s": 1.0, "installed_version": 0}
            resp = await api.post("/v1/heartbeat", json=hb, headers={"Authorization": f"Bearer {creds[0]}"})
            assert resp.status == 200, await resp.text()
        for v in (1, 2):
            status.record(_step(v))
        async with TestClient(TestServer(Dashboard(status, view_token).app())) as client:
            return await body(client)

    try:
        return asyncio.run(main())
    finally:
        store.close()


def test_page_is_self_contained_and_reads_only_keys_the_state_has(tmp_path):
    async def body(client):
        page = await client.get("/")
        state = await client.get("/api/state")
        return page.status, page.content_type, await page.text(), state.status, await state.json()

    status, ctype, html, st_status, st = _serve(tmp_path, body)
    assert (status, ctype, st_status) == (200, "text/html", 200)
    assert html == PAGE
    # nothing from the network: no absolute URL at all, no external script/style/image, no CSS import
    assert "http://" not in html and "https://" not in html and "//cdn" not in html
    for tag, attr, url in re.findall(r"<(\w+)[^>]*?\b(src|href)\s*=\s*[\"']?([^\"'\s>]*)", html):
        assert url.startswith("data:"), (tag, attr, url)
    assert "@import" not in html and "url(" not in html
    assert 'fetch("api/state"' in html  # relative: works behind any prefix
    # what the page reads is there
    for section, keys in PAGE_READS.items():
        assert set(keys) <= set(st[section] if section else st), section
    assert "series" in st
    series_read = set(re.findall(r'\bs\["([^"]+)"\]', html))
    assert series_read and series_read <= set(st["series"]) == set(SERIES)
    assert st["series"]["step"] == [1, 2] and st["series"]["reward/accuracy"] == [None, 0.5]
    columns = set(re.findall(r'^\s*\["(\w+)", "(?:num|mono|)"', html, re.M))
    assert len(columns) == 12 and all(columns | {"reason"} <= set(w) for w in st["pool"]["workers"])
    assert st["learner"]["steps"] == 2 and st["pool"]["active"] == 2
    assert "esc(" in html and "textContent" in html  # worker strings are escaped, never raw innerHTML


def test_metrics_parse_and_agree_with_the_state(tmp_path):
    async def body(client):
        metrics = await client.get("/metrics")
        state = await client.get("/api/state")
        return metrics.status, metrics.headers["Content-Type"], await metrics.text(), await state.json()

    status, ctype, text, st = _serve(tmp_path, body)
    assert status == 200 and ctype.startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    per_worker: dict[str, dict[str, Any]] = {}
    for name, field in (("echo2_worker_usd_per_hour", "usd_per_hour"), ("echo2_worker_active", "active"),
                        ("echo2_worker_installed_version", "installed_version"),
                        ("echo2_worker_install_seconds", "install_s"),
                        ("echo2_worker_rollouts_admitted", "rollouts"),
                        ("echo2_worker_rollouts_per_second", "mu"),
                        ("echo2_worker_relay_demoted", "relay_demoted"),
                        ("echo2_worker_mismatch_kl", "mismatch_kl")):  # fmt: skip
        for s in fams[name].samples:
            row = per_worker.setdefault(
                s.labels["worker"], {"name": s.labels["name"], "hardware": s.labels["hardware"]}
            )
            row[field] = s.value
    workers = {w["worker_id"]: w for w in st["pool"]["workers"]}
    assert set(per_worker) == set(workers) and len(workers) == 2
    for wid, m in per_worker.items():
        w = workers[wid]
        assert (m["name"], m["hardware"]) == (w["name"], w["hardware"])  # label escaping round-trips
        assert m["usd_per_hour"] == w["usd_per_hour"]
        assert m["active"] == float(w["state"] == "active")
        assert m["installed_version"] == w["installed_version"] and m["rollouts"] == w["rollouts"]
        assert m["install_s"] == w["install_s"]
        assert m["mu"] == w["mu"] and m["relay_demoted"] == float(w["relay_demoted"])
    assert sorted(w["installed_version"] for w in workers.values()) == [-1, 0]
    assert sorted(w["relay_demoted"] for w in workers.values()) == [False, True]  # the demotion shows
    for wid, m in per_worker.items():  # NaN on /metrics, null in the table, before an update read it
        kl = workers[wid]["mismatch_kl"]
        assert (math.isnan(m["mismatch_kl"]) and kl is None) or m["mismatch_kl"] == kl == 0.0125
    assert sorted(str(w["mismatch_kl"]) for w in workers.values()) == ["0.0125", "None"]
    assert HOSTILE in {w["name"] for w in workers.values()}
    assert fams["echo2_pool_active_workers"].samples[0].value == st["pool"]["active"]
    assert fams["echo2_learner_version"].samples[0].value == st["learner"]["version"] == 2
    assert fams["echo2_cost_usd"].samples[0].value == st["cost"]["usd_total"]
    assert fams["echo2_broadcast_version"].samples[0].value == st["broadcast"]["version"] == 0
    stale = {
        s.labels.get("le"): s.value for s in fams["echo2_staleness"].samples if s.name.endswith("_bucket")
    }
    assert stale == {"0": 1.0, "1": 2.0, "2": 2.0, "+Inf": 2.0}  # steps 1 and 2 had max staleness 1 and 0


def test_view_token_rule(tmp_path):
    assert not needs_token("127.0.0.1") and not needs_token("::1") and not needs_token("localhost")
    assert needs_token("0.0.0.0") and needs_token("192.0.2.7") and needs_token("::")

    async def open_(client):
        return [(await client.get(p)).status for p in ("/", "/api/state", "/metrics")]

    assert _serve(tmp_path / "open", open_) == [200, 200, 200]  # loopback: no credential asked

    async def guarded(client):
        out = {}
        for p in ("/", "/api/state", "/metrics"):
            out[p] = [
                (await client.get(p)).status,
                (await client.get(p, headers={"Authorization": "Bearer wrong"})).status,
                (await client.get(p, headers={"Authorization": f"Bearer {TOKEN}"})).status,  # join token
                (await client.get(f"{p}?token={TOKEN}")).status,
                (await client.get(p, headers={"Authorization": f"Bearer {VIEW}"})).status,
                (await client.get(f"{p}?token={VIEW}")).status,
            ]
        state = await client.get(f"/api/state?token={VIEW}")
        return out, json.loads(await state.text())

    out, st = _serve(tmp_path / "guarded", guarded, view_token=VIEW)
    assert out == {p: [401, 401, 401, 401, 200, 200] for p in ("/", "/api/state", "/metrics")}
    assert st["learner"]["version"] == 2


def test_metrics_exports_exactly_the_catalogs_families(tmp_path):
    """Every family on /metrics is the catalog's (observe/catalog.py): name, type, help and labels."""
    from echo2.observe.catalog import PROMETHEUS

    async def body(client):
        return await (await client.get("/metrics")).text()

    fams = {f.name: f for f in text_string_to_metric_families(_serve(tmp_path, body))}
    assert set(fams) == {p.name for p in PROMETHEUS}
    for p in PROMETHEUS:
        fam = fams[p.name]
        assert (fam.type, fam.documentation) == (p.kind, p.help), p.name
        for s in fam.samples:
            assert set(s.labels) - {"le"} == set(p.labels), (p.name, s.labels)


def test_every_viewer_and_scrape_within_a_second_is_served_from_one_snapshot(tmp_path):
    """Forty pages and scrapes in one second read the members once; the next second once more."""

    async def read(client):
        return await (await client.get("/api/state")).json()

    template = _serve(tmp_path, read)  # a real node's state, its version then set to the call's count

    class Counted:
        staleness_counts, staleness_sum, calls = [0, 0, 0], 0, 0

        def state(self) -> dict[str, Any]:
            self.calls += 1
            return {**template, "learner": {**template["learner"], "version": self.calls}}

        async def state_sliced(self) -> dict[str, Any]:
            await asyncio.sleep(0)
            return self.state()

    status, now = Counted(), [100.0]
    dash = Dashboard(status, None, clock=lambda: now[0])  # type: ignore[arg-type]

    async def main() -> list[int]:
        async with TestClient(TestServer(dash.app())) as client:
            seen = []
            for k in range(20):
                now[0] = 100.0 + 0.04 * k  # all inside the first second
                seen.append((await (await client.get("/api/state")).json())["learner"]["version"])
                assert (await client.get("/metrics")).status == 200
            now[0] = 101.0
            seen.append((await (await client.get("/api/state")).json())["learner"]["version"])
            return seen

    seen = asyncio.run(main())
    assert seen == [1] * 20 + [2] and status.calls == dash.snapshot.builds == 2
    assert dash.snapshot.expositions == 1  # the twenty scrapes of the first snapshot: written once
    fresh = Dashboard(status, None, max_age_s=0.0)  # type: ignore[arg-type]

    async def twice() -> None:
        await fresh.snapshot.get()
        await fresh.snapshot.get()

    asyncio.run(twice())
    assert fresh.snapshot.builds == 2  # a zero age takes one at every request


def test_scrapes_of_one_snapshot_share_its_exposition_and_one_gone_leaves_it_to_the_others(tmp_path):
    """Scrapes waiting together on a snapshot's text get the same bytes; one cancelled midway does not
    cancel the writing the others wait on."""

    async def read(client):
        return await (await client.get("/api/state")).json()

    template = _serve(tmp_path, read)

    class Fixed:
        staleness_counts, staleness_sum = [1, 1, 0], 1

        def state(self) -> dict[str, Any]:
            return template

        async def state_sliced(self) -> dict[str, Any]:
            return template

    async def main() -> tuple[list[bytes], int]:
        dash = Dashboard(Fixed(), None, clock=lambda: 0.0)  # type: ignore[arg-type]
        tasks = [asyncio.ensure_future(dash.snapshot.exposition()) for _ in range(5)]
        await asyncio.sleep(0)
        tasks[0].cancel()
        got = await asyncio.gather(*tasks[1:])
        return got, dash.snapshot.expositions, dash.snapshot.builds

    got, written, built = asyncio.run(main())
    assert written == built == 1 and len(set(got)) == 1 and b"echo2_learner_version" in got[0]


def test_the_sliced_state_is_the_state_and_lets_the_loop_run_between_slices(tmp_path):
    """A node of 1,201 members: ``state_sliced`` equals ``state`` (the clock held still), and a ticker on
    the same loop runs between its slices (3 slices of rows at 500, then the pool's figures)."""
    from echo2.protocol import RegisterRequest
    from echo2.runtime import status as status_mod
    from echo2.runtime.pool import Pool

    cfg = load_config()
    reg = WorkerRegistry(tmp_path, TOKEN, lambda: 50.0, 1_300)
    pool = Pool(reg, cfg.controller, cfg.staleness, cfg.batch.rollouts, 12.24, tmp_path, lambda: 50.0)
    for _ in range(1_201):
        rec, _ = reg.register(RegisterRequest(name="w", usd_per_hour=0.35, rollouts_per_s=1.0))
        pool.enroll(rec)
    publisher = type("P", (), {"members": staticmethod(lambda: [])})()
    snaps = type("S", (), {"version": -1, "publisher": publisher, "bcast": {}, "publication": None})()
    status = NodeStatus(reg, pool, snaps, cfg.staleness.S, 2, lambda: 3, lambda: 50.0)  # type: ignore[arg-type]

    async def main() -> tuple[dict[str, Any], int]:
        ticks = [0]

        async def ticker() -> None:
            while True:
                ticks[0] += 1
                await asyncio.sleep(0)

        t = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        before = ticks[0]
        got = await status.state_sliced()
        t.cancel()
        return got, ticks[0] - before

    sliced, ticked = asyncio.run(main())
    assert sliced == status.state() and len(sliced["pool"]["workers"]) == 1_201
    assert ticked >= -(-1_201 // status_mod.ROWS_A_SLICE) + 3  # the loop ran between every slice
