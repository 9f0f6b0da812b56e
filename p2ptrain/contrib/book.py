"""A peer's contribution book: signs a receipt of each averaging round it took part in, publishes its
latest receipts in the DHT and, optionally, appends every one to a file; and the reads of them.

In the DHT each peer holds one owner-signed entry (sub-key ``r``) under ``{run_id}/receipts/{b}``,
``b`` one of ``BUCKETS`` drawn from its PeerID (a DHT reply holds at most 1 MiB of one key: the
buckets let hundreds of peers' entries be read): its announced name and its newest receipts,
bounded (``MAX_KEPT`` receipts, ``MAX_ENTRY`` bytes), expiring ``ttl`` seconds after its last
write. A round's receipts are published in the background, at most every ``publish_every`` seconds:
no round waits for them. Receipts are credited from
whoever holds them (see :mod:`.leaderboard`), so a peer that left is still credited from its
group's receipts while they last.

The file (``path``) holds one JSON object per line, ``{"by", "body", "sig"}`` (base64), the same
signed bytes as in the DHT: anyone can verify it with :func:`read_file`.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dht import DHTError, DHTNode, Identity, PeerID, TaskGroup

from .receipt import MAX_BODY, Receipt, Signed, build_receipt, parse_signed, sign

if TYPE_CHECKING:
    from ..averaging import StepResult
    from ..optim import DecentralizedOptimizer

__all__ = ["ContributionBook", "check_name", "read_file", "read_receipts", "receipts_key"]

log = logging.getLogger("p2ptrain.contrib")

_VERSION = 1
_SUBKEY = "r"
MAX_KEPT = 64  # newest receipts a peer keeps in its DHT entry
MAX_ENTRY = 60 * 1024  # bytes of one peer's entry (the DHT's value limit is 64 KiB)
MAX_NAME = 40
TTL = 86_400.0  # the DHT's longest


BUCKETS = 16


def receipts_key(run_id: str, bucket: int) -> str:
    """The DHT key of run ``run_id``'s receipts in ``bucket`` (a peer's: ``bucket_of``)."""
    return f"{run_id}/receipts/{bucket}"


def bucket_of(peer: PeerID) -> int:
    return peer.to_bytes()[-1] % BUCKETS


def check_name(name: str | None) -> str | None:
    """``name`` if it is a printable name of at most ``MAX_NAME`` characters; ValueError otherwise."""
    if name is not None and not (0 < len(name) <= MAX_NAME and name.isprintable()):
        raise ValueError(f"name {name!r:.60}: 1 to {MAX_NAME} printable characters")
    return name


class ContributionBook:
    """Receipts of this peer's rounds (``node``'s identity signs them) under ``run_id``.

    ``record`` may be called from any thread; ``start``/``close`` run on ``node``'s loop."""

    def __init__(self, node: DHTNode, run_id: str, *, name: str | None = None, path: str | os.PathLike | None = None,
                 publish_every: float = 30.0, ttl: float = TTL):
        self.node, self.run_id, self.name = node, run_id, check_name(name)
        self.key = receipts_key(run_id, bucket_of(node.peer_id))
        self.identity: Identity = node.identity
        self.path = None if path is None else os.fspath(path)
        self.publish_every, self.ttl = publish_every, ttl
        self.kept: collections.deque[Signed] = collections.deque(maxlen=MAX_KEPT)
        self.signed = 0  # receipts signed since start
        self.samples = 0  # what our own receipts credit us with, summed
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dirty = asyncio.Event()
        self._tasks = TaskGroup()

    # ------------------------------------------------------------------ any thread
    def record(self, result: StepResult, run: str, compute_s: float = 0.0) -> Signed | None:
        """Sign our receipt of ``result`` (a round of averaging prefix ``run``); None for a round with
        no group or no all-reduce detail."""
        ar = result.allreduce
        if ar is None or result.group_size < 2:
            return None
        receipt = self._receipt(result, run, compute_s)
        signed = sign(receipt, self.identity)
        with self._lock:
            self.kept.append(signed)
            self.signed += 1
            self.samples += receipt.lines[ar.rank].samples
            if self.path is not None:
                self._append(signed)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._dirty.set)
        return signed

    def _receipt(self, result: StepResult, run: str, compute_s: float) -> Receipt:
        """Our receipt of ``result`` (an extension point: a hostile peer signs another)."""
        assert result.allreduce is not None
        return build_receipt(result.allreduce, run, result.round_id, self.identity.peer_id, time.time(),
                             slices=result.allreduces, failed=result.failed, bytes_sent=result.bytes_sent,
                             compute_s=compute_s)

    def _append(self, signed: Signed) -> None:
        by, body, sig = (base64.b64encode(x).decode() for x in signed.to_wire())
        try:
            with open(self.path, "a", encoding="utf-8") as f:  # type: ignore[arg-type]
                f.write(json.dumps({"by": by, "body": body, "sig": sig}) + "\n")
        except OSError as e:
            log.warning("cannot append to the receipts file %s: %s", self.path, e.strerror or e)

    def entry(self) -> dict[str, Any]:
        """Our DHT entry: our name and our newest receipts that fit ``MAX_ENTRY``."""
        with self._lock:
            newest = list(self.kept)[::-1]
        out, size = [], 64 + len(self.name or "")
        for s in newest:
            size += len(s.body) + len(s.sig) + 48
            if size > MAX_ENTRY:
                break
            out.append([s.body, s.sig])
        return {"v": _VERSION, "n": self.name, "r": out}

    def hook(self, opt: DecentralizedOptimizer) -> Callable[[StepResult], None]:
        """The round hook for ``opt`` (its ``stats.round_hooks``): our receipt of each gradient round,
        our compute time claimed as our counted samples over our measured samples/s."""
        run = opt.averager.prefix

        def on_round(result: StepResult) -> None:
            ar = result.allreduce
            sps = opt.stats.local_sps
            own = ar.weights[ar.rank] if ar is not None and len(ar.weights) > ar.rank else 0.0
            if ar is not None:  # (no more than we counted for: a round begun early declared the most)
                own = min([own] + [s.weights[ar.rank] for r in result.allreduces for s in r.shards
                                   if ar.rank in s.weights])
            try:
                self.record(result, run, own / sps if sps > 0 else 0.0)
            except Exception:  # noqa: BLE001 - a receipt we cannot make must not stop training
                log.exception("could not sign the receipt of round %s", result.round_id)

        return on_round

    # ------------------------------------------------------------------ on the node's loop
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._tasks.spawn(self._publisher(), name="contrib-publisher")

    async def publish(self) -> None:
        """Write our entry now (nothing when we hold no receipt yet)."""
        entry = self.entry()
        if not entry["r"]:
            return
        self._dirty.clear()
        try:
            await self.node.store_owned(self.key, _SUBKEY, entry, time.time() + self.ttl)
        except DHTError as e:
            log.debug("publishing receipts failed: %s", e)

    async def _publisher(self) -> None:
        while True:
            await self._dirty.wait()
            await self.publish()
            await asyncio.sleep(self.publish_every)  # at most one write per period, whatever the rounds

    async def close(self, timeout: float = 2.0) -> None:
        """Stop publishing; write the receipts not yet published (bounded by ``timeout``)."""
        await self._tasks.close()
        if self._dirty.is_set():
            try:
                async with asyncio.timeout(timeout):
                    await self.publish()
            except TimeoutError:
                log.debug("the last receipts were not published within %.1f s", timeout)


def parse_entry(value: object, owner: PeerID) -> tuple[str | None, list[Signed]]:
    """(announced name, its own valid receipts) from ``owner``'s DHT entry; invalid parts left out."""
    if not isinstance(value, dict) or value.get("v") != _VERSION or not isinstance(value.get("r"), list):
        return None, []
    name = value.get("n")
    try:
        name = check_name(name) if isinstance(name, str) else None
    except ValueError:
        name = None
    out = []
    for item in value["r"][:MAX_KEPT]:
        if isinstance(item, list) and len(item) == 2:
            s = parse_signed([owner.to_bytes(), *item], owner)
            if s is not None:
                out.append(s)
    return name, out


async def read_receipts(node: DHTNode, run_id: str) -> tuple[list[Signed], dict[PeerID, str]]:
    """Every valid receipt the peers of ``run_id`` publish, and the names they announce."""
    reads = await asyncio.gather(*(node.get_owned(receipts_key(run_id, b), _SUBKEY, max_size=64 * 1024)
                                   for b in range(BUCKETS)))
    signed: list[Signed] = []
    names: dict[PeerID, str] = {}
    for owner, ov in ((o, v) for read in reads for o, v in read.values.items()):
        name, found = parse_entry(ov.value, owner)
        signed += found
        if name is not None:
            names[owner] = name
    return signed, names


def read_file(path: str | os.PathLike) -> list[Signed]:
    """The valid receipts of a receipts file (lines that do not verify are left out)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                d = json.loads(line)
                wire = [base64.b64decode(d[k], validate=True) for k in ("by", "body", "sig")]
            except (ValueError, KeyError, TypeError):
                continue
            if len(wire[1]) <= MAX_BODY and (s := parse_signed(wire)) is not None:
                out.append(s)
    return out
