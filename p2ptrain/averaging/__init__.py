"""Decentralized averaging: groups formed on the fly through the DHT, then a compressed,
fault-tolerant butterfly all-reduce among their members.

    group.py        Member, Group, partition; bandwidth and weight caps (sans-IO)
    schema.py       tensor schema hash: peers with different models or codecs never meet
    claims.py       what a peer believes of matchmaking: registrations, the leader's group
    plan.py         matchmaking's group planning: peer order, balanced groups, settle window (sans-IO)
    mixing.py       mixing groups: a grid of matchmaking keys, one dimension per round (sans-IO)
    mm_state.py     one matchmaking round's state at one peer
    board.py        matchmaking's DHT board: our signed entry for a round, validated reads of the others'
    join.py         matchmaking's lead/follow/join protocol (the leader closes, members join it)
    matchmaking.py  Matchmaker: register, gather until the set settles, plan, join; adaptive waits
    round_types.py  the all-reduce's config and result types, codec ids, the resources a round is lent
    protocol.py     the all-reduce's wire: stream header, result summary, exact-size reads
    reducer.py      an owner's sum (or robust combination) of its shard, chunk by chunk (sans-IO)
    context.py      what both sides of one round share: parameters, failures, accounting, the worker
    owner.py        a round's owner side: one task per sender, then the replies
    sender.py       a round's sender side: one task per other owner
    round.py        one all-reduce round's lifecycle (run, abort) over the two sides
    allreduce.py    AllReduceService: runs rounds (stream handlers, registry, worker, kept buffers)
    ledger.py       what a member keeps of a robust round for the others' audits (sans-IO)
    verify.py       recompute an owner's chunk, tell a cheating owner from a lying member (sans-IO)
    audit.py        shard audits under a robust rule: the protocol, both sides
    robust.py       robust aggregation rules (trimmed mean, median, CenteredClip), sans-IO
    averager.py     Averager / BlockingAverager: the public API
"""

from .allreduce import AllReduceService
from .audit import AuditConfig
from .averager import Averager, BlockingAverager, EarlyStart, StepResult
from .group import Group, Member, partition
from .matchmaking import Matchmaker
from .mixing import GridMixer
from .robust import AGGREGATIONS, aggregate
from .round_types import AllReduceConfig, AllReduceResult
from .schema import Schema, tensor_schema

__all__ = [
    "AGGREGATIONS",
    "AllReduceConfig",
    "AllReduceResult",
    "AllReduceService",
    "AuditConfig",
    "Averager",
    "BlockingAverager",
    "EarlyStart",
    "GridMixer",
    "Group",
    "Matchmaker",
    "Member",
    "Schema",
    "StepResult",
    "aggregate",
    "partition",
    "tensor_schema",
]
