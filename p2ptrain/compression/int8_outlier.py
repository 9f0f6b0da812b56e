"""Blockwise int8 that keeps each block's largest values exact: ``int8-outlier``.

Why: plain blockwise int8 (:mod:`.int8`) sets a block's step from its largest |value|, so one
outlier in a block of 256 makes the step coarse for the other 255. Heavy-tailed tensors (the
gradients and pseudo-gradients of large models have outlier features) lose most of their
resolution that way. This codec sends the ``outliers`` largest-|value| entries of every block as
exact float32 values with their position in the block, and quantises the rest with a step set by
the largest value left (the ``outliers + 1``-th largest |value|), as LLM.int8() does with
outlier features.

Per block of ``block`` values (the last may be shorter): the ``k = outliers`` largest |x| are
kept exactly (all of them when the block has at most ``k`` values); the others quantise as in
``int8`` with ``step = r / 127``, r the largest |x| among them: ``q = round(x / step)``, and
``q = 0`` at the outliers' positions.

Error bound: outliers exact (up to the ``scale`` argument's rounding); others
``|dec - x| <= r / 254`` up to float32 rounding, with r clamped to >= 2**-100 as in ``int8``.
Lower error than ``int8`` on heavy-tailed updates, for a few % more bytes and a slower encode (a
``torch.topk`` per block; figures in benchmarks/README.md, "Codecs"). For slow links and
heavy-tailed updates; ``int8`` on fast ones.

Wire layout (float32 parts first, 4-byte aligned whenever the buffer is)::

    [scales: float32 x nb][outlier values: float32 x nb*k][positions: uint8 x nb*k][q: int8 x numel]

Blocks of at most 256 values, so a position fits one byte. Padding slots (a short last block with
fewer than ``k`` values) hold value 0 at position 0: decoding adds the outliers in
(``scatter_add``), so padding adds nothing and a hostile repeated position cannot do more than
``add_bound`` allows for. Validation: scales as ``int8``; outlier values finite; every position
inside its block.
"""

from __future__ import annotations

import torch

from .base import Codec, CompressionError, Encoded, abs_max, as_uint8, frombuffer, scratch
from .int8 import _INF, _TINY, Int8Codec

__all__ = ["Int8OutlierCodec"]


class Int8OutlierCodec(Int8Codec):
    name = "int8-outlier"

    def __init__(self, block: int = 256, outliers: int = 2, **kw):
        super().__init__(block=block, **kw)
        if block > 256:
            raise ValueError("int8-outlier block must be at most 256 (positions are one byte)")
        if not (isinstance(outliers, int) and not isinstance(outliers, bool) and 1 <= outliers < block):
            raise ValueError(f"int8-outlier outliers must be an int in [1, block), got {outliers!r}")
        self.outliers = outliers

    def _opts_repr(self) -> str:
        return f"block={self.block}, outliers={self.outliers}"

    def _extra_meta_keys(self):
        return {"block": int, "outliers": int}

    def _meta(self, chunk, **extra):
        return super()._meta(chunk, outliers=self.outliers, **extra)

    def encoded_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        nb = self.n_blocks(numel)
        return 4 * nb + 5 * nb * self.outliers + int(numel)

    def _layout(self, buf, numel: int):
        """Views of the four wire parts (scales, outlier values, positions, q) of ``buf``."""
        nb, k = self.n_blocks(numel), self.outliers
        o_val, o_pos, o_q = 4 * nb, 4 * nb + 4 * nb * k, 4 * nb + 5 * nb * k
        if isinstance(buf, torch.Tensor):
            return (buf[:o_val].view(torch.float32), buf[o_val:o_pos].view(torch.float32),
                    buf[o_pos:o_q], buf[o_q : o_q + numel].view(torch.int8))
        return (frombuffer(buf, torch.float32, 0, nb), frombuffer(buf, torch.float32, o_val, nb * k),
                frombuffer(buf, torch.uint8, o_pos, nb * k), frombuffer(buf, torch.int8, o_q, numel))

    # ------------------------------------------------------------------ encode
    # Int8Codec's one-pass encode-and-decode is plain int8's: decode our own bytes instead
    _encode_decoded = Codec._encode_decoded
    _decode_add_base = Codec._decode_add_base  # (int8's fused kernels know nothing of outliers)
    decode_add_encode = Codec.decode_add_encode
    fuses_add_encode = Codec.fuses_add_encode
    encode_checks_finite = False  # (not claimed for its own encode)
    devices = frozenset()  # (int8's device path knows nothing of outliers)

    def _encode(self, chunk: torch.Tensor, out: torch.Tensor | None = None, scale: float = 1.0) -> Encoded:
        n, dev, k = chunk.numel(), chunk.device, self.outliers
        x = chunk if chunk.dtype == torch.float32 else scratch("int8.x32", n, torch.float32, dev).copy_(chunk)
        nbytes = self.encoded_nbytes(n)
        wire = out[:nbytes] if out is not None else torch.empty(nbytes, dtype=torch.uint8, device=dev)
        scales, vals, pos, q = self._layout(wire, n)
        tmp = scratch("int8.enc", min(n, self.block * (n // self.block)) or n, torch.float32, dev)
        for start, stop, rows, cols, b0 in self._parts(n):
            xb = x[start:stop].view(rows, cols)
            t = tmp[: stop - start].view(rows, cols)
            # NaN/inf first, with one min/max pass (NaN propagates through it; topk's ordering of
            # NaN is not something to rely on)
            if not abs_max(xb) < _INF:
                raise CompressionError("int8-outlier: input chunk contains NaN or inf; refusing to encode it")
            kk = min(k, cols)
            top = torch.topk(torch.abs(xb, out=t), min(k + 1, cols), dim=1)  # descending |x|
            idx = top.indices[:, :kk]
            rest = top.values[:, k] if cols > k else torch.zeros(rows, device=dev)
            step = rest.clamp_min_(_TINY).div_(127.0)
            torch.mul(step, scale, out=scales[b0 : b0 + rows])
            v = vals[b0 * k : (b0 + rows) * k].view(rows, k)
            p = pos[b0 * k : (b0 + rows) * k].view(rows, k)
            if kk < k:  # a short last block: padding slots add 0 at position 0
                v.zero_()
                p.zero_()
            torch.mul(xb.gather(1, idx), scale, out=v[:, :kk])
            p[:, :kk].copy_(idx)
            torch.mul(xb, step.reciprocal_().unsqueeze(1), out=t)
            t.round_().clamp_(-127.0, 127.0).scatter_(1, idx, 0.0)  # outliers travel exactly, not in q
            q[start:stop].view(rows, cols).copy_(t)
        return Encoded(self._meta(chunk), [as_uint8(wire)])

    # ------------------------------------------------------------------ decode
    def _checked(self, buf, numel: int, check: bool = True):
        """The wire parts, validated: positions always (a bad one would fail the scatter with
        another exception than CompressionError), scales and outlier values unless ``check`` is
        off (``add_bound`` ran already). Also the largest scale and |outlier| (0 unchecked)."""
        scales, vals, pos, q = self._layout(buf, numel)
        k = self.outliers
        for _start, _stop, rows, cols, b0 in self._parts(numel):
            if cols < 256 and int(pos[b0 * k : (b0 + rows) * k].max()) >= cols:
                raise CompressionError("int8-outlier: an outlier position lies outside its block; "
                                       "rejecting the message")
        hi = vmax = 0.0
        if check and numel:
            hi = self._scales_max(scales)
            lo, top = torch.aminmax(vals)
            vmax = max(-float(lo), float(top))
            if not vmax < _INF:  # NaN compares false
                raise CompressionError("int8-outlier: received outlier values contain NaN or inf; "
                                       "rejecting the message")
        return scales, vals, pos, q, hi, vmax

    def _add_bound(self, meta, buf, numel):
        # |q| <= 128 at every position, plus every outlier of the block landing on the same one
        _s, _v, _p, _q, hi, vmax = self._checked(buf, numel)
        return 128.0 * hi + self.outliers * vmax

    def _decode_into(self, meta, buf, numel, out):
        scales, vals, pos, q, _hi, _vmax = self._checked(buf, numel)
        f32 = out if out.dtype == torch.float32 else scratch("int8.dec", numel, torch.float32, out.device)
        f32.copy_(q)
        self._apply(f32, scales, vals, pos, numel, 1.0, None)
        if f32 is not out:
            out.copy_(f32)

    def _decode_add(self, meta, buf, numel, acc, weight, base):
        scales, vals, pos, q, _hi, _vmax = self._checked(buf, numel, check=self.check_finite_on_decode)
        qf = scratch("int8.dec", numel, torch.float32, acc.device)
        qf.copy_(q)
        self._apply(acc, scales, vals, pos, numel, weight, acc if base is None else base, qf)

    def _apply(self, dst, scales, vals, pos, numel, weight, src, qf=None):
        """``dst = q * scale * weight (+ src)``, then the outliers (times ``weight``) added in.
        Without ``src``, ``dst`` holds q already and is scaled in place."""
        k, dev = self.outliers, dst.device
        if dev.type != "cpu":
            scales, vals, pos = scales.to(dev), vals.to(dev), pos.to(dev)
            qf = qf.to(dev) if qf is not None else None
        if weight != 1.0:
            scales, vals = scales * weight, vals * weight
        for start, stop, rows, cols, b0 in self._parts(numel):
            s = scales[b0 : b0 + rows].unsqueeze(1)
            d = dst[start:stop].view(rows, cols)
            if src is None:
                d.mul_(s)
            else:
                torch.addcmul(src[start:stop].view(rows, cols), qf[start:stop].view(rows, cols), s, out=d)
            idx = pos[b0 * k : (b0 + rows) * k].view(rows, k).long()
            d.scatter_add_(1, idx, vals[b0 * k : (b0 + rows) * k].view(rows, k))
