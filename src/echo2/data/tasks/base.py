"""The task adapter contract (SPEC §1): the ``Adapter`` protocol and the helpers adapters share (the
one task protocol of a run, which wraps an adapter, is ``echo2.tasks.base.Task``).

A task builds prompts ``x`` (a train stream and two fixed held-out splits), defines the reward
``R(x, y)``, and says how a trajectory's metadata ``Ω`` becomes learner-side signals (a per-token
loss mask). What grades a completion (``Prompt.answer``) is a secret of the learner: a lease carries the
prompt's text and ``meta`` only, so a task keeps no grading secret in ``meta``. A new task is a new
adapter module plus its config model, registered in ``echo2.tasks.registry``. This module imports no
adapter: adapters import it, never the reverse.

Three splits, disjoint by *problem* (each adapter defines when two prompts are the same problem):

- **train** — ``sample_train``; never yields a validation or test problem.
- **validation** — ``validation_prompts``; for decisions made while training (warm start stops on it).
- **test** — ``eval_prompts``; only reported, never used to decide anything.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal, Protocol, TypeVar, runtime_checkable

from echo2.errors import DataError
from echo2.types import Prompt

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Grade:
    """What the reward function says of one completion."""

    reward: float  # scalar r = R(x, y)
    parsed: bool  # False when no answer could be read from y (then reward is 0 and it is counted)


def grade_all(task: Adapter, todo: Sequence[tuple[Prompt, str]]) -> list[Grade]:
    """``task``'s grade of every ``(prompt, completion)``, in order, as fast as the task allows: its own
    batch (``grade_many``: a task whose grades wait on something, e.g. a judge's replies, all in flight
    at once), else on ``grade_threads`` threads for a task that declares them (code: each grade a
    sandboxed process), else one by one. Every grade a learner makes of many completions (a submission's,
    an evaluation's, a warm start's) goes through here."""
    many = getattr(task, "grade_many", None)
    if many is not None:
        return list(many(todo))
    grade = task.grade
    threads = min(len(todo), getattr(task, "grade_threads", 1))
    if threads <= 1:
        return [grade(p, text) for p, text in todo]
    with ThreadPoolExecutor(threads, thread_name_prefix="echo2-grade") as pool:
        return list(pool.map(lambda job: grade(*job), todo))


class Adapter(Protocol):
    """A data-plane task adapter."""

    name: str

    def sample_train(self, rng: random.Random, n: int) -> list[Prompt]:
        """``n`` training prompts drawn with ``rng`` (never a validation or test problem)."""
        ...

    def train_prompts(self) -> Sequence[Prompt] | None:
        """The whole training split when it is finite (a dataset file: the learner then leases it in
        epochs), None for a stream of generated problems (then ``sample_train`` draws)."""
        ...

    def validation_prompts(self, n: int) -> list[Prompt]:
        """The first ``n`` prompts of the fixed validation split (same list on every call), disjoint
        by problem from train and test; what training-time decisions (early stopping) look at."""
        ...

    def eval_prompts(self, n: int) -> list[Prompt]:
        """The first ``n`` prompts of the fixed test split (same list on every call); reported only."""
        ...

    def grade(self, prompt: Prompt, completion: str) -> Grade:
        """The reward of ``completion`` for ``prompt``; never raises on unparseable text."""
        ...

    def token_mask(self, completion_ids: Sequence[int], meta: dict[str, object]) -> list[float]:
        """Per-token loss weights for a completion, from its metadata Ω (1.0 = trained on)."""
        ...


@runtime_checkable
class ReadsAnAnswer(Protocol):
    """A task whose grader reads only the end of a completion, from a place it can point to (math: its
    last ``\\boxed{``). The generation check accepts a numerical near tie before that place, never
    from it on; a task that cannot say has the whole completion read (``tasks/verify.py``)."""

    def answer_start(self, prompt: Prompt, completion: str) -> int:
        """The character offset of ``completion`` from which the grade is read (0: the whole text):
        the grade of the text from there must equal the whole text's."""
        ...


@runtime_checkable
class CountsOutcomes(Protocol):
    """A task whose gradings end in named outcomes it counts (code: passed, failed, timeout, ...)."""

    def outcome_counts(self) -> dict[str, int]:
        """Gradings of this process so far, by outcome (running counts)."""
        ...


@runtime_checkable
class WritesReference(Protocol):
    """A task whose warm start imitates something other than ``Prompt.answer`` (code: a record's
    reference solution, while the answer holds its tests)."""

    def reference(self, prompt: Prompt) -> str:
        """The reference completion of ``prompt`` (what the supervised warm start teaches)."""
        ...


def full_mask(completion_ids: Sequence[int], meta: dict[str, object]) -> list[float]:
    """Train on every completion token (the mask most tasks want)."""
    return [1.0] * len(completion_ids)


def stable_fraction(key: str) -> float:
    """A deterministic number in [0, 1) for ``key``, the same on every machine and run
    (Python's ``hash`` is salted per process, so it cannot split data reproducibly)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


Split = Literal["train", "validation", "test"]


def split_of(u: float, test_fraction: float, validation_fraction: float) -> Split:
    """The split of a problem whose stable hash is ``u`` in [0, 1): test = ``[0, test_fraction)``,
    validation = ``[test_fraction, test_fraction + validation_fraction)``, train = the rest.
    Pass ``test_fraction=0`` when the test split comes from elsewhere (a separate file)."""
    if u < test_fraction:
        return "test"
    if u < test_fraction + validation_fraction:
        return "validation"
    return "train"


R = TypeVar("R")


class FileSplitsAccess:
    """The split verbs of a task whose splits come from a dataset file, read on first use (a worker
    grades nothing and leases its prompts, so it never reads one): a subclass says how in
    ``_read_splits`` and names its bundled sample in ``SAMPLE``."""

    SAMPLE = ""  # the file under ``data/tasks/samples`` read when ``train_path`` is unset

    def __init__(self) -> None:
        self._splits: dict[Split, list[Prompt]] | None = None
        self._splits_lock = threading.Lock()

    def splits(self) -> dict[Split, list[Prompt]]:
        """The train / validation / test prompts, read on first use (any thread)."""
        with self._splits_lock:
            if self._splits is None:
                self._splits = self._read_splits()
            return self._splits

    def _read_splits(self) -> dict[Split, list[Prompt]]:
        raise NotImplementedError

    def dataset_files(self, train_path: str | None, eval_path: str | None) -> tuple[Path, Path | None]:
        """The train file (the bundled sample when ``train_path`` is unset) and the test file, if any."""
        if train_path is None:
            train = Path(str(resources.files("echo2.data.tasks") / "samples" / self.SAMPLE))
        else:
            train = Path(train_path)
        return train, None if eval_path is None else Path(eval_path)

    def train_prompts(self) -> list[Prompt]:
        return self.splits()["train"]

    def sample_train(self, rng: random.Random, n: int) -> list[Prompt]:
        train = self.splits()["train"]
        return [rng.choice(train) for _ in range(n)]

    def validation_prompts(self, n: int) -> list[Prompt]:
        return self.splits()["validation"][:n]

    def eval_prompts(self, n: int) -> list[Prompt]:
        return self.splits()["test"][:n]


def file_splits(
    records: Sequence[R],
    test_records: Sequence[R] | None,
    key: Callable[[R], str],
    tag: str,
    test_fraction: float,
    validation_fraction: float,
    files: tuple[Path, Path | None],
) -> dict[Split, list[R]]:
    """A dataset file's records in the three splits, disjoint by problem (``key``: records with the same
    key are the same problem; ``tag`` salts the hash). Without ``test_records``: test =
    ``[0, test_fraction)`` of the stable hash, validation the next ``validation_fraction``, train the rest;
    with them (an eval file) they are the test split, and records of ``records`` whose key is among
    theirs are left out (logged). An empty split is a :class:`DataError` naming the files."""
    splits: dict[Split, list[R]] = {"train": [], "validation": [], "test": []}
    test_keys: set[str] = set()
    if test_records is not None:
        splits["test"] = list(test_records)
        test_keys = {key(r) for r in test_records}
    overlap = 0
    for record in records:
        k = key(record)
        if k in test_keys:
            overlap += 1
            continue
        u = stable_fraction(f"{tag}:{k}")
        splits[split_of(u, 0.0 if test_keys else test_fraction, validation_fraction)].append(record)
    train_file, eval_file = files
    if overlap:
        log.warning(
            "%s: %d records ask a question of the test file %s; left out of train and validation",
            train_file, overlap, eval_file,
        )  # fmt: skip
    empty = [name for name, got in splits.items() if not got]
    if empty:
        sizes = ", ".join(f"{name} {len(got)}" for name, got in splits.items())
        raise DataError(
            f"{train_file}: {len(records)} records leave an empty {' and '.join(empty)} split ({sizes}; "
            f"eval_fraction={test_fraction}, validation_fraction={validation_fraction}); "
            "add records, change the fractions, or set task.eval_path"
        )
    return splits
