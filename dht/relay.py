"""Reaching peers that accept no connections, through a relay peer that forwards streams.

A peer behind a NAT or a firewall (a client-mode ``Host``) can dial out but nobody can dial it.
Here it keeps a connection open to a public peer running a :class:`RelayService` and *reserves* a
slot there (RPC ``relay.reserve``, refreshed while the host runs). Anyone may then reach it at its
circuit address ``/ip4/<relay>/tcp/<port>/p2p/<relay id>/p2p-circuit/p2p/<target id>``:

1. the dialer opens a ``relay/hop`` stream to the relay, naming the target in the header;
2. the relay opens a ``relay/stop`` stream to the target over the target's own connection to it,
   naming the dialer; the target answers with a status line, then so does the relay to the dialer;
3. from then on the relay copies bytes between the two streams, both ways, within the streams'
   flow control (a slow end slows the other; the relay buffers at most a window per direction)
   and within a per-circuit budget of bytes and seconds;
4. each end runs an ordinary ``transport.Connection`` over its stream (``stream_transport``): a
   full Noise XX handshake, end to end. The relay sees only ciphertext and cannot read, alter
   (the AEAD tags fail and the connection closes) or impersonate either end: the dialer expects
   the target's PeerID and the target expects the dialer's the relay named, and the handshake
   proves both.

The relayed connection is registered with the host like any other, so ``host.call``,
``conn.open_stream`` and the DHT's RPCs work over it unchanged. It lives as long as the streams
under it: closing either end, the relay, or the connection to the relay ends it.

Status lines (relay to dialer, target to relay) are a 2-byte big-endian length and a msgpack map:
``{"ok": true}`` or ``{"ok": false, "error": "<one line>"}``.

Relays do not chain: reservations and circuits over a relayed connection are refused.

Importing this module makes every ``transport.Host`` dial circuit addresses and take reservations
(``Host.reserve_relay``) through a :class:`CircuitTransport`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import struct
import time
from collections import Counter
from typing import Any

from .aio import cancel_all, wait_event
from .connection import Connection
from .errors import DHTError, PeerUnreachable, ProtocolError, RPCError
from .identity import PeerID
from .multiaddr import Multiaddr
from .quota import address_group
from .stream import Stream, StreamReset
from .stream_transport import StreamTransport
from .tasks import TaskGroup
from .transport import CIRCUIT, Host, register_transport
from .wire import pack, unpack

log = logging.getLogger("dht.relay")

RESERVE_METHOD = "relay.reserve"
HOP_PROTOCOL = "relay/hop"
STOP_PROTOCOL = "relay/stop"

_STATUS_LEN = struct.Struct(">H")
MAX_STATUS = 1024
#: how long one end waits for the other's status line
STATUS_TIMEOUT = 10.0

DEFAULT_RESERVATION_TTL = 120.0
DEFAULT_MAX_RESERVATIONS = 128
DEFAULT_MAX_CIRCUITS = 256
DEFAULT_MAX_CIRCUITS_PER_PEER = 16
#: a circuit carries training traffic (averaging rounds of many MB), not only DHT RPCs: the budget
#: bounds what one circuit costs the relay, and a dialer simply dials again when it runs out
DEFAULT_CIRCUIT_BYTES = 1 << 30
DEFAULT_CIRCUIT_SECONDS = 3600.0


class RelayRefused(PeerUnreachable):
    """The relay would not (or could not) set up the circuit; the message says why."""


class CircuitLimit(DHTError):
    """A circuit used up its byte or time budget at the relay."""


def relayed_via(conn: Connection) -> PeerID | None:
    """The relay that ``conn`` runs through, or None for a direct connection."""
    transport = conn._transport
    return transport.get_extra_info("relay") if isinstance(transport, StreamTransport) else None


# ---------------------------------------------------------------------------------- status lines


async def write_message(stream: Stream, obj: Any, timeout: float = STATUS_TIMEOUT) -> None:
    """Send ``obj`` as one 2-byte-length msgpack message (status lines, hole punch messages)."""
    body = pack(obj)
    await stream.write(_STATUS_LEN.pack(len(body)) + body, timeout=timeout)


async def read_message(stream: Stream, buf: bytearray, timeout: float = STATUS_TIMEOUT,
                       max_size: int = MAX_STATUS) -> Any:
    """The next message ``write_message`` sent on ``stream``; ``buf`` keeps the bytes read past it."""
    try:
        async with asyncio.timeout(timeout):
            while True:
                if len(buf) >= _STATUS_LEN.size:
                    (n,) = _STATUS_LEN.unpack_from(buf)
                    if n > max_size:
                        raise ProtocolError(f"{stream.protocol} message of {n} bytes from {stream.peer_id}")
                    if len(buf) >= _STATUS_LEN.size + n:
                        break
                chunk = await stream.read()
                if chunk is None:
                    raise PeerUnreachable(f"{stream.peer_id} closed the {stream.protocol} stream before answering")
                buf += chunk
    except TimeoutError:
        raise PeerUnreachable(f"no answer from {stream.peer_id} on {stream.protocol} within {timeout} s") from None
    end = _STATUS_LEN.size + n
    msg = unpack(memoryview(buf)[_STATUS_LEN.size:end])
    del buf[:end]
    return msg


async def write_status(stream: Stream, error: str | None = None) -> None:
    await write_message(stream, {"ok": True} if error is None else {"ok": False, "error": error[:500]})


async def read_status(stream: Stream, timeout: float = STATUS_TIMEOUT) -> tuple[str | None, bytes]:
    """(None if ok, else the peer's reason; the bytes that followed the status line)."""
    buf = bytearray()
    msg = await read_message(stream, buf, timeout)
    if not isinstance(msg, dict) or not isinstance(msg.get("ok"), bool):
        raise ProtocolError(f"malformed status line from {stream.peer_id}")
    error = None if msg["ok"] else str(msg.get("error") or "refused")
    return error, bytes(buf)


async def _accepted(stream: Stream, refused: str) -> bytes:
    """Wait for the other end's status line on ``stream``: the bytes that followed it when it says
    ok; else the stream is reset and RelayRefused(``refused: <its reason>``) raised."""
    try:
        error, leftover = await read_status(stream)
    except BaseException:
        stream.reset("no status")
        raise
    if error is not None:
        stream.reset("refused")
        raise RelayRefused(f"{refused}: {error}")
    return leftover


def _is_endpoint(host: Any, port: Any) -> bool:
    """Whether (``host``, ``port``), from a peer, is an IP address and a TCP port."""
    if not (isinstance(host, str) and isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536):
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _peer_of(header: Any) -> PeerID:
    if not isinstance(header, dict) or not isinstance(header.get("peer"), bytes):
        raise ProtocolError("relay stream header must be {'peer': <peer id bytes>}")
    try:
        return PeerID(header["peer"])
    except ValueError as e:
        raise ProtocolError(f"relay stream header: {e}") from None


# ---------------------------------------------------------------------------------- relay side


class Reservations:
    """Which peers may be reached through us, until when, and over which connection. Sans-IO:
    callers pass the time, so expiry is tested without sleeping.

    One slot per PeerID, and, since PeerIDs are free, fairness per address group
    (``quota.address_group``): when the table is full, a peer whose group holds fewer slots than
    the largest group takes the soonest-expiring slot of that group. Sybils from one address can
    fill an idle relay but not keep other addresses out of it. (No fixed cap per address: peers
    behind one NAT, the very peers that need a relay, share one.)"""

    def __init__(self, max_reservations: int, ttl: float):
        self.max_reservations = max_reservations
        self.ttl = ttl
        self._by_peer: dict[PeerID, tuple[Any, float, str | None]] = {}  # peer -> (its connection, expiry, group)

    def __len__(self) -> int:
        return len(self._by_peer)

    def reserve(self, peer: PeerID, conn: Any, now: float, group: str | None = None) -> float:
        """Record or refresh ``peer``'s slot (its address group ``group``); returns its expiry.
        RelayRefused when full and ``group`` holds about as many slots as the largest group."""
        self.expire(now)
        if peer not in self._by_peer and len(self._by_peer) >= self.max_reservations:
            self._evict_for(group)
        expiry = now + self.ttl
        self._by_peer[peer] = (conn, expiry, group)
        return expiry

    def _evict_for(self, group: str | None) -> None:
        held = Counter(g for _c, _e, g in self._by_peer.values())
        largest, most = held.most_common(1)[0]
        if largest == group or most <= held[group] + 1:
            raise RelayRefused(f"relay is full: {self.max_reservations} reservations held, try another relay")
        victim = min((p for p, (_c, _e, g) in self._by_peer.items() if g == largest), key=lambda p: self._by_peer[p][1])
        log.info("relay full: dropped %s's reservation (%d held from %s) for a peer from %s",
                 victim, most, largest, group)
        del self._by_peer[victim]

    def lookup(self, peer: PeerID, now: float) -> Any | None:
        entry = self._by_peer.get(peer)
        if entry is None:
            return None
        if entry[1] <= now:
            del self._by_peer[peer]
            return None
        return entry[0]

    def drop(self, peer: PeerID) -> None:
        self._by_peer.pop(peer, None)

    def expire(self, now: float) -> None:
        for peer in [p for p, (_c, expiry, _g) in self._by_peer.items() if expiry <= now]:
            del self._by_peer[peer]

    def clear(self) -> None:
        self._by_peer.clear()


class _Budget:
    """Bytes a circuit may still carry (both directions together); None: no limit."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.used = 0

    def spend(self, n: int) -> None:
        self.used += n
        if self.limit is not None and self.used > self.limit:
            raise CircuitLimit(f"relay circuit limit: more than {self.limit} bytes relayed")


async def _pump(src: Stream, dst: Stream, budget: _Budget) -> None:
    # The read returns credit to ``src``'s sender only once the chunk is taken; ``dst.write``
    # waits for ``dst``'s credit: a slow reader at one end therefore slows the writer at the other.
    while (chunk := await src.read()) is not None:
        budget.spend(len(chunk))
        await dst.write(chunk)
    dst.write_eof()


async def splice(a: Stream, b: Stream, *, max_bytes: int | None, max_seconds: float | None) -> None:
    """Copy ``a`` to ``b`` and ``b`` to ``a`` until both directions end; a reset, a budget or the
    deadline running out, or cancellation resets both streams with the reason."""
    loop = asyncio.get_running_loop()
    budget = _Budget(max_bytes)
    pumps = [loop.create_task(_pump(a, b, budget)), loop.create_task(_pump(b, a, budget))]
    reason: str | None = None
    try:
        async with asyncio.timeout(max_seconds):
            done, _pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
    except TimeoutError:
        reason = f"relay circuit limit: open for more than {max_seconds:g} s"
    except (CircuitLimit, StreamReset, DHTError) as e:
        reason = str(e)
    except asyncio.CancelledError:
        reason = "relay closing"
        raise
    finally:
        await cancel_all(pumps)
        if reason is not None:
            a.reset(reason[:200])
            b.reset(reason[:200])


class RelayService:
    """Run on a public (listening) peer: lets peers reserve a slot and forwards circuits to them.

    ``circuit_bytes``/``circuit_seconds`` bound each circuit (None: unbounded); past them both
    ends see the circuit reset with a reason that says which limit ended it.
    """

    def __init__(
        self,
        host: Host,
        *,
        max_reservations: int = DEFAULT_MAX_RESERVATIONS,
        max_circuits: int = DEFAULT_MAX_CIRCUITS,
        max_circuits_per_peer: int = DEFAULT_MAX_CIRCUITS_PER_PEER,
        circuit_bytes: int | None = DEFAULT_CIRCUIT_BYTES,
        circuit_seconds: float | None = DEFAULT_CIRCUIT_SECONDS,
        reservation_ttl: float = DEFAULT_RESERVATION_TTL,
    ):
        if host.client_mode:
            raise ValueError("a relay must accept connections: a client-mode host cannot run a RelayService")
        self.host = host
        self.max_circuits = max_circuits
        self.max_circuits_per_peer = max_circuits_per_peer
        self.circuit_bytes = circuit_bytes
        self.circuit_seconds = circuit_seconds
        self.reservations = Reservations(max_reservations, reservation_ttl)
        self._circuits: dict[asyncio.Task, PeerID] = {}  # circuit task -> its target
        self._unsubscribe = None
        self._started = False

    @property
    def circuits(self) -> int:
        """Circuits being set up or forwarding now."""
        return len(self._circuits)

    def start(self) -> None:
        """Answer reservations and hop streams on the host (started or not)."""
        if self._started:
            return
        self._started = True
        self.host.on_request(RESERVE_METHOD, self._on_reserve)
        self.host.on_stream(HOP_PROTOCOL, self._on_hop)
        self._unsubscribe = self.host.on_disconnect(self.reservations.drop)

    async def close(self) -> None:
        """Refuse new reservations and circuits, end every circuit (both ends see a reset)."""
        if not self._started:
            return
        self._started = False
        self.host.off_request(RESERVE_METHOD, self._on_reserve)
        self.host.off_stream(HOP_PROTOCOL)
        if self._unsubscribe is not None:
            self._unsubscribe()
        self.reservations.clear()
        await cancel_all(self._circuits)

    async def __aenter__(self) -> RelayService:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _on_reserve(self, conn: Connection, args: Any) -> dict:
        if relayed_via(conn) is not None:
            raise RelayRefused("reservations are only taken over a direct connection (relays do not chain)")
        assert conn.remote_peer is not None
        self.reservations.reserve(conn.remote_peer, conn, time.monotonic(), address_group(conn.remote_host))
        return {"ttl": self.reservations.ttl, "bytes": self.circuit_bytes, "seconds": self.circuit_seconds,
                "observed": [conn.remote_host, conn.remote_port]}  # where the reserver's NAT maps it

    async def _on_hop(self, stream: Stream) -> None:
        task = asyncio.current_task()
        assert task is not None
        source = stream.peer_id
        try:
            target = _peer_of(stream.header)
            self._admit(stream, target)
        except DHTError as e:
            await write_status(stream, str(e))
            return
        self._circuits[task] = target
        stop: Stream | None = None
        try:
            try:
                stop, leftover = await self._open_stop(source, target)
            except DHTError as e:
                await write_status(stream, str(e))
                return
            await write_status(stream)
            if leftover:
                await stream.write(leftover)
            log.debug("relaying %s -> %s", source, target)
            await splice(stream, stop, max_bytes=self.circuit_bytes, max_seconds=self.circuit_seconds)
        finally:
            del self._circuits[task]
            if stop is not None and not stop.closed:
                stop.reset("relay closing")

    def _admit(self, stream: Stream, target: PeerID) -> None:
        if relayed_via(stream._conn) is not None:
            raise RelayRefused("circuits are only relayed for direct connections (relays do not chain)")
        if target == stream.peer_id:
            raise RelayRefused("cannot relay a peer to itself")
        if len(self._circuits) >= self.max_circuits:
            raise RelayRefused(f"relay is busy: {self.max_circuits} circuits open, try again later")
        if sum(1 for t in self._circuits.values() if t == target) >= self.max_circuits_per_peer:
            raise RelayRefused(f"relay is busy: {self.max_circuits_per_peer} circuits to {target} open")

    async def _open_stop(self, source: PeerID, target: PeerID) -> tuple[Stream, bytes]:
        conn = self.reservations.lookup(target, time.monotonic())
        if conn is None or conn.is_closed:
            self.reservations.drop(target)
            raise RelayRefused(f"{target} has no reservation at this relay (not connected, or it expired)")
        stop = await conn.open_stream(STOP_PROTOCOL, {"peer": source.to_bytes()})
        return stop, await _accepted(stop, f"{target} refused the circuit")


# ---------------------------------------------------------------------------------- both ends


async def dial_circuit(host: Host, addr: Multiaddr, timeout: float = 5.0) -> Connection:
    """A secure connection to ``addr.peer_id`` through the relay of circuit address ``addr``.

    The Noise handshake runs end to end and expects the target's PeerID: a relay that connects
    us to anyone else fails it (HandshakeError). Raises RelayRefused when the relay says no."""
    target = addr.peer_id
    if addr.relay_id is None or target is None:
        raise ValueError(f"{addr} is not a circuit address")
    try:
        async with asyncio.timeout(timeout):
            return await _dial_circuit(host, addr, target)
    except TimeoutError:
        raise PeerUnreachable(f"dial to {target} through relay {addr.relay_id} timed out after {timeout} s") from None


async def _dial_circuit(host: Host, addr: Multiaddr, target: PeerID) -> Connection:
    relay_conn = await host.connect_addr(addr.relay_addr)
    if relayed_via(relay_conn) is not None:
        raise RelayRefused(f"relay {addr.relay_id} is itself reached through a relay: relays do not chain")
    stream = await relay_conn.open_stream(HOP_PROTOCOL, {"peer": target.to_bytes()})
    try:
        leftover = await _accepted(stream, f"relay {addr.relay_id} cannot reach {target}")
    except StreamReset as e:
        raise RelayRefused(f"peer {addr.relay_id} does not relay (is it running with --relay?): {e}") from None
    conn = Connection(host, initiator=True, expected_peer=target)
    transport = StreamTransport(stream, conn, extra={"relay": addr.relay_id}, leftover=leftover)
    # Owned by the connection to the relay: the circuit cannot outlive it.
    relay_conn._spawn(transport.run())
    try:
        return await conn.ready
    except BaseException:
        conn.close("dial failed", abort=True)
        raise


class RelayClient:
    """Keeps this host reachable through relays: one reservation per relay, refreshed while the
    host runs, and the ``relay/stop`` handler that turns incoming circuits into connections.

    Use through ``Host.reserve_relay`` (which closes it with the host)."""

    def __init__(self, host: Host, *, retry_max: float = 30.0):
        self.host = host
        self.retry_max = retry_max
        self._relays: dict[PeerID, Multiaddr] = {}  # relay id -> our circuit address through it
        self._active: set[PeerID] = set()  # relays whose reservation is current
        self._tasks = TaskGroup("relay client", log=log)  # one reservation keeper per relay
        self._wake: dict[PeerID, asyncio.Event] = {}
        host.on_stream(STOP_PROTOCOL, self._on_stop)
        self._unsubscribe = host.on_disconnect(self._on_disconnect)

    @property
    def addrs(self) -> list[Multiaddr]:
        """Our circuit addresses through relays that hold a current reservation for us."""
        return [a for r, a in self._relays.items() if r in self._active]

    async def reserve(self, relay: Multiaddr | str, timeout: float = 5.0) -> Multiaddr:
        """Reserve a slot at ``relay`` (its full address, with /p2p/<id>) and keep it; returns our
        circuit address through it. Raises what the first attempt raised (e.g. RelayRefused when
        the relay is full): later failures are retried in the background until close()."""
        addr = Multiaddr.parse(relay) if isinstance(relay, str) else relay
        if addr.peer_id is None or addr.is_circuit:
            raise ValueError(f"relay address {addr} must be a direct address ending in /p2p/<relay id>")
        circuit = addr.circuit(self.host.peer_id)
        if addr.peer_id in self._relays:
            return circuit
        first: asyncio.Future[float] = self.host.loop.create_future()
        self._relays[addr.peer_id] = circuit
        self._wake[addr.peer_id] = asyncio.Event()
        task = self._tasks.spawn(self._keep(addr, timeout, first))

        def ended(t: asyncio.Task) -> None:  # never leave reserve() waiting on a task that is gone
            if not first.done():
                first.set_exception(PeerUnreachable("relay client closed") if t.cancelled() or t.exception() is None
                                    else t.exception())
        task.add_done_callback(ended)
        try:
            await asyncio.shield(first)
        except BaseException:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self._forget(addr.peer_id)
            raise
        return circuit

    def _forget(self, relay: PeerID) -> None:
        self._relays.pop(relay, None)
        self._wake.pop(relay, None)
        self._active.discard(relay)

    async def _keep(self, addr: Multiaddr, timeout: float, first: asyncio.Future[float]) -> None:
        relay = addr.peer_id
        assert relay is not None
        wake = self._wake[relay]
        delay = 1.0
        while True:
            try:
                conn = await self.host.connect_addr(addr, timeout)
                if relayed_via(conn) is not None:
                    raise RelayRefused(f"relay {relay} is only reached through another relay")
                try:
                    reply = await conn.call(RESERVE_METHOD, None, timeout)
                except RPCError as e:  # e.g. full, or no relay there: say so in the relay's words
                    hint = " (is it running with --relay?)" if "unknown method" in str(e) else ""
                    raise RelayRefused(f"relay {relay} refused the reservation{hint}: {e}") from None
                ttl = reply.get("ttl") if isinstance(reply, dict) else None
                if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or ttl <= 0:
                    raise ProtocolError(f"relay {relay} answered the reservation with {reply!r}")
                observed = reply.get("observed")
                if isinstance(observed, list) and len(observed) == 2 and _is_endpoint(*observed):
                    self.host.note_observed(relay, (observed[0], observed[1]))
                self._set_active(relay, True)
                if not first.done():
                    first.set_result(float(ttl))
                delay = 1.0
                # Refresh well before expiry, and often enough that the idle watchdog of either
                # side never closes the connection the circuits need.
                wait = min(float(ttl) / 3, self.host.limits.idle_timeout / 3)
            except DHTError as e:
                self._set_active(relay, False)
                if not first.done():
                    first.set_exception(e)
                    return
                log.info("reservation at relay %s failed (%s); retrying in %.0f s", relay, e, delay)
                wait, delay = delay, min(delay * 2, self.retry_max)
            wake.clear()
            await wait_event(wake, wait)  # set when the connection to the relay closes

    def _set_active(self, relay: PeerID, active: bool) -> None:
        """Note whether ``relay`` holds a reservation for us; tell our peers when that changes."""
        if (relay in self._active) != active:
            (self._active.add if active else self._active.discard)(relay)
            self.host.announce_addrs()

    def _on_disconnect(self, peer: PeerID) -> None:
        if peer in self._wake:
            self._set_active(peer, False)
            self._wake[peer].set()

    async def _on_stop(self, stream: Stream) -> None:
        relay = stream.peer_id
        try:
            if relay not in self._active:
                raise RelayRefused("no reservation of ours at this peer")
            if relayed_via(stream._conn) is not None:
                raise RelayRefused("relays do not chain")
            source = _peer_of(stream.header)
        except DHTError as e:
            await write_status(stream, str(e))
            return
        await write_status(stream)
        # The relay named the dialer: the handshake holds it to that (it cannot substitute anyone).
        conn = Connection(self.host, initiator=False, expected_peer=source)
        await StreamTransport(stream, conn, extra={"relay": relay}).run()

    async def close(self) -> None:
        """Stop refreshing reservations (the relay lets them expire) and accepting circuits."""
        self.host.off_stream(STOP_PROTOCOL)
        self._unsubscribe()
        await self._tasks.close()
        for relay in list(self._relays):
            self._forget(relay)


class CircuitTransport:
    """A host's transport for circuit addresses (``transport.PeerTransport``): dials through the
    relay an address names, and listens through relays that hold a reservation for us (a
    ``RelayClient``, made on the first one)."""

    def __init__(self, host: Host):
        from .holepunch import HolePuncher  # (it builds on this module)

        self.host = host
        self._client: RelayClient | None = None
        #: upgrades relayed connections to direct ones where NAT allows (``dht.holepunch``)
        self.puncher = HolePuncher(host)

    @property
    def addrs(self) -> list[Multiaddr]:
        return self._client.addrs if self._client is not None else []

    async def dial(self, addr: Multiaddr, timeout: float) -> Connection:
        return await dial_circuit(self.host, addr, timeout)

    async def listen(self, addr: Multiaddr | str, timeout: float) -> Multiaddr:
        if self._client is None:
            self._client = RelayClient(self.host)
        return await self._client.reserve(addr, timeout)

    async def close(self) -> None:
        await self.puncher.close()
        if self._client is not None:
            await self._client.close()


register_transport(CIRCUIT, CircuitTransport)
