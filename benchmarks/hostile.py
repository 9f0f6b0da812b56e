"""Hostile peers: training accuracy on digits with a quarter of the swarm attacking, mean vs robust
aggregation, against clean training measured in the same run.

    python benchmarks/hostile.py                       # 8 peers (2 hostile), 40 epochs: ~15 min on 2 busy cores
    python benchmarks/hostile.py --peers 4 --epochs 30 --attacks sign_flip

Every peer is a DecentralizedOptimizer in this one process (a thread each, its own DHT node on
127.0.0.1, real encrypted streams), sync mode, the digits task's model/optimizer/lr, batch 32,
``--target-batch-size`` samples per global step. The hostile peers are ordinary peers that rewrite
the gradients they are about to average (``p2ptrain.testing.hostile``'s ``gradient_rewrite``):

* ``scaled``: their real gradient x100;
* ``sign_flip``: x-100;
* ``random``: gaussian noise, 100x the norm of their real gradient (per tensor);
* ``nan``: NaN on the wire (the service's ``_outgoing`` extension point: a peer's own ``run`` refuses NaN input);
* ``owner_tamper``: as the owner of a shard, they send everyone its result x-100
  (``p2ptrain.testing.hostile.shards``; honest members audit owners under a robust rule);
* ``epoch_claim``: they report epoch 1e9 and serve, under it, a state with lr 1000 and parameters
  x1000 (``p2ptrain.testing.hostile.state``), then only serve; a peer that believed them would load it;
* ``bandwidth_inflate``: they declare a bandwidth of 1e14, to own the whole vector, and tamper with
  their replies as ``owner_tamper`` does (owning shards is worth it only to set them);
* ``latest_claim``: every peer checkpoints every 5 epochs; 5 epochs before the end the whole swarm
  stops, the two attackers sign one checkpoint of theirs (parameters x1000, lr 1000) as the run's
  latest at epoch 2**63-1 and serve it, and the honest peers restart from fresh models, resume
  from what they believe is the run's latest and train the last 5 epochs;
* ``plain_value_poison``: they train honestly and store unsigned plain values with a 24 h TTL
  under the run's progress key and the matchmaking keys (round and schemas) of their next 4
  epochs, and serve them to every lookup of those keys.

Runs: ``clean/mean`` (nobody hostile), then per attack ``<attack>/mean`` and ``<attack>/<rule>`` for
each ``--rules``. Printed per run: the test accuracy of the honest peers (mean over them; they end
nearly identical), the difference to clean in accuracy points, and how many (peer, reason) exclusions
the honest peers reported. Targets (issue 27): attacked/robust within 2 points of clean; under
``mean`` the state and checkpoint takeovers (``epoch_claim``, ``latest_claim``) fail as well.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2ptrain import DHT, DecentralizedOptimizer  # noqa: E402
from p2ptrain.checkpoint import build_snapshot, restore  # noqa: E402
from p2ptrain.checkpoint.store import CheckpointStore  # noqa: E402
from p2ptrain.tasks.digits import DigitsTask  # noqa: E402
from p2ptrain.testing.hostile import MODES  # noqa: E402

ATTACKS = ("scaled", "sign_flip", "random", "nan", "owner_tamper", "bandwidth_inflate", "epoch_claim",
           "latest_claim", "plain_value_poison")


def _shard_attack(attack: str, opt: DecentralizedOptimizer) -> None:
    """Turn ``opt``'s peer into an owner_tamper / bandwidth_inflate attacker."""
    if attack == "bandwidth_inflate":
        MODES["bandwidth_inflate"].run(opt.averager.matchmaker)
    MODES["owner_tamper"].run(opt.averager.service)


def corrupter(attack: str, seed: int):
    """What a hostile peer does to the gradients it averages (None for attacks done otherwise)."""
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


def _poisoned_checkpoint(opt: DecentralizedOptimizer) -> tuple[dict, dict]:
    """``opt``'s checkpoint state with parameters x1000 and lr 1000, and the manifest meta an honest
    checkpoint of the run carries (so that it loads)."""
    with opt._state_lock:
        _, state = opt._checkpoint_state([t.detach().clone() for t in opt._model_extra()])
        manifest, buffer = build_snapshot(state, {})
    evil = restore(manifest, buffer, copy=True)
    evil["params"] = [p * 1000.0 for p in evil["params"]]
    for group in evil["inner"]["param_groups"]:
        group["lr"] = 1000.0
    assert opt.checkpointer is not None
    return evil, {**opt.checkpointer.labels, **opt.checkpointer.meta}


class _Poisoner(threading.Thread):
    """``plain_value_poison`` of the run's progress key and of the matchmaking (round and schema)
    keys of the peer's next few epochs, as they come, until stopped."""

    def __init__(self, dht: DHT, opt: DecentralizedOptimizer, run_id: str, ahead: int = 4):
        super().__init__(name=f"poison-{dht.peer_id.short()}", daemon=True)
        self.dht, self.opt, self.run_id, self.ahead = dht, opt, run_id, ahead
        self.stop = threading.Event()
        self.done: set[str] = set()

    def run(self) -> None:
        mm = self.opt.averager.matchmaker
        while not self.stop.is_set():
            epoch = self.opt.epoch
            keys = [f"{self.run_id}/progress", *(k for e in range(epoch, epoch + self.ahead)
                                                   for k in (mm.round_key(f"e{e}"), mm.schemas_key(f"e{e}")))]
            for key in keys:
                if key not in self.done and not self.stop.is_set():
                    try:
                        self.dht.run(MODES["plain_value_poison"].run(self.dht.node, key), timeout=10)
                    except Exception:  # noqa: BLE001 - an attacker keeps going
                        continue
                    self.done.add(key)
            self.stop.wait(0.2)


def run_swarm(*, peers: int, hostile: int, attack: str | None, aggregation: str, epochs: int,
              target_batch_size: int = 256, batch_size: int = 32, run_id: str = "hostile",
              timeout: float = 300.0, threads_per_peer: int = 1) -> dict:
    """Train ``peers`` in-process peers (the first ``hostile`` of them attacking with ``attack``) for
    ``epochs`` global steps; returns the honest peers' mean test accuracy and what they reported.
    ``latest_claim``: every peer checkpoints every 5 epochs; after epoch ``epochs - 5`` all stop,
    the attackers claim a poisoned checkpoint as the run's latest, and the honest peers restart
    (fresh models, same stores), resume and train to ``epochs``."""
    torch.set_num_threads(threads_per_peer)
    task = DigitsTask()
    honest = range(hostile if attack else 0, peers)
    dhts: list[DHT] = []
    opts: list[DecentralizedOptimizer] = []
    models: list[torch.nn.Module] = []
    poisoners: list[_Poisoner] = []
    services: list[tuple[DHT, Any]] = []  # the attackers' checkpoint services
    tmp = tempfile.TemporaryDirectory(prefix="p2ptrain-hostile-")
    ckpt = {"checkpoint_every": 5} if attack == "latest_claim" else {}

    def make(i: int, seed: int = 0) -> DecentralizedOptimizer:
        model = task.make_model(seed)  # the same init everywhere
        opt = DecentralizedOptimizer(
            task.make_optimizer(model.parameters()), dht=dhts[i], run_id=run_id,
            target_batch_size=target_batch_size, batch_size_per_step=batch_size,
            aggregation=aggregation, matchmaking_timeout=5.0, averaging_timeout=30.0,
            **({**ckpt, "checkpoint_dir": Path(tmp.name) / f"peer{i}"} if ckpt else {}),
        )
        if i < len(models):
            models[i], opts[i] = model, opt
        else:
            models.append(model)
            opts.append(opt)
        return opt

    def train_all(ids: Iterable[int], until: int, deadline: float) -> None:
        errors: list[BaseException] = []

        def train(i: int) -> None:
            try:
                it = task.batches(batch_size, seed=7, rank=i, world=peers)
                opt, model = opts[i], models[i]
                while opt.epoch < until and time.monotonic() < deadline:
                    task.loss(model, next(it)).backward()
                    opt.step()
                    opt.zero_grad()
            except BaseException as e:  # noqa: BLE001 - reported by the caller
                errors.append(e)

        ths = [threading.Thread(target=train, args=(i,), name=f"peer{i}") for i in ids]
        for t in ths:
            t.start()
        for t in ths:
            t.join(max(1.0, deadline - time.monotonic()) + 30)
        if errors:
            raise errors[0]

    try:
        for i in range(peers):
            dhts.append(DHT([str(dhts[0].multiaddrs[0])] if dhts else []))
            opt = make(i)
            if i < hostile and attack is not None:
                if attack == "nan":
                    opt.averager.service._outgoing = _nan_wire
                elif attack in ("owner_tamper", "bandwidth_inflate"):
                    _shard_attack(attack, opt)
                elif attack == "plain_value_poison":
                    poisoners.append(_Poisoner(dhts[i], opt, run_id))
                elif attack not in ("epoch_claim", "latest_claim"):  # (claims come later, below)
                    MODES["gradient_rewrite"].run(opt, corrupter(attack, seed=1000 + i))
        for o in opts:
            o.wait_for_peers(peers, timeout=30)
        for poisoner in poisoners:
            poisoner.start()
        claimants = set(range(hostile)) if attack == "epoch_claim" else set()
        for i in claimants:  # epoch 1e9, lr 1000, parameters x1000, served to whoever believes it
            MODES["epoch_claim"].run(opts[i], 10**9)
        deadline = time.monotonic() + timeout
        t0 = time.monotonic()
        first = epochs - 5 if attack == "latest_claim" else epochs
        train_all([i for i in range(peers) if i not in claimants], first, deadline)
        resumed: list[int | None] = []
        if attack == "latest_claim":  # the swarm stops; two attackers claim the run's latest; the rest restart
            evil, meta = _poisoned_checkpoint(opts[0])
            for o in opts:
                o.close()
            for i in range(hostile):
                service = dhts[i].run(MODES["latest_claim"].run(
                    dhts[i].node, CheckpointStore(Path(tmp.name) / f"evil{i}"), run_id, evil, meta=meta, ttl=600),
                    timeout=30)
                services.append((dhts[i], service))
            # a restart a few seconds later: sooner, the rounds re-run from the checkpoint would meet
            # their own entries of before the stop (done, alive for timeout + 2 s) and end alone
            time.sleep(8.0)
            restarts = [threading.Thread(target=make, args=(i, 1)) for i in honest]  # together, as after an outage
            for t in restarts:  # (another init: what each trains from comes from a checkpoint)
                t.start()
            for t in restarts:
                t.join()
            resumed = [opts[i].stats.resumed_epoch for i in honest]
            for i in honest:
                opts[i].wait_for_peers(len(honest), timeout=30)
            train_all(honest, epochs, deadline)
        accs = [task.evaluate(models[i])["accuracy"] for i in honest]
        return {
            "accuracy": sum(accs) / len(accs),
            "accuracy_min": min(accs),
            "epochs": min(opts[i].epoch for i in honest),
            "excluded": sum(len(opts[i].stats.excluded) for i in honest),
            "excluded_peers": sorted({p for i in honest for p in opts[i].stats.excluded}),
            "excluded_reasons": sorted({w for i in honest for w in opts[i].stats.excluded.values()}),
            "hostile_peers": [str(dhts[i].peer_id) for i in range(hostile if attack else 0)],
            "resumed": resumed,
            "seconds": time.monotonic() - t0,
        }
    finally:
        for poisoner in poisoners:
            poisoner.stop.set()
            poisoner.join(15)
        for o in opts:
            o.close()
        for dht, service in services:
            dht.run(service.close(), timeout=10)
        for d in reversed(dhts):
            d.close()
        tmp.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--target-batch-size", type=int, default=256)
    ap.add_argument("--attacks", default=",".join(ATTACKS))
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
        resumed = f", resumed at {r['resumed']}" if r["resumed"] else ""
        print(f"  {rows[-1][0]}: accuracy {r['accuracy']:.3f} ({r['seconds']:.0f} s{resumed})", file=sys.stderr,
              flush=True)
        return r

    clean = one(None, "mean")
    for attack in attacks:
        for rule in ["mean", *rules]:
            one(attack, rule)
    base = clean["accuracy"]
    print(f"\n{'run':<34}{'accuracy':>9}{'min':>7}{'vs clean':>10}{'epochs':>8}{'excluded':>10}{'secs':>7}")
    for name, r in rows:
        print(f"{name:<34}{r['accuracy']:>9.3f}{r['accuracy_min']:>7.3f}{100 * (r['accuracy'] - base):>+9.1f}p"
              f"{r['epochs']:>8}{r['excluded']:>10}{r['seconds']:>7.1f}")
    robust = [(n, r) for n, r in rows if not n.endswith("/mean")]
    worst = min((r["accuracy"] for _, r in robust), default=base)
    print(f"\nworst attacked/robust run: {100 * (worst - base):+.1f} points vs clean (target: within 2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
