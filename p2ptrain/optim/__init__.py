"""Decentralized optimizers: a swarm of peers takes the steps of one torch optimizer together.

    progress.py    global training progress through the DHT (sans-IO ``summarize`` + tracker)
    state_sync.py  serving our state, loading the swarm's (late join, missed rounds)
    optimizer.py   DecentralizedOptimizer: ``sync`` (collaborative large batch) and ``diloco`` modes

The optimizer is imported lazily: tools that only read progress (``p2ptrain status``) need no torch.
"""

from typing import Any

from .progress import PeerReport, ProgressTracker, SwarmView, parse_record, summarize

__all__ = ["DecentralizedOptimizer", "OptimizerStats", "PeerReport", "ProgressTracker", "SwarmView",
           "parse_record", "summarize"]


def __getattr__(name: str) -> Any:
    if name in ("DecentralizedOptimizer", "OptimizerStats"):
        from . import optimizer

        return getattr(optimizer, name)
    raise AttributeError(f"module 'p2ptrain.optim' has no attribute {name!r}")
