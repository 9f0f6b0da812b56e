"""The checkpoints of an FSDP peer's ranks, one shard of the model each, exported as one file.

Each rank of an FSDP peer checkpoints its own shard's swarm (:mod:`p2ptrain.optim.fsdp`); its
manifest's ``meta["fsdp"]`` says ``[rank, world size, [full shape of each parameter]]``. Given one
checkpoint of every rank, :func:`export_shards` writes the whole model under its ``state_dict``
names: each parameter's shards concatenated along dim 0 in rank order (``fully_shard``'s
``Shard(0)``), every other tensor (buffers, which FSDP replicates) from rank 0's checkpoint.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .export import recorded_names
from .safetensors_io import tensor_names, write_safetensors

if TYPE_CHECKING:
    import torch

    from .blobs import Progress
    from .manifest import Manifest
    from .store import CheckpointStore

#: the manifest meta key of a shard's checkpoint: [rank, world size, [full shape of each parameter]]
FSDP_LABEL = "fsdp"
#: ranks a model may be sharded over (a label is another peer's claim: bounded before use)
MAX_WORLD = 1 << 16
_PARAM = re.compile(r"^(?:params|outer)\.(\d+)$")


def shard_label(manifest: Manifest) -> tuple[int, int, list[list[int]]] | None:
    """``(rank, world size, full shapes)`` of a shard's checkpoint; None for a whole model's
    (or a malformed label)."""
    label = manifest.meta.get(FSDP_LABEL)
    if not (isinstance(label, list) and len(label) == 3):
        return None
    rank, world, shapes = label
    if not (type(rank) is int and type(world) is int and 0 <= rank < world <= MAX_WORLD and isinstance(shapes, list)):
        return None
    if not all(isinstance(s, list) and all(type(d) is int and 0 <= d < 2**62 for d in s) for s in shapes):
        return None
    return rank, world, shapes


def stitch(labels: Sequence[tuple[int, int, list[list[int]]]]) -> list[int]:
    """The order (indices into ``labels``) that puts one checkpoint of each rank 0..K-1 in rank
    order; ValueError when they are not the K shards of one model."""
    if not labels:
        raise ValueError("no shards given")
    world, shapes = labels[0][1], labels[0][2]
    if sorted(r for r, _, _ in labels) != list(range(world)) or any(w != world or s != shapes for _, w, s in labels):
        got = ", ".join(f"rank {r} of {w}" for r, w, _ in labels)
        raise ValueError(f"these checkpoints are not the shards of one model ({got}): give one checkpoint "
                         "of each rank of an FSDP peer, saved at the same epoch")
    return sorted(range(len(labels)), key=lambda i: labels[i][0])


def export_shards(store: CheckpointStore, manifest_ids: Sequence[bytes], path: str | os.PathLike[str], *,
                  progress: Progress | None = None) -> int:
    """Write the whole model from one checkpoint of every rank of an FSDP peer (``manifest_ids``,
    any order) as one ``.safetensors`` file, atomically; returns the tensors written."""
    import torch

    manifests = [store.manifest(m) for m in manifest_ids]
    labels = [shard_label(m) for m in manifests]
    if any(label is None for label in labels):
        raise ValueError("a checkpoint given is not a shard of an FSDP peer's model (it has no fsdp label)")
    order = stitch(labels)  # type: ignore[arg-type]
    shapes = labels[order[0]][2]  # type: ignore[index]
    names = recorded_names(manifests[order[0]])
    if names is None:
        raise ValueError("the shards record no state_dict names (their optimizer was given no model=)")
    paths = tensor_names(manifests[order[0]].skeleton)
    loaded: list[list[torch.Tensor | None]] = []
    for i in order:
        loaded.append(store.load_tensors(manifest_ids[i], progress=progress, only=set(names.values()))[1])
    out: dict[str, Any] = {}
    for key, index in names.items():
        param = _PARAM.match(paths[index])
        if param is None:  # (a buffer: replicated, rank 0's)
            out[key] = loaded[0][index]
            continue
        shape = shapes[int(param.group(1))]
        parts = [shard[index] for shard in loaded]
        whole = torch.cat([p.reshape(-1, *shape[1:]) for p in parts]) if shape else parts[0]  # type: ignore[union-attr]
        if list(whole.shape) != shape:
            raise ValueError(f"{key}: the shards make {list(whole.shape)}, their label says {shape}")
        out[key] = whole
    write_safetensors(path, out, {"p2ptrain.shards": str(len(order))})
    return len(out)
