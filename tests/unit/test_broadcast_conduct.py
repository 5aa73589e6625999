"""What install acks say of the relays: ``wire.relative_pace`` worked by hand, ``conduct.Conduct``'s
findings (two children needed, a starved relay excused, a finding that expires, paces of peers outside
the plan not heard), the links it hands the trees, and ``TreePipelined`` rebuilding its trees when a
member's link moves so that a slow relay serves nobody."""

from __future__ import annotations

from echo2.broadcast.conduct import READ_AFTER, SLOW_VERSIONS, Conduct
from echo2.broadcast.pipelined import TreePipelined
from echo2.broadcast.strategy import LEARNER
from echo2.broadcast.wire import LAG_MIN_CHUNKS, Pace, relative_pace


def _pace(rate: float, count: int) -> Pace:
    p = Pace()
    for j in range(count):
        p.note(j / rate)
    return p


def test_relative_pace_worked_by_hand() -> None:
    others = [_pace(20.0, 20), _pace(10.0, 17), _pace(40.0, 40)]  # median 20/s
    assert relative_pace(_pace(5.0, 12), others) == 0.25
    assert relative_pace(_pace(20.0, 12), others) == 1.0
    assert relative_pace(_pace(5.0, LAG_MIN_CHUNKS - 1), others) is None  # too few chunks of its own
    assert relative_pace(_pace(5.0, 12), [_pace(20.0, LAG_MIN_CHUNKS - 1)]) is None  # no reference


def _versions(c: Conduct, upto: int) -> dict[str, float | None]:
    return c.links(upto, ["a", "b", "c", "d"], dict.fromkeys("abcd"), 1.0)


def test_a_relay_two_children_read_slow_is_placed_low_for_a_while() -> None:
    c = Conduct()
    plan = {"b": {LEARNER, "a"}, "c": {LEARNER, "a"}, "d": {LEARNER, "a", "b"}}
    c.heard(1, "b", {"a": 0.3}, plan["b"])
    assert _versions(c, 1 + READ_AFTER) == dict.fromkeys("abcd")  # one child is not enough
    c.heard(2, "b", {"a": 0.3}, plan["b"])
    c.heard(2, "c", {"a": 0.35, LEARNER: 0.1, "z": 0.1}, plan["c"])  # the learner and a stranger: unheard
    c.heard(2, "d", {"a": 0.9, "b": 1.0}, plan["d"])
    links = _versions(c, 2 + READ_AFTER)
    assert links == {"a": 0.35, "b": 1.0, "c": 1.0, "d": 1.0}  # median of 0.3, 0.35, 0.9: unit x 0.35
    assert c.slow() == {"a": 0.35}
    c.heard(2, "b", {"c": 0.1}, {"c"})  # late acks of a version already read: not heard
    c.heard(2, "d", {"c": 0.1}, {"c"})
    assert _versions(c, 3 + READ_AFTER) == links and c.slow() == {"a": 0.35}
    # a liar that declared 10x the others' link: placed at the fleet's median times its pace, not its claim
    declared = {"a": 100.0, "b": 10.0, "c": 10.0, "d": 10.0}
    assert c.links(2 + READ_AFTER, list("abcd"), declared, 1.0) == {**declared, "a": 10.0 * 0.35}
    partly = {"a": 100.0, "b": 10.0, "c": None, "d": 10.0}  # not every relay declared: the unit for all
    assert c.links(2 + READ_AFTER, list("abcd"), partly, 7.0) == {
        **dict.fromkeys("abcd", 7.0),
        "a": 7.0 * 0.35,
    }
    assert _versions(c, 2 + SLOW_VERSIONS) == links  # held ...
    assert _versions(c, 3 + SLOW_VERSIONS) == dict.fromkeys("abcd")  # ... then it relays as declared again
    assert _versions(c, 4 + SLOW_VERSIONS) == dict.fromkeys("abcd") and c.slow() == {}


def test_a_relay_that_passed_on_a_slow_source_is_excused_one_that_blames_an_honest_one_is_not() -> None:
    c = Conduct()
    c.heard(5, "b", {"a": 0.3}, {"a"})  # b pulls from a, which is slow to b and to c
    c.heard(5, "c", {"a": 0.3}, {"a"})
    c.heard(5, "d", {"b": 0.3}, {"b"})  # b passes a's pace on to d and e
    c.heard(5, "e", {"b": 0.3}, {"b"})
    c.heard(5, "x", {"y": 0.3}, {"y"})  # x blames y, which reads slow to x alone ...
    c.heard(5, "w", {"x": 0.2}, {"x"})
    c.heard(5, "v", {"x": 0.2}, {"x"})
    c.heard(5, "u", {"y": 1.0}, {"y"})  # ... and fine to u: y is not slow, so x is not excused by it
    c.links(5 + READ_AFTER, list("abcdexywvu"), {}, 1.0)
    assert c.slow() == {"a": 0.3, "x": 0.2}  # b was starved by a; y's median (0.3, 1.0) is 0.65


def test_the_trees_are_built_again_when_a_link_moves_and_a_slow_relay_serves_nobody() -> None:
    workers = [f"w{i}" for i in range(12)]
    tree = TreePipelined()
    even = dict.fromkeys(workers, 1.0)
    first = tree.tree(workers, even)
    plan = first.plan(64)
    serving = {a.source for pulls in plan.values() for a in pulls} - {LEARNER}
    assert "w3" in serving  # every member relays a stripe at equal links
    assert tree.tree(workers, even) is first  # kept while nothing moved
    assert tree.tree(workers, {**even, "w3": 0.6}) is first  # within RELINK_FACTOR: kept
    slow = {**even, "w3": 0.3}
    again = tree.tree(workers, slow)
    assert again is not first
    plan = again.plan(64)
    assert "w3" not in {a.source for pulls in plan.values() for a in pulls}  # a leaf in every stripe
    assert any(a.source != LEARNER for a in plan["w3"])  # still pulling from peers
