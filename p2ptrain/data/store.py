"""Datasets on disk: their index and shards as blobs of the checkpoint store, plus what is held.

Same directory and blob store as checkpoints (``CheckpointStore``): a shard is a manifest of
chunks, the index a manifest with no tensors (``index``), so identical bytes are stored once and
``ckpt``'s verify/gc machinery applies. Beside ``blobs/`` a dataset adds::

    datasets/<index hex>   empty: this store holds (some of) the dataset; ``data ls`` lists these
    roots/<manifest hex>   empty: gc keeps this manifest and its chunks (the index and each shard held)

A shard counts as held when its manifest blob is stored (written last, after its chunks).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from dht import Identity

from ..checkpoint.blobs import CorruptBlobError, MissingBlobError, StoreError, fsync_dir
from ..checkpoint.cid import cid as make_cid
from ..checkpoint.info import CheckpointNotFound
from ..checkpoint.manifest import DEFAULT_CHUNK_SIZE, MIN_CHUNK_SIZE, Manifest, ManifestError, build_snapshot, restore
from ..checkpoint.store import CheckpointStore
from .index import SHARD_KIND, DatasetError, DatasetIndex, ShardRef, check_shard, parse_dataset_id
from .records import DEFAULT_ROW, DEFAULT_SHARD_BYTES, detect_format, shards_of

#: a gc that keeps every checkpoint (``data gc`` sweeps only what no dataset or checkpoint uses)
_KEEP_ALL = 1 << 30


class DataStore:
    """The datasets under one data directory (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str] | None = None):
        self.ckpt = CheckpointStore(root)
        self.root = self.ckpt.root
        self.blobs = self.ckpt.blobs
        self._datasets = self.root / "datasets"
        self._roots = self.root / "roots"
        for d in (self._datasets, self._roots):
            d.mkdir(exist_ok=True)

    # ------------------------------------------------------------------ writing

    def add(self, paths: list[str | os.PathLike[str]], name: str, identity: Identity, *,
            shard_bytes: int = DEFAULT_SHARD_BYTES, chunk_size: int | None = None,
            row: int = DEFAULT_ROW) -> DatasetIndex:
        """Cut ``paths`` into shards (``records``), store them and a signed index; the index.
        ``chunk_size`` (default: an eighth of a shard, 4 MiB at most) is the unit of verification
        and of the split between providers: a shard of several chunks comes from several peers."""
        if chunk_size is None:
            chunk_size = max(MIN_CHUNK_SIZE, min(DEFAULT_CHUNK_SIZE, shard_bytes // 8))
        fmt = detect_format([Path(p) for p in paths])
        refs = []
        for tensor, count in shards_of(paths, fmt, shard_bytes, row):
            m, buf = build_snapshot({"records": tensor}, {"kind": SHARD_KIND, "format": fmt, "records": count},
                                    chunk_size=chunk_size)
            view = memoryview(buf.numpy())
            blobs = [(m.chunk_digest(i), view[slice(*m.chunk_span(i))]) for i in range(m.num_chunks)]
            with self.blobs.shared():
                self.blobs.write_many([*blobs, (m.id, m.encoded)])
                self._root(m.id)
            refs.append(ShardRef(m.id, m.total_size, count))
        if not refs:
            raise DatasetError(f"{', '.join(map(str, paths))}: no records to add (empty files?)")
        index = DatasetIndex.sign(identity, name, fmt, refs)
        self.put_index(index)
        return index

    def put_index(self, index: DatasetIndex) -> None:
        """Store a (verified) index and mark the dataset held."""
        m = index.manifest()
        with self.blobs.shared():
            self.blobs.write_many([(m.id, m.encoded)])
            self._root(m.id)
            self._mark(self._datasets, m.id)

    def _root(self, mid: bytes) -> None:
        self._mark(self._roots, mid)

    @staticmethod
    def _mark(where: Path, mid: bytes) -> None:
        target = where / mid.hex()
        if not target.exists():
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
            fsync_dir(where)

    def add_chunk(self, m: Manifest, index: int, data: bytes | bytearray | memoryview) -> None:
        """One verified chunk of a shard being fetched (``CheckpointStore.add_chunk``)."""
        self.ckpt.add_chunk(m, index, data)

    def missing_chunks(self, m: Manifest) -> list[int]:
        return self.ckpt.missing_chunks(m)

    def commit_shard(self, ref: ShardRef, fmt: str, m: Manifest) -> None:
        """Make a fetched shard held: every chunk stored, then its manifest (last)."""
        check_shard(m, ref, fmt)
        with self.blobs.shared():
            missing = [i for i in range(m.num_chunks) if not self.blobs.has(m.chunk_digest(i))]
            if missing:
                raise DatasetError(f"shard {make_cid(m.id)}: {len(missing)} chunks not stored yet")
            self.blobs.write_many([(m.id, m.encoded)], present=(m.chunk_digest(i) for i in range(m.num_chunks)))
            self._root(m.id)
        with contextlib.suppress(FileNotFoundError):
            (self.root / "pending" / m.id.hex()).unlink()

    # ------------------------------------------------------------------ reading

    def index(self, dataset_id: bytes) -> DatasetIndex:
        """The stored, verified index; DatasetError when it is absent or not a dataset."""
        try:
            m = self.ckpt.manifest(dataset_id)
        except CheckpointNotFound:
            raise DatasetError(f"dataset {make_cid(dataset_id)} is not in {self.root} ('p2ptrain data get "
                               f"{make_cid(dataset_id)}' fetches it from the swarm)") from None
        except (CorruptBlobError, ManifestError) as e:
            raise DatasetError(f"dataset {make_cid(dataset_id)}: {e}; fetch it again ('p2ptrain data get')") from None
        return DatasetIndex.from_manifest(m, dataset_id)

    def serves(self, mid: bytes) -> bool:
        """Whether ``mid`` is a dataset index or shard held here (what a peer may fetch from us)."""
        return (self._roots / mid.hex()).exists() and self.blobs.has(mid)

    def has_shard(self, ref: ShardRef) -> bool:
        return self.blobs.has(ref.id)

    def held(self, index: DatasetIndex) -> list[bool]:
        return [self.has_shard(s) for s in index.shards]

    def shard_manifest(self, ref: ShardRef) -> Manifest:
        return self.ckpt.manifest(ref.id)

    def load_shard(self, index: DatasetIndex, i: int) -> torch.Tensor:
        """Shard ``i``'s record tensor, every chunk verified (a corrupt one is removed and
        reported with what to do)."""
        ref = index.shards[i]
        try:
            m, buf = self.ckpt.load(ref.id)
        except (CheckpointNotFound, StoreError) as e:
            raise DatasetError(f"dataset {index.cid}, shard {i}: {e}") from None
        check_shard(m, ref, index.format)
        return restore(m, buf)["records"]

    def list(self) -> list[tuple[DatasetIndex, int]]:
        """Every dataset held (fully or partly), with how many of its shards are stored."""
        out = []
        for e in sorted(os.scandir(self._datasets), key=lambda e: e.name):
            with contextlib.suppress(ValueError, DatasetError):
                index = self.index(bytes.fromhex(e.name))
                out.append((index, sum(self.held(index))))
        return out

    def resolve(self, text: str) -> bytes:
        """The id of a held dataset named by its CID, hex digest, name or a unique prefix;
        any well-formed CID is returned as is (it may be fetched)."""
        with contextlib.suppress(DatasetError):
            return parse_dataset_id(text)
        s = text.strip().lower()
        found = [i.id for i, _ in self.list() if i.name == text or (len(s) >= 6 and (
            i.cid.startswith(s) or i.id.hex().startswith(s)))]
        if len(found) == 1:
            return found[0]
        if found:
            raise DatasetError(f"{text!r} matches {len(found)} datasets: give more of the CID")
        return parse_dataset_id(text)  # raises, saying what a dataset id looks like

    # ------------------------------------------------------------------ upkeep

    def verify(self, dataset_id: bytes) -> list[str]:
        """Re-hash the index and every held shard from disk; one line per problem (corrupt
        blobs are removed, so a ``get`` fetches them again)."""
        try:
            index = self.index(dataset_id)
        except DatasetError as e:
            return [str(e)]
        problems = []
        for i, ref in enumerate(index.shards):
            if not self.has_shard(ref):
                continue
            try:
                m = self.shard_manifest(ref)
                check_shard(m, ref, index.format)
                for c in range(m.num_chunks):
                    self.blobs.verify(m.chunk_digest(c))
            except MissingBlobError:
                problems.append(f"shard {i}: a chunk is missing; 'p2ptrain data get {index.cid}' fetches it")
                with contextlib.suppress(FileNotFoundError):
                    self.blobs.path(ref.id).unlink()  # no longer held: its manifest goes too
            except (CorruptBlobError, CheckpointNotFound, ManifestError, DatasetError) as e:
                problems.append(f"shard {i}: {e}; 'p2ptrain data get {index.cid}' fetches it again")
                with contextlib.suppress(FileNotFoundError):
                    self.blobs.path(ref.id).unlink()
        return problems

    def drop(self, dataset_id: bytes) -> None:
        """Stop holding a dataset: its blobs go at the next gc (those another dataset uses stay)."""
        index = self.index(dataset_id)
        keep = {s.id for other, _ in self.list() if other.id != dataset_id for s in other.shards}
        for mid in [dataset_id, *(s.id for s in index.shards if s.id not in keep)]:
            with contextlib.suppress(FileNotFoundError):
                (self._roots / mid.hex()).unlink()
        with contextlib.suppress(FileNotFoundError):
            (self._datasets / dataset_id.hex()).unlink()

    def gc(self) -> tuple[int, int]:
        """Remove every blob no dataset and no checkpoint uses; (blobs removed, bytes freed)."""
        r = self.ckpt.gc(keep=_KEEP_ALL)
        return r.blobs_removed, r.bytes_freed
