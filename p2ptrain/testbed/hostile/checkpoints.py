"""Hostile peers: checkpoints attacks (see the package docstring)."""

from __future__ import annotations

from ._registry import mode  # noqa: F401
