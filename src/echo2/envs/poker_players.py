"""The seat side of the poker environment (``envs/poker.py``): what a seat sees, how an action is read,
how strong a hand is, and the players that decide from it.

* :class:`SeatView` -- everything the player at one seat may see when it must act, with its rendered
  observation ``text`` (one renderer, :func:`render`, for every seat: the hero, a rule-based
  opponent and a self-play opponent all see the same kind of line).
* :data:`ACTIONS`, :func:`parse_action`, :func:`resolve_action` -- the one-letter action language and
  its fallback (check if free, else fold), documented in ``envs/poker.py``.
* :func:`hand_strength` -- the single-digit strength bucket 0-9 of the observation: preflop a Chen
  score of the two hole cards, postflop the made-hand category (pokerkit's ``StandardHighHand``)
  counted only where the seat's own cards improve on the board.
* :func:`rule_player` (``tag``, ``station``, ``lag``) and :class:`TextPolicyOpponent` -- opponents.

Everything here is pure: an opponent's randomness comes only from the ``random.Random`` the
environment passes it (one per seat, seeded from the deal), so a hand replays exactly.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final, Literal, Protocol

from pokerkit import Card, CardsLike, Entry, Hand, Label, StandardHighHand

Style = Literal["tag", "station", "lag"]

ACTIONS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "f": "fold",
        "c": "check, or call the amount to call",
        "r": "raise to about the pot (pot-sized raise; at least the legal minimum, at most all-in)",
        "a": "all-in (raise all-in, or a call that commits the whole stack)",
    }
)
"""The action language: one lower-case letter per decision (the model writes it, then EOS)."""

STREETS: Final[str] = "PFTR"  # preflop, flop, turn, river (the street letter of the observation)

_RANK: Final[Mapping[str, int]] = MappingProxyType({r: i for i, r in enumerate("23456789TJQKA", start=2)})
_LABEL_ORDER: Final[Mapping[Label, int]] = MappingProxyType({label: i for i, label in enumerate(Label)})
_STRAIGHT_WINDOWS: Final[tuple[frozenset[int], ...]] = tuple(
    frozenset(range(low, low + 5)) for low in range(1, 11)
)  # 1 = the ace played low (A-2-3-4-5) ... 10 = T-J-Q-K-A


MAX_OBSERVATION_CHARS: Final[int] = 60
PROMPT_MARKER: Final[str] = "\n>"  # ends every observation; the model's action follows it


@dataclass(frozen=True)
class SeatView:
    """What the player at ``seat`` may see when it must act: amounts in chips, and the observation
    ``text`` rendered from them (in big blinds). ``strength`` and ``text`` are computed on first use
    (a calling station needs neither)."""

    seat: int  # pokerkit's player index (2 players: 0 = big blind, 1 = button/small blind; else 0 = SB)
    players: int  # seats at the table
    position: int  # players - 1 - seat: 0 = the button (acts last after the flop)
    street: str  # one of STREETS
    hole: tuple[str, ...]  # the seat's two hole cards as pokerkit writes them, e.g. ("Kh", "9s")
    board: tuple[str, ...]  # the board so far (0, 3, 4 or 5 cards)
    pot: int  # chips in the pot, including the bets in front of the players this street
    to_call: int  # chips the seat must add to call (0: checking is free)
    stack: int  # chips behind (not yet bet)
    big_blind: int  # chips
    raise_to: int | None  # the total bet ``r`` makes, None when no raise is possible
    legal: str  # the letters of ACTIONS legal now, in ACTIONS order ("c" always is)
    history: str  # the others' actions since this seat's last decision (see envs/poker.py)
    opponents_in: int  # other seats still in the hand
    cards: tuple[Card, ...] | None = field(default=None, repr=False, compare=False)  # hole + board, parsed

    @functools.cached_property
    def strength(self) -> int:
        """The hand-strength bucket 0-9 (:func:`hand_strength`)."""
        cards = self.cards if self.cards is not None else tuple(Card.parse("".join(self.hole + self.board)))
        return hand_strength(cards[: len(self.hole)], cards[len(self.hole) :])

    @functools.cached_property
    def text(self) -> str:
        """The rendered observation for this seat (:func:`render`)."""
        return render(self)

    @property
    def fallback(self) -> str:
        """The action an unparsable or illegal answer becomes: check if free, else fold."""
        return "c" if self.to_call == 0 else "f"

    @property
    def price(self) -> float:
        """Pot odds: the share of the pot after calling that the call costs (0 when checking is free)."""
        return self.to_call / (self.pot + self.to_call) if self.to_call else 0.0


def _in_bb(chips: int, big_blind: int) -> int:
    return (2 * chips + big_blind) // (2 * big_blind)  # rounded half up


def render(view: SeatView) -> str:
    """The observation text of ``view``'s seat (format in ``envs/poker.py``'s docstring)."""
    bb = view.big_blind
    call = max(1, _in_bb(view.to_call, bb)) if view.to_call else 0
    head = (
        f"{view.street}{view.position} {''.join(view.hole)}|{''.join(view.board)}|h{view.strength}"
        f" p{_in_bb(view.pot, bb)} c{call} s{_in_bb(view.stack, bb)} n{view.opponents_in} o:"
    )
    room = MAX_OBSERVATION_CHARS - len(head) - len(PROMPT_MARKER)
    history = view.history[max(0, len(view.history) - room) :] if room > 0 else ""
    return head + history + PROMPT_MARKER


def parse_action(text: str) -> str | None:
    """The action letter of ``text``: strip whitespace, take the first character, lower-case it;
    ``None`` when that is not a letter of :data:`ACTIONS` (or the text is empty)."""
    stripped = text.strip()
    if not stripped:
        return None
    letter = stripped[0].lower()
    return letter if letter in ACTIONS else None


def resolve_action(view: SeatView, text: str) -> tuple[str, bool]:
    """The letter the environment applies for ``text`` at ``view`` and whether the fallback was used
    (the text was unparsable, or its action is not legal now)."""
    letter = parse_action(text)
    if letter is not None and letter in view.legal:
        return letter, False
    if letter in ("r", "a") and view.raise_to is None:  # no raise possible: clipped to a check / call
        return "c", False
    return view.fallback, True


# --- hand strength -------------------------------------------------------------------------------


class HighHand(StandardHighHand):
    """pokerkit's ``StandardHighHand`` (same lookup, same order), memoized: a hand's entry is computed
    once, and the best hand of a set of cards is remembered (pokerkit re-evaluates the same hands many
    times per showdown). The environment's game uses this type for all its hands."""

    @functools.cached_property
    def entry(self) -> Entry:
        return self.lookup.get_entry(self.cards)

    @classmethod
    def from_game(cls, hole_cards: CardsLike, board_cards: CardsLike = ()) -> Hand:
        best = _best_hand(frozenset((*Card.clean(hole_cards), *Card.clean(board_cards))))
        if best is None:
            raise ValueError(f"no {cls.__qualname__} can be formed from {hole_cards!r} and {board_cards!r}")
        return best


@functools.lru_cache(maxsize=1 << 16)
def _best_hand(cards: frozenset[Card]) -> HighHand | None:
    """pokerkit's ``CombinationHand.from_game`` (the first strongest five-card combination), with one
    lookup per combination and the cards in a fixed order."""
    best: tuple[Card, ...] | None = None
    best_entry: Entry | None = None
    for combination in itertools.combinations(sorted(cards, key=repr), HighHand.card_count):
        entry = HighHand.lookup.get_entry_or_none(combination)
        if entry is not None and (best_entry is None or entry > best_entry):
            best, best_entry = combination, entry
    return None if best is None else HighHand(best)


def chen_score(hole: Sequence[Card]) -> int:
    """Bill Chen's preflop score of two hole cards (-1 for 72o ... 20 for AA), halves rounded up."""
    high, low = sorted((_RANK[c.rank] for c in hole), reverse=True)
    top = {14: 10.0, 13: 8.0, 12: 7.0, 11: 6.0}.get(high, high / 2)
    if high == low:
        return int(max(5.0, 2 * top))
    score = top + (2.0 if hole[0].suit == hole[1].suit else 0.0)
    gap = high - low - 1
    score -= (0.0, 1.0, 2.0, 4.0)[gap] if gap < 4 else 5.0
    if gap <= 1 and high < 12:
        score += 1.0
    return -int(-score // 1)  # ceil


def _board_label(board: Sequence[Card]) -> int:
    if len(board) == 5:
        return _LABEL_ORDER[HighHand.from_game(board).entry.label]
    counts = [*sorted(Counter(c.rank for c in board).values(), reverse=True), 0, 0]
    if counts[0] == 4:
        return _LABEL_ORDER[Label.FOUR_OF_A_KIND]
    if counts[0] == 3:
        return _LABEL_ORDER[Label.THREE_OF_A_KIND]
    if counts[0] == 2:
        return _LABEL_ORDER[Label.TWO_PAIR if counts[1] == 2 else Label.ONE_PAIR]
    return _LABEL_ORDER[Label.HIGH_CARD]


def _has_draw(hole: Sequence[Card], board: Sequence[Card]) -> bool:
    """Four to a flush or four of five straight ranks, with at least one of the seat's own cards."""
    cards = [*hole, *board]
    suits = Counter(c.suit for c in cards)
    if any(n == 4 and any(c.suit == s for c in hole) for s, n in suits.items()):
        return True

    def ranks(cs: Iterable[Card]) -> set[int]:
        out = {_RANK[c.rank] for c in cs}
        return out | {1} if 14 in out else out

    mine, every = ranks(hole), ranks(cards)
    return any(len(w & every) == 4 and w & mine for w in _STRAIGHT_WINDOWS)


def _pair_bucket(pair: int, hole_ranks: Sequence[int], board_ranks: Sequence[int]) -> int:
    """A pair of the seat's: 4 overpair or top pair with a J+ kicker, 3 top pair, 2 any lower pair."""
    top = max(board_ranks)
    if hole_ranks[0] == hole_ranks[1]:
        return 4 if pair > top else 2
    if pair != top:
        return 2
    kicker = hole_ranks[1] if hole_ranks[0] == pair else hole_ranks[0]
    return 4 if kicker >= 11 else 3


def hand_strength(hole: Sequence[Card], board: Sequence[Card]) -> int:
    """The strength bucket 0-9 of ``hole`` with ``board`` (see :func:`_strength`; memoized)."""
    return _strength(tuple(hole), tuple(board))


@functools.lru_cache(maxsize=1 << 14)
def _strength(hole: tuple[Card, ...], board: tuple[Card, ...]) -> int:
    """The strength bucket 0-9 of ``hole`` with ``board`` (deterministic).

    Preflop: ``chen_score // 2`` clamped to 0..9 (AA 9, KK 8, QQ 7, JJ/AKs 6, TT/AKo 5, 99/AQo 4,
    72o 0). Postflop, by pokerkit's best five-card hand, counted only where it beats what the board
    alone makes (a hand the board makes by itself is worth nothing): 0 nothing, 1 nothing but a flush
    or straight draw (flop and turn), 2 a lower pair, 3 top pair, 4 top pair with a J+ kicker or an
    overpair, 5 two pair from both hole cards or trips with one, 6 a set or a straight, 7 a flush,
    8 a full house, 9 four of a kind or a straight flush (on a river board that makes a straight or
    better by itself, such a hand counts only when the seat's own cards beat the board's).
    """
    if not board:
        return max(0, min(9, chen_score(hole) // 2))
    hand = HighHand.from_game(hole, board)
    label = hand.entry.label
    mine = sorted((_RANK[c.rank] for c in hole), reverse=True)
    on_board = [_RANK[c.rank] for c in board]
    board_label = _board_label(board)
    beats_board_made = (  # a straight or better on a board that makes one itself, beaten by own cards
        len(board) == 5
        and _LABEL_ORDER[label] >= _LABEL_ORDER[Label.STRAIGHT]
        and hand > HighHand.from_game(board)
    )
    if _LABEL_ORDER[label] <= board_label and not beats_board_made:
        return 1 if len(board) < 5 and _has_draw(hole, board) else 0
    paired = [r for r in mine if r in on_board]
    match label:
        case Label.ONE_PAIR | Label.TWO_PAIR:
            if label is Label.TWO_PAIR and len(set(paired)) == 2 and board_label == 0:
                return 5
            pair = mine[0] if mine[0] == mine[1] else max(paired)
            return _pair_bucket(pair, mine, on_board)
        case Label.THREE_OF_A_KIND:
            return 6 if mine[0] == mine[1] else 5
        case Label.STRAIGHT:
            return 6
        case Label.FLUSH:
            return 7
        case Label.FULL_HOUSE:
            return 8
        case _:
            return 9


# --- players -------------------------------------------------------------------------------------


class Opponent(Protocol):
    """A player at a non-hero seat: answers its view with an action string of the action language."""

    def act(self, view: SeatView, rng: random.Random) -> str: ...


def _first_legal(view: SeatView, *letters: str) -> str:
    return next((a for a in letters if a in view.legal), view.fallback)


@dataclass(frozen=True)
class RulePlayer:
    """A rule-based player of one style (see :func:`rule_player`)."""

    style: Style

    def act(self, view: SeatView, rng: random.Random) -> str:
        if self.style == "station":
            return "c"
        if self.style == "tag":
            return self._tag(view)
        return self._lag(view, rng)

    @staticmethod
    def _tag(view: SeatView) -> str:
        preflop = not view.board
        strong, medium = (6, 4) if preflop else (4, 2)
        if view.strength >= strong:
            return _first_legal(view, "r", "a", "c")
        if view.to_call == 0:
            return "c"
        if view.strength >= medium and view.price <= 0.35:
            return "c"
        if not preflop and view.strength == 1 and view.price <= 0.25:
            return "c"  # a draw at a small price
        return "f"

    @staticmethod
    def _lag(view: SeatView, rng: random.Random) -> str:
        preflop = not view.board
        strong, medium, weakest = (5, 3, 1) if preflop else (4, 2, 0)
        if view.strength >= strong:
            return _first_legal(view, "a" if rng.random() < 0.15 else "r", "a", "c")
        if rng.random() < (0.6 if view.strength >= medium else 0.35):
            return _first_legal(view, "r", "c")
        if view.strength <= weakest and view.price > 0.3:
            return "f"  # only the very weakest hands fold, and only facing a big bet
        return "c"


def rule_player(style: Style) -> Opponent:
    """A rule-based opponent, deterministic given the rng the environment passes it.

    * ``tag`` tight-aggressive: raises strong hands (preflop bucket >= 6, postflop >= 4), calls medium
      ones (preflop >= 4, postflop a pair, or a draw at a small price) when the call costs at most 35 %
      of the pot after calling, folds the rest facing a bet, checks otherwise. Uses no randomness.
    * ``station`` calling station: always checks or calls; never raises, never folds.
    * ``lag`` loose-aggressive: raises strong hands (15 % all-in), raises 60 % of medium and 35 % of
      weak hands, calls the rest, and folds only the weakest (preflop bucket <= 1, postflop nothing)
      facing a bet of more than 30 % of the pot after calling.
    """
    if style not in ("tag", "station", "lag"):
        raise ValueError(f"unknown opponent style {style!r} (tag, station or lag)")
    return RulePlayer(style)


class TextPolicyOpponent:
    """An opponent played by a text policy (observation text -> action text), e.g. an earlier snapshot
    of the language model: it sees its seat's :attr:`SeatView.text` and its answer is parsed with the
    hero's rules and fallback. ``illegal`` counts the answers that needed the fallback."""

    def __init__(self, policy: Callable[[str], str]) -> None:
        self.policy = policy
        self.illegal = 0

    def act(self, view: SeatView, rng: random.Random) -> str:
        letter, illegal = resolve_action(view, self.policy(view.text))
        self.illegal += int(illegal)
        return letter
