"""The learner's model sharded over ranks with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each decoder layer and then the whole model are wrapped with ``fully_shard`` on a 1-D device mesh
(``cpu`` with the gloo backend, ``cuda`` with NCCL): every rank holds a shard of the parameters, their
gradients and the AdamW states, and a layer's full parameters exist only while it computes. Gradients
are **summed** over ranks (``set_gradient_divide_factor(1.0)``), because each rank's loss is already its
share of the whole minibatch's (``grpo.Norm`` over the minibatch): so the sharded update equals the
one-process update (``GRPOTrainer`` splits the micro-batches over the ranks and keeps their
collectives in step, ``learner/trainer.py``). Gradient clipping over DTensors takes the global norm.

Publication from shards (:func:`full_weights`): every tensor is gathered (``DTensor.full_tensor``, a
collective all ranks call in the same order) one at a time, cast to the publication dtype and kept on
rank 0 only, so no rank holds two full fp32 copies; tied parameters ship once, under their first name,
as ``weights.delta.sampler_copy`` ships a one-process model's. The bytes are then the one-process
learner's for the same weights.

Sharded checkpoints (:func:`save_states` / :func:`load_states`): the model's and the optimizer's
states written with ``torch.distributed.checkpoint`` (DCP, each rank its own shards, rank 0 the
metadata) into a checkpoint's ``dcp/`` folder beside the config and tokenizer files
(:func:`write_shell`); DCP reshards on load, so such a checkpoint resumes at any world size, one process
without a process group included. The other way, a one-process checkpoint (HF weights +
``optimizer.pt``) resumes sharded: the weights load whole and are sharded, and the optimizer's state,
keyed by parameter position, is re-keyed by name and sharded (:func:`load_full_optimizer`).

The ranks of one learner (:class:`Ranks`): ``torchrun``'s environment names them, rank 0 is the
learner node (API, store, broadcast, checks, run directory) and announces each collective operation on
the model before it does it (an update, an evaluation, a publication's gather, a checkpoint's states);
the other ranks wait for the announcement and do the same (``runtime/core.py``: ``Follower``). Every
collective runs under a stated timeout (``learner.collective_timeout_s``); while rank 0 waits for
workers it announces nothing, so it sends an empty announcement every quarter of that timeout.

Loading (:func:`materialize`, :func:`load_from_rank0`, :func:`sharded_reference`): every rank builds
the model from its config with its parameters on the meta device (``models/snapshot.empty_model``: no
memory, no random init), wraps it with ``fully_shard`` and allocates only its own shard on its device;
rank 0 alone reads the checkpoint, tensor by tensor, and sends each rank the rows of its shard
(``torch.distributed`` point-to-point) in pieces of at most ``LOAD_CHUNK_BYTES`` (4 MiB,
``planner/memory_model.py``), so no rank ever holds more than its shard plus a piece or two in flight (a
safetensors file is opened per piece and read by rows, its mapping closed after each; another format
is memory-mapped whole by rank 0). The KL reference (``grpo.kl_beta > 0``) is built
the same way, sharded from the start, and takes the policy's local shards (in bf16 under
``bf16-mixed``, as ``trainer.frozen_reference`` casts a one-process learner's copy); resumed from a
sharded checkpoint it takes that checkpoint's weights (:func:`load_states`), as a one-process
learner's reference is the weights it loaded. A one-process checkpoint's optimizer state goes the same
way (:func:`load_full_optimizer`: rank 0 reads it, memory-mapped, and broadcasts it tensor by tensor).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from echo2.errors import CheckpointError
from echo2.planner.memory_model import LOAD_CHUNK_BYTES
from echo2.weights.delta import _publish_dtypes

_STOP, _KEEPALIVE = "", "."  # the ranks' own announcements, no operation's name


@dataclass
class Ranks:
    """This process's place among the learner's ranks (one rank: ``world`` = 1, no process group)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    timeout_s: float = 600.0
    last_announced: float = field(default_factory=time.monotonic)
    # a stop asked for while the ranks generate (rank 0's; set from another thread): the generation
    # ends at its next step on every rank (:meth:`all_done`), which then says so in ``halted``
    halt: threading.Event = field(default_factory=threading.Event)
    halted: bool = False

    @classmethod
    def from_env(cls, device_type: str, timeout_s: float) -> Ranks:
        """The ranks ``torchrun`` started (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR`` /
        ``MASTER_PORT``): the process group initialised, gloo on the CPU and NCCL on CUDA, every
        collective bounded by ``timeout_s``; one rank when ``WORLD_SIZE`` is unset or 1."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls(timeout_s=timeout_s)
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device_type == "cuda":
            torch.cuda.set_device(local)
        if not dist.is_initialized():
            backend = "nccl" if device_type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        return cls(dist.get_rank(), dist.get_world_size(), local, timeout_s)

    @property
    def sharded(self) -> bool:
        return self.world > 1

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def mesh(self, device_type: str) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.world,))

    @classmethod
    def of(cls, model: torch.nn.Module) -> Ranks:
        """The ranks ``model`` is sharded over: the initialised process group's when it is wrapped with
        FSDP2 in one, else one rank (a trainer given no ranks takes these)."""
        if not (dist.is_available() and dist.is_initialized() and is_sharded(model)):
            return cls()
        return cls(dist.get_rank(), dist.get_world_size())

    # ---- the collectives the ranks do together: each the identity at one rank -------------------------
    def sum(self, value: float) -> float:
        """``value`` summed over the ranks (in float64)."""
        if not self.sharded:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self._device())
        dist.all_reduce(t)
        return float(t.item())

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks, in place; returned."""
        if self.sharded:
            dist.all_reduce(tensor)
        return tensor

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank."""
        if not self.sharded:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def all_done(self, done_B: torch.Tensor) -> bool:
        """Every row of every rank has ended, or a rank was told to :attr:`halt` (then :attr:`halted`
        is set on every rank: the rows are cut short). A sharded generation's stop: each forward is a
        collective, so every rank takes the same number of steps."""
        ended, halt = bool(done_B.all()), self.halt.is_set()
        if self.sharded:
            flags = torch.tensor([not ended, halt], dtype=torch.int32, device=done_B.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            ended, halt = not flags[0].item(), bool(flags[1].item())
        self.halted |= halt and not ended
        return ended or halt

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (any picklable object), in rank order, on every rank."""
        if not self.sharded:
            return [value]
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, value)
        return everyone

    def share_of(self, items: list[Any], pad: Any) -> list[Any]:
        """This rank's share of ``items``: every ``world``-th from its own, padded with ``pad`` so that
        every rank has as many (their collectives must pair up)."""
        if not self.sharded:
            return items
        mine = items[self.rank :: self.world]
        return mine + [pad] * (math.ceil(len(items) / self.world) - len(mine))

    def _device(self) -> torch.device:
        """Where this rank's collectives' tensors live: its GPU under NCCL, else the CPU."""
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (what the others pass is ignored)."""
        if not self.sharded:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def announce(self, op: str, *args: Any) -> None:
        """Rank 0: the collective operation it is about to do (the other ranks do it too)."""
        if self.sharded:
            self.share((op, args))
            self.last_announced = time.monotonic()

    def receive(self) -> tuple[str, tuple[Any, ...]] | None:
        """A rank other than 0: the next operation rank 0 announced (its name and arguments), past any
        keepalive; None when rank 0 said stop."""
        while True:
            op, args = self.share(None)
            if op == _STOP:
                return None
            if op != _KEEPALIVE:
                return str(op), tuple(args)

    def keepalive(self) -> None:
        """Rank 0 while it waits: an empty announcement every quarter of the collective timeout, so the
        other ranks, waiting for the next one, do not time out while workers generate."""
        if self.sharded and time.monotonic() - self.last_announced > self.timeout_s / 4:
            self.announce(_KEEPALIVE)

    def stop(self) -> None:
        """Rank 0: the other ranks stop following (their :meth:`receive` gives None)."""
        self.announce(_STOP)

    def close(self) -> None:
        """The process group ends on every rank together (a rank tearing its connections down while
        another still talks to it can abort the other's process)."""
        if self.sharded and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def leave(code: int) -> NoReturn:
    """A rank whose work is done and whose process group is closed ends here, without the interpreter's
    teardown: there one of torch's C++ threads now and then aborts the process ("terminate called without
    an active exception", SIGABRT), and torchrun then reads a rank that finished as failed and reports
    the run so. Logs and standard streams are flushed first; ``code`` is the exit status."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def shard(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """``model`` (an HF causal LM) wrapped in place with FSDP2 on ``mesh``: each decoder layer, then the
    root; gradients summed over ranks. Returns the model."""
    from torch.distributed.fsdp import fully_shard

    hf: Any = model  # a transformers model: its decoder and config are its own attributes
    decoder = hf.get_decoder() if hasattr(hf, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers to shard (model.get_decoder().layers)")
    if not getattr(hf.config, "architectures", None):  # sharding renames the class (FSDP<name>)
        hf.config.architectures = [type(model).__name__]
    for module in [*layers, model]:
        fsdp = fully_shard(module, mesh=mesh)
        fsdp.set_gradient_divide_factor(1.0)  # a sum: each rank's loss is its share of the whole
        fsdp.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    return model


def settle(model: torch.nn.Module) -> None:
    """Every parameter of a sharded model back in its sharded form (the root keeps what its forward
    gathered until a backward; a forward without one, an evaluation, leaves it gathered): what the
    optimizer and the state-dict functions expect. Nothing for a model that is not sharded."""
    reshard = getattr(model, "reshard", None)
    if callable(reshard) and is_sharded(model):
        reshard()


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def full_weights(model: torch.nn.Module, dtype: str = "bfloat16") -> dict[str, torch.Tensor] | None:
    """The weights of a sharded model as ``sampler_copy`` makes them (each storage once, detached, on
    the CPU, floating tensors in ``dtype``), gathered tensor by tensor; on rank 0, None elsewhere. Every
    rank must call it (the gathers are collectives)."""
    from torch.distributed.tensor import DTensor

    settle(model)
    target = _publish_dtypes()[dtype]
    rank0 = dist.get_rank() == 0
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if id(t) in seen:  # a tied parameter: shipped under its first name
                continue
            seen.add(id(t))
            full = t.full_tensor() if isinstance(t, DTensor) else t
            if rank0:
                cast = target if full.is_floating_point() else full.dtype
                out[name] = full.detach().to(device="cpu", dtype=cast, copy=True).contiguous()
            del full
    return out if rank0 else None


def _unsharded() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def save_states(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The model's and the optimizer's states into ``path`` with DCP; every rank calls it (each writes
    its own shards; rank 0 writes the metadata last, after every rank's files)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    settle(model)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path), no_dist=_unsharded())


def load_states(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    reference: torch.nn.Module | None = None,
) -> None:
    """The states :func:`save_states` wrote at any world size, into ``model`` and ``optimizer`` as this
    process holds them (sharded over this world, or whole), and the model's weights into ``reference``
    (a frozen KL reference, in its own dtype) when given; every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    settle(model)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # the optimizer's state initialised (zeros)
    state = _read(path, {"model": model_sd, "optim": optim_sd})
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if reference is not None:
        load_model_states(path, reference)


def load_model_states(path: Path, model: torch.nn.Module) -> None:
    """Only the model's weights of a checkpoint :func:`save_states` wrote, into ``model`` in its own
    dtype (a KL reference; a model to export as a plain HF checkpoint); every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    settle(model)
    set_model_state_dict(model, _read(path, {"model": get_model_state_dict(model)})["model"])


def _read(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (state dicts shaped as this process holds them) filled in place from the DCP checkpoint
    at ``path``; CheckpointError naming the checkpoint when it is none or does not fit."""
    import torch.distributed.checkpoint as dcp

    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path} is not a sharded checkpoint: its DCP .metadata is missing")
    try:
        dcp.load(state, checkpoint_id=str(path), no_dist=_unsharded())
    except Exception as exc:  # DCP raises its own types (CheckpointException); name the checkpoint
        raise CheckpointError(f"cannot load the sharded checkpoint {path}: {exc}") from exc
    return state


def write_shell(path: Path, policy: Any) -> None:
    """A sharded checkpoint's files besides ``dcp/`` (rank 0): the model's config and generation config
    and the tokenizer, so that the model is rebuilt from them before its states are loaded."""
    path.mkdir(parents=True, exist_ok=True)
    policy.model.config.save_pretrained(path)
    generation = getattr(policy.model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(path)
    policy.tokenizer.save_pretrained(path)


def load_full_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, full: dict[str, Any] | None
) -> None:
    """A one-process optimizer's ``state_dict()`` (``optimizer.pt``: states keyed by the position of
    each trainable parameter in ``model.parameters()``) into ``optimizer`` over ``model`` as this
    process holds it, sharded or whole: re-keyed by parameter name, then loaded as a full state dict
    (each rank keeps its shard). ``full`` None: a rank other than 0 of a process group, which receives
    rank 0's tensor by tensor (``broadcast_from_rank0``). Every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    group = not _unsharded()
    problem = None
    if full is not None:
        groups = full.get("param_groups", [])
        if sum(len(g["params"]) for g in groups) != len(names):
            problem = (
                f"optimizer state for {sum(len(g['params']) for g in groups)} parameters, "
                f"the model trains {len(names)}: not this model's optimizer"
            )
    problem = _agreed(problem) if group else problem
    if problem is not None:
        raise CheckpointError(problem)
    by_name: dict[str, Any] = {}
    if full is not None:
        state = {names[i]: v for i, v in full.get("state", {}).items()}
        groups = [{**g, "params": [names[i] for i in g["params"]]} for g in full.get("param_groups", [])]
        by_name = {"state": state, "param_groups": groups}
    set_optimizer_state_dict(
        model,
        optimizer,
        by_name,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=group),
    )


def _agreed(problem: str | None) -> str | None:
    """Rank 0's verdict on what it read, on every rank (so that all raise, or none)."""
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---- loading: the model built on the meta device, each rank its shard, rank 0 reading ---------------
def materialize(model: torch.nn.Module, mesh: Any, device: torch.device) -> torch.nn.Module:
    """``model`` (its parameters on the meta device, its buffers real: ``models/snapshot.empty_model``)
    sharded over ``mesh`` (:func:`shard`) with only this rank's shard allocated, uninitialised, on
    ``device``; the buffers as they were built. The weights come next (:func:`load_from_rank0`, or a
    sharded checkpoint's :func:`load_states`)."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    shard(model, mesh)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    return model


def load_from_rank0(model: torch.nn.Module, source: Path | None) -> None:
    """The weights of the HF checkpoint at ``source`` into ``model`` as this rank holds it (sharded by
    :func:`materialize`): rank 0 reads each tensor's rows rank by rank and sends them (its own it copies),
    the others receive their rows into their shards; ``source`` is read on rank 0 only (None elsewhere).
    Every rank calls it. CheckpointError on every rank, before any weight moves, when the checkpoint
    lacks a weight of the model or has it in another shape."""
    from torch.distributed.tensor import DTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    targets = _targets(model)
    rows = [t.to_local().shape[0] if isinstance(t, DTensor) else None for _, t in targets]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, rows)  # how many rows of each tensor each rank holds
    reader = _CheckpointReader(source) if rank == 0 and source is not None else None
    problem, dtypes = None, None
    if rank == 0:
        try:
            if reader is None:
                raise CheckpointError("rank 0 was given no checkpoint to read")
            dtypes = reader.plan(targets)
        except CheckpointError as exc:
            problem = str(exc)
    problem = _agreed(problem)
    if problem is not None:
        raise CheckpointError(problem)
    box: list[Any] = [dtypes]
    dist.broadcast_object_list(box, src=0)
    for i, (names, t) in enumerate(targets):
        spans = [everyone[r][i] for r in range(world)] if rows[i] is not None else None
        _move(reader, names, t, spans, box[0][i])


def _targets(model: torch.nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """The tensors a checkpoint fills (the model's state dict, each tensor once with every name it has:
    tied ones share one), in state-dict order, which every rank shares."""
    named: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        named.setdefault(id(t), ([], t))[0].append(name)
    return list(named.values())


@torch.no_grad()
def _move(
    reader: _CheckpointReader | None,
    names: list[str],
    t: torch.Tensor,
    spans: list[int] | None,
    dtype: torch.dtype,
) -> None:
    """One tensor ``t`` from rank 0 (``reader``) into each rank's local part of it: rows ``spans[r]`` for
    rank ``r`` of a tensor sharded on its first dimension (in rank order), in pieces of rows of at most
    ``LOAD_CHUNK_BYTES`` in the stored ``dtype``; or the whole (``spans`` None: a buffer) to every rank."""
    from torch.distributed.tensor import DTensor

    rank = dist.get_rank()
    local = t.to_local() if isinstance(t, DTensor) else t
    if spans is None:
        for r in range(dist.get_world_size()):
            if rank in (0, r):
                _piece(reader, names, local, r, dtype, None, None)
        return
    step = max(1, LOAD_CHUNK_BYTES // (max(1, math.prod(t.shape[1:])) * dtype.itemsize))
    start = 0
    for r, n in enumerate(spans):
        if rank in (0, r):
            for lo in range(0, n, step):
                hi = min(n, lo + step)
                into = local[lo:hi] if rank == r else local[:0]  # rank 0 sending: the device alone
                _piece(reader, names, into, r, dtype, start + lo, start + hi)
        start += n


def _piece(
    reader: _CheckpointReader | None,
    names: list[str],
    into: torch.Tensor,
    r: int,
    dtype: torch.dtype,
    lo: int | None,
    hi: int | None,
) -> None:
    """Rows ``lo:hi`` of a tensor (all of it when ``lo`` is None) from rank 0 to rank ``r``: rank 0 reads
    them and copies them into ``into`` (``r`` = 0) or sends them; rank ``r`` receives them into ``into``."""
    if dist.get_rank() == 0:
        assert reader is not None
        piece = reader.rows(names, lo, hi)
        if r == 0:
            into.copy_(piece)
        else:
            dist.send(piece.to(into.device), dst=r)
    else:
        buf = torch.empty(into.shape, dtype=dtype, device=into.device)
        dist.recv(buf, src=0)
        into.copy_(buf)


class _CheckpointReader:
    """Rank 0's reading of an HF checkpoint's weights by name and rows: safetensors files (one, or an
    index of several) opened per tensor and read by slice, so that at most one slice is in memory;
    any other format (``pytorch_model.bin``) memory-mapped whole by ``torch.load``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        index = path / "model.safetensors.index.json"
        single = path / "model.safetensors"
        self.files: dict[str, Path] = {}
        self.whole: dict[str, torch.Tensor] | None = None
        if index.is_file():
            import json

            weight_map = json.loads(index.read_text()).get("weight_map", {})
            self.files = {name: path / file for name, file in weight_map.items()}
        elif single.is_file():
            self.files = {name: single for name in self._keys(single)}
        else:
            self.whole = self._torch_files(path)

    @staticmethod
    def _keys(file: Path) -> list[str]:
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())

    @staticmethod
    def _torch_files(path: Path) -> dict[str, torch.Tensor]:
        files = sorted(path.glob("pytorch_model*.bin"))
        if not files:
            raise CheckpointError(f"{path}: no model.safetensors, safetensors index or pytorch_model.bin")
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
        return out

    def _name(self, names: list[str]) -> str:
        have = self.whole if self.whole is not None else self.files
        return next((n for n in names if n in have), names[0])

    def plan(self, targets: list[tuple[list[str], torch.Tensor]]) -> list[torch.dtype]:
        """The stored dtype of each target (what rank 0 sends), after checking that every one is in the
        checkpoint with the target's whole shape (CheckpointError naming the first that is not)."""
        from safetensors import safe_open

        dtypes = []
        for names, t in targets:
            name = self._name(names)
            if self.whole is not None:
                if name not in self.whole:
                    raise CheckpointError(f"{self.path}: the checkpoint lacks the weight {name}")
                stored, shape = self.whole[name].dtype, tuple(self.whole[name].shape)
            else:
                if name not in self.files:
                    raise CheckpointError(f"{self.path}: the checkpoint lacks the weight {name}")
                with safe_open(str(self.files[name]), framework="pt") as f:
                    sl = f.get_slice(name)
                    shape = tuple(sl.get_shape())
                    stored = _SAFETENSORS_DTYPES.get(sl.get_dtype(), t.dtype)
            if shape != tuple(t.shape):
                raise CheckpointError(
                    f"{self.path}: weight {name} has shape {shape}, the model's {tuple(t.shape)}"
                )
            dtypes.append(stored)
        return dtypes

    def rows(self, names: list[str], lo: int | None, hi: int | None) -> torch.Tensor:
        """Rows ``lo:hi`` of the weight (the whole of it when ``lo`` is None), a fresh CPU tensor."""
        from safetensors import safe_open

        name = self._name(names)
        if self.whole is not None:
            t = self.whole[name]
            return (t if lo is None else t[lo:hi]).clone()
        with safe_open(str(self.files[name]), framework="pt") as f:  # unmapped when closed
            sl = f.get_slice(name)
            return sl[:] if lo is None else sl[lo:hi]


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def sharded_reference(
    model: torch.nn.Module, empty: torch.nn.Module, mixed: bool, mesh: Any
) -> torch.nn.Module:
    """The KL reference of a sharded ``model``, sharded from the start: ``empty`` (the same architecture
    on the meta device, ``models/snapshot.empty_model``) frozen, cast to bf16 when ``mixed`` (as
    ``trainer.frozen_reference`` casts a one-process copy), sharded over ``mesh`` and given ``model``'s
    local shards; no rank holds more of it than its shard."""
    from torch.distributed.tensor import DTensor

    device = next(model.parameters()).device
    reference = empty.eval()
    if mixed:
        reference.to(torch.bfloat16)
    reference.requires_grad_(False)
    materialize(reference, mesh, device)
    with torch.no_grad():
        mine = dict(model.state_dict(keep_vars=True))
        for name, t in reference.state_dict(keep_vars=True).items():
            src = mine[name]
            dst_local = t.to_local() if isinstance(t, DTensor) else t
            dst_local.copy_(src.to_local() if isinstance(src, DTensor) else src)
    return reference
