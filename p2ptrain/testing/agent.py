"""What runs inside a test bed host: a DHT/averaging node driven by JSON lines, or a client-mode trainer.

Why a module of its own: the loopback helpers (``dht_swarm``, ``averaging_worker`` beside it) listen
on 127.0.0.1, which no other namespace can reach, and ``p2ptrain peer`` has no client mode.
Here every node listens on the host's own address (``--listen IP``) or on nothing (``--client``).

``python -m p2ptrain.testing.agent node --listen IP|--client`` speaks ``dht_swarm``'s JSON-lines
protocol (:func:`.dht_swarm.serve_commands`): it prints ``{"id": null, "ready": true, "pid"}``,
then answers one JSON line per command line on stdin (each carries an ``id`` echoed back; a failure
answers ``{"id", "error": "one line"}`` and the node lives on). Commands:

  start    {"bootstrap": [multiaddr], "config": {DHTConfig overrides}} -> {"addr" (None: client), "peer_id"}
  store    {"key", "value", "ttl"} -> {"accepted"}
  get      {"key"} -> {"value", "hops"}
  warm     {} -> {}   (imports torch and the averaging code; see ``op_warm``)
  average  {"prefix", "rank", "numel", "weight", "expected", "timeout"} -> {"group_size", "weight_total",
           "values": the averaged flat tensor (``worker.flat_input(rank, numel)`` before the round)}
  exit     {} -> {}   (then the node closes and the process exits)

``python -m p2ptrain.testing.agent train --client --bootstrap ADDR [...]`` trains the digits example
like ``p2ptrain peer --json`` (the same :func:`p2ptrain.run.run_peer`, the same JSON events), with
a DHT node that accepts no connections.

Both exit when stdin reaches EOF or their parent dies (PR_SET_PDEATHSIG), so a test that dies
leaves nothing behind even outside a test bed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import threading
import time
from typing import Any

from ..children import die_with_parent
from .dht_swarm import reply, serve_commands

__all__ = ["main"]


class _Node:
    """One DHTNode and the commands a test sends it."""

    def __init__(self, listen: str | None) -> None:
        self.listen = listen
        self.node: Any = None

    async def op_start(self, bootstrap: list[str] = (), config: dict | None = None) -> dict:  # type: ignore[assignment]
        from dht import DHTConfig, DHTNode, Multiaddr

        if self.node is not None:
            raise RuntimeError("already started")
        node = DHTNode(listen=None if self.listen is None else (self.listen, 0), config=DHTConfig(**(config or {})))
        await node.start([Multiaddr.parse(a) for a in bootstrap])
        self.node = node
        return {"addr": str(node.multiaddrs[0]) if node.multiaddrs else None, "peer_id": str(node.peer_id)}

    def _started(self) -> Any:
        if self.node is None:
            raise RuntimeError("not started: send 'start' first")
        return self.node

    async def op_store(self, key: str, value: Any, ttl: float = 300.0) -> dict:
        return {"accepted": await self._started().store(key, value, time.time() + ttl)}

    async def op_get(self, key: str) -> dict:
        from dht import DHTNode

        result = await self._started().lookup_value(key)
        found = DHTNode.decode(result.records)
        value = {k: v.value for k, v in found.items()} if isinstance(found, dict) else getattr(found, "value", None)
        return {"value": value, "hops": result.hops}

    async def op_warm(self) -> dict:
        """Import torch and the averaging code now (a DHT-only node never pays for them). Sent to
        every node before an ``average`` that starts them together: otherwise each imports at its
        ``average``, in its event loop, and on a loaded machine the imports' lengths differ by more
        than matchmaking waits for a late peer (the group formed without the slowest importer)."""
        import torch  # noqa: F401

        import p2ptrain.averaging  # noqa: F401
        return {}

    async def op_average(self, prefix: str, rank: int, numel: int, weight: float = 1.0,
                         expected: int | None = None, timeout: float = 30.0) -> dict:
        import torch

        from p2ptrain.averaging import Averager
        from p2ptrain.averaging.round_types import AllReduceConfig
        from p2ptrain.testing.averaging_worker import flat_input

        torch.set_num_threads(1)  # imported here: a DHT-only node never pays for torch
        tensor = flat_input(rank, numel)
        async with Averager(self._started(), prefix, {"x": tensor}, matchmaking_timeout=timeout,
                            allreduce_config=AllReduceConfig(timeout=timeout)) as avg:
            res = await avg.step(weight, round_id=0, timeout=timeout, expected=expected)
        return {"group_size": res.group_size, "weight_total": res.weight_total, "failed": res.failed,
                "not_averaged": list(res.not_averaged), "values": tensor.tolist()}

    async def close(self) -> None:
        if self.node is not None:
            await self.node.close()


def _train(args: argparse.Namespace) -> int:
    """A client-mode ``p2ptrain peer --json``: the same run_peer, the same events on stdout."""
    from p2ptrain.run import PeerConfig, run_peer

    stop = threading.Event()

    def watch_stdin() -> None:  # EOF on stdin (the parent went away): finish the step and leave
        sys.stdin.read()
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    cfg = PeerConfig(task="digits", epochs=args.epochs, data_seed=args.data_seed, wait_peers=args.wait_peers,
                     threads=args.threads, compute_delay=args.compute_delay, bootstrap=args.bootstrap, listen=None)
    done = run_peer(cfg, reply, stop)
    return 0 if done.get("event") == "done" else 1


def main(argv: list[str] | None = None) -> int:
    import logging

    p = argparse.ArgumentParser(prog="python -m p2ptrain.testing.agent", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("node", help="a DHT/averaging node driven by JSON lines on stdin")
    where = n.add_mutually_exclusive_group(required=True)
    where.add_argument("--listen", metavar="IP", help="listen on this address (a port the kernel picks)")
    where.add_argument("--client", action="store_true", help="client mode: accept no connections")
    t = sub.add_parser("train", help="a client-mode digits trainer, JSON events on stdout")
    t.add_argument("--client", action="store_true", required=True, help="(the only mode: no listen address)")
    t.add_argument("--bootstrap", action="append", required=True, metavar="MULTIADDR")
    t.add_argument("--epochs", type=int, default=30)
    t.add_argument("--data-seed", type=int, default=None)
    t.add_argument("--wait-peers", type=int, default=0)
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--compute-delay", type=float, default=0.0, metavar="S", help="extra seconds per step")
    args = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("P2PT_AGENT_LOGLEVEL", "WARNING"), stream=sys.stderr,
                        format=f"[agent {os.getpid()}] %(levelname)s %(name)s: %(message)s")
    die_with_parent()
    gc.freeze()  # (as the CLI does: the imports' heap stays out of every collection)
    if args.cmd == "train":
        return _train(args)
    try:
        asyncio.run(serve_commands(_Node(None if args.client else args.listen)))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
