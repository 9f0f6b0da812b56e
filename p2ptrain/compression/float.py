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

Device paths (CPU and CUDA): the cast and the add are the CPU codec's torch ops on the device (a
cast rounds to nearest even everywhere; the add with ``weight`` is ``base + weight * x`` in float32,
one fused rounding where the CPU's vector lanes and CUDA fuse it, exact for ``weight`` 1).
"""

from __future__ import annotations

import torch

from .base import DTYPES, Codec, CompressionError, Encoded, abs_max, as_uint8, check_finite, frombuffer, scratch
from .device import Transfer

__all__ = ["NoneCodec", "Float16Codec", "BFloat16Codec"]


class _CastCodec(Codec):
    wire_dtype: torch.dtype | None = None  # None: the chunk's own dtype
    #: inputs with |x| >= overflow raise (they would round to inf in the wire dtype)
    overflow: float = float("inf")
    devices = frozenset({"cpu", "cuda"})

    def encoded_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return int(numel) * self._wire(dtype).itemsize  # (no tensor per call: it is per chunk)

    def _wire(self, dtype: torch.dtype) -> torch.dtype:
        return self.wire_dtype or dtype

    def _encode(self, chunk: torch.Tensor, out: torch.Tensor | None = None, scale: float = 1.0) -> Encoded:
        wd = self._wire(chunk.dtype)
        if chunk.numel():
            if self._ranged(chunk.dtype):
                # one reduction catches NaN (propagates through amax), inf and out-of-range values
                self._refuse(chunk.dtype, float(_absmax(chunk)), scale)
            else:
                check_finite(chunk, f"{self.name}: input chunk")
        if chunk.dtype == wd and scale == 1.0:
            wire = chunk
        else:
            n = chunk.numel()
            wire = out[: n * wd.itemsize].view(wd) if out is not None else torch.empty(n, dtype=wd, device=chunk.device)
            self._cast(chunk, scale, wire)
        return Encoded(self._meta(chunk), [as_uint8(wire)])

    def _ranged(self, dtype: torch.dtype) -> bool:
        """Whether a chunk of ``dtype`` may hold finite values beyond the wire dtype's range."""
        return dtype != self._wire(dtype) and self.overflow != float("inf")

    def _refuse(self, dtype: torch.dtype, amax: float, scale: float) -> None:
        """Raise CompressionError where a ``dtype`` chunk with max |x| ``amax`` does not encode."""
        if not self._ranged(dtype):
            if not amax < float("inf"):  # NaN compares false
                raise CompressionError(f"{self.name}: input chunk contains NaN or inf; refusing to encode/average it")
            return
        amax *= scale
        if not amax < self.overflow:
            if amax != amax or amax == float("inf"):
                raise CompressionError(f"{self.name}: input chunk contains NaN or inf; refusing to encode it")
            raise CompressionError(
                f"{self.name}: input chunk has |x| = {amax:.6g} >= {self.overflow:.6g}, beyond the "
                f"{self._wire(dtype)} range; use the 'bf16' or 'int8' codec (or scale the values)"
            )

    def _cast(self, chunk: torch.Tensor, scale: float, wire: torch.Tensor) -> torch.Tensor:
        """``chunk * scale`` cast into ``wire`` (a multiply while cast: one pass)."""
        return wire.copy_(chunk) if scale == 1.0 else torch.mul(chunk, scale, out=wire)

    def _device_wire(self, chunk, scale, decoded):
        n, wd = chunk.numel(), self._wire(chunk.dtype)
        probe = _absmax(chunk) if n else None
        wire = chunk
        if chunk.dtype != wd or scale != 1.0:
            wire = self._cast(chunk, scale, scratch("cast.wire", n, wd, chunk.device))
        if decoded is not None:
            decoded.copy_(wire)
        return wire, probe

    def _device_refuse(self, chunk, wire, probe, scale):
        if probe is not None:
            self._refuse(chunk.dtype, probe, scale)

    def _device_decode(self, meta, buf, wire, numel, acc, weight, base, tx: Transfer):
        x = wire.view(self._wire(_meta_dtype(meta)))
        if self.check_finite_on_decode and numel and not tx.item(_absmax(x)) < float("inf"):
            raise CompressionError(f"{self.name}: received payload contains NaN or inf; rejecting the message")
        if weight is None:
            acc.copy_(x)
        else:
            self._add(x, acc, weight, base)

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
        self._add(self._payload(meta, buf, numel, acc.device), acc, weight, base)

    @staticmethod
    def _add(x: torch.Tensor, acc: torch.Tensor, weight: float, base: torch.Tensor | None) -> None:
        if x.dtype != acc.dtype:
            # a mixed-dtype add would cast x into a fresh full-size temporary: cast into scratch
            x = scratch("cast.dec", x.numel(), acc.dtype, acc.device).copy_(x)
        torch.add(acc if base is None else base, x, alpha=weight, out=acc)


def _absmax(x: torch.Tensor) -> torch.Tensor:
    """max |x| of a non-empty tensor as a 0-dim tensor on its device: max(amax, -amin), no |x|
    temporary, NaN propagates through both."""
    return torch.maximum(x.amax(), x.amin().neg_())


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
