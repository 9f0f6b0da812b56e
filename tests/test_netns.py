"""p2ptrain.testing: namespaces that talk over TCP, links that enforce their rate (and delay/loss
where the kernel can), and a cleanup that leaves nothing behind, also after an interrupted build.

Skipped with the reason where network namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from p2ptrain.testing import Testbed, TestbedError, available, delayline, features
from p2ptrain.testing.linkspec import parse_loss, parse_rate, parse_time

_OK, _WHY = available()
needs_netns = pytest.mark.skipif(not _OK, reason=f"no network namespaces here: {_WHY}")

# A TCP server: accept one connection, read until EOF, answer the byte count, exit.
_SERVER = r"""
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 7000)); s.listen(1)
print("listening", flush=True)
c, _ = s.accept(); buf = bytearray(1 << 20); n = 0
while k := c.recv_into(buf):
    n += k
c.sendall(str(n).encode()); c.close()
"""

# A TCP client: time connect() (one RTT) and sending N bytes until the server confirms them all.
_CLIENT = r"""
import json, socket, sys, time
t0 = time.perf_counter(); c = socket.create_connection((sys.argv[1], 7000), timeout=10)
t1 = time.perf_counter(); n = int(sys.argv[2]); data = bytes(1 << 16); sent = 0
while sent < n:
    sent += c.send(data[: n - sent])
c.shutdown(socket.SHUT_WR); got = int(c.recv(64))
print(json.dumps({"connect": t1 - t0, "transfer": time.perf_counter() - t1, "got": got}))
"""

# UDP: host 1 sends numbered datagrams, host 0 counts what arrives (no GSO: one packet each).
_UDP_SINK = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], 7001)); s.settimeout(20)
print("listening", flush=True); n = 0
try:
    while True:
        s.recv(64); n += 1; s.settimeout(1.0)  # the source may start slowly on a loaded box; then 1 s idle ends
except socket.timeout:
    print(n, flush=True)
"""
_UDP_SOURCE = r"""
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(int(sys.argv[2])):
    s.sendto(b"x", (sys.argv[1], 7001))
    if i % 50 == 0:
        time.sleep(0.001)
"""


def _ours(prefix: str) -> tuple[list[str], list[str]]:
    """Namespaces, and root-namespace links, that mention ``prefix``: both must be empty after close."""
    ns = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout.split("\n")
    links = subprocess.run(["ip", "-o", "link"], check=True, capture_output=True, text=True).stdout.split("\n")
    return [n for n in ns if prefix in n], [ln for ln in links if prefix in ln]


def _tcp(tb: Testbed, nbytes: int) -> dict:
    srv = tb.popen(0, [sys.executable, "-c", _SERVER, tb.hosts[0].ip], stdout=subprocess.PIPE, text=True)
    assert srv.stdout.readline().strip() == "listening"
    cli = tb.popen(1, [sys.executable, "-c", _CLIENT, tb.hosts[0].ip, str(nbytes)], stdout=subprocess.PIPE, text=True)
    out, _ = cli.communicate(timeout=30)
    assert cli.returncode == 0 and srv.wait(timeout=10) == 0
    return json.loads(out)


def test_parsing() -> None:
    assert parse_rate("1gbit") == 1e9 and parse_rate("100mbit") == 1e8 and parse_rate("1mbps") == 8e6
    assert parse_time("1ms") == pytest.approx(1e-3) and parse_time("250us") == pytest.approx(2.5e-4)
    assert parse_time(0.5) == 0.5 and parse_loss("1%") == pytest.approx(0.01) and parse_loss(0.2) == 0.2
    for bad in (lambda: parse_rate("fast"), lambda: parse_rate("1gbyte"), lambda: parse_time("1 hour"),
                lambda: parse_loss("100%"), lambda: Testbed(0), lambda: Testbed(2, prefix="no spaces")):
        with pytest.raises(TestbedError):
            bad()


def test_not_root_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(TestbedError, match=r"need root .*uid 1000") as err:
        Testbed(2)
    assert "\n" not in str(err.value)


@needs_netns
def test_tcp_between_namespaces_at_the_configured_rate() -> None:
    with Testbed(2, rate="100mbit") as tb:
        assert tb.hosts[0].ip != tb.hosts[1].ip and tb.hosts[0].ns != tb.hosts[1].ns
        r = _tcp(tb, 4 << 20)
        assert r["got"] == 4 << 20
        # 4 MiB at 100 Mbit/s: 0.34 s on the wire (0.35 s of goodput); the 16 KiB burst cannot skip it
        assert r["transfer"] >= 0.25, r
        assert r["transfer"] < 5, r  # enforced, not throttled to a crawl (a loaded box gets slack)
        prefix = tb.prefix
    assert _ours(prefix) == ([], [])


@needs_netns
@pytest.mark.parametrize("rate", [None, "100mbit"])
def test_delay_adds_rtt(rate: str | None) -> None:
    """netem's delay, or without netem the userspace delay line: the TCP handshake (one RTT)
    takes 2 x 25 ms longer, and bulk data still arrives whole."""
    with Testbed(2, rate=rate) as tb:
        base = _tcp(tb, 1)["connect"]
    with Testbed(2, rate=rate, delay="25ms") as tb:
        assert (tb.delay_line is None) == features()["netem"]
        r = _tcp(tb, 2 << 20)
        delayed = r["connect"]
        assert r["got"] == 2 << 20
        prefix = tb.prefix
    assert delayed >= 0.045 and delayed - base >= 0.04, (base, delayed)  # RTT = 2 x 25 ms
    assert _ours(prefix) == ([], [])


@needs_netns
def test_loss_drops_about_that_share() -> None:
    """With netem, netem's loss; without it, the classic-BPF fallback. 20% of 2000 datagrams."""
    with Testbed(2, rate=None, loss="20%") as tb:
        sink = tb.popen(0, [sys.executable, "-c", _UDP_SINK, tb.hosts[0].ip], stdout=subprocess.PIPE, text=True)
        assert sink.stdout.readline().strip() == "listening"
        tb.run(1, [sys.executable, "-c", _UDP_SOURCE, tb.hosts[0].ip, "2000"], check=True, timeout=30)
        got = int(sink.stdout.readline())
    assert 1400 <= got <= 1800, got  # 1600 expected; binomial sd ~18


@needs_netns
def test_close_kills_processes_and_removes_everything() -> None:
    tb = Testbed(3, rate="1gbit")
    prefix = tb.prefix
    assert len(_ours(prefix)[0]) == 4  # three hosts and the switch
    tracked = tb.popen(1, ["sleep", "60"])
    untracked = subprocess.Popen(tb.exec_argv(2, ["sleep", "60"]))  # not tracked: killed with its namespace
    time.sleep(0.1)
    t0 = time.monotonic()
    tb.close()
    assert time.monotonic() - t0 < 5
    assert tracked.poll() is not None and untracked.wait(timeout=5) is not None
    assert _ours(prefix) == ([], [])
    tb.close()  # idempotent
    with pytest.raises(TestbedError, match="closed"):
        tb.popen(0, ["true"])


@needs_netns
def test_interrupted_build_and_body_leave_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RuntimeError, match="boom"), Testbed(2, rate="1gbit") as tb:
        prefix = tb.prefix
        raise RuntimeError("boom")
    assert _ours(prefix) == ([], [])

    calls = []

    def shape(self: Testbed, host: object, port: str) -> None:
        calls.append(port)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl+C halfway through building the second host

    monkeypatch.setattr(Testbed, "_shape", shape)
    prefix = f"p2pt-{os.getpid()}-intr-"
    with pytest.raises(KeyboardInterrupt):
        Testbed(3, rate="1gbit", prefix=prefix)
    assert calls == ["p0", "p1"]
    assert _ours(prefix) == ([], [])


def test_delay_line_without_a_compiler_is_one_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The delay line is compiled on first use: with no compiler, the error says what to install."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(delayline.shutil, "which", lambda name: None)
    with pytest.raises(delayline.DelayLineUnavailable, match="needs a C compiler.*install gcc"):
        delayline.binary()
    assert not list(tmp_path.rglob("delayline-*"))


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_delay_line_builds_once_and_is_cached(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = delayline.binary()
    assert os.access(first, os.X_OK) and first.startswith(str(tmp_path))
    monkeypatch.setattr(delayline.subprocess, "run", None)  # a second call must not compile again
    assert delayline.binary() == first
