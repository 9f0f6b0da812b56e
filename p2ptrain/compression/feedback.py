"""Error feedback: carry what a lossy codec dropped into the next round.

``ErrorFeedback(codec)`` keeps one float32 residual per ``key`` (a tensor/chunk identifier chosen by
the caller, e.g. ``(param_group, chunk_index)``). ``encode(chunk, key)`` encodes
``chunk + residual[key]`` and stores ``residual[key] = (chunk + residual[key]) - decoded``. Hence,
over R rounds, ``sum(decoded_r) == sum(chunk_r) - residual_R`` (up to float32 rounding of the
additions): nothing is lost, only delayed.

It has the codec interface (decode/decode_add/encoded_nbytes delegate to the wrapped codec), so the
all-reduce can use it wherever it uses a codec. Not thread-safe per key.
"""

from __future__ import annotations

from typing import Any, Hashable

import torch

from .base import BufferLike, Codec, Encoded, check_finite, dtype_name, out_buffer

__all__ = ["ErrorFeedback"]


class ErrorFeedback(Codec):
    def __init__(self, codec: Codec):
        super().__init__(max_numel=codec.max_numel, check_finite_on_decode=codec.check_finite_on_decode)
        self.codec = codec
        self.name = codec.name
        self._residuals: dict[Hashable, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.codec!r}, keys={len(self._residuals)})"

    # ------------------------------------------------------------------ state
    def residual(self, key: Hashable = None) -> torch.Tensor | None:
        return self._residuals.get(key)

    def reset(self, key: Hashable | None = ..., /) -> None:  # type: ignore[assignment]
        """Forget the residual of ``key``, or of every key when called without one (e.g. after
        loading fresh state from peers)."""
        if key is ...:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)

    @property
    def state_nbytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self._residuals.values())

    # ------------------------------------------------------------------ codec interface
    def encode(self, chunk: torch.Tensor, key: Any = None, *, out: torch.Tensor | None = None,
               scale: float = 1.0, decoded: torch.Tensor | None = None) -> Encoded:
        self._check_chunk(chunk)
        if decoded is not None:
            self._check_out(decoded, chunk.numel())
        if scale != 1.0:  # the residual would carry scaled and unscaled values mixed
            raise ValueError("ErrorFeedback encodes unscaled chunks only (scale must be 1)")
        out = out_buffer(self, chunk, out)
        check_finite(chunk, f"{self.name}: input chunk")  # never fold NaN/inf into the residual
        r = self._residuals.get(key)
        if r is None or r.shape != chunk.shape or r.device != chunk.device:
            r = chunk.to(torch.float32, copy=True)
            self._residuals[key] = r
        else:
            r.add_(chunk)
        # with ``decoded``: what a receiver gets, written by the inner codec (int8: in its encode's pass)
        enc = self.codec._encode(r, out) if decoded is None else self.codec._encode_decoded(r, out, 1.0, decoded)
        enc.meta["dtype"] = dtype_name(chunk.dtype)
        self._subtract_sent(enc, r)
        return enc

    def _subtract_sent(self, enc: Encoded, r: torch.Tensor) -> None:
        idx = enc.local.get("indices")
        if idx is not None:  # top-k with float32 values: what was sent is exactly r[idx]
            r.index_fill_(0, idx, 0.0)
        else:
            self.codec.decode_add(enc.meta, enc.tobytes(), r, -1.0)

    def encoded_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return self.codec.encoded_nbytes(numel, dtype)

    def decode(self, meta: Any, buffer: BufferLike, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.codec.decode(meta, buffer, out)

    def add_bound(self, meta: Any, buffer: BufferLike) -> float:
        return self.codec.add_bound(meta, buffer)

    def decode_add(self, meta: Any, buffer: BufferLike, acc: torch.Tensor, weight: float = 1.0,
                   base: torch.Tensor | None = None) -> torch.Tensor:
        return self.codec.decode_add(meta, buffer, acc, weight, base)

    def decode_add_base(self, meta: Any, buffer: BufferLike, acc: torch.Tensor, weight: float,
                        base: torch.Tensor) -> float:
        return self.codec.decode_add_base(meta, buffer, acc, weight, base)
