"""The DHT, averaging and the optimizer across the multi-host test bed (p2ptrain.testing).

Every peer runs in a network namespace of its own, behind a 100 Mbit/s link with 1% loss into it
(and a variant with 20 ms one-way delay): nothing goes over loopback, each
peer has its own IP, and lost packets must be recovered by TCP and survived by our timeouts.

* a DHT of 8 hosts: every host stores a record, every host reads every record;
* an averaging round of 4 hosts with unequal weights gives the exact weighted mean on every host;
* two public peers, two behind NAT routers (``--behind-nat``, reached through the others' relays,
  full members: they own their share of every round) and a client-mode trainer in a host that
  nobody can dial (inbound TCP SYNs are dropped at its switch port) train digits together to the
  accuracy target.

Root only (network namespaces); skipped with the reason elsewhere. Each test builds its own test
bed and tears it down (which kills every process inside), and checks no child process is left.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import pytest
import torch

from p2ptrain.testing.averaging_worker import flat_input
from dht import Multiaddr
from p2ptrain.testing import Testbed, available
from p2ptrain.testing.bed_peers import Proc, train_swarm

_OK, _WHY = available()
pytestmark = [pytest.mark.skipif(not _OK, reason=f"no network namespaces here: {_WHY}"), pytest.mark.slow]

RATE, LOSS = "100mbit", "1%"
ACCURACY = 0.95
# DHT timings a bit above the defaults' floor: a lost SYN costs TCP a 1 s retransmit
DHT_CONFIG = {"rpc_timeout": 3.0, "bootstrap_timeout": 15.0}
# 20 ms one-way: netem where the kernel has it, else the test bed's userspace delay line
DELAYS = [None, pytest.param("20ms", id="20ms")]


def _bed(n: int, delay: str | None = None, no_inbound: tuple[int, ...] = ()) -> Testbed:
    return Testbed(n, rate=RATE, loss=LOSS, delay=delay, no_inbound=no_inbound)


class Node(Proc):
    """``python -m p2ptrain.testing.agent node`` in one host: send commands, read their replies."""

    def __init__(self, tb: Testbed, host: int, client: bool = False):
        where = ["--client"] if client else ["--listen", tb.hosts[host].ip]
        super().__init__(tb, host, [sys.executable, "-m", "p2ptrain.testing.agent", "node", *where])
        self.wait_for(lambda m: m.get("ready"), 60)
        self._next = 0

    def send(self, op: str, **kw: Any) -> int:
        self._next += 1
        self.proc.stdin.write(json.dumps({"id": self._next, "op": op, **kw}) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._next

    def reply(self, ident: int, timeout: float) -> dict[str, Any]:
        # replies to commands sent together come in any order: one read past already is in seen
        msg = next((m for m in self.seen if m.get("id") == ident), None) or \
            self.wait_for(lambda m: m.get("id") == ident, timeout)
        assert "error" not in msg, f"host of pid {self.proc.pid}: {msg['error']}"
        return msg

    def request(self, op: str, timeout: float = 60, **kw: Any) -> dict[str, Any]:
        return self.reply(self.send(op, **kw), timeout)


@pytest.fixture
def no_leftovers(child_pids):
    before = child_pids()
    yield
    assert child_pids() <= before, "a process outlived its test bed"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("delay", DELAYS)
def test_dht_of_eight_hosts_stores_and_gets_from_every_host(delay: str | None, no_leftovers: None) -> None:
    with _bed(8, delay) as tb:
        nodes = [Node(tb, i) for i in range(8)]
        boot = nodes[0].request("start", config=DHT_CONFIG)["addr"]
        assert boot.startswith(f"/ip4/{tb.hosts[0].ip}/tcp/"), boot
        ids = [n.send("start", bootstrap=[boot], config=DHT_CONFIG) for n in nodes[1:]]
        for h, (n, i) in enumerate(zip(nodes[1:], ids), 1):
            assert n.reply(i, 60)["addr"].startswith(f"/ip4/{tb.hosts[h].ip}/tcp/")
        expected = {f"key-{i}": {"host": i, "ip": tb.hosts[i].ip} for i in range(8)}
        ids = [n.send("store", key=f"key-{i}", value=expected[f"key-{i}"], ttl=120) for i, n in enumerate(nodes)]
        for n, i in zip(nodes, ids):
            assert n.reply(i, 60)["accepted"] >= 3, n.seen[-1]
        for n in nodes:
            ids = [n.send("get", key=key) for key in expected]
            got = {key: n.reply(i, 60)["value"] for key, i in zip(expected, ids)}
            assert got == expected


@pytest.mark.timeout(90)
@pytest.mark.parametrize("delay", DELAYS)
def test_averaging_four_hosts_gives_the_exact_weighted_mean(delay: str | None, no_leftovers: None) -> None:
    numel, weights = 50_000, [1.0, 2.0, 3.0, 0.5]  # 200 KB of float32: a few hundred ms per link
    with _bed(4, delay) as tb:
        nodes = [Node(tb, i) for i in range(4)]
        boot = nodes[0].request("start", config=DHT_CONFIG)["addr"]
        ids = [n.send("start", bootstrap=[boot], config=DHT_CONFIG) for n in nodes[1:]]
        for n, i in zip(nodes[1:], ids):
            n.reply(i, 60)
        for n, i in [(n, n.send("warm")) for n in nodes]:  # torch imported everywhere: they start together
            n.reply(i, 60)
        ids = [n.send("average", prefix="netns-avg", rank=r, numel=numel, weight=weights[r], expected=4, timeout=40)
               for r, n in enumerate(nodes)]
        results = [n.reply(i, 80) for n, i in zip(nodes, ids)]
    exact = sum(w * flat_input(r, numel).double() for r, w in enumerate(weights)) / sum(weights)
    for r, res in enumerate(results):
        assert res["group_size"] == 4 and not res["failed"] and not res["not_averaged"], res
        assert res["weight_total"] == pytest.approx(sum(weights))
        got = torch.tensor(res["values"], dtype=torch.float64)
        assert torch.allclose(got, exact, rtol=0, atol=1e-5), f"host {r}: max error {(got - exact).abs().max()}"


@pytest.mark.timeout(240)
def test_nat_routed_peers_are_full_members_and_a_client_nobody_can_dial_trains_too(no_leftovers: None) -> None:
    """Two public peers that relay, two behind NAT routers (``--behind-nat``) and a client-mode
    trainer in a host that takes no connections: the NAT'd ones announce only circuit addresses and
    own their share of every round's vector, the client owns none but averages through connections
    it dialled, and all five reach the accuracy target together."""
    n, nat, client = 5, (2, 3), 4
    # 100 ms of emulated compute per step: epochs of ~0.4 s. With epochs of a few ms, a peer delayed
    # by the 2 loaded cores or by a retransmission on these lossy links (TCP's minimum RTO is 200 ms)
    # missed most rounds and caught up by state loads instead
    train = ["--threads", "1", "--epochs", "40", "--wait-peers", str(n), "--compute-delay", "0.1"]
    with Testbed(n, rate=RATE, loss=LOSS, nat=nat, no_inbound=(client,)) as tb:
        # the client's host really takes no connections: a dial times out (a closed port would refuse at once)
        probe = "import socket,sys\ntry: socket.create_connection((sys.argv[1], 9), timeout=1.5)\n" \
                "except TimeoutError: print('timeout')\nexcept OSError as e: print(type(e).__name__)"
        out = tb.run(0, [sys.executable, "-c", probe, tb.hosts[client].ip], capture_output=True, text=True,
                     timeout=30)
        assert out.stdout.strip() == "timeout", out
        runs = train_swarm(tb, train, clients=(client,))
    summary = [{k: done[k] for k in ("epoch", "rounds", "failed_rounds", "group_values", "owned_values", "links",
                                     "bytes_sent")} for _, done in runs]
    for i, (started, done) in enumerate(runs):
        assert done["epoch"] == 40 and done["metrics"]["accuracy"] >= ACCURACY, summary
        # rounds in a group (a round alone while others are around counts as failed): most epochs
        assert done["rounds"] - done["failed_rounds"] >= 20, summary
        circuits = [a for a in started["multiaddrs"] if "/p2p-circuit/" in a]
        assert (circuits and len(circuits) == len(started["multiaddrs"])) if i in nat else not circuits, started
        if i == client:
            assert started["multiaddrs"] == [] and done["owned_values"] == 0, summary
            assert done["bytes_sent"] > 1e6 and done["bytes_received"] > 1e6, summary
        else:  # equal declared bandwidths: each of the 4 owners holds about a quarter of the group rounds' values
            assert 0.1 < done["owned_values"] / done["group_values"] < 0.5, summary


class Lines:
    """A process's text output, line by line, read by a thread: wait for a line that matches."""

    def __init__(self, stream: Any) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=lambda: [*map(self.lines.put, stream), self.lines.put(None)], daemon=True).start()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} within {timeout} s: {self.seen[-5:]}") from None
            if line is None:
                raise AssertionError(f"the output ended before a line matching {pattern!r}: {self.seen[-5:]}")
            self.seen.append(line)
            if m := re.search(pattern, line):
                return m


@pytest.mark.timeout(240)
def test_two_machines_train_together_following_the_readme(tmp_path: Any, no_leftovers: None) -> None:
    """README, "Training across machines": machine A runs ``p2ptrain peer --listen
    /ip4/0.0.0.0/tcp/4001 --key-file ...`` and prints the address others join with; machine B runs
    the same command with ``--bootstrap`` and that address; they train together.

    A used to print /ip4/127.0.0.1/tcp/4001/p2p/..., with which B dialed itself."""
    one_core = ["--threads", "1"]  # two peers on a 2-core box: oversubscribed torch threads crawl
    readme = [sys.executable, "-m", "p2ptrain", "peer", "--listen", "/ip4/0.0.0.0/tcp/4001"]
    with Testbed(2) as tb:
        err_a = tempfile.TemporaryFile("w+")
        a = tb.popen(0, [*readme, "--key-file", str(tmp_path / "key"), *one_core], stdout=subprocess.PIPE,
                     stderr=err_a, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        out_a = Lines(a.stdout)
        try:
            printed = out_a.wait_for(r"(/ip[46]/\S+/tcp/\d+/p2p/\w+)", 90).group(1)
        except AssertionError:
            err_a.seek(0)
            raise AssertionError(err_a.read()[-3000:]) from None
        addr = Multiaddr.parse(printed)
        assert (addr.host, addr.port, addr.peer_id is not None) == (tb.hosts[0].ip, 4001, True), printed
        b = Proc(tb, 1, [*readme, "--bootstrap", printed, *one_core, "--json"])
        done = b.wait_for(lambda e: e.get("event") == "done", 200)
        acc_a = float(out_a.wait_for(r"^done: .* acc (\d+\.\d)%", 60).group(1)) / 100
        assert a.wait(timeout=30) == 0 and b.proc.wait(timeout=30) == 0, b.err()
    # together: B averaged with A (rounds in a group, bytes both ways), and both reach the target
    assert done["epoch"] == 40 and done["rounds"] - done["failed_rounds"] >= 20, done
    assert done["bytes_sent"] > 1e5 and done["bytes_received"] > 1e5, done
    assert done["metrics"]["accuracy"] >= ACCURACY and acc_a >= ACCURACY, (done, acc_a)
