"""The wire of protocol ``p2ptrain/allreduce/1``: the stream header (built and checked), the owner's
result summary (packed and checked), and exact-size reads over a stream's frames.

For every ordered pair (sender i, owner j), i != j, j's shard non-empty, i opens ONE bidirectional
stream to j with the header ``{"g": group_id, "from": i, "w": weight, "n": numel, "codec": id,
"gcodec": id}`` (plus ``"agg"`` under a robust rule) and

* reduce: writes its part ``flat[start_j:end_j]`` chunk by chunk (``chunk_numel`` values, the last
  shorter), each chunk exactly ``codec.encoded_nbytes(chunk_numel)`` bytes, then half-closes (EOF).
  The codec meta is derived locally on both sides, never read from the wire.
* gather: reads the reply: ``u32 length | msgpack summary`` (who contributed, weight sum), then the
  averaged part, chunk by chunk in the gather codec, then EOF; decoded straight into ``flat``.
"""

from __future__ import annotations

import math
import struct
from typing import Any

from dht import ProtocolError, Stream, pack, unpack

from .round_types import Drop

__all__ = ["MAX_SUMMARY", "PREFIX", "PROTOCOL", "Reader", "check_header", "pack_summary", "parse_summary"]

PROTOCOL = "p2ptrain/allreduce/1"
PREFIX = struct.Struct(">I")  # the length of the result summary
MAX_SUMMARY = 1 << 16
_HEADER_KEYS = frozenset({"g", "from", "w", "n", "codec", "gcodec"})
_HEADER_KEYS_AGG = _HEADER_KEYS | {"agg"}  # "agg" is sent only for a robust aggregation


def check_header(hdr: Any, rank: int, ours: dict[str, Any], max_weight: float) -> str | None:
    """Why the header ``hdr`` of the stream from member ``rank`` is refused, given ``ours`` (our own
    header for the round); None if it is acceptable."""
    if not isinstance(hdr, dict) or (set(hdr) != _HEADER_KEYS and set(hdr) != _HEADER_KEYS_AGG):
        return "malformed header"
    w, n, frm = hdr["w"], hdr["n"], hdr["from"]
    if isinstance(frm, bool) or frm != rank:
        return f"header claims rank {frm!r:.20}, its peer id is rank {rank}"
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not (0 < w <= max_weight):
        return f"bad weight {w!r:.30} (must be finite, > 0 and <= {max_weight:g})"
    if isinstance(n, bool) or n != ours["n"]:
        return f"numel {n!r:.30} differs from ours ({ours['n']})"
    if hdr["codec"] != ours["codec"] or hdr["gcodec"] != ours["gcodec"]:
        return f"codec {hdr['codec']!r:.40}/{hdr['gcodec']!r:.40} differs from ours"
    agg = ours.get("agg", "mean")
    if hdr.get("agg", "mean") != agg:
        return f"aggregation {hdr.get('agg', 'mean')!r:.40} differs from ours ({agg})"
    return None


def pack_summary(summary: dict) -> bytes:
    """The reply's head: ``u32 length | msgpack summary``."""
    body = pack(summary)
    return PREFIX.pack(len(body)) + body


def parse_summary(body: bytes | bytearray,
                  size: int) -> tuple[list[int], dict[int, int], float, dict[int, float]]:
    """(ranks whose whole part is in the average, rank -> chunks of its part that made it, the
    smallest weight sum, rank -> the weight a contributor's part counted with: empty from an older
    owner) from an owner's summary in a group of ``size``; raises Drop if malformed."""
    try:
        s = unpack(body)
    except ProtocolError:
        raise Drop("malformed result summary") from None
    rng = range(size)
    if not (
        isinstance(s, dict) and isinstance(s.get("ok"), list) and isinstance(s.get("part"), list)
        and isinstance(s.get("w"), (int, float)) and all(isinstance(r, int) and r in rng for r in s["ok"])
        and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and p[0] in rng
                and isinstance(p[1], int) for p in s["part"])
    ):
        raise Drop("malformed result summary")
    counted = s.get("cw", [])
    if not (isinstance(counted, list) and all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and p[0] in rng
            and isinstance(p[1], (int, float)) and not isinstance(p[1], bool) and 0 <= p[1] < math.inf
            for p in counted)):
        raise Drop("malformed result summary: counted weights")
    return list(s["ok"]), dict(s["part"]), float(s["w"]), {r: float(w) for r, w in counted}


class Reader:
    """Exact-size reads over a stream's frames, whatever their boundaries (a remainder is kept).
    ``read_exact`` hands out zero-copy views of received frames; only a read spanning frames copies,
    into a buffer allocated at that first need (a zero-filled multi-MiB bytearray per stream per
    round was a third of an N=8 round's CPU time, for a copy that rarely happens)."""

    __slots__ = ("stream", "_rest", "_buf", "max_bytes")

    def __init__(self, stream: Stream, max_bytes: int = 0):
        self.stream = stream
        self._rest: memoryview | None = None
        self._buf: memoryview | None = None
        self.max_bytes = max_bytes  # the largest read_exact; the size of the fallback buffer

    @property
    def allocated(self) -> int:
        return len(self._buf) if self._buf is not None else 0

    async def readinto(self, buf: memoryview, timeout: float) -> int:
        n, filled, rest = len(buf), 0, self._rest
        while filled < n:
            if rest is None:
                rest = await self.stream.read(timeout)
                if rest is None:
                    break
            k = min(len(rest), n - filled)
            buf[filled : filled + k] = rest[:k]
            filled += k
            rest = rest[k:] if k < len(rest) else None
        self._rest = rest
        return filled

    async def read_exact(self, n: int, timeout: float) -> memoryview | None:
        """``n`` (<= ``max_bytes``) bytes: a zero-copy view of the received frame when one frame
        holds them all, else a copy in the reader's own buffer (valid until the next read); None
        if the stream ended first."""
        rest = self._rest
        while rest is None:
            rest = await self.stream.read(timeout)
            if rest is None:
                return None
            if not len(rest):
                rest = None
        if len(rest) >= n:
            self._rest = rest[n:] if len(rest) > n else None
            return rest[:n]
        self._rest = rest
        if self._buf is None:
            self._buf = memoryview(bytearray(max(n, self.max_bytes)))
        buf = self._buf[:n]
        return buf if await self.readinto(buf, timeout) == n else None

    async def at_eof(self, timeout: float) -> bool:
        if self._rest is not None:
            return False
        while True:
            chunk = await self.stream.read(timeout)
            if chunk is None:
                return True
            if len(chunk):
                self._rest = chunk
                return False

