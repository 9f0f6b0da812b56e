"""``p2ptrain peer``: join a swarm and train one of the built-in examples until done or Ctrl+C."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from dht import ConfigError, DHTError, Multiaddr, SwarmKeyMismatch

from ..background import BOOTSTRAP_ENV
from .common import (ANNOUNCE_HELP, EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, LISTEN_DEFAULT, LISTEN_HELP,
                     SWARM_KEY_ENV, add_peer_cache_args,
                     add_swarm_key_arg, bootstrap_addrs, fail, interrupts, joining, parse_listen, peer_cache_of,
                     split_relayed, swarm_key_of)
from .ckpt_cmd import add_trusted_writers, trusted_writers_of
from .relay_opts import add_relay_args, relay_vias, start_relaying
from .torchrun import add_ranks_args, check_ranks_args, close_worker, init_worker, is_worker, launch


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "peer",
        help="join a swarm (or start one) and train an example model",
        description="Join the swarm through a bootstrap peer (or start a new one) and train; shows one "
        "progress line per second. Ctrl+C leaves cleanly; a second Ctrl+C exits at once.",
    )
    p.add_argument("--bootstrap", action="append", metavar="MULTIADDR",
                   help="peer to join through (repeatable); default: $P2PTRAIN_BOOTSTRAP, else ./bootstrap_peers.txt; "
                   "none: start a new swarm")
    p.add_argument("--bootstrap-file", metavar="PATH", help="file of bootstrap multiaddrs, one per line")
    p.add_argument("--bootstrap-timeout", type=float, default=10.0, metavar="S",
                   help="seconds to keep retrying bootstrap peers that refuse or do not answer (default: %(default)s)")
    p.add_argument("--listen", default=LISTEN_DEFAULT, metavar="MULTIADDR", help=LISTEN_HELP)
    p.add_argument("--announce-host", metavar="HOST", help=ANNOUNCE_HELP)
    p.add_argument("--client", action="store_true",
                   help="client mode, for a peer behind NAT or a firewall: dial out, accept no connections "
                   "(it trains and averages, but owns no shard and serves no state; --listen is ignored)")
    p.add_argument("--behind-nat", action="store_true",
                   help="a full member behind NAT or a firewall: it listens (for hole punching) but announces no "
                   "direct address, is reached through relays (--relay-via, else public peers started with "
                   "--relay), and owns a shard and serves state like a public peer; unlike --client")
    p.add_argument("--key-file", metavar="PATH", help="Ed25519 identity key, kept across restarts (created if missing)")
    add_trusted_writers(p, "a checkpoint in the DHT is the run's latest (what a peer resumes from) when three distinct "
                        "writers signed it, or one of these PeerIDs did (repeatable, or comma-separated); never "
                        "one peer's claim alone")
    add_swarm_key_arg(p)
    add_peer_cache_args(p)
    add_relay_args(p)
    add_training_args(p)
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics on this port (0: any free port, printed at start)")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="address the metrics server binds (default: %(default)s; 0.0.0.0 lets a remote "
                   "Prometheus scrape it)")
    p.add_argument("--round-log", metavar="PATH", help="append one JSON line per averaging round to this file")
    p.add_argument("--name", help="a name for this peer on the run's leaderboard (p2ptrain status --leaderboard); "
                   "a claim shown beside its PeerID, at most 40 printable characters")
    p.add_argument("--receipts-file", metavar="PATH",
                   help="also append the signed receipt of each averaging round to this file (JSON lines)")
    p.add_argument("--script", metavar="PATH",
                   help="run your own training script as this peer instead of --example: it runs as "
                   "__main__ with the bootstrap peers in $P2PTRAIN_BOOTSTRAP, which p2ptrain.DHT() joins")
    p.add_argument("--script-args", default="", metavar="ARGS",
                   help="arguments for --script as one string: --script-args='--lr 0.1 --epochs 5'")
    p.add_argument("--json", action="store_true", help="print events as JSON lines on stdout")
    p.set_defaults(func=main)


#: p2ptrain.compression.CODECS, restated: importing it would import torch for every ``--help``
COMPRESSION_CHOICES = ["none", "fp16", "bf16", "int8", "int8-outlier", "topk"]


def add_training_args(p: argparse.ArgumentParser) -> None:
    """What to train and how: the same flags for ``p2ptrain peer`` and ``p2ptrain swarm``."""
    p.add_argument("--config", metavar="FILE",
                   help="TOML file of options, keys named like the long flags (target_batch_size = 512); "
                   "flags beat $P2PTRAIN_<FLAG> variables (P2PTRAIN_EPOCHS=50), which beat the file")
    p.add_argument("--example", choices=["digits", "char_lm"], default="digits", help="what to train (default: digits)")
    p.add_argument("--run-id", help="swarm run name (default: derived from the example and its options)")
    p.add_argument("--mode", choices=["sync", "diloco"], default="sync", help="default: sync")
    p.add_argument("--epochs", type=int, default=40, help="global epochs to train (default: %(default)s)")
    p.add_argument("--target-batch-size", type=int, default=512, help="swarm samples per global step (sync)")
    p.add_argument("--batch-size", type=int, help="samples per local step (default: the example's)")
    p.add_argument("--local-steps", type=int, default=50, help="local steps per outer round (diloco, default 50)")
    p.add_argument("--compression", choices=COMPRESSION_CHOICES,
                   help="codec on the wire (default: none for sync, int8 for diloco; int8-outlier sends each "
                        "block's 2 largest values exactly: for heavy-tailed updates)")
    p.add_argument("--aggregation", choices=["mean", "trimmed_mean", "median", "centered_clip"], default="mean",
                   help="how a group combines its members' updates: mean (default, trusts every peer) or a "
                        "robust rule that a minority of hostile peers cannot steer; the same on every peer")
    p.add_argument("--lr", type=float, help="inner learning rate (default: the example's)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="diloco: outer Nesterov SGD learning rate (default 0.7)")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="diloco: outer momentum (default 0.9)")
    p.add_argument("--inner-warmup-steps", type=int, default=0, metavar="N",
                   help="diloco: warm the inner lr up linearly over this peer's first N local steps (default 0)")
    p.add_argument("--seed", type=int, default=0, help="model init seed, the same on every peer (default 0)")
    p.add_argument("--data-seed", type=int, help="data order (default: different on every peer)")
    p.add_argument("--dataset", metavar="CID", help="train on this dataset ('p2ptrain data add' printed its CID): "
                   "shards are fetched from the peers that hold it and read about once per epoch across the swarm")
    p.add_argument("--compute-delay", type=float, default=0.0, metavar="S",
                   help="extra seconds per step, to emulate a bigger model (benchmarks)")
    p.add_argument("--delay-updates", action="store_true", help="sync: average in the background, apply one epoch late")
    p.add_argument("--target-group-size", type=int, default=16, metavar="N",
                   help="peers per averaging group (default: %(default)s); a larger swarm averages in a grid of "
                        "groups that changes every round, so that they mix into one model (the same on every peer)")
    p.add_argument("--no-mixing", action="store_true",
                   help="no grid: each round is one key for the whole swarm, split into groups as peers come "
                        "(the same on every peer)")
    p.add_argument("--overlap-outer", action="store_true",
                   help="diloco: run each outer round during the next inner steps instead of pausing for it "
                        "(one more model-sized buffer; the same on every peer)")
    p.add_argument("--bandwidth", type=float, default=1.0, metavar="X",
                   help="this peer's upload bandwidth relative to the swarm's usual peer (default 1.0; 0.5 on a link "
                        "half as fast): the share of each round's all-reduce it serves is sized by it, at most 2x "
                        "the group's median")
    p.add_argument("--wait-peers", type=int, metavar="N",
                   help="wait (up to 60 s) for N peers, this one included, before training, so a swarm started "
                   "together trains together; 1: train at once (default: a peer that starts a new swarm, with no "
                   "bootstrap peer, waits for a second one as long as it takes; a joining peer does not wait)")
    p.add_argument("--device", default="cpu",
                   help="where the model trains: cpu (default), cuda or cuda:N; averaging always runs on the host")
    p.add_argument("--threads", type=int, metavar="N",
                   help="torch threads for this peer (default: torch's; use 1 when several peers share a machine)")
    p.add_argument("--save", metavar="PATH", help="write the trained model there at the end (safetensors, atomic)")
    p.add_argument("--checkpoint-every", type=int, metavar="N",
                   help="save a checkpoint every N global epochs (two peers of the swarm do, chosen without a "
                   "coordinator), serve it to other peers and announce it in the DHT")
    p.add_argument("--data-dir", metavar="DIR",
                   help="checkpoint store: resume from the newest checkpoint (here or in the swarm) when no live "
                   "peer is ahead (default: $P2PTRAIN_DATA_DIR, else ~/.cache/p2ptrain, used with --checkpoint-every)")
    add_ranks_args(p)


def training_argv(args: argparse.Namespace) -> list[str]:
    """The training flags of ``args`` as a command line again (for the peers a swarm starts).

    Values come from flags, ``P2PTRAIN_*`` variables or a config file alike (already merged into
    ``args``); one that a variable also sets is always passed, so the child's flag beats the
    variable it inherits, as the parent's did."""
    import os

    out: list[str] = []
    for action in _TRAINING_ACTIONS:
        if action.dest == "config":
            continue
        value = getattr(args, action.dest)
        inherited = f"P2PTRAIN_{action.dest.upper()}" in os.environ
        if value is None or value is False or (value == action.default and not inherited):
            continue
        out.append(action.option_strings[0])
        if value is not True:
            out.append(str(value))
    return out


def _collect_training_actions() -> list[argparse.Action]:
    parser = argparse.ArgumentParser(add_help=False)
    add_training_args(parser)
    return list(parser._actions)


def check_training_args(args: argparse.Namespace) -> None:
    """A ConfigError for training options that cannot work (``p2ptrain peer`` and ``p2ptrain swarm``,
    which checks them before it starts any peer)."""
    if args.epochs < 1:
        raise ConfigError("--epochs must be at least 1")
    if args.threads is not None and args.threads < 1:
        raise ConfigError("--threads must be at least 1")
    if args.compute_delay < 0:
        raise ConfigError("--compute-delay cannot be negative")
    if not 0 < args.bandwidth < 1e15:
        raise ConfigError("--bandwidth must be a positive number, relative to the usual peer's (1.0); a peer that "
                          "should serve no share of the averaging runs with --client")
    if args.wait_peers is not None and args.wait_peers < 0:
        raise ConfigError("--wait-peers cannot be negative (1 trains at once)")
    check_ranks_args(args)
    from ..optim.options import OptionError, check_options  # (the optimizer's checks, without torch)

    given = {"run_id": args.run_id, "batch_size_per_step": args.batch_size}
    try:
        check_options(mode=args.mode, target_batch_size=args.target_batch_size, local_steps=args.local_steps,
                      outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                      inner_warmup_steps=args.inner_warmup_steps, checkpoint_every=args.checkpoint_every,
                      overlap_outer=args.overlap_outer, target_group_size=args.target_group_size,
                      **{k: v for k, v in given.items() if v is not None})
    except OptionError as e:
        raise ConfigError(e.flag_message) from None
    from ..run import resolve_device  # torch: only once the other options are known to be good

    resolve_device(args.device)  # a CUDA flag on a machine without one fails here, before joining


def _config(args: argparse.Namespace) -> Any:
    check_training_args(args)
    trusted = sorted(map(str, trusted_writers_of(args)))
    if not args.bootstrap_timeout > 0:
        raise ConfigError("--bootstrap-timeout must be a positive number of seconds")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise ConfigError("--metrics-port must be between 0 and 65535 (0: any free port)")
    from ..contrib import check_name

    try:
        check_name(args.name)
    except ValueError as e:
        raise ConfigError(f"--name: {e}") from None
    listen = None if args.client else parse_listen(args.listen)
    bootstrap = bootstrap_addrs(args.bootstrap, args.bootstrap_file)
    if args.behind_nat and (args.client or args.relay or not bootstrap):
        raise ConfigError("--behind-nat " + ("and --client exclude each other: --client owns nothing, --behind-nat "
                                             "is a full member through relays" if args.client else
                                             "cannot --relay: nobody can dial a peer behind NAT" if args.relay else
                                             "needs --bootstrap: its relays are peers of a running swarm"))
    wait_peers, wait_timeout = args.wait_peers, 60.0
    if wait_peers is None:  # the first peer of a new swarm waits for a second, however long it takes
        wait_peers, wait_timeout = (0, 60.0) if bootstrap or args.client else (2, None)
    from ..run import PeerConfig

    return PeerConfig(
        task=args.example, run_id=args.run_id, mode=args.mode, compression=args.compression,
        aggregation=args.aggregation,
        target_batch_size=args.target_batch_size, batch_size=args.batch_size, local_steps=args.local_steps,
        lr=args.lr, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
        inner_warmup_steps=args.inner_warmup_steps, epochs=args.epochs, seed=args.seed, data_seed=args.data_seed,
        compute_delay=args.compute_delay, bandwidth=args.bandwidth,
        delay_updates=args.delay_updates, overlap_outer=args.overlap_outer,
        target_group_size=args.target_group_size, mixing=not args.no_mixing, wait_peers=wait_peers,
        wait_timeout=wait_timeout, device=args.device, fsdp=args.fsdp,
        threads=args.threads, save=args.save,
        checkpoint_every=args.checkpoint_every, data_dir=args.data_dir, dataset=args.dataset,
        bootstrap=bootstrap, listen=listen, announce_host=args.announce_host, key_file=args.key_file,
        trusted_writers=trusted, name=args.name, receipts_file=args.receipts_file,
    )


#: options each peer picks for itself: a joining peer need not repeat them
_PER_PEER = {"data_seed", "threads", "device", "save", "data_dir", "compute_delay", "wait_peers", "checkpoint_every",
             "nproc_per_node", "max_restarts", "bandwidth"}


def join_flags(args: argparse.Namespace) -> list[str]:
    """The flags a peer needs to join this one's run: those that decide the run and the model
    (from flags, variables or the config file alike), and the private swarm's key as given."""
    per_peer = _PER_PEER - ({"nproc_per_node"} if args.fsdp else set())  # (FSDP: the same K on every peer)
    out = training_argv(argparse.Namespace(**{**vars(args), **{k: None for k in per_peer}}))
    if getattr(args, "swarm_key_file", None):
        out += ["--swarm-key-file", args.swarm_key_file]
    return out


def format_metrics(metrics: dict[str, float]) -> str:
    """A final evaluation as one short line: ``acc 95.1%``, ``ppl 12.345 loss 2.513``."""
    names = {"accuracy": "acc", "perplexity": "ppl", "loss": "loss"}
    return " ".join(f"{names.get(k, k)} {v:.1%}" if k == "accuracy" else f"{names.get(k, k)} {v:.3f}"
                    for k, v in metrics.items())


def _printer(as_json: bool, join: Sequence[str] = ()):
    """Events as text (``join``: the flags others add to ``p2ptrain peer --bootstrap ADDR``), or as JSON lines."""
    live = sys.stdout.isatty()
    waited = -1.0  # seconds of the wait last shown (-1: none yet)
    joinable = False  # a join command was printed

    def show(event: dict[str, Any]) -> None:
        nonlocal waited, joinable
        if as_json:
            # one write per line: the ranks of a --nproc-per-node peer share stdout, and print() under
            # python -u writes the newline separately, so two ranks' lines could interleave
            sys.stdout.write(json.dumps(event) + "\n")
            sys.stdout.flush()
            return
        kind = event["event"]
        if kind == "started":
            addrs = event.get("multiaddrs") or []
            direct, circuits = split_relayed(addrs)
            head = f"peer {event['peer_id']} in run {event['run_id']!r} at epoch {event['epoch']}"
            if direct:
                command = shlex.join(["p2ptrain", "peer", "--bootstrap", direct[0], *join])
                print(f"{head}; others join with\n  {command}", flush=True)
                for other in direct[1:]:  # this machine's other addresses (another network, IPv6)
                    print(f"  or with --bootstrap {other}", flush=True)
                joinable = True
            else:  # client mode or behind NAT: others cannot bootstrap through us (a relay address only reaches us)
                why = "behind NAT, reached through relays" if circuits else "client mode: it accepts no connections"
                print(f"{head} ({why}, so others join through another peer)", flush=True)
                for a in circuits:
                    print(f"reachable through a relay at {a}", flush=True)
            if event.get("metrics_url"):
                print(f"metrics at {event['metrics_url']}", flush=True)
        elif kind in ("progress", "done"):
            loss = "-" if event["loss"] is None else f"{event['loss']:.4f}"
            line = (f"epoch {event['epoch']:>4}  loss {loss}  peers {event['peers']}  swarm {event['swarm_sps']:>8.0f} "
                    f"samples/s  local {event['local_sps']:>7.0f}  sent {event['bytes_sent'] / 1e6:.1f} MB  "
                    f"recv {event['bytes_received'] / 1e6:.1f} MB")
            if kind == "progress" and live:  # one line rewritten in place on a terminal
                print("\r" + line, end="", flush=True)
            else:
                tested = f"  test {format_metrics(event['metrics'])}" if event.get("metrics") else ""
                print(("\n" if live else "") + (line if kind == "progress" else f"done: {line}{tested}"), flush=True)
        elif kind == "waiting":
            count, want, seconds = event["peers"], event["want"], event["seconds"]
            if waited < 0:
                more = want - count
                how = f"start {'them' if more != 1 else 'one'} with the command above; " if joinable else ""
                print(f"waiting for {more} more peer{'s' * (more != 1)} before training ({how}--wait-peers 1 "
                      "trains without waiting, Ctrl+C stops)", flush=True)
            if live:  # one line rewritten in place on a terminal
                print(f"\r  waiting {seconds:.0f} s: {count} of {want} peers", end="", flush=True)
            elif waited >= 0 and seconds >= waited + 60:  # elsewhere, a line a minute
                print(f"  waiting {seconds:.0f} s: {count} of {want} peers", flush=True)
            if waited < 0 or seconds >= waited + 60:
                waited = seconds

    return show


def main(args: argparse.Namespace) -> int:
    cfg = _config(args)
    _share_swarm_key(args)
    if args.script:
        return _run_script(args.script, args.script_args, cfg.bootstrap)
    if args.nproc_per_node > 1 and not is_worker():
        return launch(args)
    from ..metrics import PeerMetrics, RoundLog

    round_log = RoundLog.open(args.round_log) if args.round_log else None  # ConfigError when it cannot
    metrics = PeerMetrics() if args.metrics_port is not None else None
    try:
        if metrics is not None:
            try:
                metrics.serve(args.metrics_port, args.metrics_host)
            except OSError as e:
                return fail(f"--metrics-port {args.metrics_port}: cannot serve metrics on "
                            f"{args.metrics_host}:{args.metrics_port}: {e.strerror or e} (another peer or exporter "
                            "on it? pick another port, or 0 for any free one)")
        return _train(args, cfg, metrics, round_log)
    finally:
        if metrics is not None:
            metrics.close()
        if round_log is not None:
            round_log.close()


def _share_swarm_key(args: argparse.Namespace) -> None:
    """The peer's DHT (and a --script's ``p2ptrain.DHT()``) reads the swarm key file from the
    environment: set it to the file this command was given, however it was given (flag, variable
    or config file, already merged and checked), and to nothing when none was."""
    import os

    if args.swarm_key_file:
        os.environ[SWARM_KEY_ENV] = os.path.abspath(os.path.expanduser(args.swarm_key_file))
    else:
        os.environ.pop(SWARM_KEY_ENV, None)


def _run_script(path: str, script_args: str, bootstrap: list[Multiaddr]) -> int:
    """Run a user's training script in this process, as ``python PATH ARGS`` would, with the
    bootstrap peers handed over in ``$P2PTRAIN_BOOTSTRAP`` (``p2ptrain.DHT()`` joins them)."""
    import os
    import runpy
    import shlex

    if not os.path.isfile(path):
        raise ConfigError(f"--script {path!r}: no such file")
    try:
        argv = shlex.split(script_args)
    except ValueError as e:
        raise ConfigError(f"--script-args: {e}") from None
    if bootstrap:
        os.environ[BOOTSTRAP_ENV] = " ".join(map(str, bootstrap))
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_FAILURE)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return EXIT_OK


def _train(args: argparse.Namespace, cfg: Any, metrics: Any, round_log: Any) -> int:
    from ..optim.ranks import RankFailure
    from ..run import run_peer

    show = _printer(args.json, join_flags(args))
    round_hooks = [h for h in (metrics and metrics.on_round, round_log and round_log.write) if h]

    def on_event(event: dict[str, Any]) -> None:
        if metrics is not None:
            metrics.on_event(event)
            if event["event"] == "started":
                event = {**event, "metrics_url": metrics.url}
        show(event)

    def on_round(record: dict[str, Any]) -> None:
        for hook in round_hooks:
            hook(record)

    stop = threading.Event()
    t0 = time.monotonic()
    ranks = init_worker(args.device) if is_worker() else None  # (a rank of a --nproc-per-node peer)
    if ranks is not None and not ranks.is_leader:  # only the leader speaks; the others say where they ended
        on_event = (lambda e: e["event"] == "done" and show(e)) if args.json else (lambda e: None)  # noqa: E731
    try:
        with interrupts(stop.set, "stopping after the current step (Ctrl+C again to exit at once)..."):
            dht = _start_dht(args, cfg) if ranks is None or ranks.is_leader else None
            try:
                done = run_peer(cfg, on_event, stop, dht=dht, on_round=on_round if round_hooks else None)
            finally:
                if dht is not None:
                    dht.close()
                close_worker(ranks)
    except SwarmKeyMismatch as e:  # refused by the swarm: the settings must change, not a retry
        return fail(str(e), EXIT_USAGE)
    except (DHTError, ConfigError) as e:
        return fail(str(e))
    except OSError as e:
        return fail(f"{e.strerror or e} (is the listen address free and valid?)")
    except ValueError as e:  # a setting the trainer refused that no check above caught
        return fail(f"cannot train with these settings: {e}", EXIT_USAGE)
    except RankFailure as e:  # (the optimizer left the swarm already)
        return fail(f"{e}: this peer left the swarm")
    if stop.is_set():
        print(f"left the swarm after {time.monotonic() - t0:.1f} s", file=sys.stderr)
        return EXIT_OK
    return EXIT_OK if done.get("event") == "done" else EXIT_FAILURE


def _start_dht(args: argparse.Namespace, cfg: Any) -> Any:
    """The peer's DHT node, started as ``run_peer`` would start it, plus the peer cache: a default
    of the command line (in the data directory), not of the library, so it is configured here."""
    from dht import DHTConfig

    from ..background import DHT

    config = DHTConfig(peer_cache=peer_cache_of(args, swarm_key_of(args)), bootstrap_timeout=args.bootstrap_timeout)
    vias = relay_vias(args, cfg.listen is not None)
    with joining(cfg.bootstrap, args.bootstrap_timeout):
        dht = DHT(list(cfg.bootstrap), listen=cfg.listen, key_file=cfg.key_file, announce_host=cfg.announce_host,
                  config=config, reachable=not args.behind_nat)
    try:
        if args.relay or vias:
            dht.run(start_relaying(dht.node.host, args.relay, vias), timeout=30)
        if args.behind_nat and not dht.node.host.circuit_addrs:
            raise ConfigError("--behind-nat: no relay took a reservation, so no peer could reach this one; start a "
                              "public peer with --relay, or name one with --relay-via")
    except BaseException:
        dht.close()
        raise
    return dht


_TRAINING_ACTIONS = _collect_training_actions()
