"""Strangers against a real learner: `echo2 run` (tiny model, TLS, one honest worker process) while
attackers set up exactly like a worker (benchmarks/echo2_bench/adversary.py) and lie. Every generation
is re-checked here (security.check_fraction = 1) so each forgery is caught at its first submission
the learner could train on (one dropped as stale, when the learner moved more than S versions during
the attacker's generation on a busy machine, is never trained and so never checked);
benchmarks/adversary.py measures the default fraction."""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
from waiting import last_step, wait_for

from echo2.observe.rundir import read_metrics
from echo2_bench.adversary_length import regrade

pytestmark = pytest.mark.integration
KINDS = (
    "model",
    "logprobs",
    "launder",
    "reward",
    "prompt",
    "deflated",
    "replay",
    "poison_100",
    "poison_1e30",
    "unpublished",
)
# the generation check runs after the answer (the worker is told pending_check; the verdict quarantines
# it before its next call), the turn mask check in the request
FORGERIES = {"model": "pending_check", "logprobs": "pending_check", "launder": "turn_mask"}


async def _attack(join: str, token: str) -> dict[str, object]:
    import aiohttp

    from echo2.protocol import HeartbeatRequest, RegisterRequest
    from echo2.rollout.client import LearnerClient, Refused
    from echo2_bench.adversary import Attacker, Hoarder, attack_until_caught
    from echo2_bench.adversary_length import LengthAttacker

    out: dict[str, object] = {}
    async with aiohttp.ClientSession() as session:
        stop = asyncio.Event()  # two identities that lease all they may and never answer, throughout
        hoarders = [Hoarder(join, token, session, f"hoarder{i}") for i in range(2)]
        hoarding = [asyncio.ensure_future(h.run(stop)) for h in hoarders]
        for kind in KINDS:
            cls = LengthAttacker if kind == "launder" else Attacker
            att = (
                cls(join, token, kind, session)
                if kind == "launder"
                else cls(join, token, kind, session, max_prompts=1)
            )
            await att.start()
            (trial,) = await attack_until_caught(att, 1, budget=4 if kind in FORGERIES else 2)
            out[kind] = (trial.worker_id, trial.outcomes, trial.quarantined_after)
            await att.close()
        stop.set()
        out["hoarders"] = [await t for t in hoarding]
        # a lying heartbeat: 1e9 rollouts in a nanosecond, from a worker that submitted nothing
        liar = LearnerClient(join, session, reconnect_s=10)
        reg = await liar.register(RegisterRequest(name="liar", usd_per_hour=0.1), token)
        await liar.heartbeat(HeartbeatRequest(rollouts=10**9, busy_s=1e-9, installed_version=0))
        out["liar"] = reg.worker_id
        # no credential, a forged one: no weights
        anon = LearnerClient(join, session, reconnect_s=10)
        for cred in (None, "forged-credential"):
            anon.credential = cred
            try:
                await anon.snapshot_chain(-1)
                out[f"download:{cred}"] = 200
            except Refused as exc:
                out[f"download:{cred}"] = exc.status
        # a registration flood stops at the cap
        statuses = []
        for i in range(12):
            try:
                await LearnerClient(join, session, reconnect_s=10).register(
                    RegisterRequest(name=f"flood{i}", usd_per_hour=0.1), token
                )
                statuses.append(200)
            except Refused as exc:
                statuses.append(exc.status)
        out["flood"] = statuses
    return out


def test_attackers_are_refused_or_quarantined_and_the_honest_worker_trains_on(tiny_overrides, tmp_path):
    run_dir = tmp_path / "run"
    sets = [*tiny_overrides, "runtime.workers=1", "runtime.lease_prompts=2", "train.eval_every=1000"]
    sets += ["security.check_fraction=1.0", "security.check_samples=1000", "security.max_workers=17"]
    # every submission re-checked: a check queue that declines none (at the default 32, each check
    # waiting lowers the draw by 1/32, so a busy machine declined the model forger's first submission)
    sets += ["security.check_queue=1000000"]
    # R = 16 here: the default 1/8 of the in-flight budget would be one probation lease, which the two
    # hoarders would keep from every attacker that comes after them (tests/unit/test_leases.py)
    sets += ["security.probation_share=1.0"]
    # one join token's copies of the model: each caught forger comes back as a new identity, so the
    # attackers here fetch more than max_workers copies within a minute (the budget itself:
    # tests/unit/test_routes_hostile.py)
    sets += ["security.token_copies_per_hour=1000000"]
    args = [a for s in sets for a in ("--set", s)]
    log = (tmp_path / "run.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "echo2.cli", "run", *args, "--steps", "100000", "--no-progress"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        # a few steps in: version 0 cannot be deflated
        wait_for(lambda: last_step(run_dir) >= 3, 180, "the learner's third step")
        info = json.loads((run_dir / "learner.json").read_text())
        token = (run_dir / "join_token").read_text().strip()
        got = asyncio.run(asyncio.wait_for(_attack(info["join"], token), 240))
        time.sleep(3)  # a few more honest steps
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = (tmp_path / "run.log").read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "Traceback" not in text

    # forgeries of the generation and of the reward: caught at the first submission the learner could
    # train on (a generation forgery's verdict may land after a second one, which is held as well)
    for kind, reason in FORGERIES.items():
        _, outcomes, caught = got[kind]  # type: ignore[misc]
        checked = [o for o in outcomes if o != "dropped_stale"]  # a stale drop is never trained
        assert checked[:1] == [reason] and set(checked) == {reason}, (kind, outcomes)
        assert caught == len(outcomes) and (reason == "pending_check" or len(checked) == 1), (kind, outcomes)
    # deterministic refusals, every time, nobody quarantined for them
    assert got["prompt"][1] == ["prompt_mismatch"] * 2  # type: ignore[index]
    assert got["deflated"][1] == ["version_mismatch"] * 2  # type: ignore[index]
    assert got["replay"][1] == ["replay"] * 2  # type: ignore[index]  # the original landed, the copy not
    # log-probs below what the sampler can draw: refused at the door, every time, nobody trained on them
    assert got["poison_100"][1] == got["poison_1e30"][1] == ["logprob"] * 2  # type: ignore[index]
    # a version that was never published (odd, at kappa = 2): refused every time
    assert got["unpublished"][1] == ["unpublished_version"] * 2  # type: ignore[index]
    # the hoarders got one 1-prompt lease each at a time, never answered: at most the probation share
    for tally in got["hoarders"]:  # type: ignore[union-attr]
        assert tally.grants >= 1 and tally.prompts == tally.grants, tally
        allowed = {"too_many_leases", "probation_full", "benched", "inactive", "buffer_full", "stale_weights"}
        assert set(tally.refusals) <= allowed and tally.refusals.get("too_many_leases", 0) >= 1, tally
    assert got["download:None"] == 401 and got["download:forged-credential"] == 403
    # the cap: 1 honest + 10 attackers + 2 hoarders + the liar = 14 registrations before the flood (17
    # slots, none freed yet), 3 more allowed
    assert got["flood"] == [200] * 3 + [403] * 9

    workers = {w["worker_id"]: w for w in json.loads((run_dir / "workers.json").read_text())}
    quarantined = {w["name"] for w in workers.values() if w["quarantined"]}
    assert quarantined == {"attacker-model", "attacker-logprobs", "attacker-launder"}
    # the forged rewards were never stored: what its groups carry is the learner's grade
    assert regrade(run_dir, [got["reward"][0]]) == 0  # type: ignore[index]
    db = sqlite3.connect(run_dir / "store.sqlite")
    # the reward forger's groups are honest completions with the learner's rewards: trained, harmlessly
    liars = [got[k][0] for k in KINDS if k not in ("replay", "reward")]  # type: ignore[index]
    marks = ",".join("?" * len(liars))
    trained = db.execute(
        "SELECT COUNT(*) FROM rollout_groups g JOIN leases l USING (lease_id) "
        f"WHERE l.worker_id IN ({marks}) AND g.consumed_step >= 1",
        liars,
    ).fetchone()[0]
    db.close()
    assert trained == 0  # not one forged group was trained on

    rows = [r for r in read_metrics(run_dir) if "security/quarantined" in r]
    last = rows[-1]
    assert last["security/quarantined"] == 3
    # the honest worker's completions passed well inside the tolerance (position_error_max counts the
    # forgers' positions too: the tampered log-probs are 1 off)
    assert last["security/checked_trajectories"] > 20 and last["security/worst_passing_logprob_error"] < 0.05
    assert last["security/position_error_max"] >= 0.99
    assert last["store/rejected/registration_cap"] == 9 and last["store/rejected/turn_mask"] == 1
    assert last["store/rejected/logprob"] == 4 and last["store/rejected/unpublished_version"] == 2
    assert last["store/rejected/forged_generation"] >= 2  # model and logprobs, found by the checker
    (honest,) = [
        w for w in workers.values() if not w["name"].startswith(("attacker-", "liar", "flood", "hoarder"))
    ]
    assert not honest["quarantined"] and honest["rollouts"] > 0  # the honest worker trained on throughout
