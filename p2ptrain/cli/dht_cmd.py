"""``p2ptrain dht``: run a DHT-only peer (e.g. a bootstrap node), get/put one record, or create a
private swarm's key (``p2ptrain dht swarm-key FILE``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from typing import Any

from dht import ConfigError, DHTConfig, DHTNode, Identity

from .common import (ANNOUNCE_HELP, EXIT_OK, LISTEN_DEFAULT, LISTEN_HELP, SWARM_KEY_ENV, add_peer_cache_args,
                     add_swarm_key_arg, bootstrap_addrs, joining, parse_listen, peer_cache_of, run, split_relayed,
                     swarm_key_of, until)
from .relay_opts import add_relay_args, relay_vias, start_relaying


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dht",
        help="run a DHT-only peer (a bootstrap node), or inspect records with get/put",
        description="Run a DHT-only peer and print its full multiaddr, for others to --bootstrap from. "
        "With 'get' or 'put', join as a client, do one operation and exit.",
    )
    p.add_argument("action", nargs="?", choices=["run", "get", "put", "swarm-key"], default="run",
                   help="run (default): serve until Ctrl+C; get KEY; put KEY VALUE; swarm-key FILE: create a new "
                   "private swarm's key (mode 0600), for --swarm-key-file")
    p.add_argument("args", nargs="*", help="KEY for get; KEY VALUE for put (VALUE parsed as JSON when it is JSON)")
    p.add_argument("--listen", default=LISTEN_DEFAULT, metavar="MULTIADDR", help=LISTEN_HELP)
    p.add_argument("--announce-host", metavar="HOST", help=ANNOUNCE_HELP)
    p.add_argument("--bootstrap", action="append", metavar="MULTIADDR",
                   help="peer to join through (repeatable); default: $P2PTRAIN_BOOTSTRAP, else ./bootstrap_peers.txt")
    p.add_argument("--bootstrap-file", metavar="PATH", help="file of bootstrap multiaddrs, one per line")
    p.add_argument("--key-file", metavar="PATH",
                   help="Ed25519 identity key (created with mode 0600 if missing; default: a fresh identity)")
    p.add_argument("--client", action="store_true", help="client mode: accept no inbound connections")
    add_relay_args(p)
    p.add_argument("--subkey", help="get/put: a sub-key of KEY (dictionary entry)")
    p.add_argument("--ttl", type=float, default=3600.0,
                   help="put: seconds until the record expires (default: %(default)s)")
    p.add_argument("--latest", action="store_true", help="get: ask all k closest peers and merge")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for bootstrap (default: %(default)s)")
    add_swarm_key_arg(p)
    add_peer_cache_args(p)
    p.set_defaults(func=main)


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, bytes):
        return obj.hex()
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def _new_swarm_key(args: argparse.Namespace) -> int:
    from dht import SwarmKey

    if len(args.args) != 1:
        raise ConfigError("usage: p2ptrain dht swarm-key FILE (creates FILE; it must not exist)")
    key = SwarmKey.generate()
    key.save(args.args[0])
    print(f"wrote a new swarm key to {args.args[0]} (mode 0600, fingerprint {key.fingerprint}); copy it to every "
          f"peer of the swarm and start them with --swarm-key-file {args.args[0]}", file=sys.stderr)
    return EXIT_OK


def main(args: argparse.Namespace) -> int:
    if args.action == "swarm-key":
        return _new_swarm_key(args)
    if args.action == "get" and len(args.args) != 1:
        raise ConfigError("usage: p2ptrain dht get KEY [--subkey S] --bootstrap MULTIADDR")
    if args.action == "put" and len(args.args) != 2:
        raise ConfigError("usage: p2ptrain dht put KEY VALUE [--subkey S] [--ttl SECONDS] --bootstrap MULTIADDR")
    if args.action == "run" and args.args:
        raise ConfigError(f"unexpected arguments {' '.join(args.args)!r}; did you mean 'dht get' or 'dht put'?")
    boot = bootstrap_addrs(args.bootstrap, args.bootstrap_file)
    if args.action != "run" and not boot:
        raise ConfigError("get/put need a swarm: give --bootstrap MULTIADDR (or entries in bootstrap_peers.txt)")
    listen = None if (args.client or args.action != "run") else parse_listen(args.listen)
    vias = relay_vias(args, listen is not None) if args.action == "run" else []
    if args.key_file is not None:
        from ..config import check_key_file

        check_key_file(args.key_file)
    identity = Identity.load_or_create(args.key_file)
    announce = args.announce_host
    swarm_key = swarm_key_of(args)
    config = DHTConfig(bootstrap_timeout=args.timeout, peer_cache=peer_cache_of(args, swarm_key))

    async def session(stop: asyncio.Event) -> int:
        node = DHTNode(identity, listen, config=config, announce_host=announce, swarm_key=swarm_key)
        try:
            with joining(boot, args.timeout):
                await node.start(boot)
            relay = await start_relaying(node.host, args.relay and args.action == "run", vias, args.timeout)
            if relay is not None:
                print("relaying for peers that accept no connections", file=sys.stderr)
            if args.action == "get":
                return await _get(node, args)
            if args.action == "put":
                return await _put(node, args)
            return await _serve(node, stop, first=not boot,
                                key_file=args.swarm_key_file or os.environ.get(SWARM_KEY_ENV))
        finally:
            await node.close()

    return run(session)


async def _get(node: DHTNode, args: argparse.Namespace) -> int:
    value = await node.get(args.args[0], latest=args.latest or args.subkey is not None)
    if isinstance(value, dict) and args.subkey is not None:
        value = value.get(args.subkey)
    if value is None:
        print(f"not found: {args.args[0]}" + (f"[{args.subkey}]" if args.subkey else ""), file=sys.stderr)
        return 1
    if isinstance(value, dict):
        out = {k: {"value": _jsonable(v.value), "expires_in": round(v.expiration - time.time(), 1)}
               for k, v in value.items()}
    else:
        out = {"value": _jsonable(value.value), "expires_in": round(value.expiration - time.time(), 1)}
    print(json.dumps(out, indent=2))
    return EXIT_OK


async def _put(node: DHTNode, args: argparse.Namespace) -> int:
    key, value = args.args
    held = len(node.storage)
    accepted = await node.store(key, _parse_value(value), time.time() + args.ttl, subkey=args.subkey)
    # this short-lived client keeps a copy too, which leaves with it: count only the swarm's peers
    accepted -= len(node.storage) > held
    print(json.dumps({"key": key, "subkey": args.subkey, "stored_on_peers": accepted}))
    return EXIT_OK if accepted > 0 else 1


async def _serve(node: DHTNode, stop: asyncio.Event, first: bool, key_file: str | None = None) -> int:
    addrs = [str(a) for a in node.multiaddrs]
    print(f"peer id: {node.peer_id}", file=sys.stderr)
    if node.host.swarm_key is not None:
        print(f"private swarm: swarm key fingerprint {node.host.swarm_key.fingerprint}", file=sys.stderr)
    if first:
        print("no bootstrap peers given: this is the first peer of a new swarm", file=sys.stderr)
    direct, circuits = split_relayed(addrs)
    if direct:
        with_key = f" --swarm-key-file {shlex.quote(key_file)}" if key_file and node.host.swarm_key else ""
        print(f"others can join with --bootstrap ADDRESS{with_key}, one of:", file=sys.stderr)
    elif circuits:  # a relayed peer can be called, but the DHT does not route through relays yet
        print("client mode: others join through another peer; this one is reachable through a relay at:",
              file=sys.stderr)
    else:
        print("client mode: others join through another peer (this one accepts no connections)", file=sys.stderr)
    for a in direct + circuits:
        print(a, flush=True)  # stdout: the multiaddr alone, for scripts
    interactive = sys.stderr.isatty()
    while not stop.is_set():
        await until(stop, asyncio.sleep(5.0))
        line = f"peers in routing table: {len(node.routing)}  records held: {len(node.storage)}  " \
               f"connections: {len(node.host.connections)}"
        print(("\r" + line) if interactive else line, end="" if interactive else "\n", file=sys.stderr, flush=True)
    print("\nleaving the swarm", file=sys.stderr)
    return EXIT_OK
