"""Linear learning-rate warmup applied around one optimizer step.

Shared by DiLoCo's inner steps (:class:`~p2ptrain.optim.DecentralizedOptimizer`'s
``inner_warmup_steps``) and the single-process baseline (:func:`p2ptrain.tasks.train_single`), so
a benchmark compares the two under exactly the same schedule. The lr is scaled for the step and put
back right after, rather than kept by a torch ``LRScheduler``: the optimizer's own lr, its saved
state and any scheduler the user steps stay untouched.
"""

from __future__ import annotations

import torch

__all__ = ["warmed_step"]


def warmed_step(optimizer: torch.optim.Optimizer, step: int, warmup_steps: int) -> None:
    """``optimizer.step()`` at ``min(1, step / warmup_steps)`` of its lr (``step`` counts from 1)."""
    if step >= warmup_steps:
        optimizer.step()
        return
    scale = step / warmup_steps
    saved = [g["lr"] for g in optimizer.param_groups]
    try:
        for g in optimizer.param_groups:
            g["lr"] = g["lr"] * scale
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, saved):
            g["lr"] = lr
