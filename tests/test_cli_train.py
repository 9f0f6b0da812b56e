"""The training commands driven as a person drives them: ``p2ptrain peer`` and ``p2ptrain swarm``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

CLI = [sys.executable, "-m", "p2ptrain"]

pytestmark = pytest.mark.timeout(180)


def test_help_mentions_the_training_commands():
    out = subprocess.run([*CLI, "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "peer" in out.stdout and "swarm" in out.stdout
    for cmd in ("peer", "swarm"):
        out = subprocess.run([*CLI, cmd, "--help"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and "--example" in out.stdout and "--epochs" in out.stdout


def test_compression_choices_are_the_codecs():
    """The CLI restates the codec names (importing them would import torch for every --help)."""
    from p2ptrain.cli.peer_cmd import COMPRESSION_CHOICES
    from p2ptrain.compression import CODECS

    assert COMPRESSION_CHOICES == list(CODECS)


@pytest.mark.parametrize("args, needle", [
    (["peer", "--epochs", "0"], "--epochs must be at least 1"),
    (["peer", "--bootstrap", "/ip4/1.2.3/tcp/1"], "1.2.3"),
    (["peer", "--listen", "/dns4/example.com/tcp/1"], "listen on an IP address"),
    (["peer", "--threads", "0"], "--threads"),
    (["peer", "--inner-warmup-steps", "10"], "--inner-warmup-steps is for --mode diloco"),
    (["peer", "--mode", "diloco", "--outer-momentum", "1"], "--outer-momentum in [0, 1)"),
    (["swarm", "--peers", "0"], "--peers"),
    (["peer", "--device", "tpu"], "not a device name"),
    (["peer", "--bootstrap-timeout", "0"], "--bootstrap-timeout"),
    (["peer", "--device", "cuda:9"], "cuda:9"),
    (["peer", "--run-id", "a/b"], "--run-id"),
])
def test_bad_config_is_one_line_error(args, needle):
    out = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert needle in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_unreachable_bootstrap_is_one_line_error():
    t0 = time.monotonic()
    out = subprocess.run([*CLI, "peer", "--bootstrap-timeout", "2", "--bootstrap",
                          "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWBtg3aaGc3bB8PxW4hbMHHzqDtdqdyiAMtoWDjuhzZAXv"],
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 1
    assert "bootstrap" in out.stderr and "Traceback" not in out.stderr
    assert time.monotonic() - t0 < 9  # gave up after its 2 s, not the default 10 s


def test_swarm_trains_and_writes_the_model(tmp_path, child_pids):
    before = child_pids()
    out = subprocess.run([*CLI, "swarm", "--peers", "2", "--epochs", "12", "--json", "--out", str(tmp_path), "-vv"],
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-2000:]
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    done = [e for e in events if e["event"] == "done"]
    assert sorted(e["peer"] for e in done) == [0, 1]
    assert all(e["epoch"] == 12 and e["rounds"] > 0 for e in done)
    for i in (0, 1):  # each peer's log, at the -vv the launcher was given
        assert "DEBUG p2ptrain.optim: epoch 12: averaged with 2 peers" in \
            (tmp_path / "logs" / f"peer-{i}.log").read_text()
    model = tmp_path / "digits-model.safetensors"
    assert model.exists() and model.stat().st_size > 10_000
    umask = os.umask(0)
    os.umask(umask)
    assert model.stat().st_mode & 0o777 == 0o666 & ~umask  # an ordinary file, not a private temp file
    from safetensors.torch import load_file

    assert any(k.endswith("weight") for k in load_file(str(model)))
    assert child_pids() <= before


def test_swarm_saves_one_model_and_keeps_checkpoints_where_ckpt_looks(tmp_path, child_pids):
    """--save: one file, written by one peer, printed once. --checkpoint-every: the checkpoints go
    to the default store, the one `p2ptrain ckpt` reads without flags, and the newest exports
    into a file that the example's model loads (strict) and that computes what the saved model does."""
    from safetensors.torch import load_file

    from p2ptrain.tasks import get_task

    before = child_pids()
    env = {k: v for k, v in os.environ.items() if k != "P2PTRAIN_DATA_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # the default store: $XDG_CACHE_HOME/p2ptrain
    saved = tmp_path / "final.safetensors"
    out = subprocess.run([*CLI, "swarm", "--peers", "2", "--epochs", "4", "--checkpoint-every", "2", "--save",
                          str(saved), "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=170,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("trained model:") == 1 and str(saved) in out.stdout, out.stdout[-2000:]
    store = tmp_path / "cache" / "p2ptrain"
    assert f"checkpoints go to {store}" in out.stdout
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".safetensors")) == ["final.safetensors"]

    listed = subprocess.run([*CLI, "ckpt", "ls", "--json"], capture_output=True, text=True, timeout=60, env=env)
    assert listed.returncode == 0, listed.stderr
    checkpoints = json.loads(listed.stdout)
    assert checkpoints and checkpoints[0]["epoch"] == 4, checkpoints
    assert len({c["cid"] for c in checkpoints}) == len(checkpoints)  # each checkpoint once, with its writers

    exported = tmp_path / "exported.safetensors"
    run = subprocess.run([*CLI, "ckpt", "export", checkpoints[0]["cid"], str(exported)], capture_output=True,
                         text=True, timeout=60, env=env)
    assert run.returncode == 0 and "note" not in run.stderr, run.stderr
    task = get_task("digits")
    from_ckpt, from_save = task.make_model(seed=1), task.make_model(seed=2)
    from_ckpt.load_state_dict(load_file(str(exported)), strict=True)
    from_save.load_state_dict(load_file(str(saved)), strict=True)
    x, _ = next(task.batches(16, seed=0))
    with torch.no_grad():
        assert torch.equal(from_ckpt.eval()(x), from_save.eval()(x))
    assert child_pids() <= before


def test_swarm_stops_cleanly_on_sigint(tmp_path, child_pids):
    before = child_pids()
    proc = subprocess.Popen([*CLI, "swarm", "--peers", "2", "--epochs", "100000", "--compute-delay", "0.01",
                             "--json", "--out", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if '"progress"' in line:
                break
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-2000:]
        assert time.monotonic() - t0 < 30
        assert "Traceback" not in err
        assert sum('"done"' in line for line in rest.splitlines()) == 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert child_pids() <= before  # the launcher waited for every peer before exiting


def test_peer_runs_a_users_script_with_the_bootstrap_peers(tmp_path):
    boot = subprocess.Popen([*CLI, "dht", "run", "--listen", "/ip4/127.0.0.1/tcp/0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        addr = boot.stdout.readline().strip()
        script = tmp_path / "train.py"
        script.write_text(
            "import sys, p2ptrain\n"
            "dht = p2ptrain.DHT()  # joins the swarm p2ptrain peer was pointed at\n"
            "print('args', sys.argv[1:], 'routing', len(dht.node.routing))\n"
            "dht.close()\n"
            "sys.exit(3 if '--fail' in sys.argv else 0)\n")
        out = subprocess.run([*CLI, "peer", "--bootstrap", addr, "--script", str(script), "--script-args=--lr 0.1"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "args ['--lr', '0.1'] routing 1" in out.stdout
        failing = subprocess.run([*CLI, "peer", "--bootstrap", addr, "--script", str(script), "--script-args=--fail"],
                                 capture_output=True, text=True, timeout=60)
        assert failing.returncode == 3
        missing = subprocess.run([*CLI, "peer", "--script", str(tmp_path / "nope.py")], capture_output=True, text=True,
                                 timeout=60)
        assert missing.returncode == 2 and "no such file" in missing.stderr and "Traceback" not in missing.stderr
    finally:
        boot.kill()
        boot.wait()


def test_client_mode_peer_trains_with_a_listening_one():
    """``--client`` (behind NAT: no inbound connections) still averages in a group with a normal peer.

    The listening peer trains 3 epochs longer: with equal counts, a client delayed by one round
    (state download, a loaded machine) did its last epoch alone after the other had left."""
    server = subprocess.Popen([*CLI, "peer", "--json", "--epochs", "9", "--wait-peers", "2"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        started = json.loads(server.stdout.readline())
        assert started["event"] == "started" and started["multiaddrs"]
        client = subprocess.run([*CLI, "peer", "--json", "--client", "--epochs", "6", "--bootstrap",
                                 started["multiaddrs"][0]], capture_output=True, text=True, timeout=120)
        assert client.returncode == 0, client.stderr
        events = [json.loads(line) for line in client.stdout.splitlines()]
        assert events[0]["event"] == "started" and events[0]["multiaddrs"] == []  # listens nowhere
        done = events[-1]
        assert (done["event"] == "done" and done["epoch"] == 6 and done["group_size"] == 2
                and done["failed_rounds"] == 0), events[-8:]
        assert server.wait(timeout=60) == 0
    finally:
        server.kill()
        server.wait()


def test_started_line_without_a_listening_address(capsys):
    """A client-mode peer (no address) or one behind NAT (only relay circuit addresses) prints no
    bogus join hint, and says which it is."""
    from p2ptrain.cli.peer_cmd import _printer

    show = _printer(False)
    circuit = "/ip4/1.2.3.4/tcp/1/p2p/R/p2p-circuit/p2p/P"
    for addrs in ([], [circuit]):
        show({"event": "started", "peer_id": "P", "run_id": "r", "epoch": 0, "multiaddrs": addrs})
        out = capsys.readouterr().out
        assert ("behind NAT" if addrs else "client mode") in out and "--bootstrap" not in out
        assert (f"reachable through a relay at {circuit}" in out) == bool(addrs)
    show({"event": "started", "peer_id": "P", "run_id": "r", "epoch": 0,
          "multiaddrs": [circuit, "/ip4/1.2.3.4/tcp/1/p2p/P"]})
    assert "--bootstrap /ip4/1.2.3.4/tcp/1/p2p/P\n" in capsys.readouterr().out


def test_peer_asked_to_stop_while_joining_does_not_start():
    """Ctrl+C during the join (e.g. the state download): no ``started`` event, no training."""
    import threading

    from p2ptrain.run import PeerConfig, run_peer

    stop = threading.Event()
    stop.set()
    events: list[dict] = []
    done = run_peer(PeerConfig(task="digits", epochs=3), events.append, stop)
    assert done["event"] == "stopped" and done["stopped"] and done["epoch"] == 0
    assert [e["event"] for e in events] == []
