"""DecentralizedOptimizer: a torch optimizer whose steps are taken by a whole swarm of peers.

It wraps any torch optimizer (the *inner* one) and is used exactly like it::

    opt = DecentralizedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), dht=dht,
                                 run_id="digits-mlp", target_batch_size=4096, batch_size_per_step=32)
    for x, y in batches:
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()

Two modes: ``sync``, collaborative large-batch training, like one big machine
(:mod:`~p2ptrain.optim.sync_step`), and ``diloco``, H local steps between averaging rounds of
compressed pseudo-gradients (:mod:`~p2ptrain.optim.diloco_step`).

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
from pathlib import Path
from typing import Any

import torch

from dht import LogThrottle, Multiaddr, PeerID

from ..averaging import AllReduceConfig, Averager, GridMixer, StepResult
from ..background import DHT
from ..checkpoint.autosave import Checkpointer
from ..checkpoint.live import StateLock
from ..contrib import ContributionBook, check_name
from ..deadlines import STATE_LOAD, resolve
from .adopt import Schedule
from .catch_up import catch_up_at_start, fall_behind, fetch_state, load_state_from_peers
from .claims import EpochJudge
from .diloco_step import diloco_step, finish_overlapped, outer_step
from .fsdp import FsdpShard, is_sharded, rank_dht
from .memory import flat_views
from .options import TrainerOptions
from .progress import PeerReport, ProgressTracker, SwarmView
from .ranks import PeerRanks, RankFailure, lead
from .rounds import Cell, Early, apply_mix, average, drop_early, expected_peers, maybe_average_state, reports_ahead
from .shared_state import (apply_shared_state, checkpoint_state, load_torch_state_dict, make_checkpointer, model_extra,
                           shared_state, torch_state_dict)
from .state_sync import StateSync
from .stats import CycleRate, OptimizerStats
from .sync_step import end_sync_epoch, round_over, sync_step

log = logging.getLogger("p2ptrain.optim")
#: seconds between two warnings about failed state loads (the ones between go to DEBUG, counted)
_LOAD_WARN_EVERY = 30.0


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

    ``overlap_outer`` (``diloco`` only): the outer round runs in the background while the next
    ``local_steps`` inner steps proceed (no pause for it): a peer trains on from where its own
    pseudo-gradient would take the outer parameters, and half-merges into them once the round
    lands (see :mod:`~p2ptrain.optim.diloco_step`). It costs
    one more fp32 model-sized buffer (outer parameters, momentum and the averaging buffer: 3x the
    model, against 2x for blocking rounds). All peers of a run must agree on it (it is in the
    schema). Call :meth:`finish_round` before evaluating or saving the final model.

    ``inner_warmup_steps`` (``diloco`` only): scale the inner learning rate linearly from
    1/N to 1 over this peer's first N local steps. Early DiLoCo rounds start from random weights,
    where H unsynchronised steps at full lr can leave the average stuck on a loss plateau; a short
    warmup avoids it. Peers of one run need not agree on it
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

    ``mixing`` (default on): once the swarm has more than ``target_group_size`` peers, each round
    meets in a cell of a grid that changes every round and also averages the cell's parameters,
    so groups mix into one model without state rounds (:mod:`~p2ptrain.averaging.mixing`).

    ``averaging_timeout``, ``load_state_timeout``: seconds for one all-reduce round and for loading
    the swarm's state (or its checkpoint, on resume); by default derived from the bytes moved and
    this peer's own measured bandwidth and latency (:mod:`p2ptrain.deadlines`), 60 s until measured.

    ``model``: the module whose parameters ``optimizer`` trains (optional). Checkpoints then
    record its ``state_dict`` names, so ``p2ptrain ckpt export`` writes a file that
    ``model.load_state_dict`` takes, and hold its other state_dict tensors (buffers such as
    BatchNorm running stats, frozen parameters) as the saving peer has them, restored on resume.

    ``receipts``: after each gradient round sign a receipt of what the group credited each member
    with and publish it in the DHT (``p2ptrain status --leaderboard``; :mod:`p2ptrain.contrib`),
    with ``name`` announced beside our PeerID; ``receipts_file``: also append them there.

    ``process_group``: in a torchrun job, the ranks that form this one peer (default: the
    initialised default group, if any). Rank 0 is the peer's leader, which alone runs the DHT
    node and averages with the swarm; on the other ranks this constructor makes a
    :class:`~p2ptrain.optim.follower.RankFollower` (see :mod:`~p2ptrain.optim.ranks`). With an
    FSDP2 model (``fully_shard``) every rank averages its own shard instead (:mod:`~p2ptrain.optim.fsdp`).
    """

    #: this rank's shard of an FSDP model (None: the optimizer trains whole tensors)
    fsdp: FsdpShard | None = None

    def __new__(cls, *args: Any, process_group: Any = None, **kwargs: Any) -> DecentralizedOptimizer:
        if cls is DecentralizedOptimizer:
            ranks = PeerRanks.detect(process_group)
            inner = args[0] if args else kwargs.get("optimizer")
            if ranks is not None and not ranks.is_leader and not is_sharded(inner):
                from .follower import RankFollower

                cls = RankFollower
        return super().__new__(cls)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        run_id: str,
        dht: DHT | None = None,
        initial_peers: Sequence[str | Multiaddr] | None = None,
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
        mixing: bool = True,
        delay_updates: bool = False,
        overlap_outer: bool = False,
        scheduler: Any = None,
        matchmaking_timeout: float = 5.0,
        averaging_timeout: float | None = None,
        refresh_period: float = 0.5,
        bandwidth: float = 1.0,
        load_state_timeout: float | None = None,
        average_state_every: int | None = None,
        outer_momentum_in_state: bool = False,
        checkpoint_every: int | None = None,
        checkpoint_dir: str | Path | None = None,
        checkpoint_keep: int = 3,
        checkpoint_writers: int = 3,
        trusted_writers: Sequence[PeerID | str] = (),
        model: torch.nn.Module | None = None,
        receipts: bool = True,
        name: str | None = None,
        receipts_file: str | Path | None = None,
        process_group: Any = None,
    ):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        # FSDP: this rank trains its shards, as a member of its shard's swarm (see optim/fsdp.py)
        self.fsdp = FsdpShard(optimizer, process_group, sync=mode == "sync") if is_sharded(optimizer) else None
        if self.fsdp is not None:
            run_id = self.fsdp.run_id(run_id)
        peer_name = check_name(name)
        self.options = o = TrainerOptions(
            run_id=run_id, target_batch_size=target_batch_size, batch_size_per_step=batch_size_per_step, mode=mode,
            local_steps=local_steps, outer_lr=outer_lr, outer_momentum=outer_momentum,
            inner_warmup_steps=inner_warmup_steps, compression=compression, aggregation=aggregation,
            target_group_size=target_group_size, mixing=mixing, delay_updates=delay_updates,
            overlap_outer=overlap_outer, matchmaking_timeout=matchmaking_timeout,
            averaging_timeout=averaging_timeout, refresh_period=refresh_period, bandwidth=bandwidth,
            load_state_timeout=load_state_timeout, average_state_every=average_state_every,
            outer_momentum_in_state=outer_momentum_in_state, checkpoint_every=checkpoint_every,
            checkpoint_dir=checkpoint_dir, checkpoint_keep=checkpoint_keep, checkpoint_writers=checkpoint_writers,
            trusted_writers=trusted_writers,
        )
        if dht is not None and initial_peers:
            raise ValueError("pass either dht= or initial_peers=, not both")
        self._torch_bookkeeping(optimizer)

        self.inner = optimizer
        self.run_id = run_id
        self.mode = mode
        self.target_batch_size = int(target_batch_size)
        self.batch_size_per_step = int(batch_size_per_step)
        self.local_steps = int(local_steps)
        self.inner_warmup_steps = inner_warmup_steps
        self._inner_steps = 0  # diloco: local steps taken by this peer (the warmup's clock)
        self.delay_updates = delay_updates
        self.overlap_outer = overlap_outer
        self.matchmaking_timeout = matchmaking_timeout
        self.codec = o.codec
        # "mean" trusts every peer; a robust rule (trimmed_mean, median, centered_clip) bounds
        # what a minority of hostile peers can do to the average (see averaging/robust.py)
        self.aggregation = aggregation
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

            self._state_names, self._extra_keys = module_names(model, self.fsdp.dparams if self.fsdp else self.params,
                                                               "params" if mode == "sync" else "outer")

        self.ranks = PeerRanks.detect(process_group) if self.fsdp is None else None
        self._ranks_seen = (-1, -1)  # (version, epoch) the other ranks last received
        self._owns_dht = dht is None
        self.dht = dht if dht is not None else (rank_dht(initial_peers, self.fsdp.ranks) if self.fsdp
                                                 else DHT(initial_peers))
        self._loop = self.dht.loop
        # What we average: gradients (sync) or pseudo-gradients (diloco), fp32, back to back in one
        # buffer on the parameters' device, which the averager averages in place when it is on the
        # CPU (else a slice at a time through host staging). Sync without delayed updates
        # accumulates in it; diloco keeps the outer parameters in it between rounds. Names carry
        # shapes into the schema, so other models never meet us.
        self._buffers = flat_views(self.params)  # (untouched until first written: no memory yet)
        named = [(f"p{i}", b) for i, b in enumerate(self._buffers)]
        self.averager = Averager(
            self.dht.node, f"{run_id}/{mode}", named, codec=self.codec, aggregation=self.aggregation,
            tag="overlap" if overlap_outer else "",  # (peers one round apart in their reports never meet)
            target_group_size=target_group_size,
            bandwidth=bandwidth, matchmaking_timeout=matchmaking_timeout,
            allreduce_config=AllReduceConfig(timeout=averaging_timeout),
            shards=self.fsdp.world_size if self.fsdp else 1,
        )
        # epoch claims are believed on evidence only (a quorum; under mean also a plausible rate)
        self._strict = self.aggregation != "mean"  # a robust rule: what a minority claims steers nothing
        self._judge = EpochJudge(strict=self._strict, live_window=max(3.0, 4 * refresh_period))
        self.tracker = ProgressTracker(self.dht.node, run_id, self.averager.schema.key,
                                       self.target_batch_size if mode == "sync" else local_steps * batch_size_per_step,
                                       refresh=refresh_period, judge=self._judge_claims, on_refused=self._refused,
                                       held=lambda: self._applied)
        self._grad_acc: list[torch.Tensor] = []  # sync: zeroed at the first step (a joiner's
        # download should not wait for zero-filling a model-sized buffer it does not need yet)
        self._outer: list[torch.Tensor] = []
        self.outer_optimizer: torch.optim.Optimizer | None = None
        #: diloco: the outer parameters are in the model's parameters during a round (see diloco_step)
        self._outer_in_params = False
        self._holders: list[torch.Tensor] = []
        if mode == "diloco":
            self._outer = flat_views(self.params) if overlap_outer else self._buffers  # (see diloco_step)
            torch._foreach_copy_(self._outer, [p.detach() for p in self.params])
            self.outer_optimizer = torch.optim.SGD(self._outer, lr=outer_lr, momentum=outer_momentum,
                                                   nesterov=outer_momentum > 0)

        self.stats = OptimizerStats()
        self.epoch = 0
        self.local_samples = 0
        self._local_steps_done = 0
        self._rate = CycleRate()
        self._sps = 0.0  # samples/s of this peer's training loop (see CycleRate)
        self._paused = 0.0  # seconds of this step spent waiting for averaging
        # one warning per _LOAD_WARN_EVERY and kind about state we cannot load (a load that keeps
        # failing, client-mode peers ahead), counting those held back
        self._load_warnings = LogThrottle(_LOAD_WARN_EVERY)
        self._pending: Future[StepResult | None] | None = None  # delayed update in flight
        self._pending_epoch = -1
        self._early: Early | None = None  # a round of ours begun before its data (rounds.begin_early)
        self._mixing: Future[StepResult | None] | None = None  # the parameter mix in flight (rounds.start_mix)
        self._mix_bufs: list[torch.Tensor] | None = None
        # held while the state changes; taking it first preserves a version a peer is downloading
        self._state_lock = StateLock()
        # Clear while a round's all-reduce (and then its update) is in flight: a joiner asking for
        # our state then gets the state right after it, at the start of the epoch the swarm is
        # about to train, not that of an epoch whose round is already closing (it would be a step
        # behind at once). Not cleared during matchmaking: a round may be waiting for that very
        # joiner, whose construction waits for our snapshot (each would wait out the other's timeout).
        self._settled = threading.Event()
        self._settled.set()
        self._closed = False
        self._applied = 0  # global updates contained in our state (what a snapshot is labelled)
        self._version = 0  # bumped (under the state lock) by every change of the shared state
        self._untrained = 0  # the version of a state we did not train on: the initial one, or one loaded
        self._outer_momentum_in_state = outer_momentum_in_state
        self.average_state_every = o.state_every
        self._state_averagers: dict[str, tuple[list[Any], Averager]] = {}  # (see rounds.state_averager)
        # the grid of mixing groups once the swarm outgrows a group, and the cell of our last round
        self.mixer = GridMixer(self.dht.node.peer_id.to_bytes(), target_group_size) if mixing else None
        self._cell = Cell()
        self._last_expected = 1
        self._partners: dict[PeerID, int] = {}  # peers holding our state, as of an epoch (see diloco_step.dropped)
        self.state_sync = StateSync(self.dht.node.host, f"{run_id}/{mode}/state", self._shared_state, self._state_lock,
                                    settled=self._settled, settle_timeout=matchmaking_timeout,
                                    version=lambda: self._version)
        self.scheduler = scheduler(self) if callable(scheduler) and not hasattr(scheduler, "step") else scheduler
        self._schedule = Schedule(self.inner, self.scheduler)  # a loaded state's lr: ours, replayed
        # the most a peer's state download may take: the shared tensors and 7 more copies of them
        # (optimizer moments and more) plus 16 MiB of counters; a larger manifest is refused unread
        self._state_cap = 8 * sum(t.numel() * max(4, t.element_size()) for t in self.params) + (16 << 20)
        self.checkpointer: Checkpointer | None = None
        self.contribution = (ContributionBook(self.dht.node, run_id, name=peer_name, path=receipts_file)
                             if receipts else None)
        try:
            self.checkpointer = make_checkpointer(self, o)
            self._loop.run(self._start())
        except BaseException:
            self._closed = True
            self._loop.run(self._close(), timeout=15)
            if self._owns_dht:
                self.dht.close()
            raise
        catch_up_at_start(self)
        if self.ranks is not None:
            lead(self, force=True)

    def _torch_bookkeeping(self, optimizer: torch.optim.Optimizer) -> None:
        """torch.optim.Optimizer's own bookkeeping, without copying the inner param groups."""
        self.defaults = optimizer.defaults
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                     "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                     "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, OrderedDict())
        self._patch_step_function()

    async def _start(self) -> None:
        await self.averager.start()
        await self.state_sync.start()
        if self.checkpointer is not None:
            await self.checkpointer.start()
        await self.tracker.start(publish=False)
        if self.contribution is not None:
            await self.contribution.start()
            self.stats.round_hooks.append(self.contribution.hook(self))

    def wait_for_peers(self, n: int, timeout: float = 60.0) -> int:
        """Block until ``n`` compatible peers (us included) are in the swarm or ``timeout`` passes;
        returns how many there are. For launchers and tests that start a swarm together, so that
        the first peer does not train alone while the others are still starting. A peer counts
        once it holds its starting state (a checkpoint it resumed, or the swarm's)."""
        view = self._wait_view(lambda v: v.num_peers + len(v.behind) >= n, timeout)
        count = view.num_peers + len(view.behind)
        return count if self.ranks is None else self.ranks.decide(count)

    def drain(self, timeout: float = 30.0) -> bool:
        """Stay in the swarm, serving state, until no peer reports an epoch before ours (``timeout``
        s at most): a run's last peers leave a straggler providers to catch up from, not a round
        with nobody. True when nobody was left behind. Call it after the last step, before close."""
        def nobody_behind(view: SwarmView) -> bool:
            return not any(p.epoch < self.epoch for p in view.training)

        return nobody_behind(self._wait_view(nobody_behind, timeout))

    def _wait_view(self, done: Callable[[SwarmView], bool], timeout: float) -> SwarmView:
        """Fresh views of the swarm until ``done`` holds for one or ``timeout`` passes; the last."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            view = self._loop.run(self.tracker.wait_fresh(min(max(remaining, 0.0), 0.5)))
            if done(view) or remaining <= 0:
                return view

    # ------------------------------------------------------------------ torch.optim.Optimizer face

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        if self.fsdp is not None:
            self.fsdp.zero_grad()

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
        return torch_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load_torch_state_dict(self, state_dict)

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, batch_size: int | None = None) -> Any:  # type: ignore[override]
        """Account for one local batch (``batch_size`` samples, default ``batch_size_per_step``)
        whose gradients are in ``.grad``; take a global step when the swarm is ready for one."""
        loss, bs = self._open_step(closure, batch_size)
        try:
            self._step(bs)
        except RankFailure:
            self.close()  # a rank of ours died: the whole peer leaves the swarm
            raise
        return loss

    def _open_step(self, closure: Callable[[], Any] | None, batch_size: int | None) -> tuple[Any, int]:
        """``step``'s start: the closure's loss and the batch's size (checked)."""
        if self._closed:
            raise RuntimeError("this DecentralizedOptimizer is closed")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        bs = self.batch_size_per_step if batch_size is None else int(batch_size)
        if bs < 1:
            raise ValueError("batch_size must be positive")
        return loss, bs

    def _step(self, bs: int) -> None:
        if self.ranks is not None:  # the peer's batch: every rank's
            bs = self.ranks.sum(bs)
        elif self.fsdp is not None:  # (and this rank's gradients onto its shards)
            bs = self.fsdp.begin_step(bs)
        self._sps = self._rate.tick(bs, self._paused, time.perf_counter())
        self._paused = 0.0
        self.stats.local_sps = self._sps
        self.stats.samples_total += bs
        if self.mode == "sync":
            sync_step(self, bs)
        else:
            diloco_step(self, bs)
        if self.ranks is not None:  # what the step changed, to the other ranks
            lead(self)

    # ---- the steps' stages: methods, so that instrumented subclasses (benchmarks/) can wrap them
    # and tests can call them with a stand-in for the optimizer

    def _end_sync_epoch(self, view: SwarmView) -> None:
        end_sync_epoch(self, view)

    def _outer_step(self, view: SwarmView) -> None:
        outer_step(self, view)

    def _average(self, epoch: int, samples: int, view: SwarmView) -> Future[StepResult | None]:
        return average(self, epoch, samples, view)

    def _maybe_average_state(self, epoch: int) -> bool:
        return maybe_average_state(self, epoch)

    def _expected(self, view: SwarmView, epoch: int) -> int:
        return expected_peers(view, epoch, reports_ahead(self))

    def _round_over(self, view: SwarmView) -> bool:
        return round_over(self, view)

    # ---- shared state (late join, missed rounds, checkpoints)

    @property
    def load_state_timeout(self) -> float:
        """Seconds a state load from peers, or a resume from the swarm's checkpoint, may take."""
        size = self.state_sync.size  # (0 before our state's size is known: not derived then)
        return resolve(self.options.load_state_timeout, STATE_LOAD, size, self.averager.service.link if size else None)

    def _shared_state(self) -> tuple[int, dict[str, Any]]:
        return shared_state(self)

    def _load_state_from_peers(self, view: SwarmView, missed: bool = False) -> bool:
        return load_state_from_peers(self, view, missed)

    def _fall_behind(self, view: SwarmView) -> None:
        fall_behind(self, view)

    def _fetch_state(self, view: SwarmView, at_least: int | None = None,
                     into: dict[str, list[torch.Tensor]] | None = None) -> Any:
        return fetch_state(self, view, self._applied if at_least is None else at_least, into=into)

    def _apply_shared_state(self, state: dict[str, Any], epoch: int) -> None:
        apply_shared_state(self, state, epoch)

    def _model_extra(self) -> list[torch.Tensor]:
        return model_extra(self._model, self._extra_keys)

    def _checkpoint_state(self, buffers: list[torch.Tensor]) -> tuple[int, dict[str, Any]]:
        return checkpoint_state(self, buffers)

    def _checkpoint_saved(self, info: Any) -> None:  # in the save thread
        self.stats.checkpoints_saved += 1
        self.stats.last_checkpoint_epoch = info.epoch

    # ---- epoch claims

    def _judge_claims(self, reports: list[PeerReport], me: PeerReport) -> dict[PeerID, str]:
        """(on the loop) The peers whose epoch we do not believe; see ``claims``. We have a say
        once we hold an epoch of our own: a fresh joiner at 0 has nothing to weigh."""
        return self._judge.judge(reports, me, counts_me=me.epoch > 0, now=time.time(), my_sps=self._sps,
                                 samples_per_epoch=self.tracker.target)

    def _refused(self, refused: dict[PeerID, str]) -> None:
        """(on the loop) Name the peers whose epoch claim we refused: once in the log, in ``stats.excluded``."""
        for peer, why in refused.items():
            if self.stats.exclude(str(peer), f"epoch claim refused: it {why}"):
                log.warning("not believing peer %s: it %s; it is left out until it says otherwise", peer.short(), why)

    def finish_round(self) -> None:
        """Apply what is in flight (``sync``: the parameter mix; with ``overlap_outer``: the round,
        and the outer parameters put in the model), as blocking rounds leave it (before evaluating
        or saving it)."""
        apply_mix(self, wait=True)
        if self.overlap_outer:
            finish_overlapped(self)
            if self.ranks is not None:
                lead(self, force=True)

    def memory_report(self) -> dict[str, int]:
        """Bytes this optimizer holds, by buffer kind (see :mod:`~p2ptrain.optim.memory`)."""
        from .memory import memory_report

        return memory_report(self)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Finish (or abandon) the round in flight, leave the swarm; idempotent."""
        if self._closed:
            return
        self._closed = True
        drop_early(self)
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
        if self.contribution is not None:
            await self.contribution.close()  # (publishes the receipts not yet in the DHT)
        for _, averager in self._state_averagers.values():
            await averager.close()
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
