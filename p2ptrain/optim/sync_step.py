"""``sync`` (collaborative large-batch training, like one big machine): every ``step()`` only adds
this peer's gradients (weighted by its batch size) to a local accumulator and tells the swarm, through
:mod:`~p2ptrain.optim.progress`, how many samples it has. When the swarm together has
``target_batch_size`` samples, every peer averages its accumulated gradient in a group (weighted by
samples) and all take the same inner step: the *global epoch* advances together. With
``delay_updates=True`` the averaging runs in the background while the next epoch's batches are
computed and its result is applied one step later (no pause; the update is one epoch stale).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from ..averaging import StepResult
from .catch_up import fall_behind
from .memory import flat_views
from .progress import SwarmView
from .rounds import (apply_mix, begin_early, drop_early, early_due, early_lead, missed_round, round_result,
                     state_round_due)
from .shared_state import maybe_checkpoint

if TYPE_CHECKING:
    from .optimizer import DecentralizedOptimizer


def sync_step(opt: DecentralizedOptimizer, bs: int) -> None:
    """Add this batch's gradients (``bs`` samples) to the accumulator; end the epoch when due."""
    apply_mix(opt, wait=False)
    apply_pending(opt, wait=False)
    drop_early(opt, stale=True)  # (our epoch changed under it: a state loaded)
    if not opt._grad_acc:
        # without delayed updates we accumulate in the buffer that is averaged (zeroed once
        # applied); with them the next epoch accumulates while the last one's round runs
        opt._grad_acc = opt._buffers if not opt.delay_updates else flat_views(opt._buffers)
        torch._foreach_zero_(opt._grad_acc)
    # One call for all tensors, not one per tensor: each torch call gives up the GIL and
    # waits up to 5 ms to get it back while the event loop runs Python (a delayed round).
    pairs = [(acc, p.grad) for acc, p in zip(opt._grad_acc, opt.params) if p.grad is not None]
    if pairs:
        torch._foreach_add_([a for a, _ in pairs], [g for _, g in pairs], alpha=bs)
    opt.local_samples += bs
    view = opt.tracker.report(opt.epoch, opt.local_samples, opt._sps)
    opt.stats.observe(view, opt.epoch, opt.local_samples)
    behind = view.epoch > opt.epoch + 1 or (view.epoch == opt.epoch + 1 and round_over(opt, view))
    due = view.epoch == opt.epoch + 1 or view.reached or view.ready
    if opt.fsdp is not None:  # an FSDP peer's ranks end their epochs at one step (see optim/fsdp.py)
        due = opt.fsdp.end_epoch(due and not behind)
    if behind:
        drop_early(opt)
        fall_behind(opt, view)
    elif due:
        # the published counts reach the target, or a peer is waiting for us, or peers already
        # moved on from our epoch (they may still be in its round): end the epoch and try to
        # join the round; if it has closed, apply_pending loads the swarm's state instead of
        # stepping alone
        opt._end_sync_epoch(view)
    elif view.due:
        # The extrapolated estimate says the target is reached: confirm with the counts the
        # peers published (read now). Ending on the estimate ended fast epochs with a third to
        # a half of the target's samples when a peer's throughput was overestimated.
        opt.tracker.hurry()
    epoch_s = view.target / view.sps if view.sps > 0 else 0.0
    if not (due or behind) and early_due(opt, epoch_s, view.eta):
        # the epoch's round begins while we compute its last batches, declaring the most we will
        # average with: twice the samples we would have by its end at our pace
        begin_early(opt, opt.epoch, 2 * (opt.local_samples + opt._sps * (view.eta + early_lead(opt))) + bs, view)


def end_sync_epoch(opt: DecentralizedOptimizer, view: SwarmView) -> None:
    """End our epoch: its mean gradient into the buffers, its round started (and applied unless
    updates are delayed)."""
    if opt._pending is not None:
        apply_pending(opt, wait=True)  # at most one round in flight
    samples = opt.local_samples
    if opt._grad_acc is not opt._buffers:
        torch._foreach_copy_(opt._buffers, opt._grad_acc)
        torch._foreach_zero_(opt._grad_acc)
    torch._foreach_div_(opt._buffers, float(samples))
    epoch = opt.epoch
    opt.tracker.report(epoch, samples, opt._sps, ready=True)
    future = opt._average(epoch, samples, view)
    opt.epoch += 1
    opt.local_samples = 0
    opt._pending, opt._pending_epoch = future, epoch
    if not opt.delay_updates:
        apply_pending(opt, wait=True)
    opt.tracker.report(opt.epoch, 0, opt._sps)


def apply_pending(opt: DecentralizedOptimizer, wait: bool) -> None:
    """Take the inner step with the averaged gradients of the round in flight, once it is done."""
    future = opt._pending
    if future is None or (not wait and not future.done()):
        return
    opt._pending = None
    try:
        _apply_round(opt, future)
    finally:
        if opt._grad_acc is opt._buffers:  # the next epoch accumulates in it
            torch._foreach_zero_(opt._buffers)
        opt._settled.set()


def _apply_round(opt: DecentralizedOptimizer, future: Future[StepResult | None]) -> None:
    result = round_result(opt, future)
    apply_mix(opt, wait=True)  # (the last epoch's mix, before anything changes the parameters)
    if missed_round(opt, result):
        return
    grads = [p.grad for p in opt.params]
    with opt._state_lock:
        for p, buf in zip(opt.params, opt._buffers):
            p.grad = buf.to(device=p.device, dtype=p.dtype, non_blocking=False).view_as(p)
        opt.inner.step()
        if opt.scheduler is not None:
            opt.scheduler.step()
        opt._applied = opt._pending_epoch + 1
        opt._version += 1
    for p, g in zip(opt.params, grads):  # the user's current gradients stay as they were
        p.grad = g
    if not state_round_due(opt.average_state_every, opt._pending_epoch, opt._last_expected):
        opt._settled.set()  # the update is in (else once the state round is: maybe_average_state)
    opt.state_sync.update_size()
    opt.stats.record(result, opt.epoch, opt.local_samples)
    opt._maybe_average_state(opt._pending_epoch)
    maybe_checkpoint(opt)


def round_over(opt: DecentralizedOptimizer, view: SwarmView) -> bool:
    """Whether our epoch's round is over for everyone, so there is no group left to join.

    Without delayed updates a peer reports the next epoch only once it applied the round;
    when no other peer still reports ours, waiting in matchmaking (a joiner whose download
    the swarm outran) would only end in a state load after the deadline: load now. With
    delayed updates peers report the next epoch while their round may still be matching."""
    if opt.delay_updates:
        return False
    me = opt.tracker.me.peer
    return not any(p.epoch == opt.epoch and p.peer != me for p in view.behind)
