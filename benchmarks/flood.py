"""A training swarm while an attacker floods one peer with connections: does the victim keep training?

    python benchmarks/flood.py                                  # all modes, 30 epochs each
    python benchmarks/flood.py --modes none,connect --epochs 20

Each row trains the digits example with 3 ``p2ptrain peer --json`` processes on 127.0.0.1 (peer 0,
the bootstrap peer everyone talks to, is the victim). Once the victim reports progress, an attacker
process starts (from source address 127.0.0.2, so a per-IP limit can tell it from the peers):

* ``none``: no attacker (the baseline, run in the same invocation);
* ``cpu``: an attacker that only burns one core (the control: what an attacker's CPU alone costs
  the victim on this 2-core box, network defences or not);
* ``connect``: ``--sockets`` TCP connections held open that never send a byte, each reopened as
  soon as the victim closes it (the victim's handshake deadline, or its connection cap);
* ``stall``: the same, but each sends a valid first Noise handshake message (the victim answers
  with its DH and signature work) and then never the third;
* ``rpc``: ``--rpc-conns`` completed handshakes (a fresh identity each) spamming ``find_node`` calls,
  64 in flight per connection (the per-connection cap), as fast as answers come.
* ``streams``: ``--rpc-conns`` completed handshakes, each opening as many all-reduce streams as the
  victim accepts (64 tried), headed for rounds that never start (the victim's service holds such a
  stream up to its accept wait, unread), and filling each one's flow-control window with junk;
  every stream the victim resets is opened again. What a peer can make another hold in memory.
* ``tiny``: the same all-reduce streams, but each window sent as 1-byte data frames (hostile mode
  ``tiny_frames``): each cost the victim a ~300-byte chunk object before frames were coalesced.
* ``zombie``: the victim runs ``--relay``; ``--rpc-conns`` identities each open 16 relay hop streams
  that the relay refuses (its handler answers and returns) and fill each one's window without
  ever ending it (hostile mode ``zombie_streams``), then hold them: a returned handler's stream
  stayed open, its data queued, and kept the connection busy until the victim's streams were
  reset after their handler.
* ``bomb``: ``--rpc-conns`` identities, 4 calls in flight each, of ``find_node`` with a 1 MiB
  body of empty maps (hostile mode ``msgpack_bomb``: it decoded to ~72 MiB of objects).

Per row: the victim's local samples/s over the attack window (its progress events from the
attacker's first report on: the attacker's imports take seconds on a loaded box), the ratio to
``none``, how long the swarm took to finish, the victim's RSS (MB, at attack start and the max) and
open fds (max), and what the attacker got done (connections opened / answered RPCs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _procs import Children, loadavg, rss_mb, sigterm_as_exit  # noqa: E402

ATTACKER_IP = "127.0.0.2"


# ----------------------------------------------------------------------------- attacker


def _raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


class _Counts:
    def __init__(self) -> None:
        self.opened = self.closed_by_victim = self.refused = self.rpcs = self.rpc_errors = 0
        self.streams = self.stream_resets = self.junk_mb = self.frames = 0


async def _hold(host: str, port: int, counts: _Counts, first: Callable[[], bytes] | None, stop: asyncio.Event) -> None:
    """One socket slot: connect, optionally send ``first()``, hold until the victim closes; repeat."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        closed = loop.create_future()

        class Hold(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                if first is not None:
                    transport.write(first())  # type: ignore[attr-defined]

            def data_received(self, data: bytes) -> None:
                pass  # the victim's handshake answer: ignored, never answered

            def connection_lost(self, exc: Exception | None) -> None:
                if not closed.done():
                    closed.set_result(None)

        try:
            transport, _ = await loop.create_connection(Hold, host, port, local_addr=(ATTACKER_IP, 0))
        except OSError:
            counts.refused += 1
            await asyncio.sleep(0.01)
            continue
        counts.opened += 1
        try:
            await asyncio.wait({closed, loop.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if closed.done():
                counts.closed_by_victim += 1
            transport.close()


def _msg1_factory() -> Callable[[], bytes]:
    """A valid first XX handshake message (fresh ephemeral key each time), length-prefixed."""
    from dht.identity import Identity
    from dht.noise import StaticKey, XXHandshake
    from dht.connection import DEFAULT_PROLOGUE
    from dht.mux import _HS_LEN

    ident = Identity()
    static = StaticKey(ident)

    def make() -> bytes:
        hs = XXHandshake(ident, True, prologue=DEFAULT_PROLOGUE, local_payload={"port": None}, static=static)
        msg = hs.write_message()
        return _HS_LEN.pack(len(msg)) + msg

    return make


async def _as_fresh_peers(host: str, port: int, peer: str, counts: _Counts, stop: asyncio.Event, lanes: int,
                          lane: Callable[[Any], Awaitable[None]]) -> None:
    """Until ``stop``: a fresh identity completes a handshake with the victim and runs ``lanes``
    concurrent ``lane(conn)`` loops on that connection; when the victim drops it, start over."""
    from dht.identity import Identity, PeerID
    from dht.transport import Host

    while not stop.is_set():
        h = Host(Identity(), None)
        await h.start()
        try:
            conn = await h.connect(host, port, PeerID.from_base58(peer), timeout=10)
            counts.opened += 1
            await asyncio.gather(*(lane(conn) for _ in range(lanes)))
        except Exception:
            counts.refused += 1
            await asyncio.sleep(0.1)
        finally:
            await h.close()


async def _spam(host: str, port: int, peer: str, counts: _Counts, stop: asyncio.Event, inflight: int) -> None:
    """Fresh identities, each with ``inflight`` concurrent find_node loops."""

    async def loop_calls(conn) -> None:  # type: ignore[no-untyped-def]
        while not stop.is_set() and not conn.is_closed:
            try:
                await conn.call("find_node", os.urandom(32), timeout=10)
                counts.rpcs += 1
            except Exception:
                counts.rpc_errors += 1
                if conn.is_closed:
                    return

    await _as_fresh_peers(host, port, peer, counts, stop, inflight, loop_calls)


async def _tiny_streams(host: str, port: int, peer: str, counts: _Counts, stop: asyncio.Event, per_conn: int) -> None:
    """Fresh identities, each with ``per_conn`` stream slots: open an all-reduce stream for a
    made-up group and send its window as 1-byte frames, 4096 at a time; reopen when reset."""
    from p2ptrain.averaging.protocol import PROTOCOL
    from p2ptrain.testing.hostile.streams import send_tiny

    async def slot(conn) -> None:  # type: ignore[no-untyped-def]
        while not stop.is_set() and not conn.is_closed:
            try:
                stream = await conn.open_stream(PROTOCOL, {"g": os.urandom(16)})
                counts.streams += 1
                for _ in range(conn.remote_window // 4096):
                    await send_tiny(conn, stream, 4096)
                    counts.frames += 4096
                await stream.read(timeout=60)
            except Exception:
                counts.stream_resets += 1
                await asyncio.sleep(0.05)

    await _as_fresh_peers(host, port, peer, counts, stop, per_conn, slot)


async def _zombies(host: str, port: int, peer: str, counts: _Counts, stop: asyncio.Event, per_conn: int) -> None:
    """Fresh identities, each with ``per_conn`` slots: open a relay hop stream to a peer with no
    reservation (refused: the relay's handler answers and returns), fill its window, never end
    it; hold it while the victim keeps it, else open another."""
    from dht.identity import Identity
    from dht.relay import HOP_PROTOCOL
    from p2ptrain.testing.hostile.streams import zombie_streams

    async def slot(conn) -> None:  # type: ignore[no-untyped-def]
        while not stop.is_set() and not conn.is_closed:
            try:
                window = conn.remote_window
                sent = await zombie_streams(conn, HOP_PROTOCOL, {"peer": Identity().peer_id.to_bytes()}, streams=1,
                                            data=window, piece=1 << 20)
                counts.streams += 1
                counts.junk_mb += sent >> 20
                if sent >= window:  # all of it taken: the victim holds it; so do we
                    await stop.wait()
                counts.stream_resets += 1
                await asyncio.sleep(0.05)
            except Exception:
                counts.stream_resets += 1
                await asyncio.sleep(0.05)

    await _as_fresh_peers(host, port, peer, counts, stop, per_conn, slot)


async def _bombs(host: str, port: int, peer: str, counts: _Counts, stop: asyncio.Event, inflight: int) -> None:
    """Fresh identities, each with ``inflight`` loops calling find_node with a 1 MiB msgpack bomb."""
    from dht import PeerUnreachable
    from p2ptrain.testing.hostile.streams import msgpack_bomb

    async def loop_calls(conn) -> None:  # type: ignore[no-untyped-def]
        while not stop.is_set() and not conn.is_closed:
            try:
                await msgpack_bomb(conn, "find_node", timeout=30)
                counts.rpcs += 1
            except PeerUnreachable:  # dropped (a closing socket raises before any await: no retry)
                counts.rpc_errors += 1
                return
            except Exception:
                counts.rpc_errors += 1

    await _as_fresh_peers(host, port, peer, counts, stop, inflight, loop_calls)


async def _fill_streams(host: str, port: int, peer: str, counts: _Counts, stop: asyncio.Event, per_conn: int) -> None:
    """Fresh identities, each with ``per_conn`` stream slots: open an all-reduce stream for a
    made-up group, write a window of junk, wait for the victim's reset, repeat."""
    from p2ptrain.averaging.protocol import PROTOCOL

    junk = os.urandom(1 << 20)

    async def slot(conn) -> None:  # type: ignore[no-untyped-def]
        while not stop.is_set() and not conn.is_closed:
            try:
                stream = await conn.open_stream(PROTOCOL, {"g": os.urandom(16)})
                counts.streams += 1
                for _ in range(conn.remote_window // len(junk)):
                    await stream.write(junk, timeout=30)
                    counts.junk_mb += 1
                await stream.read(timeout=60)  # until the victim gives up on it
            except Exception:
                counts.stream_resets += 1
                await asyncio.sleep(0.05)

    await _as_fresh_peers(host, port, peer, counts, stop, per_conn, slot)


#: the attacks of issue 27 item 6/9 (hostile modes): mode -> (attack, lanes per connection)
_STREAM_ATTACKS = {"tiny": (_tiny_streams, 16), "zombie": (_zombies, 16), "bomb": (_bombs, 4)}


def _from_attacker(orig: Callable) -> Callable:
    """``loop.create_connection`` dialing from the attacker's address (a Host dials from the default one)."""

    def create_connection(*a, **kw):  # type: ignore[no-untyped-def]
        kw.setdefault("local_addr", (ATTACKER_IP, 0))
        return orig(*a, **kw)

    return create_connection


async def _attack(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(sys.stdin.fileno(), lambda: stop.set() if not os.read(sys.stdin.fileno(), 1) else None)
    counts = _Counts()
    host, port = args.target.rsplit(":", 1)
    if args.mode == "rpc":
        loop.create_connection = _from_attacker(loop.create_connection)  # type: ignore[method-assign]
        tasks = [loop.create_task(_spam(host, int(port), args.peer, counts, stop, 64)) for _ in range(args.rpc_conns)]
    elif args.mode == "streams":
        loop.create_connection = _from_attacker(loop.create_connection)  # type: ignore[method-assign]
        tasks = [loop.create_task(_fill_streams(host, int(port), args.peer, counts, stop, 64))
                 for _ in range(args.rpc_conns)]
    elif args.mode in _STREAM_ATTACKS:
        loop.create_connection = _from_attacker(loop.create_connection)  # type: ignore[method-assign]
        attack, lanes = _STREAM_ATTACKS[args.mode]
        tasks = [loop.create_task(attack(host, int(port), args.peer, counts, stop, lanes))
                 for _ in range(args.rpc_conns)]
    else:
        first = _msg1_factory() if args.mode == "stall" else None
        tasks = [loop.create_task(_hold(host, int(port), counts, first, stop)) for _ in range(args.sockets)]
    t0 = time.monotonic()
    while not stop.is_set():
        await asyncio.wait({loop.create_task(stop.wait())}, timeout=1.0)
        print(json.dumps({"event": "attack", "t": round(time.monotonic() - t0, 1), **vars(counts)}), flush=True)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _burn() -> None:
    """The control: one core busy until stdin closes, no network at all."""
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    while not done.is_set():
        sum(range(100_000))


def attacker_main(args: argparse.Namespace) -> None:
    _raise_nofile()
    if args.mode == "cpu":
        _burn()
        return
    if args.mode in ("streams", *_STREAM_ATTACKS):  # (imports torch: seconds, not to be spent in the attack)
        import p2ptrain.averaging.allreduce  # noqa: F401
        import p2ptrain.testing.hostile.streams  # noqa: F401
    try:
        import uvloop

        uvloop.run(_attack(args))
    except ImportError:
        asyncio.run(_attack(args))


# ----------------------------------------------------------------------------- one row


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


async def _probe_joins(target: str, peer: str, stop: threading.Event, out: list[tuple[bool, float]]) -> None:
    """What a newcomer sees: every 0.5 s a fresh identity dials the victim (from 127.0.0.1) and
    pings it; records (success, seconds), with a 5 s limit per try."""
    from dht.identity import Identity, PeerID
    from dht.transport import Host

    host, port = target.rsplit(":", 1)
    while not stop.is_set():
        h = Host(Identity(), None)
        await h.start()
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(5):
                conn = await h.connect(host, int(port), PeerID.from_base58(peer), timeout=5)
                await conn.call("ping", None, timeout=5)
            out.append((True, time.perf_counter() - t0))
        except Exception:
            out.append((False, time.perf_counter() - t0))
        finally:
            await h.close()
        await asyncio.sleep(0.5)


def run_row(mode: str, args: argparse.Namespace) -> dict:
    common = ["--json", "--threads", "1", "--epochs", str(args.epochs), "--wait-peers", "3",
              "--compute-delay", str(args.compute_delay)]
    peer = [sys.executable, "-m", "p2ptrain", "peer", *common]
    with Children("flood") as kids:
        victim = kids.spawn("victim", [*peer, "--data-seed", "0", *(["--relay"] if mode == "zombie" else [])])
        _, _, started = kids.wait_for(lambda n, e: n == "victim" and e.get("event") == "started", 90)
        addr = started["multiaddrs"][0]
        parts = addr.split("/")
        target, peer_id = f"{parts[2]}:{parts[4]}", parts[6]
        for i in (1, 2):
            kids.spawn(f"peer{i}", [*peer, "--bootstrap", addr, "--data-seed", str(i)])
        _, t_first, first = kids.wait_for(lambda n, e: n == "victim" and e.get("event") == "progress", 120)
        rss0, samples = rss_mb(victim.pid), []
        if mode != "none":
            kids.spawn("attacker", [sys.executable, os.path.abspath(__file__), "attack", "--mode", mode,
                                    "--target", target, "--peer", peer_id, "--sockets", str(args.sockets),
                                    "--rpc-conns", str(args.rpc_conns)], stdin=True)
        early: dict[str, dict] = {}  # peers done before the attack started (none, unless very short)

        def before_attack(name: str, _t: float, ev: dict) -> None:
            nonlocal first
            if name == "victim" and ev.get("event") == "progress":
                first = ev  # the victim's rate is measured from the attack's first report on
            elif ev.get("event") == "done":
                early[name] = ev

        if mode not in ("none", "cpu"):  # (the cpu attacker reports nothing)
            kids.wait_for(lambda n, e: n == "attacker" and e.get("event") == "attack", 60, on_event=before_attack)
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.25):
                samples.append((rss_mb(victim.pid), _fds(victim.pid)))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        joins: list[tuple[bool, float]] = []
        prober = threading.Thread(target=lambda: asyncio.run(_probe_joins(target, peer_id, stop, joins)), daemon=True)
        prober.start()
        done: dict[str, dict] = dict(early)
        deadline = time.monotonic() + args.timeout
        while len(done) < 3:
            name, t, ev = kids.wait_for(lambda n, e: e.get("event") in ("done", "_eof"),
                                        max(1.0, deadline - time.monotonic()))
            if ev.get("event") == "done":
                done[name] = ev
            elif name != "attacker" and name not in done:  # (a peer done before the victim exits)
                raise RuntimeError(f"{name} exited early:\n{kids.kids[name].stderr_tail()}")
        stop.set()
        sampler.join()
        prober.join(timeout=10)
        attack = [e for _, e in kids.kids["attacker"].events if e.get("event") == "attack"] if mode != "none" else []
        if mode != "none":
            kids.kids["attacker"].proc.stdin.close()  # type: ignore[union-attr]
            kids.wait_exit(["attacker"], 10)
    v = done["victim"]
    sps = (v["steps"] - first["steps"]) * 32 / max(1e-9, v["seconds"] - first["seconds"])
    last = attack[-1] if attack else {}
    return {"mode": mode, "sps": sps, "wall": v["seconds"], "epoch": v["epoch"], "acc": v["metrics"]["accuracy"],
            "rounds": v["rounds"], "failed": v["failed_rounds"], "rss0": rss0,
            "rss_max": max((s[0] for s in samples), default=rss0), "fds_max": max((s[1] for s in samples), default=0),
            "opened": last.get("opened", 0), "rpcs": last.get("rpcs", 0), "t_first": t_first,
            "streams": last.get("streams", 0), "junk_mb": last.get("junk_mb", 0), "frames": last.get("frames", 0),
            "rpc_errors": last.get("rpc_errors", 0),
            "joins_ok": sum(ok for ok, _ in joins), "joins": len(joins),
            "join_ms": (1e3 * statistics.median([t for ok, t in joins if ok]) if any(ok for ok, _ in joins)
                        else float("nan"))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd")
    a = sub.add_parser("attack", help="(internal) the attacker process")
    a.add_argument("--mode", required=True, choices=["cpu", "connect", "stall", "rpc", "streams", *_STREAM_ATTACKS])
    a.add_argument("--target", required=True, help="host:port")
    a.add_argument("--peer", required=True, help="the victim's PeerID")
    a.add_argument("--sockets", type=int, default=2000)
    a.add_argument("--rpc-conns", type=int, default=16)
    p.add_argument("--modes", default="none,cpu,connect,stall,rpc")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--compute-delay", type=float, default=0.02, help="seconds per step added to each peer")
    p.add_argument("--sockets", type=int, default=2000, help="connect/stall: sockets the attacker holds open")
    p.add_argument("--rpc-conns", type=int, default=16, help="rpc: attacking connections (one identity each)")
    p.add_argument("--timeout", type=float, default=240, help="per row")
    args = p.parse_args()
    if args.cmd == "attack":
        attacker_main(args)
        return
    sigterm_as_exit()
    try:
        s = socket.socket()
        s.bind((ATTACKER_IP, 0))
        s.close()
    except OSError as e:
        sys.exit(f"cannot bind {ATTACKER_IP} (the attacker's source address): {e}")
    print(f"# flood: 3 digits peers on 127.0.0.1, victim = peer 0; {args.epochs} epochs, compute delay "
          f"{args.compute_delay} s/step; {loadavg()}", flush=True)
    rows = []
    for mode in args.modes.split(","):
        r = run_row(mode, args)
        rows.append(r)
        base = rows[0]["sps"] if rows[0]["mode"] == "none" else float("nan")
        print(f"{r['mode']:>8}  victim {r['sps']:7.0f} samples/s  x{r['sps'] / base:5.2f}  swarm done in "
              f"{r['wall']:5.1f} s  acc {r['acc']:.3f}  rounds {r['rounds']} (failed {r['failed']})  "
              f"RSS {r['rss0']:.0f} -> max {r['rss_max']:.0f} MB  fds max {r['fds_max']}  "
              f"newcomers {r['joins_ok']}/{r['joins']} in {r['join_ms']:.0f} ms  "
              f"attacker: {r['opened']} conns, {r['rpcs']} rpcs ({r['rpc_errors']} failed), {r['streams']} streams, "
              f"{r['junk_mb']} MB + {r['frames']} tiny frames sent",
              flush=True)


if __name__ == "__main__":
    main()
