"""Poker evaluation like the paper's Table 4: mean chip change per hand against each opponent.

For every opponent, the policy (greedy) plays a fixed list of held-out deals (seeds of the task's test
split) **from every seat**: deal ``d`` gives each seat the same cards whoever sits there
(``PokerEnv.reset_deal``), so the hands the policy plays from seat 0 and from seat 1 of a heads-up
deal are mirrored ("duplicate") and the luck of the cards cancels out of their mean. One deal's
sample is the mean chip change over its seats; the table reports the mean over deals with a 95%
t-interval over deals (the deals are independent, the seats of one deal are not), the number of
hands (deals x seats) and the policy's illegal-action rate (illegal answers / decisions).

Opponents: the rule-based styles (``envs/poker_players.py``) and any text policy, e.g. a snapshot of
the model (the warm start) answering greedily: ``TextPolicyOpponent``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from echo2.config import Config, PokerTaskConfig
from echo2.data.tasks.environment import EnvironmentTask
from echo2.envs.roster import RULE_STYLES, PokerSpec
from echo2.models.policy import TextCodec
from echo2.rollout.engines.base import Engine
from echo2.rollout.episodes import Limits, Stepper, play, start


@dataclass(frozen=True)
class Matchup:
    """The policy against one opponent over the duplicate deals."""

    opponent: str  # the opponent's name
    deals: int  # held-out deals, each played from every seat
    hands: int  # deals x seats
    mean_bb: float  # mean chip change per hand, in big blinds (positive: the policy wins)
    ci95: tuple[float, float]  # 95% t-interval of mean_bb over deals
    illegal_rate: float  # the policy's illegal or unparsable answers / its decisions
    decisions: int  # the policy's decisions
    per_deal: tuple[float, ...] = ()  # each deal's mean chip change over its seats, in deal order

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def paired_difference(a: Matchup, b: Matchup) -> tuple[float, tuple[float, float]]:
    """``a - b`` on the same deals (two policies against one opponent): mean and 95% t-interval of the
    per-deal differences, so the cards cancel out of the comparison as well."""
    if len(a.per_deal) != len(b.per_deal) or not a.per_deal:
        raise ValueError("a paired difference needs the same deals on both sides")
    return t_interval([x - y for x, y in zip(a.per_deal, b.per_deal, strict=True)])


def t_interval(samples: Sequence[float], level: float = 0.95) -> tuple[float, tuple[float, float]]:
    """Mean and two-sided ``level`` Student-t interval of independent samples."""
    from scipy import stats

    n = len(samples)
    mean = sum(samples) / n
    if n < 2:
        return mean, (-math.inf, math.inf)
    sd = math.sqrt(sum((x - mean) ** 2 for x in samples) / (n - 1))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return mean, (mean - half, mean + half)


def play_matchup(
    codec: TextCodec,
    engine: Engine,
    cfg: PokerTaskConfig,
    name: str,
    opponent: Any,
    deal_seeds: Sequence[int],
    *,
    max_context: int,
    max_new_tokens: int,
    batch_size: int = 512,
) -> Matchup:
    """The policy of ``engine`` (greedy) against ``opponent`` on ``deal_seeds``, from every seat."""
    from echo2.envs.poker import PokerEnv

    limits = Limits(cfg.max_turns, max_context, max_new_tokens)
    stepper = Stepper(cfg.step_timeout_s)
    jobs = [(d, seat) for d in deal_seeds for seat in range(cfg.players)]
    per_deal: dict[int, list[float]] = {}
    illegal = decisions = 0
    try:
        for i in range(0, len(jobs), batch_size):
            episodes = []
            for r, (d, seat) in enumerate(jobs[i : i + batch_size]):
                env = PokerEnv(cfg, [opponent])
                reset: Callable[[], str] = lambda env=env, d=d, seat=seat: env.reset_deal(d, seat)  # noqa: E731
                episodes.append(start(codec, env, d, r, stepper, reset=reset))
            play(codec, engine, episodes, limits, stepper, seed=0, greedy=True)
            for (d, _), e in zip(jobs[i : i + batch_size], episodes, strict=True):
                per_deal.setdefault(d, []).append(sum(e.rewards) if e.error is None else 0.0)
                illegal += e.illegal
                decisions += len(e.actions)
    finally:
        stepper.close()
    samples = [sum(v) / len(v) for v in per_deal.values()]
    mean, ci = t_interval(samples)
    return Matchup(
        name, len(samples), len(jobs), mean, ci, illegal / max(decisions, 1), decisions, tuple(samples)
    )


def deal_seeds(task_seeds: Sequence[int]) -> list[int]:
    """The deals of held-out episode seeds (the same deal ``PokerEnv.reset`` plays for each)."""
    from echo2.envs.poker import deal_of

    return [deal_of(s)[0] for s in task_seeds]


def format_table(rows: Sequence[Matchup]) -> str:
    """The matchups as a plain-text table (what ``echo2 eval`` prints)."""
    lines = [f"{'opponent':<14} {'hands':>6} {'chips/hand (bb)':>16} {'95% interval':>20} {'illegal':>8}"]
    for m in rows:
        ci = f"[{m.ci95[0]:+.3f}, {m.ci95[1]:+.3f}]"
        lines.append(f"{m.opponent:<14} {m.hands:>6} {m.mean_bb:>+16.3f} {ci:>20} {m.illegal_rate:>7.2%}")
    return "\n".join(lines)


def greedy_text_policy(codec: TextCodec, engine: Engine, max_new_tokens: int) -> Callable[[str], str]:
    """A model as an opponent: observation text in, its greedy answer out (deterministic)."""

    def act(observation: str) -> str:
        (sample,) = engine.generate(
            [codec.encode_prompt(observation)], seed=0, greedy=True, max_new_tokens=max_new_tokens
        )
        return codec.decode_completion(sample.completion_ids)

    return act


def poker_table(
    codec: TextCodec,
    engine: Engine,
    cfg: PokerTaskConfig,
    test_seeds: Sequence[int],
    *,
    max_context: int,
    max_new_tokens: int,
    snapshots: dict[str, Engine] | None = None,
) -> list[Matchup]:
    """Table 4: the policy against each rule-based style and each named snapshot engine (greedy), on
    the deals of ``test_seeds``, from every seat."""
    from echo2.envs.poker import TextPolicyOpponent, rule_player

    deals = deal_seeds(test_seeds)
    opponents: list[tuple[str, Any]] = [(s, rule_player(s)) for s in RULE_STYLES]  # type: ignore[arg-type]
    for name, snap in (snapshots or {}).items():
        opponents.append((name, TextPolicyOpponent(greedy_text_policy(codec, snap, max_new_tokens))))
    return [
        play_matchup(
            codec, engine, cfg, name, opp, deals, max_context=max_context, max_new_tokens=max_new_tokens
        )
        for name, opp in opponents
    ]


def evaluate_checkpoint(
    cfg: Config,
    checkpoint: str | Path,
    against: dict[str, str | Path] | None = None,
    deals: int | None = None,
) -> list[Matchup]:
    """Table 4 of the checkpoint at ``checkpoint`` on ``cfg``'s poker task: against the rule-based
    styles and each ``against`` checkpoint (name -> directory), on ``deals`` held-out deals (default
    ``task.eval_deals``) of the test split."""
    from echo2.models.policy import chat_format, load_checkpoint
    from echo2.rollout.engines.hf import HFEngine

    if not isinstance(cfg.task, PokerTaskConfig):
        raise ValueError(f"the poker table needs task.name = 'poker', not {cfg.task.name!r}")
    policy = load_checkpoint(checkpoint, chat_format(cfg))
    engine = HFEngine(policy.model, policy.eos_ids, policy.pad_id, cfg.sampling)
    snapshots: dict[str, Engine] = {}
    for name, path in (against or {}).items():
        snap = load_checkpoint(path, chat_format(cfg))
        snapshots[name] = HFEngine(snap.model, snap.eos_ids, snap.pad_id, cfg.sampling)
    task = EnvironmentTask(PokerSpec(cfg.task), cfg.seed)  # poker's own seeds: its test split
    seeds = [int(p.meta["seed"]) for p in task.eval_prompts(deals or cfg.task.eval_deals)]
    return poker_table(
        policy.codec,
        engine,
        cfg.task,
        seeds,
        max_context=cfg.context_tokens(),
        max_new_tokens=cfg.sampling.max_new_tokens,
        snapshots=snapshots,
    )


def plot_table(rows: Sequence[Matchup], path: Path, title: str = "") -> None:
    """Chip change per hand against each opponent, with its 95% interval, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    xs = range(len(rows))
    means = [m.mean_bb for m in rows]
    errs = [[m.mean_bb - m.ci95[0] for m in rows], [m.ci95[1] - m.mean_bb for m in rows]]
    ax.bar(xs, means, yerr=errs, capsize=4, color=["#4c72b0" if v >= 0 else "#c44e52" for v in means])
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(list(xs), [m.opponent for m in rows])
    ax.set_ylabel("chips per hand (big blinds)")
    ax.set_title(title or f"duplicate deals, {rows[0].hands if rows else 0} hands per opponent, 95% CI")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
