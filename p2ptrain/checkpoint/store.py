"""The local checkpoint store: immutable content-addressed blobs plus signed records, on disk.

Why: with no master there is no checkpoint directory anyone owns. Every checkpoint is a set of
blobs named by their blake3 digest (the state's chunks and its manifest) and a signed
:class:`CheckpointRecord` naming the manifest; any peer can hold, serve and verify them, and
identical chunks (frozen layers, unchanged embeddings) are stored once across checkpoints.

Layout under the data directory::

    blobs/ab/cdef...   one immutable file per blob, named by the hex of its blake3 digest
    refs/<manifest hex>.<16 hex>   one signed record per (manifest, run, writer), msgpack
    pins/<manifest hex>            empty: kept by gc whatever its age
    pending/<manifest hex>         the manifest of a fetch in progress (its chunks are kept by gc)
    tmp/                           files being written; renamed into place when complete
    lock                           flock: writers share it, gc takes it alone

Crash safety: every file is written to ``tmp/``, fsynced and renamed into place, and the
directories fsynced; a checkpoint's record is written last, after every blob it points to is
durable, so a checkpoint is visible (``list``/``latest``) only when it is complete. A SIGKILL
mid-save leaves unreferenced blobs and temp files, which :meth:`CheckpointStore.gc` removes.
Reads hash what they read; a blob that does not match its name is deleted and reported
(:class:`CorruptBlobError`), so a fetch can replace it.

Several records may name one manifest (two peers saved identical state, or one state under two
runs): each (manifest, run, writer) keeps its newest record, all are listed.

Concurrency: any number of processes may save, fetch and read at once (atomic renames; equal
names mean equal bytes). ``gc`` holds the lock file exclusively, so it never runs while a save
or commit is writing; the chunks of a fetch still in progress (between ``add_chunk`` calls) are
protected by its ``pending/`` marker, for ``pending_grace`` seconds after its last chunk.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import blake3

from dht import Identity

from ..paths import default_data_dir
from .blobs import BlobStore, CorruptBlobError, MissingBlobError, Progress, StoreError, fsync_dir
from .cid import CID_COMMON_PREFIX, cid as make_cid, parse_cid
from .info import (
    AmbiguousCheckpointError,
    CheckpointInfo,
    CheckpointNotFound,
    IncompleteCheckpointError,
    sort_newest_first,
)
from .manifest import DIGEST_SIZE, Manifest, ManifestError
from .record import CheckpointRecord, RecordError
from .tree import torch_dtype
from .upkeep import StoreUpkeep

if TYPE_CHECKING:
    import torch

_MANIFEST_CACHE = 32
#: chunks read and verified at once by ``load``
_READ_THREADS = 2
#: hex prefixes shorter than this are refused (they would match by accident)
MIN_PREFIX = 4


class CheckpointStore(StoreUpkeep):
    """Checkpoints under one data directory (see the module docstring for the layout)."""

    def __init__(self, root: str | os.PathLike[str] | None = None):
        self.root = Path(root).expanduser() if root is not None else default_data_dir()
        self.root.mkdir(parents=True, exist_ok=True)
        self.blobs = BlobStore(self.root)
        self._refs = self.root / "refs"
        self._pins = self.root / "pins"
        self._pending = self.root / "pending"
        for d in (self._refs, self._pins, self._pending):
            d.mkdir(exist_ok=True)
        # caches, shared by the threads a peer reads the store from (asyncio.to_thread)
        self._cache_lock = threading.Lock()
        self._manifests: OrderedDict[bytes, Manifest] = OrderedDict()
        self._records: dict[str, tuple[tuple[int, int, int], CheckpointRecord]] = {}  # ref name -> (stat, record)

    def __repr__(self) -> str:
        return f"CheckpointStore({str(self.root)!r})"

    # ------------------------------------------------------------------ writing

    def save(self, manifest: Manifest, buffer: torch.Tensor, *, run_id: str, epoch: int, identity: Identity,
             pin: bool = False, progress: Progress | None = None) -> CheckpointInfo:
        """Store a snapshot (from ``build_snapshot``) as epoch ``epoch`` of ``run_id``, signed by
        ``identity``: the chunks not stored yet and the manifest (durable, see
        ``BlobStore.write_many``), then the record, last. Durable on return.

        ``buffer`` must be the one ``build_snapshot`` returned with ``manifest``, unchanged: its
        chunks are written straight from it under the digests the manifest holds, not hashed a
        second time (that would cost a pass over the whole state for nothing). Were it changed
        anyway, every read and ``verify`` would find the chunk corrupt and remove it; nothing
        would load wrong bytes. ManifestError when ``buffer`` is not a buffer of the manifest's
        size. ``progress(bytes done, bytes total)`` over the chunks and the manifest."""
        record = CheckpointRecord.sign(identity, run_id=run_id, epoch=epoch, manifest_id=manifest.id,
                                       size=manifest.total_size)
        view = _buffer_view(manifest, buffer)
        blobs: list[tuple[bytes, bytes | memoryview]] = []
        for i in range(manifest.num_chunks):
            a, b = manifest.chunk_span(i)
            blobs.append((manifest.chunk_digest(i), view[a:b]))
        blobs.append((manifest.id, manifest.encoded))
        with self.blobs.shared():
            self.blobs.write_many(blobs, progress=progress)
            return self._publish(manifest, record, pin)

    def add_chunk(self, manifest: Manifest, index: int, data: bytes | bytearray | memoryview) -> None:
        """Store chunk ``index`` of ``manifest`` (a fetch in progress), verified against its
        digest: CorruptBlobError (nothing stored) when it does not match."""
        if type(index) is not int or not 0 <= index < manifest.num_chunks:
            raise IndexError(f"chunk index {index!r} out of range for {manifest.num_chunks} chunks")
        a, b = manifest.chunk_span(index)
        if len(memoryview(data).cast("B")) != b - a:
            raise CorruptBlobError(f"chunk {index} has {len(memoryview(data).cast('B'))} bytes, "
                                   f"the manifest says {b - a}")
        with self.blobs.shared():
            self._mark_pending(manifest)
            self.blobs.put(data, manifest.chunk_digest(index))

    def missing_chunks(self, manifest: Manifest) -> list[int]:
        """Indices of the chunks of ``manifest`` not yet stored (what a resumed fetch still
        needs). Also marks the fetch as pending, so gc keeps the chunks already there."""
        with self.blobs.shared():
            self._mark_pending(manifest)
            return [i for i in range(manifest.num_chunks) if not self.blobs.has(manifest.chunk_digest(i))]

    def commit(self, manifest: Manifest, record: CheckpointRecord, *, pin: bool = False) -> CheckpointInfo:
        """Make a fetched checkpoint visible once all its chunks are stored: checks the record's
        signature, that it names ``manifest`` and its size, and that no chunk is missing
        (IncompleteCheckpointError lists how many), then writes manifest and record."""
        if not isinstance(record, CheckpointRecord) or not record.verify():
            raise RecordError("the checkpoint record's signature does not verify: refusing it")
        if record.manifest_id != manifest.id:
            raise RecordError(f"the record names manifest {make_cid(record.manifest_id)}, not {make_cid(manifest.id)}")
        if record.size != manifest.total_size:
            raise RecordError(f"the record says {record.size} bytes, the manifest describes {manifest.total_size}")
        with self.blobs.shared():
            missing = [i for i in range(manifest.num_chunks) if not self.blobs.has(manifest.chunk_digest(i))]
            if missing:
                raise IncompleteCheckpointError(
                    f"checkpoint {make_cid(manifest.id)}: {len(missing)} of {manifest.num_chunks} chunks are not "
                    f"stored yet (first: {missing[0]}); add them before committing")
            # add_chunk fsynced each chunk but not its directory: make those durable too
            chunks = (manifest.chunk_digest(i) for i in range(manifest.num_chunks))
            self.blobs.write_many([(manifest.id, manifest.encoded)], present=chunks)
            return self._publish(manifest, record, pin)

    def _publish(self, manifest: Manifest, record: CheckpointRecord, pin: bool) -> CheckpointInfo:
        """With the shared lock held and every blob of ``manifest`` durable: the pin, then the
        record (the moment the checkpoint becomes visible)."""
        if pin:
            self._write_pin(manifest.id)
        record = self._write_ref(record)
        with contextlib.suppress(FileNotFoundError):  # a fetch of it, if any, is moot now
            (self._pending / manifest.id.hex()).unlink()
        self._remember(manifest)
        return CheckpointInfo(record, pinned=self._is_pinned(manifest.id))

    @staticmethod
    def _ref_name(record: CheckpointRecord) -> str:
        who = blake3.blake3(record.run_id.encode() + b"\0" + record.writer.to_bytes()).hexdigest()[:16]
        return f"{record.manifest_id.hex()}.{who}"

    def _write_ref(self, record: CheckpointRecord) -> CheckpointRecord:
        """Store ``record`` unless a newer one of the same (manifest, run, writer) is there;
        returns the record that is stored."""
        target = self._refs / self._ref_name(record)
        old = self._read_ref(target)
        if old is not None and not record.newer_than(old):
            return old
        self.blobs.atomic_write(target, record.to_bytes())
        fsync_dir(self._refs)
        return record

    def _mark_pending(self, manifest: Manifest) -> None:
        marker = self._pending / manifest.id.hex()
        try:
            os.utime(marker)
        except FileNotFoundError:
            self.blobs.atomic_write(marker, manifest.encoded)

    # ------------------------------------------------------------------ reading

    def manifest(self, manifest_id: bytes) -> Manifest:
        """The stored manifest ``manifest_id`` (verified); CheckpointNotFound when absent."""
        with self._cache_lock:
            m = self._manifests.get(manifest_id)
            if m is not None:
                self._manifests.move_to_end(manifest_id)
                return m
        try:
            data = self.blobs.read(manifest_id)
        except MissingBlobError:
            raise CheckpointNotFound(f"manifest {make_cid(manifest_id)} is not in the store at {self.root}") from None
        try:
            m = Manifest.from_bytes(data)
        except ManifestError as e:  # hashes right but does not parse: not a manifest at all
            raise ManifestError(f"blob {make_cid(manifest_id)} is not a valid manifest: {e}") from None
        self._remember(m)
        return m

    def _remember(self, m: Manifest) -> None:
        with self._cache_lock:
            self._manifests[m.id] = m
            while len(self._manifests) > _MANIFEST_CACHE:
                self._manifests.popitem(last=False)

    def _forget(self, manifest_id: bytes) -> None:
        with self._cache_lock:
            self._manifests.pop(manifest_id, None)

    def read_chunk(self, manifest: Manifest, index: int) -> bytes:
        """Chunk ``index`` of ``manifest``, verified (MissingBlobError / CorruptBlobError)."""
        if type(index) is not int or not 0 <= index < manifest.num_chunks:
            raise IndexError(f"chunk index {index!r} out of range for {manifest.num_chunks} chunks")
        return self.blobs.read(manifest.chunk_digest(index))

    def load(self, manifest_id: bytes, *, progress: Progress | None = None) -> tuple[Manifest, torch.Tensor]:
        """The manifest and the whole snapshot buffer, every chunk verified; ``restore(*result)``
        gives the state back. Each chunk is read straight into its place in the buffer and
        hashed there (one pass over memory), two chunks at a time."""
        import torch

        manifest = self.manifest(manifest_id)
        buffer = torch.empty(manifest.total_size, dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        items = []
        for i in range(manifest.num_chunks):
            a, b = manifest.chunk_span(i)
            items.append((manifest.chunk_digest(i), view[a:b]))

        def done(i: int) -> None:
            if progress is not None:
                progress(manifest.chunk_span(i)[1], manifest.total_size)

        try:
            self.blobs.read_many_into(items, threads=_READ_THREADS, on_done=done)
        except (MissingBlobError, CorruptBlobError) as e:
            raise self._chunk_error(manifest, getattr(e, "index", None), e) from None
        return manifest, buffer

    def load_tensors(self, manifest_id: bytes, *, progress: Progress | None = None,
                     only: set[int] | None = None) -> tuple[Manifest, list[torch.Tensor | None]]:
        """Like ``load``, but every tensor in its own storage (what a safetensors writer needs:
        views of one buffer count as shared memory there), chunks verified one at a time.
        ``only``: the indices of the tensors wanted (the others are None, their chunks unread)."""
        import torch

        manifest = self.manifest(manifest_id)
        tensors: list[torch.Tensor | None] = []
        spans = []
        for k, e in enumerate(manifest.tensors):
            if only is not None and k not in only:
                tensors.append(None)
                continue
            raw = torch.empty(e.nbytes, dtype=torch.uint8)
            tensors.append(raw.view(torch_dtype(e.dtype)).view(e.shape) if e.nbytes
                           else torch.empty(e.shape, dtype=torch_dtype(e.dtype)))
            spans.append((e.offset, e.offset + e.nbytes, raw))
        scratch = torch.empty(min(manifest.chunk_size, manifest.total_size), dtype=torch.uint8)
        first = 0  # tensors before this one end before the current chunk
        for i in range(manifest.num_chunks):
            a, b = manifest.chunk_span(i)
            while first < len(spans) and spans[first][1] <= a:
                first += 1
            if first == len(spans) or spans[first][0] >= b:  # no wanted byte in this chunk
                if progress is not None:
                    progress(b, manifest.total_size)
                continue
            chunk = scratch[: b - a]
            self._read_chunk_into(manifest, i, memoryview(chunk.numpy()))
            for start, end, raw in spans[first:]:
                if start >= b:
                    break
                lo, hi = max(start, a), min(end, b)
                if lo < hi:
                    raw[lo - start : hi - start].copy_(chunk[lo - a : hi - a])
            if progress is not None:
                progress(b, manifest.total_size)
        return manifest, tensors

    def _read_chunk_into(self, manifest: Manifest, index: int, out: memoryview) -> None:
        try:
            self.blobs.read_into(manifest.chunk_digest(index), out)
        except (MissingBlobError, CorruptBlobError) as e:
            raise self._chunk_error(manifest, index, e) from None

    @staticmethod
    def _chunk_error(manifest: Manifest, index: int | None, e: StoreError) -> StoreError:
        where = f"chunk {index} of {manifest.num_chunks}" if index is not None else "a chunk"
        return type(e)(f"checkpoint {make_cid(manifest.id)}, {where}: {e}; fetch the checkpoint again "
                       "('p2ptrain ckpt get') or restore the data directory")

    def _read_ref(self, path: Path) -> CheckpointRecord | None:
        """The valid record in ``path``, or None (missing, malformed, forged or misfiled)."""
        try:
            return self._parse_ref(path)
        except (OSError, RecordError):
            return None

    def _parse_ref(self, path: Path) -> CheckpointRecord:
        data = path.read_bytes()
        record = CheckpointRecord.from_bytes(data)
        if not record.verify():
            raise RecordError("signature does not verify")
        if path.name != self._ref_name(record):
            raise RecordError("record is filed under a name that is not its own")
        return record

    def _scan_refs(self, *, fresh: bool = False) -> tuple[list[CheckpointInfo], list[tuple[Path, str]]]:
        """(valid checkpoints, [(path, problem)] for ref files that are not valid records).

        Records are parsed and their signatures checked once per file version (mtime, size,
        inode); ``fresh`` re-reads every file (gc and verify: a file changed in place within the
        clock's granularity would look unchanged)."""
        pins = self._pinned()
        good, bad = [], []
        seen: dict[str, tuple[tuple[int, int, int], CheckpointRecord]] = {}
        with os.scandir(self._refs) as entries:
            for entry in entries:
                path = Path(entry.path)
                try:
                    st = entry.stat()
                    key = (st.st_mtime_ns, st.st_size, st.st_ino)  # a replaced file changes inode
                    cached = self._records.get(entry.name)
                    hit = cached is not None and cached[0] == key and not fresh
                    record = cached[1] if hit else self._parse_ref(path)
                except RecordError as e:
                    bad.append((path, str(e)))
                    continue
                except FileNotFoundError:  # removed meanwhile (gc, a newer record)
                    continue
                seen[entry.name] = (key, record)  # parsed and signature checked once per file version
                good.append(CheckpointInfo(record, record.manifest_id in pins))
        self._records = seen
        return good, bad

    def invalid_records(self) -> list[str]:
        """One line per record file that is not a valid record (gc removes them)."""
        return [f"record {path.name}: {why}" for path, why in self._scan_refs(fresh=True)[1]]

    def list(self, run_id: str | None = None) -> list[CheckpointInfo]:
        """Complete checkpoints (of ``run_id``, or all), newest first; forged or malformed
        records are skipped (``verify`` reports them)."""
        infos, _ = self._scan_refs()
        if run_id is not None:
            infos = [i for i in infos if i.run_id == run_id]
        return sort_newest_first(infos)

    def latest(self, run_id: str) -> CheckpointInfo | None:
        infos = self.list(run_id)
        return infos[0] if infos else None

    def resolve(self, text: str) -> bytes:
        """The manifest id of the stored checkpoint ``text`` names: a CID, 64 hex digits, or a
        unique prefix of either. CheckpointNotFound / AmbiguousCheckpointError / ValueError,
        each with a message saying what to do."""
        s = text.strip().lower() if isinstance(text, str) else ""
        known = {i.manifest_id for i in self.list()}
        try:
            digest = parse_cid(s)
        except ValueError as e:
            parse_error = str(e)
        else:
            if digest in known:
                return digest
            raise CheckpointNotFound(f"no checkpoint {make_cid(digest)} in {self.root} ('p2ptrain ckpt ls' lists "
                                     "them; 'p2ptrain ckpt get' fetches one from the swarm)")
        is_hex = bool(s) and all(c in "0123456789abcdef" for c in s)
        is_cid = s.startswith("b") and len(s) > len(CID_COMMON_PREFIX)
        if not (is_hex or is_cid):
            raise ValueError(parse_error)
        if is_hex and len(s) < MIN_PREFIX and not is_cid:
            raise ValueError(f"checkpoint prefix {text!r} is too short: give at least {MIN_PREFIX} characters")
        matches = sorted(m for m in known
                         if (is_hex and m.hex().startswith(s)) or (is_cid and make_cid(m).startswith(s)))
        if not matches:
            raise CheckpointNotFound(f"no checkpoint matches {text!r} in {self.root} ('p2ptrain ckpt ls' lists them)")
        if len(matches) > 1:
            shown = ", ".join(make_cid(m)[:20] + "…" for m in matches[:3])
            raise AmbiguousCheckpointError(f"{text!r} matches {len(matches)} checkpoints ({shown}); "
                                           "give more characters")
        return matches[0]

    def infos(self, manifest_id: bytes) -> list[CheckpointInfo]:
        """Every record naming ``manifest_id``, newest first (empty when none)."""
        return [i for i in self.list() if i.manifest_id == manifest_id]

    # ------------------------------------------------------------------ pins

    def _pinned(self) -> set[bytes]:
        out = set()
        with os.scandir(self._pins) as entries:
            for e in entries:
                with contextlib.suppress(ValueError):
                    if len(d := bytes.fromhex(e.name)) == DIGEST_SIZE:
                        out.add(d)
        return out

    def _is_pinned(self, manifest_id: bytes) -> bool:
        return (self._pins / manifest_id.hex()).exists()

    def _write_pin(self, manifest_id: bytes) -> None:
        fd = os.open(self._pins / manifest_id.hex(), os.O_WRONLY | os.O_CREAT, 0o644)
        os.close(fd)
        fsync_dir(self._pins)

    def pin(self, manifest_id: bytes) -> None:
        """Keep checkpoint ``manifest_id`` through every gc (CheckpointNotFound if not stored)."""
        if not self.infos(manifest_id):
            raise CheckpointNotFound(f"no checkpoint {make_cid(manifest_id)} in {self.root} to pin")
        self._write_pin(manifest_id)

    def unpin(self, manifest_id: bytes) -> None:
        """Let gc treat the checkpoint like any other again (a no-op when it was not pinned)."""
        with contextlib.suppress(FileNotFoundError):
            (self._pins / manifest_id.hex()).unlink()

    # ------------------------------------------------------------------ export

    def export(self, manifest_id: bytes, path: str | os.PathLike[str], *, with_optimizer: bool = False,
               progress: Progress | None = None) -> tuple[int, str | None]:
        """Write checkpoint ``manifest_id`` as a plain ``.safetensors`` file, atomically, under its
        model's ``state_dict`` names (optimizer state too, prefixed, ``with_optimizer``); returns
        (tensors written, a note when it records no names). See :mod:`.export`."""
        from .export import export_safetensors

        return export_safetensors(self, manifest_id, path, with_optimizer=with_optimizer, progress=progress)


def _buffer_view(manifest: Manifest, buffer: torch.Tensor) -> memoryview:
    import torch

    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1 or \
            buffer.device.type != "cpu" or not buffer.is_contiguous():
        raise ManifestError("the snapshot buffer must be a contiguous 1-D uint8 CPU tensor (as build_snapshot returns)")
    if buffer.numel() != manifest.total_size:
        raise ManifestError(f"buffer holds {buffer.numel()} bytes, the manifest describes {manifest.total_size}")
    return memoryview(buffer.numpy())


__all__ = ["CheckpointStore"]
