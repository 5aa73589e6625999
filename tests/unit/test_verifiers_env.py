"""verifiers (v1) multi-turn environments as echo2 episodes (``envs/verifiers_bridge.py``,
``envs/verifiers_turns.py``): the env's own ``run()`` played turn by turn, episodes replayed and re-scored
by the learner, what cannot be replayed refused at load with a line naming why."""

from __future__ import annotations

import copy
import dataclasses
import random
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1")

from echo2.check.rerun import GenerationCheck
from echo2.config import SamplingConfig, SecurityConfig
from echo2.data.store import Lease
from echo2.data.submission import Rejected, Submission
from echo2.data.tasks.environment import EnvironmentTask
from echo2.envs.base import EnvError
from echo2.envs.verifiers_turns import VerifiersEnvSpec, VerifiersEnvTaskConfig
from echo2.errors import ConfigError
from echo2.rollout.episodes import collect_episodes
from echo2.tasks.registry import worker_packages
from echo2.tasks.verify import EpisodeReplay

PROBE = {"env": "echo2-vf-probe", "teacher": "echo2_vf_probe:probe_teacher", "taskset_args": {"n": 64}}
ADDER = {"env": "echo2-vf-adder", "teacher": "echo2_vf_adder:adder_teacher", "taskset_args": {"n": 64}}
SAMPLING = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=4)
G = 4


def _spec(**kw) -> VerifiersEnvSpec:
    return VerifiersEnvSpec(VerifiersEnvTaskConfig(**kw))


def _play(spec: VerifiersEnvSpec, seed: int, actions=None):
    """Observations, replies and the last step of an episode: ``actions`` in order, else the teacher."""
    env = spec.make(None)  # type: ignore[arg-type]
    seen = [env.reset(seed)]
    said: list[str] = []
    while True:
        a = spec.teacher(env) if actions is None else actions[len(said)]
        said.append(a)
        step = env.step(a)
        seen.append(step.observation)
        if step.done:
            return seen, said, step


@pytest.mark.parametrize("kw", [PROBE, ADDER], ids=["probe", "adder (a local tool)"])
def test_the_envs_own_run_is_played_turn_by_turn_and_scored_by_its_rewards(kw):
    spec = _spec(**kw)
    assert spec.episodes == 64
    for seed in range(8):
        seen, said, last = _play(spec, seed)
        assert last.reward == 1.0 and last.observation == "" and not last.illegal
        assert len(seen) == len(said) + 1
    seen, said, _ = _play(_spec(**ADDER), 0)
    terms = seen[0].rstrip("=").split("+")
    assert said[0] == f"add {terms[0]} {terms[1]}" and seen[1] == f"{int(terms[0]) + int(terms[1])}>"


def test_a_wrong_player_is_answered_and_scored_zero_and_max_turns_ends_the_run():
    spec = _spec(**PROBE, max_turns=3)
    seen, said, last = _play(spec, 0, ["x", "-1", "99"])
    assert seen[1] == "?>" and seen[2] in ("higher>", "lower>")
    assert last.done and last.reward == 0.0 and len(said) == 3  # the 4th turn() came back terminated
    # the adder's answer that is still a tool call scores 0
    spec = _spec(**ADDER, max_turns=2)
    _, _, last = _play(spec, 0, ["add 1 1", "add 1 1"])
    assert last.done and last.reward == 0.0


def test_the_same_task_and_replies_give_the_same_episode_on_another_instance():
    spec = _spec(**PROBE)
    replies = ["7", "3", "11", "9", "5"]
    a = _play(spec, 5, replies)
    b = _play(_spec(**PROBE), 5, replies)
    assert a[0] == b[0] and a[2] == b[2]
    env = spec.make(None)  # type: ignore[arg-type]
    env.reset(1)
    loop = env._loop
    env.reset(2)  # an abandoned episode is closed, not left running
    assert loop is not None and loop.is_closed()
    loop = env._loop
    env.close()  # what the adapter calls on a cut episode
    assert loop is not None and loop.is_closed() and env.done
    with pytest.raises(EnvError, match="not a task"):
        env.reset(64)


def test_an_episode_plays_from_a_thread_that_runs_an_event_loop():
    """The learner's warm start and evaluation may call the environment from its event loop's thread."""
    import asyncio

    spec = _spec(**PROBE)

    async def inside() -> tuple[list[str], float]:
        seen, _, last = _play(spec, 3)
        spec.make(None).reset(0)  # type: ignore[arg-type]  # left unfinished, then collected
        return seen, last.reward

    seen, reward = asyncio.run(inside())
    assert reward == 1.0 and seen == _play(spec, 3)[0]


def test_finite_episodes_split_by_task_and_sample_only_training_tasks():
    task = EnvironmentTask(_spec(**PROBE))
    train = {p.meta["seed"] for p in task.sample_train(random.Random(0), 400)}
    val = {p.meta["seed"] for p in task.validation_prompts(100)}
    test = {p.meta["seed"] for p in task.eval_prompts(100)}
    assert train | val | test <= set(range(64)) and len(train) > 32
    assert not (train & val) and not (train & test) and not (val & test)
    assert len(val) + len(test) + len(train) <= 64


def test_the_env_package_and_verifiers_are_pinned_for_workers(tmp_path: Path, monkeypatch):
    assert worker_packages(VerifiersEnvTaskConfig(**PROBE)) == ("verifiers",)  # bundled: echo2's own
    path = tmp_path / "envfile.py"
    path.write_text("x = 1\n")
    assert VerifiersEnvTaskConfig(env=f"{path}:x").packages() == ("verifiers",)
    from importlib import metadata

    monkeypatch.setattr(metadata, "packages_distributions", lambda: {"wordle": ["vf-wordle"]})
    assert VerifiersEnvTaskConfig(env="wordle").packages() == ("verifiers", "vf-wordle")
    assert VerifiersEnvTaskConfig(env="wordle.env:load").packages() == ("verifiers", "vf-wordle")


def test_a_worker_runs_named_code_only_when_its_operator_trusts_the_run(registered_worker):
    """An installed env package (pinned, installed by the worker's operator) is played; a function, an
    object or a file the run's settings name is code the learner chooses: refused unless the worker was
    started with --trust-run-code (the run's own local workers are)."""
    import asyncio

    from echo2.config import load_config
    from echo2.runtime.launcher import worker_command
    from echo2.runtime.node import worker_settings

    assert VerifiersEnvTaskConfig(**PROBE).runs_named_code() is None
    assert "names a function" in str(VerifiersEnvTaskConfig(env="os:system").runs_named_code())
    assert "no installed distribution" in str(VerifiersEnvTaskConfig(env="antigravity").runs_named_code())
    cfg = load_config(overrides=["task.name=verifiers_env", "task.env=os:system"])
    worker = registered_worker(worker_settings(cfg))
    with pytest.raises(ConfigError, match=r"task.env = 'os:system' names a function.*--trust-run-code"):
        asyncio.run(worker.setup())
    assert worker._heartbeat_task is None  # refused before anything ran
    assert worker_command("https://127.0.0.1:1", "local-0", cfg)[-1] == "--trust-run-code"


# ---- refused at load, each with its reason -------------------------------------------------------------
_HEAD = """
import verifiers.v1 as vf
from echo2_vf_probe import ProbeEnv, ProbeEnvConfig, ProbeTask

def _cfg(cls, **kw):
    return cls(taskset={"id": "echo2-vf-probe", "n": 4}, **kw)
"""
_CASES = {
    "two agents": (
        """
class Cfg(ProbeEnvConfig):
    user: vf.AgentConfig = vf.AgentConfig()
class E(vf.Env[Cfg]):
    async def run(self, task, agents): pass
env = E(_cfg(Cfg))
""",
        "declares the agents",
    ),
    "finalize": (
        """
class E(ProbeEnv):
    async def finalize(self, task, episode): pass
env = E(_cfg(ProbeEnvConfig))
""",
        r"overrides Env.finalize",
    ),
    "a bash harness": (
        """
env = ProbeEnv(_cfg(ProbeEnvConfig, player={"harness": {"id": "bash"}}))
""",
        "pinned to the harness 'bash'",
    ),
    "a class": ("env = ProbeEnv\n", "is a class"),
    "not an env": ("env = 3\n", "not a verifiers Env"),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_what_the_learner_cannot_replay_is_refused_at_load(tmp_path: Path, case: str):
    body, why = _CASES[case]
    path = tmp_path / f"env_{case.replace(' ', '_')}.py"
    path.write_text(textwrap.dedent(_HEAD) + textwrap.dedent(body))
    with pytest.raises(ConfigError, match=why):
        _ = _spec(env=f"{path}:env").episodes


def test_a_task_whose_reward_needs_a_runtime_is_refused(tmp_path: Path):
    path = tmp_path / "runtime_env.py"
    path.write_text(
        textwrap.dedent(
            """
            import verifiers.v1 as vf
            from echo2_vf_probe import ProbeEnv, ProbeEnvConfig, ProbeTask, ProbeTaskset

            class T(ProbeTask):
                @vf.reward
                async def ran(self, trace, runtime) -> float:
                    return 1.0

            class TS(ProbeTaskset):
                def load(self):
                    for t in super().load():
                        yield T(t.data, t.config)

            def make():
                env = ProbeEnv(ProbeEnvConfig(taskset={"id": "echo2-vf-probe", "n": 4}))
                env.taskset = TS(env.taskset.config)
                return env
            """
        )
    )
    with pytest.raises(ConfigError, match="'ran' needs a runtime"):
        _ = _spec(env=f"{path}:make").episodes


def test_a_misbehaving_run_is_an_env_error_of_its_episode(tmp_path: Path):
    path = tmp_path / "bad_env.py"
    path.write_text(
        textwrap.dedent(
            """
            from echo2_vf_probe import ProbeEnv, ProbeEnvConfig

            class Raises(ProbeEnv):
                async def run(self, task, agents):
                    async with agents.player.interaction(task) as it:
                        await it.turn()
                        raise ValueError("boom")

            class Silent(ProbeEnv):
                async def run(self, task, agents):
                    pass

            class Pictures(ProbeEnv):
                async def run(self, task, agents):
                    async with agents.player.interaction(task) as it:
                        await it.turn()
                        picture = {"type": "image_url", "image_url": {"url": "x"}}
                        await it.turn([{"role": "user", "content": [picture]}])

            def build(cls):
                return lambda: cls(ProbeEnvConfig(taskset={"id": "echo2-vf-probe", "n": 4}))

            raises, silent, pictures = build(Raises), build(Silent), build(Pictures)
            """
        )
    )
    env = _spec(env=f"{path}:raises").make(None)  # type: ignore[arg-type]
    env.reset(0)
    with pytest.raises(EnvError, match="ValueError: boom"):
        env.step("3")
    with pytest.raises(EnvError, match="opened no interaction"):
        _spec(env=f"{path}:silent").make(None).reset(0)  # type: ignore[arg-type]
    env = _spec(env=f"{path}:pictures").make(None)  # type: ignore[arg-type]
    env.reset(0)
    with pytest.raises(EnvError, match="image_url"):
        env.step("3")


# ---- on the wire: played by a worker's engine, replayed and re-scored by the learner -------------------
@pytest.fixture(scope="module")
def played(tiny_policy_module, published_engine):
    """Two groups of G adder episodes from the tiny model's published bf16 weights."""
    policy = tiny_policy_module
    weights, engine = published_engine(policy, SAMPLING)
    task = EnvironmentTask(_spec(**ADDER, max_turns=3))
    prompts = task.sample_train(random.Random(1), 2)
    seed = 123456789
    batch = collect_episodes(
        policy.codec, engine, task, prompts, G, seed=seed, policy_version=1, group_prefix="L",
        max_context=128, max_new_tokens=SAMPLING.max_new_tokens,
    )  # fmt: skip
    groups = tuple(tuple(batch.trajectories[i * G : (i + 1) * G]) for i in range(len(prompts)))
    lease = Lease("L", "w", "open", 0.0, prompts, seed, 1)
    return policy, task, weights, lease, Submission("L", 1, groups)


def _forge(sub: Submission, i: int, j: int, **change) -> Submission:
    groups = [list(g) for g in sub.groups]
    groups[i][j] = dataclasses.replace(groups[i][j], **change)
    return dataclasses.replace(sub, groups=tuple(tuple(g) for g in groups))


def test_the_learner_replays_and_rescores_every_episode_and_refuses_a_claimed_reward(played):
    policy, task, _, lease, sub = played
    replay = EpisodeReplay(policy.codec, task, policy.eos_id, SAMPLING.max_new_tokens, 128)
    taken = replay.check(lease, sub)
    assert [(t.turn_mask, t.reward) for g in taken.groups for t in g] == [
        (t.turn_mask, t.reward) for g in sub.groups for t in g
    ]
    t = sub.groups[0][1]
    with pytest.raises(Rejected, match="reward_mismatch"):
        replay.check(lease, _forge(sub, 0, 1, reward=1.0 if t.reward == 0.0 else 0.0))
    with pytest.raises(Rejected, match="episode_mismatch"):
        replay.check(lease, _forge(sub, 0, 1, prompt_ids=tuple(policy.codec.encode_prompt("1+1+1="))))


def test_the_generation_check_rederives_every_reply_of_a_verifiers_episode(played):
    policy, _, weights, lease, sub = played
    check = GenerationCheck(copy.deepcopy(policy.model), SAMPLING, SecurityConfig(), rng=random.Random(0))
    check.keep(1, weights)
    verdicts = check.check(lease, sub, [(i, j) for i in range(2) for j in range(G)])
    assert all(v.misses == 0 for v in verdicts)
    assert sum(v.tokens for v in verdicts) == sum(sum(t.turn_mask) for g in sub.groups for t in g)
