"""Sans-IO checkpoint pieces: skeleton flatten/unflatten, manifests, snapshots.

Round trips (every dtype, nested structures via hypothesis, optimizer and model state dicts giving
the identical next step), and hostile input (skeletons and manifests a peer could send) rejected
with ValueError / ManifestError before anything is built or allocated.
"""

from __future__ import annotations

import math

import blake3
import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2ptrain.checkpoint import (
    Manifest,
    ManifestError,
    StateTooLarge,
    build_snapshot,
    flatten,
    restore,
    unflatten,
)
from p2ptrain.checkpoint.manifest import ALIGN, MAX_MANIFEST_BYTES, hash_chunks
from p2ptrain.checkpoint.tree import DTYPES, ITEMSIZE, MAX_DEPTH, tensor_specs


def same(a, b) -> bool:
    """Structural equality that tells list from tuple, int from bool, and compares tensors and
    floats bit for bit (NaN, -0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, float):
        return (a == b and math.copysign(1, a) == math.copysign(1, b)) or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def wire(skeleton):
    """What a peer would receive: the skeleton after a msgpack round trip."""
    return msgpack.unpackb(msgpack.packb(skeleton, use_bin_type=True), raw=False, strict_map_key=False)


def random_tensor(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    numel = math.prod(shape)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


# ---------------------------------------------------------------------------- tree round trips


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", sorted(DTYPES), ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 0, 3), (4, 5)], ids=str)
def test_every_dtype_and_shape_round_trips(dtype, shape):
    t = random_tensor(DTYPES[dtype], shape)
    skeleton, tensors = flatten({"t": t})
    assert tensors[0] is t  # flatten never copies
    assert same(unflatten(wire(skeleton), tensors), {"t": t})
    m, buf = build_snapshot({"t": t}, chunk_size=4096)
    assert same(restore(Manifest.from_bytes(m.to_bytes()), buf), {"t": t})


def test_scalars_containers_and_int_keys_survive_the_wire():
    obj = {
        "none": None, "t": True, "f": False, "i": -(2**63), "u": 2**64 - 1, "x": 1.5, "nan": float("nan"),
        "neg0": -0.0, "s": "ünïcode", "b": b"\x00\xff", "list": [1, [2, (3, 4)], ()], "tuple": (1, "a", [None]),
        3: {0: "int keys", -7: [], "mixed": {}}, "empty": {},
    }
    skeleton, tensors = flatten(obj)
    assert tensors == []
    assert same(unflatten(wire(skeleton), []), obj)


def test_non_contiguous_tensors_and_parameters_come_back_plain_and_contiguous():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    obj = {"t": base.t(), "s": base[:, ::2], "p": torch.nn.Parameter(torch.ones(2))}
    m, buf = build_snapshot(obj, chunk_size=4096)
    out = restore(m, buf)
    assert torch.equal(out["t"], base.t()) and out["t"].is_contiguous()
    assert torch.equal(out["s"], base[:, ::2]) and type(out["p"]) is torch.Tensor and not out["p"].requires_grad


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True), st.text(max_size=8),
    st.binary(max_size=8),
)
tensors = st.builds(
    random_tensor,
    st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8, torch.float64]),
    st.lists(st.integers(0, 3), max_size=3).map(tuple),
    st.integers(0, 1000),
)
keys = st.one_of(st.text(max_size=6), st.integers(-(2**63), 2**63 - 1))
trees = st.recursive(
    st.one_of(scalars, tensors),
    lambda kids: st.one_of(
        st.lists(kids, max_size=4), st.lists(kids, max_size=4).map(tuple), st.dictionaries(keys, kids, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees)
def test_nested_structures_round_trip(obj):
    skeleton, ts = flatten(obj)
    assert same(unflatten(wire(skeleton), ts), obj)
    m, buf = build_snapshot(obj, {"epoch": 1}, chunk_size=4096)
    m2 = Manifest.from_bytes(m.to_bytes())
    assert m2.id == m.id
    assert same(restore(m2, buf, copy=True), obj)


# ---------------------------------------------------------------------------- state dicts


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4))


def _step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True, betas=(0.8, 0.95)),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
], ids=["adamw", "adamw-amsgrad", "sgd-momentum"])
def test_optimizer_and_model_state_round_trip_gives_identical_next_step(make_opt):
    model = _model(0)
    opt = make_opt(model.parameters())
    for i in range(3):
        _step(model, opt, i)
    snap = {"model": model.state_dict(), "opt": opt.state_dict(), "epoch": 3}
    m, buf = build_snapshot(snap, {"epoch": 3}, chunk_size=4096)
    state = restore(Manifest.from_bytes(m.to_bytes()), buf.clone())
    assert isinstance(next(iter(state["opt"]["state"])), int)

    other = _model(1)  # different weights and hyper-parameters: everything must come from the state
    other_opt = make_opt(other.parameters())
    other_opt.param_groups[0]["lr"] = 0.5
    other.load_state_dict(state["model"])
    other_opt.load_state_dict(state["opt"])
    _step(model, opt, 99)
    _step(other, other_opt, 99)
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)
    assert same(flatten(opt.state_dict())[0], flatten(other_opt.state_dict())[0])


# ---------------------------------------------------------------------------- hostile skeletons


def _ref(i=0, dtype="float32", shape=(2,)):
    return ["T", i, dtype, list(shape)]


@pytest.mark.parametrize("skeleton,match", [
    (_ref(dtype="float128"), "unknown tensor dtype"),
    (_ref(dtype=7), "unknown tensor dtype"),
    (_ref(i=1), "out of range|0..n-1"),
    (_ref(i=-1), "bad tensor index"),
    (_ref(i=True), "bad tensor index"),
    (["l", [_ref(), _ref()]], "referenced twice"),
    (_ref(shape=(3,)), "skeleton says"),
    (_ref(shape=(1, 2)), "skeleton says"),
    (_ref(dtype="int32"), "skeleton says"),
    (["T", 0, "float32", [-1]], "bad tensor dimension"),
    (["T", 0, "float32", [1.5]], "bad tensor dimension"),
    (["T", 0, "float32", "2"], "shape must be a list"),
    (["T", 0, "float32", [1] * 65], "shape must be a list"),
    (["T", 0, "float32"], "tensor reference"),
    (["d", [[1.5, 1]]], "dict keys"),
    (["d", [[None, 1]]], "dict keys"),
    (["d", [[True, 1]]], "dict keys"),
    (["d", [[b"k", 1]]], "dict keys"),
    (["d", [["a", 1], ["a", 2]]], "duplicate dict key"),
    (["d", [["a"]]], "pairs"),
    (["d", {"a": 1}], "malformed skeleton node"),
    ({"a": 1}, "malformed skeleton node"),
    (["x", []], "unknown skeleton tag"),
    ([1, 2], "malformed skeleton node"),
    (["l"], "malformed skeleton node"),
    (["l", [], []], "malformed skeleton node"),
])
def test_hostile_skeletons_are_rejected(skeleton, match):
    with pytest.raises(ValueError, match=match):
        unflatten(skeleton, [torch.zeros(2)])


def test_too_deep_nesting_is_rejected_both_ways():
    deep = 1
    for _ in range(MAX_DEPTH + 1):
        deep = ["l", [deep]]
    with pytest.raises(ValueError, match="deeper than"):
        unflatten(deep, [])
    obj: list = []
    obj.append(obj)  # a cycle
    with pytest.raises(ValueError, match="deeper than"):
        flatten(obj)


def test_unused_and_missing_tensors_are_rejected():
    with pytest.raises(ValueError, match="references 1 tensors, 2 were given"):
        unflatten(_ref(), [torch.zeros(2), torch.zeros(2)])
    with pytest.raises(ValueError, match="0..n-1"):
        tensor_specs(["l", [_ref(0), _ref(2)]])


@pytest.mark.parametrize("obj,match", [
    ({1.5: 1}, "dict keys"),
    ({True: 1}, "dict keys"),
    ({(1, 2): 1}, "dict keys"),
    ({"x": {1, 2}}, "cannot serialize a builtins.set"),
    ({"x": object()}, "cannot serialize"),
    ([2**64], "does not fit in 64 bits"),
    ({-(2**63) - 1: 0}, "does not fit in 64 bits"),
    (torch.zeros(2, 2).to_sparse(), "dense strided"),
])
def test_flatten_refuses_what_it_cannot_carry(obj, match):
    with pytest.raises(ValueError, match=match):
        flatten(obj)


# ---------------------------------------------------------------------------- manifests


def _body(m: Manifest) -> dict:
    return msgpack.unpackb(m.to_bytes(), raw=False, strict_map_key=False)


def _pack(body) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


@pytest.fixture
def snap():
    obj = {"a": torch.arange(5000, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16), "s": torch.tensor(7)}
    return build_snapshot(obj, {"epoch": 12}, chunk_size=4096)


def test_manifest_layout_ids_and_chunks(snap):
    m, buf = snap
    assert [e.offset % ALIGN for e in m.tensors] == [0, 0, 0]
    assert m.total_size == buf.numel() and m.num_chunks == math.ceil(m.total_size / 4096)
    assert m.id == blake3.blake3(m.to_bytes()).digest() and m.epoch == 12
    assert all(m.verify_chunk(i, memoryview(buf.numpy())[slice(*m.chunk_span(i))]) for i in range(m.num_chunks))
    assert hash_chunks(buf, 4096) == m.digests
    pad = m.tensors[1].offset + m.tensors[1].nbytes
    assert not buf[pad : m.tensors[2].offset].any()  # alignment padding is zeroed, not stale memory
    again, _ = build_snapshot(restore(m, buf, copy=True), {"epoch": 12}, chunk_size=4096)
    assert again.id == m.id and again == m and hash(again) == hash(m)
    other, _ = build_snapshot(restore(m, buf, copy=True), {"epoch": 13}, chunk_size=4096)
    assert other.id != m.id


def test_snapshot_is_isolated_from_training_and_restore_views_or_copies(snap):
    t = torch.zeros(1000)
    m, buf = build_snapshot({"t": t}, chunk_size=4096)
    t += 1  # training goes on
    assert not restore(m, buf)["t"].any()
    view, copy = restore(m, buf)["t"], restore(m, buf, copy=True)["t"]
    assert view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    assert copy.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    with pytest.raises(ManifestError, match="buffer holds"):
        restore(m, buf[:-1])
    with pytest.raises(ManifestError, match="uint8"):
        restore(m, buf.view(torch.int32))


def test_empty_state_has_no_chunks():
    m, buf = build_snapshot({"x": 1, "e": torch.empty(0)})
    assert m.total_size == 0 and m.num_chunks == 0 and m.digests == b""
    assert same(restore(Manifest.from_bytes(m.to_bytes()), buf), {"x": 1, "e": torch.empty(0)})


def _mutate(m: Manifest, **changes) -> bytes:
    body = _body(m)
    body.update(changes)
    return _pack(body)


@pytest.mark.parametrize("make,match", [
    (lambda m: b"\xc1garbage", "not valid msgpack"),
    (lambda m: b"", "not valid msgpack"),
    (lambda m: _pack([1, 2]), "map with keys"),
    (lambda m: _pack({**_body(m), "extra": 1}), "map with keys"),
    (lambda m: _pack(dict(reversed(list(_body(m).items())))), "map with keys"),
    (lambda m: _mutate(m, v=2), "unsupported manifest version"),
    (lambda m: _mutate(m, chunk_size=100), "chunk_size"),
    (lambda m: _mutate(m, chunk_size=2.0), "chunk_size"),
    (lambda m: _mutate(m, digests=_body(m)["digests"][:-1]), "chunk digests"),
    (lambda m: _mutate(m, digests="text"), "chunk digests"),
    (lambda m: _mutate(m, total=1), "does not match the tensor table"),
    (lambda m: _mutate(m, meta=[1]), "meta must be a dict"),
    (lambda m: _mutate(m, meta={1: 2}), "meta must be a dict"),
    (lambda m: _mutate(m, tensors=_body(m)["tensors"][:-1]), "the table lists"),
    (lambda m: _mutate(m, tensors=[[d, s, o + 1, n] for d, s, o, n in _body(m)["tensors"]]), "canonical layout"),
    (lambda m: _mutate(m, tensors=[[d, s, o, n + 4] for d, s, o, n in _body(m)["tensors"]]), "canonical layout"),
    (lambda m: _mutate(m, tensors=[["int128", s, o, n] for d, s, o, n in _body(m)["tensors"]]), "malformed tensor"),
    (lambda m: _mutate(m, tensors=[[d, "x", o, n] for d, s, o, n in _body(m)["tensors"]]), "malformed tensor"),
    (lambda m: _mutate(m, skeleton=["T", 0, "float32", [1]]), "the table lists"),
    (lambda m: _mutate(m, skeleton=["d", [[1.5, 0]]]), "bad skeleton: dict keys"),
    (lambda m: m.to_bytes() + b"\x00", "not valid msgpack"),
])
def test_hostile_manifests_are_rejected(snap, make, match):
    m, _ = snap
    with pytest.raises(ManifestError, match=match):
        Manifest.from_bytes(make(m))


def test_non_canonical_encodings_are_rejected(snap):
    m, _ = snap
    body = _body(m)
    # same values, different bytes: a float meta value packed as float32, an int packed wide
    loose = msgpack.packb({**body, "meta": {"epoch": 12.5}}, use_bin_type=True, use_single_float=True)
    with pytest.raises(ManifestError, match="not canonical"):
        Manifest.from_bytes(loose)
    wide = m.to_bytes().replace(b"\xa1v\x01", b"\xa1v\xd2\x00\x00\x00\x01", 1)
    with pytest.raises(ManifestError, match="not canonical"):
        Manifest.from_bytes(wide)


def test_size_limits_are_checked_before_allocation(snap):
    m, _ = snap
    with pytest.raises(ManifestError, match="exceeds the"):
        Manifest.from_bytes(b"\x00" * (MAX_MANIFEST_BYTES + 1))
    with pytest.raises(StateTooLarge, match="exceeds the 1000-byte limit"):
        Manifest.from_bytes(m.to_bytes(), max_total=1000)
    # an exabyte tensor: rejected by arithmetic, nothing allocated
    huge = {"v": 1, "skeleton": ["T", 0, "float64", [2**40, 2**20]], "tensors": [["float64", [2**40, 2**20], 0, 2**63]],
            "chunk_size": 4096, "total": 2**63, "digests": b"", "meta": {}}
    with pytest.raises(StateTooLarge):
        Manifest.from_bytes(_pack(huge))
    with pytest.raises(StateTooLarge):
        build_snapshot({"t": torch.zeros(1000)}, max_total=100)
    with pytest.raises(ManifestError, match="msgpack-able"):
        build_snapshot({"t": torch.zeros(1)}, meta={"bad": object()})


def test_itemsizes_match_torch():
    """The static table that lets the ckpt commands read manifests without torch agrees with torch
    for every dtype this build has (and this build has the common ones)."""
    assert {"float32", "bfloat16", "int64", "bool", "float8_e4m3fn"} <= set(DTYPES)
    for name, dtype in DTYPES.items():
        assert ITEMSIZE[name] == dtype.itemsize, name
