"""Write notices: a reader of a key may ask its holder to tell it when a write that asks for it
lands, instead of polling the key fast. Sans-IO: who watches what, and whom a write tells.

A ``find_value`` may carry ``watch`` seconds: the holder then remembers the asker for that long
(``Watchers.add``). A ``store`` may carry a ``notice`` tag: after the write, every watcher of its key
hears of it once per tag (``Watchers.due``); the writer chooses the tag (an epoch, say), so that a
burst of writes that mean the same thing wakes each watcher once. A notice hands the write's records
over (the watcher keeps them as a store's: signed by their owners, only if newer than its own) and
says "read the key again" to a watcher that needs more; a lying holder can withhold or replay a
record, as a read's answer can, never forge one.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

from .identity import PeerID

T = TypeVar("T")

MAX_WATCH = 30.0  # s: a watch lasts at most this long unless renewed by another read
MIN_NOTICE_GAP = 0.1  # s: a watcher hears of one key at most this often, whatever the tags


class Watchers(Generic[T]):
    """The watchers of each key, with what reaches them (``T``: a connection), bounded in keys
    and in watchers per key so that hostile readers cannot grow it."""

    def __init__(self, max_keys: int = 1024, max_per_key: int = 256):
        self.max_keys, self.max_per_key = max_keys, max_per_key
        #: key -> watcher -> [until, channel, last tag, when it was last told]
        self._by_key: dict[bytes, dict[PeerID, list]] = {}

    def __len__(self) -> int:
        return sum(len(w) for w in self._by_key.values())

    def add(self, key: bytes, peer: PeerID, channel: T, seconds: float, now: float) -> bool:
        """``peer`` watches ``key`` for ``seconds`` (at most ``MAX_WATCH``) through ``channel``;
        False when the table is full (the read is answered all the same)."""
        watchers = self._by_key.get(key)
        if watchers is None:
            if len(self._by_key) >= self.max_keys:
                self._prune(now)
                if len(self._by_key) >= self.max_keys:
                    return False
            watchers = self._by_key[key] = {}
        until = now + min(max(seconds, 0.0), MAX_WATCH)
        seen = watchers.get(peer)
        if seen is not None:
            seen[0], seen[1] = max(seen[0], until), channel
            return True
        if len(watchers) >= self.max_per_key:
            for p in [p for p, w in watchers.items() if w[0] <= now]:
                del watchers[p]
            if len(watchers) >= self.max_per_key:
                return False
        watchers[peer] = [until, channel, None, -MAX_WATCH]
        return True

    def due(self, key: bytes, tag: Hashable, writer: PeerID | None, now: float) -> list[T]:
        """The channels to tell of a write of ``key`` tagged ``tag`` by ``writer``: each live watcher
        but the writer, once per tag, at most once per ``MIN_NOTICE_GAP``."""
        watchers = self._by_key.get(key)
        if not watchers:
            return []
        out = []
        for peer, w in list(watchers.items()):
            if w[0] <= now:
                del watchers[peer]
            elif peer != writer and w[2] != tag and now - w[3] >= MIN_NOTICE_GAP:
                w[2], w[3] = tag, now
                out.append(w[1])
        if not watchers:
            del self._by_key[key]
        return out

    def _prune(self, now: float) -> None:
        for key in list(self._by_key):
            live = {p: w for p, w in self._by_key[key].items() if w[0] > now}
            if live:
                self._by_key[key] = live
            else:
                del self._by_key[key]
