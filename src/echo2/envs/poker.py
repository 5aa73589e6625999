"""No-Limit Texas Hold'em as a text environment (SPEC §8), on pokerkit, against rule-based or text-policy
opponents. One hand is one episode; the learner plays the *hero* seat.

Rules. pokerkit's ``NoLimitTexasHoldem`` (tournament mode, no antes, no rake) keeps the whole game:
blinds ``small_blind``/``big_blind`` chips, every seat starts with ``stack_bb`` big blinds, the minimum
bet is one big blind. Seats are pokerkit's player indices: with 2 players seat 0 is the big blind and
seat 1 the button, which posts the small blind and acts first preflop; with 3-6 players seat 0 is the
small blind, 1 the big blind and ``players - 1`` the button. The environment only chooses actions
(``can_fold``/``check_or_call``/``complete_bet_or_raise_to``) and deals its own predetermined deck;
showdown, pots and payoffs are pokerkit's (at showdown every remaining hand is shown, which changes
no payoff; hands are pokerkit's ``StandardHighHand``, memoized as ``poker_players.HighHand``).

Deal. ``reset_deal(d, k)`` shuffles the 52 cards with a generator seeded by ``d`` alone: seat ``s``
gets cards ``2s`` and ``2s+1`` of that order and the board is the next five, so a deal gives every
seat the same cards whichever seat the hero sits in. Playing deal ``d`` from every seat ``k`` is the
*duplicate* evaluation (heads-up: the mirrored deal). ``opponents[j]`` sits ``j + 1`` seats to the
hero's left, and the opponent at seat ``s`` draws its randomness from a generator seeded by
``(d, s)``. ``reset(seed)`` draws ``d`` and the hero's seat from ``seed``. Same seed, same actions:
same observations and rewards.

Actions (:data:`ACTIONS`, one character, so an answer is one token then EOS): ``f`` fold, ``c``
check or call, ``r`` raise to about the pot (pokerkit's pot-sized raise, clipped to at least the
legal minimum and at most all-in: where a raise is legal only as all-in, ``r`` is all-in), ``a``
all-in (a raise to the whole stack, or a call where calling commits the whole stack). Where no raise
is possible at all (facing an all-in, or every other player all-in), ``r`` and ``a`` are clipped to
what is: a check or call (like a raise larger than the stack is clipped to all-in; not illegal).
Parsing strips whitespace and lower-cases the first character.

Fallback. An unparsable answer (empty, any other character) or a letter not legal now (``f`` when
checking is free) is replaced by **check if free, else fold**, and the step reports
``illegal=True``. Opponents'
illegal answers get the same fallback (counted in ``PokerEnv.opponent_illegal``, never in the
hero's ``illegal``; a ``TextPolicyOpponent`` applies it itself and counts in its own ``illegal``).

No walks. ``reset`` returns the hero's first decision, which always exists: an opponent's fold that
would end the hand before the hero has acted once (everyone folds to the hero in the big blind) is
replaced by a check/call (not counted as illegal). Nothing else in the game is changed; after the
hero's first decision opponents fold freely.

Rewards. 0 on every step but the last, whose reward is the hero's chip change for the whole hand in
big blinds, ``(final stack - starting stack) / big_blind``: the undiscounted return is the chip
change (``PokerEnv.chip_change_bb``). The step that ends the hand has ``done=True`` and observation
``""``. When the hero folds or is all-in, the opponents play the hand out at once and that step is
the last.

Observation (one line, at most 60 printable ASCII characters including the final ``"\\n>"``; the
model answers after ``>``, so a transcript reads obs ``>`` action EOS obs ``>`` action EOS ...).
Three real ones (each followed by ``"\\n>"``)::

    P1 2c9h||h0 p4 c2 s19 n1 o:r            heads-up big blind facing the button's pot-sized raise
    F1 Ah4h|9c5c7s|h0 p24 c12 s16 n2 o:c/xr 6-max big blind: a call preflop, then a check, a bet
    T1 Ah4h|9c5c7sAd|h3 p48 c0 s4 n2 o:c/xx  its turn: one more call on the flop, two checks

fields in this fixed order: the street (``P`` preflop, ``F`` flop, ``T`` turn, ``R`` river) and the
position digit (``players - 1 - seat``: 0 the button, who acts last after the flop); the hole cards;
``|`` the board (empty preflop) ``|``; ``h`` the hand-strength bucket 0-9
(:func:`~echo2.envs.poker_players.hand_strength`: preflop a Chen score of the hole cards, postflop
the made-hand category counted where the hero's cards improve on the board); ``p`` the pot
(including this street's bets), ``c`` the amount to call (0: checking is free; a non-free call never
shows 0) and ``s`` the hero's stack behind, in big blinds rounded half up; ``n`` the opponents still
in the hand; ``o:`` the others' actions since the hero's last decision (since the deal for the
first), in order, with ``f`` fold, ``x`` check, ``c`` call, ``r`` bet/raise, ``a`` all-in (bet,
raise or call) and ``/`` a new street dealt (the blinds are not actions). Where the history would
overflow 60 characters its oldest letters are dropped.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from pokerkit import Automation, Card, Deck, NoLimitTexasHoldem, State

from echo2.envs.base import EnvError, EnvStep
from echo2.envs.poker_players import (
    ACTIONS,
    MAX_OBSERVATION_CHARS,
    PROMPT_MARKER,
    STREETS,
    HighHand,
    Opponent,
    RulePlayer,
    SeatView,
    TextPolicyOpponent,
    hand_strength,
    parse_action,
    render,
    resolve_action,
    rule_player,
)

if TYPE_CHECKING:  # the config is declared with the spec (envs/poker_task.py), which imports this module
    from echo2.envs.poker_task import PokerTaskConfig

__all__ = [
    "ACTIONS",
    "MAX_OBSERVATION_CHARS",
    "PROMPT_MARKER",
    "Opponent",
    "PokerEnv",
    "RulePlayer",
    "SeatView",
    "TextPolicyOpponent",
    "hand_strength",
    "parse_action",
    "render",
    "resolve_action",
    "rule_player",
]

log = logging.getLogger(__name__)


_AUTOMATIONS: Final[tuple[Automation, ...]] = (
    Automation.ANTE_POSTING,
    Automation.BET_COLLECTION,
    Automation.BLIND_OR_STRADDLE_POSTING,
    Automation.HAND_KILLING,
    Automation.CHIPS_PUSHING,
    Automation.CHIPS_PULLING,
)


class _NoLimitHoldem(NoLimitTexasHoldem):
    """pokerkit's No-Limit Texas Hold'em with its hands evaluated by the memoized ``HighHand``."""

    hand_types = (HighHand,)


_DECK: Final[tuple[Card, ...]] = tuple(Deck.STANDARD)  # canonical order: 2c 2d 2h 2s 3c ... As
_STREET_MARK: Final[int] = -1  # the "seat" of a new-street marker in the action log


def deal_of(seed: int, players: int = 2) -> tuple[int, int]:
    """The deal and the hero's seat ``PokerEnv.reset(seed)`` plays (the deal alone does not depend on
    ``players``: held-out evaluation replays a test seed's deal from every seat)."""
    rng = random.Random(f"echo2.poker.reset/{seed}")
    deal_seed = rng.getrandbits(63)
    return deal_seed, rng.randrange(players)


class PokerEnv:
    """One hand of No-Limit Hold'em per episode, the hero against ``players - 1`` opponents
    (implements :class:`echo2.envs.base.TextEnv`; rules, observation and fallback in the module
    docstring)."""

    def __init__(self, cfg: PokerTaskConfig, opponents: Sequence[Opponent]) -> None:
        n = cfg.players
        if len(opponents) == 1:
            self._opponents: tuple[Opponent, ...] = tuple(opponents) * (n - 1)
        elif len(opponents) == n - 1:
            self._opponents = tuple(opponents)
        else:
            raise ValueError(f"{len(opponents)} opponents for {n} players: give {n - 1}, or one for all")
        self.cfg = cfg
        self.players = n
        self.big_blind = cfg.big_blind
        self.starting_stack = cfg.stack_bb * cfg.big_blind
        self.hero_seat = 0
        self.opponent_illegal = 0  # opponents' answers that needed the fallback, this hand
        self._state: State | None = None
        self._seat_players: dict[int, Opponent] = {}
        self._rngs: list[random.Random] = []
        self._holes: list[list[Card]] = []
        self._board: list[Card] = []
        self._burns: list[Card] = []
        self._log: list[tuple[int, str]] = []
        self._since: list[int] = []
        self._hero_decisions = 0
        self._hero_view: SeatView | None = None

    # --- the TextEnv protocol ----------------------------------------------------------------

    def reset(self, seed: int) -> str:
        """Start the hand of ``seed``: the deal and the hero's seat are drawn from it (:func:`deal_of`)."""
        deal_seed, hero_seat = deal_of(seed, self.players)
        return self.reset_deal(deal_seed, hero_seat)

    def reset_deal(self, deal_seed: int, hero_seat: int) -> str:
        """Start deal ``deal_seed`` with the hero in ``hero_seat`` and return its first observation."""
        n = self.players
        if not 0 <= hero_seat < n:
            raise ValueError(f"hero_seat={hero_seat} is not a seat of a {n}-player table")
        deck = list(_DECK)
        random.Random(f"echo2.poker.deal/{deal_seed}").shuffle(deck)
        self._holes = [deck[2 * s : 2 * s + 2] for s in range(n)]
        self._board = deck[2 * n : 2 * n + 5]
        self._burns = deck[2 * n + 5 : 2 * n + 8]
        self._rngs = [random.Random(f"echo2.poker.seat/{deal_seed}/{s}") for s in range(n)]
        self.hero_seat = hero_seat
        self._seat_players = {(hero_seat + 1 + j) % n: opp for j, opp in enumerate(self._opponents)}
        self._state = _NoLimitHoldem.create_state(
            _AUTOMATIONS,
            True,
            0,
            (self.cfg.small_blind, self.cfg.big_blind),
            self.cfg.big_blind,
            (self.starting_stack,) * n,
            n,
        )
        self._log = []
        self._since = [0] * n
        self._hero_decisions = 0
        self.opponent_illegal = 0
        self._play_until_hero()
        if self._hero_view is None:  # the no-walk rule makes this unreachable
            raise EnvError(f"deal {deal_seed} ended before the hero in seat {hero_seat} acted")
        return self._hero_view.text

    def step(self, action: str) -> EnvStep:
        """Apply the hero's ``action`` (fallback if needed), let the opponents act until the hero's
        next decision or the end of the hand, and return what follows."""
        state = self._state
        view = self._hero_view
        if state is None or view is None:
            raise EnvError("step() without a hand in progress: call reset() first")
        letter, illegal = resolve_action(view, action)
        self._apply(self.hero_seat, letter)
        self._hero_decisions += 1
        self._play_until_hero()
        if self._hero_view is not None:
            return EnvStep(self._hero_view.text, 0.0, False, illegal)
        return EnvStep("", self.chip_change_bb, True, illegal)

    # --- the rest of the API -----------------------------------------------------------------

    def hero_view(self) -> SeatView:
        """The hero's view of its current decision (e.g. for a rule-based teacher to answer)."""
        if self._hero_view is None:
            raise EnvError("no hero decision is pending (the hand is over or was never started)")
        return self._hero_view

    @property
    def done(self) -> bool:
        return self._state is not None and not self._state.status

    @property
    def chip_change_bb(self) -> float:
        """The hero's final stack minus its starting stack, in big blinds (meaningful once done)."""
        if self._state is None:
            return 0.0
        return (self._state.stacks[self.hero_seat] - self.starting_stack) / self.big_blind

    @property
    def payoffs(self) -> tuple[int, ...]:
        """Every seat's chip change this hand (pokerkit's ``payoffs``; they sum to 0 once done)."""
        return tuple(self._state.payoffs) if self._state is not None else ()

    @property
    def state(self) -> State | None:
        """pokerkit's state of the current hand (read it; do not act on it)."""
        return self._state

    # --- internals -----------------------------------------------------------------------------

    def _play_until_hero(self) -> None:
        """Deal and let opponents act until the hero must decide (``_hero_view`` set) or the hand is
        over (``_hero_view`` None)."""
        state = self._state
        assert state is not None
        self._hero_view = None
        while state.status:
            if state.card_burning_status:
                state.burn_card(self._burns.pop())
            elif (dealee := state.hole_dealee_index) is not None:
                state.deal_hole((self._holes[dealee][len(state.hole_cards[dealee])],))
            elif (count := state.board_dealing_count) is not None:
                dealt = len(list(state.get_board_cards(0)))
                state.deal_board(self._board[dealt : dealt + count])
                self._log.append((_STREET_MARK, "/"))
            elif state.showdown_index is not None:
                state.show_or_muck_hole_cards(True)  # everyone shows: cheaper than pokerkit's choice
            elif (actor := state.actor_index) is not None:
                if actor == self.hero_seat:
                    self._hero_view = self._view(actor)
                    return
                self._opponent_acts(actor)
            else:
                raise EnvError(f"pokerkit waits on nothing the environment drives: {state.operations[-1]!r}")

    def _opponent_acts(self, seat: int) -> None:
        state = self._state
        assert state is not None
        view = self._view(seat)
        letter, illegal = resolve_action(view, self._seat_players[seat].act(view, self._rngs[seat]))
        if illegal:
            self.opponent_illegal += 1
            log.debug("opponent at seat %d answered illegally; fallback %r", seat, letter)
        if letter == "f" and self._hero_decisions == 0 and sum(state.statuses) == 2:
            letter = "c"  # no walks: the hero always gets its first decision
        self._apply(seat, letter)

    def _apply(self, seat: int, letter: str) -> None:
        """Apply a legal ``letter`` for ``seat`` (the actor) and log it."""
        state = self._state
        assert state is not None
        stack = state.stacks[seat]
        if letter == "f":
            state.fold()
            mark = "f"
        elif letter == "c" or (letter == "a" and not state.can_complete_bet_or_raise_to()):
            amount = state.checking_or_calling_amount or 0
            state.check_or_call()
            mark = "x" if amount == 0 else "a" if amount == stack else "c"
        else:
            target = (
                state.max_completion_betting_or_raising_to_amount
                if letter == "a"
                else state.pot_completion_betting_or_raising_to_amount
            )
            assert target is not None
            all_in = target - state.bets[seat] == stack
            state.complete_bet_or_raise_to(target)
            mark = "a" if all_in else "r"
        self._log.append((seat, mark))
        self._since[seat] = len(self._log)

    def _view(self, seat: int) -> SeatView:
        """The view of ``seat``, which must be the actor."""
        state = self._state
        assert state is not None and state.street_index is not None
        hole = state.hole_cards[seat]
        board = list(state.get_board_cards(0))
        to_call = state.checking_or_calling_amount or 0
        stack = state.stacks[seat]
        can_raise = state.can_complete_bet_or_raise_to()
        legal = (
            ("f" if state.can_fold() else "")
            + "c"
            + ("ra" if can_raise else "a" if 0 < to_call == stack else "")
        )
        return SeatView(
            seat=seat,
            players=self.players,
            position=self.players - 1 - seat,
            street=STREETS[state.street_index],
            hole=tuple(repr(c) for c in hole),
            board=tuple(repr(c) for c in board),
            pot=state.total_pot_amount,
            to_call=to_call,
            stack=stack,
            big_blind=self.big_blind,
            raise_to=state.pot_completion_betting_or_raising_to_amount if can_raise else None,
            legal=legal,
            history="".join(mark for who, mark in self._log[self._since[seat] :] if who != seat),
            opponents_in=sum(state.statuses) - 1,
            cards=(*hole, *board),
        )
