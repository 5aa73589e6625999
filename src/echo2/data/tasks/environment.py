"""Multi-turn environment tasks (SPEC §8): the task adapter of a text environment (``echo2.envs``).

A prompt of an environment task is an *episode seed*, not a text: ``Prompt.meta["seed"]`` (and, for
environments with opponents, ``meta["opponent"]``). A GRPO group is ``G`` episodes of the same seed, so
their returns compare like with like (the same deal, the same hidden number); the rollout plane plays
them (``rollout/episodes.py``) and the learner replays them to re-check the claimed return
(``tasks/verify.py``). ``Prompt.text`` only describes the episode for people and logs.

**Splits hold out whole episodes.** The split of a seed is a stable hash of ``"<env>:<seed>"``: test =
``[0, eval_fraction)``, validation = the next ``validation_fraction``, train = the rest. A seed fixes
everything random in an episode (poker: the whole deck), so no training episode replays a held-out
deal. The fixed held-out lists take the seeds 0, 1, 2, ... that fall in their split. An environment of
finitely many episodes (a verifiers taskset: ``EnvSpec.episodes``) has the seeds ``0..episodes-1`` only,
each one task, so a task is in one split.

A new environment is an :class:`EnvSpec` (how to build it, which extra prompt fields it draws, who
teaches its warm start) registered in ``envs/roster.py`` with its config model; nothing else changes.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from echo2.data.tasks.base import Split, full_mask, split_of, stable_fraction
from echo2.envs.base import EnvScore, TextEnv
from echo2.errors import DataError
from echo2.types import Prompt

TextPolicy = Callable[[str], str]  # observation text -> action text (a model opponent)


class EnvSpec(Protocol):
    """What an environment tells its task adapter."""

    @property
    def name(self) -> str:
        """The environment's name (the task name)."""
        ...

    @property
    def score(self) -> EnvScore:
        """What its held-out evaluation measures ("chips" for poker, else "return")."""
        ...

    @property
    def discount(self) -> float:
        """Gamma of the episodic return."""
        ...

    @property
    def max_turns(self) -> int:
        """Policy decisions per episode before it is cut."""
        ...

    @property
    def step_timeout_s(self) -> float:
        """An environment step slower than this ends the episode."""
        ...

    @property
    def illegal_penalty(self) -> float:
        """Subtracted from the reward of a step whose action was illegal (training)."""
        ...

    @property
    def eval_fraction(self) -> float:
        """Share of episode seeds held out as the test split."""
        ...

    @property
    def validation_fraction(self) -> float:
        """Share of episode seeds held out as the validation split."""
        ...

    @property
    def episodes(self) -> int | None:
        """How many distinct episodes there are (seeds ``0..episodes-1``: a finite set of tasks), or
        None: any 31-bit seed."""
        ...

    def make(self, prompt: Prompt, opponent_policy: TextPolicy | None = None) -> TextEnv:
        """A fresh environment for the episode ``prompt`` names (not reset yet). ``opponent_policy``
        plays a model opponent (``meta["opponent"] == "selfplay"``), when the environment has one."""
        ...

    def draw_meta(self, rng: random.Random) -> dict[str, Any]:
        """Extra prompt fields of a training episode besides its seed (e.g. the opponent)."""
        ...

    def fixed_meta(self, index: int) -> dict[str, Any]:
        """Extra prompt fields of the ``index``-th held-out episode (deterministic)."""
        ...

    def teacher(self, env: TextEnv) -> str:
        """The action a scripted expert takes in ``env``'s current state (the warm start imitates it)."""
        ...

    def ready_judges(self) -> None:
        """On the learner, before it scores an episode: name and probe the judges it will call (a verifiers
        env's plugged judges, ``task.judges = "learner"``); a judge that fails stops the run here."""
        ...

    def judged(self, envs: Sequence[TextEnv]) -> list[float | None]:
        """The learner's part of scoring finished episodes: each one's whole reward with its judges called
        (it replaces the last reward the environment gave, which left them out), or None."""
        ...

    def outcome_counts(self) -> dict[str, int]:
        """The learner's own scorings of episodes in this process so far, by outcome (running counts)."""
        ...


class EnvironmentTask:
    """The data adapter of a multi-turn environment: episode seeds, their splits and the environment's
    spec. It has no text reward function: an episode is rewarded by playing it (``rollout/episodes.py``);
    ``echo2.tasks.episodic`` puts it behind the task protocol."""

    def __init__(self, spec: EnvSpec, seed: int = 0) -> None:
        self.spec = spec
        self.name = spec.name
        self.seed = seed
        self._fixed: dict[Split, list[Prompt]] = {"validation": [], "test": []}

    def split(self, episode_seed: int) -> Split:
        u = stable_fraction(f"{self.name}:{episode_seed}")
        return split_of(u, self.spec.eval_fraction, self.spec.validation_fraction)

    def prompt(self, episode_seed: int, meta: dict[str, Any]) -> Prompt:
        tail = "".join(f":{v}" for _, v in sorted(meta.items()))
        described = " ".join(f"{k} {v}" for k, v in sorted(meta.items()))
        return Prompt(
            prompt_id=f"{self.name}:{episode_seed}{tail}",
            text=f"{self.name} episode {episode_seed} {described}".strip(),
            answer="",
            meta={"seed": episode_seed, **meta},
        )

    def train_prompts(self) -> list[Prompt] | None:
        return None  # a stream of episode seeds

    @functools.cached_property
    def _train_seeds(self) -> list[int] | None:
        """The training seeds of a finite environment, read once (None: any 31-bit seed)."""
        episodes = self.spec.episodes
        if episodes is None:
            return None
        seeds = [s for s in range(episodes) if self.split(s) == "train"]
        if not seeds:
            raise DataError(f"{self.name}: none of its {episodes} episodes falls in the train split")
        return seeds

    def sample_train(self, rng: random.Random, n: int) -> list[Prompt]:
        seeds = self._train_seeds
        if seeds is not None:
            return [self.prompt(rng.choice(seeds), self.spec.draw_meta(rng)) for _ in range(n)]
        out: list[Prompt] = []
        while len(out) < n:
            s = rng.getrandbits(31)
            if self.split(s) == "train":
                out.append(self.prompt(s, self.spec.draw_meta(rng)))
        return out

    def _fixed_prompts(self, split: Split, n: int) -> list[Prompt]:
        cache = self._fixed[split]
        s = (cache[-1].meta["seed"] + 1) if cache else 0
        end = self.spec.episodes
        while len(cache) < n and (end is None or s < end):
            if self.split(s) == split:
                cache.append(self.prompt(s, self.spec.fixed_meta(len(cache))))
            s += 1
        return cache[:n]

    def validation_prompts(self, n: int) -> list[Prompt]:
        return self._fixed_prompts("validation", n)

    def eval_prompts(self, n: int) -> list[Prompt]:
        return self._fixed_prompts("test", n)

    def token_mask(self, completion_ids: Sequence[int], meta: dict[str, object]) -> list[float]:
        return full_mask(completion_ids, meta)
