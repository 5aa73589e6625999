"""Attackers that starve the learner rather than lie in a completion (``benchmarks/adversary.py``, study
``stale_flood``), for ``adversary_runs.liveness_run``'s window beside one honest worker:

- ``stale_hoard(k)``: ``k`` identities lease claiming the oldest admissible published version, wait until
  their answer is too stale to admit, and answer with typed groups (well formed, made up): before, a stale
  answer counted as a returned lease, so they left probation and held most of the in-flight budget;
- ``flood(width)``: a **proven forger** (an identity that passes its first checks honestly and then
  rewrites every wrong answer of its completions into the right one, the answer worked out from the
  prompt, claiming the weights' log-probs) and, from the moment it is proven, ``width`` fresh identities
  doing honest one-prompt work at once (each of their first submissions drawn for the check), a new
  identity for each that is caught or idle.

:func:`honest_stale_share` reads the store: of the honest worker's answered leases in a window, the share of
their groups dropped as stale (at submission, or later in the buffer).

Every identity comes from a loopback address of its own (127.0.0.2-254: all of 127/8 is loopback on
Linux), as attackers on many machines would, never the honest worker's (127.0.0.1): the perimeter's
per-address caps would otherwise throttle the honest worker with them, and bind the attack less than a
real one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sqlite3
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

ATTACK_TIMEOUT_S = 60.0
ADDRESSES = itertools.cycle(SOURCES)  # the perimeter study's attacker addresses, in turn


def session_from() -> Any:
    """An aiohttp session whose connections come from the next attacker address."""
    import aiohttp

    connector = aiohttp.TCPConnector(local_addr=(next(ADDRESSES), 0))
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=ATTACK_TIMEOUT_S))


async def _hoard_one(att: Any, token: str, stop: asyncio.Event, tally: dict[str, int]) -> None:
    """One stale hoarder (its own identity and address; the codec of ``att``, which set up like a worker)."""
    async with session_from() as session:
        await _hoard(att, LearnerClient(att.w.opts.join_url, session, reconnect_s=30.0), token, stop, tally)


async def _hoard(
    att: Any, client: LearnerClient, token: str, stop: asyncio.Event, tally: dict[str, int]
) -> None:
    await client.register(RegisterRequest(name="attacker-stale", usd_per_hour=0.35), token)
    epoch = att.w._follower().epoch
    while not stop.is_set():
        try:
            beat = await client.heartbeat(HeartbeatRequest(rollouts=0, busy_s=0.0, installed_version=0))
            lease = None
            for v in range(beat.min_version, beat.version + 1):  # the oldest admissible it may claim
                got = await client.lease(
                    LeaseRequest(max_prompts=8, installed_version=v, installed_epoch=epoch)
                )
                if isinstance(got, LeaseGrant):
                    lease = (got, v)
                    break
                tally[got.reason] = tally.get(got.reason, 0) + 1
                if got.reason != "unpublished_version":
                    break
            if lease is None:
                await asyncio.sleep(0.5)
                continue
            grant, v = lease
            tally["granted_prompts"] = tally.get("granted_prompts", 0) + len(grant.prompts)
            while not stop.is_set():  # hold it until its answer is too stale to admit
                now = await client.heartbeat(HeartbeatRequest(rollouts=0, busy_s=0.0, installed_version=v))
                if now.min_version > v:
                    break
                await asyncio.sleep(0.2)
            reply = await client.submit(
                SubmitRequest(lease_id=grant.lease_id, policy_version=v, groups=_typed(att, grant))
            )
            key = "dropped_stale" if reply.dropped_stale else "admitted"
            tally[key] = tally.get(key, 0) + 1
        except Refused as exc:
            tally[exc.reply.error] = tally.get(exc.reply.error, 0) + 1
            await asyncio.sleep(0.5)


def _typed(att: Any, grant: LeaseGrant) -> list[Any]:
    """Well-formed groups nobody sampled: the leased prompts' own tokens, a one-digit answer and EOS."""
    codec, eos = att.w.codec, int(att.w.engine.eos_ids[0])
    digit = codec.tokenizer("7", add_special_tokens=False)["input_ids"]
    groups = []
    for i, p in enumerate(grant.prompts):
        ids = tuple(codec.encode(p.prompt()))
        t = Trajectory(
            p.prompt_id, f"{grant.lease_id}:{i}", ids, (*digit, eos), (-0.5,) * (len(digit) + 1), 0.0, 0
        )
        groups.append(group_to_wire([t] * grant.group_size))
    return groups


def stale_hoard(k: int) -> Any:
    """The liveness window's attack: ``k`` stale hoarders."""

    async def attack(info: dict[str, Any], token: str, run_dir: Path, stop: asyncio.Event) -> dict[str, Any]:
        from echo2_bench.adversary import Attacker

        tally: dict[str, int] = {}
        async with session_from() as session:
            att = Attacker(info["join"], token, "honest", session)
            await att.start()
            tasks = [asyncio.ensure_future(_hoard_one(att, token, stop, tally)) for _ in range(k)]
            await stop.wait()
            await _cancel(tasks)
            await att.close()
        return {"identities": k, **tally}

    return attack


async def _flood_one(
    att: Any, token: str, lock: asyncio.Lock, stop: asyncio.Event, tally: dict[str, int]
) -> None:
    """Fresh identities, one after the other, each from an address of its own, doing honest one-prompt
    work until it cannot lease."""
    me: dict[str, Any] = {"client": None, "session": None, "refused": 0}
    try:
        while not stop.is_set():
            await _flood_step(att, token, lock, tally, me)
    finally:  # the session of the identity in use (cancelled or not) is closed
        if me["session"] is not None:
            await me["session"].close()


async def _flood_step(
    att: Any, token: str, lock: asyncio.Lock, tally: dict[str, int], me: dict[str, Any]
) -> None:
    """One lease of a flooding identity (a fresh one, and its own address, when it was caught or idle);
    ``me`` holds its client, session and refusals in a row."""
    try:
        if me["client"] is None or me["refused"] > 20:  # caught, or idle for long: a fresh identity
            if me["session"] is not None:
                await me["session"].close()
            me["session"] = session_from()
            me["client"] = LearnerClient(att.w.opts.join_url, me["session"], reconnect_s=30.0)
            me["refused"] = 0
            await me["client"].register(RegisterRequest(name="flood", usd_per_hour=0.35), token)
            tally["identities"] = tally.get("identities", 0) + 1
        client = me["client"]
        async with lock:  # stay current like an honest worker (cheap when it is)
            await att.w._follower().fetch()
        got = await client.lease(
            LeaseRequest(
                max_prompts=1, installed_version=att.w.installed, installed_epoch=att.w._follower().epoch
            )
        )
        if not isinstance(got, LeaseGrant):
            tally[got.reason] = tally.get(got.reason, 0) + 1
            me["refused"] += 1
            await asyncio.sleep(min(got.retry_after_s, 0.5))
            return
        async with lock:  # one generation at a time on the one engine
            groups = await asyncio.to_thread(att._generate, got)
        groups_wire = [group_to_wire(g) for g in groups]
        reply = await client.submit(
            SubmitRequest(lease_id=got.lease_id, policy_version=att.w.installed, groups=groups_wire)
        )
        key = "pending_check" if reply.pending_check else "admitted" if reply.admitted else "dropped_stale"
        tally[key] = tally.get(key, 0) + 1
    except Refused as exc:
        tally[exc.reply.error] = tally.get(exc.reply.error, 0) + 1
        if exc.reply.error in ("quarantined", "retired"):
            me["client"] = None
        await asyncio.sleep(0.2)


def flood(width: int) -> Any:
    """The liveness window's attack: a flood of ``width`` fresh identities at a time beside a proven forger
    (honest until it has passed ``check_first`` checks, then rewriting every wrong answer)."""

    async def attack(info: dict[str, Any], token: str, run_dir: Path, stop: asyncio.Event) -> dict[str, Any]:
        from echo2_bench.adversary import Attacker
        from echo2_bench.adversary_length import LengthAttacker

        tally: dict[str, int] = {}
        outcomes: list[str] = []
        async with session_from() as session:
            worker = Attacker(info["join"], token, "honest", session, max_prompts=1)
            forger = LengthAttacker(info["join"], token, "forger", session)
            await worker.start()
            await forger.start()
            lock = asyncio.Lock()
            tasks: list[asyncio.Future[Any]] = []
            while not stop.is_set() and (
                not outcomes or outcomes[-1] not in ("quarantined", "forged_generation")
            ):
                async with lock:
                    try:
                        outcomes.append(await forger.submit_one())
                    except Refused as exc:  # any call of a quarantined identity
                        outcomes.append(exc.reply.error)
                if outcomes and outcomes[-1] == "no_lease":
                    outcomes.pop()
                    await asyncio.sleep(0.3)
                if forger.lying and not tasks:  # proven: now the flood comes, and it lies
                    tasks = [
                        asyncio.ensure_future(_flood_one(worker, token, lock, stop, tally))
                        for _ in range(width)
                    ]
            await stop.wait()
            await _cancel(tasks)
            quarantined = await _caught(forger)
            with contextlib.suppress(LearnerGone):  # the learner may stop first: the tally stands
                await worker.close()
                await forger.close()
        return {
            "width": width,
            "flood": tally,
            "forger_outcomes": outcomes,
            "forger_quarantined": quarantined,
            "forger_lied_from": forger.check_first,
            "forger_forged_groups": sorted(forger.forged),
            "forger_admitted_forged": sorted(forger.admitted_forged),
        }

    return attack


async def _caught(att: Any) -> bool:
    try:
        await att.w.client.version()
    except Refused as exc:
        return exc.reply.error == "quarantined"
    return False


async def _cancel(tasks: list[asyncio.Future[Any]]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t


def honest_stale_share(run_dir: Path, name: str, since: float, until: float) -> dict[str, float]:
    """Of the leases of the worker named ``name`` answered between ``since`` and ``until`` (clock seconds),
    the groups answered and the share of them dropped as stale (at submission, or later in the buffer)."""
    import json

    names = {w["worker_id"]: w["name"] for w in json.loads((run_dir / "workers.json").read_text())}
    ids = [w for w, n in names.items() if n == name]
    db = sqlite3.connect(run_dir / "store.sqlite")
    marks = ",".join("?" * len(ids))
    rows = db.execute(
        "SELECT l.n_prompts, COUNT(g.group_id), SUM(CASE WHEN g.consumed_step = -1 THEN 1 ELSE 0 END) "
        f"FROM leases l LEFT JOIN rollout_groups g USING (lease_id) WHERE l.worker_id IN ({marks}) "
        "AND l.state = 'submitted' AND l.submitted_at BETWEEN ? AND ? GROUP BY l.lease_id",
        [*ids, since, until],
    ).fetchall()
    db.close()
    answered = sum(int(n) for n, _, _ in rows)
    stale = sum(int(n) - int(stored) + int(later or 0) for n, stored, later in rows)
    return {"groups_answered": answered, "stale_groups": stale, "stale_share": stale / max(1, answered)}
