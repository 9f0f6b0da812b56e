"""The codecs' device paths (``Codec.device_encode`` / ``device_decode`` / ``device_decode_add``):
torch ops on the tensor's own device, only wire bytes crossing to the host. Run here on CPU
tensors, they must give the CPU codec's wire bytes and decoded values bit for bit, with the
compiled int8 kernels and with the torch fallback; an all-reduce round whose sender takes them
gives the normal round's results; the CUDA test at the end (skipped without CUDA;
``P2PTRAIN_TEST_DEVICE=cpu`` runs it on the CPU) checks the same through the plain API."""

from __future__ import annotations

import asyncio
import os
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2ptrain.averaging import Averager, averager, context
from p2ptrain.averaging.group import Group
from p2ptrain.averaging.robust import aggregate
from p2ptrain.averaging.round_types import AllReduceConfig, AllReduceResult
from p2ptrain.optim.memory import flat_views
from p2ptrain.compression import CODECS, Codec, CompressionError, get_codec, kernels
from p2ptrain.compression.device import Transfer
from test_allreduce import DiesMidRound, data, run_all, swarm  # noqa: F401 - swarm is a fixture
from test_averager import nodes  # noqa: F401 - a fixture

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DEVICE_CODECS = ["none", "fp16", "bf16", "int8"]
#: where the property tests run the device paths (CUDA too where there is one)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
BLOCK = 64  # a small int8 block: odd lengths end in a short block cheaply


def make(name: str):
    return get_codec(name, block=BLOCK) if name == "int8" else get_codec(name)


def torch_path():
    """Within it, int8 on the CPU runs its torch ops instead of the compiled kernels."""
    return mock.patch.object(kernels, "AVAILABLE", False)


@st.composite
def chunks(draw, finite: bool = False):
    n = draw(st.sampled_from([0, 1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5, 1000, 4099]))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16]))
    kinds = ["randn", "zeros", "equal", "max", "fp16_edge", "subnormal", "tiny", "mixed", "ties"]
    kind = draw(st.sampled_from(kinds if finite else kinds + ["nonfinite"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(n, generator=g, dtype=torch.float64)
    fmax = torch.finfo(dtype).max
    if kind == "zeros":
        x = torch.zeros(n, dtype=torch.float64)
        x[1::3] = -0.0
    elif kind == "equal":  # every block all one value
        x = torch.full((n,), draw(st.sampled_from([-3.5, 1e-3, 7.0])), dtype=torch.float64)
    elif kind == "max":  # the dtype's largest magnitudes (bf16 refuses what rounds to inf)
        x = torch.sign(x) * fmax
    elif kind == "fp16_edge":  # around fp16's largest finite value and its overflow threshold
        x = torch.sign(x) * torch.tensor([65504.0, 65519.0, 65520.0, 1e5])[torch.randint(0, 4, (n,), generator=g)]
    elif kind == "subnormal":
        x = x * (1e-40 if dtype == torch.float32 else 1e-6 if dtype == torch.float16 else 1e-39)
    elif kind == "tiny":  # below int8's 2**-100 floor
        x = x * 1e-32
    elif kind == "mixed":
        x = x * torch.pow(10.0, torch.randint(-30, 30, (n,), generator=g).double())
    elif kind == "ties":  # k + 0.5 quantisation steps: round half to even must agree
        x = torch.randint(-254, 255, (n,), generator=g).double() / 2
        if n:
            x[0] = 127.0
    x = x.clamp(-fmax, fmax).to(dtype)
    if kind == "nonfinite" and n:
        x[draw(st.integers(0, n - 1))] = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    return x


def outcome(fn):
    """What ``fn`` returns, or the message of the CompressionError it raises."""
    try:
        return fn()
    except CompressionError as e:
        return ("refused", str(e))


def wire(enc) -> tuple[dict, bytes]:
    return enc.meta, enc.tobytes()


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bit patterns: equal bits, not merely equal values (-0.0, NaN)."""
    t = t.contiguous()
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


@SETTINGS
@given(name=st.sampled_from(DEVICE_CODECS), x=chunks(), scale=st.sampled_from([1.0, 0.5, 1 / 3, 1e-7]),
       dev=st.sampled_from(DEVICES))
def test_device_encode_is_the_cpu_encode_byte_for_byte(name, x, scale, dev):
    codec = make(name)
    want = outcome(lambda: wire(codec.encode(x, scale=scale)))
    xd = x.to(dev)
    got = outcome(lambda: wire(codec.device_encode(xd, scale=scale)))
    with torch_path():
        slow = outcome(lambda: wire(codec.encode(x, scale=scale)))
        got_slow = outcome(lambda: wire(codec.device_encode(xd, scale=scale)))
    assert got == want
    assert slow == want
    assert got_slow == want
    if want[0] == "refused":
        return
    # ``decoded`` (what a receiver decodes), also when it is the chunk itself
    dec_want, dec_got = torch.full_like(x, float("nan")), torch.full_like(xd, float("nan"))
    codec.encode(x, scale=scale, decoded=dec_want)
    assert wire(codec.device_encode(xd, scale=scale, decoded=dec_got)) == want
    assert torch.equal(bits(dec_got.cpu()), bits(dec_want))
    same = xd.clone()
    assert wire(codec.device_encode(same, scale=scale, decoded=same)) == want
    assert torch.equal(bits(same.cpu()), bits(dec_want))


@SETTINGS
@given(name=st.sampled_from(DEVICE_CODECS), x=chunks(finite=True), weight=st.sampled_from([1.0, 0.25, 1 / 3, 3.0]),
       in_place=st.booleans(), acc_dtype=st.sampled_from([torch.float32, torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**31 - 1), dev=st.sampled_from(DEVICES))
def test_device_decode_and_decode_add_are_the_cpu_ones_bit_for_bit(name, x, weight, in_place, acc_dtype, seed, dev):
    codec = make(name)
    try:
        meta, buf = wire(codec.encode(x))
    except CompressionError:  # beyond fp16's or bf16's range (test_device_encode checks the refusal)
        return
    n = x.numel()
    # (int8 refuses its own message for values within an ulp of float32's max: 127 times such a
    # block's scale rounds to inf; both paths alike)
    want = outcome(lambda: bits(codec.decode(meta, buf, torch.empty(n))))
    got = outcome(lambda: bits(codec.device_decode(meta, buf, torch.empty(n, device=dev)).cpu()))
    assert got == want if isinstance(want, tuple) else torch.equal(got, want)
    # the size of what is added, so that the add's roundings show (max-magnitude sums overflow alike)
    size = float(x.float().abs().max().clamp(1e-30, 1e30)) if n else 1.0
    base = (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * size).to(acc_dtype)

    def add(fn, on="cpu"):
        b = base.to(on)
        acc = b.clone() if in_place else torch.full_like(b, float("nan"))
        before = acc.clone()
        try:
            fn(meta, buf, acc, weight, None if in_place else b)
        except CompressionError as e:
            assert torch.equal(bits(acc), bits(before))
            return str(e)
        return acc.cpu()

    def same(a, b) -> bool:
        return a == b if isinstance(b, str) else isinstance(a, torch.Tensor) and torch.equal(bits(a), bits(b))

    want = add(codec.decode_add)
    got = add(codec.device_decode_add, dev)
    if dev == "cpu" or name == "int8" or weight == 1.0 or isinstance(want, str):
        assert same(got, want)
    else:  # a cast codec's ``base + weight * x`` on CUDA: fused like the CPU's vector lanes, or
        # one rounding apart (see float.py)
        assert isinstance(got, torch.Tensor) and within_a_rounding(got, want, base)
    with torch_path():  # (int8: the torch fallback is the kernel's order of operations too)
        assert same(add(codec.decode_add), want)
        assert same(add(codec.device_decode_add), want)


def within_a_rounding(got: torch.Tensor, want: torch.Tensor, base: torch.Tensor) -> bool:
    """``got`` and ``want`` (sums ``base + term``) are at most a rounding of the operands apart."""
    got, want, base = got.double(), want.double(), base.double()
    ulp = torch.finfo(torch.float32).eps * (base.abs() + (want - base).abs())
    inf = want.isinf()
    return bool(((got - want).abs() <= ulp)[~inf].all()) and torch.equal(got[inf], want[inf])


@pytest.mark.parametrize("name", DEVICE_CODECS)
def test_device_paths_take_unaligned_buffers_and_write_into_out(name):
    codec = make(name)
    x = torch.randn(3 * BLOCK + 5)
    meta, buf = wire(codec.encode(x))
    out = torch.zeros(len(buf) + 16, dtype=torch.uint8)
    enc = codec.device_encode(x, out=out)
    assert enc.buffers[0].data_ptr() == out.data_ptr() and enc.tobytes() == buf
    shifted = bytearray(len(buf) + 1)
    shifted[1:] = buf
    got = codec.device_decode(meta, memoryview(shifted)[1:], torch.empty(x.numel()))
    assert torch.equal(got, codec.decode(meta, buf))
    with pytest.raises(ValueError, match="out must be"):
        codec.device_encode(x, out=torch.zeros(len(buf) - 1, dtype=torch.uint8))


@pytest.mark.parametrize("name", DEVICE_CODECS)
def test_hostile_payloads_are_refused_before_acc_is_touched(name):
    codec = make(name)
    x = torch.randn(2 * BLOCK + 3)
    meta, buf = wire(codec.encode(x))
    bad = bytearray(buf)
    if name == "int8":
        bad[4:8] = torch.tensor([float("nan")]).numpy().tobytes()  # the second block's scale
    else:  # a NaN payload value (fp16 0x7e00, bf16 0x7fc0, float32 0x7fc00000: the high bytes)
        bad[2:4] = b"\xc0\x7f" if name != "fp16" else b"\x00\x7e"
    acc = torch.randn(x.numel())
    before = acc.clone()
    with pytest.raises(CompressionError) as cpu:
        codec.decode_add(meta, bytes(bad), acc.clone())
    with pytest.raises(CompressionError) as dev:
        codec.device_decode_add(meta, bytes(bad), acc)
    assert str(dev.value) == str(cpu.value)
    assert torch.equal(acc, before)
    with pytest.raises(CompressionError):
        codec.device_decode(meta, bytes(bad), acc)
    assert torch.equal(acc, before)
    with pytest.raises(CompressionError, match="expected"):  # the CPU codec's validation
        codec.device_decode_add(meta, buf[:-1], acc)


def test_codecs_declare_their_devices():
    for name in CODECS:
        codec = get_codec(name)
        assert ("cuda" in codec.devices) == (name in DEVICE_CODECS), name
        if name not in DEVICE_CODECS:
            with pytest.raises(CompressionError, match="no device path"):
                codec.device_encode(torch.randn(8))


def test_transfer_on_the_cpu_is_plain_copies():
    src = torch.arange(10, dtype=torch.float32)
    out = torch.zeros(64, dtype=torch.uint8)
    with Transfer(src.device) as tx:
        host = tx.to_host(src, out)
        assert tx.to_device(host).data_ptr() == host.data_ptr()  # (the CPU is the device: no copy)
        assert tx.item(src.sum()) == 45.0
    assert host.data_ptr() == out.data_ptr() and torch.equal(host.view(torch.float32), src)


def forced(monkeypatch, on: bool) -> None:
    """Rounds over CPU tensors take the device path (``context.staged``) or not."""
    monkeypatch.setattr(context, "staged", lambda flat: on)


def spy_device_calls(monkeypatch) -> list[str]:
    calls: list[str] = []
    for name in ("device_encode", "device_decode"):
        def spy(self, *args, _f=getattr(Codec, name), _name=name, **kw):
            calls.append(_name)
            return _f(self, *args, **kw)
        monkeypatch.setattr(Codec, name, spy)
    return calls


@pytest.mark.usefixtures("loop_errors")
@pytest.mark.parametrize("codec", ["none", "fp16", "int8"])
async def test_a_round_whose_members_take_the_device_path_gives_the_same_results(swarm, monkeypatch, codec):  # noqa: F811
    """Forced on for CPU tensors, the device path (a ``flat`` on a device: what we send encoded and
    replies decoded by the codecs' device paths, our own shard reduced in a host copy and written
    back) gives every member the normal round's values bit for bit, and it did run there."""
    calls = spy_device_calls(monkeypatch)
    async with asyncio.timeout(20):
        # two members: one contribution per owner, so no arrival order changes a sum's rounding
        group, _h, services = await swarm.group(2, config=AllReduceConfig(chunk_numel=4096))
        xs, ws = data(2, 2 * 10_007 + 5)
        got, pooled = {}, {}
        for on in (False, True):
            forced(monkeypatch, on)
            calls.clear()
            flats = [x.clone() for x in xs]
            g = Group(group.group_id + bytes([on]), group.members)
            assert all(r.ok and not r.failed for r in await run_all(g, services, flats, ws, codec))
            assert {"device_encode", "device_decode"} <= set(calls) if on else not calls
            got[on] = flats
            pooled[on] = [len(s._wires) for s in services]
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got[False], got[True]))
        assert pooled[True] == pooled[False]  # (the device path's wire buffers are pinned: not pooled)


@pytest.mark.usefixtures("loop_errors")
async def test_a_robust_round_on_the_device_path_gives_the_same_results_and_survives_a_death(swarm, monkeypatch):  # noqa: F811
    """Under a robust rule (rows combined in rank order: any arrival order gives the same bits),
    with the audit of the others' replies: the device path gives the normal path's bits; with a
    member that dies midway, the survivors hold exactly the rule over what their results report."""
    cn = 1024
    cfg = AllReduceConfig(chunk_numel=cn, timeout=10.0, join_timeout=2.0, stall_timeout=1.0)
    async with asyncio.timeout(40):
        group, _h, services = await swarm.group(3, config=cfg)
        xs, ws = data(3, 3 * 4 * cn + 77, seed=3)
        got = {}
        for on in (False, True):
            forced(monkeypatch, on)
            flats = [x.clone() for x in xs]
            g = Group(group.group_id + bytes([on]), group.members)
            assert all(r.ok and not r.failed for r in await run_all(g, services, flats, ws, aggregation="median"))
            got[on] = flats
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got[False], got[True]))

        group, _h, services = await swarm.group(3, config=cfg, service_cls={2: DiesMidRound})  # (device path)
        ones = [1.0] * 3  # (equal weights: no cap changes what the rule sees)
        flats = [x.clone() for x in xs]
        results = await asyncio.gather(*(s.run(group, r, flats[r], 1.0, aggregation="median")
                                         for r, s in enumerate(services)), return_exceptions=True)
        for r in (0, 1):
            res = results[r]
            # (2 dies sending, or later: then the audit finds it gone and recomputes its shard without it)
            assert isinstance(res, AllReduceResult) and 2 in res.failed and set(res.not_averaged) <= {2}, res
            want = xs[r].clone()
            for sh in res.shards:
                for a in range(sh.start, sh.start + sh.averaged, cn):
                    b, ci = min(a + cn, sh.end), (a - sh.start) // cn
                    ranks = sorted(set(sh.contributors) | {k for k, d in sh.partial.items() if d > ci})
                    want[a:b] = aggregate("median", torch.stack([xs[k][a:b] for k in ranks]), torch.tensor(ones)[ranks])
            assert torch.equal(bits(flats[r]), bits(want))
            assert res.shards[0].partial.get(2, 0) <= 2 and 2 not in res.shards[0].contributors


@pytest.mark.usefixtures("loop_errors")
async def test_an_averager_averages_views_of_one_buffer_in_place_on_the_device_path(nodes, monkeypatch):  # noqa: F811
    """The optimizer's buffers (``flat_views``: views of one buffer on the parameters' device)
    are averaged in that buffer, slice by slice, on the device path: no host staging of values."""
    forced(monkeypatch, True)
    calls = spy_device_calls(monkeypatch)
    monkeypatch.setattr(averager, "copy_slice", lambda *a, **k: pytest.fail("staged through the host"))
    peers = await nodes(2)
    gen = torch.Generator().manual_seed(2)
    sets = [flat_views([torch.empty(20, 30), torch.empty(100)]) for _ in peers]
    for views in sets:
        for v in views:
            v.copy_(torch.randn(v.shape, generator=gen))
    want = [(a + b) / 2 for a, b in zip(*sets)]
    avgs = [Averager(nd, "device", views, slice_numel=256, matchmaking_timeout=5.0) for nd, views in zip(peers, sets)]
    try:
        async with asyncio.timeout(30):
            assert all(a._flat is not None and a._flat.data_ptr() == v[0].data_ptr() for a, v in zip(avgs, sets))
            results = await asyncio.gather(*(a.step(expected=2) for a in avgs))
        assert all(r.averaged and len(r.allreduces) == 3 for r in results)  # 700 values in slices of 256
        assert {"device_encode", "device_decode"} <= set(calls)
        for views in sets:
            for v, w in zip(views, want):
                torch.testing.assert_close(v, w, rtol=0, atol=1e-6)
    finally:
        await asyncio.gather(*(a.close() for a in avgs))


# ---------------------------------------------------------------------------- on a device

DEVICE = torch.device(os.environ.get("P2PTRAIN_TEST_DEVICE", "cuda"))
needs_device = pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs CUDA")


@needs_device
@pytest.mark.timeout(60)
@pytest.mark.usefixtures("loop_errors")
@pytest.mark.parametrize("codec", ["none", "int8"])
async def test_a_round_over_device_tensors_gives_the_cpu_rounds_bits(swarm, monkeypatch, codec):  # noqa: F811
    """Members whose ``flat`` is on the device end with a CPU round's bits, through pinned wire
    buffers where the device is CUDA."""
    made = []

    def spy(nbytes, _f=context.host_buffer):
        made.append(_f(nbytes))
        return made[-1]
    monkeypatch.setattr(context, "host_buffer", spy)
    async with asyncio.timeout(40):
        group, _h, services = await swarm.group(2, config=AllReduceConfig(chunk_numel=1 << 16))
        xs, ws = data(2, 3 * (1 << 16) + 5)
        want = [x.clone() for x in xs]
        assert all(r.ok for r in await run_all(group, services, want, ws, codec))
        flats = [x.to(DEVICE) for x in xs]
        forced(monkeypatch, True)  # (staged on CUDA anyway; on the CPU with P2PTRAIN_TEST_DEVICE=cpu)
        g = Group(group.group_id + b"d", group.members)
        assert all(r.ok and not r.failed for r in await run_all(g, services, flats, ws, codec))
        assert all(torch.equal(bits(f.cpu()), bits(w)) for f, w in zip(flats, want))
        assert (codec == "none" or made) and all(t.is_pinned() == (DEVICE.type == "cuda") for t in made)


@needs_device
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", DEVICE_CODECS)
def test_device_tensors_encode_and_decode_as_the_cpu_does(name):
    """Through the plain API: a device chunk's wire bytes are a CPU chunk's (a CPU peer and a GPU
    peer average together), in a host buffer (pinned on CUDA); decode-adds into a device tensor
    give the CPU's float32 results. Work queued on the current stream is seen, and the result is
    seen by what is queued after."""
    codec = make(name)
    g = torch.Generator().manual_seed(1)
    cpu = torch.randn(1 << 16, generator=g) * torch.pow(10.0, torch.randint(-6, 4, (1 << 16,), generator=g).float())
    cpu[:BLOCK] = 0.0
    cpu[BLOCK : 2 * BLOCK] = 2.5
    half = cpu * 0.5
    x = cpu.to(DEVICE)
    x.mul_(0.5)  # queued on the current stream: the encode must wait for it
    for scale in (1.0, 1 / 3):
        enc = codec.encode(x, scale=scale)
        assert wire(enc) == wire(codec.encode(half, scale=scale))
        assert enc.buffers[0].device.type == "cpu"
        assert enc.buffers[0].is_pinned() == (DEVICE.type == "cuda")
    meta, buf = wire(codec.encode(half))
    base = torch.randn(half.numel(), generator=g)
    for weight in (1.0, 1 / 3):
        want = base.clone()
        codec.decode_add(meta, buf, want, weight)
        acc = base.to(DEVICE)
        codec.decode_add(meta, buf, acc, weight)
        got = acc.cpu()
        if name == "int8" or weight == 1.0:
            assert torch.equal(got, want)
        else:  # ``base + weight * x``: one fused rounding on the CPU's vector lanes and on CUDA;
            # at most one more where a platform does not fuse it
            assert within_a_rounding(got, want, base)
        out = torch.empty_like(acc)
        codec.decode(meta, buf, out=out)
        assert torch.equal(out.cpu(), codec.decode(meta, buf))
    bad = x.clone()
    bad[123] = float("nan")
    with pytest.raises(CompressionError, match="NaN or inf"):
        codec.encode(bad)
