"""The `p2ptrain` command driven as a user would: real subprocesses, bounded, cleaned up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dht import Identity

CLI = [sys.executable, "-m", "p2ptrain.cli"]


def run_cli(*args: str, timeout: float = 30, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


@pytest.fixture
def bootstrap_peer(tmp_path):
    """A `p2ptrain dht` peer in its own process; yields its multiaddr as it printed it."""
    proc = subprocess.Popen(
        [*CLI, "dht", "--listen", "/ip4/127.0.0.1/tcp/0", "--key-file", str(tmp_path / "boot.key")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )
    try:
        line = proc.stdout.readline().strip()  # blocks until the peer prints its address
        assert line.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/12D3KooW" in line, line
        yield proc, line
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def test_help_lists_commands():
    out = run_cli("--help")
    assert out.returncode == 0
    assert "dht" in out.stdout and "demo" in out.stdout
    out = run_cli("dht", "--help")
    assert out.returncode == 0 and "--bootstrap" in out.stdout and "--client" in out.stdout


def test_put_get_through_a_bootstrap_peer_and_clean_sigint(bootstrap_peer, tmp_path):
    proc, addr = bootstrap_peer
    put = run_cli("dht", "put", "greeting", '{"hello": "world"}', "--ttl", "60", "--bootstrap", addr, cwd=tmp_path)
    assert put.returncode == 0, put.stderr
    assert json.loads(put.stdout)["stored_on_peers"] >= 1
    get = run_cli("dht", "get", "greeting", "--bootstrap", addr, cwd=tmp_path)
    assert get.returncode == 0, get.stderr
    assert json.loads(get.stdout)["value"] == {"hello": "world"}
    missing = run_cli("dht", "get", "nothing-here", "--bootstrap", addr, cwd=tmp_path)
    assert missing.returncode == 1 and "not found" in missing.stderr

    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=5) == 0
    assert "Traceback" not in proc.stderr.read()


def test_key_file_keeps_peer_id_across_restarts(tmp_path):
    key = tmp_path / "peer.key"
    ids = []
    for _ in range(2):
        proc = subprocess.Popen([*CLI, "dht", "--listen", "/ip4/127.0.0.1/tcp/0", "--key-file", str(key)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tmp_path)
        try:
            ids.append(proc.stdout.readline().strip().rsplit("/", 1)[-1])
        finally:
            proc.terminate()
            assert proc.wait(timeout=5) == 0
    assert ids[0] == ids[1] == str(Identity.load(key).peer_id)
    assert os.stat(key).st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    "args, needle",
    [
        (["dht", "get", "k", "--bootstrap", "/ip4/1.2.3/tcp/1"], "not a valid ip4 address"),
        (["dht", "get", "k", "--bootstrap", "/ip4/127.0.0.1/tcp/99999"], "port"),
        (["dht", "get", "k", "--bootstrap", "ip4/127.0.0.1/tcp/1"], "must start with '/'"),
        (["dht", "--listen", "/dns4/example.com/tcp/1"], "listen on an IP address"),
        (["dht", "get"], "usage"),
    ],
)
def test_bad_input_is_one_line_error(args, needle, tmp_path):
    out = run_cli(*args, cwd=tmp_path)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in out.stderr, out.stderr


def test_garbage_key_file_is_one_line_error(tmp_path):
    key = tmp_path / "bad.key"
    key.write_bytes(b"not a key")
    out = run_cli("dht", "--key-file", str(key), cwd=tmp_path)
    assert out.returncode == 2
    assert "not a p2ptrain Ed25519 key" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("argv, verbosity, as_json", [
    (["peer"], 0, False), (["-v", "peer"], 1, False), (["peer", "-vv"], 2, False),
    (["-v", "peer", "-v", "--log-json"], 2, True), (["ckpt", "ls", "-v"], 1, False),
    (["ckpt", "-v", "ls", "-v"], 2, False), (["--log-json", "dht", "get", "k"], 0, True),
])
def test_logging_flags_work_before_and_after_the_command(argv, verbosity, as_json):
    from p2ptrain.cli import build_parser, logging_options

    assert logging_options(build_parser().parse_args(argv)) == (verbosity, as_json)


def test_logging_flags_after_the_command_reach_the_logging_setup(tmp_path, monkeypatch):
    import p2ptrain.cli as cli

    calls = []
    monkeypatch.setattr(cli, "setup_logging", lambda verbose, as_json: calls.append((verbose, as_json)))
    assert cli.main(["-v", "ckpt", "ls", "--data-dir", str(tmp_path), "-vv", "--log-json"]) == 0
    assert calls == [(3, True)]
    assert "-v, --verbose" in run_cli("peer", "--help").stdout


def test_unreachable_bootstrap_fails_within_timeout(tmp_path):
    dead = f"/ip4/127.0.0.1/tcp/1/p2p/{Identity().peer_id}"
    start = time.monotonic()
    out = run_cli("dht", "--bootstrap", dead, "--timeout", "2", cwd=tmp_path)
    assert out.returncode == 1
    assert "could not reach any bootstrap peer" in out.stderr and "Traceback" not in out.stderr
    assert time.monotonic() - start < 15


def test_bootstrap_file_is_read_and_validated(tmp_path, bootstrap_peer):
    _proc, addr = bootstrap_peer
    (tmp_path / "bootstrap_peers.txt").write_text(f"# comment\n\n{addr}  # the local peer\n")
    out = run_cli("dht", "put", "from-file", "1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    (tmp_path / "bootstrap_peers.txt").write_text("/ip4/127.0.0.1/tcp/notaport\n")
    out = run_cli("dht", "get", "x", cwd=tmp_path)
    assert out.returncode == 2 and "bootstrap_peers.txt:1" in out.stderr


def test_shipped_bootstrap_file_parses_and_has_no_live_entries():
    from p2ptrain.cli.common import read_bootstrap_file

    assert read_bootstrap_file(Path(__file__).parent.parent / "bootstrap_peers.txt") == []
