"""The frames of the TCP broadcast, typed on both ends: one model per kind, one parser, one way back.

A frame's header is a JSON object (``broadcast.wire``: ``u32 length | header | payload``) whose ``op``
names its kind. Each kind is a frozen pydantic model here, discriminated by its ``op`` (a
``Literal``), strict (exact JSON types: ``1.0`` is no version, ``true`` no port) and closed (an
unknown key is refused), every string, number, list and object bounded by a named limit below::

    control, worker -> learner   join · installed · stalled · rejected · leave
    control, learner -> worker   announce · revoke · serve · shutdown · error
    a pull, puller -> server     get
    a pull, server -> puller     chunk (then its payload) · error

:func:`parse_frame` is the one way a received header becomes a model: anything else is a
:class:`ProtocolError` naming the op and the offending field (and the sender, when the caller names
it), never a pydantic error. One view is read before it: a server's gate reads a ``get``'s
credential fields alone (:func:`parse_get_credentials`, the same types, blind to the rest), so a pull
without a valid credential is refused as such whatever else is wrong with it; the whole frame is
``parse_frame``'s next. :func:`to_wire` is the one way back: the dict ``wire.write_frame``
sends, with exactly the keys (and their order) the nodes sent before these models existed, so peers
of this version interoperate whichever side built its frame by hand. An optional field left at None
(``join.credential``, ``get.cert``, ``get.proof``, ``announce.members``) is not sent; a chunk's payload
length ``n`` is written by ``wire.encode`` from the payload, so :func:`to_wire` leaves it out.

What a model cannot know stays with its owner: whether a chunk index is below the manifest's chunk
count and a source has an address (``wire.parse_announcement``), what a manifest or credential says
(``weights.manifest``, ``broadcast.access``: both travel here as plain objects), whether a pull is
one this node serves (``access.Gate``).
"""

from __future__ import annotations

import functools
import re
import struct
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, TypeVar, get_args, overload

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError

from echo2.errors import Echo2Error
from echo2.weights import manifest

MAX_VERSION = 2**53  # a version past this is not exact as a JSON double (as protocol.MAX_INT)
MAX_ID = 128  # characters of a member id (a worker id, or "learner")
MAX_HOST = 255  # characters of a host name or address (the DNS limit)
MAX_FINGERPRINT = 128  # characters of a certificate fingerprint (64 hex digits; 95 with OpenSSL's colons)
MAX_CREDENTIAL = 1024  # characters of the credential a join carries (the registry's are 43)
MAX_REASON = 4096  # characters of a refusal's reason (it may quote a member id or two, escaped)
MAX_CHUNKS = manifest.MAX_CHUNKS  # chunks of one version: indices and counts
MAX_CHUNK_BYTES = manifest.MAX_CHUNK_SIZE  # payload bytes of one chunk
MAX_MEMBERS = 1 << 16  # members one frame names (peers, sources, serve, receipts)
MAX_FLEET = 1 << 30  # members a version may be announced to (a count, never a list)
MAX_FIELDS = 64  # keys of a nested record (a manifest, a credential: about ten each)
MAX_CERT_HEX = 8192  # hex characters of a member's DER certificate in a get (2 x access.MAX_CERT_BYTES)
MAX_PROOF_HEX = 1024  # hex characters of its proof of possession (an ECDSA P-256 signature: <= 144)
CHUNK_INDEX_BYTES = 4  # a get's payload: each chunk index as a little-endian uint32
# what a stranger can make a node parse: the first frame a node reads from a peer nobody has vouched for
# yet (a join: ~0.3 KiB; a get's header with its certificate and proof: ~1.8 KiB) is at most this many
# bytes, holding at most PRE_AUTH_ITEMS separators (',' '[' '{': a get's header has about 20)
PRE_AUTH_HEADER = 4 << 10
PRE_AUTH_ITEMS = 64

FRAME = ConfigDict(extra="forbid", strict=True, frozen=True, validate_by_name=True, validate_by_alias=True)

Version = Annotated[int, Field(ge=0, le=MAX_VERSION)]  # a published snapshot version
Member = Annotated[str, Field(min_length=1, max_length=MAX_ID)]  # a member id
Host = Annotated[str, Field(min_length=1, max_length=MAX_HOST)]  # where a chunk server listens
Port = Annotated[int, Field(ge=1, le=65535)]  # its TCP port
Fingerprint = Annotated[str, Field(max_length=MAX_FINGERPRINT)]  # SHA-256 of a certificate ("" = plain TCP)
Reason = Annotated[str, Field(max_length=MAX_REASON)]  # why something was refused, for a log line
ChunkIndex = Annotated[int, Field(ge=0, lt=MAX_CHUNKS)]  # which chunk of a version
ChunkCount = Annotated[int, Field(ge=0, le=MAX_CHUNKS)]  # how many chunks
MAX_PACE = 1e6  # a source's pace over the member's other sources' (wire.relative_pace), at most
PaceRatio = Annotated[float, Field(gt=0, le=MAX_PACE, allow_inf_nan=False)]
# a manifest or a credential: a plain object here, parsed by its owner (weights.manifest, broadcast.access)
Record = Annotated[dict[str, Any], Field(max_length=MAX_FIELDS)]
RunCredential = Annotated[str, Field(max_length=MAX_CREDENTIAL)]  # a join's run credential
CertHex = Annotated[str, Field(max_length=MAX_CERT_HEX)]  # a member's DER certificate, hex
ProofHex = Annotated[str, Field(max_length=MAX_PROOF_HEX)]  # its proof of possession, hex


class Stride(BaseModel):
    """Every ``step``-th chunk from ``start`` on, to the version's last: a relay tree's stripe, named in a
    few bytes instead of a list of C / k indices."""

    model_config = FRAME

    start: ChunkIndex
    step: Annotated[int, Field(ge=1, le=MAX_CHUNKS)]


def _chunks_kind(value: object) -> str:
    return "stride" if isinstance(value, dict | Stride) else "list"


# a pull stream's chunks: [chunk, ...] or {"start": s, "step": k}, told apart by their JSON type
Chunks = Annotated[
    Annotated[Annotated[list[ChunkIndex], Field(max_length=MAX_CHUNKS)], Tag("list")]
    | Annotated[Stride, Tag("stride")],
    Discriminator(_chunks_kind),
]
# JSON has no tuples: these accept a list (strict=False on the tuple itself); their items stay strict.
Source = Annotated[tuple[Member, Chunks], Field(strict=False)]  # a pull stream: [source, chunks]
Address = Annotated[tuple[Host, Port], Field(strict=False)]  # [host, port]: plain TCP
PinnedAddress = Annotated[tuple[Host, Port, Fingerprint], Field(strict=False)]  # [host, port, fingerprint]


class ProtocolError(Echo2Error):
    """A peer sent a malformed, oversized or unexpected frame; the message says what."""


# ---- control: worker -> learner ---------------------------------------------------------------------
class JoinFrame(BaseModel):
    """A worker's first frame on its control connection: it is a member while that connection is open."""

    model_config = FRAME

    op: Literal["join"] = "join"
    worker: Member  # its worker id, unique among live members (never "learner": the publisher checks)
    host: Host  # where its chunk server listens, as its peers reach it
    port: Port  # ... and on which port
    cert: Fingerprint = ""  # fingerprint of its chunk server's certificate ("" without TLS)
    credential: RunCredential | None = None  # its run credential (not sent when None)
    # [run epoch, version] of the weights it holds (not sent when None: none): a member that joins after
    # an anchor was announced is attached to it only if it holds nothing as new (publisher.py, latecomers)
    held: Annotated[list[Version], Field(min_length=2, max_length=2)] | None = None


class InstalledFrame(BaseModel):
    """An install ack, with the receipts ``rounds.receipt_fault`` checks and the pace of each peer it
    pulled a stripe from (``wire.relative_pace``; read by ``conduct.Conduct``)."""

    model_config = FRAME

    op: Literal["installed"] = "installed"
    v: Version  # the version installed
    got: Annotated[dict[Member, ChunkCount], Field(max_length=MAX_MEMBERS)]  # source -> chunks stored from it
    pace: Annotated[dict[Member, PaceRatio], Field(max_length=MAX_MEMBERS)] = {}  # peer -> its relative pace


class StalledFrame(BaseModel):
    """A report that a peer sent nothing within its deadline for this member."""

    model_config = FRAME

    op: Literal["stalled"] = "stalled"
    v: Version  # the version it stalled in
    source: Member  # the peer that stalled


class RejectedFrame(BaseModel):
    """A worker refused an announcement (bad signature, shape, stale version, someone else's credential)."""

    model_config = FRAME

    op: Literal["rejected"] = "rejected"
    v: Version | None  # the version its manifest named (null when it named none): always sent
    reason: Reason  # why, for the learner's log


class LeaveFrame(BaseModel):
    """A member leaves the topology (it closes its control connection next)."""

    model_config = FRAME

    op: Literal["leave"] = "leave"


# ---- control: learner -> worker ---------------------------------------------------------------------
class AnnounceFrame(BaseModel):
    """A new version for one member: the signed manifest, that member's plan and its credential. Its size
    does not grow with the fleet: ``peers`` names only the member's own sources and repair ancestors (and
    the learner), ``members`` says how many the version went to."""

    model_config = FRAME

    op: Literal["announce"] = "announce"
    manifest: Record  # the signed manifest (``Manifest.to_dict``; verified by the worker)
    sources: Annotated[
        list[Source], Field(max_length=MAX_MEMBERS)
    ]  # its pull streams: [source, [chunk, ...]] or [source, {"start": s, "step": k}]
    peers: Annotated[dict[Member, Address | PinnedAddress], Field(max_length=MAX_MEMBERS)]  # id -> address
    stall_hint: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0  # seconds still normal (0 = none)
    serve: Annotated[list[Member], Field(max_length=MAX_MEMBERS)] = []  # members it serves this version
    # a source -> where that source gets the chunks this member pulls from it (its stripe ancestor,
    # asked first when the source fails; the learner when none is named)
    repair: Annotated[dict[Member, Member], Field(max_length=MAX_MEMBERS)] = {}
    credential: Record  # its credential for the version (``access.Credential.to_dict``)
    # members the version was announced to (N of ``wire.first_chunk_deadline``); None: len(peers) - 1
    members: Annotated[int, Field(ge=1, le=MAX_FLEET)] | None = None


class RevokeFrame(BaseModel):
    """A member this node serves lost the learner's trust (quarantined, retired): serve it nothing more,
    and close the streams it has open here."""

    model_config = FRAME

    op: Literal["revoke"] = "revoke"
    member: Member  # whom to stop serving


class ServeFrame(BaseModel):
    """A member that joined after version ``v`` was announced pulls it from this node (the learner
    attached it here, ``publisher.py``, "Latecomers"): serve it ``v`` like a member of the plan."""

    model_config = FRAME

    op: Literal["serve"] = "serve"
    v: Version  # the version it pulls
    member: Member  # whom to serve it to


class ShutdownFrame(BaseModel):
    """The learner is closing: the worker leaves."""

    model_config = FRAME

    op: Literal["shutdown"] = "shutdown"


class ErrorFrame(BaseModel):
    """A refusal: of a join (control connection) or of a pull (before or instead of a chunk)."""

    model_config = FRAME

    op: Literal["error"] = "error"
    reason: Reason  # what was refused and why


# ---- a pull -----------------------------------------------------------------------------------------
class GetFrame(BaseModel):
    """A pull request (``access.pull_request``): who asks for which version, with what credential; the
    chunks it wants, in order, are its payload (:func:`encode_chunk_list`: ``n`` bytes, 4 per index),
    which a server reads only once the header's credential checked (``store.serve_pull``), so what a
    stranger makes a server parse is this small header alone (``PRE_AUTH_HEADER``)."""

    model_config = FRAME

    op: Literal["get"] = "get"
    v: Version  # the version asked for
    member: Annotated[Member, Field(alias="from")]  # who asks (its credential names the same member)
    repair: bool = False  # in place of another source (never rate-capped)
    cred: Record  # the learner's credential for that member and version
    cert: CertHex | None = None  # over TLS: its certificate (hex DER)
    proof: ProofHex | None = None  # over TLS: its signature over (server, member, version) (hex)
    # payload bytes: the chunk list, 4 per index, at least one (wire.encode writes it from the payload)
    n: Annotated[int, Field(ge=CHUNK_INDEX_BYTES, le=CHUNK_INDEX_BYTES * MAX_CHUNKS, multiple_of=4)]


class ChunkFrame(BaseModel):
    """One chunk of a pull; its payload of ``n`` bytes follows the header."""

    model_config = FRAME

    op: Literal["chunk"] = "chunk"
    v: Version  # the version it belongs to
    i: ChunkIndex  # its index
    n: Annotated[int, Field(ge=0, le=MAX_CHUNK_BYTES)] = 0  # payload bytes (written by wire.encode)


class GetCredentials(BaseModel):
    """What a server's gate reads of a ``get`` first (``access.Gate.authenticate``): who asks, for which
    version, with what credential and, over TLS, certificate and proof. The fields are
    :class:`GetFrame`'s, as strict; the frame's other keys are ignored here (``parse_frame`` reads the
    whole frame next). A missing credential, certificate or proof is None, for the gate to refuse by
    name ("no credential"), not a parse error. Not a frame kind: nothing sends one."""

    model_config = ConfigDict(
        extra="ignore", strict=True, frozen=True, validate_by_name=True, validate_by_alias=True
    )

    op: Literal["get"] = "get"
    member: Annotated[Member, Field(alias="from")]  # who asks
    v: Version  # the version asked for
    cred: Record | None = None  # the learner's credential (None: the gate refuses "no credential")
    cert: CertHex | None = None  # over TLS: the member's certificate (hex DER)
    proof: ProofHex | None = None  # over TLS: its proof of possession (hex)


Frame = (
    JoinFrame | InstalledFrame | StalledFrame | RejectedFrame | LeaveFrame
    | AnnounceFrame | RevokeFrame | ServeFrame | ShutdownFrame | ErrorFrame | GetFrame | ChunkFrame
)  # fmt: skip
F = TypeVar("F", bound=Frame)
G = TypeVar("G", bound=Frame)

_FRAMES: TypeAdapter[Frame] = TypeAdapter(Annotated[Frame, Field(discriminator="op")])
KINDS: dict[str, type[Frame]] = {cls.model_fields["op"].default: cls for cls in get_args(Frame)}
_UNSENT_NONE = {  # per kind: optional fields not sent while None
    cls: frozenset(k for k, f in cls.model_fields.items() if not f.is_required() and f.default is None)
    for cls in KINDS.values()
}
# per kind, what to_wire sends: (field, wire key, left out while None), in the order of the fields;
# a chunk's and a get's ``n`` is the framing's (wire.encode writes it from the payload)
_WIRE: dict[type[BaseModel], tuple[tuple[str, str, bool], ...]] = {
    cls: tuple(
        (name, info.alias or name, name in _UNSENT_NONE[cls])
        for name, info in cls.model_fields.items()
        if not (cls in (ChunkFrame, GetFrame) and name == "n")
    )
    for cls in KINDS.values()
}
_VERSION: TypeAdapter[int] = TypeAdapter(Version, config=ConfigDict(strict=True))


@overload
def parse_frame(header: Mapping[str, Any], kind: type[F], /, *, sender: str | None = None) -> F: ...
@overload
def parse_frame(
    header: Mapping[str, Any], kind: type[F], other: type[G], /, *, sender: str | None = None
) -> F | G: ...
@overload
def parse_frame(header: Mapping[str, Any], *kinds: type[Frame], sender: str | None = None) -> Frame: ...
def parse_frame(header: Mapping[str, Any], *kinds: type[BaseModel], sender: str | None = None) -> Frame:
    """The model of a received header (``wire.read_header``'s dict), of one of ``kinds`` (any kind when
    none are given); ProtocolError naming the op and the field otherwise (``sender``: a member id for
    the message)."""
    op = header.get("op")
    at = f" from {sender!r}" if sender is not None else ""
    if not isinstance(op, str) or op not in KINDS:
        raise ProtocolError(f"unknown frame op {show(op)}{at}")
    if kinds and KINDS[op] not in kinds:
        expected = ", ".join(repr(k.model_fields["op"].default) for k in kinds)
        raise ProtocolError(f"unexpected {op!r} frame{at} (expected {expected})")
    try:
        return _FRAMES.validate_python(header, by_alias=True, by_name=False)
    except ValidationError as exc:
        raise ProtocolError(f"{op!r} frame{at}: {_explain(exc, tagged=True)}") from None


def parse_get_credentials(header: Mapping[str, Any], *, sender: str | None = None) -> GetCredentials:
    """The credential fields of a received ``get`` (:class:`GetCredentials`); ProtocolError naming the
    field otherwise, worded as :func:`parse_frame`'s (``'get' frame: field 'from': ...``)."""
    at = f" from {sender!r}" if sender is not None else ""
    if header.get("op") != "get":
        raise ProtocolError(f"unexpected {show(header.get('op'))} frame{at} (expected 'get')")
    try:
        return GetCredentials.model_validate(header, by_alias=True, by_name=False)
    except ValidationError as exc:
        raise ProtocolError(f"'get' frame{at}: {_explain(exc, tagged=False)}") from None


def to_wire(frame: Frame) -> dict[str, Any]:
    """The header ``wire.write_frame`` sends for ``frame`` (the module docstring: same keys as ever).
    Shallow: the field values go out as they are (tuples encode as JSON arrays; a nested model, a
    parsed announcement's ``Stride``, is written as its fields by ``wire.encode``), so the learner's
    announcements, one per member, copy nothing they share (the manifest)."""
    return _sent(type(frame), functools.partial(getattr, frame))


def _sent(kind: type[BaseModel], value_of: Callable[[str], Any]) -> dict[str, Any]:
    """The header :func:`to_wire` sends for a frame of ``kind`` whose field values ``value_of`` gives."""
    out: dict[str, Any] = {}
    for name, key, unsent_none in _WIRE[kind]:
        value = value_of(name)
        if value is not None or not unsent_none:
            out[key] = value
    return out


def announce(**fields: Any) -> dict[str, Any]:
    """The header of an announcement the learner builds itself: ``to_wire`` of the ``AnnounceFrame`` of
    ``fields``, not validated again (its parts are this process's own: the signed manifest, the plan,
    the members' checked join addresses; a member parses it strictly) and without building the model
    (one per member and publication: at 10,000 members constructing them cost about as much as
    encoding them). A field left out takes the model's default; an unknown or missing one is an error."""
    if unknown := fields.keys() - _ANNOUNCE_DEFAULTS.keys() - _ANNOUNCE_REQUIRED:
        raise TypeError(f"AnnounceFrame has no field {sorted(unknown)}")
    if missing := _ANNOUNCE_REQUIRED - fields.keys():
        raise TypeError(f"AnnounceFrame needs {sorted(missing)}")
    return _sent(AnnounceFrame, {**_ANNOUNCE_DEFAULTS, **fields}.__getitem__)


_ANNOUNCE_REQUIRED = frozenset(n for n, info in AnnounceFrame.model_fields.items() if info.is_required())
_ANNOUNCE_DEFAULTS = {
    n: info.get_default(call_default_factory=True)
    for n, info in AnnounceFrame.model_fields.items()
    if not info.is_required()
}


def refusal(reason: str) -> ErrorFrame:
    """The ``error`` frame refusing something for ``reason``, cut to ``MAX_REASON`` characters (a
    reason may quote a peer's values, so its length is not this node's to promise)."""
    return ErrorFrame(reason=reason[:MAX_REASON])


def encode_chunk_list(chunks: list[int]) -> bytes:
    """A get's payload: ``chunks`` as little-endian uint32 (each in ``[0, MAX_CHUNKS)``: the caller's)."""
    return struct.pack(f"<{len(chunks)}I", *chunks)


def decode_chunk_list(payload: bytes) -> list[int]:
    """The chunk indices of a get's payload (its length, a multiple of 4 within bounds, is the frame
    model's rule); whether they fit the version is the server's (``store.check_chunk_list``)."""
    return list(struct.unpack(f"<{len(payload) // CHUNK_INDEX_BYTES}I", payload))


def version_or_none(value: object) -> int | None:
    """``value`` if it is a frame's version (an int in [0, MAX_VERSION]), else None: what a rejection
    names of an announcement whose manifest may be garbage."""
    try:
        return _VERSION.validate_python(value)
    except ValidationError:
        return None


def show(value: object) -> str:
    """A peer's value for an error message: its repr, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_UNION_LABEL = re.compile(r"^(tuple\[|list$|stride$)")


def _explain(exc: ValidationError, tagged: bool) -> str:
    """The first fault of a failed validation as ``field 'a.b': what, got value`` (and how many more).
    ``tagged``: the validation was the discriminated union's, whose ``loc`` starts with the op tag."""
    errors = exc.errors(include_url=False)
    err = errors[0]
    # the op tag (tagged) and a union's member label (an announced peer's address, a pull's chunks as a
    # list or a stride) are no field
    loc = err["loc"][1:] if tagged else err["loc"]
    path = ".".join(str(p) for p in loc if not (isinstance(p, str) and _UNION_LABEL.match(p)))
    if err["type"] == "missing":
        text = f"field {path!r} is missing"
    elif err["type"] == "extra_forbidden":
        text = f"unknown field {path!r}"
    else:
        text = f"field {path!r}: {err['msg']}, got {show(err['input'])}"
    return text + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")
