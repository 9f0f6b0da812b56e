"""The ranks of one peer: a ``torch.distributed`` process group (a torchrun job) that is one peer.

Rank 0 of the group is the peer's *leader*: it runs the DHT node, the averager, state sync,
checkpoints and the progress record (counting every rank's samples). The other ranks run no DHT
node; they follow the leader through the collectives of :class:`PeerRanks`, which are all
leader-to-all (``broadcast``, ``decide``) or symmetric (``sum``, ``all_reduce_mean``), so every
rank must call them in the same order. A collective that fails (a rank died) raises
:class:`RankFailure`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgpack
import torch
import torch.distributed as dist

from ..errors import P2PTrainError

__all__ = ["LEADER", "PeerRanks", "RankFailure", "ddp", "follow", "lead", "rank_device", "rank_seed", "stopping"]

#: the rank that runs the peer's DHT node and averages with the swarm
LEADER = 0
#: the longest decision ``decide`` carries (a round's outcome, an epoch: a few hundred bytes)
MAX_DECISION = 1 << 20
#: bytes of the one broadcast that carries a decision (its length, then as much of it as fits)
INLINE = 256

T = TypeVar("T")


class RankFailure(P2PTrainError, RuntimeError):
    """A collective between the ranks of this peer failed: a rank died or left; the peer must leave."""


class PeerRanks:
    """The process group of one peer's ranks, with the few collectives the optimizer needs.

    ``group``: the process group (``None``: the default one, which must be initialised).
    Collectives run on ``device``: the current CUDA device under NCCL, else the CPU; tensors
    elsewhere are staged through it."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call init_process_group first "
                               "(torchrun does not do it for you)")
        self.group = group
        self.rank: int = dist.get_rank(group)
        self.world_size: int = dist.get_world_size(group)
        #: this rank's global rank of the leader (``src`` of broadcasts in a sub-group)
        self._src = dist.get_global_rank(group, LEADER) if group is not None else LEADER
        backend = dist.get_backend(group)
        self.device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                       else torch.device("cpu"))

    @classmethod
    def detect(cls, process_group: dist.ProcessGroup | None = None) -> PeerRanks | None:
        """The ranks of ``process_group`` (default: the initialised default group), or None when
        there is none, or it has one rank (a plain single-process peer)."""
        if process_group is None and not (dist.is_available() and dist.is_initialized()):
            return None
        ranks = cls(process_group)
        return ranks if ranks.world_size > 1 else None

    @property
    def is_leader(self) -> bool:
        """Whether this rank runs the peer's DHT node and averages with the swarm."""
        return self.rank == LEADER

    def __repr__(self) -> str:
        return f"PeerRanks(rank={self.rank}, world_size={self.world_size}, device={self.device})"

    # ---- collectives (every rank calls each, in the same order)

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """The leader's values of ``tensors`` into every rank's, in place: one collective per
        dtype and device (flattened), not one per tensor."""
        buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            buckets.setdefault((t.dtype, t.device), []).append(t)
        for group in buckets.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group]) if len(group) > 1 else \
                group[0].detach().reshape(-1).clone()
            self.broadcast_flat(flat)
            offset = 0
            for t in group:
                n = t.numel()
                t.detach().copy_(flat[offset:offset + n].view_as(t))
                offset += n

    def broadcast_flat(self, flat: torch.Tensor) -> None:
        """The leader's ``flat`` (one contiguous tensor, a flat buffer or shard) into every rank's, in place."""
        if not flat.is_contiguous():
            raise ValueError("broadcast_flat needs a contiguous tensor")
        work = flat if flat.device == self.device else flat.to(self.device)
        self._run(dist.broadcast, work, src=self._src, group=self.group)
        if work is not flat:
            flat.copy_(work)

    def decide(self, decision: Any = None) -> Any:
        """The leader's ``decision`` (anything msgpack encodes: numbers, strings, lists, dicts)
        on every rank; the other ranks pass nothing. One broadcast when it fits ``INLINE`` bytes."""
        head = torch.zeros(INLINE, dtype=torch.uint8)
        payload = b""
        if self.is_leader:
            payload = msgpack.packb(decision, use_bin_type=True)
            if len(payload) > MAX_DECISION:
                raise ValueError(f"a decision of {len(payload)} bytes is over the {MAX_DECISION} bytes of decide()")
            inline = payload[:INLINE - 4]
            head[:4 + len(inline)] = torch.frombuffer(bytearray(len(payload).to_bytes(4, "little") + inline),
                                                      dtype=torch.uint8)
        head = self._broadcast_bytes(head)
        n = int.from_bytes(head[:4].numpy().tobytes(), "little")
        if not 0 < n <= MAX_DECISION:
            raise RankFailure(f"the leader announced a decision of {n} bytes")
        data = head[4:4 + n].numpy().tobytes()
        if n > INLINE - 4:  # the rest in a second broadcast
            rest = (torch.frombuffer(bytearray(payload[INLINE - 4:]), dtype=torch.uint8) if self.is_leader
                    else torch.empty(n - (INLINE - 4), dtype=torch.uint8))
            data += self._broadcast_bytes(rest).numpy().tobytes()
        return msgpack.unpackb(data, raw=False)

    def _broadcast_bytes(self, buf: torch.Tensor) -> torch.Tensor:
        work = buf.to(self.device)
        self._run(dist.broadcast, work, src=self._src, group=self.group)
        return work.cpu()

    def sum(self, value: int) -> int:
        """The sum of every rank's ``value`` (sample counts), on every rank."""
        t = torch.tensor([int(value)], dtype=torch.int64, device=self.device)
        self._run(dist.all_reduce, t, op=dist.ReduceOp.SUM, group=self.group)
        return int(t.item())

    def all_reduce_mean(self, tensors: Sequence[torch.Tensor]) -> None:
        """Every rank's ``tensors`` replaced by their mean over the ranks, in place."""
        for t in tensors:
            work = t.detach()
            if work.device != self.device or not work.is_contiguous():
                work = work.contiguous().to(self.device)
            self._run(dist.all_reduce, work, op=dist.ReduceOp.SUM, group=self.group)
            work.div_(self.world_size)
            if work.data_ptr() != t.data_ptr():
                t.detach().copy_(work)

    def barrier(self) -> None:
        """Wait until every rank is here."""
        self._run(dist.barrier, group=self.group)

    def forward_backward(self, loss: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``loss()`` and its backward on a DDP model, which talk to the other ranks (buffers, the
        gradient all-reduce): a rank that died makes them a RankFailure, not a bare RuntimeError."""
        return self.together(lambda: (out := loss(), out.backward())[0])

    def together(self, work: Callable[[], T]) -> T:
        """``work()``, which talks to the other ranks (a DDP or FSDP forward, an evaluation): a rank
        that died makes it a RankFailure, not a bare RuntimeError."""
        out: list[T] = []
        self._run(lambda: out.append(work()))
        return out[0]

    @staticmethod
    def _run(collective: Any, *args: Any, **kwargs: Any) -> None:
        try:
            collective(*args, **kwargs)
        except RuntimeError as e:  # (gloo, nccl and their DistError subclasses)
            raise RankFailure(f"a rank of this peer failed ({type(e).__name__}: {e})") from e


# ---- the in-peer step protocol: after each step (and at start) the leader tells the other ranks
# where the peer stands, and sends the parameters whenever the swarm changed them

def lead(opt: Any, force: bool = False) -> None:
    """(the leader, after a step) Broadcast the epoch and learning rates, and the parameters when
    a round, a state load or a merge changed them (``force``: always)."""
    seen = (opt._version, opt.epoch)
    changed = force or seen != opt._ranks_seen
    opt.ranks.decide({"epoch": opt.epoch, "params": changed, "lr": [g["lr"] for g in opt.inner.param_groups]})
    if changed:
        opt.ranks.broadcast(opt.params)
        opt._ranks_seen = seen


def follow(opt: Any) -> None:
    """(another rank, after a step) Take what the leader's ``lead`` sends."""
    decision = opt.ranks.decide()
    opt.epoch = int(decision["epoch"])
    for group, lr in zip(opt.inner.param_groups, decision["lr"], strict=True):
        group["lr"] = lr
    if decision["params"]:
        opt.ranks.broadcast(opt.params)


# ---- for a training loop whose ranks are one peer (p2ptrain.run)

#: steps between two looks at the leader's stop event (``stopping``): each look is a collective
STOP_EVERY = 16


def stopping(stop: Any, ranks: PeerRanks | None, step: int = 0) -> bool:
    """Whether to stop (``stop``: a threading.Event), as the leader sees it on every rank: a
    signal reaches the ranks at different steps, and they must stop at the same one. With ranks,
    it is looked at once every ``STOP_EVERY`` steps (``step``, counted alike on every rank)."""
    if ranks is None:
        return stop.is_set()
    return step % STOP_EVERY == 0 and bool(ranks.decide(stop.is_set()))


def rank_device(device: torch.device) -> torch.device:
    """This rank's device for ``device``: ``cuda`` without an index is the CUDA device of the
    local rank (ranks share them round-robin when there are fewer)."""
    import os

    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def rank_seed(seed: int, rank: int) -> int:
    """A data seed of its own for every rank of a peer whose leader drew ``seed``."""
    return (int(seed) + rank * 0x9E3779B1) % (1 << 32)


def ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` in DistributedDataParallel on ``device`` (its gradients averaged over the ranks)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
