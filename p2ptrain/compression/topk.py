"""Top-k sparsification: keep the ``fraction`` largest-magnitude entries of each chunk.

Wire layout: ``[values: float32 x k][indices: int32 x k]`` with ``k = ceil(fraction * numel)``
(at least 1 for a non-empty chunk, at most numel), so ``encoded_nbytes(numel) = 8 k`` is exact.
Kept entries are exact (float32 values); the others decode to 0. Use it through
:class:`~p2ptrain.compression.feedback.ErrorFeedback` (``get_codec("topk")`` does) so the dropped
mass is carried into the next round.

Selection: ``torch.topk`` over a 1M-value chunk is slow on CPU (it partially sorts everything).
For large chunks we estimate a magnitude threshold from a strided sample (``kthvalue`` over ~64k
values), keep the candidates above it (~1.5 k of them) and run the exact top-k among those only;
if the estimate keeps fewer than k candidates we fall back to the full ``torch.topk``. The result
is the exact top-k either way (ties broken arbitrarily).
"""

from __future__ import annotations

import math

import torch

from .base import Codec, CompressionError, Encoded, as_uint8, check_finite, frombuffer, scratch

__all__ = ["TopKCodec"]

_SAMPLE = 1 << 16  # sample size for the threshold estimate
_MIN_SAMPLED = 1 << 17  # below this many values, plain torch.topk
_OVERSAMPLE = 1.5  # aim for ~1.5 k candidates


class TopKCodec(Codec):
    name = "topk"

    def __init__(self, fraction: float = 0.01, **kw):
        super().__init__(**kw)
        fraction = float(fraction)
        if not 0.0 < fraction <= 1.0:
            raise ValueError("topk fraction must be in (0, 1]")
        self.fraction = fraction

    def _opts_repr(self) -> str:
        return f"fraction={self.fraction}"

    def _extra_meta_keys(self):
        return {"fraction": float}

    def _meta(self, chunk, **extra):
        return super()._meta(chunk, fraction=self.fraction, **extra)

    def k(self, numel: int) -> int:
        numel = int(numel)
        if numel <= 0:
            return 0
        return min(numel, max(1, math.ceil(self.fraction * numel)))

    def encoded_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return 8 * self.k(numel)

    # ------------------------------------------------------------------ encode
    def select(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Indices (int64, unsorted) of the k largest |x| (x finite)."""
        n = x.numel()
        a = torch.abs(x, out=scratch("topk.abs", n, x.dtype, x.device))  # no fresh 4 MiB per chunk
        if n < _MIN_SAMPLED or k * 8 > n:
            return torch.topk(a, k, sorted=False).indices
        stride = (n // _SAMPLE) | 1  # odd stride: less aliasing with power-of-two structure
        s = a[::stride]
        m = s.numel()
        ks = min(m, math.ceil(m * k / n * _OVERSAMPLE) + 8)
        thr = torch.kthvalue(s, m - ks + 1).values
        cand = torch.nonzero(torch.ge(a, thr, out=scratch("topk.mask", n, torch.bool, x.device))).squeeze(1)
        if cand.numel() < k:  # unlucky sample: exact fallback
            return torch.topk(a, k, sorted=False).indices
        if cand.numel() == k:
            return cand
        top = torch.topk(a[cand], k, sorted=False).indices
        return cand[top]

    def _encode(self, chunk: torch.Tensor, out: torch.Tensor | None = None, scale: float = 1.0) -> Encoded:
        n = chunk.numel()
        check_finite(chunk, "topk: input chunk")
        k = self.k(n)
        x = chunk if chunk.dtype == torch.float32 else chunk.float()
        idx = self.select(x, k) if k else torch.empty(0, dtype=torch.long, device=x.device)
        vals = x[idx] if scale == 1.0 else x[idx] * scale
        return Encoded(
            self._meta(chunk),
            [as_uint8(vals), as_uint8(idx.to(torch.int32))],
            local={"indices": idx, "values": vals},
        )

    # ------------------------------------------------------------------ decode
    def _unpack(self, buf, numel: int, device: torch.device):
        k = self.k(numel)
        vals = frombuffer(buf, torch.float32, 0, k)
        idx = frombuffer(buf, torch.int32, 4 * k, k)
        if k:
            lo, hi = torch.aminmax(idx)
            if int(lo) < 0 or int(hi) >= numel:
                raise CompressionError(f"topk: received indices outside [0, {numel}); rejecting the message")
            if self.check_finite_on_decode and not bool(torch.isfinite(vals).all()):
                raise CompressionError("topk: received values contain NaN or inf; rejecting the message")
        idx = idx.to(device=device, dtype=torch.long)
        return vals.to(device), idx

    def _add_bound(self, meta, buf, numel):
        # decode_add sums repeated indices: the bound is the sum of all |values|, not their max
        vals, _idx = self._unpack(buf, numel, torch.device("cpu"))
        return float(vals.abs().sum(dtype=torch.float64)) if vals.numel() else 0.0

    def _decode_into(self, meta, buf, numel, out):
        vals, idx = self._unpack(buf, numel, out.device)
        out.zero_()
        out.index_put_((idx,), vals.to(out.dtype))

    def _decode_add(self, meta, buf, numel, acc, weight, base):
        vals, idx = self._unpack(buf, numel, acc.device)
        if base is not None and base.data_ptr() != acc.data_ptr():
            acc.copy_(base)
        acc.index_add_(0, idx, vals.to(acc.dtype), alpha=weight)
