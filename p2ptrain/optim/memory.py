"""Where a peer's memory goes: the buffers an optimizer holds beyond the model and its inner
optimizer, by name, each storage counted once (``benchmarks/memory.py`` prints it)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .optimizer import DecentralizedOptimizer


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def flat_views(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 tensors shaped like ``params``, back to back in one buffer on their device (the CPU if
    they are spread over several), not yet touched."""
    devices = {p.device for p in params}
    device = devices.pop() if len(devices) == 1 else torch.device("cpu")
    flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32, device=device)
    views, offset = [], 0
    for p in params:
        views.append(flat[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    return views


def memory_report(opt: DecentralizedOptimizer) -> dict[str, int]:
    """Bytes per buffer kind (host and device alike); a storage shared by two kinds counts once,
    under the first. The model's parameters and the inner optimizer's state are listed for scale."""
    seen: set[int] = set()

    def size(tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total

    service = opt.averager.service
    report = {
        "model parameters": size(opt.params),
        "inner optimizer state": size(_tensors(opt.inner.state)),
        "gradient accumulator": size(opt._grad_acc),
        "outer parameters": size(opt._outer),
        "outer optimizer state": size(_tensors(opt.outer_optimizer.state)) if opt.outer_optimizer else 0,
        "averaging buffer": size(opt._buffers),
        "outer parameters during a round": size(opt._holders),  # (0 where they are the model's own)
        "all-reduce scratch and wire pools": size([*service._scratch, *service._wires]),
        "state copies for downloads": opt.state_sync.held_bytes,
    }
    return report
