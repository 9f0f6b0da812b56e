"""``p2ptrain ckpt``: the local checkpoint store from the command line.

Checkpoints are content-addressed (a CID names every byte), so the commands take a CID, its
64-hex digest, or any unique prefix of either. ``save`` imports a ``.safetensors`` model file,
``export`` writes one that ``safetensors.torch.load_file`` opens, ``get`` fetches a checkpoint
from the swarm; ``ls``/``show``/``verify``/``gc``/``pin``/``unpin`` look after what is stored.
Errors are one line on stderr: exit 2 for bad input, 1 for a failure (not found, corrupt data).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dht import ConfigError

from .common import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, fail, joining

#: PyTorch's pickle-based formats: never opened (unpickling runs code)
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle", ".tar")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ckpt",
        help="manage checkpoints: save, ls, show, get, verify, gc, pin, export",
        description="Checkpoints are immutable, content-addressed blobs in a local data directory (default: "
        "$P2PTRAIN_DATA_DIR, else $XDG_CACHE_HOME/p2ptrain or ~/.cache/p2ptrain), named by a CID "
        "(bafkr4i...). Every command takes a CID, its hex digest or a unique prefix of either.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--data-dir", metavar="DIR", help="the checkpoint store (default: $P2PTRAIN_DATA_DIR, else "
                        "$XDG_CACHE_HOME/p2ptrain or ~/.cache/p2ptrain)")
    actions = p.add_subparsers(dest="ckpt_action", metavar="ACTION")

    a = actions.add_parser("save", parents=[common], help="import a .safetensors model file as a checkpoint",
                           description="Store the tensors of a .safetensors file as a checkpoint of a run (tensor "
                           "names are kept, so 'export' gives the same file back) and print its CID. Pickle-based "
                           ".pt/.pth/.bin files are refused.")
    a.add_argument("file", help="a .safetensors file")
    a.add_argument("--run-id", required=True, help="the run this checkpoint belongs to")
    a.add_argument("--epoch", required=True, type=int, help="its epoch (a non-negative int)")
    a.add_argument("--key-file", metavar="PATH", help="Ed25519 key that signs the checkpoint (created with mode "
                   "0600 if missing; default: a fresh identity)")
    a.add_argument("--pin", action="store_true", help="keep it through every gc")
    a.add_argument("--json", action="store_true", help="print the checkpoint as JSON")
    a.set_defaults(ckpt_func=_save)

    a = actions.add_parser("ls", parents=[common], help="list stored checkpoints, newest first",
                           description="List stored checkpoints, newest first, with their writers. A checkpoint "
                           "is confirmed when three distinct writers signed it, or one of --trusted-writers did; "
                           "an unconfirmed one is a single writer's claim, which peers take as a run's latest only "
                           "from a writer they trust.")
    a.add_argument("--run-id", help="only this run's checkpoints")
    a.add_argument("--json", action="store_true", help="print a JSON list")
    add_trusted_writers(a, "count a checkpoint these PeerIDs signed as confirmed (repeatable, or comma-separated)")
    a.set_defaults(ckpt_func=_ls)

    a = actions.add_parser("show", parents=[common], help="a checkpoint's tensors, chunks, writer and signature")
    a.add_argument("id", metavar="CID", help="CID, hex digest or unique prefix")
    a.add_argument("--json", action="store_true", help="print it as JSON")
    a.set_defaults(ckpt_func=_show)

    a = actions.add_parser("verify", parents=[common], help="re-hash stored blobs; exit 1 with one line per problem",
                           description="Re-read and hash every blob of one checkpoint (or of all). Corrupt blobs "
                           "are removed (fetch the checkpoint again with 'get'); exit 1 when anything is wrong.")
    a.add_argument("id", nargs="?", metavar="CID", help="only this checkpoint (default: all)")
    a.set_defaults(ckpt_func=_verify)

    a = actions.add_parser("gc", parents=[common], help="delete all but the newest checkpoints of each run",
                           description="Per run keep the newest --keep checkpoints and every pinned one; delete "
                           "the others, then every blob nothing kept uses and what crashed saves left behind.")
    a.add_argument("--keep", type=int, default=3, help="checkpoints kept per run (default: %(default)s)")
    a.add_argument("--json", action="store_true", help="print what was removed as JSON")
    a.set_defaults(ckpt_func=_gc)

    for name, text in (("pin", "keep a checkpoint through every gc"), ("unpin", "let gc delete it when it is old")):
        a = actions.add_parser(name, parents=[common], help=text)
        a.add_argument("id", metavar="CID", help="CID, hex digest or unique prefix")
        a.set_defaults(ckpt_func=_pin if name == "pin" else _unpin)

    a = actions.add_parser("export", parents=[common], help="write a checkpoint as a plain .safetensors file",
                           description="Write a checkpoint's model to one .safetensors file (atomically), under "
                           "the model's state_dict names: model.load_state_dict(safetensors.torch.load_file(OUT)) "
                           "takes it. A checkpoint that records no names (an older one, or one saved by an "
                           "optimizer given no model=) is written under its positional names (params.0, ...). "
                           "An FSDP peer's ranks checkpoint a shard each: give one checkpoint of every rank "
                           "(same epoch) and the file holds the whole model.")
    a.add_argument("id", metavar="CID", nargs="+", help="CID, hex digest or unique prefix (FSDP: one per rank)")
    a.add_argument("out", metavar="OUT.safetensors", help="the file to write")
    a.add_argument("--with-optimizer", action="store_true",
                   help="also write the optimizer's state, under optimizer. (outer_optimizer. for diloco) and "
                   "scheduler. prefixes")
    a.set_defaults(ckpt_func=_export)

    a = actions.add_parser("get", parents=[common], help="fetch a checkpoint from the swarm into the store",
                           description="Find a checkpoint of a run in the DHT (its CID, or the newest one with "
                           "'latest') and download it from every peer that serves it, each chunk verified.")
    a.add_argument("id", metavar="CID|latest", help="a full CID or hex digest, or 'latest'")
    a.add_argument("--run-id", required=True, help="the run the checkpoint belongs to")
    a.add_argument("--bootstrap", action="append", metavar="MULTIADDR",
                   help="any peer of the swarm (repeatable); default: $P2PTRAIN_BOOTSTRAP, else ./bootstrap_peers.txt")
    a.add_argument("--bootstrap-file", metavar="PATH", help="file of bootstrap multiaddrs, one per line")
    a.add_argument("--timeout", type=float, help="seconds for the whole fetch (default: derived from the checkpoint's "
                   "size and the measured bandwidth, or 600 s where none is measured, as in a one-shot fetch)")
    a.add_argument("--json", action="store_true", help="print the fetched checkpoint as JSON")
    add_trusted_writers(a, "'latest' is the newest checkpoint that three distinct writers agree on or that one of "
                         "these PeerIDs signed (repeatable, or comma-separated)")
    from .common import add_swarm_key_arg

    add_swarm_key_arg(a)
    a.set_defaults(ckpt_func=_get)

    p.set_defaults(func=main, ckpt_parser=p)


def add_trusted_writers(parser: argparse.ArgumentParser, text: str) -> None:
    """``--trusted-writers PEERID`` (repeatable, or comma-separated), here and on ``p2ptrain peer``."""
    parser.add_argument("--trusted-writers", action="append", metavar="PEERID", help=text)


def trusted_writers_of(args: argparse.Namespace) -> frozenset[Any]:
    """The PeerIDs of ``--trusted-writers``; a ConfigError naming a value that is not one."""
    from ..checkpoint.trust import parse_writers

    try:
        return parse_writers(args.trusted_writers or ())
    except ValueError as e:
        raise ConfigError(f"--trusted-writers: {e}") from None


def main(args: argparse.Namespace) -> int:
    if getattr(args, "ckpt_func", None) is None:
        args.ckpt_parser.print_help()
        return EXIT_USAGE
    from ..checkpoint.manifest import ManifestError
    from ..checkpoint.record import RecordError
    from ..checkpoint.blobs import StoreError
    from ..checkpoint.info import AmbiguousCheckpointError, CheckpointNotFound

    try:
        return args.ckpt_func(args)
    except (AmbiguousCheckpointError, RecordError) as e:
        return fail(str(e), EXIT_USAGE)
    except (CheckpointNotFound, StoreError, ManifestError) as e:
        return fail(str(e), EXIT_FAILURE)
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        return fail(f"{where}{e.strerror or e}", EXIT_FAILURE)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


# ---------------------------------------------------------------------------------- helpers


def _store(args: argparse.Namespace) -> Any:
    from ..checkpoint.store import CheckpointStore

    root = args.data_dir
    if root is not None and not str(root).strip():
        raise ConfigError("--data-dir: empty path")
    try:
        return CheckpointStore(root)
    except OSError as e:
        where = root or "the default data directory"
        raise ConfigError(f"cannot use {where} as the checkpoint store: {e.strerror or e} "
                          "(give a writable --data-dir or set $P2PTRAIN_DATA_DIR)") from None


def _resolve(store: Any, text: str) -> bytes:
    """A checkpoint argument -> manifest id; bad syntax is a usage error (exit 2)."""
    from ..checkpoint.info import AmbiguousCheckpointError

    try:
        return store.resolve(text)
    except AmbiguousCheckpointError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _run_id(text: str) -> str:
    from ..checkpoint.record import RecordError, check_run_id

    try:
        return check_run_id(text)
    except RecordError as e:
        raise ConfigError(f"--run-id: {e}") from None


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,} B" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n:,.1f} GB"


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' * (count != 1)}"


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _info_json(info: Any) -> dict[str, Any]:
    r = info.record
    return {"cid": info.cid, "manifest_id": r.manifest_id.hex(), "run_id": r.run_id, "epoch": r.epoch,
            "size": r.size, "created": r.created, "writer": str(r.writer), "pinned": info.pinned}


def _print_json(obj: Any) -> None:
    try:
        print(json.dumps(obj, indent=2))
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _console(stderr: bool = False) -> Any:
    from .common import make_console

    return make_console(stderr)  # no width limit off a terminal: a CID is never cut


@contextlib.contextmanager
def _progress(description: str) -> Iterator[Callable[[int, int], None]]:
    """A rich progress bar on stderr (when it is a terminal); yields ``update(done, total)``."""
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    console = _console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=console, transient=True,
                  disable=not console.is_terminal) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


# ---------------------------------------------------------------------------------- actions


def _check_not_pickle(path: Path) -> None:
    """Refuse PyTorch's pickle formats by name and by content: loading one could run code."""
    head = b""
    with contextlib.suppress(OSError):
        with open(path, "rb") as f:
            head = f.read(9)
    looks_safetensors = len(head) == 9 and head[8:9] == b"{"
    zip_or_pickle = head.startswith(b"PK\x03\x04") or (head[:1] == b"\x80" and head[1:2] in b"\x02\x03\x04\x05")
    if path.suffix.lower() in PICKLE_SUFFIXES or (zip_or_pickle and not looks_safetensors):
        raise ConfigError(
            f"{path}: pickle-based PyTorch files are never loaded (unpickling runs arbitrary code); convert it once, "
            "where you trust it: python -c \"import torch, safetensors.torch as s; "
            f"s.save_file(torch.load('{path}'), 'model.safetensors')\" and save that")


def _save(args: argparse.Namespace) -> int:
    from dht import Identity

    from ..checkpoint.cid import cid
    from ..checkpoint.manifest import build_snapshot
    from ..checkpoint.safetensors_io import read_safetensors

    path = Path(args.file)
    run_id = _run_id(args.run_id)
    if args.epoch < 0:
        raise ConfigError(f"--epoch {args.epoch}: an epoch is a non-negative int")
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    _check_not_pickle(path)
    if args.key_file is not None:
        from ..config import check_key_file

        check_key_file(args.key_file)
    identity = Identity.load_or_create(args.key_file)
    store = _store(args)
    try:
        tensors, metadata = read_safetensors(path)
    except ValueError as e:
        raise ConfigError(f"{e}; 'ckpt save' imports .safetensors files") from None
    manifest, buffer = build_snapshot(tensors, meta={"safetensors_metadata": metadata} if metadata else None)
    new = sum(not store.blobs.has(manifest.chunk_digest(i)) for i in range(manifest.num_chunks))
    with _progress("saving") as update:
        info = store.save(manifest, buffer, run_id=run_id, epoch=args.epoch, identity=identity, pin=args.pin,
                          progress=update)
    if args.json:
        _print_json({**_info_json(info), "tensors": len(tensors), "chunks": manifest.num_chunks, "new_chunks": new})
    else:
        print(cid(manifest.id))
        print(f"saved {path.name} as epoch {args.epoch} of run {run_id!r}: {_n(len(tensors), 'tensor')}, "
              f"{_size(manifest.total_size)}, {new} of {_n(manifest.num_chunks, 'chunk')} new (the others were "
              f"stored already); signed by {info.writer}", file=sys.stderr)
    return EXIT_OK


def _by_checkpoint(infos: list[Any]) -> list[list[Any]]:
    """Records grouped by the checkpoint (manifest) they name, newest first: peers that saved the
    same state wrote one checkpoint, each signing its own record of it."""
    groups: dict[bytes, list[Any]] = {}
    for i in infos:
        groups.setdefault(i.manifest_id, []).append(i)
    return list(groups.values())


def _joined(values: list[Any]) -> str:
    return ", ".join(dict.fromkeys(map(str, values)))


def _confirmed(group: list[Any], trusted: frozenset[Any]) -> str | None:
    """Why the newest claim on a checkpoint is believed (``trust.evidence``), or None: one writer's word."""
    from ..checkpoint.trust import evidence, group_claims

    return evidence(group_claims(i.record for i in group)[0].writers, trusted=trusted)


def _ls(args: argparse.Namespace) -> int:
    store = _store(args)
    trusted = trusted_writers_of(args)
    checkpoints = _by_checkpoint(store.list(_run_id(args.run_id) if args.run_id is not None else None))
    confirmed = [_confirmed(g, trusted) for g in checkpoints]
    if args.json:
        # run and epoch of the newest record (one state saved under two runs is rare)
        _print_json([{**{k: v for k, v in _info_json(g[0]).items() if k != "writer"},
                      "writers": [str(i.writer) for i in g], "confirmed": basis is not None}
                     for g, basis in zip(checkpoints, confirmed)])
        return EXIT_OK
    bad = store.invalid_records()
    if bad:
        print(f"warning: {len(bad)} record file(s) are not valid records and are ignored; "
              "'p2ptrain ckpt verify' lists them, 'gc' removes them", file=sys.stderr)
    if not checkpoints:
        where = f" of run {args.run_id!r}" if args.run_id else ""
        print(f"no checkpoints{where} in {store.root} (look elsewhere with --data-dir DIR or $P2PTRAIN_DATA_DIR)",
              file=sys.stderr)
        return EXIT_OK
    from rich.table import Table

    table = Table(title=f"{_n(len(checkpoints), 'checkpoint')} in {store.root}", title_justify="left")
    for col in ("cid", "run", "epoch", "size", "created", "writers", "confirmed", "pinned"):
        table.add_column(col, justify="right" if col in ("epoch", "size") else "left", no_wrap=col == "cid")
    for g, basis in zip(checkpoints, confirmed):
        table.add_row(g[0].cid, _joined([i.run_id for i in g]), _joined([i.epoch for i in g]), _size(g[0].size),
                      _when(max(i.created for i in g)), _joined([i.writer.short() for i in g]),
                      basis or "[yellow]no: one writer's claim[/yellow]", "yes" if g[0].pinned else "")
    _console().print(table)
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    from ..checkpoint.cid import cid
    from ..checkpoint.export import export_plan

    store = _store(args)
    mid = _resolve(store, args.id)
    infos = store.infos(mid)
    m = store.manifest(mid)
    # what export names them (with --with-optimizer): a tied weight under each of its names
    names: dict[int, list[str]] = {}
    try:
        for name, i in export_plan(m, with_optimizer=True)[0]:
            names.setdefault(i, []).append(name)
    except ValueError:
        pass
    missing = [i for i in range(m.num_chunks) if not store.blobs.has(m.chunk_digest(i))]
    tensors = [{"name": names.get(i, [f"#{i}"])[0], **({"aliases": names[i][1:]} if len(names.get(i, ())) > 1 else {}),
                "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes} for i, t in enumerate(m.tensors)]
    records = [{**_info_json(i), "signature": "valid"} for i in infos]
    if args.json:
        _print_json({"cid": cid(mid), "manifest_id": mid.hex(), "size": m.total_size, "chunk_size": m.chunk_size,
                     "chunks": m.num_chunks, "missing_chunks": missing, "pinned": bool(infos and infos[0].pinned),
                     "records": records, "tensors": tensors,
                     "meta": {k: v for k, v in m.meta.items() if isinstance(v, (str, int, float, bool, dict, list))}})
        return EXIT_OK
    from rich.table import Table

    console = _console()
    console.print(f"[bold]{cid(mid)}[/bold]  ({mid.hex()})", highlight=False)
    chunking = (f"{_n(m.num_chunks, 'chunk')} of up to {_size(m.chunk_size)}" if m.num_chunks > 1
                else _n(m.num_chunks, "chunk"))
    console.print(f"size {_size(m.total_size)} in {chunking}"
                  + (f", [red]{len(missing)} missing[/red]" if missing else ", all stored")
                  + (", pinned" if infos and infos[0].pinned else ""), highlight=False)
    for i in infos:
        console.print(f"run {i.run_id!r} epoch {i.epoch}, written {_when(i.created)} by {i.writer}: "
                      "signature [green]valid[/green]", highlight=False)
    table = Table(title=_n(len(tensors), "tensor"), title_justify="left")
    for col in ("name", "dtype", "shape", "bytes"):
        table.add_column(col, justify="right" if col == "bytes" else "left")
    for t in tensors:
        table.add_row(" = ".join([t["name"], *t.get("aliases", [])]), t["dtype"],
                      "×".join(map(str, t["shape"])) or "scalar", f"{t['bytes']:,}")
    console.print(table)
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    store = _store(args)
    mid = _resolve(store, args.id) if args.id is not None else None
    count = len(store.infos(mid)) if mid is not None else len({i.manifest_id for i in store.list()})
    with _progress("verifying") as update:
        problems = store.verify(mid, progress=update)
    if problems:
        for line in problems:
            print(f"p2ptrain: error: {line}", file=sys.stderr)
        print(f"{len(problems)} problem{'s' * (len(problems) != 1)} found in {store.root}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"ok: {count} checkpoint{'s' * (count != 1)} verified in {store.root}")
    return EXIT_OK


def _gc(args: argparse.Namespace) -> int:
    if args.keep < 0:
        raise ConfigError(f"--keep {args.keep}: keep a non-negative number of checkpoints per run")
    store = _store(args)
    r = store.gc(keep=args.keep)
    if args.json:
        _print_json({"kept": [_info_json(i) for i in r.kept], "removed": [_info_json(i) for i in r.removed],
                     "blobs_removed": r.blobs_removed, "bytes_freed": r.bytes_freed, "temp_removed": r.temp_removed,
                     "bad_records_removed": r.bad_refs_removed, "problems": r.problems})
    else:
        print(f"removed {_n(len(r.removed), 'checkpoint')} and {_n(r.blobs_removed, 'blob')} "
              f"({_size(r.bytes_freed)} freed); kept {len(r.kept)}"
              + (f"; {r.temp_removed} temp files and {r.bad_refs_removed} bad records removed"
                 if r.temp_removed or r.bad_refs_removed else ""))
    for line in r.problems:
        print(f"p2ptrain: error: {line} (no blob was deleted; run 'p2ptrain ckpt verify')", file=sys.stderr)
    return EXIT_FAILURE if r.problems else EXIT_OK


def _pin(args: argparse.Namespace) -> int:
    from ..checkpoint.cid import cid

    store = _store(args)
    mid = _resolve(store, args.id)
    store.pin(mid)
    print(f"pinned {cid(mid)}")
    return EXIT_OK


def _unpin(args: argparse.Namespace) -> int:
    from ..checkpoint.cid import cid

    store = _store(args)
    mid = _resolve(store, args.id)
    store.unpin(mid)
    print(f"unpinned {cid(mid)}")
    return EXIT_OK


def _export(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.is_dir():
        raise ConfigError(f"{out} is a directory: give the file to write, e.g. {out / 'model.safetensors'}")
    if not out.parent.is_dir():
        raise ConfigError(f"{out.parent}: no such directory")
    store = _store(args)
    mids = [_resolve(store, text) for text in args.id]
    with _progress("exporting") as update:
        try:
            count, note = _export_one_or_shards(store, mids, out, args.with_optimizer, update)
        except ValueError as e:
            from ..checkpoint.manifest import ManifestError

            if isinstance(e, ManifestError):
                raise
            raise ConfigError(f"cannot export: {e}") from None
    if note:
        print(f"note: {note}", file=sys.stderr)
    print(f"wrote {out} ({_n(count, 'tensor')}, {_size(out.stat().st_size)})")
    return EXIT_OK


def _export_one_or_shards(store: Any, mids: list[bytes], out: Path, with_optimizer: bool,
                          update: Any) -> tuple[int, str | None]:
    from ..checkpoint.shards import export_shards, shard_label

    if len(mids) == 1 and shard_label(store.manifest(mids[0])) is None:
        return store.export(mids[0], out, with_optimizer=with_optimizer, progress=update)
    if with_optimizer:
        raise ConfigError("--with-optimizer is not supported for an FSDP peer's shards (their optimizer states "
                          "stay sharded)")
    return export_shards(store, mids, out, progress=update), None


def _get(args: argparse.Namespace) -> int:
    import asyncio

    from dht import DHTConfig, DHTNode, Identity

    from ..checkpoint.cid import parse_cid
    from .common import bootstrap_addrs, run, swarm_key_of, until

    run_id = _run_id(args.run_id)
    if args.id == "latest":
        manifest_id = None
    else:
        try:
            manifest_id = parse_cid(args.id)
        except ValueError as e:
            raise ConfigError(f"{e} (or 'latest'; a prefix only names a checkpoint already stored)") from None
    if args.timeout is not None and args.timeout <= 0:
        raise ConfigError("--timeout must be positive")
    join_for = 30.0 if args.timeout is None else min(args.timeout, 30.0)
    boot = bootstrap_addrs(args.bootstrap, args.bootstrap_file)
    if not boot:
        raise ConfigError("get fetches from the swarm: give --bootstrap MULTIADDR of any peer (a peer prints its "
                          "address when it starts), or entries in bootstrap_peers.txt")
    swarm_key = swarm_key_of(args)
    trusted = trusted_writers_of(args)
    store = _store(args)

    async def session(stop: asyncio.Event) -> int:
        from ..checkpoint.blobs import StoreError
        from ..checkpoint.swarm import fetch_checkpoint
        from ..checkpoint.errors import StateTransferError

        node = DHTNode(Identity(), None, config=DHTConfig(bootstrap_timeout=join_for),
                       swarm_key=swarm_key)
        try:
            with joining(boot, join_for):
                await node.start(boot)
            with _progress("fetching") as update:
                try:
                    info = await until(stop, fetch_checkpoint(node, store, run_id=run_id, manifest_id=manifest_id,
                                                              progress=update, timeout=args.timeout, trusted=trusted))
                except (StateTransferError, StoreError) as e:
                    return fail(str(e))
            if info is None:  # Ctrl+C: what was fetched stays, a later get resumes
                return EXIT_INTERRUPTED
        finally:
            await node.close()
        if args.json:
            _print_json(_info_json(info))
        else:
            print(info.cid)
            print(f"fetched epoch {info.epoch} of run {info.run_id!r} ({_size(info.size)}), written by "
                  f"{info.writer}", file=sys.stderr)
        return EXIT_OK

    return run(session)
