"""The root of p2ptrain's exceptions: every exception class p2ptrain defines derives from
``P2PTrainError`` (keeping its other bases, e.g. ``ValueError``), so ``except P2PTrainError`` catches
all of them. The dht package has its own root, ``dht.errors.DHTError``."""

from __future__ import annotations


class P2PTrainError(Exception):
    """Base class of every exception p2ptrain defines."""
