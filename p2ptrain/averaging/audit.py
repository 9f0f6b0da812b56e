"""Shard audits: under a robust rule each member checks, after its round, that every other owner's
reply is the rule over the members' parts, so that an owner cannot set the others' values beyond
what the rule allows (issue 27, item 3).

Why audits and not two owners per shard: a second owner doubles the reduce traffic and the rule's
work in every round, and two colluding owners of one shard (2 hostile peers of 8 share a shard in
about a quarter of the rounds) still pass. An audit costs, per round and member, one chunk of every
other owner's shard (``AuditConfig.chunks``) fetched from each contributor and recomputed; a
shard of up to that many chunks is checked whole, every round, by every member (the small models
of the examples: each owner is checked completely); in a bigger shard a cheating owner is found
with the probability that one of its tampered chunks is drawn, by members it cannot predict.

Protocol ``p2ptrain/allreduce-audit/1``: the auditor opens one stream per member it asks, header
``{"g": group id, "q": [[kind, x, y], ...]}`` with kind ``"s"`` (the bytes you sent owner ``x`` for
chunk ``y`` of its shard) or ``"r"`` (you are the owner: your row of rank ``y`` in chunk ``x``, as
you combined it), half-closes, and reads per item ``u32 length | msgpack {"w": weight, "n": bytes}``
and the bytes, or ``{"e": why}``. What members keep for this is their :class:`.ledger.Ledger`.

Who is believed (see :mod:`.verify`): each part as its sender shows it. A member that shows the
auditor another part than it sent the owner only changes a hostile row, which the rule tolerates;
it cannot frame an honest owner, because a mismatch is attributed with the owner's own copies: the
owner is named (``failed``, hence the optimizer's ``stats.excluded``) only if it misreports the
auditor's own part or its reply is not the rule over the parts it shows. A named owner's whole shard
is recomputed from the members' parts without its own; a mismatch that only a dispute between
another member and the owner explains is fixed for that chunk and named to nobody.

Not covered: ``mean`` (it trusts peers: no audit); an owner that drops honest senders as if they
had failed (each of them names it, the others average without them); tampering confined to chunks
of a large shard that no auditor drew this round.
"""

from __future__ import annotations

import asyncio
import logging
import random
import struct
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dht import DHTError, PeerUnreachable, ProtocolError
from dht.aio import wait_event
from dht.stream import Stream
from dht.wire import pack, unpack

from ..compression import CompressionError
from .group import counted_weight, weight_cap
from .ledger import Ledger, chunks
from .verify import Part, agrees, judge, recompute

if TYPE_CHECKING:
    from .round import AllReduceResult, _Round

__all__ = ["AUDIT_PROTOCOL", "AuditConfig", "audit_round", "serve"]

log = logging.getLogger("p2ptrain.allreduce.audit")

AUDIT_PROTOCOL = "p2ptrain/allreduce-audit/1"
_PREFIX = struct.Struct(">I")
_MAX_META = 256
MAX_ITEMS = 1 << 14  # items one audit stream may ask for


@dataclass
class AuditConfig:
    """``chunks``: chunks of every other owner's shard a member recomputes per round under a robust
    rule (0: no audits; a shard of at most that many chunks is checked whole). ``kept``: rounds whose
    ledgers a service keeps for late auditors. ``max_streams``: audit streams one member may open
    per round of ours (an auditor needs at most three)."""

    chunks: int = 1
    kept: int = 2
    max_streams: int = 4


# ---------------------------------------------------------------------------- serving


def _parse_items(q: Any, ledger: Ledger) -> list[tuple[str, int, int]] | None:
    if not isinstance(q, list) or len(q) > MAX_ITEMS:
        return None
    out = []
    for item in q:
        if not (isinstance(item, list) and len(item) == 3 and item[0] in ("s", "r")
                and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 31 for v in item[1:])):
            return None
        out.append((item[0], item[1], item[2]))
    return out


def _lookup(ledger: Ledger, kind: str, x: int, y: int) -> tuple[float, memoryview] | None:
    if kind == "s":
        data = ledger.sent_bytes(x, y)
        return None if data is None else (ledger.weight, data)
    row = ledger.row(x, y) if x < len(ledger.my_chunks) and y < ledger.group.size else None
    return None if row is None else (row[0], memoryview(row[1].numpy()).cast("B"))


async def serve(ledger: Ledger, stream: Stream, wait: float, write_timeout: float,
                answer: Callable[[str, int, int, memoryview], memoryview] | None = None) -> None:
    """Answer one audit stream from what ``ledger`` holds; what we do not hold yet is waited for
    until our round is over (at most ``wait`` seconds). ``answer`` (tests: a member that lies to
    auditors) may replace the bytes of each answer."""
    hdr = stream.header
    items = _parse_items(hdr.get("q") if isinstance(hdr, dict) else None, ledger)
    if items is None:
        stream.reset("malformed audit request")
        return
    try:
        for kind, x, y in items:
            got = _lookup(ledger, kind, x, y)
            if got is None and await wait_event(ledger.finished, wait):
                got = _lookup(ledger, kind, x, y)
            if got is not None and answer is not None:
                got = (got[0], answer(kind, x, y, got[1]))
            meta = {"e": "not held"} if got is None else {"w": got[0], "n": len(got[1])}
            body = pack(meta)
            await stream.write(_PREFIX.pack(len(body)) + body, timeout=write_timeout)
            if got is not None:
                await stream.write(got[1], timeout=write_timeout)
        stream.write_eof()
    except (DHTError, TimeoutError) as e:
        stream.reset(f"audit answer failed: {e}"[:200])


# ---------------------------------------------------------------------------- asking


async def _fetch(rnd: _Round, rank: int, items: list[list], sizes: list[int]) -> list[Any]:
    """Ask member ``rank`` for ``items`` (expected sizes ``sizes``): one answer per item, or raise."""
    from .round import _Reader  # (round imports this module's users; import late)

    cfg, member = rnd.cfg, rnd.group.members[rank]
    host = rnd.svc.host
    conn = host.connection(member.peer_id)
    if conn is None:
        if member.addr is None:
            raise PeerUnreachable("no connection to a client-mode member")
        conn = await host.connect(member.addr[0], member.addr[1], member.peer_id, cfg.connect_timeout)
    stream = await conn.open_stream(AUDIT_PROTOCOL, {"g": rnd.group.group_id, "q": items})
    done = False
    try:
        stream.write_eof()
        reader = _Reader(stream, max(sizes, default=0))
        head = bytearray(_PREFIX.size)
        out: list[Any] = []
        for size in sizes:
            if await reader.readinto(memoryview(head), cfg.stall_timeout) < len(head):
                raise ProtocolError("audit answer ended early")
            (ln,) = _PREFIX.unpack(head)
            body = bytearray(min(ln, _MAX_META + 1))
            if ln > _MAX_META or await reader.readinto(memoryview(body), cfg.stall_timeout) < ln:
                raise ProtocolError("malformed audit answer")
            meta = unpack(bytes(body))
            if isinstance(meta, dict) and "e" in meta:
                out.append(str(meta["e"])[:200])
                continue
            w = meta.get("w") if isinstance(meta, dict) else None
            if (meta.get("n") if isinstance(meta, dict) else None) != size or isinstance(w, bool) \
                    or not isinstance(w, (int, float)) or not 0 < w <= cfg.max_weight:
                raise ProtocolError("malformed audit answer")
            data = await reader.read_exact(size, cfg.read_timeout(size))
            if data is None:
                raise ProtocolError("audit answer ended early")
            out.append((float(w), bytearray(data)))
        done = True
        return out
    finally:
        if not done:
            stream.reset("audit aborted")


async def _ask(rnd: _Round, wanted: dict[int, list[tuple[list, int]]]) -> dict[int, list[Any]]:
    """``wanted``: rank -> [(item, size)]; every member asked at once. A member that fails answers
    its reason for every item."""

    async def one(rank: int, req: list[tuple[list, int]]) -> list[Any]:
        total = sum(s for _, s in req)
        try:
            async with asyncio.timeout(rnd.cfg.connect_timeout + rnd.cfg.read_timeout(total)):
                return await _fetch(rnd, rank, [i for i, _ in req], [s for _, s in req])
        except (DHTError, TimeoutError, ProtocolError, OSError) as e:
            return [f"could not ask it: {e}"[:200]] * len(req)

    ranks = sorted(wanted)
    got = await asyncio.gather(*(one(r, wanted[r]) for r in ranks))
    return dict(zip(ranks, got))


# ---------------------------------------------------------------------------- one round's audit


@dataclass(eq=False)
class _Chunk:
    owner: int
    ci: int
    a: int
    b: int
    contributors: set[int]
    parts: dict[int, Part] = field(default_factory=dict)  # rank -> part as its sender showed it
    copies: dict[int, Part] | None = None  # the owner's copies (asked for on a mismatch)


class _Audit:
    """The auditor's side of one round (``rnd`` after its run, ``result`` its result)."""

    def __init__(self, rnd: _Round, result: AllReduceResult, per_shard: int):
        self.rnd, self.result, self.per_shard = rnd, result, per_shard
        self.me, self.members = rnd.rank, rnd.group.members
        self.codec = rnd.ledger.codec if rnd.ledger is not None else None
        self.gname = getattr(rnd.gcodec, "name", "?")
        self.rng = random.SystemRandom()  # an owner must not predict which chunks we draw
        self.caps: dict[int, float] = {}  # owner -> weight cap at that owner (from its own weight)
        self.named: dict[int, str] = {}  # owner -> why it failed the audit
        self.checked = self.mismatched = 0

    # -- parts
    def _nbytes(self, n: int) -> int:
        return self.rnd._enc_nbytes(self.codec, n)

    def _decode(self, buf: Any, n: int) -> torch.Tensor | None:
        out = torch.empty(n, dtype=torch.float32)
        try:
            self.codec.decode(dict(self.rnd.rmeta, numel=n), buf, out=out)
        except CompressionError:
            return None
        return out

    def _cap(self, owner: int) -> float:
        return self.caps.get(owner, weight_cap(self.members, self.rnd.weight))

    def _sent_part(self, c: _Chunk, rank: int, answer: Any) -> Part | None:
        """A member's part of ``c`` from its answer (its own header weight, counted as the owner counts it)."""
        if not isinstance(answer, tuple):
            return None
        values = self._decode(answer[1], c.b - c.a)
        return None if values is None else (counted_weight(self.members[rank], answer[0], self._cap(c.owner)), values)

    @staticmethod
    def _row(answer: Any, n: int) -> Part | None:
        """A row as an owner combined it (weight as counted there, float32 values)."""
        if not isinstance(answer, tuple) or len(answer[1]) != 4 * n:
            return None
        values = torch.frombuffer(answer[1], dtype=torch.float32)
        return (answer[0], values) if bool(torch.isfinite(values).all()) else None

    def _mine(self, c: _Chunk) -> Part | None:
        assert self.rnd.ledger is not None
        data = self.rnd.ledger.sent_bytes(c.owner, c.ci)
        values = None if data is None else self._decode(data, c.b - c.a)
        if values is None:
            return None
        return counted_weight(self.members[self.me], self.rnd.weight, self._cap(c.owner)), values

    # -- plan
    def plan(self) -> list[_Chunk]:
        out = []
        for s in self.result.shards:
            if s.owner == self.me or s.status != "ok" or not s.numel:
                continue
            cks = chunks(s.start, s.end, self.rnd.cn)
            n = len(cks)
            drawn = range(n) if n <= self.per_shard else sorted(self.rng.sample(range(n), self.per_shard))
            for ci in drawn:
                who = set(s.contributors) | {r for r, k in s.partial.items() if k > ci}
                out.append(_Chunk(s.owner, ci, *cks[ci], who))
        return out

    # -- waves
    async def first_look(self, todo: list[_Chunk]) -> list[_Chunk]:
        """Ask every contributor for its part of each drawn chunk and each owner for its own row;
        the chunks whose reply does not match (or lack a part) are returned."""
        wanted: dict[int, list[tuple[list, int]]] = {}
        back: list[tuple[_Chunk, int, int]] = []  # (chunk, rank asked, index of its answer)
        for c in todo:
            for r in sorted(c.contributors - {self.me}):
                item, size = ((["r", c.ci, r], 4 * (c.b - c.a)) if r == c.owner
                              else (["s", c.owner, c.ci], self._nbytes(c.b - c.a)))
                wanted.setdefault(r, []).append((item, size))
                back.append((c, r, len(wanted[r]) - 1))
        answers = await _ask(self.rnd, wanted)
        for c, r, i in back:  # the owners' own rows first: they set the weight caps
            if r == c.owner and (row := self._row(answers[r][i], c.b - c.a)) is not None:
                c.parts[r] = row
                self.caps.setdefault(c.owner, weight_cap(self.members, row[0]))
        bad = []
        for c in todo:
            mine = self._mine(c)
            if mine is None:
                continue  # (we did not send it whole: not a chunk we can check)
            c.parts[self.me] = mine
        for c, r, i in back:
            if r != c.owner and (part := self._sent_part(c, r, answers[r][i])) is not None:
                c.parts[r] = part
        for c in todo:
            if self.me not in c.parts:
                continue
            self.checked += 1
            if self.me not in c.contributors or c.owner not in c.contributors:
                self.named.setdefault(c.owner, "left us (or itself) out of the contributors it reported, yet replied")
                continue
            if c.contributors <= c.parts.keys():
                value = await self.rnd._compute(recompute, self.rnd.agg, c.parts)
                if agrees(self.rnd.flat[c.a : c.b], value, self.gname):
                    continue
            bad.append(c)
        return bad

    async def settle(self, bad: list[_Chunk]) -> None:
        """Ask the owners of mismatching chunks for the parts they combined, and judge."""
        wanted: dict[int, list[tuple[list, int]]] = {}
        for c in bad:
            for r in sorted(c.contributors):
                wanted.setdefault(c.owner, []).append((["r", c.ci, r], 4 * (c.b - c.a)))
        answers = await _ask(self.rnd, wanted)
        at: dict[int, int] = {}
        for c in bad:
            got = answers[c.owner][at.get(c.owner, 0) : at.get(c.owner, 0) + len(c.contributors)]
            at[c.owner] = at.get(c.owner, 0) + len(c.contributors)
            rows = {r: row for r, a in zip(sorted(c.contributors), got) if (row := self._row(a, c.b - c.a)) is not None}
            c.copies = rows if rows else None
            if c.owner in self.named:
                continue
            reply = self.rnd.flat[c.a : c.b]
            supplied = {r: p for r, p in c.parts.items() if r not in (self.me, c.owner)}
            verdict = judge(self.rnd.agg, reply, self.gname, c.contributors, self.me, c.parts[self.me], supplied,
                            c.copies)
            if verdict.cheat is not None:
                self.named[c.owner] = verdict.cheat
                continue
            # no proof against the owner: believe each part as its sender showed it, the owner's
            # copies only where a sender showed nothing
            parts = {**{r: p for r, p in (c.copies or {}).items()}, **c.parts}
            value = await self.rnd._compute(recompute, self.rnd.agg, parts)
            if not agrees(reply, value, self.gname):
                self.mismatched += 1
                self.rnd.flat[c.a : c.b].copy_(value)
                log.warning("all-reduce %s: audit of owner %d, chunk %d: the parts of ranks %s differ from the "
                            "owner's copies (one of the two lied); using the parts as their senders show them",
                            self.rnd.group.group_id.hex()[:8], c.owner, c.ci, verdict.disputed)

    async def exclude(self, owner: int, why: str, seen: list[_Chunk]) -> None:
        """Recompute ``owner``'s whole shard from the other members' parts, without its own."""
        s = next(s for s in self.result.shards if s.owner == owner)
        have = {c.ci: c for c in seen if c.owner == owner}
        todo = []
        for ci, (a, b) in enumerate(chunks(s.start, s.end, self.rnd.cn)):
            who = set(s.contributors) | {r for r, k in s.partial.items() if k > ci}
            todo.append(have.get(ci) or _Chunk(owner, ci, a, b, who))
        wanted: dict[int, list[tuple[list, int]]] = {}
        back = []
        for c in todo:
            if self.me not in c.parts and (mine := self._mine(c)) is not None:
                c.parts[self.me] = mine
            for r in sorted(c.contributors - {self.me, owner} - c.parts.keys()):
                wanted.setdefault(r, []).append((["s", owner, c.ci], self._nbytes(c.b - c.a)))
                back.append((c, r, len(wanted[r]) - 1))
        answers = await _ask(self.rnd, wanted) if wanted else {}
        for c, r, i in back:
            if (part := self._sent_part(c, r, answers[r][i])) is not None:
                c.parts[r] = part
        for c in todo:
            parts = {r: p for r, p in c.parts.items() if r != owner}
            if self.me in parts:
                self.rnd.flat[c.a : c.b].copy_(await self.rnd._compute(recompute, self.rnd.agg, parts))
        s.contributors = sorted(set(s.contributors) - {owner})
        s.error = f"recomputed by the audit without its owner ({why})"
        self.result.failed[owner] = f"owner {owner} failed the audit of its shard: {why}; its shard was recomputed " \
                                    f"from the members' parts without it"
        log.warning("all-reduce %s: rank %d %s", self.rnd.group.group_id.hex()[:8], owner, self.result.failed[owner])


async def audit_round(rnd: _Round, result: AllReduceResult, per_shard: int) -> None:
    """Audit the other owners' replies of ``rnd`` (over, ``result`` its result): fixes ``rnd.flat``
    and names cheating owners in ``result.failed``. Bounded by the round's ``timeout``."""
    t0 = time.monotonic()
    audit = _Audit(rnd, result, per_shard)
    todo = audit.plan() if audit.codec is not None else []
    if not todo:
        return
    async with asyncio.timeout(rnd.cfg.timeout):
        bad = await audit.first_look(todo)
        if bad:
            await audit.settle(bad)
        for owner, why in sorted(audit.named.items()):
            await audit.exclude(owner, why, todo)
    log.debug("all-reduce %s: audited %d chunks in %.3f s (%d owners named, %d disputes)",
              rnd.group.group_id.hex()[:8], audit.checked, time.monotonic() - t0, len(audit.named), audit.mismatched)
