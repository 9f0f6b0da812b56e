"""The NAT of a test bed router namespace, set up over netlink with nf_tables (pyroute2): no
iptables or nft binary is needed, only a kernel with nf_tables and its nat and masq expressions.

Run inside the router's namespace (``python -m p2ptrain.testing.natrouter [symmetric]``):

* every connection the router forwards is masqueraded to the address of the link it leaves by
  (only connections from the LAN are ever new here: nothing routes to the LAN from outside);
* nothing is delivered to the router itself (an input chain that drops everything), so an
  unsolicited SYN from outside is dropped, as home routers do, not answered with a reset;
* what comes back is let in by conntrack alone: address- and port-dependent filtering.

Mapping: Linux keeps a connection's source port when that tuple is free, so one inside port maps
to one outside port whatever the destination (endpoint-independent mapping, a "port-restricted
cone" NAT): what hole punching needs. ``symmetric`` picks a random outside port per connection
instead (NF_NAT_RANGE_PROTO_RANDOM_FULLY), so the port a third peer observes is not the port a
punch must reach: hole punching then fails and the relay stays the way in.
"""

from __future__ import annotations

import functools
import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

TABLE = "p2pt_nat"
_NF_DROP = 0


def build(host_ns: str, router_ns: str, ifname: str, local_ip: str, nat_type: str,
          run: Callable[[Sequence[str]], Any]) -> None:
    """The LAN between a test bed host (``host_ns``, its ``ifname`` at ``local_ip``/24) and its
    router (``router_ns``, at .1), the host's default route through it, and the router's NAT."""
    lan = local_ip.rsplit(".", 1)[0]
    run(["ip", "link", "add", "name", ifname, "netns", host_ns, "type", "veth", "peer", "name", "lan0",
         "netns", router_ns])
    run(["ip", "-n", router_ns, "addr", "add", f"{lan}.1/24", "dev", "lan0"])
    run(["ip", "-n", router_ns, "link", "set", "lan0", "up"])
    run(["ip", "-n", host_ns, "addr", "add", f"{local_ip}/24", "dev", ifname])
    run(["ip", "-n", host_ns, "link", "set", ifname, "up"])
    run(["ip", "-n", host_ns, "route", "add", "default", "via", f"{lan}.1"])
    run(["ip", "netns", "exec", router_ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
    kind = ["symmetric"] if nat_type == "symmetric" else []
    run(["ip", "netns", "exec", router_ns, sys.executable, "-m", "p2ptrain.testing.natrouter", *kind])


@functools.lru_cache(maxsize=1)
def available() -> tuple[bool, str]:
    """Whether NAT routers can be set up here (pyroute2, and a kernel with nf_tables NAT: tried
    once per process in a throwaway namespace), and if not the one-line reason."""
    try:
        import pyroute2.nftables.main  # noqa: F401
    except ImportError as e:
        return False, f"NAT routers need pyroute2 (pip install pyroute2): {e}"
    ns = f"p2pt-{os.getpid()}-{secrets.token_hex(2)}-natprobe"  # (testing.netns.cleanup_stale's pattern)
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"cannot make a network namespace to try NAT in: {e}"
    try:
        res = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m", "p2ptrain.testing.natrouter"],
                             capture_output=True, text=True, timeout=60)
        if res.returncode != 0:
            last = (res.stderr.strip().splitlines() or ["?"])[-1]
            return False, f"this kernel cannot do nf_tables NAT: {last[:200]}"
        return True, "ok"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


def apply(symmetric: bool = False) -> None:
    """Install the NAT in the current network namespace (root)."""
    from pyroute2.nftables.expressions import genex
    from pyroute2.nftables.main import NFTables

    nft = NFTables(nfgen_family=2)  # ipv4
    try:
        nft.table("add", name=TABLE)
        nft.chain("add", table=TABLE, name="post", hook="postrouting", type="nat", priority=100)
        masq = [genex("masq", {"flags": {"NF_NAT_RANGE_PROTO_RANDOM_FULLY"}} if symmetric else {})]
        nft.rule("add", table=TABLE, chain="post", expressions=(masq,))
        nft.chain("add", table=TABLE, name="in", hook="input", type="filter", priority=0, policy=_NF_DROP)
    finally:
        nft.close()


if __name__ == "__main__":
    apply(symmetric=sys.argv[1:] == ["symmetric"])
