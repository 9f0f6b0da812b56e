"""Butterfly all-reduce over real loopback Hosts in one event loop: exactness per codec, shard sizes,
client-mode members, members that die or stall, hostile senders, late starters, bounded memory.

Every test is bounded by ``asyncio.timeout`` and closes its hosts and services in the fixture.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os

import pytest
import torch

from dht import Host, Identity, StreamReset, pack
from p2ptrain.averaging.allreduce import AllReduceService
from p2ptrain.averaging.protocol import PROTOCOL, parse_summary
from p2ptrain.averaging.round_types import AllReduceConfig, AllReduceResult, Drop, codec_id
from p2ptrain.averaging.group import Group, Member, partition
from p2ptrain.compression import get_codec

FAST = AllReduceConfig(chunk_numel=4096, timeout=10.0, join_timeout=2.0, stall_timeout=1.0)


# Nothing may reach the loop's exception handler (e.g. "Task exception was never retrieved").
pytestmark = pytest.mark.usefixtures("loop_errors")


class Swarm:
    def __init__(self):
        self.hosts: list[Host] = []
        self.services: list[AllReduceService] = []

    async def host(self, client: bool = False) -> Host:
        host = Host(Identity(), None if client else ("127.0.0.1", 0))
        await host.start()
        self.hosts.append(host)
        return host

    async def group(self, n: int, *, clients=(), bandwidths=None, config=AllReduceConfig(), service_cls=None,
                    raw=()):
        """n members (ranks in ``raw`` get a Host but no service); returns (group, hosts, services)."""
        hosts, services, members = [], [], []
        for r in range(n):
            h = await self.host(client=r in clients)
            hosts.append(h)
            addr = None if r in clients else ("127.0.0.1", h.listen_port)
            members.append(Member(h.peer_id, addr, bandwidths[r] if bandwidths else 1.0))
            if r in raw:
                services.append(None)
                continue
            cls = (service_cls or {}).get(r, AllReduceService) if isinstance(service_cls, dict) else (
                service_cls or AllReduceService)
            svc = cls(h, config)
            await svc.start()
            self.services.append(svc)
            services.append(svc)
        return Group(os.urandom(16), tuple(members)), hosts, services

    async def close(self):
        for s in self.services:
            await s.close()
        for h in self.hosts:
            await h.close()


@pytest.fixture
async def swarm():
    s = Swarm()
    yield s
    await s.close()


def data(n: int, numel: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(numel, generator=g) for _ in range(n)]
    ws = [float(w) for w in torch.rand(n, generator=g) * 3 + 0.5]
    return xs, ws


def weighted_mean(xs, ws, ranks=None):
    ranks = range(len(xs)) if ranks is None else ranks
    num = sum(ws[r] * xs[r].double() for r in ranks)
    return (num / sum(ws[r] for r in ranks)).float()


def expected_values(res: AllReduceResult, xs, ws, me: int, cn: int) -> torch.Tensor:
    """What member ``me`` must hold given the contributors its result reports, chunk by chunk."""
    out = xs[me].clone()
    for s in res.shards:  # a failed shard may still have an averaged prefix (owner died mid-reply)
        for a in range(s.start, s.start + s.averaged, cn):
            b = min(a + cn, s.end)
            ci = (a - s.start) // cn
            ranks = set(s.contributors) | {r for r, k in s.partial.items() if k > ci}
            out[a:b] = weighted_mean([x[a:b] for x in xs], ws, sorted(ranks))
    return out


async def run_all(group, services, flats, ws, codec="none", **kw):
    return await asyncio.gather(*(
        svc.run(group, r, flats[r], ws[r], codec, **kw) for r, svc in enumerate(services) if svc is not None
    ))


# ---------------------------------------------------------------------- exactness


TOL = {"none": 1e-6, "fp16": 4e-3, "int8": 4e-2, "int8-outlier": 4e-2}


@pytest.mark.parametrize("n,numel,codec", [
    (2, 3, "none"), (3, 10_007, "none"), (5, 65_536 + 300, "none"), (5, 3, "none"), (2, 65_536 + 300, "none"),
    (3, 65_536 + 300, "fp16"), (2, 10_007, "fp16"), (5, 10_007, "int8"), (2, 65_536 + 300, "int8"),
    (3, 3, "int8"), (3, 10_007, "bf16"), (3, 10_007, "int8-outlier"), (2, 65_536 + 300, "int8-outlier"),
])
async def test_weighted_mean(swarm, n, numel, codec):
    atol = TOL.get(codec, 2e-2)
    async with asyncio.timeout(20):
        cfg = AllReduceConfig(chunk_numel=4096, offload_min_numel=0 if numel > 60_000 else None, offload_min_cpus=1)
        group, _hosts, services = await swarm.group(n, config=cfg)
        xs, ws = data(n, numel, seed=n * numel)
        flats = [x.clone() for x in xs]
        results = await run_all(group, services, flats, ws, codec)
        want = weighted_mean(xs, ws)
        for r, (res, flat) in enumerate(zip(results, flats)):
            assert res.ok and res.failed == {} and res.rank == r and res.group_size == n
            assert all(s.contributors == list(range(n)) and s.averaged == s.numel for s in res.shards)
            assert math.isclose(res.weight_total, sum(ws), rel_tol=1e-6)
            torch.testing.assert_close(flat, want, atol=atol, rtol=0 if codec == "none" else 1e-3)
            # every member holds bit-identical values, whatever the codec
            assert torch.equal(flat, flats[0])
            if n > 1 and numel > n * 256:
                assert res.bytes_sent > 0 and res.bytes_received > 0


async def test_codec_wire_bytes_shrink(swarm):
    async with asyncio.timeout(20):
        numel = 1 << 16
        sent = {}
        for codec in ("none", "int8"):
            group, _h, services = await swarm.group(2, config=FAST)
            xs, ws = data(2, numel)
            flats = [x.clone() for x in xs]
            res = await run_all(group, services, flats, ws, codec)
            sent[codec] = res[0].bytes_sent
            assert res[0].ok
        # half of the vector goes out and half comes back: 4 bytes/value raw, ~1.02 with int8
        assert sent["none"] >= numel * 4 * 0.9
        assert sent["int8"] < sent["none"] / 3.5


async def test_topk_with_error_feedback(swarm):
    async with asyncio.timeout(20):
        group, _h, services = await swarm.group(3, config=FAST)
        xs, ws = data(3, 20_000)
        flats = [x.clone() for x in xs]
        codecs = [get_codec("topk", fraction=0.1) for _ in range(3)]  # one (stateful) codec per member
        results = await asyncio.gather(*(s.run(group, r, flats[r], ws[r], codecs[r]) for r, s in enumerate(services)))
        assert all(r.ok for r in results)
        assert all(torch.equal(f, flats[0]) for f in flats)  # fp16 gather: identical everywhere
        assert codecs[0].state_nbytes > 0  # residuals kept for the parts it sent
        # the owner's own part enters exactly; the others only by their top 10 %: closer than nothing
        want = weighted_mean(xs, ws)
        assert (flats[0] - want).norm() < (xs[0] - want).norm()


async def test_unequal_bandwidths_change_shards_not_result(swarm):
    async with asyncio.timeout(20):
        bws = [1.0, 3.0, 0.5, 2.0]
        numel = 50_000
        group, _h, services = await swarm.group(4, bandwidths=bws, config=FAST)
        xs, ws = data(4, numel)
        flats = [x.clone() for x in xs]
        results = await run_all(group, services, flats, ws)
        sizes = [s.numel for s in results[0].shards]
        assert sizes == [e - s for s, e in partition(numel, group.members)]
        assert sizes[1] > 5 * sizes[2] and abs(sizes[1] / numel - 3 / 6.5) < 0.01
        for f in flats:
            torch.testing.assert_close(f, weighted_mean(xs, ws), atol=1e-6, rtol=0)


async def test_client_mode_member_sends_and_receives(swarm):
    async with asyncio.timeout(20):
        group, hosts, services = await swarm.group(3, clients={1}, config=FAST)
        assert hosts[1].client_mode and not group.members[1].owns_shard
        xs, ws = data(3, 30_001)
        flats = [x.clone() for x in xs]
        results = await run_all(group, services, flats, ws)
        assert [s.owner for s in results[1].shards] == [0, 2]  # the client owns nothing
        for res, f in zip(results, flats):
            assert res.ok
            torch.testing.assert_close(f, weighted_mean(xs, ws), atol=1e-6, rtol=0)


async def test_late_starter_streams_wait_in_registry(swarm):
    async with asyncio.timeout(20):
        group, _h, services = await swarm.group(3, config=FAST)
        xs, ws = data(3, 20_000)
        flats = [x.clone() for x in xs]

        async def late():
            await asyncio.sleep(0.5)  # others' streams reach this member before its round exists
            return await services[2].run(group, 2, flats[2], ws[2])

        results = await asyncio.gather(services[0].run(group, 0, flats[0], ws[0]),
                                       services[1].run(group, 1, flats[1], ws[1]), late())
        assert all(r.ok for r in results)
        for f in flats:
            torch.testing.assert_close(f, weighted_mean(xs, ws), atol=1e-6, rtol=0)


async def test_unknown_group_stream_is_reset(swarm):
    async with asyncio.timeout(10):
        host = await swarm.host()
        svc = AllReduceService(host, accept_wait=0.2)
        await svc.start()
        swarm.services.append(svc)
        other = await swarm.host()
        conn = await other.connect("127.0.0.1", host.listen_port, host.peer_id)
        stream = await conn.open_stream(PROTOCOL, {"g": b"nope"})
        with pytest.raises(Exception, match="unknown group"):
            await stream.read(timeout=5)


async def test_one_peer_cannot_fill_the_registry_of_rounds_not_started(swarm):
    """Streams for rounds that have not started wait (``accept_wait``), but at most
    ``MAX_WAITING_PER_PEER`` per sender: a peer opening more is reset at once (and the registry,
    shared by every peer, keeps room for the others' streams of rounds about to start)."""
    from p2ptrain.averaging.allreduce import MAX_WAITING_PER_PEER

    async with asyncio.timeout(20):
        host = await swarm.host()
        svc = AllReduceService(host, accept_wait=10)
        await svc.start()
        swarm.services.append(svc)
        spammer = await swarm.host()
        conn = await spammer.connect("127.0.0.1", host.listen_port, host.peer_id)
        held = [await conn.open_stream(PROTOCOL, {"g": os.urandom(16)}) for _ in range(MAX_WAITING_PER_PEER)]
        extra = await conn.open_stream(PROTOCOL, {"g": os.urandom(16)})
        with pytest.raises(StreamReset, match="too many streams for rounds that have not started"):
            await extra.read(timeout=5)
        assert all(not s.closed for s in held)  # still waiting: within its share
        for s in held:
            s.reset("done")


# ---------------------------------------------------------------------- failures


class DiesMidRound(AllReduceService):
    """Aborts its host's connections after sending ``after`` chunks to owner 0."""

    after = 2

    async def _before_chunk(self, owner: int, index: int) -> None:
        if owner == 0 and index == self.after:
            for conn in list(self.host._all):
                conn.close("simulated crash", abort=True)
            await self.host.close()
        await asyncio.sleep(0.005)  # keep it slow enough to die mid-way


class SlowToTwo(AllReduceService):
    """Sends slowly to owner 2, so that 2 dies before it could reduce (deterministic test)."""

    async def _before_chunk(self, owner: int, index: int) -> None:
        if owner == 2:
            await asyncio.sleep(0.05)


async def test_member_dies_mid_round(swarm):
    async with asyncio.timeout(20):
        cn = FAST.chunk_numel
        group, _h, services = await swarm.group(3, config=FAST, service_cls={0: SlowToTwo, 1: SlowToTwo,
                                                                              2: DiesMidRound})
        xs, ws = data(3, 60_000)
        flats = [x.clone() for x in xs]
        t0 = asyncio.get_running_loop().time()
        results = await asyncio.gather(*(s.run(group, r, flats[r], ws[r]) for r, s in enumerate(services)),
                                       return_exceptions=True)
        assert asyncio.get_running_loop().time() - t0 < 5  # no waiting for timeouts: the resets are seen
        for r in (0, 1):
            res = results[r]
            assert isinstance(res, AllReduceResult), res
            assert 2 in res.failed and set(res.failed) == {2}
            assert res.not_averaged == [2]  # its shard: local values kept
            shard2 = res.shards[2]
            assert shard2.status == "failed" and "owner 2" in shard2.error and shard2.averaged == 0
            s0 = res.shards[0]
            assert s0.status == "ok" and s0.contributors == [0, 1] and s0.partial.get(2, 0) <= DiesMidRound.after
            assert 2 in res.excluded
            torch.testing.assert_close(flats[r], expected_values(res, xs, ws, r, cn), atol=1e-6, rtol=0)
            local = slice(shard2.start + shard2.averaged, shard2.end)  # what its owner never sent back
            torch.testing.assert_close(flats[r][local], xs[r][local])
        # the survivors agree on every averaged shard
        for s in results[0].shards[:2]:
            assert torch.equal(flats[0][s.start:s.end], flats[1][s.start:s.end])


async def test_member_never_joins(swarm):
    async with asyncio.timeout(20):
        cfg = AllReduceConfig(chunk_numel=4096, join_timeout=0.5, stall_timeout=1.0, timeout=10)
        group, hosts, services = await swarm.group(3, config=cfg)
        await hosts[2].close()  # gone before the round (its shard cannot be averaged)
        xs, ws = data(3, 20_000)
        flats = [x.clone() for x in xs]
        results = await asyncio.gather(services[0].run(group, 0, flats[0], ws[0]),
                                       services[1].run(group, 1, flats[1], ws[1]))
        for r, res in enumerate(results):
            assert "cannot reach" in res.failed[2]
            assert res.not_averaged == [2]  # member 2 never ran: its shard could not be averaged
            assert res.weight_total == pytest.approx(ws[0] + ws[1])
            torch.testing.assert_close(flats[r], expected_values(res, xs, ws, r, 4096), atol=1e-6, rtol=0)


class _Count(logging.Handler):
    """Sets ``event`` once ``n`` log records containing ``text`` were emitted."""

    def __init__(self, text: str, n: int):
        super().__init__(logging.INFO)
        self.text, self.n, self.event = text, n, asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.n -= 1
            if self.n <= 0:
                self.event.set()


async def test_member_lost_after_its_exchange_failed_is_not_waited_for(swarm):
    """Member 2 refuses our streams (our exchange with it fails while its connection stays open),
    then dies before opening its own streams: the owners must stop waiting for its part when its
    last connection closes, not sit out join_timeout (60 s here, the test allows 20)."""
    async with asyncio.timeout(20):
        cfg = AllReduceConfig(chunk_numel=4096, join_timeout=60, stall_timeout=60, timeout=120)
        group, hosts, services = await swarm.group(3, config=cfg, raw=(2,))

        async def refuse(stream):
            stream.reset("not now")

        hosts[2].on_stream(PROTOCOL, refuse)
        logger = logging.getLogger("p2ptrain.allreduce")
        counter, level = _Count("rank 2: owner 2", 2), logger.level
        logger.addHandler(counter)
        logger.setLevel(logging.INFO)
        try:
            xs, ws = data(3, 20_000)
            flats = [x.clone() for x in xs]
            runs = asyncio.gather(services[0].run(group, 0, flats[0], ws[0]),
                                  services[1].run(group, 1, flats[1], ws[1]))
            await counter.event.wait()  # both owners saw their exchange with 2 fail; 2 is still connected
            assert hosts[2].connection(hosts[0].peer_id) is not None
            await hosts[2].close()
            results = await runs
        finally:
            logger.removeHandler(counter)
            logger.setLevel(level)
        for r, res in enumerate(results):
            assert set(res.failed) == {2} and res.not_averaged == [2]
            assert res.shards[r].contributors == [0, 1]
            torch.testing.assert_close(flats[r], expected_values(res, xs, ws, r, 4096), atol=1e-6, rtol=0)


class Stalls(AllReduceService):
    async def _before_chunk(self, owner: int, index: int) -> None:
        if index == 1:
            await asyncio.sleep(30)  # alive, connected, silent


async def test_stalled_sender_is_cut_off(swarm):
    async with asyncio.timeout(20):
        cfg = AllReduceConfig(chunk_numel=4096, join_timeout=2, stall_timeout=0.5, timeout=8)
        group, _h, services = await swarm.group(3, config=cfg, service_cls={2: Stalls})
        xs, ws = data(3, 30_000)
        flats = [x.clone() for x in xs]
        tasks = [asyncio.create_task(s.run(group, r, flats[r], ws[r])) for r, s in enumerate(services)]
        t0 = asyncio.get_running_loop().time()
        results = await asyncio.gather(*tasks[:2])
        assert asyncio.get_running_loop().time() - t0 < 4
        for r, res in enumerate(results):
            assert "sender failed" in res.failed[2]
            ok = [s for s in res.shards if s.owner != 2]
            assert all(s.status == "ok" and s.partial.get(2) == 1 for s in ok)
            torch.testing.assert_close(flats[r], expected_values(res, xs, ws, r, 4096), atol=1e-6, rtol=0)
        tasks[2].cancel()
        await asyncio.gather(tasks[2], return_exceptions=True)


# ---------------------------------------------------------------------- hostile senders


def _header(group, rank, numel, codec, **over):
    c = get_codec(codec)
    h = {"g": group.group_id, "from": rank, "w": 1.0, "n": numel, "codec": codec_id(c), "gcodec": codec_id(c)}
    h.update(over)
    return h


async def run_beside_attacker(group, services, xs, ws, codec, attack):
    """Members 0 and 1 run the round while ``attack(owner)`` streams to each of them as member 2.
    Every attack must end in a reset (an exception), never a result, and both members must hold
    the average of the honest two; returns their results (for the reasons in ``failed``)."""
    flats = [x.clone() for x in xs]
    attacks = [asyncio.create_task(attack(o)) for o in (0, 1)]
    results = await asyncio.gather(services[0].run(group, 0, flats[0], ws[0], codec),
                                   services[1].run(group, 1, flats[1], ws[1], codec))
    outcomes = await asyncio.gather(*attacks)
    assert all(isinstance(o, Exception) for o in outcomes), outcomes
    want = weighted_mean(xs, ws, [0, 1])
    for res, flat in zip(results, flats):
        assert res.ok, res.shards  # both shards averaged over the honest members
        assert all(s.contributors == [0, 1] and not s.partial for s in res.shards)
        torch.testing.assert_close(flat, want, atol=4e-2 if codec == "int8" else 1e-6, rtol=0)
    return results


@pytest.mark.parametrize("kind", ["numel", "weight_nan", "weight_neg", "codec", "rank", "extra_key",
                                  "garbage_nan", "garbage_int8", "short_eof", "short_stall", "not_member"])
async def test_hostile_sender_is_dropped(swarm, kind):
    async with asyncio.timeout(20):
        cfg = AllReduceConfig(chunk_numel=4096, join_timeout=1, stall_timeout=0.5, timeout=8)
        # member 2 is a client-mode peer run by hand: it owns nothing, so only its sends matter
        group, hosts, services = await swarm.group(3, clients={2}, config=cfg, raw={2})
        codec = "int8" if kind == "garbage_int8" else "none"
        numel = 20_000
        xs, ws = data(3, numel)
        bounds = partition(numel, group.members)
        hostile = hosts[2]
        if kind == "not_member":
            hostile = await swarm.host(client=True)

        async def attack(owner: int):
            a, b = bounds[owner]
            c = get_codec(codec)
            hdr = {
                "numel": _header(group, 2, numel + 1, codec),
                "weight_nan": _header(group, 2, numel, codec, w=float("nan")),
                "weight_neg": _header(group, 2, numel, codec, w=-1.0),
                "codec": _header(group, 2, numel, "fp16"),
                "rank": _header(group, 1, numel, codec),
                "extra_key": {**_header(group, 2, numel, codec), "x": 1},
            }.get(kind, _header(group, 2, numel, codec))
            conn = await hostile.connect("127.0.0.1", group.members[owner].addr[1], group.members[owner].peer_id)
            stream = await conn.open_stream(PROTOCOL, hdr)
            nb = c.encoded_nbytes(min(4096, b - a))
            try:
                if kind == "garbage_nan":
                    await stream.write(torch.full((nb // 4,), float("nan")).numpy().tobytes())
                elif kind == "garbage_int8":
                    await stream.write(b"\xff" * nb)
                elif kind == "short_eof":
                    await stream.write(b"\x00" * (nb // 2))
                    stream.write_eof()
                elif kind == "short_stall":
                    await stream.write(b"\x00" * (nb // 2))
                else:
                    await stream.write(b"\x00" * nb)
                return await stream.read(timeout=6)
            except Exception as e:  # the owner resets the stream
                return e

        results = await run_beside_attacker(group, services, xs, ws, codec, attack)
        for res in results:
            assert 2 in res.failed
            if kind != "not_member":
                assert any(w in res.failed[2] for w in ("dropped", "did not open", "sender failed")), res.failed


@pytest.mark.parametrize("codec", ["none", "int8"])
async def test_sender_whose_values_would_overflow_the_sum_is_dropped(swarm, codec):
    """Finite but huge values (3e38) at the largest accepted weight would overflow the owner's
    float32 sum (int8) or the difference its running mean takes (``none``) to inf: the sender is
    dropped before its chunk touches the accumulator (the owner's own shard of ``flat``), and the
    honest members' average is exact."""
    async with asyncio.timeout(20):
        cfg = AllReduceConfig(chunk_numel=4096, join_timeout=1, stall_timeout=0.5, timeout=8)
        group, hosts, services = await swarm.group(3, clients={2}, config=cfg, raw={2})
        numel = 20_000
        xs, ws = data(3, numel)
        bounds = partition(numel, group.members)
        c = get_codec(codec)

        async def attack(owner: int):
            a, b = bounds[owner]
            conn = await hosts[2].connect("127.0.0.1", group.members[owner].addr[1], group.members[owner].peer_id)
            stream = await conn.open_stream(PROTOCOL, _header(group, 2, numel, codec, w=cfg.max_weight))
            try:
                for lo in range(a, b, 4096):
                    huge = torch.full((min(4096, b - lo),), 3e38)
                    await stream.write(bytes(c.encode(huge).tobytes()))
                stream.write_eof()
                return await stream.read(timeout=6)
            except Exception as e:  # the owner resets the stream
                return e

        results = await run_beside_attacker(group, services, xs, ws, codec, attack)
        for res in results:
            assert "overflow" in res.failed.get(2, ""), res.failed


async def test_hostile_owner_reply_rejected(swarm):
    """An owner that replies with NaN: the sender keeps its local values for that shard."""
    async with asyncio.timeout(20):
        group, _h, services = await swarm.group(2, config=FAST)
        xs, ws = data(2, 10_000)
        flats = [x.clone() for x in xs]
        # corrupt member 1's averages in place just before they are encoded
        from p2ptrain.averaging.reducer import ShardReducer

        orig = ShardReducer.finalize

        def bad_finalize(self, ci, out_wire=None):
            if self.rank == 1:
                self.acc.fill_(float("nan"))
                a, b = (i - self.start for i in self.chunks[ci])
                self.own[a:b].fill_(float("nan"))
                self.count[ci] = 1  # skip the division; encode raw NaN
                return memoryview(self.own[a:b].numpy()).cast("B")
            return orig(self, ci, out_wire)

        ShardReducer.finalize = bad_finalize
        try:
            results = await run_all(group, services, flats, ws)
        finally:
            ShardReducer.finalize = orig
        res0 = results[0]
        assert res0.not_averaged == [1] and "result rejected" in res0.shards[1].error
        s = res0.shards[1]
        assert res0.shards[1].averaged == 0
        torch.testing.assert_close(flats[0][s.start:s.end], xs[0][s.start:s.end])
        assert res0.shards[0].status == "ok"


async def test_hostile_owner_reply_keeps_what_came_before_the_nan(swarm):
    """A ``none`` reply with a NaN mid-chunk: the sender takes what came before it (whole chunks,
    and with the compiled kernels the 16 KiB pieces of that chunk before the NaN, checked and
    copied in one pass), keeps its local values from there on, and says how many it took."""
    from p2ptrain.compression import kernels

    async with asyncio.timeout(20):
        cn = 1 << 16
        group, _h, services = await swarm.group(2, config=AllReduceConfig(chunk_numel=cn, timeout=10.0))
        xs, ws = data(2, 4 * cn)
        flats = [x.clone() for x in xs]
        from p2ptrain.averaging.reducer import ShardReducer

        orig = ShardReducer.finalize
        sent: dict[int, torch.Tensor] = {}

        def bad_finalize(self, ci, out_wire=None):
            mv = orig(self, ci, out_wire)
            if self.rank == 1:
                t = torch.frombuffer(bytearray(mv), dtype=torch.float32)
                if ci == 1:
                    t[10_000] = float("nan")
                sent[ci] = t
                return memoryview(t.numpy()).cast("B")
            return mv

        ShardReducer.finalize = bad_finalize
        try:
            results = await run_all(group, services, flats, ws)
        finally:
            ShardReducer.finalize = orig
        s = results[0].shards[1]
        assert s.status == "failed" and "result rejected" in s.error and 1 in results[0].failed
        good = cn + (10_000 // kernels.COPY_PIECE * kernels.COPY_PIECE if kernels.AVAILABLE else 0)
        assert s.averaged == good
        got = flats[0][s.start : s.end]
        assert torch.equal(got[:cn], sent[0]) and torch.equal(got[cn:good], sent[1][: good - cn])
        assert torch.equal(got[good:], xs[0][s.start + good : s.end])  # local values from the bad piece on


@pytest.mark.parametrize("codec", ["none", "int8"])
async def test_replies_written_with_streaming_stores_are_the_same_bits(swarm, monkeypatch, codec):
    """Where ``flat`` is larger than the last-level cache, replies are written around the cache
    (``kernels.stream_worthwhile``): forced on for a small round, the results are bit for bit those
    of plain stores, and the replies did take the streaming path."""
    from p2ptrain.compression import kernels

    if not kernels.CAN_STREAM:
        pytest.skip("no streaming-store kernels on this CPU or install")
    calls = []
    for name in ("decode", "copy_finite"):
        def spy(*args, _f=getattr(kernels, name), _name=name):
            calls.append((_name, args[-1]))
            return _f(*args)
        monkeypatch.setattr(kernels, name, spy)
    async with asyncio.timeout(20):
        # two members: one contribution per owner, so no arrival order changes a sum's rounding
        group, _h, services = await swarm.group(2, config=AllReduceConfig(chunk_numel=4096))
        xs, ws = data(2, 2 * 10_007 + 5)
        got = {}
        for stream in (False, True):
            monkeypatch.setattr(kernels, "stream_worthwhile", lambda nbytes, _s=stream: _s)
            calls.clear()
            flats = [x.clone() for x in xs]
            g = Group(group.group_id + bytes([stream]), group.members)
            assert all(r.ok for r in await run_all(g, services, flats, ws, codec))
            assert calls and {c[1] for c in calls} == {stream}  # every reply went the asked way
            got[stream] = flats
        assert all(torch.equal(a, b) for a, b in zip(got[False], got[True]))


@pytest.mark.parametrize("n", [2, 3])
async def test_int8_owner_encodes_each_reply_with_the_chunks_last_contribution(swarm, monkeypatch, n):
    """int8 with the kernels: the contribution that completes one of an owner's chunks is added
    and the chunk's reply encoded in one pass (``decode_add_encode``), once per chunk; the results
    are bit for bit those of the add and the encode as two calls (two members: one contribution
    per chunk, so no arrival order changes a sum's rounding)."""
    from p2ptrain.compression import Codec, kernels
    from p2ptrain.compression.int8 import Int8Codec

    if not kernels.AVAILABLE:
        pytest.skip("the int8 kernels are not built here")
    calls = []
    real = kernels.decode_add_encode
    monkeypatch.setattr(kernels, "decode_add_encode", lambda *a: calls.append(a[1].numel()) or real(*a))
    async with asyncio.timeout(20):
        cn = 4096
        group, _h, services = await swarm.group(n, config=AllReduceConfig(chunk_numel=cn))
        numel = n * 5 * cn + 77
        xs, ws = data(n, numel, seed=5)
        got = []
        for fused in (True, False):
            if not fused:  # the generic method: decode_add_base, then encode
                monkeypatch.setattr(Int8Codec, "decode_add_encode", Codec.decode_add_encode)
            flats = [x.clone() for x in xs]
            g = Group(group.group_id + bytes([fused]), group.members)
            results = await run_all(g, services, flats, ws, "int8")
            assert all(r.ok for r in results)
            for r in range(n):
                torch.testing.assert_close(flats[r], weighted_mean(xs, ws), atol=TOL["int8"], rtol=1e-3)
            got.append(flats)
        chunks = sum(-(-(e - s) // cn) for s, e in partition(numel, group.members))
        assert len(calls) == chunks and sum(calls) == numel  # every chunk once, with its last contribution
        if n == 2:
            assert all(torch.equal(a, b) for a, b in zip(*got))


# ---------------------------------------------------------------------- memory


async def test_memory_is_per_shard(swarm):
    async with asyncio.timeout(60):
        numel, cn = 1 << 22, 1 << 16
        cfg = AllReduceConfig(chunk_numel=cn)
        group, _h, services = await swarm.group(4, config=cfg)
        xs, ws = data(4, numel)
        flats = [x.clone() for x in xs]
        results = await run_all(group, services, flats, ws, "int8")
        for res in results:
            assert res.ok
            shard = numel // 4
            # the accumulator (one shard of float32) + one receive buffer per sender + one reply
            # buffer per owner, each one chunk: nothing model-sized
            assert res.buffer_bytes <= shard * 4 + 6 * cn * 4
            assert res.buffer_bytes < numel * 4 * 0.3


@pytest.mark.parametrize("codec", ["int8", "fp16"])
async def test_wire_buffers_are_reused_between_rounds(swarm, codec):
    """Encoded chunks go into two wire buffers per part that the service keeps for the next round
    (fresh ones would page-fault on every chunk), and reuse changes no result."""
    from p2ptrain.compression import kernels

    async with asyncio.timeout(20):
        numel, cn = 1 << 18, 1 << 14
        # two members: one contribution per owner, so no arrival order changes a sum's rounding
        group, _h, services = await swarm.group(2, config=AllReduceConfig(chunk_numel=cn))
        xs, ws = data(2, numel, seed=11)
        kept = []
        for r in range(3):
            flats = [x.clone() for x in xs]
            g = Group(os.urandom(16), group.members)
            results = await run_all(g, services, flats, ws, codec)
            assert all(res.ok for res in results)
            if r == 0:
                first = [f.clone() for f in flats]
            else:  # same inputs, recycled (dirty) buffers: bit-identical results
                assert all(torch.equal(a, b) for a, b in zip(first, flats))
            kept.append([sorted(t.data_ptr() for t in svc._wires) for svc in services])
        # two for the part sent to the other owner + two for the reply of one's own shard (int8:
        # one for the whole shard's replies, each encoded with the chunk's last contribution)
        assert all(len(k) == (3 if codec == "int8" and kernels.AVAILABLE else 4) for k in kept[0])
        assert kept[0] == kept[1] == kept[2]


async def test_kept_buffers_go_once_the_service_is_idle(swarm):
    """The buffers a service keeps for its next round go back to the system after ``pool_idle``
    seconds without one; a round before then pushes the deadline back."""
    async with asyncio.timeout(20):
        numel = 1 << 18
        group, _h, services = await swarm.group(2, config=AllReduceConfig(chunk_numel=1 << 14))
        xs, ws = data(2, numel, seed=12)
        services[0].pool_idle = 3600.0
        services[1].pool_idle = 0.0
        released = asyncio.Event()
        release = services[1]._release_idle

        def watched() -> None:
            release()
            released.set()

        services[1]._release_idle = watched  # type: ignore[method-assign]
        assert (await run_all(group, services, [x.clone() for x in xs], ws, "fp16"))[0].ok
        await released.wait()
        assert services[1]._wires == [] and services[1]._scratch == []
        assert services[0]._wires and services[0]._idle is not None  # an hour to go


async def test_codec_work_stays_on_the_loop_without_a_spare_cpu(swarm, monkeypatch):
    """Offloading codec work to the worker thread needs ``offload_min_cpus`` CPUs; with fewer it
    runs inline (no thread hand-offs), with enough it goes to the worker."""
    async with asyncio.timeout(20):
        cfg = AllReduceConfig(chunk_numel=4096, offload_min_numel=0, offload_min_cpus=4)
        group, _h, services = await swarm.group(2, config=cfg)
        xs, ws = data(2, 50_000, seed=3)
        for cpus, offloaded in ((2, False), (4, True)):
            calls = []
            for svc in services:
                svc.cpus = cpus
                submit = svc.resources.executor.submit
                monkeypatch.setattr(svc.resources.executor, "submit",
                                    lambda *a, _s=submit, **k: calls.append(1) or _s(*a, **k))
            flats = [x.clone() for x in xs]
            results = await run_all(Group(os.urandom(16), group.members), services, flats, ws, "int8")
            assert all(r.ok for r in results)
            torch.testing.assert_close(flats[0], weighted_mean(xs, ws), atol=4e-2, rtol=0)
            assert bool(calls) == offloaded


async def test_none_accumulates_in_place(swarm):
    """``none`` sums into the member's own shard of ``flat``: no shard-sized accumulator at all."""
    async with asyncio.timeout(20):
        numel, cn = 1 << 22, 1 << 16
        group, _h, services = await swarm.group(4, config=AllReduceConfig(chunk_numel=cn))
        xs, ws = data(4, numel)
        flats = [x.clone() for x in xs]
        results = await run_all(group, services, flats, ws, "none")
        for res, flat in zip(results, flats):
            assert res.ok
            assert res.buffer_bytes <= 6 * cn * 4  # chunk buffers only
            torch.testing.assert_close(flat, weighted_mean(xs, ws), atol=1e-6, rtol=0)


async def test_lossy_gather_codec_leaves_members_identical(swarm):
    """Exact reduce, fp16 replies: each owner keeps what the others decode, not its exact sum."""
    async with asyncio.timeout(20):
        group, _h, services = await swarm.group(3, config=AllReduceConfig(chunk_numel=4096))
        xs, ws = data(3, 20_000, seed=5)
        flats = [x.clone() for x in xs]
        results = await run_all(group, services, flats, ws, "none", gather_codec="fp16")
        assert all(r.ok for r in results)
        assert torch.equal(flats[0], flats[1]) and torch.equal(flats[0], flats[2])
        torch.testing.assert_close(flats[0], weighted_mean(xs, ws), atol=4e-3, rtol=1e-3)


@pytest.mark.parametrize("codec", ["none", "int8"])
async def test_nan_beyond_our_own_shard(swarm, codec):
    """A NaN in what we send to another owner: ``run`` raises either way. ``none`` finds it in its
    check of the whole input, before anything is sent; ``int8`` checks nothing up front and finds
    the NaN when that chunk is encoded, after earlier chunks went out. The others finish without
    us, finite, holding what their results say was averaged, and no NaN reaches them."""
    from p2ptrain.compression import CompressionError

    async with asyncio.timeout(20):
        cn = 4096
        group, _hosts, services = await swarm.group(3, config=FAST)
        for svc in services:  # how long the others wait for rank 0 to take their streams
            svc.accept_wait = 1.0
        numel = 3 * 5 * cn
        xs, ws = data(3, numel, seed=7)
        s2, _e2 = partition(numel, group.members)[2]
        bad = xs[0].clone()
        bad[s2 + 3 * cn + 7] = float("nan")  # the 4th chunk rank 0 sends to owner 2
        flats = [bad.clone(), xs[1].clone(), xs[2].clone()]
        outcome = await asyncio.gather(*(svc.run(group, r, flats[r], ws[r], codec) for r, svc in enumerate(services)),
                                       return_exceptions=True)
        assert isinstance(outcome[0], CompressionError) and "NaN or inf" in str(outcome[0])
        assert ("found during the round" in str(outcome[0])) == (codec == "int8")
        if codec == "none":
            torch.testing.assert_close(flats[0], bad, rtol=0, atol=0, equal_nan=True)  # untouched
        for r in (1, 2):
            res = outcome[r]
            assert isinstance(res, AllReduceResult), res
            assert 0 in res.failed
            assert bool(torch.isfinite(flats[r]).all())
            torch.testing.assert_close(flats[r], expected_values(res, xs, ws, r, cn), atol=TOL[codec], rtol=1e-3)
            assert 0 not in res.shards[2].contributors and res.shards[2].partial.get(0, 0) <= 3  # not the NaN chunk
            if codec == "none":
                assert all(0 not in s.contributors and 0 not in s.partial for s in res.shards)


@pytest.mark.parametrize("n", [2, 3])  # 2: the first contribution is the last, added and encoded at once
@pytest.mark.parametrize("bad", [float("nan"), -float("inf"), 3e38])
async def test_int8_refuses_our_own_shard_where_it_is_first_read(swarm, bad, n):
    """With ``int8`` nothing is checked before the round: a NaN/inf in our own shard, or a value
    whose sum could overflow float32 (3e38), is found by the first contribution's add to that
    chunk (with two members also the one that encodes the chunk's reply in the same pass). ``run``
    raises; the others finish without our shard (their own values kept there), and nothing of ours
    that was not finite reaches them."""
    from p2ptrain.compression import CompressionError

    async with asyncio.timeout(20):
        cn = 4096
        group, _hosts, services = await swarm.group(n, config=FAST)
        numel = n * 5 * cn
        xs, ws = data(n, numel, seed=8)
        s0, _e0 = partition(numel, group.members)[0]
        bad_x = xs[0].clone()
        bad_x[s0 + 2 * cn + 11] = bad  # the 3rd chunk of our own shard
        flats = [bad_x.clone()] + [x.clone() for x in xs[1:]]
        outcome = await asyncio.gather(*(svc.run(group, r, flats[r], ws[r], "int8") for r, svc in enumerate(services)),
                                       return_exceptions=True)
        assert isinstance(outcome[0], CompressionError), outcome[0]
        assert "own shard" in str(outcome[0])
        assert ("NaN or inf" if bad != 3e38 else "overflow") in str(outcome[0])
        for r in range(1, n):
            res = outcome[r]
            assert isinstance(res, AllReduceResult), res
            assert 0 in res.failed and res.shards[0].status == "failed" and res.shards[0].averaged == 0
            assert bool(torch.isfinite(flats[r]).all())
            torch.testing.assert_close(flats[r], expected_values(res, xs, ws, r, cn), atol=TOL["int8"], rtol=1e-3)


class StopsSendingToZero(AllReduceService):
    """Dies after sending one chunk to owner 0: owner 0's later chunks get no contribution."""

    async def _before_chunk(self, owner: int, index: int) -> None:
        if owner == 0 and index == 1:
            for conn in list(self.host._all):
                conn.close("simulated crash", abort=True)
            await self.host.close()


async def test_int8_refuses_a_nan_in_an_own_chunk_nobody_contributed_to(swarm):
    """Our own chunk that no contribution read is checked before its reply is encoded: ``run``
    raises for the NaN instead of reporting a shard that failed to encode."""
    from p2ptrain.compression import CompressionError

    async with asyncio.timeout(20):
        cn = 4096
        group, _hosts, services = await swarm.group(2, config=FAST, service_cls={1: StopsSendingToZero})
        numel = 2 * 4 * cn
        xs, ws = data(2, numel, seed=9)
        xs[0][3 * cn + 5] = float("nan")  # owner 0's 4th chunk: rank 1 died after its 1st
        outcome = await asyncio.gather(*(svc.run(group, r, xs[r], ws[r], "int8") for r, svc in enumerate(services)),
                                       return_exceptions=True)
        assert isinstance(outcome[0], CompressionError), outcome[0]
        assert "own shard" in str(outcome[0]) and "NaN or inf" in str(outcome[0])


async def test_rejects_bad_arguments(swarm):
    async with asyncio.timeout(10):
        group, _h, services = await swarm.group(2, config=FAST)
        with pytest.raises(ValueError):
            await services[0].run(group, 1, torch.zeros(10), 1.0)  # not our rank
        with pytest.raises(ValueError):
            await services[0].run(group, 0, torch.zeros(10, dtype=torch.float64), 1.0)
        with pytest.raises(ValueError):
            await services[0].run(group, 0, torch.zeros(10), float("inf"))
        with pytest.raises(ValueError):
            await services[0].run(group, 0, torch.zeros(4, 4), 1.0)
        from p2ptrain.compression import CompressionError

        with pytest.raises(CompressionError):
            await services[0].run(group, 0, torch.tensor([1.0, float("nan")]), 1.0)


def test_an_owner_summary_carries_the_weight_each_part_counted_with():
    """The weights an owner reports (what receipts credit at most) are optional (an older owner
    sends none) and checked like the rest: a rank outside the group, a NaN, a negative weight or
    a wrong shape drops the owner."""
    base = {"ok": [0, 1], "part": [[2, 3]], "w": 5.0}
    assert parse_summary(pack(base), 3) == ([0, 1], {2: 3}, 5.0, {})
    assert parse_summary(pack({**base, "cw": [[0, 2.0], [1, 3]]}), 3)[3] == {0: 2.0, 1: 3.0}
    for bad in ([[3, 1.0]], [[0, float("nan")]], [[0, -1.0]], [[0, True]], [[0]], {"0": 1.0}, [[0, float("inf")]]):
        with pytest.raises(Drop, match="counted weights"):
            parse_summary(pack({**base, "cw": bad}), 3)
