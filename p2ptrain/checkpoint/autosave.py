"""Periodic checkpoints of a trainer's shared state, and resuming from the newest one.

Why a trainer needs this even though peers share live state: when every peer stops at once (a
whole swarm restarted, a power cut) the live state is gone; only what was written to disk remains.
So every ``every`` global epochs a few peers -- not all: the state is identical on every member of
a group, and N copies of each checkpoint on N disks buy nothing -- save it to their
:class:`~p2ptrain.checkpoint.store.CheckpointStore`, announce it in the DHT and serve it. Which
peers is decided without coordination: each peer ranks the live peers it sees by
``blake3(peer_id || epoch)`` and saves if it is among the ``writers`` lowest. Views differ a
little between peers, so sometimes one more or one fewer peer saves; the ranking changes with the
epoch, so the disk cost rotates through the swarm.

The save never blocks training: the copy is taken in a worker thread under the trainer's lock
(which the training thread holds only while it changes parameters), the hashing and writing
happen after the lock is released. A peer that starts with no live peer ahead of it loads the
newest checkpoint it can find, in its own store or in the DHT: there only a checkpoint that three
distinct writers (its three savers) agree on, or that a trusted writer or this peer signed
(``trust``), never one peer's claim alone; it is fetched from its providers.

``choose_writers`` is the sans-IO policy; :class:`Checkpointer` is the shell a trainer owns.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import blake3

from dht import DHTError, DHTNode, InvalidRecord, PeerID

from ..errors import P2PTrainError
from .errors import StateTooLargeError, StateTransferError
from .manifest import ManifestError, build_snapshot, restore
from .record import CheckpointRecord
from .state_server import StateServer
from .swarm import CheckpointService, fetch_checkpoint, latest_verdict
from .trust import parse_writers

if TYPE_CHECKING:
    from ..loop import LoopThread
    from .info import CheckpointInfo
    from .store import CheckpointStore

log = logging.getLogger("p2ptrain.checkpoint")
#: seconds between looks for a provider of the run's latest checkpoint while none serves it (doubling)
_RETRY_FIRST, _RETRY_MAX = 0.5, 4.0


class _MovedOn(P2PTrainError):
    """A queued save found the state past the epoch it was due for (args: the state's epoch)."""


def choose_writers(peers: Iterable[PeerID], epoch: int, writers: int) -> list[PeerID]:
    """The ``writers`` peers that save the checkpoint of ``epoch``: the lowest
    ``blake3(peer id bytes || epoch as 8 bytes)``. Every peer computes it alone from the peers it
    sees; the same view gives the same answer everywhere, and the choice rotates with the epoch."""
    salt = int(epoch).to_bytes(8, "big", signed=True)
    ranked = sorted(set(peers), key=lambda p: blake3.blake3(p.to_bytes() + salt).digest())
    return ranked[: max(0, writers)]


class Checkpointer:
    """Saves a trainer's shared state every ``every`` epochs (when chosen), keeps the newest
    ``keep`` per run in ``store``, serves and announces them, and finds one to resume from.

    ``server``: the host's StateServer (a trainer's StateSync runs one); checkpoints are served
    by it next to the live state. ``meta``: what must match for a checkpoint to load into this
    trainer (mode, schema hash), stored in each manifest. ``labels``: stored in each manifest
    too, never checked (the model's state_dict names, see :mod:`.export`). ``on_saved(info)``:
    called from the save thread after each checkpoint this peer wrote. ``trusted_writers``:
    PeerIDs (or their strings) whose one record makes a checkpoint in the DHT the run's latest;
    any other needs three distinct writers agreeing (``trust.QUORUM``).
    """

    def __init__(self, node: DHTNode, loop: LoopThread, run_id: str, store: CheckpointStore, *,
                 every: int | None, server: StateServer, meta: dict[str, Any], keep: int = 3, writers: int = 3,
                 ttl: float = 300.0, on_saved: Callable[[CheckpointInfo], None] | None = None,
                 labels: dict[str, Any] | None = None, trusted_writers: Collection[PeerID | str] = ()):
        if every is not None and (type(every) is not int or every < 1):
            raise ValueError(f"checkpoint_every must be a positive number of epochs, got {every!r}")
        if type(keep) is not int or keep < 1:
            raise ValueError(f"checkpoint_keep must be at least 1, got {keep!r}")
        if type(writers) is not int or writers < 1:
            raise ValueError(f"checkpoint_writers must be at least 1, got {writers!r}")
        self.node = node
        self.loop = loop
        self.run_id = run_id
        self.store = store
        self.every = every
        self.keep = keep
        self.writers = writers
        self.meta = dict(meta)
        self.labels = dict(labels or {})
        try:
            self.trusted = parse_writers(trusted_writers)
        except ValueError as e:
            raise ValueError(f"trusted_writers: {e}") from None
        self.service = CheckpointService(node, store, run_id=run_id, server=server, ttl=ttl)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._future: concurrent.futures.Future | None = None
        self._last_epoch: int | None = None
        self.saved = 0  # checkpoints this peer wrote
        self.last_saved: CheckpointInfo | None = None
        self.skipped = 0  # due checkpoints dropped: the state moved past their epoch before the disk was free
        self._queued: concurrent.futures.Future | None = None  # the one due save waiting for the one in flight
        self._on_saved = on_saved  # called in the save thread

    async def start(self) -> None:
        await self.service.start()

    async def close(self) -> None:
        await self.service.close()

    def flush(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Wait until the checkpoint being written (if any) is on disk; returns it (None when
        nothing was in flight or the save failed or was skipped). TimeoutError after ``timeout`` seconds."""
        future = self._future
        if future is None:
            return None
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"the checkpoint save did not finish within {timeout} s") from None

    def wait(self, timeout: float | None = None) -> None:
        """Let a save in flight finish (bounded), then stop the save thread. A save cut short
        leaves nothing visible (the store writes its record last)."""
        try:
            self.flush(timeout)
        except TimeoutError:
            log.warning("a checkpoint save was still running at close; it is abandoned (nothing half-written "
                        "becomes visible)")
        self._future = self._queued = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    # ------------------------------------------------------------------ saving

    def due(self, epoch: int) -> bool:
        return self.every is not None and epoch > 0 and epoch % self.every == 0 and epoch != self._last_epoch

    def maybe_save(self, epoch: int, peers: Iterable[PeerID], state: Callable[[], tuple[int, Any]],
                   lock: AbstractContextManager[Any]) -> bool:
        """From the training thread, after the update of ``epoch`` was applied: start saving
        ``state()`` (read with ``lock`` held, in a worker thread) if the checkpoint is due and
        this peer is one of its writers among ``peers``. Returns whether a save started (or waits
        for the one in flight)."""
        if not self.due(epoch):
            return False
        self._last_epoch = epoch
        if self.node.peer_id not in choose_writers([*peers, self.node.peer_id], epoch, self.writers):
            return False
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="p2ptrain-ckpt")
        # While a save is in flight the newest due one waits behind it (one, not a queue of copies
        # of the state): it reads the state when the disk is free, if that is still this epoch's.
        if self._queued is not None and self._queued.cancel():
            self.skipped += 1
        busy = self._future is not None and not self._future.done()
        self._future = self._executor.submit(self._save, state, lock, epoch if busy else None)
        self._queued = self._future if busy else None
        return True

    def _save(self, state: Callable[[], tuple[int, Any]], lock: AbstractContextManager[Any],
              due: int | None = None) -> CheckpointInfo | None:
        """Snapshot ``state()`` and write it; ``due``: give up (counted in ``skipped``) when the
        state's epoch is no longer that one (a save that waited for the previous one)."""
        seen: dict[str, int] = {}

        def read() -> Any:  # called by build_snapshot with the lock held
            epoch, obj = state()
            if due is not None and epoch != due:
                raise _MovedOn(epoch)
            seen["epoch"] = epoch
            return obj

        try:
            manifest, buffer = build_snapshot(read, lock=lock)
            epoch = seen["epoch"]
            manifest = dataclasses.replace(manifest, meta={**self.labels, **self.meta, "epoch": epoch})
            info = self.store.save(manifest, buffer, run_id=self.run_id, epoch=epoch, identity=self.node.identity)
            del buffer
            gc = self.store.gc(self.keep)
        except _MovedOn as e:
            self.skipped += 1
            log.info("skipped the checkpoint of epoch %d: the previous save ended after the state reached epoch %d",
                     due, e.args[0])
            return None
        except Exception as e:  # noqa: BLE001 - a failed save (disk full, ...) must not stop training
            log.warning("could not save a checkpoint: %s: %s", type(e).__name__, e)
            return None
        self.saved += 1
        self.last_saved = info
        log.info("saved checkpoint %s (epoch %d, %.1f MB) in %s; %d older removed", info.cid, epoch,
                 manifest.total_size / 1e6, self.store.root, len(gc.removed))
        self.service.announce_soon(info)
        if self._on_saved is not None:
            self._on_saved(info)
        return info

    # ------------------------------------------------------------------ resuming

    def find(self, timeout: float, at_least: int = 0) -> CheckpointInfo | None:
        """The newest checkpoint of the run, in our store or believed in the DHT (``trust``: agreed
        by three writers, or signed by a trusted writer or by us), in our store on return (fetched
        from its providers if need be, waiting up to ``timeout`` for one to serve it; when that
        fails, our own newest one). One in the DHT older
        than epoch ``at_least`` is not fetched (live peers have a newer state). Our store is our
        own evidence: what is there we saved, or fetched as believed or by its id. Blocking: call
        it from the training thread."""
        local = self.store.latest(self.run_id)
        try:
            verdict = self.loop.run(latest_verdict(self.node, self.run_id, trusted=self.trusted),
                                    timeout=min(timeout, 30.0))
        except (DHTError, InvalidRecord, OSError, TimeoutError) as e:
            log.warning("could not look up the run's latest checkpoint in the DHT: %s", e)
            verdict = None
        if verdict is None or verdict.chosen is None:
            return local
        remote = verdict.chosen.record
        if remote.epoch < at_least or (local is not None and not remote.newer_than(local.record)):
            return local
        held = [i for i in self.store.list(self.run_id) if i.manifest_id == remote.manifest_id]
        if held:
            return held[0]
        log.info("the run's latest checkpoint is %s (%s)", verdict.chosen.describe(), verdict.basis)
        deadline = time.monotonic() + timeout
        delay = _RETRY_FIRST
        while True:
            try:
                info = self.loop.run(fetch_checkpoint(self.node, self.store, run_id=self.run_id,
                                                      manifest_id=remote.manifest_id,
                                                      timeout=max(1.0, deadline - time.monotonic())))
                break
            except (StateTransferError, DHTError, OSError) as e:
                # a swarm restarting: its writers may come up a little after us; wait for one,
                # since resuming from an older checkpoint would split the swarm
                if not isinstance(e, StateTooLargeError) and time.monotonic() + delay < deadline:
                    if delay == _RETRY_FIRST:
                        log.info("waiting up to %.0f s for a provider of the run's latest checkpoint (epoch %d): %s",
                                 deadline - time.monotonic(), remote.epoch, e)
                    time.sleep(delay)  # a poll of the DHT for providers, from the training thread
                    delay = min(2 * delay, _RETRY_MAX)
                    continue
                error: Exception = e
            except (ManifestError, ValueError) as e:
                error = e
            where = f"our own of epoch {local.epoch}" if local is not None else "none"
            log.warning("could not fetch the run's latest checkpoint (epoch %d, %s): %s; resuming from %s",
                        remote.epoch, remote.manifest_id.hex()[:12], error, where)
            return local
        log.info("fetched the run's latest checkpoint %s (epoch %d) from the swarm", info.cid, info.epoch)
        return info

    def endorse(self, info: CheckpointInfo) -> None:
        """Sign our own record of ``info`` (we hold and verified every chunk of it) and announce
        it as our latest: a swarm restarted with new identities would otherwise find no "latest"
        record in the DHT at all, since only a record's writer may publish it. Best effort."""
        if info.record.writer == self.node.peer_id:
            return
        try:
            record = CheckpointRecord.sign(self.node.identity, run_id=info.run_id, epoch=info.epoch,
                                           manifest_id=info.manifest_id, size=info.size)
            mine = self.store.commit(self.store.manifest(info.manifest_id), record)
        except Exception as e:  # noqa: BLE001 - the checkpoint is loaded; announcing it is a bonus
            log.warning("could not endorse checkpoint %s: %s", info.cid, e)
            return
        self.service.announce_soon(mine)

    def load(self, info: CheckpointInfo) -> Any:
        """The state saved in ``info`` (tensors are views of one buffer read from disk, every
        chunk verified); ValueError when it was saved by an incompatible trainer."""
        manifest, buffer = self.store.load(info.manifest_id)
        for key, want in self.meta.items():
            got = manifest.meta.get(key)
            if got != want:
                raise ValueError(f"checkpoint {info.cid} was saved with {key} {got!r}, this trainer has {want!r}")
        return restore(manifest, buffer)

