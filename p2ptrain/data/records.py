"""The record formats a dataset is cut from and served as (the documented format). Sans-IO.

* ``text``: any UTF-8 text files. A record is one line (its newline kept); files are read in
  the order given and their lines packed, whole, into shards of about ``shard_bytes`` bytes. A
  shard is stored as one ``uint8`` tensor of those bytes; readers get each record as ``bytes``.
* ``tokens``: ``.safetensors`` files, each holding one integer tensor (any name; the only one,
  or the one called ``tokens``) of shape ``[N, L]`` (N records of L tokens) or ``[N]`` (a token
  stream, cut into records of ``row`` tokens, the tail dropped). Every shard is one tensor of
  whole rows, with the input's dtype; readers get each record as a 1-D tensor.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from ..checkpoint.safetensors_io import read_safetensors
from .index import DatasetError

DEFAULT_SHARD_BYTES = 1 << 20
DEFAULT_ROW = 512
_INT_DTYPES = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}


def detect_format(paths: list[Path]) -> str:
    """``tokens`` when every path is a ``.safetensors`` file, ``text`` when none is."""
    kinds = {p.suffix == ".safetensors" for p in paths}
    if kinds == {True}:
        return "tokens"
    if kinds == {False}:
        return "text"
    raise DatasetError("mixing .safetensors (token arrays) and text files in one dataset: add them as two datasets")


def text_shards(paths: Iterable[Path], shard_bytes: int = DEFAULT_SHARD_BYTES) -> Iterator[tuple[torch.Tensor, int]]:
    """(shard bytes as a uint8 tensor, record count) per shard of the text files' lines."""
    buf, count = bytearray(), 0
    for path in paths:
        with open(path, "rb") as f:
            for line in f:
                if buf and len(buf) + len(line) > shard_bytes:
                    yield torch.frombuffer(bytearray(buf), dtype=torch.uint8), count
                    buf, count = bytearray(), 0
                buf += line
                count += 1
    if buf:
        yield torch.frombuffer(bytearray(buf), dtype=torch.uint8), count


def token_rows(path: Path, row: int = DEFAULT_ROW) -> torch.Tensor:
    """The ``[N, L]`` record array of one ``.safetensors`` token file (see the module docstring)."""
    try:
        tensors, _ = read_safetensors(path)
    except (OSError, ValueError) as e:
        raise DatasetError(f"{path}: not a readable safetensors file: {e}") from None
    t = tensors.get("tokens") if "tokens" in tensors else (next(iter(tensors.values())) if len(tensors) == 1 else None)
    if t is None:
        raise DatasetError(f"{path}: holds {len(tensors)} tensors: name the token array 'tokens'")
    if t.dtype not in _INT_DTYPES or t.dim() not in (1, 2):
        raise DatasetError(f"{path}: tokens must be a 1-D or 2-D integer array, not {tuple(t.shape)} {t.dtype}")
    if t.dim() == 1:
        t = t[: t.numel() // row * row].view(-1, row)
    return t


def token_shards(paths: Iterable[Path], shard_bytes: int = DEFAULT_SHARD_BYTES,
                 row: int = DEFAULT_ROW) -> Iterator[tuple[torch.Tensor, int]]:
    """(shard tensor of whole rows, row count) per shard of the token files."""
    shape = None
    for path in paths:
        rows = token_rows(path, row)
        if shape is None:
            shape = (rows.shape[1], rows.dtype)
        elif shape != (rows.shape[1], rows.dtype):
            raise DatasetError(f"{path}: rows of {rows.shape[1]} {rows.dtype} where earlier files have "
                               f"{shape[0]} {shape[1]}: one dataset, one row shape")
        per = max(1, shard_bytes // max(1, rows.shape[1] * rows.element_size()))
        for a in range(0, len(rows), per):
            part = rows[a : a + per].contiguous().clone()
            yield part, len(part)


def shards_of(paths: list[str | os.PathLike[str]], fmt: str, shard_bytes: int = DEFAULT_SHARD_BYTES,
              row: int = DEFAULT_ROW) -> Iterator[tuple[torch.Tensor, int]]:
    """The shards of ``paths`` in format ``fmt``: (records tensor, record count) each."""
    files = [Path(p) for p in paths]
    for p in files:
        if not p.is_file():
            raise DatasetError(f"{p}: no such file")
    return text_shards(files, shard_bytes) if fmt == "text" else token_shards(files, shard_bytes, row)


def records_of(fmt: str, shard: torch.Tensor) -> Iterator[bytes | torch.Tensor]:
    """The records of one shard, in order."""
    if fmt == "text":
        yield from shard.numpy().tobytes().splitlines(keepends=True)
    else:
        yield from shard
