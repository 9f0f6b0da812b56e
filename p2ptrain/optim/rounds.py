"""Averaging rounds of both modes: starting one, who will come to it, waiting for its result, and the
periodic rounds that average the state itself."""

from __future__ import annotations

import logging
import time
from collections.abc import Coroutine, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dht import Contact

from ..averaging import Averager, EarlyStart, StepResult
from .progress import PeerReport, SwarmView

if TYPE_CHECKING:
    from .optimizer import DecentralizedOptimizer

log = logging.getLogger("p2ptrain.optim")
#: seconds the training thread waits for a fresh read of the swarm's progress before skipping a
#: round that others may come to (a DHT read takes a few ms on a LAN, a few hundred on the internet)
FRESH_LOOK = 2.0
#: s: the least time before our epoch's end at which its round's matchmaking begins (begin_early)
EARLY_LEAD = 0.2


def average(opt: DecentralizedOptimizer, epoch: int, samples: int, view: SwarmView) -> Future[StepResult | None]:
    """Start averaging ``opt._buffers`` for ``epoch`` (weighted by ``samples``) on the loop.

    Alone (no other peer has reported recently) there is nobody to meet: the round is skipped
    rather than waiting out the matchmaking deadline on every epoch.
    """
    early = opt._early
    if early is not None and early.epoch == epoch:  # its group is forming (or formed): hand it the data
        opt._early = None
        opt._last_expected, opt._cell = early.expected, early.cell
        early.start.go(samples)
        return early.future
    drop_early(opt)
    expected = opt._expected(view, epoch)
    if expected <= 1 and len(view.peers) + len(view.behind) > 1:
        # Others train, but none looks due for this round. The view is up to a refresh period
        # old: a peer that finished the previous epoch's round with us since then still
        # reports the one before, looks like a peer catching up, and going alone here would
        # leave it waiting out matchmaking in a round nobody comes to. Look again before
        # skipping (bounded: a DHT that does not answer leaves us with the view we had).
        t0 = time.perf_counter()
        view = opt._loop.run(opt.tracker.refresh_now(timeout=FRESH_LOOK))
        opt._paused += time.perf_counter() - t0
        expected = opt._expected(view, epoch)
    opt._last_expected = expected
    opt._cell = Cell()
    if expected <= 1:
        done: Future[StepResult | None] = Future()
        done.set_result(None)
        return done
    opt._cell = cell = round_cell(opt, view, epoch)
    return opt._loop.submit(_step(opt, cell, epoch, samples, expected))


def round_cell(opt: DecentralizedOptimizer, view: SwarmView, epoch: int) -> Cell:
    """Round ``epoch``'s cell of the grid (its parameter mix, ``epoch + 1``, spans the groups this
    one forms, and the dimension mixed turns every epoch), expecting the peers that will come."""
    coming = frozenset(p.peer.to_bytes() for p in coming_peers(view, epoch, reports_ahead(opt)))
    reach = {p.peer.to_bytes(): p for p in view.training if p.reach}
    return grid_cell(opt, tuple(p.peer.to_bytes() for p in view.training), epoch, coming, reach)


def _step(opt: DecentralizedOptimizer, cell: Cell, epoch: int, weight: float, expected: int,
          start: EarlyStart | None = None) -> Coroutine[Any, Any, StepResult]:
    # (delayed updates overlap training with the round: snapshots do not wait for it)
    on_group = None if opt.delay_updates and opt.mode == "sync" else opt._settled.clear
    return opt.averager.step(weight=weight, round_id=f"e{epoch}{cell.key}", timeout=opt.matchmaking_timeout,
                             expected=cell.expected if cell.key else expected, on_group=on_group, start=start,
                             mates=cell.mates)


@dataclass
class Early:
    """A round of ours whose matchmaking began before its epoch ended (``begin_early``)."""

    epoch: int
    cell: Cell
    expected: int
    start: EarlyStart
    future: Future[StepResult | None]


def begin_early(opt: DecentralizedOptimizer, epoch: int, weight: float, view: SwarmView) -> None:
    """Begin ``epoch``'s round before its data (hivemind's pre-scheduled step): its group forms while
    our last steps train, and ``average`` hands it the data at the epoch's end. ``weight``: the most
    samples we will average with (declared in matchmaking). Not when nobody else looks due."""
    expected = opt._expected(view, epoch)
    if expected <= 1:
        return
    cell = round_cell(opt, view, epoch)
    start = EarlyStart(opt._loop.loop)
    opt._early = Early(epoch, cell, expected, start, opt._loop.submit(_step(opt, cell, epoch, weight, expected, start)))


def early_due(opt: DecentralizedOptimizer, epoch_s: float, left_s: float) -> bool:
    """Whether our epoch's round begins its matchmaking now (``begin_early``), ``left_s`` before the
    epoch's expected end: once that is within ``early_lead``, and not yet begun. Only for a peer of
    one process, but not diloco's overlapped rounds (which start in the background anyway), and only
    in epochs of ``epoch_s`` at least twice the lead (in shorter ones a round would begin as the
    last one ends, before the cell's views hold its mates: diloco at 64 peers, 0.5 s phases, formed
    groups of 2.6-2.7 of 4 that way, against 3.1-3.5)."""
    if opt._early is not None or opt.overlap_outer or opt.ranks is not None or opt.fsdp is not None:
        return False
    lead = early_lead(opt)
    return epoch_s >= 2 * lead and left_s <= lead


def early_lead(opt: DecentralizedOptimizer) -> float:
    """How long before our epoch's (or inner phase's) end its round's matchmaking begins: 1.5 x the
    last one's (from its start to its group), at least ``EARLY_LEAD``, at most a third of the timeout
    (that third before our first round: at 64 peers a 0.2 s guess left 35 of the first round's 64
    peers waiting 0.3-0.7 s for their group). From our start, not from the moment the group's last
    member came: the wait for mates that began later is what the lead must cover (their estimates
    of the end differ; with the shorter lead diloco at 64 peers waited more and lost 4%)."""
    last = opt.averager.matchmaker.last_stats.get("seconds")
    if last is None:  # (no round yet to go by: the swarm's first rounds meet everyone at once)
        return opt.matchmaking_timeout / 3
    return min(max(EARLY_LEAD, 1.5 * last), opt.matchmaking_timeout / 3)


def drop_early(opt: DecentralizedOptimizer, stale: bool = False) -> None:
    """Leave the round begun early, if any (``stale``: only one of an epoch other than ours): we
    will not hand it data (we loaded a state, or close). A group it formed goes on without us."""
    early = opt._early
    if early is not None and not (stale and early.epoch == opt.epoch):
        opt._early = None
        early.start.leave()


@dataclass(frozen=True)
class Cell:
    """Where a round of ours met: the peers its grid was drawn for, the round's index, its
    cell's key (``""``: the whole swarm under one key, no grid), how many of the peers expected
    to come it holds (None: not known), and those peers; the reports of the peers that can be
    dialed, and of those the cell's others expected to come, told of our arrival directly."""

    peers: tuple[bytes, ...] = ()
    k: int = 0
    key: str = ""
    expected: int | None = None
    coming: frozenset[bytes] | None = None
    reach: Mapping[bytes, PeerReport] = field(default_factory=dict, compare=False)
    mates: tuple[Contact, ...] = ()


def grid_cell(opt: DecentralizedOptimizer, peers: tuple[bytes, ...], k: int,
              coming: frozenset[bytes] | None = None, reach: Mapping[bytes, PeerReport] | None = None) -> Cell:
    """The cell of round ``k`` in a grid drawn for ``peers`` (no grid without a mixer), expecting
    those of ``coming`` (default: all) it holds; its mates are those of them ``reach`` reports an
    address for (none without a grid: the whole swarm, whose size no peer's writes may grow with)."""
    reach = reach or {}
    members = opt.mixer.members(k, peers) if opt.mixer is not None else None
    mates = tuple(Contact(r.peer, r.addr, relays=r.relays) for p in members or ()
                  if (r := reach.get(p)) is not None and (coming is None or p in coming))
    if opt.mixer is None:
        return Cell(peers, k, reach=reach)
    return Cell(peers, k, opt.mixer.key(k, peers), opt.mixer.expected(k, peers, coming), coming, reach, mates)


def cell_reports(opt: DecentralizedOptimizer, view: SwarmView, k: int) -> list[PeerReport]:
    """The reports of ``view``'s training peers (us included) in round ``k``'s cell of the grid
    drawn for them; all of them when one group holds the whole swarm."""
    training = view.training
    if opt.mixer is None:
        return training
    ids = [p.peer.to_bytes() for p in training]
    members = opt.mixer.members(k, tuple(ids))
    if members is None:
        return training
    cell = set(members)
    return [p for p, b in zip(training, ids) if b in cell]


def reports_ahead(opt: DecentralizedOptimizer) -> bool:
    """Whether a peer reports the next epoch while its round may still run (``expected_peers``'s
    ``delay_updates``): with delayed updates, or diloco's overlapped outer round."""
    return opt.delay_updates or opt.overlap_outer


def expected_peers(view: SwarmView, epoch: int, delay_updates: bool) -> int:
    """How many peers (us included) will come to ``epoch``'s round, from a ``view`` taken
    before we reported the epoch's end.

    Peers still reporting the previous epoch are finishing its round and will come; peers
    further behind are catching up (they load the state) and will not. With delayed updates
    a peer reports the next epoch as soon as its round started: when the view is already at
    ``epoch + 1``, those peers may be in our round still, and we are among ``behind``
    (without delayed updates they applied it already: only the peers at ``epoch`` come)."""
    return len(coming_peers(view, epoch, delay_updates))


def coming_peers(view: SwarmView, epoch: int, delay_updates: bool) -> list[PeerReport]:
    """The peers :func:`expected_peers` counts."""
    if view.epoch == epoch + 1:
        return [p for p in view.behind if p.epoch == epoch] + (view.peers if delay_updates else [])
    return view.peers + [p for p in view.behind if p.epoch == epoch - 1]


def missed_round(opt: DecentralizedOptimizer, result: StepResult | None) -> bool:
    """After a round of ours: whether we missed it and loaded the swarm's state instead. Others
    were there but we met nobody (we came late, or the round failed): stepping with our own
    update would leave us on a path of our own for good. When they left instead (or are behind,
    and will load ours), we are the swarm: we step, and take no state round either."""
    if opt._last_expected > 1 and (result is None or result.group_size == 1):
        if result is None or others_hold_our_epoch(opt):
            opt.stats.record(result, opt.epoch, opt.local_samples)
            opt._load_state_from_peers(opt.tracker.estimate(), missed=True)
            return True
        opt._last_expected = 1
    return False


def others_hold_our_epoch(opt: DecentralizedOptimizer) -> bool:
    """Whether a fresh look shows another peer at our state's epoch or past it: one that may
    have taken the step we missed (or missed it with us). The view that expected them is up
    to a refresh old: a peer that finished and left since then is gone from a fresh one."""
    t0 = time.perf_counter()
    view = opt._loop.run(opt.tracker.refresh_now(timeout=FRESH_LOOK))
    opt._paused += time.perf_counter() - t0
    opt.stats.observe(view, opt.epoch, opt.local_samples)
    me = opt.tracker.me.peer
    return any(p.peer != me and p.epoch >= opt._applied for p in (*view.peers, *view.behind))


def round_result(opt: DecentralizedOptimizer, future: Future[StepResult | None]) -> StepResult | None:
    """Wait for a round's result (None if it failed: counted and logged); the wait counts as a pause."""
    t0 = time.perf_counter()
    try:
        return future.result()
    except Exception as e:  # noqa: BLE001 - a failed round must not kill training
        log.warning("averaging round failed (%s: %s); stepping with the local gradients", type(e).__name__, e)
        opt.stats.failed_rounds += 1
        return None
    finally:
        opt._paused += time.perf_counter() - t0


# ---- periodic state averaging

def state_tensors(params: list[torch.Tensor], opt_state: dict[Any, Any],
                  with_state: bool) -> list[tuple[str, torch.Tensor]]:
    """What peers must agree on beyond one step: the parameters (the outer ones in diloco) and,
    ``with_state``, the floating-point optimizer state of the same shape (momenta, Adam moments)."""
    named = [(f"p{i}", p.data) for i, p in enumerate(params)]
    if not with_state:
        return named
    for i, p in enumerate(params):
        for k, v in sorted(opt_state.get(p, {}).items()):
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.shape == p.shape:
                named.append((f"s{i}.{k}", v))
    return named


def state_round_due(every: int, epoch: int, expected: int) -> bool:
    """Whether the state is averaged after ``epoch``'s update (every ``every`` epochs, when others
    came to the last round). Until that round is over, ``_settled`` stays clear from the update
    on: a snapshot taken between the two would give a joiner the state from before it, a
    rounding error apart from the swarm's after it."""
    return bool(every) and (epoch + 1) % every == 0 and expected > 1


def maybe_average_state(opt: DecentralizedOptimizer, epoch: int) -> bool:
    """Every ``average_state_every`` epochs, average the state itself, equally weighted; after a
    round in a grid cell (mixing groups), average the parameters in the next round's cell.

    Gradient rounds keep a group's members bit-identical, but once the swarm splits into
    several groups (a late matchmaker, churn, more peers than ``target_group_size``) the groups
    drift apart; averaging the state brings them back together. In a grid the next round's cell
    holds one peer of each group this round formed: mixing the parameters there averages out the
    groups' different steps (Moshpit), and a state round walks every dimension of the grid (the
    whole swarm's average in a full grid).
    """
    due = state_round_due(opt.average_state_every, epoch, opt._last_expected)
    cell = opt._cell
    if not due and not cell.key:
        return False
    if not due and opt.ranks is None and opt.fsdp is None and not opt.overlap_outer:
        start_mix(opt, epoch, cell)
        return False
    if opt.mode == "sync":
        named = state_tensors(opt.params, opt.inner.state, due)
    else:
        assert opt.outer_optimizer is not None
        # DiLoCo's point is to send little: the outer parameters are what drift; the momentum
        # buffers follow them (and would double the bytes of these rounds)
        named = state_tensors(opt._outer, opt.outer_optimizer.state, due and opt._outer_momentum_in_state)
    averager = state_averager(opt, "state" if due else "mix", named)
    dims = len(opt.mixer.shape(len(cell.peers))) if due and cell.key and opt.mixer is not None else 1
    averaged = False
    for k in range(cell.k + 1, cell.k + 1 + dims):  # (from the dimension after the gradient round's)
        here = grid_cell(opt, cell.peers, k, cell.coming, cell.reach) if cell.key else cell
        averaged = _state_round(opt, averager, f"{'s' if due else 'm'}{epoch}{here.key}", here) or averaged
    return averaged


def start_mix(opt: DecentralizedOptimizer, epoch: int, cell: Cell) -> None:
    """The parameter mix in the background: average the parameters (diloco: the outer ones) in
    the cell after ``cell``'s dimension (round ``m{epoch}``) while the next epoch trains.

    They change only when an epoch's update is applied (or a state is loaded), so the mix runs
    on a copy of them and :func:`apply_mix` puts its result in at a step after it is done: the
    average a blocking round gives, with its matchmaking (the wait for the cell's last peer) off
    the training thread. The next update waits for it, so it never lands on parameters it did
    not start from; a loaded state discards it."""
    params = [p.detach() for p in (opt.params if opt.mode == "sync" else opt._outer)]
    bufs = opt._mix_bufs
    if bufs is None or [b.shape for b in bufs] != [p.shape for p in params]:
        bufs = opt._mix_bufs = [p.clone() for p in params]
    else:
        torch._foreach_copy_(bufs, params)
    averager = state_averager(opt, "mix", [(f"p{i}", b) for i, b in enumerate(bufs)])
    here = grid_cell(opt, cell.peers, cell.k + 1, cell.coming, cell.reach)
    step = averager.step(weight=1.0, round_id=f"m{epoch}{here.key}", timeout=opt.matchmaking_timeout,
                         expected=here.expected, mates=here.mates)
    opt._mixing = opt._loop.submit(step)


def apply_mix(opt: DecentralizedOptimizer, wait: bool, discard: bool = False) -> None:
    """Put a finished mix's parameters in ours (``wait``: wait for it first; ``discard``: wait, and
    keep ours, as a loaded state must). In diloco the outer parameters take the mix, and the
    inner ones move with them: the steps taken since the mix began are kept."""
    future = opt._mixing
    if future is None or (not wait and not future.done()):
        return
    opt._mixing = None
    result = round_result(opt, future)
    if result is None:
        return
    _count_state_round(opt, result)
    if discard or result.group_size < 2 or opt._mix_bufs is None:
        return
    with opt._state_lock:
        if opt.mode == "sync":
            torch._foreach_copy_([p.detach() for p in opt.params], opt._mix_bufs)
        else:
            for p, outer, mixed in zip(opt.params, opt._outer, opt._mix_bufs):
                p.detach().add_((mixed - outer).to(p.device, p.dtype))
                outer.copy_(mixed)
        opt._version += 1


def state_averager(opt: DecentralizedOptimizer, kind: str, named: list[tuple[str, torch.Tensor]]) -> Averager:
    """The averager of ``kind`` (``state``: state rounds, ``mix``: a cell's parameters) for ``named``,
    made anew when the tensors' shapes change."""
    shapes = [(n, t.shape, t.dtype) for n, t in named]
    held = opt._state_averagers.get(kind)
    if held is None or held[0] != shapes:
        if held is not None:
            opt._loop.run(held[1].close())
        averager = Averager(
            opt.dht.node, f"{opt.run_id}/{opt.mode}/{kind}", named, codec="none", aggregation=opt.aggregation,
            target_group_size=opt.averager.matchmaker.target_group_size,
            matchmaking_timeout=opt.matchmaking_timeout, service=opt.averager.service,
        )
        opt._state_averagers[kind] = held = (shapes, averager)
    return held[1]


def _state_round(opt: DecentralizedOptimizer, averager: Averager, round_id: str, cell: Cell) -> bool:
    # Only the training thread changes the state, and it waits here for the round: the state
    # lock is taken for writing each slice of the average back, not across matchmaking and the
    # network (a snapshot for a joiner would wait for all of it).
    def written() -> None:
        opt._version += 1

    step = averager.step(weight=1.0, round_id=round_id, timeout=opt.matchmaking_timeout,
                         expected=cell.expected if cell.key else opt._last_expected, on_group=opt._settled.clear,
                         lock=opt._state_lock, on_write=written, mates=cell.mates)
    future = opt._loop.submit(step)
    try:
        result = round_result(opt, future)
    finally:
        opt._settled.set()
    if result is not None:
        _count_state_round(opt, result)
    return result is not None and result.group_size > 1


def _count_state_round(opt: DecentralizedOptimizer, result: StepResult) -> None:
    """A state round or mix that ran (alone or not), in the stats."""
    opt.stats.state_rounds += 1
    opt.stats.bytes_sent += result.bytes_sent
    opt.stats.bytes_received += result.bytes_received
