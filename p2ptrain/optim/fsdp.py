"""FSDP inside a peer: every rank of an FSDP2 (``fully_shard``) job averages its own shard of the
model with the same shard of the other peers; no rank ever gathers the full model.

Rank r of every peer is a member of *shard r's swarm*: a DecentralizedOptimizer over the rank's
local shards, with its own DHT node, progress record, averager, state server and checkpoints,
under the run id ``{run_id}.shard{r}`` (rank 0 under ``run_id`` itself, so that a peer sharded over another
number of ranks, or not sharded, meets it and is told why they never average: the world size is
in the schema). A joiner's ranks each load their shard from their shard's swarm. Each step's
sample count is the peer's (summed over its ranks). The shard swarms keep their own epochs: a
peer's ranks may cross a round a step apart, which FSDP does not mind (diloco's rounds come every
``local_steps`` steps on every rank alike).

The rank's shards are plain tensors sharing storage with the DTensor parameters (the inner
optimizer is moved onto them, and each step takes the DTensors' local gradients), so the
optimizer, averager and checkpoints see an ordinary model: the shard's rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint.shards import FSDP_LABEL
from .ranks import PeerRanks

__all__ = ["FsdpShard", "is_sharded", "rank_dht", "shard_run_id"]


def _dtensor() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # (torch without distributed)
        return None
    return DTensor


def is_sharded(optimizer: Any) -> bool:
    """Whether ``optimizer`` trains DTensor parameters (a model under ``fully_shard``)."""
    dtensor = _dtensor()
    return (dtensor is not None and isinstance(optimizer, torch.optim.Optimizer)
            and any(isinstance(p, dtensor) for g in optimizer.param_groups for p in g["params"]))


def shard_run_id(run_id: str, rank: int) -> str:
    """The run id of shard ``rank``'s swarm (rank 0: the run's own, where unsharded peers meet it)."""
    return run_id if rank == 0 else f"{run_id}.shard{rank}"


class FsdpShard:
    """This rank's shard of an FSDP2 model, as the plain tensors a DecentralizedOptimizer trains.

    ``optimizer``'s parameters must all be DTensors sharded on dim 0 over one 1-D mesh (what
    ``fully_shard`` makes); it is moved onto their local tensors (same storage: its steps update
    the model). ``process_group``: the peer's ranks (default: the mesh's)."""

    def __init__(self, optimizer: torch.optim.Optimizer, process_group: dist.ProcessGroup | None = None):
        from torch.distributed.tensor import DTensor, Shard

        self.dparams: list[torch.Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        meshes = set()
        for i, p in enumerate(self.dparams):
            if not isinstance(p, DTensor):
                raise TypeError(f"parameter {i} (shape {list(p.shape)}) is not sharded: under FSDP every "
                                "parameter the optimizer trains must be in a fully_shard'ed module")
            if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
                raise ValueError(f"parameter {i} is placed {p.placements} on a {p.device_mesh.ndim}-D mesh: "
                                 "only fully_shard's Shard(0) on a 1-D mesh is supported")
            meshes.add((p.device_mesh.device_type, tuple(p.device_mesh.mesh.tolist())))
        if len(meshes) != 1:
            raise ValueError("the parameters are sharded over several device meshes: use one")
        group = process_group if process_group is not None else self.dparams[0].device_mesh.get_group()
        self.rank: int = dist.get_rank(group)
        self.world_size: int = dist.get_world_size(group)
        self.ranks = PeerRanks(group) if self.world_size > 1 else None
        self.shapes = [list(p.shape) for p in self.dparams]
        with torch.no_grad():
            self.local: list[torch.Tensor] = [p.to_local().detach() for p in self.dparams]
        _move_optimizer(optimizer, dict(zip(map(id, self.dparams), self.local, strict=True)))

    def run_id(self, run_id: str) -> str:
        return shard_run_id(run_id, self.rank)

    def begin_step(self, batch_size: int) -> int:
        """The DTensors' local gradients onto the shards; returns the peer's batch (every rank's)."""
        for d, t in zip(self.dparams, self.local, strict=True):
            t.grad = None if d.grad is None else d.grad.to_local().detach()
        return batch_size if self.ranks is None else self.ranks.sum(batch_size)

    def zero_grad(self) -> None:
        """Drop the DTensors' gradients (FSDP accumulates into them otherwise)."""
        for d in self.dparams:
            d.grad = None

    def label(self) -> dict[str, Any]:
        """What a shard's checkpoint records, for export to make the whole model of the shards
        (:mod:`~p2ptrain.checkpoint.shards`)."""
        return {FSDP_LABEL: [self.rank, self.world_size, self.shapes]}


def rank_dht(initial_peers: Sequence[Any] | None, ranks: PeerRanks | None, **kwargs: Any) -> Any:
    """A DHT node for this rank, joining through ``initial_peers`` and its leader's node (so that
    the ranks of a peer that starts a swarm find each other); ``kwargs`` go to :class:`p2ptrain.DHT`."""
    from ..background import DHT

    if ranks is None:
        return DHT(initial_peers, **kwargs)
    dht = DHT(initial_peers, **kwargs) if ranks.is_leader else None
    leader = ranks.decide([str(a) for a in dht.multiaddrs] if dht is not None else None)
    return dht if dht is not None else DHT([*leader, *(initial_peers or [])], **kwargs)


def _move_optimizer(optimizer: torch.optim.Optimizer, local: dict[int, torch.Tensor]) -> None:
    """``optimizer``'s parameters (and any state it holds for them) onto their local tensors."""
    for group in optimizer.param_groups:
        group["params"] = [local[id(p)] for p in group["params"]]
    state = optimizer.state
    for key in [k for k in state if id(k) in local]:
        state[local[id(key)]] = {name: (v.to_local() if hasattr(v, "to_local") else v)
                                 for name, v in state.pop(key).items()}
