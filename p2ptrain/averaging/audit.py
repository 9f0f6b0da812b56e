"""Shard audits: under a robust rule each member checks, after its round, that every other owner's
reply is the rule over the members' parts, so that an owner cannot set the others' values beyond
what the rule allows.

What is checked: of every other owner's shard, ``AuditConfig.chunks`` chunks drawn at random (all of
a shard that small: the examples' models are checked whole, every round, by every member), and of
each drawn chunk, under a coordinate-wise rule (``trimmed_mean``, ``median``), every ``stride``-th
value from a random offset (``centered_clip`` mixes a chunk's values: whole chunks). The parts of
those values are fetched from each contributor and the rule recomputed. Tampering with a run of
``stride`` values or more is always found; a value tampered alone escapes one auditor with
probability ``1 - 1 / stride``, so an owner that moves enough values to matter is caught; the
draws are the auditor's own (``random.SystemRandom``), made after the owner replied.

Why audits and not two owners per shard: a second owner doubles the reduce traffic and the rule's
work in every round, and two colluding owners of one shard (2 hostile peers of 8 share one in
about a quarter of the rounds) still pass. What audits cost: ``benchmarks/allreduce_bench.py --codecs
none+trimmed_mean none+trimmed_mean+noaudit`` (a rule with and without its audits, same run).

Protocol ``p2ptrain/allreduce-audit/1``: the auditor opens one stream per member it asks, header
``{"g": group id, "q": [[kind, x, y, offset, stride], ...]}`` with kind ``"s"`` (your part of
chunk ``y`` of owner ``x``'s shard, as you sent it) or ``"r"`` (you are the owner: row ``y`` of
your chunk ``x``, as you combined it), half-closes, and reads per item ``u32 length | msgpack
{"w": weight, "n": bytes}`` and the float32 values ``[offset::stride]`` of that part, or ``{"e":
why}``. What members keep for this is their :class:`.ledger.Ledger`.

Who is believed (see :mod:`.verify`): each part as its sender shows it. A member that shows the
auditor another part than it sent the owner only changes a hostile row, which the rule tolerates;
it cannot frame an honest owner, because a mismatch is attributed with the owner's own copies: the
owner is named (``failed``, hence the optimizer's ``stats.excluded``) only if it misreports the
auditor's own part or its reply is not the rule over the parts it shows. A named owner's whole shard
is recomputed from the members' parts without its own; a mismatch that only a dispute between
another member and the owner explains is fixed for that chunk and named to nobody.

Not covered: ``mean`` (it trusts peers: no audit); an owner that drops honest senders as if they
had failed (each of them names it, the others average without them); tampering confined to values
no auditor drew this round.
"""

from __future__ import annotations

import asyncio
import logging
import random
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dht import DHTError, PeerUnreachable, ProtocolError, Stream, pack, unpack, wait_event

from .group import counted_weight, weight_cap
from .ledger import Ledger, chunks
from .protocol import Reader
from .verify import Part, agrees, judge, recompute

if TYPE_CHECKING:
    from .context import RoundContext
    from .round_types import AllReduceResult

__all__ = ["AUDIT_PROTOCOL", "AuditConfig", "audit_round", "serve"]

log = logging.getLogger("p2ptrain.allreduce.audit")

AUDIT_PROTOCOL = "p2ptrain/allreduce-audit/1"
_PREFIX = struct.Struct(">I")
_MAX_META = 256
MAX_ITEMS = 1 << 14  # items one audit stream may ask for
#: rules whose value at a coordinate depends on that coordinate only: audited on strided samples
COORDINATE_WISE = ("trimmed_mean", "median")


@dataclass
class AuditConfig:
    """``chunks``: chunks of every other owner's shard a member checks per round under a robust rule
    (0: no audits); ``stride``: of those, every ``stride``-th value under a coordinate-wise rule (1:
    all); ``owners``: audit only this many other owners per round, drawn at random (None: all; fewer
    is cheaper, but the values of an owner not drawn are taken unchecked that round). ``kept``: rounds
    whose ledgers a service keeps for the others' audits (each about two vectors' bytes: what we
    sent, and the rows we combined). ``max_streams``: audit streams one member may open per round of
    ours (an auditor needs at most three)."""

    chunks: int = 1
    stride: int = 16
    owners: int | None = None
    kept: int = 2
    max_streams: int = 4


Item = tuple[str, int, int, int, int]  # (kind, x, y, offset, stride): see the module docstring


def _sampled(n: int, off: int, stride: int) -> int:
    return len(range(off, n, stride))


# ---------------------------------------------------------------------------- serving


def _parse_items(q: Any) -> list[Item] | None:
    if not isinstance(q, list) or len(q) > MAX_ITEMS:
        return None
    out = []
    for item in q:
        if not (isinstance(item, list) and len(item) == 5 and item[0] in ("s", "r")
                and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 31 for v in item[1:])
                and item[4] >= 1):
            return None
        out.append((item[0], item[1], item[2], item[3], item[4]))
    return out


def _lookup(ledger: Ledger, item: Item) -> tuple[float, torch.Tensor] | None:
    kind, x, y, off, stride = item
    if kind == "s":
        values = ledger.sent_values(x, y) if x < ledger.group.size else None
        got = None if values is None else (ledger.weight, values)
    else:
        got = ledger.row(x, y) if x < len(ledger.my_chunks) and y < ledger.group.size else None
    return None if got is None else (got[0], got[1][off::stride].contiguous())


async def serve(ledger: Ledger, stream: Stream, wait: float, write_timeout: float,
                answer: Callable[[str, int, int, torch.Tensor], torch.Tensor] | None = None) -> None:
    """Answer one audit stream from what ``ledger`` holds; what we do not hold yet is waited for
    until our round is over (at most ``wait`` seconds). ``answer`` (the service's extension
    point: a member that lies to auditors) may replace the values of each answer."""
    hdr = stream.header
    items = _parse_items(hdr.get("q") if isinstance(hdr, dict) else None)
    if items is None:
        stream.reset("malformed audit request")
        return
    try:
        for item in items:
            got = _lookup(ledger, item)
            if got is None and await wait_event(ledger.finished, wait):
                got = _lookup(ledger, item)
            if got is not None and answer is not None:
                got = (got[0], answer(item[0], item[1], item[2], got[1]))
            data = None if got is None else memoryview(got[1].numpy()).cast("B")
            body = pack({"e": "not held"} if data is None else {"w": got[0], "n": len(data)})  # type: ignore[index]
            await stream.write(_PREFIX.pack(len(body)) + body, timeout=write_timeout)
            if data is not None:
                await stream.write(data, timeout=write_timeout)
        stream.write_eof()
    except (DHTError, TimeoutError) as e:
        stream.reset(f"audit answer failed: {e}"[:200])


# ---------------------------------------------------------------------------- asking


async def _fetch(rnd: RoundContext, rank: int, items: list[Item], sizes: list[int]) -> list[Any]:
    """Ask member ``rank`` for ``items`` (of ``sizes`` values): per item (weight, float32 values)
    or why there is none; raises if the member cannot be asked or answers out of protocol."""

    cfg, member = rnd.cfg, rnd.group.members[rank]
    host = rnd.res.host
    conn = host.connection(member.peer_id)
    if conn is None:
        if not member.reach:
            raise PeerUnreachable("no connection to a client-mode member")
        conn = await member.reach.dial(host, member.peer_id, cfg.connect_timeout)
    stream = await conn.open_stream(AUDIT_PROTOCOL, {"g": rnd.group.group_id, "q": [list(i) for i in items]})
    done = False
    try:
        stream.write_eof()
        reader = Reader(stream, 4 * max(sizes, default=0))
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
            if (meta.get("n") if isinstance(meta, dict) else None) != 4 * size or isinstance(w, bool) \
                    or not isinstance(w, (int, float)) or not 0 < w <= cfg.max_weight:
                raise ProtocolError("malformed audit answer")
            data = await reader.read_exact(4 * size, cfg.read_timeout(4 * size))
            if data is None:
                raise ProtocolError("audit answer ended early")
            values = torch.frombuffer(bytearray(data), dtype=torch.float32) if size else torch.empty(0)
            out.append((float(w), values) if bool(torch.isfinite(values).all()) else "NaN or inf in its answer")
        done = True
        return out
    finally:
        if not done:
            stream.reset("audit aborted")


async def _ask(rnd: RoundContext, wanted: dict[int, list[tuple[Item, int]]]) -> dict[int, list[Any]]:
    """``wanted``: rank -> [(item, values expected)]; every member asked at once. A member that
    fails answers its reason for each item."""

    async def one(rank: int, req: list[tuple[Item, int]]) -> list[Any]:
        total = 4 * sum(s for _, s in req)
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
    """One drawn chunk [a, b) of ``owner``'s shard, audited at values ``[off::stride]`` of it."""

    owner: int
    ci: int
    a: int
    b: int
    contributors: set[int]
    off: int = 0
    stride: int = 1
    parts: dict[int, Part] = field(default_factory=dict)  # rank -> part as its sender showed it
    copies: dict[int, Part] | None = None  # the owner's copies (asked for on a mismatch)

    @property
    def size(self) -> int:
        return _sampled(self.b - self.a, self.off, self.stride)

    def item(self, rank: int) -> tuple[Item, int]:
        """What to ask ``rank`` for (its part; the owner: its own row), and how many values."""
        head = ("r", self.ci, rank) if rank == self.owner else ("s", self.owner, self.ci)
        return (*head, self.off, self.stride), self.size

    def reply(self, flat: torch.Tensor) -> torch.Tensor:
        """The values of ``flat`` audited, on the host (no copy where ``flat`` is there)."""
        return flat[self.a : self.b][self.off :: self.stride].cpu()


class _Audit:
    """The auditor's side of one round (``rnd`` after its run, ``result`` its result)."""

    def __init__(self, rnd: RoundContext, result: AllReduceResult, cfg: AuditConfig):
        self.rnd, self.result, self.cfg = rnd, result, cfg
        self.me, self.members = rnd.rank, rnd.group.members
        self.gname = getattr(rnd.gcodec, "name", "?")
        self.rng = random.SystemRandom()  # an owner must not predict what we draw
        self.caps: dict[int, float] = {}  # owner -> weight cap at that owner (from its own weight)
        self.named: dict[int, str] = {}  # owner -> why it failed the audit
        self.checked = self.disputes = 0

    def _cap(self, owner: int) -> float:
        return self.caps.get(owner, weight_cap(self.members, self.rnd.weight))

    def _sent_part(self, c: _Chunk, rank: int, answer: Any) -> Part | None:
        """A member's part from its answer: its header weight, counted as its owner counts it."""
        if not isinstance(answer, tuple) or answer[1].numel() != c.size:
            return None
        return counted_weight(self.members[rank], answer[0], self._cap(c.owner)), answer[1]

    @staticmethod
    def _copy(c: _Chunk, answer: Any) -> Part | None:
        """A row as the owner combined it (the weight it counted it with)."""
        return answer if isinstance(answer, tuple) and answer[1].numel() == c.size else None

    def _mine(self, c: _Chunk) -> Part | None:
        assert self.rnd.ledger is not None
        values = self.rnd.ledger.sent_values(c.owner, c.ci)
        if values is None:
            return None
        w = counted_weight(self.members[self.me], self.rnd.weight, self._cap(c.owner))
        return w, values[c.off :: c.stride].contiguous()

    async def _ask_parts(self, todo: list[_Chunk], ranks: Callable[[_Chunk], list[int]]) -> None:
        """Fill each chunk's ``parts`` with what ``ranks(chunk)`` show (owners first: their own
        weight sets the weight cap at that owner)."""
        wanted: dict[int, list[tuple[Item, int]]] = {}
        back: list[tuple[_Chunk, int, int]] = []  # (chunk, rank asked, index of its answer)
        for c in todo:
            for r in ranks(c):
                wanted.setdefault(r, []).append(c.item(r))
                back.append((c, r, len(wanted[r]) - 1))
        answers = await _ask(self.rnd, wanted) if wanted else {}
        for c, r, i in back:
            if r == c.owner and (row := self._copy(c, answers[r][i])) is not None:
                c.parts[r] = row
                self.caps.setdefault(c.owner, weight_cap(self.members, row[0]))
        for c in todo:
            if self.me not in c.parts and (mine := self._mine(c)) is not None:
                c.parts[self.me] = mine
        for c, r, i in back:
            if r != c.owner and (part := self._sent_part(c, r, answers[r][i])) is not None:
                c.parts[r] = part

    # -- the waves
    def plan(self) -> list[_Chunk]:
        out = []
        stride = max(1, self.cfg.stride) if self.rnd.agg in COORDINATE_WISE else 1
        shards = [s for s in self.result.shards if s.owner != self.me and s.status == "ok" and s.numel]
        if self.cfg.owners is not None and len(shards) > self.cfg.owners:
            shards = self.rng.sample(shards, max(0, self.cfg.owners))
        for s in shards:
            cks = chunks(s.start, s.end, self.rnd.cn)
            n, k = len(cks), self.cfg.chunks
            for ci in (range(n) if n <= k else sorted(self.rng.sample(range(n), k))):
                who = set(s.contributors) | {r for r, done in s.partial.items() if done > ci}
                a, b = cks[ci]
                out.append(_Chunk(s.owner, ci, a, b, who, self.rng.randrange(min(stride, b - a)), stride))
        return out

    async def first_look(self, todo: list[_Chunk]) -> list[_Chunk]:
        """Fetch every contributor's part of the drawn values; returns the chunks whose reply does
        not match the rule over them (or that lack a part)."""
        await self._ask_parts(todo, lambda c: sorted(c.contributors - {self.me}))
        bad = []
        for c in todo:
            if self.me not in c.parts:
                continue  # (we did not send it whole: not ours to check)
            self.checked += 1
            if self.me not in c.contributors or c.owner not in c.contributors:
                self.named.setdefault(c.owner, "left us (or itself) out of the contributors it reported, yet replied")
            elif not (c.contributors <= c.parts.keys()
                      and agrees(c.reply(self.rnd.flat), await self.rnd.compute(recompute, self.rnd.agg, c.parts),
                                 self.gname)):
                bad.append(c)
        return bad

    async def settle(self, bad: list[_Chunk]) -> None:
        """Ask the owners of mismatching chunks for the parts they combined, and judge."""
        wanted: dict[int, list[tuple[Item, int]]] = {}
        for c in bad:
            for r in sorted(c.contributors):
                wanted.setdefault(c.owner, []).append((("r", c.ci, r, c.off, c.stride), c.size))
        answers = await _ask(self.rnd, wanted)
        at: dict[int, int] = {}
        for c in bad:
            i = at.get(c.owner, 0)
            at[c.owner] = i + len(c.contributors)
            got = zip(sorted(c.contributors), answers[c.owner][i : i + len(c.contributors)])
            c.copies = {r: row for r, a in got if (row := self._copy(c, a)) is not None} or None
            if c.owner in self.named:
                continue
            supplied = {r: p for r, p in c.parts.items() if r not in (self.me, c.owner)}
            reply = c.reply(self.rnd.flat)
            verdict = judge(self.rnd.agg, reply, self.gname, c.contributors, self.me, c.parts[self.me], supplied,
                            c.copies)
            if verdict.cheat is not None:
                self.named[c.owner] = verdict.cheat
                continue
            # no proof against the owner: believe each part as its sender shows it, the owner's
            # copies only where a sender showed nothing
            value = await self.rnd.compute(recompute, self.rnd.agg, {**(c.copies or {}), **c.parts})
            if not agrees(reply, value, self.gname):
                self.disputes += 1
                if c.stride == 1:  # (a strided sample cannot fix the chunk; the dispute is logged)
                    self.rnd.flat[c.a : c.b].copy_(value)
                log.warning("all-reduce %s: audit of owner %d, chunk %d: the parts of ranks %s differ from the "
                            "owner's copies (one of the two lied); using the parts as their senders show them",
                            self.rnd.group.group_id.hex()[:8], c.owner, c.ci, verdict.disputed)

    async def exclude(self, owner: int, why: str) -> None:
        """Recompute ``owner``'s whole shard from the other members' parts, without its own."""
        s = next(s for s in self.result.shards if s.owner == owner)
        todo = [_Chunk(owner, ci, a, b, set(s.contributors) | {r for r, k in s.partial.items() if k > ci})
                for ci, (a, b) in enumerate(chunks(s.start, s.end, self.rnd.cn))]
        await self._ask_parts(todo, lambda c: sorted(c.contributors - {self.me, owner}))
        for c in todo:
            parts = {r: p for r, p in c.parts.items() if r != owner}
            if self.me in parts:
                self.rnd.flat[c.a : c.b].copy_(await self.rnd.compute(recompute, self.rnd.agg, parts))
        s.contributors = sorted(set(s.contributors) - {owner})
        s.error = f"recomputed by the audit without its owner ({why})"
        self.result.failed[owner] = (f"owner {owner} failed the audit of its shard: {why}; its shard was "
                                     "recomputed from the members' parts without it")
        log.warning("all-reduce %s: %s", self.rnd.group.group_id.hex()[:8], self.result.failed[owner])


async def audit_round(rnd: RoundContext, result: AllReduceResult, cfg: AuditConfig) -> None:
    """Audit the other owners' replies of ``rnd`` (over; ``result`` its result): fixes ``rnd.flat``
    and names cheating owners in ``result.failed``. Bounded by the round's ``timeout``."""
    t0 = time.monotonic()
    audit = _Audit(rnd, result, cfg)
    todo = audit.plan()
    if not todo:
        return
    async with asyncio.timeout(rnd.cfg.timeout):
        bad = await audit.first_look(todo)
        if bad:
            await audit.settle(bad)
        for owner, why in sorted(audit.named.items()):
            await audit.exclude(owner, why)
    log.debug("all-reduce %s: audited %d chunks in %.3f s (%d owners named, %d disputes)",
              rnd.group.group_id.hex()[:8], audit.checked, time.monotonic() - t0, len(audit.named), audit.disputes)
