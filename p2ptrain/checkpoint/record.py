"""The signed root of a checkpoint: which manifest is epoch E of run R, according to whom. Sans-IO.

Why: a manifest id pins every byte of a state, but not what that state *is*. Peers announce
"the latest checkpoint of run R" in the DHT and keep such claims on disk; the record binds run id,
epoch, manifest id and size to the writer's PeerID with an Ed25519 signature, so anyone can check
a claim from the record alone (the public key is inside the PeerID) and ignore forgeries.

Encoding: a msgpack map in a fixed key order; ``from_bytes`` accepts only that canonical form
(re-encoding gives the same bytes), so equal bytes mean equal records. The signature covers a
domain-separated msgpack array of every other field.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import msgpack

from dht import Identity, PeerID

from ..errors import P2PTrainError

VERSION = 1
DIGEST_SIZE = 32
SIGNATURE_SIZE = 64
MAX_RECORD_BYTES = 1024
MAX_RUN_ID = 100
_MAX_INT = 2**63 - 1
_DOMAIN = "p2ptrain/checkpoint-record/1"
_KEYS = ("v", "run_id", "epoch", "manifest", "size", "created", "writer", "sig")


class RecordError(P2PTrainError, ValueError):
    """Bytes that are not a well-formed checkpoint record; the message says which field is wrong."""


def check_run_id(run_id: object) -> str:
    """``run_id`` when it is a valid run id (what the optimizer accepts), else RecordError."""
    if not isinstance(run_id, str) or not run_id or len(run_id) > MAX_RUN_ID or "/" in run_id \
            or not run_id.isprintable():
        raise RecordError(f"run id {run_id!r:.60}: a run id is 1 to {MAX_RUN_ID} printable characters without '/'")
    return run_id


@dataclass(frozen=True)
class CheckpointRecord:
    """``writer`` says: manifest ``manifest_id`` (``size`` bytes of state) is epoch ``epoch``
    of run ``run_id``, written at ``created`` (unix time). Construct with :meth:`sign` or
    :meth:`from_bytes`; check with :meth:`verify`."""

    run_id: str
    epoch: int
    manifest_id: bytes
    size: int
    created: float
    writer: PeerID
    signature: bytes

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        if type(self.epoch) is not int or not 0 <= self.epoch <= _MAX_INT:
            raise RecordError(f"epoch {self.epoch!r:.40} must be a non-negative 64-bit int")
        if not isinstance(self.manifest_id, bytes) or len(self.manifest_id) != DIGEST_SIZE:
            raise RecordError(f"manifest id must be {DIGEST_SIZE} bytes")
        if type(self.size) is not int or not 0 <= self.size <= _MAX_INT:
            raise RecordError(f"size {self.size!r:.40} must be a non-negative 64-bit int")
        if type(self.created) is not float or not math.isfinite(self.created) or self.created < 0:
            raise RecordError(f"created {self.created!r:.40} must be a finite non-negative float")
        if not isinstance(self.writer, PeerID):
            raise RecordError("writer must be a PeerID")
        if not isinstance(self.signature, bytes) or len(self.signature) != SIGNATURE_SIZE:
            raise RecordError(f"signature must be {SIGNATURE_SIZE} bytes")

    @staticmethod
    def _payload(run_id: str, epoch: int, manifest_id: bytes, size: int, created: float, writer: PeerID) -> bytes:
        return msgpack.packb([_DOMAIN, run_id, epoch, manifest_id, size, created, writer.to_bytes()], use_bin_type=True)

    @classmethod
    def sign(cls, identity: Identity, *, run_id: str, epoch: int, manifest_id: bytes, size: int,
             created: float | None = None) -> CheckpointRecord:
        """A record of ``identity``'s claim; ``created`` defaults to now. RecordError on bad fields."""
        check_run_id(run_id)
        created = time.time() if created is None else float(created)
        if type(epoch) is not int or type(size) is not int:  # before packing: msgpack takes floats too
            raise RecordError("epoch and size must be ints")
        if not isinstance(manifest_id, bytes) or len(manifest_id) != DIGEST_SIZE:
            raise RecordError(f"manifest id must be {DIGEST_SIZE} bytes")
        try:
            payload = cls._payload(run_id, epoch, manifest_id, size, created, identity.peer_id)
        except (OverflowError, TypeError, ValueError) as e:
            raise RecordError(f"cannot encode the record: {e}") from None
        return cls(run_id, epoch, manifest_id, size, created, identity.peer_id, identity.sign(payload))

    def verify(self) -> bool:
        """True when ``signature`` is ``writer``'s signature of every other field."""
        payload = self._payload(self.run_id, self.epoch, self.manifest_id, self.size, self.created, self.writer)
        return self.writer.verify(self.signature, payload)

    def to_bytes(self) -> bytes:
        return msgpack.packb({
            "v": VERSION, "run_id": self.run_id, "epoch": self.epoch, "manifest": self.manifest_id,
            "size": self.size, "created": self.created, "writer": self.writer.to_bytes(), "sig": self.signature,
        }, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> CheckpointRecord:
        """Decode untrusted bytes; RecordError (and nothing else) when they are not a record.
        The signature is *not* checked here: call :meth:`verify`."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise RecordError(f"a record is bytes, not {type(data).__name__}")
        if len(data) > MAX_RECORD_BYTES:
            raise RecordError(f"record of {len(data)} bytes exceeds the {MAX_RECORD_BYTES}-byte limit")
        data = bytes(data)
        try:
            body = msgpack.unpackb(data, raw=False, strict_map_key=True, max_str_len=MAX_RECORD_BYTES,
                                   max_bin_len=MAX_RECORD_BYTES, max_array_len=16, max_map_len=16, max_ext_len=0)
        except (ValueError, TypeError, msgpack.UnpackException) as e:  # msgpack's errors on garbage
            raise RecordError(f"record is not valid msgpack ({type(e).__name__})") from None
        if not isinstance(body, dict) or tuple(body) != _KEYS:
            raise RecordError(f"a record is a map with keys {list(_KEYS)}")
        if body["v"] != VERSION:
            raise RecordError(f"unsupported record version {body['v']!r:.20}")
        if not isinstance(body["writer"], bytes):
            raise RecordError("writer must be bytes")
        try:
            writer = PeerID(body["writer"])
        except ValueError as e:
            raise RecordError(f"writer: {e}") from None
        record = cls(body["run_id"], body["epoch"], body["manifest"], body["size"], body["created"], writer,
                     body["sig"])
        if record.to_bytes() != data:
            raise RecordError("record encoding is not canonical")
        return record

    def _order(self) -> tuple[int, float, bytes]:
        return self.epoch, self.created, bytes(255 - b for b in self.manifest_id)

    def newer_than(self, other: CheckpointRecord | None) -> bool:
        """Whether this record supersedes ``other``: higher epoch wins; on a tie the later
        ``created``, then the lower manifest id (an arbitrary but global order, so every peer
        picks the same one)."""
        return other is None or self._order() > other._order()
