"""Placement of fetched chunks: chosen tensors straight into the caller's memory (sans-IO)."""

from __future__ import annotations

import random

import torch

from p2ptrain.checkpoint import build_snapshot
from p2ptrain.checkpoint.placement import Placement, tensors_under

CHUNK = 4096


def make_state():
    g = torch.Generator().manual_seed(3)
    return {
        "params": [torch.randn(3000, generator=g), torch.randn(7, 5, generator=g).to(torch.bfloat16),
                   torch.randn(2, 2100, generator=g)],
        "inner": {"state": {0: {"step": torch.tensor(4.0), "m": torch.randn(3000, generator=g)}}, "lr": 0.1},
    }


def test_placed_tensors_get_their_bytes_in_place_and_the_rest_buffer_is_never_written_there():
    state = make_state()
    manifest, buffer = build_snapshot(state, {"epoch": 1}, chunk_size=CHUNK)
    idx = tensors_under(manifest.skeleton, "params")
    assert len(idx) == 3
    targets = [torch.zeros(3000), torch.zeros(7, 5, dtype=torch.bfloat16), torch.zeros(2, 2100)]
    ptrs = [t.data_ptr() for t in targets]
    place = Placement(manifest, dict(zip(idx, targets)))
    assert set(place.placed) == set(idx)
    assert place.placed_bytes == sum(t.numel() * t.element_size() for t in targets)
    place.rest.fill_(0xAB)  # a sentinel: the placed ranges of ``rest`` must keep it
    order = list(range(manifest.num_chunks))
    random.Random(1).shuffle(order)  # chunks land in any order (several providers)
    view = memoryview(buffer.numpy())
    for k in order:
        s, e = manifest.chunk_span(k)
        place.put(k, view[s:e])
    restored = place.restore()
    for got, want, target, ptr in zip(restored["params"], state["params"], targets, ptrs):
        assert got is target and got.data_ptr() == ptr
        assert torch.equal(target, want)
    assert torch.equal(restored["inner"]["state"][0]["m"], state["inner"]["state"][0]["m"])
    assert restored["inner"]["state"][0]["step"].item() == 4.0 and restored["inner"]["lr"] == 0.1
    for i in idx:
        e = manifest.tensors[i]
        assert bool((place.rest[e.offset : e.offset + e.nbytes] == 0xAB).all())


def test_a_target_that_does_not_fit_is_left_alone_and_its_bytes_land_in_the_rest():
    state = make_state()
    manifest, buffer = build_snapshot(state, {}, chunk_size=CHUNK)
    idx = tensors_under(manifest.skeleton, "params")
    wrong_shape, wrong_dtype = torch.zeros(2999), torch.zeros(7, 5)  # (float32, not bfloat16)
    strided = torch.zeros(2100, 2).t()  # not contiguous
    place = Placement(manifest, {idx[0]: wrong_shape, idx[1]: wrong_dtype, idx[2]: strided, 99: torch.zeros(1)})
    assert place.placed == {}
    view = memoryview(buffer.numpy())
    for k in range(manifest.num_chunks):
        s, e = manifest.chunk_span(k)
        place.put(k, view[s:e])
    assert torch.equal(place.rest, buffer)
    assert not wrong_shape.any() and not wrong_dtype.any() and not strided.any()
    restored = place.restore()
    for got, want in zip(restored["params"], state["params"]):
        assert torch.equal(got, want)


def test_put_rejects_a_chunk_of_the_wrong_size():
    manifest, buffer = build_snapshot(make_state(), {}, chunk_size=CHUNK)
    place = Placement(manifest, {})
    try:
        place.put(0, bytes(CHUNK - 1))
    except ValueError as e:
        assert "chunk 0" in str(e)
    else:
        raise AssertionError("a short chunk was accepted")


def test_tensors_under_reads_only_a_top_level_list_of_tensors():
    manifest, _ = build_snapshot(make_state(), {}, chunk_size=CHUNK)
    assert tensors_under(manifest.skeleton, "params") == [0, 1, 2]
    assert tensors_under(manifest.skeleton, "inner") == []  # a dict, not a list of tensors
    assert tensors_under(manifest.skeleton, "missing") == []
    for bad in (None, ["l", []], ["d", "x"], ["d", [["params", ["l", [["T", "0", "float32", []]]]]]],
                ["d", [["params", ["l", [["d", []]]]]]]):
        assert tensors_under(bad, "params") == []
