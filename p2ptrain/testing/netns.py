"""A multi-host test bed on one Linux machine: network namespaces, veth links, a bridge, tc shaping.

Why: on loopback every transfer is CPU-bound (GB/s), so whatever exists for slow links (codecs,
pipelining, deadlines) cannot show. ``Testbed(n)`` gives each of ``n`` "hosts" a network namespace of
its own with one veth link into a shared switch, and shapes each link the way a NIC would be::

    with Testbed(2, rate="1gbit") as tb:
        srv = tb.popen(0, [sys.executable, "server.py", tb.hosts[0].ip])
        cli = tb.popen(1, [sys.executable, "client.py", tb.hosts[0].ip])

Layout (names carry a unique prefix, ``p2pt-<pid>-<hex>-`` by default, so concurrent runs never meet)::

    <prefix>h0: lo, eth0 10.a.b.1/24 --veth-- p0 \\
    <prefix>h1: lo, eth0 10.a.b.2/24 --veth-- p1  >- br0, all in namespace <prefix>sw ("the switch")
    ...                                           /

Both ends of every veth are created directly inside their namespaces, so the root namespace is not
touched at all (no links, no routes, no qdiscs; the machine's ``lo`` is never shaped) and a run can
only collide with another through its prefix. The 10.a.b.0/24 subnet is derived from the prefix:
namespaces are isolated, so a clash would be harmless, but distinct subnets keep logs and captures
of concurrent runs apart.

Shaping, per host link (``rate`` like tc: ``"1gbit"``, ``"100mbit"``, ``"500kbit"``):

* upload (host ``eth0`` egress): ``tbf rate R``. Measured with one TCP stream: tbf at 1gbit
  gives 0.95 Gbit/s of goodput (the 1448/1514 framing ceiling is 0.956), at 100mbit 0.095; htb
  0.937 at 1gbit. tbf also works on kernels built without netem (the one this was written on
  has only tbf, htb, fifo, ingress/clsact and cls_bpf), so netem's ``rate`` is never used.
* download (switch port ``p<i>`` egress): ``tbf rate R`` as well: a real NIC is limited both ways;
  without it, N-1 peers could push (N-1) x R into one host at once.
* ``delay`` (one way, so the RTT between two hosts is 2 x delay) and ``loss`` go on the download
  side, on the switch port, via netem with the tbf as its child. On the switch side the packets
  are already detached from their sending socket; netem on the sender's own egress would hold
  them against TCP small queues (tcp_limit_output_bytes per socket) and cap throughput at
  limit/delay. netem's ``limit`` (packets) is sized for n x rate x (delay + 50 ms), since the
  default 1000 packets silently drops at high rates. Without netem in the kernel: ``delay`` is a
  userspace delay line (:mod:`.delayline`: each port's ingress redirected through a tap whose
  reader holds every frame ``delay`` before the bridge forwards it; exact, a C program compiled on
  first use, about 1 Gbit/s of frames per core), and ``loss`` falls back to a classic-BPF filter that sends a random
  fraction of IPv4 packets into an htb class whose fifo holds nothing (i.e. drops them). Either
  way loss applies per sk_buff, and veth passes TCP as GSO super-packets of up to 64 KiB, so one
  "lost packet" can be a whole burst of segments.

Every host knows every other host's MAC (static neighbour entries, MACs derived from the subnet):
no ARP, so the first packet is not delayed and a lost ARP request cannot stall a connection for
the kernel's 1 s ARP retransmit timer.

Lifetime: :meth:`Testbed.close` (also on ``with`` exit, garbage collection and interpreter exit)
stops the processes it started, kills anything else still running inside its namespaces (nothing
there can belong to anyone else) and deletes the namespaces, which destroys the veths and the
bridge with them. A SIGKILLed owner cannot clean up: :func:`cleanup_stale` removes namespaces left by
test beds whose owning process is gone.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import delayline, natrouter
from .linkspec import TestbedError, parse_loss, parse_rate, parse_time

if TYPE_CHECKING:
    from typing import Self

log = logging.getLogger("p2ptrain.testing")

__all__ = ["Host", "Testbed", "TestbedError", "available", "cleanup_stale", "features"]

# Every namespace this module makes starts with this; cleanup_stale() never looks at anything else.
NAME_ROOT = "p2pt-"
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]{1,40}$")
_STALE_RE = re.compile(r"^p2pt-(\d+)-")
# Classic BPF over an Ethernet frame (tc at a switch port's egress sees the MAC header first):
# match IPv4 TCP, first fragment, SYN set and ACK clear, i.e. a connection attempt and nothing
# else of the flow (A: accumulator, X: index register, "jeq k jt jf" counts jumps from the next op)
_SYN_FILTER = ",".join([
    "12",
    "40 0 0 12",          # A = ethertype
    "21 0 9 2048",        # IPv4 ? next : no match
    "48 0 0 23",          # A = IP protocol
    "21 0 7 6",           # TCP ? next : no match
    "40 0 0 20",          # A = flags + fragment offset
    "69 5 0 8191",        # a later fragment (no TCP header) ? no match : next
    "177 0 0 14",         # X = IP header length (4 * IHL)
    "80 0 0 27",          # A = byte 14 + X + 13: the TCP flags
    "84 0 0 18",          # A &= SYN | ACK
    "21 0 1 2",           # SYN alone ? match : no match
    f"6 0 0 {2**32 - 1}",  # match: the whole packet goes to the dropping class
    "6 0 0 0",            # no match
])
_HOST_IF = "eth0"  # inside each host namespace: the only link, named like a real machine's
_BRIDGE = "br0"  # inside the switch namespace
_DELAY_TAP = "dl0"  # the userspace delay line's tap (switch namespace), when netem is missing


@dataclass(frozen=True)
class Host:
    """One host of a test bed: ``ns`` is its network namespace, ``ip`` its address on the switch
    (for a host behind NAT, its router's: where others see it); ``local_ip`` is the address its
    processes bind to (``ip`` too unless it is behind NAT); ``router_ns`` its NAT router's namespace."""

    index: int
    ns: str
    ip: str
    mac: str
    ifname: str = _HOST_IF
    local_ip: str = ""
    router_ns: str | None = None

    __test__ = False


# ------------------------------------------------------------------------------- commands


def _run(argv: Sequence[str], *, check: bool = True, timeout: float = 20, stdin: str | None = None
         ) -> subprocess.CompletedProcess:
    """Run one iproute2 command; a failure becomes a one-line TestbedError naming the command."""
    try:
        res = subprocess.run(list(argv), check=False, capture_output=True, text=True, timeout=timeout, input=stdin)
    except FileNotFoundError:
        raise TestbedError(f"{argv[0]!r} not found: install iproute2") from None
    except subprocess.TimeoutExpired:
        raise TestbedError(f"timed out after {timeout:.0f} s: {' '.join(argv)}") from None
    if check and res.returncode != 0:
        why = " ".join((res.stderr or res.stdout).split()) or f"exit status {res.returncode}"
        raise TestbedError(f"`{' '.join(argv)}` failed: {why}")
    return res


def _netns_list() -> list[str]:
    res = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    res = _run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in res.stdout.split() if p.isdigit()]


def _delete_netns(ns: str) -> None:
    """Kill whatever still runs in ``ns`` (only our processes can be in a namespace we made), then
    delete it; the kernel destroys its links (and each veth's peer) with it."""
    for pid in _netns_pids(ns):
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    res = _run(["ip", "netns", "del", ns], check=False)
    if res.returncode != 0 and ns in _netns_list():
        log.warning("could not delete network namespace %s: %s", ns, " ".join(res.stderr.split()))


def _preflight() -> None:
    """Raise the one-line reason why no test bed can be built here, before anything is created."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        raise TestbedError("network namespaces need Linux")
    if os.geteuid() != 0:
        raise TestbedError(f"network namespaces need root (CAP_NET_ADMIN); running as uid {os.geteuid()}")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise TestbedError(f"the `{tool}` command is missing: install iproute2")


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[bool, str, bool]:
    """(works, reason, netem) from building a throwaway namespace with a veth, a bridge and a tbf."""
    try:
        _preflight()
    except TestbedError as e:
        return False, str(e), False
    ns = f"{NAME_ROOT}{os.getpid()}-{secrets.token_hex(2)}-probe"
    try:
        _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", ns, "link", "add", "name", "pa", "type", "veth", "peer", "name", "pb"])
        _run(["ip", "-n", ns, "link", "add", "name", "pbr", "type", "bridge"])
        _run(["tc", "-n", ns, "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "1gbit", "burst", "128k",
              "latency", "10ms"])
        netem = _run(["tc", "-n", ns, "qdisc", "add", "dev", "pb", "root", "netem", "delay", "1ms"],
                     check=False).returncode == 0
        return True, "ok", netem
    except TestbedError as e:
        return False, str(e), False
    finally:
        _run(["ip", "netns", "del", ns], check=False)


def available() -> tuple[bool, str]:
    """Whether a :class:`Testbed` can be built here (root, iproute2, netns, veth, bridge, tbf),
    and if not, the one-line reason (for ``pytest.skip``). Probed once per process."""
    ok, why, _ = _probe()
    return ok, why


def features() -> dict[str, bool]:
    """What the kernel offers beyond the basics: ``{"netem": bool}``. Without netem, ``delay`` is
    refused and ``loss`` uses the classic-BPF fallback."""
    return {"netem": _probe()[2]}


def cleanup_stale() -> list[str]:
    """Delete namespaces named ``p2pt-<pid>-...`` whose owning process ``pid`` is gone (a test bed
    whose owner was SIGKILLed); returns their names. Beds of live processes are left alone."""
    removed = []
    for ns in _netns_list():
        m = _STALE_RE.match(ns)
        if not m:
            continue
        pid = int(m.group(1))
        try:
            os.kill(pid, 0)
            continue  # the owner lives (or the pid was reused: leaving it is the safe mistake)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _delete_netns(ns)
        removed.append(ns)
    return removed


# ------------------------------------------------------------------------------- the test bed


def _wan_ns(h: Host) -> str:
    """The namespace of the link of ``h`` into the switch: its NAT router's, or its own."""
    return h.router_ns or h.ns


def _teardown(procs: list[subprocess.Popen], namespaces: list[str], grace: float) -> None:
    """Stop ``procs`` (SIGTERM, then SIGKILL after ``grace`` s), then delete ``namespaces``.

    A plain function over plain lists (no reference to the Testbed), so that ``weakref.finalize``
    can run it at garbage collection or interpreter exit as well as from ``close()``."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            p.terminate()
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.warning("process %d did not die after SIGKILL", p.pid)
    for ns in reversed(namespaces):  # hosts first, the switch last
        _delete_netns(ns)


class Testbed:
    """``n_hosts`` network namespaces joined by a switch, each link shaped to ``rate`` both ways.

    Args:
        n_hosts: how many hosts (1 .. 250: one /24).
        rate: link rate per host and direction, tc syntax (``"1gbit"``); None: unshaped veth
            (tens of Gbit/s, CPU-bound like loopback).
        delay: one-way delay added on the way into each host (RTT = 2 x delay), e.g. ``"1ms"``.
            By netem where the kernel has it (see :func:`features`), else by a userspace delay
            line in the switch (:mod:`.delayline`, a C process of this test bed): exact and
            jitter-free, about 1 Gbit/s of frames per core.
        loss: probability that a packet into a host is dropped, e.g. ``"1%"`` (per GSO sk_buff).
        prefix: namespace name prefix; default ``p2pt-<pid>-<4 hex>-``. Two live test beds must
            not share one.
        subnet: first three octets of the hosts' /24 (``"10.77.0"``); default derived from prefix.
        grace: seconds that started processes get after SIGTERM before SIGKILL, at close.
        no_inbound: indices of hosts that nobody can open a TCP connection to, as behind a NAT or
            a stateful firewall: every TCP SYN (without ACK) into them is dropped at their switch
            port, so a dial times out (it is never refused). What they dial works both ways.
        nat: indices of hosts behind a NAT router of their own (a namespace ``<prefix>r<i>``
            between the host, at ``local_ip`` 192.168.<i+1>.2, and the switch, at ``ip``): it
            masquerades what the host dials and drops what nobody asked for (:mod:`.natrouter`,
            nf_tables over netlink through pyroute2). ``nat_type``: ``"cone"`` (endpoint-independent
            mapping, port-dependent filtering) or ``"symmetric"`` (a random port per connection).

    ``hosts[i]`` has ``.ns`` and ``.ip``; :meth:`popen` starts a process inside host i;
    :meth:`close` (or leaving the ``with`` block) removes everything. Construction either completes
    or cleans up what it made and raises :class:`TestbedError`.
    """

    __test__ = False

    @classmethod
    def from_netem(cls, n_hosts: int, spec: str) -> Testbed:
        """A test bed from the benchmarks' ``--netem RATE[,DELAY[,LOSS]]`` (``1gbit``,
        ``100mbit,50ms``, ``100mbit,,1%``: an empty field is left unshaped)."""
        rate, delay, loss = (spec.split(",") + [None, None])[:3]
        return cls(n_hosts, rate=rate or None, delay=delay or None, loss=loss or None)

    def __init__(self, n_hosts: int, *, rate: str | None = "1gbit", delay: str | float | None = None,
                 loss: str | float | None = None, prefix: str | None = None, subnet: str | None = None,
                 grace: float = 2.0, no_inbound: Iterable[int] = (), nat: Iterable[int] = (),
                 nat_type: str = "cone") -> None:
        if not 1 <= int(n_hosts) <= 250:
            raise TestbedError(f"n_hosts must be 1 .. 250, not {n_hosts}")
        self.n_hosts = int(n_hosts)
        self.rate_bps = parse_rate(rate) if rate else None
        self.delay_s = parse_time(delay) if delay else 0.0
        self.loss = parse_loss(loss) if loss else 0.0
        self.no_inbound = frozenset(int(i) for i in no_inbound)
        if not all(0 <= i < self.n_hosts for i in self.no_inbound):
            raise TestbedError(f"no_inbound {sorted(self.no_inbound)}: host indices must be 0 .. {self.n_hosts - 1}")
        self.nat = frozenset(int(i) for i in nat)
        if not all(0 <= i < self.n_hosts for i in self.nat) or nat_type not in ("cone", "symmetric"):
            raise TestbedError(f"nat {sorted(self.nat)} {nat_type!r}: host indices 0 .. {self.n_hosts - 1}, "
                               "type 'cone' or 'symmetric'")
        self.nat_type = nat_type
        self.prefix = prefix or f"{NAME_ROOT}{os.getpid()}-{secrets.token_hex(2)}-"
        if not _PREFIX_RE.match(self.prefix):
            raise TestbedError(f"bad prefix {self.prefix!r}: 1-40 of [A-Za-z0-9_.-]")
        self.subnet = subnet or self._subnet_for(self.prefix)
        if not re.fullmatch(r"(\d{1,3})\.(\d{1,3})\.(\d{1,3})", self.subnet) or \
                any(int(o) > 255 for o in self.subnet.split(".")):
            raise TestbedError(f"bad subnet {self.subnet!r}: the first three octets, e.g. '10.77.0'")
        self.switch_ns = f"{self.prefix}sw"
        octets = [int(o) for o in self.subnet.split(".")]
        self.hosts = [Host(i, f"{self.prefix}h{i}", f"{self.subnet}.{i + 1}",
                           "02:{:02x}:{:02x}:{:02x}:00:{:02x}".format(*octets, i + 1),
                           local_ip=f"192.168.{i + 1}.2" if i in self.nat else f"{self.subnet}.{i + 1}",
                           router_ns=f"{self.prefix}r{i}" if i in self.nat else None)
                      for i in range(self.n_hosts)]
        self._procs: list[subprocess.Popen] = []
        self._namespaces: list[str] = []  # in creation order: the switch first
        self._finalizer = weakref.finalize(self, _teardown, self._procs, self._namespaces, grace)
        _preflight()
        self.delay_line: subprocess.Popen | None = None  # the userspace delay, without netem
        try:
            self._build()
        except BaseException:  # KeyboardInterrupt included: never leave half a test bed behind
            self.close()
            raise

    @staticmethod
    def _subnet_for(prefix: str) -> str:
        h = hashlib.blake2b(prefix.encode(), digest_size=2).digest()
        return f"10.{64 + h[0] % 128}.{h[1]}"

    # ---------------------------------------------------------------- building

    def _add_ns(self, ns: str) -> None:
        if ns in _netns_list():
            raise TestbedError(f"network namespace {ns} exists already: another test bed uses prefix {self.prefix!r}")
        _run(["ip", "netns", "add", ns])
        self._namespaces.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _build(self) -> None:
        sw = self.switch_ns
        self._add_ns(sw)
        _run(["ip", "-n", sw, "link", "add", _BRIDGE, "type", "bridge", "stp_state", "0", "forward_delay", "0"])
        _run(["ip", "-n", sw, "link", "set", _BRIDGE, "up"])
        for h in self.hosts:
            self._add_ns(h.ns)
            wan = _wan_ns(h)
            if h.router_ns is not None:
                self._add_ns(h.router_ns)
            port = f"p{h.index}"
            _run(["ip", "link", "add", "name", h.ifname, "address", h.mac, "netns", wan, "type", "veth",
                  "peer", "name", port, "netns", sw])
            _run(["ip", "-n", sw, "link", "set", port, "master", _BRIDGE])
            _run(["ip", "-n", sw, "link", "set", port, "up"])
            _run(["ip", "-n", wan, "addr", "add", f"{h.ip}/24", "dev", h.ifname])
            _run(["ip", "-n", wan, "link", "set", h.ifname, "up"])
            if h.router_ns is not None:
                # (60 s: the router's NAT is set by a Python process, slow to start on a loaded box)
                natrouter.build(h.ns, h.router_ns, h.ifname, h.local_ip, self.nat_type,
                                functools.partial(_run, timeout=60))
            self._shape(h, port)
        if self.delay_s and not features()["netem"]:
            self._start_delay_line()
        # Static neighbours: no ARP on the wire, so no first-packet resolution delay, and no lost
        # ARP request (with ``loss``) stalling a connection for the 1 s ARP retransmit timer.
        for h in self.hosts:
            neigh = "".join(f"neigh replace {o.ip} lladdr {o.mac} dev {h.ifname} nud permanent\n"
                            for o in self.hosts if o is not h)
            if neigh:
                _run(["ip", "-n", _wan_ns(h), "-batch", "-"], stdin=neigh)


    def _start_delay_line(self) -> None:
        """Every frame into the switch goes through :mod:`.delayline` first: each port's ingress
        redirects it to a tap in the bridge, whose reader writes it back ``delay_s`` later. Static
        forwarding entries (and no learning on the tap, which re-sends every host's frames) keep
        the bridge delivering each frame to its host's port only."""
        sw, tap = self.switch_ns, _DELAY_TAP
        _run(["ip", "-n", sw, "tuntap", "add", "dev", tap, "mode", "tap"])
        _run(["ip", "-n", sw, "link", "set", tap, "master", _BRIDGE])
        _run(["ip", "-n", sw, "link", "set", "dev", tap, "type", "bridge_slave", "learning", "off"])
        _run(["ip", "-n", sw, "link", "set", tap, "up"])
        batch = "".join(f"fdb replace {h.mac} dev p{h.index} master static\n" for h in self.hosts)
        _run(["bridge", "-n", sw, "-batch", "-"], stdin=batch)
        try:
            program = delayline.binary()
        except delayline.DelayLineUnavailable as e:
            raise TestbedError(str(e)) from None
        p = subprocess.Popen(["ip", "netns", "exec", sw, program, tap, repr(self.delay_s)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._procs.append(p)
        self.delay_line = p
        line = p.stdout.readline().strip() if p.stdout is not None else ""
        if line != "ready":
            raise TestbedError(f"the delay line did not start (exit code {p.poll()})")
        for h in self.hosts:
            port = f"p{h.index}"
            _run(["tc", "-n", sw, "qdisc", "add", "dev", port, "ingress"])
            _run(["tc", "-n", sw, "filter", "add", "dev", port, "parent", "ffff:", "protocol", "all", "u32",
                  "match", "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", tap])

    def _tbf(self) -> list[str]:
        """tbf arguments for ``rate_bps``: a burst of 1 ms at line rate (at least 16 KiB, so that it
        holds a few frames at low rates; at >= 1gbit it exceeds 64 KiB and GSO packets pass whole
        instead of being segmented, which costs CPU) and a queue of 50 ms (at least 1 MiB), about
        what a NIC ring plus a switch buffer hold."""
        assert self.rate_bps is not None
        rate_Bps = self.rate_bps / 8
        burst = max(16 << 10, int(rate_Bps * 1e-3))
        limit = max(1 << 20, int(rate_Bps * 0.05)) + burst
        return ["tbf", "rate", f"{int(self.rate_bps)}bit", "burst", str(burst), "limit", str(limit)]

    def _shape(self, h: Host, port: str) -> None:
        sw = self.switch_ns
        if self.rate_bps:  # upload
            _run(["tc", "-n", _wan_ns(h), "qdisc", "add", "dev", h.ifname, "root", *self._tbf()])
        blocked = h.index in self.no_inbound
        netem = features()["netem"] if (self.delay_s or self.loss) else False
        if netem and not blocked:  # download: netem (delay, loss), its child tbf (rate)
            _run(["tc", "-n", sw, "qdisc", "add", "dev", port, "root", "handle", "1:", *self._netem()])
            if self.rate_bps:
                _run(["tc", "-n", sw, "qdisc", "add", "dev", port, "parent", "1:1", "handle", "10:", *self._tbf()])
        elif self.loss or blocked:
            # htb with a default class at the rate and a class whose fifo holds nothing (a drop);
            # filters send inbound SYNs (no_inbound) and, without netem, a random share (loss) there.
            rate = f"{int(self.rate_bps or 100e9)}bit"
            quantum = "60000"  # above the MTU; r2q's default would warn at high rates
            tc = ["tc", "-n", sw]
            _run([*tc, "qdisc", "add", "dev", port, "root", "handle", "1:", "htb", "default", "10"])
            _run([*tc, "class", "add", "dev", port, "parent", "1:", "classid", "1:10", "htb", "rate", rate,
                  "ceil", rate, "quantum", quantum])
            _run([*tc, "class", "add", "dev", port, "parent", "1:", "classid", "1:20", "htb", "rate", rate,
                  "ceil", rate, "quantum", quantum])
            _run([*tc, "qdisc", "add", "dev", port, "parent", "1:20", "handle", "20:", "pfifo", "limit", "0"])
            if netem:  # delay/loss by a netem leaf under the rate class (htb holds the rate, not a tbf)
                _run([*tc, "qdisc", "add", "dev", port, "parent", "1:10", "handle", "10:", *self._netem()])
            if blocked:
                _run([*tc, "filter", "add", "dev", port, "parent", "1:", "protocol", "ip", "prio", "1", "bpf",
                      "bytecode", _SYN_FILTER, "classid", "1:20"])
            if self.loss and not netem:
                # classic BPF: A = random u32 (SKF_AD_RANDOM); A > threshold ? no match : class 1:20
                threshold = min(2**32 - 1, int(self.loss * 2**32))
                prog = f"4,32 0 0 {2**32 - 0x1000 + 56},37 0 1 {threshold},6 0 0 0,6 0 0 {2**32 - 1}"
                _run([*tc, "filter", "add", "dev", port, "parent", "1:", "protocol", "ip", "prio", "2", "bpf",
                      "bytecode", prog, "classid", "1:20"])
        elif self.rate_bps:  # download
            _run(["tc", "-n", sw, "qdisc", "add", "dev", port, "root", *self._tbf()])

    def _netem(self) -> list[str]:
        """netem arguments for ``delay_s`` and ``loss``. netem holds what arrives during ``delay``
        before the rate limit drains it, and up to n-1 hosts send into one port at once: its
        packet limit is sized for that, in 1500-byte packets."""
        rate_Bps = (self.rate_bps or 10e9) / 8
        limit = max(1000, int(self.n_hosts * rate_Bps * (self.delay_s + 0.05) / 1500))
        args = ["netem", "limit", str(limit)]
        if self.delay_s:
            args += ["delay", f"{self.delay_s * 1e6:.0f}us"]
        if self.loss:
            args += ["loss", f"{self.loss * 100:.6g}%"]
        return args

    # ---------------------------------------------------------------- use

    def describe(self) -> str:
        """The links in words, for benchmark headers: ``"2 hosts, 1gbit up+down per host, ..."``."""
        rate = "unshaped veth" if not self.rate_bps else f"{self.rate_bps / 1e9:g} Gbit/s up and down per host (tbf)"
        parts = [f"{self.n_hosts} netns hosts via a bridge", rate]
        if self.delay_s:
            parts.append(f"+{self.delay_s * 1e3:g} ms one way (RTT +{2 * self.delay_s * 1e3:g} ms, netem)")
        if self.loss:
            parts.append(f"{self.loss * 100:g}% loss into each host")
        if self.no_inbound:
            parts.append(f"no inbound TCP connections to host{'s' if len(self.no_inbound) > 1 else ''} "
                         f"{', '.join(map(str, sorted(self.no_inbound)))}")
        if self.nat:
            parts.append(f"hosts {', '.join(map(str, sorted(self.nat)))} behind {self.nat_type} NAT routers")
        return ", ".join(parts)

    def exec_argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside host ``i`` (``ip netns exec``, which execs in place: the
        wrapped pid is the command's pid), for callers with their own spawner (asyncio, mp).
        Processes started that way are not tracked, but close() still kills them with the namespace."""
        return ["ip", "netns", "exec", self.hosts[i].ns, *map(str, argv)]

    def popen(self, i: int, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside host ``i`` (environment, cwd and stdio as ``subprocess.Popen``);
        tracked: close() sends it SIGTERM, then SIGKILL."""
        if not self._finalizer.alive:
            raise TestbedError("this test bed is closed")
        p = subprocess.Popen(self.exec_argv(i, argv), **popen_kwargs)
        self._procs.append(p)
        return p

    def run(self, i: int, argv: Sequence[str], *, check: bool = False,
            **run_kwargs: Any) -> subprocess.CompletedProcess:
        """``subprocess.run`` inside host ``i`` (short commands: ``ip addr``, ``ss``...)."""
        return subprocess.run(self.exec_argv(i, argv), check=check, **run_kwargs)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Stop the processes, delete the namespaces (and with them every link and qdisc). Idempotent."""
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Testbed {self.prefix!r} {self.describe()}{' closed' if self.closed else ''}>"
