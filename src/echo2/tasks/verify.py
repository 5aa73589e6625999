"""What a worker says that the learner checks itself: the prompt it answered, the version it sampled
with, and (on a drawn share of submissions) that its tokens are the claimed weights' draw. What a
completion earned the learner grades itself: a lease carries no grading secret (``protocol.LeasedPrompt``),
so a worker's reward is not believed, nor needed.

A worker is a stranger's machine (docs/security.md). Nothing it claims is believed:

- **Every submission** (:class:`Verifier`, cheap): every sample's ``prompt_ids`` are the leased
  prompt's own tokens (the learner encodes the prompt text exactly as workers do) [prompt_mismatch];
  a single-turn completion carries no turn mask but all ones (the loss trains what the grade reads)
  [turn_mask]; a completion ends at its first EOS, and one without EOS is exactly ``max_new_tokens``
  long (no cherry-picked truncation) [completion_shape]; the claimed version is not older than the one
  the worker said it held when it took the lease (installs only move forward) [version_mismatch]. Every
  reward (and parse status) is then the task's own grade of the completion, whatever the worker sent.
- **A drawn share** (``check/rerun.GenerationCheck``, one forward pass per checked completion): the
  learner re-runs the claimed version's published weights over the prompt and completion and, with
  the lease's seed, recomputes at every step the sampler's log-prob and the seeded Gumbel-max draw
  (``rollout/sampling.py``). Every position must pass (``check/positions.py``): the log-prob within
  ``logprob_tolerance``, the token the draw or a declared numerical near tie (within
  ``gumbel_tolerance`` of the best perturbed score); one miss is a forgery [forged_generation], and a near
  tie on a token the grader reads (:meth:`Verifier.graded_from`) is no forgery but is not trained
  [graded_tie]. A different model, tampered log-probs, an inflated version (the tokens are not the
  claimed version's draw), best-of-n cherry-picking, an answer rewritten or a phrase inserted all fail
  it; honest numerical noise (batched vs unbatched kernels, another GPU) stays inside the tolerances.
  The tolerances follow the run's declared ``security.engine_precision`` (config.ENGINE_TOLERANCES: a
  bf16 engine's rounding is larger than a float32 one's), never a worker's claim.
  In a multi-turn episode only the policy's tokens are checked: its token at completion index ``c``
  was drawn at noise step ``c`` (``rollout/episodes.py``), whatever turn it belongs to.
- **Episodes** (:class:`EpisodeReplay`, every submission of an environment task): the learner replays
  each episode from its seed and the policy's actions: every observation turn must be the
  environment's own tokens, the turn mask exact, and the claimed return the replay's [reward_mismatch];
  the mask and the return stored are the replay's.

The checks run off the event loop, one at a time, on models and a tokenizer of their own. A failure
of ``reward_mismatch``, ``episode_mismatch``, ``turn_mask`` or ``forged_generation`` is evidence of
lying: the intake quarantines the worker (``intake.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from echo2.data.submission import Rejected, Submission
from echo2.data.tasks.base import ReadsAnAnswer, grade_all
from echo2.envs.base import EnvError
from echo2.rollout.engines.base import EosIds, eos_tuple, first_eos
from echo2.types import Prompt, Trajectory

if TYPE_CHECKING:
    from echo2.data.store import Lease
    from echo2.data.tasks.base import Adapter
    from echo2.data.tasks.environment import EnvironmentTask
    from echo2.models.policy import TextCodec
    from echo2.rollout.episodes import Episode

REWARD_TOLERANCE = 1e-6  # a claimed reward this close to the recomputed one is the same reward
# these quarantine: an honest worker cannot produce them
EVIDENCE = frozenset({"reward_mismatch", "forged_generation", "episode_mismatch", "turn_mask"})


class Verifier:
    """The checks every submission gets (cheap: a tokenizer and the task's grader)."""

    def __init__(self, codec: TextCodec, task: Adapter, eos_id: EosIds, max_new_tokens: int) -> None:
        self._setup(codec, eos_id, max_new_tokens)
        self.task = task  # the adapter whose reward function re-grades every completion

    def _setup(self, codec: TextCodec, eos_id: EosIds, max_new_tokens: int) -> None:
        from echo2.models.policy import TextCodec

        self.codec = TextCodec.of(copy.deepcopy(codec.tokenizer), codec.chat)  # this thread's own
        self.eos_ids = eos_tuple(eos_id)  # every token that ends a completion
        self.max_new_tokens = max_new_tokens
        self._lock = threading.Lock()  # one check at a time: the tokenizer is not shared across calls
        self._tokens: dict[tuple[str, str | None], tuple[int, ...]] = {}  # (prompt text, system) -> tokens

    def check(self, lease: Lease, sub: Submission) -> Submission:
        """The submission as the learner takes it, or :class:`Rejected` unless it is what ``lease`` asked
        for: the claimed version not older than the worker held, every group answering its leased
        prompt with that prompt's own tokens, every completion well formed (a single-turn completion
        carries no turn mask but all ones [turn_mask]). Every reward is the task's own grade (what a
        worker claims is never believed: its leases carry no answer to grade with), every parse status
        too (any thread). Groups whose prompt id is not in the lease are left to the store, which
        refuses them (``prompt_mismatch``)."""
        if sub.policy_version < lease.installed_version:
            raise Rejected(
                "version_mismatch",
                f"policy_version: {sub.policy_version}, but the worker held "
                f"{lease.installed_version} when it took the lease",
            )
        by_id = {p.prompt_id: p for p in lease.prompts}
        return dataclasses.replace(sub, groups=self._checked(sub, by_id))

    def _checked(self, sub: Submission, by_id: dict[str, Prompt]) -> tuple[tuple[Trajectory, ...], ...]:
        """Every group as the learner takes it: each sample's shape checked (``_completion_text``), then
        every completion graded (on several threads for a task that declares them)."""
        todo: list[tuple[Prompt, str]] = []  # (prompt, completion text) of every sample to grade, in order
        with self._lock:
            for i, group in enumerate(sub.groups):
                prompt = by_id.get(group[0].prompt_id) if group else None
                if prompt is None:
                    continue
                want = self._prompt_tokens(prompt)
                for j, t in enumerate(group):
                    todo.append((prompt, self._completion_text(prompt, want, t, f"groups[{i}].samples[{j}]")))
        grades = iter(grade_all(self.task, todo))
        groups = []
        for group in sub.groups:
            if not group or group[0].prompt_id not in by_id:
                groups.append(group)
                continue
            graded = []
            for t in group:
                grade = next(grades)
                meta = {**t.meta, "parsed": grade.parsed}
                graded.append(dataclasses.replace(t, reward=grade.reward, meta=meta, turn_mask=()))
            groups.append(tuple(graded))
        return tuple(groups)

    def _completion_text(self, prompt: Prompt, want: tuple[int, ...], t: Trajectory, where: str) -> str:
        """The completion's text, once its shape is what a lease of ``prompt`` asked for."""
        if tuple(t.prompt_ids) != want:
            raise Rejected("prompt_mismatch", f"{where}.prompt_ids: not the leased prompt's tokens")
        if any(m != 1 for m in t.turn_mask):  # the loss would train fewer tokens than the grade read
            raise Rejected(
                "turn_mask",
                f"{where}.turn_mask: a single-turn completion is the policy's whole (no mask, or all 1); "
                "a mask with 0s would train fewer tokens than the reward grades",
            )
        ids = t.completion_ids
        eos = first_eos(ids, self.eos_ids)
        if eos >= 0 and eos != len(ids) - 1:
            raise Rejected("completion_shape", f"{where}.completion_ids: tokens after EOS at {eos}")
        if eos < 0 and len(ids) != self.max_new_tokens:
            raise Rejected(
                "completion_shape",
                f"{where}.completion_ids: {len(ids)} tokens without EOS (a completion ends at EOS or "
                f"after max_new_tokens={self.max_new_tokens})",
            )
        return self.codec.decode_completion(ids)

    def graded_from(self, prompt: Prompt, t: Trajectory) -> int:
        """The first completion position whose token the grader reads (any thread): a task that can say
        where its answer starts (``data.tasks.base.ReadsAnAnswer``: math's last ``\\boxed{``, when the
        grade of the text from there is the whole text's) gives that position, less one token of margin;
        else 0, the whole completion. A near tie of the generation check is never accepted from here on
        (``GenerationCheck``)."""

        if not isinstance(self.task, ReadsAnAnswer):
            return 0
        with self._lock:
            ids = list(t.completion_ids)
            at = self.task.answer_start(prompt, self.codec.decode_completion(ids))
            if at <= 0:
                return 0
            lo, hi = 0, len(ids)  # the most tokens whose text ends before the answer starts
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if len(self.codec.decode_completion(ids[:mid])) <= at:
                    lo = mid
                else:
                    hi = mid - 1
            return max(0, lo - 1)

    def _prompt_tokens(self, prompt: Prompt) -> tuple[int, ...]:
        key = (prompt.text, prompt.meta.get("system"))
        tokens = self._tokens.get(key)
        if tokens is None:
            if len(self._tokens) > 65536:  # bounded: a long run leases many distinct prompts
                self._tokens.clear()
            tokens = self._tokens[key] = tuple(self.codec.encode(prompt))
        return tokens


class _ReplayEngine:
    """Plays back one claimed episode's policy turns as if they were sampled (the runner's own loop then
    rebuilds everything else: observations, mask, cut, return). A turn that is not one generation's
    shape (tokens after EOS, or no EOS before ``max_new_tokens``) is refused."""

    def __init__(self, t: Trajectory, eos_ids: tuple[int, ...], max_new_tokens: int, where: str) -> None:
        self.turns: list[tuple[int, ...]] = []
        run: list[int] = []
        for tok, m in zip(t.completion_ids, t.turn_mask, strict=True):
            if m:
                run.append(tok)
            elif run:
                self.turns.append(tuple(run))
                run = []
        if run:
            self.turns.append(tuple(run))
        for k, turn in enumerate(self.turns):
            eos = first_eos(turn, eos_ids)
            if (eos >= 0 and eos != len(turn) - 1) or (eos < 0 and len(turn) != max_new_tokens):
                raise Rejected(
                    "completion_shape",
                    f"{where}: policy turn {k} of {len(turn)} tokens is not one generation (it ends at EOS "
                    f"or after max_new_tokens={max_new_tokens})",
                )
        self.next = 0

    def generate(self, prompts: Sequence[Sequence[int]], seed: int, **_: Any) -> list[Any]:
        from echo2.rollout.engines.base import Sample

        out = []
        for _p in prompts:  # one episode per replay: one prompt per call
            turn = self.turns[self.next] if self.next < len(self.turns) else ()
            self.next += 1
            out.append(Sample(turn, (0.0,) * len(turn), finished=bool(turn)))
        return out


class _Scripted:
    """A model opponent's recorded answers (``meta["opponent_actions"]``: a JSON list of strings),
    replayed in order; a record that is not one is refused [schema]."""

    def __init__(self, recorded: object, where: str) -> None:
        try:
            said = json.loads(recorded) if isinstance(recorded, str) else []
        except ValueError:
            said = None
        if not isinstance(said, list) or not all(isinstance(a, str) for a in said):
            raise Rejected("schema", f"{where}.meta.opponent_actions: not a JSON list of strings")
        self.said: list[str] = said

    def __call__(self, observation: str) -> str:
        return self.said.pop(0) if self.said else ""


class EpisodeReplay(Verifier):
    """Every submission of an environment task: each episode is played again from its seed with the
    policy turns it claims (and the recorded answers of a model opponent). Its prompt must be the
    environment's first observation, every observation turn and the turn mask what the environment
    answers [episode_mismatch], and the return the replay's [reward_mismatch]."""

    def __init__(
        self, codec: TextCodec, task: EnvironmentTask, eos_id: EosIds, max_new_tokens: int, max_context: int
    ) -> None:
        from echo2.rollout.episodes import Stepper, limits_for

        self._setup(codec, eos_id, max_new_tokens)
        self.env_task = task
        self.limits = limits_for(task, max_context, max_new_tokens)
        self.stepper = Stepper(task.spec.step_timeout_s)  # one environment thread for every replay
        task.spec.ready_judges()  # a verifiers env's judges: named and probed here, or the run stops

    def _prompt_tokens(self, prompt: Prompt) -> tuple[int, ...]:
        return ()  # the replay rebuilds the prompt from the seed

    def graded_from(self, prompt: Prompt, t: Trajectory) -> int:
        """0: the environment reads every action of the policy."""
        return 0

    def _checked(self, sub: Submission, by_id: dict[str, Prompt]) -> tuple[tuple[Trajectory, ...], ...]:
        """Every episode replayed (one at a time: one environment thread), then the judges the learner
        calls for the finished ones (``EnvSpec.judged``: the submission's calls at once)."""
        from echo2.rollout.episodes import add_judges

        groups: list[tuple[Trajectory, ...]] = []
        replayed: list[tuple[int, int, Episode]] = []
        with self._lock:
            for i, group in enumerate(sub.groups):
                prompt = by_id.get(group[0].prompt_id) if group else None
                if prompt is not None:
                    for j, t in enumerate(group):
                        replayed.append((i, j, self._check_sample(prompt, t, f"groups[{i}].samples[{j}]")))
                groups.append(group)
        spec = self.env_task.spec
        add_judges(spec, [e for _, _, e in replayed])
        out = [list(g) for g in groups]
        for i, j, e in replayed:  # the replay's return and turn mask, never the worker's
            out[i][j] = dataclasses.replace(
                out[i][j], reward=e.ret(spec.discount, spec.illegal_penalty), turn_mask=tuple(e.mask)
            )
        return tuple(tuple(g) for g in out)

    def _check_sample(self, prompt: Prompt, t: Trajectory, where: str) -> Episode:
        """The episode ``t`` claims, replayed: its observations, turn mask and return (before the judges the
        learner calls: the worker's claim leaves them out) checked against the claim."""
        from echo2.rollout import episodes

        if not t.turn_mask:
            raise Rejected("episode_mismatch", f"{where}.turn_mask: an episode needs its turn mask")
        spec = self.env_task.spec
        engine = _ReplayEngine(t, self.eos_ids, self.max_new_tokens, where)
        env = spec.make(prompt, _Scripted(t.meta.get("opponent_actions"), where))
        try:
            e = episodes.start(self.codec, env, int(prompt.meta["seed"]), 0, self.stepper)
        except EnvError as exc:
            raise Rejected("episode_mismatch", f"{where}: the environment fails at reset ({exc})") from None
        episodes.play(self.codec, engine, [e], self.limits, self.stepper, seed=0)  # type: ignore[arg-type]
        if tuple(e.prompt_ids) != tuple(t.prompt_ids):  # the seed's first observation (the opponents'
            # first moves included): a worker that sends another one made it up
            raise Rejected("episode_mismatch", f"{where}.prompt_ids: not the episode's first observation")
        claimed_error = "env_error" in t.meta
        if claimed_error and e.error is None:
            # a step that failed or timed out on the worker's machine: the episode's turns must still be
            # the environment's up to where it stopped, and its return 0 (a timeout cannot be replayed)
            n = len(t.completion_ids)
            e.completion, e.mask, e.error = e.completion[:n], e.mask[:n], "claimed by the worker"
        if tuple(e.completion) != tuple(t.completion_ids) or tuple(e.mask) != tuple(t.turn_mask):
            at = next(
                (k for k, (a, b) in enumerate(zip(e.completion, t.completion_ids, strict=False)) if a != b),
                min(len(e.completion), len(t.completion_ids)),
            )
            raise Rejected(
                "episode_mismatch",
                f"{where}.completion_ids: the replayed episode differs from token {at} on (its observations "
                "or turn mask are not what the environment answers)",
            )
        ret = e.ret(spec.discount, spec.illegal_penalty)
        if not math.isclose(t.reward, ret, rel_tol=0.0, abs_tol=REWARD_TOLERANCE):
            raise Rejected(
                "reward_mismatch", f"{where}.reward: {t.reward!r} claimed, the replay gives {ret!r}"
            )
        return e
