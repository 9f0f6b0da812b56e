"""DHT records, their validation, and the bounded in-memory store, with no I/O.

A key holds either one plain value or a dictionary of sub-keys, each with its own expiration: a
group of peers can then share one key (say, a matchmaking round) where every member writes and
refreshes its own entry without clobbering the others. Owner-signed records outrank unsigned
ones (``replaces_entry``): an unsigned plain value can neither erase nor hide a key's owned
sub-keys, in a store or in a merged lookup, and unsigned sub-keys filling a key give way to owned ones.

Records are validated on every write because they come from untrusted peers. A name carrying an
``[owner:<PeerID>]`` marker may only be written by that peer, proven by an Ed25519 signature; since
a PeerID embeds its public key, any node can check that without a key server.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import msgpack

from .errors import InvalidRecord
from .identity import Identity, PeerID
from .quota import RECORD_OVERHEAD, Holder, Ledger

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


@functools.lru_cache(maxsize=4096)
def _marked_peer(text: bytes) -> PeerID:
    """The PeerID an owner marker names, parsed once per id: a reader checks every record of the
    same few owners again and again (base58 in Python, and the key PeerID keeps, cost ~20 us)."""
    return PeerID.from_base58(text.decode("ascii"))


def owner_of(name: bytes | None) -> PeerID | None:
    """The peer named by ``name``'s owner marker, None when there is none.

    A malformed marker, or markers naming two peers, raise InvalidRecord rather than reading as
    "not owned": otherwise a typo in an owned name would silently make it writable by anyone.
    """
    if name is None or b"[owner:" not in name:
        return None
    owners = set()
    for match in _OWNER_MARKER.finditer(name):
        try:
            owners.add(_marked_peer(match.group(1)))
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


def verified_owner(record: Record) -> PeerID | None:
    """The peer that signed ``record``, None when anyone may write it; InvalidRecord when the
    record names an owner whose signature is missing or wrong."""
    owner = record_owner(record)
    if owner is None:
        return None
    if record.signature is None:
        raise InvalidRecord(f"unsigned write to owned key {record.key!r} (owner {owner})")
    if not owner.verify(record.signature, signing_payload(record)):
        raise InvalidRecord(f"bad signature for owned key {record.key!r} (owner {owner})")
    return owner


_UNSEEN = object()


class VerifiedOwners:
    """``verified_owner``, remembered per record (bounded; records of small values only): a key
    polled again and again costs one signature check per record, not one per read. Refusals are
    remembered too, so a forgery replayed on every read costs nothing more."""

    def __init__(self, max_entries: int = 4096, max_value: int = 4096):
        self.max_entries, self.max_value = max_entries, max_value
        self._seen: dict[tuple, PeerID | str | None] = {}  # record's fields -> owner, or why it was refused

    def owner(self, record: Record) -> PeerID | None:
        fields = (record.key, record.subkey, record.value, record.expiration, record.signature)  # (hashed in C)
        seen = self._seen.get(fields, _UNSEEN)
        if seen is _UNSEEN:
            try:
                seen = verified_owner(record)
            except InvalidRecord as e:
                seen = str(e)
            if len(record.value) <= self.max_value:
                if len(self._seen) >= self.max_entries:
                    self._seen.clear()
                self._seen[fields] = seen
        if isinstance(seen, str):
            raise InvalidRecord(seen)
        return seen  # type: ignore[return-value]


#: the memo of every node and store of this process: a record that one of several peers in a process
#: (a local swarm, a benchmark's) checked is not checked again by the others; the same bytes verify alike
PROCESS_OWNERS = VerifiedOwners(max_entries=16384)


def validate_record(
    record: Record,
    now: float,
    max_value_size: int = 64 * 1024,
    max_key_size: int = 1024,
    max_ttl: float = 86400.0,
    owners: VerifiedOwners | None = None,
) -> PeerID | None:
    """Raise InvalidRecord unless ``record`` may be stored at time ``now``; else return its owner
    (None: anyone may write it). ``owners`` remembers signatures already checked."""
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
    return owners.owner(record) if owners is not None else verified_owner(record)


def _max_expiration(entry: Record | dict[bytes, Record]) -> float:
    if isinstance(entry, Record):
        return entry.expiration
    return max(r.expiration for r in entry.values())


def is_owned(record: Record) -> bool:
    """Whether ``record`` names an owner (for a record that passed ``validate_record``: is signed by it)."""
    return b"[owner:" in record.key or (record.subkey is not None and b"[owner:" in record.subkey)


def _holds_owned(entry: Record | dict[bytes, Record]) -> bool:
    return is_owned(entry) if isinstance(entry, Record) else any(is_owned(r) for r in entry.values())


def replaces_entry(record: Record, entry: Record | dict[bytes, Record]) -> bool:
    """Whether ``record`` replaces the whole of ``entry`` (a key's plain value or its sub-keys)
    when the two are of different kinds, or ``record`` is plain (then ``entry`` is plain too).

    Owner-signed records outrank unsigned ones: an unsigned plain value never displaces owned
    sub-keys (anyone could otherwise erase a run's progress or a matchmaking round, and hold the
    key until it expires), and an owned sub-key displaces an unsigned plain value whatever its
    expiration. Between equals, the newer replaces the older, as it always did."""
    owned, held = is_owned(record), _holds_owned(entry)
    if owned != held:
        return owned
    return record.expiration > _max_expiration(entry)


def record_cost(record: Record) -> int:
    """The bytes a stored record holds in memory, for the byte quotas (see ``quota``)."""
    return (len(record.key) + len(record.subkey or b"") + len(record.value) + len(record.signature or b"")
            + RECORD_OVERHEAD)


class RecordStore:
    """Records this node holds, bounded in records and bytes, per source peer and per key.

    Past the per-peer quotas a write is refused; when the store is full, what a write may evict
    is decided per address group and peer (``quota.Ledger``): a flood from one address (any number
    of identities) evicts its own records, not those of other sources.
    """

    def __init__(
        self,
        max_value_size: int = 64 * 1024,
        max_key_size: int = 1024,
        max_ttl: float = 86400.0,
        max_records: int = 100_000,
        max_records_per_source: int = 2_000,
        max_subkeys_per_key: int = 1_000,
        max_bytes: int = 128 << 20,
        max_bytes_per_source: int = 16 << 20,
        owners: VerifiedOwners | None = None,
    ):
        self.max_value_size = max_value_size
        self.owners = PROCESS_OWNERS if owners is None else owners  # (signatures checked, remembered)
        self.max_key_size = max_key_size
        self.max_ttl = max_ttl
        self.max_subkeys_per_key = max_subkeys_per_key
        # key -> plain Record, or {subkey: Record} for a dictionary
        self._data: dict[bytes, Record | dict[bytes, Record]] = {}
        self._ledger = Ledger(max_records, max_bytes, max_records_per_source, max_bytes_per_source)
        # (expiration, tiebreak, key, subkey); entries of replaced records are skipped lazily
        self._expiry: list[tuple[float, int, bytes, bytes | None]] = []
        self._tiebreak = itertools.count()

    @property
    def bytes(self) -> int:
        """What the stored records cost, in bytes (``record_cost`` summed)."""
        return self._ledger.bytes

    def store(self, record: Record, now: float, source: PeerID | None = None, group: str | None = None) -> bool:
        """Store ``record`` if it is newer than what it replaces; raise InvalidRecord if invalid,
        of the wrong kind for its key, or over a quota.

        ``source`` is the peer that sent it (None for our own writes) and ``group`` its address
        group (``quota.address_group``; None: a group of its own), for the quotas.
        """
        validate_record(record, now, self.max_value_size, self.max_key_size, self.max_ttl, self.owners)
        self.remove_expired(now)
        existing = self._data.get(record.key)
        if existing is None:
            replaced: list[tuple[bytes, bytes | None]] = []
        elif record.subkey is None or isinstance(existing, Record):
            if not replaces_entry(record, existing):
                if is_owned(record) or not _holds_owned(existing):
                    return False  # not newer
                raise InvalidRecord(f"key {record.key[:64]!r} holds owner-signed sub-keys: "
                                    "an unsigned plain value may not replace them")
            replaced = self._names(record.key)
        else:
            old = existing.get(record.subkey)
            if old is not None and record.expiration <= old.expiration:
                return False
            replaced = [(record.key, record.subkey)] if old is not None else []
            if old is None and len(existing) >= self.max_subkeys_per_key:
                # a full key: an owned sub-key takes the place of the soonest-expiring unsigned one
                unowned = [r for r in existing.values() if not is_owned(r)] if is_owned(record) else []
                if not unowned:
                    raise InvalidRecord(f"too many subkeys under key {record.key!r}")
                replaced = [(record.key, min(unowned, key=lambda r: r.expiration).subkey)]
        holder: Holder = (group, source)
        saved = [(self._current(*name), self._ledger.holder(name)) for name in replaced]
        for name in replaced:
            self._drop(*name)
        try:
            self._ledger.make_room(holder, record_cost(record), lambda name: self._drop(*name))
        except InvalidRecord:
            for old_record, old_holder in saved:  # the write failed: put back what it was to replace
                assert old_record is not None and old_holder is not None
                self._insert(old_record, old_holder)
            raise
        self._insert(record, holder)
        return True

    def _insert(self, record: Record, holder: Holder) -> None:
        if record.subkey is None:
            self._data[record.key] = record
        else:
            entry = self._data.setdefault(record.key, {})
            assert isinstance(entry, dict)
            entry[record.subkey] = record
        self._ledger.add((record.key, record.subkey), holder, record_cost(record), record.expiration)
        heapq.heappush(
            self._expiry, (record.expiration, next(self._tiebreak), record.key, record.subkey)
        )

    def _names(self, key: bytes) -> list[tuple[bytes, bytes | None]]:
        entry = self._data.get(key)
        if entry is None:
            return []
        if isinstance(entry, Record):
            return [(key, None)]
        return [(key, subkey) for subkey in entry]

    def records_from(self, peer: PeerID) -> int:
        """How many stored records ``peer`` sent us (its quota's use)."""
        return self._ledger.peer_records(peer)

    def _drop(self, key: bytes, subkey: bytes | None) -> None:
        self._ledger.remove((key, subkey))
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
        if len(self._expiry) > 2 * len(self) + 64:  # too many stale entries: rebuild
            self._expiry = [
                (r.expiration, next(self._tiebreak), r.key, r.subkey) for r in self.records()
            ]
            heapq.heapify(self._expiry)
        return removed

    def __len__(self) -> int:
        return self._ledger.records

    def records(self) -> Iterator[Record]:
        """Every stored record, e.g. to republish; call ``remove_expired`` first to skip stale ones."""
        for entry in list(self._data.values()):
            yield from ([entry] if isinstance(entry, Record) else list(entry.values()))

    def keys(self) -> list[bytes]:
        return list(self._data)


def merge_records(records: Iterable[Record]) -> list[Record]:
    """Resolve the records a lookup collected from several nodes, as a store would.

    Per (key, subkey) the latest expiration wins; a plain value beats a key's dictionary only as
    ``replaces_entry`` says (never unsigned over owned sub-keys), otherwise the dictionary stands.
    Validate records first.
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
        if key in plain and (not entry or replaces_entry(plain[key], entry)):
            merged.append(plain[key])
        else:
            merged.extend(entry[s] for s in sorted(entry))
    return merged
