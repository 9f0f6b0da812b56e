"""A standalone Kademlia DHT over authenticated, encrypted asyncio connections.

Knows nothing of torch or training. Layers, each depending only on the ones before it:
identity/multiaddr -> wire/noise -> transport/stream -> relay (circuits through a public peer)
-> routing/storage -> node.
"""

from .config import DHTConfig
from .connection import Connection
from .errors import (
    BootstrapError,
    ConfigError,
    DHTError,
    HandshakeError,
    InvalidRecord,
    MultiaddrError,
    PeerIdMismatch,
    PeerUnreachable,
    ProtocolError,
    RPCError,
    RPCTimeout,
)
from .identity import Identity, PeerID
from .limits import Limits
from .lookup import LookupResult, ValueWithExpiration
from .multiaddr import Multiaddr
from .node import BootstrapRefused, DHTNode
from .noise import SwarmKeyMismatch
from .relay import CircuitLimit, RelayRefused, RelayService
from .swarmkey import SwarmKey
from .tasks import TaskGroup
from .transport import Host

__all__ = [
    "BootstrapError",
    "BootstrapRefused",
    "CircuitLimit",
    "ConfigError",
    "Connection",
    "DHTConfig",
    "DHTError",
    "DHTNode",
    "HandshakeError",
    "Host",
    "Identity",
    "InvalidRecord",
    "Limits",
    "LookupResult",
    "Multiaddr",
    "MultiaddrError",
    "PeerID",
    "PeerIdMismatch",
    "PeerUnreachable",
    "ProtocolError",
    "RPCError",
    "RPCTimeout",
    "RelayRefused",
    "RelayService",
    "SwarmKey",
    "SwarmKeyMismatch",
    "TaskGroup",
    "ValueWithExpiration",
]
