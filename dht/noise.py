"""Sans-IO secure channel: a Noise XX handshake bound to Ed25519 PeerIDs, then AEAD frames.

Why Noise and not TLS: asyncio's TLS runs through a memory BIO in 16 KB records and caps a stream
far below what AES-GCM itself runs at (README, "Why Noise and not TLS"). A Noise handshake
(one round trip and a half, no certificates) followed by AES-256-GCM over *large* frames keeps
encryption nearly free. We follow libp2p-noise's identity binding: each side's static X25519 key
is signed by its Ed25519 identity key (``"noise-libp2p-static-key:" + static``), so after the
handshake each side knows the other's PeerID for certain.

Handshake: ``Noise_XX_25519_AESGCM_SHA256`` with the swarm's prologue (peers of different swarms or
protocol versions fail the handshake instead of talking past each other). A private swarm adds its
swarm key as a Noise pre-shared key: ``Noise_XXpsk0_25519_AESGCM_SHA256``, where ``psk0`` mixes the
key in (MixKeyAndHash) before the very first message, so every handshake key depends on it. psk0
rather than libp2p-style psk3 because a peer without the key is then refused at message 1: the
listener never answers a stranger with its static key and PeerID, and it can say why it refused
(no key, another key, or a key where it has none: the first message differs in size or fails its
tag). It answers such a peer with a one-byte *refusal* message (never a valid message 2) so that
the dialer can print a clear reason instead of "connection closed". Transport frames differ
from Noise's 64 KB messages: they are up to ``MAX_FRAME_BODY`` (4 MiB) so that tensor chunks of 4 MiB
are encrypted in one call; nonces are 64-bit counters per direction, as in Noise.

Nothing here touches a socket: callers feed bytes in and get bytes out.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Callable

import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .errors import HandshakeError, PeerIdMismatch, ProtocolError
from .identity import Identity, PeerID
from .sealer import seal_job

PROTOCOL_NAME = b"Noise_XX_25519_AESGCM_SHA256"
PSK_PROTOCOL_NAME = b"Noise_XXpsk0_25519_AESGCM_SHA256"
PSK_SIZE = 32
STATIC_KEY_DOMAIN = b"noise-libp2p-static-key:"
DHLEN = 32
TAGLEN = 16
MAX_HANDSHAKE_MESSAGE = 4096
_NONCE = struct.Struct(">4xQ")  # AESGCM nonce in Noise: 32 zero bits, then the counter big-endian
_NONCE_LIMIT = 2**64 - 1
#: why a frame that fails its tag closes the connection (inline or on the pool: the same words)
AUTH_FAILED = "frame failed authentication (corrupted or forged)"


def _hkdf2(chaining_key: bytes, ikm: bytes) -> tuple[bytes, bytes]:
    temp = hmac.digest(chaining_key, ikm, "sha256")
    out1 = hmac.digest(temp, b"\x01", "sha256")
    out2 = hmac.digest(temp, out1 + b"\x02", "sha256")
    return out1, out2


def _hkdf3(chaining_key: bytes, ikm: bytes) -> tuple[bytes, bytes, bytes]:
    temp = hmac.digest(chaining_key, ikm, "sha256")
    out1 = hmac.digest(temp, b"\x01", "sha256")
    out2 = hmac.digest(temp, out1 + b"\x02", "sha256")
    out3 = hmac.digest(temp, out2 + b"\x03", "sha256")
    return out1, out2, out3


# ---------------------------------------------------------------- swarm key refusals

#: what a listener found wrong with a dialer's first message, sent back as the one byte of a refusal
REFUSE_NO_KEY = 1  # the listener has a swarm key, the dialer has none
REFUSE_WRONG_KEY = 2  # both have one, they differ
REFUSE_UNEXPECTED_KEY = 3  # the dialer has one, the listener has none
REFUSAL_SIZE = 1  # a refusal is a handshake message of exactly one byte; message 2 is >= 96

_LISTENER_REASON = {
    REFUSE_NO_KEY: "the peer has no swarm key",
    REFUSE_WRONG_KEY: "different swarm key",
    REFUSE_UNEXPECTED_KEY: "the peer uses a swarm key and this peer has none",
}
_DIALER_REASON = {
    REFUSE_NO_KEY: "it says it is in a private swarm and this peer has no swarm key",
    REFUSE_WRONG_KEY: "it says it uses a different swarm key",
    REFUSE_UNEXPECTED_KEY: "it says it has no swarm key (a public swarm) and this peer uses one",
}
#: A refusal is one unauthenticated byte: whoever answers at the address dialed can send any code
#: (the listener cannot prove its identity to a stranger without showing it, which psk0 avoids).
#: So a dialer reports what the peer *says*, never advises dropping its own key on that word, and
#: calls a code that contradicts its own configuration a bogus refusal.
_UNVERIFIED = "a refusal is not authenticated: make sure that address is a peer of your swarm"
#: what a person should do about a refusal, by code (the CLI names its own flag)
REFUSAL_HINT = {
    REFUSE_NO_KEY: "this swarm needs --swarm-key-file (it is private)",
    REFUSE_WRONG_KEY: f"the peer says this peer's --swarm-key-file holds another key than the swarm's ({_UNVERIFIED})",
    REFUSE_UNEXPECTED_KEY: f"the peer says that swarm is public and has no swarm key ({_UNVERIFIED}; "
                           "if so, its peers need the same key as this one)",
}
_BOGUS_HINT = ("the peer's refusal does not fit this peer's own swarm key setting: not a p2ptrain peer, or "
               "not the peer you meant to reach")


class SwarmKeyMismatch(HandshakeError):
    """The two sides are not in the same swarm: different swarm keys, or only one side has one.

    ``code`` is one of ``REFUSE_*``; ``refused_by_peer`` is True on the dialing side (the listener
    refused us), False on the listening side (we refused the dialer). ``have_key`` (the dialing
    side's own setting, when known) tells a refusal that cannot be right: the code is the remote's
    unauthenticated word (see ``_UNVERIFIED``).
    """

    def __init__(self, code: int, refused_by_peer: bool, have_key: bool | None = None):
        self.code = code
        self.refused_by_peer = refused_by_peer
        #: False when the peer's refusal contradicts what we know of our own key (or is unknown)
        self.plausible = _plausible(code, have_key) if refused_by_peer else True
        if refused_by_peer:
            why = _DIALER_REASON.get(code, "it is in another swarm") if self.plausible else (
                f"with a reason ({code}) that does not fit this peer's own swarm key setting")
            message = f"the peer refused the handshake: {why}"
        else:
            message = f"handshake failed ({_LISTENER_REASON.get(code, 'different swarm key, or none')})"
        super().__init__(message)

    @property
    def hint(self) -> str:
        if not self.plausible:
            return _BOGUS_HINT
        return REFUSAL_HINT.get(self.code, "check --swarm-key-file on both sides")


def _plausible(code: int, have_key: bool | None) -> bool:
    """Whether a refusal's code can be true of a dialer with (or without) a swarm key."""
    if code not in REFUSAL_HINT:
        return False
    if have_key is None:
        return True
    return have_key == (code != REFUSE_NO_KEY)


def _pub_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _dh(priv: X25519PrivateKey, pub: bytes) -> bytes:
    try:
        return priv.exchange(X25519PublicKey.from_public_bytes(pub))
    except ValueError:  # low-order point: all-zero shared secret
        raise HandshakeError("peer sent an invalid X25519 key") from None


class CipherState:
    """One direction of an AEAD channel with a counter nonce (Noise's CipherState)."""

    __slots__ = ("_aead", "_key", "_n")

    def __init__(self, key: bytes | None = None):
        self._aead = AESGCM(key) if key is not None else None
        self._key = key
        self._n = 0

    @property
    def has_key(self) -> bool:
        return self._aead is not None

    def _next_nonce(self) -> bytes:
        if self._n >= _NONCE_LIMIT:
            raise ProtocolError("nonce space exhausted; reconnect")
        nonce = _NONCE.pack(self._n)
        self._n += 1
        return nonce

    def encrypt(self, ad: bytes, plaintext: bytes | bytearray | memoryview) -> bytes:
        if self._aead is None:
            return bytes(plaintext)
        return self._aead.encrypt(self._next_nonce(), plaintext, ad)

    def decrypt(self, ad: bytes, ciphertext: bytes | bytearray | memoryview) -> bytes:
        if self._aead is None:
            return bytes(ciphertext)
        try:
            return self._aead.decrypt(self._next_nonce(), ciphertext, ad)
        except InvalidTag:
            raise ProtocolError(AUTH_FAILED) from None

    def encrypt_into(self, ad: bytes, plaintext, out) -> None:
        """Encrypt ``plaintext`` into ``out`` (len(plaintext) + 16 bytes) without a temporary copy."""
        assert self._aead is not None
        self._aead.encrypt_into(self._next_nonce(), plaintext, ad, out)

    def encrypt_job(self, ad: bytes, plaintext, out) -> Callable[[], None]:
        """Reserve the next nonce now (frames must leave in nonce order) and return the
        encryption into ``out`` as a call for another thread (see ``dht.sealer``)."""
        assert self._key is not None
        return seal_job(self._key, self._next_nonce(), ad, plaintext, out)

    def decrypt_into(self, ad: bytes, ciphertext, out) -> None:
        assert self._aead is not None
        try:
            self._aead.decrypt_into(self._next_nonce(), ciphertext, ad, out)
        except InvalidTag:
            raise ProtocolError(AUTH_FAILED) from None

    def decrypt_job(self, ad: bytes, ciphertext, out) -> Callable[[], None]:
        """Reserve the next nonce now (frames arrive in nonce order) and return the decryption into
        ``out`` as a call for another thread; it raises ProtocolError(AUTH_FAILED) on a bad tag."""
        assert self._key is not None
        key, nonce = self._key, self._next_nonce()

        def job() -> None:  # (its own AESGCM, as ``seal_job``'s)
            try:
                AESGCM(key).decrypt_into(nonce, ciphertext, ad, out)
            except InvalidTag:
                raise ProtocolError(AUTH_FAILED) from None
        return job


class _SymmetricState:
    def __init__(self, prologue: bytes, protocol_name: bytes = PROTOCOL_NAME):
        name = protocol_name
        self.h = name.ljust(32, b"\x00") if len(name) <= 32 else hashlib.sha256(name).digest()
        self.ck = self.h
        self.cipher = CipherState()
        self.mix_hash(prologue)

    def mix_hash(self, data: bytes) -> None:
        self.h = hashlib.sha256(self.h + data).digest()

    def mix_key(self, ikm: bytes) -> None:
        self.ck, temp_k = _hkdf2(self.ck, ikm)
        self.cipher = CipherState(temp_k)

    def mix_key_and_hash(self, ikm: bytes) -> None:
        self.ck, temp_h, temp_k = _hkdf3(self.ck, ikm)
        self.mix_hash(temp_h)
        self.cipher = CipherState(temp_k)

    def encrypt_and_hash(self, plaintext: bytes) -> bytes:
        ct = self.cipher.encrypt(self.h, plaintext)
        self.mix_hash(ct)
        return ct

    def decrypt_and_hash(self, ciphertext: bytes) -> bytes:
        try:
            pt = self.cipher.decrypt(self.h, ciphertext)
        except ProtocolError:
            raise HandshakeError("handshake message failed authentication (wrong swarm or garbage)") from None
        self.mix_hash(ciphertext)
        return pt

    def split(self) -> tuple[CipherState, CipherState]:
        k1, k2 = _hkdf2(self.ck, b"")
        return CipherState(k1), CipherState(k2)


class StaticKey:
    """A host's static X25519 key and its identity signature, made once and reused by every
    handshake (as libp2p-noise does): saves a key generation and a signature per connection."""

    def __init__(self, identity: Identity, private: X25519PrivateKey | None = None):
        self.private = private or X25519PrivateKey.generate()
        self.public = _pub_bytes(self.private)
        self.signature = identity.sign(STATIC_KEY_DOMAIN + self.public)


class XXHandshake:
    """The three-message XX pattern. Drive it with ``write_message``/``read_message`` in turn:

    initiator: write(1) read(2) write(3)        responder: read(1) write(2) read(3)

    ``local_payload`` (msgpack-able dict) is carried, encrypted, in messages 2 and 3 next to the
    identity proof; the remote's arrives in ``remote_payload``. When ``expected_peer`` is set the
    initiator refuses a responder with any other PeerID, before it reveals its own identity.

    ``psk`` (a swarm key's 32 bytes) turns the pattern into XXpsk0. A responder whose first message
    does not match (other key, or a key on one side only) raises :class:`SwarmKeyMismatch`; it
    should then send ``refusal(error)`` instead of message 2, which makes the initiator's
    ``read_message`` raise a SwarmKeyMismatch with the reason.
    """

    def __init__(
        self,
        identity: Identity,
        initiator: bool,
        prologue: bytes = b"",
        expected_peer: PeerID | None = None,
        local_payload: dict | None = None,
        static: StaticKey | None = None,
        psk: bytes | None = None,
    ):
        if psk is not None and len(psk) != PSK_SIZE:
            raise ValueError(f"a pre-shared key is {PSK_SIZE} bytes")
        self.identity = identity
        self.initiator = initiator
        self.expected_peer = expected_peer
        self.local_payload = local_payload or {}
        self._psk = psk
        self._ss = _SymmetricState(prologue, PSK_PROTOCOL_NAME if psk is not None else PROTOCOL_NAME)
        self._static = static or StaticKey(identity)
        self._s = self._static.private
        self._e = X25519PrivateKey.generate()
        self._re: bytes | None = None
        self._rs: bytes | None = None
        self._step = 0
        self.remote_peer: PeerID | None = None
        self.remote_payload: dict = {}
        self.send_cipher: CipherState | None = None
        self.recv_cipher: CipherState | None = None

    @property
    def complete(self) -> bool:
        return self.send_cipher is not None

    @property
    def first_message_size(self) -> int:
        return DHLEN + (TAGLEN if self._psk is not None else 0)

    def _identity_payload(self) -> bytes:
        return msgpack.packb(
            {
                "id": self.identity.peer_id.to_bytes(),
                "sig": self._static.signature,
                "ext": self.local_payload,
            },
            use_bin_type=True,
        )

    def _check_identity(self, payload: bytes) -> None:
        try:
            obj = msgpack.unpackb(payload, raw=False)  # size already bounded by MAX_HANDSHAKE_MESSAGE
            if not isinstance(obj, dict):
                raise ValueError
            peer = PeerID(obj["id"])
            sig, ext = obj["sig"], obj.get("ext", {})
            if not isinstance(sig, bytes) or not isinstance(ext, dict):
                raise ValueError
        except Exception:
            raise HandshakeError("peer sent a malformed identity payload") from None
        assert self._rs is not None
        if not peer.verify(sig, STATIC_KEY_DOMAIN + self._rs):
            raise HandshakeError(f"peer {peer} failed to prove its identity (bad static-key signature)")
        if self.expected_peer is not None and peer != self.expected_peer:
            raise PeerIdMismatch(f"dialed {self.expected_peer} but reached {peer}: refusing the connection")
        self.remote_peer = peer
        self.remote_payload = ext

    # ------------------------------------------------------------------ tokens

    def _write_e(self) -> bytes:
        e_pub = _pub_bytes(self._e)
        self._ss.mix_hash(e_pub)
        if self._psk is not None:  # psk handshakes also mix ephemeral keys into the cipher key
            self._ss.mix_key(e_pub)
        return e_pub

    def _read_e(self, e_pub: bytes) -> None:
        self._re = bytes(e_pub)
        self._ss.mix_hash(self._re)
        if self._psk is not None:
            self._ss.mix_key(self._re)

    def _write(self, payload: bytes) -> bytes:
        """The next handshake message carrying ``payload`` (Noise's WriteMessage)."""
        ss = self._ss
        if self.initiator and self._step == 0:  # -> [psk,] e
            if self._psk is not None:
                ss.mix_key_and_hash(self._psk)
            out = self._write_e() + ss.encrypt_and_hash(payload)
        elif not self.initiator and self._step == 1:  # <- e, ee, s, es
            out = self._write_e()
            ss.mix_key(_dh(self._e, self._re))
            out += ss.encrypt_and_hash(self._static.public)
            ss.mix_key(_dh(self._s, self._re))
            out += ss.encrypt_and_hash(payload)
        elif self.initiator and self._step == 2:  # -> s, se
            out = ss.encrypt_and_hash(self._static.public)
            ss.mix_key(_dh(self._s, self._re))
            out += ss.encrypt_and_hash(payload)
            self.send_cipher, self.recv_cipher = ss.split()
        else:
            raise HandshakeError("handshake message written out of turn")
        self._step += 1
        return out

    def _read(self, message: bytes) -> bytes:
        """The payload of the peer's next handshake message (Noise's ReadMessage)."""
        ss = self._ss
        if len(message) > MAX_HANDSHAKE_MESSAGE:
            raise HandshakeError("handshake message too large")
        if not self.initiator and self._step == 0:  # -> [psk,] e
            if len(message) < self.first_message_size:
                raise HandshakeError("malformed first handshake message (not a p2ptrain peer?)")
            if self._psk is not None:
                ss.mix_key_and_hash(self._psk)
            self._read_e(message[:DHLEN])
            try:
                payload = ss.decrypt_and_hash(message[DHLEN:])
            except HandshakeError:
                if self._psk is None:
                    raise
                raise SwarmKeyMismatch(REFUSE_WRONG_KEY, refused_by_peer=False) from None
        elif self.initiator and self._step == 1:  # <- e, ee, s, es
            if len(message) == REFUSAL_SIZE:
                raise SwarmKeyMismatch(message[0], refused_by_peer=True, have_key=self._psk is not None)
            if len(message) < DHLEN + DHLEN + TAGLEN + TAGLEN:
                raise HandshakeError("malformed second handshake message")
            self._read_e(message[:DHLEN])
            ss.mix_key(_dh(self._e, self._re))
            self._rs = ss.decrypt_and_hash(message[DHLEN : 2 * DHLEN + TAGLEN])
            ss.mix_key(_dh(self._e, self._rs))
            payload = ss.decrypt_and_hash(message[2 * DHLEN + TAGLEN :])
        elif not self.initiator and self._step == 2:  # -> s, se
            if len(message) < DHLEN + TAGLEN + TAGLEN:
                raise HandshakeError("malformed third handshake message")
            self._rs = ss.decrypt_and_hash(message[: DHLEN + TAGLEN])
            ss.mix_key(_dh(self._e, self._rs))
            payload = ss.decrypt_and_hash(message[DHLEN + TAGLEN :])
            self.recv_cipher, self.send_cipher = ss.split()
        else:
            raise HandshakeError("handshake message read out of turn")
        self._step += 1
        return payload

    def _check_first_message_size(self, n: int) -> None:
        if n > MAX_HANDSHAKE_MESSAGE:
            raise HandshakeError("handshake message too large")
        if n == DHLEN + (TAGLEN if self._psk is not None else 0):
            return
        if self._psk is not None and n == DHLEN:
            raise SwarmKeyMismatch(REFUSE_NO_KEY, refused_by_peer=False)
        if self._psk is None and n == DHLEN + TAGLEN:
            raise SwarmKeyMismatch(REFUSE_UNEXPECTED_KEY, refused_by_peer=False)
        raise HandshakeError("malformed first handshake message (not a p2ptrain peer?)")

    # ------------------------------------------------------------------ p2ptrain's messages

    def write_message(self) -> bytes:
        """Messages 2 and 3 carry our identity proof; message 1 carries nothing."""
        return self._write(b"" if self._step == 0 else self._identity_payload())

    def read_message(self, message: bytes) -> None:
        step = self._step
        if step == 0 and not self.initiator:
            self._check_first_message_size(len(message))
        payload = self._read(message)
        try:
            if step == 0:
                if payload:
                    raise HandshakeError("malformed first handshake message (unexpected payload)")
            else:
                self._check_identity(payload)
        except HandshakeError:
            self._step = -1  # a refused identity ends the handshake: nothing more may be written
            self.send_cipher = self.recv_cipher = None
            raise

    @staticmethod
    def refusal(error: SwarmKeyMismatch) -> bytes:
        """The message a responder sends instead of message 2 when it refuses a dialer."""
        return bytes([error.code])
