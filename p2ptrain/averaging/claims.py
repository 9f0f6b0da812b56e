"""What a peer believes of the matchmaking messages of others (sans-IO, but for ``verify_group``'s
one optional re-read): registrations read from the DHT, and the group a leader hands its joiners.

A leader chooses the group's members, their order, addresses, bandwidths and weights: a hostile
one could give itself every shard (the others' bandwidth 0), point a member's address elsewhere,
or fill the group with peers that never registered. So a joiner takes a group
only if it is the size this round allows, led by the leader it asked, with our own entry as we
declared it, and every other member exactly as that member registered itself for the round
(owner-signed sub-keys, read from the DHT); a member we have not seen is looked up once more.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from dht import PeerID

from .group import Group, Member

__all__ = ["VERSION", "Entry", "check_group", "join_reply_group", "parse_entry", "verify_group"]

VERSION = 1  # of the registration values and join calls


@dataclass(frozen=True)
class Entry:
    """One peer's registration for a round, as read (and validated) from the DHT."""

    member: Member
    arrived: float  # unix time, as the peer declared it
    wait: float  # seconds the peer waits from its arrival
    done: bool  # the peer has its group (or gave up): not a candidate any more


def parse_entry(value: object, owner: PeerID) -> Entry | None:
    """A registration value written by ``owner``; None if malformed or claiming another peer."""
    if not isinstance(value, dict) or value.get("v") != VERSION:
        return None
    try:
        member = Member.from_wire(value.get("m"))
    except (ValueError, TypeError):
        return None
    if member.peer_id != owner:
        return None
    arrived, wait, done = value.get("t"), value.get("w"), value.get("d", False)
    for x in (arrived, wait):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            return None
    if not 0 <= wait <= 86_400 or not isinstance(done, bool):
        return None
    return Entry(member, float(arrived), float(wait), done)


def join_reply_group(reply: object, me: PeerID, leader: PeerID) -> Group | None:
    """The group in a leader's answer to our join; None if there is none or it is malformed."""
    if not isinstance(reply, dict) or "group" not in reply:
        return None
    try:
        group = Group.from_wire(reply["group"])
    except (ValueError, TypeError):
        return None
    ids = {m.peer_id for m in group.members}
    if me not in ids or leader not in ids or len(group.group_id) != 16:
        return None
    return group


def check_group(group: Group, me: Member, leader: PeerID, registered: Mapping[PeerID, Member],
                min_size: int, max_size: int) -> tuple[str | None, list[PeerID]]:
    """Why we refuse ``group`` from ``leader`` (None: no reason yet), and the members it names that
    ``registered`` (peer -> member info as it registered for this round) does not hold."""
    if not min_size <= group.size <= max_size:
        return f"it has {group.size} members, where this round needs {min_size} to {max_size}", []
    if group.members[0].peer_id != leader:
        return "the leader we joined is not its first member", []
    unknown = []
    for m in group.members:
        if m.peer_id == me.peer_id:
            if m != me:
                return f"it changed our own entry (to {m})", []
            continue
        reg = registered.get(m.peer_id)
        if reg is None:
            unknown.append(m.peer_id)
        elif reg != m:
            return f"member {m.peer_id} differs from its registration ({m} against {reg})", []
    return None, unknown


async def verify_group(group: Group, me: Member, leader: PeerID, registered: Mapping[PeerID, Member],
                       reread: Callable[[], Awaitable[Mapping[PeerID, Member]]], min_size: int,
                       max_size: int) -> str | None:
    """``check_group``, reading the registrations once more (``reread``) if the group names peers
    we have not seen; None if we take the group, else why not."""
    why, unknown = check_group(group, me, leader, registered, min_size, max_size)
    if why is None and unknown:
        fresh = {**registered, **await reread()}
        why, unknown = check_group(group, me, leader, fresh, min_size, max_size)
        if why is None and unknown:
            why = f"member {unknown[0]} is not registered for this round"
    return why
