"""Private swarms: a swarm key mixed into the Noise handshake (XXpsk0), refusals, key files, CLI.

Layers, bottom up: the sans-IO handshake (a known-answer vector and every key mismatch), hosts on
loopback (refusal both ways, the listener's rate-limited WARNING line, the dialer's error), DHT
nodes and an averaging round inside a private swarm, a TCP proxy that checks nothing readable
crosses the wire, and the command line in real processes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import subprocess
import sys
import time

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from dht import ConfigError, DHTConfig, DHTNode, Identity, Multiaddr
from dht.node import BootstrapRefused
from dht.noise import (
    REFUSE_NO_KEY,
    REFUSE_UNEXPECTED_KEY,
    REFUSE_WRONG_KEY,
    StaticKey,
    SwarmKeyMismatch,
    XXHandshake,
)
from dht.swarmkey import SwarmKey, load_swarm_key
from dht.limits import LogThrottle
from dht.transport import Host
from p2ptrain.averaging import Averager

CLI = [sys.executable, "-m", "p2ptrain"]
K1, K2 = SwarmKey(bytes(range(32))), SwarmKey(bytes(range(100, 132)))
FAST = DHTConfig(rpc_timeout=1.0, bootstrap_timeout=2.0, maintenance_period=0.5)

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------ the handshake (sans-IO)


def _inc(n: int) -> bytes:
    return bytes(range(n, n + 32))


def test_xxpsk0_matches_an_independent_implementation():
    """snow's (Rust) test_XXpsk0_expected_value: same keys, prologue, psk and payloads give the
    same third message, so our XXpsk0 is Noise's, not a look-alike."""
    a, b = Identity(), Identity()
    init = XXHandshake(a, True, prologue=bytes([1, 2, 3]), psk=_inc(4),
                       static=StaticKey(a, X25519PrivateKey.from_private_bytes(_inc(0))))
    resp = XXHandshake(b, False, prologue=bytes([1, 2, 3]), psk=_inc(4),
                       static=StaticKey(b, X25519PrivateKey.from_private_bytes(_inc(1))))
    init._e = X25519PrivateKey.from_private_bytes(_inc(32))
    resp._e = X25519PrivateKey.from_private_bytes(_inc(33))
    m1 = init._write(b"abc")
    assert len(m1) == 51 and resp._read(m1) == b"abc"
    m2 = resp._write(b"defg")
    assert len(m2) == 100 and init._read(m2) == b"defg"
    m3 = init._write(b"")
    assert resp._read(m3) == b""
    assert m3.hex() == ("1b6d7cc3b13bd02217f9cdb98c50870db96281193dca4df570bf6230a603b686"
                        "fd90d2914c7e797d9276ef8fb34b0c9d87faa048ce4bc7e7af21b6a450352275")


def _pair(init_key: SwarmKey | None, resp_key: SwarmKey | None) -> tuple[XXHandshake, XXHandshake]:
    init = XXHandshake(Identity(), True, prologue=b"p", psk=init_key.secret if init_key else None)
    resp = XXHandshake(Identity(), False, prologue=b"p", psk=resp_key.secret if resp_key else None)
    return init, resp


def test_same_swarm_key_completes_and_the_session_works():
    init, resp = _pair(K1, K1)
    resp.read_message(init.write_message())
    init.read_message(resp.write_message())
    resp.read_message(init.write_message())
    assert init.remote_peer == resp.identity.peer_id and resp.remote_peer == init.identity.peer_id
    assert resp.recv_cipher.decrypt(b"h", init.send_cipher.encrypt(b"h", b"hello")) == b"hello"


@pytest.mark.parametrize("init_key, resp_key, code, listener_says, dialer_says", [
    (None, K1, REFUSE_NO_KEY, "the peer has no swarm key", "private swarm and this peer has no swarm key"),
    (K2, K1, REFUSE_WRONG_KEY, "different swarm key", "it uses a different swarm key"),
    (K1, None, REFUSE_UNEXPECTED_KEY, "the peer uses a swarm key", "it has no swarm key (a public swarm)"),
])
def test_mismatch_is_refused_at_the_first_message_with_its_reason(init_key, resp_key, code, listener_says,
                                                                  dialer_says):
    init, resp = _pair(init_key, resp_key)
    with pytest.raises(SwarmKeyMismatch) as refused:
        resp.read_message(init.write_message())
    err = refused.value
    assert err.code == code and not err.refused_by_peer and listener_says in str(err)
    assert resp.remote_peer is None and not resp.complete  # the listener learned and revealed nothing
    with pytest.raises(SwarmKeyMismatch) as told:  # the dialer reads the one-byte refusal
        init.read_message(XXHandshake.refusal(err))
    assert told.value.code == code and told.value.refused_by_peer and dialer_says in str(told.value)
    assert not init.complete


def test_a_forged_first_message_of_psk_size_is_refused_as_another_key():
    _, resp = _pair(None, K1)
    with pytest.raises(SwarmKeyMismatch, match="different swarm key"):
        resp.read_message(os.urandom(48))


# ------------------------------------------------------------------ swarm key files


def test_key_file_round_trip_mode_and_no_overwrite(tmp_path):
    key = SwarmKey.generate()
    path = tmp_path / "swarm.key"
    key.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text().splitlines()[:2] == ["/key/swarm/psk/1.0.0/", "/base16/"]
    assert SwarmKey.load(path) == key and load_swarm_key(str(path)) == key
    with pytest.raises(ConfigError, match="already exists"):
        SwarmKey.generate().save(path)
    assert SwarmKey.load(path) == key  # untouched
    assert [p.name for p in tmp_path.iterdir()] == ["swarm.key"]  # no temporary left behind


def test_libp2p_base64_key_files_are_read(tmp_path):
    import base64

    path = tmp_path / "swarm.key"
    path.write_text(f"/key/swarm/psk/1.0.0/\n/base64/\n{base64.b64encode(K1.secret).decode()}\n")
    assert SwarmKey.load(path) == K1


@pytest.mark.parametrize("content, needle", [
    (b"", "is not a swarm key"),
    (b"/key/swarm/psk/1.0.0/\n/base16/\n" + b"ab" * 31 + b"\n", "32 bytes, this one has 31"),
    (b"/key/swarm/psk/1.0.0/\n/base16/\nnot-hex\n", "not valid base16"),
    (b"/key/swarm/psk/1.0.0/\n/bin/\nxx\n", "unsupported swarm key encoding"),
    (b"p2ptrain-ed25519-v1\n" + bytes(32), "is a peer identity key (--key-file), not a swarm key"),
    (b"/key/swarm/psk/1.0.0/\n/base16/\n\xff\xfe\n", "not text"),
    (b"x" * 10_000, "larger than"),
])
def test_bad_key_files_are_one_line_errors_naming_the_file(tmp_path, content, needle):
    path = tmp_path / "swarm.key"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        SwarmKey.load(path)
    assert needle in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="cannot read swarm key file"):
        SwarmKey.load(tmp_path / "missing.key")


def test_the_key_is_never_shown():
    text = f"{K1} {K1!r} {[K1]}"
    assert K1.secret.hex() not in text and K1.fingerprint in text
    assert K1 != K2 and K1 == SwarmKey(K1.secret) and K1.fingerprint != K2.fingerprint


def test_log_throttle_allows_one_line_per_address_and_counts_the_rest():
    t = LogThrottle(interval=60.0, max_addresses=2)
    assert t.allow("1.1.1.1", 0.0) == 0
    assert [t.allow("1.1.1.1", s) for s in (1.0, 2.0, 3.0)] == [None, None, None]
    assert t.allow("2.2.2.2", 4.0) == 0  # per address
    assert t.allow("1.1.1.1", 61.0) == 3  # the next line says how many were held back
    assert t.allow("3.3.3.3", 62.0) is None  # table full of recent addresses: bounded, stays quiet
    assert t.allow("3.3.3.3", 130.0) == 0  # old entries are dropped to make room


# ------------------------------------------------------------------ hosts on loopback


@pytest.fixture
async def hosts(loop_errors):
    made: list[Host] = []

    async def make(key: SwarmKey | None, listen=("127.0.0.1", 0)) -> Host:
        host = Host(Identity(), listen, swarm_key=key)
        await host.start()
        host.on_request("echo", lambda _conn, args: _echo(args))
        made.append(host)
        return host

    yield make
    for host in made:
        await host.close()


async def _echo(args):
    return args


def _refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "refused" in r.getMessage()]


async def test_hosts_with_the_same_key_talk(hosts):
    async with asyncio.timeout(10):
        a, b = await hosts(K1), await hosts(K1)
        assert await a.call(b.peer_id, ("127.0.0.1", b.listen_port), "echo", {"x": 1}) == {"x": 1}


@pytest.mark.parametrize("dialer_key, listener_key, listener_says, dialer_says", [
    (None, K1, "handshake failed (the peer has no swarm key)", "private swarm and this peer has no swarm key"),
    (K2, K1, "handshake failed (different swarm key)", "it uses a different swarm key"),
    (K1, None, "handshake failed (the peer uses a swarm key and this peer has none)", "it has no swarm key"),
])
async def test_other_swarms_are_refused_both_ways_with_one_clear_line(hosts, caplog, dialer_key, listener_key,
                                                                      listener_says, dialer_says):
    caplog.set_level(logging.DEBUG)
    async with asyncio.timeout(10):
        listener, dialer = await hosts(listener_key), await hosts(dialer_key)
        for _ in range(3):  # a peer retrying in a loop: refused every time, logged once
            with pytest.raises(SwarmKeyMismatch) as info:
                await dialer.connect("127.0.0.1", listener.listen_port, listener.peer_id)
            assert dialer_says in str(info.value) and "\n" not in str(info.value)
        lines = _refusals(caplog)
        assert len(lines) == 1, lines
        assert lines[0].startswith("refused 127.0.0.1:") and lines[0].endswith(listener_says)
        assert listener.connections == [] and dialer.connections == []
        # the listener still serves its own swarm
        friend = await hosts(listener_key)
        assert await friend.call(listener.peer_id, ("127.0.0.1", listener.listen_port), "echo", 7) == 7
    secrets = [k.secret for k in (dialer_key, listener_key) if k is not None]
    for secret in secrets:
        assert secret.hex() not in caplog.text and secret.hex().upper() not in caplog.text


# ------------------------------------------------------------------ DHT and averaging in a private swarm


@pytest.fixture
async def nodes():
    started: list[DHTNode] = []

    async def make(n: int, key: SwarmKey | None, boot=None, **kw) -> list[DHTNode]:
        new = [DHTNode(config=FAST, swarm_key=key, **kw) for _ in range(n)]
        for nd in new:
            started.append(nd)
            await nd.start(boot if boot is not None else (started[0].multiaddrs if nd is not started[0] else []))
        return new

    yield make
    await asyncio.gather(*(nd.close() for nd in started), return_exceptions=True)


async def test_keyed_peers_store_get_and_average_together(nodes):
    async with asyncio.timeout(30):
        peers = await nodes(3, K1)
        await peers[1].store("run/config", {"lr": 0.1}, time.time() + 60)
        got = await peers[2].get("run/config")
        assert got is not None and got.value == {"lr": 0.1}

        tensors = [torch.full((64,), float(i)) for i in range(2)]
        avgs = [Averager(nd, "private-run", [t], matchmaking_timeout=3.0) for nd, t in zip(peers[:2], tensors)]
        try:
            for a in avgs:
                await a.start()
            results = await asyncio.gather(*(a.step() for a in avgs))
            assert [r.group_size for r in results] == [2, 2] and all(r.averaged for r in results)
            for t in tensors:
                torch.testing.assert_close(t, torch.full((64,), 0.5))
        finally:
            await asyncio.gather(*(a.close() for a in avgs))


@pytest.mark.parametrize("joiner_key, needle", [
    (None, "this swarm needs --swarm-key-file"),
    (K2, "holds another key than the swarm's"),
])
async def test_a_stranger_cannot_join_and_is_told_why(nodes, joiner_key, needle):
    async with asyncio.timeout(15):
        (first,) = await nodes(1, K1)
        await first.store("secret/plan", "x", time.time() + 60)
        stranger = DHTNode(config=FAST, swarm_key=joiner_key)
        with pytest.raises(BootstrapRefused) as info:
            await stranger.start(first.multiaddrs)
        assert str(info.value).startswith("could not join: the bootstrap peer refused the handshake — ")
        assert needle in str(info.value)
        assert len(first.routing) == 0  # it never made it into the routing table


async def test_a_public_peer_cannot_join_through_a_keyed_one_either_way(nodes):
    async with asyncio.timeout(15):
        (public,) = await nodes(1, None)
        keyed = DHTNode(config=FAST, swarm_key=K1)
        with pytest.raises(BootstrapRefused, match="that swarm is public"):
            await keyed.start(public.multiaddrs)


async def test_nothing_readable_crosses_the_wire(nodes):
    """A TCP proxy between two keyed peers records every byte; a known value's plaintext, its key
    and the swarm key never appear in it, though the value did arrive."""
    captured = bytearray()
    marker = b"PLAINTEXT-MARKER-0123456789-visible-if-unencrypted"

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                captured.extend(data)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    (target,) = await nodes(1, K1)
    pipes: list[asyncio.Task] = []

    async def on_client(reader, writer):
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target.host.listen_port)
        pipes.append(asyncio.ensure_future(pipe(reader, up_writer)))
        pipes.append(asyncio.ensure_future(pipe(up_reader, writer)))

    proxy = await asyncio.start_server(on_client, "127.0.0.1", 0)
    try:
        async with asyncio.timeout(15):
            port = proxy.sockets[0].getsockname()[1]
            via_proxy = Multiaddr.from_host_port("127.0.0.1", port, target.peer_id)
            (client,) = await nodes(1, K1, boot=[via_proxy], listen=None)  # client mode: all traffic via the proxy
            await client.store(b"plain-key-" + marker, marker.decode(), time.time() + 60)
            held = target.storage.get(b"plain-key-" + marker, time.time())
            assert held and marker in held[0].value  # the value reached the target
    finally:
        proxy.close()
        for t in pipes:
            t.cancel()
        await asyncio.gather(*pipes, return_exceptions=True)
    data = bytes(captured)
    assert len(data) > 500
    assert marker not in data and marker[:16] not in data
    assert K1.secret not in data and K1.secret.hex().encode() not in data


# ------------------------------------------------------------------ the command line (real processes)


def _cli(*args: str, timeout: float = 60, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("P2PTRAIN_")}
    full_env.update(env or {})
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)


@pytest.fixture
def keyed_bootstrap(tmp_path):
    """A `p2ptrain dht` peer of a private swarm in its own process: (process, multiaddr, key path)."""
    key_path = tmp_path / "swarm.key"
    out = _cli("dht", "swarm-key", str(key_path))
    assert out.returncode == 0, out.stderr
    proc = subprocess.Popen([*CLI, "dht", "--listen", "/ip4/127.0.0.1/tcp/0", "--swarm-key-file", str(key_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        line = proc.stdout.readline().strip()
        assert "/p2p/12D3KooW" in line, line
        yield proc, line, key_path
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def test_swarm_key_command_creates_a_private_file_and_never_prints_the_key(tmp_path):
    path = tmp_path / "k"
    out = _cli("dht", "swarm-key", str(path))
    assert out.returncode == 0, out.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = SwarmKey.load(path)
    assert key.fingerprint in out.stderr and key.secret.hex() not in out.stdout + out.stderr
    again = _cli("dht", "swarm-key", str(path))
    assert again.returncode == 2 and "already exists" in again.stderr and "Traceback" not in again.stderr
    assert SwarmKey.load(path) == key


def test_cli_refuses_strangers_and_admits_the_key_holder(keyed_bootstrap, tmp_path):
    proc, addr, key_path = keyed_bootstrap
    other = tmp_path / "other.key"
    SwarmKey.generate().save(other)

    no_key = _cli("dht", "get", "x", "--bootstrap", addr, "--timeout", "5")
    assert no_key.returncode == 2, no_key.stderr
    assert no_key.stderr.strip().splitlines()[-1] == ("p2ptrain: error: could not join: the bootstrap peer refused "
                                                     "the handshake — this swarm needs --swarm-key-file "
                                                     "(it is private)")
    wrong = _cli("status", "--bootstrap", addr, "--swarm-key-file", str(other), "--timeout", "5")
    assert wrong.returncode == 2 and "another key than the swarm's" in wrong.stderr
    member = _cli("dht", "put", "k", "42", "--bootstrap", addr, env={"P2PTRAIN_SWARM_KEY_FILE": str(key_path)})
    assert member.returncode == 0, member.stderr
    got = _cli("dht", "get", "k", "--bootstrap", addr, "--swarm-key-file", str(key_path))
    assert got.returncode == 0 and '"value": 42' in got.stdout
    for out in (no_key, wrong, member, got):
        assert "Traceback" not in out.stderr

    proc.kill()
    _, err = proc.communicate(timeout=10)
    refused = [line for line in err.splitlines() if "WARNING" in line and "refused 127.0.0.1:" in line]
    assert refused and refused[0].endswith("handshake failed (the peer has no swarm key)")
    assert len(refused) == 1  # the second stranger came from the same address within the minute
    for secret in (SwarmKey.load(key_path).secret, SwarmKey.load(other).secret):
        assert secret.hex() not in err


def test_peer_without_the_key_exits_2_with_the_reason(keyed_bootstrap):
    _, addr, _ = keyed_bootstrap
    out = _cli("peer", "--bootstrap", addr, "--epochs", "1", timeout=90)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "could not join: the bootstrap peer refused the handshake — this swarm needs --swarm-key-file" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_peer_with_the_key_joins_and_trains(keyed_bootstrap):
    """The key reaches the peer's DHT however it is given (here: a config file, relative path)."""
    proc, addr, key_path = keyed_bootstrap
    config = key_path.parent / "run.toml"
    config.write_text(f'swarm_key_file = "{key_path.name}"\nepochs = 1\n')
    out = _cli("peer", "--config", str(config), "--bootstrap", addr, "--json", timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    assert '"event": "done"' in out.stdout


def test_python_dht_takes_the_key_or_the_environment(tmp_path, monkeypatch):
    import p2ptrain

    path = tmp_path / "swarm.key"
    K1.save(path)
    monkeypatch.setenv("P2PTRAIN_SWARM_KEY_FILE", str(path))
    with p2ptrain.DHT([]) as from_env, p2ptrain.DHT([], swarm_key=False) as public:
        assert from_env.node.host.swarm_key == K1 and public.node.host.swarm_key is None
        with pytest.raises(BootstrapRefused, match="that swarm is public"):
            p2ptrain.DHT([str(public.multiaddrs[0])], swarm_key=path, start_timeout=10)
        with p2ptrain.DHT([str(from_env.multiaddrs[0])], swarm_key=K1.secret) as member:
            assert member.node.host.swarm_key == K1


@pytest.mark.parametrize("args, env, needle", [
    (["status", "--bootstrap", "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWBtg3aaGc3bB8PxW4hbMHHzqDtdqdyiAMtoWDjuhzZAXv",
      "--swarm-key-file", "/nonexistent/swarm.key"], {}, "--swarm-key-file: cannot read swarm key file"),
    (["dht", "get", "x", "--bootstrap",
      "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWBtg3aaGc3bB8PxW4hbMHHzqDtdqdyiAMtoWDjuhzZAXv"],
     {"P2PTRAIN_SWARM_KEY_FILE": "/nonexistent/swarm.key"}, "$P2PTRAIN_SWARM_KEY_FILE: cannot read"),
    (["peer", "--epochs", "1"], {"P2PTRAIN_SWARM_KEY_FILE": "/nonexistent/swarm.key"},
     "$P2PTRAIN_SWARM_KEY_FILE: cannot read swarm key file"),
])
def test_unreadable_key_file_is_a_one_line_usage_error(args, env, needle):
    out = _cli(*args, env=env)
    assert out.returncode == 2, out.stderr
    assert needle in out.stderr and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_swarm_command_gives_every_child_the_key(tmp_path, monkeypatch):
    """`p2ptrain swarm --swarm-key-file` hands the key to its bootstrap peer and to every training
    peer (children get no P2PTRAIN_* variables, so the flag is the only way it reaches them)."""
    from types import SimpleNamespace

    from p2ptrain.cli import build_parser
    from p2ptrain.cli import swarm_cmd

    key_path = tmp_path / "swarm.key"
    K1.save(key_path)
    launched: list[list[str]] = []

    class FakeChild:
        def __init__(self, index, argv, events, log=None):
            self.index = index
            launched.append(argv)
            self.proc = SimpleNamespace(wait=lambda *a, **k: 0, poll=lambda: 0, returncode=0)
            self.stderr: list[str] = []
            events.put((index, "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWBtg3aaGc3bB8PxW4hbMHHzqDtdqdyiAMtoWDjuhzZAXv\n"
                        if index < 0 else None))

        def signal(self, sig):
            pass

    monkeypatch.setattr(swarm_cmd, "_Child", FakeChild)
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["swarm", "--peers", "3", "--json", "--swarm-key-file", "swarm.key"])
    assert swarm_cmd.main(args) == 0
    assert len(launched) == 4 and launched[0][launched[0].index("p2ptrain") + 1:][:2] == ["dht", "run"]
    for argv in launched:
        i = argv.index("--swarm-key-file")
        assert argv[i + 1] == str(key_path.resolve())
