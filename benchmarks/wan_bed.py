"""The test bed's WAN links: throughput and RTT under load through the delay line, C vs Python.

    python benchmarks/wan_bed.py                     # 8 hosts, 100mbit, 25 ms one way (50 ms RTT)
    python benchmarks/wan_bed.py --rate 1gbit --hosts 4

Root only, on a kernel without netem (where the delay line is used). Hosts 0..N-1 each send bulk TCP
to the next one (a ring: every link full both ways, N x RATE through the delay line); two more hosts
ping-pong 64-byte messages over TCP before and during the load, on links of their own, so their RTT
is the delay line's (queueing in the loaded links' tbf is not in it). Both delay lines run in the
same invocation: this checkout's C program and the Python loop of commit ``PY_COMMIT`` (the one it
replaced), started in its place. Prints per line: goodput per link (Mbit/s, median / min), the
aggregate vs N x RATE, the delay line's CPU share, RTT idle and under load (median / p99).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from p2ptrain.testing import Testbed, delayline  # noqa: E402
from p2ptrain.testing.linkspec import parse_rate, parse_time  # noqa: E402

PY_COMMIT = "6358d5d"  # the last commit with the Python delay line

_SINK = r"""
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 7000)); s.listen(1); print("listening", flush=True)
c, _ = s.accept(); buf = bytearray(1 << 20); n = 0; t0 = None; skip = float(sys.argv[2])
while k := c.recv_into(buf):
    now = time.monotonic()
    if t0 is None: t0 = now
    if now - t0 >= skip: n += k
    last = now
print(n * 8 / max(1e-9, last - t0 - skip) / 1e6, flush=True)
"""
_SOURCE = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], 7000), timeout=20); data = bytes(1 << 16)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end: c.sendall(data)
c.close()
"""
_ECHO = r"""
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 7001)); s.listen(1); print("listening", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while m := c.recv(64): c.sendall(m)
"""
_PING = r"""
import json, socket, sys, time
c = socket.create_connection((sys.argv[1], 7001), timeout=20); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(int(sys.argv[2])):
    t = time.perf_counter(); c.sendall(bytes(64)); got = 0
    while got < 64: got += len(c.recv(64 - got))
    rtts.append(time.perf_counter() - t); time.sleep(0.02)
print(json.dumps(rtts), flush=True)
"""


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pings(tb: Testbed, n: int) -> list[float]:
    a, b = tb.n_hosts - 2, tb.n_hosts - 1
    echo = tb.popen(a, [sys.executable, "-c", _ECHO, tb.hosts[a].ip], stdout=subprocess.PIPE, text=True)
    assert echo.stdout.readline().strip() == "listening"
    out = tb.run(b, [sys.executable, "-c", _PING, tb.hosts[a].ip, str(n)], capture_output=True, text=True,
                 timeout=120, check=True).stdout
    echo.wait(timeout=10)
    return json.loads(out)


def measure(a: argparse.Namespace) -> dict:
    n = a.hosts
    with Testbed(n + 2, rate=a.rate, delay=a.delay) as tb:
        assert tb.delay_line is not None, "this kernel has netem: the delay line is not used"
        idle = _pings(tb, 20)
        sinks = [tb.popen((i + 1) % n, [sys.executable, "-c", _SINK, tb.hosts[(i + 1) % n].ip, "1.0"],
                          stdout=subprocess.PIPE, text=True) for i in range(n)]
        for s in sinks:
            assert s.stdout.readline().strip() == "listening"
        cpu0, t0 = _cpu(tb.delay_line.pid), time.monotonic()
        sources = [tb.popen(i, [sys.executable, "-c", _SOURCE, tb.hosts[(i + 1) % n].ip, str(a.seconds)])
                   for i in range(n)]
        time.sleep(1.0)  # slow start over: ping during the steady part
        loaded = _pings(tb, int((a.seconds - 1.5) / 0.07))
        for p in sources:
            p.wait(timeout=a.seconds + 30)
        cpu = (_cpu(tb.delay_line.pid) - cpu0) / (time.monotonic() - t0)
        mbits = [float(s.communicate(timeout=30)[0]) for s in sinks]
    return {"mbits": mbits, "cpu": cpu, "idle": idle, "loaded": loaded}


def _python_delay_line(tmp: str) -> str:
    """An executable that runs the Python delay line of PY_COMMIT with the C program's arguments."""
    src = subprocess.run(["git", "show", f"{PY_COMMIT}:p2ptrain/testing/delayline.py"], check=True,
                         capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout
    script = os.path.join(tmp, "delayline_py.py")
    with open(script, "w") as f:
        f.write(src)
    wrapper = os.path.join(tmp, "delayline_py")
    with open(wrapper, "w") as f:
        # at the C program's real-time priority, so that only the per-frame cost differs
        f.write(f'#!/bin/sh\nexec chrt -f 10 {sys.executable} -P {script} "$@"\n')
    os.chmod(wrapper, 0o755)
    return wrapper


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.1f} / {sorted(xs)[int(0.99 * (len(xs) - 1))] * 1e3:.1f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--delay", default="25ms", help="one way")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--only", choices=["c", "python"])
    a = ap.parse_args()
    rate = parse_rate(a.rate) / 1e6
    print(f"{a.hosts} hosts in a ring, {a.rate} per link, {parse_time(a.delay) * 2e3:g} ms RTT, {a.seconds:g} s; "
          f"load {os.getloadavg()[0]:.1f}")
    print("delay line | Mbit/s per link med / min | aggregate vs N x rate | delay line CPU | "
          "RTT idle med / p99 | RTT loaded med / p99")
    with tempfile.TemporaryDirectory() as tmp:
        c_binary = delayline.binary
        for name, program in [("c", c_binary), ("python", lambda: _python_delay_line(tmp))]:
            if a.only and name != a.only:
                continue
            delayline.binary = program
            try:
                r = measure(a)
            finally:
                delayline.binary = c_binary
            print(f"{name:10} | {statistics.median(r['mbits']):.1f} / {min(r['mbits']):.1f} | "
                  f"{sum(r['mbits']) / (a.hosts * rate):.3f} | {r['cpu'] * 100:.0f}% | "
                  f"{_ms(r['idle'])} | {_ms(r['loaded'])}", flush=True)


if __name__ == "__main__":
    main()
