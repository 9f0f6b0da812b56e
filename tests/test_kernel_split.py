"""Big int8/copy kernel calls split across threads (``kernels.set_threads``), as on many-core hosts:
the same bits as one call, whatever the split, NaN/inf included; on by default only from 4 CPUs."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys

import pytest
import torch

from dht import Host, Identity, Limits
from p2ptrain.averaging import AllReduceConfig, AllReduceService, Group, Member
from p2ptrain.compression import kernels

pytestmark = pytest.mark.skipif(not kernels.AVAILABLE, reason="the int8 kernels are not built here")

SIZES = [5000, 3 * 4096, 4 * 4096 + 77, 40_000 + 1]  # over the (lowered) split size; odd tails
BLOCK = 256


@pytest.fixture
def split():
    """``split(fn)``: fn() run as one call and in 3 parts at once, both results returned (parts
    from 4096 values on: small tensors, a fast test of the same code)."""

    def both(fn):
        kernels.set_threads(1)
        one = fn()
        assert kernels.set_threads(3, split_min=4096) == 3
        many = fn()
        return one, many

    yield both
    kernels.set_threads(None)  # (the default again)


def values(n: int, seed: int, bad: tuple[int, float] | None = None) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3
    x[::97] = 0.0
    if bad is not None:
        x[bad[0]] = bad[1]
    return x


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN payloads too)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def same_float(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@pytest.mark.parametrize("n", SIZES)
def test_encode_and_decode_split_give_the_same_bits(split, n):
    x = values(n, n)
    nb = -(-n // BLOCK)

    def run():
        scales, q, dec = torch.empty(nb), torch.empty(n, dtype=torch.int8), torch.empty(n)
        ok = kernels.encode(x, BLOCK, 0.5, scales, q, dec)
        out = torch.full((n,), 7.0)
        kernels.decode(scales, q, BLOCK, out, stream=True)
        return ok, scales, q, dec, out, kernels.absmax(x)

    one, many = split(run)
    assert one[0] is many[0] is True and same_float(one[5], many[5])
    assert all(same(a, b) for a, b in zip(one[1:5], many[1:5]))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bad", [None, math.inf, math.nan])
def test_decode_add_and_its_fused_encode_split_give_the_same_bits(split, n, bad):
    nb = -(-n // BLOCK)
    scales, q = torch.empty(nb), torch.empty(n, dtype=torch.int8)
    assert kernels.encode(values(n, 1), BLOCK, 1.0, scales, q)
    src = values(n, 2, None if bad is None else (n - 3, bad))  # in the last part

    def run():
        acc = src.clone()
        m1 = kernels.decode_add_max(scales, q, BLOCK, 0.75, acc, acc)
        out, so, qo = src.clone(), torch.zeros(nb), torch.zeros(n, dtype=torch.int8)
        m2, ok = kernels.decode_add_encode(scales, q, BLOCK, 0.5, out, out, 0.25, so, qo)
        return m1, m2, ok, acc, out, so if ok else None, qo if ok else None

    one, many = split(run)
    assert same_float(one[0], many[0]) and same_float(one[1], many[1]) and one[2] == many[2] == (bad is None)
    assert same(one[3], many[3]) and same(one[4], many[4])
    assert bad is not None or (same(one[5], many[5]) and same(one[6], many[6]))  # (partly written on NaN/inf)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("where", [None, "first", "last"])
def test_a_split_checked_copy_stops_where_one_call_stops_and_writes_nothing_after(split, n, where):
    at = {None: None, "first": 4100, "last": n - 1}[where]
    src = values(n, 3, None if at is None else (at, math.nan))

    def run():
        dst = torch.full((n,), -1.0)
        return kernels.copy_finite(src, dst, stream=True), dst

    (done1, dst1), (done2, dst2) = split(run)
    assert done1 == done2 == (n if at is None else at // kernels.COPY_PIECE * kernels.COPY_PIECE)
    assert same(dst1, dst2) and bool((dst2[done2:] == -1.0).all())


def test_split_only_from_four_cpus_unless_asked(monkeypatch):
    monkeypatch.delenv("P2PT_KERNEL_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(2)))
    assert kernels._default_threads() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    assert kernels._default_threads() == 4
    monkeypatch.setenv("P2PT_KERNEL_THREADS", "3")
    assert kernels._default_threads() == 3


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_the_parts_run_at_once_on_threads_of_their_own():
    """A split call's parts run on the extension's threads beside the caller's (a fresh process:
    the pool, once made, stays for the next calls)."""
    code = ("import os, torch; from p2ptrain.compression import kernels\n"
            "tasks = lambda: len(os.listdir('/proc/self/task'))\n"
            "kernels.set_threads(1); kernels.absmax(torch.ones(1 << 16)); one = tasks()\n"
            "kernels.set_threads(3, split_min=4096); kernels.absmax(torch.ones(1 << 16)); print(one, tasks())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, P2PT_KERNEL_THREADS="1"))
    assert out.returncode == 0, out.stderr
    one, three = map(int, out.stdout.split())
    assert three == one + 2


async def _average(inputs: list[torch.Tensor], codec: str) -> list[torch.Tensor]:
    """One all-reduce round of ``inputs`` among as many hosts, configured as on a many-core host:
    codec work in the worker thread, frames sealed and opened on the hosts' pools."""
    hosts, services, flats = [], [], [x.clone() for x in inputs]
    try:
        for _ in inputs:
            h = Host(Identity(), ("127.0.0.1", 0), limits=Limits(seal_threads=2))
            await h.start()
            hosts.append(h)
            svc = AllReduceService(h, AllReduceConfig(timeout=30))
            svc.cpus = 16
            await svc.start()
            services.append(svc)
        group = Group(os.urandom(16), tuple(Member(h.peer_id, ("127.0.0.1", h.listen_port), 1.0) for h in hosts))
        async with asyncio.timeout(40):
            results = await asyncio.gather(*(s.run(group, r, flats[r], 1.0 + r, codec) for r, s in enumerate(services)))
        assert all(r.ok for r in results), [r.failed for r in results]
    finally:
        for s in services:
            await s.close()
        for h in hosts:
            await h.close()
    return flats


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", ["none", "int8"])
async def test_a_round_with_split_kernels_averages_to_the_same_bits(codec):
    inputs = [values((2 << 20) + 77, seed) for seed in (11, 12)]  # chunks of 1M values: split calls
    kernels.set_threads(1)
    try:
        one = await _average(inputs, codec)
        kernels.set_threads(3)
        many = await _average(inputs, codec)
    finally:
        kernels.set_threads(None)
    assert all(same(a, b) for a, b in zip(one, many)) and same(many[0], many[1])
