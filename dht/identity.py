"""Peer identity: Ed25519 key pairs and libp2p-format PeerIDs.

A PeerID is the base58btc encoding of an *identity* multihash of the protobuf-encoded public key, so
an Ed25519 peer's id starts with ``12D3KooW`` exactly as in libp2p and a libp2p tool recognises it.
Because the public key is embedded in the id (no hashing), any node can verify a signature made by a
PeerID from the id alone: this is what makes owner-signed DHT records possible without a key server.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import ConfigError

log = logging.getLogger("dht.identity")

# libp2p crypto.proto: message PublicKey { required KeyType Type = 1; required bytes Data = 2; }
# KeyType Ed25519 = 1. Field 1 varint -> 0x08 0x01; field 2 length-delimited, 32 bytes -> 0x12 0x20.
_ED25519_PROTO_PREFIX = b"\x08\x01\x12\x20"
_IDENTITY_MULTIHASH = 0x00  # multihash code "identity": the digest *is* the data


class PeerID:
    """The id of a peer: wraps the multihash bytes; hashable, comparable, printed as base58btc."""

    __slots__ = ("_bytes", "_b58", "_key")

    def __init__(self, multihash: bytes):
        multihash = bytes(multihash)
        if (
            len(multihash) != 2 + len(_ED25519_PROTO_PREFIX) + 32
            or multihash[0] != _IDENTITY_MULTIHASH
            or multihash[1] != len(multihash) - 2
            or not multihash[2:].startswith(_ED25519_PROTO_PREFIX)
        ):
            raise ValueError("not an Ed25519 identity-multihash PeerID")
        self._bytes = multihash
        self._b58: str | None = None
        self._key: Ed25519PublicKey | None = None

    @classmethod
    def from_public_key(cls, key: Ed25519PublicKey) -> PeerID:
        raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        proto = _ED25519_PROTO_PREFIX + raw
        return cls(bytes([_IDENTITY_MULTIHASH, len(proto)]) + proto)

    @classmethod
    def from_base58(cls, text: str) -> PeerID:
        """Parse a ``12D3KooW...`` string; raises ValueError with a reason on anything else."""
        try:
            raw = base58.b58decode(text)
        except ValueError:
            raise ValueError(f"peer id {text!r} is not valid base58") from None
        try:
            return cls(raw)
        except ValueError:
            raise ValueError(
                f"peer id {text!r} is not an Ed25519 libp2p PeerID (expected the 12D3KooW... form)"
            ) from None

    def to_bytes(self) -> bytes:
        return self._bytes

    def to_base58(self) -> str:
        if self._b58 is None:
            self._b58 = base58.b58encode(self._bytes).decode()
        return self._b58

    def public_key(self) -> Ed25519PublicKey:
        if self._key is None:
            self._key = Ed25519PublicKey.from_public_bytes(self._bytes[-32:])
        return self._key

    def verify(self, signature: bytes, data: bytes) -> bool:
        """True when ``signature`` is this peer's Ed25519 signature of ``data``."""
        try:
            self.public_key().verify(signature, data)
            return True
        except (InvalidSignature, ValueError):
            return False

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PeerID) and other._bytes == self._bytes

    def __lt__(self, other: PeerID) -> bool:
        return self._bytes < other._bytes

    def __hash__(self) -> int:
        return hash(self._bytes)

    def __str__(self) -> str:
        return self.to_base58()

    def __repr__(self) -> str:
        return f"PeerID({self.to_base58()})"

    def short(self) -> str:
        """Last characters of the id, for logs (the prefix is the same for every Ed25519 peer)."""
        return "…" + self.to_base58()[-6:]


class Identity:
    """An Ed25519 private key and the PeerID derived from it."""

    def __init__(self, private_key: Ed25519PrivateKey | None = None):
        self.private_key = private_key or Ed25519PrivateKey.generate()
        self.public_key = self.private_key.public_key()
        self.peer_id = PeerID.from_public_key(self.public_key)

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)

    def private_bytes(self) -> bytes:
        return self.private_key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> Identity:
        return cls(Ed25519PrivateKey.from_private_bytes(raw))

    # Key file: the 32-byte raw seed behind a short magic, so a wrong file is told apart from a key.
    _MAGIC = b"p2ptrain-ed25519-v1\n"

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the key atomically with mode 0600 (never world-readable, even for an instant).

        The temp file is a fresh, unpredictable name opened with O_EXCL and O_NOFOLLOW
        (``mkstemp``): a file or symlink someone placed beside the key is never written through."""
        path = Path(path)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            try:
                os.write(fd, self._MAGIC + self.private_bytes())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Identity:
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise ConfigError(f"cannot read key file {path}: {e.strerror}") from None
        if not data.startswith(cls._MAGIC) or len(data) != len(cls._MAGIC) + 32:
            raise ConfigError(
                f"key file {path} is not a p2ptrain Ed25519 key; move it away to create a new identity"
            )
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if os.name == "posix" and mode & 0o077:
            log.warning("key file %s can be read by other users (mode %04o): run 'chmod 600 %s'", path, mode, path)
        return cls.from_private_bytes(data[len(cls._MAGIC) :])

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str] | None) -> Identity:
        """Load the key at ``path``, creating it (mode 0600) when missing; ephemeral when None."""
        if path is None:
            return cls()
        if Path(path).exists():
            return cls.load(path)
        identity = cls()
        identity.save(path)
        return identity
