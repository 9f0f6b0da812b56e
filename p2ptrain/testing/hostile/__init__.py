"""Hostile peers for tests and benchmarks: every attack of ``docs/threat-model.md`` as a named mode.

One entry point, :data:`MODES` (name -> :class:`Mode`), whose attacks live in one submodule per
layer: ``records`` (DHT records, storage, routing, relay), ``streams`` (frames and streams),
``checkpoints`` (checkpoint records), ``shards`` (averaging rounds), ``receipts`` (contribution
receipts), ``state`` (progress and training state). They are ordinary peers of the run, with valid
keys and signatures: what they abuse is what the protocol would believe, not the parsing of bytes
(see ``tests/test_fuzz_handlers``).
"""

from __future__ import annotations

from ._registry import MODES, Mode, mode
from . import checkpoints, receipts, records, shards, state, streams  # noqa: F401  (each registers its modes)

__all__ = ["MODES", "Mode", "mode"]
