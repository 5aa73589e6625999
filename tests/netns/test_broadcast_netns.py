"""The netns harness (root): topology lifecycle and tbf-shaped broadcasts."""

from __future__ import annotations

import subprocess

import pytest

from echo2.physics.broadcast import lower_bound
from echo2_bench import BENCHMARKS_DIR
from echo2_bench.netns import NetnsTopology, netns_available

pytestmark = [
    pytest.mark.netns,
    pytest.mark.timeout(180),
    pytest.mark.skipif(netns_available() is not None, reason=f"netns harness: {netns_available()}"),
]


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_topology_is_removed_even_when_the_body_fails() -> None:
    before = _namespaces()
    with pytest.raises(RuntimeError, match="boom"), NetnsTopology(3, tag="t1") as topo:
        assert {topo.switch, topo.ns(0), topo.ns(2)} <= _namespaces()
        topo.shape(1, 8e6, 8e6)
        qdisc = subprocess.run([*topo.exec_prefix(1), "tc", "qdisc", "show"], capture_output=True, text=True)
        assert "tbf" in qdisc.stdout and "8Mbit" in qdisc.stdout
        raise RuntimeError("boom")
    assert _namespaces() == before


def test_shaped_links_separate_star_limited_from_tree_pipelined() -> None:
    from echo2_bench.harness import Harness, Scenario

    # B0 = 2 x the workers' links: star pays N * G / B0 = 3.0 s, tree about G / B = 1.5 s, a gap no
    # load on the machine closes (at B0 = 3 x, 2.0 s against 1.5 s, a loaded CI machine read 2.20 / 2.24)
    g, bw, ratio, n = 3_000_000, 16e6, 2.0, 4
    common = dict(size=g, chunk=16 << 10, b0_bps=bw * ratio, bw_bps=bw, timeout=90, pace=0.95)
    before = _namespaces()
    with Harness("netns", n) as h:
        tree = h.run(Scenario("tree-pipelined", n, **common))
        star = h.run(Scenario("star-limited", n, **common))
    assert _namespaces() == before
    t_star = lower_bound(tree.size, bw * ratio / 8, bw / 8, n)  # 1.5 s
    star_ideal = n * star.size / (bw * ratio / 8)  # N*G/B0 = 3.0 s
    # tbf really shapes: nobody beats the physics, and star pays for N copies on the uplink
    assert tree.t_all() >= 0.95 * t_star
    assert star.t_all() >= 0.95 * star_ideal
    assert star.learner_bytes == n * star.size and tree.learner_bytes == tree.size
    # loose CI bound here; the benchmark measures the 1.25x target at larger G
    assert tree.t_all() <= 1.5 * t_star
    assert tree.t_all() < star.t_all()


def test_ctrl_c_mid_run_removes_namespaces_and_processes(tmp_path) -> None:
    import os
    import signal
    import sys
    import time
    from pathlib import Path

    cmd = [sys.executable, str(BENCHMARKS_DIR / "broadcast.py"), "--mode", "netns", "--ns", "4",
           "--strategies", "star-limited", "--no-faults", "--no-relay", "--size-mb", "4",
           "--bw-mbps", "1", "--out", str(tmp_path / "b.json")]  # fmt: skip
    # links of 1 / 3 Mbit/s: the broadcast alone takes N * G / B0 = 4 * 32 Mbit / 3 Mbit/s ~ 43 s of
    # shaped time, whatever the machine's speed, so the SIGINT below always lands mid-run (at 8 Mbit/s
    # a fast machine finished it in 7 s, before the signal)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    tag = f"e2b{proc.pid % 100000}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(ns.startswith(tag) for ns in _namespaces()):
        time.sleep(0.2)
    assert any(ns.startswith(tag) for ns in _namespaces()), "harness never built its topology"
    time.sleep(2.0)  # processes are up and the broadcast is under way
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out.decode()[-2000:]
    assert not any(ns.startswith(tag) for ns in _namespaces())
    marker = f"e2bcast{proc.pid}-".encode()
    leftovers = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if marker in (p / "cmdline").read_bytes():
                    leftovers.append(int(p.name))
            except OSError:
                pass
    assert not leftovers, f"processes left behind: {leftovers}"
    assert os.path.exists(tmp_path) and not (tmp_path / "b.json").exists()
