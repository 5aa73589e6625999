"""What the members' install acks say of the relays they pulled from, and the links the next trees are
built over (``publisher.TcpPublisher``).

A relay that sends, but slower than its peers, slows every member below it in its stripe for every
version. Under a quarter of the pace of a member's other sources it is cut as a stall
(``wire.lagging``); above that nothing reported it, and a member that declared a fast upload link
(``RegisterRequest.uplink_mbps``) kept its place near a stripe's root whatever it delivered. Each
install ack now carries, for every peer its member pulled a stripe from, that stream's pace over the
member's other sources' (``wire.relative_pace``: a member's streams share its downlink and each carries
one stripe at about the stripe rate, so an honest relay reads about 1).

:class:`Conduct` keeps those paces per version, and ``READ_AFTER`` versions later (acks come late)
finds a relay **slow** when at least ``SLOW_REPORTS`` of its children read it under ``SLOW_PACE`` of
their other sources (their median), unless a source of its own was found slow in that version (it
passed on what it got, as the stall reports' exoneration has it: ``publisher._exonerate``). A slow
relay's link is taken as that fraction of the fleet's median link (declared, or a common unit where
not every relay declared one; never its own claim) for ``SLOW_VERSIONS`` versions, so the link-aware
trees (``strategy.LinkAware``, ``pipelined.TreePipelined.tree``, built afresh when a link moves by
more than 2x) place it at the leaves, where it serves nobody and still pulls from peers (a demoted
relay pulls from the learner); then it relays as declared again and is read again.

What a liar can do with it: its own paces name only the peers its plan has it pull from and count once
per version; one child alone cannot make a relay slow (``SLOW_REPORTS`` = 2), so an honest relay is
placed low only by two colluding children of the same version, and only for ``SLOW_VERSIONS``; a relay
cannot excuse itself by reporting its own source slow unless that source's other children agree.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Mapping, Sequence

from echo2.broadcast.strategy import LEARNER

SLOW_PACE = 0.5  # a relay read by its children under this share of their other sources' pace ...
SLOW_REPORTS = 2  # ... by at least this many of them (their median) is slow
SLOW_VERSIONS = 8  # versions a finding holds before the relay relays as declared again
READ_AFTER = 2  # a version's acks are read this many versions after it (acks arrive late)


class Conduct:
    """The paces install acks report, per version, and the relays found slow from them."""

    def __init__(self) -> None:
        self._heard: dict[int, dict[str, list[float]]] = {}  # version -> relay -> its children's paces
        self._sources: dict[int, dict[str, frozenset[str]]] = {}  # version -> member -> its planned sources
        self._slow: dict[str, tuple[float, int]] = {}  # relay -> (its pace, the last version it holds for)
        self._done = -1  # the newest version read: later acks of it are not heard
        self.findings = 0  # relays found slow so far (a relay found again counts again)

    def heard(self, version: int, member: str, pace: Mapping[str, float], sources: Collection[str]) -> None:
        """A counted install ack of ``version`` from ``member``, whose plan had it pull from ``sources``:
        ``pace`` of each of them (peers outside its plan, and the learner, are not listened to)."""
        if version <= self._done:
            return  # read already
        self._sources.setdefault(version, {})[member] = frozenset(sources)
        heard = self._heard.setdefault(version, {})
        for source, p in pace.items():
            if source in sources and source not in (LEARNER, member):
                heard.setdefault(source, []).append(p)

    def _read(self, version: int) -> None:
        """Find the slow relays of every version up to ``version - READ_AFTER`` and forget those versions;
        findings past their ``SLOW_VERSIONS`` are dropped."""
        for v in sorted(set(self._heard) | set(self._sources)):
            if v > version - READ_AFTER:
                break
            heard, sources = self._heard.pop(v, {}), self._sources.pop(v, {})
            self._done = max(self._done, v)
            medians = {s: statistics.median(ps) for s, ps in heard.items() if len(ps) >= SLOW_REPORTS}
            slow = {s for s, m in medians.items() if m < SLOW_PACE}
            for s in slow:
                if not sources.get(s, frozenset()) & slow:  # not starved by a slow source of its own
                    self._slow[s] = (medians[s], v + SLOW_VERSIONS)
                    self.findings += 1
        self._slow = {w: f for w, f in self._slow.items() if f[1] >= version}

    def slow(self) -> dict[str, float]:
        """The relays found slow now -> the pace they were read at."""
        return {w: p for w, (p, _) in self._slow.items()}

    def links(
        self, version: int, members: Sequence[str], declared: Mapping[str, float | None], unit: float
    ) -> dict[str, float | None]:
        """The upload rates to plan ``version`` over: ``declared`` (None: not declared) as they are while
        no member is slow; else every member's declared rate (``unit`` for all where one did not
        declare), and a slow one's the fleet's median times its pace: what it claimed is not believed
        (a member that declared ten times the others' link and delivers a third of their pace would
        still rank above them at its own claim times its pace)."""
        self._read(version)
        slow = {w: self._slow[w][0] for w in members if w in self._slow}
        if not slow:
            return {w: declared.get(w) for w in members}
        base = {w: r for w in members if (r := declared.get(w)) is not None}
        if len(base) < len(members):  # not every member declared one: the unit for all
            base = dict.fromkeys(members, unit)
        typical = statistics.median(base.values())
        return {w: typical * slow[w] if w in slow else base[w] for w in members}
