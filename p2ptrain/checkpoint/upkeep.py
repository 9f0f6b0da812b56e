"""The store's upkeep: ``gc`` (what to keep, what to sweep) and ``verify`` (re-hash from disk), as a
base class of :class:`~p2ptrain.checkpoint.store.CheckpointStore`, whose layout they walk."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .blobs import CorruptBlobError, MissingBlobError, Progress, StoreError
from .cid import cid as make_cid
from .info import CheckpointInfo, CheckpointNotFound, GcResult, sort_newest_first
from .manifest import Manifest, ManifestError

if TYPE_CHECKING:
    from .blobs import BlobStore
    from .record import CheckpointRecord

#: a fetch's chunks stay protected from gc this long after its last ``add_chunk``
DEFAULT_PENDING_GRACE = 3600.0


class StoreUpkeep:
    """``gc`` and ``verify`` over a store's refs, pins, pending fetches and blobs."""

    if TYPE_CHECKING:  # what CheckpointStore provides
        blobs: BlobStore
        _refs: Path
        _pins: Path
        _pending: Path
        root: Path

        def _scan_refs(self, *, fresh: bool = False) -> tuple[list[CheckpointInfo], list[tuple[Path, str]]]: ...
        @staticmethod
        def _ref_name(record: CheckpointRecord) -> str: ...
        def _pinned(self) -> set[bytes]: ...
        def manifest(self, manifest_id: bytes) -> Manifest: ...
        def _forget(self, manifest_id: bytes) -> None: ...

    def gc(self, keep: int = 3, *, pending_grace: float = DEFAULT_PENDING_GRACE) -> GcResult:
        """Per run, keep the newest ``keep`` checkpoints and every pinned one; delete the rest,
        then every blob no kept checkpoint (or fetch in progress) uses, temp files left by
        crashed writers, and malformed or forged record files. Runs with the store locked
        against writers, so it never removes what a concurrent save is writing."""
        if type(keep) is not int or keep < 0:
            raise ValueError(f"keep must be a non-negative int, not {keep!r}")
        result = GcResult()
        with self.blobs.exclusive():
            infos, bad = self._scan_refs(fresh=True)
            for path, _ in bad:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                result.bad_refs_removed += 1
            by_run: dict[str, list[CheckpointInfo]] = {}
            for info in sort_newest_first(infos):
                by_run.setdefault(info.run_id, []).append(info)
            for run in by_run.values():
                newest: list[bytes] = []
                for info in run:
                    if info.manifest_id not in newest and len(newest) < keep:
                        newest.append(info.manifest_id)
                for info in run:
                    if info.pinned or info.manifest_id in newest:
                        result.kept.append(info)
                    else:
                        with contextlib.suppress(FileNotFoundError):
                            (self._refs / self._ref_name(info.record)).unlink()
                        result.removed.append(info)
            kept_ids = {i.manifest_id for i in result.kept}
            for pinned in self._pinned() - kept_ids:  # a pin whose records are gone pins nothing
                with contextlib.suppress(FileNotFoundError):
                    (self._pins / pinned.hex()).unlink()
            live: set[bytes] = set()
            for mid in kept_ids:
                live.add(mid)
                try:
                    m = self.manifest(mid)
                except (StoreError, ManifestError, CheckpointNotFound) as e:
                    result.problems.append(f"checkpoint {make_cid(mid)}: {e}")
                    continue
                live.update(m.chunk_digest(i) for i in range(m.num_chunks))
            result.pending_removed = self._live_pending(live, pending_grace)
            self._live_roots(live)
            for digest, path in [] if result.problems else list(self.blobs.digests()):
                if digest in live:
                    continue
                try:
                    size = path.stat().st_size
                    path.unlink()
                except FileNotFoundError:
                    continue
                self._forget(digest)
                result.blobs_removed += 1
                result.bytes_freed += size
            with os.scandir(self.blobs.tmp) as entries:  # no writer holds the lock: all are stale
                for e in entries:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(e.path)
                        result.temp_removed += 1
            for sub in self.blobs.dir.iterdir():
                with contextlib.suppress(OSError):
                    sub.rmdir()  # only succeeds when empty
        result.kept = sort_newest_first(result.kept)
        return result

    def _live_roots(self, live: set[bytes]) -> None:
        """Add the blobs other users of the store keep (``roots/<manifest hex>``: a dataset's
        index and shards) to ``live``: each manifest and, when it is stored, its chunks."""
        with contextlib.suppress(FileNotFoundError), os.scandir(self.root / "roots") as entries:
            for e in entries:
                with contextlib.suppress(ValueError):
                    mid = bytes.fromhex(e.name)
                    live.add(mid)
                    with contextlib.suppress(StoreError, ManifestError, CheckpointNotFound):
                        m = self.manifest(mid)
                        live.update(m.chunk_digest(i) for i in range(m.num_chunks))

    def _live_pending(self, live: set[bytes], grace: float) -> int:
        """Add the blobs of fetches touched within ``grace`` seconds to ``live``; remove older
        markers. Returns how many markers were removed."""
        removed, now = 0, time.time()
        with os.scandir(self._pending) as entries:
            for e in entries:
                try:
                    fresh = now - e.stat().st_mtime <= grace
                    m = Manifest.from_bytes(Path(e.path).read_bytes()) if fresh else None
                except (OSError, ManifestError):
                    m = None
                if m is None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(e.path)
                    removed += 1
                    continue
                live.add(m.id)
                live.update(m.chunk_digest(i) for i in range(m.num_chunks))
        return removed

    def verify(self, manifest_id: bytes | None = None, *, progress: Progress | None = None) -> list[str]:
        """Re-hash every blob of one checkpoint (or all) from disk; one line per problem (empty
        when all is well). Corrupt blobs are removed as they are found."""
        problems: list[str] = []
        infos, bad = self._scan_refs(fresh=True)
        if manifest_id is None:
            problems += [f"record {path.name}: {why}" for path, why in bad]
        else:
            infos = [i for i in infos if i.manifest_id == manifest_id]
            if not infos:
                raise CheckpointNotFound(f"no checkpoint {make_cid(manifest_id)} in {self.root}")
        by_manifest: dict[bytes, list[CheckpointInfo]] = {}
        for info in sort_newest_first(infos):
            by_manifest.setdefault(info.manifest_id, []).append(info)
        manifests: list[tuple[Manifest, str]] = []
        for mid, group in by_manifest.items():
            label = f"checkpoint {make_cid(mid)} (run {group[0].run_id!r}, epoch {group[0].epoch})"
            self._forget(mid)  # re-read from disk
            try:
                m = self.manifest(mid)
            except CheckpointNotFound:
                problems.append(f"{label}: its manifest blob is missing")
                continue
            except (CorruptBlobError, ManifestError) as e:
                problems.append(f"{label}: manifest: {e}")
                continue
            problems += [f"{label}: record says {i.size} bytes, the manifest {m.total_size}"
                         for i in group if i.size != m.total_size][:1]
            manifests.append((m, label))
        total = sum(m.total_size for m, _ in manifests)
        done, checked = 0, set()
        for m, label in manifests:
            for i in range(m.num_chunks):
                d = m.chunk_digest(i)
                a, b = m.chunk_span(i)
                if d not in checked:
                    try:
                        size = self.blobs.verify(d)
                        if size != b - a:  # right hash, wrong size cannot happen; kept as a guard
                            problems.append(f"{label}: chunk {i} has {size} bytes, expected {b - a}")
                    except MissingBlobError:
                        problems.append(f"{label}: chunk {i} of {m.num_chunks} is missing")
                    except CorruptBlobError:
                        problems.append(f"{label}: chunk {i} of {m.num_chunks} was corrupt (removed)")
                    else:
                        checked.add(d)
                done += b - a
                if progress is not None:
                    progress(done, total)
        return problems
