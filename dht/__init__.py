"""A standalone Kademlia DHT over authenticated, encrypted asyncio connections.

Knows nothing of torch or training. Layers, each depending only on the ones before it:
identity/multiaddr -> wire/noise -> transport/stream -> relay (circuits through a public peer)
-> routing/storage -> node.

Besides the DHT it exports what code built on it shares: byte streams and their msgpack framing
(``Stream``, ``pack``/``unpack``, the size limits) and a few asyncio/OS helpers (``TaskGroup``,
``cancel_all``, ``wait_event``, ``LogThrottle``, ``usable_cpus``). Users import from here only.
"""

from .aio import cancel_all, wait_event
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
from .holepunch import PunchStats, punch_stats
from .identity import Identity, PeerID
from .limits import Limits, LogThrottle
from .lookup import LookupResult, ValueWithExpiration
from .multiaddr import MAX_CIRCUITS, Multiaddr, parse_circuits
from .node import BootstrapRefused, DHTNode
from .noise import SwarmKeyMismatch
from .owned import OwnedRead, OwnedValue
from .peercache import default_cache_name
from .relay import CircuitLimit, RelayRefused, RelayService, relayed_via
from .routing import Contact
from .sealer import usable_cpus
from .stream import Stream, StreamReset
from .swarmkey import SwarmKey, load_swarm_key
from .tasks import TaskGroup
from .transport import Host
from .wire import MAX_FRAME_BODY, MAX_MESSAGE, pack, unpack

__all__ = [
    "BootstrapError",
    "BootstrapRefused",
    "CircuitLimit",
    "ConfigError",
    "Connection",
    "Contact",
    "DHTConfig",
    "DHTError",
    "DHTNode",
    "HandshakeError",
    "Host",
    "Identity",
    "InvalidRecord",
    "Limits",
    "LogThrottle",
    "LookupResult",
    "MAX_CIRCUITS",
    "MAX_FRAME_BODY",
    "MAX_MESSAGE",
    "Multiaddr",
    "MultiaddrError",
    "OwnedRead",
    "OwnedValue",
    "PeerID",
    "PeerIdMismatch",
    "PeerUnreachable",
    "ProtocolError",
    "PunchStats",
    "RPCError",
    "RPCTimeout",
    "RelayRefused",
    "RelayService",
    "Stream",
    "StreamReset",
    "SwarmKey",
    "SwarmKeyMismatch",
    "TaskGroup",
    "ValueWithExpiration",
    "cancel_all",
    "default_cache_name",
    "load_swarm_key",
    "pack",
    "punch_stats",
    "relayed_via",
    "parse_circuits",
    "unpack",
    "usable_cpus",
    "wait_event",
]
