"""A DHT swarm spread over real OS processes on 127.0.0.1: store, get, crash (SIGKILL), survive.

Each ``SwarmProcess`` is a child running several DHTNodes (see p2ptrain/testing/dht_swarm.py). The fixture kills
every child it spawned, even when a test fails or times out, and the last check in each test is that
no child process of ours is left behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from p2ptrain.testing.dht_swarm import SwarmProcess

# Fast background work, so that a republish period passes within a test.
CONFIG = {"republish_interval": 2.0, "maintenance_period": 0.5, "rpc_timeout": 1.0, "bootstrap_timeout": 5.0}

Spawn = Callable[[int], Awaitable[list[SwarmProcess]]]


@pytest.fixture
async def spawn(child_pids) -> AsyncIterator[Spawn]:
    """Spawns swarm children; on teardown kills and reaps all of them and checks none is left."""
    procs: list[SwarmProcess] = []
    before = child_pids()

    async def _spawn(n: int) -> list[SwarmProcess]:
        new = await asyncio.gather(*(SwarmProcess.spawn() for _ in range(n)), return_exceptions=True)
        procs.extend(p for p in new if isinstance(p, SwarmProcess))
        for p in new:
            if isinstance(p, BaseException):
                raise p
        return new  # type: ignore[return-value]

    try:
        yield _spawn
    finally:
        for p in procs:
            p.kill()
        await asyncio.gather(*(p.close(timeout=2) for p in procs), return_exceptions=True)
        leftover = child_pids() - before
        assert not leftover, f"child processes left behind: {sorted(leftover)}"
        assert all(p.proc.returncode is not None for p in procs)


async def start_swarm(procs: list[SwarmProcess], per_proc: int, **kw: object) -> list[list[str]]:
    """Process 0 hosts the first peer; every other node bootstraps from its node 0."""
    first = await procs[0].request("start", n=per_proc, config=CONFIG, **kw)
    boot = first["addrs"][:1]
    rest = await asyncio.gather(*(p.request("start", n=per_proc, bootstrap=boot, config=CONFIG, **kw)
                                  for p in procs[1:]))
    return [first["addrs"]] + [r["addrs"] for r in rest]


async def assert_all_gettable(procs: list[SwarmProcess], per_proc: int, expected: dict[str, object]) -> None:
    """Every node of every given process finds every key, with the stored value."""
    gets = [[node, key] for node in range(per_proc) for key in expected]
    replies = await asyncio.gather(*(p.request("get_many", gets=gets, concurrency=4) for p in procs))
    for p, reply in zip(procs, replies):
        for (node, key), r in zip(gets, reply["results"]):
            assert r["value"] == expected[key], f"process {p.pid} node {node} key {key}: {r}"


@pytest.mark.timeout(60)
async def test_swarm_survives_sigkill_of_30_percent(spawn: Spawn) -> None:
    n_procs, per_proc = 10, 4
    async with asyncio.timeout(50):
        procs = await spawn(n_procs)
        await start_swarm(procs, per_proc)
        expected = {f"key-{i}": {"i": i, "blob": "x" * i} for i in range(20)}
        writer = procs[1]
        for key, value in expected.items():
            reply = await writer.request("store", node=0, key=key, value=value, ttl=300)
            assert reply["accepted"] >= 10, (key, reply)
        await assert_all_gettable([p for p in procs if p is not writer], per_proc, expected)

        # 30% of the processes crash: the bootstrap process, the writer (so the records must live
        # on through replicas alone) and one more.
        victims = [procs[0], procs[1], procs[6]]
        for p in victims:
            p.kill()
        await asyncio.gather(*(p.proc.wait() for p in victims))
        survivors = [p for p in procs if p not in victims]

        # No event tells us that a republish round has run on every survivor: time itself must pass
        # (one republish interval plus a maintenance tick and slack), so this sleep is deliberate.
        await asyncio.sleep(CONFIG["republish_interval"] + CONFIG["maintenance_period"] + 1.0)
        await assert_all_gettable(survivors, per_proc, expected)


@pytest.mark.timeout(40)
async def test_subkey_dictionary_merged_across_processes(spawn: Spawn) -> None:
    async with asyncio.timeout(30):
        procs = await spawn(4)
        await start_swarm(procs, 2)
        for i, p in enumerate(procs[1:], 1):
            reply = await p.request("store", node=i % 2, key="group", subkey=f"peer-{i}", value=i, ttl=60)
            assert reply["accepted"] >= 1
        got = await procs[0].request("get", node=1, key="group", latest=True)
        assert got["value"] == {"peer-1": 1, "peer-2": 2, "peer-3": 3}
        # Overwriting one sub-key keeps the others.
        await procs[2].request("store", node=0, key="group", subkey="peer-2", value=20, ttl=60)
        got = await procs[3].request("get", node=1, key="group", latest=True)
        assert got["value"] == {"peer-1": 1, "peer-2": 20, "peer-3": 3}


@pytest.mark.timeout(40)
async def test_client_mode_process_can_store_and_get(spawn: Spawn) -> None:
    async with asyncio.timeout(30):
        procs = await spawn(4)
        addrs = await start_swarm(procs[:3], 3)
        client = procs[3]
        reply = await client.request("start", n=2, bootstrap=addrs[1][:1], config=CONFIG, client_mode=True)
        assert reply["addrs"] == [None, None]  # client-mode nodes accept no connections

        assert (await client.request("store", node=0, key="from-client", value=[1, 2], ttl=60))["accepted"] >= 2
        await procs[0].request("store", node=2, key="from-server", value="hello", ttl=60)
        assert (await procs[2].request("get", node=1, key="from-client"))["value"] == [1, 2]
        assert (await client.request("get", node=1, key="from-server"))["value"] == "hello"
        assert (await client.request("get", node=0, key="missing"))["value"] is None

        # Errors answer the command and leave the child serving.
        with pytest.raises(Exception, match="no running node"):
            await client.request("get", node=7, key="x")
        await client.request("stop", nodes=[1])
        assert (await client.request("get", node=0, key="from-server"))["value"] == "hello"
