"""The first half of a fetch: ask every provider for its manifest, and choose the one to download.

The manifest chosen is the one the most providers hold as their latest (or the id asked for);
each is validated against its content address before use. A provider that is unreachable,
holds something else or sends a bad reply is dropped with a reason the caller sees.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any

import blake3

from dht import Connection, DHTError, Host, PeerID, cancel_all

from .errors import CorruptReply, NoProviderError, StateTooLargeError
from .manifest import MAX_MANIFEST_BYTES, Manifest, ManifestError, StateTooLarge
from ..addresses import Reach
from .state_protocol import MANIFEST_METHOD, MANIFEST_PROTOCOL, MAX_HELD, Provider, check_id

log = logging.getLogger("p2ptrain.checkpoint")


def short_peer(peer: PeerID) -> str:
    """A peer id cut to fit in an error message."""
    text = str(peer)
    return text if len(text) <= 16 else f"{text[:6]}..{text[-6:]}"


class ManifestProbe:
    """The providers of one fetch: what each holds, which were dropped and why, and the manifest
    to download (``probe``, then ``choose``)."""

    def __init__(self, host: Host, key: str, providers: list[Provider], *, rpc_timeout: float,
                 stall_timeout: float, max_total: int, wanted: bytes | None = None):
        self.host = host
        self.key = key
        self.wanted = wanted
        self.addrs: dict[PeerID, Reach] = {}
        for peer, addr in providers:
            self.addrs.setdefault(peer, addr if isinstance(addr, Reach) else Reach(addr))
        self.rpc_timeout = rpc_timeout
        self.stall_timeout = stall_timeout
        self.max_total = max_total
        self.dropped: dict[PeerID, str] = {}
        self.corrupt: set[PeerID] = set()
        self.latest: dict[PeerID, bytes] = {}  # provider -> id of its latest manifest
        self.holders: dict[bytes, list[PeerID]] = collections.defaultdict(list)
        self.blobs: dict[bytes, bytes] = {}  # manifest id -> verified encoded manifest
        self.sizes: dict[bytes, int] = {}
        self.too_large: dict[bytes, int] = {}  # manifest id -> its total, refused (over max_total)
        self.phase = "asking providers for their manifests"
        #: manifest requests still in flight once a quorum answered (see ``probe``)
        self._late: dict[asyncio.Task, PeerID] = {}

    def drop(self, peer: PeerID, reason: str, *, corrupt: bool = False) -> None:
        if peer not in self.dropped:
            log.info("state %r: provider %s %s", self.key, peer, reason)
        self.dropped.setdefault(peer, reason)
        if corrupt:
            self.corrupt.add(peer)

    async def probe(self) -> None:
        """Ask every provider for its manifest at once, and return as soon as a strict majority
        of them name the same latest manifest (or one holds the wanted id), or all have answered.

        Each provider snapshots its state when asked, which takes seconds under load: waiting for
        the slowest one would gate every download on it. A majority of the providers asked
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
            conn = await self.addrs[peer].dial(self.host, peer, self.rpc_timeout)
            reply = await conn.call(MANIFEST_METHOD, request, timeout=self.rpc_timeout)
        except (DHTError, OSError) as e:
            self.drop(peer, f"unreachable: {e}")
            return
        if reply is None:
            self.drop(peer, f"holds no state for {self.key!r}")
            return
        try:
            if not isinstance(reply, dict):
                raise TypeError("reply is not a map")
            mid, size, blob, held = (check_id(reply.get("id")), reply.get("size"), reply.get("manifest"),
                                     reply.get("held"))
            if type(size) is not int or not 0 < size <= MAX_MANIFEST_BYTES:
                raise ValueError(f"bad manifest size {size!r:.20}")
            if not isinstance(held, list) or len(held) > MAX_HELD:
                raise ValueError("bad list of held manifests")
            held_ids = {check_id(h) for h in held} | {mid}
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
            except CorruptReply as e:
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
                    raise CorruptReply("manifest longer than announced")
                out += piece
            blob = bytes(out)
            if blake3.blake3(blob).digest() != mid:
                raise CorruptReply("manifest does not match its id")
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
        holders = ", ".join(map(short_peer, self.holders.get(mid, ())[:4]))
        return StateTooLargeError(
            f"state {self.key!r} ({mid.hex()[:12]}) offered by {holders} is {self.too_large[mid]} bytes, too large "
            f"here: more than the {self.max_total} bytes this fetch expects (max_total); refused before allocating it")

    def _no_provider(self, what: str) -> str:
        reasons = "; ".join(f"{short_peer(p)}: {r}" for p, r in list(self.dropped.items())[:6])
        return (f"none of {len(self.addrs)} providers of state {self.key!r} {what}"
                + (f" ({reasons})" if reasons else ""))

    async def _connect(self, peer: PeerID) -> Connection:
        conn = self.host.connection(peer)
        if conn is not None:
            return conn
        return await self.addrs.get(peer, Reach()).dial(self.host, peer, self.rpc_timeout)
