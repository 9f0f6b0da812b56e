"""The signed dataset manifest (its "index"): which shards, in which order, make dataset N. Sans-IO.

A dataset's CID is the id of a checkpoint-style :class:`~p2ptrain.checkpoint.manifest.Manifest`
with no tensors whose ``meta`` holds the index: its name, record format, the id, byte size and
record count of every shard, when and by whom it was written, and the writer's Ed25519
signature over all of that. So the CID pins every byte of the dataset (each shard is itself a
manifest of chunk digests), the existing state servers and fetchers move it like any other
manifest, and a reader checks the signature from the index alone (the key is in the PeerID).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import msgpack

from dht import Identity, PeerID

from ..checkpoint.cid import cid as make_cid
from ..checkpoint.manifest import MIN_CHUNK_SIZE, Manifest
from ..errors import P2PTrainError

KIND = "p2ptrain/dataset"
SHARD_KIND = "p2ptrain/data-shard"
#: record formats: ``text`` (UTF-8 lines, one record each) and ``tokens`` (rows of an integer array)
FORMATS = ("text", "tokens")
#: bounded so a provider's entry (one bit per shard) fits a DHT value
MAX_SHARDS = 30_000
MAX_NAME = 100
_DOMAIN = "p2ptrain/dataset-index/1"


class DatasetError(P2PTrainError, ValueError):
    """An index that is malformed, forged or not the one asked for; the message says which."""


@dataclass(frozen=True)
class ShardRef:
    """One shard: the id of its manifest, its bytes and its records."""

    id: bytes
    size: int
    records: int


@dataclass(frozen=True)
class DatasetIndex:
    """``writer`` says: dataset ``name`` is ``shards`` in this order, of records in ``format``."""

    name: str
    format: str
    shards: tuple[ShardRef, ...]
    created: float
    writer: PeerID
    signature: bytes

    @staticmethod
    def _payload(name: str, fmt: str, shards: tuple[ShardRef, ...], created: float, writer: PeerID) -> bytes:
        rows = [[s.id, s.size, s.records] for s in shards]
        return msgpack.packb([_DOMAIN, name, fmt, rows, created, writer.to_bytes()], use_bin_type=True)

    @classmethod
    def sign(cls, identity: Identity, name: str, fmt: str, shards: list[ShardRef]) -> DatasetIndex:
        _check(name, fmt, shards)
        created = time.time()
        sig = identity.sign(cls._payload(name, fmt, tuple(shards), created, identity.peer_id))
        return cls(name, fmt, tuple(shards), created, identity.peer_id, sig)

    def verify(self) -> bool:
        return self.writer.verify(self.signature, self._payload(self.name, self.format, self.shards, self.created,
                                                                self.writer))

    @property
    def size(self) -> int:
        return sum(s.size for s in self.shards)

    @property
    def records(self) -> int:
        return sum(s.records for s in self.shards)

    def manifest(self) -> Manifest:
        """The manifest whose id is this dataset's CID."""
        meta = {"kind": KIND, "name": self.name, "format": self.format,
                "shards": [[s.id, s.size, s.records] for s in self.shards], "created": self.created,
                "writer": self.writer.to_bytes(), "sig": self.signature}
        return Manifest(None, (), MIN_CHUNK_SIZE, b"", meta)

    @property
    def id(self) -> bytes:
        return self.manifest().id

    @property
    def cid(self) -> str:
        return make_cid(self.id)

    @classmethod
    def from_manifest(cls, m: Manifest, expected_id: bytes | None = None) -> DatasetIndex:
        """The verified index a manifest holds; DatasetError when it is none, is forged, or is
        not ``expected_id``."""
        if expected_id is not None and m.id != expected_id:
            raise DatasetError(f"got manifest {make_cid(m.id)} where dataset {make_cid(expected_id)} was asked for")
        meta = m.meta
        if m.tensors or meta.get("kind") != KIND:
            raise DatasetError(f"{make_cid(m.id)} is not a dataset (a checkpoint or a shard?)")
        try:
            rows, writer = meta["shards"], PeerID(meta["writer"])
            if not isinstance(rows, list) or not all(isinstance(r, list) and len(r) == 3 for r in rows):
                raise TypeError("shards must be a list of [id, size, records]")
            shards = tuple(ShardRef(bytes(r[0]), r[1], r[2]) for r in rows)
            index = cls(meta["name"], meta["format"], shards, meta["created"], writer, meta["sig"])
            _check(index.name, index.format, list(shards))
            if type(index.created) is not float or not math.isfinite(index.created):
                raise TypeError("created must be a float")
            if not isinstance(index.signature, bytes):
                raise TypeError("sig must be bytes")
        except (KeyError, TypeError, ValueError) as e:
            raise DatasetError(f"dataset {make_cid(m.id)} has a malformed index: {e}") from None
        if not index.verify():
            raise DatasetError(f"dataset {make_cid(m.id)}: the index's signature does not verify (forged or "
                               "tampered): refusing it")
        if index.manifest().id != m.id:
            raise DatasetError(f"dataset {make_cid(m.id)}: the index is not in its canonical form")
        return index


def _check(name: object, fmt: object, shards: list[ShardRef]) -> None:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or not name.isprintable():
        raise DatasetError(f"dataset name {name!r:.60}: 1 to {MAX_NAME} printable characters")
    if fmt not in FORMATS:
        raise DatasetError(f"record format {fmt!r:.30} is not one of {', '.join(FORMATS)}")
    if not 0 < len(shards) <= MAX_SHARDS:
        raise DatasetError(f"a dataset has 1 to {MAX_SHARDS} shards, not {len(shards)}")
    for s in shards:
        if len(s.id) != 32 or type(s.size) is not int or type(s.records) is not int or s.size < 0 or s.records < 0:
            raise DatasetError("malformed shard entry")


def parse_dataset_id(text: str) -> bytes:
    """The 32-byte id a dataset CID (or 64 hex digits) names; DatasetError saying what was expected."""
    from ..checkpoint.cid import parse_cid

    try:
        return parse_cid(text)
    except ValueError as e:
        raise DatasetError(str(e).replace("checkpoint id", "dataset id")) from None


def check_shard(m: Manifest, ref: ShardRef, fmt: str) -> None:
    """DatasetError unless ``m`` is the shard ``ref`` names (its manifest hashed already)."""
    if m.id != ref.id or m.total_size != ref.size or m.meta.get("kind") != SHARD_KIND \
            or m.meta.get("format") != fmt or m.meta.get("records") != ref.records or len(m.tensors) != 1:
        raise DatasetError(f"shard {make_cid(ref.id)} does not match the dataset's index")


__all__ = ["DatasetError", "DatasetIndex", "FORMATS", "ShardRef", "check_shard", "parse_dataset_id"]
