"""Owner-signed entries: ``store_owned``/``get_owned`` on a swarm, and the sans-IO pieces under them
(``owned_values``, ``VerifiedOwners``)."""

from __future__ import annotations

import asyncio
import time

import pytest

from dht import DHTConfig, DHTNode, Identity, InvalidRecord, OwnedValue, PeerID, pack
from dht.owned import owned_values
from dht.storage import Record, VerifiedOwners, owned_name, sign_record

FAST = DHTConfig(rpc_timeout=1.0, bootstrap_timeout=2.0, maintenance_period=0.2, republish_interval=0.5)
ALICE, BOB = Identity(), Identity()


def entry(who: Identity, value: object, expiration: float, name: bytes = b"m", key: bytes = b"round") -> Record:
    return sign_record(Record(key, owned_name(name, who.peer_id), pack(value), expiration), who)


def test_owned_values_takes_each_owners_latest_decodable_value_under_its_own_name():
    now = time.time()
    records = [
        entry(ALICE, "old", now + 10),
        entry(ALICE, "new", now + 20),
        sign_record(Record(b"round", owned_name(b"m", ALICE.peer_id), b"\xc1", now + 30), ALICE),  # not msgpack
        entry(BOB, "bob", now + 10),
        entry(BOB, "other name", now + 40, name=b"x"),
        entry(BOB, "x" * 100, now + 50),  # over max_size
        Record(b"round", b"m", pack("unowned"), now + 60),
        Record(b"round", None, pack("plain"), now + 60),
    ]
    assert owned_values(records, "m", VerifiedOwners(), max_size=64) == {
        ALICE.peer_id: OwnedValue("new", now + 20), BOB.peer_id: OwnedValue("bob", now + 10)}


def test_owned_values_refuses_an_entry_signed_by_anyone_but_its_owner():
    forged = sign_record(Record(b"round", owned_name(b"m", ALICE.peer_id), pack("forged"), time.time() + 60), BOB)
    assert owned_values([forged], "m", VerifiedOwners(), max_size=64) == {}


def test_verified_owners_checks_a_record_once_and_remembers_refusals(monkeypatch):
    checks: list[PeerID] = []
    real = PeerID.verify

    def counted(self: PeerID, signature: bytes, data: bytes) -> bool:
        checks.append(self)
        return real(self, signature, data)

    monkeypatch.setattr(PeerID, "verify", counted)
    good = entry(ALICE, 1, time.time() + 60)
    forged = sign_record(Record(b"round", owned_name(b"m", ALICE.peer_id), pack(2), time.time() + 60), BOB)
    big = entry(ALICE, "x" * 64, time.time() + 60)
    memo = VerifiedOwners(max_entries=2, max_value=32)
    for _ in range(3):
        assert memo.owner(good) == ALICE.peer_id
        with pytest.raises(InvalidRecord, match="bad signature"):
            memo.owner(forged)
    assert len(checks) == 2
    memo.owner(big)
    memo.owner(big)
    assert len(checks) == 4  # values over max_value are not remembered
    memo.owner(entry(BOB, 3, time.time() + 60))  # a third entry: the memo starts over
    memo.owner(good)
    assert len(checks) == 6


def test_the_stores_and_nodes_of_one_process_check_a_record_once_between_them(monkeypatch):
    """Several peers in one process (a local swarm, the 64-peer benchmark's 8 a process) each read
    and hold the same records: one of them checks a signature, the others find it checked; a
    forgery is refused by every one of them."""
    from dht.storage import RecordStore

    checks: list[PeerID] = []
    real = PeerID.verify
    monkeypatch.setattr(PeerID, "verify", lambda self, sig, data: checks.append(self) or real(self, sig, data))
    good = entry(ALICE, "shared", time.time() + 60, key=b"run/progress")
    forged = sign_record(Record(b"run/progress", owned_name(b"m", ALICE.peer_id), pack(1), time.time() + 60), BOB)
    stores = [RecordStore() for _ in range(8)]
    for store in stores:
        assert store.store(good, time.time(), source=BOB.peer_id)
        with pytest.raises(InvalidRecord, match="bad signature"):
            store.store(forged, time.time(), source=BOB.peer_id)
    assert owned_values(stores[0].get(b"run/progress", time.time()), "m", stores[0].owners, max_size=64) == {
        ALICE.peer_id: OwnedValue("shared", good.expiration)}
    assert len(checks) == 2


@pytest.fixture
async def nodes():
    started: list[DHTNode] = []
    first = DHTNode(config=FAST)
    await first.start()
    started.append(first)
    rest = [DHTNode(config=FAST) for _ in range(5)]
    await asyncio.gather(*(n.start(first.multiaddrs) for n in rest))
    started += rest
    try:
        yield started
    finally:
        await asyncio.gather(*(n.close() for n in started), return_exceptions=True)


async def test_get_owned_reads_each_peers_entry_by_peer(nodes):
    a, b, reader = nodes[1], nodes[2], nodes[5]
    exp = time.time() + 60
    assert await a.store_owned("run/progress", "p", {"epoch": 3}, exp) > 0
    assert await b.store_owned("run/progress", "p", {"epoch": 4}, exp + 1) > 0
    await b.store("run/progress", {"epoch": 99}, exp, subkey="p")  # unowned: nobody's entry
    read = await reader.get_owned("run/progress", "p")
    assert read.values == {a.peer_id: OwnedValue({"epoch": 3}, exp), b.peer_id: OwnedValue({"epoch": 4}, exp + 1)}
    assert read.closest
    assert (await reader.get_owned("run/progress", "other")).values == {}


async def test_get_owned_from_holders_asks_only_them_and_says_which_answered(nodes):
    writer, reader = nodes[1], nodes[4]
    await writer.store_owned("round", "m", "here", time.time() + 60)
    holders = [c for c in (await reader.get_owned("round", "m")).closest if c.peer_id != writer.peer_id][:3]
    dead = next(n for n in nodes if n.peer_id == holders[0].peer_id)
    await dead.close()
    lookups = []
    reader._run_lookup = lambda *a: lookups.append(a)  # type: ignore[method-assign]
    read = await reader.get_owned("round", "m", holders=holders, timeout=1.0)
    assert read.values[writer.peer_id].value == "here" and not lookups
    assert [c.peer_id for c in read.closest] == [c.peer_id for c in holders[1:]]


async def test_a_holder_sees_entries_as_they_land_without_a_read(nodes):
    """``watch`` is set by each peer's write of the key that lands here; ``local_owned`` reads what this
    node holds, with no RPC (a matchmaking round sees its peers half a round trip sooner)."""
    holder, a, b = nodes[1], nodes[2], nodes[3]
    exp = time.time() + 60
    here = [c for c in a.nearest_known("round") if c.peer_id == holder.peer_id]
    assert here and holder.local_owned("round", "m") == {}
    with holder.watch("round") as landed:
        await a.store_owned("round", "m", "a's", exp, closest=here)
        assert landed.is_set()
        landed.clear()
        await b.store_owned("other round", "m", "b's", exp, closest=here)
        assert not landed.is_set()  # another key
        await b.store_owned("round", "m", {"x": "a longer value"}, exp, closest=here)
        assert landed.is_set()
    assert holder.local_owned("round", "m") == {a.peer_id: OwnedValue("a's", exp),
                                                b.peer_id: OwnedValue({"x": "a longer value"}, exp)}
    assert holder.local_owned("round", "m", max_size=4) == {a.peer_id: OwnedValue("a's", exp)}
    assert not holder._watches  # the watch is gone with its block


async def test_a_reader_watching_a_key_hears_of_writes_that_ask_for_a_notice_once_per_tag(nodes, monkeypatch):
    """A read with ``watch`` asks the holder to tell the reader of writes that ask for a notice:
    once per tag, never of plain writes, handing the write's record over (the reader holds it
    without a read); a notice from a peer the reader did not ask is ignored, records and all."""
    import dht.watchers
    from dht import Contact

    monkeypatch.setattr(dht.watchers, "MIN_NOTICE_GAP", 0.0)
    holder, writer, reader, stranger = nodes[1], nodes[2], nodes[3], nodes[4]
    at = [Contact(holder.peer_id, ("127.0.0.1", holder.host.listen_port))]
    heard: list[tuple[PeerID, bytes]] = []
    real = reader._noticed
    reader._noticed = lambda who, key, records, group: (  # type: ignore[method-assign]
        heard.append((who, key)), real(who, key, records, group))
    exp = time.time() + 60
    with reader.notices("run/progress") as told:
        await reader.get_owned("run/progress", "p", holders=at, watch=5.0)
        await writer.store_owned("run/progress", "p", 1, exp, closest=at)  # plain: nobody is told
        await writer.store_owned("run/progress", "p", 2, exp + 1, closest=at, notice=7)
        await asyncio.wait_for(told.wait(), 5)
        assert heard == [(holder.peer_id, b"run/progress")]
        assert reader.local_owned("run/progress", "p")[writer.peer_id].value == 2  # handed over, no read
        told.clear()
        await writer.store_owned("run/progress", "p", 3, exp + 2, closest=at, notice=7)  # same tag: told already
        await writer.store_owned("run/progress", "p", 4, exp + 3, closest=at, notice=8)
        await asyncio.wait_for(told.wait(), 5)
        assert len(heard) == 2 and reader.local_owned("run/progress", "p")[writer.peer_id].value == 4
        told.clear()
        forged = stranger.owned("p")  # (the stranger's own record: valid, but nobody asked it)
        record = sign_record(Record(b"run/progress", forged.encode(), pack(9), exp + 4, None), stranger.identity)
        await stranger.host.call(reader.peer_id, ("127.0.0.1", reader.host.listen_port), "notice",
                                 [b"run/progress", [record.to_wire()]])
        assert len(heard) == 3 and not told.is_set()  # it was not asked to
        assert stranger.peer_id not in reader.local_owned("run/progress", "p")
    assert (await reader.get_owned("run/progress", "p", holders=at)).values[writer.peer_id].value == 4


async def test_a_write_asking_for_a_notice_still_lands_on_holders_of_an_older_version(nodes, monkeypatch):
    """An older holder refuses a store in the notice form (it takes only a list of records): the
    write is sent again as a plain one, so a mixed-version swarm loses no record over notices."""
    import dht.protocol
    from dht import Contact, ProtocolError

    def old_form(args):
        if isinstance(args, dict):
            raise ProtocolError("store takes a list of at most 256 records")
        return args, None

    monkeypatch.setattr(dht.protocol, "_store_request", old_form)
    holder, writer, reader = nodes[1], nodes[2], nodes[3]
    at = [Contact(holder.peer_id, ("127.0.0.1", holder.host.listen_port))]
    assert await writer.store_owned("run/progress", "p", "ready", time.time() + 60, closest=at, notice=3) >= 2
    assert (await reader.get_owned("run/progress", "p", holders=at)).values[writer.peer_id].value == "ready"
