"""Which peer reads which shard in an epoch: rendezvous (highest random weight) hashing. Sans-IO.

Every peer computes the same owner for (dataset, epoch, shard) from the same set of live
trainers, so the swarm covers each shard about once per epoch with no coordination. When a
peer leaves, only the shards it owned move (each to the peer with the next-highest weight);
the others keep theirs. A new epoch reshuffles who reads what.
"""

from __future__ import annotations

from collections.abc import Iterable

import blake3

from dht import PeerID


def weight(dataset_id: bytes, epoch: int, shard: int, peer: PeerID) -> bytes:
    return blake3.blake3(dataset_id + epoch.to_bytes(8, "big") + shard.to_bytes(4, "big") + peer.to_bytes()).digest()


def owner(dataset_id: bytes, epoch: int, shard: int, peers: Iterable[PeerID]) -> PeerID:
    """The peer that reads ``shard`` in ``epoch`` among ``peers`` (non-empty)."""
    return max(peers, key=lambda p: weight(dataset_id, epoch, shard, p))


def assigned(dataset_id: bytes, epoch: int, num_shards: int, peers: Iterable[PeerID], me: PeerID) -> list[int]:
    """The shards ``me`` reads in ``epoch`` when ``peers`` (``me`` added) train, in reading order
    (a per-epoch shuffle, so peers do not all start at shard 0)."""
    group = set(peers) | {me}
    mine = [i for i in range(num_shards) if owner(dataset_id, epoch, i, group) == me]
    return sorted(mine, key=lambda i: weight(dataset_id, epoch, i, me))
