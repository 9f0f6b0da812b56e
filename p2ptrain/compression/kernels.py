"""The int8 codec's optional compiled kernels (``_int8_kernels.c``), behind checked wrappers.

Why they exist: on loopback or any link faster than a core can run torch's five-pass int8 encode,
the codec's memory passes, not the network, are an int8 round's time. Each kernel here is one pass
(measured in ``benchmarks/allreduce_bench.py`` and README, "Averaging"). The extension is built by
``pip install`` where a C compiler is present; without it, or with ``P2PT_KERNELS=0`` in the
environment (to compare, or to rule the kernels out), ``AVAILABLE`` is False and callers use their
torch path, which encodes and decodes to the same bits.

The C functions take raw addresses; these wrappers are the only callers and check what C cannot:
device, dtype, contiguity and sizes. Every kernel releases the GIL. On a many-core host a call over
``SPLIT_MIN`` values or more runs in parts at once on a few threads of the extension's own, within
that one release of the GIL (``threads``, ``set_threads``); the parts are whole groups of blocks,
so the bits are those of one call.
"""

from __future__ import annotations

import os

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


#: calls over at least this many values run in parts where ``threads()`` > 1: a part of 64K values or
#: more outweighs waking a thread for it
SPLIT_MIN = 1 << 18


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


_threads = 1


def threads() -> int:
    """How many threads a big kernel call runs on (1: one call, as without the split)."""
    return _threads


def set_threads(n: int | None, split_min: int = SPLIT_MIN) -> int:
    """Run calls over ``split_min`` values or more in ``n`` parts at once from now on (1: never;
    None: the default, see ``P2PT_KERNEL_THREADS``); returns the count in effect (1 where the
    extension cannot make threads). For tests and benchmarks; the pool's idle threads stay."""
    global _threads
    want = _default_threads() if n is None else max(1, n)
    split = getattr(_K, "set_threads", None)  # (absent from a build older than the split: one call)
    _threads = split(want, split_min) if split is not None else 1
    return _threads


set_threads(None)


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
    return _K.absmax(_need(x, torch.float32, 0, "absmax"), x.numel())


def encode(x: torch.Tensor, block: int, scale: float, scales: torch.Tensor, q: torch.Tensor,
           dec: torch.Tensor | None = None) -> bool:
    """Blockwise int8 encode of float32 ``x`` into ``scales`` (float32, one per block, times
    ``scale``) and ``q`` (int8); with ``dec``, also what a receiver decodes, in the same pass
    (``dec`` may be ``x``). False, with the outputs partly written, if ``x`` holds NaN or inf."""
    n = x.numel()
    args = (_need(x, torch.float32, n, "encode x"), n, block, scale,
            _need(scales, torch.float32, -(-n // block), "encode scales"), _need(q, torch.int8, n, "encode q"),
            0 if dec is None else _need(dec, torch.float32, n, "encode dec"))
    return _K.encode(*args)


def decode(scales: torch.Tensor, q: torch.Tensor, block: int, out: torch.Tensor, stream: bool = False) -> None:
    """``out = q * scale`` per block (``out`` float32, ``q.numel()`` values); ``stream``: with
    streaming stores where the CPU has them (see ``stream_worthwhile``), the same values."""
    n = q.numel()
    _K.decode(_need(scales, torch.float32, -(-n // block), "decode scales"), _need(q, torch.int8, n, "decode q"),
              n, block, _need(out, torch.float32, n, "decode out"), stream)


def decode_add(scales: torch.Tensor, q: torch.Tensor, block: int, weight: float, src: torch.Tensor,
               out: torch.Tensor) -> None:
    """``out = src + q * (scale * weight)`` per block; ``src`` may be ``out``."""
    n = q.numel()
    _K.decode_add(_need(scales, torch.float32, -(-n // block), "decode_add scales"),
                  _need(q, torch.int8, n, "decode_add q"), n, block, weight,
                  _need(src, torch.float32, n, "decode_add src"), _need(out, torch.float32, n, "decode_add out"))


def decode_add_max(scales: torch.Tensor, q: torch.Tensor, block: int, weight: float, src: torch.Tensor,
                   out: torch.Tensor) -> float:
    """``decode_add``, returning max |src| (inf or NaN if ``src`` holds inf or NaN) measured in
    the same pass: ``out`` is written whatever ``src`` holds. ``src`` is ``out`` itself or does
    not overlap it."""
    n = q.numel()
    args = (_need(scales, torch.float32, -(-n // block), "decode_add scales"), _need(q, torch.int8, n, "decode_add q"),
            n, block, weight, _need(src, torch.float32, n, "decode_add src"),
            _need(out, torch.float32, n, "decode_add out"))
    if args[5] != args[6] and _overlap(args[5], args[6], 4 * n):
        raise ValueError("decode_add_max: src must be out itself or not overlap it")
    return _K.decode_add(*args)  # (one kernel: ``decode_add`` drops the max it returns)


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
    return _K.decode_add_encode(*args)


def copy_finite(src: torch.Tensor, dst: torch.Tensor, stream: bool = False) -> int:
    """``dst[:n] = src`` (float32, not overlapping), ``COPY_PIECE`` values at a time, each piece
    checked for NaN/inf before it is written: returns how many values were copied, ``n =
    src.numel()`` unless a piece holds a NaN/inf (then the start of that piece). One pass where a
    check and a copy were two. ``stream``: as in ``decode``."""
    n = src.numel()
    ps, pd = _need(src, torch.float32, n, "copy_finite src"), _need(dst, torch.float32, n, "copy_finite dst")
    if _overlap(ps, pd, 4 * n):
        raise ValueError("copy_finite: src and dst overlap")
    return _K.copy_finite(ps, pd, n, stream)
