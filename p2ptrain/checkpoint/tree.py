"""Split nested Python state (a model or optimizer ``state_dict``) into a msgpack-able skeleton
plus a flat list of tensors, and put it back together, without pickle.

Why: tensors must cross the wire and land on disk as raw bytes (one copy, hashable in chunks),
while the small structure around them (dict keys, hyper-parameters, ``param_groups``) needs a
format a hostile peer cannot turn into code execution. msgpack carries the structure; this module
defines the skeleton grammar and validates it. Sans-IO: no sockets, no files.

Skeleton grammar (every container is tagged, so lists, tuples and tensor references stay
distinct after a msgpack round trip, and dicts may have int keys as optimizer ``state`` does)::

    node   := None | bool | int | float | str | bytes          (scalars, as themselves)
            | ["l", [node, ...]]                                (list)
            | ["t", [node, ...]]                                (tuple)
            | ["d", [[key, node], ...]]                         (dict; key is str or int; order kept)
            | ["T", index, dtype_name, [dim, ...]]              (tensor number ``index``)

Tensor indices are assigned in depth-first order and every index 0..n-1 appears exactly once.
What is not preserved: ``OrderedDict`` becomes ``dict`` (so a model state dict loses its
``_metadata`` version attribute, which ``load_state_dict`` treats as "current"), tensors come
back contiguous, without ``requires_grad``, and tensors that shared storage come back separate.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: nesting deeper than this is refused: state dicts are 3-4 levels deep, and a hostile skeleton
#: must not be able to exhaust Python's recursion limit
MAX_DEPTH = 64
#: more dimensions than torch itself supports is refused
MAX_NDIM = 64
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # what msgpack can encode

#: dtype name (as in ``torch.<name>``) -> bytes per value. A static table, so that reading and
#: checking a manifest (``p2ptrain ckpt ls``, ``show``, ``verify``) does not import torch, which
#: takes ~2 s on the machines we run on; ``test_itemsizes_match_torch`` keeps it honest.
ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
}
_TORCH_DTYPES: tuple[dict[str, torch.dtype], dict[torch.dtype, str]] | None = None


def _torch_dtypes() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    """name -> dtype and back, for the names this torch build has (imports torch on first use)."""
    global _TORCH_DTYPES
    if _TORCH_DTYPES is None:
        import torch

        names = {n: getattr(torch, n) for n in ITEMSIZE if hasattr(torch, n)}
        _TORCH_DTYPES = (names, {dt: n for n, dt in names.items()})
    return _TORCH_DTYPES


def known_dtype(name: Any) -> bool:
    """Whether a skeleton or manifest may name dtype ``name``. In a process that has torch loaded
    (every one that will build tensors from it), only the dtypes this torch build has; in one
    that does not (the ``ckpt`` commands that only read manifests), every name in ``ITEMSIZE``."""
    if not isinstance(name, str) or name not in ITEMSIZE:
        return False
    return "torch" not in sys.modules or name in _torch_dtypes()[0]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name that ``known_dtype`` accepted (imports torch)."""
    try:
        return _torch_dtypes()[0][name]
    except KeyError:
        raise ValueError(f"this torch build has no dtype {name!r:.40}; a newer torch can load it") from None


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # name -> torch dtype for this build (imports torch)
        return _torch_dtypes()[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_SCALARS = (type(None), bool, int, float, str, bytes)


@dataclass(frozen=True)
class TensorSpec:
    """What a tensor reference in a skeleton promises: dtype name and shape."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype``; ValueError for dtypes without a stable byte layout here."""
    name = _torch_dtypes()[1].get(dtype)
    if name is None:
        raise ValueError(f"tensors of dtype {dtype} cannot be serialized")
    return name


def spec_of(t: torch.Tensor) -> TensorSpec:
    """The spec of a plain dense tensor; ValueError for sparse, quantized or meta tensors."""
    import torch

    if t.layout != torch.strided or t.is_quantized or t.is_meta or t.is_nested:
        raise ValueError(f"only dense strided tensors can be serialized, not {t.layout} / {t.device}")
    return TensorSpec(dtype_name(t.dtype), tuple(t.shape))


# ---------------------------------------------------------------------------- flatten


def _is_key(k: Any) -> bool:
    return isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool))


def flatten(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """``(skeleton, tensors)``: the msgpack-able structure and the tensors in reference order.

    Tensors are returned as they are (no copy): the caller decides when to copy (see
    ``manifest.build_snapshot``). Raises ValueError for anything the grammar cannot carry.
    """
    import torch

    tensors: list[torch.Tensor] = []

    def walk(x: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"nesting deeper than {MAX_DEPTH} levels (or a reference cycle)")
        if isinstance(x, torch.Tensor):
            spec = spec_of(x)
            tensors.append(x)
            return ["T", len(tensors) - 1, spec.dtype, list(spec.shape)]
        if isinstance(x, _SCALARS):
            if type(x) is int and not _INT_MIN <= x <= _INT_MAX:
                raise ValueError(f"integer {x} does not fit in 64 bits")
            return x
        if isinstance(x, dict):
            pairs = []
            for k, v in x.items():
                if not _is_key(k):
                    raise ValueError(f"dict keys must be str or int, not {type(k).__name__}: {k!r:.60}")
                if not isinstance(k, str) and not _INT_MIN <= k <= _INT_MAX:
                    raise ValueError(f"dict key {k} does not fit in 64 bits")
                pairs.append([k, walk(v, depth + 1)])
            return ["d", pairs]
        if isinstance(x, list):
            return ["l", [walk(v, depth + 1) for v in x]]
        if isinstance(x, tuple):
            return ["t", [walk(v, depth + 1) for v in x]]
        raise ValueError(f"cannot serialize a {type(x).__module__}.{type(x).__qualname__}")

    return walk(obj, 0), tensors


# ---------------------------------------------------------------------------- unflatten


def _parse_ref(node: list) -> tuple[int, TensorSpec]:
    if len(node) != 4:
        raise ValueError("tensor reference must be ['T', index, dtype, shape]")
    _, index, dtype, shape = node
    if type(index) is not int or index < 0:
        raise ValueError(f"bad tensor index {index!r:.40}")
    if not known_dtype(dtype):
        raise ValueError(f"unknown tensor dtype {dtype!r:.40}")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise ValueError(f"tensor shape must be a list of at most {MAX_NDIM} dims")
    for d in shape:
        if type(d) is not int or d < 0 or d >= 2**62:
            raise ValueError(f"bad tensor dimension {d!r:.40}")
    return index, TensorSpec(dtype, tuple(shape))


def _rebuild(skeleton: Any, on_tensor: Callable[[int, TensorSpec], Any]) -> tuple[Any, int]:
    """Walk ``skeleton`` validating it; tensor references become ``on_tensor(index, spec)``.
    Returns the rebuilt object and the number of tensor references (indices checked to be
    exactly 0..n-1, each once)."""
    seen: set[int] = set()

    def walk(node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"skeleton nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, _SCALARS):
            return node
        if not isinstance(node, list) or len(node) < 2 or not isinstance(node[0], str):
            raise ValueError(f"malformed skeleton node of type {type(node).__name__}")
        tag = node[0]
        if tag == "T":
            index, spec = _parse_ref(node)
            if index in seen:
                raise ValueError(f"tensor index {index} referenced twice")
            seen.add(index)
            return on_tensor(index, spec)
        if len(node) != 2 or not isinstance(node[1], list):
            raise ValueError(f"malformed skeleton node {tag!r:.10}")
        body = node[1]
        if tag == "l":
            return [walk(v, depth + 1) for v in body]
        if tag == "t":
            return tuple(walk(v, depth + 1) for v in body)
        if tag == "d":
            out: dict = {}
            for pair in body:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise ValueError("dict entries must be [key, value] pairs")
                k = pair[0]
                if not _is_key(k):
                    raise ValueError(f"dict keys must be str or int, not {type(k).__name__}")
                if k in out:
                    raise ValueError(f"duplicate dict key {k!r:.60}")
                out[k] = walk(pair[1], depth + 1)
            return out
        raise ValueError(f"unknown skeleton tag {tag!r:.10}")

    obj = walk(skeleton, 0)
    if seen and (min(seen) != 0 or max(seen) != len(seen) - 1):
        raise ValueError("tensor indices must be exactly 0..n-1")
    return obj, len(seen)


def tensor_specs(skeleton: Any) -> list[TensorSpec]:
    """Validate ``skeleton`` and return its tensor specs in index order (ValueError if invalid)."""
    specs: dict[int, TensorSpec] = {}

    def collect(index: int, spec: TensorSpec) -> None:
        specs[index] = spec

    _, n = _rebuild(skeleton, collect)
    return [specs[i] for i in range(n)]


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Rebuild the object ``flatten`` took apart; the tensors are used as given (no copy).

    ``skeleton`` may come from a peer: anything malformed (unknown tag or dtype, bad or missing
    index, a tensor whose dtype/shape differs from its reference, too deep nesting, bad dict
    keys) raises ValueError before any object is handed back.
    """

    def take(index: int, spec: TensorSpec) -> torch.Tensor:
        if index >= len(tensors):
            raise ValueError(f"tensor index {index} out of range ({len(tensors)} tensors)")
        t = tensors[index]
        if t.dtype != spec.torch_dtype or tuple(t.shape) != spec.shape:
            raise ValueError(
                f"tensor {index} is {dtype_name(t.dtype)}{list(t.shape)}, "
                f"the skeleton says {spec.dtype}{list(spec.shape)}"
            )
        return t

    obj, n = _rebuild(skeleton, take)
    if n != len(tensors):
        raise ValueError(f"skeleton references {n} tensors, {len(tensors)} were given")
    return obj
