"""Multi-turn episodes (SPEC §8): the adapter between a text environment and the policy.

One episode is one trajectory. Its prompt is the environment's first observation; its "completion"
is everything after it, turn by turn: the policy's action tokens (ending with EOS, or cut at
``max_new_tokens``), then the environment's answer encoded as the next prompt turn, then the next
action, and so on::

    prompt_ids      = encode(o_0)
    completion_ids  = a_0 <eos> encode(o_1) a_1 <eos> encode(o_2) ...
    turn_mask       = 1 ... 1   0 ...  0    1 ... 1   0 ...  0          (1 = the policy's token)
    sampler_logprobs: the sampler's log-prob on policy tokens, 0.0 on observation tokens

so the learner's loss (masked by ``turn_mask``) trains exactly the policy's tokens, with the
off-policy correction of single-turn GRPO applied token by token. The reward of the trajectory is the
episodic return ``R = Σ_t γ^t (r_t - p·[a_t illegal])`` over the policy's decisions ``t`` (``p``:
the environment config's ``illegal_penalty``, 0 unless set; held-out evaluation reports the
environment's own return, without it).

Every episode of a call draws its tokens with one noise row (``rows``) and continues its noise steps
across turns (``first_steps`` = the token's index in the completion), so the learner re-derives every
policy token of an episode exactly as it does a single-turn completion (``check/rerun.py``).

What ends an episode besides the environment's ``done``: ``max_turns`` decisions, or a context that
could not hold another turn (``max_context``): the episode is *cut* (counted, its return is what it
earned so far). An environment that raises, takes longer than ``step_timeout_s`` or answers with a
non-finite reward or a non-text observation ends its episode with an *error* (counted; the episode's
return is 0 and it is still trained on, like any other bad outcome of the policy's actions): it never
stops the worker. An illegal or unparsable action is the environment's business (its documented
fallback) and is counted from ``EnvStep.illegal``.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from echo2.data.tasks.environment import EnvironmentTask, EnvSpec, TextPolicy
from echo2.envs.base import EnvError, EnvStep, TextEnv
from echo2.models.policy import TextCodec
from echo2.observe import catalog as m
from echo2.rollout.collect import RolloutBatch
from echo2.rollout.engines.base import Engine
from echo2.types import Prompt, Trajectory

log = logging.getLogger(__name__)


class Stepper:
    """Runs environment calls on a thread of their own, with a timeout. A call that hangs is abandoned
    with its thread (which cannot be killed) and the next call gets a fresh thread."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="echo2-env")

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        future = self._pool.submit(fn, *args)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="echo2-env")
            raise EnvError(f"environment step took longer than {self.timeout_s:g} s") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class Episode:
    """One episode being played (mutable while it runs; read its fields once ``over``)."""

    env: TextEnv
    row: int  # noise row of its draws
    prompt_ids: list[int] = field(default_factory=list)  # encode(o_0)
    completion: list[int] = field(default_factory=list)  # actions and observation turns
    logprobs: list[float] = field(default_factory=list)  # sampler log-prob per completion token (0 on obs)
    mask: list[int] = field(default_factory=list)  # 1 = policy token
    rewards: list[float] = field(default_factory=list)  # r_t per decision, as the environment gave it
    illegal_at: list[bool] = field(default_factory=list)  # per decision: the action was illegal
    actions: list[str] = field(default_factory=list)  # decoded actions, in order
    over: bool = False
    cut: bool = False  # ended by max_turns / max_context, not by the environment
    error: str | None = None  # the environment misbehaved (the return is 0)

    @property
    def illegal(self) -> int:
        """Actions the environment could not take as written."""
        return sum(self.illegal_at)

    def ret(self, discount: float, illegal_penalty: float = 0.0) -> float:
        """The episodic return ``Σ_t γ^t (r_t - p·[a_t illegal])`` (0 after an environment error)."""
        if self.error is not None:
            return 0.0
        return sum(
            (r - illegal_penalty * bad) * discount**t
            for t, (r, bad) in enumerate(zip(self.rewards, self.illegal_at, strict=True))
        )


@dataclass(frozen=True)
class Limits:
    """How long an episode may run."""

    max_turns: int  # policy decisions
    max_context: int  # prompt + completion tokens the model can attend to
    max_new_tokens: int  # tokens per action


def _checked(step: object) -> EnvStep:
    if not isinstance(step, EnvStep):
        raise EnvError(f"step() returned {type(step).__name__}, not an EnvStep")
    if not isinstance(step.observation, str):
        raise EnvError(f"step() returned a {type(step.observation).__name__} observation, not text")
    if (
        isinstance(step.reward, bool)
        or not isinstance(step.reward, int | float)
        or not math.isfinite(step.reward)
    ):
        raise EnvError(f"step() returned the reward {step.reward!r}, not a finite number")
    return step


def start(
    codec: TextCodec,
    env: TextEnv,
    seed: int,
    row: int,
    stepper: Stepper,
    reset: Callable[[], str] | None = None,
) -> Episode:
    """Reset ``env`` to ``seed`` (or by ``reset``, e.g. a poker deal from a given seat); raises
    :class:`EnvError` when it misbehaves (there is no episode to play)."""
    try:
        first = stepper.call(reset or env.reset, *(() if reset else (seed,)))
    except EnvError:
        raise
    except Exception as exc:  # an environment is user code: whatever it raises is its own fault
        raise EnvError(f"reset({seed}) raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(first, str) or not first:
        raise EnvError(f"reset({seed}) returned {first!r}, not a non-empty text observation")
    return Episode(env=env, row=row, prompt_ids=codec.encode_prompt(first))


def play(
    codec: TextCodec,
    engine: Engine,
    episodes: Sequence[Episode],
    limits: Limits,
    stepper: Stepper,
    *,
    seed: int,
    greedy: bool = False,
) -> int:
    """Play ``episodes`` to their end in lockstep (one batched generation per turn); returns the policy
    tokens generated."""
    tokens = 0
    for turn in range(limits.max_turns):
        live = [e for e in episodes if not e.over]
        for e in live:
            if len(e.prompt_ids) + len(e.completion) + limits.max_new_tokens > limits.max_context:
                e.over = e.cut = True
        live = [e for e in live if not e.over]
        if not live:
            break
        samples = engine.generate(
            [e.prompt_ids + e.completion for e in live],
            seed=seed,
            greedy=greedy,
            max_new_tokens=limits.max_new_tokens,
            rows=[e.row for e in live],
            first_steps=[len(e.completion) for e in live],
        )
        for e, s in zip(live, samples, strict=True):
            tokens += len(s.completion_ids)
            e.completion += s.completion_ids
            e.logprobs += s.logprobs
            e.mask += [1] * len(s.completion_ids)
            action = codec.decode_completion(s.completion_ids)
            e.actions.append(action)
            _step(codec, e, action, stepper)
            if not e.over and turn == limits.max_turns - 1:
                e.over = e.cut = True
    for e in episodes:  # what an unfinished episode holds (a verifiers env's run) is released
        close = getattr(e.env, "close", None)
        if e.cut and callable(close):
            try:
                stepper.call(close)
            except Exception as exc:  # user code: a failing close costs nothing but this line
                log.warning("closing a cut episode's environment failed: %s", exc)
    return tokens


def _step(codec: TextCodec, e: Episode, action: str, stepper: Stepper) -> None:
    try:
        step = _checked(stepper.call(e.env.step, action))
    except Exception as exc:  # an environment is user code: whatever it raises ends only this episode
        e.over = True
        e.error = str(exc) if isinstance(exc, EnvError) else f"step() raised {type(exc).__name__}: {exc}"
        log.warning("episode (noise row %d) ended by its environment: %s", e.row, e.error)
        return
    e.rewards.append(float(step.reward))
    e.illegal_at.append(bool(step.illegal))
    if step.done:
        e.over = True
        return
    obs = codec.encode_prompt(step.observation)
    e.completion += obs
    e.logprobs += [0.0] * len(obs)
    e.mask += [0] * len(obs)


class _Recorder:
    """Wraps a model opponent and records what it answered (replayed by the learner's check)."""

    def __init__(self, policy: TextPolicy) -> None:
        self.policy = policy
        self.said: list[str] = []

    def __call__(self, observation: str) -> str:
        out = self.policy(observation)
        self.said.append(out.strip())
        return out


def collect_episodes(
    codec: TextCodec,
    engine: Engine,
    task: EnvironmentTask,
    prompts: Sequence[Prompt],
    group_size: int,
    *,
    seed: int,
    policy_version: int,
    group_prefix: str,
    max_context: int,
    max_new_tokens: int,
    opponent_policy: Callable[[Prompt], TextPolicy | None] | None = None,
) -> RolloutBatch:
    """``group_size`` episodes of every prompt's seed, played with the engine's weights (version
    ``policy_version``); episode ``j`` of prompt ``i`` draws with noise row ``i * group_size + j``."""
    spec = task.spec
    limits = limits_for(task, max_context, max_new_tokens)
    stepper = Stepper(spec.step_timeout_s)
    episodes: list[Episode] = []
    recorders: list[_Recorder | None] = []
    try:
        for i, p in enumerate(prompts):
            opp = opponent_policy(p) if opponent_policy is not None else None
            for j in range(group_size):
                rec = _Recorder(opp) if opp is not None else None
                recorders.append(rec)
                episodes.append(
                    start(codec, spec.make(p, rec), int(p.meta["seed"]), i * group_size + j, stepper)
                )
        t0 = time.perf_counter()
        tokens = play(codec, engine, episodes, limits, stepper, seed=seed)
        t_gen = time.perf_counter() - t0
    finally:
        stepper.close()
    trajectories = []
    for k, (e, rec) in enumerate(zip(episodes, recorders, strict=True)):
        p = prompts[k // group_size]
        trajectories.append(
            Trajectory(
                prompt_id=p.prompt_id,
                group_id=f"{group_prefix}:{k // group_size}",
                prompt_ids=tuple(e.prompt_ids),
                completion_ids=tuple(e.completion),
                sampler_logprobs=tuple(e.logprobs),
                reward=e.ret(spec.discount, spec.illegal_penalty),
                policy_version=policy_version,
                meta=episode_meta(e, rec.said if rec is not None else None),
                turn_mask=tuple(e.mask),
            )
        )
    return RolloutBatch(
        trajectories=trajectories,
        unparsed=sum(e.illegal for e in episodes),
        tokens=tokens,
        t_gen_s=t_gen,
    )


def limits_for(task: EnvironmentTask, max_context: int, max_new_tokens: int) -> Limits:
    spec = task.spec
    return Limits(spec.max_turns, max_context, max_new_tokens)


def evaluate_episodes(
    codec: TextCodec,
    engine: Engine,
    task: EnvironmentTask,
    prompts: Sequence[Prompt],
    *,
    max_context: int,
    max_new_tokens: int,
    batch_size: int = 256,
) -> tuple[list[float], int, int]:
    """Greedy episodes of ``prompts`` (one each): their returns, the illegal actions and the decisions."""
    returns: list[float] = []
    illegal = decisions = 0
    stepper = Stepper(task.spec.step_timeout_s)
    limits = limits_for(task, max_context, max_new_tokens)
    try:
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i : i + batch_size]
            episodes = [
                start(codec, task.spec.make(p), int(p.meta["seed"]), r, stepper) for r, p in enumerate(chunk)
            ]
            play(codec, engine, episodes, limits, stepper, seed=0, greedy=True)
            add_judges(task.spec, episodes)
            returns += [e.ret(task.spec.discount) for e in episodes]
            illegal += sum(e.illegal for e in episodes)
            decisions += sum(len(e.actions) for e in episodes)
    finally:
        stepper.close()
    return returns, illegal, decisions


def add_judges(spec: EnvSpec, episodes: Sequence[Episode]) -> None:
    """The learner's part of finished episodes' rewards (``EnvSpec.judged``: the judges it calls, on the
    learner only) in place of the last reward each environment gave, which left them out."""
    for e, whole in zip(episodes, spec.judged([e.env for e in episodes]), strict=True):
        if whole is not None and e.error is None and e.rewards:
            e.rewards[-1] = whole


def episode_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """The ``env/`` metrics of a trained batch of episodes: decisions per episode, the share of illegal
    actions, episodes cut (``max_turns`` / context) and episodes ended by an environment error."""
    n = max(len(trajectories), 1)
    turns = sum(int(t.meta.get("turns", 0)) for t in trajectories)
    return {
        m.ENV_TURNS_MEAN.key: turns / n,
        m.ENV_ILLEGAL_RATE.key: sum(int(t.meta.get("illegal", 0)) for t in trajectories) / max(turns, 1),
        m.ENV_CUT.key: float(sum(bool(t.meta.get("cut")) for t in trajectories)),
        m.ENV_ERRORS.key: float(sum("env_error" in t.meta for t in trajectories)),
    }


def episode_meta(e: Episode, opponent_said: list[str] | None) -> dict[str, Any]:
    """Ω of an episode: turns, illegal actions, cut, environment error, a model opponent's actions."""
    meta: dict[str, Any] = {"turns": len(e.actions), "illegal": e.illegal, "cut": e.cut}
    if e.error is not None:
        meta["env_error"] = e.error[:200]
    if opponent_said is not None:
        # every answer as given (stripped), never cut: a cut record would not replay; one too long for
        # the learner's meta bound is refused at the door (oversized) instead
        meta["opponent_actions"] = json.dumps(opponent_said, separators=(",", ":"))
    return meta
