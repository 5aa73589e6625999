"""Poker as an echo2 task: the Table 4 evaluation over duplicate deals, the learner's replay of a
self-play episode, the self-play pool, and the task presets."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from echo2.config import PokerTaskConfig, SamplingConfig, load_config, task_preset
from echo2.data.store import Lease
from echo2.data.submission import Rejected, Submission
from echo2.data.tasks.environment import EnvironmentTask
from echo2.envs.poker import PokerEnv, deal_of, rule_player
from echo2.envs.roster import PokerSpec
from echo2.errors import ConfigError
from echo2.rollout.engines.base import Sample
from echo2.rollout.episodes import collect_episodes
from echo2.rollout.matchups import deal_seeds, format_table, play_matchup, t_interval
from echo2.rollout.opponents import SelfPlayPool
from echo2.tasks.verify import EpisodeReplay

SAMPLING = SamplingConfig(max_new_tokens=2)


class _Letters:
    """An engine that answers every observation with one fixed letter (then EOS), or a letter drawn
    from a seeded generator: a stand-in policy whose strategy is known."""

    def __init__(self, codec, eos_id: int, letters: str) -> None:
        self.codec, self.eos_id, self.letters = codec, eos_id, letters
        self.calls = 0

    def generate(self, prompts, seed, greedy=False, max_new_tokens=None, rows=None, first_steps=None):
        out = []
        for b, _ in enumerate(prompts):
            r = random.Random(f"{seed}:{rows[b] if rows else b}:{first_steps[b] if first_steps else 0}")
            letter = r.choice(self.letters)
            ids = (*self.codec.encode_prompt(letter), self.eos_id)
            out.append(Sample(ids, (-0.5,) * len(ids), True))
        self.calls += 1
        return out

    def install(self, weights) -> None:
        pass


def test_t_interval_by_hand():
    # mean 2, sample sd 1.5811, n 5: half width = t(0.975, 4) 2.7764 * 1.5811 / sqrt(5) = 1.9632
    mean, (lo, hi) = t_interval([0.0, 1.0, 2.0, 3.0, 4.0])
    assert mean == 2.0
    assert lo == pytest.approx(2.0 - 1.9632, abs=1e-3) and hi == pytest.approx(2.0 + 1.9632, abs=1e-3)


def test_duplicate_deals_cancel_the_cards_between_identical_strategies(tiny_policy_module):
    """A policy that always checks or calls, against the calling station (the same strategy), wins
    exactly 0 on every deal once the deal is played from both seats; against the tight player it does
    not, and the table counts hands as deals x seats."""
    policy = tiny_policy_module
    engine = _Letters(policy.codec, policy.eos_id, "c")
    cfg = PokerTaskConfig(players=2)
    deals = deal_seeds(range(30))
    station = play_matchup(
        policy.codec, engine, cfg, "station", rule_player("station"), deals, max_context=320, max_new_tokens=2
    )
    assert station.hands == 60 and station.deals == 30
    assert station.mean_bb == 0.0 and station.ci95 == (0.0, 0.0)
    assert station.illegal_rate == 0.0
    tag = play_matchup(
        policy.codec, engine, cfg, "tag", rule_player("tag"), deals, max_context=320, max_new_tokens=2
    )
    assert tag.mean_bb != 0.0
    assert "station" in format_table([station, tag])


def test_illegal_answers_are_counted_by_the_table(tiny_policy_module):
    policy = tiny_policy_module
    engine = _Letters(policy.codec, policy.eos_id, "z")  # never a legal letter: always the fallback
    m = play_matchup(
        policy.codec,
        engine,
        PokerTaskConfig(),
        "tag",
        rule_player("tag"),
        deal_seeds(range(5)),
        max_context=320,
        max_new_tokens=2,
    )
    assert m.illegal_rate == 1.0 and m.decisions >= 10


def test_reset_plays_the_deal_of_its_seed():
    cfg = PokerTaskConfig(players=3)
    a, b = PokerEnv(cfg, [rule_player("station")]), PokerEnv(cfg, [rule_player("station")])
    d, seat = deal_of(77, 3)
    assert a.reset(77) == b.reset_deal(d, seat) and a.hero_seat == seat


@pytest.fixture(scope="module")
def selfplay_episodes(tiny_policy_module):
    """Self-play poker episodes: a model opponent (here a seeded random-letter engine) whose answers the
    worker records."""
    policy = tiny_policy_module
    hero = _Letters(policy.codec, policy.eos_id, "fcra")
    opponent_engine = _Letters(policy.codec, policy.eos_id, "fcr")
    pool = SelfPlayPool(opponent_engine, policy.codec, every=5, size=3, max_new_tokens=2)
    pool.offer(0, {})
    task = EnvironmentTask(PokerSpec(PokerTaskConfig(opponents=["selfplay"])))
    prompts = task.sample_train(random.Random(3), 3)
    batch = collect_episodes(
        policy.codec,
        hero,
        task,
        prompts,
        4,
        seed=11,
        policy_version=2,
        group_prefix="L",
        max_context=320,
        max_new_tokens=2,
        opponent_policy=pool.policy_for,
    )
    groups = tuple(tuple(batch.trajectories[i * 4 : (i + 1) * 4]) for i in range(3))
    replay = EpisodeReplay(policy.codec, task, policy.eos_id, 2, 320)
    return Lease("L", "w", "open", 0.0, prompts, 11, 2), Submission("L", 2, groups), replay


def test_a_self_play_episode_replays_from_its_recorded_opponent(selfplay_episodes):
    lease, sub, replay = selfplay_episodes
    said = [json.loads(t.meta.get("opponent_actions", "[]")) for g in sub.groups for t in g]
    assert any(said), "the opponent acted in some hand"
    replay.check(lease, sub)
    k = next(i for i, s in enumerate(said) if s)
    gi, j = divmod(k, 4)
    t = sub.groups[gi][j]
    other = {"f": "c", "c": "r", "r": "f"}
    answers = json.loads(t.meta["opponent_actions"])
    swapped = json.dumps([other[answers[0]], *answers[1:]])
    groups = [list(g) for g in sub.groups]
    groups[gi][j] = dataclasses.replace(t, meta={**t.meta, "opponent_actions": swapped})
    forged = dataclasses.replace(sub, groups=tuple(tuple(g) for g in groups))
    with pytest.raises(Rejected, match=r"episode_mismatch|reward_mismatch"):
        replay.check(lease, forged)
    groups[gi][j] = dataclasses.replace(t, meta={**t.meta, "opponent_actions": "crf"})  # not a JSON list
    with pytest.raises(Rejected, match="schema"):
        replay.check(lease, dataclasses.replace(sub, groups=tuple(tuple(g) for g in groups)))


def test_the_self_play_pool_keeps_the_first_and_the_newest_milestones(tiny_policy_module):
    pool = SelfPlayPool(None, tiny_policy_module.codec, every=10, size=3, max_new_tokens=2)  # type: ignore[arg-type]
    for v in [0, 3, 9, 10, 14, 21, 35, 47, 52]:
        pool.offer(v, {})
    assert pool.versions() == [0, 47, 52]  # 0 always; then one per crossed multiple of 10, newest kept
    task = EnvironmentTask(PokerSpec(PokerTaskConfig()))
    assert pool.policy_for(task.prompt(5, {"opponent": "tag"})) is None
    assert pool.policy_for(task.prompt(5, {"opponent": "selfplay"})) is not None


def test_presets_and_config_refusals():
    cfg = load_config(overrides=task_preset("poker"))
    from echo2.tasks.episodic import Episodic
    from echo2.tasks.registry import build_task

    assert (
        cfg.task.name == "poker"
        and isinstance(build_task(cfg.task), Episodic)
        and cfg.context_tokens() == 320
    )
    with pytest.raises(ConfigError, match="unknown task"):
        task_preset("chess")
    with pytest.raises(ConfigError, match="seq-mean-token-sum-norm"):
        load_config(overrides=[*task_preset("poker"), "grpo.loss_agg=seq-mean-token-sum-norm"])
    with pytest.raises(ConfigError, match="big_blind"):
        load_config(overrides=["task.name=poker", "task.small_blind=2", "task.big_blind=2"])
    with pytest.raises(ConfigError, match="opponents"):
        load_config(overrides=["task.name=poker", 'task.opponents=["shark"]'])


def test_the_illegal_penalty_is_part_of_the_return_and_of_its_replay(tiny_policy_module):
    """Always answering "f": illegal wherever checking is free (then it checks); with a penalty of 1
    per illegal action the trained return is the chip change minus the illegal count, and the learner's
    replay agrees."""
    policy = tiny_policy_module
    engine = _Letters(policy.codec, policy.eos_id, "f")
    task = EnvironmentTask(PokerSpec(PokerTaskConfig(opponents=["station"], illegal_penalty=1.0)))
    prompts = task.sample_train(random.Random(8), 6)
    batch = collect_episodes(
        policy.codec,
        engine,
        task,
        prompts,
        2,
        seed=1,
        policy_version=0,
        group_prefix="L",
        max_context=320,
        max_new_tokens=2,
    )
    assert any(t.meta["illegal"] for t in batch.trajectories)
    for t in batch.trajectories:
        env = PokerEnv(task.spec.cfg, [rule_player("station")])
        env.reset(int(t.prompt_id.split(":")[1]))
        for _ in range(t.meta["turns"]):
            if env.step("f").done:
                break
        assert t.reward == pytest.approx(env.chip_change_bb - t.meta["illegal"])
    groups = tuple(tuple(batch.trajectories[i * 2 : (i + 1) * 2]) for i in range(6))
    replay = EpisodeReplay(policy.codec, task, policy.eos_id, 2, 320)
    replay.check(Lease("L", "w", "open", 0.0, prompts, 1, 0), Submission("L", 0, groups))


def test_six_max_tables_play_replay_and_evaluate(tiny_policy_module):
    """6-max with mixed rule-based opponents through the same runner, replay and Table 4 (6 seats)."""
    policy = tiny_policy_module
    engine = _Letters(policy.codec, policy.eos_id, "fcr")
    cfg = PokerTaskConfig(players=6, stack_bb=40)
    task = EnvironmentTask(PokerSpec(cfg))
    prompts = task.sample_train(random.Random(4), 3)
    batch = collect_episodes(
        policy.codec,
        engine,
        task,
        prompts,
        2,
        seed=5,
        policy_version=0,
        group_prefix="L",
        max_context=320,
        max_new_tokens=2,
    )
    groups = tuple(tuple(batch.trajectories[i * 2 : (i + 1) * 2]) for i in range(3))
    EpisodeReplay(policy.codec, task, policy.eos_id, 2, 320).check(
        Lease("L", "w", "open", 0.0, prompts, 5, 0), Submission("L", 0, groups)
    )
    m = play_matchup(
        policy.codec,
        engine,
        cfg,
        "lag",
        rule_player("lag"),
        deal_seeds(range(4)),
        max_context=320,
        max_new_tokens=2,
    )
    assert m.hands == 24 and m.deals == 4
