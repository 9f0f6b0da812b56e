"""The paths a newcomer walks through the `p2ptrain` command: ordinary CLI conventions, output that
survives a pipe, a first peer that waits for company, and children that cannot be shadowed by the
working directory. Real subprocesses where a user would see the difference, bounded and cleaned up."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dht import Identity

# -P: a test below runs the command from a folder holding a p2ptrain/ directory, as the installed
# entry point would run there (its own sys.path[0] is its bin directory, never the working directory)
CLI = [sys.executable, "-P", "-m", "p2ptrain"]
ADDR = re.compile(r"/ip4/[\d.]+/tcp/\d+/p2p/12D3KooW[1-9A-HJ-NP-Za-km-z]{44}")

pytestmark = pytest.mark.timeout(180)


def run_cli(*args: str, timeout: float = 60, cwd: Path | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, **kw)


@pytest.fixture
def bootstrap_peer(tmp_path):
    """A `p2ptrain dht` peer in its own process; yields its multiaddr."""
    proc = subprocess.Popen([*CLI, "dht", "--listen", "/ip4/127.0.0.1/tcp/0"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=tmp_path)
    try:
        line = proc.stdout.readline().strip()
        assert ADDR.fullmatch(line), line
        yield line
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_options_anywhere_and_put_counts_only_the_swarms_peers(bootstrap_peer, tmp_path):
    """`dht put --bootstrap X KEY VALUE` parses (argparse alone stopped at the option), and the
    short-lived client that put the record is not among the peers that keep it: here one."""
    put = run_cli("dht", "put", "--bootstrap", bootstrap_peer, "greeting", "--ttl", "60", '"hi"', cwd=tmp_path)
    assert put.returncode == 0, put.stderr
    assert json.loads(put.stdout) == {"key": "greeting", "subkey": None, "stored_on_peers": 1}
    get = run_cli("dht", "get", "--bootstrap", bootstrap_peer, "greeting", cwd=tmp_path)
    assert get.returncode == 0 and json.loads(get.stdout)["value"] == "hi", get.stderr


@pytest.mark.parametrize("argv, needle", [
    (["peer", "--epoch", "3"], "p2ptrain peer: error: unrecognized option --epoch; did you mean --epochs?"),
    (["swarm", "--peer", "3"], "p2ptrain swarm: error: unrecognized option --peer; did you mean --peers?"),
    (["peer", "--epochz=3"], "unrecognized option --epochz; did you mean --epochs?"),
    (["ckpt", "ls", "--jsn"], "p2ptrain ckpt ls: error: unrecognized option --jsn; did you mean --json?"),
    (["dht", "get", "k", "--boot", "/ip4/1.2.3.4/tcp/1"], "unrecognized option --boot; did you mean --bootstrap?"),
    (["peer", "--epochs", "x"], "argument --epochs: invalid int value: 'x'"),
])
def test_no_abbreviations_and_one_line_did_you_mean(argv, needle, capsys):
    from p2ptrain.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert needle in err and "--help" in err, err


def test_swarm_checks_its_options_before_starting_any_peer(monkeypatch, capsys):
    from p2ptrain.cli import main, swarm_cmd

    def no_child(*_a, **_k):
        raise AssertionError("a peer was started")

    monkeypatch.setattr(swarm_cmd, "_Child", no_child)
    for argv, needle in ((["--epochs", "-3"], "--epochs must be at least 1"),
                         (["--mode", "diloco", "--outer-lr", "0"], "--outer-lr must be positive"),
                         (["--wait-peers", "-1"], "--wait-peers cannot be negative"),
                         (["--bandwidth", "0"], "--bandwidth must be a positive number")):
        assert main(["swarm", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err, err


def test_key_file_directories_are_created_private(tmp_path):
    """`--key-file ~/.p2ptrain/key` on a fresh machine: every command creates the missing folders (0700)."""
    from p2ptrain.cli import build_parser
    from p2ptrain.config import apply_config

    key = tmp_path / "home" / ".p2ptrain" / "peer.key"
    argv = ["peer", "--key-file", str(key)]
    apply_config(build_parser().parse_args(argv), build_parser, argv, {})
    assert key.parent.is_dir() and not key.exists()
    for d in (key.parent, key.parent.parent):
        assert d.stat().st_mode & 0o777 == 0o700 & ~_umask(), oct(d.stat().st_mode)

    key = tmp_path / "dht" / "keys" / "boot.key"
    proc = subprocess.Popen([*CLI, "dht", "--listen", "/ip4/127.0.0.1/tcp/0", "--key-file", str(key)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        line = proc.stdout.readline().strip()
        assert line.endswith(str(Identity.load(key).peer_id)), (line, proc.stderr.read() if not line else "")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    for d in (key.parent, key.parent.parent):
        assert d.stat().st_mode & 0o777 == 0o700 & ~_umask(), oct(d.stat().st_mode)

    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(4)}, str(tmp_path / "model.safetensors"))
    key = tmp_path / "ckpt" / "keys" / "writer.key"
    out = run_cli("ckpt", "save", "model.safetensors", "--run-id", "r", "--epoch", "1", "--key-file", str(key),
                  "--data-dir", str(tmp_path / "store"), cwd=tmp_path)
    assert out.returncode == 0 and key.exists(), out.stderr
    for d in (key.parent, key.parent.parent):
        assert d.stat().st_mode & 0o777 == 0o700 & ~_umask(), oct(d.stat().st_mode)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("argv", [
    ["peer", "--bootstrap-timeout", "3", "--no-peer-cache"],
    ["dht", "get", "k", "--timeout", "3", "--no-peer-cache"],
    ["status", "--timeout", "3"],
    ["ckpt", "get", "latest", "--run-id", "r", "--timeout", "3"],
])
def test_joining_shows_progress_while_bootstrap_peers_do_not_answer(argv, tmp_path):
    dead = f"/ip4/127.0.0.1/tcp/1/p2p/{Identity().peer_id}"
    out = run_cli(*argv, "--bootstrap", dead, cwd=tmp_path)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert lines[0] == f"joining through {dead}: no answer yet, retrying for up to 3 s", lines  # one line off a tty
    assert len(lines) == 2 and "could not reach any bootstrap peer" in lines[1], lines


def test_private_swarm_join_hint_names_the_swarm_key(tmp_path, monkeypatch, capsys):
    from dht import SwarmKey

    from p2ptrain.cli import build_parser
    from p2ptrain.cli.peer_cmd import _printer, join_flags
    from p2ptrain.config import apply_config

    monkeypatch.chdir(tmp_path)
    SwarmKey.generate().save("team.key")
    argv = ["peer", "--swarm-key-file", "team.key", "--example", "char_lm", "--threads", "1"]
    args = build_parser().parse_args(argv)
    apply_config(args, build_parser, argv, {})
    show = _printer(False, join_flags(args))
    addr = f"/ip4/10.0.0.1/tcp/4001/p2p/{Identity().peer_id}"
    other = addr.replace("10.0.0.1", "192.168.1.5")
    show({"event": "started", "peer_id": "P", "run_id": "r", "epoch": 0, "multiaddrs": [addr, other]})
    out = capsys.readouterr().out
    # the settings the run depends on and the key as the user named it; not this peer's own threads
    assert f"\n  p2ptrain peer --bootstrap {addr} --example char_lm --swarm-key-file team.key\n" in out, out
    assert out.endswith(f"\n  or with --bootstrap {other}\n"), out

    # `p2ptrain dht` (a bootstrap node) says so too, for the key named by the flag or the variable
    for argv, env in ((["--swarm-key-file", "team.key"], {}), ([], {"P2PTRAIN_SWARM_KEY_FILE": "team.key"})):
        proc = subprocess.Popen([*CLI, "dht", "--listen", "/ip4/127.0.0.1/tcp/0", *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=tmp_path, env={**os.environ, **env})
        try:
            assert ADDR.fullmatch(proc.stdout.readline().strip())
        finally:
            proc.terminate()
            err = proc.communicate(timeout=10)[1]
        assert "others can join with --bootstrap ADDRESS --swarm-key-file team.key, one of:" in err, err


def test_first_peer_waits_for_a_second_and_prints_how_to_join(tmp_path, child_pids):
    """A peer with no bootstrap starts a swarm: it waits (as long as it takes) for a second peer,
    printing the command to start one, then both train together and end with a readable line.
    Output off a terminal: no line is wrapped, so the address is whole."""
    before = child_pids()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen([*CLI, "peer", "--epochs", "3", "--threads", "1"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    joiner = None
    try:
        head = [first.stdout.readline() for _ in range(3)]
        assert head[0].startswith("peer 12D3KooW") and "others join with" in head[0], head
        command = shlex.split(head[1])
        assert command[:3] == ["p2ptrain", "peer", "--bootstrap"] and ADDR.fullmatch(command[3]), head
        assert command[4:] == ["--epochs", "3"], head  # what the run depends on; not --threads
        assert head[2].startswith("waiting for 1 more peer before training") and "--wait-peers 1" in head[2], head

        joiner = subprocess.Popen([*CLI, *command[1:], "--json", "--threads", "1"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
        events = [json.loads(line) for line in joiner.communicate(timeout=120)[0].splitlines()]
        assert joiner.returncode == 0 and events[-1]["event"] == "done", events[-3:]
        rest, err = first.communicate(timeout=60)
        assert first.returncode == 0, err[-2000:]
        done = [line for line in rest.splitlines() if line.startswith("done: ")]
        assert len(done) == 1 and re.search(r"  test loss [\d.]+ acc [\d.]+%$", done[0]), rest
        assert "{" not in rest, rest  # no raw Python dict
        assert "Traceback" not in err
    finally:
        for p in (first, joiner):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert child_pids() <= before


def test_who_waits_for_whom(tmp_path, monkeypatch):
    """The first peer of a new swarm waits for a second, as long as it takes; a joining or client
    peer does not; --wait-peers from a flag, a variable or the config file overrides both (60 s)."""
    from p2ptrain.cli import build_parser
    from p2ptrain.cli.peer_cmd import _config, join_flags
    from p2ptrain.config import apply_config

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("P2PTRAIN_BOOTSTRAP", raising=False)
    boot = f"/ip4/127.0.0.1/tcp/1/p2p/{Identity().peer_id}"
    (tmp_path / "run.toml").write_text("wait_peers = 3\n")
    for argv, env, expected in ((["peer"], {}, (2, None)),
                                (["peer", "--bootstrap", boot], {}, (0, 60.0)),
                                (["peer", "--client"], {}, (0, 60.0)),
                                (["peer", "--wait-peers", "1"], {}, (1, 60.0)),
                                (["peer"], {"P2PTRAIN_WAIT_PEERS": "1"}, (1, 60.0)),
                                (["peer", "--config", "run.toml"], {}, (3, 60.0)),
                                (["peer", "--config", "run.toml", "--bootstrap", boot], {}, (3, 60.0))):
        args = build_parser().parse_args(argv)
        apply_config(args, build_parser, argv, env)
        cfg = _config(args)
        assert (cfg.wait_peers, cfg.wait_timeout) == expected, (argv, env)
    # a declared bandwidth is each peer's own: it reaches the peer's config, never another peer's flags
    args = build_parser().parse_args(["peer", "--bandwidth", "0.5"])
    apply_config(args, build_parser, ["peer", "--bandwidth", "0.5"], {})
    assert _config(args).bandwidth == 0.5 and "--bandwidth" not in join_flags(args)


def test_first_peer_waiting_reports_and_stops_cleanly(tmp_path):
    """--json: a `waiting` event about once a second, no training meanwhile; Ctrl+C leaves at once."""
    proc = subprocess.Popen([*CLI, "peer", "--json", "--epochs", "2", "--threads", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        lines = [proc.stdout.readline() for _ in range(4)]
        assert all(lines), (lines, proc.poll() is not None and proc.stderr.read())
        events = [json.loads(line) for line in lines]
        assert [e["event"] for e in events] == ["started", "waiting", "waiting", "waiting"], events
        assert all(e["peers"] == 1 and e["want"] == 2 and e["timeout"] is None for e in events[1:])
        assert events[3]["seconds"] >= 1.5  # it waited, and did not train, for two seconds
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0 and time.monotonic() - t0 < 10, err
        assert '"done"' not in out and '"progress"' not in out and "left the swarm" in err and "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_swarm_from_a_folder_holding_a_p2ptrain_directory(tmp_path, child_pids):
    """The parent of a clone holds p2ptrain/: the peers a swarm starts still import the installed
    package. --json: one started event per peer, and the verdict as the last event."""
    before = child_pids()
    (tmp_path / "p2ptrain").mkdir()
    out = run_cli("swarm", "--peers", "2", "--epochs", "2", "--json", "--out", str(tmp_path / "out"), cwd=tmp_path,
                  timeout=170)
    assert out.returncode == 0, out.stderr[-2000:]
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert sorted(e["peer"] for e in events if e["event"] == "started") == [0, 1]
    assert events[-1]["event"] == "summary" and events[-1]["peers_done"] == 2, events[-1]
    assert events[-1]["same_parameters"] is True and events[-1]["distinct_states"] == 1
    assert len(events[-1]["saved"]) == 1
    assert child_pids() <= before


def test_demo_says_what_it_kills_and_keeps_addresses_whole(tmp_path):
    out = run_cli("demo", "--peers", "4", "--procs", "4", "--records", "5", "--kill-fraction", "0.3",
                  "--republish", "1", cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    row = [line for line in out.stderr.splitlines() if "SIGKILLed processes" in line]
    assert len(row) == 1 and "1 of 4 (25%)" in row[0], out.stderr
    assert ADDR.search(out.stderr), out.stderr  # the bootstrap peer's address, on one line
