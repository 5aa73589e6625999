"""The No-Limit Hold'em text environment (``envs/poker.py``): determinism, duplicate deals, chip
conservation, the reward, the action fallback, the observation format, the opponents' styles."""

from __future__ import annotations

import random
import string
from collections import Counter
from collections.abc import Callable

import pytest
from pokerkit import Card, Deck, StandardHighHand

from echo2.config import PokerTaskConfig
from echo2.envs.base import EnvError, EnvStep, TextEnv
from echo2.envs.poker import (
    ACTIONS,
    MAX_OBSERVATION_CHARS,
    PROMPT_MARKER,
    Opponent,
    PokerEnv,
    SeatView,
    TextPolicyOpponent,
    hand_strength,
    parse_action,
    rule_player,
)
from echo2.envs.poker_players import HighHand

PRINTABLE = set(string.printable) - set("\t\r\x0b\x0c")


def cfg(players: int = 2, **kw: object) -> PokerTaskConfig:
    return PokerTaskConfig(players=players, **kw)


class Fixed:
    """An opponent that always answers the same text (legal or not)."""

    def __init__(self, answer: str) -> None:
        self.answer = answer

    def act(self, view: SeatView, rng: random.Random) -> str:
        return self.answer


class Recording:
    """Wraps an opponent and records its views and answers."""

    def __init__(self, inner: Opponent) -> None:
        self.inner = inner
        self.views: list[SeatView] = []
        self.answers: list[str] = []

    def act(self, view: SeatView, rng: random.Random) -> str:
        answer = self.inner.act(view, rng)
        self.views.append(view)
        self.answers.append(answer)
        return answer


def play(env: PokerEnv, first: str, choose: Callable[[str], str]) -> tuple[list[str], list[EnvStep]]:
    """Play the hand from its first observation; ``choose`` answers each observation."""
    observations, steps = [first], []
    while True:
        step = env.step(choose(observations[-1]))
        steps.append(step)
        if step.done:
            return observations, steps
        observations.append(step.observation)


def random_hands(env: PokerEnv, hands: int, seed: int = 0) -> list[tuple[list[str], list[EnvStep]]]:
    rng = random.Random(seed)
    garbage = ["f", "c", "r", "a", "F", " c\n", "R!", "", "x", "?"]
    out = []
    for s in range(hands):
        first = env.reset(seed * 100_000 + s)
        out.append(play(env, first, lambda _obs: rng.choice(garbage)))
        assert sum(env.payoffs) == 0
        assert out[-1][1][-1].reward == pytest.approx(env.chip_change_bb)
    return out


def assert_observation(obs: str) -> None:
    assert len(obs) <= MAX_OBSERVATION_CHARS, obs
    assert set(obs) <= PRINTABLE, obs
    assert obs.endswith(PROMPT_MARKER) and obs.count("\n") == 1, obs


# --- the action language ---------------------------------------------------------------------------


def test_parse_action() -> None:
    assert set(ACTIONS) == {"f", "c", "r", "a"}
    assert parse_action("c") == "c"
    assert parse_action("  R\n") == "r"
    assert parse_action("Call") == "c"
    assert parse_action("all in") == "a"
    for bad in ("", "   ", "x", "?", "1", "\n"):
        assert parse_action(bad) is None


# --- determinism and deals -------------------------------------------------------------------------


@pytest.mark.parametrize("players", [2, 6])
def test_same_seed_same_actions_same_hand(players: int) -> None:
    def run() -> list[tuple[list[str], list[EnvStep]]]:
        env = PokerEnv(cfg(players), [rule_player("lag")])  # lag draws from its rng
        return random_hands(env, 30, seed=players)

    assert run() == run()


def test_reset_draws_deal_and_seat_from_seed() -> None:
    env = PokerEnv(cfg(6), [rule_player("station")])
    seats = set()
    for seed in range(60):
        first = env.reset(seed)
        seats.add(env.hero_seat)
        assert env.reset(seed) == first
    assert seats == set(range(6))


@pytest.mark.parametrize("players", [2, 3, 6])
def test_reset_deal_gives_each_seat_the_same_cards(players: int) -> None:
    env = PokerEnv(cfg(players), [rule_player("station")])
    for deal in (0, 7, 123456789):
        holes, boards = [], []
        for hero in range(players):
            env.reset_deal(deal, hero)
            assert env.hero_seat == hero
            assert env.state is not None
            holes.append([tuple(h) for h in env.state.hole_cards])
            play(env, "", lambda _obs: "c")  # station everywhere: the hand goes to the river
            boards.append(tuple(env.state.get_board_cards(0)))
        assert all(h == holes[0] for h in holes)
        assert len(set(boards)) == 1 and len(boards[0]) == 5
        dealt = [c for h in holes[0] for c in h] + list(boards[0])
        assert len(set(dealt)) == len(dealt)


def test_opponents_sit_to_the_heros_left_in_order() -> None:
    recs = [Recording(rule_player("station")) for _ in range(5)]
    env = PokerEnv(cfg(6), recs)
    for hero in range(6):
        env.reset_deal(3, hero)
        play(env, "", lambda _obs: "c")
        for j, rec in enumerate(recs):
            assert {v.seat for v in rec.views} == {(hero + 1 + j) % 6}
            rec.views.clear()


def test_opponent_count_must_fit_the_table() -> None:
    with pytest.raises(ValueError, match="opponents"):
        PokerEnv(cfg(6), [rule_player("tag"), rule_player("lag")])
    PokerEnv(cfg(3), [rule_player("tag"), rule_player("lag")])
    with pytest.raises(ValueError, match="hero_seat"):
        PokerEnv(cfg(2), [rule_player("tag")]).reset_deal(0, 2)


# --- rewards, chips, config ------------------------------------------------------------------------


@pytest.mark.parametrize("players", [2, 6])
def test_return_is_the_chip_change_and_chips_are_conserved(players: int) -> None:
    env = PokerEnv(cfg(players), [rule_player("lag")])
    changes = []
    for observations, steps in random_hands(env, 100, seed=1):
        assert all(s.reward == 0.0 for s in steps[:-1])
        assert [s.done for s in steps] == [False] * (len(steps) - 1) + [True]
        assert steps[-1].observation == ""
        assert len(observations) == len(steps)
        changes.append(sum(s.reward for s in steps))
    assert any(c > 0 for c in changes) and any(c < 0 for c in changes)


def test_blinds_and_stacks_from_config() -> None:
    c = cfg(3, small_blind=5, big_blind=10, stack_bb=50)
    env = PokerEnv(c, [rule_player("station")])
    env.reset_deal(11, 0)  # seat 0 = small blind at a 3-handed table; the button (seat 2) acted first
    assert env.state is not None and env.state.starting_stacks == (500, 500, 500)
    view = env.hero_view()
    assert (view.pot, view.to_call, view.stack, view.big_blind) == (25, 5, 495, 10)
    assert view.history == "c"  # the button limped (the station)
    assert view.text.startswith("P2 ") and " p3 c1 s50 n2 o:c\n>" in view.text  # 2.5 BB -> 3, 49.5 -> 50
    step = env.step("f")
    assert step.done and step.reward == pytest.approx(-0.5) == env.chip_change_bb
    assert env.payoffs[0] == -5 and sum(env.payoffs) == 0


def test_pot_sized_raise_and_all_in() -> None:
    bb = Recording(rule_player("station"))
    env = PokerEnv(cfg(2, stack_bb=20), [bb])
    env.reset_deal(5, 1)  # hero on the button: small blind, acts first
    assert env.hero_view().raise_to == 6  # pot-sized: call 1 to 2, then raise the pot of 4
    env.step("r")
    assert bb.views[0].to_call == 4 and bb.views[0].history == "r"
    assert bb.views[1].street == "F" and bb.views[1].history == "/"  # it called; the flop came
    env.reset_deal(5, 1)
    bb.views.clear()
    step = env.step("a")
    assert bb.views[0].to_call == 38 and bb.views[0].history == "a" and bb.views[0].legal == "fca"
    assert step.done  # the station called all-in: the board ran out
    assert abs(step.reward) in (0.0, 20.0)


# --- the fallback ----------------------------------------------------------------------------------


def test_garbage_and_illegal_actions_fall_back_to_check_or_fold() -> None:
    env = PokerEnv(cfg(2), [rule_player("station")])
    env.reset_deal(1, 1)  # hero is the small blind: calling costs 1 chip, folding is legal
    step = env.step("zzz")
    assert step.illegal and step.done and step.reward == pytest.approx(-0.5)  # folded

    env.reset_deal(1, 0)  # hero in the big blind; the station limped: checking is free
    assert env.hero_view().to_call == 0 and "f" not in env.hero_view().legal
    step = env.step("f")
    assert step.illegal and not step.done  # checked instead: the flop comes
    assert step.observation.startswith("F")
    step = env.step("")
    assert step.illegal and not step.done and step.observation.startswith("T")  # empty: checked

    env.reset_deal(1, 0)
    assert not env.step("c").illegal


def test_raise_that_is_not_possible_is_clipped_to_a_call() -> None:
    env = PokerEnv(cfg(2), [Fixed("a")])  # the opponent shoves every time
    env.reset_deal(2, 0)  # hero in the big blind facing the button's all-in
    view = env.hero_view()
    assert view.legal == "fca" and view.raise_to is None and view.history == "a"
    step = env.step("r")  # no raise over an all-in of an equal stack: clipped to the call
    assert not step.illegal and step.done and step.reward in (-20.0, 0.0, 20.0)
    env.reset_deal(2, 0)
    step = env.step("a")  # calling all-in is "a"
    assert not step.illegal and step.done and step.reward in (-20.0, 0.0, 20.0)


def test_opponents_illegal_answers_get_the_fallback() -> None:
    env = PokerEnv(cfg(2), [Fixed("nonsense")])
    env.reset_deal(4, 0)  # the opponent (button) answers garbage facing the big blind: it folds...
    # ... but a fold before the hero's first decision would be a walk: it calls instead.
    assert env.hero_view().history == "c" and env.opponent_illegal == 1
    step = env.step("r")
    assert not step.illegal and step.done and step.reward == pytest.approx(1.0)  # garbage -> fold
    assert env.opponent_illegal == 2


def test_text_policy_opponent_sees_its_own_observation() -> None:
    seen: list[str] = []

    def policy(text: str) -> str:
        seen.append(text)
        return "garbage" if len(seen) % 3 == 0 else "c"

    opp = TextPolicyOpponent(policy)
    env = PokerEnv(cfg(6), [opp])
    random_hands(env, 20, seed=3)
    assert seen and opp.illegal > 0
    for text in seen:
        assert_observation(text)
    assert env.opponent_illegal == 0  # the wrapper applied the fallback itself


# --- no walks --------------------------------------------------------------------------------------


@pytest.mark.parametrize("players", [2, 6])
def test_hero_always_gets_a_decision(players: int) -> None:
    env = PokerEnv(cfg(players), [Fixed("f")])  # everyone folds whenever folding is legal
    big_blind = 0 if players == 2 else 1
    for hero in range(players):
        first = env.reset_deal(9, hero)
        assert_observation(first)
        if hero == big_blind:  # the last opponent's fold would have been a walk: it called
            assert env.hero_view().history == "f" * (players - 2) + "c"
        step = env.step("r")  # after the hero's first decision, opponents fold freely
        assert step.done and step.reward > 0


def test_many_deals_always_reach_the_hero() -> None:
    env = PokerEnv(cfg(6), [rule_player("tag")])
    for seed in range(150):
        assert_observation(env.reset(seed))
        assert env.hero_view().seat == env.hero_seat


def test_no_step_without_a_hand() -> None:
    env = PokerEnv(cfg(2), [rule_player("tag")])
    with pytest.raises(EnvError):
        env.step("c")
    env.reset(0)
    play(env, "", lambda _obs: "f")
    with pytest.raises(EnvError):
        env.step("c")
    with pytest.raises(EnvError):
        env.hero_view()


# --- observations ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("players", "stack_bb", "styles"),
    [
        (2, 20, ["station"]),
        (6, 20, ["tag", "station", "lag", "tag", "lag"]),
        (6, 1000, ["lag", "station", "station", "lag", "station"]),  # long amounts, long histories
    ],
)
def test_random_hands_play_and_observations_are_compact(
    players: int, stack_bb: int, styles: list[str]
) -> None:
    env: TextEnv = PokerEnv(cfg(players, stack_bb=stack_bb), [rule_player(s) for s in styles])  # type: ignore[arg-type]
    assert isinstance(env, PokerEnv)
    hands = random_hands(env, 500 if stack_bb == 20 else 100, seed=players)
    streets: Counter[str] = Counter()
    for observations, _steps in hands:
        for obs in observations:
            assert_observation(obs)
            streets[obs[0]] += 1
    assert set(streets) == set("PFTR")
    assert any(s.illegal for _, steps in hands for s in steps)


def test_observation_fields() -> None:
    env = PokerEnv(cfg(2), [rule_player("station")])
    first = env.reset_deal(5, 1)
    view = env.hero_view()
    hole = "".join(view.hole)
    assert first == f"P0 {hole}||h{view.strength} p2 c1 s20 n1 o:\n>"  # 1.5 BB pot, 0.5 to call
    step = env.step("c")
    board = "".join(env.hero_view().board)
    assert len(env.hero_view().board) == 3
    assert step.observation == f"F0 {hole}|{board}|h{env.hero_view().strength} p2 c0 s19 n1 o:x/x\n>"


def test_long_histories_are_cut_from_the_left() -> None:
    view = SeatView(
        seat=0,
        players=6,
        position=5,
        street="R",
        hole=("As", "Kd"),
        board=("Ah", "Kh", "2c", "7d", "9s"),
        pot=2 * 6000,
        to_call=2 * 999,
        stack=2 * 1000,
        big_blind=2,
        raise_to=None,
        legal="fca",
        history="rcccc/rcccc/rcccc/rcca",
        opponents_in=5,
    )  # no pokerkit cards given: the view parses its strings
    assert view.strength == 5
    assert view.text.startswith("R5 AsKd|AhKh2c7d9s|h5 p6000 c999 s1000 n5 o:")
    assert_observation(view.text)
    assert len(view.text) == MAX_OBSERVATION_CHARS and view.text.endswith("rcccc/rcca\n>")


# --- hand strength ---------------------------------------------------------------------------------


def cards(text: str) -> list[Card]:
    return list(Card.parse(text))


@pytest.mark.parametrize(
    ("hole", "board", "bucket"),
    [
        ("AsAh", "", 9),
        ("KsKd", "", 8),
        ("AsKs", "", 6),
        ("7h2c", "", 0),
        ("Ks3d", "Ad7c2h", 0),  # king high
        ("QhJh", "Th9h2c", 1),  # flush and straight draw
        ("8c8d", "KdKc5h", 2),  # a pair under the board's pair
        ("Ad4c", "Ac9d2h", 3),  # top pair, weak kicker
        ("AsKd", "Ad7c2h", 4),  # top pair, good kicker
        ("7c7d", "5s4d2h", 4),  # overpair
        ("Ah7d", "Ad7c2h", 5),  # two pair
        ("7s7d", "Ad7c2h", 6),  # set
        ("5s6s", "7h8h9c", 6),  # straight
        ("Kc3c", "4c5c9c8c2c", 7),  # a flush better than the board's
        ("2d3d", "4c5c9c8cKc", 0),  # plays the board's flush
        ("AcKd", "QsQdQh", 0),  # trips on the board
        ("AdAc", "AhKdKs", 8),  # full house
    ],
)
def test_hand_strength_buckets(hole: str, board: str, bucket: int) -> None:
    assert hand_strength(cards(hole), cards(board)) == bucket


def test_memoized_hands_agree_with_pokerkit() -> None:
    deck = list(Deck.STANDARD)
    rng = random.Random(0)
    for _ in range(400):
        sample = rng.sample(deck, rng.choice([5, 6, 7]))
        ours = HighHand.from_game(sample[:2], sample[2:])
        theirs = StandardHighHand.from_game(sample[:2], sample[2:])
        assert ours.entry == theirs.entry


# --- opponents -------------------------------------------------------------------------------------


def test_opponent_styles_are_distinct() -> None:
    freq: dict[str, tuple[float, float]] = {}
    for style in ("tag", "station", "lag"):
        rec = Recording(rule_player(style))
        env = PokerEnv(cfg(2), [rec])
        random_hands(env, 200, seed=7)
        facing = [a for v, a in zip(rec.views, rec.answers, strict=True) if v.to_call > 0]
        raises = sum(a in "ra" for a in rec.answers) / len(rec.answers)
        folds = facing.count("f") / len(facing)
        freq[style] = (raises, folds)
    assert freq["lag"][0] > freq["tag"][0] > freq["station"][0] == 0.0
    assert freq["tag"][1] > freq["lag"][1] > freq["station"][1] == 0.0


def test_rule_players_are_deterministic_in_their_rng() -> None:
    env = PokerEnv(cfg(6), [Recording(rule_player("lag"))])
    env.reset(0)
    view = env.hero_view()
    lag = rule_player("lag")
    assert [lag.act(view, random.Random(1)) for _ in range(3)] == [lag.act(view, random.Random(1))] * 3
    assert all(rule_player("tag").act(view, random.Random(i)) in view.legal for i in range(5))
    with pytest.raises(ValueError):
        rule_player("shark")  # type: ignore[arg-type]
