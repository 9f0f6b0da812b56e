"""How fetching state from peers fails: one base class, ``StateTransferError``, whose
messages name the key, the manifest and what went wrong."""

from __future__ import annotations

from ..errors import P2PTrainError


class StateTransferError(P2PTrainError):
    """Fetching state failed; the message names the key, the manifest and what went wrong."""


class NoProviderError(StateTransferError):
    """No reachable provider holds the requested state (or a valid manifest for it)."""


class StateTooLargeError(NoProviderError):
    """The state offered is larger than the fetch expects (``max_total``): refused before allocating it."""


class ChunksUnavailableError(StateTransferError):
    """Every provider of the chosen manifest failed before all chunks were verified."""


class StateTimeoutError(StateTransferError, TimeoutError):
    """The fetch did not finish within its timeout."""


class CorruptReply(P2PTrainError):
    """A provider sent bytes that fail verification or break the protocol (the fetch drops it;
    never raised to the caller)."""
