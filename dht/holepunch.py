"""Direct connections to peers behind NAT: hole punching coordinated over a relayed connection,
as libp2p's DCUtR does.

When a peer behind NAT (B, ``Host(reachable=False)``) accepts a connection through a relay from
A, B opens a ``dht/holepunch`` stream on it and the two exchange, as 2-byte-length msgpack maps:

1. B -> A ``{"addrs": [[ip, port], ...]}``: where B's NAT maps B's listen port, as relays saw it
   (``Host.observed_addrs``); B starts a clock.
2. A -> B ``{"addrs": [...], "reachable": bool}``: A's listen addresses if A is reachable, else
   A's observed ones. B now knows the round-trip time over the relay.
3. If A is reachable, B just dials it (connection reversal). Else B -> A ``{"sync": true}`` and
   B waits half the round trip; A dials B's addresses as soon as SYNC arrives. Both therefore send
   their SYN at about the same moment, each from its listen port (SO_REUSEADDR/SO_REUSEPORT), so
   each NAT sees an outgoing connection before the other's SYN reaches it and lets it in: a TCP
   simultaneous open. On it A is the Noise initiator and B the responder, whoever's SYN won.

The direct connection, authenticated like any other (the handshake proves the expected PeerID),
is registered with the host, which sends on a direct connection rather than a relayed one from
then on; the relayed connection stays until it idles out, and the peer's circuit addresses stay
its way in when the direct connection goes. B tries up to ``ROUNDS`` times. Endpoint-independent
NAT mappings (full cone, port-restricted cone) let this work; a symmetric NAT maps each
destination to a new port, so the observed port is wrong and the relay remains the only way.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from dataclasses import dataclass
from typing import Any

from .connection import Connection
from .errors import DHTError, PeerUnreachable, ProtocolError
from .identity import PeerID
from .relay import read_message, relayed_via, write_message
from .stream import Stream
from .tasks import TaskGroup
from .transport import CIRCUIT, Host

log = logging.getLogger("dht.holepunch")

PROTOCOL = "dht/holepunch"
MAX_ADDRS = 8
ROUNDS = 3
#: how long one round waits for a message, and for the simultaneous open
MESSAGE_TIMEOUT = 10.0
PUNCH_TIMEOUT = 5.0
#: once our own dials failed, how long the other side's may still take to finish its handshake
GRACE = 1.0
_MAX_MESSAGE = 2048

# ---------------------------------------------------------------------------------- sans-IO


def parse_addrs(obj: Any) -> list[tuple[str, int]]:
    """Validated ``[[ip, port], ...]`` from a peer (at most ``MAX_ADDRS``); ProtocolError if malformed."""
    if not isinstance(obj, list) or len(obj) > MAX_ADDRS:
        raise ProtocolError(f"hole punch addresses must be a list of at most {MAX_ADDRS}")
    out: list[tuple[str, int]] = []
    for item in obj:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], int)
                and not isinstance(item[1], bool) and 0 < item[1] < 65536):
            raise ProtocolError("hole punch address must be [ip, port]")
        try:
            ip = ipaddress.ip_address(item[0])
        except ValueError:
            raise ProtocolError(f"hole punch address {item[0][:60]!r} is not an IP address") from None
        if ip.is_unspecified or ip.is_multicast:
            raise ProtocolError(f"hole punch address {ip} cannot be dialed")
        if (str(ip), item[1]) not in out:
            out.append((str(ip), item[1]))
    return out


def candidates(observed: list[tuple[str, int]], listen_port: int | None) -> list[tuple[str, int]]:
    """Where a peer should punch to reach us: each address peers observed for us, and that address
    with our listen port (a NAT that keeps source ports maps our listen port to itself)."""
    out: list[tuple[str, int]] = []
    for ip, port in observed:
        for cand in ((ip, listen_port), (ip, port)) if listen_port else ((ip, port),):
            if cand not in out:
                out.append(cand)  # type: ignore[arg-type]
    return out[:MAX_ADDRS]


def parse_connect(msg: Any) -> tuple[list[tuple[str, int]], bool]:
    """(addresses, reachable) from a CONNECT message."""
    if not isinstance(msg, dict):
        raise ProtocolError("hole punch CONNECT must be a map")
    reachable = msg.get("reachable", False)
    if not isinstance(reachable, bool):
        raise ProtocolError("hole punch 'reachable' must be a bool")
    return parse_addrs(msg.get("addrs")), reachable


def sync_delay(rtt: float) -> float:
    """How long B waits after sending SYNC before dialing: A dials when SYNC arrives, half a
    round trip later, so both SYNs leave together."""
    return max(0.0, rtt / 2)


@dataclass
class PunchStats:
    """What this host's hole punching achieved, counted per relayed connection it accepted (the
    side that drives the punch): each pair's punch is counted once, at one end."""

    attempts: int = 0  # relayed connections we tried to upgrade
    direct: int = 0  # ... that a simultaneous open made direct
    reversed: int = 0  # ... made direct by dialing a reachable peer
    failed: int = 0  # ... that stayed relayed after every round

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def punch_stats(host: Host) -> PunchStats:
    """What ``host``'s hole punching achieved so far (all zero before it dialed or reserved a circuit)."""
    transport = host._transports.get(CIRCUIT)
    puncher = getattr(transport, "puncher", None)
    return puncher.stats if isinstance(puncher, HolePuncher) else PunchStats()


# ---------------------------------------------------------------------------------- IO


class HolePuncher:
    """Upgrades this host's relayed connections to direct ones (module doc); made with the host's
    circuit transport (``relay.CircuitTransport``), closed with it."""

    def __init__(self, host: Host):
        self.host = host
        self.stats = PunchStats()
        self._tasks = TaskGroup("hole punch", log=log)
        self._punching: dict[PeerID, asyncio.Task] = {}  # B side: the upgrade under way per peer
        host.on_stream(PROTOCOL, self._on_stream)
        host.on_connect.append(self._on_connect)

    async def close(self) -> None:
        self.host.off_stream(PROTOCOL)
        if self._on_connect in self.host.on_connect:
            self.host.on_connect.remove(self._on_connect)
        await self._tasks.close()

    def _our_addrs(self) -> tuple[list[tuple[str, int]], bool]:
        h = self.host
        if h.reachable:
            return [(a.host, a.port) for a in h.listen_addrs if not a.is_circuit][:MAX_ADDRS], True
        return candidates(h.observed_addrs, h.listen_port), False

    def _on_connect(self, conn: Connection) -> None:
        peer = conn.remote_peer
        # B: a connection through a relay that we accepted, while we listen behind NAT
        if (peer is None or conn.initiator or relayed_via(conn) is None or self.host.reachable
                or self.host.listen_port is None or peer in self._punching or self._tasks.closed):
            return
        self._punching[peer] = self._tasks.spawn(self._upgrade(conn, peer))

    async def settled(self, peer: PeerID) -> None:
        """Wait until no upgrade of a relayed connection to ``peer`` is under way."""
        task = self._punching.get(peer)
        if task is not None:
            await asyncio.wait([task])

    def _direct(self, peer: PeerID) -> bool:
        conn = self.host.connection(peer)
        return conn is not None and relayed_via(conn) is None

    async def _upgrade(self, relayed: Connection, peer: PeerID) -> None:
        self.stats.attempts += 1
        try:
            for attempt in range(ROUNDS):
                if self._direct(peer) or relayed.is_closed:
                    break
                try:
                    await self._round(relayed, peer)
                except (DHTError, OSError, TimeoutError) as e:
                    log.debug("hole punch to %s, round %d: %s", peer, attempt + 1, e)
            if not self._direct(peer):
                self.stats.failed += 1
                log.info("no direct connection to %s after %d hole punch rounds; staying relayed", peer, ROUNDS)
        finally:
            self._punching.pop(peer, None)

    async def _round(self, relayed: Connection, peer: PeerID) -> None:
        """One exchange as B (the side the relayed connection reached)."""
        loop = asyncio.get_running_loop()
        stream = await relayed.open_stream(PROTOCOL, None)
        buf = bytearray()
        try:
            addrs, _ = self._our_addrs()
            t0 = loop.time()
            await write_message(stream, {"addrs": [list(a) for a in addrs]})
            theirs, reachable = parse_connect(await read_message(stream, buf, MESSAGE_TIMEOUT, _MAX_MESSAGE))
            rtt = loop.time() - t0
            if not theirs:
                raise PeerUnreachable(f"{peer} has no address to punch to")
            if reachable:
                stream.write_eof()
                await self.host.dial_new(*theirs[0], peer, timeout=PUNCH_TIMEOUT)
                self.stats.reversed += 1
                return
            await write_message(stream, {"sync": True})
            await asyncio.sleep(sync_delay(rtt))
            await self._punch(peer, theirs, initiator=False)
            self.stats.direct += 1
        finally:
            if not stream.closed:
                stream.write_eof()

    async def _on_stream(self, stream: Stream) -> None:
        """A: the peer behind the relayed connection asks us to punch."""
        peer = stream.peer_id
        buf = bytearray()
        try:
            theirs, _ = parse_connect(await read_message(stream, buf, MESSAGE_TIMEOUT, _MAX_MESSAGE))
            addrs, reachable = self._our_addrs()
            await write_message(stream, {"addrs": [list(a) for a in addrs], "reachable": reachable})
            if reachable:
                return  # B dials us
            msg = await read_message(stream, buf, MESSAGE_TIMEOUT, _MAX_MESSAGE)
            if not (isinstance(msg, dict) and msg.get("sync") is True):
                raise ProtocolError("hole punch: expected SYNC")
            if self.host.listen_port is None or not theirs:
                raise PeerUnreachable("nothing to punch from or to")
            await self._punch(peer, theirs, initiator=True)
        except (DHTError, OSError, TimeoutError) as e:
            log.debug("hole punch from %s: %s", peer, e)
        finally:
            if not stream.closed:
                stream.write_eof()

    async def _punch(self, peer: PeerID, addrs: list[tuple[str, int]], initiator: bool) -> None:
        """Dial every address of ``peer`` at once from our listen port; the first TCP connection
        up carries a handshake in which we are ``initiator``, the other dials are cancelled. Done
        as soon as the host has a direct connection to ``peer``, whichever side's dial made it
        (without NAT in between, the other side's dial may reach our listener first)."""
        loop = asyncio.get_running_loop()
        appeared = asyncio.Event()

        def watch(conn: Connection) -> None:
            if conn.remote_peer == peer and relayed_via(conn) is None:
                appeared.set()

        if self._direct(peer):
            return
        self.host.on_connect.append(watch)
        tries = [loop.create_task(self._open(addr)) for addr in addrs]
        waiter = loop.create_task(appeared.wait())
        sock: socket.socket | None = None
        used: socket.socket | None = None  # the socket a Connection took over
        try:
            async with asyncio.timeout(PUNCH_TIMEOUT):
                pending: set[asyncio.Task] = {*tries, waiter}
                while sock is None and not appeared.is_set() and len(pending) > 1:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    sock = next((t.result() for t in done if t is not waiter and t.exception() is None), None)
                if sock is None and not appeared.is_set():  # the other side's dial may be finishing
                    await asyncio.wait([waiter], timeout=GRACE)
                if sock is not None and not appeared.is_set():
                    used = sock
                    _, conn = await loop.create_connection(
                        lambda: Connection(self.host, initiator=initiator, expected_peer=peer), sock=sock)
                    try:
                        await conn.ready
                    except BaseException:
                        conn.close("hole punch handshake failed", abort=True)
                        if not appeared.is_set():
                            raise
        except TimeoutError:
            pass
        finally:
            self.host.on_connect.remove(watch)
            for t in (*tries, waiter):
                t.cancel()
            for result in await asyncio.gather(*tries, return_exceptions=True):
                if isinstance(result, socket.socket) and result is not used:
                    result.close()
            await asyncio.gather(waiter, return_exceptions=True)
        if not self._direct(peer):
            raise PeerUnreachable(f"simultaneous open to {peer} at {addrs} failed")

    async def _open(self, addr: tuple[str, int]) -> socket.socket:
        """A TCP connection to ``addr`` from our listen port (SYN retransmits keep it trying)."""
        family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((self.host.listen_host or "", self.host.listen_port))
            await asyncio.get_running_loop().sock_connect(sock, addr)
            return sock
        except BaseException:
            sock.close()
            raise
