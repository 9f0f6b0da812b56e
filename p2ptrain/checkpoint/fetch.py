"""Download a state snapshot from several peers at once, verified chunk by chunk.

A late joiner must catch up with the swarm: it asks a handful of peers for their current
manifest, picks the one most of them hold (``probe``), and pulls disjoint chunk ranges from all
of them in parallel straight into one preallocated buffer, checking each chunk's blake3 against
the manifest as it lands. A peer that sends a bad chunk is never asked again; a peer that dies,
stalls or resets only loses the chunks it had not delivered, which go back to the others.

A fetch can skip chunks the caller already has and hand each verified chunk to a sink instead
of one big buffer (``have=``/``on_chunk=``), which is how a checkpoint download resumes; or put
chosen tensors' bytes straight into memory the caller holds (``place=``, see ``placement``).
The download schedule (``schedule.ChunkSchedule``) is sans-IO; this module is its asyncio shell.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from dht import DHTError, Host, PeerID

from ..errors import P2PTrainError
from .errors import ChunksUnavailableError, CorruptReply, StateTimeoutError, StateTransferError
from .manifest import DEFAULT_MAX_TOTAL, Manifest, restore
from .placement import Placement
from .probe import ManifestProbe, short_peer
from .schedule import ChunkSchedule
from .state_protocol import CHUNKS_PROTOCOL, Provider, check_id, check_key


def _ranges(spans: list[tuple[int, int]], limit: int = 4) -> str:
    text = ", ".join(f"{a}..{b - 1}" if b - a > 1 else str(a) for a, b in spans[:limit])
    return text + (f" and {len(spans) - limit} more ranges" if len(spans) > limit else "")


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


class _SinkFailed(P2PTrainError):
    """``on_chunk`` raised: our own failure (e.g. a full disk), not the provider's."""


#: chunks the caller already holds, asked once the manifest is known
HaveHook = Callable[[Manifest], Awaitable[Iterable[int]]]
#: receives each verified chunk (the view is reused once it returns: copy or write it out first)
ChunkHook = Callable[[Manifest, int, memoryview], Awaitable[None]]


class _Fetch(ManifestProbe):
    """State of one ``fetch_state`` call; every task it starts lives in its TaskGroup."""

    def __init__(self, host: Host, key: str, providers: list[Provider], *, rpc_timeout: float,
                 stall_timeout: float, max_total: int, segment_bytes: int, wanted: bytes | None = None,
                 have: HaveHook | None = None, on_chunk: ChunkHook | None = None,
                 place: Callable[[Manifest], Placement] | None = None):
        super().__init__(host, key, providers, rpc_timeout=rpc_timeout, stall_timeout=stall_timeout,
                         max_total=max_total, wanted=wanted)
        self.have = have
        self.on_chunk = on_chunk
        self.place = place
        self.placement: Placement | None = None
        self.sink_error: BaseException | None = None
        self.segment_bytes = segment_bytes
        self.manifest: Manifest | None = None
        self.schedule: ChunkSchedule | None = None
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

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
            why = "; ".join(f"{short_peer(p)}: {self.dropped.get(p, '?')}" for p in peers[:6])
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
                except CorruptReply as e:
                    sched.failed(peer)
                    self.drop(peer, f"sent bad data: {e}", corrupt=True)
                    return
                except (DHTError, OSError) as e:
                    sched.failed(peer)
                    self.drop(peer, f"failed mid-transfer: {e}")
                    return
                finally:
                    self._notify()

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
                    raise CorruptReply(f"sent more bytes than chunks {first}..{end - 1} hold")
                off = 0
                while off < n:
                    take = n - off if placement is None else min(n - off, k_end - pos)
                    view[pos - base : pos - base + take] = piece[off : off + take]
                    pos += take
                    off += take
                    while k_end <= pos and k < end:
                        data = view[k_start - base : k_end - base]
                        if not m.verify_chunk(k, data):
                            raise CorruptReply(f"chunk {k} does not match its digest")
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
                raise CorruptReply(f"sent more bytes than chunks {first}..{end - 1} hold")
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
    check_key(key)
    if manifest_id is not None:
        check_id(manifest_id)
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
