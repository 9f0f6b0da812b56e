"""What a peer listening on all interfaces tells others to dial (dht.interfaces), and that the
CLI and the library share one default listen address.

Two machines in network namespaces, following the README, are in tests/test_netns_swarm.py."""

from __future__ import annotations

import argparse
import asyncio
import inspect
import logging
from ipaddress import ip_address

import pytest

from dht import DHTConfig, DHTNode, Multiaddr
from dht.interfaces import announce_hosts, interface_ips, routable

pytestmark = pytest.mark.timeout(60)

# a machine with loopback, a LAN card (v4, a ULA and a link-local v6), a docker bridge and a public v6
MACHINE = [ip_address(a) for a in ("127.0.0.1", "::1", "192.168.1.20", "fd00::20", "fe80::1c2:3ff:fe04:506",
                                   "172.17.0.1", "2001:db8:1::20")]


def hosts(listen: str, announce: str | None = None, primary: tuple = (None,)) -> list[str]:
    return announce_hosts(listen, announce, interfaces=MACHINE, primary=[ip_address(p) if p else None for p in primary])


def test_wildcard_announces_every_routable_address_of_its_family_and_no_loopback() -> None:
    assert hosts("0.0.0.0") == ["192.168.1.20", "172.17.0.1"]
    # "::" is bound IPv6-only (asyncio sets IPV6_V6ONLY): its v6 addresses, link-local skipped
    assert hosts("::") == ["fd00::20", "2001:db8:1::20"]


def test_the_default_route_interface_comes_first() -> None:
    # records that carry one address of a peer carry the first: the one other machines reach
    assert hosts("0.0.0.0", primary=("172.17.0.1",)) == ["172.17.0.1", "192.168.1.20"]
    # a "default route" address that no interface has is not announced
    assert hosts("0.0.0.0", primary=("10.9.9.9",)) == ["192.168.1.20", "172.17.0.1"]


def test_an_explicit_listen_host_or_announce_host_is_kept() -> None:
    assert hosts("127.0.0.1") == ["127.0.0.1"]
    assert hosts("192.168.1.20") == ["192.168.1.20"]
    assert hosts("0.0.0.0", announce="203.0.113.7") == ["203.0.113.7"]
    assert hosts("127.0.0.1", announce="peer.example.org") == ["peer.example.org"]


def test_a_machine_without_a_network_falls_back_to_loopback(caplog: pytest.LogCaptureFixture) -> None:
    lonely = [ip_address("127.0.0.1"), ip_address("::1"), ip_address("fe80::1")]
    with caplog.at_level(logging.DEBUG, logger="dht.interfaces"):
        assert announce_hosts("0.0.0.0", interfaces=lonely, primary=[None]) == ["127.0.0.1"]
        assert announce_hosts("::", interfaces=lonely, primary=[None]) == ["::1"]
    assert "no routable interface address" in caplog.text


def test_routable() -> None:
    assert not any(routable(ip_address(a)) for a in ("127.0.0.1", "::1", "0.0.0.0", "::", "fe80::1", "224.0.0.1"))
    assert all(routable(ip_address(a)) for a in ("10.0.0.5", "192.168.1.20", "fd00::2", "2001:db8::1"))


async def test_a_node_on_all_interfaces_announces_each_of_them_and_is_joined_through_each() -> None:
    if not any(routable(ip) for ip in interface_ips() if ip.version == 4):
        pytest.skip("this machine has no IPv4 address besides loopback")
    expected = announce_hosts("0.0.0.0")
    cfg = DHTConfig(rpc_timeout=1.0, bootstrap_timeout=3.0)
    async with DHTNode(listen=("0.0.0.0", 0), config=cfg) as a:
        await a.start()
        addrs = a.multiaddrs
        assert [m.host for m in addrs] == expected and "127.0.0.1" not in expected
        assert all(m.port == a.host.listen_port and m.peer_id == a.peer_id for m in addrs)
        for m in addrs:  # every announced address reaches this node
            async with DHTNode(config=cfg) as b:
                await b.start([m])
                assert b.host.connection(a.peer_id) is not None


async def test_several_addresses_of_one_peer_join_through_the_one_that_answers() -> None:
    cfg = DHTConfig(rpc_timeout=1.0, bootstrap_timeout=5.0)
    async with DHTNode(config=cfg) as a:
        await a.start()
        good = a.multiaddrs[0]
        # the first address given is a dead one of the same peer (an interface others cannot reach)
        dead = Multiaddr.from_host_port("127.0.0.1", 1, a.peer_id)
        async with DHTNode(config=cfg) as b:
            await b.start([dead, good])
            assert b.host.connection(a.peer_id) is not None


def test_the_cli_and_the_library_listen_on_the_same_default() -> None:
    from p2ptrain import DHT
    from p2ptrain.cli import dht_cmd, peer_cmd
    from p2ptrain.cli.common import parse_listen
    from p2ptrain.run import PeerConfig

    library = inspect.signature(DHT).parameters["listen"].default
    assert library == PeerConfig().listen == ("0.0.0.0", 0)
    for module in (peer_cmd, dht_cmd):
        parser = argparse.ArgumentParser()
        module.add_parser(parser.add_subparsers())
        sub = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
        (command,) = sub.values()
        assert parse_listen(command.get_default("listen")) == library, module.__name__


async def test_a_peer_whose_recorded_address_fails_is_dialed_where_it_was_last_seen() -> None:
    """Group, progress and checkpoint records carry one address of a peer (its first); when that
    one is not reachable from here (another interface of a multi-homed machine), ``connect``
    tries where the peer was last connected from, within the same timeout."""
    from dht import Host, HandshakeError, Identity, PeerUnreachable

    a, b, other = (Host(Identity(), ("127.0.0.1", 0)) for _ in range(3))
    for h in (a, b, other):
        await h.start()
    try:
        first = await b.connect("127.0.0.1", a.listen_port, a.peer_id)  # b sees a at 127.0.0.1:<a's port>
        first.close("done")
        while b.connection(a.peer_id) is not None or a.connection(b.peer_id) is not None:
            await asyncio.sleep(0.01)
        # a's recorded address refuses (nothing listens on port 1), or reaches another peer
        for wrong in (("127.0.0.1", 1), ("127.0.0.1", other.listen_port)):
            conn = await b.connect(*wrong, a.peer_id, timeout=3.0)
            assert conn.remote_peer == a.peer_id and conn.remote_listen_port == a.listen_port
            conn.close("done")
            while b.connection(a.peer_id) is not None:
                await asyncio.sleep(0.01)
        # a peer never seen has nowhere else to be tried; impersonation still fails
        with pytest.raises(PeerUnreachable):
            await b.connect("127.0.0.1", 1, Identity().peer_id, timeout=3.0)
        with pytest.raises(HandshakeError):
            await b.connect("127.0.0.1", other.listen_port, Identity().peer_id, timeout=3.0)
    finally:
        for h in (a, b, other):
            await h.close()
