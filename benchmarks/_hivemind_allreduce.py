"""Baseline: one member of a hivemind 1.1.12 ``DecentralizedAverager`` group, driven by
``allreduce_bench.py --hivemind-python PY`` (run with that interpreter, never imported by p2ptrain).
The parent starts rank 0 first and hands the others its multiaddrs as ``peers``.

Make the interpreter with ``python3 -m venv V && V/bin/pip install torch==2.13.0 hivemind==1.1.12
'numpy<2.4'``: with numpy 2.4 hivemind's 8-bit codecs break silently (the round "succeeds" and
leaves the tensors unaveraged), which is why every round here is checked, not only timed.

Protocol with the parent (JSON lines): we read ``{"rank", "n", "numel", "codec", "rounds", "peers",
"tag"}``, print ``{"maddrs": [...]}`` once our DHT is up, then per round read "go", form the group
(matchmaking is *not* timed: ``require_trigger``), print ``{"formed": true}``, read "run", run the
all-reduce and print ``{"t": seconds, "ok": bool, "err"/"mae": max/mean |result - expected| at sampled
indices, "averaged": bool}``.
Member r's tensor is ``randn(numel, seed=r)``; the expected average is recomputed from the seeds.
Exit code 3: hivemind is not importable.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    try:
        import hivemind
        import torch
        from hivemind.averaging.control import AveragingStage
        from hivemind.compression import Float16Compression, NoCompression, Uniform8BitQuantization
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"error": f"cannot import hivemind: {e!r}"}), flush=True)
        sys.exit(3)
    import logging

    logging.getLogger("hivemind").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    job = json.loads(sys.stdin.readline())
    rank, n, numel, codec_name = job["rank"], job["n"], job["numel"], job["codec"]
    compression = {"none": NoCompression, "fp16": Float16Compression, "int8": Uniform8BitQuantization}[codec_name]()
    dht = hivemind.DHT(initial_peers=job.get("peers") or None, start=True, nat_port_map=False,
                       host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    print(json.dumps({"maddrs": [str(a) for a in dht.get_visible_maddrs()]}), flush=True)
    orig = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    idx = torch.randint(0, numel, (4096,), generator=torch.Generator().manual_seed(12345))
    expected = torch.zeros(len(idx))
    for r in range(n):
        expected += torch.randn(numel, generator=torch.Generator().manual_seed(r))[idx]
    expected /= n
    averager = hivemind.averaging.DecentralizedAverager(
        [orig.clone()], dht, prefix=f"bench{job['tag']}", target_group_size=n, min_group_size=n,
        min_matchmaking_time=2.0, request_timeout=10.0, compression=compression, start=True,
    )
    try:
        for _ in range(job["rounds"]):
            sys.stdin.readline()  # "go"
            with averager.get_tensors() as ts:
                ts[0].copy_(orig)
            control = averager.step(wait=False, require_trigger=True, timeout=300)
            while control.stage != AveragingStage.AWAITING_TRIGGER and not control.done():
                time.sleep(0.005)
            print(json.dumps({"formed": not control.done()}), flush=True)
            sys.stdin.readline()  # "run": everyone formed its group
            t = time.perf_counter()
            control.allow_allreduce()
            try:
                ok = control.result(timeout=600) is not None
            except Exception:  # noqa: BLE001
                ok = False
            dt = time.perf_counter() - t
            with averager.get_tensors() as ts:
                diff = (ts[0][idx] - expected).abs()
            # hivemind's Uniform8Bit clips the tails (max error ~2 on randn even when it works), so
            # "averaged" means: far closer to the average than our own unaveraged input is
            mae_local = float((orig[idx] - expected).abs().mean())
            print(json.dumps({"t": dt, "ok": ok, "err": float(diff.max()), "mae": float(diff.mean()),
                              "averaged": float(diff.mean()) < 0.25 * mae_local}), flush=True)
    finally:
        averager.shutdown()
        dht.shutdown()


if __name__ == "__main__":
    main()
