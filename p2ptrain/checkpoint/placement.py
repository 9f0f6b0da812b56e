"""Where the chunks of a downloaded state land: some tensors straight into memory the caller holds.

Why: a joiner downloads the swarm's state into a buffer of the state's size, then copies the
parameters out of it into its model. That buffer is fresh memory, whose page faults can cost more
than the transfer itself (``benchmarks/late_join.py`` prints both). The model's parameters are
memory the process touched already, and they are about to be overwritten anyway. A ``Placement``
writes the bytes of chosen tensors (``targets``: manifest tensor index -> a tensor of the same dtype
and shape) into those tensors, and every other byte into one buffer of the state's size, of which
only the pages written are ever touched: the parameters' ranges of it never are.

The caller gives up what ``targets`` held as soon as the first chunk lands: a download that fails
halfway leaves them part old, part new (every new byte verified). Use it where that is acceptable,
e.g. for a peer that has not trained yet and will load the state again before it does.

Sans-IO: ``put`` takes one verified chunk; ``restore`` gives the state object, whose placed
tensors are the targets themselves.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from typing import Any

import torch

from .manifest import Manifest, _typed
from .tree import torch_dtype, unflatten


class Placement:
    """The landing place of one manifest's chunks (see the module docstring)."""

    def __init__(self, manifest: Manifest, targets: Mapping[int, torch.Tensor]):
        self.manifest = manifest
        #: the targets that fit their entry (CPU, contiguous, same dtype and shape); any other
        #: tensor, or a target that does not fit, lands in ``rest``
        self.placed: dict[int, torch.Tensor] = {}
        spans: list[tuple[int, int, memoryview]] = []
        for i, t in targets.items():
            if not 0 <= i < len(manifest.tensors):
                continue
            e = manifest.tensors[i]
            if not (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous()
                    and t.dtype == torch_dtype(e.dtype) and tuple(t.shape) == tuple(e.shape) and e.nbytes):
                continue
            t = t.detach() if t.requires_grad else t
            self.placed[i] = t
            spans.append((e.offset, e.offset + e.nbytes, memoryview(t.reshape(-1).view(torch.uint8).numpy())))
        spans.sort(key=lambda s: s[0])
        self._spans = spans
        self._starts = [s[0] for s in spans]
        # virtual memory only: pages are faulted where bytes are written, never in placed ranges
        self.rest = torch.empty(manifest.total_size, dtype=torch.uint8)
        self._rest = memoryview(self.rest.numpy())

    @property
    def placed_bytes(self) -> int:
        return sum(b - a for a, b, _ in self._spans)

    def put(self, index: int, data: memoryview | bytes | bytearray) -> None:
        """Copy chunk ``index`` (verified by the caller) to where its bytes belong."""
        s, e = self.manifest.chunk_span(index)
        if len(data) != e - s:
            raise ValueError(f"chunk {index} has {len(data)} bytes, the manifest says {e - s}")
        data = memoryview(data).cast("B")
        pos = s
        k = max(0, bisect.bisect_right(self._starts, s) - 1)
        while pos < e:
            if k < len(self._spans) and self._spans[k][1] <= pos:
                k += 1
                continue
            a, b, mv = self._spans[k] if k < len(self._spans) else (e, e, None)
            if pos < a:  # bytes before the next placed tensor (or the chunk's end): the rest buffer
                stop = min(a, e)
                self._rest[pos:stop] = data[pos - s : stop - s]
                pos = stop
                continue
            stop = min(b, e)
            assert mv is not None
            mv[pos - a : stop - a] = data[pos - s : stop - s]
            pos = stop

    def restore(self, *, copy: bool = False) -> Any:
        """The state object: placed tensors are the targets, the others views of ``rest``
        (independent copies of all of them with ``copy``)."""
        tensors = []
        for i, e in enumerate(self.manifest.tensors):
            t = self.placed.get(i)
            if t is None:
                t = _typed(self.rest, e) if e.nbytes else torch.empty(e.shape, dtype=torch_dtype(e.dtype))
            tensors.append(t.clone() if copy else t)
        return unflatten(self.manifest.skeleton, tensors)


def tensors_under(skeleton: Any, key: str) -> list[int]:
    """Manifest tensor indices of the list of tensors at top-level ``key`` of a dict skeleton
    (e.g. ``"params"`` of a trainer's shared state), in list order; [] if there is none."""
    if not (isinstance(skeleton, list) and len(skeleton) == 2 and skeleton[0] == "d" and isinstance(skeleton[1], list)):
        return []
    for item in skeleton[1]:
        if isinstance(item, list) and len(item) == 2 and item[0] == key:
            node = item[1]
            if not (isinstance(node, list) and len(node) == 2 and node[0] in ("l", "t") and isinstance(node[1], list)):
                return []
            out = []
            for t in node[1]:
                if not (isinstance(t, list) and len(t) == 4 and t[0] == "T" and isinstance(t[1], int)):
                    return []
                out.append(t[1])
            return out
    return []
