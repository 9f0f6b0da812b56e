"""The compiled int8 kernels (p2ptrain/compression/_int8_kernels.c) against the torch path they
replace: the same wire bytes and decoded values, the same NaN/inf refusal, argument checks in the
wrappers, and the switch that turns them off."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import sysconfig
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2ptrain.compression import CODECS, CompressionError, Int8Codec, get_codec, kernels
from p2ptrain.compression.base import abs_max

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

needs_kernels = pytest.mark.skipif(not kernels.AVAILABLE, reason="the int8 kernels are not built here")


def test_kernels_are_built_where_a_c_compiler_is():
    """setup.py marks the extension optional, so a broken build would only warn: where a compiler
    is present (as in CI), the kernels must have been built and loaded."""
    if os.environ.get("P2PT_KERNELS", "1") == "0":
        pytest.skip("P2PT_KERNELS=0 switches the kernels off")
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}) on this machine: the torch path serves")
    assert kernels.AVAILABLE, "a C compiler is present but p2ptrain.compression._int8_kernels did not build"


def test_p2pt_kernels_0_switches_them_off():
    code = "from p2ptrain.compression import kernels; print(kernels.AVAILABLE)"
    env = dict(os.environ, P2PT_KERNELS="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def torch_path():
    """Within it, the codec runs its torch ops instead of the kernels."""
    return mock.patch.object(kernels, "AVAILABLE", False)


@st.composite
def chunks(draw):
    n = draw(st.sampled_from([1, 7, 15, 16, 17, 63, 64, 65, 255, 256, 257, 1000, 4099]))
    kind = draw(st.sampled_from(["randn", "zeros", "tiny", "subnormal", "huge", "mixed", "ties"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(n, generator=g, dtype=torch.float64)
    if kind == "zeros":
        x = torch.zeros(n, dtype=torch.float64)
        if n > 3:
            x[3] = -0.0
    elif kind == "tiny":  # below int8's 2**-100 floor
        x = x * 1e-32
    elif kind == "subnormal":
        x = x * 1e-40
    elif kind == "huge":  # near float32's max: 1 / step must stay a normal float
        x = (x / x.abs().max().clamp_min(1e-30)) * 3.4e38
    elif kind == "mixed":
        x = x * torch.pow(10.0, torch.randint(-30, 30, (n,), generator=g).double())
    elif kind == "ties":  # values that land on k + 0.5 steps: round half to even must agree
        x = torch.randint(-254, 255, (n,), generator=g).double() / 2
        x[0] = 127.0
    return x.clamp(-3.4e38, 3.4e38).to(torch.float32)


@needs_kernels
@SETTINGS
@given(x=chunks(), block=st.sampled_from([8, 64, 256, 1000]), scale=st.sampled_from([1.0, 0.5, 1 / 3, 1e-7]))
def test_encode_and_decode_match_the_torch_path_bit_for_bit(x, block, scale):
    codec = Int8Codec(block=block)
    fast = codec.encode(x, scale=scale).tobytes()
    dec_fast = torch.full_like(x, float("nan"))
    fused = codec.encode(x.clone(), scale=scale, decoded=dec_fast).tobytes()
    got = codec.decode(codec._meta(x), fast)
    with torch_path():
        slow = codec.encode(x, scale=scale).tobytes()
        want = codec.decode(codec._meta(x), slow)
    assert fast == slow
    assert fused == slow
    assert torch.equal(got, want)
    assert torch.equal(dec_fast, want)  # what the owner keeps is what the others decode


@needs_kernels
@SETTINGS
@given(x=chunks(), weight=st.sampled_from([1.0, 0.25, 3.0, 1e-6]), in_place=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_decode_add_matches_the_torch_path_within_one_rounding(x, weight, in_place, seed):
    codec = Int8Codec(block=64)
    enc = codec.encode(x)
    meta, wire = enc.meta, enc.tobytes()
    base = torch.randn(x.numel(), generator=torch.Generator().manual_seed(seed)) * float(x.abs().max().clamp_max(1e30))
    acc = base.clone() if in_place else torch.zeros_like(x)
    codec.decode_add(meta, wire, acc, weight, None if in_place else base)
    with torch_path():
        want = base.clone()
        codec.decode_add(meta, wire, want, weight)
    term = codec.decode(meta, wire).double() * torch.tensor(weight, dtype=torch.float32).double()
    exact = base.double() + term
    # torch's addcmul may fuse its multiply-add (one rounding fewer): both within two roundings
    # of the operands' size (the sum itself may cancel to far less)
    ulp = torch.finfo(torch.float32).eps * (base.double().abs() + term.abs()) + torch.finfo(torch.float32).tiny
    fits = exact.abs() < torch.finfo(torch.float32).max  # elsewhere both overflow alike
    for got in (acc, want):
        assert bool(((got.double() - exact).abs() <= 2 * ulp)[fits].all())
        assert torch.equal(got[~fits], acc[~fits]) and bool(got[~fits].isinf().all())


@needs_kernels
@SETTINGS
@given(x=chunks(), base=chunks(), weight=st.sampled_from([1.0, 0.25, 3.0]), in_place=st.booleans())
def test_decode_add_max_is_decode_add_plus_the_absmax_of_its_base(x, base, weight, in_place):
    """The fused kernel writes exactly what ``decode_add`` writes and returns ``absmax(base)``, in
    place or not, whatever the sizes (vector body, tails, partial blocks)."""
    n = min(x.numel(), base.numel())
    x, base = x[:n].contiguous(), base[:n].contiguous()
    codec = Int8Codec(block=64)
    enc = codec.encode(x)
    meta, wire = enc.meta, enc.tobytes()
    want = torch.empty(n)
    codec.decode_add(meta, wire, want, weight, base)
    acc = base.clone() if in_place else torch.empty(n)
    got = codec.decode_add_base(meta, wire, acc, weight, acc if in_place else base)
    assert torch.equal(acc, want)
    assert got == kernels.absmax(base)


@needs_kernels
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("pos", [0, 15, 16, 255, 256, 1002])  # first, lane end, lane start, block ends, tail
def test_decode_add_max_flags_nonfinite_base_values(bad, pos):
    base = torch.randn(1003)
    base[pos] = bad
    q, scales = torch.randint(-127, 128, (1003,), dtype=torch.int8), torch.rand(4)
    for in_place in (False, True):
        out = base.clone() if in_place else torch.empty(1003)
        got = kernels.decode_add_max(scales, q, 256, 1.0, out if in_place else base, out)
        assert not got < float("inf")
        assert (got != got) == (bad != bad)  # NaN for a NaN, inf for an inf


@needs_kernels
@SETTINGS
@given(x=chunks(), base=chunks(), weight=st.sampled_from([1.0, 0.25, 3.0]), in_place=st.booleans(),
       block=st.sampled_from([8, 64, 256, 1000]), scale=st.sampled_from([1.0, 0.5, 1 / 3]))
def test_decode_add_encode_is_the_add_then_the_encode(x, base, weight, in_place, block, scale):
    """The fused add-and-encode writes exactly what ``decode_add_max`` and then ``encode`` (with
    its decoded copy, in place) write, and returns the same max, whatever the sizes."""
    n = min(x.numel(), base.numel())
    x, base = x[:n].contiguous() / 8, base[:n].contiguous() / 4  # (the sum stays finite)
    codec = Int8Codec(block=block)
    enc = codec.encode(x)
    nb = codec.n_blocks(n)
    scales, q = enc.buffers[0][: 4 * nb].view(torch.float32), enc.buffers[0][4 * nb :].view(torch.int8)
    want = base.clone()
    want_max = kernels.decode_add_max(scales, q, block, weight, want, want)
    want_sc, want_q = torch.empty(nb), torch.empty(n, dtype=torch.int8)
    assert kernels.encode(want, block, scale, want_sc, want_q, want)
    acc = base.clone() if in_place else torch.full((n,), float("nan"))
    got_sc, got_q = torch.empty(nb), torch.empty(n, dtype=torch.int8)
    got_max, ok = kernels.decode_add_encode(scales, q, block, weight, acc if in_place else base, acc, scale,
                                            got_sc, got_q)
    assert ok and got_max == want_max
    assert torch.equal(acc, want) and torch.equal(got_sc, want_sc) and torch.equal(got_q, want_q)


@needs_kernels
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 3.3e38])  # 3.3e38: finite, but the sum is not
def test_decode_add_encode_reports_a_sum_that_does_not_encode(bad):
    n, block = 5000, 256
    codec = Int8Codec(block=block)
    enc = codec.encode(torch.full((n,), 3e38))
    nb = codec.n_blocks(n)
    scales, q = enc.buffers[0][: 4 * nb].view(torch.float32), enc.buffers[0][4 * nb :].view(torch.int8)
    acc = torch.randn(n)
    acc[4321] = bad
    own, ok = kernels.decode_add_encode(scales, q, block, 1.0, acc, acc, 1.0, torch.empty(nb),
                                        torch.empty(n, dtype=torch.int8))
    assert not ok
    assert (own != own) if bad != bad else own == float(torch.tensor(bad))  # every block measured


@needs_kernels
def test_decode_add_encode_refuses_overlaps():
    n, nb = 4096, 16
    scales, q, acc = torch.ones(nb), torch.zeros(n, dtype=torch.int8), torch.zeros(n)
    wire = torch.empty(4 * nb + n, dtype=torch.uint8)
    sc_out, q_out = wire[: 4 * nb].view(torch.float32), wire[4 * nb :].view(torch.int8)
    assert kernels.decode_add_encode(scales, q, 256, 1.0, acc, acc, 1.0, sc_out, q_out)[1]  # adjacent: fine
    shifted = torch.zeros(n + 1)
    for src, out, so, qo in [(acc, acc, acc[:nb], q_out),  # scales_out inside out
                             (acc, acc, sc_out, wire[:n].view(torch.int8)),  # q_out over scales_out
                             (shifted[1:], shifted[:-1], sc_out, q_out)]:  # src partly over out
        with pytest.raises(ValueError, match="overlap"):
            kernels.decode_add_encode(scales, q, 256, 1.0, src, out, 1.0, so, qo)


@needs_kernels
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("off", [0, 1, 7])  # dst 4, 8 and 32 bytes past a 32-byte boundary
@pytest.mark.parametrize("n", [1, 4095, 4096, 4097, 3 * 4096 + 5])
def test_copy_finite_copies_everything_finite(n, off, stream):
    src, buf = torch.randn(n) * 1e30, torch.zeros(n + 11)
    dst = buf[off:]
    assert kernels.copy_finite(src, dst, stream) == n
    assert torch.equal(dst[:n], src) and not dst[n:].any() and not buf[:off].any()


@needs_kernels
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("pos", [0, 4095, 4096, 8191, 12291])  # piece edges, the short last piece
def test_copy_finite_stops_at_the_piece_holding_a_nonfinite_value(bad, pos, stream):
    n = 3 * 4096 + 5
    src, dst = torch.randn(n), torch.zeros(n + 3)[3:]
    src[pos] = bad
    done = kernels.copy_finite(src, dst, stream)
    assert done == pos // kernels.COPY_PIECE * kernels.COPY_PIECE
    assert torch.equal(dst[:done], src[:done]) and not dst[done:].any()  # nothing of that piece written


@needs_kernels
@SETTINGS
@given(x=chunks(), block=st.sampled_from([8, 64, 256, 1000]), off=st.integers(0, 15))
def test_streaming_decode_writes_the_same_values(x, block, off):
    # the streaming twin writes plain stores up to the first 32-byte boundary and after the last
    # whole vector: every alignment of the output and every block length must come out the same
    codec = Int8Codec(block=block)
    enc = codec.encode(x)
    want = codec.decode(enc.meta, enc.tobytes())
    streaming = copy.copy(codec)
    streaming.stream_decoded = True
    buf = torch.full((x.numel() + 24,), 7.0)
    got = streaming.decode(enc.meta, enc.tobytes(), out=buf[off : off + x.numel()])
    assert torch.equal(got, want)
    assert (buf[:off] == 7).all() and (buf[off + x.numel() :] == 7).all()  # nothing outside out


def test_streaming_is_only_worthwhile_beyond_the_last_level_cache():
    assert kernels.STREAM_MIN_BYTES >= 1 << 20
    assert not kernels.stream_worthwhile(kernels.STREAM_MIN_BYTES)
    assert kernels.stream_worthwhile(kernels.STREAM_MIN_BYTES + 1) == kernels.CAN_STREAM


@needs_kernels
def test_copy_finite_refuses_overlap_and_wrong_tensors():
    buf = torch.randn(3000)
    with pytest.raises(ValueError, match="overlap"):
        kernels.copy_finite(buf[:2000], buf[1000:])
    with pytest.raises(ValueError, match="copy_finite dst"):
        kernels.copy_finite(buf[:1000], torch.empty(999))
    with pytest.raises(ValueError, match="copy_finite src"):
        kernels.copy_finite(buf.double(), torch.empty(3000))


@needs_kernels
def test_decode_add_max_refuses_a_partly_overlapping_src():
    buf = torch.randn(2000)
    q, scales = torch.zeros(1000, dtype=torch.int8), torch.ones(4)
    with pytest.raises(ValueError, match="overlap"):
        kernels.decode_add_max(scales, q, 256, 1.0, buf[1:1001], buf[:1000])
    kernels.decode_add_max(scales, q, 256, 1.0, buf[1000:], buf[:1000])  # disjoint: fine


def _message_and_base(codec):
    """A 3000-value message of ``codec`` (meta, wire bytes) and values to add it to."""
    enc = codec.encode(torch.randn(3000, generator=torch.Generator().manual_seed(3)) * 5)
    return enc.meta, enc.tobytes(), torch.randn(3000, generator=torch.Generator().manual_seed(4)) * 7


def _both_paths():
    """The torch path, and the kernels' where they are built."""
    return (torch_path(),) if not kernels.AVAILABLE else (torch_path(), mock.patch.object(kernels, "AVAILABLE", True))


@pytest.mark.parametrize("name", ["int8", "int8-outlier", "fp16", "none"])
def test_decode_add_encode_is_decode_add_base_then_encode(name):
    """``decode_add_encode`` (one kernel for int8, the two calls for the others and without the
    kernels) sums as ``decode_add_base`` does, encodes the sum as ``encode(decoded=)`` does into a
    prefix of ``out``, and returns the max of what ``acc`` held; the message is validated."""
    codec = get_codec(name)
    meta, wire, base = _message_and_base(codec)
    for ctx in _both_paths():
        with ctx:
            want = base.clone()
            want_max = codec.decode_add_base(meta, wire, want, 0.5, want)
            want_wire = codec.encode(want, scale=0.25, decoded=want).tobytes()
            acc, out = base.clone(), torch.zeros(16000, dtype=torch.uint8)
            got, got_max = codec.decode_add_encode(meta, wire, acc, 0.5, 0.25, out)
            assert got_max == want_max and got.data_ptr() == out.data_ptr()
            assert bytes(got.numpy()) == want_wire and torch.equal(acc, want)
    with pytest.raises(CompressionError):
        codec.decode_add_encode(meta, wire[:-1], base.clone(), 0.5, 0.25, torch.zeros(16000, dtype=torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["int8", "int8-outlier", "fp16", "none"])
def test_decode_add_encode_on_a_cuda_accumulator(name):
    """A GPU ``acc`` takes the generic path (the kernels are host-only): the sum stays on the
    device, the reply's wire bytes land in the host ``out``, and both match the host's within
    float rounding (the device's add may fuse differently, so the bytes are compared decoded)."""
    codec = get_codec(name)
    meta, wire, base = _message_and_base(codec)
    want, out_cpu = base.clone(), torch.zeros(16000, dtype=torch.uint8)
    want_wire, want_max = codec.decode_add_encode(meta, wire, want, 0.5, 0.25, out_cpu)
    acc, out = base.cuda(), torch.zeros(16000, dtype=torch.uint8)
    got_wire, got_max = codec.decode_add_encode(meta, wire, acc, 0.5, 0.25, out)
    assert acc.device.type == "cuda" and got_wire.device.type == "cpu"
    assert got_wire.data_ptr() == out.data_ptr() and got_max == want_max
    torch.testing.assert_close(acc.cpu(), want, rtol=0, atol=1e-5)
    reply_meta = codec.encode(want, scale=0.25, decoded=want.clone()).meta
    torch.testing.assert_close(codec.decode(reply_meta, bytes(got_wire.numpy())),
                               codec.decode(reply_meta, bytes(want_wire.numpy())), rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", CODECS)
def test_decode_add_base_is_decode_add_and_the_absmax_of_base(name):
    """Every codec's ``decode_add_base`` (fused for int8, generic for the others) adds as
    ``decode_add`` does and measures ``base``, NaN/inf included, on either path."""
    wrapped = get_codec(name)
    codec = getattr(wrapped, "codec", wrapped)
    meta, wire, base = _message_and_base(codec)
    for ctx in _both_paths():
        with ctx:
            want = codec.decode_add(meta, wire, torch.empty(3000), 0.5, base)
            acc = base.clone()
            assert codec.decode_add_base(meta, wire, acc, 0.5, acc) == abs_max(base)
            torch.testing.assert_close(acc, want, rtol=0, atol=1e-5)  # (torch's addcmul may fuse)
            bad = base.clone()
            bad[2999] = float("inf")
            assert codec.decode_add_base(meta, wire, torch.empty(3000), 0.5, bad) == float("inf")
    with pytest.raises(CompressionError):  # the message is validated as in decode_add
        codec.decode_add_base(meta, wire[:-1], torch.empty(3000), 0.5, base)


@needs_kernels
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("pos", [0, 255, 256, 1000, 1002])  # first, block end, block start, tail block
def test_nonfinite_input_is_refused_as_by_the_torch_path(bad, pos):
    x = torch.randn(1003)
    x[pos] = bad
    codec = Int8Codec()
    with pytest.raises(CompressionError, match="NaN or inf"):
        codec.encode(x)
    with pytest.raises(CompressionError, match="NaN or inf"):
        codec.encode(x, decoded=torch.empty_like(x))
    assert not abs_max(x) < float("inf")
    with torch_path():
        with pytest.raises(CompressionError, match="NaN or inf"):
            codec.encode(x)


@needs_kernels
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100_003])
def test_absmax_matches_aminmax(n):
    x = torch.randn(n) * 1e3
    lo, hi = torch.aminmax(x)
    assert kernels.absmax(x) == max(-float(lo), float(hi))
    x[n // 2] = -float("inf")
    assert kernels.absmax(x) == float("inf")
    x[n - 1] = float("nan")
    assert kernels.absmax(x) != kernels.absmax(x)  # NaN
    assert kernels.absmax(torch.zeros(n)) == 0.0


@needs_kernels
def test_wrappers_refuse_what_the_c_side_cannot_check():
    x = torch.randn(1000)
    scales, q = torch.empty(4), torch.empty(1000, dtype=torch.int8)
    with pytest.raises(ValueError, match="encode scales"):  # 1000 / 256 needs 4: give 3
        kernels.encode(x, 256, 1.0, scales[:3], q)
    with pytest.raises(ValueError, match="encode x"):
        kernels.encode(x.double(), 256, 1.0, scales, q)
    with pytest.raises(ValueError, match="encode x"):
        kernels.encode(torch.randn(2000)[::2], 256, 1.0, scales, q)
    with pytest.raises(ValueError, match="decode out"):
        kernels.decode(scales, q, 256, torch.empty(999))
    with pytest.raises(ValueError, match="decode_add src"):
        kernels.decode_add(scales, q, 256, 1.0, torch.empty(1000, dtype=torch.float16), torch.empty(1000))


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_encode_decoded_is_what_a_receiver_decodes(name, dtype):
    """Every codec's ``encode(decoded=)`` (fused for int8, generic for the others, and error
    feedback's) writes exactly ``decode(encode(x))``, including into the chunk itself."""
    wrapped = get_codec(name)  # topk comes with error feedback: stateful, so checked on its own
    codec = getattr(wrapped, "codec", wrapped)
    x = (torch.randn(3000, generator=torch.Generator().manual_seed(5)) * 5).to(dtype)

    def decode(enc):
        return codec.decode(enc.meta, enc.tobytes(), out=torch.empty(3000, dtype=dtype))

    want = decode(codec.encode(x.clone()))
    got = torch.empty_like(x)
    assert torch.equal(decode(codec.encode(x.clone(), decoded=got)), want)
    assert torch.equal(got, want)
    y = x.clone()
    codec.encode(y, decoded=y)
    assert torch.equal(y, want)
    if wrapped is not codec:
        for _ in range(2):  # the second encode carries the first one's residual
            enc = wrapped.encode(x, decoded=got)
            assert torch.equal(got, decode(enc))
    with pytest.raises(CompressionError, match="out must be"):
        codec.encode(x, decoded=torch.empty(10))
