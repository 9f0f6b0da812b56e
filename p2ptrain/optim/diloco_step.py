"""``diloco`` (DiLoCo, Douillard et al. 2023): every peer takes ``local_steps`` (H) ordinary inner
steps, then the peers average their *pseudo-gradient* (outer parameters minus current parameters),
compressed (``compression``, int8 by default), and apply an outer optimizer (Nesterov SGD) to the
outer parameters, which every member then continues from. A slow peer is not waited for: once a
peer of its round's group (its grid cell, in a large swarm) is ready to average, or should be by
its own published estimate, it stops after its current step and joins with the samples it has
(weighted accordingly); peers that are not ready within the matchmaking deadline are left out of
that round.

With ``overlap_outer`` the round runs on the event loop while the next H inner steps proceed (at
most one in flight: round t lands at the latest when round t+1 starts). Each peer trains on from
where the outer step would take the outer parameters with its own pseudo-gradient (an eager
update, Kale et al. 2025); once the round lands, the outer parameters take the real step and the
parameters are merged into them (streaming DiLoCo, Douillard et al. 2025): see ``outer_swap``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from .catch_up import fall_behind
from .outer_swap import eager_start, land_overlapped, swap_back, swap_out
from .progress import SwarmView
from .rounds import (apply_mix, begin_early, cell_reports, drop_early, early_due, missed_round,
                     others_hold_our_epoch, round_result, state_round_due)
from .shared_state import maybe_checkpoint
from .warmup import warmed_step

if TYPE_CHECKING:
    from ..averaging import StepResult
    from .optimizer import DecentralizedOptimizer

#: overlapped rounds: the share of its distance from the new outer parameters (the steps taken
#: during the round, its departure from the group's mean) that a peer keeps when a round lands:
#: streaming DiLoCo's alpha (on char_lm with the whole round in flight 0.6 did best of 0.3-0.7)
OVERLAP_MIX = 0.6


#: s: a peer of our cell whose inner phase should have ended this long ago without a ready report
#: stalled or died (at 64 peers on 2 cores a ready report takes up to ~0.6 s to reach its cell)
ETA_TRUST = 1.0


def overlap_mix(lr: float, momentum: float) -> float:
    """``OVERLAP_MIX``, or less for large outer steps: a peer's departure from the group's mean
    comes back ``lr * (1 + momentum)`` times larger through its eager start, times the mix at
    the merge; that product is kept at 0.75 at most, so the departures shrink round after round."""
    return min(OVERLAP_MIX, 0.75 / (lr * (1 + momentum)))


def diloco_step(opt: DecentralizedOptimizer, bs: int) -> None:
    """One inner step on this batch (``bs`` samples); the outer step once H are done or another
    peer is ready to average (a slow peer joins with the samples it has)."""
    overlap = opt.overlap_outer
    apply_mix(opt, wait=False)
    drop_early(opt, stale=True)  # (our epoch changed under it: a state loaded)
    opt._inner_steps += 1
    # an inner step changes the parameters, not the shared state (outer parameters and optimizer):
    # the plain lock, so that a peer downloading our state does not make us copy it
    with opt._state_lock.raw:
        warmed_step(opt.inner, opt._inner_steps, opt.inner_warmup_steps)
    opt.stats.overlapped_steps += opt._pending is not None
    opt._local_steps_done += 1
    opt.local_samples += bs
    view = opt.tracker.estimate()
    opt.stats.observe(view, opt.epoch, opt.local_samples)
    me = opt.tracker.me.peer
    mates = [p for p in cell_reports(opt, view, opt.epoch) if p.peer != me]  # (whom we average with)
    # Overlapped, a peer reports the next epoch once its round started: one epoch ahead of us,
    # it is in the round of ours, or just out of it. Blocking, a peer one epoch ahead is out of
    # its round: ours is over when no peer of our cell is left at our epoch. Further ahead, we
    # fell behind.
    if view.epoch > opt.epoch + 1 or (view.epoch == opt.epoch + 1 and not overlap
                                      and not any(p.epoch == opt.epoch for p in mates)):
        drop_early(opt)
        land_outer(opt, wait=True)
        fall_behind(opt, view)
        return
    # The round's end as a sample target, so that the tracker refreshes faster as it nears
    # and the peers notice each other's readiness in time (it decides nothing else here).
    opt.tracker.target = opt.local_steps * bs * max(1, view.num_peers)
    # (only our cell's readiness stops us early: a grid's cells meet apart, and waiting on the
    # swarm's first ready peer cut every other cell's inner phases short; a peer whose inner
    # phase should be over by its own estimate is taken as ready: its ready report would reach
    # us a notice or a poll later; not long after, though: by then it stalled or died)
    now = time.time()
    others_ready = any(p.epoch > opt.epoch or (p.epoch == opt.epoch and (p.ready or due(p.eta, now))) for p in mates)
    if opt._local_steps_done >= opt.local_steps or others_ready:
        opt._outer_step(view)
    else:
        eta = inner_eta(opt, bs)
        opt.tracker.report(opt.epoch, opt.local_samples, opt._sps, eta=eta)
        # our phase ends at our eta or at the first of our cell mates' (see others_ready): the
        # round's matchmaking begins early_lead before that, at about the same time on all of them
        ends = [e for e in (eta, *(p.eta for p in mates if p.epoch == opt.epoch)) if e is not None and e > now]
        phase = opt.local_steps * bs / opt._sps if opt._sps > 0 else 0.0
        if ends and early_due(opt, phase, min(ends) - now):
            # (the most samples we will average with: those of the steps left at this batch size)
            begin_early(opt, opt.epoch, opt.local_samples + (opt.local_steps - opt._local_steps_done) * bs, view)
    if overlap:  # (after the inner step: the next gradients are taken at the merged parameters)
        land_outer(opt, wait=False)


def due(eta: float | None, now: float) -> bool:
    """Whether a peer's published end of its inner phase (``eta``) has come, within ``ETA_TRUST``."""
    return eta is not None and now - ETA_TRUST <= eta <= now


def inner_eta(opt: DecentralizedOptimizer, bs: int | None = None) -> float | None:
    """When our inner phase ends at our measured pace (unix time; None before it is measured)."""
    if opt._sps <= 0:
        return None
    left = (opt.local_steps - opt._local_steps_done) * (opt.batch_size_per_step if bs is None else bs)
    return time.time() + max(0, left) / opt._sps


def outer_step(opt: DecentralizedOptimizer, view: SwarmView) -> None:
    """The pseudo-gradient into the buffers, then the round and the outer step."""
    if opt.overlap_outer:
        start_overlapped(opt, view)
        return
    samples = opt.local_samples
    apply_mix(opt, wait=True)  # (the last epoch's mix, before the pseudo-gradient is taken)
    with opt._state_lock:
        swap_out(opt)
        opt._version += 1
    epoch = opt.epoch
    try:
        _outer_round(opt, epoch, samples, view)
    finally:
        opt._settled.set()  # (cleared by the round once it grouped)


def _outer_round(opt: DecentralizedOptimizer, epoch: int, samples: int, view: SwarmView) -> None:
    opt.tracker.report(epoch, samples, opt._sps, ready=True)
    result = round_result(opt, opt._average(epoch, samples, view))
    with opt._state_lock:
        deltas = swap_back(opt)
        opt._version += 1
    missed = dropped(opt, result)
    with opt._state_lock:
        if missed:  # our update is lost; take the swarm's state (see catch_up.load_state_from_peers)
            for p, outer in zip(opt.params, opt._outer):
                p.copy_(outer)
        else:
            _outer_update(opt, deltas)
            # the peers that share our state now, as of this round (none after a lone step)
            me = opt.dht.node.peer_id
            opt._partners = {m: epoch for m in result.members if m != me} if result is not None else {}
            for p, outer in zip(opt.params, opt._outer):
                p.copy_(outer)
            opt._applied = epoch + 1
            opt._version += 1
    if missed:  # as a sync peer that missed its round: the next epoch, if a peer holds its update
        opt.epoch = epoch + 1
        opt.stats.record(result, opt.epoch, opt.local_samples)
        opt._load_state_from_peers(opt.tracker.estimate(), missed=True)
        return
    if not state_round_due(opt.average_state_every, epoch, opt._last_expected):
        opt._settled.set()  # the update is in (else once the state round is: maybe_average_state)
    opt.state_sync.update_size()
    opt.epoch += 1
    opt.local_samples = 0
    opt._local_steps_done = 0
    opt.stats.record(result, opt.epoch, opt.local_samples)
    if opt._maybe_average_state(epoch):
        with opt._state_lock:
            for p, outer in zip(opt.params, opt._outer):
                p.copy_(outer)
    maybe_checkpoint(opt)
    opt.tracker.report(opt.epoch, 0, opt._sps, eta=inner_eta(opt))


def dropped(opt: DecentralizedOptimizer, result: StepResult | None) -> bool:
    """Whether to drop our round's update for the swarm's state: the round failed midway (the
    buffer may hold part sums), or we met nobody (a group of one; or no round, as nobody looked
    due, while we have partners) and another peer may hold or be taking the update: one at or
    past our epoch (a fresh look), or a partner whose report predates the round we last shared
    (it shows that round's epoch or an earlier one: views lag under load). Partners: the other
    members of our last round, or the peers we loaded our state from. Stepping alone would leave
    us on a path of our own for good (averaged pseudo-gradients never close the gap)."""
    if result is None and opt._last_expected > 1:
        return True
    if not (result.group_size == 1 if result is not None else opt._partners):
        return False
    if others_hold_our_epoch(opt) or any(p.epoch <= opt._partners.get(p.peer, -1) for p in opt.tracker.view.training):
        return True
    opt._last_expected = 1  # they left or are behind: we are the swarm, and step
    return False


def _outer_update(opt: DecentralizedOptimizer, deltas: list[torch.Tensor]) -> None:
    """The outer optimizer's step with the averaged pseudo-gradient ``deltas`` (and the scheduler's)."""
    assert opt.outer_optimizer is not None
    for outer, delta in zip(opt._outer, deltas):
        outer.grad = delta
    opt.outer_optimizer.step()
    for outer in opt._outer:
        outer.grad = None
    if opt.scheduler is not None:
        opt.scheduler.step()


# ---- overlapped rounds (overlap_outer)

def start_overlapped(opt: DecentralizedOptimizer, view: SwarmView) -> None:
    """End our epoch: its pseudo-gradient into the averaging buffer and its round started on the
    event loop; training goes on meanwhile (``land_outer`` applies the round once it is over)."""
    if opt._pending is not None:
        land_outer(opt, wait=True)  # at most one round in flight: its update is this one's base
        if opt.local_samples == 0:  # (it was missed: we loaded the swarm's state and start anew)
            return
    samples, epoch = opt.local_samples, opt.epoch
    assert opt.outer_optimizer is not None
    eager_start(opt._outer, opt.params, opt._buffers, opt.outer_optimizer)
    opt.tracker.report(epoch, samples, opt._sps, ready=True)
    opt._pending, opt._pending_epoch = opt._average(epoch, samples, view), epoch
    opt.epoch += 1
    opt.local_samples = 0
    opt._local_steps_done = 0
    opt.tracker.report(opt.epoch, 0, opt._sps, eta=inner_eta(opt))


def land_outer(opt: DecentralizedOptimizer, wait: bool) -> None:
    """Apply the round in flight once it is over (``wait``: wait for it): the outer step with its
    average, the parameters merged into the new outer ones. A round we missed (others were
    there but we met nobody, or it failed midway) loads the swarm's state instead."""
    future = opt._pending
    if future is None or (not wait and not future.done()):
        return
    opt._pending = None
    epoch = opt._pending_epoch
    try:
        result = round_result(opt, future)
        if missed_round(opt, result):
            return
        assert opt.outer_optimizer is not None
        with opt._state_lock:
            group = opt.outer_optimizer.param_groups[0]
            land_overlapped(opt.params, opt._outer, overlap_mix(group["lr"], group["momentum"]),
                            lambda: _outer_update(opt, opt._buffers))
            opt._applied = epoch + 1
            opt._version += 1
        if not state_round_due(opt.average_state_every, epoch, opt._last_expected):
            opt._settled.set()  # the update is in (else once the state round is: maybe_average_state)
        opt.state_sync.update_size()
        opt.stats.record(result, opt.epoch, opt.local_samples)
        opt._maybe_average_state(epoch)
        maybe_checkpoint(opt)
    finally:
        opt._settled.set()


@torch.no_grad()
def finish_overlapped(opt: DecentralizedOptimizer) -> None:
    """Apply the round in flight, if any, and put the outer parameters in the model, as a
    blocking round leaves it."""
    land_outer(opt, wait=True)
    for p, outer in zip(opt.params, opt._outer):
        p.copy_(outer)
