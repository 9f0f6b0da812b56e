"""``diloco`` (DiLoCo, Douillard et al. 2023): every peer takes ``local_steps`` (H) ordinary inner
steps, then the peers average their *pseudo-gradient* (outer parameters minus current parameters),
compressed (``compression``, int8 by default), and apply an outer optimizer (Nesterov SGD) to the
outer parameters, which every member then continues from. A slow peer is not waited for: once a
peer of its epoch is ready to average, it stops after its current step and joins with the samples it
has (weighted accordingly); peers that are not ready within the matchmaking deadline are left out of
that round.
"""

from __future__ import annotations

from typing import TYPE_CHECKING


from .catch_up import fall_behind
from .outer_swap import swap_back, swap_out
from .progress import SwarmView
from .rounds import round_result, state_round_due
from .shared_state import maybe_checkpoint
from .warmup import warmed_step

if TYPE_CHECKING:
    from .optimizer import DecentralizedOptimizer


def diloco_step(opt: DecentralizedOptimizer, bs: int) -> None:
    """One inner step on this batch (``bs`` samples); the outer step once H are done or another
    peer is ready to average (a slow peer joins with the samples it has)."""
    opt._inner_steps += 1
    with opt._state_lock:
        warmed_step(opt.inner, opt._inner_steps, opt.inner_warmup_steps)
    opt._local_steps_done += 1
    opt.local_samples += bs
    view = opt.tracker.estimate()
    opt.stats.observe(view, opt.epoch, opt.local_samples)
    if view.epoch > opt.epoch:
        fall_behind(opt, view)
        return
    # The round's end as a sample target, so that the tracker refreshes faster as it nears
    # and the peers notice each other's readiness in time (it decides nothing else here).
    opt.tracker.target = opt.local_steps * bs * max(1, view.num_peers)
    others_ready = any(p.ready and p.peer != opt.tracker.me.peer for p in view.peers)
    if opt._local_steps_done >= opt.local_steps or others_ready:
        opt._outer_step(view)
    else:
        opt.tracker.report(opt.epoch, opt.local_samples, opt._sps)


def outer_step(opt: DecentralizedOptimizer, view: SwarmView) -> None:
    """The pseudo-gradient into the buffers, then the round and the outer step."""
    assert opt.outer_optimizer is not None
    samples = opt.local_samples
    with opt._state_lock:
        swap_out(opt)
        opt._version += 1
    epoch = opt.epoch
    try:
        _outer_round(opt, epoch, samples, view)
    finally:
        opt._settled.set()  # (cleared by the round once it grouped)


def _outer_round(opt: DecentralizedOptimizer, epoch: int, samples: int, view: SwarmView) -> None:
    assert opt.outer_optimizer is not None
    opt.tracker.report(epoch, samples, opt._sps, ready=True)
    result = round_result(opt, opt._average(epoch, samples, view))
    with opt._state_lock:
        deltas = swap_back(opt)
        opt._version += 1
        if result is None and opt._last_expected > 1:
            # The round failed midway: the buffer may hold part sums. Our update is lost; take
            # the swarm's state with it rather than step alone (see catch_up.load_state_from_peers).
            for p, outer in zip(opt.params, opt._outer):
                p.copy_(outer)
            failed = True
        else:
            failed = False
            for outer, delta in zip(opt._outer, deltas):
                outer.grad = delta
            opt.outer_optimizer.step()
            for outer in opt._outer:
                outer.grad = None
            for p, outer in zip(opt.params, opt._outer):
                p.copy_(outer)
            if opt.scheduler is not None:
                opt.scheduler.step()
            opt._applied = epoch + 1
            opt._version += 1
    if failed:  # as a sync peer that missed its round: the next epoch, if a peer holds its update
        opt.epoch = epoch + 1
        opt.stats.record(result, opt.epoch, opt.local_samples)
        opt._load_state_from_peers(opt.tracker.estimate(), missed=True)
        return
    if not state_round_due(opt.average_state_every, epoch, opt._last_expected):
        opt._settled.set()  # the update is in (else once the state round is: maybe_average_state)
    opt.state_sync.warm()
    opt.epoch += 1
    opt.local_samples = 0
    opt._local_steps_done = 0
    opt.stats.record(result, opt.epoch, opt.local_samples)
    if opt._maybe_average_state(epoch):
        with opt._state_lock:
            for p, outer in zip(opt.params, opt._outer):
                p.copy_(outer)
    maybe_checkpoint(opt)
    opt.tracker.report(opt.epoch, 0, opt._sps)
