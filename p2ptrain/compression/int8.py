"""Blockwise absmax int8: 1 byte per value plus one float32 scale per ``block`` values.

Per block b of ``block`` consecutive values (the last block may be shorter):
``scale_b = absmax_b / 127``, ``q = round(x / scale_b)`` in [-127, 127], ``dec = q * scale_b``.

Error bound: |dec - x| <= absmax_b / 254 (half a quantisation step) up to float32 rounding
(relative slack ~1e-6). Blocks with absmax_b < 2**-100 (~7.9e-31) are quantised as if their absmax
were 2**-100 (abs error < 2**-100; an all-zero block still decodes to zeros): it keeps 1/scale
finite with one clamp instead of masking such blocks out, and such values are noise for any
float32 training run.

Scales are float32, not float16: fp16 scales would underflow for blocks with absmax < ~1e-5*127
(small gradients are common) and overflow above 65504*127; float32 costs 4 bytes per 256 values
(1.6 % of the payload, ratio 3.94x instead of 3.97x vs float32 input).

Wire layout (the float32 part first so it is 4-byte aligned whenever the buffer is):
``[scales: float32 x ceil(numel/block)][q: int8 x numel]``.

NaN/inf never needs a separate pass: the per-block absmax propagates NaN and inf, so the check is
a reduction over ceil(numel/block) scales.

On CPU, float32 work goes to the fused one-pass kernels of :mod:`.kernels` when they are built;
torch ops otherwise and on a device (``devices``): the same float32 operations in the same order,
so the same wire bytes and decoded values, decode-add included (a multiply, then an add: no fused
multiply-add), on every device.
"""

from __future__ import annotations

from typing import Any

import torch

from . import kernels
from .base import BufferLike, Codec, CompressionError, Encoded, abs_max, as_uint8, frombuffer, scratch

__all__ = ["Int8Codec"]

_TINY = 2.0**-100
_INF = float("inf")
_MAX_SCALE = torch.finfo(torch.float32).max / 127
_NONFINITE = "int8: input chunk contains NaN or inf; refusing to encode it"


class Int8Codec(Codec):
    name = "int8"
    uses_out = True
    encode_checks_finite = True  # the block absmaxes propagate NaN/inf: no separate pass
    encode_total = True  # the block scales absorb any finite value
    devices = frozenset({"cpu", "cuda"})

    def __init__(self, block: int = 256, **kw):
        super().__init__(**kw)
        if not (isinstance(block, int) and 8 <= block <= 1 << 16):
            raise ValueError("int8 block must be an int in [8, 65536]")
        self.block = block

    def _opts_repr(self) -> str:
        return f"block={self.block}"

    def _extra_meta_keys(self):
        return {"block": int}

    def _meta(self, chunk, **extra):
        return super()._meta(chunk, block=self.block, **extra)

    def n_blocks(self, numel: int) -> int:
        return -(-int(numel) // self.block)

    def encoded_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return 4 * self.n_blocks(numel) + int(numel)

    # ------------------------------------------------------------------ encode
    def _parts(self, numel: int):
        """(start, stop, rows, cols, first_block) for the full blocks and the short tail block."""
        B = self.block
        nfull = numel // B
        parts = []
        if nfull:
            parts.append((0, nfull * B, nfull, B, 0))
        if numel - nfull * B:
            parts.append((nfull * B, numel, 1, numel - nfull * B, nfull))
        return parts

    def _encode(self, chunk: torch.Tensor, out: torch.Tensor | None = None, scale: float = 1.0) -> Encoded:
        return self._encode_into(chunk, out, scale, None)

    def _encode_decoded(self, chunk: torch.Tensor, out: torch.Tensor | None, scale: float,
                        decoded: torch.Tensor) -> Encoded:
        return self._encode_into(chunk, out, scale, decoded)

    def _encode_into(self, chunk: torch.Tensor, out: torch.Tensor | None, scale: float,
                     decoded: torch.Tensor | None) -> Encoded:
        # With the kernels (CPU): one pass, ``decoded`` written in it too; else ``_encode_blocks``.
        n = chunk.numel()
        dev = chunk.device
        if chunk.dtype == torch.float32:
            x = chunk
        else:
            x = scratch("int8.x32", n, torch.float32, dev)
            x.copy_(chunk)
        nb = self.n_blocks(n)
        # One wire buffer, scales then values: the message leaves as one frame and arrives as one
        # zero-copy view (two buffers meant a second, small frame per chunk and a copy on receipt
        # to join them).
        wire = out[: 4 * nb + n] if out is not None else torch.empty(4 * nb + n, dtype=torch.uint8, device=dev)
        scales = wire[: 4 * nb].view(torch.float32)
        q = wire[4 * nb :].view(torch.int8)
        fused = None  # ``decoded``, where the kernel writes it in the encode's own pass
        if kernels.AVAILABLE and dev.type == "cpu":  # one pass, the same bytes
            if decoded is not None and decoded.dtype == torch.float32 and decoded.device == dev:
                fused = decoded
            if not kernels.encode(x, self.block, scale, scales, q, fused):
                raise CompressionError(_NONFINITE)
        else:
            self._encode_blocks(x, scale, scales, q)
            self._refuse(scales)
        enc = Encoded(self._meta(chunk), [as_uint8(wire)])  # from a GPU: one copy of the compressed bytes
        if decoded is not None and fused is None:  # torch path, or a float16/bfloat16/CUDA ``decoded``
            self._decode_into(enc.meta, memoryview(enc.buffers[0].numpy()), n, decoded)
        return enc

    def _encode_blocks(self, x: torch.Tensor, scale: float, scales: torch.Tensor, q: torch.Tensor) -> None:
        """The torch path of the encode (a device, or no kernels): float32 ``x`` into ``scales``,
        ``q``; a NaN/inf in ``x`` leaves a NaN/inf scale (``_refuse``), checked after it, so a device
        never waits mid-encode."""
        # Passes over the chunk: amax + amin (read), x * inv -> float scratch, round in place, cast
        # into q. Temporaries come from the per-thread scratch (no fresh 4 MiB per chunk). The
        # per-block work is as few small ops as it can be: offloaded, each one is a dispatch that
        # waits for the GIL the event loop's Python holds (and, with cryptography before 50, its
        # AES-GCM too). Divisions are by tensors: CUDA divides by a Python number as a multiply by
        # its reciprocal, which is not the kernels' (or the CPU's) division.
        n, dev = x.numel(), x.device
        tmp = scratch("int8.enc", min(n, self.block * (n // self.block)) or n, torch.float32, dev)
        for start, stop, rows, cols, b0 in self._parts(n):
            xb = x[start:stop].view(rows, cols)
            t = tmp[: stop - start].view(rows, cols)
            # amax and amin (aminmax(dim=1) is much slower on CPU): no |x| temporary, NaN/inf
            # propagate into absmax
            hi = torch.amax(xb, dim=1)
            absmax = torch.maximum(hi, torch.amin(xb, dim=1).neg_(), out=hi)  # NaN/inf propagate
            step = absmax.clamp_min_(_TINY).div_(torch.full_like(absmax, 127.0))  # in [2**-100 / 127, fmax / 127]
            # q is the same for x * scale (scale-invariant): only the block scales take ``scale``
            torch.mul(step, scale, out=scales[b0 : b0 + rows])
            # 1 / step stays a normal float (a reciprocal of absmax itself would be subnormal for
            # absmax > 2**126, and zero where denormals are flushed)
            torch.mul(xb, step.reciprocal_().unsqueeze(1), out=t)
            t.round_()
            q[start:stop].view(rows, cols).copy_(t)

    @staticmethod
    def _refuse(scales: torch.Tensor) -> None:
        """Raise CompressionError if an encode's (host) ``scales`` show a NaN/inf input: the block
        absmaxes propagate them, and a finite chunk's scales are at most float32 max / 127."""
        if scales.numel() and not abs_max(scales) < _INF:  # NaN compares false
            raise CompressionError(_NONFINITE)

    def _device_wire(self, chunk, scale, decoded):
        n, dev = chunk.numel(), chunk.device
        x = chunk if chunk.dtype == torch.float32 else scratch("int8.x32", n, torch.float32, dev).copy_(chunk)
        nb = self.n_blocks(n)
        wire = scratch("int8.wire", 4 * nb + n, torch.uint8, dev)
        scales, q = wire[: 4 * nb].view(torch.float32), wire[4 * nb :].view(torch.int8)
        self._encode_blocks(x, scale, scales, q)
        if decoded is not None:
            self._decode_blocks(scales, q, decoded)
        return wire, None

    def _device_refuse(self, chunk, wire, probe, scale):
        self._refuse(wire[: 4 * self.n_blocks(chunk.numel())].view(torch.float32))

    def _device_decode(self, meta, buf, wire, numel, acc, weight, base, tx):
        nb = self.n_blocks(numel)
        if nb and (weight is None or self.check_finite_on_decode):  # (as ``_unpack`` checks)
            self._scales_max(frombuffer(buf, torch.float32, 0, nb))
        scales, q = wire[: 4 * nb].view(torch.float32), wire[4 * nb :].view(torch.int8)
        if weight is None:
            self._decode_blocks(scales, q, acc)
        else:
            self._add_blocks(scales, q, weight, acc if base is None else base, acc)

    # ------------------------------------------------------------------ decode
    def _scales_max(self, scales: torch.Tensor) -> float:
        """Validate received block scales and return the largest: an honest encoder sends
        0 <= scale = absmax/127 <= float32 max/127; a larger scale would decode to inf, NaN
        compares false."""
        smin, smax = torch.aminmax(scales)
        hi = float(smax)
        if not (float(smin) >= 0.0 and hi <= _MAX_SCALE):
            raise CompressionError(
                "int8: received scales contain NaN, inf, negative or out-of-range values; rejecting the message"
            )
        return hi

    def _unpack(self, buf, numel: int, device: torch.device, check: bool = True):
        nb = self.n_blocks(numel)
        scales = frombuffer(buf, torch.float32, 0, nb)
        q = frombuffer(buf, torch.int8, 4 * nb, numel)
        if nb and check:
            self._scales_max(scales)
        if device.type != "cpu":
            scales, q = scales.to(device), q.to(device)
        return scales, q

    def _add_bound(self, meta, buf, numel):
        # validates the scales: a receiver that called this may decode with check_finite_on_decode off
        return 128.0 * self._scales_max(frombuffer(buf, torch.float32, 0, self.n_blocks(numel)))  # |q| <= 128

    def _decode_into(self, meta, buf, numel, out):
        # int8 * float32 would cast q into a fresh float32 temporary: cast straight into ``out``
        # instead, then scale in place (float32 out), or go through the per-thread scratch.
        scales, q = self._unpack(buf, numel, out.device)
        if kernels.AVAILABLE and out.dtype == torch.float32 and out.device.type == "cpu":
            kernels.decode(scales, q, self.block, out, self.stream_decoded)
            return
        self._decode_blocks(scales, q, out)

    def _decode_blocks(self, scales: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> None:
        """The torch path of the decode: ``out = q * scale`` per block, on ``out``'s device."""
        numel = q.numel()
        f32 = out if out.dtype == torch.float32 else scratch("int8.dec", numel, torch.float32, out.device)
        f32.copy_(q)
        for start, stop, rows, cols, b0 in self._parts(numel):
            f32[start:stop].view(rows, cols).mul_(scales[b0 : b0 + rows].unsqueeze(1))
        if f32 is not out:
            out.copy_(f32)

    @staticmethod
    def _kernel_adds(acc: torch.Tensor, src: torch.Tensor) -> bool:
        """Whether ``acc = src + ...`` goes to the compiled kernels (CPU float32, contiguous)."""
        return (kernels.AVAILABLE and acc.dtype == src.dtype == torch.float32 and acc.device.type == "cpu"
                and src.is_contiguous())

    def _decode_add_base(self, meta, buf, numel, acc, weight, base):
        if self._kernel_adds(acc, base):
            scales, q = self._unpack(buf, numel, acc.device, check=self.check_finite_on_decode)
            return kernels.decode_add_max(scales, q, self.block, weight, base, acc)
        return super()._decode_add_base(meta, buf, numel, acc, weight, base)

    def fuses_add_encode(self, reply: Codec) -> bool:
        # the compiled kernels, and a reply in this very format
        return kernels.AVAILABLE and type(reply) is type(self) and reply.block == self.block

    def decode_add_encode(self, meta: Any, buffer: BufferLike, acc: torch.Tensor, weight: float, scale: float,
                          out: torch.Tensor) -> tuple[torch.Tensor | None, float]:
        # one pass with the kernels (the two calls' bits)
        if not self._kernel_adds(acc, acc):
            return super().decode_add_encode(meta, buffer, acc, weight, scale, out)
        numel, mv, weight = self._check_add(meta, buffer, acc, weight, acc)
        nb = self.n_blocks(numel)
        wire = out[: 4 * nb + numel]
        if not numel:
            return wire, 0.0
        scales, q = self._unpack(mv, numel, acc.device, check=self.check_finite_on_decode)
        own, ok = kernels.decode_add_encode(scales, q, self.block, weight, acc, acc, scale,
                                            wire[: 4 * nb].view(torch.float32), wire[4 * nb :].view(torch.int8))
        return (wire if ok else None), own

    def _decode_add(self, meta, buf, numel, acc, weight, base):
        # check_finite_on_decode off: the caller validated this buffer with add_bound (the scale
        # range is the only way an int8 message decodes to inf or NaN)
        scales, q = self._unpack(buf, numel, acc.device, check=self.check_finite_on_decode)
        src = acc if base is None else base
        if self._kernel_adds(acc, src):
            kernels.decode_add(scales, q, self.block, weight, src, acc)
            return
        self._add_blocks(scales, q, weight, src, acc)

    def _add_blocks(self, scales: torch.Tensor, q: torch.Tensor, weight: float, src: torch.Tensor,
                    acc: torch.Tensor) -> None:
        """The torch path of the decode-add, ``acc = src + q * (scale * weight)`` per block: the
        kernel's float32 operations in its order (a multiply, then an add), so the same bits."""
        if weight != 1.0:  # (a float32 multiply, as the kernel's; by 1 it is exact)
            scales = scales * weight
        qf = scratch("int8.dec", q.numel(), torch.float32, acc.device)
        qf.copy_(q)  # an int8 operand would be cast into a fresh temporary
        for start, stop, rows, cols, b0 in self._parts(q.numel()):
            qf[start:stop].view(rows, cols).mul_(scales[b0 : b0 + rows].unsqueeze(1))
        torch.add(src, qf, out=acc)
