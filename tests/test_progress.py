"""The sans-IO core of global progress: report parsing (hostile input) and the swarm view."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dht import Identity
from p2ptrain.optim.progress import PeerReport, parse_report, summarize

PEERS = [Identity().peer_id for _ in range(4)]
NOW = 1_000_000.0


def report(i: int, epoch: int = 3, samples: int = 100, sps: float = 50.0, age: float = 0.0, **kw) -> PeerReport:
    return PeerReport(PEERS[i], epoch, samples, sps, NOW - age, kw.pop("schema", "abc"), ("127.0.0.1", 4000 + i), **kw)


def test_report_round_trips_through_the_wire_form():
    r = report(1, ready=True)
    assert parse_report(r.to_wire(), r.peer) == r
    timed = report(2, eta=NOW + 3.5)  # (diloco: when its inner phase should end)
    assert parse_report(timed.to_wire(), timed.peer) == timed and "f" not in r.to_wire()


@pytest.mark.parametrize("mutate", [
    lambda w: w.update(v=2), lambda w: w.update(e=-1), lambda w: w.update(e=1.5), lambda w: w.update(s="many"),
    lambda w: w.update(sps=float("nan")), lambda w: w.update(sps=-1), lambda w: w.update(t=float("inf")),
    lambda w: w.update(h="x" * 65), lambda w: w.update(a=["127.0.0.1", 70000]), lambda w: w.update(a="host:1"),
    lambda w: w.pop("e"), lambda w: w.update(f=float("nan")), lambda w: w.update(f="soon"),
])
def test_malformed_reports_are_rejected(mutate):
    wire = report(0).to_wire()
    mutate(wire)
    assert parse_report(wire, PEERS[0]) is None


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda children: (st.lists(children, max_size=4)
                                      | st.dictionaries(st.text(max_size=4), children, max_size=6))))
def test_parse_report_never_raises(value):
    result = parse_report(value, PEERS[0])
    assert result is None or isinstance(result, PeerReport)


def test_view_sums_the_current_epoch_and_extrapolates_by_throughput():
    me = report(0, samples=100, sps=0)
    others = [report(1, samples=200, sps=100, age=0.5), report(2, samples=50, sps=10, age=1.0, ready=True)]
    view = summarize(others, me, NOW, target=1000, stale_after=10)
    # peer 1 computed for 0.5 s at 100/s since its report; peer 2 is ready: not extrapolated
    assert view.samples == pytest.approx(100 + 200 + 50 + 50)
    assert view.num_peers == 3 and [p.peer for p in view.ready] == [PEERS[2]]
    assert view.eta == pytest.approx((1000 - 400) / 110)


def test_view_follows_the_most_advanced_epoch_and_lists_those_behind():
    me = report(0, epoch=3)
    view = summarize([report(1, epoch=4, samples=10), report(2, epoch=3)], me, NOW, 100, 10)
    assert view.epoch == 4 and view.samples == pytest.approx(10 + 50 * 0)  # age 0: no extrapolation
    assert {p.peer for p in view.behind} == {PEERS[0], PEERS[2]}


def test_stale_left_ignored_and_other_schemas_do_not_count():
    me = report(0, epoch=1, samples=0, sps=0)
    others = [report(1, epoch=9, age=60), report(2, epoch=9, left=True), report(3, epoch=9, schema="other")]
    view = summarize(others, me, NOW, 100, stale_after=10)
    assert view.epoch == 1 and view.num_peers == 1
    view = summarize([report(1, epoch=9)], me, NOW, 100, 10, ignored=[PEERS[1]])
    assert view.epoch == 1


def test_extrapolation_is_bounded():
    """A peer that stopped reporting (crashed, clock skew) cannot make the target look reached."""
    me = report(0, samples=0, sps=0)
    view = summarize([report(1, samples=0, sps=1000, age=9)], me, NOW, 100_000, stale_after=10)
    assert view.samples <= 1000 * 5
    assert not view.reached and math.isfinite(view.eta)


def test_peers_just_past_the_previous_round_count_toward_the_new_epoch():
    """After a round, the others' reports still say the old epoch for a moment; they are computing
    for the new one already, and short epochs would overshoot their target if they did not count."""
    me = report(0, epoch=4, samples=32, sps=100)
    others = [report(1, epoch=3, samples=500, sps=100, age=2.0),
              report(2, epoch=3, samples=500, sps=10, age=0.1, ready=True)]
    view = summarize(others, me, NOW, 1000, 10, epoch_started=NOW - 0.5)
    # peer 1: 0.5 s at 100/s since our epoch began; peer 2 (seen entering the round that ended
    # our previous epoch): 0.1 s at 10/s since its report
    assert view.samples == pytest.approx(32 + 50 + 1)
    assert summarize(others, me, NOW, 1000, 10).samples == pytest.approx(32)


def test_the_epoch_ends_on_published_counts_and_the_estimate_only_says_when_to_look():
    """An estimate past the target (a peer's throughput extrapolated since its report) is not the
    end of the epoch: only the counts the peers published are; it is a reason to read them again."""
    me = report(0, samples=300, sps=100)
    view = summarize([report(1, samples=300, sps=1000, age=0.5)], me, NOW, target=1000, stale_after=10)
    assert view.samples == pytest.approx(300 + 300 + 500) and view.due
    assert view.reported == 600 and not view.reached
    view = summarize([report(1, samples=700, sps=1000)], me, NOW, target=1000, stale_after=10)
    assert view.reached and view.due


def test_peers_training_counts_every_recent_peer_at_any_epoch():
    """Right after a round the other peers may still report the epoch that ended: they train in
    the run all the same (what ``stats.peers`` and the metrics' swarm_peers show)."""
    me = report(0, epoch=4)
    view = summarize([report(1, epoch=3, ready=True), report(2, epoch=4), report(3, epoch=1, age=60)], me, NOW, 100,
                     stale_after=10)
    assert view.num_peers == 2 and {p.peer for p in view.training} == set(PEERS[:3])

def test_refresh_now_is_bounded_when_the_dht_does_not_answer():
    """A peer about to skip a round reads the progress again first; a DHT that does not answer
    must leave it with the view it had after ``timeout``, not stall its training."""
    import asyncio
    import types

    from p2ptrain.optim.progress import ProgressTracker

    async def silent(*args, **kwargs):
        await asyncio.Event().wait()  # never answers

    node = types.SimpleNamespace(client_mode=True, multiaddrs=[], peer_id=Identity().peer_id, store_owned=silent,
                                 get_owned=silent, local_owned=lambda *a, **kw: {})

    async def main():
        tracker = ProgressTracker(node, "run", "schema", target=64)
        before = tracker.view
        t0 = asyncio.get_running_loop().time()
        view = await tracker.refresh_now(timeout=0.05)
        return view, before, asyncio.get_running_loop().time() - t0

    view, before, took = asyncio.run(main())
    assert view is before and took < 2.0


def test_a_peer_blocked_in_a_round_or_a_load_keeps_its_report_alive(monkeypatch):
    """The training thread reports nothing while it waits for a round or downloads the state (up
    to two matchmaking timeouts back to back). The tracker republishes the same report as of now
    before others take it for a dead peer's (older than ``ttl``): two peers blocked together once
    left each other out of their views and trained on alone, a state apart."""
    import asyncio
    import time as clock
    import types

    from dht import OwnedRead
    from p2ptrain.optim import progress

    stored: list[dict] = []

    async def store_owned(key, name, value, expiration, closest=None, notice=None):
        stored.append(value)

    async def get_owned(key, name, **kw):
        return OwnedRead({}, [])

    node = types.SimpleNamespace(client_mode=True, multiaddrs=[], peer_id=Identity().peer_id,
                                 store_owned=store_owned, get_owned=get_owned, nearest=_in_order,
                                 local_owned=lambda *a, **kw: {})
    now = [clock.time()]
    monkeypatch.setattr(progress.time, "time", lambda: now[0])

    async def main():
        tracker = progress.ProgressTracker(node, "run", "schema", target=64, ttl=10.0)
        tracker.report(3, 32, 100.0, ready=True)
        await tracker.refresh_now()
        await tracker.refresh_now()  # nothing changed, nothing is due: no store
        assert len(stored) == 1
        now[0] += 1.0
        await tracker.refresh_now()
        assert len(stored) == 1
        now[0] += 2.0  # 3 s without a report: republished, same report, fresh time
        await tracker.refresh_now()
        assert len(stored) == 2 and stored[1]["t"] == now[0] and stored[1]["e"] == 3 and stored[1]["r"] is True
        assert {k: v for k, v in stored[1].items() if k != "t"} == {k: v for k, v in stored[0].items() if k != "t"}

    asyncio.run(main())


def test_a_refresh_reads_one_of_the_three_closest_holders_in_turn_and_looks_the_key_up_again_when_due_or_when_it_fails(
        monkeypatch):
    """A refresh costs a few RPCs, not a lookup over the whole swarm: after a full lookup it
    publishes to the key's three closest holders and reads from one of them in turn (each holds
    every report); a new lookup follows after ``relookup`` seconds, or at once after a refresh
    whose holder failed."""
    import asyncio
    import types

    from dht import Contact, OwnedRead
    from p2ptrain.optim import progress

    closest = [Contact(Identity().peer_id, ("127.0.0.1", 5000 + i)) for i in range(8)]
    asked: list[list | None] = []
    stored_to: list[list | None] = []
    answering = [True]

    async def get_owned(key, name, holders=None, **kw):
        asked.append(holders)
        return OwnedRead({}, closest if holders is None else holders if answering[0] else [])

    async def store_owned(key, name, value, expiration, closest=None, notice=None):
        stored_to.append(closest)

    node = types.SimpleNamespace(client_mode=True, multiaddrs=[], peer_id=Identity().peer_id,
                                 store_owned=store_owned, get_owned=get_owned, nearest=_in_order,
                                 local_owned=lambda *a, **kw: {})
    clock = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])

    async def main():
        tracker = progress.ProgressTracker(node, "run", "schema", target=64, relookup=5.0)
        await tracker.refresh_now()  # nothing known yet: a full lookup
        for epoch in (1, 2, 3):
            tracker.report(epoch, 32, 100.0)
            await tracker.refresh_now()
            assert stored_to[-1] == closest[:3]
        assert asked == [None, [closest[0]], [closest[1]], [closest[2]]]
        clock[0] += 6.0  # past relookup: a full lookup again
        await tracker.refresh_now()
        assert asked[-1] is None
        answering[0] = False  # the holder asked fails: the next refresh looks the key up
        await tracker.refresh_now()
        assert asked[-1] is not None
        await tracker.refresh_now()
        assert asked[-1] is None

    asyncio.run(main())


def test_the_first_lookups_of_the_key_come_sooner_then_every_relookup_seconds(monkeypatch):
    """A swarm that starts at once fills its routing tables as it goes: a first lookup that stopped
    short of the key's holders left a third of 64 peers writing and reading apart from the rest
    for the 15 s until the next. Lookups come 1, 2, 4 ... s apart, up to ``relookup``."""
    import asyncio

    from dht import Contact, OwnedRead
    from p2ptrain.optim import progress

    closest = [Contact(Identity().peer_id, ("127.0.0.1", 5000 + i)) for i in range(3)]
    full: list[float] = []
    clock = [100.0]

    async def get_owned(key, name, holders=None, **kw):
        if holders is None:
            full.append(clock[0] - 100.0)
        return OwnedRead({}, closest if holders is None else holders)

    async def store_owned(key, name, value, expiration, closest=None, notice=None):
        pass

    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    node = _fake_node(store_owned, get_owned)

    async def main():
        tracker = progress.ProgressTracker(node, "run", "schema", target=64, relookup=5.0)
        for _ in range(39):  # (19 s)
            await tracker.refresh_now()
            clock[0] += 0.5

    asyncio.run(main())
    assert full == [0.0, 1.5, 4.0, 8.5, 14.0], full  # (gaps > 1, 2, 4, then relookup = 5 s)


def test_a_holder_sees_the_reports_written_to_its_own_node_at_each_read():
    """The peers nearest the key are its holders: the reports written to them are in their own
    node, and they read from the other holders. A write that reached only ours (the others did
    not answer, or the writer's lookup found us and farther peers) is in our view all the same."""
    import asyncio
    import time
    import types

    from dht import OwnedRead
    from p2ptrain.optim import progress

    other = Identity().peer_id
    theirs = PeerReport(other, 2, 10, 50.0, time.time(), "schema", ("127.0.0.1", 1)).to_wire()

    async def get_owned(key, name, holders=None, **kw):
        return OwnedRead({}, [])  # (the other holders have nothing of it)

    async def store_owned(key, name, value, expiration, closest=None, notice=None):
        pass

    node = _fake_node(store_owned, get_owned)
    node.local_owned = lambda key, name, **kw: {other: types.SimpleNamespace(value=theirs)}

    async def main():
        tracker = progress.ProgressTracker(node, "run", "schema", target=64)
        view = await tracker.refresh_now()
        assert [p.peer for p in view.peers] == [other] and view.epoch == 2

    asyncio.run(main())


def test_a_lookup_that_missed_a_nearer_holder_does_not_replace_it_until_it_fails(monkeypatch):
    """Under load a key's nearest holders may answer a lookup too late to count; the reports then
    went to, and came from, farther peers that hold a few of them (at 64 peers some views missed a
    third of the swarm for epochs). The holders kept are the nearest that answered any lookup."""
    import asyncio

    from dht import Contact, DHTNode, OwnedRead
    from p2ptrain.optim import progress

    contacts = DHTNode.nearest("run/progress", [Contact(Identity().peer_id, ("127.0.0.1", 5000 + i))
                                                for i in range(8)], 8)
    answers = [contacts[:3], contacts[1:4]]  # the second lookup: the nearest answered too late
    stored_to: list = []
    failing: list = []

    async def get_owned(key, name, holders=None, **kw):
        if holders is None:
            return OwnedRead({}, answers.pop(0) if answers else contacts[1:4])
        return OwnedRead({}, [] if holders[0].peer_id in failing else holders)

    async def store_owned(key, name, value, expiration, closest=None, notice=None):
        stored_to.append([c.peer_id for c in closest or []])

    clock = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    node = _fake_node(store_owned, get_owned)
    node.nearest = DHTNode.nearest

    async def main():
        tracker = progress.ProgressTracker(node, "run", "schema", target=64, relookup=5.0)
        await tracker.refresh_now()
        clock[0] += 6.0
        tracker.report(1, 0, 100.0)
        await tracker.refresh_now()  # the second lookup
        tracker.report(2, 0, 100.0)
        await tracker.refresh_now()
        assert stored_to[-1] == [c.peer_id for c in contacts[:3]]
        failing.append(contacts[0].peer_id)
        for epoch in (3, 4, 5, 6):  # reads rotate to the nearest holder, which now fails: it is dropped
            tracker.report(epoch, 0, 100.0)
            await tracker.refresh_now()
        assert contacts[0].peer_id not in stored_to[-1]  # (the last report went out after the drop)

    asyncio.run(main())


def _in_order(key, contacts, n):
    """``DHTNode.nearest`` for fakes whose contacts come nearest first."""
    return list({c.peer_id: c for c in contacts}.values())[:n]


def _fake_node(store_owned, get_owned):
    import asyncio
    import contextlib
    import types

    return types.SimpleNamespace(client_mode=True, multiaddrs=[], peer_id=Identity().peer_id,
                                 store_owned=store_owned, get_owned=get_owned, nearest=_in_order,
                                 local_owned=lambda *a, **kw: {},
                                 notices=lambda key: contextlib.nullcontext(asyncio.Event()))


def test_a_new_sample_count_is_published_every_few_seconds_or_once_the_epoch_looks_over(monkeypatch):
    """Each reader checks the signature of every record that changed since its last read, so a
    count that only grew is published every ``publish_every`` s (readers extrapolate in between),
    while a new epoch or ready flag goes out at once, and so does the count once the estimate says
    the target is reached (the epoch ends on published counts)."""
    import asyncio
    import time as clock

    from dht import OwnedRead
    from p2ptrain.optim import progress

    stored: list[dict] = []

    async def store_owned(key, name, value, expiration, closest=None, notice=None):
        stored.append(value)

    async def get_owned(key, name, **kw):
        return OwnedRead({}, [])

    now = [clock.time()]
    monkeypatch.setattr(progress.time, "time", lambda: now[0])

    async def main():
        tracker = progress.ProgressTracker(_fake_node(store_owned, get_owned), "run", "schema", target=1000,
                                           ttl=30.0, publish_every=2.0)
        await tracker.refresh_now()
        assert [v["s"] for v in stored] == [0]
        for samples in (32, 64, 96):  # the count grows, the epoch's end is far: kept back
            now[0] += 0.5
            tracker.report(0, samples, 64.0)
            await tracker.refresh_now()
        assert len(stored) == 1
        now[0] += 0.6  # 2.1 s since the last publish: the count goes out
        tracker.report(0, 128, 64.0)
        await tracker.refresh_now()
        assert [v["s"] for v in stored] == [0, 128]
        now[0] += 0.1
        tracker.report(1, 0, 64.0)  # a new epoch: at once
        await tracker.refresh_now()
        now[0] += 0.1
        tracker.report(1, 0, 64.0, ready=True)  # ready: at once
        await tracker.refresh_now()
        assert [(v["e"], v["r"]) for v in stored[2:]] == [(1, False), (1, True)]
        now[0] += 0.1
        assert tracker.report(1, 1000, 64.0).due  # our own count reaches the target: at once
        await tracker.refresh_now()
        assert stored[-1]["s"] == 1000 and len(stored) == 5

    asyncio.run(main())


def test_a_new_epoch_or_ready_flag_follows_the_store_in_flight_at_once_not_at_the_next_poll():
    """A report that changed beyond its count while our last one was still being stored goes out
    as soon as that store is in. Waiting for the next poll (``min_refresh`` at least) left peers
    whose epochs take a few ms deciding from a report epochs old that we would not come to a
    round: two README peers averaged in 5-30 of 40 epochs."""
    import asyncio

    from dht import OwnedRead
    from p2ptrain.optim import progress

    stored: list[dict] = []
    gate = asyncio.Event()

    async def store_owned(key, name, value, expiration, closest=None, notice=None):
        stored.append(value)
        if len(stored) == 2:
            await gate.wait()  # (a slow holder)

    async def get_owned(key, name, **kw):
        return OwnedRead({}, [])

    async def main():
        tracker = progress.ProgressTracker(_fake_node(store_owned, get_owned), "run", "schema", target=1000,
                                           refresh=30.0, min_refresh=5.0, ttl=60.0)
        await tracker.start()
        try:
            tracker.report(1, 0, 64.0)  # a new epoch: its store hangs
            while len(stored) < 2:
                await asyncio.sleep(0.01)
            tracker.report(1, 0, 64.0, ready=True)
            await asyncio.sleep(0.05)
            gate.set()
            async with asyncio.timeout(1.0):  # (not min_refresh's 5 s)
                while len(stored) < 3:
                    await asyncio.sleep(0.01)
            assert [(v["e"], v["r"]) for v in stored] == [(0, False), (1, False), (1, True)]
        finally:
            await tracker.close()

    asyncio.run(main())


def test_a_new_epoch_or_ready_flag_goes_out_while_a_slow_read_is_in_flight():
    """Under load a read takes a round trip or more: a ready report must not wait for it (peers
    end their epoch on it), so it is stored at once, beside the read."""
    import asyncio

    from dht import OwnedRead
    from p2ptrain.optim import progress

    stored: list[dict] = []
    reading, gate = asyncio.Event(), asyncio.Event()

    async def store_owned(key, name, value, expiration, closest=None, notice=None):
        stored.append(value)

    async def get_owned(key, name, **kw):
        if stored:  # (the first read, at start, answers at once)
            reading.set()
            await gate.wait()  # (a slow holder)
        return OwnedRead({}, [])

    async def main():
        tracker = progress.ProgressTracker(_fake_node(store_owned, get_owned), "run", "schema", target=1000,
                                           refresh=0.01, min_refresh=0.01, ttl=60.0)
        await tracker.start()
        try:
            await asyncio.wait_for(reading.wait(), 5.0)  # a refresh's read hangs
            tracker.report(0, 500, 64.0, ready=True)
            async with asyncio.timeout(5.0):
                while not stored[-1]["r"]:
                    await asyncio.sleep(0.01)
            assert not gate.is_set()  # (stored while the read still hangs)
        finally:
            gate.set()
            await tracker.close()

    asyncio.run(main())


def test_reports_are_kept_across_reads_each_peers_newest_until_no_read_returns_it(monkeypatch):
    """A refresh reads one holder: a report it lacks (a store that did not reach it) or holds in an
    older version does not go back in the view; a peer that no read returns for ``ttl`` seconds
    (its record expired everywhere) is forgotten."""
    import asyncio
    import time as clock

    from dht import OwnedRead, OwnedValue
    from p2ptrain.optim import progress

    t0 = clock.time()
    mono = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: mono[0])
    replies: list[dict] = []

    async def get_owned(key, name, **kw):
        return OwnedRead({r.peer: OwnedValue(r.to_wire(), t0 + 60) for r in replies.pop(0)}, [])

    async def store_owned(*args, **kwargs):
        pass

    def rep(i: int, epoch: int, at: float) -> PeerReport:
        return PeerReport(PEERS[i], epoch, 10, 5.0, t0 + at, "schema", ("127.0.0.1", 4000 + i))

    async def main():
        tracker = progress.ProgressTracker(_fake_node(store_owned, get_owned), "run", "schema", target=10**6,
                                           ttl=10.0)
        replies.extend([[rep(1, 2, 0.0), rep(2, 2, 0.0)], [rep(1, 1, -1.0)], [rep(1, 3, 1.0)]])
        view = await tracker.refresh_now()
        assert {p.peer for p in view.training} == {tracker.me.peer, PEERS[1], PEERS[2]}
        view = await tracker.refresh_now()  # an older report of peer 1, none of peer 2: both kept
        assert view.epoch == 2 and {p.peer for p in view.peers} == {PEERS[1], PEERS[2]}
        mono[0] += 11.0  # peer 2 not returned for longer than ttl: forgotten
        view = await tracker.refresh_now()
        assert view.epoch == 3 and {p.peer for p in view.training} == {tracker.me.peer, PEERS[1]}

    asyncio.run(main())


def test_a_caller_looping_on_wait_fresh_gets_at_most_one_read_per_min_refresh():
    """``wait_for_peers`` and ``drain`` loop on ``wait_fresh``: each call starts a refresh at once,
    but no sooner than ``min_refresh`` after the last one, so such loops do not read the key's
    holders back to back (64 peers joining at once did, hundreds of times a second)."""
    import asyncio

    from dht import OwnedRead
    from p2ptrain.optim import progress

    reads = [0]

    async def store_owned(key, name, value, expiration, closest=None, notice=None):
        pass

    async def get_owned(key, name, **kw):
        reads[0] += 1
        return OwnedRead({}, [])

    async def main():
        tracker = progress.ProgressTracker(_fake_node(store_owned, get_owned), "run", "schema", target=1000,
                                           refresh=10.0, min_refresh=0.05)
        await tracker.start()
        loop = asyncio.get_running_loop()
        start, views = loop.time(), 0
        while loop.time() - start < 0.5:
            await tracker.wait_fresh(1.0)
            views += 1
        took = loop.time() - start
        await tracker.close()
        return views, took

    views, took = asyncio.run(main())
    assert 3 <= views <= took / 0.05 + 2, (views, took)
    assert reads[0] <= views + 2


def test_refresh_is_slow_far_from_the_epochs_end_and_fast_near_it():
    """Far from the target a read waits half the estimated time left (each read returns every
    peer's record), at most ``slow_refresh``; near it, at the estimate's end; past it, at once."""
    from p2ptrain.optim.progress import SwarmView, refresh_period

    def period(samples: float, sps: float = 1000.0, ready: bool = False, **kw) -> float:
        view = SwarmView(epoch=3, samples=samples, target=10_000, sps=sps, **kw)
        return refresh_period(view, ready, refresh=0.5, min_refresh=0.05, slow_refresh=2.0)

    assert period(0) == 2.0  # 10 s left
    assert period(7_000) == pytest.approx(1.5)  # 3 s left
    assert period(9_200) == 0.5  # 0.8 s left: the usual period
    assert period(9_800) == pytest.approx(0.2)  # at the estimate's end
    assert period(10_100) == 0.05  # the estimate says over: confirm on the counts
    assert period(10_100, reported=10_000) == 0.1
    assert period(0, ready=True) == 2.0  # in a round: our next epoch's report goes out at once
    assert period(0, sps=0.0) == 0.5  # nobody computes: no estimate
    assert refresh_period(SwarmView(epoch=3, samples=0, target=10_000, sps=1000.0), False, refresh=10.0,
                          min_refresh=0.05, slow_refresh=2.0) == 10.0  # never more often than before


def test_the_view_at_each_step_follows_each_new_read_and_ignored_peers_at_once(monkeypatch):
    """``estimate`` (every step) reuses the reports' filtering until a read or the ignored peers change."""
    import asyncio
    import time as clock

    from dht import OwnedRead, OwnedValue
    from p2ptrain.optim import progress

    t0 = clock.time()
    mono = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: mono[0])
    replies: list[list[PeerReport]] = []

    async def get_owned(key, name, **kw):
        return OwnedRead({r.peer: OwnedValue(r.to_wire(), t0 + 60) for r in replies.pop(0)}, [])

    async def store_owned(*args, **kwargs):
        pass

    def rep(i: int, epoch: int) -> PeerReport:
        return PeerReport(PEERS[i], epoch, 10, 5.0, t0, "schema", ("127.0.0.1", 4000 + i))

    async def main():
        tracker = progress.ProgressTracker(_fake_node(store_owned, get_owned), "run", "schema", target=10**6,
                                           ttl=10.0)
        replies.extend([[rep(1, 2), rep(2, 2)], [rep(1, 2), rep(2, 4)]])
        await tracker.refresh_now()
        assert tracker.estimate().epoch == 2 and tracker.estimate().num_peers == 2
        tracker.ignore([PEERS[1]], seconds=5.0)
        assert {p.peer for p in tracker.estimate().training} == {tracker.me.peer, PEERS[2]}
        mono[0] += 6.0  # no longer ignored
        assert {p.peer for p in tracker.estimate().training} == {tracker.me.peer, PEERS[1], PEERS[2]}
        await tracker.refresh_now()
        assert tracker.estimate().epoch == 4 and [p.peer for p in tracker.estimate().peers] == [PEERS[2]]

    asyncio.run(main())


def test_a_ready_report_reaches_the_readers_through_their_holders_notice_not_their_next_poll():
    """A peer's first ready report of an epoch asks the key's holders to tell the readers that
    watch it (those that read from them lately), handing the report over: a reader that would poll
    again only in 30 s has it at once, without a read. The report is its writer's signed record,
    believed as a read's (a notice without it, from an older holder, makes the reader read at once:
    the next test)."""
    import asyncio

    from dht import Contact, DHTConfig, DHTNode
    from p2ptrain.optim.progress import ProgressTracker

    async def main():
        cfg = DHTConfig(rpc_timeout=1.0, bootstrap_timeout=2.0)
        first = DHTNode(config=cfg)
        await first.start()
        rest = [DHTNode(config=cfg) for _ in range(6)]
        await asyncio.gather(*(n.start(first.multiaddrs) for n in rest))
        slow = dict(refresh=30.0, slow_refresh=30.0, min_refresh=0.01)
        # the two peers farthest from the key: neither holds the reports (3 holders of 7 nodes)
        by_peer = {n.peer_id: n for n in rest}
        order = DHTNode.nearest("run/progress", [Contact(n.peer_id, ("127.0.0.1", 1)) for n in rest], len(rest))
        a, b = (ProgressTracker(by_peer[c.peer_id], "run", "schema", target=1000, **slow) for c in order[-2:])
        try:
            await a.start()
            await b.start()
            for _ in range(3):  # a read from each holder in turn: b watches them all
                await b.refresh_now()
            assert not b.view.ready
            reads = b._turn
            a.report(0, 10, 0.0, ready=True)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            while not b.view.ready and loop.time() - t0 < 5.0:
                await asyncio.sleep(0.01)
            assert [r.peer for r in b.view.ready] == [a.node.peer_id]
            assert b._turn == reads  # (no read of the holders: none is due for 30 s)
        finally:
            await a.close()
            await b.close()
            await asyncio.gather(*(n.close() for n in [first, *rest]))

    asyncio.run(main())


def test_notices_wake_a_read_at_most_every_quarter_second_however_many_come():
    """A writer cycling notice tags (or a holder lying about writes) makes the holders tell us
    again and again: on notices that hand over no new report the tracker reads, at most once per
    ``_NOTICE_GAP``."""
    import asyncio
    import contextlib
    import types

    from dht import OwnedRead
    from p2ptrain.optim import progress

    told = asyncio.Event()
    reads = [0]

    async def get_owned(key, name, **kw):
        reads[0] += 1
        return OwnedRead({}, [])

    async def store_owned(*args, **kwargs):
        pass

    node = types.SimpleNamespace(client_mode=True, multiaddrs=[], peer_id=Identity().peer_id, store_owned=store_owned,
                                 get_owned=get_owned, nearest=_in_order, local_owned=lambda *a, **kw: {},
                                 notices=lambda key: contextlib.nullcontext(told))

    async def main():
        tracker = progress.ProgressTracker(node, "run", "schema", target=1000, refresh=30.0, slow_refresh=30.0,
                                           min_refresh=0.01)
        await tracker.start()
        first = reads[0]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        while loop.time() - t0 < 0.6:  # a notice every 10 ms for 0.6 s
            told.set()
            await asyncio.sleep(0.01)
        took = loop.time() - t0
        await tracker.close()
        return reads[0] - first, took

    woken, took = asyncio.run(main())
    assert 1 <= woken <= took / progress._NOTICE_GAP + 2, (woken, took)
