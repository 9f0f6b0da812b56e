"""Owner-signed entries: under one key, one value per peer, each under its owner's own sub-key
(``DHTNode.owned``), so that no peer can write, erase or speak for another's. Sans-IO:
``owned_values`` picks each owner's value out of the records a read found."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from .errors import InvalidRecord, ProtocolError
from .identity import PeerID
from .routing import Contact
from .storage import Record, VerifiedOwners, owned_name
from .wire import unpack


class OwnedValue(NamedTuple):
    value: Any
    expiration: float


@dataclass
class OwnedRead:
    """What ``DHTNode.get_owned`` found: each peer's value, and the key's holders as this read saw
    them (to read from again, or to ``store_owned`` to without a lookup)."""

    values: dict[PeerID, OwnedValue]
    closest: list[Contact]


def owned_values(records: Iterable[Record], name: str, owners: VerifiedOwners,
                 max_size: int) -> dict[PeerID, OwnedValue]:
    """Each owner's value under its own ``name`` sub-key among ``records`` (of one key): of its
    records, the latest to expire that is signed by it and decodes. Left out: plain values,
    sub-keys not their owner's own ``name``, values over ``max_size`` bytes or not msgpack."""
    by_subkey: dict[bytes, list[Record]] = {}
    for record in records:
        if record.subkey is not None and len(record.value) <= max_size:
            by_subkey.setdefault(record.subkey, []).append(record)
    base, out = name.encode(), {}
    for subkey, found in by_subkey.items():
        found.sort(key=lambda r: r.expiration, reverse=True)
        for record in found:
            try:
                owner = owners.owner(record)
            except InvalidRecord:
                continue
            if owner is None or subkey != owned_name(base, owner):
                break  # not an owner's own ``name`` sub-key (the same for each record of it)
            try:
                out[owner] = OwnedValue(unpack(record.value, max_size), record.expiration)
                break
            except ProtocolError:
                continue
    return out
