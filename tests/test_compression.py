"""Property tests for p2ptrain.compression: round-trip error bounds, exact wire sizes, NaN/inf
rejection, hostile-message fuzzing, error feedback conservation."""

from __future__ import annotations


import msgpack
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from p2ptrain.compression import (
    CODECS,
    CompressionError,
    ErrorFeedback,
    Int8Codec,
    Int8OutlierCodec,
    TopKCodec,
    get_codec,
    iter_chunks,
)

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCK = 64  # a small int8 block in the property tests so block +- 1 shapes stay cheap


def make_codec(name: str):
    if name in ("int8", "int8-outlier"):
        return get_codec(name, block=BLOCK)
    return get_codec(name)


numels = st.sampled_from([0, 1, 2, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 3, 255, 256, 257, 1000, 5000])


@st.composite
def chunks(draw, dtypes=DTYPES):
    n = draw(numels)
    dtype = draw(st.sampled_from(dtypes))
    kind = draw(st.sampled_from(["randn", "zeros", "constant", "tiny", "huge", "mixed", "sparse"]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    if kind == "zeros":
        x = torch.zeros(n, dtype=torch.float64)
    elif kind == "constant":
        x = torch.full((n,), draw(st.sampled_from([-3.5, 1e-3, 7.0])), dtype=torch.float64)
    elif kind == "tiny":
        x = x * 1e-30
    elif kind == "huge":
        x = x * 1e30
    elif kind == "mixed":  # magnitudes spanning many decades within each block
        x = x * torch.pow(10.0, torch.randint(-20, 20, (n,), generator=g).double())
    elif kind == "sparse":
        x = x * (torch.rand(n, generator=g) < 0.05)
    fmax = torch.finfo(dtype).max
    x = x.clamp(-fmax / 2, fmax / 2).to(dtype)
    return x


def fits(name: str, x: torch.Tensor) -> bool:
    """fp16 refuses values beyond its range (tested separately)."""
    return not (name == "fp16" and x.numel() and float(x.float().abs().max()) >= 65504)


# ---------------------------------------------------------------------------- round trips


def roundtrip(codec, x, **kw):
    enc = codec.encode(x, **kw)
    wire = enc.tobytes()
    assert len(wire) == enc.nbytes == codec.encoded_nbytes(x.numel(), x.dtype)
    msgpack.packb(enc.meta)  # meta is msgpack-able
    out = codec.decode(msgpack.unpackb(msgpack.packb(enc.meta)), wire)
    assert out.dtype == x.dtype and out.shape == x.shape
    return enc, wire, out


@SETTINGS
@given(x=chunks())
def test_none_exact(x):
    _, _, out = roundtrip(get_codec("none"), x)
    assert torch.equal(out, x)


@SETTINGS
@given(x=chunks(), name=st.sampled_from(["fp16", "bf16"]))
def test_float_relative_bound(x, name):
    assume(fits(name, x))
    codec = get_codec(name)
    _, _, out = roundtrip(codec, x)
    # decode into float32 to measure the wire rounding alone (not the output cast)
    out32 = codec.decode(codec.encode(x).meta, codec.encode(x).tobytes(), out=torch.empty(x.numel()))
    x64, o64 = x.double(), out32.double()
    u, tiny_abs = (2.0**-11, 2.0**-25) if name == "fp16" else (2.0**-8, 2.0**-133)
    bound = torch.maximum(u * x64.abs(), torch.full_like(x64, tiny_abs))
    assert ((o64 - x64).abs() <= bound).all()


@SETTINGS
@given(x=chunks())
def test_int8_blockwise_bound(x):
    codec = make_codec("int8")
    _, _, _ = roundtrip(codec, x)
    out = codec.decode(codec.encode(x).meta, codec.encode(x).tobytes(), out=torch.empty(x.numel()))
    n = x.numel()
    if n == 0:
        return
    x64 = x.double()
    nb = -(-n // BLOCK)
    padded = torch.zeros(nb * BLOCK, dtype=torch.float64)
    padded[:n] = x64.abs()
    absmax = padded.view(nb, BLOCK).amax(1).repeat_interleave(BLOCK)[:n]
    bound = absmax / 254 * (1 + 1e-5) + 2.0**-100
    assert ((out.double() - x64).abs() <= bound).all()


@SETTINGS
@given(x=chunks(), outliers=st.sampled_from([1, 2, 5]))
def test_int8_outlier_bound(x, outliers):
    """The ``outliers`` largest |values| of every block come back exactly, the others within half
    a step of the largest |value| left; and that error never exceeds plain int8's bound."""
    codec = get_codec("int8-outlier", block=BLOCK, outliers=outliers)
    roundtrip(codec, x)
    n = x.numel()
    if n == 0:
        return
    out = codec.decode(codec.encode(x).meta, codec.encode(x).tobytes(), out=torch.empty(n)).double()
    x64 = x.float().double()  # what the codec sees (a float16/bfloat16 chunk is cast exactly)
    nb = -(-n // BLOCK)
    padded = torch.full((nb * BLOCK,), -1.0, dtype=torch.float64)  # padding sorts below every |x|
    padded[:n] = x64.abs()
    ranked = padded.view(nb, BLOCK).sort(dim=1, descending=True)
    rest = ranked.values[:, outliers].clamp_min(0).repeat_interleave(BLOCK)[:n]  # (k+1)-th largest |x|
    absmax = ranked.values[:, 0].repeat_interleave(BLOCK)[:n]
    kept = torch.zeros(nb * BLOCK, dtype=torch.bool)
    kept.view(nb, BLOCK).scatter_(1, ranked.indices[:, :outliers], True)
    kept = kept[:n]
    err = (out - x64).abs()
    # ties: when several values share the (k+1)-th |value|, which of them travel exactly is the codec's choice
    exact = kept & (x64.abs() > rest)
    assert (err[exact] == 0).all()
    assert (err <= rest / 254 * (1 + 1e-5) + 2.0**-100).all()
    assert (err <= absmax / 254 * (1 + 1e-5) + 2.0**-100).all()


def test_int8_outlier_beats_int8_on_heavy_tails():
    """What the variant is for: a few huge values per block no longer coarsen everyone's step."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 16, generator=g)
    x[torch.randint(0, x.numel(), (x.numel() // 500,), generator=g)] *= 100
    errs = {}
    for name in ("int8", "int8-outlier"):
        codec = get_codec(name)
        out = codec.decode(*_enc_meta_wire(codec.encode(x)))
        errs[name] = float((out - x).norm() / x.norm())
    assert errs["int8-outlier"] < errs["int8"] / 4, errs
    n = 1 << 20
    assert get_codec("int8-outlier").encoded_nbytes(n) == n + 4 * (n // 256) + 2 * 5 * (n // 256)


def test_int8_outlier_options_and_bad_positions():
    for bad in ({"block": 512}, {"outliers": 0}, {"outliers": 256}, {"outliers": True}, {"outliers": 1.5}):
        with pytest.raises(CompressionError, match="bad options"):
            get_codec("int8-outlier", **bad)
    codec = Int8OutlierCodec(block=64, outliers=2)
    x = torch.randn(300)  # 4 full blocks and a tail of 44
    enc = codec.encode(x)
    nb = 5
    pos = 4 * nb + 4 * nb * 2  # where the positions start
    for at, value in ((pos, 64), (pos + 2 * 4, 44), (pos + 2 * 4 + 1, 255)):  # outside a block / the tail
        b = bytearray(enc.tobytes())
        b[at] = value
        for check in (codec.decode, codec.add_bound):
            with pytest.raises(CompressionError, match="position"):
                check(enc.meta, bytes(b))
        acc = torch.zeros(300)
        with pytest.raises(CompressionError, match="position"):
            Int8OutlierCodec(block=64, outliers=2, check_finite_on_decode=False).decode_add(enc.meta, bytes(b), acc)
        assert (acc == 0).all()
    b = bytearray(enc.tobytes())
    b[4 * nb : 4 * nb + 4] = torch.tensor([float("nan")]).numpy().tobytes()  # an outlier value
    with pytest.raises(CompressionError, match="NaN or inf"):
        codec.add_bound(enc.meta, bytes(b))
    with pytest.raises(CompressionError, match="outliers=3"):
        get_codec("int8-outlier", block=64).decode({**enc.meta, "outliers": 3}, enc.tobytes())


def test_int8_default_block_and_ratio():
    codec = get_codec("int8")
    assert codec.block == 256
    n = 1 << 20
    assert codec.encoded_nbytes(n) == n + 4 * (n // 256)
    assert 4 * n / codec.encoded_nbytes(n) > 3.9


@SETTINGS
@given(x=chunks(), fraction=st.sampled_from([0.01, 0.1, 0.5, 1.0]))
def test_topk_exact_on_kept(x, fraction):
    codec = TopKCodec(fraction=fraction)
    _, _, out = roundtrip(codec, x)
    n = x.numel()
    if n == 0:
        return
    k = codec.k(n)
    x32, o = x.float(), out.float()
    kept = o != 0
    assert int(kept.sum()) <= k
    assert torch.equal(o[kept], x32[kept])  # exact on kept entries
    # the kept set is a top-k set: nothing dropped is larger than what was kept (ties allowed)
    mags = x32.abs()
    kth = torch.topk(mags, k).values[-1]
    assert (mags[~kept] <= kth).all()


def test_topk_large_chunk_matches_torch_topk():
    g = torch.Generator().manual_seed(0)
    codec = TopKCodec(fraction=0.01)
    for x in [torch.randn(1 << 20, generator=g), torch.randn(1 << 18, generator=g) ** 3,
              torch.arange(1 << 18, dtype=torch.float32)]:  # structured: strided sample is biased
        enc = codec.encode(x)
        idx = enc.local["indices"]
        ref = torch.topk(x.abs(), codec.k(x.numel())).indices
        assert torch.equal(torch.sort(idx).values, torch.sort(ref).values)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 3000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_encoded_nbytes_exact(name, n, dtype):
    codec = get_codec(name)
    x = torch.randn(n).to(dtype)
    enc = codec.encode(x)
    assert enc.nbytes == len(enc.tobytes()) == codec.encoded_nbytes(n, dtype)
    assert sum(m.nbytes for m in enc.memoryviews()) == enc.nbytes
    for b in enc.buffers:
        assert isinstance(b, (bytes, torch.Tensor))
        if isinstance(b, torch.Tensor):
            assert b.dtype == torch.uint8 and b.dim() == 1 and b.is_contiguous() and b.device.type == "cpu"


def test_none_is_zero_copy():
    x = torch.randn(1000)
    enc = get_codec("none").encode(x)
    assert enc.buffers[0].data_ptr() == x.data_ptr()


@pytest.mark.parametrize("name,feedback", [(c, False) for c in CODECS] + [("int8", True), ("fp16", True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_encode_into_out_buffer(name, dtype, feedback):
    """``out`` gets the same wire bytes a fresh encode produces (codecs with ``uses_out``, unless
    the chunk already has the wire dtype), is left alone otherwise, and one too small is refused
    before anything is written."""
    codec = ErrorFeedback(make_codec(name)) if feedback else make_codec(name)
    x = torch.randn(1000 + 37).to(dtype)
    nbytes = codec.encoded_nbytes(x.numel(), dtype)
    want = (ErrorFeedback(make_codec(name)) if feedback else make_codec(name)).encode(x, key=1).tobytes()
    out = torch.full((nbytes + 64,), 0xAB, dtype=torch.uint8)
    enc = codec.encode(x, key=1, out=out)
    assert enc.tobytes() == want
    aliases = [b.data_ptr() == out.data_ptr() for b in enc.buffers if isinstance(b, torch.Tensor)]
    copies = name in ("int8", "int8-outlier") or (name in ("fp16", "bf16") and (feedback or dtype != codec.wire_dtype))
    if copies:
        assert aliases == [True] and bytes(out[:nbytes].numpy()) == want
        assert (out[nbytes:] == 0xAB).all()
    else:
        assert not any(aliases) and (out == 0xAB).all()
    small = torch.full((nbytes - 1,), 0xCD, dtype=torch.uint8)
    with pytest.raises(ValueError, match="at least"):
        codec.encode(x, key=2, out=small)
    assert (small == 0xCD).all()


def _base_codec(codec):
    return codec.codec if isinstance(codec, ErrorFeedback) else codec


@pytest.mark.parametrize("name", CODECS)
def test_add_bound_covers_what_decode_add_adds(name):
    """``add_bound`` is at least the largest |value| decode_add adds (for top-k, with repeated
    indices summed), and refuses NaN/inf like decode does."""
    codec = make_codec(name)
    x = torch.randn(3000) * 1e3
    enc = codec.encode(x)
    wire = enc.tobytes()
    acc = torch.zeros(3000)
    codec.decode_add(enc.meta, wire, acc)
    bound = codec.add_bound(enc.meta, wire)
    assert float(acc.abs().max()) <= bound <= 4 * float(x.abs().sum())
    if name == "topk":  # a hostile sender repeats one index: decode_add sums them
        k = _base_codec(codec).k(3000)
        dup = torch.cat([torch.full((k,), 5.0), torch.zeros(k)]).numpy().tobytes()  # values, then indices 0
        acc.zero_()
        codec.decode_add(enc.meta, dup, acc)
        assert float(acc[0]) == 5.0 * k <= codec.add_bound(enc.meta, dup)
    elif name not in ("int8", "int8-outlier"):  # a NaN in the payload
        bad = bytearray(wire)
        bad[0:4 if name == "none" else 2] = (b"\x00\x00\xc0\x7f" if name == "none" else
                                               {"fp16": b"\x00\x7e", "bf16": b"\xc0\x7f"}[name])
        with pytest.raises(CompressionError, match="NaN or inf"):
            codec.add_bound(enc.meta, bytes(bad))


@pytest.mark.parametrize("name", CODECS)
def test_encode_scale_is_encoding_the_scaled_chunk(name):
    """``encode(x, scale=s)`` decodes to ``x * s`` within the codec's error for ``x * s``, and a
    scale outside (0, 1] is refused."""
    codec = _base_codec(make_codec(name))  # (error feedback takes unscaled chunks only)
    x = torch.randn(5000) * 10
    s = 1 / 3
    want = codec.decode(*_enc_meta_wire(codec.encode(x * s)))
    got = codec.decode(*_enc_meta_wire(codec.encode(x, scale=s)))
    if name == "topk":  # the same entries kept, values scaled
        assert torch.equal(got != 0, want != 0)
    tol = {"none": 1e-6, "fp16": 2e-3, "bf16": 2e-2}.get(name, 0.5)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    for bad in (0.0, -1.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="scale"):
            codec.encode(x, scale=bad)


def _enc_meta_wire(enc):
    return enc.meta, enc.tobytes()


# ---------------------------------------------------------------------------- decode into out / decode_add


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_decode_into_preallocated_slice(name, out_dtype):
    codec = make_codec(name)
    x = torch.randn(1000)
    enc = codec.encode(x)
    wire = enc.tobytes()
    acc = torch.full((3000,), 7.0, dtype=out_dtype)
    res = codec.decode(enc.meta, wire, out=acc[1000:2000])
    assert res.data_ptr() == acc[1000:2000].data_ptr()
    ref = codec.decode(enc.meta, wire)
    assert torch.equal(acc[1000:2000], ref.to(out_dtype))
    assert (acc[:1000] == 7).all() and (acc[2000:] == 7).all()
    with pytest.raises(CompressionError):
        codec.decode(enc.meta, wire, out=acc[:999])


@pytest.mark.parametrize("name", CODECS)
def test_decode_add(name):
    codec = make_codec(name)
    x = torch.randn(777)
    enc = codec.encode(x)
    wire = enc.tobytes()
    ref = codec.decode(enc.meta, wire).float()
    acc = torch.randn(777)
    expect = acc + 0.25 * ref
    codec.decode_add(enc.meta, wire, acc, 0.25)
    torch.testing.assert_close(acc, expect, rtol=1e-6, atol=1e-6)
    with pytest.raises(CompressionError):
        codec.decode_add(enc.meta, wire, acc, float("nan"))
    # with ``base``: acc = base + w * decoded, into a separate tensor or in place
    base = torch.randn(777)
    out = torch.full((777,), 7.0)
    codec.decode_add(enc.meta, wire, out, 0.5, base=base)
    torch.testing.assert_close(out, base + 0.5 * ref, rtol=1e-6, atol=1e-6)
    same = base.clone()
    codec.decode_add(enc.meta, wire, same, 0.5, base=same)
    torch.testing.assert_close(same, base + 0.5 * ref, rtol=1e-6, atol=1e-6)
    # a message that fails validation leaves the accumulator untouched, base or not
    bad = bytearray(wire)
    before = out.clone()
    with pytest.raises(CompressionError):
        codec.decode_add(enc.meta, bytes(bad[:-1]), out, 0.5, base=base)
    assert torch.equal(out, before)


# ---------------------------------------------------------------------------- NaN / inf / range


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("n,pos", [(1, 0), (300, 299), (5000, 2500), (1 << 18, 12345)])
def test_nonfinite_input_rejected(name, dtype, bad, n, pos):
    codec = make_codec(name)
    x = torch.randn(n).to(dtype)
    x[pos] = bad
    with pytest.raises(CompressionError, match="NaN or inf"):
        codec.encode(x)


def test_sum_overflow_is_not_a_false_positive():
    x = torch.full((1000,), 3e38)  # finite values whose sum overflows
    for name in ("none", "bf16", "int8", "topk"):
        get_codec(name).encode(x)


def test_fp16_out_of_range_rejected():
    codec = get_codec("fp16")
    codec.encode(torch.tensor([65504.0, -65519.0]))  # rounds to +-65504: accepted
    with pytest.raises(CompressionError, match="range"):
        codec.encode(torch.tensor([1.0, 65520.0]))
    with pytest.raises(CompressionError, match="range"):
        codec.encode(torch.tensor([1e6], dtype=torch.bfloat16))


def test_error_feedback_does_not_absorb_nan():
    ef = get_codec("topk")
    ef.encode(torch.randn(100), key="a")
    r = ef.residual("a").clone()
    with pytest.raises(CompressionError):
        ef.encode(torch.full((100,), float("nan")), key="a")
    assert torch.equal(ef.residual("a"), r)


@pytest.mark.parametrize("name", CODECS)
def test_bad_chunk_shape_rejected(name):
    codec = get_codec(name)
    with pytest.raises(CompressionError):
        codec.encode(torch.randn(4, 4))
    with pytest.raises(CompressionError):
        codec.encode(torch.randn(20)[::2])
    with pytest.raises(CompressionError):
        codec.encode(torch.arange(10))


# ---------------------------------------------------------------------------- hostile messages


def _valid(name):
    codec = make_codec(name)
    enc = codec.encode(torch.randn(300))
    return codec, enc.meta, enc.tobytes()


meta_values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**64), 2**64), st.floats(allow_nan=True),
    st.text(max_size=12), st.binary(max_size=12), st.lists(st.integers(), max_size=3),
    st.sampled_from(["float32", "float16", "bfloat16", "int8", "float64", "none", "fp16", "bf16", "topk"]),
)


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(CODECS), data=st.data())
def test_fuzz_meta(name, data):
    codec, meta, wire = _valid(name)
    meta = dict(meta)
    action = data.draw(st.sampled_from(["set", "drop", "add", "replace"]))
    if action == "set":
        meta[data.draw(st.sampled_from(sorted(meta)))] = data.draw(meta_values)
    elif action == "drop":
        meta.pop(data.draw(st.sampled_from(sorted(meta))))
    elif action == "add":
        meta[data.draw(st.text(max_size=5))] = data.draw(meta_values)
    else:
        meta = data.draw(st.one_of(meta_values, st.dictionaries(st.text(max_size=6), meta_values, max_size=5)))
    try:
        out = codec.decode(meta, wire)
    except CompressionError:
        return
    assert out.numel() == meta["numel"] and out.numel() <= 300  # accepted only if consistent


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(CODECS), data=st.data())
def test_fuzz_buffer(name, data):
    codec, meta, wire = _valid(name)
    how = data.draw(st.sampled_from(["random", "truncate", "extend", "flip", "huge_numel", "neg_numel"]))
    if how == "random":
        wire = data.draw(st.binary(max_size=2 * len(wire)))
        if data.draw(st.booleans()):
            wire = wire.ljust(len(wire) + (-len(wire)) % 1, b"\0")
            wire = (wire * (len(_valid(name)[2]) // max(1, len(wire)) + 1))[: len(_valid(name)[2])]
    elif how == "truncate":
        wire = wire[: data.draw(st.integers(0, max(0, len(wire) - 1)))]
    elif how == "extend":
        wire = wire + data.draw(st.binary(min_size=1, max_size=16))
    elif how == "flip":  # same size, random bytes at random places: NaN scales, bad indices...
        b = bytearray(wire)
        for _ in range(data.draw(st.integers(1, 20))):
            b[data.draw(st.integers(0, len(b) - 1))] = data.draw(st.integers(0, 255))
        wire = bytes(b)
    elif how == "huge_numel":
        meta = {**meta, "numel": data.draw(st.sampled_from([2**31, 2**40, 2**62, 2**28 + 1]))}
    else:
        meta = {**meta, "numel": data.draw(st.integers(-(2**40), -1))}
    try:
        out = codec.decode(meta, wire)
    except CompressionError:
        return
    assert out.numel() == 300
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("name", CODECS)
def test_hostile_examples(name):
    codec, meta, wire = _valid(name)
    with pytest.raises(CompressionError, match="bytes"):
        codec.decode(meta, wire[:-1])
    with pytest.raises(CompressionError, match="numel"):
        codec.decode({**meta, "numel": -1}, wire)
    with pytest.raises(CompressionError, match="numel"):
        codec.decode({**meta, "numel": 2**62}, b"")
    with pytest.raises(CompressionError, match="dtype"):
        codec.decode({**meta, "dtype": "float64"}, wire)
    with pytest.raises(CompressionError, match="codec"):
        codec.decode({**meta, "codec": "other"}, wire)
    with pytest.raises(CompressionError):
        codec.decode(meta, "not bytes")  # type: ignore[arg-type]


def test_int8_nan_scale_and_topk_bad_index_rejected():
    codec = Int8Codec(block=64)
    enc = codec.encode(torch.randn(300))
    b = bytearray(enc.tobytes())
    # add_bound checks the scales too: the all-reduce decodes unchecked after it
    for bad in (float("nan"), -1.0, 3e38):  # 3e38: finite, but q * scale would overflow to inf
        b[0:4] = torch.tensor([bad]).numpy().tobytes()
        for check in (codec.decode, codec.add_bound):
            with pytest.raises(CompressionError, match="scales"):
                check(enc.meta, b)
    huge = torch.full((300,), 3.4e38)
    torch.testing.assert_close(codec.decode(codec.encode(huge).meta, codec.encode(huge).tobytes()), huge)

    tk = TopKCodec(fraction=0.1)
    enc = tk.encode(torch.randn(300))
    k = tk.k(300)
    b = bytearray(enc.tobytes())
    b[4 * k : 4 * k + 4] = torch.tensor([300], dtype=torch.int32).numpy().tobytes()
    with pytest.raises(CompressionError, match="indices"):
        tk.decode(enc.meta, b)
    b[4 * k : 4 * k + 4] = torch.tensor([-5], dtype=torch.int32).numpy().tobytes()
    with pytest.raises(CompressionError, match="indices"):
        tk.decode(enc.meta, b)
    with pytest.raises(CompressionError, match="fraction"):
        tk.decode({**enc.meta, "fraction": 0.5}, enc.tobytes())


@pytest.mark.parametrize("name", ["none", "fp16", "bf16"])
def test_nonfinite_payload_rejected(name):
    codec = get_codec(name)
    enc = codec.encode(torch.randn(100))
    b = bytearray(enc.tobytes())
    item = codec.encoded_nbytes(1)
    b[item * 7 : item * 8] = b"\xff" * item  # a NaN in every float format
    with pytest.raises(CompressionError, match="NaN or inf"):
        codec.decode(enc.meta, b)
    acc = torch.zeros(100)
    with pytest.raises(CompressionError):
        codec.decode_add(enc.meta, b, acc)
    assert (acc == 0).all()  # untouched


def test_unknown_codec_and_options():
    with pytest.raises(CompressionError, match="unknown codec"):
        get_codec("zstd")
    with pytest.raises(CompressionError):
        get_codec("fp16", block=3)
    with pytest.raises(ValueError):
        get_codec("int8", block=3)
    with pytest.raises(ValueError):
        get_codec("topk", fraction=0.0)


# ---------------------------------------------------------------------------- error feedback


@settings(max_examples=15, deadline=None)
@given(n=st.sampled_from([1, 10, 1000, 3000]), fraction=st.sampled_from([0.01, 0.1, 0.3]),
       rounds=st.integers(1, 12), seed=st.integers(0, 1000), dtype=st.sampled_from(DTYPES))
def test_error_feedback_conservation(n, fraction, rounds, seed, dtype):
    """sum over rounds of decoded == sum of inputs - final residual (float error only)."""
    g = torch.Generator().manual_seed(seed)
    ef = get_codec("topk", fraction=fraction)
    assert isinstance(ef, ErrorFeedback)
    sent = torch.zeros(n, dtype=torch.float64)
    total = torch.zeros(n, dtype=torch.float64)
    for _ in range(rounds):
        x = torch.randn(n, generator=g).to(dtype)
        enc = ef.encode(x, key=("p", 0))
        sent += ef.decode(enc.meta, enc.tobytes(), out=torch.empty(n)).double()
        total += x.double()
    resid = ef.residual(("p", 0)).double()
    torch.testing.assert_close(sent, total - resid, rtol=0, atol=1e-5 * rounds)
    ef.reset()
    assert ef.residual(("p", 0)) is None and ef.state_nbytes == 0


def test_error_feedback_eventually_sends_everything():
    """A constant input: with feedback even the smallest coordinate is eventually sent."""
    ef = get_codec("topk", fraction=0.1)
    x = torch.linspace(0.1, 1.0, 100)
    sent = torch.zeros(100)
    for _ in range(200):
        enc = ef.encode(x, key=0)
        ef.decode_add(enc.meta, enc.tobytes(), sent)
    assert (sent > 0).all()
    torch.testing.assert_close(sent + ef.residual(0), 200 * x, rtol=1e-5, atol=1e-3)


def test_error_feedback_keys_independent_and_int8():
    ef = ErrorFeedback(Int8Codec(block=64))
    a, b = torch.randn(300), torch.randn(500)
    ea = ef.encode(a, key="a")
    ef.encode(b, key="b")
    resid = ef.residual("a")
    torch.testing.assert_close(resid, a - ef.decode(ea.meta, ea.tobytes()), rtol=0, atol=1e-6)
    ef.reset("a")
    assert ef.residual("a") is None and ef.residual("b") is not None


def test_iter_chunks_views():
    t = torch.randn(10, 100)
    chunks_ = list(iter_chunks(t, 300))
    assert [c.numel() for c in chunks_] == [300, 300, 300, 100]
    assert chunks_[1].data_ptr() == t.reshape(-1)[300:].data_ptr()
    assert torch.equal(torch.cat(chunks_), t.reshape(-1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", CODECS)
def test_cuda_roundtrip(name):
    codec = make_codec(name)
    x = torch.randn(5000, device="cuda")
    enc = codec.encode(x)
    assert all(b.device.type == "cpu" for b in enc.buffers if isinstance(b, torch.Tensor))
    out = torch.empty(5000, device="cuda")
    codec.decode(enc.meta, enc.tobytes(), out=out)
    codec.decode_add(enc.meta, enc.tobytes(), out, 1.0)
    ref = codec.decode(enc.meta, enc.tobytes())
    torch.testing.assert_close(out.cpu(), 2 * ref, rtol=1e-6, atol=1e-6)


def test_int8_huge_values_survive_flushed_denormals():
    """A block near float32's max has absmax/127 ~ 2.7e36 and 1/that a normal float: a trainer
    that flushes denormals (torch.set_flush_denormal) still gets its values back, not zeros."""
    codec = get_codec("int8")
    x = torch.full((300,), 3.0e38)
    x[::3] = -1.0e38
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        enc = codec.encode(x)
        out = codec.decode(enc.meta, enc.tobytes())
    finally:
        torch.set_flush_denormal(False)
    assert float((out - x).abs().max()) <= 3.0e38 / 254 * (1 + 1e-5)
