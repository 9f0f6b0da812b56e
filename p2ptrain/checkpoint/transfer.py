"""Serve state snapshots to peers and download one from several peers at once, verified.

A late joiner must catch up with the swarm: it asks a handful of peers for their current
manifest, picks the one most of them hold, and pulls disjoint chunk ranges from all of them in
parallel straight into one preallocated buffer, checking each chunk's blake3 against the
manifest as it lands. A peer that sends a bad chunk is never asked again; a peer that dies,
stalls or resets only loses the chunks it had not delivered, which go back to the others.

Wire (on ``dht.transport`` connections):

- RPC ``p2ptrain.state.manifest`` ``{"key": str, "id"?: bytes}`` -> ``None`` or
  ``{"id": bytes, "size": int, "manifest": bytes | None, "held": [bytes, ...]}``: the latest
  manifest for ``key`` (or manifest ``id`` when the request names one this provider holds;
  inline when it fits an RPC message, else ``None``), and manifest ids still served for the
  key (the latest first).
- stream ``p2ptrain.state.manifest/1`` header ``{"key", "id"}`` -> the manifest bytes (for
  manifests too large for an RPC reply, which is limited to 1 MiB).
- stream ``p2ptrain.state.chunks/1`` header ``{"key", "id", "first", "count"}`` -> the raw
  bytes of chunks ``first .. first+count-1``, or a reset if that manifest is no longer held.

What a server serves under a key comes from ``ChunkSource`` objects: in-memory snapshots
(``publish``, what a trainer serves to late joiners) and sources found on demand by resolvers
(``add_resolver``; e.g. the checkpoints of an on-disk store, read chunk by chunk when asked).
A fetch can skip chunks the caller already has and hand each verified chunk to a sink instead
of one big buffer (``have=``/``on_chunk=``), which is how a checkpoint download resumes; or put
chosen tensors' bytes straight into memory the caller holds (``place=``, see ``placement``).

The download schedule (``ChunkSchedule``) is sans-IO; ``fetch_state`` is the asyncio shell.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import blake3
import torch

from dht.aio import cancel_all
from dht.errors import DHTError
from dht.identity import PeerID
from dht.stream import Stream
from dht.transport import Connection, Host
from dht.wire import MAX_MESSAGE

from .manifest import (
    DEFAULT_MAX_TOTAL,
    DIGEST_SIZE,
    MAX_MANIFEST_BYTES,
    Manifest,
    ManifestError,
    StateTooLarge,
    restore,
)
from .placement import Placement
from .throttle import TokenBucket

if TYPE_CHECKING:
    from typing import Self

log = logging.getLogger("p2ptrain.checkpoint")

MANIFEST_METHOD = "p2ptrain.state.manifest"
MANIFEST_PROTOCOL = "p2ptrain.state.manifest/1"
CHUNKS_PROTOCOL = "p2ptrain.state.chunks/1"
MAX_KEY_LEN = 256
#: manifests up to this size travel inside the RPC reply; larger ones over a stream
INLINE_MANIFEST_MAX = MAX_MESSAGE - 4096
#: at most this many previous manifest ids are listed in a reply
_MAX_HELD = 8
#: a rate-limited server sends chunks in pieces of this size
_THROTTLE_PIECE = 1 << 20

Address = tuple[str, int]
Provider = tuple[PeerID, Address | None]


class StateTransferError(Exception):
    """Fetching state failed; the message names the key, the manifest and what went wrong."""


class NoProviderError(StateTransferError):
    """No reachable provider holds the requested state (or a valid manifest for it)."""


class StateTooLargeError(NoProviderError):
    """The state offered is larger than the fetch expects (``max_total``): refused before allocating it."""


class ChunksUnavailableError(StateTransferError):
    """Every provider of the chosen manifest failed before all chunks were verified."""


class StateTimeoutError(StateTransferError, TimeoutError):
    """The fetch did not finish within its timeout."""


# ---------------------------------------------------------------------------- serving


class ChunkSource(Protocol):
    """One snapshot a server can serve: its manifest, and its chunks on demand.

    ``chunk`` returns exactly chunk ``index``'s bytes (a server never re-hashes what a source
    returns; a source backed by something that can rot, like a disk, verifies them itself) and
    raises ``LookupError`` (or ``OSError``) when the chunk is no longer there.
    """

    manifest: Manifest

    async def chunk(self, index: int) -> bytes | bytearray | memoryview: ...


@dataclass(eq=False)
class MemorySource:
    """A snapshot in one buffer (from ``build_snapshot``), served without copying.

    ``on_release(buffer)``: called once the server no longer publishes the snapshot and no
    stream reads it any more, so its owner can reuse the memory (see ``checkpoint.recycle``);
    from then on ``acquire`` fails and a late request is told the state is no longer held.
    """

    manifest: Manifest
    buffer: torch.Tensor
    on_release: Callable[[torch.Tensor], None] | None = field(default=None, repr=False)
    view: memoryview = field(init=False, repr=False)
    _users: int = field(default=0, init=False, repr=False)
    _evicted: bool = field(default=False, init=False, repr=False)
    _released: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.buffer, torch.Tensor) or self.buffer.dtype != torch.uint8 or self.buffer.dim() != 1 \
                or self.buffer.device.type != "cpu" or not self.buffer.is_contiguous():
            raise ValueError("buffer must be a contiguous 1-D uint8 CPU tensor (as build_snapshot returns)")
        if self.buffer.numel() != self.manifest.total_size:
            raise ValueError(f"buffer holds {self.buffer.numel()} bytes, the manifest describes "
                             f"{self.manifest.total_size}")
        self.view = memoryview(self.buffer.numpy())

    async def chunk(self, index: int) -> memoryview:
        if self._released:
            raise LookupError("the snapshot's buffer was released")
        a, b = self.manifest.chunk_span(index)
        return self.view[a:b]

    @property
    def busy(self) -> bool:
        """Whether a stream is reading it."""
        return self._users > 0

    def acquire(self) -> bool:
        """Keep the buffer for a stream that reads it; False once it was released."""
        if self._released:
            return False
        self._users += 1
        return True

    def release(self) -> None:
        self._users -= 1
        self._maybe_release()

    def evict(self) -> None:
        """No longer published: release the buffer once the streams reading it finish."""
        self._evicted = True
        self._maybe_release()

    def _maybe_release(self) -> None:
        if self._evicted and self._users <= 0 and not self._released:
            self._released = True
            if self.on_release is not None:
                self.on_release(self.buffer)


#: finds what to serve under a key that nothing was published for: ``await resolver(key)`` ->
#: sources, the latest first (empty when the resolver does not know the key)
Resolver = Callable[[str], Awaitable[list[ChunkSource]]]


def _evict(sources: Iterable[ChunkSource]) -> None:
    for s in sources:
        if isinstance(s, MemorySource):
            s.evict()


def _check_key(key: Any) -> str:
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LEN:
        raise ValueError(f"state key must be a non-empty str of at most {MAX_KEY_LEN} characters")
    return key


def _check_id(mid: Any) -> bytes:
    if not isinstance(mid, bytes) or len(mid) != DIGEST_SIZE:
        raise ValueError(f"manifest id must be {DIGEST_SIZE} bytes")
    return mid


class StateServer:
    """Serves the snapshots published on this host, per key, to any peer that asks.

    Keeps the latest ``keep`` snapshots per key (default 2: the latest, plus the previous one so
    downloads that started before a ``publish`` can finish). Chunk streams already running keep
    their snapshot alive until they finish, whatever is published meanwhile.
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
        self._tasks: set[asyncio.Task] = set()
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
        await cancel_all(self._tasks)
        for snaps in self._snapshots.values():
            _evict(snaps)
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
        _check_key(key)
        source = MemorySource(manifest, buffer, on_release)
        old = self._snapshots.get(key, [])
        snaps = [source, *(s for s in old if s.manifest.id != manifest.id)]
        self._snapshots[key] = snaps[: self.keep]
        _evict(s for s in old if s not in self._snapshots[key])

    def provide(self, key: str, refresh: Callable[[], Awaitable[tuple[Manifest, torch.Tensor] | None]]) -> None:
        """Snapshot ``key`` lazily: before answering a manifest request, await ``refresh()``,
        which returns a new snapshot to publish, or None when the latest one is still current
        (or when it published one itself, e.g. with ``on_release``).

        A trainer's state changes every step and a snapshot costs a copy and a hash of all of it,
        so it is taken only when a peer asks (and at most once at a time, however many ask).
        """
        _check_key(key)
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
        if refresh is None:
            return
        task = self._refreshing.get(key)
        if task is None or task.done():
            async def run() -> None:
                snap = await refresh()
                if snap is not None and not self._closed:
                    self.publish(key, *snap)
            task = self._refreshing[key] = asyncio.get_running_loop().create_task(run())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
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
        idle = [s for s in snaps[1:] if isinstance(s, MemorySource) and not s.busy]
        self._snapshots[key] = [s for s in snaps if s not in idle]
        _evict(idle)

    def unpublish(self, key: str) -> None:
        """Stop serving ``key`` (streams already running finish)."""
        _evict(self._snapshots.pop(key, []))

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
        key = _check_key(args.get("key"))
        wanted = args.get("id")
        if wanted is not None:
            wanted = _check_id(wanted)
        await self._refresh(key)
        snaps = await self._held(key)
        if not snaps or self._closed:
            return None
        m = next((s.manifest for s in snaps if s.manifest.id == wanted), snaps[0].manifest)
        enc = m.encoded
        held = [s.manifest.id for s in snaps[:_MAX_HELD]]
        if m.id not in held:
            held[-1:] = [m.id]
        return {
            "id": m.id,
            "size": len(enc),
            "manifest": enc if len(enc) <= INLINE_MANIFEST_MAX else None,
            "held": held,
        }

    def _own(self) -> asyncio.Task:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        return task

    async def _lookup(self, stream: Stream) -> ChunkSource | None:
        hdr = stream.header
        try:
            if not isinstance(hdr, dict):
                raise TypeError("header must be a map")
            key, mid = _check_key(hdr.get("key")), _check_id(hdr.get("id"))
        except (TypeError, ValueError) as e:
            stream.reset(f"malformed header: {e}")
            return None
        snap = await self._find(key, mid)
        if snap is None or self._closed:
            stream.reset("state no longer held")
            return None
        return snap

    async def _on_manifest_stream(self, stream: Stream) -> None:
        task = self._own()
        try:
            snap = await self._lookup(stream)
            if snap is not None:
                await stream.write(snap.manifest.encoded, timeout=self.write_timeout)
        finally:
            self._tasks.discard(task)

    async def _on_chunks(self, stream: Stream) -> None:
        task = self._own()
        ahead: asyncio.Future | None = None
        held: MemorySource | None = None
        try:
            snap = await self._lookup(stream)
            if snap is None:
                return
            if isinstance(snap, MemorySource):
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
            self._tasks.discard(task)

    async def _before_chunk(self, key: str, index: int) -> None:
        """Hook before each chunk is sent (tests override it to simulate slow or dying peers)."""


# ---------------------------------------------------------------------------- the schedule (sans-IO)


class ChunkSchedule:
    """Which chunks are still needed and who is fetching what. No IO, no clocks.

    Chunks are handed out as contiguous segments (one stream request each). A provider reports
    chunks as verified in order; when its request ends early (failure), the unverified rest of
    its segment goes back to the front of the queue for someone else. Chunks in ``have`` (the
    downloader holds them already, e.g. from an interrupted fetch) are never handed out.
    """

    def __init__(self, num_chunks: int, segment: int, have: Iterable[int] = ()):
        if segment < 1:
            raise ValueError("segment must be at least 1 chunk")
        self.num_chunks = num_chunks
        held = {i for i in have if 0 <= i < num_chunks}
        self._pending: collections.deque[tuple[int, int]] = collections.deque()
        run_start = None
        for i in range(num_chunks + 1):
            needed = i < num_chunks and i not in held
            if needed and run_start is None:
                run_start = i
            elif not needed and run_start is not None:
                self._pending.extend((a, min(a + segment, i)) for a in range(run_start, i, segment))
                run_start = None
        self._active: dict[Any, list[int]] = {}  # provider -> [next unverified chunk, end]
        self.reused = len(held)
        self.verified_count = len(held)
        self.chunks_from: collections.Counter = collections.Counter()

    @property
    def complete(self) -> bool:
        return self.verified_count == self.num_chunks

    @property
    def idle(self) -> bool:
        """Nothing left to hand out and nothing in flight: waiting for work is pointless."""
        return not self._pending and not self._active

    def take(self, provider: Any) -> tuple[int, int] | None:
        """The next segment [first, end) for ``provider``, or None if none is waiting."""
        if provider in self._active:
            raise RuntimeError("provider already has a segment in flight")
        if not self._pending:
            return None
        a, b = self._pending.popleft()
        self._active[provider] = [a, b]
        return a, b

    def verified(self, provider: Any, index: int) -> None:
        seg = self._active[provider]
        if index != seg[0]:
            raise RuntimeError(f"chunk {index} verified out of order (expected {seg[0]})")
        seg[0] += 1
        self.verified_count += 1
        self.chunks_from[provider] += 1

    def done(self, provider: Any) -> None:
        """``provider`` finished its segment (every chunk of it verified)."""
        a, b = self._active.pop(provider)
        if a != b:
            raise RuntimeError(f"segment ended with chunks {a}..{b - 1} unverified")

    def failed(self, provider: Any) -> None:
        """``provider``'s request ended early: requeue what it did not deliver."""
        seg = self._active.pop(provider, None)
        if seg is not None and seg[0] < seg[1]:
            self._pending.appendleft((seg[0], seg[1]))

    def missing(self) -> list[tuple[int, int]]:
        """Chunk ranges [first, end) not yet verified (queued or in flight), sorted."""
        return sorted(list(self._pending) + [(a, b) for a, b in self._active.values() if a < b])


def _short(peer: PeerID) -> str:
    text = str(peer)
    return text if len(text) <= 16 else f"{text[:6]}..{text[-6:]}"


def _ranges(spans: list[tuple[int, int]], limit: int = 4) -> str:
    text = ", ".join(f"{a}..{b - 1}" if b - a > 1 else str(a) for a, b in spans[:limit])
    return text + (f" and {len(spans) - limit} more ranges" if len(spans) > limit else "")


# ---------------------------------------------------------------------------- fetching


@dataclass
class FetchResult:
    """What ``fetch_state`` got and from whom."""

    manifest: Manifest
    buffer: torch.Tensor | None  # contiguous 1-D uint8, every chunk verified; None with on_chunk or place
    contributors: dict[PeerID, int]  # provider -> chunks it delivered (verified)
    dropped: dict[PeerID, str] = field(default_factory=dict)  # providers not used or given up on, and why
    corrupt: set[PeerID] = field(default_factory=set)  # providers that sent bytes failing verification
    seconds: float = 0.0
    reused: int = 0  # chunks not downloaded because the caller had them (``have``)
    placement: Placement | None = None  # where the chunks went, with ``place``
    votes: tuple[int, int] = (0, 0)  # (providers naming this manifest their latest, providers asked)

    def restore(self, *, copy: bool = False) -> Any:
        """The state object (tensors are views of ``buffer`` unless ``copy``; see ``manifest.restore``;
        with ``place``, the placed tensors are the caller's own)."""
        if self.placement is not None:
            return self.placement.restore(copy=copy)
        if self.buffer is None:
            raise ValueError("this fetch handed its chunks to on_chunk and kept no buffer to restore from")
        return restore(self.manifest, self.buffer, copy=copy)


class _Corrupt(Exception):
    """The provider sent bytes that fail verification or break the protocol."""


class _SinkFailed(Exception):
    """``on_chunk`` raised: our own failure (e.g. a full disk), not the provider's."""


#: chunks the caller already holds, asked once the manifest is known
HaveHook = Callable[[Manifest], Awaitable[Iterable[int]]]
#: receives each verified chunk (the view is reused once it returns: copy or write it out first)
ChunkHook = Callable[[Manifest, int, memoryview], Awaitable[None]]


class _Fetch:
    """State of one ``fetch_state`` call; every task it starts lives in its TaskGroup."""

    def __init__(self, host: Host, key: str, providers: list[Provider], *, rpc_timeout: float,
                 stall_timeout: float, max_total: int, segment_bytes: int, wanted: bytes | None = None,
                 have: HaveHook | None = None, on_chunk: ChunkHook | None = None,
                 place: Callable[[Manifest], Placement] | None = None):
        self.host = host
        self.key = key
        self.wanted = wanted
        self.have = have
        self.on_chunk = on_chunk
        self.place = place
        self.placement: Placement | None = None
        self.sink_error: BaseException | None = None
        self.addrs: dict[PeerID, Address | None] = {}
        for peer, addr in providers:
            self.addrs.setdefault(peer, addr)
        self.rpc_timeout = rpc_timeout
        self.stall_timeout = stall_timeout
        self.max_total = max_total
        self.segment_bytes = segment_bytes
        self.dropped: dict[PeerID, str] = {}
        self.corrupt: set[PeerID] = set()
        self.latest: dict[PeerID, bytes] = {}  # provider -> id of its latest manifest
        self.holders: dict[bytes, list[PeerID]] = collections.defaultdict(list)
        self.blobs: dict[bytes, bytes] = {}  # manifest id -> verified encoded manifest
        self.sizes: dict[bytes, int] = {}
        self.too_large: dict[bytes, int] = {}  # manifest id -> its total, refused (over max_total)
        self.phase = "asking providers for their manifests"
        self.manifest: Manifest | None = None
        self.schedule: ChunkSchedule | None = None
        self._changed = asyncio.Event()
        #: manifest requests still in flight once a quorum answered (see ``probe``)
        self._late: dict[asyncio.Task, PeerID] = {}

    def drop(self, peer: PeerID, reason: str, *, corrupt: bool = False) -> None:
        if peer not in self.dropped:
            log.info("state %r: provider %s %s", self.key, peer, reason)
        self.dropped.setdefault(peer, reason)
        if corrupt:
            self.corrupt.add(peer)

    def _notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    # ------------------------------------------------------------------ manifests

    async def probe(self) -> None:
        """Ask every provider for its manifest at once, and return as soon as a strict majority
        of them name the same latest manifest (or one holds the wanted id), or all have answered.

        Each provider snapshots its state when asked, and under load they take 0.7-2.5 s each:
        waiting for the slowest one gated every download on it. A majority of the providers asked
        cannot be outvoted by the rest, so the choice is the same as after hearing all of them.
        The requests still in flight stay in ``_late``; ``download`` adds those providers when
        they answer with the chosen manifest, and ``close`` cancels what is left."""
        asked = []
        for peer in self.addrs:
            if peer == self.host.peer_id:
                self.drop(peer, "is this host")
            else:
                asked.append(peer)
        pending = {asyncio.create_task(self._ask(peer)): peer for peer in asked}
        self._late = pending
        quorum = len(asked) // 2 + 1
        while pending and not self._agreed(quorum):
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                del pending[task]
                task.result()  # _ask handles the providers' failures; anything else is ours

    def _agreed(self, quorum: int) -> bool:
        if self.wanted is not None:
            return bool(self.holders.get(self.wanted))
        return max(collections.Counter(self.latest.values()).values(), default=0) >= quorum

    async def close(self) -> None:
        """Cancel the manifest requests nobody waits for any more."""
        late, self._late = list(self._late), {}
        await cancel_all(late)

    async def _ask(self, peer: PeerID) -> None:
        try:
            request: dict[str, Any] = {"key": self.key}
            if self.wanted is not None:
                request["id"] = self.wanted
            reply = await self.host.call(peer, self.addrs[peer], MANIFEST_METHOD, request, timeout=self.rpc_timeout)
        except (DHTError, OSError) as e:
            self.drop(peer, f"unreachable: {e}")
            return
        if reply is None:
            self.drop(peer, f"holds no state for {self.key!r}")
            return
        try:
            if not isinstance(reply, dict):
                raise TypeError("reply is not a map")
            mid, size, blob, held = _check_id(reply.get("id")), reply.get("size"), reply.get("manifest"), reply.get("held")
            if type(size) is not int or not 0 < size <= MAX_MANIFEST_BYTES:
                raise ValueError(f"bad manifest size {size!r:.20}")
            if not isinstance(held, list) or len(held) > _MAX_HELD:
                raise ValueError("bad list of held manifests")
            held_ids = {_check_id(h) for h in held} | {mid}
            if blob is not None and (
                    not isinstance(blob, bytes) or len(blob) != size or blake3.blake3(blob).digest() != mid):
                raise ValueError("inline manifest does not match its id")
        except (TypeError, ValueError) as e:
            self.drop(peer, f"sent a malformed manifest reply: {e}", corrupt=True)
            return
        self.latest[peer] = mid
        self.sizes.setdefault(mid, size)
        if blob is not None:
            self.blobs.setdefault(mid, blob)
        for h in held_ids:
            self.holders[h].append(peer)

    async def _manifest(self, mid: bytes) -> Manifest | None:
        """The validated manifest ``mid`` (fetched over a stream if it was not inline), or None."""
        blob = self.blobs.get(mid)
        for peer in ([] if blob is not None else list(self.holders.get(mid, ()))):
            if peer in self.dropped:
                continue
            try:
                blob = await self._download_manifest(peer, mid)
                break
            except (DHTError, OSError) as e:
                self.drop(peer, f"failed to send manifest {mid.hex()[:12]}: {e}")
            except _Corrupt as e:
                self.drop(peer, f"sent a bad manifest: {e}", corrupt=True)
        if blob is None:
            return None
        try:
            return Manifest.from_bytes(blob, max_total=self.max_total)
        except StateTooLarge as e:  # our limit, not the providers' fault
            self.too_large[mid] = e.size
            for peer in self.holders.get(mid, ()):
                self.drop(peer, f"holds state {mid.hex()[:12]} that is too large here: {e}")
            return None
        except ManifestError as e:
            for peer in self.holders.get(mid, ()):
                self.drop(peer, f"serves an invalid manifest {mid.hex()[:12]}: {e}", corrupt=True)
            return None

    async def _download_manifest(self, peer: PeerID, mid: bytes) -> bytes:
        size = self.sizes.get(mid, MAX_MANIFEST_BYTES)
        conn = await self._connect(peer)
        stream = await conn.open_stream(MANIFEST_PROTOCOL, {"key": self.key, "id": mid})
        try:
            stream.write_eof()
            out = bytearray()
            while (piece := await stream.read(self.stall_timeout)) is not None:
                if len(out) + len(piece) > size:
                    raise _Corrupt("manifest longer than announced")
                out += piece
            blob = bytes(out)
            if blake3.blake3(blob).digest() != mid:
                raise _Corrupt("manifest does not match its id")
            return blob
        finally:
            if not stream.closed:
                stream.reset("done")

    async def choose(self, manifest_id: bytes | None) -> Manifest:
        """The manifest to download: ``manifest_id`` if given, else the one held (as latest)
        by the most providers; ties go to the larger ``meta["epoch"]``, then the lowest id."""
        self.phase = "choosing a manifest"
        if manifest_id is not None:
            if not self.holders.get(manifest_id):
                raise NoProviderError(self._no_provider(f"holds manifest {manifest_id.hex()[:12]}"))
            m = await self._manifest(manifest_id)
            if m is None:
                raise self._too_large(manifest_id) if manifest_id in self.too_large else NoProviderError(
                    self._no_provider(f"could supply a valid manifest {manifest_id.hex()[:12]}"))
            return m
        votes = collections.Counter(self.latest.values())
        for count in sorted(set(votes.values()), reverse=True):
            tied = sorted(mid for mid, c in votes.items() if c == count)
            found = [m for mid in tied if (m := await self._manifest(mid)) is not None]
            if found:
                return min(found, key=lambda m: (-m.epoch, m.id))
        if self.too_large:
            raise self._too_large(max(self.too_large, key=lambda mid: votes.get(mid, 0)))
        raise NoProviderError(self._no_provider("holds a valid manifest"))

    def _too_large(self, mid: bytes) -> StateTooLargeError:
        holders = ", ".join(map(_short, self.holders.get(mid, ())[:4]))
        return StateTooLargeError(
            f"state {self.key!r} ({mid.hex()[:12]}) offered by {holders} is {self.too_large[mid]} bytes, too large "
            f"here: more than the {self.max_total} bytes this fetch expects (max_total); refused before allocating it")

    def _no_provider(self, what: str) -> str:
        reasons = "; ".join(f"{_short(p)}: {r}" for p, r in list(self.dropped.items())[:6])
        return f"none of {len(self.addrs)} providers of state {self.key!r} {what}" + (f" ({reasons})" if reasons else "")

    # ------------------------------------------------------------------ chunks

    async def download(self, m: Manifest, parallel: int | None) -> torch.Tensor | None:
        self.manifest = m
        self.phase = f"downloading manifest {m.id.hex()[:12]}"
        peers = [p for p in self.holders.get(m.id, ()) if p not in self.dropped]
        for p, mid in self.latest.items():
            if p not in peers and p not in self.dropped:
                self.drop(p, f"holds a different state ({mid.hex()[:12]})")
        n = m.num_chunks
        try:
            have = set(await self.have(m)) if self.have is not None else set()
        except Exception as e:  # noqa: BLE001 - ours (e.g. an unreadable store), not the providers'
            raise StateTransferError(f"could not tell which chunks of state {self.key!r} are held already: {e}") from e
        needed = n - len({i for i in have if 0 <= i < n})
        per_request = max(1, self.segment_bytes // m.chunk_size)
        segment = max(1, min(per_request, -(-needed // (4 * max(1, len(peers))))))
        self.schedule = ChunkSchedule(n, segment, have)
        # with a sink, each worker keeps one segment's bytes at a time instead of the whole state;
        # with a placement, one chunk's, copied out once verified
        buffer = None
        if self.place is not None:
            self.placement = self.place(m)
        elif self.on_chunk is None:
            buffer = torch.empty(m.total_size, dtype=torch.uint8)  # bounded by max_total
        if self.schedule.complete:
            return buffer
        if not peers:
            raise ChunksUnavailableError(f"no provider left for state {self.key!r} ({m.id.hex()[:12]})")
        view = memoryview(buffer.numpy()) if buffer is not None else None
        slots = asyncio.Semaphore(parallel or len(self.addrs))
        async with asyncio.TaskGroup() as tg:
            for peer in peers:
                tg.create_task(self._worker(peer, m, view, slots, segment * m.chunk_size))
            if self._late:
                tg.create_task(self._admit_late(
                    lambda peer: tg.create_task(self._worker(peer, m, view, slots, segment * m.chunk_size)), m))
        if self.sink_error is not None:
            raise StateTransferError(
                f"could not keep a chunk of state {self.key!r} ({m.id.hex()[:12]}): {self.sink_error}"
            ) from self.sink_error
        if not self.schedule.complete:
            why = "; ".join(f"{_short(p)}: {self.dropped.get(p, '?')}" for p in peers[:6])
            raise ChunksUnavailableError(
                f"no provider could supply chunks {_ranges(self.schedule.missing())} of state {self.key!r} "
                f"({m.id.hex()[:12]}): {why}"
            )
        return buffer

    async def _admit_late(self, start: Callable[[PeerID], Any], m: Manifest) -> None:
        """Providers whose manifest arrives after the download began: those holding ``m`` get a
        worker of their own (``start``); until the download is complete, no longer."""
        sched = self.schedule
        assert sched is not None
        pending = self._late
        while pending and not sched.complete and self.sink_error is None:
            changed = asyncio.ensure_future(self._changed.wait())
            try:
                done, _ = await asyncio.wait([*pending, changed], return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()
            for task in done:
                peer = pending.pop(task, None)
                if peer is None:
                    continue
                task.result()
                if peer in self.dropped:
                    continue
                if peer in self.holders.get(m.id, ()):
                    start(peer)
                else:
                    self.drop(peer, f"holds a different state ({self.latest[peer].hex()[:12]})")

    async def _worker(self, peer: PeerID, m: Manifest, view: memoryview | None, slots: asyncio.Semaphore,
                      scratch_bytes: int) -> None:
        sched = self.schedule
        assert sched is not None
        async with slots:
            if view is None:  # chunks go to on_chunk or a placement: they land here first
                size = m.chunk_size if self.placement is not None else scratch_bytes
                view = memoryview(bytearray(min(size, m.total_size)))
            while not sched.complete and self.sink_error is None:
                seg = sched.take(peer)
                if seg is None:
                    if sched.idle:
                        return
                    await self._changed.wait()
                    continue
                try:
                    await self._fetch_segment(peer, m, view, *seg)
                    sched.done(peer)
                except _SinkFailed:  # ours, not the provider's (sink_error says what): end the fetch
                    sched.failed(peer)
                    return
                except _Corrupt as e:
                    sched.failed(peer)
                    self.drop(peer, f"sent bad data: {e}", corrupt=True)
                    return
                except (DHTError, OSError) as e:
                    sched.failed(peer)
                    self.drop(peer, f"failed mid-transfer: {e}")
                    return
                finally:
                    self._notify()

    async def _connect(self, peer: PeerID) -> Connection:
        conn = self.host.connection(peer)
        if conn is not None:
            return conn
        addr = self.addrs.get(peer)
        if addr is None:
            raise DHTError(f"no connection to {peer} and no address to dial")
        return await self.host.connect(addr[0], addr[1], peer, timeout=self.rpc_timeout)

    async def _fetch_segment(self, peer: PeerID, m: Manifest, view: memoryview, first: int, end: int) -> None:
        """Stream chunks [first, end) from ``peer`` into ``view`` (the whole state's buffer, a
        scratch buffer for this segment when chunks go to ``on_chunk``, or for one chunk when
        they go to a placement), verifying each as it completes. ``on_chunk`` runs concurrently
        with the next chunks' arrival (a disk write overlaps the network); all of a segment's
        calls finish before it returns, even when the provider fails, so every chunk the
        schedule counts as verified was handed over."""
        sched = self.schedule
        assert sched is not None
        conn = await self._connect(peer)
        stream = await conn.open_stream(
            CHUNKS_PROTOCOL, {"key": self.key, "id": m.id, "first": first, "count": end - first}
        )
        sinking: list[asyncio.Future] = []
        try:
            stream.write_eof()  # we send nothing; the stream is done once the provider ends it
            pos, stop = m.chunk_span(first)[0], m.chunk_span(end - 1)[1]
            placement = self.placement
            # where view[0] sits in the state's byte stream (a placement's view holds one chunk)
            base = 0 if self.on_chunk is None and placement is None else pos
            k = first
            k_start, k_end = m.chunk_span(k)
            while pos < stop:
                piece = await stream.read(self.stall_timeout)
                if piece is None:
                    raise DHTError(f"stream ended at chunk {k} of {first}..{end - 1}")
                n = len(piece)
                if n > stop - pos:
                    raise _Corrupt(f"sent more bytes than chunks {first}..{end - 1} hold")
                off = 0
                while off < n:
                    take = n - off if placement is None else min(n - off, k_end - pos)
                    view[pos - base : pos - base + take] = piece[off : off + take]
                    pos += take
                    off += take
                    while k_end <= pos and k < end:
                        data = view[k_start - base : k_end - base]
                        if not m.verify_chunk(k, data):
                            raise _Corrupt(f"chunk {k} does not match its digest")
                        if self.on_chunk is not None:
                            sinking.append(asyncio.ensure_future(self.on_chunk(m, k, data)))
                        if placement is not None:
                            placement.put(k, data)  # a copy: the view takes the next chunk
                        sched.verified(peer, k)
                        k += 1
                        if k < end:
                            k_start, k_end = m.chunk_span(k)
                            if placement is not None:
                                base = k_start
            if await stream.read(self.stall_timeout) is not None:
                raise _Corrupt(f"sent more bytes than chunks {first}..{end - 1} hold")
        finally:
            if not stream.closed:
                stream.reset("fetch ended")
            if sinking:
                for result in await asyncio.gather(*sinking, return_exceptions=True):
                    if isinstance(result, Exception) and self.sink_error is None:
                        self.sink_error = result
        if self.sink_error is not None:
            raise _SinkFailed()

    def timeout_message(self, timeout: float) -> str:
        where = self.phase
        if self.schedule is not None and self.manifest is not None:
            where += f", chunks {_ranges(self.schedule.missing())} of {self.schedule.num_chunks} still missing"
        return f"fetching state {self.key!r} timed out after {timeout} s while {where}"


async def fetch_state(
    host: Host,
    key: str,
    providers: list[Provider],
    *,
    manifest_id: bytes | None = None,
    timeout: float = 30.0,
    parallel: int | None = None,
    stall_timeout: float = 10.0,
    rpc_timeout: float = 5.0,
    max_total: int = DEFAULT_MAX_TOTAL,
    segment_bytes: int = 64 << 20,
    have: HaveHook | None = None,
    on_chunk: ChunkHook | None = None,
    place: Callable[[Manifest], Placement] | None = None,
) -> FetchResult:
    """Download the state published under ``key`` from ``providers``, verified chunk by chunk.

    Asks every provider for its manifest (concurrently; unreachable ones are skipped), picks
    ``manifest_id`` if given, else the manifest the most providers hold as their latest (ties:
    larger ``meta["epoch"]``, then lowest id), and splits its chunks among all providers holding
    it, ``parallel`` of them at a time (default: all), ``segment_bytes`` per request at most.
    A provider whose bytes fail verification is not asked again; one that dies, resets or sends
    nothing for ``stall_timeout`` seconds loses its unfinished chunks to the others.

    ``on_chunk(manifest, index, view)``: receives every verified chunk as it lands (awaited; the
    view is reused afterwards) and no whole-state buffer is kept (``FetchResult.buffer`` is None):
    for downloads into a store, which survive an interruption chunk by chunk. ``have(manifest)``
    (only with ``on_chunk``) names chunks the caller holds already; they are not downloaded.
    An exception from ``on_chunk`` ends the fetch with ``StateTransferError`` (not the
    providers' fault: nobody is dropped for it).

    ``place(manifest)``: a ``Placement`` for the manifest chosen; each verified chunk is copied
    into it (chosen tensors straight into the caller's memory, see ``placement``) and
    ``FetchResult.restore`` rebuilds the state from it. Its targets change as chunks land, before
    the fetch is complete.

    ``max_total``: the most bytes the caller expects (the state of its model, the size a
    checkpoint's record gives); a larger manifest is refused with ``StateTooLargeError`` before
    anything is allocated or downloaded. The default, 64 GiB, is only a ceiling: pass what you expect.

    Raises ``NoProviderError`` (``StateTooLargeError``), ``ChunksUnavailableError`` or
    ``StateTimeoutError`` (all ``StateTransferError``).
    """
    if have is not None and on_chunk is None:
        raise ValueError("have= needs on_chunk=: chunks the caller holds are not in the downloaded buffer")
    if place is not None and on_chunk is not None:
        raise ValueError("place= and on_chunk= are two different places for the same chunks: pass one")
    _check_key(key)
    if manifest_id is not None:
        _check_id(manifest_id)
    if parallel is not None and parallel < 1:
        raise ValueError("parallel must be at least 1")
    started = time.monotonic()
    f = _Fetch(host, key, providers, rpc_timeout=min(rpc_timeout, timeout), stall_timeout=stall_timeout,
               max_total=max_total, segment_bytes=segment_bytes, wanted=manifest_id, have=have, on_chunk=on_chunk,
               place=place)
    deadline = asyncio.timeout(timeout)
    try:
        async with deadline:
            await f.probe()
            m = await f.choose(manifest_id)
            buffer = await f.download(m, parallel)
    except TimeoutError:
        if not deadline.expired():
            raise
        raise StateTimeoutError(f.timeout_message(timeout)) from None
    finally:
        await f.close()
    assert f.schedule is not None
    contributors = {p: n for p, n in f.schedule.chunks_from.items() if n}
    votes = (sum(1 for mid in f.latest.values() if mid == m.id), sum(1 for p in f.addrs if p != host.peer_id))
    return FetchResult(m, buffer, contributors, f.dropped, f.corrupt, time.monotonic() - started, f.schedule.reused,
                       f.placement, votes)
