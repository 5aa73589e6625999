"""The learner core under the one learner loop (``loop.py``) of both learner processes (``echo2
train``, ``local.py``; the node of ``echo2 run`` / ``echo2 learner``, ``learner.py``): the run
directory and its trackers, the policy (a checkpoint to resume, else the starting checkpoint: the
user's, or the embedded model's warm start), the task, the GRPO trainer and an engine on the
trainer's own weights; held-out evaluation and its running first / best / last readings;
checkpoints; and what a diverged update leaves behind (the last good weights, a summary naming the error).

What differs between the two processes is the loop's feed: where the store's groups come from
(generated in-process with the current weights, or submitted by workers) and what a step does around
the update (publish, retarget the pool).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from echo2.check.turns import Turns
from echo2.config import Config
from echo2.errors import ConfigError, Echo2Error, TrainingDivergedError
from echo2.models.snapshot import empty_model
from echo2.observe.rundir import OPTIM_FILE, STATE_FILE, RunDir
from echo2.tasks.base import Task
from echo2.types import Bounds, Trajectory
from echo2.weights.delta import sampler_copy

log = logging.getLogger(__name__)
TOY_LR_FLOOR = 1e-4  # a learning rate at least this large with a user's checkpoint is warned about

if TYPE_CHECKING:
    from echo2.learner.sharded import Ranks
    from echo2.learner.trainer import GRPOTrainer, UpdateStats
    from echo2.models.policy import Policy
    from echo2.rollout.engines.hf import HFEngine
    from echo2.rollout.evaluate import EvalResult


P = ParamSpec("P")
R = TypeVar("R")
# the operations on the model that every rank does together, by name: rank 0 announces one and does it
# (Plane.lead), the other ranks replay what it announced (Follower.run); one table, filled by @collective
COLLECTIVES: dict[str, Callable[..., Any]] = {}


def collective(op: Callable[Concatenate[Plane, P], R]) -> Callable[Concatenate[Plane, P], R]:
    """Register a :class:`Plane` method as a collective operation (module table ``COLLECTIVES``)."""
    COLLECTIVES[op.__name__] = op
    return op


@dataclass
class Plane:
    """What every rank of a learner holds: the policy (sharded over the ranks when there are several),
    the task, the GRPO trainer, an engine on the trainer's own weights, the held-out prompts and the
    bounds they are evaluated under, and the ranks. Its ``@collective`` methods are the operations every
    rank does together; rank 0 runs one through :meth:`lead`."""

    policy: Policy
    task: Task
    trainer: GRPOTrainer
    engine: HFEngine  # greedy evaluation on the trainer's own weights
    eval_prompts: list[Any]
    bounds: Bounds
    ranks: Ranks

    @classmethod
    def load(
        cls, cfg: Config, ranks: Ranks, device: Any, source: Path, resumed: bool, isolate: bool
    ) -> Plane:
        """The policy from ``source`` (a checkpoint to resume when ``resumed``, with its optimizer state:
        a one-process checkpoint or a sharded one, at any world size), sharded over ``ranks``; the task,
        the trainer (``isolate``: a non-finite group is left out of an update instead of ending it) and
        the engine."""
        from echo2.learner.trainer import GRPOTrainer
        from echo2.models.policy import chat_format, load_checkpoint
        from echo2.rollout.engines.hf import HFEngine
        from echo2.tasks.registry import build_task

        # a LoRA learner's frozen base is bf16 under bf16-mixed: a bf16 checkpoint loads as stored
        keep_bf16 = cfg.lora.enabled and cfg.learner.precision == "bf16-mixed"
        # sharded: every rank builds the model on the meta device and holds only its shard (shard_policy)
        policy = load_checkpoint(source, chat_format(cfg), keep_bf16, weights=not ranks.sharded)
        _lora(cfg, policy, source, resumed, ranks.sharded)
        reference = None
        if ranks.sharded:
            reference = shard_policy(cfg, ranks, device, policy, source, resumed)
        else:
            policy.model.to(device)
        version0 = json.loads((source / STATE_FILE).read_text())["version"] if resumed else 0
        task = build_task(cfg.task, cfg.seed)
        trainer = GRPOTrainer(
            policy.model,
            cfg.grpo,
            cfg.sampling,
            policy.pad_id,
            task.token_mask,
            version0,
            isolate=isolate,
            learner=cfg.learner,
            reference=reference,
            ranks=ranks,
            eos_ids=policy.eos_ids,
        )
        if resumed:
            _resume_states(source, ranks, device, policy.model, trainer)
        # every rank stops generating at the same step (each forward of a sharded model is a collective)
        engine = HFEngine.on_policy(policy, cfg.sampling, cfg.learner.micro_batch_tokens, ranks.all_done)
        eval_prompts = task.eval_prompts(cfg.train.eval_size)
        return cls(policy, task, trainer, engine, eval_prompts, Bounds.of(cfg), ranks)

    def lead(self, op: Callable[Concatenate[Plane, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Rank 0: announce the collective ``op`` (a ``@collective`` method of this class) with its
        arguments to the other ranks, then do it."""
        assert COLLECTIVES.get(op.__name__) is op, f"{op.__name__} is not a registered collective"
        assert not kwargs, "a collective's arguments are positional (they are replayed as announced)"
        self.ranks.announce(op.__name__, *args)
        return op(self, *args)

    def follow(self, name: str, args: tuple[Any, ...]) -> None:
        """A rank other than 0: do the collective rank 0 announced as ``name``."""
        op = COLLECTIVES.get(name)
        if op is None:
            raise Echo2Error(f"rank {self.ranks.rank}: unknown operation {name!r} from rank 0")
        op(self, *args)

    @collective
    def update(self, batch: list[Trajectory]) -> UpdateStats:
        """One GRPO update (``GRPOTrainer.update``; every rank computes its share)."""
        return self.trainer.update(batch)

    @collective
    def evaluate(self) -> EvalResult:
        """The task's greedy held-out score, in the update's precision (this thread's autocast); cut
        short when rank 0 is told to halt (``Ranks.halted`` says so after)."""
        self.ranks.halted = False
        with self.trainer.autocast():
            return self.task.evaluate(self.policy.codec, self.engine, self.eval_prompts, self.bounds)

    @collective
    def weights(self, dtype: str) -> dict[str, Any] | None:
        """A sampler copy of the weights in ``dtype`` (``weights.delta.sampler_copy``; a LoRA policy's:
        the adapter alone); sharded: gathered tensor by tensor to rank 0 (None on the others)."""
        from echo2.learner.sharded import full_weights
        from echo2.models.lora import adapter_copy, has_adapter

        if self.ranks.sharded:
            return full_weights(self.policy.model, dtype)
        if has_adapter(self.policy.model):  # a LoRA run publishes the adapter alone (models/lora.py)
            return adapter_copy(self.policy.model, dtype)
        return sampler_copy(self.policy.model, dtype)

    @collective
    def save_states(self, path: str) -> None:
        """The model's and the optimizer's states into ``path/dcp`` (every rank its shards)."""
        from echo2.learner.sharded import save_states
        from echo2.models.policy import DCP_DIR

        save_states(Path(path) / DCP_DIR, self.policy.model, self.trainer.optimizer)


def shard_policy(cfg: Config, ranks: Ranks, device: Any, policy: Policy, source: Path, resumed: bool) -> Any:
    """A sharded learner's policy (built on the meta device) sharded over ``ranks``, each rank's shard
    allocated on ``device`` and filled by rank 0 from the checkpoint (``learner/sharded.py``; a sharded
    checkpoint's states come later, with the optimizer's); the KL reference, when ``grpo.kl_beta > 0``,
    sharded from the start with the policy's shards. Returns the reference (None without one)."""
    from echo2.learner.sharded import load_from_rank0, materialize, sharded_reference
    from echo2.models.policy import DCP_DIR

    mesh = ranks.mesh(device.type)
    materialize(policy.model, mesh, device)
    if not (resumed and (source / DCP_DIR).is_dir()):
        load_from_rank0(policy.model, source if ranks.leader else None)
    if cfg.grpo.kl_beta <= 0:
        return None
    mixed = cfg.learner.precision == "bf16-mixed"
    return sharded_reference(policy.model, empty_model(policy.model.config), mixed, mesh)


def _resume_states(source: Path, ranks: Ranks, device: Any, model: Any, trainer: GRPOTrainer) -> None:
    """A resumed checkpoint's optimizer state (and a sharded checkpoint's weights, any world size, with
    the KL reference's); a one-process checkpoint's ``optimizer.pt`` read by rank 0 alone when sharded
    (memory-mapped, then broadcast tensor by tensor)."""
    import torch

    from echo2.learner.sharded import load_full_optimizer, load_states
    from echo2.models.policy import DCP_DIR

    if (source / DCP_DIR).is_dir():  # a sharded learner's: any world size loads it
        load_states(source / DCP_DIR, model, trainer.optimizer, trainer.reference)
    elif (source / OPTIM_FILE).is_file() and ranks.sharded:
        state = (
            torch.load(source / OPTIM_FILE, weights_only=True, map_location="cpu", mmap=True)
            if ranks.leader
            else None
        )
        load_full_optimizer(model, trainer.optimizer, state)
    elif (source / OPTIM_FILE).is_file():
        state = torch.load(source / OPTIM_FILE, weights_only=True, map_location=device)
        trainer.optimizer.load_state_dict(state)


def _lora(cfg: Config, policy: Policy, source: Path, resumed: bool, sharded: bool) -> None:
    """``[lora]`` on the loaded policy: a fresh adapter on the starting checkpoint (its path and digest
    recorded), or the resumed checkpoint's, which must be the one ``[lora]`` describes; ConfigError for
    a checkpoint of the other kind, or LoRA on a sharded learner (not built)."""
    from echo2.models import lora

    carries = lora.has_adapter(policy.model)
    if not cfg.lora.enabled:
        if carries:
            raise ConfigError(
                f"{source} is a LoRA checkpoint (an adapter): set lora.enabled = true to resume it"
            )
        return
    if sharded:
        raise ConfigError("lora.enabled on a sharded learner is not built: run LoRA on one process")
    if carries:
        lora.check_matches(policy.model, cfg.lora, source)
        lora.train_adapter_only(policy.model, cfg.learner.precision)
    else:
        if resumed:
            raise ConfigError(f"{source} is a checkpoint of full fine-tuning: it cannot resume as LoRA")
        policy.lora_base = {"path": str(source.resolve()), "sha256": lora.base_digest(policy.model)}
        lora.attach(policy.model, cfg.lora, cfg.learner.precision)


def _placement(cfg: Config) -> tuple[Ranks, Any]:
    """This process's ranks (``torchrun``'s environment) and its device: ``learner.device``, and with
    several ranks on CUDA the GPU of this rank's ``LOCAL_RANK``."""
    import torch

    from echo2.learner.sharded import Ranks
    from echo2.models.policy import resolve_device

    device = resolve_device(cfg.learner.device)
    ranks = Ranks.from_env(device.type, cfg.learner.collective_timeout_s)
    if ranks.sharded and device.type == "cuda":
        device = torch.device("cuda", ranks.local_rank)
    return ranks, device


@dataclass
class LearnerCore:
    """The learning plane of one learner process, rank 0 of a sharded one (:meth:`load` builds it).

    Each operation on the model that is a collective over the ranks (an update, an evaluation, a
    publication's copy, a checkpoint's states) is announced to the other ranks first (:class:`Follower`
    does the same); with one rank the announcements are nothing."""

    cfg: Config
    run_dir: RunDir
    plane: Plane
    resumed_from: int | None  # the checkpoint version this process resumed (None: a fresh run)
    first_acc: float = math.nan  # held-out score when this process started
    best_acc: float = math.nan  # best held-out score seen
    last_acc: float = math.nan  # newest held-out score
    # the update and the generation check take turns (check/turns.py: security.check_duty)
    turns: Turns = field(default_factory=Turns)

    @classmethod
    def load(
        cls, cfg: Config, run_path: Path, ckpt: Path | None = None, *, isolate: bool = False
    ) -> LearnerCore:
        """Trackers first (a missing package fails before the warm start), then the run directory (a
        fresh run clears an old run's outputs, a resumed one keeps them), the policy from ``ckpt`` (with
        its version and optimizer state) or the starting checkpoint, the task, the trainer (``isolate``:
        a non-finite group is left out of an update instead of ending it) and the engine. The other
        ranks, if any, load what this one tells them (:meth:`Follower.load`)."""
        from echo2.observe.trackers import start_trackers
        from echo2.tasks.warm_cache import starting_checkpoint

        ranks, device = _placement(cfg)
        if not ranks.leader:  # the other ranks follow (Follower); a command that does not route them is wrong
            raise Echo2Error(f"rank {ranks.rank} of {ranks.world}: only rank 0 runs the learner core")
        sinks = start_trackers(cfg.train.report_to, run_path, run_path.resolve().name, cfg.to_dict())
        run_dir = RunDir(run_path, cfg.to_dict(), resume=ckpt is not None, sinks=sinks, background=True)
        if cfg.model.path is not None and cfg.grpo.lr >= TOY_LR_FLOOR:
            log.warning(
                "grpo.lr = %g is the embedded toy model's learning rate; RL on a pretrained LLM usually "
                "uses 1e-6 to 3e-6 (configs/math_qwen3.toml): set grpo.lr",
                cfg.grpo.lr,
            )
        source = ckpt or starting_checkpoint(cfg)
        ranks.share((str(source), ckpt is not None))  # the other ranks load the same checkpoint
        plane = Plane.load(cfg, ranks, device, source, ckpt is not None, isolate)
        turns = Turns(cfg.security.check_duty)
        return cls(cfg, run_dir, plane, plane.trainer.version if ckpt else None, turns=turns)

    @property
    def policy(self) -> Policy:
        return self.plane.policy

    @property
    def task(self) -> Task:
        return self.plane.task

    @property
    def trainer(self) -> GRPOTrainer:
        return self.plane.trainer

    @property
    def engine(self) -> HFEngine:
        return self.plane.engine

    @property
    def eval_prompts(self) -> list[Any]:
        return self.plane.eval_prompts

    @property
    def ranks(self) -> Ranks:
        return self.plane.ranks

    @property
    def version(self) -> int:
        """The learner's ``v_t`` (the trainer is its one provider)."""
        return self.trainer.version

    def update(self, batch: list[Trajectory]) -> UpdateStats:
        """One GRPO update (``GRPOTrainer.update``; every rank computes its share); a check running
        beside it gives it the cores (:attr:`turns`)."""
        with self.turns.updating():
            return self.plane.lead(Plane.update, batch)

    def evaluate(self) -> EvalResult | None:
        """The task's greedy held-out score of the current weights, in the update's precision and in
        batches of at most ``learner.micro_batch_tokens`` tokens; the running readings follow it (the
        first call sets the starting one). None when ``ranks.halt`` cut it short (a stop, ``loop.py``)."""
        ev = self.plane.lead(Plane.evaluate)
        if self.ranks.halted:
            return None
        if math.isnan(self.first_acc):
            self.first_acc = self.best_acc = ev.accuracy
        self.last_acc, self.best_acc = ev.accuracy, max(self.best_acc, ev.accuracy)
        return ev

    def weights(self, dtype: str) -> dict[str, Any]:
        """A sampler copy of the current weights in ``dtype`` (a publication's), gathered from the ranks."""
        weights = self.plane.lead(Plane.weights, dtype)
        assert weights is not None  # rank 0 holds the gathered copy
        return weights

    def save(self, name: str, optimizer: bool = False, state: dict[str, Any] | None = None) -> str:
        """A crash-consistent checkpoint of the weights at this version (the optimizer's state too when
        asked, and ``state``) under ``checkpoints/<name>``; returns its path. Sharded: the model's and
        the optimizer's states with DCP, every rank its shards (``learner/sharded.py``)."""
        opt = self.trainer.optimizer if optimizer else None
        if not self.ranks.sharded:
            return self.run_dir.save_checkpoint(name, self.policy, self.version, opt, state)

        def write(tmp: Path) -> None:
            from echo2.learner.sharded import write_shell

            self.plane.lead(Plane.save_states, str(tmp))
            write_shell(tmp, self.policy)

        return self.run_dir.save_checkpoint(name, self.policy, self.version, None, state, write=write)

    def close(self) -> None:
        """The other ranks stop following; the process group ends. Best effort: when a rank is gone the
        error that ended the loop is the one to report (torchrun then stops every rank)."""
        try:
            self.ranks.stop()
        except RuntimeError as exc:  # torch.distributed's errors (DistBackendError) are RuntimeErrors
            log.error("could not tell the other learner ranks to stop: %s", exc)
            return
        self.ranks.close()

    def diverged(self, exc: TrainingDivergedError, good: str, **summary: Any) -> TrainingDivergedError:
        """What a diverged update leaves: the summary names the error and the last good weights (saved
        by the caller as ``good``, before the optimizer stepped); the error to raise says where they are."""
        self.run_dir.write_summary({"error": str(exc), "last_good_checkpoint": good, **summary})
        return TrainingDivergedError(f"{exc}; last good weights saved to {good}")


@dataclass
class Follower:
    """A rank other than 0 of a sharded learner: it loads the checkpoint rank 0 names and then does each
    collective operation rank 0 announces (:class:`LearnerCore`), until rank 0 says stop."""

    cfg: Config
    plane: Plane

    @classmethod
    def load(cls, cfg: Config, *, isolate: bool = True) -> Follower:
        ranks, device = _placement(cfg)
        if not ranks.sharded:
            raise Echo2Error("a follower rank runs under torchrun with WORLD_SIZE > 1")
        source, resumed = ranks.share(None)
        return cls(cfg, Plane.load(cfg, ranks, device, Path(source), resumed, isolate))

    def run(self) -> int:
        """Follow rank 0 until it stops; the number of operations done."""
        from echo2.learner.trainer import PoisonedBatch

        plane, done = self.plane, 0
        while (announced := plane.ranks.receive()) is not None:
            name, args = announced
            with contextlib.suppress(PoisonedBatch):  # an update's: rank 0 deals with it (the ranks agreed)
                plane.follow(name, args)
            done += 1
        plane.ranks.close()
        return done
