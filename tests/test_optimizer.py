"""DecentralizedOptimizer with several peers in one process (threads), on real loopback DHT nodes.

Multi-process swarms (churn, convergence) are in test_optimizer_swarm.py; these check the
optimizer's contract: the torch optimizer surface, exact equivalence with plain PyTorch when alone,
bit-identical parameters across the peers of a group, DiLoCo outer steps, late joiners that start
from the swarm's state, and peers with another model kept apart.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from p2ptrain import DHT, DecentralizedOptimizer

pytestmark = pytest.mark.timeout(90)

W_TRUE = torch.arange(8, dtype=torch.float32).reshape(8, 1) / 8


def make_model(seed: int = 0, width: int = 8) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batch(gen: torch.Generator, bs: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(bs, 8, generator=gen)
    return x, x @ W_TRUE


def eval_loss(model: torch.nn.Module, seed: int = 99) -> float:
    with torch.no_grad():
        return float(loss_of(model, batch(torch.Generator().manual_seed(seed), 256)))


def loss_of(model: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = b
    return torch.nn.functional.mse_loss(model(x), y)


@pytest.fixture
def swarm():
    """Yields a factory of DHT nodes joined to one bootstrap; closes them all."""
    nodes: list[DHT] = []

    def make() -> DHT:
        node = DHT([str(nodes[0].multiaddrs[0])] if nodes else [])
        nodes.append(node)
        return node

    yield make
    for node in reversed(nodes):
        node.close()


def train(opt: DecentralizedOptimizer, model: torch.nn.Module, gen: torch.Generator, until_epoch: int,
          max_steps: int = 2000) -> int:
    steps = 0
    while opt.epoch < until_epoch and steps < max_steps:
        loss_of(model, batch(gen)).backward()
        opt.step()
        opt.zero_grad()
        steps += 1
    return steps


def in_threads(*fns) -> None:
    errors: list[BaseException] = []

    def wrap(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a peer thread hung"
    if errors:
        raise errors[0]


def test_alone_equals_plain_gradient_accumulation(swarm):
    """One peer in sync mode is exactly plain PyTorch with gradient accumulation to the target."""
    model, ref = make_model(), make_model()
    opt = DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht=swarm(), run_id="alone",
                                 target_batch_size=64, batch_size_per_step=16)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    try:
        for step in range(12):
            loss_of(model, batch(g1)).backward()
            opt.step()
            opt.zero_grad()
            (loss_of(ref, batch(g2)) / 4).backward()  # 4 micro-batches of 16 make the target 64
            if step % 4 == 3:
                ref_opt.step()
                ref_opt.zero_grad()
        assert opt.epoch == 3
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    finally:
        opt.close()


def test_two_peers_take_identical_steps(swarm):
    dhts = [swarm(), swarm()]
    models = [make_model(), make_model()]
    opts = [DecentralizedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), dht=d, run_id="pair",
                                   target_batch_size=512, batch_size_per_step=16) for m, d in zip(models, dhts)]
    try:
        assert opts[0].wait_for_peers(2, timeout=20) == 2 and opts[1].wait_for_peers(2, timeout=20) == 2
        first = eval_loss(models[0])
        gens = [torch.Generator().manual_seed(10 + i) for i in range(2)]
        in_threads(*(lambda i=i: train(opts[i], models[i], gens[i], 6) for i in range(2)))
        assert [o.epoch for o in opts] == [6, 6]
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(p, q), "peers of one group must end bit-identical"
        # most epochs are averaged in a pair (a loaded machine may make a peer miss one and catch up)
        assert opts[0].stats.rounds + opts[0].stats.state_loads >= 3 and opts[0].stats.last_group_size == 2
        assert opts[0].stats.bytes_sent > 0
        last = eval_loss(models[0])
        assert last < first
    finally:
        for o in opts:
            o.close()


def test_state_averaging_reunites_diverged_peers(swarm):
    """Peers that start (or drifted) apart end identical after a state-averaging round."""
    dhts = [swarm(), swarm()]
    models = [make_model(seed=1), make_model(seed=2)]
    assert not torch.equal(next(models[0].parameters()), next(models[1].parameters()))
    opts = [DecentralizedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), dht=d, run_id="reunite",
                                   target_batch_size=64, batch_size_per_step=16, average_state_every=2)
            for m, d in zip(models, dhts)]
    try:
        opts[0].wait_for_peers(2, timeout=20)
        opts[1].wait_for_peers(2, timeout=20)
        gens = [torch.Generator().manual_seed(50 + i) for i in range(2)]
        in_threads(*(lambda i=i: train(opts[i], models[i], gens[i], 2) for i in range(2)))
        assert opts[0].stats.state_rounds == 1 == opts[1].stats.state_rounds
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(p, q)
        s0, s1 = opts[0].inner.state_dict()["state"], opts[1].inner.state_dict()["state"]
        for k in s0:
            assert torch.equal(s0[k]["exp_avg"], s1[k]["exp_avg"])
    finally:
        for o in opts:
            o.close()


def test_late_joiner_starts_from_the_swarm_state(swarm):
    dhts = [swarm(), swarm()]
    models = [make_model(), make_model()]
    opts = [DecentralizedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), dht=d, run_id="late",
                                   target_batch_size=64, batch_size_per_step=16) for m, d in zip(models, dhts)]
    joiner = None
    try:
        opts[0].wait_for_peers(2, timeout=20)
        opts[1].wait_for_peers(2, timeout=20)
        gens = [torch.Generator().manual_seed(20 + i) for i in range(2)]
        in_threads(*(lambda i=i: train(opts[i], models[i], gens[i], 4) for i in range(2)))
        assert opts[0].epoch == opts[1].epoch == 4
        # the two stop stepping (they keep serving); a new peer, initialised differently, joins
        late_model = make_model(seed=123)
        where = [p.data_ptr() for p in late_model.parameters()]
        joiner = DecentralizedOptimizer(torch.optim.AdamW(late_model.parameters(), lr=1e-2), dht=swarm(),
                                        run_id="late", target_batch_size=64, batch_size_per_step=16)
        assert joiner.epoch == 4
        assert joiner.stats.state_loads == 1
        # the providers served their live tensors: nothing changed meanwhile, so no copy was made
        assert sum(o.memory_report()["state copies for downloads"] for o in opts) == 0
        for p, q in zip(late_model.parameters(), models[0].parameters()):
            assert torch.equal(p, q)
        # a fresh peer's parameters were downloaded into in place: no state-sized buffer for them
        assert [p.data_ptr() for p in late_model.parameters()] == where
        assert joiner.stats.last_state_in_place == sum(p.numel() * 4 for p in late_model.parameters())
        s_join, s_ref = joiner.inner.state_dict()["state"], opts[0].inner.state_dict()["state"]
        for k in s_ref:
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(s_join[k][name], s_ref[k][name])
        # a second load before any update of ours is in place too; once the state is our own
        # (here: one the user loaded), a download goes to a buffer of its own until complete
        assert joiner._load_state_from_peers(joiner.tracker.estimate())
        assert joiner.stats.last_state_in_place > 0
        joiner.load_state_dict(joiner.state_dict())
        assert joiner._load_state_from_peers(joiner.tracker.estimate())
        assert joiner.stats.last_state_in_place == 0 and joiner.stats.state_loads == 3
        for p, q in zip(late_model.parameters(), models[0].parameters()):
            assert torch.equal(p, q)
    finally:
        for o in [*opts, joiner]:
            if o is not None:
                o.close()


def test_diloco_outer_step_keeps_peers_identical(swarm):
    dhts = [swarm(), swarm()]
    models = [make_model(), make_model()]
    start = [p.detach().clone() for p in models[0].parameters()]
    opts = [DecentralizedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), dht=d, run_id="dl", mode="diloco",
                                   local_steps=5, batch_size_per_step=16, compression="none")
            for m, d in zip(models, dhts)]
    try:
        opts[0].wait_for_peers(2, timeout=20)
        opts[1].wait_for_peers(2, timeout=20)
        gens = [torch.Generator().manual_seed(30 + i) for i in range(2)]
        in_threads(*(lambda i=i: train(opts[i], models[i], gens[i], 3) for i in range(2)))
        assert [o.epoch for o in opts] == [3, 3]
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(p, q)
        assert any(not torch.equal(p, s) for p, s in zip(models[0].parameters(), start))
        assert opts[0].stats.last_group_size == 2
    finally:
        for o in opts:
            o.close()


def test_diloco_compresses_pseudo_gradients_by_default(swarm):
    model = make_model()
    opt = DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht=swarm(), run_id="dlc", mode="diloco")
    try:
        assert opt.codec == "int8" and opt.averager.codec_name == "int8"
    finally:
        opt.close()


def test_diloco_inner_warmup_scales_the_first_local_steps(swarm):
    # SGD, lr 1, a constant gradient of 1: each local step moves a weight by exactly the lr it used
    w = torch.nn.Parameter(torch.zeros(4))
    inner = torch.optim.SGD([w], lr=1.0)
    opt = DecentralizedOptimizer(inner, dht=swarm(), run_id="dlw", mode="diloco", local_steps=100,
                                 batch_size_per_step=1, inner_warmup_steps=4)
    try:
        moved = []
        for _ in range(6):
            before = float(w[0].detach())
            w.grad = torch.ones(4)
            opt.step()
            moved.append(before - float(w[0].detach()))
        assert moved == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
        assert inner.param_groups[0]["lr"] == 1.0  # the user's lr is untouched
        assert opt.epoch == 0  # all local: no outer round yet
    finally:
        opt.close()


def test_other_model_never_averages_and_is_reported(swarm):
    a_model, b_model = make_model(width=8), make_model(width=8)
    b_model[0] = torch.nn.Linear(8, 32)  # a different hidden layer on peer b
    b_model[2] = torch.nn.Linear(32, 1)
    a = DecentralizedOptimizer(torch.optim.SGD(a_model.parameters(), lr=0.1), dht=swarm(), run_id="mix",
                               target_batch_size=32, batch_size_per_step=16, refresh_period=0.1)
    b = DecentralizedOptimizer(torch.optim.SGD(b_model.parameters(), lr=0.1), dht=swarm(), run_id="mix",
                               target_batch_size=32, batch_size_per_step=16, refresh_period=0.1)
    try:
        a.wait_for_peers(2, timeout=2)  # only counts compatible peers: returns after the timeout
        gens = [torch.Generator().manual_seed(40 + i) for i in range(2)]
        in_threads(lambda: train(a, a_model, gens[0], 3), lambda: train(b, b_model, gens[1], 3))
        assert a.stats.rounds == 0 and b.stats.rounds == 0  # nobody compatible: no averaging round
        assert any("different model" in m for m in a.mismatches.values())
        assert any("different model" in m for m in b.mismatches.values())
    finally:
        a.close()
        b.close()


def test_torch_optimizer_surface(swarm):
    """param_groups, LR schedulers stepped per global epoch, GradScaler, closures, state_dict."""
    model = make_model()
    opt = DecentralizedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), dht=swarm(), run_id="surface", target_batch_size=32,
        batch_size_per_step=16, scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    try:
        assert isinstance(opt, torch.optim.Optimizer)
        assert opt.param_groups is opt.inner.param_groups
        gen = torch.Generator().manual_seed(5)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for _ in range(4):  # 2 epochs of 2 steps
            scaler.scale(loss_of(model, batch(gen))).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert opt.epoch == 2
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)

        def closure():
            opt.zero_grad()
            loss = loss_of(model, batch(gen))
            loss.backward()
            return loss

        assert isinstance(opt.step(closure), torch.Tensor)
        sd = copy.deepcopy(opt.state_dict())
        assert sd["epoch"] == 2 and "scheduler" in sd
        opt.load_state_dict(sd)
        assert opt.epoch == 2
        with pytest.raises(RuntimeError, match="parameter groups"):
            opt.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})
    finally:
        opt.close()


def test_bad_arguments_are_clear(swarm):
    model = make_model()
    dht = swarm()
    with pytest.raises(ValueError, match="mode"):
        DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht=dht, run_id="x", mode="fast")
    with pytest.raises(ValueError, match="run_id"):
        DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht=dht, run_id="a/b")
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        DecentralizedOptimizer(model, dht=dht, run_id="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="codec|compression"):
        DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht=dht, run_id="x", compression="zip")
    with pytest.raises(ValueError, match="inner_warmup_steps is for diloco"):  # sync peers must step alike
        DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht=dht, run_id="x", inner_warmup_steps=10)
    with pytest.raises(ValueError, match="non-negative"):
        DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht=dht, run_id="x", mode="diloco",
                               inner_warmup_steps=-1)


def test_a_snapshot_taken_mid_round_is_labelled_with_the_updates_it_holds(swarm):
    """A state request during an averaging round must not get the old parameters labelled with
    the new epoch (a joiner would then stay one update behind for good)."""
    from concurrent.futures import Future

    model = make_model()
    opt = DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht=swarm(), run_id="race",
                                 target_batch_size=16, batch_size_per_step=16)
    round_started, release = threading.Event(), threading.Event()

    def slow_average(epoch, samples, view):
        future: Future = Future()
        round_started.set()
        threading.Thread(target=lambda: (release.wait(10), future.set_result(None))).start()
        return future

    opt._average = slow_average  # the round is held open until the snapshot was taken
    snaps = []

    def snapshot():
        round_started.wait(10)
        with opt._state_lock:
            epoch, state = opt._shared_state()
            snaps.append((epoch, state["params"][0].clone()))
        release.set()

    t = threading.Thread(target=snapshot)
    t.start()
    try:
        before = next(model.parameters()).detach().clone()
        loss_of(model, batch(torch.Generator().manual_seed(1))).backward()
        opt.step()
        t.join(10)
        epoch, params = snaps[0]
        assert opt.epoch == 1
        assert epoch == 0 and torch.equal(params, before), "the mid-round snapshot holds epoch 0's state"
        with opt._state_lock:
            assert opt._shared_state()[0] == 1
    finally:
        release.set()
        opt.close()


def _fetching_optimizer(fetch, me, applied: int, **tracker):
    """The parts of an optimizer ``fetch_state`` uses: ``fetch`` downloads, the tracker is ``me``
    plus ``tracker`` (e.g. ``ignore``, ``refresh_now``), the loop runs coroutines at once."""
    import asyncio
    import types

    from p2ptrain.optim.state_sync import StateSync

    return types.SimpleNamespace(
        _applied=applied, load_state_timeout=10.0, matchmaking_timeout=1.0, _strict=False, _state_cap=1 << 30,
        _newest=None, state_sync=types.SimpleNamespace(choose=StateSync.choose, fetch=fetch),
        tracker=types.SimpleNamespace(me=types.SimpleNamespace(peer=me), **tracker),
        _loop=types.SimpleNamespace(run=lambda coro: asyncio.run(coro)),
    )


def test_state_load_asks_other_peers_when_the_most_advanced_are_gone():
    """Under churn the most advanced peers a joiner read about may have died: it leaves them out
    and downloads from the next ones (a fresh read of the progress), instead of giving up."""

    from dht import Identity
    from p2ptrain.checkpoint import StateTransferError
    from p2ptrain.optim.progress import PeerReport, SwarmView

    me, dead, alive = (Identity().peer_id for _ in range(3))

    def report(peer, epoch):
        return PeerReport(peer, epoch, 0, 1.0, 0.0, "s", addr=("127.0.0.1", 1))

    first = SwarmView(epoch=9, samples=0, target=64, peers=[report(dead, 9)], behind=[report(alive, 8)])
    fresh = SwarmView(epoch=8, samples=0, target=64, peers=[report(alive, 8)])
    asked, ignored = [], []

    async def fetch(providers, timeout, into=None, **_vetting):
        asked.append([p.peer for p in providers])
        if providers[0].peer == dead:
            raise StateTransferError("unreachable: connection refused")
        return "state of epoch 8"

    async def refresh_now():
        return fresh

    fake = _fetching_optimizer(fetch, me, applied=0, ignore=ignored.extend, refresh_now=refresh_now)
    assert DecentralizedOptimizer._fetch_state(fake, first) == "state of epoch 8"  # type: ignore[arg-type]
    assert asked == [[dead], [alive]] and ignored == [dead]
    fake.state_sync.fetch = lambda providers, timeout, into=None, **_: fetch([report(dead, 9)], timeout)
    with pytest.raises(StateTransferError):  # nobody can give it: a bounded number of tries
        DecentralizedOptimizer._fetch_state(fake, first)  # type: ignore[arg-type]


def test_a_peer_whose_round_is_over_for_everyone_loads_the_state_at_once():
    """Without delayed updates a peer reports the next epoch only after applying the round: when
    no other peer still reports ours, there is no group to wait for (a joiner whose download the
    swarm outran would sit out the matchmaking deadline, then load anyway)."""
    import types

    from dht import Identity
    from p2ptrain.optim.progress import PeerReport, SwarmView

    me, a, b = (Identity().peer_id for _ in range(3))

    def report(peer, epoch, ready=False):
        return PeerReport(peer, epoch, 0, 1.0, 0.0, "s", addr=("127.0.0.1", 1), ready=ready)

    fake = types.SimpleNamespace(epoch=4, delay_updates=False,
                                 tracker=types.SimpleNamespace(me=types.SimpleNamespace(peer=me)))
    over = SwarmView(epoch=5, samples=0, target=64, peers=[report(a, 5), report(b, 5)], behind=[report(me, 4)])
    assert DecentralizedOptimizer._round_over(fake, over)  # type: ignore[arg-type]
    # b is still in epoch 4's round (or about to enter it): there is a group to join
    open_ = SwarmView(epoch=5, samples=0, target=64, peers=[report(a, 5)], behind=[report(me, 4), report(b, 4, True)])
    assert not DecentralizedOptimizer._round_over(fake, open_)  # type: ignore[arg-type]
    fake.delay_updates = True  # peers report the next epoch while their round may still be matching
    assert not DecentralizedOptimizer._round_over(fake, over)  # type: ignore[arg-type]


def test_expected_round_size_counts_delayed_peers_that_reported_the_next_epoch():
    """With delayed updates peers report the next epoch once their round started: a peer ending
    its epoch last must still expect them (it used to count itself out and skip the round)."""
    import types

    from dht import Identity
    from p2ptrain.optim.progress import PeerReport, SwarmView

    me, a, b, c = (Identity().peer_id for _ in range(4))

    def report(peer, epoch):
        return PeerReport(peer, epoch, 0, 1.0, 0.0, "s", addr=("127.0.0.1", 1))

    fake = types.SimpleNamespace(delay_updates=True, overlap_outer=False)
    moved_on = SwarmView(epoch=5, samples=0, target=64, peers=[report(a, 5), report(b, 5)],
                         behind=[report(me, 4), report(c, 4)])
    assert DecentralizedOptimizer._expected(fake, moved_on, 4) == 4  # type: ignore[arg-type]
    fake.delay_updates = False  # peers at 5 applied round 4 already: only c and we are left
    assert DecentralizedOptimizer._expected(fake, moved_on, 4) == 2  # type: ignore[arg-type]
    fake.overlap_outer = True  # diloco's overlapped rounds: peers report the next epoch alike
    assert DecentralizedOptimizer._expected(fake, moved_on, 4) == 4  # type: ignore[arg-type]
    fake.overlap_outer = False
    same = SwarmView(epoch=4, samples=0, target=64, peers=[report(me, 4), report(a, 4)],
                     behind=[report(b, 3), report(c, 1)])  # b is finishing round 3; c is catching up
    for delay in (True, False):
        fake.delay_updates = delay
        assert DecentralizedOptimizer._expected(fake, same, 4) == 3  # type: ignore[arg-type]


def test_a_peer_about_to_skip_a_round_looks_at_the_swarm_again_first():
    """The view is up to a refresh period old. With epochs of a few ms, the partner that just
    averaged epoch 3 with us could still report epoch 2: it looked like a peer catching up, we
    skipped round 4 and left it waiting out matchmaking alone (the client-mode CLI test's flake)."""
    import asyncio
    import types

    from dht import Identity
    from p2ptrain.optim.progress import PeerReport, SwarmView

    me, other = (Identity().peer_id for _ in range(2))

    def report(peer, epoch, ready=False):
        return PeerReport(peer, epoch, 0, 1.0, 0.0, "s", addr=("127.0.0.1", 1), ready=ready)

    stale = SwarmView(epoch=4, samples=0, target=64, peers=[report(me, 4)], behind=[report(other, 2)])
    fresh = SwarmView(epoch=4, samples=0, target=64, peers=[report(me, 4, True), report(other, 4)])
    refreshes, rounds = [], []

    async def refresh_now(timeout=None):
        assert timeout is not None and 0 < timeout <= 5  # bounded: a silent DHT must not stall training
        refreshes.append(1)
        return views.pop(0)

    fake = types.SimpleNamespace(
        delay_updates=False, overlap_outer=False, mode="sync", matchmaking_timeout=5.0, _paused=0.0, mixer=None,
        _early=None,
        _settled=types.SimpleNamespace(clear=None),
        tracker=types.SimpleNamespace(refresh_now=refresh_now),
        averager=types.SimpleNamespace(step=lambda **kw: kw),
        _loop=types.SimpleNamespace(run=lambda coro: asyncio.run(coro), submit=rounds.append),
    )
    fake._expected = lambda view, epoch: DecentralizedOptimizer._expected(fake, view, epoch)
    views = [fresh]
    DecentralizedOptimizer._average(fake, 4, 64, stale)  # type: ignore[arg-type]
    assert refreshes == [1] and fake._last_expected == 2
    assert [(r["round_id"], r["expected"]) for r in rounds] == [("e4", 2)]
    # still nobody due after a fresh look (the other peer really is catching up): skip the round
    views = [stale]
    assert DecentralizedOptimizer._average(fake, 4, 64, stale).result() is None  # type: ignore[arg-type]
    assert len(refreshes) == 2 and fake._last_expected == 1 and len(rounds) == 1
    # alone in the swarm: nothing to look for, no DHT read on every epoch
    alone = SwarmView(epoch=4, samples=0, target=64, peers=[report(me, 4)])
    assert DecentralizedOptimizer._average(fake, 4, 64, alone).result() is None  # type: ignore[arg-type]
    assert len(refreshes) == 2 and len(rounds) == 1


def test_failed_state_loads_warn_once_then_count(swarm, caplog, monkeypatch):
    """A state load that keeps failing (the peers ahead unreachable, say) is tried again at later
    steps: one warning, then the failures are counted into the next one instead of flooding the log."""
    import logging

    from p2ptrain.checkpoint import StateTransferError

    opt = DecentralizedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1), dht=swarm(), run_id="quiet-loads",
                                 target_batch_size=64, batch_size_per_step=16)
    try:
        def no_provider(view, *_args, **_kw):
            raise StateTransferError("no peer serves it")

        monkeypatch.setattr(opt, "_fetch_state", no_provider)
        view = opt.tracker.estimate()
        with caplog.at_level(logging.WARNING, logger="p2ptrain.optim"):
            assert not any(opt._load_state_from_peers(view) for _ in range(5))
            said = [r.getMessage() for r in caplog.records if "could not load the swarm's state" in r.getMessage()]
            assert len(said) == 1 and "no peer serves it" in said[0] and opt.epoch == 0
            opt._load_warnings.interval = 0.0  # the next failure warns, with the count held back
            caplog.clear()
            opt._load_state_from_peers(view)
            assert "(4 more failed since the last warning)" in caplog.text
    finally:
        opt.close()


def test_client_mode_peers_ahead_are_left_out_instead_of_stopping_training(caplog):
    """Peers ahead that are all in client mode serve no state: a load cannot succeed, and trying
    at every step (each resets the epoch's samples) stopped our training for as long as they
    stayed ahead. They are left out of the view for a while instead, with one warning."""
    import logging
    import types

    from dht import Identity, LogThrottle
    from p2ptrain.optim.progress import PeerReport, SwarmView

    me, client, server = (Identity().peer_id for _ in range(3))

    def report(peer, epoch, addr=("127.0.0.1", 1)):
        return PeerReport(peer, epoch, 0, 1.0, 0.0, "s", addr=addr, client=addr is None)

    ignored, loads = [], []
    fake = types.SimpleNamespace(epoch=4, _load_warnings=LogThrottle(30.0), _load_state_from_peers=loads.append,
                                 tracker=types.SimpleNamespace(me=types.SimpleNamespace(peer=me),
                                                               ignore=ignored.extend))
    clients_ahead = SwarmView(epoch=6, samples=0, target=64, peers=[report(client, 6, None)],
                              behind=[report(me, 4), report(server, 4)])
    with caplog.at_level(logging.WARNING, logger="p2ptrain.optim"):
        for _ in range(3):
            DecentralizedOptimizer._fall_behind(fake, clients_ahead)  # type: ignore[arg-type]
    assert loads == [] and ignored == [client] * 3
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "client mode" in said[0] and "epoch 6" in said[0], said
    # a peer ahead that serves its state: load it (the client's state comes with it, or later)
    both = SwarmView(epoch=6, samples=0, target=64, peers=[report(client, 6, None)],
                     behind=[report(me, 4), report(server, 5)])
    DecentralizedOptimizer._fall_behind(fake, both)  # type: ignore[arg-type]
    assert loads == [both] and len(ignored) == 3


def test_state_is_never_loaded_from_peers_behind_us():
    """A peer that reports fewer updates than our state holds is no provider, even when no
    better one serves: its state would take us back."""

    from dht import Identity
    from p2ptrain.checkpoint import StateTransferError
    from p2ptrain.optim.progress import PeerReport, SwarmView

    me, client, old, level = (Identity().peer_id for _ in range(4))

    def report(peer, epoch, addr=("127.0.0.1", 1)):
        return PeerReport(peer, epoch, 0, 1.0, 0.0, "s", addr=addr)

    asked = []

    async def fetch(providers, timeout, into=None, **_vetting):
        asked.append([p.peer for p in providers])
        return "state"

    fake = _fetching_optimizer(fetch, me, applied=5)
    view = SwarmView(epoch=7, samples=0, target=64, peers=[report(client, 7, None)],
                     behind=[report(old, 3), report(me, 5)])
    with pytest.raises(StateTransferError, match="no peer at or past our epoch 5"):
        DecentralizedOptimizer._fetch_state(fake, view)  # type: ignore[arg-type]
    assert asked == []
    view.behind.append(report(level, 5))  # as far as we are: theirs may be the swarm's, ours a stray
    assert DecentralizedOptimizer._fetch_state(fake, view) == "state"  # type: ignore[arg-type]
    assert asked == [[level]]


def test_a_holder_that_fails_us_is_not_taken_for_nobody_holding_the_update():
    """A peer that missed a round skips its update only when nobody holds it (NoProviders). When
    the one peer that holds it fails to serve it (slow under load) and is left out, the next try
    finds nobody: that must not read as "nobody holds it", or we skip an update the swarm applied
    and stay a step apart for good (the same epoch number on another state)."""

    from p2ptrain.checkpoint import StateTransferError
    from p2ptrain.optim.progress import PeerReport, SwarmView
    from dht import Identity
    from p2ptrain.optim.state_sync import NoProviders

    me, holder = (Identity().peer_id for _ in range(2))
    first = SwarmView(epoch=2, samples=0, target=64,
                      peers=[PeerReport(holder, 2, 0, 1.0, 0.0, "s", addr=("127.0.0.1", 1))])
    ignored: list = []

    async def fetch(providers, timeout, into=None, **_vetting):
        raise StateTransferError("timed out waiting for the manifest")

    async def refresh_now():
        return SwarmView(epoch=1, samples=0, target=64)  # the holder is left out now

    fake = _fetching_optimizer(fetch, me, applied=1, ignore=ignored.extend, refresh_now=refresh_now)
    with pytest.raises(StateTransferError, match="timed out") as caught:
        DecentralizedOptimizer._fetch_state(fake, first, at_least=2)  # type: ignore[arg-type]
    assert not isinstance(caught.value, NoProviders) and ignored == [holder]


def test_a_peer_that_skipped_the_update_is_no_provider_of_it():
    """A peer whose round failed for everyone skips the update and reports the next epoch with
    one update fewer in its state (``held``). A peer that missed the same round must read that
    as "nobody holds it" and skip it too, without downloading a state that cannot do (and
    leaving that peer out of its view: it would then train alone, a state apart)."""

    from dht import Identity
    from p2ptrain.optim.progress import PeerReport, SwarmView, parse_report
    from p2ptrain.optim.state_sync import NoProviders

    me, skipped = (Identity().peer_id for _ in range(2))
    report = PeerReport(skipped, 2, 0, 1.0, 0.0, "s", addr=("127.0.0.1", 1), held=1)
    assert parse_report(report.to_wire(), skipped) == report
    assert parse_report({**report.to_wire(), "u": "1"}, skipped) is None
    asked, ignored = [], []

    async def fetch(providers, timeout, into=None, **_vetting):
        asked.append(providers)
        return "its state"

    fake = _fetching_optimizer(fetch, me, applied=1, ignore=ignored.extend)
    with pytest.raises(NoProviders):
        DecentralizedOptimizer._fetch_state(fake, SwarmView(epoch=2, samples=0, target=64, peers=[report]),
                                            at_least=2)  # type: ignore[arg-type]
    assert asked == [] and ignored == []
    held = PeerReport(skipped, 2, 0, 1.0, 0.0, "s", addr=("127.0.0.1", 1), held=2)
    assert DecentralizedOptimizer._fetch_state(fake, SwarmView(epoch=2, samples=0, target=64, peers=[held]),
                                               at_least=2) == "its state"  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_diloco_alone_is_plain_diloco_and_holds_two_model_sized_buffers(swarm, dtype):
    """A lone diloco peer's outer steps are DiLoCo's (Nesterov SGD on outer minus inner params),
    with the pseudo-gradient swapped into the buffer the outer parameters live in: fp32 models
    need no third buffer, others (float64 here) one fp32 holder."""
    model, ref = make_model().to(dtype), make_model().to(dtype)
    opt = DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), dht=swarm(), run_id=f"dl-{dtype}",
                                 mode="diloco", local_steps=3, batch_size_per_step=16, outer_lr=0.7,
                                 outer_momentum=0.9)
    ref_inner = torch.optim.SGD(ref.parameters(), lr=0.05)
    outer = [p.detach().to(torch.float32, copy=True) for p in ref.parameters()]
    ref_outer = torch.optim.SGD(outer, lr=0.7, momentum=0.9, nesterov=True)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    x_dtype = dict(dtype=dtype)
    try:
        for step in range(9):
            x, y = batch(g1)
            torch.nn.functional.mse_loss(model(x.to(**x_dtype)), y.to(**x_dtype)).backward()
            opt.step()
            opt.zero_grad()
            x, y = batch(g2)
            torch.nn.functional.mse_loss(ref(x.to(**x_dtype)), y.to(**x_dtype)).backward()
            ref_inner.step()
            ref_inner.zero_grad()
            if step % 3 == 2:
                with torch.no_grad():
                    for o, p in zip(outer, ref.parameters()):
                        o.grad = o - p.to(torch.float32)
                    ref_outer.step()
                    for o, p in zip(outer, ref.parameters()):
                        p.copy_(o)
        assert opt.epoch == 3
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        for o, q in zip(opt._outer, outer):
            torch.testing.assert_close(o, q, rtol=1e-5, atol=1e-6)
        held = opt.memory_report()
        fp32 = 4 * sum(p.numel() for p in model.parameters())
        assert held["outer parameters"] == held["outer optimizer state"] == fp32
        assert held["averaging buffer"] == 0  # (the outer parameters' own buffer)
        assert len(opt._holders) == len(opt.params) and all(
            (h.data_ptr() == p.data_ptr()) == (dtype == torch.float32) for h, p in zip(opt._holders, opt.params))
    finally:
        opt.close()


def test_sync_accumulates_in_the_buffer_it_averages(swarm):
    """Sync mode holds one fp32 model-sized buffer beyond the model and the inner optimizer: the
    accumulator, which the averager averages in place (no copy of it), and with delayed updates
    a second one."""
    dhts = [swarm(), swarm()]
    models = [make_model(), make_model()]
    opts = [DecentralizedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), dht=d, run_id="acc",
                                   target_batch_size=64, batch_size_per_step=16, delay_updates=i == 1,
                                   average_state_every=0) for i, (m, d) in enumerate(zip(models, dhts))]
    try:
        gens = [torch.Generator().manual_seed(40 + i) for i in range(2)]
        in_threads(*(lambda i=i: train(opts[i], models[i], gens[i], 2) for i in range(2)))
        fp32 = 4 * sum(p.numel() for p in models[0].parameters())
        plain = {"model parameters", "inner optimizer state"}
        for o, buffers in zip(opts, (1, 2)):
            held = {k: v for k, v in o.memory_report().items() if k not in plain and v}
            assert sum(held.values()) == buffers * fp32, held
        assert opts[0].averager._flat.data_ptr() == opts[0]._grad_acc[0].data_ptr()
    finally:
        for o in opts:
            o.close()


def test_diloco_inner_steps_do_not_copy_a_state_a_peer_downloads(swarm):
    """The served diloco state is the outer parameters and optimizer: inner steps leave it alone,
    so a peer reading it costs no copy until the outer step changes it."""
    model = make_model()
    opt = DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), dht=swarm(), run_id="dl-serve",
                                 mode="diloco", local_steps=4, batch_size_per_step=16)
    gen = torch.Generator().manual_seed(3)
    try:
        opt._loop.run(opt.state_sync._refresh())  # a peer asked for the manifest: its version is leased
        assert len(opt.state_sync._live) == 1
        for _ in range(3):
            loss_of(model, batch(gen)).backward()
            opt.step()
            opt.zero_grad()
        assert opt.epoch == 0 and opt.memory_report()["state copies for downloads"] == 0
        loss_of(model, batch(gen)).backward()
        opt.step()  # the outer step changes the state: the leased version is preserved
        assert opt.epoch == 1 and opt.memory_report()["state copies for downloads"] > 0
    finally:
        opt.close()
