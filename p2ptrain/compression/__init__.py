"""Compression codecs for the averaging subsystem (sans-IO: tensors in, raw bytes out).

>>> codec = get_codec("int8")                     # or "none", "fp16", "bf16", "int8-outlier", "topk"
>>> enc = codec.encode(chunk)                     # chunk: flat contiguous 1-D float tensor
>>> wire = enc.memoryviews()                      # raw buffers, written back to back
>>> codec.encoded_nbytes(chunk.numel())           # == enc.nbytes: preallocate / validate size
>>> codec.decode(enc.meta, received_bytes, out=acc_slice)        # or:
>>> codec.decode_add(enc.meta, received_bytes, acc_slice, weight=0.5)

Every malformed or hostile message raises :class:`CompressionError` (never another exception, never
a large allocation before the sizes check out); NaN/inf input to ``encode`` raises it too.
See each module's docstring for the codec's error bound.
"""

from __future__ import annotations

from typing import Any, Callable

from .base import DEFAULT_MAX_NUMEL, DTYPES, Codec, CompressionError, Encoded, iter_chunks
from .feedback import ErrorFeedback
from .float import BFloat16Codec, Float16Codec, NoneCodec
from .int8 import Int8Codec
from .int8_outlier import Int8OutlierCodec
from .topk import TopKCodec

__all__ = [
    "CODECS",
    "Codec",
    "CompressionError",
    "DEFAULT_MAX_NUMEL",
    "DTYPES",
    "Encoded",
    "ErrorFeedback",
    "BFloat16Codec",
    "Float16Codec",
    "Int8Codec",
    "Int8OutlierCodec",
    "NoneCodec",
    "TopKCodec",
    "get_codec",
    "iter_chunks",
]


def _topk(error_feedback: bool = True, **opts: Any) -> Codec:
    codec = TopKCodec(**opts)
    return ErrorFeedback(codec) if error_feedback else codec


_FACTORIES: dict[str, Callable[..., Codec]] = {
    "none": NoneCodec,
    "fp16": Float16Codec,
    "bf16": BFloat16Codec,
    "int8": Int8Codec,
    "int8-outlier": Int8OutlierCodec,
    "topk": _topk,
}

#: codec names accepted by :func:`get_codec`
CODECS: tuple[str, ...] = tuple(_FACTORIES)


def get_codec(name: str, **opts: Any) -> Codec:
    """A codec by name. Options: every codec takes ``max_numel`` and ``check_finite_on_decode``;
    ``int8`` takes ``block`` (default 256); ``int8-outlier`` takes ``block`` (default 256, at most 256) and
    ``outliers`` (values per block sent exactly, default 2); ``topk`` takes ``fraction`` (default 0.01) and
    ``error_feedback`` (default True: returns a stateful :class:`ErrorFeedback`, one per model/averager;
    pass ``key=`` to ``encode``)."""
    try:
        factory = _FACTORIES[name]
    except (KeyError, TypeError):
        raise CompressionError(f"unknown codec {name!r}; choose one of {', '.join(CODECS)}") from None
    try:
        return factory(**opts)
    except (TypeError, ValueError) as e:  # an unknown option, or a value out of range
        raise CompressionError(f"bad options for codec {name!r}: {e}") from None
