"""The test bed's delay line, for kernels without netem: one-way delay by a small C program.

The test bed's hosts meet at a bridge in the switch namespace. Without ``sch_netem`` (and without
``sch_fq`` or ``sch_etf``, which honour a packet's departure time) the kernel has no way to hold a
packet for a while, so a process does it: every frame a host sends is redirected at its switch
port's ingress (tc ``u32`` + ``mirred``) to a tap device; the delay line (``delayline.c``) reads
each frame, keeps it ``delay`` seconds, and writes it back into the tap, a port of the bridge like
the hosts': the bridge forwards it by its static entries to the destination port, whose shaping
(rate, loss, the no-inbound filter) then applies as without delay.

One FIFO is exact for a constant delay: no jitter, no reordering. The program is compiled with the
system's C compiler on first use and cached (``$XDG_CACHE_HOME/p2ptrain``, by source hash). It runs
at a real-time priority: on a loaded box an ordinary process wakes tens of ms late, which is what
capped the delayed bed near 100 Mbit/s in all (benchmarks/README.md, 'WAN test bed').
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("delayline.c")


class DelayLineUnavailable(RuntimeError):
    """The delay line cannot be built here (no C compiler, or it failed)."""


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "p2ptrain"


def binary() -> str:
    """The path of the compiled delay line, building it on first use (atomically, so concurrent
    test beds share one build). Raises :class:`DelayLineUnavailable` with the reason."""
    source = SOURCE.read_bytes()
    out = _cache_dir() / f"delayline-{hashlib.blake2b(source, digest_size=8).hexdigest()}"
    if out.exists():
        return str(out)
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise DelayLineUnavailable(
            "a test bed delay without netem needs a C compiler to build its delay line "
            f"({SOURCE.name}); none found (tried $CC, cc, gcc): install gcc, or use a kernel with sch_netem")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = os.path.join(tmp, "delayline")
        r = subprocess.run([cc, "-O2", "-o", built, str(SOURCE)], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise DelayLineUnavailable(f"building the delay line with {cc} failed:\n{r.stderr.strip()}")
        os.replace(built, out)
    return str(out)
