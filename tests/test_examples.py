"""Examples are documentation: each must keep running and printing what it promises."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from dht import Host, Identity, Multiaddr

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_dht_kv_example_runs():
    out = subprocess.run([sys.executable, str(EXAMPLES / "dht_kv.py")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "bob reads demo/config: {'lr': 0.0003, 'batch': 32}" in out.stdout
    assert "members: ['alice', 'bob']" in out.stdout
    assert "bob cannot overwrite alice's entry" in out.stdout


def _events(stdout: str) -> list[dict]:
    import json

    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


async def _wildcard_hosts() -> list[str]:
    """The hosts a listener on every interface announces here."""
    host = Host(Identity(), ("0.0.0.0", 0))
    await host.start()
    try:
        return [a.host for a in host.listen_addrs]
    finally:
        await host.close()


def test_digits_example_trains_alone():
    out = subprocess.run([sys.executable, str(EXAMPLES / "digits_mlp.py"), "--json", "--epochs", "8"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    events = _events(out.stdout)
    assert events[0]["event"] == "started" and events[0]["addr"] == events[0]["addrs"][0]
    # p2ptrain.DHT() listens on every interface: the example shows each address others can dial
    assert [Multiaddr.parse(a).host for a in events[0]["addrs"]] == asyncio.run(_wildcard_hosts())
    done = events[-1]
    assert done["event"] == "done" and done["epoch"] == 8 and done["accuracy"] > 0.5


def test_digits_example_pair_averages(tmp_path):
    first = subprocess.Popen([sys.executable, str(EXAMPLES / "digits_mlp.py"), "--json", "--epochs", "15",
                              "--wait-peers", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        import json

        addr = json.loads(first.stdout.readline())["addr"]
        second = subprocess.run([sys.executable, str(EXAMPLES / "digits_mlp.py"), "--json", "--epochs", "15",
                                 "--wait-peers", "2", "--bootstrap", addr], capture_output=True, text=True, timeout=120)
        rest, err = first.communicate(timeout=60)
    finally:
        first.kill()
        first.wait()
    assert second.returncode == 0 and first.returncode == 0, (second.stderr, err)
    a, b = _events(rest)[-1], _events(second.stdout)[-1]
    assert a["event"] == b["event"] == "done"
    assert a["rounds"] > 0 and b["bytes_sent"] > 0


def test_char_lm_example_runs_an_outer_round():
    out = subprocess.run([sys.executable, str(EXAMPLES / "char_lm.py"), "--json", "--epochs", "1", "--local-steps", "4",
                          "--batch-size", "8", "--threads", "1"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    events = _events(out.stdout)
    rounds = [e for e in events if e["event"] == "round"]
    assert rounds and rounds[0]["epoch"] == 1 and rounds[0]["perplexity"] > 1
    assert events[-1]["event"] == "done" and isinstance(events[-1]["sample"], str)
