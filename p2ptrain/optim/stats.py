"""OptimizerStats: what the swarm and this peer have done so far, and how rounds and views update
it; CycleRate: this peer's samples/s."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from ..averaging import StepResult
from .progress import SwarmView

log = logging.getLogger("p2ptrain.optim")


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
    #: values of the group rounds' vectors (summed over rounds), and those of the shards this peer
    #: owned: its share of the averaging work, sized by its bandwidth
    group_values: int = 0
    owned_values: int = 0
    failed_rounds: int = 0  # rounds that found nobody or lost part of the average
    state_rounds: int = 0  # rounds that averaged the parameters and optimizer state themselves
    overlapped_steps: int = 0  # diloco overlap_outer: inner steps taken while an outer round was in flight
    state_loads: int = 0  # times this peer downloaded the swarm's state (joining, or after missing rounds)
    last_state_load_s: float = 0.0
    last_state_providers: int = 0  # peers the last state download came from (in parallel)
    last_state_in_place: int = 0  # bytes of it written straight into our tensors (see catch_up.load_state_from_peers)
    checkpoints_saved: int = 0  # checkpoints this peer wrote (it is one of the writers of some epochs)
    last_checkpoint_epoch: int | None = None  # epoch of the last checkpoint this peer wrote
    resumed_epoch: int | None = None  # epoch of the checkpoint this peer started from, if any
    #: peers dropped from our rounds (NaN/inf or wrong-sized parts, other codec or aggregation,
    #: died, stalled): peer id -> why, the latest reason per peer (at most 64 peers kept)
    excluded: dict[str, str] = field(default_factory=dict)
    #: called with each gradient round's result as ``record`` accounts for it (e.g. a contribution
    #: book's, :mod:`p2ptrain.contrib`), in the thread that steps
    round_hooks: list[Callable[[StepResult], None]] = field(default_factory=list, repr=False, compare=False)

    def exclude(self, peer: str, why: str) -> bool:
        """Record why ``peer`` was left out in ``excluded`` (at most 64 peers kept); whether it
        was not there yet."""
        new = peer not in self.excluded
        if not new or len(self.excluded) < 64:
            self.excluded[peer] = why
        return new and peer in self.excluded

    def observe(self, view: SwarmView, epoch: int, local_samples: int) -> None:
        """The swarm's size and speed from ``view``; our epoch and samples."""
        training = view.training  # (not only those at our epoch: right after a round, others still report the last)
        self.peers = len(training)
        self.swarm_sps = sum(p.sps for p in training)
        self.epoch = epoch
        self.local_samples = local_samples

    def record(self, result: StepResult | None, epoch: int, local_samples: int) -> None:
        """Account for an averaging round's ``result`` (None: there was none), and log its exclusions."""
        self.epoch = epoch
        self.local_samples = local_samples
        if result is None:
            return
        self.rounds += 1
        self.last_group_size = result.group_size
        self.last_round_s = result.total_s
        self.last_round_samples = int(result.weight_total)
        self.bytes_sent += result.bytes_sent
        self.bytes_received += result.bytes_received
        for ar in result.allreduces if result.group_size > 1 else ():
            self.group_values += sum(s.numel for s in ar.shards)
            self.owned_values += sum(s.numel for s in ar.shards if s.owner == ar.rank)
        if result.group_size == 1 and self.peers > 1 or result.not_averaged:
            self.failed_rounds += 1
        for rank, why in result.failed.items():
            peer = str(result.members[rank]) if rank < len(result.members) else f"rank {rank}"
            self.exclude(peer, why)
            log.warning("epoch %d: peer %s excluded from the round: %s", epoch, peer, why)
        for hook in self.round_hooks:
            hook(result)
        log.debug("epoch %d: averaged with %d peers in %.3f s (matchmaking %.3f s, %d peers seen)", epoch,
                  result.group_size, result.total_s, result.matchmaking_s, self.peers)


class CycleRate:
    """Samples/s of the whole training loop (forward, backward, data, our own step) minus our
    averaging pauses: what the swarm needs to predict when an epoch's batch is complete.

    Measured over full step-to-step cycles; timing only the user's part of the loop would
    overestimate it badly on a loaded machine and make the swarm close epochs early. Samples
    and seconds are averaged apart and divided: an average of per-cycle rates is dominated by
    the shortest cycles (with fast steps and a busy CPU, several times the real rate).
    """

    def __init__(self) -> None:
        self.sps = 0.0
        self._ema: tuple[float, float] | None = None  # (samples, seconds) of a step cycle, averaged
        self._last: float | None = None  # when the last cycle started

    def tick(self, samples: int, paused: float, now: float) -> float:
        """A cycle of ``samples`` ends at ``now`` (``paused`` seconds of it spent averaging) and
        the next starts; the rate so far (0 until a cycle is complete)."""
        if self._last is not None:
            cycle = max(now - self._last - paused, 1e-6)
            n, t = (samples, cycle) if self._ema is None else self._ema
            self._ema = n, t = 0.9 * n + 0.1 * samples, 0.9 * t + 0.1 * cycle
            self.sps = n / t
        self._last = now
        return self.sps
