"""Mixing groups: the grid's shape, a simulated swarm whose cells stay small and whose values mix to
one average, and real peers in different groups converging without a state round."""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections import Counter, defaultdict
from concurrent.futures import Future

import torch

from p2ptrain import DecentralizedOptimizer
from p2ptrain.averaging import StepResult
from dht import Identity
from p2ptrain.optim import diloco_step, rounds, sync_step
from p2ptrain.optim.progress import PeerReport, SwarmView
from p2ptrain.averaging.mixing import GridMixer, grid_shape, swarm_size
from tests.test_optimizer import batch, in_threads, loss_of, make_model, swarm, train  # noqa: F401 (fixture)


def test_grid_shape_keeps_groups_within_the_target():
    assert grid_shape(8, 8) == ()  # one group holds everyone: no grid
    assert grid_shape(16, 8) == (4, 4)
    assert grid_shape(32, 8) == (8, 4)
    assert grid_shape(64, 8) == (8, 8)
    assert grid_shape(8, 4) == (4, 2)
    assert grid_shape(64, 4) == grid_shape(64, 6) == (4, 4, 4)  # sides are powers of two
    # peers that count the swarm a few peers apart draw the same grid
    assert {swarm_size(n) for n in (52, 60, 64, 70, 90)} == {64}


def simulate(n: int, target: int, rounds: int, seed: int = 0, late: float = 0.0) -> tuple[list[float], int, list[int]]:
    """``n`` peers averaging scalars in grid cells (each cell split into groups of at most
    ``target``, as matchmaking does; a peer comes too late for a round with probability ``late``
    and forms a group of its own): the spread after each round, the largest cell seen, and the
    size of every group formed."""
    rng = random.Random(seed)
    ids = [hashlib.blake2b(f"peer{i}".encode(), digest_size=8).digest() for i in range(n)]
    mixers = [GridMixer(me, target) for me in ids]
    values = [rng.gauss(0, 1) for _ in range(n)]
    spreads, largest, sizes = [], 0, []
    for k in range(rounds):
        cells: dict[str, list[int]] = defaultdict(list)
        for i, m in enumerate(mixers):
            cells[m.key(k, ids)].append(i)
        largest = max(largest, *(len(c) for c in cells.values()))
        for members in cells.values():
            members.sort(key=lambda i: hashlib.blake2b(ids[i] + bytes([k])).digest())
            came = [i for i in members if rng.random() >= late]
            n_groups = -(-len(came) // target)
            groups = [came[g::n_groups] for g in range(n_groups)] + [[i] for i in members if i not in came]
            for group in groups:
                sizes.append(len(group))
                mean = sum(values[i] for i in group) / len(group)
                for i in group:
                    values[i] = mean
        spreads.append(max(values) - min(values))
    return spreads, largest, sizes


def test_a_full_grid_averages_the_whole_swarm_in_one_round_per_dimension():
    spreads, largest, _ = simulate(64, 8, 4)
    assert largest == 8  # each round's key holds one group's worth of peers, not the swarm
    assert spreads[0] > 0.5 and spreads[1] < 1e-12


def test_an_uneven_swarm_still_mixes_to_one_value():
    spreads, largest, _ = simulate(40, 8, 8, seed=3)  # a grid of 8 x 4 drawn for 32, holding 40
    assert largest <= 16  # the 8 beyond the grid's 32 share cells: never more than twice a group's worth
    assert spreads[1] < spreads[0] and spreads[-1] < 1e-3 * spreads[0]


def test_each_cell_of_the_next_dimension_draws_one_peer_from_each_group_of_the_last():
    ids = [bytes([i]) * 8 for i in range(16)]
    mixers = [GridMixer(me, 4) for me in ids]
    cells: list[dict[str, list[int]]] = [defaultdict(list), defaultdict(list)]
    for k in (0, 1):
        for i, m in enumerate(mixers):
            cells[k][m.key(k, ids)].append(i)
        assert sorted(len(c) for c in cells[k].values()) == [4, 4, 4, 4]
        assert all(mixers[i].expected(k, ids) == 4 for i in range(16))
    for members in cells[1].values():
        assert len({next(key for key, c in cells[0].items() if i in c) for i in members}) == 4


def test_cells_stay_full_when_peers_miss_rounds():
    """A peer that comes late to a round meets nobody, and its cell's group forms one short; the
    next round's cells are drawn from the swarm alone, so every one holds a full side's worth
    again and the groups are as large as the late peers allow (4 / (1 + 4 x late) on average)."""
    for late, least in ((0.02, 3.6), (0.05, 3.25)):
        sizes = [s for seed in range(3) for s in simulate(64, 4, 30, seed=seed, late=late)[2][-3 * 64:]]
        assert sum(sizes) / len(sizes) >= least, (late, sum(sizes) / len(sizes))
    assert simulate(64, 4, 30, seed=0, late=0.05)[1] == 4


def test_a_peer_that_saw_the_swarm_short_is_placed_right_once_it_sees_it_whole():
    """A view that misses a peer shifts our index: that round we meet in a neighbour's cell. The
    next round is drawn from the view of then, not from the placement of the first."""
    ids = [bytes([i]) * 8 for i in range(16)]
    me = GridMixer(ids[9], 4)
    short = ids[:3] + ids[4:]
    assert me.key(1, short) != GridMixer(ids[9], 4).key(1, ids)
    assert me.key(3, ids) == GridMixer(ids[9], 4).key(3, ids)


def test_a_peer_expects_only_the_peers_of_its_cell_that_come():
    ids = [bytes([i]) * 8 for i in range(16)]
    me = GridMixer(ids[0], 4)
    cell = [i for i in range(16) if GridMixer(ids[i], 4).key(1, ids) == me.key(1, ids)]
    assert len(cell) == 4 and me.expected(1, ids) == 4
    away = {ids[cell[-1]]}  # (behind: loading the state, it will not come)
    assert me.expected(1, ids, coming=set(ids) - away) == 3
    assert GridMixer(ids[0], 16).expected(1, ids) is None  # one group holds everyone: no grid


def spread(models: list[torch.nn.Module]) -> float:
    """The largest distance between two peers' parameters relative to the mean's norm."""
    flats = [torch.cat([p.detach().flatten() for p in m.parameters()]) for m in models]
    mean = torch.stack(flats).mean(0)
    return max(float((a - b).norm()) for a in flats for b in flats) / float(mean.norm())


def test_peers_in_different_groups_converge_without_a_state_round(swarm):  # noqa: F811 (fixture)
    """Four peers in groups of two (a 2 x 2 grid) that start apart end near one model with state
    rounds off: each round mixes the parameters of its cell, and the cells change every round."""
    models = [make_model(seed=i) for i in range(4)]
    dhts = [swarm() for _ in models]
    opts = [DecentralizedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05), dht=d, run_id="mix",
                                   target_batch_size=64, batch_size_per_step=16, target_group_size=2,
                                   average_state_every=0, matchmaking_timeout=3.0)
            for m, d in zip(models, dhts)]
    try:
        for o in opts:
            assert o.wait_for_peers(4, timeout=20) == 4
        before = spread(models)
        gens = [torch.Generator().manual_seed(20 + i) for i in range(4)]
        in_threads(*(lambda i=i: train(opts[i], models[i], gens[i], 2) for i in range(4)))
        in_threads(*(o.finish_round for o in opts))  # (the last mix, running in the background)
        after_two = spread(models)
        in_threads(*(lambda i=i: train(opts[i], models[i], gens[i], 5) for i in range(4)))
        in_threads(*(o.finish_round for o in opts))
        after = spread(models)
        assert all(o.stats.last_group_size <= 2 for o in opts)  # groups of two: never the whole swarm
        assert before > 0.5
        # two mixes (one per dimension of the grid) average the whole swarm; more keep it together
        assert after_two < 0.1 * before and after < 1e-3 * before, (before, after_two, after)
    finally:
        for o in opts:
            o.close()


def test_a_state_round_walks_every_dimension_of_the_grid_and_leaves_one_model(swarm, monkeypatch):  # noqa: F811
    """Eight peers in groups of two (a 2 x 2 x 2 grid) that start apart: a state round averages
    along the three dimensions in turn, and every peer ends with the same model."""
    models = [make_model(seed=i) for i in range(8)]
    opts = [DecentralizedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05), dht=swarm(), run_id="walk",
                                   target_batch_size=128, batch_size_per_step=16, target_group_size=2,
                                   average_state_every=1, matchmaking_timeout=5.0)
            for m in models]
    ran: Counter[str] = Counter()  # state rounds, by round id (epoch and cell), over every peer
    state_round = rounds._state_round

    def counted(opt, averager, round_id, cell):
        ran[round_id] += 1
        return state_round(opt, averager, round_id, cell)

    monkeypatch.setattr(rounds, "_state_round", counted)
    try:
        for o in opts:
            assert o.wait_for_peers(8, timeout=30) == 8
        before = spread(models)
        gens = [torch.Generator().manual_seed(40 + i) for i in range(8)]
        in_threads(*(lambda i=i: train(opts[i], models[i], gens[i], 1) for i in range(8)))
        after = spread(models)
        assert all(o.stats.last_group_size <= 2 for o in opts)
        state = [r for r in ran if r.startswith("s0")]
        assert len(state) == 4 * 3 and all(ran[r] == 2 for r in state)  # (4 cells of 2 per dimension)
        assert before > 0.5 and after < 1e-5 * before, (before, after)
    finally:
        for o in opts:
            o.close()


def held_mix(monkeypatch, release: Future, write) -> None:
    """Mix rounds whose cell comes when ``release`` is set, and then ``write`` each tensor (the mix)."""
    class CellAverage:
        def __init__(self, named: list) -> None:
            self.tensors = [t for _, t in named]

        async def step(self, **_: object) -> StepResult:
            await asyncio.wrap_future(release)
            for t in self.tensors:
                write(t)
            return StepResult("m", 2, [])

    monkeypatch.setattr(rounds, "state_averager", lambda opt, kind, named: CellAverage(named))


def test_a_parameter_mix_runs_beside_the_next_steps_and_lands_between_two(swarm, monkeypatch):  # noqa: F811
    """sync: the mix after a gradient round averages a copy of the parameters while steps go on;
    its result lands at the first step after it is done; a state loaded meanwhile discards it."""
    release: Future = Future()
    held_mix(monkeypatch, release, lambda t: t.fill_(0.5))
    model = make_model()
    opt = DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht=swarm(), run_id="bgmix",
                                 target_batch_size=10**6, batch_size_per_step=16, target_group_size=2)
    gen = torch.Generator().manual_seed(0)
    try:
        peers = tuple(bytes([i]) * 38 for i in range(3)) + (opt.dht.node.peer_id.to_bytes(),)
        before = [p.detach().clone() for p in model.parameters()]
        rounds.start_mix(opt, 0, rounds.grid_cell(opt, peers, 0))
        for _ in range(3):  # the cell has not come: steps go on, on our parameters
            loss_of(model, batch(gen)).backward()
            opt.step()
            opt.zero_grad()
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        release.set_result(None)
        opt._mixing.result(timeout=10)
        loss_of(model, batch(gen)).backward()
        opt.step()
        assert all(bool((p == 0.5).all()) for p in model.parameters())
        rounds.start_mix(opt, 1, rounds.grid_cell(opt, peers, 1))
        opt._mixing.result(timeout=10)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(2.0)
        opt._apply_shared_state(opt._shared_state()[1], 3)  # (a state load: ours, as it is now)
        assert all(bool((p == 2.0).all()) for p in model.parameters()) and opt._mixing is None
    finally:
        opt.close()


def test_a_diloco_mix_moves_the_outer_parameters_and_keeps_the_steps_taken_since(swarm, monkeypatch):  # noqa: F811
    """diloco: the mix of the outer parameters runs beside the next inner steps; once it lands the
    outer parameters are the mix and the inner ones moved with them (the steps since are kept)."""
    release: Future = Future()
    held_mix(monkeypatch, release, lambda t: t.add_(1.0))
    model = make_model()
    opt = DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht=swarm(), run_id="dlmix",
                                 mode="diloco", local_steps=10**6, batch_size_per_step=16, target_group_size=2)
    gen = torch.Generator().manual_seed(0)
    try:
        peers = tuple(bytes([i]) * 38 for i in range(3)) + (opt.dht.node.peer_id.to_bytes(),)
        outer_before = [o.clone() for o in opt._outer]
        rounds.start_mix(opt, 0, rounds.grid_cell(opt, peers, 0))
        for _ in range(3):  # (inner steps while the cell has not come)
            loss_of(model, batch(gen)).backward()
            opt.step()
            opt.zero_grad()
        assert all(torch.equal(o, b) for o, b in zip(opt._outer, outer_before))
        moved = [p.detach() - o for p, o in zip(model.parameters(), opt._outer)]  # the inner steps' progress
        assert any(bool(m.abs().sum() > 0) for m in moved)
        release.set_result(None)
        opt._mixing.result(timeout=10)
        with torch.no_grad():  # (a step with no gradient: the inner optimizer leaves the parameters)
            opt.step()
        assert all(torch.allclose(o, b + 1.0) for o, b in zip(opt._outer, outer_before))
        kept = [p.detach() - o for p, o in zip(model.parameters(), opt._outer)]
        assert all(torch.allclose(k, m, atol=1e-6) for k, m in zip(kept, moved))
    finally:
        opt.close()


def diloco_in_a_grid_of_four(dht, run_id: str):
    """A diloco peer with an endless inner phase in a 2 x 2 grid of itself and three made-up peers:
    (model, optimizer, us, our round-0 cell mate, a peer of the other cell, the last one)."""
    model = make_model()
    opt = DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht=dht, run_id=run_id,
                                 mode="diloco", local_steps=10**6, batch_size_per_step=16, target_group_size=2)
    me = opt.tracker.me.peer
    others = [Identity().peer_id for _ in range(3)]
    cell = opt.mixer.members(0, tuple(p.to_bytes() for p in [me, *others]))
    assert cell is not None and len(cell) == 2  # (a 2 x 2 grid)
    mate = next(p for p in others if p.to_bytes() in cell)
    stranger = next(p for p in others if p.to_bytes() not in cell)
    rest = next(p for p in others if p not in (mate, stranger))
    return model, opt, me, mate, stranger, rest


def test_a_diloco_peer_stops_its_inner_phase_early_only_for_a_peer_of_its_own_cell(swarm, monkeypatch):  # noqa: F811
    """In a grid the cells meet apart: a peer ready elsewhere in the swarm leaves our inner phase
    alone, a ready peer of our cell ends it (it waits for us), and so does one whose published
    estimate of its phase's end has just passed (not long ago: that one stalled). Blocking, a peer of our cell one
    epoch ahead while another is still at ours means our round is open: we join it; once nobody
    of our cell is left at our epoch, it is over and we load the swarm's state."""
    model, opt, me, mate, stranger, rest = diloco_in_a_grid_of_four(swarm(), "dlcell")
    gen = torch.Generator().manual_seed(0)
    ended: list[str] = []
    behind: list[str] = []
    monkeypatch.setattr(opt, "_outer_step", lambda view: ended.append("outer"))
    monkeypatch.setattr(diloco_step, "fall_behind", lambda o, view: behind.append("load"))

    def view_with(*reports: PeerReport) -> SwarmView:
        top = max(r.epoch for r in reports)
        return SwarmView(epoch=top, samples=0, target=64, peers=[r for r in reports if r.epoch == top],
                         behind=[r for r in reports if r.epoch < top])

    def step_with(view: SwarmView) -> None:
        monkeypatch.setattr(opt.tracker, "estimate", lambda: view)
        loss_of(model, batch(gen)).backward()
        opt.step()
        opt.zero_grad()

    def rep(peer, epoch: int, ready: bool = False, eta: float | None = None) -> PeerReport:
        return PeerReport(peer, epoch, 0, 1.0, time.time(), "s", addr=("127.0.0.1", 1), ready=ready, eta=eta)

    try:
        step_with(view_with(rep(me, 0), rep(mate, 0), rep(stranger, 0, ready=True), rep(rest, 0)))
        assert ended == [] and behind == []
        past, later, stalled = time.time() - 0.1, time.time() + 60, time.time() - 5 * diloco_step.ETA_TRUST
        step_with(view_with(rep(me, 0), rep(mate, 0, eta=later), rep(stranger, 0, eta=past), rep(rest, 0)))
        assert ended == [] and behind == []
        step_with(view_with(rep(me, 0), rep(mate, 0, eta=stalled), rep(stranger, 0), rep(rest, 0)))
        assert ended == [] and behind == []  # (long past and still not ready: it stalled or died)
        # a peer of our cell whose inner phase is over by its own estimate: as good as its ready report
        step_with(view_with(rep(me, 0), rep(mate, 0, eta=past), rep(stranger, 0), rep(rest, 0)))
        assert ended == ["outer"] and behind == []
        step_with(view_with(rep(me, 0), rep(mate, 0, ready=True), rep(stranger, 0), rep(rest, 0)))
        assert ended == ["outer", "outer"] and behind == []
        # blocking rounds: a stranger at epoch 1 finished a round of another cell; ours is still open
        step_with(view_with(rep(me, 0), rep(mate, 0), rep(stranger, 1), rep(rest, 0)))
        assert ended == ["outer", "outer"] and behind == []
        step_with(view_with(rep(me, 0), rep(mate, 1), rep(stranger, 0), rep(rest, 1)))
        assert behind == ["load"]  # (our mate is past our round: nobody of our cell is left at our epoch)
    finally:
        opt.close()


def test_a_diloco_round_begins_its_matchmaking_before_the_first_end_in_its_cell(swarm, monkeypatch):  # noqa: F811
    """A round's matchmaking begins ``early_lead`` before our inner phase ends, or a cell mate's
    (whose readiness ends ours), once an epoch, declaring the samples of the steps left; and is
    left when our epoch changes under it (a loaded state) without handing it data."""
    model, opt, me, mate, stranger, rest = diloco_in_a_grid_of_four(swarm(), "dlearly")
    gen = torch.Generator().manual_seed(0)
    begun: list[tuple[int, float]] = []
    left: list[int] = []

    class Start:
        def __init__(self, epoch: int):
            self.epoch = epoch

        def leave(self) -> None:
            left.append(self.epoch)

    def begin(o, epoch: int, weight: float, view: SwarmView) -> None:
        begun.append((epoch, weight))
        o._early = rounds.Early(epoch, rounds.Cell(), 2, Start(epoch), Future())

    monkeypatch.setattr(diloco_step, "begin_early", begin)
    monkeypatch.setattr(opt, "_outer_step", lambda view: None)

    def step_with(*reports: PeerReport) -> None:
        view = SwarmView(epoch=0, samples=0, target=64, peers=list(reports))
        monkeypatch.setattr(opt.tracker, "estimate", lambda: view)
        loss_of(model, batch(gen)).backward()
        opt.step()
        opt.zero_grad()

    def rep(peer, eta: float | None = None) -> PeerReport:
        return PeerReport(peer, 0, 0, 1.0, time.time(), "s", addr=("127.0.0.1", 1), eta=eta)

    lead = rounds.early_lead(opt)
    assert rounds.EARLY_LEAD <= lead <= opt.matchmaking_timeout / 3
    try:
        soon = time.time() + lead / 2
        step_with(rep(me), rep(mate, time.time() + 60), rep(stranger, soon), rep(rest))
        assert begun == []  # (our phase, 10**6 steps, and our mate's end far off; a stranger's is not ours)
        step_with(rep(me), rep(mate, soon), rep(stranger), rep(rest))
        assert begun == [(0, 16 * 10**6)]  # the samples of the steps left: 2 taken, 10**6 - 2 left, and this one
        step_with(rep(me), rep(mate, soon), rep(stranger), rep(rest))
        assert len(begun) == 1 and left == []  # once an epoch
        opt.epoch = 1  # (as a loaded state leaves it)
        step_with(rep(me), rep(mate, soon), rep(stranger), rep(rest))
        assert left == [0] and opt._early is None and len(begun) == 1
    finally:
        opt.close()


def test_a_round_begun_early_gets_the_data_of_its_epoch_and_a_stale_one_is_left():
    """``average`` hands an early round of our epoch its samples (the group it formed stays ours)
    and leaves one of another epoch before it starts the round the usual way."""
    went: list[float] = []
    left: list[str] = []

    class Start:
        def __init__(self, name: str):
            self.name = name

        def go(self, weight: float) -> None:
            went.append(weight)

        def leave(self) -> None:
            left.append(self.name)

    cell = rounds.Cell((b"a", b"b"), 3, "/g2", 2)
    future: Future = Future()
    opt = type("Fake", (), {})()
    opt._early = rounds.Early(3, cell, 2, Start("e3"), future)
    view = SwarmView(epoch=3, samples=0, target=64)
    assert rounds.average(opt, 3, 48, view) is future
    assert went == [48] and left == [] and opt._early is None and opt._cell is cell and opt._last_expected == 2
    opt._early = rounds.Early(2, cell, 2, Start("e2"), Future())
    opt._expected = lambda view, epoch: 1  # (nobody else due: no round of a new kind starts)
    opt.tracker = None
    alone = rounds.average(opt, 3, 48, SwarmView(epoch=3, samples=0, target=64))
    assert left == ["e2"] and went == [48] and alone.result() is None


def test_a_sync_round_begins_its_matchmaking_when_the_swarm_is_early_lead_from_its_target(swarm, monkeypatch):  # noqa: F811
    """Sync: once the swarm's estimate puts the target within ``early_lead``, the epoch's round
    begins (once), declaring more samples than we will have by then; not in epochs shorter than
    twice the lead (the round would begin as the last one ends)."""
    model = make_model()
    opt = DecentralizedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht=swarm(), run_id="syncearly",
                                 mode="sync", target_batch_size=10**6, batch_size_per_step=16)
    gen = torch.Generator().manual_seed(0)
    others = [PeerReport(Identity().peer_id, 0, 0, 1.0, time.time(), "s", addr=("127.0.0.1", 1)) for _ in range(3)]
    begun: list[tuple[int, float]] = []

    def begin(o, epoch: int, weight: float, view: SwarmView) -> None:
        begun.append((epoch, weight))
        o._early = rounds.Early(epoch, rounds.Cell(), 4, None, Future())

    monkeypatch.setattr(sync_step, "begin_early", begin)
    lead = rounds.early_lead(opt)

    def step_at(eta: float, sps: float = 1000.0) -> None:
        view = SwarmView(epoch=0, samples=10**6 - eta * sps, target=10**6, peers=others, sps=sps)
        monkeypatch.setattr(opt.tracker, "report", lambda *a, **k: view)
        loss_of(model, batch(gen)).backward()
        opt.step()
        opt.zero_grad()

    try:
        step_at(10 * lead)
        assert begun == []
        step_at(lead / 2, sps=10**6 / lead)  # (the whole epoch takes the lead)
        assert begun == []
        step_at(lead / 2)
        assert [e for e, _ in begun] == [0] and begun[0][1] > 2 * opt.local_samples
        step_at(lead / 4)
        assert len(begun) == 1
    finally:
        opt._early = None
        opt.close()


def test_a_rounds_mates_are_its_cells_peers_that_come_and_can_be_dialed():
    """The peers a round's entry goes to directly (``Cell.mates``): those of its grid cell that
    are expected to come and serve at an address; the next dimension's cell (the parameter mix)
    draws its own from the same reports."""
    ids = [Identity().peer_id for _ in range(16)]
    me = ids[0]
    reports = [PeerReport(p, 0, 0, 1.0, time.time(), "s", addr=None if i == 5 else ("127.0.0.1", 1000 + i))
               for i, p in enumerate(ids)]
    late = ids[7].to_bytes()  # (at an older epoch: loading the state, it will not come)
    view = SwarmView(epoch=3, samples=0, target=64, peers=[r for r in reports if r.peer != ids[7]],
                     behind=[PeerReport(ids[7], 1, 0, 1.0, time.time(), "s", addr=("127.0.0.1", 1007))])
    opt = type("Fake", (), {})()
    opt.mixer = GridMixer(me.to_bytes(), 4)
    opt.delay_updates = opt.overlap_outer = False
    for k in (3, 4):
        cell = rounds.round_cell(opt, view, k)
        members = opt.mixer.members(k, tuple(p.peer.to_bytes() for p in view.training))
        assert len(members) == 4 and me.to_bytes() in members
        want = [p for p in members if p != late and p != ids[5].to_bytes()]
        assert [c.peer_id.to_bytes() for c in cell.mates] == want
        assert all(c.addr == ("127.0.0.1", 1000 + ids.index(c.peer_id)) for c in cell.mates)
        mix = rounds.grid_cell(opt, cell.peers, k + 1, cell.coming, cell.reach)
        assert {c.peer_id.to_bytes() for c in mix.mates} <= set(opt.mixer.members(k + 1, cell.peers))
    small = SwarmView(epoch=3, samples=0, target=64, peers=reports[:4])  # (one group holds it: no grid)
    assert rounds.round_cell(opt, small, 3).mates == ()
