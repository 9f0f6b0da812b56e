"""Identity: Ed25519 keys, libp2p-format PeerIDs, key files."""

from __future__ import annotations

import logging
import os
import stat

import base58
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.errors import ConfigError
from dht.identity import Identity, PeerID

# libp2p peer-ids spec test vector (also used by rust-libp2p's keypair tests): Ed25519 seed and the
# protobuf-encoded public key it derives to; the PeerID is the one other implementations derive.
SPEC_SEED = bytes.fromhex("7e0830617c4a7de83925dfb2694556b12936c477a0e1feb2e148ec9da60fee7d")
SPEC_PUBLIC_PROTO = bytes.fromhex("080112201ed1e8fae2c4a144b8be8fd4b47bf3d3b34b871c3cacf6010f0e42d474fce27e")
SPEC_PEER_ID = "12D3KooWBtg3aaRMjxwedh83aGiUkwSxDwUZkzuJcfaqUmo7R3pq"


def test_peer_id_is_libp2p_ed25519_identity_multihash():
    ident = Identity()
    pid = ident.peer_id
    raw = pid.to_bytes()
    assert len(raw) == 38
    assert raw[:6] == b"\x00\x24\x08\x01\x12\x20"
    assert raw[6:] == ident.public_key.public_bytes_raw()
    assert pid.public_key().public_bytes_raw() == raw[6:]
    text = pid.to_base58()
    assert text.startswith("12D3KooW")
    assert str(pid) == text
    assert base58.b58decode(text) == raw


def test_spec_test_vector():
    ident = Identity.from_private_bytes(SPEC_SEED)
    assert ident.peer_id.to_bytes() == b"\x00\x24" + SPEC_PUBLIC_PROTO
    assert ident.peer_id.to_base58() == SPEC_PEER_ID
    assert PeerID.from_base58(SPEC_PEER_ID) == ident.peer_id


def test_base58_round_trip_and_equality():
    pid = Identity().peer_id
    again = PeerID.from_base58(pid.to_base58())
    assert again == pid
    assert hash(again) == hash(pid)
    assert PeerID(pid.to_bytes()) == pid
    assert pid != Identity().peer_id
    assert pid != pid.to_base58()  # not equal to its text
    assert {pid: 1}[again] == 1
    assert pid.short().endswith(pid.to_base58()[-6:])


def test_peer_ids_sort_by_bytes():
    ids = [Identity().peer_id for _ in range(8)]
    assert sorted(ids) == sorted(ids, key=lambda p: p.to_bytes())


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not-base58-0OIl",  # 0, O, I, l are not in the base58 alphabet
        "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",  # a sha256 (RSA-style) PeerID
        SPEC_PEER_ID[:-1],
        SPEC_PEER_ID + "1",
    ],
)
def test_from_base58_rejects_non_ed25519_ids(text):
    with pytest.raises(ValueError) as info:
        PeerID.from_base58(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\x00\x24\x08\x01\x12\x20" + b"\x00" * 31,  # short key
        b"\x12\x24\x08\x01\x12\x20" + b"\x00" * 32,  # sha2-256 code instead of identity
        b"\x00\x24\x08\x02\x12\x20" + b"\x00" * 32,  # secp256k1 key type
        b"\x00\x23\x08\x01\x12\x20" + b"\x00" * 32,  # wrong multihash length
    ],
)
def test_peer_id_constructor_validates(raw):
    with pytest.raises(ValueError):
        PeerID(raw)


def test_sign_verify():
    a, b = Identity(), Identity()
    data = b"some record"
    sig = a.sign(data)
    assert a.peer_id.verify(sig, data)
    # a PeerID parsed from text alone can verify (the key is embedded in the id)
    assert PeerID.from_base58(str(a.peer_id)).verify(sig, data)
    assert not b.peer_id.verify(sig, data)
    assert not a.peer_id.verify(sig, data + b"!")
    assert not a.peer_id.verify(sig, b"")
    tampered = bytearray(sig)
    tampered[0] ^= 1
    assert not a.peer_id.verify(bytes(tampered), data)
    assert not a.peer_id.verify(b"", data)
    assert not a.peer_id.verify(sig[:-1], data)


@settings(max_examples=50, deadline=None)
@given(data=st.binary(max_size=256), flip=st.integers(min_value=0, max_value=64 * 8 - 1))
def test_any_bit_flip_in_signature_is_rejected(data, flip):
    ident = _FIXED
    sig = bytearray(ident.sign(data))
    assert ident.peer_id.verify(bytes(sig), data)
    sig[flip // 8] ^= 1 << (flip % 8)
    assert not ident.peer_id.verify(bytes(sig), data)


_FIXED = Identity.from_private_bytes(SPEC_SEED)


def test_private_bytes_round_trip():
    ident = Identity()
    again = Identity.from_private_bytes(ident.private_bytes())
    assert again.peer_id == ident.peer_id
    assert again.sign(b"x") == ident.sign(b"x")  # Ed25519 is deterministic


def test_key_file_created_with_mode_0600(tmp_path):
    path = tmp_path / "sub" / "key"
    old = os.umask(0)  # even a permissive umask must not make the key readable by others
    try:
        ident = Identity.load_or_create(path)
    finally:
        os.umask(old)
    assert path.exists()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert Identity.load(path).peer_id == ident.peer_id
    # no temporary file left next to the key
    assert sorted(p.name for p in path.parent.iterdir()) == ["key"]


def test_key_file_is_never_written_through_a_file_or_link_placed_beside_it(tmp_path):
    """The temp file's name used to be predictable (.key.<pid>.tmp) and opened without O_EXCL: a
    file someone created there kept its mode 0644, and a symlink there was written through."""
    path = tmp_path / "key"
    planted = tmp_path / f".key.{os.getpid()}.tmp"
    planted.write_bytes(b"")
    planted.chmod(0o644)
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched")
    link = tmp_path / f".other.{os.getpid()}.tmp"
    link.symlink_to(victim)
    Identity().save(path)
    Identity().save(tmp_path / "other")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "other").st_mode) == 0o600
    assert victim.read_bytes() == b"untouched" and not (tmp_path / "other").is_symlink()


def test_loading_a_key_others_can_read_warns(tmp_path, caplog):
    path = tmp_path / "key"
    Identity().save(path)
    with caplog.at_level(logging.WARNING, logger="dht.identity"):
        Identity.load(path)
    assert not caplog.records  # 0600: nothing to say
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="dht.identity"):
        Identity.load(path)
    assert any("chmod 600" in r.getMessage() and "0644" in r.getMessage() for r in caplog.records), caplog.text


def test_load_or_create_is_stable(tmp_path):
    path = tmp_path / "key"
    first = Identity.load_or_create(path)
    second = Identity.load_or_create(path)
    third = Identity.load_or_create(str(path))
    assert first.peer_id == second.peer_id == third.peer_id


def test_load_or_create_none_is_ephemeral():
    a = Identity.load_or_create(None)
    b = Identity.load_or_create(None)
    assert a.peer_id != b.peer_id


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"garbage that is not a key",
        b"\x00" * 32,  # a raw seed without the magic
        Identity._MAGIC + b"\x01" * 31,  # truncated
        Identity._MAGIC + b"\x01" * 33,  # too long
    ],
)
def test_garbage_key_file_gives_config_error(tmp_path, content):
    path = tmp_path / "key"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        Identity.load_or_create(path)
    message = str(info.value)
    assert str(path) in message
    assert "not a p2ptrain Ed25519 key" in message
    assert "\n" not in message
    assert path.read_bytes() == content  # never overwritten


def test_unreadable_key_file_gives_config_error(tmp_path):
    path = tmp_path / "key-dir"
    path.mkdir()  # exists but is a directory: cannot be read as a file
    with pytest.raises(ConfigError) as info:
        Identity.load(path)
    assert "cannot read key file" in str(info.value)
    assert str(path) in str(info.value)
