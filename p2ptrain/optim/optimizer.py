"""DecentralizedOptimizer: a torch optimizer whose steps are taken by a whole swarm of peers.

It wraps any torch optimizer (the *inner* one) and is used exactly like it::

    opt = DecentralizedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), dht=dht,
                                 run_id="digits-mlp", target_batch_size=4096, batch_size_per_step=32)
    for x, y in batches:
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()

Two modes:

``sync`` (collaborative large-batch training, like one big machine): every ``step()`` only adds
this peer's gradients (weighted by its batch size) to a local accumulator and tells the swarm, through
:mod:`~p2ptrain.optim.progress`, how many samples it has. When the swarm together has
``target_batch_size`` samples, every peer averages its accumulated gradient in a group (weighted by
samples) and all take the same inner step: the *global epoch* advances together. With
``delay_updates=True`` the averaging runs in the background while the next epoch's batches are
computed and its result is applied one step later (no pause; the update is one epoch stale).

``diloco`` (DiLoCo, Douillard et al. 2023): every peer takes ``local_steps`` (H) ordinary inner
steps, then the peers average their *pseudo-gradient* (outer parameters minus current parameters),
compressed (``compression``, int8 by default), and apply an outer optimizer (Nesterov SGD) to the
outer parameters, which every member then continues from. A slow peer is not waited for: once a
peer of its epoch is ready to average, it stops after its current step and joins with the samples it
has (weighted accordingly); peers that are not ready within the matchmaking deadline are left out of
that round.

Peers join and leave at any time; the mechanics of a round are in :mod:`~p2ptrain.averaging`.

Checkpoints (``checkpoint_every``/``checkpoint_dir``): every N global epochs three peers chosen without
coordination save the shared state to their local store, serve it and announce it in the DHT; a peer
that starts with no live peer ahead of it (or a whole swarm restarted) resumes from the newest
checkpoint in the DHT or on its disk (:mod:`~p2ptrain.checkpoint.autosave`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dht import PeerID
from dht.limits import LogThrottle

from ..averaging import AllReduceConfig, Averager, StepResult
from ..averaging.robust import check_aggregation
from ..background import DHT
from ..checkpoint import StateTransferError
from ..checkpoint.autosave import Checkpointer
from ..compression import get_codec
from ..gil import short_gil_waits
from .adopt import Schedule, optimizer_state
from .claims import EpochJudge
from .progress import PeerReport, ProgressTracker, SwarmView
from .state_sync import NoProviders, StateSync
from .warmup import warmed_step

log = logging.getLogger("p2ptrain.optim")
#: seconds between two warnings about failed state loads (the ones between go to DEBUG, counted)
_LOAD_WARN_EVERY = 30.0
#: seconds the training thread waits for a fresh read of the swarm's progress before skipping a
#: round that others may come to (a DHT read takes a few ms on a LAN, a few hundred on the internet)
_FRESH_LOOK = 2.0

_MODES = ("sync", "diloco")


@dataclass
class OptimizerStats:
    """What the swarm and this peer have done so far (read it any time, e.g. for a progress line)."""

    epoch: int = 0  # global epoch: optimizer steps the swarm has taken together
    local_samples: int = 0  # samples this peer accumulated toward the current epoch
    samples_total: int = 0  # samples this peer processed since it started
    peers: int = 1  # compatible peers training in the run (reported recently, any epoch), us included
    swarm_sps: float = 0.0  # samples per second, whole swarm (from the peers' reports)
    local_sps: float = 0.0
    rounds: int = 0  # averaging rounds this peer took part in
    last_group_size: int = 1
    last_round_s: float = 0.0
    last_round_samples: int = 0  # samples behind the last round's average (its group's, together)
    bytes_sent: int = 0
    bytes_received: int = 0
    failed_rounds: int = 0  # rounds that found nobody or lost part of the average
    state_rounds: int = 0  # rounds that averaged the parameters and optimizer state themselves
    state_loads: int = 0  # times this peer downloaded the swarm's state (joining, or after missing rounds)
    last_state_load_s: float = 0.0
    last_state_providers: int = 0  # peers the last state download came from (in parallel)
    last_state_in_place: int = 0  # bytes of it written straight into our tensors (see _load_state_from_peers)
    checkpoints_saved: int = 0  # checkpoints this peer wrote (it is one of the writers of some epochs)
    last_checkpoint_epoch: int | None = None  # epoch of the last checkpoint this peer wrote
    resumed_epoch: int | None = None  # epoch of the checkpoint this peer started from, if any
    #: peers dropped from our rounds (NaN/inf or wrong-sized parts, other codec or aggregation,
    #: died, stalled): peer id -> why, the latest reason per peer (at most 64 peers kept)
    excluded: dict[str, str] = field(default_factory=dict)


class DecentralizedOptimizer(torch.optim.Optimizer):
    """Makes a swarm of peers train one model; see the module docstring for the two modes.

    ``dht``: a :class:`p2ptrain.DHT` (shared with other components); or ``initial_peers`` to let
    this optimizer create and own one. ``run_id`` names the training run: only peers with the same
    run id, model (parameter shapes and dtypes) and ``compression`` ever average together; a peer
    with another model is reported in the log and in :attr:`mismatches`.

    ``aggregation``: how a group combines its members' tensors: ``mean`` (weighted, the fastest,
    trusts every peer) or a robust rule (``trimmed_mean``, ``median``, ``centered_clip``) that keeps
    a minority of hostile peers from steering training; all peers of a run must use the same one
    (it is part of the schema, like ``compression``). Peers dropped from a round are logged and
    listed in ``stats.excluded``.

    ``scheduler``: an LR scheduler over *this* optimizer, or a callable ``f(optimizer)`` making one;
    it is stepped once per global epoch (do not step it yourself).

    ``inner_warmup_steps`` (``diloco`` only): scale the inner learning rate linearly from
    1/N to 1 over this peer's first N local steps. Early DiLoCo rounds start from random weights,
    where H unsynchronised steps at full lr can leave the average stuck on a loss plateau (measured
    on char_lm: one seed in two); a short warmup avoids it. Peers of one run need not agree on it
    (each replica's inner trajectory is its own) and a joiner warms up again, which costs it a few
    slower steps only. The scale is applied around each inner step, so a user's ``scheduler``
    (per outer round) and the inner optimizer's saved state are unaffected. Not for ``sync`` mode,
    whose peers must all take the same step: use ``scheduler`` there.

    ``checkpoint_every``: save a checkpoint every N global epochs (by ``checkpoint_writers`` peers
    of the swarm, not all) into the store at ``checkpoint_dir`` (default: ``$P2PTRAIN_DATA_DIR`` or
    the user's cache directory), keeping the newest ``checkpoint_keep`` per run. With either set,
    a peer that finds no live peer ahead of it resumes from the newest checkpoint (DHT or disk).
    In the DHT a checkpoint counts only when three distinct writers signed it, or one of
    ``trusted_writers`` (PeerIDs or their strings) did: never one peer's claim alone.

    ``model``: the module whose parameters ``optimizer`` trains (optional). Checkpoints then
    record its ``state_dict`` names, so ``p2ptrain ckpt export`` writes a file that
    ``model.load_state_dict`` takes, and hold its other state_dict tensors (buffers such as
    BatchNorm running stats, frozen parameters) as the saving peer has them, restored on resume.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        run_id: str,
        dht: DHT | None = None,
        initial_peers: Sequence[str] | None = None,
        target_batch_size: int = 4096,
        batch_size_per_step: int = 32,
        mode: str = "sync",
        local_steps: int = 50,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        inner_warmup_steps: int = 0,
        compression: str | None = None,
        aggregation: str = "mean",
        target_group_size: int = 16,
        delay_updates: bool = False,
        scheduler: Any = None,
        matchmaking_timeout: float = 5.0,
        averaging_timeout: float = 60.0,
        refresh_period: float = 0.5,
        bandwidth: float = 1.0,
        load_state_timeout: float = 60.0,
        average_state_every: int | None = None,
        outer_momentum_in_state: bool = False,
        checkpoint_every: int | None = None,
        checkpoint_dir: str | Path | None = None,
        checkpoint_keep: int = 3,
        checkpoint_writers: int = 3,
        trusted_writers: Sequence[PeerID | str] = (),
        model: torch.nn.Module | None = None,
    ):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {', '.join(_MODES)}, got {mode!r}")
        if not isinstance(run_id, str) or not run_id or len(run_id) > 100 or "/" in run_id:
            raise ValueError("run_id must be a non-empty string of at most 100 characters without '/'")
        if target_batch_size < 1 or batch_size_per_step < 1:
            raise ValueError("target_batch_size and batch_size_per_step must be positive")
        if mode == "diloco" and local_steps < 1:
            raise ValueError("local_steps must be at least 1")
        if not (0 < outer_lr < float("inf")) or not (0 <= outer_momentum < 1):
            raise ValueError("outer_lr must be positive and outer_momentum in [0, 1)")
        if type(inner_warmup_steps) is not int or inner_warmup_steps < 0:
            raise ValueError(f"inner_warmup_steps must be a non-negative int, got {inner_warmup_steps!r}")
        if inner_warmup_steps and mode != "diloco":
            raise ValueError("inner_warmup_steps is for diloco mode (sync peers must all take the same step: "
                             "warm up with scheduler=, stepped per global epoch)")
        if dht is not None and initial_peers:
            raise ValueError("pass either dht= or initial_peers=, not both")
        if checkpoint_every is not None and (type(checkpoint_every) is not int or checkpoint_every < 1):
            raise ValueError(f"checkpoint_every must be a positive number of epochs, got {checkpoint_every!r}")
        # torch.optim.Optimizer's own bookkeeping, without copying the inner param groups
        self.defaults = optimizer.defaults
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                     "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                     "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, OrderedDict())
        self._patch_step_function()

        self.inner = optimizer
        self.run_id = run_id
        self.mode = mode
        self.target_batch_size = int(target_batch_size)
        self.batch_size_per_step = int(batch_size_per_step)
        self.local_steps = int(local_steps)
        self.inner_warmup_steps = inner_warmup_steps
        self._inner_steps = 0  # diloco: local steps taken by this peer (the warmup's clock)
        self.delay_updates = delay_updates
        self.matchmaking_timeout = matchmaking_timeout
        self.codec = compression or ("int8" if mode == "diloco" else "none")
        # "mean" trusts every peer; a robust rule (trimmed_mean, median, centered_clip) bounds
        # what a minority of hostile peers can do to the average (see averaging/robust.py)
        self.aggregation = check_aggregation(aggregation)
        #: test/benchmark hook: called with the tensors this peer is about to average (gradients
        #: or pseudo-gradients) so a simulated hostile peer can rewrite them in place
        self._corrupt: Callable[[list[torch.Tensor]], None] | None = None
        self.params: list[torch.Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        if not self.params:
            raise ValueError("the optimizer has no parameters")
        # the model's state_dict names (manifest meta of our checkpoints) and its tensors the
        # optimizer does not train (buffers), which checkpoints hold beside the parameters
        self._model = model
        self._state_names: dict[str, str] = {}
        self._extra_keys: list[str] = []
        if model is not None:
            from ..checkpoint.export import module_names

            self._state_names, self._extra_keys = module_names(model, self.params,
                                                               "params" if mode == "sync" else "outer")

        get_codec(self.codec)  # a typo fails here, with the list of codecs, before any network starts
        self._owns_dht = dht is None
        self.dht = dht if dht is not None else DHT(initial_peers)
        self._loop = self.dht.loop
        # What we average: gradients (sync) or pseudo-gradients (diloco), fp32 on the CPU where the
        # wire needs them anyway. Names carry shapes into the schema, so other models never meet us.
        self._buffers = [torch.empty(p.shape, dtype=torch.float32) for p in self.params]  # written before each use
        named = [(f"p{i}", b) for i, b in enumerate(self._buffers)]
        self.averager = Averager(
            self.dht.node, f"{run_id}/{mode}", named, codec=self.codec, aggregation=self.aggregation,
            target_group_size=target_group_size,
            bandwidth=bandwidth, matchmaking_timeout=matchmaking_timeout,
            allreduce_config=AllReduceConfig(timeout=averaging_timeout),
        )
        # epoch claims are believed on evidence only (a quorum; under mean also a plausible rate)
        self._strict = self.aggregation != "mean"  # a robust rule: what a minority claims steers nothing
        self._judge = EpochJudge(strict=self._strict, live_window=max(3.0, 4 * refresh_period))
        self.tracker = ProgressTracker(self.dht.node, run_id, self.averager.schema.hash,
                                       self.target_batch_size if mode == "sync" else local_steps * batch_size_per_step,
                                       refresh=refresh_period, judge=self._judge_claims, on_refused=self._refused)
        self._grad_acc: list[torch.Tensor] = []  # sync: allocated at the first step (a joiner's
        # download should not wait for zero-filling a model-sized buffer it does not need yet)
        self._outer: list[torch.Tensor] = []
        self.outer_optimizer: torch.optim.Optimizer | None = None
        if mode == "diloco":
            self._outer = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]
            self.outer_optimizer = torch.optim.SGD(self._outer, lr=outer_lr, momentum=outer_momentum,
                                                   nesterov=outer_momentum > 0)

        self.stats = OptimizerStats()
        self.epoch = 0
        self.local_samples = 0
        self._local_steps_done = 0
        self._sps = 0.0
        self._cycle_ema: tuple[float, float] | None = None  # (samples, seconds) of a step cycle, averaged
        self._last_step_start: float | None = None
        self._paused = 0.0  # seconds of this step spent waiting for averaging
        # one warning per _LOAD_WARN_EVERY and kind about state we cannot load (a load that keeps
        # failing, client-mode peers ahead), counting those held back
        self._load_warnings = LogThrottle(_LOAD_WARN_EVERY)
        self._pending: Future[StepResult | None] | None = None  # delayed update in flight
        self._pending_epoch = -1
        self._state_lock = threading.Lock()  # held while parameters change (snapshots wait on it)
        # Clear while a round's all-reduce (and then its update) is in flight: a joiner asking for
        # our state then gets the state right after it, at the start of the epoch the swarm is
        # about to train, instead of the state of an epoch whose round is already closing, which
        # left it a step behind, so it had to download everything again at its first step. Not
        # cleared during matchmaking: a round may be waiting for that very joiner, whose
        # construction waits for our snapshot (each would wait out the other's timeout).
        self._settled = threading.Event()
        self._settled.set()
        self._closed = False
        self._applied = 0  # global updates contained in our state (what a snapshot is labelled)
        self._version = 0  # bumped (under the state lock) by every change of the shared state
        self._untrained = 0  # the version of a state we did not train on: the initial one, or one loaded
        self._outer_momentum_in_state = outer_momentum_in_state
        self.average_state_every = average_state_every if average_state_every is not None else (
            5 if mode == "sync" else 10)
        self._state_averager: Averager | None = None
        self._state_shapes: list[Any] = []
        self._last_expected = 1
        self.load_state_timeout = load_state_timeout
        self.state_sync = StateSync(self.dht.node.host, f"{run_id}/{mode}/state", self._shared_state, self._state_lock,
                                    settled=self._settled, settle_timeout=matchmaking_timeout,
                                    version=lambda: self._version)
        self.scheduler = scheduler(self) if callable(scheduler) and not hasattr(scheduler, "step") else scheduler
        self._schedule = Schedule(self.inner, self.scheduler)  # a loaded state's lr: ours, replayed
        # the most a peer's state download may take: the shared tensors and 7 more copies of them
        # (optimizer moments and more) plus 16 MiB of counters; a larger manifest is refused unread
        self._state_cap = 8 * sum(t.numel() * max(4, t.element_size()) for t in self.params) + (16 << 20)
        self.checkpointer: Checkpointer | None = None
        try:
            if checkpoint_every is not None or checkpoint_dir is not None:
                from ..checkpoint.store import CheckpointStore

                self.checkpointer = Checkpointer(
                    self.dht.node, self._loop, run_id, CheckpointStore(checkpoint_dir), every=checkpoint_every,
                    server=self.state_sync.server, keep=checkpoint_keep, writers=checkpoint_writers,
                    meta={"mode": mode, "schema": self.averager.schema.hash}, on_saved=self._checkpoint_saved,
                    labels={"state_dict": self._state_names} if self._state_names else None,
                    trusted_writers=trusted_writers,
                )
            self._loop.run(self._start())
        except BaseException:
            self._closed = True
            self._loop.run(self._close(), timeout=15)
            if self._owns_dht:
                self.dht.close()
            raise
        view = self.tracker.view
        resumed = self.checkpointer is not None and self._resume_from_checkpoint(view)
        if view.epoch > self.epoch and not resumed:  # the swarm has trained already: start from where it is
            self._load_state_from_peers(view)
        # the swarm sees us from here on, at the epoch we start from (not at 0 while we resume)
        self.tracker.report(self.epoch, 0, self._sps)
        self._loop.run(self.tracker.publish())

    async def _start(self) -> None:
        await self.averager.start()
        await self.state_sync.start()
        if self.checkpointer is not None:
            await self.checkpointer.start()
        await self.tracker.start(publish=False)

    def wait_for_peers(self, n: int, timeout: float = 60.0) -> int:
        """Block until ``n`` compatible peers (us included) are in the swarm or ``timeout`` passes;
        returns how many there are. For launchers and tests that start a swarm together, so that
        the first peer does not train alone while the others are still starting. A peer counts
        once it holds its starting state (a checkpoint it resumed, or the swarm's)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            view = self._loop.run(self.tracker.wait_fresh(min(max(remaining, 0.0), 0.5)))
            count = view.num_peers + len(view.behind)
            if count >= n or remaining <= 0:
                return count

    # ------------------------------------------------------------------ torch.optim.Optimizer face

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError("DecentralizedOptimizer cannot add parameter groups after it was created: "
                           "every peer must average the same tensors")

    @property
    def mismatches(self) -> dict[str, str]:
        """Peers of this run training another model: base58 peer id -> what is different."""
        out = {str(k): v for k, v in self.tracker.mismatched.items()}
        out.update(self.averager.matchmaker.mismatches())
        return out

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"inner": self.inner.state_dict(), "epoch": self.epoch, "mode": self.mode}
        if self.outer_optimizer is not None:
            sd["outer"] = self.outer_optimizer.state_dict()
            sd["outer_params"] = [t.clone() for t in self._outer]
        if self.scheduler is not None:
            sd["scheduler"] = self.scheduler.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("mode", self.mode) != self.mode:
            raise ValueError(f"this state was saved in {state_dict.get('mode')!r} mode, not {self.mode!r}")
        with self._state_lock:
            self.inner.load_state_dict(state_dict["inner"])
            self.epoch = int(state_dict.get("epoch", 0))
            if self.outer_optimizer is not None and "outer" in state_dict:
                for dst, src in zip(self._outer, state_dict["outer_params"], strict=True):
                    dst.copy_(src)
                self.outer_optimizer.load_state_dict(state_dict["outer"])
            if self.scheduler is not None and "scheduler" in state_dict:
                self.scheduler.load_state_dict(state_dict["scheduler"])
            self._version += 1
        self.tracker.report(self.epoch, self.local_samples, self._sps)

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, batch_size: int | None = None) -> Any:  # type: ignore[override]
        """Account for one local batch (``batch_size`` samples, default ``batch_size_per_step``)
        whose gradients are in ``.grad``; take a global step when the swarm is ready for one."""
        if self._closed:
            raise RuntimeError("this DecentralizedOptimizer is closed")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        bs = self.batch_size_per_step if batch_size is None else int(batch_size)
        if bs < 1:
            raise ValueError("batch_size must be positive")
        self._measure_throughput(bs)
        if self.mode == "sync":
            self._sync_step(bs)
        else:
            self._diloco_step(bs)
        return loss

    def _measure_throughput(self, bs: int) -> None:
        """Samples/s of the whole training loop (forward, backward, data, our own step) minus our
        averaging pauses: what the swarm needs to predict when an epoch's batch is complete.

        Measured over full step-to-step cycles; timing only the user's part of the loop would
        overestimate it badly on a loaded machine and make the swarm close epochs early. Samples
        and seconds are averaged apart and divided: an average of per-cycle rates is dominated by
        the shortest cycles (with fast steps and a busy CPU, several times the real rate).
        """
        now = time.perf_counter()
        if self._last_step_start is not None:
            cycle = max(now - self._last_step_start - self._paused, 1e-6)
            n, t = (bs, cycle) if self._cycle_ema is None else self._cycle_ema
            self._cycle_ema = n, t = 0.9 * n + 0.1 * bs, 0.9 * t + 0.1 * cycle
            self._sps = n / t
        self._last_step_start = now
        self._paused = 0.0
        self.stats.local_sps = self._sps
        self.stats.samples_total += bs

    # ---- sync

    def _sync_step(self, bs: int) -> None:
        self._apply_pending(wait=False)
        if not self._grad_acc:
            self._grad_acc = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        # One call for all tensors, not one per tensor: each torch call gives up the GIL and
        # waits up to 5 ms to get it back while the event loop runs Python (a delayed round).
        pairs = [(acc, p.grad) for acc, p in zip(self._grad_acc, self.params) if p.grad is not None]
        if pairs:
            torch._foreach_add_([a for a, _ in pairs], [g for _, g in pairs], alpha=bs)
        self.local_samples += bs
        view = self.tracker.report(self.epoch, self.local_samples, self._sps)
        self._observe(view)
        if view.epoch > self.epoch + 1 or (view.epoch == self.epoch + 1 and self._round_over(view)):
            self._fall_behind(view)
        elif view.epoch == self.epoch + 1 or view.reached or view.ready:
            # the published counts reach the target, or a peer is waiting for us, or peers already
            # moved on from our epoch (they may still be in its round): end the epoch and try to
            # join the round; if it has closed, _apply_pending loads the swarm's state instead of
            # stepping alone
            self._end_sync_epoch(view)
        elif view.due:
            # The extrapolated estimate says the target is reached: confirm with the counts the
            # peers published (read now). Ending on the estimate ended fast epochs with a third to
            # a half of the target's samples when a peer's throughput was overestimated.
            self.tracker.hurry()

    def _end_sync_epoch(self, view: SwarmView) -> None:
        if self._pending is not None:
            self._apply_pending(wait=True)  # at most one round in flight
        samples = self.local_samples
        torch._foreach_copy_(self._buffers, self._grad_acc)
        torch._foreach_div_(self._buffers, float(samples))
        torch._foreach_zero_(self._grad_acc)
        if self._corrupt is not None:
            self._corrupt(self._buffers)
        epoch = self.epoch
        self.tracker.report(epoch, samples, self._sps, ready=True)
        future = self._average(epoch, samples, view)
        self.epoch += 1
        self.local_samples = 0
        self._pending, self._pending_epoch = future, epoch
        if not self.delay_updates:
            self._apply_pending(wait=True)
        self.tracker.report(self.epoch, 0, self._sps)

    def _average(self, epoch: int, samples: int, view: SwarmView) -> Future[StepResult | None]:
        """Start averaging ``self._buffers`` for ``epoch`` (weighted by ``samples``) on the loop.

        Alone (no other peer has reported recently) there is nobody to meet: the round is skipped
        rather than waiting out the matchmaking deadline on every epoch.
        """
        expected = self._expected(view, epoch)
        if expected <= 1 and len(view.peers) + len(view.behind) > 1:
            # Others train, but none looks due for this round. The view is up to a refresh period
            # old: a peer that finished the previous epoch's round with us since then still
            # reports the one before, looks like a peer catching up, and going alone here would
            # leave it waiting out matchmaking in a round nobody comes to (seen with epochs of a
            # few ms: the rest of the run on two diverging paths). Look again before skipping
            # (bounded: a DHT that does not answer leaves us with the view we had).
            t0 = time.perf_counter()
            view = self._loop.run(self.tracker.refresh_now(timeout=_FRESH_LOOK))
            self._paused += time.perf_counter() - t0
            expected = self._expected(view, epoch)
        self._last_expected = expected
        if expected <= 1:
            done: Future[StepResult | None] = Future()
            done.set_result(None)
            return done
        # (delayed updates overlap training with the round: snapshots do not wait for it)
        on_group = None if self.delay_updates and self.mode == "sync" else self._settled.clear
        return self._loop.submit(self.averager.step(weight=samples, round_id=f"e{epoch}",
                                                    timeout=self.matchmaking_timeout, expected=expected,
                                                    on_group=on_group))

    def _expected(self, view: SwarmView, epoch: int) -> int:
        """How many peers (us included) will come to ``epoch``'s round, from a ``view`` taken
        before we reported the epoch's end.

        Peers still reporting the previous epoch are finishing its round and will come; peers
        further behind are catching up (they load the state) and will not. With delayed updates
        a peer reports the next epoch as soon as its round started: when the view is already at
        ``epoch + 1``, those peers may be in our round still, and we are among ``behind``
        (without delayed updates they applied it already: only the peers at ``epoch`` come).
        Counting only the peers at ``epoch + 1`` there made a peer that ended its epoch last
        think it was alone and skip the round, on a path of its own until the next state round."""
        if view.epoch == epoch + 1:  # (without delayed updates, peers at epoch + 1 are done with it)
            return sum(1 for p in view.behind if p.epoch == epoch) + (view.num_peers if self.delay_updates else 0)
        return view.num_peers + sum(1 for p in view.behind if p.epoch == epoch - 1)

    def _apply_pending(self, wait: bool) -> None:
        """Take the inner step with the averaged gradients of the round in flight, once it is done."""
        future = self._pending
        if future is None or (not wait and not future.done()):
            return
        self._pending = None
        try:
            self._apply_round(future)
        finally:
            self._settled.set()

    def _apply_round(self, future: Future[StepResult | None]) -> None:
        result = self._round_result(future)
        if self._last_expected > 1 and (result is None or result.group_size == 1):
            if result is None or self._others_hold_our_epoch():
                # Others were there but we met nobody (we came late, or the round failed): stepping
                # with our own gradients would leave us on a path of our own for good. Take theirs.
                self._record(result)
                self._load_state_from_peers(self.tracker.estimate(), missed=True)
                return
            # they left (or are behind, and will load ours): we are the swarm; no state round either
            self._last_expected = 1
        grads = [p.grad for p in self.params]
        with self._state_lock:
            for p, buf in zip(self.params, self._buffers):
                p.grad = buf.to(device=p.device, dtype=p.dtype, non_blocking=False).view_as(p)
            self.inner.step()
            if self.scheduler is not None:
                self.scheduler.step()
            self._applied = self._pending_epoch + 1
            self._version += 1
        for p, g in zip(self.params, grads):  # the user's current gradients stay as they were
            p.grad = g
        if not self._state_round_due(self._pending_epoch):
            self._settled.set()  # the update is in (else once the state round is: _maybe_average_state)
        self.state_sync.warm()
        self._record(result)
        self._maybe_average_state(self._pending_epoch)
        self._maybe_checkpoint()

    def _others_hold_our_epoch(self) -> bool:
        """Whether a fresh look shows another peer at our state's epoch or past it: one that may
        have taken the step we missed (or missed it with us). The view that expected them is up
        to a refresh old: a peer that finished and left since then is gone from a fresh one."""
        t0 = time.perf_counter()
        view = self._loop.run(self.tracker.refresh_now(timeout=_FRESH_LOOK))
        self._paused += time.perf_counter() - t0
        self._observe(view)
        me = self.tracker.me.peer
        return any(p.peer != me and p.epoch >= self._applied for p in (*view.peers, *view.behind))

    # ---- periodic state averaging

    def _state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """What peers must agree on beyond one step: the parameters (the outer ones in diloco) and
        the floating-point optimizer state of the same shape (momenta, Adam moments)."""
        if self.mode == "sync":
            params, opt = self.params, self.inner
        else:
            assert self.outer_optimizer is not None
            params, opt = self._outer, self.outer_optimizer
        named = [(f"p{i}", p.data) for i, p in enumerate(params)]
        if self.mode == "diloco" and not self._outer_momentum_in_state:
            # DiLoCo's point is to send little: the outer parameters are what drift; the
            # momentum buffers follow them (and would double the bytes of these rounds)
            return named
        for i, p in enumerate(params):
            for k, v in sorted(opt.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.shape == p.shape:
                    named.append((f"s{i}.{k}", v))
        return named

    def _maybe_average_state(self, epoch: int) -> bool:
        """Every ``average_state_every`` epochs, average the state itself, equally weighted.

        Gradient rounds keep a group's members bit-identical, but once the swarm splits into
        several groups (a late matchmaker, churn, more peers than ``target_group_size``) the groups
        drift apart for good; averaging the state brings them back together.
        """
        if not self._state_round_due(epoch):
            return False
        named = self._state_tensors()
        shapes = [(n, t.shape, t.dtype) for n, t in named]
        if self._state_averager is None or self._state_shapes != shapes:
            if self._state_averager is not None:
                self._loop.run(self._state_averager.close())
            self._state_averager = Averager(
                self.dht.node, f"{self.run_id}/{self.mode}/state", named, codec="none",
                aggregation=self.aggregation,
                target_group_size=self.averager.matchmaker.target_group_size,
                matchmaking_timeout=self.matchmaking_timeout, service=self.averager.service,
            )
            self._state_shapes = shapes
        # Only this (training) thread changes the state, and it waits here for the round: the
        # state lock is needed for writing the average back, not across matchmaking and the
        # network (a snapshot for a joiner would wait for all of it).
        future = self._loop.submit(self._state_averager.step(weight=1.0, round_id=f"s{epoch}",
                                                             timeout=self.matchmaking_timeout,
                                                             expected=self._last_expected, scatter=False,
                                                             on_group=self._settled.clear))
        try:
            result = self._round_result(future)
            if result is not None and result.group_size > 1:
                with self._state_lock:
                    self._state_averager.scatter()
                    self._version += 1
        finally:
            self._settled.set()
        if result is not None:
            self.stats.state_rounds += 1
            self.stats.bytes_sent += result.bytes_sent
            self.stats.bytes_received += result.bytes_received
        return result is not None and result.group_size > 1

    def _state_round_due(self, epoch: int) -> bool:
        """Whether the state is averaged after ``epoch``'s update. Until that round is over,
        ``_settled`` stays clear from the update on: a snapshot taken between the two would give a
        joiner the state from before it, a rounding error apart from the swarm's after it (the
        average of equal values need not be exactly that value), for ``average_state_every``
        epochs."""
        k = self.average_state_every
        return bool(k) and (epoch + 1) % k == 0 and self._last_expected > 1

    def _round_result(self, future: Future[StepResult | None]) -> StepResult | None:
        t0 = time.perf_counter()
        try:
            return future.result()
        except Exception as e:  # noqa: BLE001 - a failed round must not kill training
            log.warning("averaging round failed (%s: %s); stepping with the local gradients", type(e).__name__, e)
            self.stats.failed_rounds += 1
            return None
        finally:
            self._paused += time.perf_counter() - t0

    def _round_over(self, view: SwarmView) -> bool:
        """Whether our epoch's round is over for everyone, so there is no group left to join.

        Without delayed updates a peer reports the next epoch only once it applied the round;
        when no other peer still reports ours, waiting in matchmaking (a joiner whose download
        the swarm outran) would only end in a state load after the deadline: load now. With
        delayed updates peers report the next epoch while their round may still be matching."""
        if self.delay_updates:
            return False
        me = self.tracker.me.peer
        return not any(p.epoch == self.epoch and p.peer != me for p in view.behind)

    def _fall_behind(self, view: SwarmView) -> None:
        """The swarm moved past our epoch without us (we missed its rounds): load its state.

        Unless every peer ahead of us is in client mode: they serve no state, so a load cannot
        succeed, and trying again at every step (each one resets the epoch's samples) would stop
        our training for as long as they stay ahead. Leave them out of the view for a while
        instead, and train on from our own epoch."""
        me = self.tracker.me.peer
        ahead = [p for p in (*view.peers, *view.behind) if p.peer != me and p.epoch > self.epoch]
        if ahead and all(p.addr is None for p in ahead):
            self.tracker.ignore([p.peer for p in ahead])
            quiet = self._load_warnings.allow("client ahead", time.monotonic())
            if quiet is not None:
                log.warning("%d peer(s) at epoch %d are ahead of us, but in client mode they serve no state to "
                            "catch up from; training on from our own epoch %d%s", len(ahead),
                            max(p.epoch for p in ahead), self.epoch,
                            f" ({quiet} more times since the last warning)" if quiet else "")
            return
        log.info("the swarm is at epoch %d, we are at %d: loading its state", view.epoch, self.epoch)
        self._load_state_from_peers(view)

    # ---- shared state (late join, missed rounds)

    def _shared_state(self) -> tuple[int, dict[str, Any]]:
        """What every member of a group holds identically after a round (called with the lock),
        labelled with the number of global updates it contains: ``self.epoch`` runs ahead of the
        state while a round is in flight (or, with delayed updates, until it is applied)."""
        state: dict[str, Any] = {}
        if self.mode == "sync":
            state["params"] = [p.detach() for p in self.params]
            state["inner"] = self.inner.state_dict()
        else:
            assert self.outer_optimizer is not None
            state["outer"] = list(self._outer)
            state["outer_opt"] = self.outer_optimizer.state_dict()
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return self._applied, state

    def _load_state_from_peers(self, view: SwarmView, missed: bool = False) -> bool:
        """Download the state of the most advanced peers and continue from it; on failure, keep
        ours (and the swarm's epoch number) and say so: training goes on either way.

        When we have not trained on our state (a new peer's first load, or a second one before
        its first update), the download writes the parameters in place as it goes: no
        state-sized buffer to fault in, which was most of a late join's time. If it fails they
        are part ours, part the swarm's (verified) ones; we are still behind the swarm then, and
        load again before our first update. A peer that trained keeps its own until a download
        is complete.

        ``missed``: we ended our epoch but missed its round: only a state with that update in it
        will do (a provider still in the round serves the one before: taking it and our epoch
        number would leave us an update short of the swarm for good). Without one we go back to
        the epoch our state holds and catch up from there, unless nobody has it: then the whole
        round failed, and every peer skips that update alike."""
        t0 = time.perf_counter()
        if self._pending is not None:  # a round still in flight would land on top of the new state
            self._round_result(self._pending)
            self._pending = None
        loaded = False
        epoch = self.epoch
        result = None
        at_least = self._applied + int(missed)
        try:
            into = self._placeable() if self._version == self._untrained else {}
            if into:
                with self._state_lock:  # no snapshot of ours sees them half-written
                    try:
                        result = self._fetch_state(view, at_least, into=into)
                    finally:  # they changed, whether or not the download completed
                        self._version += 1
                        self._untrained = self._version
            else:
                result = self._fetch_state(view, at_least)
            epoch = result.manifest.meta["epoch"]
            self.stats.last_state_providers = len(result.contributors)
            self.stats.last_state_in_place = result.placement.placed_bytes if result.placement is not None else 0
            applied = epoch
            self._apply_shared_state(result.restore(), applied)
            self._untrained = self._version
            loaded = True
            self.state_sync.warm()  # we serve this state from now on
            if self.delay_updates:
                # with delayed updates the providers' state trails their epoch by the round in
                # flight: join at their epoch (that update reaches us with the next state round)
                epoch = max(epoch, view.epoch)
        except (StateTransferError, ValueError, KeyError, TypeError, RuntimeError) as e:
            missed = missed and not isinstance(e, NoProviders)  # (nobody holds the update we missed)
            if result is not None:  # fetched, but it does not fit us: not a state to follow either
                self.tracker.ignore(list(result.contributors))
            quiet = self._load_warnings.allow("state load", time.monotonic())
            if quiet is not None:
                more = f" ({quiet} more failed since the last warning)" if quiet else ""
                log.warning("could not load the swarm's state (%s); continuing from our own at epoch %d%s",
                            e, self.epoch, more)
            else:
                log.debug("could not load the swarm's state (%s); continuing from our own at epoch %d", e, self.epoch)
        for acc in self._grad_acc:
            acc.zero_()
        self.epoch = max(epoch, self.epoch)
        if missed and not loaded and not self.delay_updates:
            self.epoch = self._applied  # never an epoch beyond the updates our state holds
        self.local_samples = 0
        self._local_steps_done = 0
        self.stats.state_loads += int(loaded)
        self.stats.last_state_load_s = time.perf_counter() - t0
        self.tracker.report(self.epoch, 0, self._sps)
        if loaded:  # the view that sent us here is as old as the download: look again
            self._loop.run(self.tracker.refresh_now())
        self._paused += time.perf_counter() - t0
        return loaded

    def _placeable(self) -> dict[str, list[torch.Tensor]]:
        """Our tensors a download can write in place (CPU ones: see ``StateSync.fetch``)."""
        ours = [p.detach() for p in self.params] if self.mode == "sync" else list(self._outer)
        if not all(t.device.type == "cpu" and t.is_contiguous() for t in ours):
            return {}
        return {"params" if self.mode == "sync" else "outer": ours}

    async def _newest(self) -> int:
        """(on the loop) The newest epoch a fresh read of the swarm's progress shows, as believed
        (see ``claims``), plus the one a provider may have reached since it published."""
        return (await self.tracker.refresh_now(timeout=_FRESH_LOOK)).epoch + 1

    def _fetch_state(self, view: SwarmView, at_least: int | None = None, attempts: int = 3,
                     into: dict[str, list[torch.Tensor]] | None = None) -> Any:
        """Download the state from the most advanced peers of ``view``; if none of them can give
        it (under churn they may have died since they last reported), leave them out of the view
        and try the next most advanced ones, from a fresh read of the swarm's progress.

        Peers whose state we cannot get do not get to set our epoch either: a peer that trained
        alone and left (its record lingers) must not drag the swarm along. Peers that report
        fewer updates than ``at_least`` (default: our state's) are no providers: theirs would take
        us back; while peers one epoch short of it (still in its round) may get there, we wait for
        them, at most a matchmaking timeout."""
        at_least = self._applied if at_least is None else at_least
        deadline = time.monotonic() + self.load_state_timeout
        patience = time.monotonic() + self.matchmaking_timeout
        strict = self._strict
        attempt = 0
        while True:
            me = self.tracker.me.peer
            others = [p for p in (*view.peers, *view.behind) if p.peer != me]
            providers = self.state_sync.choose([p for p in others if p.epoch >= at_least], quorum=strict)
            if not providers and time.monotonic() < min(patience, deadline) and any(
                    p.epoch == at_least - 1 and p.addr is not None for p in others):
                view = self._loop.run(self.tracker.wait_fresh(0.5))
                continue
            if not providers:
                raise NoProviders(f"no peer at or past our epoch {at_least} serves it")
            try:
                return self._loop.run(self.state_sync.fetch(providers, max(1.0, deadline - time.monotonic()),
                                                            into=into, at_least=at_least, strict=strict,
                                                            max_total=self._state_cap, newest=self._newest))
            except StateTransferError as e:
                self.tracker.ignore([p.peer for p in providers])
                attempt += 1
                if attempt == attempts or time.monotonic() >= deadline:
                    raise
                log.info("could not load the state from %d peer(s) (%s); asking others", len(providers), e)
                view = self._loop.run(self.tracker.refresh_now())

    @torch.no_grad()
    def _apply_shared_state(self, state: dict[str, Any], epoch: int) -> None:
        # the optimizer state checked against ours before anything changes (ValueError if it does not fit)
        opt = optimizer_state(state["inner"], self.inner) if self.mode == "sync" else \
            optimizer_state(state["outer_opt"], self.outer_optimizer)
        # a copy per tensor, each giving up the GIL: short waits (see p2ptrain.gil)
        with short_gil_waits(), self._state_lock:
            self._applied = epoch
            self._version += 1
            if self.mode == "sync":
                params = state["params"]
                if len(params) != len(self.params):
                    raise ValueError(f"the peers' state has {len(params)} parameters, ours {len(self.params)}")
                for p, src in zip(self.params, params):
                    if p.shape != src.shape:
                        raise ValueError(f"the peers' parameter of shape {list(src.shape)} does not fit ours "
                                         f"{list(p.shape)}")
                for p, src in zip(self.params, params):
                    if p.data_ptr() != src.data_ptr():  # (a download written in place is there already)
                        p.copy_(src)
                self.inner.load_state_dict(opt)
            else:
                assert self.outer_optimizer is not None
                for dst, src in zip(self._outer, state["outer"], strict=True):
                    if dst.data_ptr() != src.data_ptr():
                        dst.copy_(src)
                self.outer_optimizer.load_state_dict(opt)
                for p, outer in zip(self.params, self._outer):
                    p.copy_(outer)
            self._schedule.advance_to(epoch)  # (the state's scheduler settings are not ours to take)
            self._load_model_extra(state.get("buffers"))

    def _load_model_extra(self, saved: Any) -> None:
        """The model's buffers from a checkpoint that holds them (live states do not: each peer
        keeps its own); one of another model is left out, with a warning."""
        ours = self._model_extra() if saved is not None else []
        if not ours:
            return
        if not isinstance(saved, list) or [tuple(t.shape) for t in saved if isinstance(t, torch.Tensor)] != [
                tuple(t.shape) for t in ours]:
            log.warning("the checkpoint's model buffers do not fit this model's; keeping ours")
            return
        for dst, src in zip(ours, saved):
            dst.detach().copy_(src)

    def _model_extra(self) -> list[torch.Tensor]:
        """The model's state_dict tensors the optimizer does not train, as they are now."""
        if self._model is None or not self._extra_keys:
            return []
        tensors = self._model.state_dict(keep_vars=True)
        return [tensors[k] for k in self._extra_keys]

    # ---- checkpoints

    def _maybe_checkpoint(self) -> None:
        """After an update landed (and any state averaging of that epoch): save the state when a
        checkpoint of this epoch is due and this peer is one of its writers among the live peers."""
        ck = self.checkpointer
        if ck is None or not ck.due(self._applied):
            return
        view = self.tracker.estimate()
        live = [p.peer for p in (*view.peers, *view.behind) if not p.client]
        # forward passes change buffers outside the state lock: copy them here, in the training thread
        extra = [t.detach().to("cpu", copy=True) for t in self._model_extra()]
        ck.maybe_save(self._applied, live, lambda: self._checkpoint_state(extra), self._state_lock)

    def _checkpoint_state(self, buffers: list[torch.Tensor]) -> tuple[int, dict[str, Any]]:
        """The shared state, plus the model's buffers when we know the model (called with the lock)."""
        applied, state = self._shared_state()
        return applied, {**state, "buffers": buffers} if buffers else state

    def _checkpoint_saved(self, info: Any) -> None:  # in the save thread
        self.stats.checkpoints_saved += 1
        self.stats.last_checkpoint_epoch = info.epoch

    def _resume_from_checkpoint(self, view: SwarmView) -> bool:
        """Start from the newest checkpoint (DHT or disk) unless live peers are ahead of it (their
        state is newer: the caller loads that instead). Failures are logged; training goes on."""
        ck = self.checkpointer
        assert ck is not None
        t0 = time.perf_counter()
        try:
            info = ck.find(self.load_state_timeout, at_least=view.epoch)
            if info is None or info.epoch <= 0 or info.epoch < view.epoch:
                return False
            self._apply_shared_state(ck.load(info), info.epoch)
        except Exception as e:  # noqa: BLE001 - a bad checkpoint (corrupt, other model) must not stop the start
            log.warning("could not resume from a checkpoint (%s: %s); starting without it", type(e).__name__, e)
            return False
        ck.endorse(info)
        self.epoch = info.epoch
        self.stats.resumed_epoch = info.epoch
        self.stats.last_state_load_s = time.perf_counter() - t0
        self.tracker.report(self.epoch, 0, self._sps)
        self._loop.run(self.tracker.refresh_now())
        log.info("resumed from checkpoint %s at epoch %d (%.2f s)", info.cid, info.epoch, self.stats.last_state_load_s)
        return True

    # ---- diloco

    def _diloco_step(self, bs: int) -> None:
        self._inner_steps += 1
        with self._state_lock:
            warmed_step(self.inner, self._inner_steps, self.inner_warmup_steps)
        self._local_steps_done += 1
        self.local_samples += bs
        view = self.tracker.estimate()
        self._observe(view)
        if view.epoch > self.epoch:
            self._fall_behind(view)
            return
        # The round's end as a sample target, so that the tracker refreshes faster as it nears
        # and the peers notice each other's readiness in time (it decides nothing else here).
        self.tracker.target = self.local_steps * bs * max(1, view.num_peers)
        others_ready = any(p.ready and p.peer != self.tracker.me.peer for p in view.peers)
        if self._local_steps_done >= self.local_steps or others_ready:
            self._outer_step(view)
        else:
            self.tracker.report(self.epoch, self.local_samples, self._sps)

    def _outer_step(self, view: SwarmView) -> None:
        assert self.outer_optimizer is not None
        samples = self.local_samples
        for buf, outer, p in zip(self._buffers, self._outer, self.params):
            torch.sub(outer, p.detach().to("cpu", torch.float32), out=buf)
        if self._corrupt is not None:
            self._corrupt(self._buffers)
        epoch = self.epoch
        try:
            self._outer_round(epoch, samples, view)
        finally:
            self._settled.set()  # (cleared by _average's round once it grouped)

    def _outer_round(self, epoch: int, samples: int, view: SwarmView) -> None:
        assert self.outer_optimizer is not None
        self.tracker.report(epoch, samples, self._sps, ready=True)
        result = self._round_result(self._average(epoch, samples, view))
        with self._state_lock:
            for outer, buf in zip(self._outer, self._buffers):
                outer.grad = buf
            self.outer_optimizer.step()
            for p, outer in zip(self.params, self._outer):
                p.copy_(outer)
            if self.scheduler is not None:
                self.scheduler.step()
            self._applied = epoch + 1
            self._version += 1
        if not self._state_round_due(epoch):
            self._settled.set()  # the update is in (else once the state round is: _maybe_average_state)
        self.state_sync.warm()
        self.epoch += 1
        self.local_samples = 0
        self._local_steps_done = 0
        self._record(result)
        if self._maybe_average_state(epoch):
            with self._state_lock:
                for p, outer in zip(self.params, self._outer):
                    p.copy_(outer)
        self._maybe_checkpoint()
        self.tracker.report(self.epoch, 0, self._sps)

    # ---- bookkeeping

    def _judge_claims(self, reports: list[PeerReport], me: PeerReport) -> dict[PeerID, str]:
        """(on the loop) The peers whose epoch we do not believe; see ``claims``. We have a say
        once we hold an epoch of our own: a fresh joiner at 0 has nothing to weigh."""
        return self._judge.judge(reports, me, counts_me=me.epoch > 0, now=time.time(), my_sps=self._sps,
                                 samples_per_epoch=self.tracker.target)

    def _refused(self, refused: dict[PeerID, str]) -> None:
        """(on the loop) Name the peers whose epoch claim we refused: once in the log, in ``stats.excluded``."""
        for peer, why in refused.items():
            if self._exclude(str(peer), f"epoch claim refused: it {why}"):
                log.warning("not believing peer %s: it %s; it is left out until it says otherwise", peer.short(), why)

    def _exclude(self, peer: str, why: str) -> bool:
        """Record why ``peer`` was left out in ``stats.excluded`` (at most 64 peers kept); whether
        it was not there yet."""
        new = peer not in self.stats.excluded
        if not new or len(self.stats.excluded) < 64:
            self.stats.excluded[peer] = why
        return new and peer in self.stats.excluded

    def _observe(self, view: SwarmView) -> None:
        training = view.training  # (not only those at our epoch: right after a round, others still report the last)
        self.stats.peers = len(training)
        self.stats.swarm_sps = sum(p.sps for p in training)
        self.stats.epoch = self.epoch
        self.stats.local_samples = self.local_samples

    def _record(self, result: StepResult | None) -> None:
        self.stats.epoch = self.epoch
        self.stats.local_samples = self.local_samples
        if result is None:
            return
        self.stats.rounds += 1
        self.stats.last_group_size = result.group_size
        self.stats.last_round_s = result.total_s
        self.stats.last_round_samples = int(result.weight_total)
        self.stats.bytes_sent += result.bytes_sent
        self.stats.bytes_received += result.bytes_received
        if result.group_size == 1 and self.stats.peers > 1 or result.not_averaged:
            self.stats.failed_rounds += 1
        for rank, why in result.failed.items():
            peer = str(result.members[rank]) if rank < len(result.members) else f"rank {rank}"
            self._exclude(peer, why)
            log.warning("epoch %d: peer %s excluded from the round: %s", self.epoch, peer, why)
        log.debug("epoch %d: averaged with %d peers in %.3f s (matchmaking %.3f s, %d peers seen)", self.epoch,
                  result.group_size, result.total_s, result.matchmaking_s, self.stats.peers)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Finish (or abandon) the round in flight, leave the swarm; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._pending is not None:
            try:
                self._pending.result(timeout=self.matchmaking_timeout + 5)
            except Exception:  # noqa: BLE001 - closing: the round's outcome no longer matters
                self._pending.cancel()
            self._pending = None
        if self.checkpointer is not None:
            self.checkpointer.wait(timeout=60)
        try:
            self._loop.run(self._close(), timeout=15)
        finally:
            if self._owns_dht:
                self.dht.close()

    async def _close(self) -> None:
        if self._state_averager is not None:
            await self._state_averager.close()
        if self.checkpointer is not None:
            await self.checkpointer.close()
        await self.tracker.close()
        await self.state_sync.close()
        await self.averager.close()

    def __enter__(self) -> DecentralizedOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"DecentralizedOptimizer(mode={self.mode!r}, run_id={self.run_id!r}, epoch={self.epoch}, "
                f"inner={type(self.inner).__name__})")
