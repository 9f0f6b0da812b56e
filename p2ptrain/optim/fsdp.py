"""FSDP inside a peer: every rank of an FSDP2 (``fully_shard``) job averages its own shard of the
model with the same shard of the other peers; no rank ever gathers the full model.

Rank r of every peer is a member of *shard r's swarm*: a DecentralizedOptimizer over the rank's
local shards, with its own DHT node, progress record, averager, state server and checkpoints,
under the run id ``{run_id}.shard{r}`` (rank 0 under ``run_id`` itself, so that a peer sharded over another
number of ranks, or not sharded, meets it and is told why they never average: the world size is
in the schema). A joiner's ranks each load their shard from their shard's swarm. Each step's
sample count is the peer's (summed over its ranks). The shard swarms keep their own epochs: a
peer's ranks may cross a round a step apart, which FSDP does not mind (diloco's rounds come every
``local_steps`` steps on every rank alike). In sync mode the ranks end their epochs at the step where
any of them found it due: a rank in a round while its peer's other ranks wait for it in FSDP's
collectives would hold up the other peers' rounds, which wait for that very peer.

The rank's shards are plain tensors sharing storage with the DTensor parameters (the inner
optimizer is moved onto them, and each step takes the DTensors' local gradients), so the
optimizer, averager and checkpoints see an ordinary model: the shard's rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.shards import FSDP_LABEL
from .ranks import PeerRanks

__all__ = ["FsdpShard", "is_sharded", "rank_dht", "shard_model", "shard_run_id"]


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
    the model). ``process_group``: the peer's ranks (default: the mesh's). ``sync``: the optimizer's
    mode is sync (its ranks agree on every step whether to end the epoch: :meth:`end_epoch`)."""

    def __init__(self, optimizer: torch.optim.Optimizer, process_group: dist.ProcessGroup | None = None,
                 sync: bool = False):
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
        self.sync = sync
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

    def end_epoch(self, due: bool) -> bool:
        """(sync mode, every step) Whether this peer's ranks end their epoch now: all of them once
        any found it ``due``, so that they go to their rounds together."""
        return bool(due) if self.ranks is None else self.ranks.sum(int(bool(due))) > 0

    def hold(self, batch_size: int) -> None:
        """A step of a rank that is done while others train on: their step's collectives, no step."""
        if self.ranks is not None:
            self.ranks.sum(batch_size)
            if self.sync:
                self.ranks.sum(0)

    def poll(self, done: bool, stop: bool) -> str:
        """(each step of a training loop) What this rank does, agreed by all: ``"stop"`` once any
        rank was told to stop or all are ``done``, ``"hold"`` (see :meth:`hold`) while this one is
        done and others are not, else ``"step"``. One all-reduce."""
        if self.ranks is None:
            return "stop" if done or stop else "step"
        total = self.ranks.sum(int(done) + (self.world_size + 1) * int(stop))
        return "stop" if total >= self.world_size else "hold" if done else "step"

    def zero_grad(self) -> None:
        """Drop the DTensors' gradients (FSDP accumulates into them otherwise)."""
        for d in self.dparams:
            d.grad = None

    def label(self) -> dict[str, Any]:
        """What a shard's checkpoint records, for export to make the whole model of the shards
        (:mod:`~p2ptrain.checkpoint.shards`)."""
        return {FSDP_LABEL: [self.rank, self.world_size, self.shapes]}


def rank_dht(initial_peers: Sequence[Any] | None, ranks: PeerRanks | None, dht: Any = None, **kwargs: Any) -> Any:
    """A DHT node for this rank, joining through ``initial_peers`` and its leader's node (so that
    the ranks of a peer that starts a swarm find each other); ``kwargs`` go to :class:`p2ptrain.DHT`.
    ``dht``: the leader's node, already started (else one is made for it too)."""
    from ..background import DHT

    if ranks is None:
        return dht if dht is not None else DHT(initial_peers, **kwargs)
    if ranks.is_leader and dht is None:
        dht = DHT(initial_peers, **kwargs)
    leader = ranks.decide([str(a) for a in dht.multiaddrs] if dht is not None else None)
    return dht if dht is not None else DHT([*leader, *(initial_peers or [])], **kwargs)


def shard_model(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` under FSDP2 over the default process group, in place: every layer of its stacks
    (the children of its ``nn.Sequential``/``nn.ModuleList``, outermost) a unit, the rest the root's,
    which is whole during the model's own forward (e.g. an embedding it also uses as the tied head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        stack = isinstance(module, (nn.Sequential, nn.ModuleList))
        for child in module.children():
            if stack and any(p.requires_grad for p in child.parameters()):
                units.append(child)
            else:
                visit(child)

    visit(model)
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _move_optimizer(optimizer: torch.optim.Optimizer, local: dict[int, torch.Tensor]) -> None:
    """``optimizer``'s parameters (and any state it holds for them) onto their local tensors."""
    for group in optimizer.param_groups:
        group["params"] = [local[id(p)] for p in group["params"]]
    state = optimizer.state
    for key in [k for k in state if id(k) in local]:
        state[local[id(key)]] = {name: (v.to_local() if hasattr(v, "to_local") else v)
                                 for name, v in state.pop(key).items()}
