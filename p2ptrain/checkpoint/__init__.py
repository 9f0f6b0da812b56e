"""Training state as verifiable bytes: flatten nested state to a msgpack skeleton plus raw
tensor bytes (``tree``), describe a snapshot by a content-addressed chunk manifest
(``manifest``), and serve / fetch snapshots from several peers at once (``transfer``).
"""

from .manifest import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_MAX_TOTAL,
    MAX_MANIFEST_BYTES,
    Manifest,
    ManifestError,
    StateTooLarge,
    TensorEntry,
    build_snapshot,
    restore,
)
from .transfer import (
    ChunksUnavailableError,
    FetchResult,
    NoProviderError,
    StateServer,
    StateTimeoutError,
    StateTransferError,
    fetch_state,
)
from .swarm import (
    CheckpointService,
    CheckpointUnavailable,
    announce,
    fetch_checkpoint,
    find_latest,
    find_providers,
)
from .cid import cid, parse_cid
from .record import CheckpointRecord, RecordError
from .store import (
    AmbiguousCheckpointError,
    BlobStore,
    CheckpointInfo,
    CheckpointNotFound,
    CheckpointStore,
    CorruptBlobError,
    GcResult,
    IncompleteCheckpointError,
    MissingBlobError,
    StoreError,
)
from .tree import TensorSpec, flatten, unflatten

__all__ = [
    "AmbiguousCheckpointError",
    "BlobStore",
    "CheckpointInfo",
    "CheckpointNotFound",
    "CheckpointRecord",
    "CheckpointStore",
    "CorruptBlobError",
    "GcResult",
    "IncompleteCheckpointError",
    "MissingBlobError",
    "RecordError",
    "StoreError",
    "cid",
    "parse_cid",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_MAX_TOTAL",
    "MAX_MANIFEST_BYTES",
    "CheckpointService",
    "CheckpointUnavailable",
    "ChunksUnavailableError",
    "FetchResult",
    "Manifest",
    "ManifestError",
    "NoProviderError",
    "StateServer",
    "StateTimeoutError",
    "StateTooLarge",
    "StateTransferError",
    "TensorEntry",
    "TensorSpec",
    "announce",
    "build_snapshot",
    "fetch_checkpoint",
    "fetch_state",
    "find_latest",
    "find_providers",
    "flatten",
    "restore",
    "unflatten",
]
