"""One matchmaking peer for benchmarks/wan_matchmaking.py (not a public tool): a round per ``go``.

    python benchmarks/_mm_worker.py --listen HOST [--bootstrap MULTIADDR] --expected N [--tree DIR]

Prints ``{"event": "ready", "addr"}`` once its DHT node has joined, then for each ``go`` line on
stdin one ``{"event": "round", "round", "size", "group", "seconds", "marks"}`` (``Matchmaker.last_stats``;
no marks from code older than them). Uses only ``DHTNode`` and ``Matchmaker``, so ``--tree`` may
name an older checkout of the project, whose code it then runs: the benchmark's baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def run(a: argparse.Namespace) -> None:
    import torch

    from dht import DHTNode, Multiaddr
    from p2ptrain.averaging.matchmaking import Matchmaker
    from p2ptrain.averaging.schema import tensor_schema

    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    node = DHTNode(listen=(a.listen, 0))
    await node.start([Multiaddr.parse(a.bootstrap)] if a.bootstrap else [])
    mm = Matchmaker(node, "wan-matchmaking", tensor_schema([("w", torch.zeros(64))], "none"))
    _emit({"event": "ready", "addr": str(node.multiaddrs[0])})
    k = 0
    try:
        while line := await stdin.readline():  # (EOF: the benchmark is done, or gone)
            if line.strip() != b"go":
                continue
            group = await mm.form_group(f"r{k}", timeout=a.timeout, expected=a.expected)
            stats = mm.last_stats
            _emit({"event": "round", "round": k, "size": group.size, "group": group.group_id.hex(),
                   "seconds": stats.get("seconds"), "marks": stats.get("marks", {})})
            k += 1
    finally:
        await mm.close()
        await node.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--listen", required=True, help="the address to listen on (the test bed host's)")
    ap.add_argument("--bootstrap", default="")
    ap.add_argument("--expected", type=int, required=True, help="peers per round, us included")
    ap.add_argument("--timeout", type=float, default=5.0, help="matchmaking timeout per round, s")
    ap.add_argument("--tree", default="", help="run the dht and p2ptrain packages of this checkout")
    a = ap.parse_args()
    if a.tree:
        sys.path.insert(0, a.tree)
    asyncio.run(run(a))


if __name__ == "__main__":
    main()
