"""Hostile peers: training accuracy on digits with a quarter of the swarm attacking, mean vs robust
aggregation, against clean training measured in the same run.

    python benchmarks/hostile.py                       # 8 peers (2 hostile), 40 epochs: ~15 min on 2 busy cores
    python benchmarks/hostile.py --peers 4 --epochs 30 --attacks sign_flip

Every peer is a DecentralizedOptimizer in this one process (a thread each, its own DHT node on
127.0.0.1, real encrypted streams), sync mode, the digits task's model/optimizer/lr, batch 32,
``--target-batch-size`` samples per global step. The hostile peers are ordinary peers whose
test-only ``_corrupt`` hook rewrites the gradients they are about to average:

* ``scaled``: their real gradient x100;
* ``sign_flip``: x-100;
* ``random``: gaussian noise, 100x the norm of their real gradient (per tensor);
* ``nan``: NaN on the wire (the service's ``_outgoing`` hook: a peer's own ``run`` refuses NaN input);
* ``owner_tamper``: as the owner of a shard, they send everyone its result x-100
  (``p2ptrain.testbed.hostile.shards``; honest members audit owners under a robust rule);
* ``epoch_claim``: they report epoch 1e9 and serve, under it, a state with lr 1000 and parameters
  x1000 (``p2ptrain.testbed.hostile.state``), then only serve; a peer that believed them would load it;
* ``bandwidth_inflate``: they declare a bandwidth of 1e14, to own the whole vector, and tamper with
  their replies as ``owner_tamper`` does (owning shards is worth it only to set them).

Runs: ``clean/mean`` (nobody hostile), then per attack ``<attack>/mean`` and ``<attack>/<rule>`` for
each ``--rules``. Printed per run: the test accuracy of the honest peers (mean over them; they end
nearly identical), the difference to clean in accuracy points, and how many (peer, reason) exclusions
the honest peers reported. The issue's target: attacked/robust within 5 points of clean.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2ptrain import DHT, DecentralizedOptimizer  # noqa: E402
from p2ptrain.tasks.digits import DigitsTask  # noqa: E402
from p2ptrain.testbed.hostile import MODES  # noqa: E402

ATTACKS = ("scaled", "sign_flip", "random", "nan", "owner_tamper", "bandwidth_inflate", "epoch_claim")


def _shard_attack(attack: str, opt: DecentralizedOptimizer) -> None:
    """Turn ``opt``'s peer into an owner_tamper / bandwidth_inflate attacker."""
    if attack == "bandwidth_inflate":
        MODES["bandwidth_inflate"].run(opt.averager.matchmaker)
    MODES["owner_tamper"].run(opt.averager.service)


def corrupter(attack: str, seed: int):
    """The ``_corrupt`` hook of a hostile peer (None for attacks done on the wire)."""
    gen = torch.Generator().manual_seed(seed)

    def scaled(bufs: list[torch.Tensor]) -> None:
        for b in bufs:
            b.mul_(100.0)

    def sign_flip(bufs: list[torch.Tensor]) -> None:
        for b in bufs:
            b.mul_(-100.0)

    def random(bufs: list[torch.Tensor]) -> None:
        for b in bufs:
            noise = torch.randn(b.shape, generator=gen)
            b.copy_(noise * (100.0 * float(b.norm()) / max(float(noise.norm()), 1e-12)))

    return {"scaled": scaled, "sign_flip": sign_flip, "random": random}.get(attack)


def _nan_wire(owner: int, index: int, views: list[memoryview]) -> list[memoryview]:
    return [memoryview(bytearray(torch.full((len(v) // 4,), float("nan")).numpy().tobytes())) for v in views]


def run_swarm(*, peers: int, hostile: int, attack: str | None, aggregation: str, epochs: int,
              target_batch_size: int = 256, batch_size: int = 32, run_id: str = "hostile",
              timeout: float = 300.0, threads_per_peer: int = 1) -> dict:
    """Train ``peers`` in-process peers (the first ``hostile`` of them attacking with ``attack``) for
    ``epochs`` global steps; returns the honest peers' mean test accuracy and what they reported."""
    torch.set_num_threads(threads_per_peer)
    task = DigitsTask()
    dhts: list[DHT] = []
    opts: list[DecentralizedOptimizer] = []
    models = []
    try:
        for i in range(peers):
            dhts.append(DHT([str(dhts[0].multiaddrs[0])] if dhts else []))
            model = task.make_model(0)  # same init everywhere
            models.append(model)
            opt = DecentralizedOptimizer(
                task.make_optimizer(model.parameters()), dht=dhts[-1], run_id=run_id,
                target_batch_size=target_batch_size, batch_size_per_step=batch_size,
                aggregation=aggregation, matchmaking_timeout=5.0, averaging_timeout=30.0,
            )
            opts.append(opt)
            if i < hostile and attack is not None:
                if attack == "nan":
                    opt.averager.service._outgoing = _nan_wire  # type: ignore[method-assign]
                elif attack in ("owner_tamper", "bandwidth_inflate"):
                    _shard_attack(attack, opt)
                elif attack != "epoch_claim":  # (claimed once every peer is up, below)
                    opt._corrupt = corrupter(attack, seed=1000 + i)
        for o in opts:
            o.wait_for_peers(peers, timeout=30)
        claimants = set(range(hostile)) if attack == "epoch_claim" else set()
        for i in claimants:  # epoch 1e9, lr 1000, parameters x1000, served to whoever believes it
            MODES["epoch_claim"].run(opts[i], 10**9)
        errors: list[BaseException] = []
        deadline = time.monotonic() + timeout

        def train(i: int) -> None:
            try:
                it = task.batches(batch_size, seed=7, rank=i, world=peers)
                opt, model = opts[i], models[i]
                while opt.epoch < epochs and time.monotonic() < deadline and i not in claimants:
                    task.loss(model, next(it)).backward()
                    opt.step()
                    opt.zero_grad()
            except BaseException as e:  # noqa: BLE001 - reported by the caller
                errors.append(e)

        t0 = time.monotonic()
        ths = [threading.Thread(target=train, args=(i,), name=f"peer{i}") for i in range(peers)]
        for t in ths:
            t.start()
        for t in ths:
            t.join(timeout + 30)
        if errors:
            raise errors[0]
        honest = range(hostile if attack else 0, peers)
        accs = [task.evaluate(models[i])["accuracy"] for i in honest]
        return {
            "accuracy": sum(accs) / len(accs),
            "accuracy_min": min(accs),
            "epochs": min(opts[i].epoch for i in honest),
            "excluded": sum(len(opts[i].stats.excluded) for i in honest),
            "excluded_peers": sorted({p for i in honest for p in opts[i].stats.excluded}),
            "excluded_reasons": sorted({w for i in honest for w in opts[i].stats.excluded.values()}),
            "hostile_peers": [str(dhts[i].peer_id) for i in range(hostile if attack else 0)],
            "seconds": time.monotonic() - t0,
        }
    finally:
        for o in opts:
            o.close()
        for d in reversed(dhts):
            d.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--target-batch-size", type=int, default=256)
    ap.add_argument("--attacks", default="scaled,sign_flip,random,nan")
    ap.add_argument("--rules", default="trimmed_mean,centered_clip")
    args = ap.parse_args(argv)
    attacks = [a for a in args.attacks.split(",") if a]
    bad = [a for a in attacks if a not in ATTACKS]
    if bad:
        print(f"error: unknown attack {bad[0]!r}: choose from {', '.join(ATTACKS)}", file=sys.stderr)
        return 2
    rules = [r for r in args.rules.split(",") if r]
    hostile = args.peers // 4
    logging.basicConfig(level=logging.ERROR)
    print(f"digits, {args.peers} peers ({hostile} hostile), sync, {args.epochs} epochs of "
          f"{args.target_batch_size} samples, in one process; torch {torch.__version__}")
    rows = []

    def one(attack: str | None, rule: str) -> dict:
        r = run_swarm(peers=args.peers, hostile=hostile, attack=attack, aggregation=rule, epochs=args.epochs,
                      target_batch_size=args.target_batch_size, run_id=f"h-{attack}-{rule}")
        rows.append((f"{attack or 'clean'}/{rule}", r))
        print(f"  {rows[-1][0]}: accuracy {r['accuracy']:.3f} ({r['seconds']:.0f} s)", file=sys.stderr, flush=True)
        return r

    clean = one(None, "mean")
    for attack in attacks:
        for rule in ["mean", *rules]:
            one(attack, rule)
    base = clean["accuracy"]
    print(f"\n{'run':<26}{'accuracy':>9}{'min':>7}{'vs clean':>10}{'epochs':>8}{'excluded':>10}{'secs':>7}")
    for name, r in rows:
        print(f"{name:<26}{r['accuracy']:>9.3f}{r['accuracy_min']:>7.3f}{100 * (r['accuracy'] - base):>+9.1f}p"
              f"{r['epochs']:>8}{r['excluded']:>10}{r['seconds']:>7.1f}")
    robust = [(n, r) for n, r in rows if not n.endswith("/mean")]
    worst = min((r["accuracy"] for _, r in robust), default=base)
    print(f"\nworst attacked/robust run: {100 * (worst - base):+.1f} points vs clean (target: within 5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
