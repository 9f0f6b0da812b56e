"""Swarm keys: the 32-byte secret shared by the peers of a private swarm, and its key file.

A swarm key is mixed into every Noise handshake as a pre-shared key (see ``noise``), so a peer
without it cannot derive session keys at all: it is refused at the first handshake message, before
the listener reveals its identity, and cannot read or inject traffic.

The file format is libp2p's ``swarm.key`` (go-libp2p's pnet), so one key file serves both::

    /key/swarm/psk/1.0.0/
    /base16/
    <64 hex digits>

(``/base64/`` is read too.) Files are written atomically with mode 0600 and never overwritten.
The secret never appears in ``repr``/``str`` or logs: those show a short fingerprint, a hash of the
key that is safe to print and lets two operators check they hold the same key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import secrets
from pathlib import Path

from .errors import ConfigError

log = logging.getLogger("dht.swarmkey")

KEY_SIZE = 32
HEADER = "/key/swarm/psk/1.0.0/"
_FINGERPRINT_DOMAIN = b"p2ptrain-swarmfp"  # blake2b personalisation (16 bytes at most)
_MAX_FILE = 4096  # a key file is ~90 bytes; refuse to read a huge file by mistake


class SwarmKey:
    """A private swarm's pre-shared key. Compare with ``==`` (constant time); ``secret`` is the raw
    32 bytes, for the handshake only."""

    __slots__ = ("_secret",)

    def __init__(self, secret: bytes):
        if not isinstance(secret, (bytes, bytearray)) or len(secret) != KEY_SIZE:
            raise ConfigError(f"a swarm key is exactly {KEY_SIZE} bytes")
        self._secret = bytes(secret)

    @classmethod
    def generate(cls) -> SwarmKey:
        return cls(secrets.token_bytes(KEY_SIZE))

    @property
    def secret(self) -> bytes:
        return self._secret

    @property
    def fingerprint(self) -> str:
        """16 hex digits derived one-way from the key: safe to log and compare between machines."""
        return hashlib.blake2b(self._secret, digest_size=8, person=_FINGERPRINT_DOMAIN).hexdigest()

    def __repr__(self) -> str:
        return f"SwarmKey(fingerprint={self.fingerprint})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SwarmKey) and hmac.compare_digest(self._secret, other._secret)

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    # ------------------------------------------------------------------ file format

    def dumps(self) -> str:
        return f"{HEADER}\n/base16/\n{self._secret.hex()}\n"

    @classmethod
    def parse(cls, text: str, source: str = "swarm key") -> SwarmKey:
        """Read the libp2p ``swarm.key`` format; ConfigError names ``source`` and what is wrong."""
        lines = [line.strip() for line in text.strip().splitlines()]
        if len(lines) != 3 or lines[0] != HEADER:
            raise ConfigError(f"{source} is not a swarm key (expected 3 lines starting with {HEADER}); "
                              "create one with 'p2ptrain dht swarm-key FILE'")
        encoding, body = lines[1], lines[2]
        try:
            if encoding == "/base16/":
                secret = bytes.fromhex(body)
            elif encoding == "/base64/":
                secret = base64.b64decode(body, validate=True)
            else:
                raise ConfigError(f"{source}: unsupported swarm key encoding {encoding[:20]!r} "
                                  "(use /base16/ or /base64/)")
        except (ValueError, binascii.Error):
            raise ConfigError(f"{source}: the key line is not valid {encoding.strip('/')}") from None
        if len(secret) != KEY_SIZE:
            raise ConfigError(f"{source}: a swarm key is {KEY_SIZE} bytes, this one has {len(secret)}")
        return cls(secret)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SwarmKey:
        """The key in ``path``; a ConfigError (one line, naming the file) when it is not one."""
        p = Path(path).expanduser()
        try:
            with open(p, "rb") as f:
                data = f.read(_MAX_FILE + 1)
            mode = os.stat(p).st_mode
        except OSError as e:
            raise ConfigError(f"cannot read swarm key file {path}: {e.strerror or e}") from None
        if data.startswith(b"p2ptrain-ed25519-v1\n"):
            raise ConfigError(f"{path} is a peer identity key (--key-file), not a swarm key; create one with "
                              "'p2ptrain dht swarm-key FILE'")
        if len(data) > _MAX_FILE:
            raise ConfigError(f"{path} is not a swarm key (larger than {_MAX_FILE} bytes)")
        try:
            text = data.decode("ascii")
        except UnicodeDecodeError:
            raise ConfigError(f"{path} is not a swarm key (not text)") from None
        key = cls.parse(text, f"swarm key file {path}")
        if mode & 0o077:
            log.warning("swarm key file %s is readable by other users (mode %o): chmod 600 %s",
                        path, mode & 0o777, path)
        return key

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the key to a new file with mode 0600, atomically; never replaces an existing file
        (a swarm key overwritten by mistake would lock this peer out of its swarm)."""
        p = Path(path).expanduser()
        if p.exists() or p.is_symlink():
            raise ConfigError(f"{path} already exists; refusing to overwrite a swarm key (remove it first)")
        parent = p.parent if str(p.parent) else Path(".")
        if not parent.is_dir():
            raise ConfigError(f"cannot create swarm key file {path}: directory {parent} does not exist")
        tmp = parent / f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, self.dumps().encode("ascii"))
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, p)  # fails if the target appeared meanwhile: no silent overwrite
            except FileExistsError:
                raise ConfigError(f"{path} already exists; refusing to overwrite a swarm key") from None
        except OSError as e:
            raise ConfigError(f"cannot create swarm key file {path}: {e.strerror or e}") from None
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def load_swarm_key(key: SwarmKey | bytes | str | os.PathLike[str] | None) -> SwarmKey | None:
    """Normalise what callers pass as ``swarm_key``: a SwarmKey, its 32 raw bytes, or a key file."""
    if key is None or isinstance(key, SwarmKey):
        return key
    if isinstance(key, (bytes, bytearray)):
        return SwarmKey(bytes(key))
    if not isinstance(key, (str, os.PathLike)):
        raise TypeError(f"swarm_key must be a SwarmKey, 32 bytes or a key file path, not {type(key).__name__}")
    return SwarmKey.load(key)
