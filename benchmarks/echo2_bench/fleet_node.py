"""A fleet of simulated members against the real learner node (``benchmarks/fleet.py --study node``).

Each member is what a stock worker is to the learner, less the model: its own identity registered with
the run's join token, its own TLS connections from a loopback address of its own (127.0.0.2-254 in turn,
so the perimeter's per-address rules see a fleet, not one machine), heartbeats at the cadence the
learner's settings give, and the stock worker's lease loop: ask for a lease; refused, wait the
``retry_after_s`` the refusal says (1 s after a refused request); granted, "generate" for the member's
pace (``PACE_S`` +- 20%), then submit the lease's groups asking for the next lease in the same round trip.
A group holds real-length completions (``LENGTHS`` tokens: filler text, then ``\\boxed{answer}`` and
EOS), half of them with the sum's right answer worked out from the prompt, so the learner's grader agrees
with some and the groups carry signal. Nobody samples them: the run turns the generation check off
(``security.check_fraction = 0``, ``check_first = 0``), as the issue's measurement did. No weights move:
a member claims as installed the newest version the learner has published, read from the run
directory's ``published/`` once a second for the whole fleet (the stand-in for the broadcast's
announcements: a member holds each version as soon as it is out); a lease refused as
``unpublished_version`` (the file written before the publication was announced) takes the version the
refusal names.

Every call is timed as a worker sees it (the client's own retries of 429 and 503 included) and counted
by endpoint and outcome: 200, a refusal (status and error), or a failure (no answer: ``LearnerGone``).
A figure of the runtime: the real node, the real protocol, loopback links.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from echo2.protocol import (
    HeartbeatRequest,
    LeaseGrant,
    LeaseRequest,
    RegisterRequest,
    SubmitRequest,
    group_to_wire,
)
from echo2.rollout.client import LearnerClient, LearnerGone, Refused
from echo2.types import Trajectory
from echo2_bench.perimeter import SOURCES

PACE_S = 20.0  # seconds a member "generates" one lease (the issue's: one lease every 20 s +- 20%)
LENGTHS = (372, 770)  # completion tokens, uniform (the real lengths)
REQUEST_TIMEOUT_S = 120.0  # a call that takes longer counts as failed
RECONNECT_S = 60.0  # the client's retry window for refused connections, 429 and 503
FILLER = (
    "First add the ones, then carry into the tens and add them, then the hundreds; check each column "
    "again before writing the total down. "
)


@dataclass
class Tally:
    """What the fleet saw: latencies by endpoint, outcomes by endpoint, registration times."""

    latency: dict[str, list[float]] = field(default_factory=dict)  # endpoint -> seconds of each 200
    outcomes: dict[str, dict[str, int]] = field(default_factory=dict)  # endpoint -> outcome -> count
    registered_at: list[float] = field(default_factory=list)  # seconds from the fleet's start
    refusals: dict[str, int] = field(default_factory=dict)  # lease refusals by reason
    admitted: int = 0
    dropped_stale: int = 0
    granted_prompts: int = 0

    def count(self, endpoint: str, outcome: str, seconds: float | None = None) -> None:
        table = self.outcomes.setdefault(endpoint, {})
        table[outcome] = table.get(outcome, 0) + 1
        if seconds is not None:
            self.latency.setdefault(endpoint, []).append(seconds)


class Codec:
    """The run's tokenizer and chat format, read from the model skeleton the learner serves (as a worker
    reads it), shared by every member."""

    def __init__(self, codec: Any, eos: int) -> None:
        self.codec, self.eos = codec, eos
        self.filler = list(codec.tokenizer(FILLER * 40, add_special_tokens=False)["input_ids"])

    @classmethod
    async def fetch(cls, join: str, token: str) -> Codec:
        """Register one identity (counted: the fleet's template), read the skeleton: the codec."""
        import tempfile

        import aiohttp

        from echo2.models.policy import ChatFormat, TextCodec
        from echo2.models.snapshot import tokenizer_from_skeleton, write_skeleton
        from echo2.rollout.worker import _eos_ids  # the worker's reading of the run's end tokens

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as s:
            client = LearnerClient(join, s, reconnect_s=RECONNECT_S)
            reg = await client.register(RegisterRequest(name="fleet-template", usd_per_hour=0.35), token)
            skeleton = await client.model()
        st = reg.settings
        with tempfile.TemporaryDirectory(prefix="echo2-fleet-") as tmp:
            write_skeleton(skeleton.files, Path(tmp))
            tokenizer = tokenizer_from_skeleton(Path(tmp))
        chat = ChatFormat.of(st.chat_template, st.system_prompt, st.chat_template_kwargs)
        return cls(TextCodec.of(tokenizer, chat), _eos_ids(st.eos_ids, tokenizer)[0])

    def groups(self, grant: LeaseGrant, rng: random.Random) -> list[Any]:
        """The lease's groups: real-length completions, half of them ending in the sum's right answer."""
        out = []
        for i, p in enumerate(grant.prompts):
            prompt = p.prompt()
            ids = tuple(self.codec.encode(prompt))
            nums = [int(x) for x in re.findall(r"\d+", prompt.text)]
            right = str(sum(nums[:2])) if len(nums) >= 2 else "0"
            rows = []
            for _ in range(grant.group_size):
                answer = right if rng.random() < 0.5 else str(int(right) + 1 + rng.randrange(9))
                tail = list(
                    self.codec.tokenizer(f" \\boxed{{{answer}}}", add_special_tokens=False)["input_ids"]
                )
                n = rng.randint(*LENGTHS) - len(tail) - 1
                start = rng.randrange(len(self.filler) - n) if len(self.filler) > n else 0
                body = (self.filler * (1 + n // max(1, len(self.filler))))[start : start + n]
                completion = (*body, *tail, self.eos)
                rows.append(
                    Trajectory(
                        p.prompt_id,
                        f"{grant.lease_id}:{i}",
                        ids,
                        completion,
                        (-1.0,) * len(completion),
                        0.0,
                        0,
                    )
                )
            out.append(group_to_wire(rows))
        return out


class Published:
    """The newest version the learner has published, from its run directory's ``published/`` (one
    listing a second for the whole fleet)."""

    def __init__(self, run_dir: Path) -> None:
        self.where = run_dir / "published"
        self.newest = 0

    async def follow(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                names = [f.name for f in os.scandir(self.where)]
                got = [int(n[1:11]) for n in names if re.fullmatch(r"v\d{10}\.bin", n)]
                self.newest = max([self.newest, *got])
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)


class Member:
    """One simulated member: registration, heartbeats and the stock worker's lease loop."""

    def __init__(
        self, i: int, join: str, token: str, codec: Codec, tally: Tally, t0: float, published: Published
    ) -> None:
        self.i, self.join, self.token, self.codec, self.tally, self.t0 = i, join, token, codec, tally, t0
        self.published = published
        self.rng = random.Random(f"member:{i}")
        self.attempt = secrets.token_urlsafe(16)  # one registration, however often it is sent
        self._version = 0  # what a refusal named as published
        self.epoch = 0  # the run epoch of the manifests it "installs" (a lease is refused for another)
        self.worker_id = ""

    async def _timed(self, endpoint: str, call: Any) -> Any:
        """Await ``call``; count its outcome under ``endpoint``; None where it was refused or failed."""
        t = time.perf_counter()
        try:
            got = await asyncio.wait_for(call, REQUEST_TIMEOUT_S)
        except Refused as exc:
            self.tally.count(endpoint, f"{exc.status} {exc.reply.error}")
            return None
        except (LearnerGone, TimeoutError) as exc:
            self.tally.count(endpoint, f"failed {type(exc).__name__}")
            return None
        self.tally.count(endpoint, "200", time.perf_counter() - t)
        return got

    async def run(self, stop: asyncio.Event, shared: Any = None) -> None:
        """Register, then heartbeats and leases until ``stop``; over connections of its own, or over
        ``shared`` (an aiohttp session of its address's members: its pool of connections)."""
        import aiohttp

        if shared is not None:
            await self._serve(shared, stop)
            return
        connector = aiohttp.TCPConnector(local_addr=(SOURCES[self.i % len(SOURCES)], 0))
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await self._serve(session, stop)

    async def _serve(self, session: Any, stop: asyncio.Event) -> None:
        client = LearnerClient(self.join, session, reconnect_s=RECONNECT_S, give_up=stop.is_set)
        reg = None
        while reg is None and not stop.is_set():
            req = RegisterRequest(
                name=f"sim{self.i}", usd_per_hour=0.35, rollouts_per_s=8 / PACE_S, attempt=self.attempt
            )
            reg = await self._timed("register", client.register(req, self.token))
            if reg is None:
                await asyncio.sleep(1.0 + self.rng.random())
        if reg is None:
            return
        self.worker_id = reg.worker_id
        self.tally.registered_at.append(time.perf_counter() - self.t0)
        await self._current(client)
        beats = asyncio.ensure_future(self._heartbeats(client, reg.settings.heartbeat_s, stop))
        try:
            await self._leases(client, reg.settings.lease_prompts, stop)
        finally:
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beats

    @property
    def version(self) -> int:
        return max(self._version, self.published.newest)

    async def _current(self, client: LearnerClient) -> None:
        """The published version's epoch, as a worker reads it before installing (no weights move)."""
        got = await self._timed("version", client.version())
        if got is not None and got.version is not None:
            self._version = max(self._version, got.version)
            self.epoch = int((got.manifest or {}).get("lineage", {}).get("epoch", 0))

    async def _heartbeats(self, client: LearnerClient, every_s: float, stop: asyncio.Event) -> None:
        await asyncio.sleep(self.rng.random() * every_s)  # spread over the period, as start times are
        while not stop.is_set():
            beat = await self._timed(
                "heartbeat",
                client.heartbeat(HeartbeatRequest(rollouts=0, busy_s=0.0, installed_version=self.version)),
            )
            # the learner's cadence for its fleet, as the stock worker follows it (absent before it)
            every_s = getattr(beat, "heartbeat_s", None) or every_s
            await asyncio.sleep(every_s)

    def _ask(self, prompts: int) -> LeaseRequest:
        return LeaseRequest(max_prompts=prompts, installed_version=self.version, installed_epoch=self.epoch)

    async def _leases(self, client: LearnerClient, prompts: int, stop: asyncio.Event) -> None:
        nxt: Any = None
        while not stop.is_set():
            got = nxt
            nxt = None
            if got is None:
                got = await self._timed("lease", client.lease(self._ask(prompts)))
            if got is None:  # the request itself refused: again in 1 s, as the stock worker does
                await asyncio.sleep(1.0)
                continue
            if not isinstance(got, LeaseGrant):
                self.tally.refusals[got.reason] = self.tally.refusals.get(got.reason, 0) + 1
                if got.reason == "finished":
                    return
                if got.reason in ("stale_epoch", "rolled_back") and got.min_version is not None:
                    await self._current(client)  # a restarted learner: its manifest again
                elif got.reason == "unpublished_version" and got.min_version is not None:
                    self._version = got.min_version
                await asyncio.sleep(got.retry_after_s)
                continue
            self.tally.granted_prompts += len(got.prompts)
            version = max(self.version, got.min_version)
            with contextlib.suppress(asyncio.TimeoutError):  # "generating"; a stop ends it
                await asyncio.wait_for(stop.wait(), PACE_S * self.rng.uniform(0.8, 1.2))
            if stop.is_set():
                return
            req = SubmitRequest(
                lease_id=got.lease_id,
                policy_version=version,
                groups=self.codec.groups(got, self.rng),
                next_lease=self._ask(prompts).model_dump(),
            )
            reply = await self._timed("submit", client.submit(req))
            if reply is not None:
                self.tally.admitted += reply.admitted
                self.tally.dropped_stale += reply.dropped_stale
                nxt = reply.next_lease


async def fleet(
    join: str,
    token: str,
    n: int,
    codec: Codec,
    run_dir: Path,
    stop: asyncio.Event,
    tally: Tally,
    per_address: int = 0,
) -> None:
    """``n`` members started at once (each registers as it can), run until ``stop``. ``per_address``
    (0: each member its own connections): the members of one address share a pool of that many
    connections (where the machine's descriptors cannot hold two per member)."""
    import aiohttp

    t0 = time.perf_counter()
    published = Published(run_dir)
    following = asyncio.ensure_future(published.follow(stop))
    members = [Member(i, join, token, codec, tally, t0, published) for i in range(n)]
    pools: list[Any] = []
    if per_address:
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        pools = [
            aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(local_addr=(a, 0), limit=per_address), timeout=timeout
            )
            for a in SOURCES[: min(n, len(SOURCES))]
        ]
    tasks = [asyncio.ensure_future(m.run(stop, pools[m.i % len(pools)] if pools else None)) for m in members]
    await stop.wait()
    await following
    done, pending = await asyncio.wait(tasks, timeout=30)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for t in done:
        if not t.cancelled() and t.exception() is not None:
            tally.count("member", f"crashed {type(t.exception()).__name__}: {t.exception()}")
    for session in pools:
        await session.close()


def quantiles(xs: list[float]) -> dict[str, float | int]:
    """Count, p50, p99 and max of ``xs`` (seconds)."""
    if not xs:
        return {"n": 0}
    s = sorted(xs)
    q = lambda p: s[min(len(s) - 1, int(p * len(s)))]  # noqa: E731
    return {"n": len(s), "p50": q(0.5), "p99": q(0.99), "max": s[-1]}
