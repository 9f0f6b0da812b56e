"""Hostile peers: shards attacks (see the package docstring): what one member of an averaging group
can do to the others' results through the all-reduce and matchmaking it takes part in.

Each mode installs itself on an honest object of the peer it turns hostile (its
:class:`~p2ptrain.averaging.AllReduceService`, :class:`~p2ptrain.averaging.Matchmaker` or
:class:`~p2ptrain.averaging.Averager`) by replacing one of its methods on that instance (the
service's extension points ``_reply`` and ``_audit_values``, or a matchmaker's method); it returns
nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from ._registry import mode

__all__ = ["audit_lie", "bandwidth_inflate", "leader_group_forge", "owner_tamper", "weight_inflate"]


def _scaled_f32(data: Any, scale: float, first: int | None = None) -> memoryview:
    """A copy of float32 wire bytes (a ``none`` codec's chunk), its ``first`` values (all: None)
    times ``scale``."""
    values = torch.frombuffer(bytearray(memoryview(data).cast("B")), dtype=torch.float32)
    values[:first].mul_(scale)
    return memoryview(values.numpy()).cast("B")


@mode("owner_tamper", "an owner sends every member its shard's result times -100 (float32 replies)")
def owner_tamper(service: Any, scale: float = -100.0, first: int | None = None) -> None:
    """``service``: the hostile peer's AllReduceService; its own values stay honest. ``first``:
    tamper with only the first ``first`` values of each chunk of the reply."""
    service._reply = lambda index, data: _scaled_f32(data, scale, first)


@mode("audit_lie", "a member shows auditors its parts times -100, not what it sent the owners")
def audit_lie(service: Any, scale: float = -100.0) -> None:
    """``service``: the hostile peer's AllReduceService. It would frame honest owners, whose replies
    then differ from a recomputation with its lie."""
    service._audit_values = lambda kind, x, y, values: values * scale if kind == "s" else values


@mode("bandwidth_inflate", "a member declares a bandwidth of 1e14, to own (nearly) the whole vector")
def bandwidth_inflate(matchmaker: Any, bandwidth: float = 1e14) -> None:
    """``matchmaker``: the hostile peer's Matchmaker (e.g. ``averager.matchmaker``)."""
    matchmaker.bandwidth = float(bandwidth)


@mode("leader_group_forge", "a leader hands its joiners a group in which it owns every shard")
def leader_group_forge(matchmaker: Any) -> None:
    """``matchmaker``: the hostile peer's Matchmaker. The group it answers joins with gives every
    other member bandwidth 0 (so the leader owns the whole vector); its own copy stays honest."""
    accept = matchmaker._accept

    async def forged(rnd: Any, lead: Any, member: Any, joiner_deadline: float) -> Any:
        reply = await accept(rnd, lead, member, joiner_deadline)
        if isinstance(reply, dict) and "group" in reply:
            gid, members = reply["group"]
            me = matchmaker.node.peer_id.to_bytes()
            reply = {"group": [gid, [m if m[0] == me else [m[0], m[1], 0.0, *m[3:]] for m in members]]}
        return reply

    matchmaker._accept = forged


@mode("weight_inflate", "a member declares a weight of 1e12 samples in every round (matchmaking and header)")
def weight_inflate(averager: Any, weight: float = 1e12) -> None:
    """``averager``: the hostile peer's Averager; whatever weight its caller passes, it claims ``weight``."""
    step = averager.step

    async def inflated(*args: Any, **kwargs: Any) -> Any:
        if args:
            args = (weight, *args[1:])
        else:
            kwargs["weight"] = weight
        return await step(*args, **kwargs)

    averager.step = inflated
