"""Butterfly all-reduce throughput on loopback, with baselines measured in the same run.

    python benchmarks/allreduce_bench.py                      # N = 2 4 8, 64M floats, none fp16 int8 topk
    python benchmarks/allreduce_bench.py --n 2 --numel 16777216 --codecs none int8 --rounds 5 \
        --hivemind-python /tmp/hmvenv/bin/python --kill-trials 3

For each N and codec it spawns N worker processes that form one group directly (no DHT: the parent collects
each worker's peer id and port and hands every worker the member list on stdin), runs ``--rounds``
rounds per codec after ``--warmup`` uncounted ones (every contender gets the same; a barrier through
the parent before each round; every round starts from the same inputs). Each codec has a group of
members of its own, all alive at once (one group runs every codec where they would not fit in
memory, and says so): the warm-up rounds run codec by codec, then the measured
rounds interleaved, in an order reversed every other round (A B, B A, ...), so that a drift of this
shared box slows every codec alike and "vs none" compares codecs, not minutes. It prints seconds
per round (the slowest member's call to ``run``, its check of the input included; median over
rounds), bus bandwidth =
2 (N-1)/N * bytes / time, CPU seconds per member per round (user + sys, with minor page faults),
peak RSS growth over the inputs (the largest member's high-water mark within a round, reset before
each, above what it held once its tensors were allocated; gloo's in brackets), and the max error of
rank 0's result against the exact average at 4096 sampled indices.

Baselines, measured right before each N: raw single-stream loopback TCP (asyncio, two processes,
1 MiB writes), torch.distributed gloo all_reduce with N processes at the same size (run again after
ours; the faster of the two counts), and, with
``--hivemind-python``, hivemind 1.1.12's DecentralizedAverager at the same N/size/codec (all-reduce
time only, matchmaking excluded; its result is checked too: hivemind's 8-bit codecs silently skip
averaging with numpy >= 2.4). Fault tolerance: ``--kill-trials`` rounds per N in which one member is
SIGKILLed mid-round; prints how long after the kill the survivors' round returns (library default
deadlines; the target is <= 3 s). ``--profile`` runs rank 0 of the first codec under cProfile.

``--netem RATE[,DELAY[,LOSS]]`` (e.g. ``--netem 1gbit`` or ``--netem 1gbit,1ms``; root only) runs
every process of a group -- our workers, the raw TCP pair, the gloo ranks and the hivemind members --
one per network namespace of a :class:`p2ptrain.testing.Testbed`, each behind a link shaped to RATE
both ways, talking over the namespace IPs instead of 127.0.0.1: on loopback everything is
CPU-bound, so what codecs buy on slow links only shows there. The raw TCP baseline then sends about
2 s worth of the link rate instead of >= 1 GiB.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time

MiB = 1 << 20
#: rounds each contender runs first, not counted (--warmup). Three: a member's frame pool keeps the
#: buffers of the most frames it has had in flight at once, and that peak is reached over the first
#: few rounds, each new one a fresh zero-filled 4 MiB buffer (~1000 page faults, ~12 ms of CPU). With
#: one warm-up round, N = 8 rounds still met new peaks (a median of 338-1041 faults per round in some
#: runs, 0-1 in others): the noise, not the steady state, decided "x gloo" and "vs none" there.
WARMUP = 3


def _maxrss_mb() -> float:
    """This process's peak resident memory so far (MB): what a round added shows as its growth."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak_rss() -> None:
    """Start this process's peak-RSS mark afresh (Linux: 5 to /proc/self/clear_refs), so that
    ``_peak_rss_mb`` after a round is that round's own peak, whatever ran before it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # (not Linux, or not allowed: the mark then runs from the start, like ru_maxrss)


def _peak_rss_mb() -> float:
    """Peak resident memory (MB) since the last ``_reset_peak_rss``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return _maxrss_mb()


def _threads() -> int:
    """torch intra-op threads per process, ours and gloo alike (--threads; the environment carries it
    into every spawned member)."""
    return max(1, int(os.environ.get("P2PT_BENCH_THREADS", "1")))


class _Net:
    """Where a run's processes live: on loopback (default), or rank r in host r of a Testbed (--netem)."""

    def __init__(self) -> None:
        self.tb = None  # p2ptrain.testing.Testbed when --netem

    def ip(self, rank: int) -> str:
        return self.tb.hosts[rank].ip if self.tb is not None else "127.0.0.1"

    def popen(self, rank: int, argv: list[str], **kwargs) -> subprocess.Popen:
        if self.tb is not None:
            return self.tb.popen(rank, argv, **kwargs)
        return subprocess.Popen(argv, **kwargs)


_NET = _Net()


def _loop_policy() -> None:
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass


# ---------------------------------------------------------------------- worker: one member


def _expected(numel: int, n: int, idx):
    """The plain average of every member's initial tensor at ``idx`` (member r holds randn(seed=r))."""
    import torch

    acc = torch.zeros(len(idx), dtype=torch.float64)
    for r in range(n):
        acc += torch.randn(numel, generator=torch.Generator().manual_seed(r))[idx].double()
    return (acc / n).float()


def _training_loop() -> None:
    """What shares a peer's process with its averaging rounds when updates are delayed or DiLoCo
    overlaps them with compute: a small model's training steps, many short torch calls with
    Python between them, forever. (Measured on 2 cores: rounds take twice as long beside it, the
    CPU share, and a shorter GIL switch interval does not help.)"""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    while True:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


async def _worker_main(profile_path: str | None, listen_ip: str = "127.0.0.1") -> None:
    import logging

    import torch

    from dht import Host, Identity, Limits, PeerID
    from p2ptrain.averaging import AllReduceConfig
    from p2ptrain.averaging.allreduce import AllReduceService
    from p2ptrain.averaging.group import Group, Member
    from p2ptrain.compression import get_codec

    torch.set_num_threads(_threads())
    if os.environ.get("P2PT_BENCH_SWITCH"):  # experiment: the GIL switch interval (--switch-interval)
        sys.setswitchinterval(float(os.environ["P2PT_BENCH_SWITCH"]))
    if os.environ.get("P2PT_BENCH_BUSY"):  # --beside-training: a training loop in another thread
        threading.Thread(target=_training_loop, daemon=True, name="training").start()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if os.environ.get("P2PT_BENCH_LOG"):
        logging.getLogger("dht").setLevel(logging.INFO)
        logging.getLogger("p2ptrain").setLevel(logging.INFO)
    lim = {}
    if os.environ.get("P2PT_BENCH_SEAL"):  # --seal-threads
        lim["seal_threads"] = int(os.environ["P2PT_BENCH_SEAL"])
    if os.environ.get("P2PT_BENCH_DECRYPT"):  # --decrypt-on-pool
        lim["decrypt_on_pool"] = os.environ["P2PT_BENCH_DECRYPT"] == "on"
    if os.environ.get("P2PT_BENCH_WINDOW"):  # --stream-window
        lim["stream_window"] = int(os.environ["P2PT_BENCH_WINDOW"])
    host = Host(Identity(), (listen_ip, 0), limits=Limits(**lim))
    await host.start()
    print(json.dumps({"peer": host.peer_id.to_base58(), "port": host.listen_port, "ip": listen_ip}), flush=True)
    loop = asyncio.get_running_loop()

    def readline():
        return loop.run_in_executor(None, sys.stdin.readline)

    job = json.loads(await readline())
    if job.get("frame"):  # experiment: cap the stream data frames this member sends and accepts
        import dht.connection

        dht.connection.MAX_FRAME_BODY = int(job["frame"])
    members = tuple(Member(PeerID.from_base58(p), (ip, port)) for p, port, ip in job["members"])
    rank, n, numel = job["rank"], len(job["members"]), job["numel"]
    # offload: "auto" is the library's default (worker thread only with >= offload_min_cpus CPUs)
    offload = {"off": {"offload_min_numel": None}, "on": {"offload_min_cpus": 1}}.get(job["offload"], {})
    if job.get("kill"):  # the library's default deadlines: how fast a round recovers from a dead member
        cfg = AllReduceConfig(chunk_numel=job["chunk"], **offload)
    else:  # generous deadlines: a loaded 2-core box must not turn slowness into failures
        cfg = AllReduceConfig(timeout=600, join_timeout=30, stall_timeout=30, chunk_numel=job["chunk"],
                              **offload)
    svc = AllReduceService(host, cfg, accept_wait=30)
    await svc.start()
    check = job.get("check") and rank == 0
    if check:  # first: its member-sized temporary is freed before the inputs, which are twice its size
        idx = torch.randint(0, numel, (4096,), generator=torch.Generator().manual_seed(12345))
        expected = _expected(numel, n, idx)
    orig = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    flat = orig.clone()
    _reset_peak_rss()
    rss0 = _peak_rss_mb()  # the inputs are allocated and touched: what a round adds shows above this
    print(json.dumps({"ready": True}), flush=True)
    prof = None
    if profile_path:
        import cProfile

        prof = cProfile.Profile()
    codecs = {name: get_codec(name.split("+")[0]) for name in job["codecs"]}
    try:
        for rnd in itertools.count():
            name = (await readline()).strip()  # barrier: "go" with the codec to run; EOF ends
            if not name:
                break
            codec = codecs[name]
            group = Group(f"{name}-{rnd}".encode(), members)
            profiling = prof is not None and name == job["codecs"][0]
            if profiling:
                prof.enable()
            _reset_peak_rss()
            u0 = resource.getrusage(resource.RUSAGE_SELF)  # (microseconds: os.times counts 10 ms ticks)
            start = time.monotonic()
            # "none+trimmed_mean": that codec under a robust rule; "+noaudit": without its audits
            parts = name.split("+")
            if hasattr(svc, "audit"):
                svc.audit.chunks = 0 if "noaudit" in parts else 1
            res = await svc.run(group, rank, flat, 1.0, codec, aggregation=parts[1] if len(parts) > 1 else "mean")
            end = time.monotonic()
            u1 = resource.getrusage(resource.RUSAGE_SELF)
            if profiling:
                prof.disable()
            err = float((flat[idx] - expected).abs().max()) if check else None
            # t: the caller's time in run(): res.time_total starts after run's check of the input
            print(json.dumps({"codec": name, "t": end - start, "end": end, "reduce": res.time_reduce,
                              "ok": res.ok, "err": err, "failed": {str(k): v for k, v in res.failed.items()},
                              "user": u1.ru_utime - u0.ru_utime, "sys": u1.ru_stime - u0.ru_stime,
                              "flt": u1.ru_minflt - u0.ru_minflt,
                              "rss": _peak_rss_mb() - rss0}), flush=True)
            # the next round starts from the same inputs; said when done, so that no round of
            # another group of members (another codec) runs beside this copy
            flat.copy_(orig)
            print(json.dumps({"reset": True}), flush=True)
    finally:
        if prof is not None:
            prof.dump_stats(profile_path)
        await svc.close()
        await host.close()


# ---------------------------------------------------------------------- baselines


def _tcp_sink(port_q) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    c, _ = srv.accept()
    buf = bytearray(4 * MiB)
    while c.recv_into(buf):
        pass
    c.close()


def _tcp_sink_main(ip: str) -> None:
    """--tcp-sink: _tcp_sink in a test bed host, its port on stdout (a Queue cannot cross namespaces)."""
    srv = socket.socket()
    srv.bind((ip, 0))
    srv.listen(1)
    print(json.dumps({"port": srv.getsockname()[1]}), flush=True)
    c, _ = srv.accept()
    buf = bytearray(4 * MiB)
    while c.recv_into(buf):
        pass
    c.close()


async def _tcp_send(ip: str, port: int, total: int) -> float:
    """Seconds to write ``total`` bytes as 1 MiB buffers to ``ip:port`` (until closed)."""
    _r, w = await asyncio.open_connection(ip, port)
    data = memoryview(bytearray(MiB))
    t = time.perf_counter()
    for _ in range(total // MiB):
        w.write(data)
        await w.drain()
    w.close()
    await w.wait_closed()
    return time.perf_counter() - t


def raw_tcp(total: int) -> float:
    """Bytes/s of one asyncio stream writing 1 MiB buffers to a reader in another process (with
    --netem: the reader in test bed host 1, the writer in host 0, both processes of their own)."""
    if _NET.tb is not None:
        return _raw_tcp_netns(total)
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_tcp_sink, args=(q,))
    p.start()
    port = q.get()

    _loop_policy()
    dt = asyncio.run(_tcp_send("127.0.0.1", port, total))
    p.join()
    return total / dt


def _raw_tcp_netns(total: int) -> float:
    sink = _NET.popen(1, [sys.executable, __file__, "--tcp-sink", _NET.ip(1)], stdout=subprocess.PIPE, text=True)
    try:
        port = json.loads(sink.stdout.readline())["port"]
        out = subprocess.run(_NET.tb.exec_argv(0, [sys.executable, __file__, "--tcp-send", _NET.ip(1), str(port),
                                                   str(total)]),
                             check=True, capture_output=True, text=True, timeout=600).stdout
        sink.wait(timeout=60)
        return total / json.loads(out)["dt"]
    finally:
        _kill_leftovers([sink])


def _gloo_worker(rank: int, n: int, port: int, numel: int, rounds: int, q, master: str = "127.0.0.1") -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(_threads())
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=n)
    x = torch.randn(numel)
    rss0 = _maxrss_mb()
    times = []
    for _ in range(rounds):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t)
    dist.destroy_process_group()
    q.put({"t": times, "rss": _maxrss_mb() - rss0})


class _PrintQueue:
    """_gloo_worker's queue in a test bed host: the times go to stdout as one JSON line."""

    def put(self, obj) -> None:
        print(json.dumps(obj), flush=True)


def _gloo_summary(per_rank: list[dict], rounds: int) -> tuple[float, float]:
    """(median over rounds of the slowest rank's time, the largest peak-RSS growth of a rank)."""
    return (statistics.median(max(r["t"][i] for r in per_rank) for i in range(WARMUP, rounds)),
            max(r["rss"] for r in per_rank))


def gloo(n: int, numel: int, rounds: int) -> tuple[float, float]:
    if _NET.tb is not None:
        return _gloo_netns(n, numel, rounds)
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ps = [ctx.Process(target=_gloo_worker, args=(r, n, port, numel, rounds, q)) for r in range(n)]
    for p in ps:
        p.start()
    per_rank = [q.get() for _ in ps]
    for p in ps:
        p.join()
    return _gloo_summary(per_rank, rounds)


def _kill_leftovers(procs: list[subprocess.Popen]) -> None:
    """SIGKILL whoever still runs: these helpers have no stdin to close, and after an error (or
    Ctrl+C) a gloo rank blocked in C++ would not notice anything gentler."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _gloo_netns(n: int, numel: int, rounds: int) -> tuple[float, float]:
    """gloo with rank r in test bed host r; the store on host 0 (a fresh namespace: any port is free)."""
    # TORCH_CPP_LOG_LEVEL: c10d warns that it cannot reverse-resolve the namespace IPs (harmless)
    env = dict(os.environ, GLOO_SOCKET_IFNAME=_NET.tb.hosts[0].ifname, TORCH_CPP_LOG_LEVEL="ERROR")
    ps = [_NET.popen(r, [sys.executable, __file__, "--gloo-worker",
                         json.dumps([r, n, 29500, numel, rounds, _NET.ip(0)])],
                     stdout=subprocess.PIPE, text=True, env=env)
          for r in range(n)]
    try:
        per_rank = [json.loads(p.stdout.readline()) for p in ps]
        for p in ps:
            p.wait(timeout=60)
    finally:
        _kill_leftovers(ps)
    return _gloo_summary(per_rank, rounds)


# ---------------------------------------------------------------------- parent


def _spawn_ours(n: int, job: dict, profile: str | None = None) -> list[subprocess.Popen]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    procs = []
    for r in range(n):
        cmd = [sys.executable, __file__, "--worker", "--listen-ip", _NET.ip(r)]
        cmd += ["--profile-out", profile] if profile and r == 0 else []
        procs.append(_NET.popen(r, cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
    hello = [json.loads(p.stdout.readline()) for p in procs]
    members = [[h["peer"], h["port"], h["ip"]] for h in hello]
    for r, p in enumerate(procs):
        p.stdin.write(json.dumps(dict(job, members=members, rank=r)) + "\n")
        p.stdin.flush()
    for p in procs:
        assert json.loads(p.stdout.readline())["ready"]
    return procs


def _reap(procs: list[subprocess.Popen], timeout: float = 60) -> None:
    """Close the children's stdin (they exit on EOF), wait, and SIGKILL whoever lingers."""
    for p in procs:
        if p.poll() is None:
            try:
                p.stdin.close()
            except OSError:
                pass
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _schedule(codecs: list[str], rounds: int) -> list[str]:
    """The codec of each round: ``WARMUP`` rounds of each codec in turn (the first of a codec
    allocates its buffers), then the measured rounds interleaved, the order reversed every other
    round (A B, B A, A B, ...): a drift of this shared box between minutes then slows every codec
    alike instead of whichever ran last, and their ratio stays a comparison of codecs."""
    out = [c for c in codecs for _ in range(min(WARMUP, rounds))]
    for r in range(rounds - WARMUP):
        out += codecs if r % 2 == 0 else codecs[::-1]
    return out


def ours(n: int, numel: int, codecs: list[str], rounds: int, profile: str | None, chunk: int = 1 << 20,
         offload: str = "auto", check: bool = True, frame: int = 0) -> dict[str, list[dict]]:
    job = {"numel": numel, "chunk": chunk, "offload": offload, "check": check, "frame": frame}
    # One group of members per codec, all alive at once (the others wait on stdin): a member's
    # frame buffer pool then holds what its own codec's rounds use, as in a training run, instead
    # of trading 4 MiB and 1 MiB buffers (and their page faults) at every switch of codec. Where
    # that many members would not fit in memory (a member holds its input, the copy it resets
    # from and its buffers), one group runs every codec.
    need = n * len(codecs) * 3 * numel * 4
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    groups = [[c] for c in codecs] if len(codecs) == 1 or need < 0.7 * avail else [list(codecs)]
    if len(groups) == 1 and len(codecs) > 1:
        print(f"N={n}: one group of members runs every codec (a group per codec would need about "
              f"{need / 1e9:.0f} GB of the {avail / 1e9:.0f} GB free)", flush=True)
    spawned: list[subprocess.Popen] = []
    sets: dict[str, list[subprocess.Popen]] = {}
    try:
        for g in groups:
            procs = _spawn_ours(n, dict(job, codecs=g), profile if codecs[0] in g else None)
            spawned += procs
            sets.update((c, procs) for c in g)
        out: dict[str, list[dict]] = {c: [] for c in codecs}
        for c in _schedule(codecs, rounds):
            procs = sets[c]
            for p in procs:
                p.stdin.write(c + "\n")
                p.stdin.flush()
            reports = [json.loads(p.stdout.readline()) for p in procs]
            resets = [json.loads(p.stdout.readline()) for p in procs]  # (read even under python -O)
            if not all(r.get("reset") for r in resets):
                raise RuntimeError(f"a member did not report its input reset: {resets}")
            out[c].append({"t": max(x["t"] for x in reports), "ok": all(x["ok"] for x in reports),
                           "err": reports[0]["err"], "reduce": max(x["reduce"] for x in reports),
                           "failed": [x["failed"] for x in reports if x["failed"]],
                           "cpu": max(x["user"] + x["sys"] for x in reports), "sys": max(x["sys"] for x in reports),
                           "flt": reports[0]["flt"], "rss": max(x["rss"] for x in reports)})
        return out
    finally:
        _reap(spawned)


def kill_trials(n: int, numel: int, trials: int, kill_after: float, chunk: int, offload: str) -> list[float]:
    """Seconds from SIGKILLing member n-1 mid-round (``kill_after`` s after "go") until the last
    survivor's round returns, one per trial (fresh processes each), library-default deadlines."""
    out = []
    for _ in range(trials):
        job = {"numel": numel, "codecs": ["none"], "chunk": chunk, "offload": offload,
               "check": False, "kill": True}
        procs = _spawn_ours(n, job)
        try:
            for p in procs:
                p.stdin.write("none\n")
                p.stdin.flush()
            time.sleep(kill_after)
            victim = procs[-1]
            victim.kill()
            t_kill = time.monotonic()
            reports = [json.loads(p.stdout.readline()) for p in procs[:-1]]
            ends = [x["end"] for x in reports]
            if min(ends) < t_kill:
                print(f"  (kill trial N={n}: a survivor finished {t_kill - min(ends):.3f} s before the kill;"
                      " use a larger --kill-numel or smaller --kill-after)", flush=True)
            out.append(max(ends) - t_kill)
        finally:
            _reap(procs)
    return out


def _line_reader(proc: subprocess.Popen):
    import queue
    import threading

    q: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()

    def get(timeout: float) -> dict:
        line = q.get(timeout=timeout)
        if line is None:
            raise RuntimeError(f"hivemind member exited (rc={proc.wait()})")
        return json.loads(line)

    return get


# --netem: run _hivemind_allreduce.py with hivemind's DHT listening on this test bed host's IP (the
# script binds 127.0.0.1, which inside a namespace no other host can reach)
_HIVEMIND_NETNS = r"""
import runpy, sys
ip, script = sys.argv[1], sys.argv[2]
sys.argv = [script]
try:
    import hivemind
    _init = hivemind.DHT.__init__
    def _init_on_ip(self, *args, **kwargs):
        kwargs["host_maddrs"] = [f"/ip4/{ip}/tcp/0"]
        _init(self, *args, **kwargs)
    hivemind.DHT.__init__ = _init_on_ip
except Exception:
    pass  # the script reports a missing hivemind itself
runpy.run_path(script, run_name="__main__")
"""


def hivemind_rounds(python: str, n: int, numel: int, codec: str, rounds: int, timeout: float = 900) -> list[dict] | str:
    """hivemind's DecentralizedAverager, same N/size/codec: per round {"t", "ok", "err"} or why not."""
    import tempfile

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_hivemind_allreduce.py")
    log = tempfile.NamedTemporaryFile("w", prefix="hivemind-bench-", suffix=".log", delete=False)  # noqa: SIM115 (kept: its name is reported)
    procs: list[subprocess.Popen] = []
    try:
        job = {"n": n, "numel": numel, "codec": codec, "rounds": rounds, "peers": [], "tag": os.urandom(4).hex()}
        readers = []
        for r in range(n):
            argv = [python, script] if _NET.tb is None else [python, "-c", _HIVEMIND_NETNS, _NET.ip(r), script]
            p = _NET.popen(r, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
            procs.append(p)
            readers.append(_line_reader(p))
            p.stdin.write(json.dumps(dict(job, rank=r)) + "\n")
            p.stdin.flush()
            hello = readers[-1](timeout)
            if "error" in hello:
                return hello["error"]
            if r == 0:
                job["peers"] = hello["maddrs"]
        out = []
        for _ in range(rounds):
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            formed = [get(timeout)["formed"] for get in readers]
            for p in procs:
                p.stdin.write("run\n")
                p.stdin.flush()
            reports = [get(timeout) for get in readers]
            out.append({"t": max(x["t"] for x in reports), "err": reports[0]["err"], "mae": reports[0]["mae"],
                        "ok": all(formed) and all(x["ok"] and x["averaged"] for x in reports)})
        return out
    except Exception as e:  # noqa: BLE001
        return f"failed: {e!r} (log: {log.name})"
    finally:
        _reap(procs, timeout=30)


# expected |average error| at sampled indices, per codec (randn inputs): a bound, not a tolerance test
_ERR_BOUND = {"none": 1e-5, "fp16": 5e-3, "bf16": 3e-2, "int8": 5e-2, "int8-outlier": 5e-2, "topk": None}


def main() -> None:
    global WARMUP
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[2, 4, 8], help="group sizes")
    ap.add_argument("--numel", type=int, default=1 << 26, help="float32 values per member (default 64M = 256 MiB)")
    ap.add_argument("--codecs", nargs="+", default=["none", "fp16", "int8", "topk"])
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (median), after --warmup")
    ap.add_argument("--warmup", type=int, default=WARMUP,
                    help="rounds run first and not counted, for every contender (ours allocates its "
                         "reusable buffers over the first rounds; a training run does thousands)")
    ap.add_argument("--profile", metavar="FILE",
                    help="cProfile rank 0 (first codec, first N) into FILE and print the top")
    ap.add_argument("--no-gloo", action="store_true")
    ap.add_argument("--no-tcp", action="store_true")
    ap.add_argument("--no-check", action="store_true", help="skip checking the averages against the expected values")
    ap.add_argument("--chunk", type=int, default=1 << 20, help="values per chunk")
    ap.add_argument("--offload", choices=["auto", "on", "off"], default="auto",
                    help="codec work in a worker thread: always, never, or the library default (auto: "
                         "only with >= AllReduceConfig.offload_min_cpus CPUs)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads per process, ours and gloo alike (default 1: N processes "
                         "share the cores; a trainer on a many-core box runs with more)")
    ap.add_argument("--switch-interval", type=float, default=0.0, metavar="S",
                    help="experiment: sys.setswitchinterval(S) in our members (default: Python's 5 ms)")
    ap.add_argument("--seal-threads", type=int, default=None, metavar="T",
                    help="threads that encrypt our big outgoing frames (Limits.seal_threads; default: the "
                         "library's, 2 from 4 usable CPUs up, else 0 = inline on the event loop)")
    ap.add_argument("--decrypt-on-pool", choices=["on", "off"], default=None,
                    help="where there are sealing threads, decrypt big incoming frames on them too "
                         "(Limits.decrypt_on_pool; default on)")
    ap.add_argument("--kernel-threads", type=int, default=None, metavar="K",
                    help="split each big int8/copy kernel call over K threads (P2PT_KERNEL_THREADS; default: "
                         "the library's, from 4 usable CPUs up; 1 = one thread)")
    ap.add_argument("--stream-window", type=int, default=None, metavar="BYTES",
                    help="experiment: each member's per-stream receive window (Limits.stream_window)")
    ap.add_argument("--beside-training", action="store_true",
                    help="each of our members also runs a small model's training loop in another thread, as a "
                         "peer does while a round overlaps compute (delayed updates, DiLoCo)")
    ap.add_argument("--frame", type=int, default=0, help="experiment: cap stream data frames at this many bytes")
    ap.add_argument("--hivemind-python", metavar="PY", help="interpreter with hivemind 1.1.12 (and numpy<2.4)")
    ap.add_argument("--hivemind-codecs", nargs="+", default=["none", "int8"], help="codecs to run on hivemind")
    ap.add_argument("--kill-trials", type=int, default=5, help="SIGKILL trials per N (0: none)")
    ap.add_argument("--kill-numel", type=int, default=None, help="values per member in kill trials (default --numel)")
    ap.add_argument("--kill-after", type=float, default=None,
                    help="seconds into the round to kill (default 40%% of the measured 'none' round)")
    ap.add_argument("--netem", metavar="RATE[,DELAY[,LOSS]]",
                    help="one network namespace per process, links shaped to RATE up and down per host, "
                         "DELAY one way (e.g. 1gbit or 1gbit,1ms; needs root; without netem DELAY runs through a "
                         "userspace delay line of ~100 Mbit/s at most)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile-out", help=argparse.SUPPRESS)
    ap.add_argument("--listen-ip", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--tcp-sink", metavar="IP", help=argparse.SUPPRESS)
    ap.add_argument("--tcp-send", nargs=3, metavar=("IP", "PORT", "BYTES"), help=argparse.SUPPRESS)
    ap.add_argument("--gloo-worker", metavar="JSON", help=argparse.SUPPRESS)
    args = ap.parse_args()
    WARMUP = max(0, args.warmup)
    os.environ["P2PT_BENCH_THREADS"] = str(max(1, args.threads))
    if args.switch_interval > 0:
        os.environ["P2PT_BENCH_SWITCH"] = str(args.switch_interval)
    if args.beside_training:
        os.environ["P2PT_BENCH_BUSY"] = "1"
    if args.stream_window:
        os.environ["P2PT_BENCH_WINDOW"] = str(args.stream_window)
    if args.seal_threads is not None:
        os.environ["P2PT_BENCH_SEAL"] = str(max(0, args.seal_threads))
    if args.decrypt_on_pool is not None:
        os.environ["P2PT_BENCH_DECRYPT"] = args.decrypt_on_pool
    if args.kernel_threads is not None:
        os.environ["P2PT_KERNEL_THREADS"] = str(max(1, args.kernel_threads))
    if args.worker:
        _loop_policy()
        asyncio.run(_worker_main(args.profile_out, args.listen_ip))
        return
    if args.tcp_sink:
        _tcp_sink_main(args.tcp_sink)
        return
    if args.tcp_send:
        _loop_policy()
        ip, port, total = args.tcp_send
        print(json.dumps({"dt": asyncio.run(_tcp_send(ip, int(port), int(total)))}), flush=True)
        return
    if args.gloo_worker:
        rank, n, port, numel, rounds, master = json.loads(args.gloo_worker)
        _gloo_worker(rank, n, port, numel, rounds, _PrintQueue(), master)
        return
    if not args.netem:
        _run(args)
        return
    import signal

    from p2ptrain.testing import Testbed, TestbedError

    try:
        tb = Testbed.from_netem(max(2, *args.n), args.netem)
    except TestbedError as e:
        sys.exit(f"--netem: {e}")
    # SIGTERM would skip the finally below: make it an exit, so the namespaces go with us
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        _NET.tb = tb
        _run(args)
    finally:
        _NET.tb = None
        tb.close()


def _run(args: argparse.Namespace) -> None:
    nbytes = args.numel * 4
    link = "" if _NET.tb is None else f"; link: {_NET.tb.describe()}"
    from p2ptrain.compression import kernels

    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {nbytes / MiB:.0f} MiB per member{link}; "
          f"torch threads per process: {args.threads}; "
          f"int8 kernels: {'on' if kernels.AVAILABLE else 'off (not built, or P2PT_KERNELS=0)'}", flush=True)
    rows = []
    kills = {}
    for n in args.n:
        busf = 2 * (n - 1) / n * nbytes
        if _NET.tb is None:
            tcp = None if args.no_tcp else raw_tcp(min(4 << 30, max(1 << 30, 4 * nbytes)))
        else:  # ~2 s at the link rate (>= 1 GiB would take 9 s at 1 Gbit/s)
            rate = _NET.tb.rate_bps or 8e9
            tcp = None if args.no_tcp else raw_tcp(max(16 * MiB, int(rate / 8 * 2) // MiB * MiB))
        if tcp:
            where = "loopback" if _NET.tb is None else "test bed"
            print(f"N={n}: raw {where} TCP, one asyncio stream, 1 MiB writes: {tcp / 1e9:.2f} GB/s", flush=True)
        g, g_rss = (None, None) if args.no_gloo else gloo(n, args.numel, args.rounds + WARMUP)
        if g is not None:
            print(f"N={n}: gloo all_reduce: {g:.3f} s/round, bus {busf / g / 1e9:.2f} GB/s, peak RSS "
                  f"+{g_rss:.0f} MB over its input", flush=True)
        res = ours(n, args.numel, args.codecs, args.rounds + WARMUP, args.profile if n == args.n[0] else None,
                   args.chunk, args.offload, not args.no_check, args.frame)
        if g is not None:
            # gloo again after ours, and the faster of the two: this shared 2-core box drifts by
            # 30% between minutes, and the ratio should not flatter us when gloo hit a slow one
            g2, g2_rss = gloo(n, args.numel, args.rounds + WARMUP)
            print(f"N={n}: gloo all_reduce again after ours: {g2:.3f} s/round; using the faster, "
                  f"{min(g, g2):.3f} s", flush=True)
            g, g_rss = min(g, g2), max(g_rss, g2_rss)
        t_none = None
        for c, rounds in res.items():
            rounds = rounds[WARMUP:]
            t = statistics.median(r["t"] for r in rounds)
            if c == "none":
                t_none = t
            errs = [r["err"] for r in rounds if r["err"] is not None]
            err = max(errs) if errs else None
            bound = _ERR_BOUND.get(c)
            row = {"n": n, "codec": c, "t": t, "bus": busf / t, "tcp": tcp, "gloo": g,
                   "ok": all(r["ok"] for r in rounds),
                   "err": err, "err_ok": err is None or bound is None or err <= bound,
                   "cpu": statistics.median(r["cpu"] for r in rounds),
                   "sys": statistics.median(r["sys"] for r in rounds),
                   "flt": statistics.median(r["flt"] for r in rounds), "failed": rounds[-1]["failed"], "hm": None,
                   "rss": max(r["rss"] for r in rounds), "gloo_rss": g_rss}
            rows.append(row)
            line = f"N={n} p2ptrain {c:5s}: {t:.3f} s/round, bus {row['bus'] / 1e9:.2f} GB/s"
            if tcp:
                line += f" = {row['bus'] / tcp:.2f}x raw TCP"
            if g is not None:
                line += f", {g / t:.2f}x gloo"
            line += (f"; cpu/rank {row['cpu']:.3f} s (sys {row['sys']:.3f}, {row['flt']:.0f} faults); peak RSS "
                     f"+{row['rss']:.0f} MB over the inputs")
            if err is not None:
                line += f", max err {err:.2g}"
            if not row["ok"] or not row["err_ok"]:
                line += f"  NOT OK: {row['failed']}"
            print(line, flush=True)
            if args.hivemind_python and c in args.hivemind_codecs:
                hm = hivemind_rounds(args.hivemind_python, n, args.numel, c, args.rounds + WARMUP)
                row["hm"] = hm
                if isinstance(hm, str):
                    print(f"N={n} hivemind {c:5s}: {hm}", flush=True)
                else:
                    hm = hm[WARMUP:]
                    th = statistics.median(r["t"] for r in hm)
                    herr = max(r["err"] for r in hm)
                    hok = all(r["ok"] for r in hm)
                    row["hm"] = {"t": th, "ok": hok, "err": herr}
                    print(f"N={n} hivemind {c:5s}: {th:.3f} s/round (all-reduce only, matchmaking excluded), "
                          f"max err {herr:.2g}, mean err {max(r['mae'] for r in hm):.2g}"
                          f"{'' if hok else '  NOT AVERAGED / FAILED'}; p2ptrain is {th / t:.2f}x faster",
                          flush=True)
        if args.kill_trials:
            kn = args.kill_numel or args.numel
            after = (args.kill_after if args.kill_after is not None
                     else max(0.05, 0.4 * (t_none or 1.0) * kn / args.numel))
            ks = kill_trials(n, kn, args.kill_trials, after, args.chunk, args.offload)
            kills[n] = ks
            ks_sorted = sorted(ks)
            p95 = ks_sorted[min(len(ks) - 1, round(0.95 * (len(ks) - 1)))]
            print(f"N={n} SIGKILL of one member {after:.2f} s into a round: survivors done {p95:.2f} s after the kill "
                  f"(p95 of {len(ks)}; all: {', '.join(f'{k:.2f}' for k in ks)}); target <= 3 s", flush=True)
    _table(rows, kills)
    if args.profile:
        import pstats

        print(f"\nprofile of rank 0, N={args.n[0]}, codec {args.codecs[0]}:")
        pstats.Stats(args.profile).sort_stats("tottime").print_stats(18)


def _table(rows: list[dict], kills: dict[int, list[float]]) -> None:
    cw = max([5] + [len(r["codec"]) for r in rows])
    print(f"\n  N  {'codec':{cw}s}  s/round  bus GB/s  x raw TCP  x gloo  vs none  cpu/rank  +RSS MB (gloo)  hivemind s"
          "  x hivemind  check")
    t_none = {r["n"]: r["t"] for r in rows if r["codec"] == "none"}
    for r in rows:
        tcp = f"{r['bus'] / r['tcp']:9.2f}" if r["tcp"] else f"{'-':>9}"
        gl = f"{r['gloo'] / r['t']:6.2f}" if r["gloo"] else f"{'-':>6}"
        vn = f"{t_none[r['n']] / r['t']:6.2f}x" if r["n"] in t_none else f"{'-':>7}"
        hm = r["hm"]
        if isinstance(hm, dict):
            hms = f"{hm['t']:10.3f}  {hm['t'] / r['t']:9.2f}x" + ("" if hm["ok"] else " (hivemind NOT OK)")
        else:
            hms = f"{'-':>10}  {'-':>10}"
        ok = "ok" if r["ok"] and r["err_ok"] else "FAILED"
        if r["err"] is not None:
            ok += f" (err {r['err']:.1g})"
        gr = f"({r['gloo_rss']:.0f})" if r["gloo_rss"] is not None else ""
        rss = f"{r['rss']:.0f} {gr}"
        print(f"{r['n']:3d}  {r['codec']:{cw}s}  {r['t']:7.3f}  {r['bus'] / 1e9:8.2f}  {tcp}  {gl}  {vn}  "
              f"{r['cpu']:8.3f}  {rss:>14}  {hms}  {ok}")
    for n, ks in kills.items():
        print(f"  N={n}: SIGKILL mid-round -> survivors finished in max {max(ks):.2f} s (trials: {len(ks)})")


if __name__ == "__main__":
    main()
