"""Datasets as content-addressed blobs: cut files into shards in the checkpoint blob store, sign
an index (its CID names the dataset), and read them from the swarm (``SwarmDataset``), each
peer the shards rendezvous hashing gives it per epoch. ``records`` documents the formats.

Names are imported on first use: the store commands should not wait for torch's import.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY: dict[str, str] = {
    **dict.fromkeys(("DatasetError", "DatasetIndex", "ShardRef"), "index"),
    "DataStore": "store",
    **dict.fromkeys(("DataService", "DataUnavailable", "fetch_index", "fetch_shard", "members"), "swarm"),
    "SwarmDataset": "dataset",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
