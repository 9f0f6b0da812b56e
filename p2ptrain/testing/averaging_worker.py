"""One averaging peer in a process of its own: a test and benchmark tool, not part of the trainer.

``python -m p2ptrain.testing.averaging_worker --bootstrap MULTIADDR --rank R --numel N ...`` starts a
DHTNode (client mode with ``--client``), builds a deterministic tensor list from ``--rank`` and runs
``--rounds`` averaging rounds with an :class:`~p2ptrain.averaging.Averager`. Multi-process tests
(tests/test_averaging_processes.py) start several of these on 127.0.0.1, so that averaging runs over
real sockets between real processes, and crashes are real crashes (SIGKILL).

Tensors: ``flat_input(rank, numel)`` is ``randn(numel)`` from a generator seeded with the rank; it
is split into two tensors whose shapes depend on ``--shape-variant`` (another variant: another
schema, with the same values). A parent can recompute every worker's input with ``flat_input``.

stdout: one JSON object per line. First ``{"event": "ready", "rank", "peer_id", "addr", "pid"}``
once the DHT node has joined, then one ``{"event": "round", ...}`` per round (see ``_report``) and
``{"event": "exit"}`` after the last round (not when stdin closes first). Logs (warnings, e.g.
schema mismatches) go to stderr.

Flags worth knowing:

* ``--wait-go``: before each round, wait for a line ``go`` on stdin (the parent starts every
  worker's round at the same moment, whatever their start-up times were).
* ``--out PATH``: after each round, write the flat float32 result (raw little-endian bytes) to PATH
  (``{round}`` in PATH is replaced by the round index).
* ``--codec none,int8,fp16``: round k uses the k-th codec (cycling); every change of codec starts
  again from the worker's initial tensors, so one set of processes can check several codecs.
* ``--die-after-bytes B``: SIGKILL ourselves once this round wrote B bytes of all-reduce stream
  payload: a true crash mid-round, as the other peers see it. The hook lives here (a wrapper of
  ``Stream.write`` for the all-reduce protocol), not in the library.

Lifetime: the worker exits by itself when its parent dies: EOF on stdin ends it (after a graceful
close, bounded by a watchdog), and on Linux PR_SET_PDEATHSIG SIGKILLs it as well.
"""

from __future__ import annotations

import argparse
import ctypes
import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from dht import DHTConfig, DHTNode, Multiaddr, Stream
from ..children import die_with_parent

from ..averaging.protocol import PROTOCOL
from ..averaging.round_types import AllReduceConfig
from ..averaging.averager import Averager, StepResult

log = logging.getLogger("p2ptrain.testing.averaging_worker")


def flat_input(rank: int, numel: int) -> torch.Tensor:
    """The values worker ``rank`` averages, flattened (the same for every shape variant)."""
    gen = torch.Generator().manual_seed(int(rank))
    return torch.randn(int(numel), generator=gen, dtype=torch.float32)


def split_sizes(numel: int, variant: int = 0) -> list[tuple[int, ...]]:
    """Two shapes holding ``numel`` values; ``variant`` moves the boundary (another schema)."""
    k = max(1, min(numel - 1, numel // 3 + 256 * int(variant)))
    return [(k,), (numel - k,)]


def make_tensors(rank: int, numel: int, variant: int = 0) -> list[tuple[str, torch.Tensor]]:
    flat = flat_input(rank, numel)
    out, offset = [], 0
    for i, shape in enumerate(split_sizes(numel, variant)):
        n = 1
        for d in shape:
            n *= d
        out.append((f"t{i}", flat[offset : offset + n].clone().view(shape)))
        offset += n
    return out


# ---------------------------------------------------------------------------------------- crash hook


class _Killer:
    """Counts all-reduce stream payload written this round; SIGKILLs the process at ``limit``.

    ``Stream.write`` returns once the bytes are in the connection's write buffer (megabytes), so
    "written" is not "sent": at the limit the worker freezes every all-reduce write, lets its
    connections flush what was written and the peers read it (bounded: 1.5 s), then dies. The peers
    thus hold about ``limit`` bytes of our parts when we crash, which is what the flag promises.
    """

    def __init__(self, limit: int | None, at_once: bool = False):
        self.limit = limit
        self.at_once = at_once
        self.written = 0
        self.armed = False
        self.dying = False
        self.conns: set[Any] = set()

    def install(self) -> None:
        if self.limit is None:
            return
        original = Stream.write
        killer = self

        async def write(stream: Stream, data: Any, timeout: float | None = None) -> None:
            if not (killer.armed and stream.protocol == PROTOCOL):
                return await original(stream, data, timeout)
            if killer.dying:
                await asyncio.get_running_loop().create_future()  # frozen until the SIGKILL
            killer.conns.add(stream._conn)
            view = memoryview(data).cast("B")
            room = killer.limit - killer.written  # type: ignore[operator]
            if len(view) >= room:
                killer.dying = True
                if room > 0:
                    await original(stream, view[:room], timeout)
                    killer.written += room
                await killer._die()
            await original(stream, view, timeout)
            killer.written += len(view)

        Stream.write = write  # type: ignore[method-assign]

    async def _die(self) -> None:
        deadline = time.monotonic() + 1.0
        while not self.at_once and time.monotonic() < deadline:
            transports = [getattr(c, "_transport", None) for c in self.conns]
            if all(t is None or t.get_write_buffer_size() == 0 for t in transports):
                break
            await asyncio.sleep(0.005)
        # The peers read what reached their sockets: our exit resets the connections (we leave
        # unread data behind), and a reset discards what the peer's kernel still held for it.
        if not self.at_once:
            await asyncio.sleep(0.5)
        log.warning("--die-after-bytes: %d bytes written this round; SIGKILL", self.written)
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------------------------- worker


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _report(args: argparse.Namespace, k: int, res: StepResult, avg: Averager, t_start: float) -> dict:
    ar = res.allreduce
    shards = []
    if ar is not None:
        for s in ar.shards:
            shards.append({"owner": s.owner, "start": s.start, "end": s.end, "status": s.status,
                           "contributors": list(s.contributors),
                           "partial": {str(r): c for r, c in s.partial.items()},
                           "averaged": s.averaged, "weight": s.weight, "error": s.error})
    return {
        "event": "round", "rank": args.rank, "round": k, "peer_id": str(avg.dht.peer_id),
        "group_rank": ar.rank if ar is not None else 0,
        "group_size": res.group_size, "members": [str(m) for m in res.members],
        "failed": {str(r): why for r, why in res.failed.items()}, "not_averaged": list(res.not_averaged),
        "shards": shards, "weight_total": res.weight_total,
        "bytes_sent": res.bytes_sent, "bytes_received": res.bytes_received,
        "matchmaking_s": res.matchmaking_s, "allreduce_s": res.allreduce_s, "total_s": res.total_s,
        "time_reduce": ar.time_reduce if ar is not None else 0.0,
        "time_gather": ar.time_gather if ar is not None else 0.0,
        "wall_start": t_start, "wall_end": time.time(),
        "mismatches": avg.matchmaker.mismatches(), "schema": avg.schema.hash,
    }


async def _stdin_lines(go: asyncio.Queue, main: asyncio.Task) -> None:
    """Feed ``go`` lines to the queue; at EOF (the parent closed our stdin or died) end ``main``."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        if line.strip() == b"go":
            go.put_nowait(None)
    log.info("stdin closed: exiting")
    # The graceful path gets a few seconds; after that the process ends regardless.
    timer = threading.Timer(3.0, os._exit, args=(3,))
    timer.daemon = True
    timer.start()
    main.cancel()


async def run(args: argparse.Namespace) -> None:
    main = asyncio.current_task()
    assert main is not None
    go: asyncio.Queue = asyncio.Queue()
    watcher = asyncio.get_running_loop().create_task(_stdin_lines(go, main))
    killer = _Killer(args.die_after_bytes, args.die_at_once)
    killer.install()
    cfg = DHTConfig(rpc_timeout=args.rpc_timeout)
    node = DHTNode(listen=None if args.client else ("127.0.0.1", 0), config=cfg)
    try:
        await node.start([Multiaddr.parse(args.bootstrap)] if args.bootstrap else [])
        codecs = [c for c in args.codec.split(",") if c]
        ar_cfg = AllReduceConfig(chunk_numel=args.chunk_numel, timeout=args.allreduce_timeout)
        avg: Averager | None = None
        try:
            for k in range(args.rounds):
                codec = codecs[k % len(codecs)]
                if avg is None or avg.codec_name != codec:
                    # A new codec starts from fresh inputs (one Averager at a time: each owns the
                    # host's all-reduce stream handler while it runs).
                    if avg is not None:
                        await avg.close()
                        avg = None
                    avg = Averager(node, args.prefix, dict(make_tensors(args.rank, args.numel, args.shape_variant)),
                                   codec=codec, target_group_size=args.target_group_size,
                                   matchmaking_timeout=args.matchmaking_timeout, allreduce_config=ar_cfg)
                    await avg.start()
                if k == 0:
                    _emit({"event": "ready", "rank": args.rank, "peer_id": str(node.peer_id), "pid": os.getpid(),
                           "addr": str(node.multiaddrs[0]) if node.multiaddrs else None,
                           "schema": avg.schema.hash})
                if args.wait_go:
                    await go.get()
                t_start = time.time()
                killer.written, killer.armed, killer.dying = 0, True, False
                res = await avg.step(args.weight, round_id=args.round_offset + k)
                killer.armed = False
                if args.out:
                    flat = torch.cat([t.detach().reshape(-1) for t in avg.tensors]).to(torch.float32)
                    Path(args.out.format(round=k)).write_bytes(_raw_bytes(flat))
                _emit(_report(args, k, res, avg, t_start))
        finally:
            if avg is not None:
                await avg.close()
    finally:
        await node.close()
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    _emit({"event": "exit", "rank": args.rank})


def _raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's memory as bytes, without needing numpy (which torch does not require)."""
    t = t.detach().contiguous().cpu()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m p2ptrain.testing.averaging_worker",
                                description="One averaging peer (test/benchmark tool): JSON lines on stdout.")
    p.add_argument("--bootstrap", default="", help="multiaddr of a DHT peer to join through")
    p.add_argument("--rank", type=int, required=True, help="seeds the tensors; echoed in every report")
    p.add_argument("--numel", type=int, required=True)
    p.add_argument("--codec", default="none",
                   help="codec, or a comma list: round k uses the k-th (cycling), from fresh inputs at each change")
    p.add_argument("--weight", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--round-offset", type=int, default=0, help="round ids are offset + k")
    p.add_argument("--client", action="store_true", help="client mode: no listen address, owns no shard")
    p.add_argument("--die-after-bytes", type=int, default=None,
                   help="SIGKILL ourselves after writing this many all-reduce payload bytes in a round")
    p.add_argument("--die-at-once", action="store_true",
                   help="with --die-after-bytes: die at the limit, without letting the written bytes flush")
    p.add_argument("--target-group-size", type=int, default=16)
    p.add_argument("--matchmaking-timeout", type=float, default=10.0)
    p.add_argument("--allreduce-timeout", type=float, default=AllReduceConfig().timeout)
    p.add_argument("--chunk-numel", type=int, default=AllReduceConfig().chunk_numel)
    p.add_argument("--rpc-timeout", type=float, default=DHTConfig().rpc_timeout)
    p.add_argument("--out", default=None,
                   help="write the flat float32 result here after each round ('{round}' in it: the round)")
    p.add_argument("--prefix", default="p2ptrain-worker")
    p.add_argument("--shape-variant", type=int, default=0, help="another variant: another schema")
    p.add_argument("--wait-go", action="store_true", help="wait for a 'go' line on stdin before each round")
    p.add_argument("-v", "--verbose", action="count", default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"%(asctime)s [worker {args.rank} {os.getpid()}] %(levelname)s %(name)s: %(message)s")
    die_with_parent()
    torch.set_num_threads(1)
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(run(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        pass


if __name__ == "__main__":
    main()
