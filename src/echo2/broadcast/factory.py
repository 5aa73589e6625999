"""The broadcast factory: the one place the runtime picks a transport for the snapshot seam, and a
strategy by its name (:func:`get_strategy`: a variant is a new registered class, not another ``if``).

``tcp`` is the real plane (``TcpPublisher`` on the learner, a ``TcpWorkerNode`` per worker that relays
chunks to its peers); ``memory`` is the in-process hub (tests, the minimal example, single-process
runs), whose publisher is also its own address. Both verify every manifest and blob before a worker
sees a snapshot, and both implement ``broadcast.api``'s ``SnapshotPublisher`` / ``SnapshotReceiver``.
Over TCP, ``tls`` (the run's certificate, ``echo2.transport``) puts the plane under TLS, and each
receiver pins its fingerprint (``pin``); the in-memory hub never leaves the process. Either publisher
gets the run's ``ledger`` of members and installed versions (``broadcast.api.MemberLedger``: the
worker registry): the TCP one must be given it (``OpenLedger``, anyone joins, only by name); the
in-memory hub's receivers are the learner process's own, so it defaults to ``OpenLedger``.
"""

from __future__ import annotations

from typing import Literal

from echo2.broadcast.api import MemberLedger, SnapshotPublisher, SnapshotReceiver
from echo2.broadcast.in_memory import InMemoryHub
from echo2.broadcast.pipelined import RelayChain, TreeChains, TreePipelined
from echo2.broadcast.publisher import TcpPublisher
from echo2.broadcast.receiver import TcpWorkerNode
from echo2.broadcast.star import StarLimited, StarUnlimited
from echo2.broadcast.strategy import Strategy
from echo2.errors import ConfigError
from echo2.perimeter import Limits
from echo2.physics.broadcast import StrategyName, strategy_name
from echo2.transport import TlsIdentity
from echo2.weights.manifest import ManifestKey

BroadcastKind = Literal["tcp", "memory"]


def registry() -> dict[StrategyName, Strategy]:
    """Name -> strategy for every shipped strategy (frozen dataclasses: safe to share); the keys are
    exactly the names of :data:`echo2.physics.broadcast.StrategyName`."""
    shipped: list[Strategy] = [StarUnlimited(), StarLimited(), TreePipelined(), RelayChain(), TreeChains()]
    return {s.name: s for s in shipped}


def get_strategy(name: str) -> Strategy:
    """The strategy called ``name``; ConfigError listing the choices for an unknown name."""
    return registry()[strategy_name(name)]


PublisherAddress = tuple[str, int] | InMemoryHub  # where receivers join: host and port, or the hub itself


def open_publisher(
    kind: BroadcastKind,
    key: ManifestKey,
    strategy: Strategy,
    chunk_size: int | None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    advertise_host: str | None = None,
    ledger: MemberLedger | None = None,
    tls: TlsIdentity | None = None,
    perimeter: Limits | None = None,
) -> SnapshotPublisher:
    """The learner's end of the broadcast plane (call ``await start()`` before publishing); ``tls``
    None means plain TCP; ``chunk_size`` None lets the publisher choose it per snapshot; ``perimeter``
    the port's limits before anyone is known (None: the defaults cut to the descriptor limit). A TCP
    publisher needs its ``ledger`` (ConfigError without one)."""
    if kind == "memory":
        return InMemoryHub(key, chunk_size, ledger=ledger)
    if ledger is None:
        raise ConfigError(
            "a TCP snapshot publisher needs the run's ledger of members (the worker registry), or "
            "broadcast.api.OpenLedger() by name to let anyone join"
        )
    return TcpPublisher(
        key, strategy, chunk_size, host=host, port=port, advertise_host=advertise_host, tls=tls,
        ledger=ledger, perimeter=perimeter,
    )  # fmt: skip


def open_receiver(
    publisher: PublisherAddress,
    worker_id: str,
    key: ManifestKey,
    *,
    credential: str | None = None,
    host: str = "127.0.0.1",
    advertise_host: str | None = None,
    pin: str | None = None,
    port: int = 0,
    advertise_port: int | None = None,
    held: tuple[int, int] | None = None,
) -> SnapshotReceiver:
    """A worker's end: joins ``publisher`` (call ``await start(join_timeout)``), yields verified
    snapshots and, over TCP, relays chunks to peers from ``host:port`` (port 0: any free one;
    ``advertise_host:advertise_port`` is what they dial, for a relay behind NAT port forwarding);
    ``pin`` (the learner certificate's fingerprint) puts every connection under TLS; ``held`` (run epoch,
    version) names the weights the worker holds (a member that joins after an anchor was announced
    is attached to it only when it holds nothing as new: ``publisher.py``, "Latecomers")."""
    if isinstance(publisher, InMemoryHub):
        return publisher.receiver(worker_id)
    return TcpWorkerNode(
        worker_id,
        publisher,
        key,
        host=host,
        port=port,
        advertise_host=advertise_host,
        advertise_port=advertise_port,
        credential=credential,
        pin=pin,
        held=held,
    )
