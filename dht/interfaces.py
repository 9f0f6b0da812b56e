"""Which addresses a listening host announces: for a wildcard (0.0.0.0, ::), every routable
interface address of this machine, the way libp2p lists them.

Why: 127.0.0.1 handed to another machine makes it dial itself. Loopback is announced only when the
host listens on it, or when no other interface exists (a machine with no network: then the peers can
only be local anyway).
IPv6 link-local addresses (fe80::/10) are skipped: they need a scope (``%eth0``) that means
nothing on another machine.

Interfaces are listed by ``ifaddr`` (pure Python, ``getifaddrs`` through ctypes). The
interface of the default route comes first: records that carry one address of a peer (group
membership, progress reports, checkpoint providers) carry the first, and it is the one most
other machines can reach (a docker bridge, say, is reachable from this machine only).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Iterable
from typing import Union

import ifaddr

log = logging.getLogger("dht.interfaces")

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]

#: wildcard listen hosts and the IP versions a socket bound to them accepts (asyncio binds "::"
#: with IPV6_V6ONLY, so it takes no IPv4 connections)
WILDCARDS: dict[str, tuple[int, ...]] = {"0.0.0.0": (4,), "::": (6,), "": (4,)}
_LOOPBACK = {4: "127.0.0.1", 6: "::1"}
# documentation addresses (RFC 5737, 3849): a UDP connect() to them sends nothing, and picks the
# source address of the route a packet to the internet would take
_PROBE = {4: ("192.0.2.1", socket.AF_INET), 6: ("2001:db8::1", socket.AF_INET6)}


def interface_ips() -> list[IPAddress]:
    """Every address of every interface of this machine, in the order the system lists them."""
    out: list[IPAddress] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            # ifaddr gives an IPv6 address as (address, flowinfo, scope_id)
            text = ip.ip[0] if isinstance(ip.ip, tuple) else ip.ip
            try:
                out.append(ipaddress.ip_address(text.split("%", 1)[0]))
            except ValueError:
                continue
    return out


def default_route_ip(version: int) -> IPAddress | None:
    """The source address of this machine's default route for IPv4 or IPv6 (None: no such route)."""
    target, family = _PROBE[version]
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))  # no packet is sent: this only asks the kernel for a route
            return ipaddress.ip_address(s.getsockname()[0].split("%", 1)[0])
    except (OSError, ValueError):
        return None


def routable(ip: IPAddress) -> bool:
    """Whether another machine could dial ``ip``: not loopback, not unspecified or multicast, and
    not an IPv6 link-local address (unusable without a scope)."""
    if ip.is_loopback or ip.is_unspecified or ip.is_multicast:
        return False
    return not (ip.version == 6 and ip.is_link_local)


def announce_hosts(listen_host: str, announce_host: str | None = None, *,
                   interfaces: Iterable[IPAddress] | None = None,
                   primary: Iterable[IPAddress | None] | None = None) -> list[str]:
    """The hosts a peer listening on ``listen_host`` tells others to dial, best first.

    ``announce_host`` (e.g. a NAT's public address) wins; a specific ``listen_host`` is itself; a
    wildcard gives every routable interface address of its IP version(s), the default route's
    first, or loopback when there is none. ``interfaces`` and ``primary`` (the default routes'
    addresses) replace what this machine has, for tests."""
    if announce_host:
        return [announce_host]
    versions = WILDCARDS.get(listen_host)
    if versions is None:
        return [listen_host]
    ips = list(interface_ips() if interfaces is None else interfaces)
    first = list(primary) if primary is not None else [default_route_ip(v) for v in versions]
    out: list[str] = []
    for ip in [*(p for p in first if p is not None and p in ips), *ips]:
        if ip.version in versions and routable(ip) and str(ip) not in out:
            out.append(str(ip))
    if not out:
        out = [_LOOPBACK[v] for v in versions]
        log.debug("listening on %r but this machine has no routable interface address: announcing %s",
                  listen_host, ", ".join(out))
    return out
