"""Leases follow what a worker returned, never what it claims (runtime/standing.py, leases.py, pool.py):
probation, slow start, strikes and the bench; K identities that lease and never submit cannot starve
an honest worker; a registration's claimed rate can never release a worker that delivers."""

from __future__ import annotations

from typing import Any

import pytest

from echo2.config import load_config
from echo2.data.store import TrajectoryStore
from echo2.data.submission import Submission
from echo2.protocol import (
    MAX_HEARTBEAT_S,
    HeartbeatRequest,
    LeaseGrant,
    LeaseRefusal,
    LeaseRequest,
    RegisterRequest,
)
from echo2.runtime.leases import LeaseBroker
from echo2.runtime.members import Cadence, WorkerRegistry
from echo2.runtime.pool import Pool
from echo2.runtime.prompts import PromptSource
from echo2.runtime.standing import BENCH_TTLS, Standings
from echo2.tasks.registry import build_task
from echo2.types import Trajectory


def test_standing_probation_slow_start_strikes_and_the_bench():
    st = Standings(max_unreturned=3, lease_ttl_s=30.0)
    assert st.on_probation("w") and st.max_open("w", 4) == 1 and st.ttl("w") == 30.0
    for k in range(1, 6):
        st.returned_lease("w")
        assert not st.on_probation("w") and st.max_open("w", 4) == min(4, 1 + k)
    st.expired("w", now=100.0)  # a strike: back to probation, half the time to live
    assert st.on_probation("w") and st.max_open("w", 4) == 1 and st.ttl("w") == 15.0
    st.expired("w", now=115.0)
    assert st.ttl("w") == 7.5 and st.bench_left("w", 115.0) == 0.0
    st.expired("w", now=122.5)  # the third in a row: benched
    assert st.bench_left("w", 122.5) == BENCH_TTLS * 30.0 and st.benched == 1 and st.unreturned == 3
    assert st.ttl("w") == 7.5  # after the bench one more strike benches it again
    st.expired("w", now=300.0)
    assert st.benched == 2
    st.returned_lease("w")  # a returned lease clears the strikes
    assert st.ttl("w") == 30.0 and not st.on_probation("w")
    st.asked("v", now=10.0)
    assert st.asked_within("v", 15.0, 10.0) and not st.asked_within("v", 25.0, 10.0)
    assert not st.asked_within("nobody", 0.0, 10.0)
    assert st.metrics() == {"leases/unreturned": 4, "leases/stale_answers": 0, "leases/benched": 2}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _node(tmp_path: Any, *overrides: str) -> tuple[Any, TrajectoryStore, LeaseBroker, Pool, Clock]:
    """The defaults of the issue's scenario: S = 3, G = 8, R = 256 (cap 512), 8-prompt leases."""
    cfg = load_config(overrides=list(overrides))
    clock = Clock()
    store = TrajectoryStore(tmp_path / "store.sqlite", cfg.staleness.S, cfg.batch.group_size)
    registry = WorkerRegistry(tmp_path, "t" * 20, clock, 1000)
    standings = Standings(cfg.security.max_unreturned, cfg.runtime.lease_ttl_s)
    pool = Pool(registry, cfg.controller, cfg.staleness, cfg.batch.rollouts, 0.0, tmp_path, clock)
    broker = LeaseBroker(
        store=store, prompts=PromptSource(build_task(cfg.task, 0), 0), batch=cfg.batch,
        staleness=cfg.staleness, runtime=cfg.runtime, version=lambda: 10, is_active=pool.is_active,
        clock=clock, security=cfg.security, standings=standings, published=lambda: {10},
    )  # fmt: skip
    return cfg, store, broker, pool, clock


def _register(
    registry: WorkerRegistry, pool: Pool, name: str, rate: float | None = None, usd: float = 0.35
) -> str:
    rec, _ = registry.register(RegisterRequest(name=name, usd_per_hour=usd, rollouts_per_s=rate))
    pool.enroll(rec)
    return rec.worker_id


def _answer(store: TrajectoryStore, broker: LeaseBroker, grant: LeaseGrant, worker: str) -> int:
    """Submit well-formed groups for ``grant`` (version 10) and tell the broker, as the intake does."""
    groups = tuple(
        tuple(
            Trajectory(p.prompt_id, f"{grant.lease_id}:{i}", (1,), (2,), (-0.5,), float(j % 2), 10)
            for j in range(grant.group_size)
        )
        for i, p in enumerate(grant.prompts)
    )
    res = store.submit(Submission(grant.lease_id, 10, groups), worker, learner_version=10, now=0.0)
    broker.returned(worker)
    return res.admitted


def _ask(broker: LeaseBroker, worker: str, n: int = 8) -> LeaseGrant | LeaseRefusal:
    """A lease request, as the route makes it: the call authenticates (the registry's liveness)."""
    broker.is_active.__self__.registry[worker].last_seen_s = broker.clock()  # type: ignore[attr-defined]
    return broker.grant(worker, LeaseRequest(max_prompts=n, installed_version=10))


@pytest.mark.parametrize("hoarders", [2, 4, 8, 32])
def test_identities_that_lease_and_never_submit_cannot_starve_an_honest_worker(tmp_path, hoarders):
    """K identities lease all they can and never answer: together they hold at most probation_share of
    the in-flight budget (1-prompt leases, one each, K beyond 8 refused), while one honest worker
    fills a whole learner batch (R = 256) and still gets leases; unreturned leases bench them."""
    cfg, store, broker, pool, clock = _node(tmp_path)
    registry = pool.registry
    honest = _register(registry, pool, "honest")
    first = _ask(broker, honest)  # it was working before they came
    assert isinstance(first, LeaseGrant) and len(first.prompts) == cfg.security.probation_prompts == 1
    _answer(store, broker, first, honest)
    bad = [_register(registry, pool, f"hoarder{i}") for i in range(hoarders)]
    grants = [_ask(broker, w) for w in bad for _ in range(3)]
    held = sum(len(g.prompts) * g.group_size for g in grants if isinstance(g, LeaseGrant))
    assert held <= cfg.security.probation_share * broker.inflight_cap == 64
    assert all(len(g.prompts) == 1 for g in grants if isinstance(g, LeaseGrant))
    reasons = {g.reason for g in grants if isinstance(g, LeaseRefusal)}
    assert reasons <= {"too_many_leases", "probation_full"} and "too_many_leases" in reasons
    admitted = 0
    while admitted < cfg.batch.rollouts:  # the honest worker: lease, answer, repeat
        grant = _ask(broker, honest)
        assert isinstance(grant, LeaseGrant), grant
        admitted += _answer(store, broker, grant, honest)
    assert store.take_batch(cfg.batch.prompts, 10, step=11) is not None  # the learner gets its batch
    more = [_ask(broker, honest) for _ in range(cfg.runtime.max_leases_per_worker)]
    assert all(isinstance(g, LeaseGrant) and len(g.prompts) == 8 for g in more), more  # slow start done
    for g in more:
        _answer(store, broker, g, honest)
    # their leases expire unreturned, round after round: strikes (struck ones share half of the
    # probation share), shorter leases, then the bench; the honest worker never loses a lease
    seen = set()
    for _ in range(2 * cfg.security.max_unreturned):
        clock.t += cfg.runtime.lease_ttl_s
        for worker, held_s in broker.expire():
            pool.unreturned(worker, held_s)
            assert worker in bad
        again = [_ask(broker, w) for w in bad]
        seen |= {g.reason for g in again if isinstance(g, LeaseRefusal)}
        held = sum(len(g.prompts) * g.group_size for g in again if isinstance(g, LeaseGrant))
        assert held <= (32 if hoarders <= 8 else 64)  # struck ones: half the probation share
        ok = _ask(broker, honest)
        assert isinstance(ok, LeaseGrant), ok
        _answer(store, broker, ok, honest)
        store.take_batch(cfg.batch.prompts, 10, step=12)  # the learner trains on what is there
    assert "benched" in seen and broker.standings.benched >= min(4, hoarders)


def test_a_new_worker_gets_past_a_flood_of_fresh_identities(tmp_path):
    """16 fresh identities ask before a new honest worker: 8 fill the probation share, 8 wait. All of
    them ask again every second, before it. Room that frees up goes to whoever was refused for want of
    it first, and a worker with a strike has only half the share: so the 8 that waited before it get
    the first 8 places and the newcomer the next, after two times to live, while the first 8 (struck
    now) queue behind it; without the queue the hoarders, asking first, would take every place."""
    cfg, _, broker, pool, clock = _node(tmp_path)
    bad = [_register(pool.registry, pool, f"hoarder{i}") for i in range(16)]
    assert sum(isinstance(_ask(broker, w), LeaseGrant) for w in bad) == 8  # 8 x 8 rollouts = the share
    clock.t += 1.0
    newcomer = _register(pool.registry, pool, "newcomer")
    waited = 0.0
    while True:
        [_ask(broker, w) for w in bad]  # the hoarders ask first, every second
        got = _ask(broker, newcomer)
        if isinstance(got, LeaseGrant):
            break
        assert got.reason == "probation_full"
        clock.t += 1.0
        waited += 1.0
        broker.expire()
        assert waited <= 2 * cfg.runtime.lease_ttl_s + 2, "the newcomer never got past the flood"
    assert waited >= 2 * cfg.runtime.lease_ttl_s - 2  # behind the 8 that were refused before it


def test_a_refused_answer_expires_its_lease_at_once_and_strikes_unless_the_learner_caused_it(tmp_path):
    from echo2.runtime.leases import NO_FAULT

    cfg, store, broker, pool, _ = _node(tmp_path)
    w = _register(pool.registry, pool, "w")
    first = _ask(broker, w)
    assert isinstance(first, LeaseGrant) and isinstance(_ask(broker, w), LeaseRefusal)  # one at a time
    broker.refused(w, first.lease_id, "unpublished_version")
    assert store.lease(first.lease_id).state == "expired"
    assert [p.prompt_id for p in broker.prompts.reissue] == [p.prompt_id for p in first.prompts]
    assert broker.standings.struck(w) and broker.standings.ttl(w) == cfg.runtime.lease_ttl_s / 2
    second = _ask(broker, w)  # its prompts went back and it may lease again at once (on probation)
    assert isinstance(second, LeaseGrant) and second.expires_in_s == cfg.runtime.lease_ttl_s / 2
    broker.refused(w, second.lease_id, "stale_epoch")  # the learner's doing: no strike
    assert "stale_epoch" in NO_FAULT and broker.standings.ttl(w) == cfg.runtime.lease_ttl_s / 2
    broker.refused(w, second.lease_id, "prompt_mismatch")  # no longer open: nothing happens
    assert broker.standings.ttl(w) == cfg.runtime.lease_ttl_s / 2


def test_a_fast_worker_that_fills_the_budget_cannot_keep_a_newcomer_out(tmp_path):
    """The probation allowance is beside the in-flight budget: a delivering worker whose answers fill
    the whole budget (buffer_full for more) leaves a newcomer its first lease."""
    cfg, store, broker, pool, _ = _node(tmp_path)
    fast = _register(pool.registry, pool, "fast")
    while isinstance(grant := _ask(broker, fast), LeaseGrant):  # answered at once: the buffer fills
        _answer(store, broker, grant, fast)
    assert grant.reason == "buffer_full" and store.outstanding_rollouts() > broker.inflight_cap - 64
    newcomer = _register(pool.registry, pool, "newcomer")
    first = _ask(broker, newcomer)
    assert isinstance(first, LeaseGrant) and len(first.prompts) == cfg.security.probation_prompts


def test_a_worker_that_left_probation_holds_no_place_in_its_queue(tmp_path):
    """The regression: a worker queued for probation room that then left probation (an answer of it
    accepted) kept its place and, still asking (as a trusted worker), blocked every newcomer behind
    it; and a worker holding its one probation lease is told too_many_leases, never queued."""
    _, store, broker, pool, clock = _node(
        tmp_path, "batch.prompts=4", "batch.group_size=4", "runtime.lease_prompts=4"
    )
    assert broker.probation_cap == 4  # one probation lease of 1 prompt x 4
    a, b, c = (_register(pool.registry, pool, n) for n in "abc")
    held = _ask(broker, b)
    assert isinstance(held, LeaseGrant)
    again = _ask(broker, b)
    assert isinstance(again, LeaseRefusal) and again.reason == "too_many_leases" and b not in broker._waiting
    queued = _ask(broker, a)
    assert isinstance(queued, LeaseRefusal) and queued.reason == "probation_full" and a in broker._waiting
    clock.t += 1.0
    broker.returned(a)  # a late answer of an earlier lease of a's was accepted: a leaves probation
    _answer(store, broker, held, b)  # the room frees up
    clock.t += 1.0
    assert isinstance(_ask(broker, a), LeaseGrant)  # a asks on, as a trusted worker now
    assert isinstance(_ask(broker, c), LeaseGrant)  # and the newcomer is not kept behind it


def test_a_lease_is_cut_to_what_fits_in_the_budget(tmp_path):
    """The regression: with a budget of about one lease (R = 16, cap 32, leases of 8 x 4 = 32) the
    groups of two probation leases (8 buffered, below a batch) kept every full lease out: no step ever.
    A lease is cut to the prompts that fit instead."""
    _, store, broker, pool, _ = _node(tmp_path, "batch.prompts=4", "batch.group_size=4")
    assert broker.inflight_cap == 32
    a, b = (_register(pool.registry, pool, n) for n in "ab")
    for w in (a, b):
        grant = _ask(broker, w)
        assert isinstance(grant, LeaseGrant) and len(grant.prompts) == 1
        _answer(store, broker, grant, w)
    cut = _ask(broker, a)  # 8 buffered: 24 rollouts fit, 6 prompts
    assert isinstance(cut, LeaseGrant) and len(cut.prompts) == 6
    full = _ask(broker, b)
    assert isinstance(full, LeaseRefusal) and full.reason == "buffer_full"


@pytest.mark.parametrize("updating", [False, True])
def test_a_lagging_worker_leases_only_what_will_still_be_admissible(tmp_path, updating):
    """Updates take the oldest groups first, so a worker whose weights lag by L versions queues behind
    the rollouts ahead and gets only what fits in (S + 1 - L) R, a batch less while an update is under
    way (it took its batch at v_t and moves the version on without taking any of those ahead); past that
    it is told to install newer weights (stale_weights with the oldest version that has room), never
    handed work it will drop. S = 3, G = 4, R = 16 (in-flight budget 32 rollouts: max_inflight_batches
    = 2), learner at version 10."""
    _, store, broker, pool, clock = _node(tmp_path, "batch.prompts=4", "batch.group_size=4")
    broker.published = lambda: {6, 7, 8, 9, 10}
    a, b = (_register(pool.registry, pool, n) for n in "ab")
    for w in (a, b):  # off probation: one returned lease each (8 rollouts ahead now)
        grant = _ask(broker, w)
        assert isinstance(grant, LeaseGrant)
        _answer(store, broker, grant, w)
    store.taken_at = 10 if updating else 9
    u = int(updating)

    def ask(worker: str, installed: int) -> LeaseGrant | LeaseRefusal:
        broker.is_active.__self__.registry[worker].last_seen_s = clock()  # type: ignore[attr-defined]
        return broker.grant(worker, LeaseRequest(max_prompts=8, installed_version=installed))

    # lag 3: (S + 1 - 3 - u) R = 16 rollouts idle, 8 ahead: 2 prompts; none while updating
    lagging = ask(a, 7)
    if updating:
        assert isinstance(lagging, LeaseRefusal)
        assert (lagging.reason, lagging.min_version) == ("stale_weights", 8)
        lagging = ask(a, 8)  # lag 2 while updating: the room of lag 3 idle
    assert isinstance(lagging, LeaseGrant) and len(lagging.prompts) == 2
    again = ask(b, 7 + u)  # 16 ahead now: none fits at that lag; one version newer would: install it
    assert isinstance(again, LeaseRefusal) and (again.reason, again.min_version) == ("stale_weights", 8 + u)
    fresh = ask(b, 10)  # current weights: the in-flight budget binds (32, 16 ahead): 4 prompts
    assert broker.inflight_cap == 32 and isinstance(fresh, LeaseGrant) and len(fresh.prompts) == 4


def test_a_lagging_worker_queues_behind_what_probation_holds_for_its_check(tmp_path):
    """Probation's rollouts sit outside the in-flight budget, not outside the queue: a newcomer's groups
    held for their check keep their place, and once checked an update takes them before anything
    submitted after them. So a lagging worker's fresh room counts them ahead (the budget's room does
    not). S = 3, G = 4, R = 16, budget 32: two proven workers' 8 rollouts buffered, a newcomer's 4 held;
    at lag 2 an idle learner has (S + 1 - 2) R = 32 rollouts of room for it: 32 - 12 = 20, 5 prompts
    (6 if the held ones were not counted, and then the update that takes the newcomer's checked group
    leaves one of the lagging worker's groups behind, stale)."""
    _, store, broker, pool, clock = _node(tmp_path, "batch.prompts=4", "batch.group_size=4")
    broker.published = lambda: {8, 9, 10}
    a, b, new = (_register(pool.registry, pool, n) for n in ("a", "b", "new"))
    for w in (a, b):
        grant = _ask(broker, w)
        assert isinstance(grant, LeaseGrant)
        _answer(store, broker, grant, w)
    probation = _ask(broker, new)
    assert isinstance(probation, LeaseGrant) and len(probation.prompts) == 1
    groups = tuple(
        tuple(Trajectory(p.prompt_id, f"{probation.lease_id}:{i}", (1,), (2,), (-0.5,), float(j % 2), 10)
              for j in range(4))
        for i, p in enumerate(probation.prompts)
    )  # fmt: skip
    store.submit(Submission(probation.lease_id, 10, groups), new, learner_version=10, now=0.0, hold=True)
    store.taken_at = 9  # no update under way
    pool.registry[a].last_seen_s = clock()
    lagging = broker.grant(a, LeaseRequest(max_prompts=8, installed_version=8))
    assert isinstance(lagging, LeaseGrant) and len(lagging.prompts) == 5
    current = broker.grant(b, LeaseRequest(max_prompts=8, installed_version=10))  # the budget binds: 32 -
    assert isinstance(current, LeaseGrant) and len(current.prompts) == 1  # (8 + 20) leaves 4, 1 prompt


def test_weights_of_another_run_epoch_get_no_lease_and_leases_carry_the_epoch(tmp_path):
    """A worker still holding an earlier learner process's version (its number may name other weights
    now) is told stale_epoch with the newest version to install; a grant carries this process's epoch,
    and so does the lease the store keeps."""
    _, store, broker, pool, clock = _node(tmp_path)
    broker.epoch = 3
    w = _register(pool.registry, pool, "w")
    broker.is_active.__self__.registry[w].last_seen_s = clock()  # type: ignore[attr-defined]
    old = broker.grant(w, LeaseRequest(max_prompts=8, installed_version=10, installed_epoch=2))
    assert isinstance(old, LeaseRefusal) and old.reason == "stale_epoch" and old.min_version == 10
    fresh = broker.grant(w, LeaseRequest(max_prompts=8, installed_version=10, installed_epoch=3))
    assert isinstance(fresh, LeaseGrant) and fresh.epoch == 3
    assert store.lease(fresh.lease_id).epoch == 3


def test_a_new_identity_with_a_submission_waiting_for_its_check_gets_no_lease(tmp_path):
    """As the node wires it (runtime/node.py): while a submission of an identity that has passed fewer
    than check_first checks waits for its generation check, a lease request is refused (check_pending,
    no strike: it asks again); once the verdict is in, or for a proven identity, leases are granted."""
    from types import SimpleNamespace

    from echo2.runtime.node import _leasing

    cfg = load_config(overrides=["security.check_first=2"])
    clock = Clock()
    store = TrajectoryStore(tmp_path / "store.sqlite", cfg.staleness.S, cfg.batch.group_size)
    registry = WorkerRegistry(tmp_path, "t" * 20, clock, 1000)
    snapshots = SimpleNamespace(published={10})
    pool, broker = _leasing(cfg, registry, store, build_task(cfg.task, 0), snapshots, lambda: 10, clock, 0)  # type: ignore[arg-type]
    w = _register(registry, pool, "w")
    rec = registry[w]
    first = _ask(broker, w)
    assert isinstance(first, LeaseGrant)
    _answer(store, broker, first, w)
    rec.checks_waiting = 1  # the intake drew it: held for the check
    refused = _ask(broker, w)
    assert isinstance(refused, LeaseRefusal) and refused.reason == "check_pending"
    assert not broker.standings.struck(w)
    rec.checks_waiting, rec.checks_passed = 0, 1  # passed
    grant = _ask(broker, w)
    assert isinstance(grant, LeaseGrant)
    _answer(store, broker, grant, w)
    rec.checks_passed, rec.checks_waiting = 2, 1  # proven: a waiting check holds nothing up
    assert isinstance(_ask(broker, w), LeaseGrant)
    registry.save()  # a restart drops the held groups: what waited is not carried over
    assert "checks_waiting" not in (tmp_path / "workers.json").read_text()


def test_submissions_waiting_for_their_check_count_in_the_probation_share(tmp_path):
    """A flood of new identities that answer (their groups held for their checks, their leases
    submitted) holds the probation share with those groups, not the others' budget: once 8 held
    1-prompt submissions fill it (64 of 512), the next newcomer waits (probation_full) and a delivering
    worker keeps the rest; a stale answer returns nothing, so it never ends probation."""
    _, store, broker, pool, _ = _node(tmp_path)
    registry = pool.registry
    honest = _register(registry, pool, "honest")
    _answer(store, broker, _ask(broker, honest), honest)  # type: ignore[arg-type]
    flood = [_register(registry, pool, f"new{i}") for i in range(9)]
    for w in flood[:8]:
        grant = _ask(broker, w)
        assert isinstance(grant, LeaseGrant) and len(grant.prompts) == 1
        groups = tuple(
            tuple(
                Trajectory(p.prompt_id, f"{grant.lease_id}:{i}", (1,), (2,), (-0.5,), 0.0, 10)
                for _ in range(8)
            )
            for i, p in enumerate(grant.prompts)
        )
        store.submit(Submission(grant.lease_id, 10, groups), w, learner_version=10, now=0.0, hold=True)
    assert store.open_prompts_by_worker().keys() == {honest} or not store.open_prompts_by_worker().get(
        flood[0]
    )
    late = _ask(broker, flood[8])
    assert isinstance(late, LeaseRefusal) and late.reason == "probation_full"
    assert isinstance(_ask(broker, honest), LeaseGrant)  # the others' budget is untouched
    store.drop_held()  # their checks are done (here: dropped): the share is free again
    assert isinstance(_ask(broker, flood[8]), LeaseGrant)
    broker.struck(flood[0], "stale")
    assert broker.standings.on_probation(flood[0]) and broker.standings.metrics()["leases/stale_answers"] == 1


def test_the_pool_is_sized_for_the_rollouts_a_batch_can_use(tmp_path):
    """With zero-variance groups left out, a batch needs R / useful rollouts received: the target is
    mu_min(R) / useful (the share measured by the store), never more than 1 / MIN_USEFUL times it."""
    from echo2.runtime.pool import MIN_USEFUL

    cfg = load_config()
    pool = Pool(registry=WorkerRegistry(tmp_path, "t" * 20, Clock(), 1000), controller=cfg.controller,
                staleness=cfg.staleness, rollouts_per_step=cfg.batch.rollouts, learner_usd_per_hour=0.0,
                run_path=tmp_path, clock=Clock())  # fmt: skip
    pool.retarget(t_train_s=10.0, t_bcast_s=1.0)
    whole = pool.controller.mu_target
    pool.retarget(t_train_s=10.0, t_bcast_s=1.0, useful=0.4)
    assert (
        pool.controller.mu_target == pytest.approx(whole / 0.4) and pool.metrics()["pool/useful_share"] == 0.4
    )
    pool.retarget(t_train_s=10.0, t_bcast_s=1.0, useful=0.0)
    assert pool.controller.mu_target == pytest.approx(whole / MIN_USEFUL)


def test_the_pool_is_sized_against_what_the_check_can_re_run(tmp_path):
    """SPEC §10: a checker that re-runs 2 completions/s keeps a floor of 0.25 for at most 8 rollouts/s of
    pool (capacity.mu_policed); a target above it is capped there (pool/mu_check_max), one below is
    kept; before the first check (capacity 0) nothing is capped."""
    cfg = load_config()
    clock = Clock()
    registry = WorkerRegistry(tmp_path, "t" * 20, clock, 1000)
    measured = [(0.0, 0.25)]
    pool = Pool(
        registry, cfg.controller, cfg.staleness, cfg.batch.rollouts, 0.0, tmp_path, clock,
        check=lambda: measured[0],
    )  # fmt: skip
    pool.retarget(t_train_s=10.0, t_bcast_s=1.0)
    uncapped = pool.controller.mu_target
    assert uncapped > 8.0 and pool.mu_check_max is None
    measured[0] = (2.0, 0.25)
    pool.retarget(t_train_s=10.0, t_bcast_s=1.0)
    assert pool.controller.mu_target == pytest.approx(8.0) and pool.metrics()["pool/mu_check_max"] == 8.0
    measured[0] = (1000.0, 0.25)
    pool.retarget(t_train_s=10.0, t_bcast_s=1.0)
    assert pool.controller.mu_target == pytest.approx(uncapped)


def test_is_active_agrees_with_the_active_list_in_every_state(tmp_path):
    """``Pool.is_active`` (constant time: every heartbeat and lease asks it) says what ``active_ids``
    lists, and both are the rule: before the pool has a target, every worker heard from; then the
    controller's alive ones and those on probation heard from; for workers on probation, delivered,
    silent, timed out, quarantined and unknown."""
    cfg, _, _, pool, clock = _node(tmp_path)
    registry = pool.registry
    ids = [_register(registry, pool, f"w{i}") for i in range(6)]
    for wid in ids[4:]:  # w4 and w5 silent since before the heartbeat timeout
        registry[wid].last_seen_s = clock() - cfg.controller.heartbeat_timeout_s - 1
    for wid in ids[1:3]:  # w1 and w2 deliver: they leave probation for the controller
        registry[wid].rollouts += 64
        pool.observe(registry[wid], HeartbeatRequest(rollouts=64, busy_s=1.0, installed_version=10))

    def agree(*want: int) -> None:
        listed = set(pool.active_ids())
        assert {w for w in [*ids, "nobody"] if pool.is_active(w)} == listed == {ids[i] for i in want}

    agree(0, 1, 2, 3)  # no target yet: heard from
    pool.retarget(t_train_s=1.0, t_bcast_s=0.1)
    agree(0, 1, 2, 3)  # w1, w2 the controller's; w0, w3 on probation and heard from
    registry.revoke(ids[0], "test")
    pool.quarantine(ids[0], "test")
    agree(1, 2, 3)
    clock.t += cfg.controller.heartbeat_timeout_s + 1  # everyone times out
    agree()
    registry[ids[1]].last_seen_s = clock()
    pool.observe(registry[ids[1]], HeartbeatRequest(rollouts=0, busy_s=0.0, installed_version=10))
    agree(1)


def test_heartbeats_run_at_most_one_controller_round_a_second(tmp_path):
    """Every heartbeat may run a controller round (the controller keeps deciding while an update holds
    the training loop), but a thousand heartbeats in one second run one round, not a thousand
    (``Pool.tick_due``); the housekeeping's own round counts."""
    from echo2.runtime.pool import ROUND_S

    _, _, _, pool, clock = _node(tmp_path)
    pool.retarget(t_train_s=10.0, t_bcast_s=1.0)
    rounds = []
    decide = pool.controller.decide
    pool.controller.decide = lambda now: rounds.append(now) or decide(now)  # type: ignore[method-assign]
    for _ in range(1000):
        pool.tick_due()
    assert len(rounds) == 1
    clock.t += ROUND_S / 2
    pool.tick_due()
    assert len(rounds) == 1
    clock.t += ROUND_S / 2
    pool.tick_due()
    assert len(rounds) == 2
    pool.tick()  # the housekeeping's round ...
    clock.t += ROUND_S / 2
    pool.tick_due()  # ... is the last one
    assert len(rounds) == 3


def test_a_newcomers_turn_is_read_from_the_head_of_the_queue_not_the_whole_queue(tmp_path):
    """A fleet arriving at once: 400 newcomers wait for the probation share. Each request looks at the
    waiters ahead of it from the head of the queue, no further than the room there is (plus the ones
    that stopped asking, which give up their place as it passes them): the same answers as the whole
    queue gave (first refused, first served), at a cost that does not grow with the queue."""
    _, store, broker, pool, clock = _node(tmp_path)
    new = [_register(pool.registry, pool, f"new{i}") for i in range(400)]
    grants = []
    for w in new:
        got = _ask(broker, w)
        grants += [got] if isinstance(got, LeaseGrant) else []
        clock.t += 0.001
    assert len(grants) == 8 and len(broker._waiting) == 392  # the share's 8 leases; the rest wait
    looked: list[str] = []
    asked_within = broker.standings.asked_within
    broker.standings.asked_within = lambda w, now, s: looked.append(w) or asked_within(w, now, s)  # type: ignore[method-assign]
    late = _ask(broker, new[-1])
    assert isinstance(late, LeaseRefusal) and late.reason == "probation_full" and len(looked) <= 8
    for g in grants:  # their leases come to an end: the share has room for 8 again
        store.expire_lease(g.lease_id)
    waiting = list(broker._waiting)
    for w in waiting[:3]:  # the first three stopped asking: they give up their places
        broker.standings.asked(w, -1e9)
    looked.clear()
    assert isinstance(_ask(broker, waiting[3]), LeaseGrant)  # the head of the live queue: its turn
    assert looked == waiting[:3] and waiting[0] not in broker._waiting  # passed over and dropped
    looked.clear()
    assert isinstance(_ask(broker, new[-1]), LeaseRefusal)  # the tail still waits behind 7 places
    assert len(looked) == 7


def test_the_fleet_cadence_stretches_past_its_heartbeat_budget():
    # 200 heartbeats a second at a 1 s period: nothing changes up to 200 members
    members = [0]
    cad = Cadence(1.0, 200.0, lambda: members[0])
    for n, factor, beat, retry in [(0, 1, 1, 0.25), (200, 1, 1, 0.25), (400, 2, 2, 1.0), (1000, 5, 5, 5.0)]:
        members[0] = n
        assert (cad.factor(), cad.heartbeat(), cad.retry()) == (factor, beat, retry)
        assert cad.silence(10.0) == 10.0 * factor  # the silence windows stretch as the period does
    members[0] = 10**9  # a reply may not ask for more than an hour
    assert cad.heartbeat() == cad.retry() == MAX_HEARTBEAT_S


def test_a_large_fleet_is_asked_to_call_less_often_and_its_silence_is_read_over_as_long(tmp_path):
    """With 1,000 members (5x the heartbeat budget) an idle worker's refused lease asks it back after 5 s
    (0.25 s in a small fleet), and the controller's heartbeat timeout is 50 s, not 10: a worker heard
    from 20 s ago is still alive."""
    cfg, _store, broker, pool, clock = _node(tmp_path)
    registry = pool.registry
    cad = Cadence(cfg.runtime.heartbeat_s, cfg.runtime.heartbeats_per_s, registry.slots_held)
    broker.cadence = pool.cadence = cad
    first = _register(registry, pool, "first")
    grant = _ask(broker, first, 1)
    assert isinstance(grant, LeaseGrant)
    again = _ask(broker, first, 1)  # on probation with a lease open: refused
    assert isinstance(again, LeaseRefusal) and again.retry_after_s == 0.25
    for i in range(999):
        _register(registry, pool, f"m{i}")
    clock.t += 1.0  # the slot count is made at most once a second
    assert cad.factor() == 5.0
    again = _ask(broker, first, 1)
    assert isinstance(again, LeaseRefusal) and again.retry_after_s == 5.0
    pool.retarget(t_train_s=1.0, t_bcast_s=0.1)
    pool.tick_due()
    assert pool.controller.config.heartbeat_timeout_s == 5 * cfg.controller.heartbeat_timeout_s
    registry[first].last_seen_s = clock()
    clock.t += 20.0
    assert pool.is_active(first)  # within 50 s (the unstretched 10 s would have lost it)


def test_the_pools_n_min_reads_the_controllers_candidates_once_whatever_the_fleet(tmp_path):
    # asked per registered worker, the candidates' set made /api/state O(N^2): 1.3 s at 10,000 members
    _cfg, _store, _broker, pool, _clock = _node(tmp_path)
    for i in range(50):
        rec, _ = pool.registry.register(RegisterRequest(name=f"w{i}", usd_per_hour=0.35))
        rec.rollouts = 8  # delivered: the controller's candidate
        pool.enroll(rec)
    pool.retarget(t_train_s=1.0, t_bcast_s=0.1)
    asked = []
    known = pool.controller.known
    pool.controller.known = lambda: asked.append(1) or known()  # type: ignore[method-assign]
    assert pool.planned_n_min() is not None and len(asked) == 1
