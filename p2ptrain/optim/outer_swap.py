"""DiLoCo's outer parameters and the pseudo-gradient in two model-sized buffers, not three.

Between rounds the outer parameters are in the averaging buffer. For a round, ``swap_out`` puts
the pseudo-gradient there (to be averaged in place) and the outer parameters in the model's own
parameters, whose values are not needed again; ``swap_back`` reverses the placement once the
round is over, leaving the averaged pseudo-gradient where the outer parameters were.

With ``overlap_outer`` the parameters keep training during the round, so the outer parameters
have a buffer of their own (the model's size, once more): ``pseudo_gradient`` fills the averaging
buffer, and ``land_overlapped`` takes the outer step and merges the parameters into the new outer
ones once the round is over.
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
def pseudo_gradient(outer: list[torch.Tensor], params: list[torch.Tensor], out: list[torch.Tensor]) -> None:
    """``out`` := ``outer`` - ``params`` (fp32; the parameters are left as they are)."""
    for o, p, b in zip(outer, params, out):
        for o_part, p_part, b_part in _pieces(o, p, b):
            torch.sub(o_part, p_part.to(b_part.device, torch.float32), out=b_part)


@torch.no_grad()
def land_overlapped(params: list[torch.Tensor], outer: list[torch.Tensor], averaged: list[torch.Tensor],
                    mix: float, outer_step: Callable[[], None]) -> None:
    """An overlapped round is over: ``averaged`` holds the group's mean pseudo-gradient, taken
    against ``outer`` while ``params`` went on training. ``outer_step()`` moves ``outer`` with it;
    ``params`` become the new outer ones plus ``mix`` times how far they are past the group's mean
    end of the round (``outer - averaged``): the steps taken since, and this peer's own departure
    from the mean. Streaming DiLoCo's merge, measured from that mean rather than from the new
    outer parameters, so that the outer step's momentum is not pulled back on the next round."""
    for p, o, a in zip(params, outer, averaged):
        for p_part, o_part, a_part in _pieces(p, o, a):
            p_part.sub_((o_part - a_part).to(p_part.device, p_part.dtype))
    outer_step()
    for p, o in zip(params, outer):
        for p_part, o_part in _pieces(p, o):
            p_part.mul_(mix).add_(o_part.to(p_part.device, p_part.dtype))


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
