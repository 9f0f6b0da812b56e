"""The codec interface: a sans-IO transform between a flat tensor chunk and raw wire bytes.

A codec never touches a socket. ``encode`` turns a flat, contiguous 1-D float chunk (float32, float16
or bfloat16; CPU or CUDA) into an :class:`Encoded`: a list of raw byte buffers (1-D ``uint8`` CPU
tensors, zero-copy views where possible) plus a small msgpack-able ``meta`` dict. The transport
writes the buffers back to back; the receiver hands the concatenated bytes and the meta to
``decode`` / ``decode_add``, which validate both strictly before touching a single element.

Wire sizes are a pure function of ``numel`` (and, for the ``none`` codec, of the dtype), see
:meth:`Codec.encoded_nbytes`: a receiver can preallocate its receive buffer and reject a peer's
message by its size alone.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Union

import torch

from ..errors import P2PTrainError
from . import kernels
from .device import Transfer

__all__ = [
    "CompressionError",
    "Codec",
    "Encoded",
    "BufferLike",
    "DTYPES",
    "DTYPE_NAMES",
    "DEFAULT_MAX_NUMEL",
    "abs_max",
    "dtype_name",
    "iter_chunks",
]

BufferLike = Union[bytes, bytearray, memoryview]

#: dtypes a chunk may have, by the name that goes into ``meta["dtype"]``.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

#: Largest chunk a decoder accepts unless told otherwise (2**28 values = 1 GiB of float32). The
#: all-reduce sends chunks of about 1M values; this bound only stops a hostile ``numel``.
DEFAULT_MAX_NUMEL = 1 << 28


class CompressionError(P2PTrainError, ValueError):
    """Raised for any input a codec refuses: NaN/inf on encode, or a malformed/hostile message on
    decode (wrong meta, wrong buffer size, out-of-range indices, non-finite scales...)."""


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise CompressionError(
            f"unsupported dtype {dtype}; chunks must be one of {sorted(DTYPES)}"
        ) from None


@dataclass
class Encoded:
    """One encoded chunk: ``buffers`` go on the wire back to back, ``meta`` goes in the header.

    Every buffer is a contiguous 1-D ``torch.uint8`` CPU tensor (``memoryview(t.numpy())`` is
    zero-copy) or ``bytes``. Buffers may alias the input chunk (``none`` codec, or fp16 input to the
    ``fp16`` codec): send them before the chunk is modified.
    """

    meta: dict[str, Any]
    buffers: list[Any] = field(default_factory=list)
    #: sender-side extras that never go on the wire (e.g. top-k indices still on the device)
    local: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(b) for b in self.buffers)

    def memoryviews(self) -> list[memoryview]:
        """Zero-copy memoryviews of the buffers, ready for ``writer.write`` / ``sendmsg``."""
        return [b if isinstance(b, memoryview) else memoryview(b.numpy() if isinstance(b, torch.Tensor) else b)
                for b in self.buffers]

    def tobytes(self) -> bytes:
        """All buffers concatenated (one copy; convenient for tests and small messages)."""
        return b"".join(bytes(m) for m in self.memoryviews())


def _nbytes(b: Any) -> int:
    if isinstance(b, torch.Tensor):
        return b.numel() * b.element_size()
    return memoryview(b).nbytes


def as_uint8(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as a flat uint8 CPU tensor: a zero-copy view on CPU, one D2H copy on CUDA."""
    t = t.reshape(-1).view(torch.uint8)
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t


def out_buffer(codec: Codec, chunk: torch.Tensor, out: torch.Tensor | None,
               staged: bool = False) -> torch.Tensor | None:
    """``encode``'s ``out`` checked (a 1-D contiguous uint8 CPU tensor that can take the chunk's
    wire bytes; ValueError if not), or None where it does not apply (no out, a CUDA chunk that is
    not ``staged``: encoded by ``device_encode``, whose wire bytes ``out`` receives)."""
    if out is None:
        return None
    nbytes = codec.encoded_nbytes(chunk.numel(), chunk.dtype)
    if not (isinstance(out, torch.Tensor) and out.dtype == torch.uint8 and out.device.type == "cpu"
            and out.dim() == 1 and out.is_contiguous() and out.numel() >= nbytes):
        raise ValueError(f"out must be a 1-D contiguous uint8 CPU tensor of at least {nbytes} bytes")
    return out if staged or chunk.device.type == "cpu" else None


#: whether torch has spent its one "buffer is not writable" warning (TORCH_WARN_ONCE: per process)
_READONLY_WARNED = False


def frombuffer(buf: BufferLike, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
    """A read-only-in-spirit tensor view of ``count`` ``dtype`` values at byte ``offset`` of ``buf``.

    ``torch.frombuffer`` warns about a read-only buffer (bytes, a received frame); those are
    wrapped without copying and the result is never written to. torch warns once per process, so
    only the first read-only buffer goes through ``warnings.catch_warnings`` (which swaps the
    process-wide filters: ~10 us, and not thread-safe, on every one of a round's chunks).
    """
    global _READONLY_WARNED
    if count == 0:
        return torch.empty(0, dtype=dtype)
    if _READONLY_WARNED or not memoryview(buf).readonly:
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer" - we never write to it
        t = torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)
    _READONLY_WARNED = True
    return t


class Codec:
    """Base class. Subclasses set ``name`` and implement ``_encode``, ``_decode_into``,
    ``_decode_add`` and ``encoded_nbytes``.

    Codecs are stateless (safe to share between tensors and threads) except :class:`ErrorFeedback`.
    ``check_finite_on_decode=False`` skips a decoder's own NaN/inf checks (fp16/bf16's pass over the
    values, top-k's, int8's scale range): for a receiver that already ran ``add_bound`` on the same
    buffer, which validates the same thing from the wire data.
    """

    name: str = "?"
    #: True when decode(encode(x)) == x bit for bit (given x has the wire dtype).
    lossless: bool = False
    #: True when ``encode`` writes its wire bytes into ``out`` when given one
    uses_out: bool = False
    #: True when ``encode`` refuses NaN/inf in the same pass that reads the chunk: the all-reduce
    #: then reads nothing up front (what it keeps is checked by ``decode_add_base``; see
    #: averaging/reducer.py)
    encode_checks_finite: bool = False
    #: A hint, not an option of the format: ``decode`` writes its output with streaming stores,
    #: around the cache, where the codec has such a kernel (int8 on x86-64). For a caller whose
    #: output nobody reads again before it would have left the cache anyway (an all-reduce result
    #: in a tensor larger than the last-level cache: ``kernels.stream_worthwhile``); it saves the
    #: read of each written line. Set on a copy of the codec (codecs are shared).
    stream_decoded: bool = False
    #: True when the wire bytes of a float32 chunk are its values themselves (``none``): a receiver
    #: may read them in place and a sender may send views of its tensor
    wire_is_values: bool = False
    #: True when ``encode`` never fails on finite float32 values (no overflow to a narrower type):
    #: an all-reduce owner may then sum into its own values in place
    encode_total: bool = False
    #: device types on which ``device_encode`` / ``device_decode`` / ``device_decode_add`` run the
    #: codec in torch ops on the tensor's own device, with the CPU codec's wire bytes and decoded
    #: values; ``encode`` / ``decode`` / ``decode_add`` take them for tensors on such a device other
    #: than the CPU. Without one, a device chunk is encoded on its device and its wire copied over.
    devices: frozenset[str] = frozenset()

    def __init__(self, *, max_numel: int = DEFAULT_MAX_NUMEL, check_finite_on_decode: bool = True):
        if not (isinstance(max_numel, int) and max_numel >= 0):
            raise ValueError("max_numel must be a non-negative int")
        self.max_numel = max_numel
        self.check_finite_on_decode = check_finite_on_decode

    # ------------------------------------------------------------------ public API
    def encode(self, chunk: torch.Tensor, key: Any = None, *, out: torch.Tensor | None = None,
               scale: float = 1.0, decoded: torch.Tensor | None = None) -> Encoded:
        """Encode a flat contiguous 1-D float chunk. Raises CompressionError on NaN/inf input.

        ``key`` identifies the chunk for stateful codecs (error feedback); stateless codecs ignore it.
        ``out``: a 1-D contiguous uint8 CPU tensor of at least ``encoded_nbytes`` bytes that a codec
        with one wire buffer writes into instead of allocating one, so a caller that encodes chunk
        after chunk can take turns with a few buffers (a fresh buffer per chunk costs a page fault
        per 4 KiB on first touch). The result then aliases ``out``. Ignored by codecs that send a
        CPU chunk itself (``none``) or several buffers (``topk``), and for device chunks of codecs
        without a device path; a device path (``devices``) copies every codec's bytes into it.

        ``scale`` (0 < scale <= 1): encode ``chunk * scale`` without a separate pass over the
        chunk, e.g. the division of a weighted mean folded into the encode of the sum (``int8``
        rescales its block scales; cast codecs multiply while they cast). At most 1, so it
        cannot overflow what a finite chunk encodes to.

        ``decoded``: a flat float tensor of the chunk's size (it may be the chunk itself) that gets
        what a receiver will decode from the result, e.g. for an all-reduce owner that must hold
        exactly the values it sends the others. ``int8`` writes it in the same pass as the encode;
        other codecs decode their own output.
        """
        self._check_chunk(chunk)
        if self._on_device(chunk):
            return self.device_encode(chunk, out=out, scale=scale, decoded=decoded)
        scale = _scale(scale)
        out = out_buffer(self, chunk, out)
        if decoded is None:
            return self._encode(chunk, out, scale)
        self._check_out(decoded, chunk.numel())
        return self._encode_decoded(chunk, out, scale, decoded)

    def encoded_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Exact number of wire bytes for a chunk of ``numel`` values (``dtype`` matters only for ``none``)."""
        raise NotImplementedError

    def decode(self, meta: Any, buffer: BufferLike, out: torch.Tensor | None = None) -> torch.Tensor:
        """Validate ``meta`` and ``buffer`` and decode them; into ``out`` when given (a flat tensor of
        ``meta["numel"]`` float values, any float dtype/device, e.g. a slice of an accumulator).
        Raises CompressionError (only) for anything malformed."""
        numel, dtype, mv = self._validate(meta, buffer)
        if out is None:
            out = torch.empty(numel, dtype=dtype)
        else:
            self._check_out(out, numel)
        if self._on_device(out):
            self._staged(meta, mv, numel, out, None, None)
        else:
            self._decode_into(meta, mv, numel, out)
        return out

    def decode_add(self, meta: Any, buffer: BufferLike, acc: torch.Tensor, weight: float = 1.0,
                   base: torch.Tensor | None = None) -> torch.Tensor:
        """``acc += weight * decode(meta, buffer)`` without a full-size temporary where the codec allows.

        ``acc`` is a flat float tensor (float32 recommended) of ``meta["numel"]`` values. A message
        that fails validation leaves ``acc`` untouched. With ``base`` (same shape, may be ``acc``
        itself): ``acc = base + weight * decode(...)`` instead, in one pass over memory where the
        codec allows; it starts an accumulator from one's own values without a separate copy."""
        numel, mv, weight = self._check_add(meta, buffer, acc, weight, base)
        if self._on_device(acc):
            self._staged(meta, mv, numel, acc, weight, base)
        else:
            self._decode_add(meta, mv, numel, acc, weight, base)
        return acc

    def decode_add_base(self, meta: Any, buffer: BufferLike, acc: torch.Tensor, weight: float,
                        base: torch.Tensor) -> float:
        """``decode_add(meta, buffer, acc, weight, base=base)``, returning max |base| (inf or NaN if
        ``base`` holds inf or NaN), measured in the same pass where the codec allows (int8 with its
        compiled kernels). Why: an all-reduce owner starts each chunk's sum from its own values,
        and this read is then their only check, instead of a pass over its whole shard before the
        round. The message is validated first as in ``decode_add``, but ``acc`` is written
        whatever ``base`` holds: the caller checks the result. ``base`` is ``acc`` itself or does
        not overlap it."""
        numel, mv, weight = self._check_add(meta, buffer, acc, weight, base)
        if not numel:
            return 0.0
        if self._on_device(acc):
            own = abs_max(base)
            self._staged(meta, mv, numel, acc, weight, base)
            return own
        return self._decode_add_base(meta, mv, numel, acc, weight, base)

    # ------------------------------------------------------------------ device paths
    def device_encode(self, chunk: torch.Tensor, *, out: torch.Tensor | None = None, scale: float = 1.0,
                      decoded: torch.Tensor | None = None) -> Encoded:
        """``encode`` in torch ops on ``chunk``'s own device (one of ``devices``; on the CPU it is
        how tests check this path): the same wire bytes as ``encode`` on the CPU. Only they cross
        to the host, into ``out`` (a uint8 CPU tensor; pinned, the copy is asynchronous) or a fresh
        pinned buffer, and they are complete when this returns. ``decoded`` stays on its device."""
        self._check_chunk(chunk)
        self._check_device(chunk.device)
        scale = _scale(scale)
        out = out_buffer(self, chunk, out, staged=True)
        if decoded is not None:
            self._check_out(decoded, chunk.numel())
        with Transfer(chunk.device) as tx:
            wire, probe = self._device_wire(chunk, scale, decoded)
            host = tx.to_host(wire, out)
            seen = None if probe is None else tx.to_host(probe.reshape(1).float()).view(torch.float32)
        self._device_refuse(chunk, host, None if seen is None else float(seen), scale)
        return Encoded(self._meta(chunk), [host])

    def device_decode(self, meta: Any, buffer: BufferLike, out: torch.Tensor) -> torch.Tensor:
        """``decode`` into ``out`` in torch ops on its device (one of ``devices``): only the wire
        bytes cross to it. The values and errors of ``decode``; ``out`` is untouched on an error."""
        numel, _dtype, mv = self._validate(meta, buffer)
        self._check_out(out, numel)
        self._check_device(out.device)
        self._staged(meta, mv, numel, out, None, None)
        return out

    def device_decode_add(self, meta: Any, buffer: BufferLike, acc: torch.Tensor, weight: float = 1.0,
                          base: torch.Tensor | None = None) -> torch.Tensor:
        """``decode_add`` in torch ops on ``acc``'s device (one of ``devices``): the same float32
        operations in the same order as on the CPU (int8: as its compiled kernel), only the wire
        bytes cross."""
        numel, mv, weight = self._check_add(meta, buffer, acc, weight, base)
        self._check_device(acc.device)
        self._staged(meta, mv, numel, acc, weight, base)
        return acc

    def _on_device(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a non-CPU tensor this codec's device path serves."""
        return t.device.type != "cpu" and t.device.type in self.devices

    def _check_device(self, device: torch.device) -> None:
        if device.type not in self.devices:
            raise CompressionError(f"{self.name}: no device path for {device.type} tensors "
                                   f"(this codec serves {sorted(self.devices) or 'none'})")

    def _staged(self, meta: dict, buf: memoryview, numel: int, acc: torch.Tensor, weight: float | None,
                base: torch.Tensor | None) -> None:
        with Transfer(acc.device) as tx:
            wire = tx.to_device(frombuffer(buf, torch.uint8, 0, buf.nbytes))
            self._device_decode(meta, buf, wire, numel, acc, weight, base, tx)

    def fuses_add_encode(self, reply: Codec) -> bool:
        """True when ``decode_add_encode`` with ``reply`` as the reply's codec runs as one pass (the
        same bits as the two calls, at less memory traffic); False where it would just chain them."""
        return False

    def decode_add_encode(self, meta: Any, buffer: BufferLike, acc: torch.Tensor, weight: float, scale: float,
                          out: torch.Tensor) -> tuple[torch.Tensor | None, float]:
        """``decode_add_base(meta, buffer, acc, weight, acc)``, then ``encode(acc, out=out,
        scale=scale, decoded=acc)``: an all-reduce owner's last contribution to a chunk and the
        chunk's reply, in one pass over ``acc`` where the codec allows (int8 with its compiled
        kernels; the same bits as the two calls). Returns (the reply's wire bytes, a prefix of the
        uint8 ``out``, or None if the sum does not encode (NaN/inf); max |acc| before the add). The
        message is validated as in ``decode_add``; ``acc`` is written whatever it held: the caller
        checks the max."""
        own = self.decode_add_base(meta, buffer, acc, weight, acc)
        try:
            enc = self.encode(acc, out=out, scale=scale, decoded=acc)
        except CompressionError:
            return None, own
        bufs = enc.buffers
        if len(bufs) == 1 and isinstance(bufs[0], torch.Tensor) and bufs[0].data_ptr() == out.data_ptr():
            return bufs[0], own
        # a codec that does not encode into ``out`` (``none``'s wire bytes are ``acc`` itself;
        # ``encode`` checked that ``out`` holds them)
        wire = torch.frombuffer(bytearray(enc.tobytes()), dtype=torch.uint8)
        return out[: wire.numel()].copy_(wire), own

    def _check_add(self, meta: Any, buffer: BufferLike, acc: torch.Tensor, weight: float,
                   base: torch.Tensor | None) -> tuple[int, memoryview, float]:
        numel, _dtype, mv = self._validate(meta, buffer)
        self._check_out(acc, numel)
        if base is not None and base.shape != acc.shape:
            raise ValueError(f"base has shape {list(base.shape)}, acc {list(acc.shape)}")
        weight = float(weight)
        if not math.isfinite(weight):
            raise CompressionError(f"weight must be finite, got {weight}")
        return numel, mv, weight

    def add_bound(self, meta: Any, buffer: BufferLike) -> float:
        """An upper bound on what ``decode_add(meta, buffer, acc, 1.0)`` can add to any one value of
        ``acc``, from a pass over the (small) wire data, not the decoded values: a receiver checks
        that a weighted contribution cannot overflow its float32 sum before the sum takes it.
        Validates like ``decode``; raises CompressionError (only) for anything malformed or
        non-finite."""
        numel, _dtype, mv = self._validate(meta, buffer)
        bound = float(self._add_bound(meta, mv, numel)) if numel else 0.0
        if not bound < float("inf"):  # NaN compares false
            raise CompressionError(f"{self.name}: received values contain NaN or inf; rejecting the message")
        return bound

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._opts_repr()})"

    def _opts_repr(self) -> str:
        return ""

    # ------------------------------------------------------------------ hooks
    def _encode(self, chunk: torch.Tensor, out: torch.Tensor | None = None, scale: float = 1.0) -> Encoded:
        raise NotImplementedError

    def _decode_into(self, meta: dict, buf: memoryview, numel: int, out: torch.Tensor) -> None:
        raise NotImplementedError

    def _encode_decoded(self, chunk: torch.Tensor, out: torch.Tensor | None, scale: float,
                        decoded: torch.Tensor) -> Encoded:
        # generic: encode, then decode our own bytes (codecs that can do both in one pass override it)
        enc = self._encode(chunk, out, scale)
        bufs = enc.memoryviews()
        self._decode_into(enc.meta, bufs[0] if len(bufs) == 1 else memoryview(b"".join(bufs)), chunk.numel(), decoded)
        return enc

    def _add_bound(self, meta: dict, buf: memoryview, numel: int) -> float:
        # generic: decode and measure (codecs override it with a pass over their wire data)
        tmp = torch.empty(numel, dtype=torch.float32)
        self._decode_into(meta, buf, numel, tmp)
        return abs_max(tmp)

    def _decode_add(self, meta: dict, buf: memoryview, numel: int, acc: torch.Tensor, weight: float,
                    base: torch.Tensor | None) -> None:
        tmp = torch.empty(numel, dtype=torch.float32, device=acc.device)
        self._decode_into(meta, buf, numel, tmp)  # validates before acc is touched
        torch.add(acc if base is None else base, tmp, alpha=weight, out=acc)

    def _decode_add_base(self, meta: dict, buf: memoryview, numel: int, acc: torch.Tensor, weight: float,
                         base: torch.Tensor) -> float:
        # generic: measure, then add (two passes; int8 fuses them)
        m = abs_max(base)
        self._decode_add(meta, buf, numel, acc, weight, base)
        return m

    def _device_wire(self, chunk: torch.Tensor, scale: float,
                     decoded: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The wire bytes of ``chunk * scale`` (a contiguous tensor on its device, read only until
        the next call) and a value the encode's checks need (``_device_refuse``), if any, on the
        device; ``decoded`` written on the way."""
        raise NotImplementedError

    def _device_refuse(self, chunk: torch.Tensor, wire: torch.Tensor, probe: float | None, scale: float) -> None:
        """Raise CompressionError where ``encode`` refuses ``chunk``, from its host wire bytes and
        ``_device_wire``'s probe."""
        raise NotImplementedError

    def _device_decode(self, meta: dict, buf: memoryview, wire: torch.Tensor, numel: int, acc: torch.Tensor,
                       weight: float | None, base: torch.Tensor | None, tx: Transfer) -> None:
        """Validate the payload (``buf`` on the host, ``wire`` the same bytes on ``acc``'s device),
        then decode it into ``acc`` (``weight`` None) or add it as ``decode_add`` does."""
        raise NotImplementedError

    def _extra_meta_keys(self) -> dict[str, type]:
        """Codec-specific meta keys and their types (validated to equal this codec's settings)."""
        return {}

    def _meta(self, chunk: torch.Tensor, **extra: Any) -> dict[str, Any]:
        return {"codec": self.name, "numel": int(chunk.numel()), "dtype": dtype_name(chunk.dtype), **extra}

    # ------------------------------------------------------------------ validation
    def _check_chunk(self, chunk: torch.Tensor) -> None:
        if not isinstance(chunk, torch.Tensor):
            raise CompressionError(f"{self.name}: expected a torch.Tensor, got {type(chunk).__name__}")
        dtype_name(chunk.dtype)
        if chunk.dim() != 1 or not chunk.is_contiguous():
            raise CompressionError(
                f"{self.name}: expected a flat contiguous 1-D chunk, got shape {tuple(chunk.shape)}"
                f" (contiguous={chunk.is_contiguous()}); use tensor.reshape(-1) / iter_chunks()"
            )
        if chunk.numel() > self.max_numel:
            raise CompressionError(f"{self.name}: chunk of {chunk.numel()} values exceeds max_numel={self.max_numel}")

    def _check_out(self, out: torch.Tensor, numel: int) -> None:
        if not isinstance(out, torch.Tensor):
            raise CompressionError(f"{self.name}: out must be a torch.Tensor, got {type(out).__name__}")
        if out.dim() != 1 or out.numel() != numel or not out.is_contiguous():
            raise CompressionError(
                f"{self.name}: out must be a contiguous 1-D tensor of {numel} values, got shape {tuple(out.shape)}"
            )
        if out.dtype not in DTYPE_NAMES:
            raise CompressionError(f"{self.name}: out dtype {out.dtype} is not one of {sorted(DTYPES)}")

    def _validate(self, meta: Any, buffer: Any) -> tuple[int, torch.dtype, memoryview]:
        if not isinstance(meta, dict):
            raise CompressionError(f"{self.name}: meta must be a dict, got {type(meta).__name__}")
        expected = {"codec": str, "numel": int, "dtype": str, **self._extra_meta_keys()}
        if set(meta) != set(expected):
            raise CompressionError(
                f"{self.name}: meta keys {sorted(map(repr, meta))} != expected {sorted(map(repr, expected))}"
            )
        for k, typ in expected.items():
            v = meta[k]
            if typ is int and (isinstance(v, bool) or not isinstance(v, int)):
                raise CompressionError(f"{self.name}: meta[{k!r}] must be an int, got {type(v).__name__}")
            if typ is float and not isinstance(v, float):
                raise CompressionError(f"{self.name}: meta[{k!r}] must be a float, got {type(v).__name__}")
            if typ is str and not isinstance(v, str):
                raise CompressionError(f"{self.name}: meta[{k!r}] must be a str, got {type(v).__name__}")
        if meta["codec"] != self.name:
            raise CompressionError(f"{self.name}: message was encoded with codec {meta['codec']!r:.40}")
        numel = meta["numel"]
        if not 0 <= numel <= self.max_numel:
            raise CompressionError(f"{self.name}: numel={numel} outside [0, max_numel={self.max_numel}]")
        dtype = DTYPES.get(meta["dtype"])
        if dtype is None:
            raise CompressionError(f"{self.name}: unknown dtype {meta['dtype']!r:.40}; "
                                   f"expected one of {sorted(DTYPES)}")
        for k in self._extra_meta_keys():
            mine = getattr(self, k)
            if meta[k] != mine:
                raise CompressionError(
                    f"{self.name}: peer used {k}={meta[k]!r:.40}, this codec is configured with {k}={mine!r}"
                )
        try:
            mv = memoryview(buffer)
        except TypeError:
            raise CompressionError(f"{self.name}: buffer must be bytes-like, got {type(buffer).__name__}") from None
        if mv.ndim != 1 or mv.itemsize != 1 or not mv.c_contiguous:
            mv = mv.cast("B") if mv.c_contiguous else memoryview(mv.tobytes())
        want = self.encoded_nbytes(numel, dtype)
        if mv.nbytes != want:
            raise CompressionError(
                f"{self.name}: buffer has {mv.nbytes} bytes, expected {want} for numel={numel} dtype={meta['dtype']}"
            )
        return numel, dtype, mv


# ---------------------------------------------------------------------- helpers used by codecs


def _scale(scale: float) -> float:
    scale = float(scale)
    if not 0.0 < scale <= 1.0:
        raise ValueError(f"scale must be in (0, 1], got {scale}")
    return scale


#: Per-thread scratch buffers (see :func:`scratch`). Thread-local, so codecs stay safe to share between
#: threads (the all-reduce calls codecs from ONE worker thread at a time, plus the event-loop thread
#: for small rounds; each thread gets its own buffers).
_TLS = threading.local()
#: Chunks larger than this many values get a fresh temporary instead (bounds the cached memory).
SCRATCH_MAX_NUMEL = 1 << 24


def scratch(tag: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable temporary of ``numel`` ``dtype`` values on ``device``, cached per thread and ``tag``.

    A fresh 4 MiB temporary per 1M-value chunk costs ~1000 page faults (glibc hands large blocks
    back to the OS); reusing one does not. The result is only valid until the next ``scratch`` call
    with the same ``tag`` in the same thread: codecs use it for internal temporaries only, never for
    anything they return (wire buffers, decoded outputs).
    """
    if numel > SCRATCH_MAX_NUMEL:
        return torch.empty(numel, dtype=dtype, device=device)
    bufs = getattr(_TLS, "bufs", None)
    if bufs is None:
        bufs = _TLS.bufs = {}
    key = (tag, dtype, device)
    t = bufs.get(key)
    if t is None or t.numel() < numel:
        t = bufs[key] = torch.empty(numel, dtype=dtype, device=device)
    return t[:numel]


def abs_max(x: torch.Tensor) -> float:
    """The largest |value| of a non-empty tensor from one min/max pass (no |x| temporary); NaN
    when it holds a NaN, which propagates through both. Contiguous float32 CPU tensors go to the
    compiled kernel when it is built (one integer max over the bits: a round's NaN/inf check of
    its whole input)."""
    if kernels.AVAILABLE and x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous():
        return kernels.absmax(x)
    lo, hi = torch.aminmax(x)
    return max(-float(lo), float(hi))


def check_finite(x: torch.Tensor, what: str) -> None:
    """Raise CompressionError if ``x`` holds a NaN or an inf.

    Fast path: a float32 sum (one streaming pass, no temporaries) is finite iff every element is,
    except when finite values overflow the sum; only then the exact (slower) isfinite pass runs.
    """
    if x.numel() == 0:
        return
    if x.dtype != torch.float32:
        # half/bfloat16: min/max in the input dtype (exact, NaN propagates; a float32 sum would
        # first cast the whole chunk into a temporary)
        if abs_max(x) < float("inf"):  # NaN compares false
            return
        raise CompressionError(f"{what} contains NaN or inf; refusing to encode/average it")
    if math.isfinite(float(x.sum())):  # (a Python float: no scalar-tensor op to dispatch)
        return
    if not bool(torch.isfinite(x).all()):
        raise CompressionError(f"{what} contains NaN or inf; refusing to encode/average it")


def iter_chunks(tensor: torch.Tensor, chunk_numel: int = 1 << 20) -> Iterator[torch.Tensor]:
    """Flat contiguous views of ``tensor`` (no copy when it is contiguous), ``chunk_numel`` values each
    (the last may be shorter): what the all-reduce feeds to ``encode`` so compression of chunk i+1
    overlaps the network transfer of chunk i."""
    if chunk_numel <= 0:
        raise ValueError("chunk_numel must be positive")
    flat = tensor.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    for start in range(0, flat.numel(), chunk_numel):
        yield flat[start : start + chunk_numel]
