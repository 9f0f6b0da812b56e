"""DiLoCo's outer parameters and the pseudo-gradient in two model-sized buffers, not three.

Between rounds the outer parameters are in the averaging buffer. For a round, ``swap_out`` puts
the pseudo-gradient there (to be averaged in place) and the outer parameters in the model's own
parameters, whose values are not needed again; ``swap_back`` reverses the placement once the
round is over, leaving the averaged pseudo-gradient where the outer parameters were.

With ``overlap_outer`` the parameters keep training during the round, so the outer parameters
have a buffer of their own (the model's size, once more): ``eager_start`` fills the averaging
buffer and moves the parameters ahead, ``land_overlapped`` takes the outer step and merges the
parameters into the new outer ones once the round is over.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .optimizer import DecentralizedOptimizer


@torch.no_grad()
def swap_out(opt: DecentralizedOptimizer) -> None:
    """Put the pseudo-gradient (outer parameters minus ours) in the buffer the outer parameters
    held, and the outer parameters in the model's own fp32 parameters (other dtypes or devices: in
    a kept fp32 buffer of their shape): no third model-sized buffer. The model's own values are
    not needed again (every peer continues from the new outer parameters)."""
    for outer, p, holder in zip(opt._outer, opt.params, outer_holders(opt)):
        for a, p_part, h in _pieces(outer, p, holder):
            tmp = p_part.to(torch.float32, copy=True)  # (a piece: bounded scratch)
            h.copy_(a)
            a.sub_(tmp)
    opt._outer_in_params = True


@torch.no_grad()
def swap_back(opt: DecentralizedOptimizer) -> list[torch.Tensor]:
    """Undo ``swap_out``'s placement: the outer parameters back in their buffer, and whatever the
    buffer held (the averaged pseudo-gradient) where they were, which is returned."""
    holders = outer_holders(opt)
    for outer, holder in zip(opt._outer, holders):
        for a, h in _pieces(outer, holder):
            tmp = h.clone()
            h.copy_(a)
            a.copy_(tmp)
    opt._outer_in_params = False
    return holders


@torch.no_grad()
def eager_start(outer: list[torch.Tensor], params: list[torch.Tensor], out: list[torch.Tensor],
                outer_opt: torch.optim.Optimizer) -> None:
    """A round starts: ``out`` := ``outer`` - ``params`` (the pseudo-gradient to average), and
    ``params`` := where ``outer_opt`` (Nesterov SGD, as ``DecentralizedOptimizer`` makes it) would
    take ``outer`` if the group's average were ours: an eager update (Kale et al. 2025), so that
    the group trains on from the new outer parameters on average, however long the round takes."""
    group = outer_opt.param_groups[0]
    lr, mu = group["lr"], group["momentum"]  # (nesterov = momentum > 0, no dampening or decay)
    for o, p, b in zip(outer, params, out):
        m = outer_opt.state[o].get("momentum_buffer") if o in outer_opt.state else None
        for o_part, p_part, b_part, *m_part in _pieces(o, p, b, *([m] if m is not None else [])):
            torch.sub(o_part, p_part.to(b_part.device, torch.float32), out=b_part)
            step = b_part * (lr * (1 + mu))  # (a piece: bounded scratch)
            if m_part:
                step.add_(m_part[0], alpha=lr * mu * mu)
            p_part.copy_(torch.sub(o_part, step, out=step))


@torch.no_grad()
def land_overlapped(params: list[torch.Tensor], outer: list[torch.Tensor], mix: float,
                    outer_step: Callable[[], None]) -> None:
    """A round started by ``eager_start`` is over: ``outer_step()`` moves ``outer`` with the
    group's average, and ``params`` keep ``mix`` of how far they are from it (streaming DiLoCo's
    merge, Douillard et al. 2025): this peer's departure from the group's mean, and the steps
    taken since the round started, which the next round's pseudo-gradient then carries."""
    outer_step()
    for p, o in zip(params, outer):
        for p_part, o_part in _pieces(p, o):
            p_part.lerp_(o_part.to(p_part.device, p_part.dtype), 1.0 - mix)


def outer_holders(opt: DecentralizedOptimizer) -> list[torch.Tensor]:
    """Where ``swap_out`` puts the outer parameters: each fp32 parameter on the buffer's device
    itself, else an fp32 buffer of its own (kept)."""
    if not opt._holders:
        opt._holders = [p.detach() if p.dtype == torch.float32 and p.device == o.device else torch.empty_like(o)
                        for p, o in zip(opt.params, opt._outer)]
    return opt._holders


def _pieces(*tensors: torch.Tensor, numel: int = 1 << 20) -> Iterator[tuple[torch.Tensor, ...]]:
    """Matching flat pieces of same-shaped tensors (a bounded temporary per piece)."""
    flats = [t.detach().view(-1) for t in tensors]
    for i in range(0, flats[0].numel(), numel):
        yield tuple(f[i : i + numel] for f in flats)
