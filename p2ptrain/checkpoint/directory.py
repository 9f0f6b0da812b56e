"""Who holds which checkpoint: the DHT entries peers publish about checkpoints. Sans-IO.

There is no checkpoint server, so two kinds of DHT entries stand in for one:

* ``{run_id}/ckpt/latest``: one owner-signed sub-key per writer, whose value is that writer's
  newest :class:`~p2ptrain.checkpoint.record.CheckpointRecord` and a few of its older ones (so
  two writers whose newest saves differ still show the checkpoint they agree on). A reader
  believes the newest claim enough writers agree on (``trust``), not the newest record. The DHT
  already refuses writes to a sub-key by anyone but its owner; on top of that a record counts only
  if its own signature verifies and its writer *is* the sub-key's owner, so nobody can replay
  another peer's record under their own name, raise an epoch, or add a voice to a claim in
  someone else's name.
* ``{run_id}/ckpt/{manifest id hex}``: one owner-signed sub-key per provider (a peer that holds
  every chunk of that manifest and serves it), whose value is its address and the signed record
  it holds for the manifest (so a fetch by manifest id finds the record to store with it).

Everything here takes the entries ``DHTNode.get_owned`` read (each peer's value under its own sub-key,
signature checked) and returns decisions; ``swarm`` does the network.
Forged or malformed entries are dropped and reported once each (by owner and value hash), so a
hostile peer cannot flood the log.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import blake3

from dht import Multiaddr, PeerID, pack

from ..addresses import Reach, parse_relays
from .record import CheckpointRecord, RecordError, check_run_id

log = logging.getLogger("p2ptrain.checkpoint")

VERSION = 1
LATEST_SUBKEY = "ckpt"
PROVIDER_SUBKEY = "prov"
#: DHT values here are small; anything larger is hostile
MAX_ENTRY_BYTES = 4096
#: records per writer in a latest entry: its newest and older ones (at most ~330 bytes each)
LATEST_HISTORY = 4

Address = tuple[str, int]


def transfer_key(run_id: str) -> str:
    """The key a :class:`~p2ptrain.checkpoint.state_server.StateServer` serves a run's checkpoints under."""
    return f"{check_run_id(run_id)}/ckpt"


def run_of_transfer_key(key: str) -> str | None:
    """The run id in a :func:`transfer_key`, or None for any other key."""
    if not key.endswith("/ckpt"):
        return None
    try:
        return check_run_id(key[: -len("/ckpt")])
    except RecordError:
        return None


def latest_key(run_id: str) -> str:
    return f"{check_run_id(run_id)}/ckpt/latest"


def providers_key(run_id: str, manifest_id: bytes) -> str:
    if not isinstance(manifest_id, bytes) or len(manifest_id) != 32:
        raise ValueError("a manifest id is 32 bytes")
    return f"{check_run_id(run_id)}/ckpt/{manifest_id.hex()}"


@dataclass(frozen=True)
class Provider:
    """A peer that announced it holds (and serves) every chunk of one checkpoint."""

    peer: PeerID
    addr: Address | None  # where to dial it directly; None: behind NAT, or only over a connection we have
    record: CheckpointRecord  # the signed record it holds for that manifest (verified)
    relays: tuple[Multiaddr, ...] = ()  # its circuit addresses (behind NAT)

    @property
    def reach(self) -> Reach:
        return Reach(self.addr, self.relays)


# ---------------------------------------------------------------------------------- encoding


def latest_value(record: CheckpointRecord, older: Iterable[CheckpointRecord] = ()) -> dict[str, Any]:
    """What a writer stores under its sub-key of :func:`latest_key`: its newest record and up to
    ``LATEST_HISTORY - 1`` of its ``older`` ones (readers before them ignore ``h``)."""
    value: dict[str, Any] = {"v": VERSION, "r": record.to_bytes()}
    history = [r.to_bytes() for r in older][: LATEST_HISTORY - 1]
    if history:
        value["h"] = history
    return value


def provider_value(addr: Address | None, record: CheckpointRecord,
                   relays: tuple[Multiaddr, ...] = ()) -> dict[str, Any]:
    """What a provider stores under its sub-key of :func:`providers_key` (``relays``: its circuit
    addresses, behind NAT)."""
    value = {"v": VERSION, "a": list(addr) if addr is not None else None, "r": record.to_bytes()}
    return {**value, "ra": Reach(addr, relays).relays_wire()} if relays else value


# ---------------------------------------------------------------------------------- decoding

_reported: set[tuple[str, bytes]] = set()


def report_once(owner: str, value: bytes, why: str) -> None:
    """Log a rejected entry once per (owner, value): the same forgery is read on every lookup."""
    mark = (owner, blake3.blake3(value).digest()[:16])
    if mark in _reported:
        return
    if len(_reported) > 10_000:
        _reported.clear()
    _reported.add(mark)
    log.warning("ignoring a checkpoint entry from %s: %s", owner, why)


def _entry(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) and value.get("v") == VERSION else None


def _report(owner: PeerID, value: Any, why: str) -> None:
    report_once(owner.short(), pack(value), why)


def _signed_record(raw: Any, owner: PeerID | None, run_id: str) -> tuple[CheckpointRecord | None, str]:
    """The verified checkpoint record in an entry's ``r`` field, or (None, why not).
    ``owner``: the writer it must name (None: any writer, as for provider entries)."""
    if not isinstance(raw, bytes):
        return None, "no record in the entry"
    try:
        rec = CheckpointRecord.from_bytes(raw)
    except RecordError as e:
        return None, f"malformed checkpoint record ({e})"
    if not rec.verify():
        return None, f"the record's signature does not verify (claims writer {rec.writer.short()}, epoch {rec.epoch})"
    if owner is not None and rec.writer != owner:
        return None, f"it republishes a record written by {rec.writer.short()} under its own name"
    if rec.run_id != run_id:
        return None, f"the record is for run {rec.run_id!r}, not {run_id!r}"
    return rec, ""


def parse_latest(owner: PeerID, value: Any, run_id: str) -> list[CheckpointRecord]:
    """The checkpoint records in ``owner``'s entry under :func:`latest_key` (its newest first),
    each a well-formed record for ``run_id`` signed by ``owner``; [] (reported once) when the
    newest is not, and a bad older one is left out (reported once)."""
    entry = _entry(value)
    history = entry.get("h", []) if entry is not None else None
    if entry is None or not isinstance(history, list) or len(history) >= LATEST_HISTORY:
        _report(owner, value, "malformed latest-checkpoint entry")
        return []
    found = []
    for raw in (entry.get("r"), *history):
        rec, why = _signed_record(raw, owner, run_id)
        if rec is None:
            _report(owner, value, why)
            if not found:
                return []
        else:
            found.append(rec)
    return found


def choose_latest(records: Iterable[CheckpointRecord | None]) -> CheckpointRecord | None:
    """The newest of ``records`` (:meth:`CheckpointRecord.newer_than`: higher epoch, then later
    creation, then lower manifest id; the same choice on every peer). Not a run's latest from
    others' records: that is ``trust.decide``'s, which believes no lone claim."""
    best: CheckpointRecord | None = None
    for rec in records:
        if rec is not None and rec.newer_than(best):
            best = rec
    return best


def parse_address(raw: Any) -> Address | None | bool:
    """A dialable (host, port), None when absent, False when malformed."""
    if raw is None:
        return None
    if isinstance(raw, list) and len(raw) == 2 and isinstance(raw[0], str) and 0 < len(raw[0]) <= 255 \
            and type(raw[1]) is int and 0 < raw[1] < 65536:
        return raw[0], raw[1]
    return False


def parse_provider(owner: PeerID, value: Any, run_id: str, manifest_id: bytes) -> Provider | None:
    """The provider in ``owner``'s entry under :func:`providers_key`, or None (reported once) unless
    it is well-formed and carries a valid record of that run and manifest."""
    entry = _entry(value)
    addr = parse_address(entry.get("a")) if entry is not None else False
    try:
        relays = parse_relays(entry.get("ra", []), owner) if entry is not None else ()
    except ValueError:
        addr = False
    if entry is None or addr is False:
        _report(owner, value, "malformed provider entry")
        return None
    rec, why = _signed_record(entry.get("r"), None, run_id)
    if rec is not None and rec.manifest_id != manifest_id:
        rec, why = None, "its record names another manifest"
    if rec is None:
        _report(owner, value, why)
        return None
    return Provider(owner, addr, rec, relays)  # type: ignore[arg-type]


def announce_period(ttl: float) -> float:
    """How often to republish entries that live ``ttl`` seconds: three times per lifetime, so two
    lost rounds in a row still leave them alive."""
    if not (math.isfinite(ttl) and ttl > 0):
        raise ValueError("ttl must be a positive number of seconds")
    return ttl / 3
