"""Where a peer is dialed: a direct address and/or circuit addresses through relays (behind NAT).

One value shared by averaging members, progress reports and state/checkpoint providers, so that
each validates, bounds and dials a peer's addresses alike (``dht.Host.reach`` does the dialing:
an open connection first, e.g. a hole-punched one, then the direct address, then each relay).
"""

from __future__ import annotations

from dataclasses import dataclass

from dht import MAX_CIRCUITS, Connection, DHTNode, Host, Multiaddr, MultiaddrError, PeerID, parse_circuits

__all__ = ["Reach", "parse_addr", "parse_relays"]

Address = tuple[str, int]


def parse_addr(obj: object) -> Address | None:
    """A direct ``[host, port]`` from untrusted input (None stays None); ValueError if malformed."""
    if obj is None:
        return None
    if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], str) and len(obj[0]) <= 255
            and type(obj[1]) is int and 0 < obj[1] < 65536):
        raise ValueError("malformed peer address")
    return obj[0], obj[1]


def parse_relays(obj: object, peer: PeerID) -> tuple[Multiaddr, ...]:
    """``peer``'s circuit addresses from untrusted input (at most ``MAX_CIRCUITS``, each naming
    ``peer`` as its target); ValueError if malformed."""
    try:
        return parse_circuits(obj, peer)
    except MultiaddrError as e:
        raise ValueError(f"malformed relay addresses: {e}") from None


@dataclass(frozen=True)
class Reach:
    """How to dial one peer: ``addr`` (direct; None behind NAT or in client mode) and ``relays``
    (its circuit addresses). Falsy when neither: a client-mode peer nobody can dial."""

    addr: Address | None = None
    relays: tuple[Multiaddr, ...] = ()

    def __bool__(self) -> bool:
        return self.addr is not None or bool(self.relays)

    @classmethod
    def of_node(cls, node: DHTNode) -> Reach:
        """Where others dial ``node`` now: its first direct address and its circuit addresses
        (none in client mode, which owns and serves nothing even when a relay reaches it)."""
        if node.client_mode:
            return cls()
        addrs = node.multiaddrs
        direct = next(((a.host, a.port) for a in addrs if not a.is_circuit), None)
        return cls(direct, tuple(a for a in addrs if a.is_circuit)[:MAX_CIRCUITS])

    def relays_wire(self) -> list[str]:
        return [str(a) for a in self.relays]

    async def dial(self, host: Host, peer: PeerID, timeout: float) -> Connection:
        """A connection to ``peer``: an open one, else at ``addr``, else through each relay."""
        return await host.reach(peer, self.addr, self.relays, timeout)
