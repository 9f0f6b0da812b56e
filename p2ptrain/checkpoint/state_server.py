"""Serve state snapshots, per key, to any peer that asks (the serving side of ``state_protocol``).

What is served under a key comes from ``ChunkSource`` objects (``sources``): in-memory snapshots
(``publish``, what a trainer serves to late joiners) and sources found on demand by resolvers
(``add_resolver``; e.g. the checkpoints of an on-disk store, read chunk by chunk when asked).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import torch

from dht import Connection, Host, Stream, TaskGroup

from .live import LiveSource
from .manifest import Manifest
from .sources import ChunkSource, MemorySource, Resolver, evict
from .state_protocol import (
    CHUNKS_PROTOCOL,
    INLINE_MANIFEST_MAX,
    MANIFEST_METHOD,
    MANIFEST_PROTOCOL,
    MAX_HELD,
    check_id,
    check_key,
)
from .throttle import TokenBucket

if TYPE_CHECKING:
    from typing import Self

log = logging.getLogger("p2ptrain.checkpoint")

#: a rate-limited server sends chunks in pieces of this size
_THROTTLE_PIECE = 1 << 20


class StateServer:
    """Serves the snapshots published on this host, per key, to any peer that asks.

    Keeps the latest ``keep`` snapshots per key (default 2: the latest, plus the previous one so
    downloads that started before a ``publish`` can finish), and older live sources that a peer is
    still downloading. Chunk streams already running keep their snapshot alive until they finish,
    whatever is published meanwhile.
    ``publish`` must be called on the host's event loop (from the training thread, use
    ``loop.call_soon_threadsafe(server.publish, key, manifest, buffer)``).

    Keys nothing was published for are asked of the resolvers (``add_resolver``), in order; one
    server per host serves both a trainer's live state and a checkpoint store.

    ``rate``: cap on the bytes per second this server sends in chunk streams, all streams
    together (a token bucket; None: unlimited) -- to emulate a provider's uplink in benchmarks,
    or to keep bandwidth for training while serving.
    """

    def __init__(self, host: Host, *, keep: int = 2, write_timeout: float = 30.0, rate: float | None = None):
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.host = host
        self.keep = keep
        self.write_timeout = write_timeout
        self._bucket = TokenBucket(rate) if rate is not None else None
        self._snapshots: dict[str, list[ChunkSource]] = {}
        self._providers: dict[str, Callable[[], Awaitable[tuple[Manifest, torch.Tensor] | None]]] = {}
        self._resolvers: list[Resolver] = []
        self._refreshing: dict[str, asyncio.Task] = {}
        self._tasks = TaskGroup("state server", log=log)  # snapshot refreshes and the streams being served
        self._started = False
        self._closed = False
        self.bytes_sent = 0  # chunk bytes sent, all streams

    async def start(self) -> None:
        """Register the RPC and stream handlers on the host."""
        if self._closed:
            raise RuntimeError("StateServer is closed")
        self.host.on_request(MANIFEST_METHOD, self._on_manifest)
        self.host.on_stream(MANIFEST_PROTOCOL, self._on_manifest_stream)
        self.host.on_stream(CHUNKS_PROTOCOL, self._on_chunks)
        self._started = True

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Unregister the handlers, reset the streams being served and drop every snapshot."""
        if self._closed:
            return
        self._closed = True
        if self._started:
            self.host.off_stream(MANIFEST_PROTOCOL)
            self.host.off_stream(CHUNKS_PROTOCOL)
            self.host.off_request(MANIFEST_METHOD, self._on_manifest)
        await self._tasks.close()
        for snaps in self._snapshots.values():
            evict(snaps)
        self._snapshots.clear()
        self._resolvers.clear()

    # ------------------------------------------------------------------ publishing

    def publish(self, key: str, manifest: Manifest, buffer: torch.Tensor,
                on_release: Callable[[torch.Tensor], None] | None = None) -> None:
        """Serve ``buffer`` (from ``build_snapshot``) under ``key`` as its latest state.

        The buffer is served as is, never copied or re-hashed here: it must not change afterwards,
        until ``on_release(buffer)`` says nothing here reads it any more (see ``MemorySource``).
        """
        if self._closed:
            raise RuntimeError("StateServer is closed")
        self.publish_source(key, MemorySource(manifest, buffer, on_release))

    def publish_source(self, key: str, source: ChunkSource) -> None:
        """Serve ``source`` under ``key`` as its latest state (e.g. a :class:`LiveSource`)."""
        if self._closed:
            raise RuntimeError("StateServer is closed")
        check_key(key)
        old = self._snapshots.get(key, [])
        snaps = [source, *(s for s in old if s.manifest.id != source.manifest.id)]
        # past ``keep``, a live version a peer is still downloading stays (its next segment request finds it)
        self._snapshots[key] = snaps[: self.keep] + [s for s in snaps[self.keep:]
                                                     if isinstance(s, LiveSource) and s.busy]
        evict(s for s in old if s not in self._snapshots[key])

    def provide(self, key: str, refresh: Callable[[], Awaitable[tuple[Manifest, torch.Tensor] | None]]) -> None:
        """Snapshot ``key`` lazily: before answering a manifest request, await ``refresh()``,
        which returns a new snapshot to publish, or None when the latest one is still current
        (or when it published one itself, e.g. with ``on_release``).

        A trainer's state changes every step and a snapshot costs a copy and a hash of all of it,
        so it is taken only when a peer asks (and at most once at a time, however many ask).
        """
        check_key(key)
        self._providers[key] = refresh

    def add_resolver(self, resolver: Resolver) -> None:
        """Ask ``resolver`` for the sources of keys nothing was published for (e.g. a store's
        checkpoints). A resolver that raises is logged and skipped for that request."""
        if self._closed:
            raise RuntimeError("StateServer is closed")
        self._resolvers.append(resolver)

    def remove_resolver(self, resolver: Resolver) -> None:
        if resolver in self._resolvers:
            self._resolvers.remove(resolver)

    async def _refresh(self, key: str) -> None:
        refresh = self._providers.get(key)
        if refresh is None or self._closed:
            return
        task = self._refreshing.get(key)
        if task is None or task.done():
            async def run() -> None:
                snap = await refresh()
                if snap is not None and not self._closed:
                    self.publish(key, *snap)
            task = self._refreshing[key] = self._tasks.spawn(run(), awaited=True)  # (its error: logged below)
        try:
            await asyncio.shield(task)
        except Exception as e:  # noqa: BLE001 - serve the previous snapshot rather than fail the request
            log.warning("could not snapshot %r for a peer: %s", key, e)

    def drop_idle(self, key: str) -> None:
        """Stop serving the snapshots of ``key`` older than the latest that no stream is reading
        (their buffers go back to their owners now instead of after ``keep`` more publishes)."""
        snaps = self._snapshots.get(key)
        if not snaps:
            return
        idle = [s for s in snaps[1:] if isinstance(s, (MemorySource, LiveSource)) and not s.busy]
        self._snapshots[key] = [s for s in snaps if s not in idle]
        evict(idle)

    def unpublish(self, key: str) -> None:
        """Stop serving ``key`` (streams already running finish)."""
        evict(self._snapshots.pop(key, []))

    def latest(self, key: str) -> Manifest | None:
        snaps = self._snapshots.get(key)
        return snaps[0].manifest if snaps else None

    async def _held(self, key: str) -> list[ChunkSource]:
        """What is served under ``key``, the latest first: published snapshots, else a resolver's."""
        snaps = self._snapshots.get(key)
        if snaps:
            return snaps
        for resolver in list(self._resolvers):
            try:
                found = await resolver(key)
            except Exception as e:  # noqa: BLE001 - a broken source must not break the server
                log.warning("could not list what to serve under %r: %s", key, e)
                continue
            if found:
                return found
        return []

    async def _find(self, key: str, mid: bytes) -> ChunkSource | None:
        for s in await self._held(key):
            if s.manifest.id == mid:
                return s
        return None

    # ------------------------------------------------------------------ handlers

    async def _on_manifest(self, _conn: Connection, args: Any) -> Any:
        if not isinstance(args, dict):
            raise TypeError("malformed state request")
        key = check_key(args.get("key"))
        wanted = args.get("id")
        if wanted is not None:
            wanted = check_id(wanted)
        await self._refresh(key)
        snaps = await self._held(key)
        if not snaps or self._closed:
            return None
        m = next((s.manifest for s in snaps if s.manifest.id == wanted), snaps[0].manifest)
        enc = m.encoded
        held = [s.manifest.id for s in snaps[:MAX_HELD]]
        if m.id not in held:
            held[-1:] = [m.id]
        return {
            "id": m.id,
            "size": len(enc),
            "manifest": enc if len(enc) <= INLINE_MANIFEST_MAX else None,
            "held": held,
        }

    async def _lookup(self, stream: Stream) -> ChunkSource | None:
        hdr = stream.header
        try:
            if not isinstance(hdr, dict):
                raise TypeError("header must be a map")
            key, mid = check_key(hdr.get("key")), check_id(hdr.get("id"))
        except (TypeError, ValueError) as e:
            stream.reset(f"malformed header: {e}")
            return None
        snap = await self._find(key, mid)
        if snap is None or self._closed:
            stream.reset("state no longer held")
            return None
        return snap

    async def _on_manifest_stream(self, stream: Stream) -> None:
        with self._tasks.adopt():
            snap = await self._lookup(stream)
            if snap is not None:
                await stream.write(snap.manifest.encoded, timeout=self.write_timeout)

    async def _on_chunks(self, stream: Stream) -> None:
        with self._tasks.adopt():
            ahead: asyncio.Future | None = None
            held: MemorySource | LiveSource | None = None
            try:
                snap = await self._lookup(stream)
                if snap is None:
                    return
                if isinstance(snap, (MemorySource, LiveSource)):
                    if not snap.acquire():  # released while the request was looked up
                        stream.reset("state no longer held")
                        return
                    held = snap
                first, count = stream.header.get("first"), stream.header.get("count")
                m = snap.manifest
                if type(first) is not int or type(count) is not int or not (
                        0 <= first and 1 <= count and first + count <= m.num_chunks):
                    stream.reset(f"chunk range out of bounds (the state has {m.num_chunks} chunks)")
                    return
                end = first + count
                loop = asyncio.get_running_loop()
                ahead = asyncio.ensure_future(snap.chunk(first))
                for i in range(first, end):
                    await self._before_chunk(stream.header["key"], i)
                    try:
                        data = await ahead
                    except (LookupError, OSError, ValueError) as e:
                        log.warning("cannot serve chunk %d of %s: %s", i, m.id.hex()[:12], e)
                        stream.reset(f"chunk {i} is no longer held here")
                        return
                    # the next chunk is read (from disk, for a store) while this one is sent
                    ahead = asyncio.ensure_future(snap.chunk(i + 1)) if i + 1 < end else None
                    a, b = m.chunk_span(i)
                    if len(data) != b - a:
                        stream.reset(f"chunk {i} is damaged here")
                        return
                    if self._bucket is None:
                        await stream.write(data, timeout=self.write_timeout)
                    else:  # in pieces, so a slow cap never leaves the fetcher without data for long
                        view = memoryview(data)
                        for p in range(0, len(view), _THROTTLE_PIECE):
                            piece = view[p : p + _THROTTLE_PIECE]
                            delay = self._bucket.take(len(piece), loop.time())
                            if delay > 0:
                                await asyncio.sleep(delay)  # the uplink cap, not synchronisation
                            await stream.write(piece, timeout=self.write_timeout)
                    self.bytes_sent += b - a
            finally:
                if ahead is not None and not ahead.done():
                    ahead.cancel()
                if ahead is not None:
                    # a read that failed or was abandoned must not be reported as never retrieved
                    ahead.add_done_callback(lambda f: f.cancelled() or f.exception())
                if held is not None:
                    held.release()

    async def _before_chunk(self, key: str, index: int) -> None:
        """Hook before each chunk is sent (tests override it to simulate slow or dying peers)."""
