"""Catching up with the swarm: falling behind it, loading its state from peers, resuming from a
checkpoint. Failures are logged and training goes on from the state we have."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint import StateTooLargeError, StateTransferError
from .progress import SwarmView
from .rounds import FRESH_LOOK, round_result
from .shared_state import placeable
from .state_sync import NoProviders, UntrustedState

if TYPE_CHECKING:
    from .optimizer import DecentralizedOptimizer

log = logging.getLogger("p2ptrain.optim")


def catch_up_at_start(opt: DecentralizedOptimizer) -> None:
    """Where a new peer starts: the newest checkpoint, unless live peers are past it (then their
    state); the swarm sees it from then on, at that epoch (not at 0 while it resumes)."""
    view = opt.tracker.view
    if len(view.training) == 1:  # nobody else: look once more (a first read under load can miss them all)
        view = opt._loop.run(opt.tracker.wait_fresh(FRESH_LOOK))
    resumed = opt.checkpointer is not None and resume_from_checkpoint(opt, view)
    if view.epoch > opt.epoch and not resumed:  # the swarm has trained already: start from where it is
        opt._load_state_from_peers(view)
    opt.tracker.report(opt.epoch, 0, opt._sps)
    opt._loop.run(opt.tracker.publish())


def fall_behind(opt: DecentralizedOptimizer, view: SwarmView) -> None:
    """The swarm moved past our epoch without us (we missed its rounds): load its state.

    Unless every peer ahead of us is in client mode: they serve no state, so a load cannot
    succeed, and trying again at every step (each one resets the epoch's samples) would stop
    our training for as long as they stay ahead. Leave them out of the view for a while
    instead, and train on from our own epoch."""
    me = opt.tracker.me.peer
    ahead = [p for p in (*view.peers, *view.behind) if p.peer != me and p.epoch > opt.epoch]
    if ahead and not any(p.reach for p in ahead):
        opt.tracker.ignore([p.peer for p in ahead])
        quiet = opt._load_warnings.allow("client ahead", time.monotonic())
        if quiet is not None:
            log.warning("%d peer(s) at epoch %d are ahead of us, but in client mode they serve no state to "
                        "catch up from; training on from our own epoch %d%s", len(ahead),
                        max(p.epoch for p in ahead), opt.epoch,
                        f" ({quiet} more times since the last warning)" if quiet else "")
        return
    log.info("the swarm is at epoch %d, we are at %d: loading its state", view.epoch, opt.epoch)
    opt._load_state_from_peers(view)


def load_state_from_peers(opt: DecentralizedOptimizer, view: SwarmView, missed: bool = False) -> bool:
    """Download the state of the most advanced peers and continue from it; on failure, keep
    ours (and the swarm's epoch number) and say so: training goes on either way.

    When we have not trained on our state (a new peer's first load, or a second one before
    its first update), the download writes the parameters in place as it goes: no
    state-sized buffer to fault in. If it fails they are part ours, part the swarm's
    (verified) ones; we are still behind the swarm then, and load again before our first
    update. A peer that trained keeps its own until a download is complete.

    ``missed``: we ended our epoch but missed its round: only a state with that update in it
    will do (a provider still in the round serves the one before: taking it and our epoch
    number would leave us an update short of the swarm for good). Without one we go back to
    the epoch our state holds and catch up from there, unless nobody has it: then the whole
    round failed, and every peer skips that update alike."""
    t0 = time.perf_counter()
    if opt._pending is not None:  # a round still in flight would land on top of the new state
        round_result(opt, opt._pending)
        opt._pending = None
    loaded = False
    epoch = opt.epoch
    result = None
    at_least = opt._applied + int(missed)
    try:
        into = placeable(opt) if opt._version == opt._untrained else {}
        if into:
            with opt._state_lock:  # no snapshot of ours sees them half-written
                try:
                    result = opt._fetch_state(view, at_least, into=into)
                finally:  # they changed, whether or not the download completed
                    opt._version += 1
                    opt._untrained = opt._version
        else:
            result = opt._fetch_state(view, at_least)
        epoch = result.manifest.meta["epoch"]
        opt.stats.last_state_providers = len(result.contributors)
        opt.stats.last_state_in_place = result.placement.placed_bytes if result.placement is not None else 0
        opt._apply_shared_state(result.restore(), epoch)
        opt._untrained = opt._version
        opt._partners = dict.fromkeys(result.contributors, epoch - 1)  # (see diloco_step.dropped)
        loaded = True
        opt.averager.service.link.observe_transfer(result.manifest.total_size, result.seconds)  # (deadlines)
        opt.state_sync.update_size()
        if opt.delay_updates:
            # with delayed updates the providers' state trails their epoch by the round in
            # flight: join at their epoch (that update reaches us with the next state round)
            epoch = max(epoch, view.epoch)
        elif not opt.overlap_outer:
            # blocking rounds: providers past their state's epoch skipped an update nobody held;
            # we hold what they hold, so we are at their epoch too (else we fall behind again)
            epoch = max([epoch, *(p.epoch for p in view.training if p.peer in result.contributors)])
    except (StateTransferError, ValueError, KeyError, TypeError, RuntimeError) as e:
        missed = missed and not isinstance(e, NoProviders)  # (nobody holds the update we missed)
        if result is not None:  # fetched, but it does not fit us: not a state to follow either
            opt.tracker.ignore(list(result.contributors))
        quiet = opt._load_warnings.allow("state load", time.monotonic())
        if quiet is not None:
            more = f" ({quiet} more failed since the last warning)" if quiet else ""
            log.warning("could not load the swarm's state (%s); continuing from our own at epoch %d%s",
                        e, opt.epoch, more)
        else:
            log.debug("could not load the swarm's state (%s); continuing from our own at epoch %d", e, opt.epoch)
    for acc in opt._grad_acc:
        acc.zero_()
    opt.epoch = max(epoch, opt.epoch)
    if missed and not loaded and not opt.delay_updates:
        opt.epoch = opt._applied  # never an epoch beyond the updates our state holds
    opt.local_samples = 0
    opt._local_steps_done = 0
    opt.stats.state_loads += int(loaded)
    opt.stats.last_state_load_s = time.perf_counter() - t0
    opt.tracker.report(opt.epoch, 0, opt._sps)
    if loaded:  # the view that sent us here is as old as the download: look again
        opt._loop.run(opt.tracker.refresh_now())
    opt._paused += time.perf_counter() - t0
    return loaded


def fetch_state(opt: DecentralizedOptimizer, view: SwarmView, at_least: int, attempts: int = 3,
                 into: dict[str, list[torch.Tensor]] | None = None) -> Any:
    """Download the state from the most advanced peers of ``view``; if none of them can give
    it (under churn they may have died since they last reported), leave them out of the view
    and try the next most advanced ones, from a fresh read of the swarm's progress.

    Peers whose state we cannot get do not get to set our epoch either: a peer that trained
    alone and left (its record lingers) must not drag the swarm along. Peers that report
    fewer updates than ``at_least`` are no providers: theirs would take us back; while peers
    one epoch short of it (still in its round) may get there, we wait for them, at most a
    matchmaking timeout. NoProviders only when nobody held it: once holders failed us, their
    error (a missed update that peers hold is not one to skip).

    A download that fails on the way (a slow or briefly unreachable provider) is asked again
    once of the same providers when no other peer holds the state: leaving them out of the
    view at once would leave us alone in it for the progress ttl. A state they served that is
    not to be believed (UntrustedState, or larger than ours can be) leaves them out at once."""
    deadline = time.monotonic() + opt.load_state_timeout
    patience = time.monotonic() + opt.matchmaking_timeout
    strict = opt._strict

    async def newest() -> int:
        """(on the loop) The newest epoch a fresh read of the swarm's progress shows, as believed
        (see ``claims``), plus the one a provider may have reached since it published."""
        return (await opt.tracker.refresh_now(timeout=FRESH_LOOK)).epoch + 1

    attempt = 0
    failed: StateTransferError | None = None
    failing: set[Any] = set()  # peers whose download failed on the way, not left out (yet)
    retried: set[Any] = set()  # those of them asked once more
    while True:
        me = opt.tracker.me.peer
        others = [p for p in (*view.peers, *view.behind) if p.peer != me]
        # (a peer that skipped a round reports its epoch but holds fewer updates: no provider)
        holders = [p for p in others if p.epoch >= at_least and (p.held is None or p.held >= at_least)]
        rest = [p for p in holders if p.peer not in failing]
        if failing and rest:  # others hold it: ask them instead
            opt.tracker.ignore(list(failing))
            holders, failing = rest, set()
        retried |= failing  # (else nobody does: the same ones once more)
        providers = opt.state_sync.choose(holders, quorum=strict)
        if not providers and time.monotonic() < min(patience, deadline) and any(
                p.epoch == at_least - 1 and p.reach for p in others):
            view = opt._loop.run(opt.tracker.wait_fresh(0.5))
            continue
        if not providers and failed is not None:  # the ones that hold it failed us: not "nobody holds it"
            opt.tracker.ignore(list(failing))
            raise failed
        if not providers:
            raise NoProviders(f"no peer at or past our epoch {at_least} serves it")
        try:
            return opt._loop.run(opt.state_sync.fetch(providers, max(1.0, deadline - time.monotonic()),
                                                      into=into, at_least=at_least, strict=strict,
                                                      max_total=opt._state_cap, newest=newest))
        except StateTransferError as e:
            failed = e
            attempt += 1
            ids = {p.peer for p in providers}
            if isinstance(e, (UntrustedState, StateTooLargeError)) or ids <= retried:  # not to believe, or twice
                opt.tracker.ignore(list(ids))
                failing -= ids
            else:
                failing |= ids
            if attempt == attempts or time.monotonic() >= deadline:
                opt.tracker.ignore(list(failing))
                raise
            log.info("could not load the state from %d peer(s) (%s); trying again", len(providers), e)
            view = opt._loop.run(opt.tracker.refresh_now())


def resume_from_checkpoint(opt: DecentralizedOptimizer, view: SwarmView) -> bool:
    """Start from the newest checkpoint (DHT or disk) unless live peers are ahead of it (their
    state is newer: the caller loads that instead). Failures are logged; training goes on."""
    ck = opt.checkpointer
    assert ck is not None
    t0 = time.perf_counter()
    try:
        info = ck.find(opt.load_state_timeout, at_least=view.epoch)
        if info is None or info.epoch <= 0 or info.epoch < view.epoch:
            return False
        opt._apply_shared_state(ck.load(info), info.epoch)
    except Exception as e:  # noqa: BLE001 - a bad checkpoint (corrupt, other model) must not stop the start
        log.warning("could not resume from a checkpoint (%s: %s); starting without it", type(e).__name__, e)
        return False
    ck.endorse(info)
    opt.epoch = info.epoch
    opt.stats.resumed_epoch = info.epoch
    opt.stats.last_state_load_s = time.perf_counter() - t0
    opt.tracker.report(opt.epoch, 0, opt._sps)
    opt._loop.run(opt.tracker.refresh_now())
    log.info("resumed from checkpoint %s at epoch %d (%.2f s)", info.cid, info.epoch, opt.stats.last_state_load_s)
    return True
