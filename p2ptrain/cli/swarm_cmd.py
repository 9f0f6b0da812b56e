"""``p2ptrain swarm``: a whole local swarm in one command — a bootstrap peer and N training peers,
each its own process on 127.0.0.1, shown in one live view; Ctrl+C stops them all cleanly.

The peers are ordinary ``p2ptrain peer --json`` processes (the launcher reads their event lines),
so the swarm exercises exactly what a person runs on several machines. The bootstrap peer is a
DHT-only ``p2ptrain dht`` process: any training peer may die without taking the swarm's entry
point with it.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from dht import ConfigError
from ..children import die_with_parent

from .common import (EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, add_swarm_key_arg, child_python, fail, interrupts,
                     make_console)
from .peer_cmd import add_training_args, check_training_args, format_metrics, training_argv


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "swarm",
        help="start a local swarm (a bootstrap peer and N training peers) and show its progress",
        description="Start a bootstrap peer and N training peers as local processes on 127.0.0.1, train the "
        "example together and show one combined view. Ends with the trained model written to --out. "
        "Ctrl+C stops every peer cleanly; a second Ctrl+C kills them at once.",
    )
    p.add_argument("--peers", type=int, default=4, help="training peers (default: %(default)s)")
    p.add_argument("--out", default="p2ptrain-out", metavar="DIR",
                   help="where the trained model is written (default: %(default)s)")
    add_training_args(p)
    add_swarm_key_arg(p)
    p.add_argument("--json", action="store_true", help="print the peers' events as JSON lines instead of a live view")
    p.set_defaults(func=main)


class _Child:
    """A child process whose stdout lines land in a shared queue as (index, line); its stderr (its
    log) is kept in memory for an error message and written to ``log`` when given."""

    def __init__(self, index: int, argv: list[str], events: queue.Queue, log: Path | None = None):
        self.index = index
        # Own session: the terminal's Ctrl+C reaches the launcher only, which stops the peers in
        # order; PDEATHSIG: if the launcher itself is killed, no peer outlives it.
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=_child_env(), start_new_session=True,
                                     preexec_fn=die_with_parent)
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(events,), daemon=True).start()
        threading.Thread(target=self._keep_log, args=(log,), daemon=True).start()

    def _keep_log(self, path: Path | None) -> None:
        out = path.open("w", encoding="utf-8", buffering=1) if path is not None else None
        try:
            for line in self.proc.stderr:
                self.stderr.append(line)
                del self.stderr[:-200]  # the tail is what an error message shows
                if out is not None:
                    out.write(line)
        finally:
            if out is not None:
                out.close()

    def _pump(self, events: queue.Queue) -> None:
        for line in self.proc.stdout:
            events.put((self.index, line))
        events.put((self.index, None))

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass


def _child_env() -> dict[str, str]:
    """The launcher's environment without ``P2PTRAIN_*``: the launcher already turned those into
    flags, and settings such as a key file or a metrics port must not reach every peer at once."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PTRAIN_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _swarm_key_argv(args: argparse.Namespace) -> list[str]:
    """Every child gets the swarm key (as an absolute path: children may run elsewhere)."""
    if not getattr(args, "swarm_key_file", None):
        return []
    return ["--swarm-key-file", os.path.abspath(os.path.expanduser(args.swarm_key_file))]


def _start_bootstrap(events: queue.Queue, timeout: float = 60.0, extra: list[str] | None = None) -> tuple[_Child, str]:
    argv = [*child_python(), "-m", "p2ptrain", "dht", "run", "--listen", "/ip4/127.0.0.1/tcp/0", *(extra or [])]
    child = _Child(-1, argv, events)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            index, line = events.get(timeout=0.5)
        except queue.Empty:
            if child.proc.poll() is not None:
                break
            continue
        if index == -1 and line and line.startswith("/ip4/"):
            return child, line.strip()
    child.signal(signal.SIGKILL)
    raise ConfigError(f"the bootstrap peer did not start: {''.join(child.stderr)[-500:]}")


def main(args: argparse.Namespace) -> int:
    if not 1 <= args.peers <= 64:
        raise ConfigError("--peers must be between 1 and 64")
    check_training_args(args)  # as each peer would, before any is started
    events: queue.Queue = queue.Queue()
    children: list[_Child] = []

    def stop_all(sig: int) -> None:
        for c in children:
            c.signal(sig)

    with interrupts(lambda: stop_all(signal.SIGINT), "stopping every peer (Ctrl+C again to kill them)...",
                    lambda: stop_all(signal.SIGKILL)) as presses:
        try:
            code = _launch(args, events, children)
        finally:
            _reap(children)
    return EXIT_INTERRUPTED if presses() and code != EXIT_OK else code


def _launch(args: argparse.Namespace, events: queue.Queue, children: list[_Child]) -> int:
    key_argv = _swarm_key_argv(args)
    boot, addr = _start_bootstrap(events, extra=key_argv)
    children.append(boot)
    # --save goes to peer 0 alone: peers of a finished run hold the same model, one file is enough
    forwarded = training_argv(argparse.Namespace(**{**vars(args), "save": None})) + key_argv
    if args.threads is None:  # each peer its share of the cores: oversubscribed torch threads cost ~20x
        forwarded += ["--threads", str(max(1, (os.cpu_count() or 1) // (args.peers * args.nproc_per_node)))]
    from . import logging_options

    verbose, log_json = logging_options(args)  # for the peers' logs
    forwarded += ["-v"] * verbose + (["--log-json"] if log_json else [])
    if args.wait_peers is None:  # the peers start together: none trains before all have joined
        forwarded += ["--wait-peers", str(args.peers)]
    save = args.save or str(Path(args.out) / f"{args.example}-model.safetensors")
    if args.checkpoint_every is not None:
        # the peers' default store, as for `p2ptrain peer` and `p2ptrain ckpt`: found without flags
        from ..paths import default_data_dir

        store = Path(args.data_dir).expanduser().resolve() if args.data_dir else default_data_dir().resolve()
        ls = "p2ptrain ckpt ls" + (f" --data-dir {store}" if store != default_data_dir().resolve() else "")
        print(f"checkpoints go to {store} ('{ls}' lists them)", file=sys.stderr if args.json else sys.stdout,
              flush=True)
    logs = _log_dir(args)
    for i in range(args.peers):
        argv = [*child_python(), "-m", "p2ptrain", "peer", "--json", "--listen", "/ip4/127.0.0.1/tcp/0",
                "--bootstrap", addr, *forwarded]  # a swarm on this machine: loopback, as its bootstrap peer
        if i == 0 and not args.fsdp:  # (FSDP: no rank holds the whole model; its checkpoints export it)
            argv += ["--save", save]
        if args.data_seed is None:
            argv += ["--data-seed", str(i)]
        children.append(_Child(i, argv, events, log=logs / f"peer-{i}.log" if logs else None))
    return _follow(children, events, _View(args.peers, args.json, addr))


def _log_dir(args: argparse.Namespace) -> Path | None:
    """``--out``/logs, where each peer's log goes (its warnings; -v adds more); None if it cannot
    be made."""
    logs = Path(args.out) / "logs"
    try:
        logs.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"warning: the peers' logs are not kept: cannot create {logs} ({e.strerror})", file=sys.stderr)
        return None
    print(f"each peer's log goes to {logs}/peer-N.log", file=sys.stderr if args.json else sys.stdout, flush=True)
    return logs


def _reap(children: list[_Child], grace: float = 10.0) -> None:
    """Ask every child to stop, give them ``grace`` seconds together, then kill what is left."""
    for c in children:
        c.signal(signal.SIGINT)
    deadline = time.monotonic() + grace
    for c in children:
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.signal(signal.SIGKILL)
            c.proc.wait()


def _follow(children: list[_Child], events: queue.Queue, view: _View) -> int:
    """Show events until every training peer has exited; the exit code sums up theirs."""
    open_streams = {c.index for c in children if c.index >= 0}
    with view:
        while open_streams:
            try:
                index, line = events.get(timeout=0.5)
            except queue.Empty:
                view.refresh()
                continue
            if index < 0:
                continue
            if line is None:
                open_streams.discard(index)
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            view.update(index, event)
    failed = []
    for c in children:
        if c.index < 0:
            continue
        if c.proc.wait() != 0:
            failed.append(c)
    view.summary()
    for c in failed:
        tail = "".join(c.stderr).strip().splitlines()[-1:] or ["(no output)"]
        fail(f"peer {c.index} exited with code {c.proc.returncode}: {tail[0]}")
    return EXIT_FAILURE if failed else EXIT_OK


class _View:
    """One live table of the peers (rich), or their events as JSON lines."""

    def __init__(self, n: int, as_json: bool, addr: str):
        self.n = n
        self.as_json = as_json
        self.addr = addr
        self.rows: dict[int, dict[str, Any]] = {}
        self.t0 = time.monotonic()
        self._live: Any = None

    def __enter__(self) -> _View:
        if not self.as_json:
            from rich.live import Live

            console = make_console()
            console.print(f"swarm of {self.n} peers, bootstrap {self.addr}", soft_wrap=True)  # an address stays whole
            self._live = Live(self._table(), console=console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self._table())
            self._live.__exit__(*exc)

    def update(self, index: int, event: dict[str, Any]) -> None:
        row = self.rows.setdefault(index, {})
        if event.get("event") == "started" and "peer_id" in row:
            return  # one started event per peer, whatever its process printed
        if not event.get("rank"):  # (another rank of a --nproc-per-node peer says only where it ended)
            row.update(event)
        if self.as_json:
            print(json.dumps({"peer": index, **event}), flush=True)
        else:
            self.refresh()

    def refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._table())

    def _table(self) -> Any:
        from rich.table import Table

        swarm_sps = max((r.get("swarm_sps", 0) for r in self.rows.values()), default=0)
        epoch = max((r.get("epoch", 0) for r in self.rows.values()), default=0)
        t = Table(title=f"epoch {epoch}   swarm {swarm_sps:,.0f} samples/s   {time.monotonic() - self.t0:.0f} s",
                  title_justify="left")
        for col in ("peer", "epoch", "loss", "samples/s", "group", "sent MB", "test"):
            t.add_column(col, justify="left" if col == "test" else "right", no_wrap=True)
        for i in range(self.n):
            r = self.rows.get(i, {})
            kind = r.get("event")
            test = format_metrics(r.get("metrics", {})) if kind == "done" else \
                {None: "starting", "waiting": "waiting for peers"}.get(kind, "training")
            loss = r.get("loss")
            t.add_row(str(i), str(r.get("epoch", "")), "" if loss is None else f"{loss:.3f}",
                      f"{r.get('local_sps', 0):,.0f}", str(r.get("group_size", "")),
                      f"{r.get('bytes_sent', 0) / 1e6:.1f}", test)
        return t

    def summary(self) -> None:
        """The verdict: did the peers end with the same parameters, and where is the model."""
        saved = [r["saved"] for r in self.rows.values() if r.get("saved")]
        digests = {r.get("params_digest") for r in self.rows.values() if r.get("event") == "done"}
        if self.as_json:
            print(json.dumps({"event": "summary", "peers": self.n, "peers_done": sum(
                r.get("event") == "done" for r in self.rows.values()), "same_parameters": len(digests) == 1,
                "distinct_states": len(digests), "saved": saved}), flush=True)
            return
        print()
        if len(digests) == 1:
            print("every peer ended with the same parameters")
        elif digests:
            print(f"the peers ended in {len(digests)} different states (a final round may have split the swarm)")
        for path in saved:
            print(f"trained model: {path}")

