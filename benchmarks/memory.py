"""A peer's host memory beyond a plain torch process, in units of the model's fp32 bytes.

    python benchmarks/memory.py                              # 85M model, sync and diloco
    python benchmarks/memory.py --models 85m 350m --modes sync diloco

For each model and mode: one plain torch process (forward, backward, AdamW step; no p2ptrain)
trains the model for ``--steps`` steps, then a swarm of two peers (real processes on 127.0.0.1,
``DecentralizedOptimizer`` around the same AdamW) trains it for as many local steps, averaging every
``--every`` local steps (sync: a global step per ``--every`` local steps of both peers; diloco:
H = ``--every``). Each process reports its peak RSS (``VmHWM``); the figure is

    (peer peak RSS - plain peak RSS) / (the model's parameters x 4 bytes)

the larger of the two peers. Targets (issue 29, model on the CPU): sync <= 1.5, diloco <= 3.0.

Each peer also prints where its memory goes (``DecentralizedOptimizer.memory_report()``: the
buffers it holds, by name) and its peak RSS per phase (start-up, first round, steady state:
``VmHWM`` is reset between phases through ``/proc/self/clear_refs``).

The plain process and the two peers run one after the other (the peers together), so their
memory does not add up on this machine; ``--tokens`` and ``--batch`` keep the compute short.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _procs import Children, peak_rss, run_main, sigterm_as_exit  # noqa: E402

#: name -> (d_model, layers, heads): GPT-style CharTransformer sizes (context 256)
MODELS = {"tiny": (64, 2, 4), "85m": (768, 12, 12), "350m": (1024, 28, 16)}
TARGETS = {"sync": 1.5, "diloco": 3.0}
#: the options beside the default modes (no target: each holds one more model-sized buffer by design)
VARIANTS = {"sync": {}, "diloco": {}, "sync-delay": {"delay_updates": True}, "diloco-overlap": {"overlap_outer": True}}


def _reset_peak() -> None:
    """Start a new peak-RSS phase (Linux: writing 5 to clear_refs resets VmHWM)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _emit(**event) -> None:
    print(json.dumps(event), flush=True)


def _model(name: str):
    import torch

    from p2ptrain.tasks.char_lm import CharTransformer

    torch.manual_seed(0)
    d, layers, heads = MODELS[name]
    return CharTransformer(context=256, d_model=d, layers=layers, heads=heads)


def _batches(a: argparse.Namespace, seed: int):
    import torch

    from p2ptrain.tasks.char_lm import VOCAB

    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randint(0, VOCAB, (a.batch, a.tokens + 1), generator=g)
        yield x[:, :-1], x[:, 1:]


def _train_step(model, x, y) -> None:
    import torch.nn.functional as F

    logits = model(x)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()


def child_plain(a: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(a.threads)
    model = _model(a.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = _batches(a, 0)
    for _ in range(a.steps):
        x, y = next(data)
        _train_step(model, x, y)
        opt.step()
        opt.zero_grad()
    _emit(event="done", peak=peak_rss(), numel=sum(p.numel() for p in model.parameters()))


def child_peer(a: argparse.Namespace) -> None:
    import torch

    from p2ptrain import DHT, DecentralizedOptimizer

    torch.set_num_threads(a.threads)
    model = _model(a.model)
    dht = DHT([a.bootstrap] if a.bootstrap else [], listen=("127.0.0.1", 0))
    _emit(event="started", multiaddrs=[str(m) for m in dht.multiaddrs])
    kw = dict(mode=a.mode.split("-")[0], **VARIANTS[a.mode], batch_size_per_step=a.batch,
              target_batch_size=2 * a.every * a.batch, local_steps=a.every, matchmaking_timeout=30.0)
    opt = DecentralizedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4), dht=dht,
                                 run_id=f"mem-{a.model}", model=model, **kw)
    phases = {"start": peak_rss()}
    opt.wait_for_peers(2, timeout=120)
    _reset_peak()
    data = _batches(a, 1 + int(a.bootstrap is not None))
    first_round = None
    for step in range(a.steps):
        x, y = next(data)
        _train_step(model, x, y)
        opt.step()
        opt.zero_grad()
        if first_round is None and opt.epoch > 0:
            first_round = step
            phases["first round"] = peak_rss()
            _reset_peak()
    phases["steady"] = peak_rss()
    report = opt.memory_report()
    _emit(event="done", peak=max(phases.values()), phases=phases, report=report, epoch=opt.epoch)
    opt.close()
    dht.close()


def _child(a: argparse.Namespace, role: str, model: str, mode: str, boot: str | None = None) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--role", role, "--model", model, "--mode", mode,
            "--steps", str(a.steps), "--every", str(a.every), "--batch", str(a.batch), "--tokens", str(a.tokens),
            "--threads", str(a.threads)]
    return argv + (["--bootstrap", boot] if boot else [])


def measure(a: argparse.Namespace, model: str, mode: str) -> dict:
    with Children(f"mem-{model}-{mode}") as kids:
        kids.spawn("plain", _child(a, "plain", model, mode))
        _, _, plain = kids.wait_for(lambda n, e: n == "plain" and e.get("event") == "done", timeout=a.timeout)
        kids.wait_exit(["plain"], 30)
        kids.spawn("p0", _child(a, "peer", model, mode))
        _, _, ev = kids.wait_for(lambda n, e: n == "p0" and e.get("event") == "started", timeout=120)
        kids.spawn("p1", _child(a, "peer", model, mode, ev["multiaddrs"][0]))
        peers = {}
        while len(peers) < 2:
            name, _, e = kids.wait_for(lambda n, e: e.get("event") == "done" and n not in peers, timeout=a.timeout)
            peers[name] = e
        kids.wait_exit(["p0", "p1"], 60)
    fp32 = 4 * plain["numel"]
    worst = max(peers.values(), key=lambda e: e["peak"])
    return {"model": model, "mode": mode, "numel": plain["numel"], "plain": plain["peak"],
            "peers": peers, "ratio": (worst["peak"] - plain["peak"]) / fp32, "worst": worst}


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["85m"], choices=sorted(MODELS))
    p.add_argument("--modes", nargs="+", default=["sync", "diloco"], choices=list(VARIANTS))
    p.add_argument("--steps", type=int, default=20,
                   help="local steps per process (default 20: a state round in both modes)")
    p.add_argument("--every", type=int, default=2, help="local steps between rounds (default 2)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--tokens", type=int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a process may take (default 900)")
    p.add_argument("--role", choices=["plain", "peer"], help=argparse.SUPPRESS)
    p.add_argument("--model", default="85m", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="sync", help=argparse.SUPPRESS)
    p.add_argument("--bootstrap", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role == "plain":
        return child_plain(a)
    if a.role == "peer":
        return child_peer(a)
    sigterm_as_exit()
    print(f"{'model':>6} {'mode':>7} {'params':>8} {'plain peak':>11} {'peer peak':>10} {'extra / fp32 model':>19} "
          f"{'target':>7}", flush=True)
    for model in a.models:
        for mode in a.modes:
            t0 = time.monotonic()
            r = measure(a, model, mode)
            target = TARGETS.get(mode)
            ok = "" if target is None else "ok" if r["ratio"] <= target else "MISSED"
            shown = f"<= {target}" if target else "-"
            print(f"{model:>6} {mode:>7} {r['numel'] / 1e6:7.1f}M {_gb(r['plain']):>11} {_gb(r['worst']['peak']):>10} "
                  f"{r['ratio']:19.2f} {shown:>7} {ok}  ({time.monotonic() - t0:.0f} s)", flush=True)
            fp32 = 4 * r["numel"]
            for name, e in sorted(r["peers"].items()):
                phases = ", ".join(f"{k} {(v - r['plain']) / fp32:+.2f}" for k, v in e["phases"].items())
                print(f"    {name}: epoch {e['epoch']}; peak RSS by phase, beyond plain / fp32 model: {phases}")
                held = ", ".join(f"{k} {v / fp32:.2f}" for k, v in e["report"].items() if v)
                print(f"        holds (/ fp32 model): {held}", flush=True)


if __name__ == "__main__":
    run_main(main)
