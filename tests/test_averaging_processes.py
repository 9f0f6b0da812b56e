"""Averaging between real OS processes on 127.0.0.1: exact means, crashes mid-round, schemas,
client mode, a lone peer.

Each peer is a ``python -m p2ptrain.testing.averaging_worker`` child (see its docstring): it joins the
bootstrap DHT node this test runs in its own event loop, averages deterministic tensors (seeded by
its rank, so the test recomputes every input), and reports each round as a JSON line. Workers wait
for a ``go`` line before each round, so that slow process start-ups do not eat into matchmaking.
The fixture kills and reaps every child, even when a test fails or times out, and checks that no
child process is left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from dht import DHTNode
from p2ptrain.testing.averaging_worker import flat_input

ROOT = Path(__file__).resolve().parent.parent
DHT_CONFIG_FLAGS = ["--rpc-timeout", "2.0", "-v"]


@dataclass(eq=False)
class Worker:
    rank: int
    proc: asyncio.subprocess.Process
    stderr_path: Path
    out_path: Path
    lines: asyncio.Queue = field(default_factory=asyncio.Queue)  # (arrival time, parsed JSON line)
    ready: dict = field(default_factory=dict)
    reader: asyncio.Task | None = None

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            self.lines.put_nowait((time.monotonic(), msg))
        self.lines.put_nowait((time.monotonic(), None))  # EOF

    async def next(self, event: str, timeout: float) -> tuple[float, dict]:
        async with asyncio.timeout(timeout):
            while True:
                t, msg = await self.lines.get()
                if msg is None:
                    raise AssertionError(f"worker {self.rank} ended (exit code {await self.proc.wait()}) "
                                         f"before '{event}'; stderr:\n{self.stderr()[-3000:]}")
                if msg.get("event") == event:
                    return t, msg

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")

    def result(self, round_: int = 0) -> torch.Tensor:
        path = Path(str(self.out_path).format(round=round_))
        return torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.float32)

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    @property
    def peer_id(self) -> str:
        return self.ready["peer_id"]


Spawn = Callable[..., Awaitable[list[Worker]]]


@pytest.fixture
async def bootstrap() -> AsyncIterator[str]:
    node = DHTNode(listen=("127.0.0.1", 0))
    await node.start()
    try:
        yield str(node.multiaddrs[0])
    finally:
        await node.close()


@pytest.fixture
async def spawn(bootstrap: str, tmp_path: Path, child_pids) -> AsyncIterator[Spawn]:
    """Starts workers (and waits for their ready lines); on teardown kills and reaps all of them
    and checks that none is left."""
    workers: list[Worker] = []
    before = child_pids()
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")

    async def _spawn(ranks: list[int], *, numel: int, extra: dict[int, list[str]] | None = None,
                     common: list[str] = (), ready_timeout: float = 40.0) -> list[Worker]:  # type: ignore[assignment]
        new = []
        for r in ranks:
            err = tmp_path / f"worker{r}.stderr"
            out = tmp_path / f"worker{r}.round{{round}}.f32"
            argv = [sys.executable, "-m", "p2ptrain.testing.averaging_worker", "--bootstrap", bootstrap,
                    "--rank", str(r),
                    "--numel", str(numel), "--weight", str(r + 1), "--out", str(out), "--wait-go",
                    *DHT_CONFIG_FLAGS, *common, *(extra or {}).get(r, [])]
            with open(err, "wb") as ferr:
                proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE,
                                                            stdout=asyncio.subprocess.PIPE, stderr=ferr, env=env)
            w = Worker(r, proc, err, out)
            w.reader = asyncio.get_running_loop().create_task(w._read())
            workers.append(w)
            new.append(w)
        t0 = time.monotonic()
        for w in new:
            _, w.ready = await w.next("ready", ready_timeout)
        print(f"\n{len(new)} workers ready in {time.monotonic() - t0:.1f} s", flush=True)
        return new

    try:
        yield _spawn
    finally:
        for w in workers:
            if w.proc.returncode is None:
                try:
                    w.proc.kill()
                except ProcessLookupError:
                    pass
        await asyncio.gather(*(asyncio.wait_for(w.proc.wait(), 10) for w in workers), return_exceptions=True)
        for w in workers:
            if w.reader is not None:
                w.reader.cancel()
        await asyncio.gather(*(w.reader for w in workers if w.reader is not None), return_exceptions=True)
        leftover = child_pids() - before
        assert not leftover, f"child processes left behind: {sorted(leftover)}"
        assert all(w.proc.returncode is not None for w in workers)


async def run_round(workers: list[Worker], round_: int = 0, timeout: float = 30.0) -> list[dict]:
    for w in workers:
        w.go()
    replies = await asyncio.gather(*(w.next("round", timeout) for w in workers))
    for w, (_, msg) in zip(workers, replies):
        assert msg["round"] == round_ and msg["rank"] == w.rank
    print(f"round {round_}: " + ", ".join(f"{m['rank']}: mm {m['matchmaking_s']:.2f} s ar {m['allreduce_s']:.2f} s"
                                          for _, m in replies), flush=True)
    return [msg for _, msg in replies]


async def finish(workers: list[Worker]) -> None:
    """Close the workers' stdin: each exits by itself, cleanly (exit code 0)."""
    for w in workers:
        assert w.proc.stdin is not None
        w.proc.stdin.close()
    codes = await asyncio.gather(*(asyncio.wait_for(w.proc.wait(), 10) for w in workers))
    assert codes == [0] * len(workers), [(w.rank, c, w.stderr()[-2000:]) for w, c in zip(workers, codes) if c]


def weighted_mean(ranks: list[int], numel: int) -> torch.Tensor:
    xs = torch.stack([flat_input(r, numel).double() for r in ranks])
    ws = torch.tensor([r + 1.0 for r in ranks], dtype=torch.float64)
    return ((xs * ws[:, None]).sum(0) / ws.sum()).float()


def rank_map(workers: list[Worker], report: dict) -> dict[int, int]:
    """Group rank -> worker rank, from the members of a round report."""
    by_peer = {w.peer_id: w.rank for w in workers}
    return {g: by_peer[p] for g, p in enumerate(report["members"])}


# ---------------------------------------------------------------------------------------- tests


@pytest.mark.timeout(60)
async def test_four_processes_average_exactly_with_each_codec(spawn: Spawn) -> None:
    numel, ranks = 100_003, [0, 1, 2, 3]
    codecs = ["none", "int8", "fp16"]
    async with asyncio.timeout(55):
        workers = await spawn(ranks, numel=numel, common=["--codec", ",".join(codecs), "--rounds", "3",
                                                          "--matchmaking-timeout", "8"])
        inputs = torch.stack([flat_input(r, numel) for r in ranks])
        absmax = float(inputs.abs().max())
        mean = weighted_mean(ranks, numel)
        for k, codec in enumerate(codecs):
            reports = await run_round(workers, k)
            results = [w.result(k) for w in workers]
            for rep, res in zip(reports, results):
                assert rep["group_size"] == 4, rep
                assert rep["failed"] == {} and rep["not_averaged"] == [], rep
                assert all(s["status"] == "ok" for s in rep["shards"])
                assert res.shape == (numel,)
            for res in results[1:]:  # every member holds the same bits (the owners' encodings)
                assert torch.equal(res, results[0]), codec
            err = (results[0] - mean).abs()
            if codec == "none":
                torch.testing.assert_close(results[0], mean, atol=1e-5, rtol=0)
            elif codec == "int8":
                # reduce (each part quantized) + gather (the mean quantized): absmax/254 per block each
                bound = 2 * absmax / 254
                assert float(err.max()) <= bound, (float(err.max()), bound)
                assert float(err.mean()) <= bound / 8, (float(err.mean()), bound)
            else:  # fp16: relative rounding 2^-11, once on each input part and once on the mean
                bound = 2 * absmax * 2.0**-11 + 1e-7
                assert float(err.max()) <= bound, (float(err.max()), bound)
                assert float(err.mean()) <= bound / 8
        await finish(workers)


@pytest.mark.timeout(100)
async def test_eight_processes_one_crashes_mid_round(spawn: Spawn) -> None:
    numel, n, victim = 4_000_000, 8, 5
    chunk = 65_536  # several chunks per shard, so that the victim's parts arrive partially
    cn = -(-chunk // 256) * 256  # as allreduce.py rounds chunk_numel
    # what the victim writes in a round: its 7 parts (reduce), then its shard to 7 peers (gather)
    volume = 2 * (n - 1) / n * numel * 4
    die_after = int(0.3 * volume)  # ~60% into the reduce phase: a crash mid-round
    async with asyncio.timeout(90):
        workers = await spawn(list(range(n)), numel=numel,
                              common=["--chunk-numel", str(chunk), "--matchmaking-timeout", "10",
                                      "--allreduce-timeout", "30"],
                              extra={victim: ["--die-after-bytes", str(die_after)]})
        survivors = [w for w in workers if w.rank != victim]
        dead = workers[victim]
        t_go = time.monotonic()
        for w in workers:
            w.go()
        await asyncio.wait_for(dead.proc.wait(), 30)
        t_kill = time.monotonic()
        assert dead.proc.returncode == -signal.SIGKILL, (dead.proc.returncode, dead.stderr()[-2000:])
        done = await asyncio.gather(*(w.next("round", 30) for w in survivors))
        t_done = [t for t, _ in done]
        reports = [msg for _, msg in done]
        assert dead.reader is not None
        await asyncio.wait_for(dead.reader, 5)
        dead_lines = [dead.lines.get_nowait()[1] for _ in range(dead.lines.qsize())]
        assert not [m for m in dead_lines if m and m.get("event") == "round"]  # no report from the victim
        assert not Path(str(dead.out_path).format(round=0)).exists()  # it never finished the round

        after_kill = sorted(t - t_kill for t in t_done)
        p95 = float(torch.tensor(after_kill).quantile(0.95))
        print(f"\nchurn: victim killed {t_kill - t_go:.2f} s after go; survivors done after the kill: "
              f"min {after_kill[0]:.3f} s, p50 {float(torch.tensor(after_kill).median()):.3f} s, p95 {p95:.3f} s, "
              f"max {after_kill[-1]:.3f} s; all done {max(t_done) - t_go:.2f} s after go; "
              f"allreduce_s {[round(r['allreduce_s'], 2) for r in reports]}")
        assert max(t_done) - t_go < 20, after_kill

        inputs = {r: flat_input(r, numel) for r in range(n)}
        results = {w.rank: w.result(0) for w in survivors}
        ok_values: dict[int, torch.Tensor] = {}  # shard owner (group rank) -> the averaged values
        expected_cache: dict[tuple, torch.Tensor] = {}
        partial_seen = 0  # (survivor, shard) pairs whose average holds some chunks of the victim's part
        for w, rep in zip(survivors, reports):
            assert rep["group_size"] == n, rep
            ranks = rank_map(workers, rep)
            inv = {wr: g for g, wr in ranks.items()}
            vg = inv[victim]
            assert str(vg) in rep["failed"], rep["failed"]
            assert rep["not_averaged"] == [vg], rep
            res = results[w.rank]
            for s in rep["shards"]:
                a, b = s["start"], s["end"]
                if s["owner"] == vg:
                    assert s["status"] == "failed" and s["averaged"] == 0, s
                    torch.testing.assert_close(res[a:b], inputs[w.rank][a:b], atol=0, rtol=0)
                    continue
                assert s["status"] == "ok", s
                contrib = {ranks[g] for g in s["contributors"]}
                partial = {ranks[int(g)]: c for g, c in s["partial"].items()}
                # the chunks of its part that arrived whole before the crash count, the rest not
                assert 0 <= partial.get(victim, 0) < -(-(b - a) // cn), s
                partial_seen += partial.get(victim, 0) > 0
                key = (a, b, frozenset(contrib), frozenset(partial.items()))
                if key not in expected_cache:  # the same for every survivor (the owner's summary)
                    expected = expected_cache[key] = torch.empty(b - a)
                    for c, ca in enumerate(range(a, b, cn)):
                        cb = min(ca + cn, b)
                        members = sorted(r for r in range(n) if r in contrib or c < partial.get(r, 0))
                        ws = torch.tensor([r + 1.0 for r in members], dtype=torch.float64)
                        xs = torch.stack([inputs[r][ca:cb].double() for r in members])
                        expected[ca - a : cb - a] = ((xs * ws[:, None]).sum(0) / ws.sum()).float()
                expected = expected_cache[key]
                torch.testing.assert_close(res[a:b], expected, atol=1e-5, rtol=0)
                if s["owner"] in ok_values:  # every survivor holds the very same bits
                    assert torch.equal(res[a:b], ok_values[s["owner"]]), s
                else:
                    ok_values[s["owner"]] = res[a:b].clone()
        assert len(ok_values) == n - 1
        # How many whole chunks of the victim reached an owner before the reset depends on timing.
        print(f"  shards averaged with a partial part of the victim: {partial_seen // len(survivors)}")
        await finish(survivors)


@pytest.mark.timeout(60)
async def test_schema_mismatch_never_groups_and_is_explained(spawn: Spawn) -> None:
    numel = 20_000
    async with asyncio.timeout(55):
        workers = await spawn([0, 1, 2, 3], numel=numel, common=["--matchmaking-timeout", "4"],
                              extra={2: ["--shape-variant", "1"], 3: ["--shape-variant", "1"]})
        assert workers[0].ready["schema"] == workers[1].ready["schema"] != workers[2].ready["schema"]
        reports = await run_round(workers)
        schema_of = {w.peer_id: w.ready["schema"] for w in workers}
        for w, rep in zip(workers, reports):
            # each peer groups with same-schema peers only (here: its pair), never across
            assert {schema_of[p] for p in rep["members"]} == {w.ready["schema"]}, rep
            assert rep["group_size"] == 2, rep
        torch.testing.assert_close(workers[0].result(), weighted_mean([0, 1], numel), atol=1e-5, rtol=0)
        torch.testing.assert_close(workers[2].result(), weighted_mean([2, 3], numel), atol=1e-5, rtol=0)
        # the mismatch is explained, in the report and in the log, naming the other peer
        explained = 0
        for w, rep in zip(workers, reports):
            others = {x.peer_id for x in workers if x.ready["schema"] != w.ready["schema"]}
            for peer, why in rep["mismatches"].items():
                assert peer in others and "different model" in why, why
                assert peer in w.stderr()
                explained += 1
        assert explained >= 1, [(r["rank"], r["mismatches"]) for r in reports]
        await finish(workers)


@pytest.mark.timeout(45)
async def test_client_mode_peer_gets_the_mean_and_owns_no_shard(spawn: Spawn) -> None:
    numel, client = 50_000, 2
    async with asyncio.timeout(40):
        workers = await spawn([0, 1, 2], numel=numel, common=["--matchmaking-timeout", "6"],
                              extra={client: ["--client"]})
        assert workers[client].ready["addr"] is None
        reports = await run_round(workers)
        mean = weighted_mean([0, 1, 2], numel)
        for w, rep in zip(workers, reports):
            assert rep["group_size"] == 3 and rep["failed"] == {} and rep["not_averaged"] == [], rep
            torch.testing.assert_close(w.result(), mean, atol=1e-5, rtol=0)
            cg = rank_map(workers, rep)
            client_g = next(g for g, r in cg.items() if r == client)
            assert all(s["owner"] != client_g for s in rep["shards"]), rep["shards"]
            # the owners' shards still cover the whole vector
            spans = sorted((s["start"], s["end"]) for s in rep["shards"])
            assert spans[0][0] == 0 and spans[-1][1] == numel
            assert all(x[1] == y[0] for x, y in zip(spans, spans[1:]))
        assert reports[client]["shards"] and reports[client]["bytes_sent"] > 0  # it did send its parts
        await finish(workers)


@pytest.mark.timeout(40)
async def test_lone_peer_returns_alone_within_its_timeout(spawn: Spawn) -> None:
    numel, mm_timeout = 10_000, 2.0
    async with asyncio.timeout(35):
        (w,) = await spawn([0], numel=numel, common=["--matchmaking-timeout", str(mm_timeout)])
        t0 = time.monotonic()
        (rep,) = await run_round([w], timeout=mm_timeout + 10)
        elapsed = time.monotonic() - t0
        assert rep["group_size"] == 1 and rep["members"] == [w.peer_id], rep
        assert rep["total_s"] <= mm_timeout + 0.5, rep["total_s"]
        assert elapsed <= mm_timeout + 2.0, elapsed
        assert torch.equal(w.result(), flat_input(0, numel))  # untouched
        await finish([w])
