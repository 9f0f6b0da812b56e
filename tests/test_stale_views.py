"""A peer whose view of the swarm lags (DHT reads slow or failing under load) must not act as if it
were alone: a diloco peer stepping alone leaves the swarm for good (``diloco_step.dropped``), and a
joiner that starts from scratch trains on a model nobody else has (``catch_up_at_start``); the
updates such peers skip must not leave the others behind them for good (``load_state_from_peers``)."""

from __future__ import annotations

import asyncio
import types

import pytest

from dht import Identity
from p2ptrain.averaging import StepResult
from p2ptrain.checkpoint import ChunksUnavailableError
from p2ptrain.optim.catch_up import catch_up_at_start, fetch_state, load_state_from_peers
from p2ptrain.optim.diloco_step import dropped
from p2ptrain.optim.progress import PeerReport, SwarmView
from p2ptrain.optim.state_sync import StateSync, UntrustedState


def _report(peer, epoch):
    return PeerReport(peer, epoch, 0, 1.0, 0.0, "s", addr=("127.0.0.1", 1))


def test_a_peer_that_met_nobody_steps_alone_only_when_no_partner_of_its_last_round_is_left():
    me, a, b = (Identity().peer_id for _ in range(3))
    looks: list[int] = []

    async def refresh_now(timeout=None):
        assert timeout is not None  # (bounded: a silent DHT must not stall training)
        looks.append(1)
        return fake.tracker.view

    def opt(expected, partners, view):
        return types.SimpleNamespace(
            _last_expected=expected, _partners=partners, _applied=5, epoch=5, local_samples=0,
            _paused=0.0, stats=types.SimpleNamespace(observe=lambda *a: None),
            _loop=types.SimpleNamespace(run=lambda coro: asyncio.run(coro)),
            tracker=types.SimpleNamespace(view=view, me=_report(me, 5), refresh_now=refresh_now))

    # a (our partner in round 4) still reports epoch 3: a view older than that round (a loaded
    # peer's DHT reads lag), in which we looked due alone and skipped round 5 while a took it
    stale = SwarmView(epoch=5, samples=0, target=64, peers=[_report(me, 5)], behind=[_report(a, 3)])
    fake = opt(1, {a: 4}, stale)
    assert dropped(fake, None) and looks == [1]  # load the state a holds; do not step alone
    fake = opt(2, {a: 4}, stale)  # the same in a round of ours that met nobody
    assert dropped(fake, StepResult("e5", 1, [me])) and len(looks) == 2
    # without partners of our own a peer behind is catching up (it will load ours): we are the swarm
    fake = opt(2, {}, stale)
    assert not dropped(fake, StepResult("e5", 1, [me])) and fake._last_expected == 1 and len(looks) == 3
    fake = opt(1, {}, stale)  # (and a skipped round needs no look at the DHT)
    assert not dropped(fake, None) and len(looks) == 3
    # a partner of round 2 that reports epoch 3 reported after that round: it really is behind
    fake = opt(1, {a: 2}, stale)
    assert not dropped(fake, None) and fake._last_expected == 1 and len(looks) == 4
    # the partner left (its report is gone): we are the swarm again, and step
    fake = opt(1, {a: 4}, SwarmView(epoch=5, samples=0, target=64, peers=[_report(me, 5)], behind=[_report(b, 2)]))
    assert not dropped(fake, None) and fake._last_expected == 1 and len(looks) == 5
    # a round that failed midway, or met others, needs no look either
    assert dropped(opt(2, {a: 4}, stale), None) and not dropped(opt(2, {a: 4}, stale), StepResult("e5", 2, [me, a]))
    assert len(looks) == 5


def test_a_new_peer_that_sees_nobody_looks_once_more_before_it_starts_from_scratch():
    me, a = (Identity().peer_id for _ in range(2))
    nobody = SwarmView(epoch=0, samples=0, target=64, peers=[_report(me, 0)])
    swarm = SwarmView(epoch=7, samples=0, target=64, peers=[_report(a, 7)], behind=[_report(me, 0)])
    looks, loads = [], []

    async def wait_fresh(timeout):
        assert 0 < timeout <= 5  # (bounded: the first peer of a swarm waits for nothing)
        looks.append(1)
        return fresh

    async def publish():
        return fresh

    def start(first):
        return types.SimpleNamespace(
            epoch=0, checkpointer=None, _sps=0.0, _load_state_from_peers=loads.append,
            _loop=types.SimpleNamespace(run=lambda coro: asyncio.run(coro)),
            tracker=types.SimpleNamespace(view=first, wait_fresh=wait_fresh, publish=publish, report=lambda *a: None))

    fresh = swarm  # the first read missed the swarm (it timed out): the second finds it, and we load its state
    catch_up_at_start(start(nobody))
    assert looks == [1] and loads == [swarm]
    catch_up_at_start(start(swarm))  # seen at once: no second look
    assert looks == [1] and loads == [swarm, swarm]
    fresh = nobody  # the first peer of a swarm: one look more, and it starts alone
    catch_up_at_start(start(nobody))
    assert looks == [1, 1] and loads == [swarm, swarm]


def test_a_peer_that_loads_the_state_of_peers_that_skipped_an_update_takes_their_epoch():
    """Peers that skipped an update nobody held report an epoch past their state's (9, holding 6):
    a peer that loads their state and stays at its label falls behind them again at every step."""
    me, a = (Identity().peer_id for _ in range(2))
    view = SwarmView(epoch=9, samples=0, target=64, peers=[_report(a, 9)], behind=[_report(me, 5)])
    fetched = types.SimpleNamespace(manifest=types.SimpleNamespace(meta={"epoch": 6}, total_size=1), seconds=0.1,
                                    contributors={a: 1}, placement=None, restore=dict)

    async def refresh_now(timeout=None):
        return view

    def load(overlap):
        fake = types.SimpleNamespace(
            _pending=None, epoch=5, _applied=5, _version=1, _untrained=0, delay_updates=False, overlap_outer=overlap,
            _fetch_state=lambda view, at_least: fetched, _apply_shared_state=lambda state, epoch: None,
            stats=types.SimpleNamespace(state_loads=0), state_sync=types.SimpleNamespace(update_size=lambda: None),
            averager=types.SimpleNamespace(service=types.SimpleNamespace(
                link=types.SimpleNamespace(observe_transfer=lambda *a: None))),
            _grad_acc=[], _paused=0.0, _sps=0.0, _loop=types.SimpleNamespace(run=lambda coro: asyncio.run(coro)),
            tracker=types.SimpleNamespace(report=lambda *a: None, refresh_now=refresh_now))
        assert load_state_from_peers(fake, view)
        return fake

    fake = load(overlap=False)
    assert fake.epoch == 9 and fake._partners == {a: 5}  # (a's reports up to epoch 5 predate that state)
    # overlapped rounds: a peer reports the next epoch while its round is in flight, not a skip
    assert load(overlap=True).epoch == 6


def test_a_state_load_that_fails_on_the_way_asks_its_only_provider_once_more_before_leaving_it_out():
    """A download from the one peer that holds the state fails mid-transfer (a slow moment): it is
    asked again at once, not left out of the view (we would look alone in it for the progress
    ttl, and a diloco peer would step alone). A provider that fails twice, or whose state is not
    to be believed, is left out."""
    me, b = (Identity().peer_id for _ in range(2))
    swarm = SwarmView(epoch=6, samples=0, target=64, peers=[_report(b, 6)], behind=[_report(me, 5)])
    asked, ignored = [], []

    class Tracker:
        def __init__(self):
            self.me, self.view = types.SimpleNamespace(peer=me), swarm

        def ignore(self, peers):
            ignored.extend(peers)
            self.view = SwarmView(epoch=5, samples=0, target=64, peers=[], behind=[_report(me, 5)])

        async def refresh_now(self, timeout=None):
            return self.view

    def load(*outcomes):
        async def fetch(providers, timeout, into=None, **_vetting):
            asked.append([p.peer for p in providers])
            outcome = outcomes[len(asked) - 1]
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        asked.clear(), ignored.clear()
        fake = types.SimpleNamespace(
            load_state_timeout=10.0, matchmaking_timeout=1.0, _strict=False, _state_cap=1 << 30, tracker=Tracker(),
            state_sync=types.SimpleNamespace(choose=StateSync.choose, fetch=fetch),
            _loop=types.SimpleNamespace(run=lambda coro: asyncio.run(coro)))
        return fetch_state(fake, swarm, 6)

    stalled = ChunksUnavailableError("no provider could supply chunks 3-7: stalled")
    assert load(stalled, "state of epoch 6") == "state of epoch 6"
    assert asked == [[b], [b]] and ignored == []
    with pytest.raises(ChunksUnavailableError):  # twice: left out (a peer that claims what it cannot serve)
        load(stalled, stalled)
    assert asked == [[b], [b]] and ignored == [b]
    with pytest.raises(UntrustedState):  # a state not to believe: left out at once, not asked again
        load(UntrustedState("labelled epoch 1000000000"))
    assert asked == [[b]] and ignored == [b]
