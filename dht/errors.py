"""Exceptions of the dht package.

Each one carries a message meant for a person: what went wrong and, where it helps, what to do.
The CLI prints ``str(error)`` on one line and exits non-zero; it never shows a traceback for these.
"""


class DHTError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(DHTError):
    """Bad user input: a malformed multiaddr, an unreadable key file, a bad option value."""


class MultiaddrError(ConfigError, ValueError):
    """A multiaddr that cannot be parsed; the message names the offending part."""


class ProtocolError(DHTError):
    """A peer sent bytes that break the wire protocol; the connection to it is closed."""


class HandshakeError(ProtocolError):
    """The secure handshake failed: wrong peer, bad signature, or garbage instead of a handshake."""


class PeerIdMismatch(HandshakeError):
    """The peer at the dialed address proved a different identity than the ``/p2p/`` id asked for:
    another peer lives there now (or the address is wrong). Retrying the same address cannot help."""


class PeerUnreachable(DHTError):
    """A dial failed: refused, timed out, or the peer closed the connection."""


class RPCError(DHTError):
    """The remote handler raised or rejected the request; the message is the remote's reason."""


class RPCTimeout(DHTError, TimeoutError):
    """No answer within the call's deadline."""


class BootstrapError(DHTError):
    """None of the bootstrap peers could be reached within the bounded wait."""


class InvalidRecord(DHTError):
    """A DHT record failed validation (size, expiry, ownership, signature)."""
