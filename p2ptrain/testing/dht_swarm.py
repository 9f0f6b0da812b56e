"""Run many DHTNodes in a child process, driven by JSON lines: for tests, benchmarks and demos.

Why a child process: a swarm spread over several OS processes exercises real sockets, real
handshakes and real crashes (SIGKILL), which one event loop hosting every node cannot. Why JSON
lines over stdin/stdout: no extra port to find, no pickle, and the child sees EOF on stdin the
moment its parent dies, so it exits instead of lingering as an orphan.

Child (``python -m p2ptrain.testing.dht_swarm``): prints ``{"id": null, "ready": true, "pid": ...}`` once
imported, then answers one JSON line per command line; logs go to stderr. Commands (each carries an
``id`` echoed back; a failure answers ``{"id": .., "error": "one line"}`` and the child lives on):

  start      {"n", "bootstrap": [multiaddr], "config": {DHTConfig overrides}, "client_mode",
              "bootstrap_per_node": m (each node joins through m of the bootstrap addrs, rotating)}
             -> {"addrs": [multiaddr per node], "start_s"}   (nodes start concurrently)
  store      {"node", "key", "value", "ttl", "subkey"} -> {"accepted"}
  get        {"node", "key", "latest"} -> {"value", "hops", "ms"}   (a sub-key dict: {subkey: value})
  get_many   {"gets": [[node, key], ...], "latest", "concurrency": 1} -> {"results": [get replies]}
  republish  {} -> {"nodes"}          stop {"nodes": [i, ...]} -> {"stopped"}          exit {}

Parent: ``async with await SwarmProcess.spawn() as p: await p.request("start", n=4)``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from dht import DHTConfig, DHTNode, Multiaddr, TaskGroup

from ..children import die_with_parent

_LINE_LIMIT = 64 << 20  # get_many replies can be large; the stdio default (64 KiB) is not enough


class SwarmError(RuntimeError):
    """A command failed in the child, or the child died."""


# ---------------------------------------------------------------------------------------- child


class _Swarm:
    def __init__(self) -> None:
        self.nodes: list[DHTNode | None] = []

    def node(self, i: int) -> DHTNode:
        if not (isinstance(i, int) and 0 <= i < len(self.nodes)) or self.nodes[i] is None:
            raise SwarmError(f"no running node {i!r} (have {len(self.nodes)})")
        return self.nodes[i]  # type: ignore[return-value]

    async def op_start(self, n: int, bootstrap: list[str] = (), config: dict | None = None,  # type: ignore[assignment]
                       client_mode: bool = False, bootstrap_per_node: int | None = None) -> dict:
        cfg = DHTConfig(**(config or {}))
        t0 = time.perf_counter()
        new = [DHTNode(listen=None if client_mode else ("127.0.0.1", 0), config=cfg) for _ in range(n)]
        boot = [Multiaddr.parse(a) for a in bootstrap]
        if not boot and new:  # this process hosts the first peer: the others join through it
            await new[0].start()
            boot, rest = [new[0].multiaddrs[0]], new[1:]
        else:
            rest = new
        m = bootstrap_per_node or len(boot)  # a rotating subset spreads hundreds of joins over peers
        subsets = [[boot[(j + x) % len(boot)] for x in range(min(m, len(boot)))] for j in range(len(rest))]
        results = await asyncio.gather(*(nd.start(b) for nd, b in zip(rest, subsets)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(nd.close() for nd in new), return_exceptions=True)
            raise SwarmError(f"{len(errors)}/{n} nodes failed to start: {errors[0]}")
        self.nodes.extend(new)
        addrs = [str(nd.multiaddrs[0]) if nd.multiaddrs else None for nd in new]
        return {"addrs": addrs, "start_s": time.perf_counter() - t0, "first": len(self.nodes) - n}

    async def op_store(self, node: int, key: str, value: Any, ttl: float = 600.0,
                       subkey: str | None = None) -> dict:
        accepted = await self.node(node).store(key, value, time.time() + ttl, subkey=subkey)
        return {"accepted": accepted}

    async def op_get(self, node: int, key: str, latest: bool = False) -> dict:
        nd = self.node(node)
        t0 = time.perf_counter()
        result = await nd.lookup_value(key, latest)
        ms = (time.perf_counter() - t0) * 1e3
        found = DHTNode.decode(result.records)
        if isinstance(found, dict):
            value: Any = {k: v.value for k, v in found.items()}
        else:
            value = None if found is None else found.value
        return {"value": value, "hops": result.hops, "ms": ms}

    async def op_get_many(self, gets: list, latest: bool = False, concurrency: int = 1) -> dict:
        sem = asyncio.Semaphore(max(1, concurrency))

        async def one(node: int, key: str) -> dict:
            async with sem:
                try:
                    return await self.op_get(node, key, latest)
                except Exception as e:  # one failed get is a data point, not a failed batch
                    return {"value": None, "hops": 0, "ms": 0.0, "error": one_line(e)}

        return {"results": await asyncio.gather(*(one(n, k) for n, k in gets))}

    async def op_republish(self) -> dict:
        live = [nd for nd in self.nodes if nd is not None]
        await asyncio.gather(*(nd.republish() for nd in live))
        return {"nodes": len(live)}

    async def op_stop(self, nodes: list[int]) -> dict:
        victims = [self.node(i) for i in nodes]
        for i in nodes:
            self.nodes[i] = None
        await asyncio.gather(*(nd.close() for nd in victims), return_exceptions=True)
        return {"stopped": len(victims)}

    async def close(self) -> None:
        live = [nd for nd in self.nodes if nd is not None]
        self.nodes = []
        try:
            async with asyncio.timeout(3):
                await asyncio.gather(*(nd.close() for nd in live), return_exceptions=True)
        except TimeoutError:
            pass


def one_line(e: BaseException) -> str:
    return (f"{type(e).__name__}: {e}".splitlines() or [type(e).__name__])[0][:500]


def reply(obj: dict) -> None:
    """One JSON line on stdout, flushed (the parent reads replies and events line by line)."""
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


async def serve_commands(target: Any) -> None:
    """The child side of the JSON-lines protocol, for any ``target`` with ``op_<name>(**args)``
    coroutines and ``close()``: says ready, runs each command line on stdin as a task (answered
    ``{"id", **result}`` or ``{"id", "error": "one line"}``), and on ``exit`` or EOF (the parent
    went away) cancels what still runs and closes ``target``."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=_LINE_LIMIT)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tasks = TaskGroup("swarm commands")
    reply({"id": None, "ready": True, "pid": os.getpid()})

    async def handle(msg: dict) -> None:
        ident = msg.pop("id", None)
        try:
            handler = getattr(target, "op_" + str(msg.pop("op", "")), None)
            if handler is None:
                raise SwarmError("unknown op")
            reply({"id": ident, **await handler(**msg)})
        except Exception as e:  # an error answers this command; the child keeps serving
            reply({"id": ident, "error": one_line(e)})

    try:
        while line := await reader.readline():  # EOF: the parent closed stdin or died
            try:
                msg = json.loads(line)
                assert isinstance(msg, dict)
            except (ValueError, AssertionError):
                reply({"id": None, "error": "malformed command line"})
                continue
            if msg.get("op") == "exit":
                reply({"id": msg.get("id")})
                break
            tasks.spawn(handle(msg))
    finally:
        await tasks.close()
        await target.close()


def main() -> None:
    import logging

    logging.basicConfig(level=os.environ.get("SWARMPROC_LOGLEVEL", "WARNING"), stream=sys.stderr,
                        format=f"[swarm {os.getpid()}] %(levelname)s %(name)s: %(message)s")
    die_with_parent()
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(serve_commands(_Swarm()))
    except KeyboardInterrupt:
        pass


# ---------------------------------------------------------------------------------------- parent


class SwarmProcess:
    """Parent-side handle of one swarm child. Always ``close()`` or ``kill()`` it (or use
    ``async with``): a child also exits by itself when our end of its stdin closes."""

    def __init__(self, proc: asyncio.subprocess.Process, spawn_s: float):
        self.proc = proc
        self.pid = proc.pid
        self.spawn_s = spawn_s  # launch -> ready line: interpreter start-up plus imports
        self._pending: dict[int, asyncio.Future] = {}
        self._next = 0
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def spawn(cls, timeout: float = 30.0, stderr: Any = None, env: dict | None = None) -> SwarmProcess:
        env = dict(os.environ if env is None else env)
        root = str(Path(__file__).resolve().parents[2])  # the folder holding dht/ and p2ptrain/
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        t0 = time.perf_counter()
        # -P: a dht/ or p2ptrain/ folder in the working directory shadows nothing
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-P", "-m", "p2ptrain.testing.dht_swarm", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=stderr, env=env, limit=_LINE_LIMIT)
        try:
            async with asyncio.timeout(timeout):
                line = await proc.stdout.readline()  # type: ignore[union-attr]
            if not json.loads(line or b"{}").get("ready"):
                raise SwarmError(f"swarm child {proc.pid} did not start (exit code {await proc.wait()})")
        except BaseException:
            _kill(proc)
            await proc.wait()
            raise
        return cls(proc, time.perf_counter() - t0)

    async def _read(self) -> None:
        try:
            while line := await self.proc.stdout.readline():  # type: ignore[union-attr]
                msg = json.loads(line)
                fut = self._pending.pop(msg.pop("id", None), None)
                if fut is not None and not fut.done():
                    if "error" in msg:
                        fut.set_exception(SwarmError(msg["error"]))
                    else:
                        fut.set_result(msg)
        finally:
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(SwarmError(f"swarm child {self.pid} exited"))
            self._pending.clear()

    async def request(self, op: str, timeout: float | None = 60.0, **kw: Any) -> dict:
        """Send one command and wait for its reply; raises SwarmError on an error reply."""
        if self._reader.done() or self.proc.stdin is None or self.proc.stdin.is_closing():
            raise SwarmError(f"swarm child {self.pid} is not running")
        self._next += 1
        ident = self._next
        fut = asyncio.get_running_loop().create_future()
        self._pending[ident] = fut
        self.proc.stdin.write(json.dumps({"id": ident, "op": op, **kw}).encode() + b"\n")
        try:
            async with asyncio.timeout(timeout):
                return await fut
        finally:
            self._pending.pop(ident, None)

    def kill(self) -> None:
        """SIGKILL the child: a crash, as far as its peers can tell."""
        _kill(self.proc)

    async def close(self, timeout: float = 5.0) -> None:
        """Ask the child to exit; SIGKILL it if it has not within ``timeout``."""
        if self.proc.returncode is None:
            try:
                if self.proc.stdin is not None and not self.proc.stdin.is_closing():
                    self.proc.stdin.write(b'{"op":"exit"}\n')
                    self.proc.stdin.close()
                await asyncio.wait_for(self.proc.wait(), timeout)
            except (TimeoutError, OSError):
                self.kill()
            except BaseException:
                self.kill()
                raise
        await self.proc.wait()
        self._reader.cancel()

    async def __aenter__(self) -> SwarmProcess:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    main()
