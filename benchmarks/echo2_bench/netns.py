"""One-machine WAN: a switch namespace with a bridge, one namespace per node, tbf-shaped veth links.

Node 0 is the learner, nodes 1..N the workers. Each node's veth is shaped in both directions with a
token-bucket filter: egress inside the node namespace is the node's uplink, egress of the switch-side
end is its downlink. Names carry the creating pid so parallel runs never collide, and :meth:`close`
(also run on failure, SIGTERM and Ctrl-C through the context manager) deletes everything created.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess

from echo2.errors import Echo2Error

log = logging.getLogger(__name__)


QUEUE_SECONDS = 0.1  # tbf queue depth in seconds of line rate (a WAN router's buffer, roughly)


class HarnessError(Echo2Error):
    """The harness cannot run here (not root, missing ip/tc) or a setup command failed."""


def netns_available() -> str | None:
    """None if namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the '{tool}' command (iproute2)"
    return None


def _run(*cmd: str) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise HarnessError(f"`{' '.join(cmd)}` failed: {res.stderr.strip()}")


class NetnsTopology:
    """Namespaces + veths + bridge for ``n_nodes`` nodes; a context manager that always cleans up."""

    def __init__(self, n_nodes: int, tag: str | None = None) -> None:
        why = netns_available()
        if why:
            raise HarnessError(f"netns harness {why}")
        if not 1 <= n_nodes <= 250:
            raise HarnessError(f"netns harness supports 1..250 nodes, got {n_nodes}")
        self.n_nodes = n_nodes
        self.tag = tag or f"{os.getpid() % 100000}"  # pid-based: parallel runs never collide
        self.switch = f"e2b{self.tag}sw"
        self._made: list[str] = []
        self._shaped: dict[tuple[int, str], float] = {}

    def ns(self, k: int) -> str:
        return f"e2b{self.tag}n{k}"

    def ip(self, k: int) -> str:
        return f"10.77.0.{k + 1}"

    def _dev(self, k: int, side: str) -> str:
        return f"b{self.tag}{side}{k}"  # <= 15 chars

    def __enter__(self) -> NetnsTopology:
        try:
            self.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self) -> None:
        _run("ip", "netns", "add", self.switch)
        self._made.append(self.switch)
        sw = ["ip", "-n", self.switch]
        _run(*sw, "link", "add", "name", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0")
        _run(*sw, "link", "set", "br0", "up")
        for k in range(self.n_nodes):
            ns, a, b = self.ns(k), self._dev(k, "n"), self._dev(k, "s")
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            _run(
                "ip",
                "link",
                "add",
                "name",
                a,
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                b,
                "netns",
                self.switch,
            )
            _run(*sw, "link", "set", b, "master", "br0")
            _run(*sw, "link", "set", b, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.ip(k)}/24", "dev", a)
            _run("ip", "-n", ns, "link", "set", a, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        self._static_neighbours()
        log.info("netns topology %s: %d nodes behind bridge in %s", self.tag, self.n_nodes, self.switch)

    def _static_neighbours(self) -> None:
        """Permanent ARP entries: with N^2 connections opening at once, broadcast ARP through shaped
        ports gets dropped and stalls connects for seconds; a real WAN has no such shared L2."""
        macs = []
        for k in range(self.n_nodes):
            out = subprocess.run(["ip", "-n", self.ns(k), "-j", "link", "show", "dev", self._dev(k, "n")],
                                 capture_output=True, text=True, check=True).stdout  # fmt: skip
            macs.append(json.loads(out)[0]["address"])
        for k in range(self.n_nodes):
            lines = [
                f"neigh replace {self.ip(j)} lladdr {macs[j]} dev {self._dev(k, 'n')} nud permanent"
                for j in range(self.n_nodes)
                if j != k
            ]
            res = subprocess.run(["ip", "-n", self.ns(k), "-batch", "-"], input="\n".join(lines) + "\n",
                                 capture_output=True, text=True)  # fmt: skip
            if res.returncode != 0:
                raise HarnessError(f"static neighbours in {self.ns(k)} failed: {res.stderr.strip()}")

    def shape(self, k: int, up_bps: float | None, down_bps: float | None) -> None:
        """Cap node ``k``'s uplink / downlink (bits/s; None = uncapped) with tbf qdiscs."""
        for direction, rate, ns, dev in (
            ("up", up_bps, self.ns(k), self._dev(k, "n")),
            ("down", down_bps, self.switch, self._dev(k, "s")),
        ):
            if self._shaped.get((k, direction)) == rate:
                continue
            if rate is None:
                subprocess.run(
                    ["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True
                )
            else:
                # burst >= one GSO super-packet (64 KiB) or tbf stalls; queue ~100 ms of line rate.
                burst = max(96 << 10, int(rate / 8 / 100))
                limit = max(256 << 10, int(rate / 8 * QUEUE_SECONDS))
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                     "rate", f"{int(rate)}bit", "burst", str(burst), "limit", str(limit))  # fmt: skip
            self._shaped[(k, direction)] = rate  # type: ignore[assignment]

    def exec_prefix(self, k: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns(k)]

    def close(self) -> None:
        """Delete every namespace this topology made (their veths and the bridge go with them)."""
        for ns in reversed(self._made):
            res = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
            if res.returncode != 0:
                log.warning("could not delete namespace %s: %s", ns, res.stderr.strip())
        if self._made:
            log.info("netns topology %s removed (%d namespaces)", self.tag, len(self._made))
        self._made.clear()
        self._shaped.clear()
