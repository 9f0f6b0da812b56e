"""A checkpoint's tensors under the names a model gives them, so an export loads with
``model.load_state_dict(safetensors.torch.load_file(path))``.

A trainer's checkpoint holds the swarm's state as the optimizer sees it: a list of parameters
(``params`` in sync mode, ``outer`` in diloco), the optimizer's state (``inner`` / ``outer_opt``)
and, when the trainer knows its model, ``buffers``: the model's ``state_dict`` tensors that the
optimizer does not train (BatchNorm running stats, frozen parameters). The manifest's
``meta["state_dict"]`` maps each ``state_dict`` key to the dotted path of its tensor in that
state (``{"fc1.weight": "params.0", "bn.running_mean": "buffers.0"}``; tied weights map two keys
to one path). A checkpoint without that map (older ones, an optimizer given no model) exports
under the paths themselves, as before.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .manifest import MAX_TENSORS, Manifest
from .safetensors_io import tensor_names, write_safetensors

if TYPE_CHECKING:
    import torch

    from .blobs import Progress
    from .store import CheckpointStore

#: the manifest meta key of the state_dict key -> state path map
META_KEY = "state_dict"
#: where the model tensors the optimizer does not train sit in a trainer's checkpoint state
BUFFERS = "buffers"
#: top-level keys of a trainer's state that hold optimizer state -> their prefix in an export
OPTIMIZER_PREFIXES = {"inner": "optimizer", "outer_opt": "outer_optimizer", "scheduler": "scheduler"}
#: prefix of any other tensor of the state that no model name covers (exported on request only)
OTHER_PREFIX = "p2ptrain"
#: names one tensor may have (tied weights: BART ties 4 embeddings); more is not a model's claim
MAX_ALIASES = 8


def module_names(model: torch.nn.Module, params: Sequence[torch.Tensor],
                 prefix: str) -> tuple[dict[str, str], list[str]]:
    """``(names, extra_keys)`` for a trainer whose state holds ``params`` under ``prefix``: each
    ``model.state_dict()`` key -> its path in the state (``params.0``, ``buffers.0``), and the
    keys of the tensors the state must hold besides the parameters (in ``buffers`` order; keys,
    since ``model.to()`` replaces buffer tensors). Non-tensor entries (a module's
    ``get_extra_state``) have no place in a checkpoint and are left out. ValueError when a
    parameter the optimizer trains is not in the model's state_dict."""
    import torch

    where = {id(p): i for i, p in enumerate(params)}
    names: dict[str, str] = {}
    extra_keys: list[str] = []
    extra_at: dict[int, int] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            continue
        i = where.get(id(t))
        if i is None:
            i = extra_at.setdefault(id(t), len(extra_keys))
            if i == len(extra_keys):
                extra_keys.append(key)
            names[key] = f"{BUFFERS}.{i}"
        else:
            names[key] = f"{prefix}.{i}"
    named = {v for v in names.values()}
    for i, p in enumerate(params):
        if f"{prefix}.{i}" not in named:
            raise ValueError(f"model= must be the module the optimizer trains: the optimizer's parameter {i} "
                             f"(shape {list(p.shape)}) is not in model.state_dict()")
    return names, extra_keys


def recorded_names(manifest: Manifest) -> dict[str, int] | None:
    """The manifest's state_dict key -> tensor index map, or None when it records none (or one
    that does not fit its tensors: the meta of a fetched manifest is another peer's claim)."""
    names = manifest.meta.get(META_KEY)
    if not isinstance(names, dict) or not names or len(names) > MAX_TENSORS:
        return None
    try:
        index = {path: i for i, path in enumerate(tensor_names(manifest.skeleton))}
    except ValueError:
        return None
    out: dict[str, int] = {}
    uses: dict[int, int] = {}
    for key, path in names.items():
        if not isinstance(key, str) or not key or not isinstance(path, str) or path not in index:
            return None
        out[key] = i = index[path]
        uses[i] = uses.get(i, 0) + 1
        if uses[i] > MAX_ALIASES:  # each name is a copy in the file: a claim of 1000 would be 1000 copies
            return None
    return out


def export_plan(manifest: Manifest, with_optimizer: bool = False) -> tuple[list[tuple[str, int]], str | None]:
    """``([(name in the file, tensor index)], note)`` for exporting ``manifest``: its model's
    state_dict names (and, ``with_optimizer``, every other tensor under a prefix: ``optimizer.``,
    ``outer_optimizer.``, ``scheduler.``, ``p2ptrain.``). A trainer's checkpoint without recorded
    names: its model tensors (and, ``with_optimizer``, the rest) under their paths in the state
    (``params.0``), and ``note`` says so. ValueError when two tensors would share a name."""
    paths = tensor_names(manifest.skeleton)
    names = recorded_names(manifest)
    if names is None:
        note = ("this checkpoint records no state_dict names (saved by an older p2ptrain, or by an optimizer "
                "given no model=): tensors are named by their path in the saved state, e.g. params.0")
        if not _looks_like_trainer_state(paths):  # an imported model file: its paths are its names
            return list(zip(paths, range(len(paths)))), None
        keep = [(p, i) for i, p in enumerate(paths) if with_optimizer or p.split(".", 1)[0] in _MODEL_PARTS]
        return keep, note
    plan = list(names.items())
    if with_optimizer:
        used = set(names.values())
        for i, path in enumerate(paths):
            if i not in used:
                head, _, rest = path.partition(".")
                prefix = OPTIMIZER_PREFIXES.get(head)
                plan.append((f"{prefix}.{rest}" if prefix and rest else f"{OTHER_PREFIX}.{path}", i))
    seen: set[str] = set()
    for name, _ in plan:
        if name in seen:
            raise ValueError(f"two tensors would both be named {name!r} in the file (a model key clashes with "
                             "an optimizer state name); export without --with-optimizer")
        seen.add(name)
    return plan, None


#: top-level keys of a trainer's state that hold the model's tensors
_MODEL_PARTS = ("params", "outer", BUFFERS)


def _looks_like_trainer_state(paths: list[str]) -> bool:
    """A checkpoint a trainer wrote, not an imported model file (whose paths are its names)."""
    return any(p.split(".", 1)[0] in _MODEL_PARTS[:2] for p in paths)


def export_safetensors(store: CheckpointStore, manifest_id: bytes, path: str | os.PathLike[str], *,
                       with_optimizer: bool = False, progress: Progress | None = None) -> tuple[int, str | None]:
    """Write checkpoint ``manifest_id`` of ``store`` as a plain ``.safetensors`` file, atomically;
    returns (tensors written, note). Names as :func:`export_plan` gives them; the file's metadata
    holds the checkpoint's CID, run and epoch (and the metadata of an imported file)."""
    from .cid import cid as make_cid

    manifest = store.manifest(manifest_id)
    plan, note = export_plan(manifest, with_optimizer)  # fails before reading gigabytes
    _, tensors = store.load_tensors(manifest_id, progress=progress, only={i for _, i in plan})
    out: dict[str, Any] = {}
    written: set[int] = set()
    for name, i in plan:  # a tied weight is one tensor under two names: the file holds a copy each
        out[name] = tensors[i].clone() if i in written else tensors[i]
        written.add(i)
    metadata: dict[str, str] = {}
    imported = manifest.meta.get("safetensors_metadata")
    if isinstance(imported, dict):
        metadata.update({k: v for k, v in imported.items() if isinstance(k, str) and isinstance(v, str)})
    metadata["p2ptrain.cid"] = make_cid(manifest_id)
    infos = store.infos(manifest_id)
    if infos:
        metadata["p2ptrain.run_id"] = infos[0].run_id
        metadata["p2ptrain.epoch"] = str(infos[0].epoch)
    write_safetensors(path, out, metadata)
    return len(out), note
