"""``SwarmDataset``: a torch ``IterableDataset`` over a dataset CID, read from the swarm.

Each epoch this peer reads the shards rendezvous hashing assigns it among the live trainers
(``assign``; no coordination), fetching each from the peers that hold it (verified chunk by
chunk, cached in the local store, then served to others). Between shards it re-reads who
trains: a shard whose owner left is taken over by the peer that now owns it, if not read yet.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset

from ..checkpoint.state_server import StateServer
from .assign import assigned
from .index import DatasetIndex, parse_dataset_id
from .records import records_of
from .store import DataStore
from .swarm import DEFAULT_TTL, DataService, DataUnavailable, fetch_index, fetch_shard, members

log = logging.getLogger("p2ptrain.data")


class SwarmDataset(IterableDataset):
    """Records of dataset ``cid`` (bytes lines for ``text``, 1-D tensors for ``tokens``).

    ``dht``: a started :class:`p2ptrain.DHT` (its loop runs the network side). ``data_dir``:
    the store shards are cached in (default: the checkpoint store's). ``server``: the host's
    state server when one runs (``opt.state_sync.server`` of a ``DecentralizedOptimizer`` on the
    same DHT: a host answers state requests through one server, so pass it). ``epochs``: stop
    after that many (None: forever). ``refresh``: seconds between re-reads of the live trainers within an epoch.
    Iterate in one worker (``num_workers=0``): the DHT is this process's. ``close()`` leaves.
    """

    def __init__(self, dht: Any, cid: str | bytes, *, data_dir: str | os.PathLike[str] | None = None,
                 server: StateServer | None = None, epochs: int | None = None, refresh: float = 2.0,
                 ttl: float = DEFAULT_TTL, timeout: float = 120.0):
        super().__init__()
        self.dht = dht
        self.id = cid if isinstance(cid, bytes) else parse_dataset_id(cid)
        self.store = DataStore(data_dir)
        self.epochs = epochs
        self.refresh = refresh
        self.timeout = timeout
        self.index: DatasetIndex = dht.run(fetch_index(dht.node, self.store, self.id), timeout=timeout)
        self._service = DataService(dht.node, self.store, self.index, server=server, training=True, ttl=ttl)
        dht.run(self._service.start(), timeout=timeout)
        self.epoch = 0
        #: epoch -> shards read in it (for coverage figures)
        self.read: dict[int, list[int]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"SwarmDataset({self.index.cid}, {self.index.name!r}, {len(self.index.shards)} shards)"

    def _members(self) -> list:
        return self.dht.run(members(self.dht.node, self.id, len(self.index.shards)), timeout=self.timeout)

    def assignment(self, epoch: int) -> list[int]:
        """The shards this peer reads in ``epoch``, by the live trainers the DHT lists now."""
        trainers = [m.peer for m in self._members() if m.training]
        return assigned(self.id, epoch, len(self.index.shards), trainers, self.dht.peer_id)

    def shard(self, i: int) -> torch.Tensor:
        """Shard ``i``'s records tensor: from the store, else fetched from the peers that hold it."""
        ref = self.index.shards[i]
        if not self.store.has_shard(ref):
            providers = self._members()
            self.dht.run(fetch_shard(self.dht.node, self.store, self.index, i, providers, timeout=self.timeout),
                         timeout=self.timeout + 5)
            self._service.changed()
        return self.store.load_shard(self.index, i)

    def epoch_shards(self, epoch: int) -> Iterator[int]:
        """Shards to read in ``epoch``, with hand-over: shards of trainers that left meanwhile
        and that this peer now owns are appended (unless read already)."""
        queue = self.assignment(epoch)
        done: set[int] = set()
        next_check = time.monotonic() + self.refresh
        while queue:
            i = queue.pop(0)
            if i in done:
                continue
            done.add(i)
            yield i
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + self.refresh
                queue += [j for j in self.assignment(epoch) if j not in done and j not in queue]

    def __iter__(self) -> Iterator[bytes | torch.Tensor]:
        while not self._closed and (self.epochs is None or self.epoch < self.epochs):
            epoch = self.epoch
            self.read[epoch] = []
            for i in self.epoch_shards(epoch):
                if self._closed:
                    return
                try:
                    tensor = self.shard(i)
                except DataUnavailable as e:
                    log.warning("%s; skipping the shard this epoch", e)
                    continue
                self.read[epoch].append(i)
                yield from records_of(self.index.format, tensor)
            self.epoch += 1

    def close(self) -> None:
        """Stop serving and leave the trainers (idempotent; others take this peer's shards over)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.dht.run(self._service.close(), timeout=15)
        except (RuntimeError, TimeoutError, asyncio.CancelledError) as e:  # the DHT closed first
            log.debug("closing dataset %s: %s", self.index.cid, e)
