"""DHT records, their validation, and the bounded in-memory store, with no I/O.

A key holds either one plain value or a dictionary of sub-keys, each with its own expiration: a
group of peers can then share one key (say, a matchmaking round) where every member writes and
refreshes its own entry without clobbering the others.

Records are validated on every write because they come from untrusted peers. A name carrying an
``[owner:<PeerID>]`` marker may only be written by that peer, proven by an Ed25519 signature; since
a PeerID embeds its public key, any node can check that without a key server.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import msgpack

from .errors import InvalidRecord
from .identity import Identity, PeerID

_SIGNING_DOMAIN = b"p2ptrain-dht-record-v1"
_OWNER_MARKER = re.compile(rb"\[owner:([^\]]*)\]")


@dataclass(frozen=True)
class Record:
    """A value under ``key`` (``subkey`` None) or under one sub-key of ``key``."""

    key: bytes
    subkey: bytes | None
    value: bytes
    expiration: float
    signature: bytes | None = None

    def to_wire(self) -> list:
        return [self.key, self.subkey, self.value, self.expiration, self.signature]

    @classmethod
    def from_wire(cls, obj: object) -> Record:
        """Parse a decoded msgpack object, checking the schema strictly (it came off the network)."""
        if not isinstance(obj, (list, tuple)) or len(obj) != 5:
            raise InvalidRecord(
                "a record must be a list of 5 items [key, subkey, value, expiration, signature]"
            )
        key, subkey, value, expiration, signature = obj
        if not isinstance(key, bytes):
            raise InvalidRecord("record key must be bytes")
        if subkey is not None and not isinstance(subkey, bytes):
            raise InvalidRecord("record subkey must be bytes or nil")
        if not isinstance(value, bytes):
            raise InvalidRecord("record value must be bytes")
        if isinstance(expiration, bool) or not isinstance(expiration, (int, float)):
            raise InvalidRecord("record expiration must be a number")
        if not math.isfinite(expiration) or abs(expiration) > 2**53:
            raise InvalidRecord("record expiration must be a finite timestamp")
        if signature is not None and not isinstance(signature, bytes):
            raise InvalidRecord("record signature must be bytes or nil")
        return cls(key, subkey, value, float(expiration), signature)


def owned_name(base: bytes, peer: PeerID) -> bytes:
    """``base`` with an owner marker appended: only ``peer`` may then write under this name."""
    return base + b"[owner:" + peer.to_base58().encode("ascii") + b"]"


def owner_of(name: bytes | None) -> PeerID | None:
    """The peer named by ``name``'s owner marker, None when there is none.

    A malformed marker, or markers naming two peers, raise InvalidRecord rather than reading as
    "not owned": otherwise a typo in an owned name would silently make it writable by anyone.
    """
    if name is None:
        return None
    owners = set()
    for match in _OWNER_MARKER.finditer(name):
        try:
            owners.add(PeerID.from_base58(match.group(1).decode("ascii")))
        except ValueError:  # covers UnicodeDecodeError too
            raise InvalidRecord(f"malformed owner marker in {name!r}") from None
    if len(owners) > 1:
        raise InvalidRecord(f"name {name!r} names more than one owner")
    return owners.pop() if owners else None


def signing_payload(record: Record) -> bytes:
    """The bytes an owner signs; domain-separated so the signature is useless in other contexts."""
    fields = [_SIGNING_DOMAIN, record.key, record.subkey, record.value, float(record.expiration)]
    return msgpack.packb(fields, use_bin_type=True)


def sign_record(record: Record, identity: Identity) -> Record:
    return dataclasses.replace(record, signature=identity.sign(signing_payload(record)))


def record_owner(record: Record) -> PeerID | None:
    """The peer that must have signed ``record``, None when anyone may write it."""
    key_owner, subkey_owner = owner_of(record.key), owner_of(record.subkey)
    if key_owner is not None and subkey_owner is not None and key_owner != subkey_owner:
        raise InvalidRecord("key and subkey name different owners")
    return key_owner or subkey_owner


def validate_record(
    record: Record,
    now: float,
    max_value_size: int = 64 * 1024,
    max_key_size: int = 1024,
    max_ttl: float = 86400.0,
) -> None:
    """Raise InvalidRecord unless ``record`` may be stored at time ``now``."""
    for what, name in (("key", record.key), ("subkey", record.subkey)):
        if name is not None and len(name) > max_key_size:
            raise InvalidRecord(
                f"record {what} of {len(name)} bytes exceeds the {max_key_size}-byte limit"
            )
    if len(record.value) > max_value_size:
        raise InvalidRecord(
            f"record value of {len(record.value)} bytes exceeds the {max_value_size}-byte limit"
        )
    if record.expiration <= now:
        raise InvalidRecord("record expired")
    if record.expiration > now + max_ttl:
        raise InvalidRecord(f"expiration is more than max_ttl ({max_ttl:g}s) in the future")
    owner = record_owner(record)
    if owner is None:
        return
    if record.signature is None:
        raise InvalidRecord(f"unsigned write to owned key {record.key!r} (owner {owner})")
    if not owner.verify(record.signature, signing_payload(record)):
        raise InvalidRecord(f"bad signature for owned key {record.key!r} (owner {owner})")


def _max_expiration(entry: Record | dict[bytes, Record]) -> float:
    if isinstance(entry, Record):
        return entry.expiration
    return max(r.expiration for r in entry.values())


class RecordStore:
    """Records this node holds, bounded in total, per source peer and per key."""

    def __init__(
        self,
        max_value_size: int = 64 * 1024,
        max_key_size: int = 1024,
        max_ttl: float = 86400.0,
        max_records: int = 100_000,
        max_records_per_source: int = 2_000,
        max_subkeys_per_key: int = 1_000,
    ):
        self.max_value_size = max_value_size
        self.max_key_size = max_key_size
        self.max_ttl = max_ttl
        self.max_records = max_records
        self.max_records_per_source = max_records_per_source
        self.max_subkeys_per_key = max_subkeys_per_key
        # key -> plain Record, or {subkey: Record} for a dictionary
        self._data: dict[bytes, Record | dict[bytes, Record]] = {}
        self._source: dict[tuple[bytes, bytes | None], PeerID | None] = {}
        self._per_source: Counter[PeerID] = Counter()
        # (expiration, tiebreak, key, subkey); entries of replaced records are skipped lazily
        self._expiry: list[tuple[float, int, bytes, bytes | None]] = []
        self._tiebreak = itertools.count()

    def store(self, record: Record, now: float, source: PeerID | None = None) -> bool:
        """Store ``record`` if it is newer than what it replaces; raise InvalidRecord if invalid.

        ``source`` is the peer that sent it (None for our own writes), for the per-peer quota.
        """
        validate_record(record, now, self.max_value_size, self.max_key_size, self.max_ttl)
        self.remove_expired(now)
        existing = self._data.get(record.key)
        if record.subkey is None or isinstance(existing, Record):
            # replaces the whole entry (plain value or dictionary) if newer than all of it
            if existing is not None and record.expiration <= _max_expiration(existing):
                return False
            replaced = self._names(record.key)
        else:
            subkeys = existing or {}
            old = subkeys.get(record.subkey)
            if old is not None and record.expiration <= old.expiration:
                return False
            if old is None and len(subkeys) >= self.max_subkeys_per_key:
                raise InvalidRecord(f"too many subkeys under key {record.key!r}")
            replaced = [(record.key, record.subkey)] if old is not None else []
        self._check_quota(replaced, source)
        for name in replaced:
            self._drop(*name)
        if record.subkey is None:
            self._data[record.key] = record
        else:
            entry = self._data.setdefault(record.key, {})
            assert isinstance(entry, dict)
            entry[record.subkey] = record
        self._source[(record.key, record.subkey)] = source
        if source is not None:
            self._per_source[source] += 1
        heapq.heappush(
            self._expiry, (record.expiration, next(self._tiebreak), record.key, record.subkey)
        )
        return True

    def _names(self, key: bytes) -> list[tuple[bytes, bytes | None]]:
        entry = self._data.get(key)
        if entry is None:
            return []
        if isinstance(entry, Record):
            return [(key, None)]
        return [(key, subkey) for subkey in entry]

    def _check_quota(
        self, replaced: list[tuple[bytes, bytes | None]], source: PeerID | None
    ) -> None:
        if len(self._source) - len(replaced) + 1 > self.max_records:
            raise InvalidRecord("storage full")
        if source is not None:
            freed = sum(1 for name in replaced if self._source[name] == source)
            if self._per_source[source] - freed + 1 > self.max_records_per_source:
                raise InvalidRecord(f"too many records from peer {source}")

    def _drop(self, key: bytes, subkey: bytes | None) -> None:
        source = self._source.pop((key, subkey))
        if source is not None:
            self._per_source[source] -= 1
            if not self._per_source[source]:
                del self._per_source[source]
        entry = self._data[key]
        if isinstance(entry, dict):
            del entry[subkey]  # type: ignore[arg-type]
            if entry:
                return
        del self._data[key]

    def _current(self, key: bytes, subkey: bytes | None) -> Record | None:
        entry = self._data.get(key)
        if isinstance(entry, dict):
            return entry.get(subkey) if subkey is not None else None
        return entry if subkey is None else None

    def get(self, key: bytes, now: float) -> list[Record]:
        """The live records under ``key``: one plain record, or one per sub-key (sorted)."""
        entry = self._data.get(key)
        if entry is None:
            return []
        records = [entry] if isinstance(entry, Record) else [entry[s] for s in sorted(entry)]
        return [r for r in records if r.expiration > now]

    def remove_expired(self, now: float) -> int:
        """Drop every record whose expiration has passed; returns how many."""
        removed = 0
        while self._expiry and self._expiry[0][0] <= now:
            expiration, _, key, subkey = heapq.heappop(self._expiry)
            current = self._current(key, subkey)
            if current is not None and current.expiration == expiration:
                self._drop(key, subkey)
                removed += 1
        if len(self._expiry) > 2 * len(self._source) + 64:  # too many stale entries: rebuild
            self._expiry = [
                (r.expiration, next(self._tiebreak), r.key, r.subkey) for r in self.records()
            ]
            heapq.heapify(self._expiry)
        return removed

    def __len__(self) -> int:
        return len(self._source)

    def records(self) -> Iterator[Record]:
        """Every stored record, e.g. to republish; call ``remove_expired`` first to skip stale ones."""
        for entry in list(self._data.values()):
            yield from ([entry] if isinstance(entry, Record) else list(entry.values()))

    def keys(self) -> list[bytes]:
        return list(self._data)


def merge_records(records: Iterable[Record]) -> list[Record]:
    """Resolve the records a lookup collected from several nodes, as a store would.

    Per (key, subkey) the latest expiration wins; a plain value beats a key's dictionary only if
    it is newer than every sub-key, otherwise the dictionary stands. Validate records first.
    """
    plain: dict[bytes, Record] = {}
    subkeys: dict[bytes, dict[bytes, Record]] = {}
    for record in records:
        if record.subkey is None:
            best = plain.get(record.key)
            if best is None or record.expiration > best.expiration:
                plain[record.key] = record
        else:
            entry = subkeys.setdefault(record.key, {})
            best = entry.get(record.subkey)
            if best is None or record.expiration > best.expiration:
                entry[record.subkey] = record
    merged: list[Record] = []
    for key in sorted(plain.keys() | subkeys.keys()):
        entry = subkeys.get(key, {})
        if key in plain and (not entry or plain[key].expiration > _max_expiration(entry)):
            merged.append(plain[key])
        else:
            merged.extend(entry[s] for s in sorted(entry))
    return merged
