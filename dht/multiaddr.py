"""Multiaddrs in their text form: ``/ip4/1.2.3.4/tcp/4001/p2p/12D3KooW...``.

We follow libp2p's format (so addresses can be pasted between tools) but only the protocols a TCP
peer needs: ip4, ip6, dns, dns4, dns6, tcp and p2p. Errors name the offending component, because a
user typing an address by hand needs to know *which* part is wrong.

A peer that accepts no connections (behind a NAT) is reached through a relay (``dht.relay``) at a
*circuit* address: the relay's full address, ``/p2p-circuit``, then the target's id::

    /ip4/1.2.3.4/tcp/4001/p2p/<relay id>/p2p-circuit/p2p/<target id>

For such an address ``host``/``port`` are the relay's, ``relay_id`` the relay's PeerID and
``peer_id`` the *target's*: code that knows nothing of circuits and dials host:port expecting
``peer_id`` reaches the relay, whose handshake then fails (it is not the target): a loud failure,
never a silent connection to the wrong peer. The relay's id is required, not optional: the
dialer authenticates the relay before it trusts it to forward anything.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from .errors import MultiaddrError
from .identity import PeerID

_HOST_PROTOCOLS = ("ip4", "ip6", "dns", "dns4", "dns6")
_DNS_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


@dataclass(frozen=True)
class Multiaddr:
    """A TCP endpoint with an optional expected PeerID, or a circuit through a relay at it."""

    host_proto: str  # one of ip4, ip6, dns, dns4, dns6
    host: str
    port: int
    peer_id: PeerID | None = None
    #: set for a circuit address: the relay at host:port (``peer_id`` is then the target behind it)
    relay_id: PeerID | None = None

    @classmethod
    def parse(cls, text: str) -> Multiaddr:
        if not isinstance(text, str) or not text.strip():
            raise MultiaddrError("empty multiaddr; expected e.g. /ip4/1.2.3.4/tcp/4001/p2p/12D3KooW...")
        text = text.strip()
        if not text.startswith("/"):
            raise MultiaddrError(f"multiaddr {text!r} must start with '/', e.g. /ip4/1.2.3.4/tcp/4001")
        parts = text.split("/")[1:]
        if parts and parts[-1] == "":
            parts = parts[:-1]
        if len(parts) < 4:
            raise MultiaddrError(
                f"multiaddr {text!r} is incomplete; expected /ip4|ip6|dns4|dns6|dns/<host>/tcp/<port>[/p2p/<id>]"
            )
        proto, host = parts[0], parts[1]
        if proto not in _HOST_PROTOCOLS:
            raise MultiaddrError(
                f"multiaddr {text!r}: unsupported protocol {proto!r}; use one of {', '.join(_HOST_PROTOCOLS)}"
            )
        host = _check_host(text, proto, host)
        if parts[2] != "tcp":
            raise MultiaddrError(f"multiaddr {text!r}: expected 'tcp' after the host, got {parts[2]!r}")
        port = _check_port(text, parts[3])
        rest = parts[4:]
        if "p2p-circuit" in rest:
            return _parse_circuit(cls, text, proto, host, port, rest)
        peer_id = None
        if rest:
            if rest[0] not in ("p2p", "ipfs") or len(rest) != 2:
                raise MultiaddrError(
                    f"multiaddr {text!r}: unexpected {'/'.join(rest)!r} after the port; only /p2p/<peer id> "
                    "(or /p2p/<relay id>/p2p-circuit/p2p/<peer id>) may follow"
                )
            peer_id = _check_peer_id(text, rest[1])
        return cls(proto, host, port, peer_id)

    def __str__(self) -> str:
        s = f"/{self.host_proto}/{self.host}/tcp/{self.port}"
        if self.relay_id is not None:
            s += f"/p2p/{self.relay_id.to_base58()}/p2p-circuit"
        if self.peer_id is not None:
            s += f"/p2p/{self.peer_id.to_base58()}"
        return s

    @property
    def is_circuit(self) -> bool:
        """Whether this address reaches its peer through a relay (``/p2p-circuit``)."""
        return self.relay_id is not None

    @property
    def relay_addr(self) -> Multiaddr:
        """The relay's own address (``/.../p2p/<relay id>``) of a circuit address."""
        if self.relay_id is None:
            raise MultiaddrError(f"{self} is not a circuit address (no /p2p-circuit)")
        return Multiaddr(self.host_proto, self.host, self.port, self.relay_id)

    def circuit(self, target: PeerID) -> Multiaddr:
        """The circuit address of ``target`` through the relay at this (full) address."""
        if self.relay_id is not None:
            raise MultiaddrError(f"{self} is already a circuit address: relays do not chain")
        if self.peer_id is None:
            raise MultiaddrError(f"{self} needs the relay's /p2p/<id> to build a circuit address through it")
        if target == self.peer_id:
            raise MultiaddrError(f"a circuit address cannot lead from relay {self.peer_id} to itself")
        return Multiaddr(self.host_proto, self.host, self.port, target, relay_id=self.peer_id)

    def with_peer_id(self, peer_id: PeerID | None) -> Multiaddr:
        return Multiaddr(self.host_proto, self.host, self.port, peer_id, self.relay_id)

    @classmethod
    def from_host_port(cls, host: str, port: int, peer_id: PeerID | None = None) -> Multiaddr:
        try:
            ip = ipaddress.ip_address(host)
            proto = "ip4" if ip.version == 4 else "ip6"
        except ValueError:
            proto = "dns"
        return cls(proto, host, port, peer_id)


#: circuit addresses one peer may advertise (one per relay it holds a reservation at)
MAX_CIRCUITS = 4
_MAX_ADDR_TEXT = 300


def parse_circuits(obj: object, peer: PeerID, limit: int = MAX_CIRCUITS) -> tuple[Multiaddr, ...]:
    """Validated circuit addresses of ``peer`` from untrusted input (a list of strings): each must
    be a circuit address whose target is ``peer``; duplicates dropped, at most ``limit`` kept.
    MultiaddrError when ``obj`` is malformed."""
    if not isinstance(obj, list) or len(obj) > limit:
        raise MultiaddrError(f"circuit addresses must be a list of at most {limit}")
    out: list[Multiaddr] = []
    for text in obj:
        if not isinstance(text, str) or len(text) > _MAX_ADDR_TEXT:
            raise MultiaddrError("circuit address must be a string of at most 300 characters")
        addr = Multiaddr.parse(text)
        if not addr.is_circuit or addr.peer_id != peer:
            raise MultiaddrError(f"{addr} is not a circuit address of {peer}")
        if addr not in out:
            out.append(addr)
    return tuple(out)


def _check_peer_id(text: str, value: str) -> PeerID:
    try:
        return PeerID.from_base58(value)
    except ValueError as e:
        raise MultiaddrError(f"multiaddr {text!r}: {e}") from None


def _parse_circuit(cls: type[Multiaddr], text: str, proto: str, host: str, port: int, rest: list[str]) -> Multiaddr:
    """``rest`` after the port of a circuit address: p2p/<relay id>/p2p-circuit/p2p/<target id>."""
    at = rest.index("p2p-circuit")
    if at != 2 or rest[0] not in ("p2p", "ipfs"):
        raise MultiaddrError(
            f"multiaddr {text!r}: /p2p-circuit must follow the relay's /p2p/<relay id> (the relay is "
            "authenticated by its id), e.g. /ip4/1.2.3.4/tcp/4001/p2p/<relay id>/p2p-circuit/p2p/<peer id>"
        )
    tail = rest[3:]
    if len(tail) != 2 or tail[0] not in ("p2p", "ipfs"):
        what = f"got {'/'.join(tail)!r}" if tail else "got nothing"
        raise MultiaddrError(
            f"multiaddr {text!r}: /p2p-circuit must be followed by /p2p/<peer id> of the peer to reach, {what}"
        )
    relay, target = _check_peer_id(text, rest[1]), _check_peer_id(text, tail[1])
    if relay == target:
        raise MultiaddrError(f"multiaddr {text!r}: the relay and the peer behind it are the same peer")
    return cls(proto, host, port, target, relay)


def _check_host(text: str, proto: str, host: str) -> str:
    if proto in ("ip4", "ip6"):
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise MultiaddrError(f"multiaddr {text!r}: {host!r} is not a valid {proto} address") from None
        if (ip.version == 4) != (proto == "ip4"):
            raise MultiaddrError(f"multiaddr {text!r}: {host!r} is not a valid {proto} address")
        return str(ip)
    labels = host.rstrip(".").split(".")
    if not host or len(host) > 253 or not all(_DNS_LABEL.match(label) for label in labels):
        raise MultiaddrError(f"multiaddr {text!r}: {host!r} is not a valid DNS name")
    return host


def _check_port(text: str, port: str) -> int:
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise MultiaddrError(f"multiaddr {text!r}: port {port!r} must be a number from 0 to 65535")
    return int(port)
