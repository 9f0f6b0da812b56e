"""``p2ptrain data``: datasets as content-addressed blobs (add, ls, show, get, verify, gc).

``add`` cuts files into shards in the checkpoint store and prints the dataset's CID; with
``--serve`` it then stays up serving them to the swarm (what a first peer does). ``get`` fetches
a dataset's index and every shard from the peers that announce it, each chunk verified.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from dht import ConfigError

from .common import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    LISTEN_DEFAULT,
    LISTEN_HELP,
    add_swarm_key_arg,
    bootstrap_addrs,
    fail,
    joining,
    parse_listen,
    run,
    swarm_key_of,
    until,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="datasets as content-addressed blobs: add, ls, show, get, verify, gc",
                       description="A dataset is files cut into content-addressed shards in the checkpoint store "
                       "plus a signed index; its CID (bafkr4i...) names every byte. 'add' on one machine, then "
                       "'p2ptrain peer --dataset CID' on others trains from it.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--data-dir", metavar="DIR", help="the store (default: $P2PTRAIN_DATA_DIR, else "
                        "$XDG_CACHE_HOME/p2ptrain or ~/.cache/p2ptrain)")
    swarm = argparse.ArgumentParser(add_help=False)
    swarm.add_argument("--bootstrap", action="append", metavar="MULTIADDR", help="any peer of the swarm (repeatable)")
    swarm.add_argument("--bootstrap-file", metavar="PATH", help="file of bootstrap multiaddrs, one per line")
    add_swarm_key_arg(swarm)
    actions = p.add_subparsers(dest="data_action", metavar="ACTION")

    a = actions.add_parser("add", parents=[common, swarm], help="cut files into shards and sign a dataset index",
                           description="Text files: one record per line. .safetensors files: one integer array "
                           "each, [N, L] rows (or a 1-D token stream cut into --row tokens). Prints the CID.")
    a.add_argument("paths", nargs="+", metavar="PATH")
    a.add_argument("--name", required=True, help="the dataset's name (shown by ls)")
    a.add_argument("--shard-size", type=int, default=1 << 20, metavar="BYTES", help="bytes per shard (default 1 MiB)")
    a.add_argument("--row", type=int, default=512, help="tokens per record of a 1-D token file (default 512)")
    a.add_argument("--key-file", metavar="PATH", help="Ed25519 key that signs the index (default: a fresh one)")
    a.add_argument("--serve", action="store_true", help="stay up serving the dataset to the swarm until Ctrl+C")
    a.add_argument("--listen", metavar="MULTIADDR", default=LISTEN_DEFAULT, help="with --serve: " + LISTEN_HELP)
    a.set_defaults(data_func=_add)

    a = actions.add_parser("ls", parents=[common], help="list the datasets held")
    a.add_argument("--json", action="store_true")
    a.set_defaults(data_func=_ls)
    a = actions.add_parser("show", parents=[common], help="a dataset's index: shards, records, writer")
    a.add_argument("id", metavar="CID")
    a.add_argument("--json", action="store_true")
    a.set_defaults(data_func=_show)
    a = actions.add_parser("verify", parents=[common], help="re-hash a dataset's shards; exit 1 per problem")
    a.add_argument("id", metavar="CID")
    a.set_defaults(data_func=_verify)
    a = actions.add_parser("gc", parents=[common], help="delete blobs no dataset or checkpoint uses")
    a.add_argument("--drop", action="append", metavar="CID", help="stop holding this dataset first (repeatable)")
    a.set_defaults(data_func=_gc)
    a = actions.add_parser("get", parents=[common, swarm], help="fetch a dataset from the swarm into the store")
    a.add_argument("id", metavar="CID")
    a.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole fetch (default 600)")
    a.set_defaults(data_func=_get)
    p.set_defaults(func=main, data_parser=p)


def main(args: argparse.Namespace) -> int:
    if getattr(args, "data_func", None) is None:
        args.data_parser.print_help()
        return EXIT_USAGE
    from ..checkpoint.blobs import StoreError
    from ..data.index import DatasetError

    try:
        return args.data_func(args)
    except (DatasetError, StoreError) as e:
        return fail(str(e), EXIT_FAILURE)
    except OSError as e:
        return fail(f"{e.filename + ': ' if e.filename else ''}{e.strerror or e}", EXIT_FAILURE)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _store(args: argparse.Namespace) -> Any:
    from ..data.store import DataStore

    if args.data_dir is not None and not str(args.data_dir).strip():
        raise ConfigError("--data-dir: empty path")
    return DataStore(args.data_dir)


def _summary(index: Any, held: int) -> dict[str, Any]:
    return {"cid": index.cid, "name": index.name, "format": index.format, "shards": len(index.shards),
            "held": held, "records": index.records, "bytes": index.size, "writer": str(index.writer),
            "created": index.created}


def _add(args: argparse.Namespace) -> int:
    from dht import Identity

    if args.shard_size < 4096 or args.row < 1:
        raise ConfigError("--shard-size must be at least 4096 and --row at least 1")
    identity = Identity.load_or_create(args.key_file) if args.key_file else Identity()
    store = _store(args)
    index = store.add(args.paths, args.name, identity, shard_bytes=args.shard_size, row=args.row)
    print(index.cid, flush=True)
    print(f"dataset {args.name!r}: {index.records} records in {len(index.shards)} shards ({index.size} bytes)",
          file=sys.stderr)
    return _serve(args, store, index) if args.serve else EXIT_OK


def _node(args: argparse.Namespace, listen: tuple[str, int] | None) -> tuple[Any, list[Any]]:
    from dht import DHTConfig, DHTNode, Identity

    boot = bootstrap_addrs(args.bootstrap, args.bootstrap_file)
    return DHTNode(Identity(), listen, config=DHTConfig(bootstrap_timeout=30.0), swarm_key=swarm_key_of(args)), boot


def _serve(args: argparse.Namespace, store: Any, index: Any) -> int:
    from ..data.swarm import DataService

    node, boot = _node(args, parse_listen(args.listen))

    async def session(stop: asyncio.Event) -> int:
        with joining(boot, 30.0):
            await node.start(boot)
        try:
            async with DataService(node, store, index):
                for a in node.multiaddrs:
                    print(f"serving {index.cid} at {a}", file=sys.stderr, flush=True)
                await stop.wait()
        finally:
            await node.close()
        return EXIT_OK

    return run(session)


def _ls(args: argparse.Namespace) -> int:
    rows = [_summary(i, h) for i, h in _store(args).list()]
    if args.json:
        print(json.dumps(rows, indent=1))
    for r in [] if args.json else rows:
        print(f"{r['cid']}  {r['name']:<20} {r['format']:<6} {r['held']}/{r['shards']} shards  {r['records']} "
              f"records  {r['bytes']} bytes")
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    store = _store(args)
    index = store.index(store.resolve(args.id))
    held = store.held(index)
    if args.json:
        print(json.dumps({**_summary(index, sum(held)), "shard_list": [
            {"id": s.id.hex(), "bytes": s.size, "records": s.records, "held": h} for s, h in zip(index.shards, held)]},
            indent=1))
        return EXIT_OK
    r = _summary(index, sum(held))
    print(f"dataset {r['cid']}\n  name {r['name']!r}, format {r['format']}, {r['records']} records, {r['bytes']} bytes"
          f"\n  written by {r['writer']} (signature verified)\n  shards: {len(held)}, {sum(held)} held here")
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    store = _store(args)
    problems = store.verify(store.resolve(args.id))
    for line in problems:
        print(line, file=sys.stderr)
    if not problems:
        print("ok", file=sys.stderr)
    return EXIT_FAILURE if problems else EXIT_OK


def _gc(args: argparse.Namespace) -> int:
    store = _store(args)
    for text in args.drop or ():
        store.drop(store.resolve(text))
    removed, freed = store.gc()
    print(f"removed {removed} blobs, freed {freed} bytes", file=sys.stderr)
    return EXIT_OK


def _get(args: argparse.Namespace) -> int:
    from ..data.index import parse_dataset_id
    from ..data.swarm import fetch_index, fetch_shards

    dataset_id = parse_dataset_id(args.id)
    store = _store(args)
    node, boot = _node(args, None)
    if not boot:
        raise ConfigError("get fetches from the swarm: give --bootstrap MULTIADDR of a peer that holds the dataset")

    async def fetch_all() -> int:
        index = await fetch_index(node, store, dataset_id)
        todo = [i for i, h in enumerate(await asyncio.to_thread(store.held, index)) if not h]
        await fetch_shards(node, store, index, todo)
        print(index.cid)
        print(f"dataset {index.name!r}: {len(index.shards)} shards held ({len(todo)} fetched now)", file=sys.stderr)
        return EXIT_OK

    async def session(stop: asyncio.Event) -> int:
        from ..data.index import DatasetError

        with joining(boot, 30.0):
            await node.start(boot)
        try:
            code = await until(stop, asyncio.wait_for(fetch_all(), args.timeout))
            return EXIT_INTERRUPTED if code is None else code  # (None: Ctrl+C; a later get resumes)
        except DatasetError as e:
            return fail(str(e))
        except TimeoutError:
            return fail(f"fetching dataset {args.id} timed out after {args.timeout} s; run get again to resume")
        finally:
            await node.close()

    return run(session)
