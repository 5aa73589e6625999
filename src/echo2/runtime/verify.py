"""What a worker says that the learner checks itself: the prompt it answered and the reward it earned.

A worker is a stranger's machine. Two of its claims cost the learner almost nothing to re-derive, so
none is believed: every sample's ``prompt_ids`` must be the leased prompt's own tokens (the learner
encodes the prompt text exactly as workers do, ``TextCodec.encode_prompt``), and every reward of a
verifiable task is recomputed from the completion (``task.grade``). A mismatch refuses the whole
submission (``prompt_mismatch`` / ``reward_mismatch``, counted like every refusal). The recomputation
runs off the event loop, on a tokenizer of its own (fast tokenizers must not be shared across
threads). Still taken on trust here: the sampler log-probs and the version that generated a sample.
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from echo2.data.submission import Rejected, Submission
from echo2.types import Prompt

if TYPE_CHECKING:
    from echo2.data.tasks.base import Task
    from echo2.models.policy import TextCodec

REWARD_TOLERANCE = 1e-6  # a claimed reward this close to the recomputed one is the same reward


class Verifier:
    def __init__(self, codec: TextCodec, task: Task) -> None:
        from echo2.models.policy import TextCodec

        self.codec = TextCodec(copy.deepcopy(codec.tokenizer), codec.chat_template)  # this thread's own
        self.task = task
        self._lock = threading.Lock()  # one check at a time: the tokenizer is not shared across calls
        self._tokens: dict[str, tuple[int, ...]] = {}  # prompt text -> its tokens

    def check(self, prompts: Sequence[Prompt], sub: Submission) -> None:
        """Raise :class:`Rejected` unless every group answers its leased prompt with its own tokens and
        every reward is the task's for that completion (any thread). Groups whose prompt id is not in
        the lease are left to the store, which refuses them (``prompt_mismatch``)."""
        by_id = {p.prompt_id: p for p in prompts}
        with self._lock:
            for i, group in enumerate(sub.groups):
                prompt = by_id.get(group[0].prompt_id) if group else None
                if prompt is None:
                    continue
                want = self._prompt_tokens(prompt.text)
                for j, t in enumerate(group):
                    where = f"groups[{i}].samples[{j}]"
                    if tuple(t.prompt_ids) != want:
                        raise Rejected(
                            "prompt_mismatch", f"{where}.prompt_ids: not the leased prompt's tokens"
                        )
                    reward = self.task.grade(prompt, self.codec.decode_completion(t.completion_ids)).reward
                    if not math.isclose(t.reward, reward, rel_tol=0.0, abs_tol=REWARD_TOLERANCE):
                        raise Rejected(
                            "reward_mismatch",
                            f"{where}.reward: {t.reward!r} claimed, the task gives {reward!r}",
                        )

    def _prompt_tokens(self, text: str) -> tuple[int, ...]:
        tokens = self._tokens.get(text)
        if tokens is None:
            if len(self._tokens) > 65536:  # bounded: a long run leases many distinct prompts
                self._tokens.clear()
            tokens = self._tokens[text] = tuple(self.codec.encode_prompt(text))
        return tokens
