import random

from echo2.config import ArithmeticTaskConfig, SamplingConfig
from echo2.rollout.collect import collect_groups
from echo2.rollout.engines.hf import HFEngine
from echo2.tasks.registry import build_task


def test_collect_groups_orders_groups_and_tags_version(tiny_policy):
    task = build_task(ArithmeticTaskConfig(max_value=9))
    engine = HFEngine(
        tiny_policy.model, tiny_policy.eos_id, tiny_policy.pad_id, SamplingConfig(max_new_tokens=3)
    )
    prompts = task.sample_train(random.Random(0), 3)
    batch = collect_groups(
        tiny_policy.codec, engine, task, prompts, 4, seed=1, policy_version=7, group_prefix="s5"
    )
    assert len(batch.trajectories) == 12
    assert [t.group_id for t in batch.trajectories] == [f"s5:{g}" for g in range(3) for _ in range(4)]
    assert [t.prompt_id for t in batch.trajectories[::4]] == [p.prompt_id for p in prompts]
    assert all(t.policy_version == 7 for t in batch.trajectories)
    # an untrained model mostly emits text that is not an integer: graded 0 and counted, never raised
    assert batch.unparsed == sum(not t.meta["parsed"] for t in batch.trajectories)
    assert all(t.reward in (0.0, 1.0) for t in batch.trajectories)
    assert batch.tokens == sum(len(t.completion_ids) for t in batch.trajectories) and batch.t_gen_s > 0
