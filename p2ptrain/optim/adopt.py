"""Adopting a state that came from other peers (or a checkpoint) without their hyper-parameters.

A peer's state is tensors and step counters; its optimizer's ``param_groups`` (lr, betas, weight
decay, ...) and its scheduler's settings are its user's choices, and a hostile peer's are anything
(lr = 1000). So only ``state`` (per-parameter tensors, each the shape of its parameter, and scalar
step counters) is taken from an optimizer state_dict, and the schedule is *replayed*: our scheduler,
from the state it had when we were built, stepped to the number of updates the loaded state holds.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import torch

#: the param_group keys LR schedulers move (OneCycleLR and CyclicLR also cycle the momentum)
_SCHEDULED = ("lr", "momentum", "betas")


def optimizer_state(loaded: Any, ours: torch.optim.Optimizer) -> dict[str, Any]:
    """A state_dict for ``ours.load_state_dict``: the per-parameter tensors of ``loaded`` (checked
    against our parameters) under our own ``param_groups``. ValueError if it does not fit."""
    if not isinstance(loaded, dict) or not isinstance(loaded.get("state"), dict):
        raise ValueError("the optimizer state is not a state_dict")
    params = [p for g in ours.param_groups for p in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    for index, entry in loaded["state"].items():
        if type(index) is not int or not 0 <= index < len(params) or not isinstance(entry, dict):
            raise ValueError(f"the optimizer state names parameter {index!r:.20}, which we do not have")
        state[index] = {}
        for name, value in entry.items():
            if not isinstance(name, str):
                raise ValueError("the optimizer state has a non-string entry name")
            if isinstance(value, torch.Tensor):
                if value.numel() != 1 and tuple(value.shape) != tuple(params[index].shape):
                    raise ValueError(f"optimizer state {name!r} of shape {list(value.shape)} does not fit "
                                     f"parameter {index} of shape {list(params[index].shape)}")
                if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                    raise ValueError(f"optimizer state {name!r} of parameter {index} is not finite")
            elif not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise ValueError(f"optimizer state {name!r} of parameter {index} is neither a tensor nor a number")
            state[index][name] = value
    return {"state": state, "param_groups": ours.state_dict()["param_groups"]}


class Schedule:
    """Our scheduler's starting point, to replay it to any number of updates."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Any):
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.groups = [{k: copy.deepcopy(g[k]) for k in _SCHEDULED if k in g} for g in optimizer.param_groups]
        self.start = copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None
        self.last_epoch = getattr(scheduler, "last_epoch", None)

    def advance_to(self, updates: int) -> None:
        """Put the scheduler (and the lr, momentum it sets) where ours would be after ``updates``
        global updates from where it started. Schedulers without a step counter (e.g.
        ReduceLROnPlateau, driven by metrics) are left as they are."""
        s = self.scheduler
        if s is None or self.start is None or type(self.last_epoch) is not int or updates < 0 or \
                isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau):
            return
        for group, saved in zip(self.optimizer.param_groups, self.groups):
            group.update(copy.deepcopy(saved))
        s.load_state_dict(copy.deepcopy(self.start))
        if updates == 0:
            return
        with warnings.catch_warnings():  # (stepping a scheduler before its optimizer warns)
            warnings.simplefilter("ignore")
            closed = getattr(s, "_get_closed_form_lr", None)
            if closed is not None:
                s.last_epoch = self.last_epoch + updates
                values = closed()
                for group, lr in zip(self.optimizer.param_groups, values):
                    group["lr"] = lr
                s._last_lr = [g["lr"] for g in self.optimizer.param_groups]
            elif isinstance(s, (torch.optim.lr_scheduler.LambdaLR, torch.optim.lr_scheduler.OneCycleLR,
                                torch.optim.lr_scheduler.CyclicLR)):
                s.last_epoch = self.last_epoch + updates - 1  # their values depend on the counter alone
                s.step()
            else:
                for _ in range(updates):
                    s.step()
