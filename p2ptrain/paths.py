"""Where p2ptrain keeps its files by default: one module with no heavy imports, so that the
checkpoint store (which needs torch) and the light commands (``p2ptrain dht``) agree on it."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_data_dir"]


def default_data_dir() -> Path:
    """``$P2PTRAIN_DATA_DIR``, else ``$XDG_CACHE_HOME/p2ptrain``, else ``~/.cache/p2ptrain``."""
    env = os.environ.get("P2PTRAIN_DATA_DIR")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME")
    return (Path(cache).expanduser() if cache else Path.home() / ".cache") / "p2ptrain"
