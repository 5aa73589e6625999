"""The learner's memory model (pure; SPEC §9): bytes per parameter by part, activation bytes per
micro-batch token, and whether a device holds a model.

Parts, in bytes per parameter ``P`` (all trainable, AdamW, fp32 master weights in both precisions):

==================  =========================  ===========================================================
part                bytes / param              held
==================  =========================  ===========================================================
weights             4                          always (fp32 masters; ``bf16-mixed`` computes in bf16 under
                                               autocast, it stores nothing in bf16)
gradients           4                          during an update (set to None after its last step)
optimizer           8                          always (AdamW ``exp_avg`` + ``exp_avg_sq``, fp32)
reference           4 (fp32) / 2 (bf16-mixed)  when ``grpo.kl_beta > 0`` (the frozen KL reference)
sampler copies      b x n_copies               always: the newest publication (the next patch's base and
                                               the check's newest version), and with ``snapshot.on_disk``
                                               off the latest anchor's encoded bytes; ``b`` = 2 for bf16
older versions      u x n_older                when checks are on: an undo per older admissible version
                                               (``ceil((S + 1) / kappa) - 1`` of them) of the share ``f`` of
                                               elements a publication changes, ``u = b f + min(4 f, 1/8)``
                                               (values, and int32 positions or a bit mask), at most ``b``
check model         0 on the CPU, b on a GPU   when checks are on: its weights are the newest copy itself
                                               (on the CPU) or one copy of it on the device
check transient     b                          while an older version is checked (rebuilt, then dropped)
publication         b (+ b at an anchor)       while a publication is copied and encoded
autocast copies     2 D / P (bf16-mixed)       during a micro-batch's forward and backward: the bf16 casts
                                               of the decoder's ``D`` weights autograd keeps for the
                                               backward, and the LM head's one chunk at a time; with
                                               activation checkpointing one layer's (or the head's) at a
                                               time. The update casts without autocast's weight cache
                                               (``learner/trainer.py``), which would keep every cast until
                                               the forward ends (2 bytes / param more under checkpointing)
==================  =========================  ===========================================================

**With LoRA** (``[lora]``, ``lora_rank`` r on the attention and MLP projections; ``a`` = adapter
parameters / ``P``, ``t`` = the targeted matrices' parameters / ``P``; still per *base* parameter):
weights ``w + 4a`` (the frozen base in the learner's precision, ``w`` = 2 under ``bf16-mixed`` and 4
under fp32, plus the fp32 adapter), gradients ``4a``, optimizer ``8a``, no reference (the base with the
adapter off is the reference), sampler copies ``b a n_copies`` plus the base's copy in the snapshot
dtype (none when it is the frozen bf16 base itself: ``bf16-mixed`` with bf16 publications), older
versions ``u a`` each, the check model ``m t`` (the newest version's targeted matrices expanded, base +
adapter, ``models/lora.PublishedBase.expand``, in float32 (``m`` = 4) with ``lora.vllm = "native"``,
the default, else in the snapshot dtype, ``m = b``) on the CPU as on a GPU, check transient and
publication ``b a`` and ``2 b a``. Measured (``benchmarks/lora.py --study memory``, the trainer
alone, 235M, r = 16, ``a`` = 2.1%): 2.48 bytes / base parameter against ``2 + 16 a`` = 2.34.

The autocast copies are transient (freed before the optimizer steps: not in ``update_peak``, read at
the step) but on the device at the peak of each micro-batch (``device``); a LoRA learner's frozen base is
bf16 already (nothing cast: 0).

**Loading a sharded learner** (``learner/sharded.py``: the model built on the meta device, rank 0
reading the checkpoint and sending each rank its rows, ``LOAD_CHUNK_BYTES`` at a time): a rank holds
its shard of the weights (and of the KL reference) and a piece or two in flight (:func:`load_peak_bytes`); a
sharded update adds, besides the shard, FSDP2's gathered fp32 weights of the root (embeddings, LM head,
final norm: kept from the forward to the backward) and of two decoder layers (the one computing and
the one prefetched), :func:`fits`.

So the floor with AdamW is ``4 + 4 + 8 = 16`` (SPEC §9), and with the defaults (bf16 publications,
S = 3, kappa = 2, checks on, published bytes on disk) the held copy adds 2 and the undo of the one
older admissible version ``u`` (0.225 at ``f`` = 5%): about 18.2 bytes / param at an update's peak. The
published anchor and patches live in files of the run directory (the page cache serves them). On a
GPU learner the parts split: weights, gradients, optimizer, reference, the check model and
activations on the device; sampler copies, undos and publications in host memory.

**Activations** of one micro-batch, per token (``H`` hidden, ``I`` MLP width, ``n_q`` / ``n_kv``
heads of ``d`` dims, ``Lyr`` layers, ``a`` bytes per activation: 4 in fp32, 2 under bf16 autocast),
counting the tensors autograd keeps for the backward pass of one Qwen3 decoder layer: the residual
input and its RMSNorm (2H), q / k / v and their norms (2 (n_q + 2 n_kv) d), rotary q / k
((n_q + n_kv) d), the attention output (n_q d), o_proj's input and the residual (2H), the second
RMSNorm (2H), gate / up / the activation / their product (4I), all in ``a`` bytes, plus fp32 norm
statistics (negligible)::

    act_per_token = Lyr * a * (6H + (4 n_q + 5 n_kv) d + 4I)

With activation checkpointing a layer keeps only its input (``Lyr * a * H``) and recomputes the rest
during its own backward (one layer's worth at a time). The LM head adds, per micro-batch, the hidden
states of its completion positions and one chunk of logits: ``chunk * V * 4 * 3`` bytes (the logits,
their float32 log-sum-exp and its gradient), independent of ``B`` and ``L``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Precision = Literal["fp32", "bf16-mixed"]
GIB = 1 << 30


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs of an architecture (a Qwen3-style decoder)."""

    params: int  # every parameter (each tied one once)
    hidden: int  # H
    intermediate: int  # I, the MLP width
    layers: int
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def qwen3(
        cls,
        hidden: int,
        intermediate: int,
        layers: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        vocab: int,
        tied: bool,
    ) -> ModelShape:
        """A Qwen3 decoder's shape with its parameter count: embeddings (and an untied LM head), per
        layer q / k / v / o, q- and k-norms, the gated MLP and two RMSNorms, and the final norm."""
        per_layer = _layer_params(hidden, intermediate, heads, kv_heads, head_dim)
        params = vocab * hidden * (1 if tied else 2) + layers * per_layer + hidden
        return cls(params, hidden, intermediate, layers, heads, kv_heads, head_dim, vocab)

    def layer_params(self) -> int:
        """Parameters of one decoder layer."""
        return _layer_params(self.hidden, self.intermediate, self.heads, self.kv_heads, self.head_dim)

    def root_params(self) -> int:
        """Parameters outside the decoder layers: the embeddings (and an untied LM head), the final norm."""
        return self.params - self.layers * self.layer_params()

    def largest_tensor(self) -> int:
        """Elements of the largest single weight: the embedding matrix (``V x H``) at any Qwen3 shape."""
        h = self.hidden
        return max(self.vocab * h, self.intermediate * h, self.heads * self.head_dim * h)

    def lora_params(self, rank: int) -> int:
        """Parameters of a rank-``rank`` LoRA adapter on every attention and MLP projection (q, k, v, o,
        gate, up, down: ``rank x (in + out)`` each, the default ``lora.target_modules``)."""
        h, q, kv, i = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate,
        )
        per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
        return rank * per_layer * self.layers

    def targeted_params(self) -> int:
        """Parameters of the matrices a default LoRA adapter targets (q, k, v, o, gate, up, down)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.layers * self.hidden * (2 * q + 2 * kv + 3 * self.intermediate)

    def activation_elements_per_token(self, checkpointing: bool = False) -> int:
        """Elements autograd keeps per token of a micro-batch (module docstring)."""
        if checkpointing:
            return self.layers * self.hidden
        d = self.head_dim
        per_layer = 6 * self.hidden + (4 * self.heads + 5 * self.kv_heads) * d + 4 * self.intermediate
        return self.layers * per_layer


def _layer_params(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """One Qwen3 decoder layer: q / k / v / o, q- and k-norms, the gated MLP, two RMSNorms."""
    d = head_dim
    return hidden * heads * d * 2 + hidden * kv_heads * d * 2 + 2 * d + 3 * hidden * intermediate + 2 * hidden


# Qwen3 shapes (the released configs), for `echo2 plan --model-size` and the docs' tables
QWEN3_SHAPES: dict[str, ModelShape] = {
    "0.6B": ModelShape.qwen3(1024, 3072, 28, 16, 8, 128, 151_936, tied=True),
    "1.7B": ModelShape.qwen3(2048, 6144, 28, 16, 8, 128, 151_936, tied=True),
    "4B": ModelShape.qwen3(2560, 9728, 36, 32, 8, 128, 151_936, tied=True),
    "8B": ModelShape.qwen3(4096, 12288, 36, 32, 8, 128, 151_936, tied=False),
}


@dataclass(frozen=True)
class LearnerMemory:
    """Bytes per parameter of each part (module docstring) and activation bytes per token."""

    weights: float
    gradients: float
    optimizer: float
    reference: float
    sampler_copies: float  # host memory on a GPU learner
    older_versions: float  # the check's undos of older admissible versions (host memory)
    check_model: float  # on the learner's device
    check_transient: float  # an older version rebuilt for its check (host memory)
    publication: float  # transient, host memory
    activation_per_token: float  # bytes per micro-batch token
    sampler_copy_count: int  # how many whole copies ``sampler_copies`` is
    autocast_copies: float = 0.0  # bf16 casts of the weights during a micro-batch (device; transient)

    @property
    def training(self) -> float:
        """Weights, gradients and optimizer states: 16 with AdamW."""
        return self.weights + self.gradients + self.optimizer

    @property
    def update_peak(self) -> float:
        """Everything held at an update's peak, activations and publication transients excluded."""
        return self.training + self.reference + self.sampler_copies + self.older_versions + self.check_model

    @property
    def device(self) -> float:
        """What a GPU learner's device holds per parameter at a micro-batch's peak (activations excluded,
        the autocast copies included)."""
        return self.training + self.reference + self.check_model + self.autocast_copies

    @property
    def host(self) -> float:
        """What a GPU learner's host memory holds per parameter at most (copies, undos, a check's
        rebuilt version and a publication)."""
        return self.sampler_copies + self.older_versions + self.check_transient + self.publication

    def device_bytes(self, params: int, micro_batch_tokens: int, logits_bytes: float = 0.0) -> float:
        """A GPU learner's device bytes at an update's peak: the per-parameter parts plus one micro-batch's
        activations and the LM head's chunk."""
        return self.device * params + self.activation_per_token * micro_batch_tokens + logits_bytes

    def table(self) -> dict[str, float]:
        return {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "reference": self.reference,
            "sampler_copies": self.sampler_copies,
            "older_versions": self.older_versions,
            "check_model": self.check_model,
            "check_transient": self.check_transient,
            "publication_transient": self.publication,
            "autocast_copies": self.autocast_copies,
            "update_peak": self.update_peak,
            "device": self.device,
            "host": self.host,
        }


LOAD_CHUNK_BYTES = 4 << 20  # the most bytes of a tensor a sharded learner's rank 0 reads and sends at once
CHANGED_FRACTION = 0.05  # share of bf16 elements one publication changes (LLM-RL learning rates: 1-5%)


def held_sampler_copies(on_disk: bool = True) -> int:
    """Whole sampler copies the learner holds: the newest publication (the next patch's base, the check's
    newest version), and the latest anchor's encoded bytes unless published bytes live on disk."""
    return 1 if on_disk else 2


def older_versions(staleness: int, kappa: int, checks: bool) -> int:
    """Older published versions still admissible, whose undos the check keeps: versions within ``S`` of
    the newest, published every ``kappa``: ``ceil((S + 1) / kappa)`` of them, less the newest."""
    return max(0, math.ceil((staleness + 1) / kappa) - 1) if checks else 0


def learner_memory(
    shape: ModelShape,
    precision: Precision = "fp32",
    *,
    staleness: int = 3,
    kappa: int = 2,
    checks: bool = True,
    kl_reference: bool = False,
    publish_bytes: int = 2,
    gpu: bool = False,
    checkpointing: bool = False,
    on_disk: bool = True,
    changed_fraction: float = CHANGED_FRACTION,
    lora_rank: int | None = None,
    lora_merged_bytes: int = 4,
) -> LearnerMemory:
    """The learner's memory by part for a model of ``shape`` (module docstring); ``lora_rank``: a LoRA
    learner's, per base parameter; ``lora_merged_bytes``: of an element of the check's merged matrices."""
    copies = held_sampler_copies(on_disk)
    n_older = older_versions(staleness, kappa, checks)
    f = changed_fraction
    undo = min(float(publish_bytes), publish_bytes * f + min(4 * f, 1 / 8))  # never above a copy
    act_bytes = 4 if precision == "fp32" else 2
    act = float(act_bytes * shape.activation_elements_per_token(checkpointing))
    casts = autocast_copies(shape, precision, checkpointing)
    if lora_rank is not None:
        a = shape.lora_params(lora_rank) / shape.params
        b = float(publish_bytes)
        base = 4.0 if precision == "fp32" else 2.0
        base_copy = 0.0 if (precision == "bf16-mixed" and publish_bytes == 2) else b
        return LearnerMemory(
            weights=base + 4 * a,
            gradients=4 * a,
            optimizer=8 * a,
            reference=0.0,
            sampler_copies=b * a * copies + base_copy,
            older_versions=undo * a * n_older,
            check_model=lora_merged_bytes * shape.targeted_params() / shape.params if checks else 0.0,
            check_transient=b * a if n_older else 0.0,
            publication=2 * b * a,
            activation_per_token=act,
            sampler_copy_count=copies,
        )
    return LearnerMemory(
        weights=4.0,
        gradients=4.0,
        optimizer=8.0,
        reference=(4.0 if precision == "fp32" else 2.0) if kl_reference else 0.0,
        sampler_copies=float(publish_bytes * copies),
        older_versions=undo * n_older,
        check_model=float(publish_bytes) if (checks and gpu) else 0.0,
        check_transient=float(publish_bytes) if n_older else 0.0,
        publication=float(2 * publish_bytes),
        activation_per_token=act,
        sampler_copy_count=copies,
        autocast_copies=casts,
    )


def autocast_copies(shape: ModelShape, precision: Precision, checkpointing: bool = False) -> float:
    """Bytes per parameter of the bf16 casts a ``bf16-mixed`` update holds at a micro-batch's peak (module
    docstring): every decoder weight's (autograd keeps each for the backward) plus the LM head's, or
    with activation checkpointing the larger of one layer's and the head's; 0 in fp32."""
    if precision == "fp32":
        return 0.0
    head = shape.vocab * shape.hidden
    if checkpointing:
        return 2.0 * max(shape.layer_params(), head) / shape.params
    return 2.0 * (shape.layers * shape.layer_params() + head) / shape.params


def load_peak_bytes(
    shape: ModelShape, world_size: int = 1, *, kl_reference: bool = False, precision: Precision = "bf16-mixed"
) -> float:
    """Device bytes one rank of a sharded learner holds while it loads (``learner/sharded.py``): its shard
    of the fp32 weights (and of the KL reference, bf16 under ``bf16-mixed``) and at most two pieces of
    ``LOAD_CHUNK_BYTES`` in flight (rank 0's read piece and its copy on the device, or a receiver's
    buffer). At ``world_size`` 1: the whole model (one process loads it whole)."""
    ref = (4.0 if precision == "fp32" else 2.0) if kl_reference else 0.0
    return (4.0 + ref) * shape.params / world_size + 2.0 * LOAD_CHUNK_BYTES


def logits_chunk_bytes(vocab: int, chunk: int) -> float:
    """Peak bytes of the LM head's chunk: logits, their float32 log-sum-exp and gradient (3 x 4 bytes)."""
    return float(chunk * vocab * 12)


def fits(
    shape: ModelShape,
    device_gib: float,
    precision: Precision = "bf16-mixed",
    *,
    micro_batch_tokens: int = 8192,
    logprob_chunk: int = 4096,
    world_size: int = 1,
    **kw: object,
) -> dict[str, float | bool]:
    """Whether one device of ``device_gib`` GiB holds the learner: with ``world_size`` ranks, its largest
    one (``learner/sharded.py``): weights, gradients, AdamW states and the KL reference divided over the
    ranks as FSDP2 divides them, the check model whole (rank 0 keeps it); on top, what one micro-batch
    holds at its peak on every rank (its activations, the LM head's chunk, the autocast copies, and with
    several ranks the gathered fp32 root and two decoder layers); and no more than that while loading
    (:func:`load_peak_bytes`): the larger of the two is what the device must hold."""
    mem = learner_memory(shape, precision, gpu=True, **kw)  # type: ignore[arg-type]
    divided = mem.training + mem.reference
    held = (divided / world_size + mem.check_model) * shape.params
    gathered = 4.0 * (shape.root_params() + 2 * shape.layer_params()) if world_size > 1 else 0.0
    act = (
        mem.activation_per_token * micro_batch_tokens
        + logits_chunk_bytes(shape.vocab, logprob_chunk)
        + mem.autocast_copies * shape.params
        + gathered
    )
    need = held + act
    load = load_peak_bytes(
        shape, world_size, kl_reference=mem.reference > 0 and not kw.get("lora_rank"), precision=precision
    )
    return {
        "bytes_per_param": held / shape.params,
        "params_gib": held / GIB,
        "activations_gib": act / GIB,
        "autocast_gib": mem.autocast_copies * shape.params / GIB,
        "load_gib": load / GIB,
        "need_gib": max(need, load) / GIB,
        "device_gib": device_gib,
        "fits": max(need, load) <= device_gib * GIB,
    }


def markdown_table(gpus_gib: tuple[float, ...] = (24, 48, 80, 141), micro_batch_tokens: int = 8192) -> str:
    """The docs' table: device GiB a one-GPU bf16-mixed learner needs per Qwen3 size (weights, gradients,
    AdamW, the check's bf16 model, one micro-batch without and with activation checkpointing), and which
    GPU sizes hold it. ``python -m echo2.planner.memory_model`` prints it."""
    rows = [
        "| Qwen3 | params | weights + grads + AdamW + check model "
        "| + bf16 casts and activations (ckpt off / on) | "
        + " | ".join(f"{g:g} GiB" for g in gpus_gib)
        + " |",
        "|---|---|---|---|" + "---|" * len(gpus_gib),
    ]
    for name, shape in QWEN3_SHAPES.items():
        off = fits(shape, 1.0, micro_batch_tokens=micro_batch_tokens)
        on = fits(shape, 1.0, micro_batch_tokens=micro_batch_tokens, checkpointing=True)
        verdicts = []
        for g in gpus_gib:
            need_off, need_on = off["need_gib"], on["need_gib"]
            verdicts.append("yes" if need_off <= g else "with ckpt" if need_on <= g else "no")
        rows.append(
            f"| {name} | {shape.params / 1e9:.2f} B | {off['params_gib']:.1f} GiB | "
            f"{off['need_gib']:.1f} / {on['need_gib']:.1f} GiB | " + " | ".join(verdicts) + " |"
        )
    return "\n".join(rows)


def sharded_table(
    ks: tuple[int, ...] = (1, 2, 4, 8),
    sizes: tuple[str, ...] = ("1.7B", "4B", "8B"),
    micro_batch_tokens: int = 8192,
) -> str:
    """The docs' table of a sharded bf16-mixed learner: GiB on its largest rank (weights + gradients +
    AdamW divided over K, the check model whole) and with one micro-batch's activations under
    activation checkpointing. ``python -m echo2.planner.memory_model --sharded`` prints it."""
    rows = [
        "| Qwen3 | " + " | ".join(f"K = {k}" for k in ks) + " |",
        "|---|" + "---|" * len(ks),
    ]
    for name in sizes:
        cells = []
        for k in ks:
            f = fits(
                QWEN3_SHAPES[name],
                1.0,
                micro_batch_tokens=micro_batch_tokens,
                world_size=k,
                checkpointing=True,
            )
            cells.append(f"{f['params_gib']:.1f} / {f['need_gib']:.1f} GiB")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    import sys

    print(sharded_table() if "--sharded" in sys.argv else markdown_table())
