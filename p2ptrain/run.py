"""One training peer: a task, a DHT node and a DecentralizedOptimizer, run until done or stopped.

The examples, ``p2ptrain peer``/``p2ptrain swarm`` and the benchmarks all train through
:func:`run_peer`, so what the tests measure is what a person runs. It is the ordinary loop a user
would write (forward, backward, ``opt.step()``, ``opt.zero_grad()``) plus what a long-running peer
needs: a stop event (Ctrl+C), periodic progress events, an optional emulated compute delay (to
measure utilisation as if the model were bigger) and a final evaluation.

Events are plain dicts handed to ``on_event``: ``started`` (peer id, multiaddr), ``progress``
(about once a second), ``eval`` and ``done``. Callers print them as text, JSON lines or a live view.
``on_round`` (optional) gets one dict per averaging round this peer took part in (or that failed),
for metrics and round logs: see :func:`_round_record`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dht import Host, Multiaddr, relayed_via

from .background import DHT
from .optim import DecentralizedOptimizer
from .optim.fsdp import rank_dht, shard_model
from .optim.ranks import PeerRanks, ddp, rank_device, rank_seed, stopping

log = logging.getLogger("p2ptrain.run")

Event = dict[str, Any]


@dataclass
class PeerConfig:
    """Everything a training peer needs; every field has a default that trains the task sensibly."""

    task: str = "digits"
    task_options: dict[str, Any] = field(default_factory=dict)
    run_id: str | None = None  # default: the task's signature, so different models never meet
    mode: str = "sync"
    compression: str | None = None  # default: none for sync, int8 for diloco
    aggregation: str = "mean"  # or trimmed_mean / median / centered_clip (hostile peers)
    target_batch_size: int = 512
    batch_size: int | None = None  # default: the task's
    local_steps: int = 50  # diloco H
    lr: float | None = None  # default: the task's
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    inner_warmup_steps: int = 0  # diloco: linear inner-lr warmup over this peer's first local steps
    epochs: int = 30  # global epochs (sync) or outer rounds (diloco) to train
    max_steps: int | None = None  # local steps, as a safety bound
    seed: int = 0  # model init: must be the same on every peer
    data_seed: int | None = None  # default: different on every peer
    compute_delay: float = 0.0  # extra seconds per step, to emulate a bigger model
    delay_updates: bool = False
    overlap_outer: bool = False  # diloco: outer rounds run during the next inner steps
    progress_every: float = 1.0
    target_group_size: int = 16
    mixing: bool = True  # a swarm larger than a group averages in a grid of groups that turns every round
    matchmaking_timeout: float = 5.0
    bandwidth: float = 1.0  # declared to groups, relative to the other peers': all-reduce shards are sized by it
    drain: float = 30.0  # at the end, seconds to stay for peers still behind (they load our state)
    device: str = "cpu"  # where the model trains: cpu, cuda, cuda:N (the wire and the state stay on the host)
    fsdp: bool = False  # in a torchrun job: shard the model over the ranks (FSDP2), not replicate it (DDP)
    threads: int | None = None  # torch intra-op threads (default: torch's); 1 when many peers share a machine
    save: str | None = None  # write the final model here (safetensors), atomically
    checkpoint_every: int | None = None  # save a checkpoint every N global epochs (a few peers do)
    data_dir: str | None = None  # checkpoint store (default: $P2PTRAIN_DATA_DIR or the user's cache dir)
    dataset: str | None = None  # train on this dataset CID (p2ptrain.data), read from the swarm
    wait_peers: int = 0  # wait for this many peers before training (a swarm started together)
    wait_timeout: float | None = 60.0  # seconds to wait for them at most (None: until they come or stop)
    bootstrap: Sequence[str | Multiaddr] = ()  # text is parsed once, by p2ptrain.DHT
    listen: tuple[str, int] | None = ("0.0.0.0", 0)  # all interfaces, as p2ptrain.DHT; None: client mode
    announce_host: str | None = None
    key_file: str | None = None
    trusted_writers: Sequence[str] = ()  # PeerIDs whose one checkpoint record makes a run's latest
    name: str | None = None  # announced beside our PeerID with our contribution receipts (p2ptrain.contrib)
    receipts_file: str | None = None  # also append our signed receipts there


def run_peer(cfg: PeerConfig, on_event: Callable[[Event], None] = lambda e: None,
             stop: threading.Event | None = None, dht: DHT | None = None,
             on_round: Callable[[Event], None] | None = None) -> Event:
    """Train until ``cfg.epochs`` global epochs are done (or ``stop`` is set); returns the ``done``
    event, or a ``stopped`` one (no ``started`` event either) when ``stop`` was set before the
    peer had joined. ``dht``: an already started node to use (else one is created from ``cfg``).
    ``on_round``: called in the training thread after each step that finished averaging rounds."""
    from .tasks import get_task

    stop = stop or threading.Event()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    ranks = PeerRanks.detect()  # a torchrun job: its ranks are one peer, rank 0 its leader
    leads = ranks is None or ranks.is_leader
    fsdp = cfg.fsdp and ranks is not None  # (every rank a member of its shard's swarm, with a DHT node)
    if ranks is not None:
        device = rank_device(device)
    task = get_task(cfg.task, **cfg.task_options)
    batch_size = cfg.batch_size or task.default_batch_size
    own_dht = dht is None
    if fsdp:
        dht = rank_dht(list(cfg.bootstrap), ranks, dht, **rank_node_options(cfg, ranks.rank))
    elif dht is None and leads:
        dht = DHT(list(cfg.bootstrap), listen=cfg.listen, key_file=cfg.key_file, announce_host=cfg.announce_host)
    opt: DecentralizedOptimizer | None = None
    dataset = None
    try:
        model = task.make_model(seed=cfg.seed).to(device)  # the same init on every device: built on the host
        # (what the loss runs: DDP averages the ranks' gradients, FSDP shards the model over them)
        trained = model if ranks is None else shard_model(model, device) if fsdp else ddp(model, device)
        opt = DecentralizedOptimizer(
            task.make_optimizer(model.parameters(), lr=cfg.lr), dht=dht, run_id=cfg.run_id or task.signature,
            target_batch_size=cfg.target_batch_size, batch_size_per_step=batch_size, mode=cfg.mode,
            local_steps=cfg.local_steps, outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum,
            inner_warmup_steps=cfg.inner_warmup_steps, compression=cfg.compression,
            aggregation=cfg.aggregation, delay_updates=cfg.delay_updates, overlap_outer=cfg.overlap_outer,
            target_group_size=cfg.target_group_size, mixing=cfg.mixing,
            matchmaking_timeout=cfg.matchmaking_timeout, bandwidth=cfg.bandwidth, checkpoint_every=cfg.checkpoint_every,
            checkpoint_dir=cfg.data_dir, model=model, trusted_writers=cfg.trusted_writers, name=cfg.name,
            receipts_file=cfg.receipts_file,
        )
        if stopping(stop, ranks):  # asked to stop while joining (e.g. Ctrl+C during the state download)
            return {"event": "stopped", "epoch": opt.epoch, "stopped": True}
        if leads:
            on_event({"event": "started", "peer_id": str(dht.peer_id),
                      "multiaddrs": [str(a) for a in dht.multiaddrs], "run_id": opt.run_id, "epoch": opt.epoch,
                      "state_loads": opt.stats.state_loads, "resumed_epoch": opt.stats.resumed_epoch,
                      "params_digest": _digest(opt), "ranks": 1 if ranks is None else ranks.world_size,
                      "config": {k: v for k, v in asdict(cfg).items() if k != "bootstrap"}})
        if cfg.wait_peers > 1 and not _wait_for_peers(opt, cfg, on_event, stop, ranks):
            return {"event": "stopped", "epoch": opt.epoch, "stopped": True}
        data_seed = cfg.data_seed if cfg.data_seed is not None or not leads else \
            int.from_bytes(dht.peer_id.to_bytes()[-4:], "big")
        if ranks is not None:  # the leader's, made different on every rank
            data_seed = rank_seed(ranks.decide(data_seed if leads else None), ranks.rank)
        if cfg.dataset:
            from .data import SwarmDataset

            dataset = SwarmDataset(dht, cfg.dataset, data_dir=cfg.data_dir, server=opt.state_sync.server)
            batches = task.record_batches(iter(dataset), batch_size)
        else:
            batches = task.batches(batch_size, seed=data_seed)
        t0 = time.perf_counter()
        next_report = t0 + cfg.progress_every
        steps, loss_ewma, start_epoch = 0, math.nan, opt.epoch
        seen = _round_counters(opt.stats)
        model.train()
        while True:
            done = opt.epoch >= cfg.epochs or (cfg.max_steps is not None and steps >= cfg.max_steps)
            # (FSDP: the shard swarms' epochs may differ by a step, and a rank that is done must
            # still take part in the model's collectives until all are)
            todo = opt.fsdp.poll(done, stop.is_set()) if fsdp else \
                "stop" if done or stopping(stop, ranks, steps) else "step"
            if todo == "stop":
                break
            x, y = next(batches)
            if device.type != "cpu":
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if ranks is None:
                loss = task.loss(trained, (x, y))
                loss.backward()
            else:  # (DDP talks to the other ranks: a dead one is a RankFailure)
                loss = ranks.forward_backward(lambda: task.loss(trained, (x, y)))
            if cfg.compute_delay > 0:
                time.sleep(cfg.compute_delay)
            if todo == "hold":
                opt.fsdp.hold(batch_size)
            else:
                opt.step()
            opt.zero_grad()
            steps += 1
            if not leads:
                continue
            if on_round is not None and _round_counters(opt.stats) != seen:
                on_round(_round_record(opt, seen))
                seen = _round_counters(opt.stats)
            value = float(loss.detach())
            loss_ewma = value if math.isnan(loss_ewma) else 0.95 * loss_ewma + 0.05 * value
            now = time.perf_counter()
            if now >= next_report:
                next_report = now + cfg.progress_every
                on_event(_progress(opt, loss_ewma, steps, now - t0))
        elapsed = time.perf_counter() - t0
        opt.finish_round()  # (overlapped rounds: the last one in, the model the swarm's outer parameters)
        _drain(opt, cfg, stop)
        model.eval()
        # (an FSDP model gathers its shards to evaluate: a rank that died there is a RankFailure too)
        metrics = task.evaluate(model) if ranks is None else ranks.together(lambda: task.evaluate(model))
        if not leads:
            done = {"event": "done", "rank": ranks.rank, "epoch": opt.epoch, "metrics": metrics, "steps": steps,
                    "params_digest": _digest(opt)}
            if fsdp:  # (every rank averages its own shard with the swarm)
                s = opt.stats
                done.update(rounds=s.rounds, bytes_sent=s.bytes_sent, bytes_received=s.bytes_received)
            on_event(done)
            return done
        done = {**_progress(opt, loss_ewma, steps, elapsed), "event": "done", "metrics": metrics,
                "stopped": stop.is_set(), "epochs_trained": opt.epoch - start_epoch,
                "params_digest": _digest(opt), "links": opt.dht.run(_links(opt.dht.node.host))}
        if cfg.save:
            done["saved"] = save_model(model, cfg.save, {"run_id": opt.run_id, "epoch": str(opt.epoch)})
        on_event(done)
        return done
    finally:
        if dataset is not None:
            dataset.close()
        if opt is not None:
            opt.close()
        if own_dht and dht is not None:
            dht.close()


def _drain(opt: DecentralizedOptimizer, cfg: PeerConfig, stop: threading.Event) -> None:
    """A peer that trained to the end stays until no peer is behind it (``cfg.drain`` s at most,
    ended by ``stop``), so that stragglers load the final state instead of stepping alone."""
    if opt.epoch < cfg.epochs:  # (stopped early: peers behind us are not waiting for our end)
        return
    deadline = time.monotonic() + cfg.drain
    while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
        if opt.drain(min(1.0, left)):
            return


def _wait_for_peers(opt: DecentralizedOptimizer, cfg: PeerConfig, on_event: Callable[[Event], None],
                    stop: threading.Event, ranks: PeerRanks | None) -> bool:
    """Wait until ``cfg.wait_peers`` peers (this one included) are in the run, ``cfg.wait_timeout``
    seconds at most, with a ``waiting`` event about once a second; False when stopped meanwhile.
    ``ranks``: this peer's, which all end the wait when the leader does."""
    t0 = time.monotonic()
    deadline = None if cfg.wait_timeout is None else t0 + cfg.wait_timeout
    step = 0.0  # the first look is immediate: its event says at once that the peer waits
    while not stopping(stop, ranks):
        count = opt.wait_for_peers(cfg.wait_peers, timeout=step)
        now = time.monotonic()
        over = count >= cfg.wait_peers or (deadline is not None and now >= deadline)
        if over if ranks is None else ranks.decide(over):
            return True
        on_event({"event": "waiting", "peers": count, "want": cfg.wait_peers, "seconds": round(now - t0, 1),
                  "timeout": cfg.wait_timeout})
        step = 1.0 if deadline is None else min(1.0, deadline - now)
    return False


def resolve_device(name: str) -> torch.device:
    """``name`` as a torch device, or a one-line ConfigError saying why this machine cannot train there."""
    from dht import ConfigError

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {name!r}: not a device name (use cpu, cuda or cuda:N)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name}: torch {torch.__version__} sees no CUDA device on this machine "
                              "(a CPU-only build, or no driver); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                              f"numbered from 0")
    elif device.type != "cpu":
        raise ConfigError(f"--device {name}: only cpu and cuda are supported")
    return device


def _progress(opt: DecentralizedOptimizer, loss: float, steps: int, elapsed: float) -> Event:
    s, book = opt.stats, opt.contribution
    return {"event": "progress", "epoch": opt.epoch, "loss": None if math.isnan(loss) else round(loss, 5),
            "steps": steps, "samples": s.samples_total, "seconds": round(elapsed, 3),
            "local_sps": round(s.local_sps, 1), "swarm_sps": round(s.swarm_sps, 1), "peers": s.peers,
            "rounds": s.rounds, "group_size": s.last_group_size, "failed_rounds": s.failed_rounds,
            "bytes_sent": s.bytes_sent, "bytes_received": s.bytes_received, "state_loads": s.state_loads,
            "group_values": s.group_values, "owned_values": s.owned_values,
            "local_samples": s.local_samples, "round_s": round(s.last_round_s, 4), "state_rounds": s.state_rounds,
            "overlapped_steps": s.overlapped_steps,
            "dht_peers": len(opt.dht.node.routing), "checkpoints_saved": s.checkpoints_saved,
            "checkpoint_epoch": s.last_checkpoint_epoch, "receipts": book.signed if book else 0,
            "receipt_samples": book.samples if book else 0}


def _round_counters(s: Any) -> tuple[int, int, int, int, int]:
    return s.rounds, s.failed_rounds, s.state_rounds, s.bytes_sent, s.bytes_received


async def _links(host: Host) -> dict[str, list[str]]:
    """The peers we hold a connection to now, by kind: direct (dialed, or hole-punched through
    NAT) or relayed (through a relay's circuit)."""
    links: dict[str, list[str]] = {"direct": [], "relayed": []}
    for conn in host.connections:
        links["direct" if relayed_via(conn) is None else "relayed"].append(str(conn.remote_peer))
    return links


def _round_record(opt: DecentralizedOptimizer, before: tuple[int, int, int, int, int]) -> Event:
    """What the step that just returned did in averaging, from the optimizer's counters: the
    rounds it finished (normally one), their group size and seconds, the bytes they moved, and how
    many failed (a failed round that raised has no group size or duration: those are None)."""
    s = opt.stats
    rounds, failed, state_rounds, sent, received = before
    ok = s.rounds - rounds
    return {"event": "round", "t": round(time.time(), 3), "peer_id": str(opt.dht.peer_id), "run_id": opt.run_id,
            "epoch": opt.epoch, "rounds": ok, "group_size": s.last_group_size if ok else None,
            "seconds": round(s.last_round_s, 4) if ok else None, "bytes_sent": s.bytes_sent - sent,
            "bytes_received": s.bytes_received - received, "failures": s.failed_rounds - failed,
            "state_rounds": s.state_rounds - state_rounds, "peers": s.peers, "samples": s.samples_total,
            "total_rounds": s.rounds, "total_failures": s.failed_rounds}


def save_model(model: torch.nn.Module, path: str, metadata: dict[str, str]) -> str:
    """Write ``model``'s state dict as safetensors, atomically and durably (the checkpoint
    store's writer): a reader (or a crash) never sees a half-written file. Returns the path."""
    import os

    from .checkpoint.safetensors_io import write_safetensors

    target = os.path.abspath(path)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    write_safetensors(target, {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, metadata)
    return target


def rank_node_options(cfg: PeerConfig, rank: int) -> dict[str, Any]:
    """The DHT node options of rank ``rank`` of an FSDP peer: a fixed listen port and the key
    file are the leader's; rank r listens on the port + r and keeps its identity in KEY.rank{r}."""
    listen, key_file = cfg.listen, cfg.key_file
    if rank and listen is not None and listen[1]:
        listen = (listen[0], listen[1] + rank)
    if rank and key_file:
        key_file = f"{key_file}.rank{rank}"
    return {"listen": listen, "key_file": key_file, "announce_host": cfg.announce_host}


@torch.no_grad()
def _digest(opt: DecentralizedOptimizer) -> str:
    """A short hash of the parameters (an FSDP rank's: its shards): peers that end in the same
    state print the same digest."""
    import hashlib

    h = hashlib.blake2b(digest_size=8)
    for p in opt.params:
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
