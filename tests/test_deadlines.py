"""Deadlines from measurement: the rule (floor, ceiling, fallback), the link meter that feeds it,
and the all-reduce service deriving its rounds' deadline from its own meter."""

from __future__ import annotations

import asyncio
import math
import os
import time

import pytest
import torch

from dht import Host, Identity
from p2ptrain.averaging.allreduce import AllReduceService, round_payload
from p2ptrain.averaging.group import Group, Member
from p2ptrain.averaging.round_types import AllReduceConfig
from p2ptrain.compression import get_codec
from p2ptrain.deadlines import (
    CHECKPOINT_FETCH,
    MIN_SAMPLE_BYTES,
    ROUND,
    STATE_LOAD,
    DeadlineRule,
    LinkMeter,
    resolve,
)

GB = 1 << 30


@pytest.mark.parametrize("rule, before", [(ROUND, 60.0), (STATE_LOAD, 60.0), (CHECKPOINT_FETCH, 600.0)])
def test_without_a_measured_bandwidth_each_deadline_keeps_its_former_fixed_value(rule, before):
    assert rule.derive(10 * GB, None) == before
    assert rule.derive(10 * GB, None, latency=0.5) == before  # a latency alone says nothing of the payload
    assert LinkMeter().deadline(rule, 10 * GB) == before
    assert resolve(None, rule, 10 * GB, None) == before


@pytest.mark.parametrize("rule", [ROUND, STATE_LOAD, CHECKPOINT_FETCH])
def test_a_small_payload_on_a_fast_link_gets_the_floor_and_a_huge_one_on_a_slow_link_the_ceiling(rule):
    assert rule.derive(1 << 20, bandwidth=1e9, latency=0.001) == rule.floor
    assert rule.derive(100 * GB, bandwidth=1e6, latency=0.2) == rule.ceiling
    assert rule.floor < rule.fallback <= rule.ceiling


def test_between_the_bounds_the_deadline_is_slack_times_the_expected_time_plus_the_margin():
    rule = DeadlineRule(floor=1.0, ceiling=1000.0, fallback=10.0, round_trips=3, slack=2.0, margin=0.5)
    # 3 round trips of 0.1 s and 100 MB at 10 MB/s: 10.3 s expected
    assert rule.derive(100_000_000, bandwidth=10e6, latency=0.1) == pytest.approx(2 * 10.3 + 0.5)
    assert rule.derive(100_000_000, bandwidth=10e6) == pytest.approx(2 * 10.0 + 0.5)  # latency not measured
    # more bytes or a slower link never shorten it
    assert rule.derive(200_000_000, 10e6) > rule.derive(100_000_000, 10e6) > rule.derive(100_000_000, 20e6)


@pytest.mark.parametrize("bandwidth", [0.0, -1.0, math.inf, math.nan])
def test_a_bandwidth_that_is_no_measurement_falls_back(bandwidth):
    assert ROUND.derive(1 << 30, bandwidth) == ROUND.fallback


def test_an_explicit_deadline_wins_over_any_measurement():
    link = LinkMeter()
    link.observe_transfer(100 << 20, 0.1)
    assert resolve(7.5, ROUND, 10 * GB, link) == 7.5
    assert resolve(None, ROUND, 10 * GB, link) == link.deadline(ROUND, 10 * GB) > ROUND.floor


def test_a_rule_must_hold_its_fallback_between_floor_and_ceiling():
    with pytest.raises(ValueError):
        DeadlineRule(floor=10.0, ceiling=5.0, fallback=7.0)
    with pytest.raises(ValueError):
        DeadlineRule(floor=10.0, ceiling=50.0, fallback=60.0)
    with pytest.raises(ValueError):
        DeadlineRule(floor=0.0, ceiling=50.0, fallback=10.0)


def test_the_link_meter_averages_its_own_transfers_and_ignores_small_or_broken_samples():
    link = LinkMeter()
    link.observe_transfer(MIN_SAMPLE_BYTES - 1, 0.001)  # mostly latency: says nothing of bandwidth
    link.observe_transfer(10 << 20, 0.0)
    link.observe_transfer(10 << 20, math.nan)
    assert link.bandwidth is None
    link.observe_transfer(100_000_000, 1.0)
    assert link.bandwidth == pytest.approx(1e8)
    link.observe_transfer(100_000_000, 10.0)  # a slower transfer pulls it down, smoothly
    assert 1e7 < link.bandwidth < 1e8
    link.observe_latency(0.05)
    link.observe_latency(-1.0)
    link.observe_latency(math.inf)
    assert link.latency == pytest.approx(0.05)
    link.observe_latency(0.15)
    assert 0.05 < link.latency < 0.15


def test_a_round_payload_bounds_what_a_member_sends_and_receives():
    none, int8 = get_codec("none"), get_codec("int8")
    assert round_payload(0, 4096, none, none) == 0
    assert round_payload(1000, 4096, none, none) == 2 * (4000 + 4000)
    assert round_payload(10_000, 4096, int8, int8) == 2 * 3 * 2 * int8.encoded_nbytes(4096)


class _FixedMeter(LinkMeter):
    """A meter whose deadline is fixed, recording what it was asked for."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds
        self.asked: list[tuple[DeadlineRule, int]] = []

    def deadline(self, rule: DeadlineRule, payload_bytes: int) -> float:
        self.asked.append((rule, payload_bytes))
        return self.seconds


async def _pair(config: AllReduceConfig, serve_second: bool = True):
    hosts, services = [], []
    for _ in range(2):
        h = Host(Identity(), ("127.0.0.1", 0))
        await h.start()
        hosts.append(h)
    for h in hosts[: 1 + serve_second]:
        svc = AllReduceService(h, config)
        await svc.start()
        services.append(svc)
    group = Group(os.urandom(16), tuple(Member(h.peer_id, ("127.0.0.1", h.listen_port)) for h in hosts))
    return group, hosts, services


async def _close(hosts, services):
    for s in services:
        await s.close()
    for h in hosts:
        await h.close()


async def test_a_round_without_a_configured_timeout_takes_its_deadline_from_the_services_meter():
    """A member that never shows up: the owner gives up on it after ``reduce_fraction`` of the
    derived deadline (1.2 s of 2 s here), not of the 60 s it had when the deadline was fixed."""
    cfg = AllReduceConfig(chunk_numel=4096, join_timeout=30.0, stall_timeout=0.5)
    assert cfg.timeout is None
    group, hosts, services = await _pair(cfg, serve_second=False)
    try:
        svc = services[0]
        svc.link = _FixedMeter(2.0)
        flat = torch.randn(10_000)
        t0 = time.monotonic()
        async with asyncio.timeout(15):
            result = await svc.run(group, 0, flat.clone())
        assert time.monotonic() - t0 < 10
        assert not result.ok and 1 in result.failed
        assert svc.link.asked == [(ROUND, round_payload(10_000, 4096, get_codec("none"), get_codec("none")))]
    finally:
        await _close(hosts, services)


async def test_a_completed_round_times_the_link_and_moves_no_more_than_its_payload():
    cfg = AllReduceConfig(chunk_numel=1 << 16)
    group, hosts, services = await _pair(cfg)
    try:
        numel = 1 << 19  # 2 MiB of float32: each member moves about that much
        xs = [torch.randn(numel), torch.randn(numel)]
        async with asyncio.timeout(30):
            results = await asyncio.gather(*(s.run(group, r, x) for r, (s, x) in enumerate(zip(services, xs))))
        for svc, res in zip(services, results):
            assert res.ok
            moved = res.bytes_sent + res.bytes_received
            none = get_codec("none")
            assert MIN_SAMPLE_BYTES <= moved <= round_payload(numel, cfg.chunk_numel, none, none)
            assert svc.link.bandwidth == pytest.approx(moved / res.time_total)
            assert ROUND.floor <= svc.link.deadline(ROUND, moved) <= ROUND.ceiling
    finally:
        await _close(hosts, services)
