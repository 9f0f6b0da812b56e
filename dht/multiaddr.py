"""Multiaddrs in their text form: ``/ip4/1.2.3.4/tcp/4001/p2p/12D3KooW...``.

We follow libp2p's format (so addresses can be pasted between tools) but only the protocols a TCP
peer needs: ip4, ip6, dns, dns4, dns6, tcp and p2p. Errors name the offending component, because a
user typing an address by hand needs to know *which* part is wrong.
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
    """A TCP endpoint with an optional expected PeerID."""

    host_proto: str  # one of ip4, ip6, dns, dns4, dns6
    host: str
    port: int
    peer_id: PeerID | None = None

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
        peer_id = None
        rest = parts[4:]
        if rest:
            if rest[0] not in ("p2p", "ipfs") or len(rest) != 2:
                raise MultiaddrError(
                    f"multiaddr {text!r}: unexpected {'/'.join(rest)!r} after the port; only /p2p/<peer id> may follow"
                )
            try:
                peer_id = PeerID.from_base58(rest[1])
            except ValueError as e:
                raise MultiaddrError(f"multiaddr {text!r}: {e}") from None
        return cls(proto, host, port, peer_id)

    def __str__(self) -> str:
        s = f"/{self.host_proto}/{self.host}/tcp/{self.port}"
        if self.peer_id is not None:
            s += f"/p2p/{self.peer_id.to_base58()}"
        return s

    def with_peer_id(self, peer_id: PeerID | None) -> Multiaddr:
        return Multiaddr(self.host_proto, self.host, self.port, peer_id)

    @classmethod
    def from_host_port(cls, host: str, port: int, peer_id: PeerID | None = None) -> Multiaddr:
        try:
            ip = ipaddress.ip_address(host)
            proto = "ip4" if ip.version == 4 else "ip6"
        except ValueError:
            proto = "dns"
        return cls(proto, host, port, peer_id)


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
