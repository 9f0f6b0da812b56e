"""The int8 codec's optional compiled kernels (``_int8_kernels.c``), behind checked wrappers.

Why they exist: on loopback or any link faster than a core can run torch's five-pass int8 encode,
the codec's memory passes, not the network, are an int8 round's time. Each kernel here is one pass
(measured in ``benchmarks/allreduce_bench.py`` and README, "Averaging"). The extension is built by
``pip install`` where a C compiler is present; without it, or with ``P2PT_KERNELS=0`` in the
environment (to compare, or to rule the kernels out), ``AVAILABLE`` is False and callers use their
torch path, which encodes and decodes to the same bits.

The C functions take raw addresses; these wrappers are the only callers and check what C cannot:
device, dtype, contiguity and sizes. Every kernel releases the GIL, so on a many-core host a call
over ``SPLIT_MIN`` values or more is split into parts run at once on a few threads (``THREADS``),
each part a whole number of blocks, which gives the same bits as one call (``set_threads``).
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["AVAILABLE", "COPY_PIECE", "SPLIT_MIN", "absmax", "copy_finite", "encode", "decode", "decode_add",
           "decode_add_max", "decode_add_encode", "set_threads", "stream_worthwhile", "threads"]

_K = None
if os.environ.get("P2PT_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off"):
    try:
        from . import _int8_kernels as _K  # type: ignore[no-redef]
    except ImportError:  # not built here (no C compiler at install): the torch paths serve
        _K = None

#: whether the compiled kernels are loaded (and not switched off with ``P2PT_KERNELS=0``)
AVAILABLE: bool = _K is not None
#: ``copy_finite`` checks and copies this many values at a time (0 without the kernels)
COPY_PIECE: int = _K.COPY_PIECE if _K is not None else 0
#: this CPU runs the streaming-store twins of ``decode`` and ``copy_finite`` (x86-64 with AVX2)
CAN_STREAM: bool = bool(_K.CAN_STREAM) if _K is not None else False


def _llc_bytes() -> int:
    """The size of this CPU's largest cache (Linux sysfs); 32 MiB where it cannot be read."""
    base, best = "/sys/devices/system/cpu/cpu0/cache", 0
    try:
        for d in os.listdir(base):
            if d.startswith("index"):
                with open(os.path.join(base, d, "size")) as f:
                    text = f.read().strip().upper()
                mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
                best = max(best, int(text.rstrip("KMG")) * mult)
    except (OSError, ValueError):
        pass
    return best or 32 << 20


#: outputs larger than this (the last-level cache) are worth streaming stores (``stream_worthwhile``)
STREAM_MIN_BYTES: int = _llc_bytes()


def stream_worthwhile(nbytes: int) -> bool:
    """Whether results written into a tensor of ``nbytes`` should go around the cache
    (``stream=True``): only where the tensor is larger than the last-level cache, so that what is
    written leaves the cache before anyone reads it again anyway. Smaller tensors keep plain stores:
    their next reader (the caller's copy back into parameters) finds them in the cache."""
    return CAN_STREAM and nbytes > STREAM_MIN_BYTES


# ---------------------------------------------------------------- big calls split across threads

#: calls over at least this many values are split (where ``threads()`` > 1): a part of 64K values or
#: more outweighs the ~20 us a hand-off to another thread costs
SPLIT_MIN = 1 << 18
#: parts start at multiples of this many values (whole ``COPY_PIECE`` pieces) ...
_GRAIN = 4096
#: ... or of this many blocks (the groups whose scales the encode computes together)
_GROUP = 16
_T = TypeVar("_T")


def _default_threads() -> int:
    """``P2PT_KERNEL_THREADS`` if set, else 2-4 from 4 usable CPUs up (a quarter of them), else 1:
    on fewer cores the other threads only compete with the event loop and the round's worker."""
    env = os.environ.get("P2PT_KERNEL_THREADS", "").strip()
    if env:
        return max(1, int(env))
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return min(4, max(2, cpus // 4)) if cpus >= 4 else 1


class _Splitter:
    """The threads that run all parts of a split call but the first (which its caller runs): one
    small pool per process, as torch keeps its own; made on first use, idle threads cost nothing."""

    def __init__(self, threads: int):
        self.threads = threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def parts(self, n: int, grain: int) -> list[tuple[int, int]] | None:
        """``[start, end)`` of each part of an ``n``-value call, or None to make one call."""
        if self.threads <= 1 or n < SPLIT_MIN:
            return None
        per = -(-n // self.threads)
        per = -(-per // grain) * grain
        return [(a, min(n, a + per)) for a in range(0, n, per)]

    def run(self, fn: Callable[[int, int], _T], parts: list[tuple[int, int]]) -> list[_T]:
        """``fn(start, end)`` of every part, all at once; the results in part order. Returns only
        when every part is done (they write the caller's tensors), even if one raised."""
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self.threads - 1, "p2pt-kernel")
            pool = self._pool
        futures = [pool.submit(fn, a, b) for a, b in parts[1:]]
        try:
            first = fn(*parts[0])
        finally:
            concurrent.futures.wait(futures)
        return [first] + [f.result() for f in futures]

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


_split = _Splitter(_default_threads())


def threads() -> int:
    """How many threads a big kernel call runs on (1: calls are not split)."""
    return _split.threads


def set_threads(n: int | None) -> None:
    """Split big calls over ``n`` threads from now on (1: never; None: the default, see
    ``P2PT_KERNEL_THREADS``); for tests and benchmarks. Not while a call runs."""
    global _split
    old, _split = _split, _Splitter(_default_threads() if n is None else max(1, n))
    old.shutdown()


def _max_of(values: list[float]) -> float:
    """The max of per-part maxima as one call over the whole would return it (NaN if any is)."""
    return math.nan if any(v != v for v in values) else max(values)


def _need(t: torch.Tensor, dtype: torch.dtype, numel: int, what: str) -> int:
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() or t.numel() < numel:
        raise ValueError(f"{what}: need a contiguous CPU {dtype} tensor of >= {numel} values, got "
                         f"{t.dtype} {t.device} {tuple(t.shape)}")
    return t.data_ptr()


def _overlap(a: int, b: int, nbytes: int, nbytes_b: int | None = None) -> bool:
    """Whether the ``nbytes`` at address ``a`` and those at ``b`` (``nbytes_b`` of them if given)
    share any byte."""
    return a < b + (nbytes if nbytes_b is None else nbytes_b) and b < a + nbytes


def absmax(x: torch.Tensor) -> float:
    """max |x| of a contiguous float32 CPU tensor in one pass; inf/nan if it holds inf/NaN."""
    p, n = _need(x, torch.float32, 0, "absmax"), x.numel()
    parts = _split.parts(n, _GRAIN)
    if parts is None:
        return _K.absmax(p, n)
    return _max_of(_split.run(lambda a, b: _K.absmax(p + 4 * a, b - a), parts))


def encode(x: torch.Tensor, block: int, scale: float, scales: torch.Tensor, q: torch.Tensor,
           dec: torch.Tensor | None = None) -> bool:
    """Blockwise int8 encode of float32 ``x`` into ``scales`` (float32, one per block, times
    ``scale``) and ``q`` (int8); with ``dec``, also what a receiver decodes, in the same pass
    (``dec`` may be ``x``). False, with the outputs partly written, if ``x`` holds NaN or inf."""
    n = x.numel()
    px, ps, pq = (_need(x, torch.float32, n, "encode x"), _need(scales, torch.float32, -(-n // block), "encode scales"),
                  _need(q, torch.int8, n, "encode q"))
    pd = 0 if dec is None else _need(dec, torch.float32, n, "encode dec")
    parts = _split.parts(n, _GROUP * block)
    if parts is None:
        return _K.encode(px, n, block, scale, ps, pq, pd)
    return all(_split.run(lambda a, b: _K.encode(px + 4 * a, b - a, block, scale, ps + 4 * (a // block), pq + a,
                                                 pd and pd + 4 * a), parts))


def decode(scales: torch.Tensor, q: torch.Tensor, block: int, out: torch.Tensor, stream: bool = False) -> None:
    """``out = q * scale`` per block (``out`` float32, ``q.numel()`` values); ``stream``: with
    streaming stores where the CPU has them (see ``stream_worthwhile``), the same values."""
    n = q.numel()
    ps, pq = _need(scales, torch.float32, -(-n // block), "decode scales"), _need(q, torch.int8, n, "decode q")
    po = _need(out, torch.float32, n, "decode out")
    parts = _split.parts(n, _GROUP * block)
    if parts is None:
        _K.decode(ps, pq, n, block, po, stream)
    else:
        _split.run(lambda a, b: _K.decode(ps + 4 * (a // block), pq + a, b - a, block, po + 4 * a, stream), parts)


def decode_add(scales: torch.Tensor, q: torch.Tensor, block: int, weight: float, src: torch.Tensor,
               out: torch.Tensor) -> None:
    """``out = src + q * (scale * weight)`` per block; ``src`` may be ``out``."""
    n = q.numel()
    _decode_add(n, block, weight, _need(scales, torch.float32, -(-n // block), "decode_add scales"),
                _need(q, torch.int8, n, "decode_add q"), _need(src, torch.float32, n, "decode_add src"),
                _need(out, torch.float32, n, "decode_add out"))


def _decode_add(n: int, block: int, weight: float, ps: int, pq: int, psrc: int, pout: int) -> float:
    parts = _split.parts(n, _GROUP * block)
    if parts is None:
        return _K.decode_add(ps, pq, n, block, weight, psrc, pout)
    return _max_of(_split.run(lambda a, b: _K.decode_add(ps + 4 * (a // block), pq + a, b - a, block, weight,
                                                         psrc + 4 * a, pout + 4 * a), parts))


def decode_add_max(scales: torch.Tensor, q: torch.Tensor, block: int, weight: float, src: torch.Tensor,
                   out: torch.Tensor) -> float:
    """``decode_add``, returning max |src| (inf or NaN if ``src`` holds inf or NaN) measured in
    the same pass: ``out`` is written whatever ``src`` holds. ``src`` is ``out`` itself or does
    not overlap it."""
    n = q.numel()
    ps, pq = _need(scales, torch.float32, -(-n // block), "decode_add scales"), _need(q, torch.int8, n, "decode_add q")
    psrc, pout = _need(src, torch.float32, n, "decode_add src"), _need(out, torch.float32, n, "decode_add out")
    if psrc != pout and _overlap(psrc, pout, 4 * n):
        raise ValueError("decode_add_max: src must be out itself or not overlap it")
    return _decode_add(n, block, weight, ps, pq, psrc, pout)  # (one kernel: ``decode_add`` drops the max)


def decode_add_encode(scales: torch.Tensor, q: torch.Tensor, block: int, weight: float, src: torch.Tensor,
                      out: torch.Tensor, scale: float, scales_out: torch.Tensor,
                      q_out: torch.Tensor) -> tuple[float, bool]:
    """``decode_add_max(scales, q, block, weight, src, out)`` and then ``encode(out, block, scale,
    scales_out, q_out, dec=out)`` in one pass over memory, bit for bit what the two write. Returns
    (max |src| as ``decode_add_max`` does, whether the sum is finite: False leaves ``scales_out``
    and ``q_out`` partly written). ``src`` is ``out`` itself or does not overlap it; the outputs
    overlap neither."""
    n = q.numel()
    nb = -(-n // block)
    args = (_need(scales, torch.float32, nb, "decode_add_encode scales"),
            _need(q, torch.int8, n, "decode_add_encode q"),
            n, block, weight, _need(src, torch.float32, n, "decode_add_encode src"),
            _need(out, torch.float32, n, "decode_add_encode out"), scale,
            _need(scales_out, torch.float32, nb, "decode_add_encode scales_out"),
            _need(q_out, torch.int8, n, "decode_add_encode q_out"))
    src_p, out_p, so_p, qo_p = args[5], args[6], args[8], args[9]
    if (src_p != out_p and _overlap(src_p, out_p, 4 * n)) or _overlap(so_p, out_p, 4 * nb, 4 * n) or \
            _overlap(qo_p, out_p, n, 4 * n) or _overlap(so_p, qo_p, 4 * nb, n):
        raise ValueError("decode_add_encode: src must be out itself or not overlap it, and the outputs must not "
                         "overlap each other or out")
    parts = _split.parts(n, _GROUP * block)
    if parts is None:
        return _K.decode_add_encode(*args)
    ps, pq, w = args[0], args[1], args[4]

    def part(a: int, b: int) -> tuple[float, bool]:
        sb = 4 * (a // block)
        return _K.decode_add_encode(ps + sb, pq + a, b - a, block, w, src_p + 4 * a, out_p + 4 * a, scale,
                                    so_p + sb, qo_p + a)
    done = _split.run(part, parts)
    return _max_of([m for m, _ in done]), all(ok for _, ok in done)


def copy_finite(src: torch.Tensor, dst: torch.Tensor, stream: bool = False) -> int:
    """``dst[:n] = src`` (float32, not overlapping), ``COPY_PIECE`` values at a time, each piece
    checked for NaN/inf before it is written: returns how many values were copied, ``n =
    src.numel()`` unless a piece holds a NaN/inf (then the start of that piece). One pass where a
    check and a copy were two. ``stream``: as in ``decode``."""
    n = src.numel()
    ps, pd = _need(src, torch.float32, n, "copy_finite src"), _need(dst, torch.float32, n, "copy_finite dst")
    if _overlap(ps, pd, 4 * n):
        raise ValueError("copy_finite: src and dst overlap")
    parts = _split.parts(n, _GRAIN)
    # split: every part is checked first, so that nothing past the first NaN/inf is written, as in one call
    if parts is None or not all(m < math.inf for m in _split.run(lambda a, b: _K.absmax(ps + 4 * a, b - a), parts)):
        return _K.copy_finite(ps, pd, n, stream)
    return sum(_split.run(lambda a, b: _K.copy_finite(ps + 4 * a, pd + 4 * a, b - a, stream), parts))
