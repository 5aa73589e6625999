"""The live dashboard in a real browser: a real `echo2 learner` with its dashboard bound beyond loopback
(so behind the view token), real `echo2 worker`s joining and dying, and headless Chromium reading
the page while `/metrics` is scraped around every read: the page and the Prometheus registry agree.

Needs a Chromium binary (Debian: `apt-get install chromium`) and the `playwright` package (the `dev`
extra; its own browser download is never used). Without either the test is skipped, saying which.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from waiting import free_ports, wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "docs" / "img" / "dashboard.png"  # rewritten when missing or ECHO2_UPDATE_SCREENSHOT=1
SAMPLES = 22  # reads of the page, about a second apart
JOIN_AT, KILL_AT = 5, 12  # the sample before which the second worker joins / the first is killed
MAX_RENDER_GAP_S = 2.0  # the page polls every second; it must redraw at least this often
FIELDS = ("usd_per_hour", "active", "installed_version", "rollouts")
FAMILIES = {  # the registry's per-worker metric for each field the page shows
    "echo2_worker_usd_per_hour": "usd_per_hour",
    "echo2_worker_active": "active",
    "echo2_worker_installed_version": "installed_version",
    "echo2_worker_rollouts_admitted": "rollouts",
}
TINY = [  # a learner small enough for a 2-core machine: warm start in a second, steps of ~0.1 s
    "model.embedded.hidden_size=32", "model.embedded.intermediate_size=64", "model.embedded.num_layers=1",
    "model.embedded.num_heads=2", "model.embedded.num_kv_heads=1", "model.warmstart.max_steps=20",
    "model.warmstart.eval_every=10", "model.warmstart.eval_size=16",
    "model.warmstart.target_accuracy=0.9", "task.max_value=9", "batch.prompts=4", "batch.group_size=4",
    "train.eval_size=16", "train.eval_every=25", "train.threads=1", "runtime.lease_prompts=2",
    "runtime.heartbeat_s=0.5", "controller.heartbeat_timeout_s=3",
]  # fmt: skip
READ_POOL = """() => {
  const rows = {};
  for (const tr of document.querySelectorAll("#pool tr[data-worker]")) {
    const row = {};
    for (const cell of tr.querySelectorAll("[data-field]")) {
      row[cell.dataset.field] = JSON.parse(cell.dataset.value);
    }
    row.hardware_text = tr.querySelector('[data-field="hardware"]').textContent;
    rows[tr.dataset.worker] = row;
  }
  return {rows, time: window.echo2State.time, renders: window.echo2Renders,
          rendered_at: window.echo2RenderedAt / 1000,
          injected: document.querySelectorAll("#pool gpu").length};
}"""


def _chromium() -> str | None:
    for name in (os.environ.get("ECHO2_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and (path := shutil.which(name)):
            return path
    return None


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _non_loopback() -> tuple[str, str]:
    """(address to bind the dashboard to, address to dial it at): one of this machine's own
    non-loopback addresses, else every interface dialled on loopback; either way a view token is asked."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout
        for addr in out.split():
            if "." in addr and not addr.startswith("127."):
                return addr, addr
    return "0.0.0.0", "127.0.0.1"


def _echo2(*args: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "echo2.cli", *args], stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env
    )


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy


def _get(url: str, token: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with _DIRECT.open(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, ConnectionError):
        return 0, b""


def _scrape(base: str, token: str) -> Scrape:
    """``/metrics`` as the registry reports it: worker id -> {field: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = _get(f"{base}/metrics", token)
    assert status == 200, (status, body[:300])
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(body.decode()):
        if fam.name in FAMILIES:
            for s in fam.samples:
                out.setdefault(s.labels["worker"], {})[FAMILIES[fam.name]] = s.value
    return out


Scrape = dict[str, dict[str, float]]  # worker id -> {field: value}


def _check_sample(dom: dict[str, Any], before: Scrape, after: Scrape) -> None:
    """The page, read between two scrapes, shows what the registry held between them."""
    rows = dom["rows"]
    assert set(before) <= set(rows) <= set(after), (sorted(before), sorted(rows), sorted(after))
    for wid, row in rows.items():
        a, b = before.get(wid, after[wid]), after[wid]  # a worker that joined in between: only `after`
        assert set(a) == set(b) == set(FIELDS), (wid, a, b)
        assert row["usd_per_hour"] == a["usd_per_hour"] == b["usd_per_hour"], (wid, row, a, b)
        assert float(row["state"] == "active") in (a["active"], b["active"]), (wid, row["state"], a, b)
        for key in ("installed_version", "rollouts"):  # both only grow
            assert a[key] <= row[key] <= b[key], (wid, key, a[key], row[key], b[key])
        assert row["hardware_text"] == row["hardware"]  # shown as text, never parsed as markup
    assert dom["injected"] == 0


def test_dashboard_in_a_browser_agrees_with_metrics(tmp_path):
    chromium = _chromium()
    if chromium is None:
        pytest.skip("no Chromium binary (apt-get install chromium, or set ECHO2_CHROMIUM)")
    why = "the playwright package (dev extra) is missing"
    sync_api = pytest.importorskip("playwright.sync_api", reason=why)

    run_dir = tmp_path / "run"
    http, bcast, dash = free_ports(3, "")
    bind, dial = _non_loopback()
    args = _sets([
        *TINY, f"model.warmstart.cache_dir={str(tmp_path / 'cache')!r}", f"train.run_dir={str(run_dir)!r}",
        f"runtime.port={http}", f"runtime.broadcast_port={bcast}",
        f"runtime.dashboard_port={dash}", f"runtime.dashboard_host={bind}",
    ])  # fmt: skip
    learner = _echo2("learner", *args, "--steps", "100000", "--max-minutes", "3", "--no-progress",
                     log=tmp_path / "learner.log")  # fmt: skip
    started = [learner]
    base = f"http://{dial}:{dash}"

    def worker(i: int, hardware: str, usd: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "ECHO2_JOIN_TOKEN": (run_dir / "join_token").read_text().strip()}
        join = json.loads((run_dir / "learner.json").read_text())["join"]  # the URL and its TLS pin
        wargs = ["--join", join, "--name", f"w{i}", "--hardware", hardware]
        wargs += ["--usd-per-hour", usd, "--max-rollouts-per-s", "100"]
        p = _echo2("worker", *wargs, env=env, log=tmp_path / f"w{i}.log")
        started.append(p)
        return p

    try:
        up = run_dir / "learner.json"
        wait_for(lambda: up.is_file() or learner.poll() is not None, 120, "the learner")
        assert learner.poll() is None, (tmp_path / "learner.log").read_text()[-3000:]
        wait_for(lambda: (run_dir / "view_token").is_file(), 30, "the view token")
        token = (run_dir / "view_token").read_text().strip()
        wait_for(lambda: _get(f"{base}/api/state?token={token}")[0] == 200, 30, "the dashboard")

        # bound beyond loopback: nothing without the view token; the token by query or by header
        assert _get(f"{base}/api/state")[0] == 401
        assert _get(f"{base}/metrics")[0] == 401
        assert _get(f"{base}/")[0] == 401
        assert _get(f"{base}/api/state?token=not-{token}")[0] == 401
        assert _get(f"{base}/api/state?token={token}")[0] == 200
        assert _get(f"{base}/api/state", token)[0] == 200

        w1 = worker(1, "RTX 5090 <gpu>", "0.35")
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=["--no-proxy-server"])
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                errors: list[str] = []
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                page.goto(f"{base}/?token={token}")  # the page sends it on as a Bearer header
                page.wait_for_function(
                    "() => { const s = window.echo2State; return s && s.pool.workers.length >= 1 "
                    "&& s.series.step.length >= 2; }",
                    timeout=60_000,
                )
                samples = _sample(page, base, token, lambda: worker(2, "RTX 4090 <gpu>", "0.29"), w1)
                assert not errors, errors
                _check_history(samples)
                _screenshot(page, tmp_path)
            finally:
                browser.close()

        learner.send_signal(signal.SIGTERM)  # the learner finishes cleanly; its workers hear it and leave
        assert learner.wait(60) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        for p in started[1:]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(20)
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()


def _sample(
    page: Any, base: str, token: str, join: Callable[[], Any], first: subprocess.Popen[bytes]
) -> list[dict[str, Any]]:
    """Read the pool from the page SAMPLES times, each time between two scrapes of /metrics, after a
    redraw from a state taken after the first scrape; the second worker joins at JOIN_AT, the first is
    killed at KILL_AT; sampling goes on (bounded) until the first one shows as lost."""
    samples: list[dict[str, Any]] = []
    i = 0
    while i < SAMPLES or not _first_lost(samples):
        assert i < SAMPLES + 15, "the killed worker never showed as lost"
        t0 = time.monotonic()
        if i == JOIN_AT:
            join()
        if i == KILL_AT:
            first.kill()
            first.wait()
        before = _scrape(base, token)
        t_before = time.time()  # the learner stamps each state with its clock, time.time()
        page.wait_for_function("t => window.echo2State.time > t", arg=t_before, polling=50, timeout=10_000)
        dom = page.evaluate(READ_POOL)
        after = _scrape(base, token)
        _check_sample(dom, before, after)
        samples.append(dom)
        i += 1
        time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
    return samples


def _first_lost(samples: list[dict[str, Any]]) -> bool:
    rows = samples[-1]["rows"].values() if samples else ()
    return any(r["name"] == "w1" and r["state"] == "lost" for r in rows)


def _check_history(samples: list[dict[str, Any]]) -> None:
    """The page redrew at least every MAX_RENDER_GAP_S; w2 appeared after it joined; w1 ended lost."""
    for a, b in itertools.pairwise(samples):
        renders = b["renders"] - a["renders"]
        assert renders >= 1, (a, b)
        assert (b["rendered_at"] - a["rendered_at"]) / renders <= MAX_RENDER_GAP_S, (a, b)
    names = [{r["name"]: r["state"] for r in s["rows"].values()} for s in samples]
    assert all(set(n) == {"w1"} for n in names[:JOIN_AT]), names[:JOIN_AT]
    assert any(n.get("w2") == "active" for n in names[JOIN_AT:]), names
    assert names[-1]["w1"] == "lost" and names[-1]["w2"] == "active", names[-1]
    assert len(samples) >= SAMPLES


def _screenshot(page: Any, tmp_path: Path) -> None:
    """Both workers in the table and every curve drawn; the docs' copy is written when it is missing
    or ECHO2_UPDATE_SCREENSHOT=1 (so a test run leaves the checkout as it was)."""
    page.wait_for_function("() => document.querySelectorAll('svg.chart path').length >= 6", timeout=10_000)
    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if not SCREENSHOT.is_file() or os.environ.get("ECHO2_UPDATE_SCREENSHOT") == "1":
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, SCREENSHOT)
