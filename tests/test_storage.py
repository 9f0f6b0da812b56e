"""Record validation, ownership signatures and the bounded store."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.errors import InvalidRecord
from dht.identity import Identity
from dht.storage import (
    Record,
    RecordStore,
    merge_records,
    owned_name,
    owner_of,
    sign_record,
    signing_payload,
    validate_record,
)

ALICE, BOB = Identity(), Identity()
NOW = 1000.0


def rec(key=b"k", subkey=None, value=b"v", expiration=NOW + 60, signature=None) -> Record:
    return Record(key, subkey, value, float(expiration), signature)


# ---------------------------------------------------------------- wire format


def test_wire_roundtrip():
    record = sign_record(rec(key=owned_name(b"k", ALICE.peer_id)), ALICE)
    wire = msgpack.unpackb(msgpack.packb(record.to_wire(), use_bin_type=True), raw=False)
    assert Record.from_wire(wire) == record
    assert Record.from_wire([b"k", None, b"v", 1070, None]).expiration == 1070.0


@pytest.mark.parametrize(
    "obj",
    [
        None,
        b"k",
        [b"k", None, b"v", 1.0],
        [b"k", None, b"v", 1.0, None, None],
        ["k", None, b"v", 1.0, None],
        [b"k", "s", b"v", 1.0, None],
        [b"k", None, "v", 1.0, None],
        [b"k", None, b"v", "1", None],
        [b"k", None, b"v", True, None],
        [b"k", None, b"v", float("nan"), None],
        [b"k", None, b"v", float("inf"), None],
        [b"k", None, b"v", 1.0, "sig"],
    ],
)
def test_from_wire_rejects_bad_schema(obj):
    with pytest.raises(InvalidRecord):
        Record.from_wire(obj)


_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.binary()
    | st.text(),
    lambda children: st.lists(children, max_size=6)
    | st.dictionaries(st.text() | st.binary() | st.integers(), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(obj=_msgpack_values | st.lists(_msgpack_values, min_size=5, max_size=5))
def test_from_wire_only_ever_raises_invalid_record(obj):
    try:
        record = Record.from_wire(obj)
    except InvalidRecord:
        return
    assert isinstance(record.key, bytes) and isinstance(record.expiration, float)


# ---------------------------------------------------------------- ownership


def test_owner_marker_parse():
    name = owned_name(b"progress/", ALICE.peer_id)
    assert name == b"progress/[owner:" + ALICE.peer_id.to_base58().encode() + b"]"
    assert owner_of(name) == ALICE.peer_id
    assert owner_of(b"plain") is None and owner_of(None) is None
    assert owner_of(owned_name(name, ALICE.peer_id)) == ALICE.peer_id  # repeated, same owner
    with pytest.raises(InvalidRecord, match="more than one owner"):
        owner_of(owned_name(name, BOB.peer_id))
    with pytest.raises(InvalidRecord, match="malformed owner marker"):
        owner_of(b"x[owner:not-a-peer]")
    with pytest.raises(InvalidRecord, match="malformed owner marker"):
        owner_of(b"x[owner:\xff]")


def test_signed_owned_key_accepted():
    record = sign_record(rec(key=owned_name(b"k", ALICE.peer_id)), ALICE)
    validate_record(record, NOW)
    assert ALICE.peer_id.verify(record.signature, signing_payload(record))  # type: ignore[arg-type]
    store = RecordStore()
    assert store.store(record, NOW, source=BOB.peer_id)  # anyone may relay a signed record


def test_unsigned_forged_and_wrong_owner_rejected():
    key = owned_name(b"k", ALICE.peer_id)
    with pytest.raises(InvalidRecord, match="unsigned write to owned key"):
        validate_record(rec(key=key), NOW)
    with pytest.raises(InvalidRecord, match="bad signature for owned key"):
        validate_record(sign_record(rec(key=key), BOB), NOW)  # signed by someone else
    tampered = dataclasses.replace(sign_record(rec(key=key), ALICE), value=b"evil")
    with pytest.raises(InvalidRecord, match="bad signature"):
        validate_record(tampered, NOW)
    with pytest.raises(InvalidRecord, match="bad signature"):
        validate_record(rec(key=key, signature=b"\x00" * 64), NOW)


def test_owned_subkey():
    subkey = owned_name(b"member", ALICE.peer_id)
    validate_record(sign_record(rec(subkey=subkey), ALICE), NOW)
    with pytest.raises(InvalidRecord, match="bad signature"):  # sub-key of X written by Y
        validate_record(sign_record(rec(subkey=subkey), BOB), NOW)
    mixed = rec(key=owned_name(b"k", BOB.peer_id), subkey=subkey)
    with pytest.raises(InvalidRecord, match="different owners"):
        validate_record(sign_record(mixed, ALICE), NOW)
    both = rec(key=owned_name(b"k", ALICE.peer_id), subkey=subkey)
    validate_record(sign_record(both, ALICE), NOW)


def test_signature_on_unowned_record_is_ignored():
    validate_record(rec(signature=b"whatever"), NOW)


# ---------------------------------------------------------------- validation limits


def test_size_and_ttl_limits():
    with pytest.raises(InvalidRecord, match="value of 70000 bytes exceeds the 65536-byte limit"):
        validate_record(rec(value=b"x" * 70000), NOW)
    with pytest.raises(InvalidRecord, match="key of 2000 bytes"):
        validate_record(rec(key=b"x" * 2000), NOW)
    with pytest.raises(InvalidRecord, match="subkey of 2000 bytes"):
        validate_record(rec(subkey=b"x" * 2000), NOW)
    with pytest.raises(InvalidRecord, match="record expired"):
        validate_record(rec(expiration=NOW), NOW)
    with pytest.raises(InvalidRecord, match="more than max_ttl"):
        validate_record(rec(expiration=NOW + 100), NOW, max_ttl=50)
    store = RecordStore(max_value_size=10)
    with pytest.raises(InvalidRecord, match="10-byte limit"):
        store.store(rec(value=b"x" * 11), NOW)
    assert len(store) == 0


# ---------------------------------------------------------------- store semantics


def test_expiry():
    store = RecordStore()
    store.store(rec(key=b"a", expiration=NOW + 10), NOW)
    store.store(rec(key=b"b", expiration=NOW + 20), NOW)
    assert store.get(b"a", NOW + 9)
    assert store.get(b"a", NOW + 10) == []  # expired even before the sweep
    assert store.remove_expired(NOW + 10) == 1
    assert store.keys() == [b"b"] and len(store) == 1
    assert store.remove_expired(NOW + 30) == 1 and len(store) == 0


def test_newer_wins():
    store = RecordStore()
    assert store.store(rec(value=b"1", expiration=NOW + 10), NOW)
    assert not store.store(rec(value=b"2", expiration=NOW + 10), NOW)  # equal: keep existing
    assert not store.store(rec(value=b"3", expiration=NOW + 5), NOW)
    assert store.get(b"k", NOW)[0].value == b"1"
    assert store.store(rec(value=b"4", expiration=NOW + 20), NOW)
    assert [r.value for r in store.get(b"k", NOW)] == [b"4"]
    assert len(store) == 1
    assert store.remove_expired(NOW + 15) == 0  # the replaced record's expiry entry is stale


def test_subkeys_expire_independently():
    store = RecordStore()
    store.store(rec(subkey=b"a", value=b"A", expiration=NOW + 10), NOW)
    store.store(rec(subkey=b"b", value=b"B", expiration=NOW + 20), NOW)
    assert [(r.subkey, r.value) for r in store.get(b"k", NOW)] == [(b"a", b"A"), (b"b", b"B")]
    assert store.store(rec(subkey=b"a", value=b"A2", expiration=NOW + 15), NOW)
    assert not store.store(rec(subkey=b"b", value=b"old", expiration=NOW + 1), NOW)
    assert len(store) == 2
    assert [r.subkey for r in store.get(b"k", NOW + 16)] == [b"b"]
    store.remove_expired(NOW + 16)
    assert len(store) == 1 and store.keys() == [b"k"]


def test_plain_vs_dictionary_replacement():
    store = RecordStore()
    store.store(rec(subkey=b"a", expiration=NOW + 10), NOW)
    store.store(rec(subkey=b"b", expiration=NOW + 30), NOW)
    assert not store.store(rec(value=b"plain", expiration=NOW + 20), NOW)  # not newer than b
    assert store.store(rec(value=b"plain", expiration=NOW + 40), NOW)
    assert [(r.subkey, r.value) for r in store.get(b"k", NOW)] == [(None, b"plain")]
    assert len(store) == 1
    assert not store.store(rec(subkey=b"c", expiration=NOW + 40), NOW)  # equal: plain stays
    assert store.store(rec(subkey=b"c", value=b"C", expiration=NOW + 50), NOW)
    assert [(r.subkey, r.value) for r in store.get(b"k", NOW)] == [(b"c", b"C")]
    assert len(store) == 1
    assert store.remove_expired(NOW + 45) == 0


def test_records_for_republish():
    store = RecordStore()
    store.store(rec(key=b"a"), NOW)
    store.store(rec(key=b"b", subkey=b"x"), NOW)
    store.store(rec(key=b"b", subkey=b"y"), NOW)
    assert sorted((r.key, r.subkey or b"") for r in store.records()) == [
        (b"a", b""), (b"b", b"x"), (b"b", b"y")
    ]


def test_count_limits():
    store = RecordStore(max_records=3, max_records_per_source=2, max_subkeys_per_key=2)
    store.store(rec(key=b"a"), NOW, source=ALICE.peer_id)
    store.store(rec(key=b"b"), NOW, source=ALICE.peer_id)
    with pytest.raises(InvalidRecord, match=f"too many records from peer {ALICE.peer_id}"):
        store.store(rec(key=b"c"), NOW, source=ALICE.peer_id)
    # replacing one of its own records does not count twice
    assert store.store(rec(key=b"a", expiration=NOW + 100), NOW, source=ALICE.peer_id)
    store.store(rec(key=b"c"), NOW)  # local writes have no per-source quota
    with pytest.raises(InvalidRecord, match="storage full"):
        store.store(rec(key=b"d"), NOW)
    assert len(store) == 3

    store = RecordStore(max_subkeys_per_key=2)
    store.store(rec(subkey=b"1"), NOW)
    store.store(rec(subkey=b"2"), NOW)
    with pytest.raises(InvalidRecord, match="too many subkeys under key"):
        store.store(rec(subkey=b"3"), NOW)
    assert store.store(rec(subkey=b"2", expiration=NOW + 70), NOW)  # update is fine


def test_quota_is_freed_when_records_expire_or_are_replaced():
    store = RecordStore(max_records_per_source=1)
    store.store(rec(key=b"a", expiration=NOW + 10), NOW, source=ALICE.peer_id)
    with pytest.raises(InvalidRecord, match="too many records"):
        store.store(rec(key=b"b", expiration=NOW + 90), NOW, source=ALICE.peer_id)
    store.store(rec(key=b"b", expiration=NOW + 90), NOW + 20, source=ALICE.peer_id)  # a expired
    store.store(rec(key=b"b", expiration=NOW + 95), NOW + 20, source=BOB.peer_id)  # Bob's now
    store.store(rec(key=b"c", expiration=NOW + 90), NOW + 20, source=ALICE.peer_id)
    assert len(store) == 2


def test_expiry_index_stays_bounded():
    store = RecordStore()
    for i in range(1000):
        store.store(rec(expiration=NOW + 1 + i * 0.01), NOW)
    assert len(store) == 1 and len(store._expiry) < 200


# ---------------------------------------------------------------- merge


def test_merge_records():
    merged = merge_records(
        [
            rec(key=b"p", value=b"old", expiration=NOW + 1),
            rec(key=b"p", value=b"new", expiration=NOW + 5),
            rec(key=b"d", subkey=b"a", value=b"a1", expiration=NOW + 1),
            rec(key=b"d", subkey=b"a", value=b"a2", expiration=NOW + 3),
            rec(key=b"d", subkey=b"b", value=b"b", expiration=NOW + 2),
            rec(key=b"d", value=b"stale plain", expiration=NOW + 2),
            rec(key=b"x", subkey=b"a", expiration=NOW + 1),
            rec(key=b"x", value=b"fresh plain", expiration=NOW + 9),
        ]
    )
    assert [(r.key, r.subkey, r.value) for r in merged] == [
        (b"d", b"a", b"a2"),
        (b"d", b"b", b"b"),
        (b"p", None, b"new"),
        (b"x", None, b"fresh plain"),
    ]
    assert merge_records([]) == []


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([None, b"a", b"b"]), st.integers(1, 20)), min_size=1, max_size=8
    )
)
def test_merge_agrees_with_a_store(writes):
    """Whatever order records arrive in, a store ends up where merge_records says it should,
    for the plain-only and subkey-only cases (mixed histories depend on arrival order)."""
    records = [rec(subkey=s, value=bytes([i]), expiration=NOW + e) for i, (s, e) in enumerate(writes)]
    if len({r.subkey is None for r in records}) > 1:
        records = [r for r in records if r.subkey is not None] or records
    store = RecordStore()
    for record in records:
        store.store(record, NOW)
    expected = {(r.subkey, r.expiration) for r in merge_records(records)}
    assert {(r.subkey, r.expiration) for r in store.get(b"k", NOW)} == expected
