"""DHTConfig: the tunables of a DHT node (replication, timeouts, periods, storage bounds)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .peercache import MAX_PEERS


@dataclass
class DHTConfig:
    k: int = 20
    alpha: int = 3
    rpc_timeout: float = 2.0
    #: a lookup also asks the next contact once a query runs past its peer's adaptive timeout
    #: (from measured round trips, ``dht.latency``): never sooner than this, nor later than rpc_timeout
    hedge_floor: float = 0.05
    #: a latest read waits for the nearest this many of a key's k closest (None: half of k, rounded
    #: up): a write reaching more than k - read_quorum of them, or the nearest ones, is seen
    read_quorum: int | None = None
    bootstrap_timeout: float = 10.0
    refresh_interval: float = 600.0  # buckets not looked up for this long get a random lookup
    republish_interval: float = 600.0  # stored records are re-replicated to the k closest this often
    maintenance_period: float = 5.0
    max_value_size: int = 64 * 1024
    max_records: int = 100_000
    max_records_per_source: int = 2_000
    #: bytes the store may hold (records' sizes plus ``quota.RECORD_OVERHEAD`` each), in all and
    #: per source peer; when full, who loses what is decided per address group (``dht.quota``)
    max_bytes: int = 128 << 20
    max_bytes_per_source: int = 16 << 20
    max_ttl: float = 86_400.0
    #: a file where the node keeps the addresses of peers it recently talked to (see
    #: ``dht.peercache``), dialed when every bootstrap address fails; None (the default): no cache
    peer_cache: str | Path | None = None
    peer_cache_size: int = MAX_PEERS
    peer_cache_interval: float = 30.0  # at most one rewrite this often (and one on close)
    #: relays a node that is not reachable (``DHTNode(reachable=False)``) reserves a slot at,
    #: chosen among the public peers of its routing table
    relays: int = 2

    @property
    def read_window(self) -> int:
        """How many of a key's closest peers a latest read asks and waits for (``read_quorum``)."""
        return min(self.k, self.read_quorum or -(-self.k // 2))
