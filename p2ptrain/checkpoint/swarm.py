"""Checkpoints in the swarm: announce them in the DHT, find the latest, fetch from many providers.

With no master there is no checkpoint directory to ask. A peer that holds a checkpoint in its
:class:`~p2ptrain.checkpoint.store.CheckpointStore` serves it (a resolver on the host's
:class:`~p2ptrain.checkpoint.state_server.StateServer` reads chunks from disk on demand) and says so in
the DHT (``directory``: a provider entry per manifest, and the signed "latest checkpoint" record
of its run). A peer that wants one looks the records up, believes the newest that enough writers
agree on (``trust``: never one self-signed claim), finds the providers and downloads chunks
from all of them in parallel, each verified against the manifest and written to its own store as
it lands: a provider that sends bad bytes is dropped and its chunks fetched elsewhere, and a
fetch that is killed resumes where it stopped.

* :func:`announce`, :func:`find_latest` (:func:`latest_verdict`), :func:`find_providers`: one DHT round each.
* :func:`fetch_checkpoint`: everything a "get the run's latest checkpoint" needs.
* :class:`CheckpointService`: what a long-running peer owns: serves the store and keeps its
  announcements alive (republished while the checkpoints are held, cancelled on close).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dht import DHTError, DHTNode, InvalidRecord, PeerID, TaskGroup, wait_event

from ..addresses import Reach
from ..deadlines import CHECKPOINT_FETCH, LinkMeter, resolve
from .directory import (
    LATEST_HISTORY,
    LATEST_SUBKEY,
    MAX_ENTRY_BYTES,
    PROVIDER_SUBKEY,
    Provider,
    announce_period,
    latest_key,
    latest_value,
    parse_latest,
    parse_provider,
    provider_value,
    providers_key,
    report_once,
    run_of_transfer_key,
    transfer_key,
)
from .errors import StateTimeoutError, StateTooLargeError, StateTransferError
from .fetch import fetch_state
from .manifest import DEFAULT_MAX_TOTAL, Manifest
from .record import CheckpointRecord, RecordError, check_run_id
from .sources import ChunkSource
from .state_server import StateServer
from .trust import QUORUM, Verdict, decide, group_claims, refusal

if TYPE_CHECKING:
    from .info import CheckpointInfo
    from .store import CheckpointStore

log = logging.getLogger("p2ptrain.checkpoint")

#: how long announcements live in the DHT without a refresh
DEFAULT_TTL = 300.0
#: checkpoints per run a peer announces (the newest ones; a store keeps a few)
ANNOUNCE_PER_RUN = 8


class CheckpointUnavailable(StateTransferError):
    """No checkpoint (or no provider of it) could be found; the message says what to check."""


# ---------------------------------------------------------------------------------- DHT rounds


def dial_address(node: DHTNode) -> tuple[str, int] | None:
    """Where others dial ``node`` directly; None for a client-mode node or one behind NAT."""
    return Reach.of_node(node).addr


async def announce(node: DHTNode, store: CheckpointStore, info: CheckpointInfo, *, ttl: float = DEFAULT_TTL) -> None:
    """Publish this peer as a provider of ``info``'s manifest and, when this peer wrote its
    newest checkpoint of the run, that record as its "latest" entry. One round, no republishing
    (:class:`CheckpointService` does that). A client-mode node serves nothing and announces
    nothing."""
    if not Reach.of_node(node):
        return
    await _announce_provider(node, info.record, ttl)
    await _announce_latest(node, store, info.record.run_id, ttl)


async def _announce_provider(node: DHTNode, record: CheckpointRecord, ttl: float) -> None:
    reach = Reach.of_node(node)
    await node.store_owned(providers_key(record.run_id, record.manifest_id), PROVIDER_SUBKEY,
                           provider_value(reach.addr, record, reach.relays), time.time() + ttl)


async def _announce_latest(node: DHTNode, store: CheckpointStore, run_id: str, ttl: float) -> None:
    own = await asyncio.to_thread(_own_newest, store, run_id, node.peer_id)
    if own:
        await node.store_owned(latest_key(run_id), LATEST_SUBKEY, latest_value(own[0], own[1:]), time.time() + ttl)


def _own_newest(store: CheckpointStore, run_id: str, me: PeerID) -> list[CheckpointRecord]:
    """Our newest records of ``run_id`` (store order: newest first), as many as a latest entry holds."""
    return [i.record for i in store.list(run_id) if i.record.writer == me][:LATEST_HISTORY]


async def latest_verdict(node: DHTNode, run_id: str, *, trusted: Collection[PeerID] = (),
                         quorum: int = QUORUM, report: bool = True) -> Verdict:
    """Which "latest checkpoint" claim of ``run_id`` in the DHT to believe (``trust.decide``:
    ``quorum`` distinct writers, a ``trusted`` writer, or our own record). Forged, tampered or
    replayed entries are ignored and logged once; so are (``report``) the newer claims that are
    not believed, by their writers."""
    read = await node.get_owned(latest_key(run_id), LATEST_SUBKEY, max_size=MAX_ENTRY_BYTES)
    verdict = decide((rec for w, e in read.values.items() for rec in parse_latest(w, e.value, run_id)),
                     trusted=trusted, me=node.peer_id, quorum=quorum)
    if report:
        report_refused(verdict, quorum)
    return verdict


def report_refused(verdict: Verdict, quorum: int = QUORUM) -> None:
    """Name in the log, once each, the writers of the claims ``verdict`` refused."""
    for claim in verdict.refused:
        key = claim.record.manifest_id + claim.record.epoch.to_bytes(8, "big")
        report_once(", ".join(sorted(str(w) for w in claim.writers)), key, refusal(claim, quorum))


async def find_latest(node: DHTNode, run_id: str, *, trusted: Collection[PeerID] = (),
                      quorum: int = QUORUM) -> CheckpointRecord | None:
    """The record of the run's latest believed checkpoint (see :func:`latest_verdict`), or None."""
    verdict = await latest_verdict(node, run_id, trusted=trusted, quorum=quorum)
    return verdict.chosen.record if verdict.chosen is not None else None


async def find_providers(node: DHTNode, run_id: str, manifest_id: bytes) -> list[Provider]:
    """The peers that announced they serve ``manifest_id`` of ``run_id`` (this one excluded)."""
    read = await node.get_owned(providers_key(run_id, manifest_id), PROVIDER_SUBKEY, max_size=MAX_ENTRY_BYTES)
    found = [parse_provider(p, e.value, run_id, manifest_id) for p, e in read.values.items()]
    return [p for p in found if p is not None and p.peer != node.peer_id]


# ---------------------------------------------------------------------------------- fetching


@dataclass
class CheckpointFetch:
    """What a checkpoint download did: the stored checkpoint and where its chunks came from."""

    info: CheckpointInfo
    downloaded: int  # chunks downloaded now
    reused: int  # chunks already in the store (an earlier, interrupted fetch; shared blobs)
    contributors: dict[PeerID, int] = field(default_factory=dict)  # provider -> chunks it delivered
    dropped: dict[PeerID, str] = field(default_factory=dict)  # providers not used or given up on, and why
    corrupt: set[PeerID] = field(default_factory=set)  # providers that sent bytes failing verification
    seconds: float = 0.0


async def download_checkpoint(
    node: DHTNode, store: CheckpointStore, record: CheckpointRecord, providers: list[Provider], *,
    progress: Callable[[int, int], None] | None = None, timeout: float | None = None, stall_timeout: float = 10.0,
    rpc_timeout: float = 5.0, agreeing: Iterable[CheckpointRecord] = (), max_size: int | None = None,
    link: LinkMeter | None = None,
) -> CheckpointFetch:
    """Download ``record``'s checkpoint from ``providers`` into ``store`` and commit it, with the
    ``agreeing`` records of other writers of the same claim (the evidence ``ckpt ls`` shows).

    Chunks the store holds already are skipped; every other chunk is verified as it lands and
    written to the store at once, so an interrupted download loses at most the chunks in flight.
    The download is sized by the record: a manifest larger than the record's size, or a record
    larger than ``max_size`` bytes, is refused (:class:`StateTooLargeError`) before any chunk.
    ``progress(done, total)`` (bytes) is called from the event loop as chunks land. ``timeout``
    (None: derived from the record's size and ``link``, which times the download) bounds it all.
    """
    if not record.verify():
        raise CheckpointUnavailable(f"the record of checkpoint {record.manifest_id.hex()[:12]} is not validly signed")
    limit = DEFAULT_MAX_TOTAL if max_size is None else max_size
    if record.size > limit:
        raise StateTooLargeError(f"checkpoint {record.manifest_id.hex()[:12]} of run {record.run_id!r} is "
                                 f"{record.size} bytes (its record says), more than the {limit} expected here: refused")
    timeout = resolve(timeout, CHECKPOINT_FETCH, record.size, link)
    wire = [(p.peer, p.reach) for p in providers if p.peer != node.peer_id]
    done = got = 0

    async def have(m: Manifest) -> set[int]:
        nonlocal done
        missing = set(await asyncio.to_thread(store.missing_chunks, m))
        held = set(range(m.num_chunks)) - missing
        done = sum(b - a for a, b in map(m.chunk_span, held))
        if progress is not None:
            progress(done, m.total_size)
        return held

    async def on_chunk(m: Manifest, index: int, data: memoryview) -> None:
        nonlocal done, got
        await asyncio.to_thread(store.add_chunk, m, index, data)
        done += len(data)
        got += len(data)
        if progress is not None:
            progress(done, m.total_size)

    if not wire:
        raise CheckpointUnavailable(
            f"no peer announces checkpoint {record.manifest_id.hex()[:12]} (epoch {record.epoch}) of run "
            f"{record.run_id!r}: its providers have left; try again later or fetch an older one")
    result = await fetch_state(node.host, transfer_key(record.run_id), wire, manifest_id=record.manifest_id,
                               have=have, on_chunk=on_chunk, timeout=timeout, stall_timeout=stall_timeout,
                               rpc_timeout=rpc_timeout, max_total=record.size)
    if link is not None:
        link.observe_transfer(got, result.seconds)
    try:
        info = await asyncio.to_thread(_commit, store, result.manifest, record, agreeing)
    except RecordError as e:  # a validly signed record that does not describe this manifest (its size)
        raise CheckpointUnavailable(f"checkpoint {record.manifest_id.hex()[:12]} "
                                    f"of run {record.run_id!r}: {e}") from None
    log.info("fetched checkpoint %s (epoch %d, %.1f MB) of run %r: %d chunks from %d providers, %d already held, "
             "%.2f s", info.cid, record.epoch, result.manifest.total_size / 1e6, record.run_id,
             sum(result.contributors.values()), len(result.contributors), result.reused, result.seconds)
    return CheckpointFetch(info, sum(result.contributors.values()), result.reused, result.contributors,
                           result.dropped, result.corrupt, result.seconds)


def _commit(store: CheckpointStore, manifest: Manifest, record: CheckpointRecord,
            agreeing: Iterable[CheckpointRecord]) -> CheckpointInfo:
    info = store.commit(manifest, record)
    for other in agreeing:
        try:
            store.commit(manifest, other)
        except RecordError as e:  # (a claim's records name one manifest and size: not expected)
            log.debug("not keeping %s's record of checkpoint %s: %s", other.writer.short(), info.cid, e)
    return info


def _unbelieved(run_id: str, verdict: Verdict) -> str:
    more = len(verdict.refused) - 1
    return (f"no checkpoint of run {run_id!r} in the DHT is confirmed: {refusal(verdict.refused[0])}; or fetch it "
            f"by its CID" + (f" ({more} more unconfirmed claim{'s' * (more > 1)})" if more else ""))


async def fetch_checkpoint(
    node: DHTNode, store: CheckpointStore, *, run_id: str, manifest_id: bytes | None = None,
    progress: Callable[[int, int], None] | None = None, timeout: float | None = None,
    trusted: Collection[PeerID] = (), max_size: int | None = None, link: LinkMeter | None = None,
) -> CheckpointInfo:
    """Fetch a checkpoint of ``run_id`` from the swarm into ``store``: ``manifest_id``, or the
    run's latest (the newest claim that ``QUORUM`` distinct writers, one ``trusted`` writer or
    our own record vouch for; see ``trust``). Returns at once when the store holds it already.
    ``max_size``: refuse a checkpoint larger than that many bytes (default: the record's size,
    up to 64 GiB).

    Chunks come from every provider in parallel, each verified; a fetch interrupted earlier
    resumes from the chunks it stored. When a :class:`CheckpointService` runs on ``node``, the
    new checkpoint is served and announced right away (a one-shot process does not announce what
    it will not be there to serve).

    ``timeout`` bounds it all; None: derived from the checkpoint's size and ``link`` (our
    measured bandwidth, which the download then updates) once its record is found.

    Raises :class:`CheckpointUnavailable` (nothing announced, no provider left) or another
    :class:`~p2ptrain.checkpoint.errors.StateTransferError` (every provider failed, timeout).
    """
    check_run_id(run_id)
    limit = CHECKPOINT_FETCH.fallback if timeout is None else timeout  # (until the checkpoint's size is known)
    deadline = asyncio.timeout(limit)
    t0 = time.monotonic()
    try:
        async with deadline:
            record: CheckpointRecord | None = None
            agreeing: tuple[CheckpointRecord, ...] = ()
            if manifest_id is None:
                verdict = await latest_verdict(node, run_id, trusted=trusted, report=False)
                if verdict.chosen is None:  # (the error names the claimants: no log line besides)
                    raise CheckpointUnavailable(_unbelieved(run_id, verdict) if verdict.refused else (
                        f"no checkpoint of run {run_id!r} is announced in the DHT: check the run id and the "
                        "bootstrap peers (a peer announces its checkpoints while it runs)"))
                report_refused(verdict)
                record, *rest = verdict.chosen.records
                agreeing = tuple(rest)
                manifest_id = record.manifest_id
            local = await asyncio.to_thread(_held, store, run_id, manifest_id)
            if local is not None:
                if progress is not None:
                    progress(local.record.size, local.record.size)
                return local
            providers = await find_providers(node, run_id, manifest_id)
            if record is None and providers:  # by id: the content is the caller's choice, any record names it
                record, *rest = group_claims(p.record for p in providers)[0].records
                agreeing = tuple(rest)
            if record is None:
                raise CheckpointUnavailable(
                    f"no peer announces checkpoint {manifest_id.hex()[:12]} of run {run_id!r}: check the id "
                    "(p2ptrain ckpt ls on a peer that has it) and that such a peer is running")
            if timeout is None:
                limit = resolve(None, CHECKPOINT_FETCH, record.size, link)
                deadline.reschedule(asyncio.get_running_loop().time() + limit - (time.monotonic() - t0))
            remaining = max(0.001, limit - (time.monotonic() - t0))
            fetched = await download_checkpoint(node, store, record, providers, progress=progress, timeout=remaining,
                                                agreeing=agreeing, max_size=max_size, link=link)
    except TimeoutError:
        if not deadline.expired():
            raise
        raise StateTimeoutError(f"fetching a checkpoint of run {run_id!r} timed out after {limit} s "
                                "(finding it in the DHT)") from None
    service = _services.get(node)
    if service is not None and Path(service.store.root).resolve() == Path(store.root).resolve():
        service.announce_soon(fetched.info)
    return fetched.info


def _held(store: CheckpointStore, run_id: str, manifest_id: bytes) -> CheckpointInfo | None:
    for info in store.list(run_id):
        if info.record.manifest_id == manifest_id:
            return info
    return None


# ---------------------------------------------------------------------------------- serving


class StoreSource:
    """One checkpoint of a store, as a :class:`~p2ptrain.checkpoint.sources.ChunkSource`:
    chunks are read from disk when a peer asks, in a worker thread, and verified by the store
    (a rotten blob is never served: the request is reset and the fetcher goes elsewhere)."""

    def __init__(self, store: CheckpointStore, manifest: Manifest):
        self.store = store
        self.manifest = manifest

    async def chunk(self, index: int) -> bytes:
        try:
            return await asyncio.to_thread(self.store.read_chunk, self.manifest, index)
        except (LookupError, OSError):
            raise
        except Exception as e:  # the store's CorruptBlobError and the like: not ours to serve
            raise LookupError(f"chunk {index} of {self.manifest.id.hex()[:12]}: {e}") from e


#: the running service of each node, so that fetch_checkpoint can announce what it fetched
_services: weakref.WeakKeyDictionary[DHTNode, CheckpointService] = weakref.WeakKeyDictionary()


class CheckpointService:
    """Serves ``store``'s checkpoints from this peer and keeps its DHT announcements alive.

    ``server``: the host's :class:`StateServer` to add the store to (a trainer already runs one
    for its live state; one server per host answers both); None starts one of its own.
    ``run_id``: announce only that run's checkpoints (every checkpoint in the store is served
    either way). Announcements are refreshed every ``ttl / 3`` seconds while the checkpoints
    are in the store; gc'd ones simply stop being refreshed and expire.
    """

    def __init__(self, node: DHTNode, store: CheckpointStore, *, run_id: str | None = None,
                 server: StateServer | None = None, ttl: float = DEFAULT_TTL):
        self.node = node
        self.store = store
        self.run_id = check_run_id(run_id) if run_id is not None else None
        self.ttl = ttl
        self.period = announce_period(ttl)
        self._server = server
        self._own_server = server is None
        self._manifests: OrderedDict[bytes, Manifest] = OrderedDict()
        self._tasks = TaskGroup("checkpoint service", log=log)  # the announce loop and one-off announcements
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self.announced = 0  # announcement rounds completed (for tests and metrics)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._server is None:
            self._server = StateServer(self.node.host)
            await self._server.start()
        self._server.add_resolver(self._resolve)
        _services[self.node] = self
        self._tasks.spawn(self._run(), name="checkpoint announcements")

    async def close(self) -> None:
        """Stop announcing and serving (idempotent). Entries already in the DHT expire by themselves."""
        if self._closed:
            return
        self._closed = True
        if _services.get(self.node) is self:
            del _services[self.node]
        await self._tasks.close()
        if self._server is not None:
            self._server.remove_resolver(self._resolve)
            if self._own_server:
                await self._server.close()

    async def __aenter__(self) -> CheckpointService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ announcing

    def announce_soon(self, info: CheckpointInfo) -> None:
        """Announce ``info`` now, from any thread (a trainer's save thread); the task is ours."""
        if self._loop is None or self._closed:
            return
        self._loop.call_soon_threadsafe(self._spawn_announce, info)

    def _spawn_announce(self, info: CheckpointInfo) -> None:
        if self._closed:
            return
        self._tasks.spawn(self._announce_one(info))

    async def _announce_one(self, info: CheckpointInfo) -> None:
        try:
            await announce(self.node, self.store, info, ttl=self.ttl)
            log.debug("announced checkpoint %s (epoch %d)", info.cid, info.record.epoch)
        except (DHTError, InvalidRecord, OSError) as e:
            log.warning("could not announce checkpoint %s: %s (retrying in %.0f s)", info.cid, e, self.period)

    async def _run(self) -> None:
        while True:
            try:
                await self._announce_all()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a bad store entry must not end the announcements
                log.warning("announcing checkpoints failed: %s; retrying in %.0f s", e, self.period)
            self.announced += 1
            await wait_event(self._wake, self.period)
            self._wake.clear()

    async def _announce_all(self) -> None:
        if not Reach.of_node(self.node):
            return
        infos = await asyncio.to_thread(self.store.list, self.run_id)
        per_run: dict[str, int] = {}
        for info in infos:  # newest first
            run = info.record.run_id
            per_run[run] = per_run.get(run, 0) + 1
            if per_run[run] <= ANNOUNCE_PER_RUN:
                await _announce_provider(self.node, info.record, self.ttl)
        for run in per_run:
            await _announce_latest(self.node, self.store, run, self.ttl)

    # ------------------------------------------------------------------ serving

    async def _resolve(self, key: str) -> list[ChunkSource]:
        run_id = run_of_transfer_key(key)
        if run_id is None:
            return []
        infos = await asyncio.to_thread(self.store.list, run_id)
        sources: list[ChunkSource] = []
        for info in infos[:ANNOUNCE_PER_RUN * 2]:
            manifest = await self._manifest(info.record.manifest_id)
            if manifest is not None:
                sources.append(StoreSource(self.store, manifest))
        return sources

    async def _manifest(self, manifest_id: bytes) -> Manifest | None:
        m = self._manifests.get(manifest_id)
        if m is None:
            try:
                m = await asyncio.to_thread(self.store.manifest, manifest_id)
            except Exception as e:  # noqa: BLE001 - gc'd or damaged meanwhile: serve the others
                log.debug("cannot serve checkpoint %s: %s", manifest_id.hex()[:12], e)
                return None
            self._manifests[manifest_id] = m
            while len(self._manifests) > 64:
                self._manifests.popitem(last=False)
        return m

