"""Peers behind NAT as full members of training: they announce no direct address, are reached
through relays (``/p2p-circuit`` addresses in their averaging entries, progress reports and
provider records), own a shard of each round and serve state to joiners."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from dht import Identity, Multiaddr, RelayService
from p2ptrain import DHT, DecentralizedOptimizer
from p2ptrain.averaging.group import Group, Member, partition
from p2ptrain.checkpoint.directory import parse_provider, provider_value
from p2ptrain.checkpoint.record import CheckpointRecord
from p2ptrain.optim.progress import PeerReport, parse_report

pytestmark = pytest.mark.timeout(90)

CLI = [sys.executable, "-m", "p2ptrain.cli"]
LOOPBACK = ("127.0.0.1", 0)
PEER = Identity().peer_id
RELAY = Multiaddr.parse(f"/ip4/10.0.0.1/tcp/4001/p2p/{Identity().peer_id}")


def test_relayed_addresses_round_trip_and_bad_ones_are_refused() -> None:
    circuit = RELAY.circuit(PEER)
    nat = Member(PEER, None, 2.0, 16.0, (circuit,))
    assert Member.from_wire(nat.to_wire()) == nat and nat.owns_shard
    unweighted = Member(PEER, None, 1.0, None, (circuit,))
    assert Member.from_wire(unweighted.to_wire()) == unweighted
    assert not Member(PEER, None, 1.0).owns_shard  # client mode: nobody can dial it
    # a NAT'd member's share is sized by its bandwidth like anyone's
    public = Member(Identity().peer_id, ("10.0.0.2", 1), 1.0)
    assert partition(1024, (public, nat), align=1) == [(0, 341), (341, 1024)]
    base = [PEER.to_bytes(), None, 1.0, None]
    for bad in ([str(RELAY.circuit(Identity().peer_id))],  # someone else's circuit
                [str(RELAY)],  # not a circuit address
                [str(circuit)] * 5,  # more than a peer may advertise
                str(circuit)):
        with pytest.raises(ValueError, match="relay addresses"):
            Member.from_wire([*base, bad])
    with pytest.raises(ValueError):
        Group.from_wire([b"g" * 16, [[*base, [str(circuit)], "extra"]]])

    report = PeerReport(PEER, 3, 10, 1.0, 1.0, "h", None, relays=(circuit,))
    assert parse_report(report.to_wire(), PEER) == report and report.reach
    assert parse_report({**report.to_wire(), "ra": [str(RELAY)]}, PEER) is None
    assert parse_report(report.to_wire(), Identity().peer_id) is None  # the circuits name another peer


def test_a_checkpoint_provider_behind_nat_is_announced_with_its_circuits() -> None:
    writer = Identity()
    record = CheckpointRecord.sign(writer, run_id="run", epoch=5, manifest_id=b"\x01" * 32, size=1)
    circuit = RELAY.circuit(record.writer)
    provider = parse_provider(record.writer, provider_value(None, record, (circuit,)), "run", record.manifest_id)
    assert provider is not None and provider.addr is None and provider.relays == (circuit,) and provider.reach
    hostile = provider_value(None, record, (RELAY.circuit(PEER),))  # circuits of another peer
    assert parse_provider(record.writer, hostile, "run", record.manifest_id) is None


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))  # shards of 256


def train(opt: DecentralizedOptimizer, model: torch.nn.Module, seed: int, until_epoch: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2000):
        if opt.epoch >= until_epoch:
            return
        x = torch.randn(16, 8, generator=gen)
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True) / 8).backward()
        opt.step()
        opt.zero_grad()


def test_a_peer_behind_nat_owns_a_shard_and_serves_state_to_a_joiner() -> None:
    """A public peer that relays and a peer behind NAT average, the NAT'd one owning its part of
    each round; once the public one stops training, a joiner loads the state from the NAT'd peer
    alone, at the circuit address its progress record names (or over a connection it has: the
    DHT's own traffic, or one hole-punched)."""
    public = DHT([], listen=LOOPBACK)
    relay = public.run(_start_relay(public))
    dhts = [public]
    opts: list[DecentralizedOptimizer] = []
    try:
        nat = DHT([str(public.multiaddrs[0])], listen=LOOPBACK, reachable=False)
        dhts.append(nat)
        assert nat.multiaddrs and all(a.is_circuit and a.relay_id == public.peer_id for a in nat.multiaddrs)
        models = [make_model(), make_model()]
        opts = [DecentralizedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), dht=d, run_id="nat",
                                       target_batch_size=64, batch_size_per_step=16) for m, d in zip(models, dhts)]
        assert opts[0].wait_for_peers(2, timeout=20) == 2 and opts[1].wait_for_peers(2, timeout=20) == 2
        threads = [threading.Thread(target=train, args=(o, m, 10 + i, 3)) for i, (o, m) in enumerate(zip(opts, models))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads) and [o.epoch for o in opts] == [3, 3]
        # equal bandwidths: the NAT'd peer owned about half of every group round's vector
        s = opts[1].stats
        assert s.group_values > 0 and 0.3 < s.owned_values / s.group_values < 0.7, s
        report = opts[1].tracker.me
        assert report.addr is None and report.relays and report.relays[0].relay_id == public.peer_id

        opts.pop(0).close()  # the public peer leaves training; it still relays
        late = make_model(seed=7)
        joiner_dht = DHT([str(public.multiaddrs[0])], listen=LOOPBACK)
        dhts.append(joiner_dht)
        joiner = DecentralizedOptimizer(torch.optim.AdamW(late.parameters(), lr=1e-2), dht=joiner_dht,
                                        run_id="nat", target_batch_size=64, batch_size_per_step=16)
        opts.append(joiner)
        assert joiner.epoch == 3 and joiner.stats.state_loads == 1
        for p, q in zip(late.parameters(), models[1].parameters()):
            assert torch.equal(p, q)
    finally:
        for o in opts:
            o.close()
        public.run(relay.close())
        for d in reversed(dhts):
            d.close()


async def _start_relay(dht: DHT) -> RelayService:
    service = RelayService(dht.node.host)
    service.start()
    return service


@pytest.mark.parametrize("extra, words", [
    (["--client"], "--behind-nat and --client exclude each other"),
    (["--relay"], "--behind-nat cannot --relay"),
    ([], "--behind-nat needs --bootstrap"),
])
def test_behind_nat_options_that_cannot_work_are_refused(extra: list[str], words: str, tmp_path, capsys) -> None:
    from p2ptrain import cli

    assert cli.main(["peer", "--behind-nat", *extra, "--data-dir", str(tmp_path)]) == 2
    assert words in capsys.readouterr().err


def test_behind_nat_without_a_relay_in_reach_says_so(tmp_path) -> None:
    public = DHT([], listen=LOOPBACK)  # relays for nobody
    try:
        out = subprocess.run([*CLI, "peer", "--behind-nat", "--bootstrap", str(public.multiaddrs[0]), "--epochs", "1",
                              "--data-dir", str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    finally:
        public.close()
    assert out.returncode != 0 and "no relay took a reservation" in out.stderr and "Traceback" not in out.stderr
