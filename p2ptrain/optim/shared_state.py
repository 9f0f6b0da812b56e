"""The shared state: what every member of a group holds identically after a round, as served to
joiners and saved in checkpoints, and how a loaded one is put in place; and the optimizer's own
``state_dict`` / ``load_state_dict`` (torch's face of a peer's state)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint.autosave import Checkpointer
from ..gil import short_gil_waits
from .adopt import optimizer_state
from .outer_swap import outer_holders
from .ranks import lead
from .rounds import apply_mix
from .options import TrainerOptions

if TYPE_CHECKING:
    from .optimizer import DecentralizedOptimizer

log = logging.getLogger("p2ptrain.optim")


def shared_state(opt: DecentralizedOptimizer) -> tuple[int, dict[str, Any]]:
    """The shared state (called with the lock), labelled with the number of global updates it
    contains: ``opt.epoch`` runs ahead of the state while a round is in flight (or, with delayed
    updates, until it is applied)."""
    state: dict[str, Any] = {}
    if opt.mode == "sync":
        state["params"] = [p.detach() for p in opt.params]
        state["inner"] = opt.inner.state_dict()
    else:
        assert opt.outer_optimizer is not None
        state["outer"] = outer_holders(opt) if opt._outer_in_params else list(opt._outer)
        state["outer_opt"] = opt.outer_optimizer.state_dict()
    if opt.scheduler is not None:
        state["scheduler"] = opt.scheduler.state_dict()
    return opt._applied, state


def placeable(opt: DecentralizedOptimizer) -> dict[str, list[torch.Tensor]]:
    """Our tensors a download can write in place (CPU ones: see ``StateSync.fetch``)."""
    ours = [p.detach() for p in opt.params] if opt.mode == "sync" else list(opt._outer)
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in ours):
        return {}
    return {"params" if opt.mode == "sync" else "outer": ours}


@torch.no_grad()
def apply_shared_state(opt: DecentralizedOptimizer, state: dict[str, Any], epoch: int) -> None:
    """Make a loaded shared state (``epoch`` updates in it) ours: ValueError, with nothing
    changed, if its optimizer state does not fit ours."""
    inner = optimizer_state(state["inner"], opt.inner) if opt.mode == "sync" else \
        optimizer_state(state["outer_opt"], opt.outer_optimizer)
    apply_mix(opt, wait=True, discard=True)  # (a mix of the parameters we leave)
    # a copy per tensor, each giving up the GIL: short waits (see p2ptrain.gil)
    with short_gil_waits(), opt._state_lock:
        opt._applied = epoch
        opt._version += 1
        if opt.mode == "sync":
            params = state["params"]
            if len(params) != len(opt.params):
                raise ValueError(f"the peers' state has {len(params)} parameters, ours {len(opt.params)}")
            for p, src in zip(opt.params, params):
                if p.shape != src.shape:
                    raise ValueError(f"the peers' parameter of shape {list(src.shape)} does not fit ours "
                                     f"{list(p.shape)}")
            for p, src in zip(opt.params, params):
                if p.data_ptr() != src.data_ptr():  # (a download written in place is there already)
                    p.copy_(src)
            opt.inner.load_state_dict(inner)
        else:
            assert opt.outer_optimizer is not None
            for dst, src in zip(opt._outer, state["outer"], strict=True):
                if dst.data_ptr() != src.data_ptr():
                    dst.copy_(src)
            opt.outer_optimizer.load_state_dict(inner)
            for p, outer in zip(opt.params, opt._outer):
                p.copy_(outer)
        opt._schedule.advance_to(epoch)  # (the state's scheduler settings are not ours to take)
        _load_model_extra(opt._model_extra() if state.get("buffers") is not None else [], state.get("buffers"))


def _load_model_extra(ours: list[torch.Tensor], saved: Any) -> None:
    """The model's buffers from a checkpoint that holds them (live states do not: each peer
    keeps its own); one of another model is left out, with a warning."""
    if not ours:
        return
    if not isinstance(saved, list) or [tuple(t.shape) for t in saved if isinstance(t, torch.Tensor)] != [
            tuple(t.shape) for t in ours]:
        log.warning("the checkpoint's model buffers do not fit this model's; keeping ours")
        return
    for dst, src in zip(ours, saved):
        dst.detach().copy_(src)


def model_extra(model: torch.nn.Module | None, keys: list[str]) -> list[torch.Tensor]:
    """The ``model``'s state_dict tensors named ``keys`` (those the optimizer does not train), as they are now."""
    if model is None or not keys:
        return []
    tensors = model.state_dict(keep_vars=True)
    return [tensors[k] for k in keys]


def checkpoint_state(opt: DecentralizedOptimizer, buffers: list[torch.Tensor]) -> tuple[int, dict[str, Any]]:
    """The shared state, plus the model's buffers when we know the model (called with the lock)."""
    applied, state = opt._shared_state()
    return applied, {**state, "buffers": buffers} if buffers else state


def make_checkpointer(opt: DecentralizedOptimizer, o: TrainerOptions) -> Checkpointer | None:
    """The checkpointer that saves the shared state and finds the newest checkpoint, if asked for one."""
    if not o.wants_checkpoints:
        return None
    from ..checkpoint.store import CheckpointStore

    return Checkpointer(
        opt.dht.node, opt._loop, o.run_id, CheckpointStore(o.checkpoint_dir), every=o.checkpoint_every,
        server=opt.state_sync.server, keep=o.checkpoint_keep, writers=o.checkpoint_writers,
        meta={"mode": o.mode, "schema": opt.averager.schema.hash}, on_saved=opt._checkpoint_saved,
        labels={**({"state_dict": opt._state_names} if opt._state_names else {}),
                **(opt.fsdp.label() if opt.fsdp else {})} or None,
        trusted_writers=o.trusted_writers,
    )


def maybe_checkpoint(opt: DecentralizedOptimizer) -> None:
    """After an update landed (and any state averaging of that epoch): save the state when a
    checkpoint of this epoch is due and this peer is one of its writers among the live peers."""
    ck = opt.checkpointer
    if ck is None or not ck.due(opt._applied):
        return
    view = opt.tracker.estimate()
    live = [p.peer for p in (*view.peers, *view.behind) if not p.client]
    # forward passes change buffers outside the state lock: copy them here, in the training thread
    extra = [t.detach().to("cpu", copy=True) for t in opt._model_extra()]
    # (the save only reads the state: the plain lock, which makes no copy for peers downloading it)
    ck.maybe_save(opt._applied, live, lambda: opt._checkpoint_state(extra), opt._state_lock.raw)


def torch_state_dict(opt: DecentralizedOptimizer) -> dict[str, Any]:
    """``opt.state_dict()``: the torch optimizer's face of this peer's state (inner optimizer,
    epoch, mode; diloco's outer parameters and optimizer; the scheduler)."""
    sd: dict[str, Any] = {"inner": opt.inner.state_dict(), "epoch": opt.epoch, "mode": opt.mode}
    if opt.outer_optimizer is not None:
        sd["outer"] = opt.outer_optimizer.state_dict()
        sd["outer_params"] = [t.clone() for t in opt._outer]
    if opt.scheduler is not None:
        sd["scheduler"] = opt.scheduler.state_dict()
    return sd


def load_torch_state_dict(opt: DecentralizedOptimizer, state_dict: dict[str, Any]) -> None:
    """``opt.load_state_dict(state_dict)``: put back what :func:`torch_state_dict` gave."""
    if state_dict.get("mode", opt.mode) != opt.mode:
        raise ValueError(f"this state was saved in {state_dict.get('mode')!r} mode, not {opt.mode!r}")
    with opt._state_lock:
        opt.inner.load_state_dict(state_dict["inner"])
        opt.epoch = int(state_dict.get("epoch", 0))
        if opt.outer_optimizer is not None and "outer" in state_dict:
            for dst, src in zip(opt._outer, state_dict["outer_params"], strict=True):
                dst.copy_(src)
            opt.outer_optimizer.load_state_dict(state_dict["outer"])
        if opt.scheduler is not None and "scheduler" in state_dict:
            opt.scheduler.load_state_dict(state_dict["scheduler"])
        opt._version += 1
    opt.tracker.report(opt.epoch, opt.local_samples, opt._sps)
    if opt.ranks is not None:
        lead(opt, force=True)
