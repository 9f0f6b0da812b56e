"""Decentralized optimizers: a swarm of peers takes the steps of one torch optimizer together.

    progress.py    global training progress through the DHT (sans-IO ``summarize`` + tracker)
    state_sync.py  serving our state, loading the swarm's (late join, missed rounds)
    options.py     TrainerOptions: the optimizer's keyword arguments, checked once (shared with the CLI)
    optimizer.py   DecentralizedOptimizer: the torch optimizer surface and the lifecycle
    sync_step.py   ``sync`` mode (collaborative large batch); diloco_step.py: ``diloco`` mode
    rounds.py      averaging rounds of both modes, and the periodic rounds that average the state
    catch_up.py    falling behind, loading the swarm's state, resuming from a checkpoint
    shared_state.py  the state every group member holds alike: served, saved, put in place
    stats.py       OptimizerStats
    ranks.py       a torchrun job as one peer: PeerRanks (rank 0 leads) and the in-peer step protocol
    follower.py    RankFollower: the optimizer of the ranks other than the leader

The optimizer is imported lazily: tools that only read progress (``p2ptrain status``) need no torch.
"""

from typing import Any

from .progress import PeerReport, ProgressTracker, SwarmView, read_reports, summarize

__all__ = ["DecentralizedOptimizer", "OptimizerStats", "PeerReport", "ProgressTracker", "SwarmView",
           "read_reports", "summarize"]


def __getattr__(name: str) -> Any:
    if name == "DecentralizedOptimizer":
        from .optimizer import DecentralizedOptimizer

        return DecentralizedOptimizer
    if name == "OptimizerStats":
        from .stats import OptimizerStats

        return OptimizerStats
    raise AttributeError(f"module 'p2ptrain.optim' has no attribute {name!r}")
