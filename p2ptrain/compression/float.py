"""Cast codecs: ``none`` (raw, lossless), ``fp16`` and ``bf16``.

Error bounds (round to nearest even, per element x; u = unit roundoff):

* ``none``: exact. The wire dtype is the chunk's own dtype (so ``encoded_nbytes`` takes a dtype).
* ``fp16``: |dec - x| <= 2**-11 * |x| for |x| >= 2**-14 (normal range), and <= 2**-25 below it
  (subnormals; |x| < 2**-25 may flush to 0). |x| >= 65520 (which would round to inf) raises
  CompressionError rather than being clamped: silently clamping a gradient changes its direction,
  the caller should pick ``bf16``/``int8`` (or scale) instead.
* ``bf16``: |dec - x| <= 2**-8 * |x| for |x| >= 2**-126; same exponent range as float32, so only
  values within half an ulp of float32 max (>= (2 - 2**-8) * 2**127, which round to inf) raise.

NaN/inf input always raises CompressionError. On decode, a payload holding NaN/inf (a hostile or
broken peer) raises CompressionError too (``check_finite_on_decode``, on by default: one fast pass).
"""

from __future__ import annotations

import torch

from .base import DTYPES, Codec, CompressionError, Encoded, abs_max, as_uint8, check_finite, frombuffer, scratch

__all__ = ["NoneCodec", "Float16Codec", "BFloat16Codec"]


class _CastCodec(Codec):
    wire_dtype: torch.dtype | None = None  # None: the chunk's own dtype
    #: inputs with |x| >= overflow raise (they would round to inf in the wire dtype)
    overflow: float = float("inf")

    def encoded_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return int(numel) * self._wire(dtype).itemsize  # (no tensor per call: it is per chunk)

    def _wire(self, dtype: torch.dtype) -> torch.dtype:
        return self.wire_dtype or dtype

    def _encode(self, chunk: torch.Tensor, out: torch.Tensor | None = None, scale: float = 1.0) -> Encoded:
        wd = self._wire(chunk.dtype)
        if chunk.numel():
            if chunk.dtype != wd and self.overflow != float("inf"):
                # one reduction catches NaN (propagates through amax), inf and out-of-range values
                # max(amax, -amin): no |x| temporary (NaN propagates through both)
                amax = float(torch.maximum(chunk.amax(), chunk.amin().neg_())) * scale
                if not amax < self.overflow:
                    if amax != amax or amax == float("inf"):
                        raise CompressionError(f"{self.name}: input chunk contains NaN or inf; refusing to encode it")
                    raise CompressionError(
                        f"{self.name}: input chunk has |x| = {amax:.6g} >= {self.overflow:.6g}, beyond the "
                        f"{wd} range; use the 'bf16' or 'int8' codec (or scale the values)"
                    )
            else:
                check_finite(chunk, f"{self.name}: input chunk")
        if chunk.dtype == wd and scale == 1.0:
            wire = chunk
        else:
            n = chunk.numel()
            wire = out[: n * wd.itemsize].view(wd) if out is not None else torch.empty(n, dtype=wd, device=chunk.device)
            if scale == 1.0:
                wire.copy_(chunk)
            else:  # multiplied while cast: one pass
                torch.mul(chunk, scale, out=wire)
        return Encoded(self._meta(chunk), [as_uint8(wire)])

    def _payload(self, meta: dict, buf: memoryview, numel: int, device: torch.device) -> torch.Tensor:
        wd = self._wire(_meta_dtype(meta))
        x = frombuffer(buf, wd, 0, numel)
        if self.check_finite_on_decode:
            try:
                check_finite(x, f"{self.name}: received payload")
            except CompressionError as e:
                raise CompressionError(str(e).replace("refusing to encode/average it",
                                                      "rejecting the message")) from None
        if device.type != "cpu":
            x = x.to(device, non_blocking=False)
        return x

    def _add_bound(self, meta, buf, numel):
        # min/max in the wire dtype: one pass, no temporary, NaN propagates (checked by add_bound)
        return abs_max(frombuffer(buf, self._wire(_meta_dtype(meta)), 0, numel))

    def _decode_into(self, meta, buf, numel, out):
        out.copy_(self._payload(meta, buf, numel, out.device))

    def _decode_add(self, meta, buf, numel, acc, weight, base):
        x = self._payload(meta, buf, numel, acc.device)
        if x.dtype != acc.dtype:
            # a mixed-dtype add would cast x into a fresh full-size temporary: cast into scratch
            x = scratch("cast.dec", numel, acc.dtype, acc.device).copy_(x)
        torch.add(acc if base is None else base, x, alpha=weight, out=acc)


def _meta_dtype(meta: dict) -> torch.dtype:
    return DTYPES[meta["dtype"]]  # (validated by Codec._validate before any codec hook runs)


class NoneCodec(_CastCodec):
    """No compression: the chunk's raw bytes (a zero-copy view on CPU)."""

    name = "none"
    lossless = True
    wire_is_values = True
    encode_total = True


class Float16Codec(_CastCodec):
    """IEEE half precision on the wire (2 bytes/value)."""

    name = "fp16"
    wire_dtype = torch.float16
    uses_out = True
    overflow = 65520.0  # (2 - 2**-11) * 2**15: the smallest value that rounds to inf in fp16


class BFloat16Codec(_CastCodec):
    """bfloat16 on the wire (2 bytes/value, float32's exponent range)."""

    name = "bf16"
    wire_dtype = torch.bfloat16
    uses_out = True
    overflow = (2 - 2**-8) * 2.0**127  # smallest float32 that rounds to inf in bf16
