"""The all-reduce's sans-IO reduction (``p2ptrain.averaging.reducer``) and the codec capabilities it
chooses its strategy by: no event loop, no streams."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.averaging.reducer import SUM_LIMIT, ShardReducer, Strategy, choose_strategy
from p2ptrain.compression import ErrorFeedback, get_codec, kernels
from p2ptrain.compression.float import NoneCodec

_EMPTY = torch.empty(0)


def test_codecs_declare_what_they_support():
    none, int8 = get_codec("none"), get_codec("int8")
    assert none.wire_is_values and not ErrorFeedback(NoneCodec()).wire_is_values
    assert not any(get_codec(c).wire_is_values for c in ("fp16", "bf16", "int8", "int8-outlier", "topk"))
    assert all(get_codec(c).encode_total for c in ("none", "int8", "int8-outlier"))
    assert not any(get_codec(c).encode_total for c in ("fp16", "bf16", "topk"))
    assert int8.fuses_add_encode(get_codec("int8")) == kernels.AVAILABLE
    assert not int8.fuses_add_encode(get_codec("int8", block=128))  # another layout of the reply
    assert not int8.fuses_add_encode(get_codec("int8-outlier"))
    assert not get_codec("int8-outlier").fuses_add_encode(get_codec("int8-outlier"))  # no fused kernel
    assert not none.fuses_add_encode(none)


@pytest.mark.parametrize("codec, gcodec, agg, absmax, want", [
    ("none", "none", "mean", 1.0, Strategy(robust=False, in_place=True, running_mean=True, fused_reply=False)),
    # own values not measured up front, or beyond what a lerp keeps finite: sum, then divide
    ("none", "none", "mean", None, Strategy(robust=False, in_place=True, running_mean=False, fused_reply=False)),
    ("none", "none", "mean", 2 * SUM_LIMIT, Strategy(False, True, False, False)),
    ("int8", "int8", "mean", None, Strategy(False, True, False, kernels.AVAILABLE)),
    ("int8", "none", "mean", 0.0, Strategy(False, True, False, False)),
    ("int8-outlier", "int8-outlier", "mean", 0.0, Strategy(False, True, False, False)),
    ("fp16", "fp16", "mean", 0.0, Strategy(False, False, False, False)),  # the reply's encode may overflow
    ("topk", "fp16", "mean", 0.0, Strategy(False, False, False, False)),
    ("none", "none", "trimmed_mean", 0.0, Strategy(True, False, False, False)),
    ("int8", "int8", "median", 0.0, Strategy(True, False, False, False)),
])
def test_choose_strategy(codec, gcodec, agg, absmax, want):
    assert choose_strategy(get_codec(codec), get_codec(gcodec), agg, absmax) == want


def test_choose_strategy_error_feedback_sends_encoded_values():
    s = choose_strategy(ErrorFeedback(NoneCodec()), NoneCodec(), "mean", 0.0)
    assert s.in_place and not s.running_mean


def _reducer(flat, codec, gcodec, n_expected, absmax, start=0, end=None, cn=256, agg="mean", weight=1.0):
    end = flat.numel() if end is None else end
    chunks = [(a, min(a + cn, end)) for a in range(start, end, cn)]
    strategy = choose_strategy(codec, gcodec, agg, absmax)
    return ShardReducer(flat[start:end], None, 0, n_expected + 1, start, end, chunks, cn, weight, codec, gcodec,
                        codec._meta(_EMPTY), agg, absmax, strategy, n_expected,
                        lambda n: torch.empty(n), lambda n: torch.empty(n, dtype=torch.uint8))


def _wire(codec, x):
    return memoryview(codec.encode(x).tobytes())


@pytest.mark.parametrize("codec", ["none", "fp16", "int8"])
def test_weighted_mean_of_a_shard(codec):
    torch.manual_seed(0)
    c = get_codec(codec)
    own, a, b = torch.randn(3, 1000).unbind()
    flat = own.clone()
    red = _reducer(flat, c, c, 2, float(own.abs().max()), cn=256)
    for ci, (s, e) in enumerate(red.chunks):
        red.accumulate(2.0, ci, _wire(c, a[s:e]))
        red.accumulate(1.0, ci, _wire(c, b[s:e]))
    replies = [c.decode(dict(c._meta(_EMPTY), numel=e - s), red.finalize(ci)) for ci, (s, e) in enumerate(red.chunks)]
    want = (own + 2 * a + b) / 4
    tol = {"none": 1e-6, "fp16": 2e-3, "int8": 5e-2}[codec]
    torch.testing.assert_close(torch.cat(replies), want, atol=tol, rtol=0)
    torch.testing.assert_close(flat, torch.cat(replies), atol=0, rtol=0)  # we hold what the others decode
    assert red.min_weight() == 4.0


def test_a_chunk_without_contributions_keeps_our_values():
    c = get_codec("int8")
    own = torch.randn(512)
    flat = own.clone()
    red = _reducer(flat, c, c, 1, 0.0)
    red.accumulate(1.0, 0, _wire(c, torch.randn(256)))
    red.finalize(1)
    assert torch.equal(flat[256:], own[256:])


@pytest.mark.skipif(not kernels.AVAILABLE, reason="the fused add-and-encode needs the compiled kernels")
def test_fused_reply_has_the_bits_of_sum_then_encode():
    torch.manual_seed(1)
    c = get_codec("int8")
    own, a, b = torch.randn(3, 600).unbind()
    out = []
    for fused in (True, False):
        flat = own.clone()
        red = _reducer(flat, c, c, 2, None)
        assert red.strategy.fused_reply
        if not fused:
            red.replies = None  # what a round without the capability does
        for ci, (s, e) in enumerate(red.chunks):
            red.accumulate(1.5, ci, _wire(c, a[s:e]))
            red.accumulate(0.5, ci, _wire(c, b[s:e]))
        out.append(([bytes(red.finalize(ci, torch.empty(c.encoded_nbytes(256), dtype=torch.uint8)))
                     for ci in range(len(red.chunks))], flat.clone()))
    assert out[0][0] == out[1][0] and torch.equal(out[0][1], out[1][1])


def test_robust_combine_is_the_rule_over_the_rows():
    c = get_codec("none")
    own = torch.zeros(300)
    rows = [torch.full((300,), 1.0), torch.full((300,), 1000.0), torch.full((300,), 2.0)]
    flat = own.clone()
    red = _reducer(flat, c, c, 3, 0.0, agg="median")
    for ci, (s, e) in enumerate(red.chunks):
        for r, x in enumerate(rows, start=1):
            red.store(r, ci, _wire(c, x[s:e]))
        ranks, _x, w = red.combine(ci, [(1, 1.0), (2, 1.0), (3, 1.0)])
        assert ranks == [0, 1, 2, 3] and w.tolist() == [1.0] * 4
        red.finalize(ci)
    assert bool(((flat >= 1.0) & (flat <= 2.0)).all())  # the outlier moved nothing beyond the others


async def test_a_round_leaves_no_reference_cycles(loop_errors):
    """A finished round's objects are freed by reference counting, not by a later garbage collection:
    its shard-sized buffers are back with the allocator before the next round allocates its own
    (a cycle kept a robust round's slots alive into the next: +80 MB peak RSS at N = 2, 64 MiB)."""
    import gc

    from test_allreduce import Swarm, data, run_all

    from p2ptrain.averaging.context import RoundContext
    from p2ptrain.averaging.owner import Owner
    from p2ptrain.averaging.sender import Sender

    swarm = Swarm()
    try:
        group, _h, services = await swarm.group(3)
        xs, ws = data(3, 5000)
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            results = await run_all(group, services, [x.clone() for x in xs], ws, aggregation="trimmed_mean")
            gc.collect()
            kinds = (RoundContext, Owner, Sender, ShardReducer)
            cyclic = [type(o).__name__ for o in gc.garbage if isinstance(o, kinds)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        assert all(r.ok for r in results)
        assert cyclic == []
    finally:
        await swarm.close()
