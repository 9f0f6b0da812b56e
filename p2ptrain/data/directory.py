"""Who holds which shards of a dataset, and who trains on it: the DHT entries. Sans-IO.

One key per dataset, ``data/<index hex>``, with one owner-signed sub-key per peer (the DHT
refuses writes to a sub-key by anyone but its owner). Its value: where to dial the peer (None
for a client-mode peer, which serves nothing), a bitmap of the shards it holds and serves, and
whether it trains on the dataset now (the live peers shards are assigned among). Peers that
fetch shards serve them too, so providers multiply as the swarm reads the data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dht import PeerID, pack

from ..checkpoint.directory import Address, parse_address, report_once

VERSION = 1
SUBKEY = "data"
#: a bitmap of MAX_SHARDS bits and an address fit well below this
MAX_ENTRY_BYTES = 4096


def dataset_key(dataset_id: bytes) -> str:
    return f"data/{dataset_id.hex()}"


def serve_key(manifest_id: bytes) -> str:
    """The state-server key a dataset's index or one of its shards is served under."""
    return f"data/{manifest_id.hex()}"


def id_of_serve_key(key: str) -> bytes | None:
    if not key.startswith("data/") or len(key) != 5 + 64:
        return None
    try:
        return bytes.fromhex(key[5:])
    except ValueError:
        return None


@dataclass(frozen=True)
class Member:
    """One peer's entry: where it is, which shards it serves, whether it trains."""

    peer: PeerID
    addr: Address | None
    held: frozenset[int]
    training: bool


def bitmap(held: list[bool]) -> bytes:
    out = bytearray(-(-len(held) // 8))
    for i, h in enumerate(held):
        if h:
            out[i // 8] |= 1 << (i % 8)
    return bytes(out)


def entry_value(addr: Address | None, held: list[bool], training: bool) -> dict[str, Any]:
    return {"v": VERSION, "a": list(addr) if addr is not None else None, "h": bitmap(held), "t": training}


def parse_entry(owner: PeerID, value: Any, num_shards: int) -> Member | None:
    """The member in ``owner``'s entry, or None (logged once) when it is malformed."""
    ok = isinstance(value, dict) and value.get("v") == VERSION and isinstance(value.get("h"), bytes) \
        and len(value["h"]) == -(-num_shards // 8) and isinstance(value.get("t"), bool)
    addr = parse_address(value.get("a")) if ok else False
    if addr is False:
        report_once(owner.short(), pack(value), "malformed dataset entry")
        return None
    bits = value["h"]
    held = frozenset(i for i in range(num_shards) if bits[i // 8] >> (i % 8) & 1)
    return Member(owner, addr, held, value["t"])  # type: ignore[arg-type]
