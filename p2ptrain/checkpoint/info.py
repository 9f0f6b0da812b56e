"""What the checkpoint store hands out about its checkpoints: their records' summary, what gc did,
and the store's errors (beside ``blobs``' own)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dht import PeerID

from ..errors import P2PTrainError
from .blobs import StoreError
from .cid import cid as make_cid
from .record import CheckpointRecord


class IncompleteCheckpointError(StoreError):
    """``commit`` was called before every chunk of the manifest was stored."""


class AmbiguousCheckpointError(P2PTrainError, ValueError):
    """A prefix matches more than one checkpoint."""


class CheckpointNotFound(P2PTrainError, KeyError):
    """No checkpoint of that id (or prefix) in the store."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0]) if self.args else "checkpoint not found"


# ---------------------------------------------------------------------------- checkpoints


@dataclass(frozen=True)
class CheckpointInfo:
    """One stored checkpoint: its signed record and whether it is pinned."""

    record: CheckpointRecord
    pinned: bool = False

    @property
    def manifest_id(self) -> bytes:
        return self.record.manifest_id

    @property
    def cid(self) -> str:
        return make_cid(self.record.manifest_id)

    @property
    def run_id(self) -> str:
        return self.record.run_id

    @property
    def epoch(self) -> int:
        return self.record.epoch

    @property
    def size(self) -> int:
        return self.record.size

    @property
    def created(self) -> float:
        return self.record.created

    @property
    def writer(self) -> PeerID:
        return self.record.writer


@dataclass
class GcResult:
    """What ``gc`` did."""

    kept: list[CheckpointInfo] = field(default_factory=list)
    removed: list[CheckpointInfo] = field(default_factory=list)
    blobs_removed: int = 0
    bytes_freed: int = 0
    temp_removed: int = 0
    bad_refs_removed: int = 0
    pending_removed: int = 0
    #: why blobs were not swept (a kept checkpoint whose manifest cannot be read: its chunks
    #: cannot be told apart from garbage, so none is deleted until ``verify`` is looked at)
    problems: list[str] = field(default_factory=list)


def sort_newest_first(infos: list[CheckpointInfo]) -> list[CheckpointInfo]:
    return sorted(infos, key=lambda i: i.record._order(), reverse=True)
