"""One rank of a ``p2ptrain peer --fsdp`` started by torchrun (for benchmarks/fsdp_sync.py). With
``$P2PT_BENCH_UNAGREED=1`` its ranks end their sync epochs each on its own view, as before they
agreed on the step (FsdpShard.end_epoch), so the benchmark can run that baseline in the same run."""

from __future__ import annotations

import os
import sys

if os.environ.get("P2PT_BENCH_UNAGREED") == "1":
    from p2ptrain.optim import fsdp

    init = fsdp.FsdpShard.__init__

    def unagreed(self, *args, **kwargs):  # (no agreement: no collective for it in hold either)
        init(self, *args, **{**kwargs, "sync": False})

    fsdp.FsdpShard.__init__ = unagreed
    fsdp.FsdpShard.end_epoch = lambda self, due: bool(due)

from p2ptrain.cli import main

sys.exit(main(sys.argv[1:]))
