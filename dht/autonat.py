"""Whether other peers can dial us: a few peers are asked to dial our listen port back, as
libp2p's AutoNAT does. A node behind NAT learns it this way (``DHTNode(reachable=None)``) and
then reserves at relays (``reserve_relays``) and announces circuit addresses through them instead
of a direct address nobody can reach.

The peer dials back the address our connection comes from, on the port we name: never an
address we choose, so nobody can make it dial a third party.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from .connection import Connection
from .errors import DHTError, ProtocolError
from .identity import PeerID
from .multiaddr import Multiaddr
from .relay import relayed_via
from .transport import Host

log = logging.getLogger("dht.autonat")

DIALBACK_METHOD = "autonat.dial"
#: how long a dial-back may take (a NAT drops the SYN: the dial times out)
DIALBACK_TIMEOUT = 3.0
#: peers asked at once
PROBES = 3


async def dial_back(host: Host, conn: Connection, args: Any) -> dict[str, bool]:
    """Serve a dial-back request: dial the caller at its own address on the port it names."""
    port = args.get("port") if isinstance(args, dict) else None
    if not (isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536):
        raise ProtocolError(f"{DIALBACK_METHOD} takes {{'port': <1..65535>}}")
    if conn.remote_host is None or relayed_via(conn) is not None or conn.remote_peer is None:
        raise ProtocolError(f"{DIALBACK_METHOD} needs a direct connection")
    try:
        back = await host.dial_new(conn.remote_host, port, conn.remote_peer, DIALBACK_TIMEOUT)
    except DHTError as e:
        log.debug("dial-back to %s at %s:%d failed: %s", conn.remote_peer, conn.remote_host, port, e)
        return {"ok": False}
    back.close("dial-back done")
    return {"ok": True}


def verdict(replies: list[Any]) -> bool | None:
    """Reachable if any peer reached us, not if peers answered and none did, None if no one answered."""
    answers = [r.get("ok") for r in replies if isinstance(r, dict) and isinstance(r.get("ok"), bool)]
    return any(answers) if answers else None


async def probe_reachable(host: Host, peers: list[PeerID]) -> bool | None:
    """Ask up to ``PROBES`` of ``peers`` (directly connected ones) to dial our listen port back."""
    conns = [c for c in (host.connection(p) for p in peers) if c is not None and relayed_via(c) is None]
    if host.listen_port is None or not conns:
        return None

    async def ask(conn: Connection) -> Any:
        return await conn.call(DIALBACK_METHOD, {"port": host.listen_port}, DIALBACK_TIMEOUT + 2.0)

    replies = await asyncio.gather(*(ask(c) for c in conns[:PROBES]), return_exceptions=True)
    return verdict(list(replies))


async def reserve_relays(host: Host, candidates: list[Multiaddr], want: int, timeout: float = 5.0) -> list[Multiaddr]:
    """Reserve at ``candidates`` (public peers' full addresses, in order; those that are no relay
    or are full are skipped) until ``want`` relays hold a reservation for us; returns our circuit
    addresses."""
    for addr in candidates:
        if len(host.circuit_addrs) >= want:
            break
        try:
            await host.reserve_relay(addr, timeout)
        except (DHTError, ValueError) as e:
            log.debug("no reservation at %s: %s", addr, e)
    return host.circuit_addrs
