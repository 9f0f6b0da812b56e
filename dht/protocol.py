"""The DHT's RPC protocol: the handlers a node serves (ping, find_node, find_value, store, and
notice: a holder telling a watcher of a write, see ``dht.watchers``) and the checks and encodings
of what they exchange. Every argument here is untrusted input.

``NodeProtocol`` is a part of ``DHTNode`` (``dht.node``): it reads the node's routing table and
record store and learns the callers as contacts.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Sequence

from .autonat import DIALBACK_METHOD, dial_back
from .config import DHTConfig
from .connection import Connection
from .errors import InvalidRecord, MultiaddrError, ProtocolError
from .identity import PeerID
from .multiaddr import parse_circuits
from .quota import address_group
from .relay import relayed_via
from .routing import ID_BITS, Contact, RoutingTable, key_id
from .storage import Record, RecordStore
from .transport import Host
from .watchers import MAX_WATCH, Watchers
from .wire import MAX_MESSAGE

#: bytes of records one find_value reply may carry: the rest of the 1 MiB message is for contacts
_REPLY_RECORD_BUDGET = MAX_MESSAGE - 64 * 1024
_PREFIX_SHIFT = ID_BITS - 64  # a find_value names the contacts it knows by their node ids' first 64 bits
_MAX_KNOWN = 256  # of them at most


def encode_contacts(contacts: Iterable[Contact]) -> list:
    """``[id, host, port]`` for a direct contact; ``[id, host | None, port | None, [circuit, ...]]``
    for one reached through relays too (older readers take the first form only)."""
    out: list = []
    for c in contacts:
        if c.relays:
            host, port = c.addr if c.addr is not None else (None, None)
            out.append([c.peer_id.to_bytes(), host, port, [str(a) for a in c.relays]])
        elif c.addr is not None:
            out.append([c.peer_id.to_bytes(), c.addr[0], c.addr[1]])
    return out


def decode_contacts(obj: Any, limit: int) -> list[Contact]:
    """A peer list from a reply (at most ``limit``); ProtocolError when it is malformed."""
    if not isinstance(obj, list):
        raise ProtocolError("malformed peer list")
    return [_decode_contact(item) for item in obj[:limit]]


def _decode_contact(item: Any) -> Contact:
    if not (isinstance(item, list) and len(item) in (3, 4)):
        raise ProtocolError("malformed peer entry")
    try:
        peer = PeerID(item[0])
    except (ValueError, TypeError):
        raise ProtocolError("malformed peer id") from None
    relays: tuple = ()
    if len(item) == 4:
        try:
            relays = parse_circuits(item[3], peer)
        except MultiaddrError as e:
            raise ProtocolError(f"malformed relay addresses: {str(e)[:200]}") from None
    host, port = item[1], item[2]
    if relays and host is None and port is None:
        return Contact(peer, None, relays=relays)
    if not (isinstance(host, str) and isinstance(port, int) and not isinstance(port, bool)):
        raise ProtocolError("malformed peer entry")
    if not (0 < port < 65536) or len(host) > 255:
        raise ProtocolError("malformed peer address")
    return Contact(peer, (host, port), relays=relays)


def _wire_size(record: Record) -> int:
    return len(record.key) + len(record.subkey or b"") + len(record.value) + len(record.signature or b"") + 32


def _within_reply_budget(records: list[Record]) -> list[Record]:
    """The records of one key that fit a find_value reply. Every record is small enough alone, but
    a key may hold up to 1000 sub-keys of 64 KiB: replying with all of them would exceed the
    message limit and the reader would drop the connection, so one writer of big sub-keys could make
    the key unreadable for everyone. Past the budget, the smallest records are kept: matchmaking
    and progress entries are small, so padding a key with big values only crowds out the padding."""
    total = sum(_wire_size(r) for r in records)
    if total <= _REPLY_RECORD_BUDGET:
        return records
    out, used = [], 0
    for r in sorted(records, key=lambda r: (_wire_size(r), -r.expiration)):
        size = _wire_size(r)
        if used + size > _REPLY_RECORD_BUDGET:
            break
        out.append(r)
        used += size
    return out


def value_request(key: bytes, within: int | None = None, known: Iterable[int] = (), watch: float = 0.0) -> Any:
    """find_value's argument: the key alone (the k closest contacts come back), or with ``within``
    only contacts nearer the key than that distance and not among ``known`` (node ids, sent as
    64-bit prefixes); ``within=0``: records only. A lookup needs no contact farther than its
    window's k-th nor one already in its window; a read from known holders needs none. ``watch``
    (with ``within``): hear of noticed writes of the key for that many seconds (``dht.watchers``)."""
    if within is None:
        return key
    ids = b"".join((i >> _PREFIX_SHIFT).to_bytes(8, "big") for i in known)
    out = [key, within.to_bytes((within.bit_length() + 7) // 8, "big"), ids]
    return [*out, float(watch)] if watch > 0 else out


def _value_request(args: Any) -> tuple[bytes, int | None, set[int], float]:
    """(key, within, known prefixes, watch seconds) from find_value's argument, in any of
    ``value_request``'s forms."""
    if isinstance(args, list) and len(args) in (3, 4):
        key, within, known, watch = args if len(args) == 4 else (*args, 0.0)
    else:
        key, within, known, watch = args, None, b"", 0.0
    if not (isinstance(key, bytes) and len(key) <= 1024):
        raise ProtocolError("key must be bytes of at most 1024")
    if within is None:
        return key, None, set(), 0.0
    if not (isinstance(within, bytes) and len(within) <= 32 and isinstance(known, bytes)
            and len(known) % 8 == 0 and len(known) <= _MAX_KNOWN * 8):
        raise ProtocolError("malformed find_value bounds")
    if not (type(watch) in (int, float) and 0 <= watch <= MAX_WATCH):
        raise ProtocolError("malformed find_value watch")
    ids = {int.from_bytes(known[i:i + 8], "big") for i in range(0, len(known), 8)}
    return key, int.from_bytes(within, "big"), ids, float(watch)


def store_request(wire: list, notice: int | None = None) -> Any:
    """store's argument: the records, with a ``notice`` tag for the key's watchers if any."""
    return wire if notice is None else {"r": wire, "n": notice}


def _store_request(args: Any) -> tuple[list, int | None]:
    notice = None
    if isinstance(args, dict):
        args, notice = args.get("r"), args.get("n")
        if not (type(notice) is int and 0 <= notice < 2**63):
            raise ProtocolError("malformed store notice")
    if not (isinstance(args, list) and len(args) <= 256):
        raise ProtocolError("store takes a list of at most 256 records")
    return args, notice


#: records a notice hands over (the write's, for one key): a watcher takes them without a read
MAX_NOTICE_RECORDS = 4


def notice_request(key: bytes, records: Sequence[Record]) -> Any:
    """notice's argument: the key alone (older watchers take only this form: "read it again"), or
    with the write's records, which the watcher checks and keeps as a read's."""
    return [key, [r.to_wire() for r in records[:MAX_NOTICE_RECORDS]]] if records else key


def _notice_request(args: Any) -> tuple[bytes, list]:
    """(key, records in wire form) from notice's argument, in either of its forms."""
    wire: Any = []
    if isinstance(args, list) and len(args) == 2:
        args, wire = args
    if not (isinstance(args, bytes) and len(args) <= 1024):
        raise ProtocolError("notice names a key of at most 1024 bytes")
    if not (isinstance(wire, list) and len(wire) <= MAX_NOTICE_RECORDS):
        raise ProtocolError(f"a notice carries a list of at most {MAX_NOTICE_RECORDS} records")
    return args, wire


def _target(args: Any) -> int:
    if not (isinstance(args, bytes) and len(args) == 32):
        raise ProtocolError("target must be 32 bytes")
    return int.from_bytes(args, "big")


class NodeProtocol:
    """The RPC handlers of ``DHTNode``; they answer from local state and never call out."""

    config: DHTConfig
    host: Host
    routing: RoutingTable
    storage: RecordStore
    _received_at: dict[bytes, float]
    _learn: Callable[[Connection], None]
    _key_stored: Callable[[bytes], None]
    _watchers: Watchers[Connection]
    _tell_watchers: Callable[[bytes, int, PeerID, Sequence[Record]], None]
    _noticed: Callable[[PeerID, bytes, Sequence[Record], str | None], None]

    def _serve(self) -> None:
        """Register the handlers on the node's host."""
        h = self.host
        h.on_request("ping", self._rpc_ping)
        h.on_request("find_node", self._rpc_find_node)
        h.on_request("find_value", self._rpc_find_value)
        h.on_request("store", self._rpc_store)
        h.on_request("notice", self._rpc_notice)
        h.on_request(DIALBACK_METHOD, self._rpc_dialback)

    async def _rpc_ping(self, conn: Connection, args: Any) -> Any:
        self._learn(conn)
        return None

    async def _rpc_find_node(self, conn: Connection, args: Any) -> Any:
        self._learn(conn)
        target = _target(args)
        return encode_contacts(self.routing.closest(target, self.config.k, exclude={conn.remote_peer}))

    async def _rpc_find_value(self, conn: Connection, args: Any) -> Any:
        self._learn(conn)
        key, within, known, watch = _value_request(args)
        if watch:
            self._watchers.add(key, conn.remote_peer, conn, watch, time.monotonic())
        records = _within_reply_budget(self.storage.get(key, time.time()))
        k = self.config.k
        closest = [] if within == 0 else self.routing.closest(key_id(key), k + len(known),
                                                              exclude={conn.remote_peer}, within=within)
        if known:
            closest = [c for c in closest if c.node_id >> _PREFIX_SHIFT not in known][:k]
        return [[r.to_wire() for r in records], encode_contacts(closest)]

    async def _rpc_dialback(self, conn: Connection, args: Any) -> Any:
        return await dial_back(self.host, conn, args)

    async def _rpc_store(self, conn: Connection, args: Any) -> Any:
        self._learn(conn)
        args, notice = _store_request(args)
        noticed: dict[bytes, list[Record]] = {}
        now, group = time.time(), address_group(conn.remote_host, relayed_via(conn))
        results = []
        for item in args:
            try:
                record = Record.from_wire(item)
                stored = self.storage.store(record, now, source=conn.remote_peer, group=group)
                # A valid STORE for the key, newer or a copy of what we hold: its sender is spreading
                # it to the k closest this period, so we need not republish it ourselves.
                self._received_at[record.key] = time.monotonic()
                if stored:
                    self._key_stored(record.key)
                    if notice is not None:
                        noticed.setdefault(record.key, []).append(record)
                results.append(stored)
            except InvalidRecord as e:
                results.append(str(e)[:200])
        for key, records in noticed.items():
            assert notice is not None
            self._tell_watchers(key, notice, conn.remote_peer, records)
        return results

    async def _rpc_notice(self, conn: Connection, args: Any) -> Any:
        key, wire = _notice_request(args)
        records = []
        for item in wire:
            try:
                records.append(Record.from_wire(item))
            except InvalidRecord:
                raise ProtocolError("malformed record in a notice") from None
        self._noticed(conn.remote_peer, key, records, address_group(conn.remote_host, relayed_via(conn)))
        return None
