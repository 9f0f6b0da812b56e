"""Hostile peers: checkpoints attacks (see the package docstring).

* ``latest_claim``: a fresh identity signs a checkpoint of its own choosing as its run's latest,
  at an epoch no honest writer reaches, then serves and announces it like any writer does.
* ``huge_manifest``: a provider serves, as a live state or a checkpoint, a manifest of far more
  bytes than the fetcher's model holds; every chunk is zeros, so each one verifies and the
  attacker needs none of the memory or disk it makes the fetcher spend.
"""

from __future__ import annotations

from typing import Any

import blake3

from dht import DHTNode

from ...checkpoint.manifest import Manifest, build_snapshot, layout
from ...checkpoint.store import CheckpointStore
from ...checkpoint.swarm import CheckpointService, announce
from ...checkpoint.state_server import StateServer
from ...checkpoint.tree import tensor_specs
from ._registry import mode

#: the highest epoch a checkpoint record can carry
MAX_EPOCH = 2**63 - 1


@mode("latest_claim", "announce a self-signed checkpoint of the attacker's as its run's latest, at epoch 2**63-1")
async def latest_claim(node: DHTNode, store: CheckpointStore, run_id: str, state: Any, *,
                       meta: dict[str, Any] | None = None, epoch: int = MAX_EPOCH, ttl: float = 60.0
                       ) -> CheckpointService:
    """Save ``state`` (with manifest ``meta``, e.g. copied from an honest checkpoint so that it
    loads) as epoch ``epoch`` of ``run_id``, signed by ``node`` alone, then serve and announce it.
    The caller closes the returned service."""
    manifest, buffer = build_snapshot(state, {"epoch": epoch, **(meta or {})})
    info = store.save(manifest, buffer, run_id=run_id, epoch=epoch, identity=node.identity)
    service = CheckpointService(node, store, run_id=run_id, ttl=ttl)
    await service.start()
    await announce(node, store, info, ttl=ttl)
    return service


def zeros_manifest(total: int, *, chunk_size: int = 4 << 20, meta: dict[str, Any] | None = None) -> Manifest:
    """A valid manifest of one ``total``-byte uint8 tensor of zeros under ``params``; nothing of
    that size is allocated (every full chunk has the same digest)."""
    skeleton = ["d", [["params", ["l", [["T", 0, "uint8", [total]]]]]]]
    entries, size = layout(tensor_specs(skeleton))
    full, last = divmod(size, chunk_size)
    digests = blake3.blake3(bytes(chunk_size)).digest() * full + (blake3.blake3(bytes(last)).digest() if last else b"")
    return Manifest(skeleton, tuple(entries), chunk_size, digests, dict(meta or {}), max_total=size)


class ZeroSource:
    """Serves a :func:`zeros_manifest`'s chunks from one chunk of zeros; counts what it sent."""

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self._zeros = memoryview(bytes(manifest.chunk_size))
        self.chunks_sent = 0

    async def chunk(self, index: int) -> memoryview:
        start, end = self.manifest.chunk_span(index)
        self.chunks_sent += 1
        return self._zeros[: end - start]


@mode("huge_manifest", "serve a manifest of far more bytes (zeros, each chunk valid) than the fetcher's model holds")
def huge_manifest(server: StateServer, key: str, total: int = 60 << 30, *,
                  meta: dict[str, Any] | None = None) -> ZeroSource:
    """Serve a ``total``-byte state of zeros under ``key`` (a live state's key, or a run's
    checkpoint key: ``directory.transfer_key``) from ``server``; returns its source, whose
    ``manifest.id`` a checkpoint record can name and whose ``chunks_sent`` tells what was taken."""
    source = ZeroSource(zeros_manifest(total, meta=meta))

    async def resolve(asked: str) -> list[Any]:
        return [source] if asked == key else []

    server.add_resolver(resolve)
    return source
