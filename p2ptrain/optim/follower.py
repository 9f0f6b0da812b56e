"""The DecentralizedOptimizer of a rank that is not its peer's leader (see :mod:`~p2ptrain.optim.ranks`).

It runs no DHT node: each ``step()`` adds its batch to the peer's sample count, takes the inner
step itself where every rank takes it alike (diloco's local steps, on gradients the model's DDP
already averaged), and then takes what the leader sends: the epoch, learning rates, and the
parameters whenever the swarm changed them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from .optimizer import DecentralizedOptimizer
from .ranks import PeerRanks, follow
from .stats import OptimizerStats
from .warmup import warmed_step


class RankFollower(DecentralizedOptimizer):
    """What ``DecentralizedOptimizer(...)`` is on a rank other than its peer's leader: the same
    torch optimizer surface, its steps the leader's."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, run_id: str, mode: str = "sync",
                 batch_size_per_step: int = 32, local_steps: int = 50, inner_warmup_steps: int = 0,
                 overlap_outer: bool = False, process_group: Any = None, **_leaders: Any):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        ranks = PeerRanks.detect(process_group)
        assert ranks is not None and not ranks.is_leader
        self.ranks = ranks
        self._torch_bookkeeping(optimizer)
        self.inner = optimizer
        self.run_id, self.mode = run_id, mode
        self.batch_size_per_step = int(batch_size_per_step)
        self.local_steps = int(local_steps)
        self.inner_warmup_steps = inner_warmup_steps
        self.overlap_outer = overlap_outer
        self.outer_optimizer = None
        self.scheduler = None  # (the leader steps it; its learning rates come with each step)
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.stats = OptimizerStats()
        self.epoch = 0
        self.local_samples = 0
        self._inner_steps = 0
        self._state_lock = threading.Lock()
        self._closed = False
        follow(self)  # the peer's starting state (the leader may have loaded the swarm's)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, batch_size: int | None = None) -> Any:  # type: ignore[override]
        loss, bs = self._open_step(closure, batch_size)
        bs = self.ranks.sum(bs)
        self.stats.samples_total += bs
        if self.mode == "diloco":  # every rank takes the local step (its gradients are the peer's)
            self._inner_steps += 1
            warmed_step(self.inner, self._inner_steps, self.inner_warmup_steps)
        follow(self)
        return loss

    def wait_for_peers(self, n: int, timeout: float = 60.0) -> int:
        return int(self.ranks.decide())

    def drain(self, timeout: float = 30.0) -> bool:
        return True  # (the leader stays in the swarm for the peer)

    @property
    def mismatches(self) -> dict[str, str]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict["inner"])
        follow(self)  # (the leader loads the shared part and sends it)

    def finish_round(self) -> None:
        if self.overlap_outer:
            follow(self)

    def memory_report(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        self._closed = True

    def __repr__(self) -> str:
        return (f"RankFollower(rank={self.ranks.rank}, mode={self.mode!r}, run_id={self.run_id!r}, "
                f"epoch={self.epoch})")
