"""Joining under churn: bootstrap retries with backoff, and the persistent peer cache."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from dht import BootstrapError, BootstrapRefused, DHTConfig, DHTNode, Identity, Multiaddr
from dht.bootstrap import DialPlan
from dht.peercache import cache_entries, load_peer_cache, save_peer_cache
from dht.routing import Contact
from dht.swarmkey import SwarmKey

pytestmark = pytest.mark.timeout(60)

FAST = DHTConfig(rpc_timeout=1.0, bootstrap_timeout=3.0, maintenance_period=0.2)
REPO = Path(__file__).resolve().parent.parent


def dead_addr() -> Multiaddr:
    """An address where nothing listens (port 1 refuses at once) with a peer id nobody has."""
    return Multiaddr.parse(f"/ip4/127.0.0.1/tcp/1/p2p/{Identity().peer_id}")


def config(**kw) -> DHTConfig:
    base = {k: getattr(FAST, k) for k in ("rpc_timeout", "bootstrap_timeout", "maintenance_period")}
    return DHTConfig(**{**base, **kw})


@pytest.fixture
async def nodes():
    made: list[DHTNode] = []

    def track(node: DHTNode) -> DHTNode:
        made.append(node)
        return node

    try:
        yield track
    finally:
        await asyncio.gather(*(n.close() for n in made), return_exceptions=True)


# ------------------------------------------------------------------ the dial plan (sans-IO)


def test_plan_backs_off_with_jitter_up_to_the_cap():
    a = dead_addr()
    plan = DialPlan([a], now=0.0, timeout=30.0, rng=random.Random(1))
    now, gaps = 0.0, []
    for _ in range(8):
        assert plan.due(now) == [a]
        plan.failed(a, "refused", now)
        wait = plan.wait(now)
        gaps.append(wait)
        assert plan.due(now) == []  # nothing before the backoff is over
        now += wait
    nominal = [0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0, 2.0]
    for gap, d in zip(gaps, nominal):
        assert d / 2 <= gap <= d + 1e-9, (gaps, nominal)
    assert plan.attempts == 8


def test_plan_stops_at_the_deadline_and_never_retries_a_refusal():
    a, b = dead_addr(), dead_addr()
    plan = DialPlan([a, b], now=0.0, timeout=1.0, rng=random.Random(2))
    assert set(plan.due(0.0)) == {a, b}
    plan.failed(a, "the peer refused the handshake", 0.01, refused=True)
    assert not plan.given_up  # b may still answer
    plan.failed(b, "refused", 0.01)
    assert plan.due(plan.wait(0.01) + 0.01) == [b]
    assert plan.due(1.0) == [] and plan.expired(1.0)
    plan2 = DialPlan([a], now=0.0, timeout=10.0)
    plan2.due(0.0)
    plan2.failed(a, "refused", 0.0, refused=True)
    assert plan2.given_up and plan2.all_refused and plan2.due(5.0) == []


def test_plan_dials_cached_peers_once_every_given_address_failed_or_after_a_grace():
    given, cached = dead_addr(), dead_addr()
    plan = DialPlan([given], [cached, given], now=0.0, timeout=10.0, cache_after=2.0)
    assert [t.addr for t in plan.cached] == [cached]  # a given address is not also a cached one
    assert plan.due(0.0) == [given]
    assert plan.wait(0.0) == pytest.approx(2.0)  # the in-flight dial may hang: wake up for the cache
    plan.failed(given, "refused", 0.05)
    assert cached in plan.due(0.05)  # every given address failed once: fall back at once
    slow = DialPlan([given], [cached], now=0.0, timeout=10.0, cache_after=2.0)
    assert slow.due(0.0) == [given] and slow.due(1.9) == []
    assert slow.due(2.0) == [cached]  # the given dial is still hanging: the grace is over


# ------------------------------------------------------------------ retries


async def test_joins_a_bootstrap_peer_that_starts_after_the_newcomer(nodes):
    """The bootstrap peer's port is reserved (bound, not listening: dials are refused) until the
    newcomer's first attempt has failed; then the peer starts there and the retry joins it."""
    reserve = socket.socket()
    reserve.bind(("127.0.0.1", 0))
    port = reserve.getsockname()[1]
    boot_id = Identity()
    addr = Multiaddr.parse(f"/ip4/127.0.0.1/tcp/{port}/p2p/{boot_id.peer_id}")
    newcomer = nodes(DHTNode(config=config(bootstrap_timeout=10.0)))
    first_failure = asyncio.Event()
    real_connect = newcomer.host.connect_addr

    async def connect_addr(a, timeout=5.0):
        try:
            return await real_connect(a, timeout)
        except Exception:
            first_failure.set()
            raise

    newcomer.host.connect_addr = connect_addr  # type: ignore[method-assign]
    joining = asyncio.ensure_future(newcomer.start([addr]))
    await asyncio.wait_for(first_failure.wait(), 5)
    assert not joining.done()
    reserve.close()
    boot = nodes(DHTNode(boot_id, ("127.0.0.1", port), config=FAST))
    await boot.start()
    t0 = time.monotonic()
    await asyncio.wait_for(joining, 10)
    assert time.monotonic() - t0 < 3.0  # the backoff is capped at 2 s
    assert boot.peer_id in newcomer.routing


async def test_dead_bootstrap_fails_after_the_timeout_with_a_clear_message():
    node = DHTNode(config=config(bootstrap_timeout=1.0))
    a, b = dead_addr(), dead_addr()
    t0 = time.monotonic()
    with pytest.raises(BootstrapError) as err:
        await node.start([a, b])
    elapsed = time.monotonic() - t0
    assert 0.9 <= elapsed < 2.5, elapsed
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("could not reach any bootstrap peer within 1.")
    assert str(a) in msg and str(b) in msg and "check the address and that the peer is running" in msg
    attempts = int(msg.split(" attempt(s)")[0].rsplit(" ", 1)[1])
    assert attempts >= 6, msg  # both addresses, retried several times (0.2 s, 0.4 s, ...)
    assert not node.host._all and not node._tasks  # cleaned up


async def test_swarm_key_refusal_is_still_fast(nodes):
    k1, k2 = SwarmKey(bytes(range(32))), SwarmKey(bytes(range(100, 132)))
    private = nodes(DHTNode(config=FAST, swarm_key=k1))
    await private.start()
    outsider = DHTNode(config=config(bootstrap_timeout=10.0), swarm_key=k2)
    t0 = time.monotonic()
    with pytest.raises(BootstrapRefused, match="refused the handshake"):
        await outsider.start(private.multiaddrs)
    assert time.monotonic() - t0 < 2.0


async def test_wrong_peer_id_is_not_retried(nodes):
    live = nodes(DHTNode(config=FAST))
    await live.start()
    wrong = live.multiaddrs[0].with_peer_id(Identity().peer_id)
    node = DHTNode(config=config(bootstrap_timeout=10.0))
    t0 = time.monotonic()
    with pytest.raises(BootstrapError, match="reached"):
        await node.start([wrong])
    assert time.monotonic() - t0 < 2.0


# ------------------------------------------------------------------ the peer cache


async def test_dead_bootstrap_but_a_cached_live_peer_joins_through_the_cache(nodes, tmp_path, caplog):
    live = nodes(DHTNode(config=FAST))
    await live.start()
    cache = tmp_path / "peers.json"
    save_peer_cache(cache, [dead_addr(), live.multiaddrs[0]])
    node = nodes(DHTNode(config=config(bootstrap_timeout=10.0, peer_cache=cache)))
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="dht.node"):
        await node.start([dead_addr()])
    assert time.monotonic() - t0 < 3.0  # the cache is tried once the given address has failed
    assert live.peer_id in node.routing
    assert f"joined through {live.multiaddrs[0]} from the peer cache" in caplog.text


async def test_no_bootstrap_means_a_new_swarm_even_with_a_cache(nodes, tmp_path):
    live = nodes(DHTNode(config=FAST))
    await live.start()
    cache = tmp_path / "peers.json"
    save_peer_cache(cache, [live.multiaddrs[0]])
    first = nodes(DHTNode(config=config(peer_cache=cache)))
    await first.start()
    assert len(first.routing) == 0


async def test_corrupt_cache_is_ignored_with_one_warning(nodes, tmp_path, caplog):
    live = nodes(DHTNode(config=FAST))
    await live.start()
    cache = tmp_path / "peers.json"
    for garbage in (b"\x00\xff not json", b'{"version": 1, "peers": "nope"}', b"[1, 2]"):
        cache.write_bytes(garbage)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dht.peercache"):
            assert load_peer_cache(cache) == []
        assert len(caplog.records) == 1 and "ignoring peer cache" in caplog.records[0].getMessage()
        assert "\n" not in caplog.records[0].getMessage()
    node = DHTNode(config=config(bootstrap_timeout=0.5, peer_cache=cache))
    with caplog.at_level(logging.WARNING, logger="dht.peercache"), pytest.raises(BootstrapError):
        await node.start([dead_addr()])
    joined = nodes(DHTNode(config=config(peer_cache=cache)))
    await joined.start(live.multiaddrs)
    await joined.close()  # rewrites the corrupt file with what it knows now
    assert load_peer_cache(cache) == [live.multiaddrs[0]]


def test_malformed_entries_are_skipped(tmp_path, caplog):
    good = dead_addr()
    cache = tmp_path / "peers.json"
    cache.write_text(json.dumps({"version": 1, "peers": [str(good), 42, "/ip4/1.2.3.4/tcp/5", "/nonsense"]}))
    with caplog.at_level(logging.WARNING, logger="dht.peercache"):
        assert load_peer_cache(cache) == [good]
    assert "skipped 3 malformed entries" in caplog.text
    assert load_peer_cache(tmp_path / "missing.json") == []  # no file yet: no warning either


def test_cache_is_bounded_and_atomic(tmp_path, monkeypatch):
    cache = tmp_path / "sub" / "peers.json"
    addrs = [Multiaddr.parse(f"/ip4/10.0.0.{i}/tcp/4001/p2p/{Identity().peer_id}") for i in range(1, 101)]
    save_peer_cache(cache, addrs)  # creates the directory
    doc = json.loads(cache.read_text())
    assert doc["version"] == 1 and len(doc["peers"]) == 64 and doc["peers"][0] == str(addrs[0])
    assert load_peer_cache(cache, limit=10) == addrs[:10]

    def crash(*_a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        save_peer_cache(cache, addrs[50:])
    assert json.loads(cache.read_text()) == doc  # the old version, whole
    assert sorted(p.name for p in cache.parent.iterdir()) == ["peers.json"]  # no temp file left
    monkeypatch.undo()
    stale = cache.parent / ".peers.json.dead.tmp"  # a writer SIGKILLed mid-write
    stale.write_text("{")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    save_peer_cache(cache, addrs[:2])
    assert sorted(p.name for p in cache.parent.iterdir()) == ["peers.json"]


def test_cache_entries_are_live_listening_peers_newest_first():
    own = Identity().peer_id
    ids = [Identity().peer_id for _ in range(4)]
    contacts = [Contact(ids[0], ("10.0.0.1", 1), last_seen=1.0), Contact(ids[1], ("10.0.0.2", 2), last_seen=3.0),
                Contact(ids[2], None, last_seen=5.0), Contact(ids[3], ("10.0.0.4", 4), last_seen=4.0, failures=1),
                Contact(own, ("10.0.0.5", 5), last_seen=9.0)]
    assert cache_entries(contacts, own) == [Multiaddr.parse(f"/ip4/10.0.0.2/tcp/2/p2p/{ids[1]}"),
                                            Multiaddr.parse(f"/ip4/10.0.0.1/tcp/1/p2p/{ids[0]}")]
    assert len(cache_entries(contacts, own, limit=1)) == 1


async def test_node_writes_its_cache_periodically_and_on_close(nodes, tmp_path):
    boot = nodes(DHTNode(config=FAST))
    await boot.start()
    others = [nodes(DHTNode(config=FAST)) for _ in range(4)]
    await asyncio.gather(*(o.start(boot.multiaddrs) for o in others))
    cache = tmp_path / "peers.json"
    node = nodes(DHTNode(config=config(peer_cache=cache, peer_cache_size=3, peer_cache_interval=60.0)))
    await node.start(boot.multiaddrs)
    for _ in range(50):  # the first maintenance tick writes it (a peer SIGKILLed later still left one)
        if cache.exists():
            break
        await asyncio.sleep(0.1)
    first = load_peer_cache(cache)
    assert len(first) == 3 and node.peer_id not in {a.peer_id for a in first}
    known = {n.peer_id for n in [boot, *others]}
    assert {a.peer_id for a in first} <= known
    cache.unlink()
    await asyncio.sleep(0.5)  # several ticks: within peer_cache_interval nothing is rewritten
    assert not cache.exists()
    await node.close()
    assert len(load_peer_cache(cache)) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["peers.json"]


async def test_failed_start_does_not_wipe_the_cache(tmp_path):
    cache = tmp_path / "peers.json"
    kept = [dead_addr()]
    save_peer_cache(cache, kept)
    node = DHTNode(config=config(bootstrap_timeout=0.3, peer_cache=cache))
    with pytest.raises(BootstrapError, match="1 cached peer"):
        await node.start([dead_addr()])
    assert load_peer_cache(cache) == kept


# ------------------------------------------------------------------ the command line


async def test_cli_dht_rejoins_through_the_cache_in_the_data_dir(nodes, tmp_path):
    """``p2ptrain dht`` keeps its cache in the data directory by default: with its bootstrap peer
    dead, it joins through the cached peer, and rewrites the cache when it leaves."""
    live = nodes(DHTNode(config=FAST))
    await live.start()
    data = tmp_path / "data"
    save_peer_cache(data / "peers.json", [live.multiaddrs[0]])
    env = {**os.environ, "P2PTRAIN_DATA_DIR": str(data), "PYTHONPATH": str(REPO)}
    env.pop("P2PTRAIN_BOOTSTRAP", None)
    env.pop("P2PTRAIN_SWARM_KEY_FILE", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "p2ptrain", "dht", "--listen", "/ip4/127.0.0.1/tcp/0", "--bootstrap", str(dead_addr()),
        "--timeout", "10", cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 30)  # type: ignore[union-attr]
        assert line.startswith(b"/ip4/127.0.0.1/tcp/"), (line, await proc.stderr.read())  # type: ignore[union-attr]
        joined = Multiaddr.parse(line.decode().strip())
        for _ in range(100):
            if joined.peer_id in live.routing:
                break
            await asyncio.sleep(0.05)
        assert joined.peer_id in live.routing
        (data / "peers.json").unlink()
        proc.send_signal(signal.SIGTERM)
        _out, err = await asyncio.wait_for(proc.communicate(), 20)
        assert proc.returncode == 0, err
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert load_peer_cache(data / "peers.json") == [live.multiaddrs[0]]
    no_cache = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "p2ptrain", "dht", "--bootstrap", str(dead_addr()), "--timeout", "0.5",
        "--no-peer-cache", cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _out, err = await asyncio.wait_for(no_cache.communicate(), 30)
    assert no_cache.returncode == 1 and b"could not reach any bootstrap peer" in err and b"cached" not in err
    assert b"Traceback" not in err
