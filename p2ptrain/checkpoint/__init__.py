"""Training state as verifiable bytes: flatten nested state to a msgpack skeleton plus raw
tensor bytes (``tree``), describe a snapshot by a content-addressed chunk manifest
(``manifest``), and serve / fetch snapshots from several peers at once (``state_server``, ``fetch``).

The names below are imported on first use (PEP 562), not with the package: most of its modules
need torch (~2 s to import), and the ``p2ptrain ckpt`` commands that only read the store
(``ls``, ``show``, ``verify``, ``gc``, ``pin``) should not wait for it.
"""

from __future__ import annotations

import importlib
from typing import Any

from .cid import cid, parse_cid  # torch-free, and the function must shadow its submodule's name
from .record import CheckpointRecord, RecordError

#: public name -> the submodule that defines it, imported on first use
_LAZY: dict[str, str] = {
    "CheckpointStore": "store",
    **dict.fromkeys(("BlobStore", "CorruptBlobError", "MissingBlobError", "StoreError"), "blobs"),
    **dict.fromkeys(("AmbiguousCheckpointError", "CheckpointInfo", "CheckpointNotFound", "GcResult",
                     "IncompleteCheckpointError"), "info"),
    **dict.fromkeys(("DEFAULT_CHUNK_SIZE", "DEFAULT_MAX_TOTAL", "MAX_MANIFEST_BYTES", "Manifest", "ManifestError",
                     "StateTooLarge", "TensorEntry", "build_snapshot", "restore"), "manifest"),
    **dict.fromkeys(("CheckpointService", "CheckpointUnavailable", "announce", "fetch_checkpoint", "find_latest",
                     "find_providers"), "swarm"),
    **dict.fromkeys(("ChunksUnavailableError", "NoProviderError", "StateTimeoutError", "StateTooLargeError",
                     "StateTransferError"), "errors"),
    **dict.fromkeys(("FetchResult", "fetch_state"), "fetch"),
    "StateServer": "state_server",
    **dict.fromkeys(("TensorSpec", "flatten", "unflatten"), "tree"),
}

__all__ = ["cid", "parse_cid", "CheckpointRecord", "RecordError", *_LAZY]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
