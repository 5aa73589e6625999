"""The wire protocol between the learner node and its rollout workers: one module, typed on both ends.

Every request and reply of the learner's HTTP API is a pydantic model here; the worker (client,
``rollout/client.py``) builds and parses them and the learner node (server, ``runtime/routes.py``)
parses and builds them, so neither side indexes the other's raw dicts. Requests are strict (exact
JSON types, unknown keys refused: a refusal names the field); replies are parsed leniently about
extra keys, so a newer learner can add fields without breaking older workers.

Endpoints (JSON; every one but ``register`` needs ``Authorization: Bearer <credential>``)::

    POST /v1/register   RegisterRequest  -> RegisterReply
    POST /v1/heartbeat  HeartbeatRequest -> HeartbeatReply
    POST /v1/lease      LeaseRequest     -> LeaseGrant | LeaseRefusal
    POST /v1/submit     SubmitRequest    -> SubmitReply
    GET  /v1/version                     -> VersionReply
    GET  /v1/snapshot?have=V&base=B      -> a snapshot chain (``echo2.weights.chain.encode_chain``): the
                                            links that take installed version V to the newest (V = -1:
                                            anchor first; in a LoRA run the link carrying the frozen
                                            base first unless B = 1, the caller holds it)
    GET  /v1/model                       -> ModelReply (config + tokenizer files: the skeleton)
    any refusal                          -> ErrorReply with a 4xx status

The trajectory codec (:func:`group_to_wire`, :func:`group_from_wire`, :func:`encode_group`,
:func:`decode_group`) is the one place a GRPO group of :class:`~echo2.types.Trajectory` becomes
bytes and back: the worker uses it to submit, the validator to build what it admits, the store to
keep it on disk.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, TypeAdapter

from echo2.config import SamplingConfig, TaskConfig
from echo2.types import MAX_EPOCH, Prompt, Trajectory

API = "/v1"
VERSION_HEADER = "X-Echo2-Version"
MAX_ID_CHARS = 256  # lease_id / prompt_id length limit
MAX_INT = 2**53  # counts and versions above this are not plausible (and not exact as JSON doubles)

STRICT = ConfigDict(extra="forbid", strict=True)  # requests: exact types, no unknown keys
LENIENT = ConfigDict(extra="ignore")  # replies: a newer learner may add fields

Version = Annotated[int, Field(ge=-1, le=MAX_INT)]  # a snapshot version; -1 = none installed yet
MAX_SECONDS = 86400.0  # no heartbeat interval, generation or install a worker reports lasts longer than a day
MAX_ROLLOUTS = 10**9  # nor does one heartbeat interval hold more rollouts than this
MAX_UPLINK_MBPS = 400_000.0  # no worker's upload link is faster (400 Gbit/s)
MAX_HEARTBEAT_S = 3600.0  # the longest heartbeat period a reply may ask for (runtime/members.py: Cadence)
Count = Annotated[int, Field(ge=0, le=MAX_INT)]
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)]
Ident = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]


# ---- requests (worker -> learner) -------------------------------------------------------------------
class RegisterRequest(BaseModel):
    """``POST /v1/register``: join the run. The run's join token travels in the ``Authorization: Bearer``
    header, checked before a byte of this body is read (at most ``routes.REGISTER_MAX_BYTES``); it is
    exchanged once for a per-worker credential."""

    model_config = STRICT

    name: Annotated[str, Field(min_length=1, max_length=64)] = "worker"  # shown in the registry
    hardware: Annotated[str, Field(max_length=128)] = ""  # free-text description (GPU model, ...)
    usd_per_hour: Annotated[float, Field(gt=0, allow_inf_nan=False)]  # this machine's price c_i (> 0)
    rollouts_per_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None  # own estimate
    # its upload link in Mbit/s, as it declares it: the relay trees put the fast ones near the root
    uplink_mbps: Annotated[float, Field(gt=0, le=MAX_UPLINK_MBPS, allow_inf_nan=False)] | None = None
    # a random id the worker draws once per registration and repeats when it sends it again: a retry of a
    # registration that had landed (its reply late or lost) gets that identity back with a new credential,
    # not a second identity, slot and share of the token's identity budget (runtime/members.py)
    attempt: Annotated[str, Field(min_length=16, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")] | None = None


class HeartbeatRequest(BaseModel):
    """``POST /v1/heartbeat``: what the worker did since its last heartbeat."""

    model_config = STRICT

    rollouts: Annotated[int, Field(ge=0, le=MAX_ROLLOUTS)]  # rollouts generated since the last heartbeat
    busy_s: Seconds  # seconds spent generating since the last heartbeat (installing excluded)
    installed_version: Version  # newest snapshot it has installed
    install_s: Seconds = 0.0  # seconds its last install took (staging + loading into the engine)


class LeaseRequest(BaseModel):
    """``POST /v1/lease``, or the ``next_lease`` of a submission."""

    model_config = STRICT

    max_prompts: Annotated[int, Field(ge=1, le=MAX_INT)]  # most prompts it wants
    installed_version: Version  # the snapshot it would generate with
    installed_epoch: Annotated[int, Field(ge=0, le=MAX_EPOCH)] = 0  # the run epoch of its manifest


class SampleWire(BaseModel):
    """One completion of a group on the wire (its prompt and version are the group's and the lease's)."""

    model_config = STRICT

    prompt_ids: list[StrictInt]  # token ids of the prompt as the policy saw it
    completion_ids: list[StrictInt]  # sampled token ids
    sampler_logprobs: list[StrictFloat]  # per-token log-probs under the sampler
    # r = R(x, y): in the store, the learner's own grade; from a worker a hint at most, never believed (the
    # learner grades every completion itself, tasks/verify.py), so a worker that cannot grade sends 0
    reward: StrictFloat = 0.0
    meta: dict[StrictStr, Any] = {}  # Ω: parse status, truncation, ... (scalars only, checked)
    # multi-turn episodes only: 1 = the policy's token, 0 = the environment's; [] = all 1. A single-turn
    # task's submission carries none (or all ones); an episode's mask in the store is the replay's
    turn_mask: list[StrictInt] = []


class GroupWire(BaseModel):
    """One GRPO group: ``group_size`` completions of one leased prompt."""

    model_config = STRICT

    prompt_id: StrictStr  # the leased prompt this group answers
    samples: list[SampleWire]  # its completions, in sampling order


class SubmitRequest(BaseModel):
    """``POST /v1/submit``: one group per leased prompt, in lease order, all from one version."""

    model_config = STRICT

    lease_id: StrictStr  # the lease this answers
    policy_version: StrictInt  # version of the weights that generated every sample
    groups: list[GroupWire]  # one per leased prompt
    next_lease: dict[str, Any] | None = None  # a LeaseRequest answered in the same round trip


# ---- replies (learner -> worker) --------------------------------------------------------------------
class LoraSettings(BaseModel):
    """A LoRA run's publications are the adapter alone: the worker holds the frozen base (the first link
    of the chain, checked against ``base_digest``) and loads base + ``scale`` x B @ A (``models/lora.py``)."""

    model_config = LENIENT

    scale: float = Field(gt=0.0, allow_inf_nan=False)  # alpha / r
    base_digest: str = Field(pattern=r"^[0-9a-f]{64}$")  # weights digest of the base; in every manifest
    # the dtype the base is published in (``snapshot.dtype``): what a worker holding the base checkpoint
    # itself (``--lora-base``) casts it to before comparing digests
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    rank: int | None = Field(default=None, ge=1, le=4096)  # lora.r: what a native vLLM engine reserves
    vllm: Literal["native", "merged"] = "merged"  # lora.vllm: how a vLLM worker applies each adapter


class PackagePin(BaseModel):
    """A distribution an environment's episodes run on, pinned (``echo2.pins``): a worker with another
    version or other files refuses to run."""

    model_config = LENIENT

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # the distribution's name
    version: str = Field(min_length=1, max_length=64)
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")  # SHA-256 over its installed files


class WorkerSettings(BaseModel):
    """The part of the run's config a worker needs (it never gets the whole tree)."""

    model_config = LENIENT

    seed: int  # seeds the worker's sampler
    task: TaskConfig  # the task adapter that grades completions
    sampling: SamplingConfig  # temperature, top-p, max new tokens
    group_size: int  # samples per GRPO group
    lease_prompts: int  # prompts to ask for per lease
    chat_template: bool  # wrap prompts with the tokenizer's chat template
    threads: int | None  # torch intra-op threads (None = torch's default)
    system_prompt: str | None = Field(None, max_length=8192)  # the system message (chat template only)
    chat_template_kwargs: dict[str, str | int | float | bool] = {}  # the chat template's extra arguments
    eos_ids: list[int] = Field(default_factory=list, max_length=64)  # tokens that end a completion
    heartbeat_s: float  # seconds between heartbeats
    max_context: int = 0  # longest prompt + completion the model attends to (bounds an episode); 0 = unknown
    lora: LoraSettings | None = None  # a LoRA run: publications are adapters over this base
    packages: list[PackagePin] = Field(default_factory=list, max_length=32)  # the environment's, pinned


class RegisterReply(BaseModel):
    model_config = LENIENT

    worker_id: str  # the id the learner assigned
    credential: str  # bearer credential for every later call (and the broadcast join)
    public_key: str  # the learner's manifest verification key (``key_from_text`` form)
    broadcast: tuple[str, int]  # host and port of the snapshot broadcast
    settings: WorkerSettings  # what this worker needs of the run's config


class HeartbeatReply(BaseModel):
    model_config = LENIENT

    active: bool  # the controller wants this worker generating
    version: int  # the learner's version v_t
    min_version: int  # oldest admissible generating version v_t - S
    finished: bool  # the run is over: stop
    # seconds until the next heartbeat: longer as the fleet grows (runtime/members.py: Cadence); absent
    # from a learner before it, where settings.heartbeat_s stands
    heartbeat_s: Annotated[float, Field(gt=0, le=MAX_HEARTBEAT_S, allow_inf_nan=False)] | None = None


class LeasedPrompt(BaseModel):
    """A prompt as a lease carries it: what the policy is shown and what a worker needs to roll it out,
    never what grades it. ``Prompt.answer`` (the gold answer, tests, a rubric's input) stays with the
    learner, which grades every completion itself (``tasks/verify.py``); ``meta`` is the task's public
    extras (an episode's seed and opponents, a system message), which a task never uses for a secret
    (``data/tasks/base.py``)."""

    model_config = LENIENT

    prompt_id: str  # the id a group answering it names
    text: str  # the prompt shown to the policy
    meta: dict[str, Any] = {}  # public extras: an episode's seed, a system message, ...

    @classmethod
    def of(cls, prompt: Prompt) -> LeasedPrompt:
        """The leased form of a learner-side prompt: its answer left out."""
        return cls(prompt_id=prompt.prompt_id, text=prompt.text, meta=dict(prompt.meta))

    def prompt(self) -> Prompt:
        """The prompt a worker rolls out: no answer (a worker does not grade; the learner does)."""
        return Prompt(prompt_id=self.prompt_id, text=self.text, answer="", meta=dict(self.meta))


class LeaseGrant(BaseModel):
    model_config = LENIENT

    kind: Literal["grant"] = "grant"
    lease_id: str  # answer it with a submission of the same id
    prompts: list[LeasedPrompt]  # the prompts to sample, in order (no grading secret: LeasedPrompt)
    group_size: int  # completions per prompt
    min_version: int  # generate with at least this version (else the groups are dropped as stale)
    expires_in_s: float  # after this the prompts are leased to someone else (a late answer still counts)
    seed: int  # sample with seeded Gumbel-max under this seed: sample j of prompt i is row i*G + j
    epoch: int = 0  # the run epoch of the learner process that issued it (its manifests carry it too)


LeaseRefusalReason = Literal[
    "finished",  # the run is over
    "inactive",  # the pool controller has not activated this worker
    "benched",  # too many of its leases went unreturned: no leases for a while (retry_after_s)
    "stale_epoch",  # its weights are of another learner process's run epoch: drop them, install min_version
    "stale_weights",  # its weights are older than v_t - S: install min_version first
    "unpublished_version",  # the learner never published (or does not hold) the version it claims
    "rolled_back",  # its weights are newer than the learner's: drop them, install the learner's
    "buffer_full",  # leased + buffered rollouts are at the in-flight cap
    "probation_full",  # workers on probation hold their whole share of the in-flight cap
    "check_pending",  # a new identity's submission waits for its generation check: ask again after it
    "too_many_leases",  # it holds as many open leases as its standing allows
]


class LeaseRefusal(BaseModel):
    model_config = LENIENT

    kind: Literal["refusal"] = "refusal"
    reason: LeaseRefusalReason  # why no lease now
    retry_after_s: float  # ask again after this long
    min_version: int | None = None  # stale_weights / unpublished_version / rolled_back: install at least this


LeaseReply = Annotated[LeaseGrant | LeaseRefusal, Field(discriminator="kind")]
LEASE_REPLY: TypeAdapter[LeaseGrant | LeaseRefusal] = TypeAdapter(LeaseReply)


class ErrorReply(BaseModel):
    """Every 4xx: a stable reason code (a metric label) and a detail naming the field and the limit."""

    model_config = LENIENT

    error: str  # reason code, counted as store/rejected/<error>
    detail: str  # what was wrong


class SubmitReply(BaseModel):
    model_config = LENIENT

    admitted: int  # trajectories stored for training
    dropped_stale: int  # trajectories accepted but too old (v < v_t - S)
    pending_check: int = 0  # of the admitted, trajectories held until their generation check (or the
    # worker's drawn submissions before them) passed
    next_lease: LeaseReply | None = None  # the answer to ``next_lease``, when asked and well formed
    next_lease_error: ErrorReply | None = None  # why ``next_lease`` was refused (the submission stands)


class VersionReply(BaseModel):
    model_config = LENIENT

    version: int | None  # newest published snapshot version (None before the first)
    manifest: dict[str, Any] | None  # its signed manifest (``weights.manifest.Manifest.to_dict``)


class ModelReply(BaseModel):
    model_config = LENIENT

    files: dict[str, str]  # file name -> text: model config and tokenizer files, no weights


# ---- the trajectory codec ---------------------------------------------------------------------------
def group_to_wire(group: Sequence[Trajectory]) -> GroupWire:
    """A GRPO group (trajectories of one prompt) as it travels and is stored."""
    if not group:
        raise ValueError("a group has at least one trajectory")
    return GroupWire.model_construct(
        prompt_id=group[0].prompt_id,
        samples=[
            SampleWire.model_construct(
                prompt_ids=list(t.prompt_ids),
                completion_ids=list(t.completion_ids),
                sampler_logprobs=list(t.sampler_logprobs),
                reward=t.reward,
                meta=dict(t.meta),
                turn_mask=list(t.turn_mask),
            )
            for t in group
        ],
    )


def group_from_wire(group: GroupWire, group_id: str, policy_version: int) -> tuple[Trajectory, ...]:
    """The trajectories of a (validated) wire group, tagged with their group id and version."""
    return tuple(
        Trajectory(
            prompt_id=group.prompt_id,
            group_id=group_id,
            prompt_ids=tuple(s.prompt_ids),
            completion_ids=tuple(s.completion_ids),
            sampler_logprobs=tuple(s.sampler_logprobs),
            reward=s.reward,
            policy_version=policy_version,
            meta=dict(s.meta),
            turn_mask=tuple(s.turn_mask),
        )
        for s in group.samples
    )


def encode_group(group: Sequence[Trajectory]) -> str:
    """JSON text of a group (what the store keeps; NaN is refused, JSON has none)."""
    return group_to_wire(group).model_dump_json()


def decode_group(text: str | bytes, group_id: str, policy_version: int) -> tuple[Trajectory, ...]:
    """Inverse of :func:`encode_group`, for text this codec wrote (the store's own rows): it does not
    validate again what was validated at the door, it only rebuilds the records (``json.loads``, no
    pydantic pass: the learner decodes every group it trains on)."""
    g = json.loads(text)
    return tuple(
        Trajectory(
            prompt_id=g["prompt_id"],
            group_id=group_id,
            prompt_ids=tuple(s["prompt_ids"]),
            completion_ids=tuple(s["completion_ids"]),
            sampler_logprobs=tuple(s["sampler_logprobs"]),
            reward=s["reward"],
            policy_version=policy_version,
            meta=s["meta"],
            turn_mask=tuple(s.get("turn_mask", ())),  # rows written before multi-turn episodes have none
        )
        for s in g["samples"]
    )


def group_id(lease_id: str, index: int) -> str:
    """The group id of the ``index``-th group of a lease (unique: lease ids are)."""
    return f"{lease_id}:{index}"
