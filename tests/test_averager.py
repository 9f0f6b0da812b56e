"""Averager end to end in one process: matchmaking through a real DHT, then the all-reduce."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from dht import DHTNode
from p2ptrain.averaging import AllReduceConfig, Averager, BlockingAverager, EarlyStart
from p2ptrain.contrib.receipt import build_receipt


@pytest.fixture
async def nodes():
    started: list[DHTNode] = []

    async def make(n: int) -> list[DHTNode]:
        first = DHTNode()
        await first.start()
        rest = [DHTNode() for _ in range(n - 1)]
        await asyncio.gather(*(nd.start(first.multiaddrs) for nd in rest))
        started.extend([first, *rest])
        return started

    try:
        yield make
    finally:
        await asyncio.gather(*(nd.close() for nd in started), return_exceptions=True)


async def test_weighted_mean_in_place_over_several_rounds(nodes):
    peers = await nodes(3)
    gen = torch.Generator().manual_seed(0)
    tensors = [{"w": torch.randn(37, 11, generator=gen), "b": torch.randn(5, generator=gen)} for _ in peers]
    avgs = [Averager(nd, "run", ts, codec="none", target_group_size=8) for nd, ts in zip(peers, tensors)]
    try:
        async with asyncio.timeout(30):
            for round_weights in ([1.0, 2.0, 3.0], [5.0, 1.0, 1.0]):
                expected = {
                    k: sum(w * ts[k] for w, ts in zip(round_weights, tensors)) / sum(round_weights) for k in ("w", "b")
                }
                results = await asyncio.gather(*(a.step(weight=w) for a, w in zip(avgs, round_weights)))
                assert [r.group_size for r in results] == [3, 3, 3]
                assert all(r.averaged and r.bytes_sent > 0 for r in results)
                for ts in tensors:
                    for k in ("w", "b"):
                        torch.testing.assert_close(ts[k], expected[k], rtol=0, atol=1e-5)
    finally:
        await asyncio.gather(*(a.close() for a in avgs))


async def test_lone_peer_keeps_its_tensors_and_does_not_hang(nodes):
    (peer,) = await nodes(1)
    t = torch.arange(10.0)
    avg = Averager(peer, "alone", [t], matchmaking_timeout=0.5)
    try:
        start = time.monotonic()
        result = await avg.step()
        assert result.group_size == 1 and not result.averaged
        assert time.monotonic() - start < 2.0
        assert torch.equal(t, torch.arange(10.0))
    finally:
        await avg.close()


def test_rejects_non_float_tensors_and_unknown_codec():
    node = DHTNode()
    with pytest.raises(TypeError, match="only floating-point"):
        Averager(node, "run", [torch.arange(3)])
    with pytest.raises(Exception, match="int7"):
        Averager(node, "run", [torch.zeros(3)], codec="int7")


def test_blocking_averager_from_synchronous_code():
    first = BlockingAverager([torch.zeros(100)], "sync-run", matchmaking_timeout=3.0)
    try:
        boot = [str(a) for a in first.dht.multiaddrs]
        second = BlockingAverager([torch.ones(100)], "sync-run", initial_peers=boot, matchmaking_timeout=3.0)
        try:
            import threading

            results = {}
            thread = threading.Thread(target=lambda: results.setdefault("a", first.step()))
            thread.start()
            results["b"] = second.step()
            thread.join(10)
            assert results["a"].group_size == results["b"].group_size == 2
            assert torch.allclose(first.averager.tensors[0], torch.full((100,), 0.5))
            assert torch.allclose(second.averager.tensors[0], torch.full((100,), 0.5))
        finally:
            second.close()
    finally:
        first.close()


async def test_robust_rule_refuses_pairs_unless_the_swarm_is_two(nodes):
    """Two peers of a larger swarm (a split round) do not pair under a robust rule: a pair cannot
    outvote a hostile member, so each keeps its own tensors. Told the swarm has 2 peers, they pair."""
    peers = await nodes(2)
    tensors = [torch.full((64,), float(i)) for i in range(2)]
    avgs = [Averager(nd, "robust", [t], aggregation="trimmed_mean", matchmaking_timeout=1.0)
            for nd, t in zip(peers, tensors)]
    try:
        async with asyncio.timeout(20):
            split = await asyncio.gather(*(a.step(round_id="split", expected=4) for a in avgs))
            assert [r.group_size for r in split] == [1, 1]
            assert [float(t[0]) for t in tensors] == [0.0, 1.0]
            pair = await asyncio.gather(*(a.step(round_id="pair", expected=2) for a in avgs))
            assert [r.group_size for r in pair] == [2, 2] and all(r.averaged for r in pair)
            assert [float(t[0]) for t in tensors] == [0.5, 0.5]
    finally:
        await asyncio.gather(*(a.close() for a in avgs))


async def test_views_of_one_buffer_are_averaged_in_it_and_others_a_slice_at_a_time(nodes):
    """A round runs one all-reduce per slice of ``slice_numel`` values. Tensors back to back in
    one fp32 CPU buffer are averaged in place (no copy of them is made); others go through a
    staging buffer of a slice, each slice written back under the given lock with ``on_write``
    called; the two kinds of peer average together."""
    import threading

    from p2ptrain.averaging.averager import shared_flat

    peers = await nodes(2)
    gen = torch.Generator().manual_seed(1)
    flat = torch.randn(700, generator=gen)
    views = [flat[:600].view(20, 30), flat[600:]]
    assert shared_flat(views).data_ptr() == flat.data_ptr() and shared_flat(views[::-1]) is None
    assert shared_flat([flat[:10], flat[11:20]]) is None  # a gap between them
    spread = [torch.randn(30, 20, generator=gen).t(), torch.randn(100, generator=gen)]  # (one not contiguous)
    expected = [(a + b) / 2 for a, b in zip(views, spread)]
    lock, writes = threading.Lock(), []

    def written() -> None:
        assert lock.locked()
        writes.append(1)

    a0 = Averager(peers[0], "slices", views, codec="none", slice_numel=256)
    a1 = Averager(peers[1], "slices", spread, codec="none", slice_numel=256)
    assert a0._flat is not None and a1._flat is None
    try:
        async with asyncio.timeout(30):
            r0, r1 = await asyncio.gather(a0.step(), a1.step(lock=lock, on_write=written))
        assert r0.averaged and r1.averaged and len(writes) == 3  # 700 values in slices of 256
        assert r1.bytes_sent > 0 and len(r0.allreduces) == len(r1.allreduces) == 3
        for got, want in zip(views, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        for got, want in zip(spread, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        assert views[0].data_ptr() == flat.data_ptr()
    finally:
        await asyncio.gather(a0.close(), a1.close())


def hook_formed(avgs: list[Averager]) -> list[asyncio.Event]:
    """An event per averager, set once its matchmaking formed a group."""
    formed = [asyncio.Event() for _ in avgs]
    for avg, event in zip(avgs, formed):
        form = avg.matchmaker.form_group

        async def formed_then_set(*args, _form=form, _event=event, **kwargs):
            group = await _form(*args, **kwargs)
            _event.set()
            return group

        avg.matchmaker.form_group = formed_then_set
    return formed


async def begin_early(avgs: list[Averager], formed: list[asyncio.Event], round_id: str,
                      weight: float) -> tuple[list[EarlyStart], list[asyncio.Task]]:
    """Every averager begins ``round_id`` before its data (``step(start=)``, declaring ``weight``);
    returns its start and step once each formed its group (``formed``: see ``hook_formed``)."""
    loop = asyncio.get_running_loop()
    for e in formed:
        e.clear()
    starts = [EarlyStart(loop) for _ in avgs]
    steps = [asyncio.create_task(a.step(weight=weight, round_id=round_id, expected=len(avgs), start=s))
             for a, s in zip(avgs, starts)]
    await asyncio.gather(*(e.wait() for e in formed))
    return starts, steps


async def test_an_early_start_forms_the_group_first_and_averages_once_the_data_are_in(nodes):
    """``step(start=...)``: matchmaking runs before the data (the tensors are not touched), the
    all-reduce once every member said ``go`` with its weight; the wait for the group after that is
    nothing when it formed before. A peer that leaves instead keeps its tensors and does not hang."""
    peers = await nodes(3)
    loop = asyncio.get_running_loop()
    tensors = [torch.full((64,), -1.0) for _ in peers]  # (placeholders: an average of these is a bug)
    fast = AllReduceConfig(join_timeout=1.0)  # (the members of a group the leaver formed wait this long for it)
    avgs = [Averager(nd, "early", [t], codec="none", target_group_size=8, allreduce_config=fast)
            for nd, t in zip(peers, tensors)]
    formed = hook_formed(avgs)
    try:
        async with asyncio.timeout(30):
            starts, steps = await begin_early(avgs, formed, "r", 100.0)
            assert not any(t.done() for t in steps) and all(bool((t == -1.0).all()) for t in tensors)
            weights = [1.0, 2.0, 5.0]
            for i, (t, s, w) in enumerate(zip(tensors, starts, weights)):
                t.copy_(torch.full((64,), float(i)))
                s.go(w)
            results = await asyncio.gather(*steps)
            mean = sum(i * w for i, w in enumerate(weights)) / sum(weights)
            assert [r.group_size for r in results] == [3, 3, 3] and all(r.averaged for r in results)
            assert all(r.matchmaking_s == 0.0 and r.group_s > 0 for r in results)
            # every member's receipt credits what each had when it said go, not the 100 samples it
            # declared (each shard's owner reports the weight it counted)
            said = {nd.peer_id: w for nd, w in zip(peers, weights)}
            for nd, r in zip(peers, results):
                receipt = build_receipt(r.allreduce, "early", "r", nd.peer_id, 0.0, slices=r.allreduces)
                assert {line.peer: line.samples for line in receipt.lines} == said
            for t in tensors:
                torch.testing.assert_close(t, torch.full((64,), mean), rtol=0, atol=1e-6)

            # the next round: one peer leaves before handing its data over
            starts, steps = await begin_early(avgs, formed, "r2", 1.0)
            starts[2].leave()
            kept = tensors[2].clone()
            for s in starts[:2]:
                s.go(1.0)
            results = await asyncio.gather(*steps)
            assert results[2].group_size == 1 and results[2].members == [peers[2].peer_id]
            assert torch.equal(tensors[2], kept)
            with pytest.raises(ValueError, match="weight"):
                EarlyStart(loop).go(float("nan"))
    finally:
        await asyncio.gather(*(a.close() for a in avgs))


async def test_a_member_that_leaves_a_round_begun_early_tells_the_others_who_go_on_at_once(nodes):
    """A member whose data never come (it loaded a state meanwhile) leaves the group it formed early
    and tells the others: they average without it at once, instead of waiting ``join_timeout`` (5 s)
    for its parts; its shard is the one part left unaveraged."""
    peers = await nodes(3)
    loop = asyncio.get_running_loop()
    tensors = [torch.full((64,), float(i)) for i in range(3)]
    avgs = [Averager(nd, "leaves", [t], codec="none", target_group_size=8) for nd, t in zip(peers, tensors)]
    formed = hook_formed(avgs)
    try:
        async with asyncio.timeout(30):
            starts, steps = await begin_early(avgs, formed, "r", 1.0)
            starts[2].leave()
            t0 = loop.time()
            for s in starts[:2]:
                s.go(1.0)
            results = await asyncio.gather(*steps[:2])
            waited = loop.time() - t0
            assert (await steps[2]).group_size == 1 and torch.equal(tensors[2], torch.full((64,), 2.0))
        assert waited < AllReduceConfig().join_timeout / 2, waited
        for r, t, own in zip(results, tensors, (0.0, 1.0)):
            leaver = r.members.index(peers[2].peer_id)
            assert r.group_size == 3 and set(r.failed) <= {leaver}, r.failed
            for shard in r.allreduce.shards:  # (the stayers' shards averaged, the leaver's not)
                value = own if shard.owner == leaver else 0.5
                assert shard.status == ("failed" if shard.owner == leaver else "ok")
                assert bool((t[shard.start:shard.end] == value).all()), (shard, t)
    finally:
        await asyncio.gather(*(a.close() for a in avgs))


async def test_an_early_start_that_never_gets_its_data_leaves_its_round(nodes):
    """A training loop that never says ``go`` (it stopped stepping) does not keep the round open:
    the step ends a timeout after matchmaking, as a group of one that wrote nothing."""
    (peer,) = await nodes(1)
    t = torch.arange(10.0)
    avg = Averager(peer, "quiet", [t], matchmaking_timeout=0.3)
    try:
        async with asyncio.timeout(10):
            result = await avg.step(start=EarlyStart(asyncio.get_running_loop()))
        assert result.group_size == 1 and result.members == [peer.peer_id] and 0.25 <= result.group_s < 5
        assert torch.equal(t, torch.arange(10.0))
    finally:
        await avg.close()
