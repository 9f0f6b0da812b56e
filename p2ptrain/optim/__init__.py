"""Decentralized optimizers: a swarm of peers takes the steps of one torch optimizer together.

    progress.py   global training progress through the DHT (sans-IO ``summarize`` + tracker)
    optimizer.py  DecentralizedOptimizer: ``sync`` (collaborative large batch) and ``diloco`` modes
"""

from .optimizer import DecentralizedOptimizer, OptimizerStats
from .progress import PeerReport, ProgressTracker, SwarmView, summarize

__all__ = ["DecentralizedOptimizer", "OptimizerStats", "PeerReport", "ProgressTracker", "SwarmView", "summarize"]
