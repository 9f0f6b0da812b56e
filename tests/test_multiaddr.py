"""Multiaddr text form: parse/format round trips and error messages that name the bad part."""

from __future__ import annotations

import pytest

from dht.errors import ConfigError, MultiaddrError
from dht.identity import Identity
from dht.multiaddr import Multiaddr

PID = Identity().peer_id
P = PID.to_base58()


@pytest.mark.parametrize(
    "text, proto, host, port",
    [
        ("/ip4/1.2.3.4/tcp/4001", "ip4", "1.2.3.4", 4001),
        ("/ip4/127.0.0.1/tcp/0", "ip4", "127.0.0.1", 0),
        ("/ip4/255.255.255.255/tcp/65535", "ip4", "255.255.255.255", 65535),
        ("/ip6/::1/tcp/4001", "ip6", "::1", 4001),
        ("/ip6/2001:db8::1/tcp/80", "ip6", "2001:db8::1", 80),
        ("/dns/example.com/tcp/443", "dns", "example.com", 443),
        ("/dns4/boot-1.example.org/tcp/4001", "dns4", "boot-1.example.org", 4001),
        ("/dns6/localhost/tcp/1", "dns6", "localhost", 1),
    ],
)
@pytest.mark.parametrize("with_peer", [False, True])
def test_round_trip(text, proto, host, port, with_peer):
    if with_peer:
        text = f"{text}/p2p/{P}"
    addr = Multiaddr.parse(text)
    assert (addr.host_proto, addr.host, addr.port) == (proto, host, port)
    assert addr.peer_id == (PID if with_peer else None)
    assert str(addr) == text
    assert Multiaddr.parse(str(addr)) == addr


def test_normalisation():
    # trailing slash and surrounding whitespace are tolerated; ip6 is printed in canonical form
    assert str(Multiaddr.parse(" /ip4/1.2.3.4/tcp/5/ ")) == "/ip4/1.2.3.4/tcp/5"
    assert Multiaddr.parse("/ip6/2001:0db8:0000::0001/tcp/5").host == "2001:db8::1"
    # /ipfs/ is the legacy name of /p2p/
    assert Multiaddr.parse(f"/ip4/1.2.3.4/tcp/5/ipfs/{P}").peer_id == PID


def test_with_peer_id_and_from_host_port():
    addr = Multiaddr.parse("/ip4/10.0.0.1/tcp/7")
    assert addr.with_peer_id(PID) == Multiaddr("ip4", "10.0.0.1", 7, PID)
    assert addr.with_peer_id(PID).with_peer_id(None) == addr
    assert Multiaddr.from_host_port("10.0.0.1", 7) == addr
    assert Multiaddr.from_host_port("::1", 7).host_proto == "ip6"
    assert Multiaddr.from_host_port("example.com", 7, PID) == Multiaddr("dns", "example.com", 7, PID)


@pytest.mark.parametrize(
    "text, names",
    [
        ("", ["empty multiaddr"]),
        ("   ", ["empty multiaddr"]),
        ("ip4/1.2.3.4/tcp/4001", ["must start with '/'"]),
        ("/ip4/1.2.3.4", ["incomplete"]),
        ("/ip4/1.2.3.4/tcp", ["incomplete"]),
        ("/udp/1.2.3.4/tcp/4001", ["'udp'", "unsupported protocol"]),
        ("/ip5/1.2.3.4/tcp/4001", ["'ip5'"]),
        ("/ip4/1.2.3/tcp/4001", ["'1.2.3'", "ip4"]),
        ("/ip4/256.1.1.1/tcp/4001", ["'256.1.1.1'"]),
        ("/ip4/example.com/tcp/4001", ["'example.com'", "ip4"]),
        ("/ip4/::1/tcp/4001", ["'::1'", "not a valid ip4 address"]),
        ("/ip6/1.2.3.4/tcp/4001", ["'1.2.3.4'", "not a valid ip6 address"]),
        ("/ip6/:::/tcp/4001", ["':::'"]),
        ("/dns/bad_name!/tcp/4001", ["'bad_name!'", "DNS name"]),
        ("/dns4/-leading.example/tcp/4001", ["'-leading.example'"]),
        ("/dns//tcp/4001", ["''", "DNS name"]),
        ("/ip4/1.2.3.4/tcp/70000", ["'70000'", "port"]),
        ("/ip4/1.2.3.4/tcp/abc", ["'abc'", "port"]),
        ("/ip4/1.2.3.4/tcp/-1", ["'-1'", "port"]),
        ("/ip4/1.2.3.4/tcp/", ["incomplete"]),
        ("/ip4/1.2.3.4/udp/4001", ["expected 'tcp'", "'udp'"]),
        ("/ip4/1.2.3.4/4001/tcp", ["expected 'tcp'", "'4001'"]),
        ("/ip4/1.2.3.4/tcp/4001/ws", ["'ws'", "after the port"]),
        ("/ip4/1.2.3.4/tcp/4001/p2p", ["'p2p'", "after the port"]),
        (f"/ip4/1.2.3.4/tcp/4001/p2p/{P}/extra", ["extra", "after the port"]),
        ("/ip4/1.2.3.4/tcp/4001/p2p/notapeer0", ["'notapeer0'", "base58"]),
        (
            "/ip4/1.2.3.4/tcp/4001/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
            ["'QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N'", "12D3KooW"],
        ),
        (f"/ip4/1.2.3.4/tcp/4001/p2p/{P[:-2]}", [repr(P[:-2])]),
    ],
)
def test_malformed(text, names):
    with pytest.raises(MultiaddrError) as info:
        Multiaddr.parse(text)
    message = str(info.value)
    for name in names:
        assert name in message, f"{name!r} not in {message!r}"
    assert "\n" not in message
    # usable both as a config error and as a plain ValueError
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)


def test_non_string_is_rejected():
    with pytest.raises(MultiaddrError):
        Multiaddr.parse(None)  # type: ignore[arg-type]
