"""Immutable content-addressed files on disk: the blob layer under :class:`CheckpointStore`.

Why a layer of its own: every durable byte of a checkpoint (its chunks and its manifest) is a
file named by the blake3 of its contents, written once and never changed. This module owns the
three things that makes true: atomic writes (temp file, fsync, rename, directory fsync), reads
that verify the hash (a blob that fails is deleted, so a fetch can replace it), and the writers'
lock that ``gc`` takes exclusively. What a checkpoint *is* (records, pins, manifests) lives in
``store.py``.

Speed without losing durability: fsync is the cost of a save (one flush and journal commit per
call). :meth:`BlobStore.write_many` therefore writes every new blob of a batch in the calling
thread and hands each file to a small thread pool that fsyncs and renames it while the next one
is written (concurrent fsyncs share journal commits), then fsyncs every directory the batch
touched, once each. A blob is renamed to its name only after its own fsync, so a name on disk
always means complete bytes; the caller makes the batch visible (a record) only after
``write_many`` returns.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import blake3

from ..errors import P2PTrainError
from .manifest import DIGEST_SIZE

try:
    import fcntl
except ImportError:  # not POSIX: no cross-process lock; gc must not run beside a writer there
    fcntl = None  # type: ignore[assignment]

Progress = Callable[[int, int], None]
Bytes = bytes | bytearray | memoryview
_READ_PIECE = 1 << 20
_WRITE_PIECE = 64 << 20
#: threads that fsync (and rename) files while the caller writes the next ones; fsync waits on
#: the disk, not the CPU, so a few more than the cores pay off even on a 2-core machine
SYNC_THREADS = 4
#: files written but not yet fsynced and renamed, at most (bounds open descriptors and the
#: dirty page cache one batch builds up)
MAX_IN_FLIGHT = 32


class StoreError(P2PTrainError):
    """Base of the errors the store raises on purpose; the message is meant for a person."""


class CorruptBlobError(StoreError):
    """A blob's bytes do not match its hash (the bad file has been removed)."""


class MissingBlobError(StoreError):
    """A blob a checkpoint needs is not in the store (never fetched, or removed as corrupt)."""


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or create in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_digest(digest: bytes) -> bytes:
    """``digest`` as bytes; ValueError unless it is a blake3 digest (32 bytes)."""
    if not isinstance(digest, (bytes, bytearray)) or len(digest) != DIGEST_SIZE:
        raise ValueError(f"a blob digest is {DIGEST_SIZE} bytes")
    return bytes(digest)


def _byte_view(data: Bytes) -> memoryview:
    return memoryview(data).cast("B")


class BlobStore:
    """Immutable files ``root/blobs/<2 hex>/<62 hex>``, each named by the blake3 of its bytes.

    Writes are atomic (``root/tmp`` file, fsync, rename, directory fsync) and a no-op when the
    blob exists; reads verify the hash and delete a blob that fails."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)
        self.dir = self.root / "blobs"
        self.tmp = self.root / "tmp"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(exist_ok=True)
        self._lock_path = self.root / "lock"

    # ------------------------------------------------------------------ locking

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        if fcntl is None:
            yield
            return
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # releases the lock

    def shared(self) -> contextlib.AbstractContextManager[None]:
        """Held by every writer (many at once): gc waits until none writes."""
        return self._locked(False)

    def exclusive(self) -> contextlib.AbstractContextManager[None]:
        """Held by gc: no writer runs meanwhile (in any process)."""
        return self._locked(True)

    # ------------------------------------------------------------------ reading

    def path(self, digest: bytes) -> Path:
        h = check_digest(digest).hex()
        return self.dir / h[:2] / h[2:]

    def has(self, digest: bytes) -> bool:
        return self.path(digest).is_file()

    def size(self, digest: bytes) -> int | None:
        try:
            return self.path(digest).stat().st_size
        except FileNotFoundError:
            return None

    def read(self, digest: bytes) -> bytes:
        """The blob's bytes, verified; MissingBlobError / CorruptBlobError (file removed)."""
        p = self.path(digest)
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            raise MissingBlobError(f"blob {digest.hex()} is not in the store at {self.root}") from None
        if blake3.blake3(data).digest() != digest:
            self._discard(p, digest)
        return data

    def read_into(self, digest: bytes, out: memoryview) -> None:
        """Fill ``out`` (exactly the blob's size) with the blob's bytes, verified: one read
        straight into ``out``, then one hash of ``out`` while it is still in the CPU cache."""
        p = self.path(digest)
        try:
            f = open(p, "rb", buffering=0)
        except FileNotFoundError:
            raise MissingBlobError(f"blob {digest.hex()} is not in the store at {self.root}") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size != len(out):
                self._discard(p, digest, f"holds {size} bytes where {len(out)} were expected")
            pos = 0
            while pos < len(out):
                n = f.readinto(out[pos:])
                if not n:
                    self._discard(p, digest, "was truncated while being read")
                pos += n
        if blake3.blake3(out).digest() != digest:
            self._discard(p, digest)

    def read_many_into(self, items: Iterable[tuple[bytes, memoryview]], *, threads: int = 2,
                       on_done: Callable[[int], None] | None = None) -> None:
        """``read_into`` for many blobs, ``threads`` at a time (reads and blake3 both release
        the GIL, so two cores read and verify two chunks at once). ``on_done(i)`` after item
        ``i`` (in order, from the calling thread). The first failure is raised
        (as ``read_into`` raises it) with ``.index`` set to its position in ``items``."""
        items = list(items)

        def one(i: int) -> int:
            digest, out = items[i]
            try:
                self.read_into(digest, out)
            except StoreError as e:
                e.index = i  # type: ignore[attr-defined]
                raise
            return i

        if threads <= 1 or len(items) <= 1:
            for i in range(len(items)):
                one(i)
                if on_done is not None:
                    on_done(i)
            return
        with ThreadPoolExecutor(threads, thread_name_prefix="blob-read") as pool:
            pending: deque[Future[int]] = deque()
            try:
                for i in range(len(items)):
                    pending.append(pool.submit(one, i))
                    if len(pending) > 2 * threads:
                        i_done = pending.popleft().result()
                        if on_done is not None:
                            on_done(i_done)
                while pending:
                    i_done = pending.popleft().result()
                    if on_done is not None:
                        on_done(i_done)
            finally:
                for f in pending:
                    f.cancel()

    def verify(self, digest: bytes) -> int:
        """Hash the blob from disk in pieces (no full copy in memory); its size. Raises like read."""
        p = self.path(digest)
        h = blake3.blake3()
        try:
            with open(p, "rb") as f:
                while piece := f.read(_READ_PIECE):
                    h.update(piece)
                size = f.tell()
        except FileNotFoundError:
            raise MissingBlobError(f"blob {digest.hex()} is not in the store at {self.root}") from None
        if h.digest() != digest:
            self._discard(p, digest)
        return size

    def _discard(self, p: Path, digest: bytes, why: str = "does not match its blake3 digest") -> None:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
        raise CorruptBlobError(f"blob {digest.hex()} {why}; the corrupt file was removed")

    # ------------------------------------------------------------------ writing

    def write(self, data: Bytes, digest: bytes | None = None) -> bytes:
        """Store ``data`` (if not already there) and return its digest. When ``digest`` is given,
        ``data`` must hash to it (CorruptBlobError otherwise, nothing written). Durable on return."""
        with self.shared():
            digest, created_in = self.put(data, digest)
            if created_in is not None:
                fsync_dir(created_in)
        return digest

    def put(self, data: Bytes, digest: bytes | None) -> tuple[bytes, Path | None]:
        """``write`` without the lock or the directory fsync (the caller holds the shared lock
        and fsyncs the directory before anything points at the blob): returns the digest and the
        directory a new file was renamed into (None when the blob was already there)."""
        view = _byte_view(data)
        actual = blake3.blake3(view).digest()
        if digest is not None and actual != digest:
            raise CorruptBlobError(f"data does not match the expected blake3 digest {digest.hex()}")
        target = self.path(actual)
        if self._present(target, len(view)):
            return actual, None
        if not target.parent.is_dir():
            target.parent.mkdir(exist_ok=True)
            fsync_dir(self.dir)
        self.atomic_write(target, view)
        return actual, target.parent

    def write_many(self, blobs: Iterable[tuple[bytes, Bytes]], *, present: Iterable[bytes] = (),
                   progress: Progress | None = None) -> int:
        """Store every ``(digest, data)`` not already stored, durably, trusting the digests:
        the caller computed them from these very bytes (``build_snapshot`` hashes every chunk),
        so hashing again would only cost time. The caller holds the shared lock.

        Each new blob is written to a temp file in the calling thread, then fsynced and renamed
        into place by a small pool while the next is written; afterwards every directory holding
        one of the blobs (new or already there: another writer's rename may not be durable yet)
        is fsynced, once, as is that of every digest in ``present`` (blobs stored before without
        a directory fsync, like ``put``'s). Durable on return; nothing refers to the blobs yet, so a crash
        meanwhile leaves only unreferenced files and temp files, which gc removes.
        ``progress(bytes done, bytes total)`` as files are written. Returns the bytes written."""
        todo = [(check_digest(digest), _byte_view(data)) for digest, data in blobs]
        total = sum(len(v) for _, v in todo)
        dirs: set[Path] = {self.path(d).parent for d in present}
        seen: set[bytes] = set()  # a state may repeat a chunk (zeros): written once
        new_dirs = False
        written = done = 0
        with ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="blob-sync") as pool:
            in_flight: deque[Future[None]] = deque()
            for digest, view in todo:
                target = self.path(digest)
                dirs.add(target.parent)
                if digest not in seen and not self._present(target, len(view)):
                    if not target.parent.is_dir():
                        target.parent.mkdir(exist_ok=True)
                        new_dirs = True
                    fd, tmp = self._write_temp(view)
                    in_flight.append(pool.submit(self._sync_and_rename, fd, tmp, target))
                    written += len(view)
                    seen.add(digest)
                    while len(in_flight) > MAX_IN_FLIGHT:
                        in_flight.popleft().result()
                done += len(view)
                if progress is not None:
                    progress(done, total)
            while in_flight:  # (after an error, leaving the pool waits for the files in flight)
                in_flight.popleft().result()
            if new_dirs:
                dirs.add(self.dir)
            for f in [pool.submit(fsync_dir, d) for d in dirs]:
                f.result()
        return written

    @staticmethod
    def _present(target: Path, size: int) -> bool:
        try:
            return target.stat().st_size == size  # a wrong size is rot: write it anew
        except FileNotFoundError:
            return False

    def _write_temp(self, view: memoryview) -> tuple[int, Path]:
        """A new temp file in ``tmp/`` holding ``view``, written from it without a copy; returns
        its open descriptor (the caller fsyncs and closes it) and its path."""
        tmp = self.tmp / f"{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            pos = 0
            while pos < len(view):
                pos += os.write(fd, view[pos : pos + _WRITE_PIECE])
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        return fd, tmp

    @staticmethod
    def _sync_and_rename(fd: int, tmp: Path, target: Path) -> None:
        """fsync and close ``fd``, then rename ``tmp`` to ``target`` (only complete bytes ever
        get a blob's name); the temp file is removed when any step fails."""
        try:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise

    def atomic_write(self, target: Path, data: Bytes) -> None:
        """``target`` := ``data`` through a temp file in ``tmp/``: write, fsync, rename. The
        caller fsyncs ``target``'s directory (once for many files)."""
        fd, tmp = self._write_temp(_byte_view(data))
        self._sync_and_rename(fd, tmp, target)

    def digests(self) -> Iterator[tuple[bytes, Path]]:
        """Every blob on disk (names that are not digests are skipped)."""
        with os.scandir(self.dir) as subdirs:
            for sub in subdirs:
                if len(sub.name) != 2 or not sub.is_dir(follow_symlinks=False):
                    continue
                with os.scandir(sub.path) as files:
                    for f in files:
                        try:
                            digest = bytes.fromhex(sub.name + f.name)
                        except ValueError:
                            continue
                        if len(digest) == DIGEST_SIZE:
                            yield digest, Path(f.path)


__all__ = ["BlobStore", "CorruptBlobError", "MissingBlobError", "StoreError", "check_digest", "fsync_dir"]
