"""Tensor schemas: what peers must agree on before they may average together.

Sans-IO. A :class:`Schema` is the ordered list of (name, shape, dtype) of the tensors a peer
averages, plus the codec it compresses them with. Its ``hash`` (16 hex chars of a blake2b over a
canonical msgpack) is part of the matchmaking key, so peers with different models or codecs never
meet in one group. To explain *why* two peers never meet, each peer also publishes a small
:meth:`Schema.summary` (bounded size whatever the model), and :func:`schema_mismatch_message`
turns ours and theirs into one sentence a person can act on::

    peer 12D3Koo... averages 'digits-mlp' with a different model: layer fc1.weight is [64, 32]
    there and [64, 16] here
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

SCHEMA_VERSION = 1
SUMMARY_ENTRIES = 16  # tensors published in full (name, shape, dtype) in a summary
SUMMARY_DIGESTS = 1024  # tensors published as a 4-byte digest each (locates the first difference)
_DIGEST_SIZE = 4
_MAX_NAME = 200  # characters of a tensor name kept in a summary
_MAX_DIMS = 16
MAX_SHARDS = 1 << 16  # ranks one peer's model may be sharded over


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype without the "torch." prefix: "float32", "bfloat16", ...

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_wire(self) -> list:
        return [self.name, list(self.shape), self.dtype]

    def digest(self) -> bytes:
        return hashlib.blake2b(_canonical(self.to_wire()), digest_size=_DIGEST_SIZE).digest()

    def __str__(self) -> str:
        return f"{self.name} {list(self.shape)} {self.dtype}"


def _canonical(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Schema:
    """The tensors a peer averages (in order) and its codec; ``hash`` identifies the pair."""

    tensors: tuple[TensorSpec, ...]
    codec: str
    hash: str
    #: ranks the model is sharded over (FSDP world size): each averages its own shard
    shards: int = 1

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def key(self) -> str:
        """The hash, with the world size of a sharded schema (``hash/k2``): what a progress record
        publishes, so that a peer sharded otherwise can be told why it never meets us."""
        return self.hash if self.shards == 1 else f"{self.hash}/k{self.shards}"

    def describe(self, limit: int = 8) -> str:
        """One line for logs: counts, codec, hash and the first ``limit`` tensors."""
        shown = ", ".join(str(t) for t in self.tensors[:limit])
        more = f", ... ({len(self.tensors) - limit} more)" if len(self.tensors) > limit else ""
        return (
            f"{len(self.tensors)} tensors, {self.numel} elements, codec {self.codec}, "
            f"schema {self.hash}: {shown}{more}"
        )

    def summary(self, entries: int = SUMMARY_ENTRIES, digests: int = SUMMARY_DIGESTS) -> dict:
        """A bounded msgpack-able description to publish, enough to explain a mismatch.

        ``e``: the first ``entries`` tensors in full; ``d``: a 4-byte digest of each of the first
        ``digests`` tensors (so the first differing tensor can be located, and named from our side,
        even past ``entries``). About 4 KiB at most.
        """
        return {
            "v": SCHEMA_VERSION,
            "hash": self.hash,
            "codec": self.codec[:64],
            "numel": self.numel,
            "count": len(self.tensors),
            "e": [[t.name[:_MAX_NAME], list(t.shape[:_MAX_DIMS]), t.dtype[:32]] for t in self.tensors[:entries]],
            "d": b"".join(t.digest() for t in self.tensors[:digests]),
            "k": self.shards,
        }


def tensor_schema(
    named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor] | Iterable[torch.Tensor],
    codec: str,
    shards: int = 1,
) -> Schema:
    """The schema of ``named_tensors`` (pairs such as ``model.named_parameters()``, a mapping, or
    bare tensors, which are named "0", "1", ...) compressed with ``codec``. Order matters.
    ``shards``: the world size of an FSDP peer whose rank's shard these tensors are."""
    if isinstance(named_tensors, Mapping):
        named_tensors = named_tensors.items()
    specs = []
    for i, item in enumerate(named_tensors):
        if isinstance(item, torch.Tensor):
            name, tensor = str(i), item
        else:
            name, tensor = item
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise TypeError("tensor_schema expects (name, tensor) pairs or tensors")
        specs.append(TensorSpec(name, tuple(int(d) for d in tensor.shape), _dtype_name(tensor.dtype)))
    if not isinstance(codec, str) or not codec:
        raise ValueError("codec must be a non-empty string such as 'fp16'")
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"shards must be an int from 1 to {MAX_SHARDS}, got {shards!r}")
    wire = [SCHEMA_VERSION, codec, [s.to_wire() for s in specs]] + ([shards] if shards > 1 else [])
    digest = hashlib.blake2b(_canonical(wire), digest_size=8).hexdigest()
    return Schema(tuple(specs), codec, digest, shards)


def parse_summary(obj: object) -> dict | None:
    """A summary from a peer, checked field by field; None when it is malformed (hostile input)."""
    if not isinstance(obj, dict):
        return None
    h, codec, numel, count = obj.get("hash"), obj.get("codec"), obj.get("numel"), obj.get("count")
    if not (isinstance(h, str) and len(h) == 16 and all(c in "0123456789abcdef" for c in h)):
        return None
    if not (isinstance(codec, str) and 0 < len(codec) <= 64):
        return None
    for n in (numel, count):
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < 2**62:
            return None
    shards = obj.get("k", 1)
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= MAX_SHARDS:
        return None
    entries_raw, digests = obj.get("e", []), obj.get("d", b"")
    if not isinstance(entries_raw, list) or not isinstance(digests, bytes) or len(digests) % _DIGEST_SIZE:
        return None
    entries = []
    for e in entries_raw[:SUMMARY_ENTRIES * 4]:
        if not (isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and isinstance(e[1], list)
                and isinstance(e[2], str) and len(e[0]) <= _MAX_NAME and len(e[2]) <= 32
                and len(e[1]) <= _MAX_DIMS
                and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**62 for d in e[1])):
            return None
        entries.append(TensorSpec(e[0], tuple(e[1]), e[2]))
    n_digests = len(digests) // _DIGEST_SIZE
    return {
        "hash": h,
        "codec": codec,
        "numel": numel,
        "count": count,
        "shards": shards,
        "entries": entries,
        "digests": [digests[i * _DIGEST_SIZE : (i + 1) * _DIGEST_SIZE] for i in range(min(n_digests, count))],
    }


def shards_of(key: str) -> int:
    """The world size a :attr:`Schema.key` names (1: unsharded, or not a key)."""
    _, _, k = key.partition("/k")
    return int(k) if k.isdigit() and 0 < int(k) <= MAX_SHARDS else 1


def shards_mismatch_message(theirs: int, ours: int) -> str:
    """Why a peer whose model is sharded over ``theirs`` ranks never averages with ours."""
    return (f"its model sharded over {_ranks(theirs)} (FSDP world size {theirs}) and ours over {_ranks(ours)} "
            f"(world size {ours}); every peer of a run must shard its model over the same number of ranks")


def _ranks(n: int) -> str:
    return "1 rank (unsharded)" if n == 1 else f"{n} ranks"


def _shape(shape: tuple[int, ...]) -> str:
    return str(list(shape))


def schema_mismatch_message(mine: Schema, other_summary: dict, *, peer: str | None = None,
                            run: str | None = None) -> str:
    """One sentence saying what differs between our schema and a peer's published summary."""
    who = f"peer {peer}" if peer else "a peer"
    what = f"averages {run!r}" if run else "averages the same run"
    other = parse_summary(other_summary)
    if other is None:
        return f"{who} {what} but published a malformed schema summary; ignoring it"
    if other["hash"] == mine.hash:
        return f"{who} {what} with the same schema ({mine.hash})"
    if other["shards"] != mine.shards:
        return f"{who} {what} with {shards_mismatch_message(other['shards'], mine.shards)}"
    codec = f"uses codec {other['codec']}, we use {mine.codec}" if other["codec"] != mine.codec else None
    model = _model_difference(mine, other)
    if model is None and codec is None:  # no difference we can locate from the summary
        model = (
            f"schema {other['hash']} there, {mine.hash} here "
            f"({other['count']} tensors / {other['numel']} elements there, {len(mine.tensors)} / {mine.numel} here)"
        )
    if model and codec:
        detail = f"with a different model: {model}; it also {codec}"
    elif model:
        detail = f"with a different model: {model}"
    else:
        detail = f"but {codec}"
    hint = "; every peer of a run must train the same model with the same codec"
    return f"{who} {what} {detail}{hint}"


def _model_difference(mine: Schema, other: dict) -> str | None:
    """Name the first tensor that differs, or None when the model part looks identical."""
    ours = mine.tensors
    entries: list[TensorSpec] = other["entries"]
    digests: list[bytes] = other["digests"]
    first = None
    for i in range(min(len(ours), other["count"])):
        if i < len(entries):
            if entries[i] != ours[i]:
                first = i
                break
        elif i < len(digests):
            if digests[i] != ours[i].digest():
                first = i
                break
        else:
            break  # past what the peer published
    if first is not None:
        here = ours[first]
        if first < len(entries):
            there = entries[first]
            if there.name == here.name and there.shape != here.shape:
                return f"layer {here.name} is {_shape(there.shape)} there and {_shape(here.shape)} here"
            if there.name == here.name and there.dtype != here.dtype:
                return f"layer {here.name} is {there.dtype} there and {here.dtype} here"
            return f"tensor #{first} is {there} there and {here} here"
        return f"tensor #{first} differs (here it is {here})"
    if other["count"] != len(ours):
        return (f"{other['count']} tensors ({other['numel']} elements) there and "
                f"{len(ours)} ({mine.numel}) here")
    if other["numel"] != mine.numel:
        return f"{other['numel']} elements there and {mine.numel} here"
    return None
