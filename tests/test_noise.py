"""Sans-IO Noise XX handshake bound to Ed25519 PeerIDs, and the transport ciphers after it."""

from __future__ import annotations

import pytest

from dht.errors import HandshakeError, PeerIdMismatch, ProtocolError
from dht.identity import Identity
from dht.noise import CipherState, StaticKey, XXHandshake

A, B, C = Identity(), Identity(), Identity()


def run_handshake(
    init: XXHandshake, resp: XXHandshake, tamper: tuple[int, int] | None = None
) -> None:
    """Drive both sides; ``tamper=(message_number, byte_index)`` flips one byte in transit."""

    def carry(n: int, msg: bytes) -> bytes:
        if tamper is not None and tamper[0] == n:
            msg = bytearray(msg)
            msg[tamper[1]] ^= 0x01
            msg = bytes(msg)
        return msg

    resp.read_message(carry(1, init.write_message()))
    init.read_message(carry(2, resp.write_message()))
    resp.read_message(carry(3, init.write_message()))


def pair(**kw) -> tuple[XXHandshake, XXHandshake]:
    init_kw = {k: v for k, v in kw.items() if k in ("expected_peer",)}
    init = XXHandshake(A, True, prologue=kw.get("prologue_i", b"p"), local_payload={"port": 4001}, **init_kw)
    resp = XXHandshake(B, False, prologue=kw.get("prologue_r", b"p"), local_payload={"port": 5001})
    return init, resp


def test_handshake_completes_and_peers_learn_each_other():
    init, resp = pair()
    assert not init.complete and not resp.complete
    run_handshake(init, resp)
    assert init.complete and resp.complete
    assert init.remote_peer == B.peer_id
    assert resp.remote_peer == A.peer_id
    assert init.remote_payload == {"port": 5001}
    assert resp.remote_payload == {"port": 4001}


def test_expected_peer_matches():
    init, resp = pair(expected_peer=B.peer_id)
    run_handshake(init, resp)
    assert init.remote_peer == B.peer_id


def test_expected_peer_mismatch_names_both_ids():
    init, resp = pair(expected_peer=C.peer_id)
    resp.read_message(init.write_message())
    msg2 = resp.write_message()
    with pytest.raises(PeerIdMismatch) as info:  # a HandshakeError whose class says "wrong peer"
        init.read_message(msg2)
    message = str(info.value)
    assert str(C.peer_id) in message and str(B.peer_id) in message
    assert not init.complete
    # the initiator refused before revealing its identity: it has nothing to send now
    with pytest.raises(HandshakeError):
        init.write_message()


def test_static_key_reuse():
    static = StaticKey(A)
    for _ in range(2):
        init = XXHandshake(A, True, static=static)
        resp = XXHandshake(B, False)
        run_handshake(init, resp)
        assert resp.remote_peer == A.peer_id


def test_static_key_of_another_identity_is_rejected():
    # A static key signed by C but presented with A's id: the signature check must fail
    init = XXHandshake(A, True, static=StaticKey(C))
    resp = XXHandshake(B, False)
    resp.read_message(init.write_message())
    init.read_message(resp.write_message())
    with pytest.raises(HandshakeError, match="failed to prove its identity"):
        resp.read_message(init.write_message())


def _message_lengths() -> tuple[int, int, int]:
    init, resp = pair()
    m1 = init.write_message()
    resp.read_message(m1)
    m2 = resp.write_message()
    init.read_message(m2)
    m3 = init.write_message()
    return len(m1), len(m2), len(m3)


LEN1, LEN2, LEN3 = _message_lengths()


@pytest.mark.parametrize("message_number, length", [(2, LEN2), (3, LEN3)])
def test_tampering_any_byte_of_message_2_or_3_fails(message_number, length):
    accepted = []
    for index in range(length):
        init, resp = pair()
        try:
            run_handshake(init, resp, tamper=(message_number, index))
        except HandshakeError:
            assert not (init.complete and resp.complete)
        else:
            accepted.append(index)
    assert accepted == [], f"message {message_number} accepted with byte(s) {accepted} flipped"


@pytest.mark.parametrize("index", [0, 15, 31])
def test_tampered_message_1_fails_at_the_initiator(index):
    # message 1 is the bare ephemeral key: a changed key desynchronises the transcript
    init, resp = pair()
    with pytest.raises(HandshakeError):
        run_handshake(init, resp, tamper=(1, index))


def test_different_prologues_fail():
    init, resp = pair(prologue_i=b"swarm-a", prologue_r=b"swarm-b")
    resp.read_message(init.write_message())
    with pytest.raises(HandshakeError, match="wrong swarm"):
        init.read_message(resp.write_message())


@pytest.mark.parametrize(
    "step, message, match",
    [
        (1, b"", "malformed first"),
        (1, b"\x00" * 31, "malformed first"),
        (1, b"\x00" * 33, "malformed first"),
        (1, b"\x00" * 5000, "too large"),
        (2, b"\x00" * 95, "malformed second"),
        (3, b"\x00" * 63, "malformed third"),
    ],
)
def test_malformed_messages(step, message, match):
    init, resp = pair()
    with pytest.raises(HandshakeError, match=match):
        if step == 1:
            resp.read_message(message)
        elif step == 2:
            init.write_message()
            init.read_message(message)
        else:
            resp.read_message(init.write_message())
            resp.write_message()
            resp.read_message(message)


def test_garbage_message_2_of_right_size_fails():
    init, resp = pair()
    resp.read_message(init.write_message())
    real = resp.write_message()
    with pytest.raises(HandshakeError):
        init.read_message(bytes(len(real)))  # all-zero e: a low-order point


def test_out_of_turn():
    init, resp = pair()
    with pytest.raises(HandshakeError, match="out of turn"):
        resp.write_message()
    with pytest.raises(HandshakeError, match="out of turn"):
        init.read_message(b"\x00" * 32)
    run_handshake(init, resp)
    with pytest.raises(HandshakeError):
        init.write_message()
    with pytest.raises(HandshakeError):
        resp.read_message(b"\x00" * 100)


# ------------------------------------------------------------------ transport ciphers

def completed() -> tuple[XXHandshake, XXHandshake]:
    init, resp = pair()
    run_handshake(init, resp)
    return init, resp


def test_transport_ciphers_interoperate_both_directions():
    init, resp = completed()
    for i in range(5):
        ad = bytes([i]) * 8
        ct = init.send_cipher.encrypt(ad, b"hello %d" % i)
        assert resp.recv_cipher.decrypt(ad, ct) == b"hello %d" % i
        ct = resp.send_cipher.encrypt(ad, b"back %d" % i)
        assert init.recv_cipher.decrypt(ad, ct) == b"back %d" % i


def test_encrypt_into_decrypt_into():
    init, resp = completed()
    header = b"HDR45678"
    plaintext = bytearray(range(256)) * 4096  # 1 MiB
    out = bytearray(len(plaintext) + 16)
    init.send_cipher.encrypt_into(header, memoryview(plaintext), memoryview(out))
    back = bytearray(len(plaintext))
    resp.recv_cipher.decrypt_into(header, memoryview(out), memoryview(back))
    assert back == plaintext
    # interoperates with the allocating forms too
    ct = init.send_cipher.encrypt(header, b"abc")
    buf = bytearray(3)
    resp.recv_cipher.decrypt_into(header, ct, buf)
    assert buf == b"abc"
    out2 = bytearray(3 + 16)
    resp.send_cipher.encrypt_into(header, b"xyz", out2)
    assert init.recv_cipher.decrypt(header, bytes(out2)) == b"xyz"


def test_directions_use_different_keys():
    init, resp = completed()
    ct = init.send_cipher.encrypt(b"", b"data")
    # the initiator cannot read its own frame with its receive key
    with pytest.raises(ProtocolError):
        init.recv_cipher.decrypt(b"", ct)


def test_replayed_frame_fails():
    init, resp = completed()
    ct = init.send_cipher.encrypt(b"h", b"once")
    assert resp.recv_cipher.decrypt(b"h", ct) == b"once"
    with pytest.raises(ProtocolError, match="authentication"):
        resp.recv_cipher.decrypt(b"h", ct)


def test_reordered_frames_fail():
    init, resp = completed()
    first = init.send_cipher.encrypt(b"h", b"first")
    second = init.send_cipher.encrypt(b"h", b"second")
    with pytest.raises(ProtocolError):
        resp.recv_cipher.decrypt(b"h", second)
    del first


def test_reordered_frames_fail_decrypt_into():
    init, resp = completed()
    init.send_cipher.encrypt(b"h", b"first")
    second = init.send_cipher.encrypt(b"h", b"second")
    with pytest.raises(ProtocolError):
        resp.recv_cipher.decrypt_into(b"h", second, bytearray(6))


@pytest.mark.parametrize("what", ["ad", "ciphertext", "tag"])
def test_tampered_frame_fails(what):
    init, resp = completed()
    ad = b"HEADER!!"
    ct = bytearray(init.send_cipher.encrypt(ad, b"payload"))
    if what == "ad":
        ad = b"HEADER!?"
    elif what == "ciphertext":
        ct[0] ^= 1
    else:
        ct[-1] ^= 1
    with pytest.raises(ProtocolError):
        resp.recv_cipher.decrypt(ad, bytes(ct))


def test_independent_sessions_have_independent_keys():
    i1, r1 = completed()
    i2, r2 = completed()
    ct = i1.send_cipher.encrypt(b"", b"secret")
    with pytest.raises(ProtocolError):
        r2.recv_cipher.decrypt(b"", ct)
    assert r1.recv_cipher.decrypt(b"", ct) == b"secret"


def test_keyless_cipher_state_is_passthrough():
    cs = CipherState()
    assert not cs.has_key
    assert cs.encrypt(b"ad", b"plain") == b"plain"
    assert cs.decrypt(b"ad", b"plain") == b"plain"
