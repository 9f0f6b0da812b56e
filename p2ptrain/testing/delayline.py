"""A userspace delay line for the test bed's switch: one-way delay on kernels without netem.

The test bed's hosts meet at a bridge in the switch namespace. Without ``sch_netem`` (and without
``sch_fq``, for earliest-departure-time pacing) the kernel has no way to hold a packet for a while,
so this process does it: every frame a host sends is redirected at its switch port's ingress (a tc
``u32`` filter with a ``mirred`` action, both in every kernel that has the bridge and tbf) to a tap
device; this process reads each frame, keeps it for ``delay`` seconds, and writes it back into the
tap, which is a port of the bridge like the hosts': the bridge forwards it by its (static, see
``Testbed``) forwarding entries to the destination port, whose shaping (rate, loss, the no-inbound
filter) then applies as without delay.

One FIFO is exact for a constant delay: frames leave in arrival order, each ``delay`` after it
arrived (to within the poll granularity, ~0.1 ms). No jitter, no reordering. It copies every frame
through Python, a few tens of thousands of frames per second: fine at the 100 Mbit/s links the
delay tests use, CPU-bound well below 1 Gbit/s.

    ip netns exec <switch ns> python -m p2ptrain.testing.delayline TAP DELAY_SECONDS

It attaches to the existing tap ``TAP`` (``ip tuntap add dev TAP mode tap``), prints ``ready``
once frames flow, and runs until SIGTERM/SIGINT or its stdin closes.
"""

from __future__ import annotations

import collections
import fcntl
import os
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
MAX_FRAME = 65536


def open_tap(name: str) -> int:
    """A non-blocking fd on the tap device ``name`` (frames without packet-info headers)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def run(fd: int, delay: float, stop_fd: int | None = None) -> None:
    """Forward frames from ``fd`` back into it, each ``delay`` seconds after it arrived, until
    ``stop_fd`` becomes readable (EOF) or a signal ends the process."""
    queue: collections.deque[tuple[float, bytes]] = collections.deque()
    watch = [fd] if stop_fd is None else [fd, stop_fd]
    while True:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, frame = queue.popleft()
            try:
                os.write(fd, frame)
            except OSError:  # the bridge refused it (ENOBUFS, link down): a dropped frame
                pass
        timeout = max(0.0, queue[0][0] - now) if queue else None
        readable, _, _ = select.select(watch, [], [], timeout)
        if stop_fd is not None and stop_fd in readable and not os.read(stop_fd, 4096):
            return  # stdin closed: the test bed is going away
        if fd in readable:
            arrived = time.monotonic()
            while True:
                try:
                    frame = os.read(fd, MAX_FRAME)
                except BlockingIOError:
                    break
                queue.append((arrived + delay, frame))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m p2ptrain.testing.delayline TAP DELAY_SECONDS", file=sys.stderr)
        return 2
    name, delay = args[0], float(args[1])
    if not 0 <= delay <= 10:
        print(f"delay {delay} s: expected 0 .. 10", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        fd = open_tap(name)
    except OSError as e:
        print(f"cannot attach to tap {name}: {e.strerror or e}", file=sys.stderr)
        return 1
    print("ready", flush=True)
    try:
        run(fd, delay, sys.stdin.fileno())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
