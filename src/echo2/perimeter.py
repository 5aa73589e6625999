"""The perimeter of a listening port: who may hold a connection, and for how long, before anyone is known.

Both of the learner's ports (the HTTP API and the snapshot broadcast) and every worker's chunk relay
face the internet, so what a stranger can hold there without a join token or a credential is bounded
here, before any byte of the application is parsed. A :class:`Perimeter` serves a port
(:meth:`Perimeter.serve`: a plain TCP listener whose every accepted socket passes :meth:`_admit` first,
TLS started only after) with these rules, each refusal counted (:class:`PerimeterCounters`):

- **caps**: at most ``max_connections`` connections on the port, at most ``max_per_address`` from one
  peer address, and at most ``pre_auth_share`` of the port held by connections nobody has vouched for
  yet (the rest is kept for members); a connection over a cap is aborted at accept (one RST, its
  descriptor released at once), so accept never meets a full descriptor table;
- **eviction, not starvation**: when the unauthenticated share is full, the oldest unvouched connection
  of the address holding the most of them is closed to admit the new one, so a flood from a few
  addresses cannot lock out a worker connecting from its own;
- **a rate per address and in all**: new connections from one address pass a token bucket
  (``accepts_per_s``, bursts of ``accept_burst``), and all new connections of the port from addresses
  with no member connected one of their own (``accepts_per_s_total``, bursts of 2 s of it): a handshake
  flood from any number of addresses costs the serving thread at most that many handshakes a second,
  while a member's pulls and reconnections from its address are not held to it;
- **deadlines**: the TLS handshake must end within ``handshake_s`` and the first request (its line and
  headers, or the first frame) be in within ``header_s`` of it; an unvouched connection is closed then,
  whatever it is doing;
- **vouching**: the application calls :meth:`Perimeter.vouch` with a connection's transport once a
  request on it authenticated (a bearer credential, the join token, a broadcast credential): from then
  on the connection is a member's, never evicted and without the perimeter's deadline (the
  application's own idle timeout and the identity's rate limits apply).

:class:`RequestRate` (keyed token buckets) is the one definition of a request-rate cap: the API's per
identity, and a port's per address for requests made before anyone is known (:meth:`Perimeter.charge`).

The caps come from the process's descriptor limit (:func:`port_limits`): ``echo2.resources`` raises the
soft limit to the hard one at start and keeps ``RESERVED_FDS`` for the process's own files; each of the
learner's two ports gets at most ``FD_SHARE`` of the rest.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from echo2.config import PerimeterConfig
from echo2.resources import RESERVED_FDS, descriptor_limits

log = logging.getLogger(__name__)

FD_SHARE = 0.4  # of the descriptors left after RESERVED_FDS, the most one listening port may hold
MIN_PORT_CONNECTIONS = 16  # a port always gets at least this many (a tiny descriptor limit still serves)


@dataclass(frozen=True)
class Limits:
    """What one port allows (``security.perimeter``, cut to the descriptor limit by :func:`port_limits`)."""

    max_connections: int  # connections held at once, in every state
    max_per_address: int  # of which from one peer address
    pre_auth_share: float  # share of max_connections that connections nobody vouched for may hold
    accepts_per_s: float  # new connections one address may open per second (token bucket) ...
    accept_burst: float  # ... in bursts of this many
    accepts_total: float  # new connections from all addresses together per second (bursts of 2 s of it)
    handshake_s: float  # a TLS handshake taking longer is abandoned
    header_s: float  # the first request must be in (and vouched for) this long after the handshake
    requests_per_s: float  # requests one address may make before any identity is known ...
    request_burst: float  # ... in bursts of this many

    @property
    def max_pre_auth(self) -> int:
        """Connections nobody has vouched for that the port holds at once (at least one)."""
        return max(1, int(self.max_connections * self.pre_auth_share))


def port_limits(cfg: PerimeterConfig, descriptors: int, ports: int = 2) -> Limits:
    """The :class:`Limits` of each of ``ports`` ports from the ``security.perimeter`` section ``cfg``,
    its connection cap cut to ``FD_SHARE`` of the descriptors left after ``RESERVED_FDS`` (and to a
    ``1/ports`` share of them, so the ports together stay under the limit)."""
    spare = max(0, descriptors - RESERVED_FDS)
    fit = int(spare * min(FD_SHARE, 1.0 / ports))
    cap = max(MIN_PORT_CONNECTIONS, min(cfg.max_connections, fit))
    return Limits(
        max_connections=cap,
        max_per_address=min(cfg.max_per_address, cap),
        pre_auth_share=cfg.pre_auth_share,
        accepts_per_s=cfg.accepts_per_s,
        accept_burst=cfg.accept_burst,
        accepts_total=cfg.accepts_per_s_total,
        handshake_s=cfg.handshake_s,
        header_s=cfg.header_s,
        requests_per_s=cfg.requests_per_s,
        request_burst=cfg.request_burst,
    )


def default_limits() -> Limits:
    """The default ``[security.perimeter]`` cut to this process's descriptor limit now."""
    return port_limits(PerimeterConfig(), descriptor_limits()[0])


def streams(
    on_connect: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Any], limit: int = 1 << 22
) -> asyncio.StreamReaderProtocol:
    """The protocol ``asyncio.start_server`` makes for each connection (a reader buffering at most
    ``limit`` bytes, and ``on_connect(reader, writer)`` as its task): a :meth:`Perimeter.serve` factory.
    A connection's task cancelled (the process stopping while a peer is connected) ends quietly: on
    Python 3.11 asyncio logs a cancelled connection task as an ERROR with a traceback (CPython
    gh-113538, fixed in 3.12), which a stop of the learner with a worker connected printed."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await on_connect(reader, writer)
        except asyncio.CancelledError:
            writer.close()

    return asyncio.StreamReaderProtocol(asyncio.StreamReader(limit=limit), handle)


@dataclass
class PerimeterCounters:
    """What a port refused or cut (cumulative); ``perimeter/<port>/<name>`` on ``/metrics``."""

    accepted: int = 0  # connections admitted at accept
    refused_full: int = 0  # aborted at accept: the port held max_connections (members and all)
    refused_address: int = 0  # aborted at accept: the address held max_per_address, none of them evictable
    refused_rate: int = 0  # aborted at accept: the address opened connections faster than accepts_per_s
    evicted: int = 0  # unvouched connections closed to make room for a new one
    handshake_failed: int = 0  # TLS handshakes that failed or passed handshake_s
    header_timeouts: int = 0  # unvouched connections closed at header_s
    requests_limited: int = 0  # requests refused before any identity was known (per-address rate)
    vouched: int = 0  # connections a request authenticated on

    def metrics(self, port: str) -> dict[str, float]:
        return {f"perimeter/{port}/{f.name}": float(getattr(self, f.name)) for f in fields(self)}


class RequestRate:
    """Token buckets, one per key (an identity, a peer address): each holds up to ``burst`` tokens,
    refilled at ``rate`` a second; a request takes one. :meth:`take` says 0 (taken) or the seconds
    until one is there. A bucket refilled to ``burst`` holds nothing an absent one does not: every
    ``SWEEP_EVERY`` takes they are dropped, so the table holds the keys heard from in the last
    ``burst / rate`` seconds."""

    SWEEP_EVERY = 1024

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at clock time)
        self._takes = 0

    def take(self, key: str) -> float:
        now = self.clock()
        self._takes += 1
        if self._takes % self.SWEEP_EVERY == 0:
            self._buckets = {k: b for k, b in self._buckets.items() if self._level(b, now) < self.burst}
        tokens = self._level(self._buckets.get(key, (self.burst, now)), now)
        if tokens >= 1.0:
            self._buckets[key] = (tokens - 1.0, now)
            return 0.0
        self._buckets[key] = (tokens, now)
        return (1.0 - tokens) / self.rate

    def _level(self, bucket: tuple[float, float], now: float) -> float:
        tokens, at = bucket
        return min(self.burst, tokens + (now - at) * self.rate)

    def forget(self, key: str) -> None:
        """Drop a key's bucket (it opens nothing any more)."""
        self._buckets.pop(key, None)

    def __len__(self) -> int:
        return len(self._buckets)


class _Conn:
    """One admitted connection, as the perimeter tracks it."""

    __slots__ = ("addr", "closed", "raw", "timer", "transport", "vouched")

    def __init__(self, addr: str, raw: asyncio.BaseTransport) -> None:
        self.addr = addr  # the peer's address (no port)
        self.raw = raw  # the accepted TCP transport
        self.transport: asyncio.BaseTransport | None = None  # what the application sees (TLS or raw)
        self.vouched = False  # a request on it authenticated
        self.closed = False  # released (its counts given back)
        self.timer: asyncio.TimerHandle | None = None  # the header deadline while unvouched


class Perimeter:
    """Admission, caps, deadlines and vouching for one listening port (module docstring)."""

    def __init__(self, name: str, limits: Limits, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name  # "api", "broadcast", "relay": the metrics' and log lines' name of the port
        self.limits = limits
        self.counters = PerimeterCounters()
        self._accepts = RequestRate(limits.accepts_per_s, limits.accept_burst, clock)
        self._accepts_total = RequestRate(limits.accepts_total, 2 * limits.accepts_total, clock)
        self._requests = RequestRate(limits.requests_per_s, limits.request_burst, clock)
        self._open = 0  # connections held
        self._per_addr: dict[str, int] = {}  # address -> connections held
        self._vouched: dict[str, int] = {}  # address -> vouched connections held
        self._pre: dict[str, OrderedDict[_Conn, None]] = {}  # address -> its unvouched, oldest first
        self._pre_count = 0  # unvouched connections held
        self._by_count: dict[int, dict[str, None]] = {}  # unvouched per address -> those addresses
        self._most = 0  # the largest key of _by_count with addresses
        self._by_transport: dict[asyncio.BaseTransport, _Conn] = {}

    # ---- serving -----------------------------------------------------------------------------------
    async def serve(
        self,
        factory: Callable[[], asyncio.BaseProtocol],
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None = None,
        backlog: int = 1024,
        reuse_port: bool = False,
    ) -> asyncio.Server:
        """Listen on ``host:port``; each admitted connection gets a protocol from ``factory`` (over TLS
        with ``ssl_context`` once its handshake is done); ``reuse_port``: other processes may listen
        on it too (the kernel spreads new connections among them)."""
        loop = asyncio.get_running_loop()
        return await loop.create_server(
            lambda: _Gatekeeper(self, factory, ssl_context),
            host,
            port,
            backlog=backlog,
            reuse_port=reuse_port or None,
        )

    def vouch(self, transport: asyncio.BaseTransport | None) -> None:
        """A request on ``transport`` authenticated: it is a member's connection now (no deadline, never
        evicted). Unknown transports (a test server's, a closed one) are ignored."""
        conn = self._by_transport.get(transport) if transport is not None else None
        if conn is None or conn.vouched or conn.closed:
            return
        conn.vouched = True
        self.counters.vouched += 1
        self._vouched[conn.addr] = self._vouched.get(conn.addr, 0) + 1
        self._drop_pre(conn)
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None

    def charge(self, addr: str | None) -> float:
        """A request from ``addr`` that no identity vouches for: 0 if the address's bucket had a token,
        else the seconds until it has one (the request is refused; counted)."""
        wait = self._requests.take(addr or "?")
        if wait > 0:
            self.counters.requests_limited += 1
        return wait

    @property
    def open(self) -> int:
        """Connections held now."""
        return self._open

    @property
    def pre_auth(self) -> int:
        """Connections held now that nobody has vouched for."""
        return self._pre_count

    def metrics(self) -> dict[str, float]:
        return {
            **self.counters.metrics(self.name),
            f"perimeter/{self.name}/open": float(self._open),
            f"perimeter/{self.name}/pre_auth": float(self._pre_count),
        }

    # ---- admission -----------------------------------------------------------------------------------
    def _admit(self, raw: asyncio.BaseTransport) -> _Conn | None:
        """The rules of the module docstring for a just-accepted connection: its record, or None after
        aborting it."""
        peer = raw.get_extra_info("peername")
        addr = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        lim = self.limits
        why = None
        member_address = self._vouched.get(addr, 0) > 0  # a member is connected from it: not a stranger
        if self._accepts.take(addr) > 0 or (not member_address and self._accepts_total.take("") > 0):
            why, self.counters.refused_rate = "rate", self.counters.refused_rate + 1
        elif self._per_addr.get(addr, 0) >= lim.max_per_address and not self._evict(addr):
            why, self.counters.refused_address = "address", self.counters.refused_address + 1
        elif self._full() and not self._evict(None):
            why, self.counters.refused_full = "full", self.counters.refused_full + 1
        if why is not None:
            raw.abort()  # type: ignore[attr-defined]
            return None
        conn = _Conn(addr, raw)
        self._open += 1
        self._per_addr[addr] = self._per_addr.get(addr, 0) + 1
        self._add_pre(conn)
        self.counters.accepted += 1
        return conn

    def _full(self) -> bool:
        """No room for another connection without evicting one: the port, or its unvouched share, is full."""
        return self._pre_count >= self.limits.max_pre_auth or self._open >= self.limits.max_connections

    def _attached(self, conn: _Conn, transport: asyncio.BaseTransport) -> None:
        """``conn``'s application transport is up (after the handshake): its header deadline starts."""
        conn.transport = transport
        self._by_transport[transport] = conn
        if not conn.vouched:
            conn.timer = asyncio.get_running_loop().call_later(self.limits.header_s, self._expire, conn)

    def _expire(self, conn: _Conn) -> None:
        conn.timer = None
        if not conn.vouched and not conn.closed:
            self.counters.header_timeouts += 1
            self._close(conn)

    def _release(self, conn: _Conn) -> None:
        """``conn`` is gone: its counts are given back (once)."""
        if conn.closed:
            return
        conn.closed = True
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None
        self._drop_pre(conn)
        if conn.transport is not None:
            self._by_transport.pop(conn.transport, None)
        self._open -= 1
        if conn.vouched:
            members = self._vouched[conn.addr] - 1
            if members:
                self._vouched[conn.addr] = members
            else:
                del self._vouched[conn.addr]
        left = self._per_addr[conn.addr] - 1
        if left:
            self._per_addr[conn.addr] = left
        else:
            del self._per_addr[conn.addr]

    def _close(self, conn: _Conn) -> None:
        """Abort ``conn`` now (its descriptor goes at once) and release it."""
        target = conn.transport if conn.transport is not None else conn.raw
        target.abort()  # type: ignore[attr-defined]
        if conn.raw is not target:
            conn.raw.abort()  # type: ignore[attr-defined]
        self._release(conn)

    def _evict(self, addr: str | None) -> bool:
        """Close the oldest unvouched connection of ``addr`` (None: of the address holding the most of
        them) to make room; False when there is none."""
        if addr is None:
            if self._most == 0:
                return False
            addr = next(iter(self._by_count[self._most]))
        pending = self._pre.get(addr)
        if not pending:
            return False
        victim = next(iter(pending))
        self.counters.evicted += 1
        self._close(victim)
        return True

    # ---- the unvouched index: per address, oldest first; addresses by how many they hold ----------------
    def _add_pre(self, conn: _Conn) -> None:
        pending = self._pre.setdefault(conn.addr, OrderedDict())
        self._move(conn.addr, len(pending), len(pending) + 1)
        pending[conn] = None
        self._pre_count += 1

    def _drop_pre(self, conn: _Conn) -> None:
        pending = self._pre.get(conn.addr)
        if pending is None or conn not in pending:
            return
        del pending[conn]
        self._move(conn.addr, len(pending) + 1, len(pending))
        if not pending:
            del self._pre[conn.addr]
        self._pre_count -= 1

    def _move(self, addr: str, was: int, now: int) -> None:
        if was:
            group = self._by_count[was]
            del group[addr]
            if not group:
                del self._by_count[was]
        if now:
            self._by_count.setdefault(now, {})[addr] = None
        self._most = max(self._most, now)
        while self._most and self._most not in self._by_count:
            self._most -= 1


class _Gatekeeper(asyncio.Protocol):
    """The protocol of every accepted socket: admission (:meth:`Perimeter._admit`), then TLS with its
    deadline, then the application's protocol, to which it forwards every event (and so sees the
    connection end, to give its counts back)."""

    def __init__(
        self,
        perimeter: Perimeter,
        factory: Callable[[], asyncio.BaseProtocol],
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        self.perimeter, self.factory, self.ssl_context = perimeter, factory, ssl_context
        self.conn: _Conn | None = None
        self.inner: Any = None  # the application's protocol, once attached
        self.task: asyncio.Task[None] | None = None
        # what arrived before the application's protocol was attached: the TLS layer reads the first
        # application bytes as it finishes the handshake, before start_tls returns to us
        self.early: list[bytes] = []
        self.early_eof = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.conn = self.perimeter._admit(transport)
        if self.conn is None:
            return
        if self.ssl_context is None:
            self._attach(transport)
        else:  # the ClientHello waits in the kernel until start_tls reads it (it resumes reading)
            transport.pause_reading()  # type: ignore[attr-defined]
            self.task = asyncio.get_running_loop().create_task(self._handshake(transport))

    async def _handshake(self, raw: asyncio.BaseTransport) -> None:
        conn = self.conn
        assert conn is not None and self.ssl_context is not None
        if conn.closed:  # evicted, or gone, before the handshake began
            return
        loop = asyncio.get_running_loop()
        try:
            tls = await loop.start_tls(
                raw,  # type: ignore[arg-type]
                self,
                self.ssl_context,
                server_side=True,
                ssl_handshake_timeout=self.perimeter.limits.handshake_s,
            )
        except (OSError, ConnectionError, TimeoutError, asyncio.CancelledError):
            if not conn.closed:
                self.perimeter.counters.handshake_failed += 1
                raw.abort()  # type: ignore[attr-defined]
                self.perimeter._release(conn)
            return
        if tls is None or conn.closed:  # evicted while the handshake ran
            if tls is not None:
                tls.abort()
            return
        self._attach(tls)

    def _attach(self, transport: asyncio.BaseTransport) -> None:
        assert self.conn is not None
        self.perimeter._attached(self.conn, transport)
        self.inner = self.factory()
        self.inner.connection_made(transport)
        early, self.early = self.early, []
        for data in early:
            self.inner.data_received(data)
        # not closed twice: a second close of an asyncio TLS transport (CPython 3.11) drops its TLS
        # protocol, and aiohttp, starting the request that came before the EOF, then fails reading it
        if self.early_eof and self.inner.eof_received() is not True and not transport.is_closing():
            transport.close()

    # ---- forwarded to the application's protocol ----------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)
        else:
            self.early.append(data)

    def eof_received(self) -> bool | None:
        if self.inner is None:
            self.early_eof = True
            # kept open until the application's protocol has seen what came before; over TLS the answer
            # is ignored (the TLS layer closes after an EOF) and asyncio logs a warning at each True
            return True if self.ssl_context is None else None
        return self.inner.eof_received()  # type: ignore[no-any-return]

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.conn is not None:
            self.perimeter._release(self.conn)
        if self.inner is not None:
            inner, self.inner = self.inner, None
            inner.connection_lost(exc)
