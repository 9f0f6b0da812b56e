"""``--relay`` and ``--relay-via``: the relay options shared by ``p2ptrain dht`` and ``p2ptrain peer``.

A public peer started with ``--relay`` forwards circuits (``dht.relay``) to peers that accept no
connections; such a peer (``--client`` behind a NAT) started with ``--relay-via <relay address>``
reserves a slot there and becomes reachable at its circuit address, printed with its others.
"""

from __future__ import annotations

import argparse
from typing import Any

from dht import ConfigError, Multiaddr


def add_relay_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--relay", action="store_true",
                   help="also relay for peers that accept no connections (a public, listening peer only): they "
                   "reserve a slot here and become reachable through it, end-to-end encrypted")
    p.add_argument("--relay-via", action="append", metavar="MULTIADDR",
                   help="become reachable through this relay (a peer started with --relay; repeatable), e.g. "
                   "with --client behind a NAT; the circuit address is printed with the others")


def relay_vias(args: argparse.Namespace, listening: bool) -> list[Multiaddr]:
    """The parsed ``--relay-via`` addresses; a ConfigError for options that cannot work."""
    if getattr(args, "relay", False) and not listening:
        raise ConfigError("--relay needs a listening peer (it forwards connections to others): drop --client")
    vias = [Multiaddr.parse(a) for a in (getattr(args, "relay_via", None) or [])]
    for a in vias:
        if a.peer_id is None or a.is_circuit:
            raise ConfigError(f"--relay-via {a}: give the relay's own full address, ending in /p2p/<relay id>")
    return vias


async def start_relaying(host: Any, relay: bool, vias: list[Multiaddr], timeout: float = 10.0) -> Any:
    """Start a RelayService on ``host`` (``relay``) and reserve a slot at each of ``vias``.

    Returns the service (or None); it needs no closing of its own: closing the host ends its
    circuits and drops its handlers' connections."""
    from dht import RelayService

    service = None
    if relay:
        service = RelayService(host)
        service.start()
    for addr in vias:
        await host.reserve_relay(addr, timeout=timeout)
    return service
