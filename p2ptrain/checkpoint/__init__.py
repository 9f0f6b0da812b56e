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
from .tree import TensorSpec, flatten, unflatten

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_MAX_TOTAL",
    "MAX_MANIFEST_BYTES",
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
    "build_snapshot",
    "fetch_state",
    "flatten",
    "restore",
    "unflatten",
]
