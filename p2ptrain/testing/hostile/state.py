"""Hostile peers: progress and training-state attacks (see the package docstring).

The attacker is an ordinary :class:`~p2ptrain.DecentralizedOptimizer` of the run, with a valid
identity and correctly signed records; it lies only in what it claims and serves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._registry import mode


@mode("epoch_claim", "report an epoch far ahead and serve a state of our own making (params x scale, lr, "
                     "scheduler) under it: taken, it would rewrite every peer that believed it")
def epoch_claim(opt: Any, epoch: int = 10**9, *, lr: float = 1000.0, scale: float = 1e3) -> None:
    """Turn ``opt`` (a DecentralizedOptimizer) into the claimant: its state is scaled, its inner
    optimizer's lr set to ``lr``, the whole labelled ``epoch``, and the claim published at once."""
    with opt._state_lock, torch.no_grad():
        for p in opt.params:
            p.mul_(scale)
        for group in opt.inner.param_groups:
            group["lr"] = lr
        opt._applied = epoch
        opt._version += 1
    opt.epoch = epoch
    opt.tracker.report(epoch, 0, opt._sps)
    opt._loop.run(opt.tracker.refresh_now(timeout=10))


@mode("gradient_rewrite", "rewrite, in place, the gradients (diloco: pseudo-gradients) it is about to average")
def gradient_rewrite(opt: Any, rewrite: Callable[[list[torch.Tensor]], None]) -> None:
    """Make ``opt`` (a DecentralizedOptimizer) call ``rewrite`` on the tensors of each of its rounds
    just before they are averaged, by wrapping its ``_average`` stage on this instance."""
    average = opt._average

    def rewritten(epoch: int, samples: int, view: Any) -> Any:
        rewrite(opt._buffers)
        return average(epoch, samples, view)

    opt._average = rewritten


@mode("huge_state", "claim an epoch and serve, as the training state, a manifest of far more bytes than the model")
def huge_state(opt: Any, epoch: int = 3, total: int = 60 << 30) -> Any:
    """Make ``opt`` serve a ``total``-byte state of zeros (every chunk valid) labelled ``epoch``,
    and claim that epoch; returns the source, whose ``chunks_sent`` tells what a fetcher took."""
    from .checkpoints import huge_manifest

    server, key = opt.state_sync.server, opt.state_sync.key
    server._providers.pop(key, None)  # (what nothing publishes is left to the resolvers)
    source = huge_manifest(server, key, total, meta={"epoch": epoch})
    opt.epoch = opt._applied = epoch
    opt.tracker.report(epoch, 0, opt._sps)
    opt._loop.run(opt.tracker.refresh_now(timeout=10))
    return source
