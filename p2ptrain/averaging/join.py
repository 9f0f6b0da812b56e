"""The lead/follow/join protocol of matchmaking: once a peer has planned its group, the leader opens
it and closes it when its members have joined; a member calls ``JOIN_METHOD`` on its leader (the
call stays open until the group closes), follows redirects, and checks the group it gets back."""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from collections import OrderedDict
from typing import Any

from dht import DHTError, DHTNode, Host, PeerID, wait_event

from .board import Board
from .claims import VERSION as _VERSION
from .claims import join_reply_group, verify_group
from .group import Group, Member
from .mm_state import Lead, MatchRound
from .plan import MAX_ROUND_ID, MIN_SETTLE, plan_groups, score
from .schema import Schema

log = logging.getLogger("p2ptrain.matchmaking")

JOIN_METHOD = "p2ptrain.mm.join"
#: How long a leader waits, at least, for the members it planned (it closes at once when all have
#: joined, so this only costs time when one of them vanished). It covers one lost packet of a join:
#: TCP's minimum retransmission timeout is 200 ms, and members end gathering up to a few read
#: latencies apart. At 0.2 s, 4 hosts on 1%-loss links split a round (3 + 1) in 3 of 65 trials: the
#: last member's join came after the leader had closed.
_MIN_LEAD_WINDOW = 0.5


class JoinDispatcher:
    """Routes join calls arriving at one host to the Matchmaker of their prefix."""

    _by_host: weakref.WeakKeyDictionary[Host, JoinDispatcher] = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self.matchmakers: dict[str, JoinProtocol] = {}

    @classmethod
    def register(cls, host: Host, mm: JoinProtocol) -> None:
        disp = cls._by_host.get(host)
        if disp is None:
            disp = cls._by_host[host] = cls()
            host.on_request(JOIN_METHOD, disp.on_join)
        if mm.prefix in disp.matchmakers and disp.matchmakers[mm.prefix] is not mm:
            raise ValueError(f"this node already runs a Matchmaker for {mm.prefix!r}")
        disp.matchmakers[mm.prefix] = mm

    @classmethod
    def unregister(cls, host: Host, mm: JoinProtocol) -> None:
        disp = cls._by_host.get(host)
        if disp is not None and disp.matchmakers.get(mm.prefix) is mm:
            del disp.matchmakers[mm.prefix]

    async def on_join(self, conn: Any, args: Any) -> Any:
        if not isinstance(args, dict) or not isinstance(args.get("prefix"), str):
            raise ValueError("malformed join request")
        mm = self.matchmakers.get(args["prefix"])
        if mm is None:
            raise ValueError(f"this peer does not average {args['prefix'][:100]!r}")
        return await mm._on_join(conn, args)


class JoinProtocol:
    """The leader's and the member's side of a round's join, mixed into ``Matchmaker``, whose
    attributes below it uses. ``_on_join`` and ``_accept`` are looked up on the instance, so a test
    peer may replace them."""

    node: DHTNode
    prefix: str
    schema: Schema
    board: Board
    target_group_size: int
    client_mode: bool
    _rounds: OrderedDict[str, MatchRound]
    _closed: bool
    latency: float

    async def _attempt(self, rnd: MatchRound, me: Member, view: list[Member], timeout: float,
                       deadline: float, failed: set[PeerID]) -> Group | None:
        plan = plan_groups(view, rnd.key, self.target_group_size)
        mine = next((g for g in plan if any(m.peer_id == me.peer_id for m in g)), None)
        if mine is None or len(mine) < rnd.min_size:
            await asyncio.sleep(min(MIN_SETTLE, max(0.0, deadline - asyncio.get_running_loop().time())))
            return None
        if mine[0].peer_id == me.peer_id:
            window = max(_MIN_LEAD_WINDOW, 2 * rnd.settle, 6 * self.latency)
            return await self._lead(rnd, me, mine, window, deadline)
        return await self._follow(rnd, me, mine[0], timeout, deadline, failed, mine)

    async def _lead(self, rnd: MatchRound, me: Member, planned: list[Member], window: float,
                    deadline: float) -> Group | None:
        loop = asyncio.get_running_loop()
        margin = max(0.05, 2 * self.latency)
        now = loop.time()
        lead = Lead(expected={m.peer_id for m in planned if m.peer_id != me.peer_id}, opened_at=now,
                     close_at=min(now + window, deadline - margin))
        lead.done = loop.create_future()
        rnd.lead = lead
        rnd.set_state("leading")
        rnd.mark("leading")
        while True:
            if len(lead.joined) + 1 >= self.target_group_size or lead.expected <= set(lead.joined):
                break
            delay = lead.close_at - loop.time()
            if delay <= 0:
                break
            lead.wake.clear()
            await wait_event(lead.wake, delay)
        lead.closed = True
        rnd.mark("closed")
        log.debug("round %s: leading, closed with %d joined of %d expected (+%d unexpected)", rnd.round_id,
                  len(lead.joined), len(lead.expected), len(set(lead.joined) - lead.expected))
        members = [me] + sorted(lead.joined.values(), key=lambda m: score(m.peer_id, rnd.key))
        if len(members) < rnd.min_size:
            lead.done.set_result(None)
            rnd.lead = None
            return None
        group = Group(os.urandom(16), tuple(members))
        lead.done.set_result(group)
        return group

    async def _follow(self, rnd: MatchRound, me: Member, leader: Member, timeout: float, deadline: float,
                      failed: set[PeerID], planned: list[Member] = ()) -> Group | None:
        """Join ``leader``, telling it whom else we ``planned`` in its group: a leader that settled
        on a smaller view then waits for them too, instead of closing without them."""
        loop = asyncio.get_running_loop()
        others = [m.peer_id.to_bytes() for m in planned if m.peer_id not in (me.peer_id, leader.peer_id)]
        rnd.redirect = leader
        rnd.set_state("following")
        for _hop in range(4):
            remaining = deadline - loop.time() - 0.02
            if remaining <= 0:
                return None
            args = {
                "v": _VERSION, "prefix": self.prefix, "schema": self.schema.hash, "round": rnd.round_id,
                "member": me.to_wire(), "remaining": remaining, "expect": others[:self.target_group_size],
            }
            rnd.mark("join_sent")
            try:
                reply = await self.node.host.call(leader.peer_id, leader.addr, JOIN_METHOD, args, timeout=remaining,
                                                  relays=leader.relays)
                rnd.mark("join_answered")
            except (DHTError, OSError) as e:
                log.debug("round %s: leader %s failed: %s", rnd.round_id, leader.peer_id, e)
                failed.add(leader.peer_id)
                return None
            group = join_reply_group(reply, me.peer_id, leader.peer_id)
            if group is not None:  # taken only as every member registered itself (claims.py)
                why = await verify_group(group, me, leader.peer_id, rnd.registered,
                                         lambda: self.board.registered(rnd, deadline), rnd.min_size,
                                         self.target_group_size)
                if why is None:
                    return group
                log.warning("round %s: refusing the group leader %s formed: %s", rnd.round_id, leader.peer_id, why)
                failed.add(leader.peer_id)
                return None
            redirect = reply.get("redirect") if isinstance(reply, dict) else None
            try:
                target = Member.from_wire(redirect) if redirect is not None else None
            except (ValueError, TypeError):
                target = None
            if target is None or target.peer_id in failed:
                reason = reply.get("refused") if isinstance(reply, dict) else None
                log.debug("round %s: %s refused us: %s", rnd.round_id, leader.peer_id, str(reason)[:200])
                failed.add(leader.peer_id)
                return None
            if target.peer_id == me.peer_id:
                # Crossed views: the peer we follow follows us. The lower score leads.
                if score(me.peer_id, rnd.key) < score(leader.peer_id, rnd.key) and not self.client_mode:
                    window = max(_MIN_LEAD_WINDOW, 6 * self.latency)
                    return await self._lead(rnd, me, [me, leader], window, deadline)
                await asyncio.sleep(max(0.02, self.latency))
                continue
            if not target.reach:
                failed.add(leader.peer_id)
                return None
            leader = target
            rnd.redirect = leader
        return None

    # ------------------------------------------------------------------ join handler (untrusted input)

    async def _on_join(self, conn: Any, args: dict) -> Any:
        loop = asyncio.get_running_loop()
        if args.get("v") != _VERSION:
            raise ValueError("unsupported matchmaking version")
        round_id, schema_hash, remaining = args.get("round"), args.get("schema"), args.get("remaining")
        if not isinstance(round_id, str) or len(round_id) > MAX_ROUND_ID or not isinstance(schema_hash, str):
            raise ValueError("malformed join request")
        if isinstance(remaining, bool) or not isinstance(remaining, (int, float)) or not 0 < remaining <= 86_400:
            raise ValueError("malformed join request: remaining time")
        if schema_hash != self.schema.hash:
            raise ValueError(
                f"schema mismatch: this peer averages {self.prefix!r} with schema {self.schema.hash} "
                f"({len(self.schema.tensors)} tensors, {self.schema.numel} elements, codec {self.schema.codec}), "
                f"the join is for schema {schema_hash[:32]!r}; every peer of a run must train the same model "
                "with the same codec"
            )
        member = Member.from_wire(args.get("member"))
        if conn.remote_peer is None or member.peer_id != conn.remote_peer:
            raise ValueError("join names another peer than the caller")
        joiner_deadline = loop.time() + float(remaining)
        while True:
            rnd = self._rounds.get(round_id)
            if rnd is None or self._closed:
                return {"refused": f"not matchmaking for round {round_id!r}"}
            if rnd.state == "done":
                if rnd.group is not None and rnd.group.size > 1 and member in rnd.group.members:
                    return {"group": rnd.group.to_wire()}
                return {"refused": "already in a group for this round"}
            if rnd.state == "following":
                return {"redirect": rnd.redirect.to_wire() if rnd.redirect else None,
                        "refused": "not a leader"}
            if rnd.state == "leading" and rnd.lead is not None:
                self._widen(rnd.lead, args.get("expect"))
                return await self._accept(rnd, rnd.lead, member, joiner_deadline)
            # Still gathering: the joiner has settled, so should we; answer once our role is known.
            rnd.join_hint.set()
            wait = joiner_deadline - loop.time()
            if wait <= 0:
                return {"refused": "too late"}
            if not await wait_event(rnd.changed, wait):
                return {"refused": "too late"}

    def _widen(self, lead: Lead, expect: object) -> None:
        """Wait for the peers a joiner planned in our group too (its view may hold peers ours missed).
        A joiner that names peers who never come costs only the wait to ``close_at``: the window bounds it."""
        if lead.closed or not isinstance(expect, list):
            return
        for raw in expect[:self.target_group_size]:
            if len(lead.expected) + 1 >= self.target_group_size:
                break
            try:
                peer = PeerID(raw)
            except (ValueError, TypeError):
                continue
            if peer != self.node.peer_id:
                lead.expected.add(peer)

    async def _accept(self, rnd: MatchRound, lead: Lead, member: Member, joiner_deadline: float) -> Any:
        loop = asyncio.get_running_loop()
        assert lead.done is not None
        if lead.closed:
            return {"refused": "group already closed"}
        if member.peer_id not in lead.joined:
            if len(lead.joined) + 1 >= self.target_group_size:
                return {"refused": "group is full"}
            if rnd.registered.get(member.peer_id, member) != member:  # the others would refuse the group
                return {"refused": "your join differs from your registration for this round"}
            lead.joined[member.peer_id] = member
            # Close in time for this joiner to get the answer before it gives up, but not sooner
            # than half the minimum window (a joiner in a hurry is dropped, not obeyed).
            lead.close_at = min(lead.close_at, max(joiner_deadline - max(0.05, 2 * self.latency),
                                                   lead.opened_at + _MIN_LEAD_WINDOW / 2))
            lead.wake.set()
        try:
            group = await asyncio.wait_for(asyncio.shield(lead.done), max(0.0, joiner_deadline - loop.time()))
        except (asyncio.CancelledError, TimeoutError) as e:
            if not lead.done.done():  # the joiner gave up or went away: do not count it in
                lead.joined.pop(member.peer_id, None)
                lead.expected.discard(member.peer_id)
                lead.wake.set()
            if isinstance(e, asyncio.CancelledError):
                raise
            return {"refused": "the group did not close before your deadline"}
        if group is None:
            return {"refused": "too few peers joined"}
        return {"group": group.to_wire()}
