"""Manifests: the content address and chunk map of one state snapshot. Sans-IO.

A snapshot is one byte stream (every tensor's raw bytes, in skeleton order, each starting at a
64-byte aligned offset) cut into fixed-size chunks; the manifest holds the skeleton, the tensor
table, the chunk size, one blake3 digest per chunk and free-form ``meta``. Its ``id`` is the
blake3 of its canonical msgpack encoding, so one 32-byte id pins every byte of the state: a
downloader verifies each chunk on arrival and can fetch different chunks from different peers.

``from_bytes`` treats its input as hostile: size limits before decoding, a schema check, the
tensor table checked against the skeleton and the canonical layout, and the encoding required to
be canonical (re-encoding gives the same bytes), so equal ids mean equal manifests.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import blake3
import msgpack

from ..errors import P2PTrainError
from ..gil import short_gil_waits
from .tree import TensorSpec, flatten, known_dtype, tensor_specs, torch_dtype, unflatten

if TYPE_CHECKING:
    import torch

VERSION = 1
DIGEST_SIZE = 32
DEFAULT_CHUNK_SIZE = 4 << 20  # one transport frame; 0.6 ms of blake3 on one core
MIN_CHUNK_SIZE = 4 << 10
MAX_CHUNK_SIZE = 256 << 20
#: tensors start at multiples of this, so views into the buffer are aligned for any dtype/SIMD
ALIGN = 64
MAX_MANIFEST_BYTES = 16 << 20
DEFAULT_MAX_TOTAL = 64 << 30
MAX_TENSORS = 1 << 20

_KEYS = ("v", "skeleton", "tensors", "chunk_size", "total", "digests", "meta")


class ManifestError(P2PTrainError, ValueError):
    """A manifest (or a buffer claimed to match one) is malformed, too large or inconsistent."""


class StateTooLarge(ManifestError):
    """A well-formed manifest describes more bytes (``size``) than the caller's ``max_total`` (``limit``) allows."""

    def __init__(self, size: int, limit: int):
        super().__init__(f"state of {size} bytes exceeds the {limit}-byte limit")
        self.size, self.limit = size, limit


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes live in the snapshot stream."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def layout(specs: list[TensorSpec]) -> tuple[list[TensorEntry], int]:
    """The canonical placement of ``specs`` in one stream: (entries, total size)."""
    entries, pos = [], 0
    for s in specs:
        n = s.nbytes
        if n:  # empty tensors take no room, and no padding before them
            pos = -(-pos // ALIGN) * ALIGN
        entries.append(TensorEntry(s.dtype, s.shape, pos, n))
        pos += n
    return entries, pos


@dataclass(frozen=True, eq=False)
class Manifest:
    """One snapshot's description. Construct with ``build_snapshot`` or ``from_bytes``; both
    validate, as does direct construction. Equality and hashing go by ``id``."""

    skeleton: Any
    tensors: tuple[TensorEntry, ...]
    chunk_size: int
    digests: bytes  # DIGEST_SIZE bytes per chunk, concatenated
    meta: dict = field(default_factory=dict)
    max_total: int = field(default=DEFAULT_MAX_TOTAL, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    # ------------------------------------------------------------------ derived

    @property
    def total_size(self) -> int:
        """Bytes in the snapshot stream (and in the buffer that holds it)."""
        last = self.tensors[-1] if self.tensors else None
        return last.offset + last.nbytes if last is not None else 0

    @property
    def num_chunks(self) -> int:
        return -(-self.total_size // self.chunk_size)

    def chunk_span(self, index: int) -> tuple[int, int]:
        """Byte range [start, end) of chunk ``index`` in the stream."""
        start = index * self.chunk_size
        return start, min(start + self.chunk_size, self.total_size)

    def chunk_digest(self, index: int) -> bytes:
        return self.digests[index * DIGEST_SIZE : (index + 1) * DIGEST_SIZE]

    def verify_chunk(self, index: int, data: bytes | bytearray | memoryview) -> bool:
        """True if ``data`` is exactly chunk ``index`` of this snapshot."""
        return blake3.blake3(data).digest() == self.chunk_digest(index)

    @property
    def epoch(self) -> float:
        """``meta["epoch"]`` when it is a number (used to break ties between manifests), else -inf."""
        e = self.meta.get("epoch")
        if not isinstance(e, (int, float)) or isinstance(e, bool) or math.isnan(e):
            return -math.inf
        return float(e)

    @cached_property
    def encoded(self) -> bytes:
        """The canonical encoding (what ``id`` hashes and what peers exchange)."""
        body = {
            "v": VERSION,
            "skeleton": self.skeleton,
            "tensors": [[t.dtype, list(t.shape), t.offset, t.nbytes] for t in self.tensors],
            "chunk_size": self.chunk_size,
            "total": self.total_size,
            "digests": self.digests,
            "meta": self.meta,
        }
        return msgpack.packb(body, use_bin_type=True)

    @cached_property
    def id(self) -> bytes:
        """Content address: blake3 of the canonical encoding (32 bytes)."""
        return blake3.blake3(self.encoded).digest()

    def to_bytes(self) -> bytes:
        return self.encoded

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Manifest) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    # ------------------------------------------------------------------ validation

    def _validate(self) -> None:
        if type(self.chunk_size) is not int or not MIN_CHUNK_SIZE <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise ManifestError(f"chunk_size must be an int in [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}]")
        if not isinstance(self.meta, dict) or not all(isinstance(k, str) for k in self.meta):
            raise ManifestError("meta must be a dict with str keys")
        if len(self.tensors) > MAX_TENSORS:
            raise ManifestError(f"more than {MAX_TENSORS} tensors")
        try:
            specs = tensor_specs(self.skeleton)
        except ValueError as e:
            raise ManifestError(f"bad skeleton: {e}") from None
        if len(specs) != len(self.tensors):
            raise ManifestError(f"skeleton references {len(specs)} tensors, the table lists {len(self.tensors)}")
        # Sizes first: a hostile shape may claim exabytes; check before anything is allocated.
        expected, total = layout(specs)
        if total > self.max_total:
            raise StateTooLarge(total, self.max_total)
        for i, (got, want) in enumerate(zip(self.tensors, expected)):
            if not isinstance(got, TensorEntry) or got != want:
                raise ManifestError(f"tensor table entry {i} does not match the skeleton's canonical layout")
        if not isinstance(self.digests, bytes) or len(self.digests) != self.num_chunks * DIGEST_SIZE:
            raise ManifestError(f"expected {self.num_chunks} chunk digests of {DIGEST_SIZE} bytes")
        try:
            size = len(self.encoded)
        except (TypeError, ValueError, OverflowError) as e:
            raise ManifestError(f"meta is not msgpack-able: {e}") from None
        if size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest of {size} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit")

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, *, max_total: int = DEFAULT_MAX_TOTAL) -> Manifest:
        """Decode and validate an untrusted manifest; ManifestError says what is wrong."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest of {len(data)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit")
        data = bytes(data)
        try:
            body = msgpack.unpackb(
                data, raw=False, strict_map_key=False, max_str_len=MAX_MANIFEST_BYTES,
                max_bin_len=MAX_MANIFEST_BYTES, max_array_len=4 * MAX_TENSORS, max_map_len=MAX_TENSORS,
                max_ext_len=0,
            )
        except (ValueError, TypeError, msgpack.UnpackException) as e:  # what msgpack raises on garbage
            raise ManifestError(f"manifest is not valid msgpack ({type(e).__name__})") from None
        if not isinstance(body, dict) or tuple(body) != _KEYS:
            raise ManifestError(f"manifest must be a map with keys {list(_KEYS)}")
        if body["v"] != VERSION:
            raise ManifestError(f"unsupported manifest version {body['v']!r:.20}")
        raw = body["tensors"]
        if not isinstance(raw, list):
            raise ManifestError("tensors must be a list")
        entries = []
        for i, e in enumerate(raw):
            if not (isinstance(e, list) and len(e) == 4 and known_dtype(e[0])
                    and isinstance(e[1], list) and all(type(d) is int for d in e[1])
                    and type(e[2]) is int and type(e[3]) is int):
                raise ManifestError(f"malformed tensor table entry {i}")
            entries.append(TensorEntry(e[0], tuple(e[1]), e[2], e[3]))
        if type(body["total"]) is not int:
            raise ManifestError("total must be an int")
        m = cls(body["skeleton"], tuple(entries), body["chunk_size"], body["digests"], body["meta"], max_total)
        if m.total_size != body["total"]:
            raise ManifestError(f"total {body['total']} does not match the tensor table ({m.total_size})")
        if m.encoded != data:
            raise ManifestError("manifest encoding is not canonical")
        return m


# ---------------------------------------------------------------------------- snapshots


def _byte_view(buffer: torch.Tensor) -> torch.Tensor:
    import torch

    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1 or \
            buffer.device.type != "cpu" or not buffer.is_contiguous():
        raise ManifestError("the snapshot buffer must be a contiguous 1-D uint8 CPU tensor")
    return buffer


#: threads hashing the chunks of one snapshot
HASH_THREADS = 4


def hash_chunks(buffer: torch.Tensor, chunk_size: int) -> bytes:
    """Concatenated blake3 digests of ``buffer`` cut into ``chunk_size`` pieces."""
    view = memoryview(_byte_view(buffer).numpy())
    return hash_pieces(-(-len(view) // chunk_size), lambda i: view[i * chunk_size : (i + 1) * chunk_size])


def hash_pieces(n: int, piece: Callable[[int], Any]) -> bytes:
    """Concatenated blake3 digests of ``piece(0)`` .. ``piece(n - 1)`` (buffers; called from
    several threads at once).

    blake3 drops the GIL while it hashes a chunk, but must take it back before the next one; in a
    peer whose event loop and training threads keep the GIL busy, each take waits up to the switch
    interval (5 ms), so chunks in a row cost several times the hashing itself. Several threads
    overlap those waits."""
    def one(i: int) -> bytes:
        return blake3.blake3(piece(i)).digest()

    if n < 2 * HASH_THREADS:
        return b"".join(map(one, range(n)))
    with ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="p2ptrain-hash") as pool:
        return b"".join(pool.map(one, range(n)))


def build_snapshot(
    obj: Any, meta: dict | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE, *,
    max_total: int = DEFAULT_MAX_TOTAL, lock: AbstractContextManager[Any] | None = None,
) -> tuple[Manifest, torch.Tensor]:
    """Copy every tensor of ``obj`` once into one new buffer and describe it.

    Returns ``(manifest, buffer)``; ``buffer`` is a contiguous 1-D uint8 CPU tensor (use
    ``memoryview(buffer.numpy())`` for raw bytes). The copy is the point: training may go on
    mutating ``obj``'s tensors while peers download the snapshot, which must not change under
    them. Call it between optimizer steps (in the training thread), then hand the result to the
    event loop (``StateServer.publish``). GPU tensors are copied straight into the buffer.

    ``lock``: held while ``obj`` is read and copied, released before the hashing (the slower
    half), so a trainer that holds it while changing parameters waits for the copy only.

    Several torch calls per tensor, each of which gives up the GIL: run with short GIL waits (see
    :mod:`p2ptrain.gil`), or a peer whose other threads are busy makes each of them wait 5 ms.
    """
    with short_gil_waits():
        return _build_snapshot(obj, meta, chunk_size, max_total, lock)


def _build_snapshot(obj: Any, meta: dict | None, chunk_size: int, max_total: int,
                    lock: AbstractContextManager[Any] | None) -> tuple[Manifest, torch.Tensor]:
    import torch

    with lock if lock is not None else nullcontext():
        skeleton, tensors = flatten(obj() if callable(obj) else obj)
        specs = tensor_specs(skeleton)
        entries, total = layout(specs)
        if total > max_total:
            raise StateTooLarge(total, max_total)
        buffer = torch.empty(total, dtype=torch.uint8)
        pos = 0
        for t, e in zip(tensors, entries):
            if e.nbytes:
                buffer[pos : e.offset].zero_()  # alignment padding: never leak stale process memory
                _typed(buffer, e).copy_(t.detach())
                pos = e.offset + e.nbytes
    m = Manifest(skeleton, tuple(entries), chunk_size, hash_chunks(buffer, chunk_size), dict(meta or {}), max_total)
    return m, buffer


def _typed(buffer: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    """A view of ``e``'s bytes in ``buffer`` with its dtype and shape."""
    return buffer[e.offset : e.offset + e.nbytes].view(torch_dtype(e.dtype)).view(e.shape)


def restore(manifest: Manifest, buffer: torch.Tensor, *, copy: bool = False) -> Any:
    """Rebuild the snapshotted object from its buffer (chunks are not re-verified here).

    By default the tensors are views of ``buffer``: a fetched state is used once, right away
    (``load_state_dict`` copies parameters; optimizers keep tensors of matching dtype as they
    are), so views avoid holding the state twice. The price: they alias the buffer and keep all
    of it alive while any of them lives. Pass ``copy=True`` for independent tensors, e.g. when
    restoring from a buffer that a ``StateServer`` still serves (in-place updates to views would
    change the bytes peers download, and fail their verification).
    """
    import torch

    buffer = _byte_view(buffer)
    if buffer.numel() != manifest.total_size:
        raise ManifestError(f"buffer holds {buffer.numel()} bytes, the manifest describes {manifest.total_size}")
    tensors = []
    for e in manifest.tensors:
        t = _typed(buffer, e) if e.nbytes else torch.empty(e.shape, dtype=torch_dtype(e.dtype))
        tensors.append(t.clone() if copy else t)
    return unflatten(manifest.skeleton, tensors)
