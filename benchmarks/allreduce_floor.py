"""How fast an uncompressed N=2 round could be on this machine: a floor under allreduce_bench's gloo ratio.

    python benchmarks/allreduce_floor.py                 # 64M floats (256 MiB) per member, 7 rounds
    python benchmarks/allreduce_floor.py --numel 16777216 --rounds 11 --no-ours

Issue 4 asks for an uncompressed round at >= 0.8x gloo's bus bandwidth at N=2 while encrypted and
fault-tolerant. On a 2-core box both members are CPU-bound, so the round time is the CPU work per
member: the kernel's copies (gloo pays them too), plus what gloo does not do. This script measures
that work without the rest of p2ptrain: two processes on uvloop, one TCP connection, 4 MiB
length-prefixed frames written with ``writelines`` and received through a ``BufferedProtocol``, the
same reduce-scatter + all-gather as the butterfly at N=2 (send the peer's half, fold what arrives
into our half as a running mean, one ``lerp`` pass as the owner does, send it back, copy the peer's
averaged half into place), and nothing else: no streams or per-stream flow control (only the
socket's own back-pressure), no matchmaking, no deadlines, no accounting, no fault tolerance.
Three variants, each a layer of what the real round does:

* ``plain``: frames as they are (no cipher, no checks): close to what gloo's ring does.
* ``aes``: every frame AES-256-GCM encrypted and decrypted into a reused buffer (the transport's
  cipher, ``cryptography``'s ``encrypt_into``/``decrypt_into``).
* ``aes+checks``: also the validation passes p2ptrain needs against a hostile or broken peer and
  its own bad input: a min/max pass over the whole input before anything is sent (NaN/inf input
  is refused up front, and it bounds our own values), a min/max pass over every received
  contribution before it is added (NaN/inf or a sum that could overflow drops the sender), a sum
  pass over every received averaged chunk before it is copied into place.

Next to them, in the same run: torch.distributed gloo ``all_reduce`` and (unless ``--no-ours``)
p2ptrain's own round (``allreduce_bench``'s members, codec ``none``). Each line prints seconds per
round (the slower member's, median over rounds after one warmup; the members meet at a barrier
before each round) and the ratio of gloo's time to it, which is the bus-bandwidth ratio; gloo runs
again at the end, and a last line gives every ratio against the faster of its two runs. Every
variant's result is checked against the exact average at sampled indices.

(An int8 variant was tried and dropped: p2ptrain's int8 round, which overlaps codec work with the
network, beat it in every run, so it bounded nothing.)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import socket
import statistics
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from allreduce_bench import WARMUP, gloo, ours  # noqa: E402

VARIANTS = ("plain", "aes", "aes+checks")
TAG = 16  # AES-GCM tag bytes
LEN = struct.Struct("<I")
#: as the all-reduce owner's: half of float32's max, room for the rounding of every addition
SUM_LIMIT = 3.4028234663852886e38 / 2


def _member(rank: int, variant: str, numel: int, frame: int, rounds: int, port_q, barrier, out_q) -> None:
    import torch
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    torch.set_num_threads(1)
    aes = variant != "plain"
    checks = variant == "aes+checks"
    tx, rx = AESGCM(b"k" * 32), AESGCM(b"k" * 32)
    orig = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    flat = orig.clone()
    half = numel // 2
    mine = flat[rank * half : (rank + 1) * half]
    other = flat[(1 - rank) * half : (2 - rank) * half]
    per = frame // 4  # values per frame

    class Proto(asyncio.BufferedProtocol):
        """Receives whole frames into one buffer; decrypts (or copies) each into one of 16 reused
        plaintext buffers and queues a view of it for the round, which consumes them in order
        (``get``). Past 8 queued frames it stops reading the socket until the round catches up
        (TCP then holds the sender back), so a buffer is never reused while still queued."""

        def __init__(self) -> None:
            self.buf = memoryview(bytearray(LEN.size + frame + TAG))
            self.have = 0
            self.plain = [memoryview(bytearray(frame)) for _ in range(16)]
            self.n = 0
            self.q: asyncio.Queue = asyncio.Queue()
            self.tr: asyncio.Transport | None = None
            self.made = asyncio.Event()
            self.paused = False
            self.writable = asyncio.Event()
            self.writable.set()

        def connection_made(self, tr) -> None:
            self.tr = tr
            self.made.set()

        def pause_writing(self) -> None:
            self.writable.clear()

        def resume_writing(self) -> None:
            self.writable.set()

        def get_buffer(self, sizehint: int) -> memoryview:
            end = LEN.size if self.have < LEN.size else LEN.size + LEN.unpack_from(self.buf)[0]
            return self.buf[self.have : end]

        def buffer_updated(self, nbytes: int) -> None:
            self.have += nbytes
            if self.have < LEN.size:
                return
            ln = LEN.unpack_from(self.buf)[0]
            if self.have < LEN.size + ln:
                return
            body = self.buf[LEN.size : LEN.size + ln]
            out = self.plain[self.n % len(self.plain)]
            if aes:
                k = ln - TAG
                rx.decrypt_into(self.n.to_bytes(12, "little"), body, None, out[:k])
            else:
                k = ln
                out[:k] = body
            self.n += 1
            self.have = 0
            self.q.put_nowait(out[:k])
            if self.q.qsize() >= 8 and not self.paused:
                self.paused = True
                self.tr.pause_reading()

        async def get(self):
            x = await self.q.get()
            if self.paused and self.q.qsize() <= 4:
                self.paused = False
                self.tr.resume_reading()
            return x

    async def main() -> None:
        loop = asyncio.get_running_loop()
        p = Proto()
        if rank == 0:
            server = await loop.create_server(lambda: p, "127.0.0.1", 0)
            port_q.put(server.sockets[0].getsockname()[1])
            await p.made.wait()
        else:
            await loop.create_connection(lambda: p, "127.0.0.1", port_q.get())
            server = None
        p.tr.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A frame's ciphertext stays queued in the transport until written. Past two frames queued
        # the transport pauses us (pause_writing) and a send waits for it to drain below one, so
        # at most 3 are ever queued and a buffer is free again before 6 more are encrypted.
        wire_frame = LEN.size + frame + TAG
        p.tr.set_write_buffer_limits(high=2 * wire_frame, low=wire_frame)
        wbufs = [memoryview(bytearray(frame + TAG)) for _ in range(6)]
        sent = [0]

        async def send(x) -> None:
            src = memoryview(x.numpy()).cast("B")
            body = src
            if aes:
                body = wbufs[sent[0] % len(wbufs)][: len(src) + TAG]
                tx.encrypt_into(sent[0].to_bytes(12, "little"), src, None, body)
            sent[0] += 1
            p.tr.writelines((LEN.pack(len(body)), body))
            await p.writable.wait()

        async def scatter() -> None:
            for i in range(0, other.numel(), per):
                await send(other[i : i + per])

        async def reduce(bound: float) -> None:
            for i in range(0, mine.numel(), per):
                x = torch.frombuffer(await p.get(), dtype=torch.float32)
                if checks:  # as the owner's add_bound: NaN/inf or a sum that could overflow drops the sender
                    lo, hi = torch.aminmax(x)
                    if not bound + max(-float(lo), float(hi)) <= SUM_LIMIT:
                        raise SystemExit("a received contribution holds NaN/inf or would overflow the sum")
                dst = mine[i : i + x.numel()]
                torch.lerp(dst, x, 0.5, out=dst)  # the running mean: no division pass before the reply

        async def gather_out() -> None:
            for i in range(0, mine.numel(), per):
                await send(mine[i : i + per])

        async def gather_in() -> None:
            for i in range(0, other.numel(), per):
                x = torch.frombuffer(await p.get(), dtype=torch.float32)
                if checks and not bool(torch.isfinite(x.sum())):
                    raise SystemExit("a received result holds NaN/inf")
                other[i : i + x.numel()].copy_(x)

        times, cpu = [], []
        for _ in range(rounds):
            flat.copy_(orig)
            await loop.run_in_executor(None, barrier.wait)
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            bound = 0.0
            if checks:  # our own input: NaN/inf refused before anything is sent; bounds our values
                lo, hi = torch.aminmax(flat)
                bound = max(-float(lo), float(hi))
                if not bound < float("inf"):
                    raise SystemExit("input holds NaN/inf")
            await asyncio.gather(scatter(), reduce(bound))
            await asyncio.gather(gather_out(), gather_in())
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            times.append(time.perf_counter() - t0)
            cpu.append((r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime))
        idx = torch.randint(0, numel, (4096,), generator=torch.Generator().manual_seed(7))
        a = torch.randn(numel, generator=torch.Generator().manual_seed(0))[idx]
        b = torch.randn(numel, generator=torch.Generator().manual_seed(1))[idx]
        err = float((flat[idx] - (a + b) / 2).abs().max())
        out_q.put({"rank": rank, "t": times, "cpu": cpu, "err": err})
        p.tr.close()
        if server is not None:
            server.close()

    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        run(main())
    except BaseException as e:  # tell the parent at once instead of letting it wait out its timeout
        out_q.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})
        raise


def floor(variant: str, numel: int, frame: int, rounds: int) -> dict:
    """Run the two members of ``variant``; median over rounds (after WARMUP) of the slower one's time."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    port_q, out_q, barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(2)
    ps = [ctx.Process(target=_member, args=(r, variant, numel, frame, rounds, port_q, barrier, out_q), daemon=True)
          for r in range(2)]
    for p in ps:
        p.start()
    res = []
    try:
        while len(res) < len(ps):
            r = out_q.get(timeout=120 + 5 * rounds)
            if "error" in r:  # the other member may be waiting for frames that will never come
                raise SystemExit(f"floor {variant}: member {r['rank']} failed: {r['error']}")
            res.append(r)
    finally:
        for p in ps:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    keep = range(WARMUP, rounds)
    t = statistics.median(max(r["t"][i] for r in res) for i in keep)
    user = statistics.median(max(r["cpu"][i][0] for r in res) for i in keep)
    sys_ = statistics.median(max(r["cpu"][i][1] for r in res) for i in keep)
    return {"t": t, "user": user, "sys": sys_, "err": max(r["err"] for r in res)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--numel", type=int, default=1 << 26, help="float32 values per member (default 64M = 256 MiB)")
    ap.add_argument("--rounds", type=int, default=7, help="measured rounds (median), after one warmup")
    ap.add_argument("--frame", type=int, default=4 << 20,
                    help="bytes of plaintext per frame (default 4 MiB, as p2ptrain)")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--no-ours", action="store_true", help="skip p2ptrain's own round")
    args = ap.parse_args()
    if args.numel % 2 or args.frame % 4 or args.frame <= 0:
        ap.error("--numel must be even and --frame a positive multiple of 4")
    rounds = args.rounds + WARMUP
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; N=2, "
          f"{args.numel * 4 / (1 << 20):.0f} MiB per member, {args.frame >> 10} KiB frames", flush=True)
    g, _ = gloo(2, args.numel, rounds)
    print(f"gloo all_reduce          {g:.3f} s/round", flush=True)
    results = {}
    for v in args.variants:
        r = results[v] = floor(v, args.numel, args.frame, rounds)
        print(f"floor {v:<18} {r['t']:.3f} s/round = {g / r['t']:.2f}x gloo; cpu/member user {r['user']:.3f} "
              f"sys {r['sys']:.3f} s; max err {r['err']:.2g}", flush=True)
    t_ours = None
    if not args.no_ours:
        o = ours(2, args.numel, ["none"], rounds, None)["none"][WARMUP:]
        t_ours = statistics.median(x["t"] for x in o)
        cpu = statistics.median(x["cpu"] for x in o)
        sys_ = statistics.median(x["sys"] for x in o)
        ok = all(x["ok"] for x in o)
        print(f"p2ptrain none            {t_ours:.3f} s/round = {g / t_ours:.2f}x gloo; cpu/member {cpu:.3f} s "
              f"(sys {sys_:.3f}); {'ok' if ok else 'WRONG RESULT'}", flush=True)
    g2, _ = gloo(2, args.numel, rounds)
    gbest = min(g, g2)
    print(f"gloo all_reduce again    {g2:.3f} s/round (the lines above used the first)", flush=True)
    # As allreduce_bench does: the faster gloo counts, so a slow minute of gloo's flatters nobody.
    rows = [(f"floor {v}", r["t"]) for v, r in results.items()]
    if t_ours is not None:
        rows.append(("p2ptrain none", t_ours))
    print(f"against the faster gloo ({gbest:.3f} s): " + ", ".join(f"{name} {gbest / t:.2f}x" for name, t in rows),
          flush=True)
    if "aes+checks" in results and t_ours is not None:
        print(f"p2ptrain none takes {t_ours / results['aes+checks']['t']:.2f}x the time of floor aes+checks",
              flush=True)


if __name__ == "__main__":
    main()
