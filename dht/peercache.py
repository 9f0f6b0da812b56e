"""The peer cache: a small file of peers a node recently talked to, for rejoining later.

Why: a peer is usually started with one or two bootstrap addresses. Under churn those peers may
be gone by the time it restarts (or while it starts), and with no other source of peers it cannot
join at all. Like the peerstores of libp2p and IPFS, a node keeps the addresses of listening peers
that answered it (its routing table holds only those) and dials them when its bootstrap peers fail.

The file is JSON, readable and editable by hand::

    {"version": 1, "saved_at": 1767225600.0, "peers": ["/ip4/10.0.0.5/tcp/4001/p2p/12D3KooW...", ...]}

It is bounded (``MAX_PEERS`` by default, most recently seen first) and replaced atomically (a
temporary file in the same directory, fsync, rename), so a crash or a concurrent writer never
leaves a torn file: a reader sees one complete version or the other. A file that cannot be read or
parsed is a cache miss with one warning, never an error: the cache only ever adds peers to try.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from .errors import ConfigError
from .identity import PeerID
from .multiaddr import Multiaddr
from .routing import Contact

log = logging.getLogger("dht.peercache")

VERSION = 1
MAX_PEERS = 64
_MAX_FILE = 1024 * 1024  # 64 addresses are ~6 KB: refuse to parse a huge file by mistake
_STALE_TEMP = 60.0  # a temporary file older than this was left by a writer that died mid-write


def load_peer_cache(path: str | os.PathLike[str], limit: int = MAX_PEERS) -> list[Multiaddr]:
    """The multiaddrs in the cache at ``path``: [] when it does not exist yet, and [] with one
    warning when it is unreadable or not a peer cache. Malformed entries are skipped."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            data = f.read(_MAX_FILE + 1)
    except FileNotFoundError:
        return []
    except OSError as e:
        log.warning("ignoring peer cache %s: cannot read it (%s)", p, e.strerror or e)
        return []
    try:
        if len(data) > _MAX_FILE:
            raise ValueError(f"larger than {_MAX_FILE} bytes")
        doc = json.loads(data)
        if not isinstance(doc, dict) or not isinstance(doc.get("peers"), list):
            raise ValueError('expected a JSON object with a "peers" list')
        if doc.get("version") != VERSION:
            raise ValueError(f"unknown version {doc.get('version')!r}")
    except (ValueError, UnicodeDecodeError) as e:
        log.warning("ignoring peer cache %s: not a peer cache (%s); it is rewritten once this peer has joined",
                    p, str(e)[:120])
        return []
    out: list[Multiaddr] = []
    skipped = 0
    for entry in doc["peers"]:
        try:
            if not isinstance(entry, str):
                raise ConfigError("not a string")
            addr = Multiaddr.parse(entry)
            if addr.peer_id is None:  # an address without a peer id could be anyone now
                raise ConfigError("no /p2p/ peer id")
        except ConfigError:
            skipped += 1
            continue
        if addr not in out:
            out.append(addr)
    if skipped:
        log.warning("peer cache %s: skipped %d malformed entr%s", p, skipped, "y" if skipped == 1 else "ies")
    return out[:limit]


def save_peer_cache(path: str | os.PathLike[str], addrs: Sequence[Multiaddr], limit: int = MAX_PEERS) -> None:
    """Replace the cache at ``path`` with (at most ``limit`` of) ``addrs``, atomically; creates the
    directory if needed. Raises OSError when it cannot (the caller logs it: a cache is optional)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(p)
    doc = {"version": VERSION, "saved_at": round(time.time(), 3), "peers": [str(a) for a in addrs[:limit]]}
    body = json.dumps(doc, indent=1).encode() + b"\n"
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _remove_stale_temps(p: Path) -> None:
    """Temporary files of ``p`` that a writer killed mid-write left behind (SIGKILL skips cleanup)."""
    now = time.time()
    try:
        for tmp in p.parent.glob(f".{p.name}.*.tmp"):
            try:
                if now - tmp.stat().st_mtime > _STALE_TEMP:
                    tmp.unlink()
            except OSError:
                pass
    except OSError:
        pass


def cache_entries(contacts: Iterable[Contact], own: PeerID, limit: int = MAX_PEERS) -> list[Multiaddr]:
    """What a node should cache: reachable peers (a direct address, else their first circuit
    address) that have not failed since they last answered, most recently seen first, at most ``limit``."""
    live = [c for c in contacts if c.dialable and c.failures == 0 and c.peer_id != own]
    live.sort(key=lambda c: c.last_seen, reverse=True)
    return [Multiaddr.from_host_port(c.addr[0], c.addr[1], c.peer_id) if c.addr is not None else c.relays[0]
            for c in live[:limit]]


def default_cache_name(swarm_fingerprint: str | None = None) -> str:
    """``peers.json`` for the public swarm, ``peers-<fingerprint>.json`` for a private one: peers of
    different swarms on one machine sharing a data directory must not overwrite each other's."""
    return "peers.json" if swarm_fingerprint is None else f"peers-{swarm_fingerprint}.json"
