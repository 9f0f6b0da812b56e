"""A round's board (p2ptrain.averaging.board): when a registration looks its key's holders up."""

from __future__ import annotations

import asyncio

import torch

from dht import Contact, DHTError, DHTNode, Identity, OwnedRead
from p2ptrain.averaging.board import _CHECK_EVERY, _HOLDERS, Board
from p2ptrain.averaging.group import Member
from p2ptrain.averaging.mm_state import MatchRound
from p2ptrain.averaging.schema import tensor_schema

SCHEMA = tensor_schema([("w", torch.zeros(4, 4))], "fp16")


class FakeNode:
    """A DHT node whose routing table knows ``known`` near every key and whose full lookups find
    ``found`` (or fail); counts the lookups."""

    def __init__(self, known: list[Contact], found: list[Contact]):
        self.peer_id = Identity().peer_id
        self.known, self.found = known, found
        self.lookups = 0
        self.fail = False

    nearest = staticmethod(DHTNode.nearest)

    def nearest_known(self, key: str) -> list[Contact]:
        return list(self.known)

    async def get_owned(self, key: str, name: str, **kw) -> OwnedRead:
        self.lookups += 1
        if self.fail:
            raise DHTError("lookup failed")
        return OwnedRead({}, list(self.found))

    async def store_owned(self, *args, **kw) -> int:
        return 1


def contacts(n: int) -> list[Contact]:
    return [Contact(Identity().peer_id, ("127.0.0.1", 20000 + i)) for i in range(n)]


async def register_rounds(node: FakeNode, board: Board, rounds: range) -> None:
    loop = asyncio.get_running_loop()
    me = Member(node.peer_id, ("127.0.0.1", 1))
    for r in rounds:
        rnd = MatchRound(str(r), board.round_key(r), 2, 1.0)
        board.register(rnd, me, 1.0, loop.time() + 1.0)
        await asyncio.wait_for(rnd.looked_up.wait(), 1.0)  # (a lookup's verdict counts from the next round)


def board_of(node: FakeNode) -> tuple[Board, list[asyncio.Task]]:
    tasks: list[asyncio.Task] = []
    return Board(node, "run", SCHEMA, lambda coro: tasks.append(asyncio.ensure_future(coro)) or tasks[-1]), tasks


async def test_rounds_skip_the_holders_lookup_while_the_routing_table_knew_every_holder_found():
    table = contacts(2 * _HOLDERS)
    node = FakeNode(table, table[3:3 + _HOLDERS])  # (a slow holder passed over is no miss)
    board, tasks = board_of(node)
    await register_rounds(node, board, range(2 + 3 * _CHECK_EVERY))
    await asyncio.gather(*tasks)
    assert node.lookups == 2 + 3  # two to build trust, then one round in _CHECK_EVERY checks it

    # a holder the table did not know: the next check finds it, and from then on every round looks up
    node.found = [*table[:_HOLDERS - 1], *contacts(1)]
    await register_rounds(node, board, range(100, 100 + 2 * _CHECK_EVERY))
    await asyncio.gather(*tasks)
    assert node.lookups - 5 == 1 + _CHECK_EVERY


async def test_failed_lookups_and_small_tables_never_build_trust():
    table = contacts(2 * _HOLDERS)
    node = FakeNode(table, table[:_HOLDERS])
    node.fail = True
    board, tasks = board_of(node)
    await register_rounds(node, board, range(6))
    await asyncio.gather(*tasks)
    assert node.lookups == 6

    small = FakeNode(contacts(_HOLDERS - 1), [])  # fewer peers than holders: each is one, no lookup
    board, tasks = board_of(small)
    await register_rounds(small, board, range(3))
    await asyncio.gather(*tasks)
    assert small.lookups == 0


async def test_a_holders_lookup_that_missed_nearer_holders_keeps_those_the_table_named():
    """Under load a key's nearest holders may answer a full lookup too late to count: the round
    writes to, and reads from, the nearest of those the lookup found and those the table named."""
    board, tasks = board_of(FakeNode([], []))
    key = board.round_key(7)
    ordered = DHTNode.nearest(key, contacts(3 * _HOLDERS), 3 * _HOLDERS)
    node = FakeNode(ordered[:_HOLDERS], ordered[2:2 + _HOLDERS])  # (the lookup missed the nearest two)
    board, tasks = board_of(node)
    rnd = MatchRound("7", key, 2, 1.0)
    board.register(rnd, Member(node.peer_id, ("127.0.0.1", 1)), 1.0, asyncio.get_running_loop().time() + 1.0)
    await asyncio.wait_for(rnd.looked_up.wait(), 1.0)
    await asyncio.gather(*tasks)
    assert node.lookups == 1 and [c.peer_id for c in rnd.holders] == [c.peer_id for c in ordered[:_HOLDERS]]
