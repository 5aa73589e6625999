"""Attackers for the adversary benchmark and its integration test: strangers holding the run's join
token who set up exactly like a real worker (``RolloutWorker.setup``: register, build the engine on the
learner's skeleton, install the current snapshot over HTTP, verified) and then lie in one way.

Each attack kind (ATTACKS) turns an honest generation into what that attacker submits:

- sampled checks catch: ``model`` (generates with other weights: the installed ones plus noise),
  ``logprobs`` (tampered sampler log-probs, which would move the importance weights), ``cherry``
  (best-of-n: n draws per prompt under other seeds, the best-rewarded submitted as the lease's),
  ``inflated`` (never installs a newer version, claims the newest published one);
- never believed: ``reward`` (forged rewards: the learner grades every completion itself, so what it
  stores is its own grade);
- every submission is refused: ``prompt`` (foreign prompt tokens), ``deflated`` (claims an older
  published version than it held at lease time), ``replay`` (the same submission twice),
  ``poison_100`` / ``poison_1e4`` / ``poison_1e30`` (every sampler log-prob -100, -1e4 or -1e30:
  below what a sampler can draw; admitted, they overflowed ``exp`` in the loss),
  ``unpublished`` (claims a version between the one it held at lease time and the newest published
  that was never published: with kappa = 2 an odd one, whose weights the learner never held).

Attackers that never submit a forgery (``Liar``: registers at 10,000 rollouts/s for $0.01/h and only
heartbeats; ``Hoarder``: leases all it may and never answers) live at the end of this module.

:func:`attack_until_caught` runs trials: each registers a fresh identity and submits until the learner
answers ``quarantined`` (or a budget runs out, or the pool stops leasing to it: ``released``), and
reports how many submissions each trial took.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from echo2.protocol import HeartbeatRequest, LeaseGrant, LeaseRequest, SubmitRequest, group_to_wire
from echo2.rollout.client import LearnerClient, Refused
from echo2.rollout.worker import RolloutWorker, WorkerOptions
from echo2.tasks.registry import build_task
from echo2.types import Prompt, Trajectory

log = logging.getLogger(__name__)

SAMPLED = ("model", "logprobs", "cherry", "inflated")  # caught by the sampled generation check
POISONS = {"poison_100": -100.0, "poison_1e4": -1e4, "poison_1e30": -1e30}  # every sampler log-prob
# refused on every submission
DETERMINISTIC = ("prompt", "deflated", "replay", *POISONS, "unpublished")
REGRADED = ("reward",)  # admitted, with the learner's grades in place of the claimed rewards
ATTACKS = SAMPLED + REGRADED + DETERMINISTIC
# refusals that quarantine (tasks/verify.py: EVIDENCE)
EVIDENCE = ("forged_generation", "reward_mismatch", "episode_mismatch", "turn_mask")
CHERRY_N = 4  # draws per prompt a best-of-n attacker picks from
NO_LEASE_LIMIT = 60  # lease refusals in a row (about a minute) that end a trial as "released"


@dataclass
class Trial:
    """One identity of one attacker: what its submissions got, in order."""

    kind: str
    worker_id: str
    outcomes: list[str] = field(default_factory=list)  # "admitted" or the refusal reason, per submission
    quarantined_after: int | None = None  # submissions until the learner answered "quarantined"
    released: bool = False  # the pool stopped leasing to it (a surplus worker) before it was caught


class Attacker:
    """A real worker's setup, then lies of one ``kind`` (the honest generation is its raw material)."""

    def __init__(
        self, join: str, token: str, kind: str, session: aiohttp.ClientSession, max_prompts: int | None = None
    ) -> None:
        if kind not in self.forges():
            raise ValueError(f"unknown attack {kind!r}; one of {sorted(self.forges())}")
        self.kind = kind
        self.max_prompts = max_prompts  # prompts per lease (None: what the run's settings say)
        opts = WorkerOptions(join_url=join, token=token, name=f"attacker-{kind}", trust_run_code=True)
        self.w = RolloutWorker(opts, build_task)  # an attacker runs whatever the run names
        self.w.client = LearnerClient(join, session, reconnect_s=30.0, give_up=lambda: self.w.finished)
        self._hb: asyncio.Task[None] | None = None

    def forges(self) -> dict[str, Callable[..., list[list[Trajectory]]]]:
        """The lies this attacker knows (a kind -> what it does to an honest generation)."""
        return FORGE

    async def start(self) -> None:
        self.w._loop = asyncio.get_running_loop()
        await self.w.setup()
        assert self.w._heartbeat_task is not None
        self.w._heartbeat_task.cancel()  # ours instead: it never re-registers by itself
        self._hb = asyncio.ensure_future(self._heartbeats())
        if self.kind == "model":
            self._perturb()

    async def close(self) -> None:
        self.w.finished = True
        if self._hb is not None:
            self._hb.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._hb

    async def new_identity(self) -> str:
        await self.w._register()
        return self.w.worker_id

    async def _heartbeats(self) -> None:
        while True:
            with contextlib.suppress(Refused):
                await self.w.client.heartbeat(
                    HeartbeatRequest(rollouts=0, busy_s=0.0, installed_version=self.w.installed)
                )
            await asyncio.sleep(self.w.settings.heartbeat_s)

    def _perturb(self) -> None:
        import torch

        model = self.w.engine.model  # type: ignore[attr-defined]
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * p.abs().mean() * torch.randn(p.shape, generator=gen))

    async def submit_one(self) -> str:
        """Lease, generate, lie, submit once; the outcome ("admitted", "pending_check": drawn for the
        check, whose verdict comes later, "no_lease" or the refusal)."""
        w = self.w
        if self.kind != "inflated":
            await w._follower().fetch()  # stay current like an honest worker
            if self.kind == "model":
                self._perturb()  # the new weights, perturbed again
        claim = await self._claimed_version()
        try:
            lease = await w.client.lease(
                LeaseRequest(
                    max_prompts=self.max_prompts or w.settings.lease_prompts,
                    installed_version=claim,
                    installed_epoch=w._follower().epoch,  # the run epoch of the weights it holds
                )
            )
        except Refused as exc:
            return exc.reply.error
        if not isinstance(lease, LeaseGrant):
            await asyncio.sleep(min(lease.retry_after_s, 1.0))
            return "no_lease"
        groups = await asyncio.to_thread(self._generate, lease)
        version = claim - 2 if self.kind == "deflated" else claim  # deflated: the published one before
        if self.kind == "unpublished":
            version = await self._unpublished_after(claim)
        req = SubmitRequest(
            lease_id=lease.lease_id, policy_version=version, groups=[group_to_wire(g) for g in groups]
        )
        outcome = await self._submit(req)
        # the store took the original (admitted, or dropped as stale on a slow machine: the lease is
        # submitted either way), so the copy is the replay under test
        if self.kind == "replay" and outcome in ("admitted", "pending_check", "dropped_stale"):
            outcome = await self._submit(req)
        return outcome

    async def _claimed_version(self) -> int:
        """The version it says it holds: the newest published for an inflating attacker (which keeps the
        weights it first installed), else the one it holds."""
        if self.kind == "inflated":
            latest = (await self.w.client.version()).version
            return latest if latest is not None else self.w.installed
        return self.w.installed

    async def _unpublished_after(self, held: int, wait_s: float = 20.0) -> int:
        """A version in (held, newest published] that was never published: with kappa = 2 the odd one
        below the newest (waits for the learner to publish past ``held``)."""
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            newest = (await self.w.client.version()).version or 0
            if newest >= held + 2 or asyncio.get_running_loop().time() >= deadline:
                return max(held + 1, newest - 1)
            await asyncio.sleep(0.2)

    async def _submit(self, req: SubmitRequest) -> str:
        try:
            reply = await self.w.client.submit(req)
        except Refused as exc:
            return exc.reply.error
        if reply.pending_check:  # drawn: held until the learner's check, which runs after this answer
            return "pending_check"
        return "admitted" if reply.admitted else "dropped_stale"

    def _generate(self, lease: LeaseGrant) -> list[list[Trajectory]]:
        from echo2.config import USER_CONTEXT_TOKENS
        from echo2.types import Bounds

        w, G = self.w, lease.group_size
        # it grades its own draws (cherry-picking) with what it can know: a public dataset's record (an
        # environment's episodes it plays to their return, as a worker does)
        prompts = [known(w.task, p.prompt()) for p in lease.prompts]
        prompts = [p if p.answer else solved(p) for p in prompts]
        st = w.settings
        bounds = Bounds(st.max_context or USER_CONTEXT_TOKENS, st.sampling.max_new_tokens)

        def draw(seed: int) -> list[list[Trajectory]]:
            batch = w.task.collect(
                w.codec,
                w.engine,
                prompts,
                G,
                seed=seed,
                policy_version=w.installed,
                group_prefix=lease.lease_id,
                bounds=bounds,
            )
            ts = batch.trajectories
            return [ts[i : i + G] for i in range(0, len(ts), G)]

        return self.forges()[self.kind](self, draw(lease.seed), lease, draw)


def known(task: Any, prompt: Prompt) -> Prompt:
    """``prompt`` with its answer as the public data the attacker can read holds it: a task read from a
    dataset file (code, math, verifiers: the bundled samples are public, as a published benchmark is) is
    read on the attacker's side too and the leased prompt found there by id and text; else as it is."""
    from echo2.data.tasks.base import FileSplitsAccess

    data = getattr(task, "data", None)
    if not isinstance(data, FileSplitsAccess):
        return prompt
    index = _PUBLIC.get(id(data))
    if index is None:
        index = _PUBLIC[id(data)] = {p.prompt_id: p for split in data.splits().values() for p in split}
    found = index.get(prompt.prompt_id)
    return found if found is not None and found.text == prompt.text else prompt


_PUBLIC: dict[int, dict[str, Prompt]] = {}  # a task's public records by prompt id (known)


def solved(prompt: Prompt) -> Prompt:
    """``prompt`` with the answer an attacker works out itself (a lease carries none): the value of the last
    arithmetic problem its text writes (``37+45=``, ``What is 37 + 45?``), or none."""
    from echo2.data.tasks.arithmetic import _evaluate, parse_problem

    found = re.findall(r"\d+(?:\s*[-+*]\s*\d+)+", prompt.text)
    if not found:
        return prompt
    operands, ops = parse_problem(found[-1].replace(" ", ""))
    return dataclasses.replace(prompt, answer=str(_evaluate(operands, ops)))


def _same(att: Attacker, groups: list[list[Trajectory]], lease: LeaseGrant, draw: Callable[..., Any]) -> Any:
    return groups


def _each(groups: list[list[Trajectory]], **change: Any) -> list[list[Trajectory]]:
    return [[dataclasses.replace(t, **change) for t in g] for g in groups]


def _logprobs(
    att: Attacker, groups: list[list[Trajectory]], lease: LeaseGrant, draw: Callable[..., Any]
) -> Any:
    return [
        [dataclasses.replace(t, sampler_logprobs=tuple(lp - 1.0 for lp in t.sampler_logprobs)) for t in g]
        for g in groups
    ]


def _cherry(
    att: Attacker, groups: list[list[Trajectory]], lease: LeaseGrant, draw: Callable[..., Any]
) -> Any:
    pools = [groups] + [draw(lease.seed + k) for k in range(1, CHERRY_N)]
    out = []
    for i, g in enumerate(groups):
        out.append([max((p[i][j] for p in pools), key=lambda t: t.reward) for j in range(len(g))])
    return out


def _reward(
    att: Attacker, groups: list[list[Trajectory]], lease: LeaseGrant, draw: Callable[..., Any]
) -> Any:
    return (
        _each(groups, reward=1.0)
        if any(t.reward != 1.0 for g in groups for t in g)
        else _each(groups, reward=0.0)
    )


def _prompt(
    att: Attacker, groups: list[list[Trajectory]], lease: LeaseGrant, draw: Callable[..., Any]
) -> Any:
    leased = {p.text for p in lease.prompts}  # a small task may lease "1+1=" itself: then it is no forgery
    text = next(t for k in itertools.count(1) if (t := f"{k}+{k}=") not in leased)
    return _each(groups, prompt_ids=tuple(att.w.codec.encode_prompt(text)))


def _poison(value: float) -> Callable[..., Any]:
    def forge(
        att: Attacker, groups: list[list[Trajectory]], lease: LeaseGrant, draw: Callable[..., Any]
    ) -> Any:
        return [
            [dataclasses.replace(t, sampler_logprobs=(value,) * len(t.completion_ids)) for t in g]
            for g in groups
        ]

    return forge


FORGE: dict[str, Callable[..., list[list[Trajectory]]]] = {
    "honest": _same,  # no lie: the restart study's lease holders (adversary_runs.restart_run)
    **{kind: _poison(value) for kind, value in POISONS.items()},
    "unpublished": _same,  # the claimed version is changed at submission
    "model": _same,  # the engine's weights are perturbed: its honest-looking output is the forgery
    "logprobs": _logprobs,
    "cherry": _cherry,
    "inflated": _same,  # the claimed version is changed at submission (see attack_until_caught)
    "reward": _reward,
    "prompt": _prompt,
    "deflated": _same,
    "replay": _same,
}


async def attack_until_caught(att: Attacker, trials: int, budget: int) -> list[Trial]:
    """``trials`` fresh identities of ``att``, each submitting until the learner answers
    ``quarantined`` or ``budget`` submissions were made (refusals count as submissions; leases the
    learner did not grant do not)."""
    out = []
    for n in range(trials):  # the identity it set up with is the first
        trial = Trial(att.kind, att.w.worker_id if n == 0 else await att.new_identity())
        refused = 0  # lease requests refused in a row
        while len(trial.outcomes) < budget:
            try:
                outcome = await att.submit_one()
            except Refused as exc:  # any call of a quarantined identity
                outcome = exc.reply.error
            if outcome == "no_lease":
                refused += 1
                if refused >= NO_LEASE_LIMIT:  # released by the controller: it can do no more harm
                    trial.released = True
                    break
                continue
            refused = 0
            if outcome == "quarantined":  # refused before submitting: caught earlier
                trial.quarantined_after = trial.quarantined_after or len(trial.outcomes)
                break
            trial.outcomes.append(outcome)
            if outcome in EVIDENCE:  # this submission got it quarantined
                trial.quarantined_after = len(trial.outcomes)
                break
        out.append(trial)
        log.info("%s trial %s: %s", att.kind, trial.worker_id, trial.outcomes)
    return out


@dataclass
class Tally:
    """What a non-submitting attacker got: lease grants and refusals by reason, calls refused."""

    grants: int = 0
    prompts: int = 0
    refusals: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)

    def count(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1


class Liar:
    """Registers claiming a fast, cheap machine (10,000 rollouts/s at $0.01/h) and then only
    heartbeats, claiming to hold the newest version: it never leases, never generates."""

    def __init__(self, join: str, token: str, session: aiohttp.ClientSession, name: str = "liar") -> None:
        self.client = LearnerClient(join, session, reconnect_s=30.0)
        self.token, self.name = token, name
        self.tally = Tally()
        self.worker_id = ""

    async def run(self, stop: asyncio.Event, rate: float = 10_000.0, usd_per_hour: float = 0.01) -> Tally:
        from echo2.protocol import RegisterRequest

        req = RegisterRequest(name=self.name, usd_per_hour=usd_per_hour, rollouts_per_s=rate)
        reg = await self.client.register(req, self.token)
        self.worker_id = reg.worker_id
        while not stop.is_set():
            try:
                newest = (await self.client.version()).version or 0
                await self.client.heartbeat(
                    HeartbeatRequest(rollouts=0, busy_s=0.0, installed_version=newest)
                )
            except Refused as exc:
                self.tally.count(self.tally.errors, exc.reply.error)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), reg.settings.heartbeat_s)
        return self.tally


class Hoarder(Liar):
    """Registers like a worker, heartbeats, and leases everything it is allowed to (as many prompts
    per lease as the run's settings say, claiming the newest published version), never answering."""

    async def run(self, stop: asyncio.Event, rate: float = 1.0, usd_per_hour: float = 0.01) -> Tally:
        from echo2.protocol import RegisterRequest

        req = RegisterRequest(name=self.name, usd_per_hour=usd_per_hour)
        reg = await self.client.register(req, self.token)
        self.worker_id = reg.worker_id
        loop = asyncio.get_running_loop()
        next_beat = 0.0
        while not stop.is_set():
            wait = 0.25
            try:
                got_version = await self.client.version()
                newest = got_version.version or 0
                epoch = int((got_version.manifest or {}).get("lineage", {}).get("epoch", 0))
                if loop.time() >= next_beat:
                    await self.client.heartbeat(
                        HeartbeatRequest(rollouts=0, busy_s=0.0, installed_version=newest)
                    )
                    next_beat = loop.time() + reg.settings.heartbeat_s
                got = await self.client.lease(
                    LeaseRequest(
                        max_prompts=reg.settings.lease_prompts,
                        installed_version=newest,
                        installed_epoch=epoch,
                    )
                )
                if isinstance(got, LeaseGrant):
                    self.tally.grants += 1
                    self.tally.prompts += len(got.prompts)
                    wait = 0.0  # ask again at once: hoard all it may
                else:
                    self.tally.count(self.tally.refusals, got.reason)
                    wait = min(got.retry_after_s, 1.0)
            except Refused as exc:
                self.tally.count(self.tally.errors, exc.reply.error)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(wait, 0.01))
        return self.tally
