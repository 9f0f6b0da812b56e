"""The state-transfer wire protocol, spoken by ``state_server`` and ``fetch``: method and
protocol names, limits, and the checks of the fields both sides read.

Wire (on ``dht.transport`` connections):

- RPC ``p2ptrain.state.manifest`` ``{"key": str, "id"?: bytes}`` -> ``None`` or
  ``{"id": bytes, "size": int, "manifest": bytes | None, "held": [bytes, ...]}``: the latest
  manifest for ``key`` (or manifest ``id`` when the request names one this provider holds;
  inline when it fits an RPC message, else ``None``), and manifest ids still served for the
  key (the latest first).
- stream ``p2ptrain.state.manifest/1`` header ``{"key", "id"}`` -> the manifest bytes (for
  manifests too large for an RPC reply, which is limited to 1 MiB).
- stream ``p2ptrain.state.chunks/1`` header ``{"key", "id", "first", "count"}`` -> the raw
  bytes of chunks ``first .. first+count-1``, or a reset if that manifest is no longer held.
"""

from __future__ import annotations

from typing import Any

from dht import MAX_MESSAGE, PeerID

from ..addresses import Reach
from .manifest import DIGEST_SIZE

MANIFEST_METHOD = "p2ptrain.state.manifest"
MANIFEST_PROTOCOL = "p2ptrain.state.manifest/1"
CHUNKS_PROTOCOL = "p2ptrain.state.chunks/1"
MAX_KEY_LEN = 256
#: manifests up to this size travel inside the RPC reply; larger ones over a stream
INLINE_MANIFEST_MAX = MAX_MESSAGE - 4096
#: at most this many previous manifest ids are listed in a reply
MAX_HELD = 8

Address = tuple[str, int]
#: a peer to fetch from, with where to dial it when there is no connection to it yet (a direct
#: address, or a ``Reach`` that may name relays)
Provider = tuple[PeerID, Address | Reach | None]


def check_key(key: Any) -> str:
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LEN:
        raise ValueError(f"state key must be a non-empty str of at most {MAX_KEY_LEN} characters")
    return key


def check_id(mid: Any) -> bytes:
    if not isinstance(mid, bytes) or len(mid) != DIGEST_SIZE:
        raise ValueError(f"manifest id must be {DIGEST_SIZE} bytes")
    return mid
