"""Copies between a device and the host for the codecs' device paths (``Codec.device_encode`` ...).

A device call runs its kernels and copies inside one :class:`Transfer`: on CUDA, on a side stream
of the calling thread (so a round's codec work overlaps the training stream), after the work
queued on the current stream (its inputs are ready), into and out of pinned host memory with
``non_blocking`` copies, and waited for on exit (the bytes are complete before anyone sends
them; the current stream is ordered after what the call wrote). On the CPU the same code runs
eagerly: that is how the device paths are tested without a GPU.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from types import TracebackType

import torch

__all__ = ["Transfer", "host_buffer"]

#: side streams per thread and device (a stream is cheap; per thread so that two threads' calls
#: never wait for each other's work)
_TLS = threading.local()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    streams = getattr(_TLS, "streams", None)
    if streams is None:
        streams = _TLS.streams = {}
    s = streams.get(device)
    if s is None:
        s = streams[device] = torch.cuda.Stream(device)
    return s


def host_buffer(nbytes: int) -> torch.Tensor:
    """A fresh uint8 host buffer, pinned where CUDA is present (torch caches pinned blocks)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


class Transfer(AbstractContextManager):
    """The kernels and copies of one codec call on ``device`` (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._side: torch.cuda.Stream | None = None
        self._ctx: AbstractContextManager | None = None
        self._keep: list[torch.Tensor] = []  # pinned sources of queued copies, alive until exit

    def __enter__(self) -> Transfer:
        if self.cuda:
            self._side = _side_stream(self.device)
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            self._ctx = torch.cuda.stream(self._side)
            self._ctx.__enter__()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self._ctx is not None and self._side is not None:
            self._ctx.__exit__(et, e, tb)
            self._ctx = None
            self._side.synchronize()
            torch.cuda.current_stream(self.device).wait_stream(self._side)
        self._keep.clear()

    def to_host(self, src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``src``'s bytes (contiguous) into ``out`` (a uint8 CPU tensor of enough bytes, ideally
        pinned) or a fresh pinned one: complete once the transfer exits."""
        src = src.reshape(-1).view(torch.uint8)
        n = src.numel()
        dst = host_buffer(n) if out is None else out[:n]
        dst.copy_(src, non_blocking=self.cuda)
        return dst

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` (received bytes, a uint8 CPU tensor) on the device; on the CPU ``host`` itself
        (never written to). On CUDA they go through a pinned buffer, the upload queued."""
        if not self.cuda:
            return host
        staged = host_buffer(host.numel()).copy_(host)
        self._keep.append(staged)
        return staged.to(self.device, non_blocking=True)

    def item(self, t: torch.Tensor) -> float:
        """The one value of ``t`` as a Python float (on CUDA: waits for what is queued so far)."""
        return float(t)  # (inside the transfer the side stream is current: the read is ordered after it)
