"""Plain ``.safetensors`` files in and out of checkpoints: tensor names and atomic files.

Why: a checkpoint's own format (manifest + chunks) is for peers; a person wants one file that
``safetensors.torch.load_file`` (or any safetensors reader) opens. A tensor's name is its dotted
path in the nested state (``model.fc1.weight``, ``optimizer.state.0.exp_avg``), which is what
``state_dict()`` keys already look like, so a model file imported with :func:`read_safetensors`
exports under the same names (a trainer's checkpoint records its model's names instead: see
:mod:`.export`). The non-tensor parts of a state (``param_groups``, the epoch) have no place in a
safetensors file and are left out.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .blobs import fsync_dir

if TYPE_CHECKING:
    import torch

#: dtypes our checkpoints carry that safetensors has no code for
UNSUPPORTED_DTYPES = frozenset({"complex128", "complex32"})


def tensor_names(skeleton: Any) -> list[str]:
    """The dotted path of every tensor of a (validated) skeleton, in tensor index order.

    Dict keys and list/tuple positions are joined by ``.``; a state that is a single tensor is
    named ``tensor``. ValueError when two tensors would get the same name (``{"a.b": x, "a":
    {"b": y}}``), since a safetensors file cannot hold both.
    """
    names: dict[int, str] = {}

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if not isinstance(node, list):
            return  # a scalar: nothing to name
        tag = node[0]
        if tag == "T":
            names[node[1]] = ".".join(path) if path else "tensor"
        elif tag == "d":
            for key, value in node[1]:
                walk(value, (*path, str(key)))
        elif tag in ("l", "t"):
            for i, value in enumerate(node[1]):
                walk(value, (*path, str(i)))

    walk(skeleton, ())
    ordered = [names[i] for i in range(len(names))]
    seen: set[str] = set()
    for name in ordered:
        if name in seen:
            raise ValueError(f"two tensors would both be named {name!r} in a safetensors file (a dict key "
                             "containing '.' collides with a nested path); this state cannot be exported")
        seen.add(name)
    return ordered


def write_safetensors(path: str | os.PathLike[str], tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (independent, contiguous CPU tensors) to ``path`` atomically: a temp
    file next to it, fsync, rename, fsync of the directory. A crash leaves the old file or the
    new one, never half of one. ValueError for a dtype safetensors cannot store."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    for name, t in tensors.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype in UNSUPPORTED_DTYPES:
            raise ValueError(f"tensor {name!r} is {dtype}, which the safetensors format cannot store")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        try:
            save_file(tensors, tmp, metadata=metadata or None)
        except (KeyError, TypeError, ValueError, RuntimeError, SafetensorError) as e:
            raise ValueError(f"safetensors cannot write this state: {e}") from None
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # safetensors creates it private; a model file is not a secret
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def read_safetensors(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, metadata)`` of a safetensors file; ValueError naming the file when it is not
    one (OSError when it cannot be read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, ValueError, TypeError, RuntimeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path} is not a valid safetensors file ({reason})") from None
    return tensors, metadata
