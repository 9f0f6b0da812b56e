"""Datasets in the swarm: serve and announce what this peer holds, find members, fetch verified.

* :class:`DataService`: serves the store's datasets from this peer (a resolver on the host's
  :class:`~p2ptrain.checkpoint.state_server.StateServer`: keys ``data/<index or shard hex>``)
  and keeps this peer's entry for one dataset alive in the DHT (``directory``).
* :func:`members`, :func:`fetch_index`, :func:`fetch_shard`: one DHT read; the checkpoint
  fetcher (``fetch_state``) downloading from every provider at once, each chunk verified against
  the manifest (and the manifest against its id) and written to the store as it lands.
"""

from __future__ import annotations

import asyncio
import logging
import time

from dht import DHTError, DHTNode, InvalidRecord, TaskGroup, cancel_all, wait_event

from ..checkpoint.cid import cid as make_cid
from ..checkpoint.errors import StateTransferError
from ..checkpoint.fetch import fetch_state
from ..checkpoint.manifest import Manifest
from ..checkpoint.sources import ChunkSource
from ..checkpoint.state_server import StateServer
from ..checkpoint.directory import parse_address
from ..checkpoint.swarm import StoreSource, dial_address
from .directory import (
    MAX_ENTRY_BYTES,
    SUBKEY,
    Member,
    dataset_key,
    entry_value,
    id_of_serve_key,
    parse_entry,
    serve_key,
)
from .index import DatasetError, DatasetIndex
from .store import DataStore

log = logging.getLogger("p2ptrain.data")

DEFAULT_TTL = 60.0


class DataUnavailable(DatasetError):
    """No peer could supply what was asked (nobody announces it, or every provider failed)."""


async def members(node: DHTNode, dataset_id: bytes, num_shards: int) -> list[Member]:
    """Every peer's valid entry for the dataset (this one included)."""
    read = await node.get_owned(dataset_key(dataset_id), SUBKEY, max_size=MAX_ENTRY_BYTES)
    found = [parse_entry(p, e.value, num_shards) for p, e in read.values.items()]
    return [m for m in found if m is not None]


async def fetch_index(node: DHTNode, store: DataStore, dataset_id: bytes, *, timeout: float = 30.0) -> DatasetIndex:
    """The dataset's verified index: from the store, else from any peer with an entry for it."""
    try:
        return await asyncio.to_thread(store.index, dataset_id)
    except DatasetError:
        pass
    name = make_cid(dataset_id)
    read = await node.get_owned(dataset_key(dataset_id), SUBKEY, max_size=MAX_ENTRY_BYTES)
    wire = [(p, a) for p, e in read.values.items()
            if p != node.peer_id and isinstance(e.value, dict) and (a := parse_address(e.value.get("a")))]
    if not wire:
        raise DataUnavailable(f"no peer announces dataset {name}: check the CID and that a peer holding it runs "
                              "('p2ptrain data add' on one, then 'p2ptrain peer --dataset CID' or 'data get' there)")
    try:
        result = await fetch_state(node.host, serve_key(dataset_id), wire, manifest_id=dataset_id, timeout=timeout,
                                   max_total=0)
    except StateTransferError as e:
        raise DataUnavailable(f"dataset {name}: could not fetch its index: {e}") from None
    index = DatasetIndex.from_manifest(result.manifest, dataset_id)
    await asyncio.to_thread(store.put_index, index)
    return index


async def fetch_shard(node: DHTNode, store: DataStore, index: DatasetIndex, i: int, providers: list[Member], *,
                      timeout: float = 120.0, stall_timeout: float = 10.0) -> dict:
    """Download shard ``i`` from the ``providers`` that hold it, into ``store``; returns
    ``{peer: chunks}`` it came from. DataUnavailable says who failed and why."""
    ref = index.shards[i]
    wire = [(m.peer, m.addr) for m in providers if i in m.held and m.addr is not None and m.peer != node.peer_id]
    if not wire:
        raise DataUnavailable(f"dataset {index.cid}, shard {i}: no reachable peer holds it (its providers left); "
                              "start a peer that holds the dataset, or try again later")

    async def have(m: Manifest) -> set[int]:
        missing = set(await asyncio.to_thread(store.missing_chunks, m))
        return set(range(m.num_chunks)) - missing

    async def on_chunk(m: Manifest, c: int, data: memoryview) -> None:
        await asyncio.to_thread(store.add_chunk, m, c, data)

    try:
        result = await fetch_state(node.host, serve_key(ref.id), wire, manifest_id=ref.id, timeout=timeout,
                                   stall_timeout=stall_timeout, max_total=ref.size, have=have, on_chunk=on_chunk)
    except StateTransferError as e:
        raise DataUnavailable(f"dataset {index.cid}, shard {i}: {e}") from None
    await asyncio.to_thread(store.commit_shard, ref, index.format, result.manifest)
    for p in result.corrupt:
        log.warning("peer %s sent corrupt bytes of dataset %s (shard %d): dropped it", p.short(), index.cid, i)
    return dict(result.contributors)


async def fetch_shards(node: DHTNode, store: DataStore, index: DatasetIndex, shards: list[int], *,
                       parallel: int = 4, timeout: float = 120.0) -> dict:
    """Fetch ``shards`` (those not held), ``parallel`` at a time, each from every peer that holds
    it; returns ``{peer: chunks}`` over all of them. The first failure is raised."""
    providers = await members(node, index.id, len(index.shards))
    todo = [i for i in shards if not await asyncio.to_thread(store.has_shard, index.shards[i])]
    slots = asyncio.Semaphore(parallel)
    totals: dict = {}

    async def one(i: int) -> None:
        async with slots:
            for p, n in (await fetch_shard(node, store, index, i, providers, timeout=timeout)).items():
                totals[p] = totals.get(p, 0) + n

    tasks = [asyncio.ensure_future(one(i)) for i in todo]
    try:
        await asyncio.gather(*tasks)  # the first failure, as is (not an ExceptionGroup)
    finally:
        await cancel_all(tasks)
    return totals


class DataService:
    """Serves ``store``'s datasets from this peer and keeps its entry for ``index`` in the DHT.

    ``server``: the host's state server (a trainer's; one per host answers all keys); None
    starts one. ``training``: announce this peer as a live trainer (shards are assigned among
    those). ``changed()`` republishes at once (a shard was fetched); ``close`` withdraws the
    trainer flag first, so the others take this peer's shards over in their next assignment.
    """

    def __init__(self, node: DHTNode, store: DataStore, index: DatasetIndex, *, server: StateServer | None = None,
                 training: bool = False, ttl: float = DEFAULT_TTL):
        self.node, self.store, self.index = node, store, index
        self.training = training
        self.ttl = ttl
        self._server = server
        self._own_server = server is None
        self._tasks = TaskGroup("data service", log=log)
        self._wake = asyncio.Event()
        self._closed = False
        self.announced = 0

    async def __aenter__(self) -> DataService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        if self._server is None:
            self._server = StateServer(self.node.host)
            await self._server.start()
        self._server.add_resolver(self._resolve)
        await self._announce()  # before returning: a caller's next read sees this peer
        self._tasks.spawn(self._run(), name="dataset announcements")

    def changed(self) -> None:
        self._wake.set()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._tasks.close()
        if self.training:
            self.training = False
            try:
                await asyncio.wait_for(self._announce(), 5)
            except (DHTError, InvalidRecord, OSError, TimeoutError) as e:
                log.debug("could not withdraw from dataset %s: %s", self.index.cid, e)
        if self._server is not None:
            self._server.remove_resolver(self._resolve)
            if self._own_server:
                await self._server.close()

    async def _announce(self) -> None:
        held = await asyncio.to_thread(self.store.held, self.index)
        await self.node.store_owned(dataset_key(self.index.id), SUBKEY,
                                    entry_value(dial_address(self.node), held, self.training), time.time() + self.ttl)
        self.announced += 1

    async def _run(self) -> None:
        while True:
            await wait_event(self._wake, self.ttl / 3)
            self._wake.clear()
            try:
                await self._announce()
            except (DHTError, InvalidRecord, OSError) as e:
                log.warning("could not announce dataset %s: %s", self.index.cid, e)

    async def _resolve(self, key: str) -> list[ChunkSource]:
        mid = id_of_serve_key(key)
        if mid is None or not await asyncio.to_thread(self.store.serves, mid):
            return []
        try:
            m = await asyncio.to_thread(self.store.ckpt.manifest, mid)
        except Exception as e:  # noqa: BLE001 - damaged meanwhile: not ours to serve
            log.debug("cannot serve %s: %s", key, e)
            return []
        return [StoreSource(self.store.ckpt, m)]
