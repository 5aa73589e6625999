"""Every claimed version is checkable, or the claim is refused (runtime/intake.py): never published,
answered across a restart, or not held by the check; security/checked_* count only real re-runs.
Drawn submissions are checked off the request path: held untrained until the checker's verdict."""

from __future__ import annotations

import asyncio
import os
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from echo2.check.positions import LogHistogram
from echo2.config import SecurityConfig
from echo2.data.store import TrajectoryStore
from echo2.data.submission import Rejected, SubmissionLimits
from echo2.protocol import SubmitRequest
from echo2.runtime.intake import Intake
from echo2.types import Prompt

G = 2
LIMITS = SubmissionLimits(
    vocab_size=50, group_size=G, max_prompt_tokens=8, max_completion_tokens=8, max_groups=2
)


class FakeCheck:
    """The generation check's seam: draws every submission while the share is above 0, holds the
    versions it is given; ``verdict`` decides each check (None: passes), ``gate`` holds it until set."""

    def __init__(
        self,
        held: set[int],
        queue: int = 32,
        fraction: float = 1.0,
        first: int = 3,
        floor: float = 0.0,
        free: int = 0,
    ) -> None:
        self.held = held
        self.runs = 0
        self.checked = self.tokens = self.declined = self.near_ties = self.room = 0
        self.worst_passing_error = 0.0
        self.errors = LogHistogram()
        self.cfg = SecurityConfig(
            check_fraction=fraction, check_floor=min(floor, fraction), check_queue=queue, check_first=first,
            check_behind_free=free,
        )  # fmt: skip
        self.verdict: Rejected | None = None
        self.gate = threading.Event()
        self.gate.set()
        self.draws: list[float] = []  # the submitter's draw (``full``) the intake asked with, in order
        self.pins: dict[int, int] = {}  # version -> drawn submissions waiting for their check of it

    def pick(self, sub: Any, share: float, full: float) -> list[tuple[int, int]]:
        self.draws.append(full)
        if share <= 0:
            self.declined += 1
            return []
        return [(0, 0)]

    def holds(self, version: int) -> bool:
        return version in self.held

    def pin(self, version: int) -> bool:
        if version not in self.held:
            return False
        self.pins[version] = self.pins.get(version, 0) + 1
        return True

    def unpin(self, version: int) -> None:
        self.pins[version] -= 1

    def capacity(self) -> tuple[float, float]:
        return 0.0, 0.0

    def check(self, lease: Any, sub: Any, picks: Any, due: Any = None, graded_from: Any = None) -> list[Any]:
        assert threading.current_thread().name.startswith("echo2-check")  # the checker's own thread
        self.due = due()  # whether the claim was at the admission floor when its check ran
        self.nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        self.gate.wait(10)
        self.runs += 1
        if self.verdict is not None:
            raise self.verdict
        return []


def _body(lease_id: str, version: int) -> SubmitRequest:
    sample = {"prompt_ids": [1], "completion_ids": [2], "sampler_logprobs": [-0.5], "reward": 0.0}
    return SubmitRequest.model_validate(
        {
            "lease_id": lease_id,
            "policy_version": version,
            "groups": [{"prompt_id": "p", "samples": [sample] * G}],
        }
    )


REFUSED: list[tuple[str, str, str]] = []
QUARANTINED: list[tuple[str, str]] = []
RETURNED: list[str] = []  # the lease broker's returns: leases that came back with admitted work
STRUCK: list[tuple[str, str]] = []  # and its strikes: (worker, reason)
RUNNER: list[asyncio.Runner] = []  # one event loop per test: the checker is a task on it


@pytest.fixture(autouse=True)
def _loop():
    with asyncio.Runner() as runner:
        RUNNER[:] = [runner]
        yield
        RUNNER.clear()


EPOCH = 7  # the run epoch of the learner process under test


def _intake(tmp_path: Any, published: set[int], check: FakeCheck, now: list[float]) -> tuple[Intake, Any]:
    store = TrajectoryStore(tmp_path / "s.sqlite", staleness=3, group_size=G)
    for seen in (REFUSED, QUARANTINED, RETURNED, STRUCK):
        seen.clear()
    intake = Intake(
        store=store, limits=LIMITS, version=lambda: 4, published=lambda: max(published), clock=lambda: now[0],
        generation=check,  # type: ignore[arg-type]
        is_published=lambda v: v in published, returned=RETURNED.append, refused=lambda *a: REFUSED.append(a),
        struck=lambda w, why: STRUCK.append((w, why)),
        quarantine=lambda rec, exc: QUARANTINED.append((rec.worker_id, exc.reason)), epoch=EPOCH,
    )  # fmt: skip
    return intake, store


def _submit(
    intake: Intake,
    store: TrajectoryStore,
    version: int,
    issued: float,
    settle: bool = True,
    epoch: int = 0,
    rec: Any = None,
    late: bool = False,
) -> str:
    """What the worker is told: ``pending`` (drawn: held for the check), ``admitted``, ``stale``, or the
    refusal; ``settle``: then wait for the check's verdict. The lease is of this learner's run epoch
    unless ``epoch`` names another, and it expired before the answer when ``late``; the worker ``w`` is
    a new identity unless ``rec`` is given."""
    lease = store.issue_lease(
        "w", [Prompt("p", "1+1=", "2")], now=issued, ttl_s=60.0, seed=1, epoch=epoch or EPOCH
    )
    if late:
        store.expire_leases(issued + 61.0)
    rec = rec or SimpleNamespace(worker_id="w", quarantined="", rollouts=0, checks_passed=0, checks_waiting=0)
    try:
        result = RUNNER[0].run(intake.accept(rec, _body(lease, version)))  # type: ignore[arg-type]
    except Rejected as exc:
        return exc.reason
    if settle:
        RUNNER[0].run(asyncio.wait_for(intake.settled(), 20))
    return "pending" if result.held else "stale" if result.dropped_stale else "admitted"


def test_claims_of_unpublished_versions_are_refused_every_time(tmp_path):
    """kappa = 2: versions 2 and 4 published, 3 never was. 20 forgeries claiming 3: 0 admitted, all
    refused before anything is drawn (the check never ran), counted; claims of 4 are re-run."""
    now = [100.0]
    check = FakeCheck(held={2, 4})
    intake, store = _intake(tmp_path, {0, 2, 4}, check, now)
    got = [_submit(intake, store, 3, issued=200.0) for _ in range(20)]
    assert got == ["unpublished_version"] * 20 and check.runs == 0
    assert store.stats().rejected_by_reason == {"unpublished_version": 20} and store.stats().admitted == 0
    assert _submit(intake, store, 4, issued=200.0) == "pending"
    assert check.runs == 1 and intake.metrics()["security/checked_submissions"] == 1
    # each refused answer was handed to the lease broker (which expires the lease and strikes)
    assert len(REFUSED) == 20 and {r[2] for r in REFUSED} == {"unpublished_version"}


def test_a_version_the_check_does_not_hold_is_refused_not_counted_as_checked(tmp_path):
    now = [100.0]
    check = FakeCheck(held={4})  # 2 is published and admissible (v_t - S = 1) but not held
    intake, store = _intake(tmp_path, {0, 2, 4}, check, now)
    assert _submit(intake, store, 2, issued=200.0) == "unchecked_version"
    assert check.runs == 0 and intake.metrics()["security/checked_submissions"] == 0


def test_a_run_without_a_generation_check_reports_the_same_security_metrics_at_zero(tmp_path):
    """``check_fraction = 0``: no checker; ``security/`` has every key the checker reports, at 0."""
    checked, _ = _intake(tmp_path, {0}, FakeCheck(held={0}), [100.0])
    store = TrajectoryStore(tmp_path / "none.sqlite", staleness=3, group_size=G)
    plain = Intake(store=store, limits=LIMITS, version=lambda: 4, published=lambda: 0, clock=lambda: 100.0)
    assert plain.checker is None and checked.checker is not None
    assert plain.metrics().keys() == checked.metrics().keys()
    assert set(plain.metrics().values()) == {0}


def test_a_lease_of_an_earlier_run_epoch_is_refused(tmp_path):
    """After a restart a version number may name other weights than the ones the worker sampled with: a
    lease of an earlier learner process's run epoch cannot be checked, whenever it was issued (the
    clock of the new process may even be behind the old one's); counted, never drawn."""
    now = [100.0]
    check = FakeCheck(held={4})
    intake, store = _intake(tmp_path, {4}, check, now)
    assert _submit(intake, store, 4, issued=500.0, epoch=EPOCH - 1) == "stale_epoch"
    assert check.runs == 0 and store.stats().rejected_by_reason == {"stale_epoch": 1}
    # the earlier process got further than the checkpoint this one resumed from, or published other
    # numbers: its lease's version is refused by its epoch first, never as a worker's lie (a fault)
    assert _submit(intake, store, 9, issued=500.0, epoch=EPOCH - 1) == "stale_epoch"  # future here
    assert _submit(intake, store, 3, issued=500.0, epoch=EPOCH - 1) == "stale_epoch"  # unpublished here
    assert store.stats().rejected_by_reason == {"stale_epoch": 3} and not QUARANTINED
    assert _submit(intake, store, 4, issued=50.0) == "pending"
    assert check.runs == 1 and not QUARANTINED


@pytest.mark.parametrize("reason", ["unpublished_version", "stale_epoch", "unchecked_version"])
def test_version_refusals_are_not_evidence(reason):
    """None of them quarantines: an honest worker after a restart can trigger each."""
    from echo2.tasks.verify import EVIDENCE

    assert reason not in EVIDENCE


def test_a_body_the_validator_refuses_still_gives_the_lease_back(tmp_path):
    """A log-prob above 0 is refused by the validator: the lease it names is handed to the lease broker
    all the same (so its prompts go out again at once)."""
    now = [100.0]
    intake, store = _intake(tmp_path, {4}, FakeCheck(held={4}), now)
    lease = store.issue_lease("w", [Prompt("p", "1+1=", "2")], now=150.0, ttl_s=60.0, seed=1, epoch=EPOCH)
    body = _body(lease, 4)
    body.groups[0].samples[0].sampler_logprobs = [0.5]
    rec = SimpleNamespace(worker_id="w", quarantined="", rollouts=0)
    with pytest.raises(Rejected, match="logprob"):
        RUNNER[0].run(intake.accept(rec, body))  # type: ignore[arg-type]
    assert len(REFUSED) == 1 and REFUSED[0] == ("w", lease, "logprob")
    other = SimpleNamespace(worker_id="intruder", quarantined="", rollouts=0)
    with pytest.raises(Rejected):
        RUNNER[0].run(intake.accept(other, body))  # type: ignore[arg-type]
    assert len(REFUSED) == 1  # another identity's lease is never given back on its word


def test_a_drawn_submission_is_answered_at_once_and_trained_only_after_its_check(tmp_path):
    """The worker's request returns before the check runs (the check waits on a gate); the groups are
    held untrained meanwhile, released when it passes; the backlog, the share and the latency are
    reported."""
    now = [100.0]
    check = FakeCheck(held={4})
    check.gate.clear()
    intake, store = _intake(tmp_path, {4}, check, now)
    assert _submit(intake, store, 4, issued=150.0, settle=False) == "pending"
    assert check.runs == 0 and store.stats().held == G and store.take_batch(1, 4, step=1) is None
    m = intake.metrics()
    assert m["security/check_backlog"] == 1 and m["security/check_share"] == pytest.approx(1 - 1 / 32)
    check.gate.set()
    RUNNER[0].run(asyncio.wait_for(intake.settled(), 20))
    assert check.runs == 1 and store.stats().held == 0 and store.take_batch(1, 4, step=1) is not None
    assert intake.metrics()["security/check_backlog"] == 0 and intake.checker.latency_s > 0
    assert check.nice == 19  # security.check_nice: the checker yields to the update
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 19  # and only the checker does
    RUNNER[0].run(intake.close())


def test_a_drawn_submission_pins_its_version_until_its_check_ran(tmp_path):
    """Drawn, its version's weights are pinned (the learner's next publication cannot forget them before
    the check ran: a drawn check always runs); unpinned once the check ran, passed or not, and at once
    when the store refuses the submission after it was drawn."""
    now = [100.0]
    check = FakeCheck(held={4})
    check.gate.clear()
    intake, store = _intake(tmp_path, {4}, check, now)
    assert _submit(intake, store, 4, issued=150.0, settle=False) == "pending" and check.pins == {4: 1}
    check.gate.set()
    RUNNER[0].run(asyncio.wait_for(intake.settled(), 20))
    assert check.pins == {4: 0}
    check.verdict = Rejected("forged_generation", "groups[0].samples[0]: not the seeded draw")
    assert _submit(intake, store, 4, issued=150.0) == "pending" and check.pins == {4: 0}
    real = store.submit

    def refused(*a: Any, **k: Any) -> Any:
        raise Rejected("lease_answered", "the store refuses it after the draw")

    store.submit = refused  # type: ignore[method-assign]
    assert _submit(intake, store, 4, issued=150.0) == "lease_answered" and check.pins == {4: 0}
    store.submit = real  # type: ignore[method-assign]
    RUNNER[0].run(intake.close())


def test_a_forgery_found_off_the_request_path_quarantines_and_is_never_trained(tmp_path):
    now = [100.0]
    check = FakeCheck(held={4})
    check.verdict = Rejected("forged_generation", "groups[0].samples[0]: not the seeded draw")
    intake, store = _intake(tmp_path, {4}, check, now)
    assert _submit(intake, store, 4, issued=150.0) == "pending"  # the worker learns nothing at once
    assert QUARANTINED == [("w", "forged_generation")]
    assert store.stats().rejected_by_reason == {"forged_generation": 1}
    assert store.take_batch(1, 4, step=1) is None and store.stats().held == 0
    assert store.stats().unchecked_dropped == G  # the quarantine callback here purges nothing itself
    check.verdict = RuntimeError("the check itself broke")  # type: ignore[assignment]
    assert _submit(intake, store, 4, issued=150.0) == "pending"
    assert store.take_batch(1, 4, step=2) is None and store.stats().unchecked_dropped == 2 * G
    assert len(QUARANTINED) == 1  # an error of the check is no evidence
    RUNNER[0].run(intake.close())


def test_without_a_floor_the_backlog_stays_bounded_by_the_check_queue(tmp_path):
    """check_floor = 0, check_queue = 2: while two checks wait, the share drawn is 0: a proven
    identity's further submissions are not drawn (counted as declined; held behind its own waiting
    checks, not queued), a new identity's are refused (check_busy, no fault of the worker's), never
    admitted unchecked; the backlog never passes 2. (The default floor forbids the first: the next
    test.)"""
    now = [100.0]
    check = FakeCheck(held={4}, queue=2)
    check.gate.clear()
    intake, store = _intake(tmp_path, {4}, check, now)
    proven = SimpleNamespace(worker_id="w", quarantined="", rollouts=0, checks_passed=3, checks_waiting=0)
    got = [_submit(intake, store, 4, issued=150.0, settle=False, rec=proven) for _ in range(5)]
    assert got == ["pending"] * 5 and intake.metrics()["security/held_behind"] == 3
    assert intake.metrics()["security/check_backlog"] == 2 and intake.checker.check_share() == 0
    assert intake.metrics()["security/check_declined"] == 3
    new = [_submit(intake, store, 4, issued=150.0, settle=False) for _ in range(2)]  # checks_passed 0
    assert new == ["check_busy", "check_busy"] and store.stats().rejected == 2
    assert [r[2] for r in REFUSED] == ["check_busy", "check_busy"]  # their leases go back at once
    assert intake.metrics()["security/check_backlog"] == 2
    check.gate.set()
    RUNNER[0].run(asyncio.wait_for(intake.settled(), 20))
    assert check.runs == 2 and store.stats().held == 0 and intake.checker.check_share() == 1.0
    assert RETURNED == ["w"] * 5 and proven.rollouts == 5 * G  # what was held behind went on
    RUNNER[0].run(intake.close())


def test_a_new_identity_is_drawn_whole_however_full_the_queue(tmp_path):
    """check_fraction = 1, check_queue = 4, two checks waiting (the share of a proven identity is 0.5):
    a new identity's draw is still 1, never scaled by the backlog, until the queue is full."""
    now = [100.0]
    check = FakeCheck(held={4}, queue=4)
    check.gate.clear()
    intake, store = _intake(tmp_path, {4}, check, now)
    shares: list[float] = []
    real = check.pick
    check.pick = lambda sub, share, full: shares.append(share) or real(sub, share, full)  # type: ignore[method-assign]
    got = [_submit(intake, store, 4, issued=150.0, settle=False) for _ in range(5)]
    assert got == ["pending"] * 4 + ["check_busy"] and shares == [1.0] * 4
    check.gate.set()
    RUNNER[0].run(asyncio.wait_for(intake.settled(), 20))
    RUNNER[0].run(intake.close())


def test_a_new_identity_is_drawn_every_time_until_it_has_passed_check_first_checks(tmp_path):
    """check_fraction = 0.25, check_first = 2: the first two submissions are drawn with certainty (the
    draw the intake asks with is 1), the third at 0.25 once two checks passed; a check that found a
    forgery proves nothing (the count stays)."""
    now = [100.0]
    check = FakeCheck(held={4}, fraction=0.25, first=2)
    intake, store = _intake(tmp_path, {4}, check, now)
    rec = SimpleNamespace(worker_id="w", quarantined="", rollouts=0, checks_passed=0, checks_waiting=0)
    assert [_submit(intake, store, 4, issued=150.0, rec=rec) for _ in range(3)] == ["pending"] * 3
    assert check.draws == [1.0, 1.0, 0.25] and rec.checks_passed == 3
    other = SimpleNamespace(worker_id="w", quarantined="", rollouts=0, checks_passed=0, checks_waiting=0)
    check.verdict = Rejected("forged_generation", "groups[0].samples[0]: not the seeded draw")
    assert _submit(intake, store, 4, issued=150.0, rec=other) == "pending"
    assert check.draws[-1] == 1.0 and other.checks_passed == 0
    assert intake.metrics()["security/check_share"] == 0.25  # a proven identity's share, queue empty
    RUNNER[0].run(intake.close())


def test_a_waiting_check_is_on_the_workers_record_and_a_claim_at_the_floor_is_due(tmp_path):
    """While its check waits, a drawn submission counts on its worker's record (a new identity gets no
    lease meanwhile, leases.py); the verdict takes it off. A new identity's check is due (it gives no
    update its turn), and so is a proven one's claim at the admission floor (v_t = 4, S = 3: version
    1); a proven identity's newer claim (4) is not."""
    now = [100.0]
    check = FakeCheck(held={1, 4})
    check.gate.clear()
    intake, store = _intake(tmp_path, {1, 4}, check, now)
    rec = SimpleNamespace(worker_id="w", quarantined="", rollouts=0, checks_passed=3, checks_waiting=0)
    assert _submit(intake, store, 1, issued=150.0, settle=False, rec=rec) == "pending"
    assert rec.checks_waiting == 1
    check.gate.set()
    RUNNER[0].run(asyncio.wait_for(intake.settled(), 20))
    assert rec.checks_waiting == 0 and check.due is True  # at the floor
    assert _submit(intake, store, 4, issued=150.0, rec=rec) == "pending" and check.due is False
    check.verdict = Rejected("forged_generation", "groups[0].samples[0]: not the seeded draw")
    new = SimpleNamespace(worker_id="w", quarantined="", rollouts=0, checks_passed=0, checks_waiting=0)
    assert _submit(intake, store, 4, issued=150.0, rec=new) == "pending"
    assert new.checks_waiting == 0 and check.due is True  # a new identity's; refused, taken off too
    RUNNER[0].run(intake.close())


def test_the_floor_holds_whatever_the_queue_does(tmp_path):
    """check_floor = 0.25, check_queue = 2: at a full queue a proven identity's draw falls to the floor
    and no further, and what is drawn waits beyond the queue (held, pending), never admitted unchecked;
    a new identity's is refused (check_busy). The backlog may pass the queue only by drawn submissions
    of proven identities (bounded by the in-flight budget, leases.py)."""
    now = [100.0]
    check = FakeCheck(held={4}, queue=2, floor=0.25)
    check.gate.clear()
    intake, store = _intake(tmp_path, {4}, check, now)
    proven = SimpleNamespace(worker_id="w", quarantined="", rollouts=0, checks_passed=3, checks_waiting=0)
    shares: list[float] = []
    real = check.pick
    check.pick = lambda sub, share, full: shares.append(share) or real(sub, share, full)  # type: ignore[method-assign]
    got = [_submit(intake, store, 4, issued=150.0, settle=False, rec=proven) for _ in range(5)]
    assert got == ["pending"] * 5 and shares == [1.0, 0.5, 0.25, 0.25, 0.25]
    assert intake.checker.check_share() == 0.25 and intake.metrics()["security/check_backlog"] == 5
    assert store.stats().held == 5 * G and store.take_batch(1, 4, step=1) is None  # nothing unchecked
    assert _submit(intake, store, 4, issued=150.0, settle=False) == "check_busy"
    check.gate.set()
    RUNNER[0].run(asyncio.wait_for(intake.settled(), 20))
    assert check.runs == 5 and store.stats().held == 0 and RETURNED == ["w"] * 5 and proven.rollouts == 5 * G
    RUNNER[0].run(intake.close())


def test_a_lease_is_returned_only_by_admitted_work(tmp_path):
    """Not drawn (check_fraction 0): an answer in time is a return; one too stale to admit is a strike,
    never a return; a late one (its lease expired first: that was its strike) is admitted, no return.
    Drawn: the return comes when its check passes, never for a forgery."""
    now = [100.0]
    check = FakeCheck(held={0, 4}, fraction=0.0)
    intake, store = _intake(tmp_path, {0, 4}, check, now)
    proven = SimpleNamespace(worker_id="w", quarantined="", rollouts=0, checks_passed=3, checks_waiting=0)
    assert _submit(intake, store, 4, issued=150.0, rec=proven) == "admitted" and RETURNED == ["w"]
    assert _submit(intake, store, 0, issued=150.0, rec=proven) == "stale"  # v_t 4, S 3: 0 is too old
    assert RETURNED == ["w"] and STRUCK == [("w", "stale")] and proven.rollouts == G
    assert _submit(intake, store, 4, issued=150.0, rec=proven, late=True) == "admitted"
    assert RETURNED == ["w"] and proven.rollouts == 2 * G
    drawn = FakeCheck(held={4})
    intake, store = _intake(tmp_path / "drawn", {4}, drawn, now)
    drawn.gate.clear()
    new = SimpleNamespace(worker_id="w", quarantined="", rollouts=0, checks_passed=0, checks_waiting=0)
    assert _submit(intake, store, 4, issued=150.0, settle=False, rec=new) == "pending"
    assert RETURNED == [] and new.rollouts == 0  # held: not yet admitted work
    drawn.gate.set()
    RUNNER[0].run(asyncio.wait_for(intake.settled(), 20))
    assert RETURNED == ["w"] and new.rollouts == G
    drawn.verdict = Rejected("forged_generation", "groups[0].samples[0]: not the seeded draw")
    assert _submit(intake, store, 4, issued=150.0, rec=new) == "pending" and RETURNED == ["w"]
    RUNNER[0].run(intake.close())


@pytest.mark.parametrize(
    ("reason", "strike", "metric"),
    [
        ("unchecked_version", "check_expired", "security/check_expired"),
        ("graded_tie", None, "security/graded_ties"),
    ],
)
def test_an_expired_check_is_a_strike_and_a_graded_tie_is_not(tmp_path, reason, strike, metric):
    """A drawn submission whose version left the window before its check ran is dropped untrained and
    costs its worker a strike (counted); one dropped for a near tie on a graded token costs nothing
    (honest rounding makes them). Neither quarantines."""
    now = [100.0]
    check = FakeCheck(held={4})
    check.verdict = Rejected(reason, "what the check found")
    intake, store = _intake(tmp_path, {4}, check, now)
    assert _submit(intake, store, 4, issued=150.0) == "pending"
    assert ([("w", strike)] if strike else []) == STRUCK and QUARANTINED == [] and RETURNED == []
    assert intake.metrics()[metric] == 1 and store.stats().unchecked_dropped == G
    assert store.take_batch(1, 4, step=1) is None
    RUNNER[0].run(intake.close())


def test_a_proven_identitys_check_goes_before_a_new_ones(tmp_path):
    """While a check runs, a new identity's submission and then a proven one's arrive: the proven one's
    is checked first (its held groups hold up training and can expire; the new identity only waits)."""
    now = [100.0]
    check = FakeCheck(held={4})
    order: list[str] = []
    real = check.check
    check.check = lambda lease, *a: order.append(lease.lease_id) or real(lease, *a)  # type: ignore[method-assign]
    check.gate.clear()
    intake, store = _intake(tmp_path, {4}, check, now)
    proven = SimpleNamespace(worker_id="w", quarantined="", rollouts=0, checks_passed=3, checks_waiting=0)

    def submit(rec: Any = None) -> str:
        _submit(intake, store, 4, issued=150.0, settle=False, rec=rec)
        return store._db.execute("SELECT lease_id FROM leases ORDER BY rowid DESC LIMIT 1").fetchone()[0]

    first = submit()
    RUNNER[0].run(asyncio.sleep(0.2))  # the checker has taken it (it waits on the gate)
    new, old = submit(), submit(proven)
    check.gate.set()
    RUNNER[0].run(asyncio.wait_for(intake.settled(), 20))
    assert order == [first, old, new]
    RUNNER[0].run(intake.close())


def _scripted(check: FakeCheck, drawn: list[bool]) -> None:
    """The draw follows ``drawn``, one entry a submission (True: drawn), instead of every one."""
    real = check.pick
    script = iter(drawn)
    check.pick = lambda sub, share, full: real(sub, share, full) if next(script) else []  # type: ignore[method-assign]


def _last_lease(store: TrajectoryStore) -> str:
    return str(store._db.execute("SELECT lease_id FROM leases ORDER BY rowid DESC LIMIT 1").fetchone()[0])


def test_what_a_member_sends_while_its_drawn_check_waits_is_held_behind_it(tmp_path):
    """A proven identity's first submission is drawn and its check waits; the two it sends meanwhile are
    not drawn, yet held (``pending``, nothing trainable) until that check passed, then released and
    returned like admitted work. Once no check of its waits, an undrawn submission is admitted at once."""
    now = [100.0]
    check = FakeCheck(held={4})
    _scripted(check, [True, False, False, False])
    check.gate.clear()
    intake, store = _intake(tmp_path, {4}, check, now)
    proven = SimpleNamespace(worker_id="w", quarantined="", rollouts=0, checks_passed=3, checks_waiting=0)
    got = [_submit(intake, store, 4, issued=150.0, settle=False, rec=proven) for _ in range(3)]
    assert got == ["pending"] * 3 and store.stats().held == 3 * G and store.take_batch(1, 4, step=1) is None
    assert check.runs == 0 and RETURNED == [] and proven.rollouts == 0
    assert intake.metrics()["security/held_behind"] == 2 and intake.metrics()["security/check_backlog"] == 1
    check.gate.set()
    RUNNER[0].run(asyncio.wait_for(intake.settled(), 20))
    assert check.runs == 1 and store.stats().held == 0 and RETURNED == ["w"] * 3 and proven.rollouts == 3 * G
    assert _submit(intake, store, 4, issued=150.0, rec=proven) == "admitted"
    assert intake.metrics()["security/dropped_behind"] == 0
    RUNNER[0].run(intake.close())


def test_nothing_sent_after_a_drawn_forgery_is_trained_however_long_its_check_waits(tmp_path):
    """The sleeper's case: a proven identity lies; its first drawn lie waits (the gate) while it sends
    five more, none drawn. The check finds the forgery: the five are dropped untrained with it (counted
    ``dropped_behind``), none returned, though the quarantine here purges nothing itself."""
    now = [100.0]
    check = FakeCheck(held={4})
    check.verdict = Rejected("forged_generation", "groups[0].samples[0]: not the seeded draw")
    _scripted(check, [True] + [False] * 5)
    check.gate.clear()
    intake, store = _intake(tmp_path, {4}, check, now)
    proven = SimpleNamespace(worker_id="w", quarantined="", rollouts=0, checks_passed=3, checks_waiting=0)
    got = [_submit(intake, store, 4, issued=150.0, settle=False, rec=proven) for _ in range(6)]
    assert got == ["pending"] * 6
    check.gate.set()
    RUNNER[0].run(asyncio.wait_for(intake.settled(), 20))
    assert QUARANTINED == [("w", "forged_generation")] and RETURNED == [] and proven.rollouts == 0
    assert store.take_batch(1, 4, step=1) is None and store.stats().held == 0
    assert store.stats().unchecked_dropped == 6 * G
    assert intake.metrics()["security/held_behind"] == 5 and intake.metrics()["security/dropped_behind"] == 5
    RUNNER[0].run(intake.close())


@pytest.mark.parametrize(("reason", "released"), [("graded_tie", True), ("unchecked_version", False)])
def test_a_submission_waits_only_for_the_checks_queued_before_it(tmp_path, reason, released):
    """Drawn A (passes), B behind A, drawn C (``reason``), D behind A and C. B is released by A's pass
    whatever C finds; D goes on only if C found no lie and did not expire (a near tie on a graded token
    is no lie: released; an expired check could not look: dropped)."""
    now = [100.0]
    check = FakeCheck(held={4})
    _scripted(check, [True, False, True, False])
    real = check.check
    failing: list[str] = []

    def check_one(lease: Any, *a: Any) -> Any:
        if lease.lease_id in failing:
            raise Rejected(reason, "what the check found")
        return real(lease, *a)

    check.check = check_one  # type: ignore[method-assign]
    check.gate.clear()
    intake, store = _intake(tmp_path, {4}, check, now)
    proven = SimpleNamespace(worker_id="w", quarantined="", rollouts=0, checks_passed=3, checks_waiting=0)
    leases = []
    for _ in range(4):
        assert _submit(intake, store, 4, issued=150.0, settle=False, rec=proven) == "pending"
        leases.append(_last_lease(store))
    failing.append(leases[2])
    check.gate.set()
    RUNNER[0].run(asyncio.wait_for(intake.settled(), 20))
    trainable = {r[0] for r in store._db.execute("SELECT lease_id FROM rollout_groups WHERE held = 0")}
    dropped = {r[0] for r in store._db.execute("SELECT lease_id FROM rollout_groups WHERE held = 1")}
    assert store.stats().held == 0 and leases[0] in trainable and leases[1] in trainable
    assert leases[2] not in trainable and (leases[3] in trainable) is released
    assert intake.metrics()["security/dropped_behind"] == (0 if released else 1)
    assert ["w"] * (3 if released else 2) == RETURNED and QUARANTINED == [] and not dropped - set(leases)
    RUNNER[0].run(intake.close())


def test_check_behind_free_submissions_go_on_while_a_check_waits_and_no_more(tmp_path):
    """security.check_behind_free = 2: while a drawn submission waits, the next two undrawn ones are
    admitted trainable at once, the third is held behind it; once no check waits the count starts again."""
    now = [100.0]
    check = FakeCheck(held={4}, free=2)
    _scripted(check, [True, False, False, False, True, False, False, False])
    check.gate.clear()
    intake, store = _intake(tmp_path, {4}, check, now)
    proven = SimpleNamespace(worker_id="w", quarantined="", rollouts=0, checks_passed=3, checks_waiting=0)
    got = [_submit(intake, store, 4, issued=150.0, settle=False, rec=proven) for _ in range(4)]
    assert (
        got == ["pending", "admitted", "admitted", "pending"]
        and intake.metrics()["security/held_behind"] == 1
    )
    check.gate.set()
    RUNNER[0].run(asyncio.wait_for(intake.settled(), 20))
    assert store.stats().held == 0 and RETURNED == ["w"] * 4
    check.gate.clear()
    got = [_submit(intake, store, 4, issued=150.0, settle=False, rec=proven) for _ in range(4)]
    assert got == ["pending", "admitted", "admitted", "pending"]
    check.gate.set()
    RUNNER[0].run(asyncio.wait_for(intake.settled(), 20))
    RUNNER[0].run(intake.close())
