"""CIDv1-style names for blake3 digests, as IPFS tools print them. Sans-IO.

Why: a checkpoint is addressed by the blake3 digest of its manifest; users copy that address
between machines and commands, so it should be self-describing (which hash, which codec) and
recognisable, and a full hex digest must keep working too. A CID here is the multibase base32
(lower case, no padding, prefix ``b``) of::

    varint(1) CIDv1 | varint(0x55) raw codec | varint(0x1e) blake3-256 | varint(32) | digest

so every one starts with ``bafkr4i`` and has 59 characters.
"""

from __future__ import annotations

import base64
import binascii

DIGEST_SIZE = 32
CID_VERSION = 1
RAW_CODEC = 0x55
BLAKE3_CODE = 0x1E
#: the four header bytes: all our codes are below 0x80, so each varint is one byte
_HEADER = bytes([CID_VERSION, RAW_CODEC, BLAKE3_CODE, DIGEST_SIZE])
CID_LENGTH = 1 + -(-(len(_HEADER) + DIGEST_SIZE) * 8 // 5)  # 'b' + unpadded base32
#: the characters every CID of ours shares (the header's whole base32 characters)
CID_COMMON_PREFIX = "b" + base64.b32encode(_HEADER + bytes(DIGEST_SIZE)).decode().lower()[: len(_HEADER) * 8 // 5]


def cid(digest: bytes) -> str:
    """The CIDv1 string (``bafkr4i...``) of a 32-byte blake3 digest."""
    if not isinstance(digest, (bytes, bytearray)) or len(digest) != DIGEST_SIZE:
        raise ValueError(f"a blake3 digest is {DIGEST_SIZE} bytes")
    return "b" + base64.b32encode(_HEADER + bytes(digest)).decode().rstrip("=").lower()


def parse_cid(text: str) -> bytes:
    """The 32-byte digest named by ``text``: a CID as :func:`cid` writes it or 64 hex digits.

    Raises ValueError with a message saying what was expected (prefixes are resolved by the
    checkpoint store, which knows what exists)."""
    if not isinstance(text, str):
        raise ValueError(f"a checkpoint id is a string, not {type(text).__name__}")
    s = text.strip()
    if len(s) == 2 * DIGEST_SIZE and all(c in "0123456789abcdefABCDEF" for c in s):
        return bytes.fromhex(s)
    if s[:1] in ("b", "B") and len(s) == CID_LENGTH:
        body = s[1:].upper()
        try:
            raw = base64.b32decode(body + "=" * (-len(body) % 8))
        except (binascii.Error, ValueError):
            raise ValueError(f"{_show(s)} is not valid base32") from None
        if raw[:4] != _HEADER:
            raise ValueError(f"{_show(s)} is a CID, but not a CIDv1 raw blake3-256 one (expected 'bafkr4i...')")
        if cid(raw[4:]) != s.lower():  # stray bits in the last character: one digest, one name
            raise ValueError(f"{_show(s)} is not a canonical CID (its last character is wrong)")
        return raw[4:]
    raise ValueError(
        f"{_show(s)} is not a checkpoint id: give its CID (bafkr4i..., {CID_LENGTH} characters) "
        f"or its blake3 digest ({2 * DIGEST_SIZE} hex digits)"
    )


def _show(s: str) -> str:
    return repr(s if len(s) <= 80 else s[:77] + "...")
