"""What every subcommand shares: running a coroutine on the best loop, clean Ctrl+C, one-line errors,
and the options of joining a swarm (bootstrap peers, the private swarm's key)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Coroutine, Iterator, Sequence

from dht import ConfigError, DHTError, Multiaddr, SwarmKey, SwarmKeyMismatch, cancel_all

from ..background import env_bootstrap, parse_multiaddrs
from ..paths import default_data_dir

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def fail(message: str, code: int = EXIT_FAILURE) -> int:
    print(f"p2ptrain: error: {message}", file=sys.stderr)
    return code


def child_python() -> list[str]:
    """The interpreter, for a child process that imports p2ptrain (``[*child_python(), "-m", "p2ptrain",
    ...]``): -P keeps the working directory off its sys.path, where a folder named p2ptrain (the
    parent of a clone) would shadow the installed package."""
    return [sys.executable, "-P"]


def make_console(stderr: bool = False) -> Any:
    """A rich Console: the terminal's width on a terminal; elsewhere (a pipe, a file, a log) no
    width limit, so that no line is wrapped and no peer ID, multiaddr or CID is split or cut."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else 100_000)


def setup_logging(verbose: int, log_json: bool = False) -> None:
    level = logging.WARNING - 10 * min(verbose, 2)
    fmt = '{"t":"%(asctime)s","level":"%(levelname)s","logger":"%(name)s","msg":"%(message)s"}' if log_json \
        else "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt, stream=sys.stderr)


def run(main: Callable[[asyncio.Event], Coroutine[Any, Any, int]]) -> int:
    """Run ``main(stop_event)`` on uvloop when available.

    The first Ctrl+C or SIGTERM sets ``stop_event`` so the command can leave cleanly; a second
    Ctrl+C exits at once. Errors of ours become one line on stderr, never a traceback.
    """

    async def wrapper() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        presses = 0

        def on_signal() -> None:
            nonlocal presses
            presses += 1
            if presses > 1:
                print("\ninterrupted again: exiting now", file=sys.stderr)
                os._exit(EXIT_INTERRUPTED)
            print("\nstopping (Ctrl+C again to exit at once)...", file=sys.stderr)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        try:
            return await main(stop)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    try:
        try:
            import uvloop
        except ImportError:
            return asyncio.run(wrapper())
        return uvloop.run(wrapper())
    except (ConfigError, SwarmKeyMismatch) as e:  # a refused handshake: the user's settings must change
        return fail(str(e), EXIT_USAGE)
    except DHTError as e:
        return fail(str(e))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


@contextlib.contextmanager
def interrupts(first: Callable[[], None], message: str,
               second: Callable[[], None] = lambda: None) -> Iterator[Callable[[], int]]:
    """For commands that block in the main thread: the first Ctrl+C or SIGTERM prints ``message``
    and calls ``first`` (stop cleanly); a second calls ``second`` and exits at once (130).
    Yields a function giving how many interrupts arrived; restores the old handlers on exit."""
    presses = 0

    def on_signal(_signum: int, _frame: Any) -> None:
        nonlocal presses
        presses += 1
        if presses > 1:
            second()
            print("\ninterrupted again: exiting now", file=sys.stderr)
            os._exit(EXIT_INTERRUPTED)
        print(f"\n{message}", file=sys.stderr)
        first()

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield lambda: presses
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


SWARM_KEY_ENV = "P2PTRAIN_SWARM_KEY_FILE"


def add_swarm_key_arg(p: Any) -> None:
    """``--swarm-key-file``, the same on every command that joins a swarm."""
    p.add_argument("--swarm-key-file", metavar="PATH",
                   help="join a private swarm: only peers with this swarm key can connect (create one with "
                   f"'p2ptrain dht swarm-key FILE'; default: ${SWARM_KEY_ENV})")


def swarm_key_of(args: Any) -> SwarmKey | None:
    """The swarm key named by ``--swarm-key-file`` (else ``$P2PTRAIN_SWARM_KEY_FILE``), or None for
    a public swarm; a ConfigError naming the option when the file is not a readable swarm key."""
    path = getattr(args, "swarm_key_file", None)
    where = "--swarm-key-file"
    if path is None and os.environ.get(SWARM_KEY_ENV):
        path, where = os.environ[SWARM_KEY_ENV], f"${SWARM_KEY_ENV}"
    if path is None:
        return None
    if not str(path).strip():
        raise ConfigError(f"{where}: empty path")
    try:
        return SwarmKey.load(path)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def add_peer_cache_args(p: Any) -> None:
    """``--peer-cache PATH`` / ``--no-peer-cache``, the same on every command that runs a peer."""
    p.add_argument("--peer-cache", metavar="PATH",
                   help="file of recently seen peers, dialed when every bootstrap peer is unreachable, so a "
                   "restarted peer can rejoin after its bootstrap peer died (default: peers.json in the data "
                   "directory: --data-dir where the command has it, else $P2PTRAIN_DATA_DIR, else "
                   "~/.cache/p2ptrain; a private swarm's file is named after its key's fingerprint)")
    p.add_argument("--no-peer-cache", action="store_true", help="neither read nor write a peer cache")


def peer_cache_of(args: Any, swarm_key: SwarmKey | None = None) -> Path | None:
    """Where this peer keeps its peer cache: ``--peer-cache``, else a file in the data directory
    (one per swarm key, so the peers of two private swarms sharing a data directory stay apart);
    None with ``--no-peer-cache``."""
    if getattr(args, "no_peer_cache", False):
        return None
    path = getattr(args, "peer_cache", None)
    if path is not None:
        if not str(path).strip():
            raise ConfigError("--peer-cache: empty path (use --no-peer-cache to disable the cache)")
        return Path(path).expanduser()
    from dht import default_cache_name

    root = getattr(args, "data_dir", None)
    base = Path(root).expanduser() if root else default_data_dir()
    return base / default_cache_name(swarm_key.fingerprint if swarm_key is not None else None)


def split_relayed(addrs: list[str]) -> tuple[list[str], list[str]]:
    """A peer's addresses as (direct, relayed): others can join the swarm through a direct one; a
    /p2p-circuit one only reaches this peer (the DHT does not route through relays)."""
    relayed = [a for a in addrs if "/p2p-circuit/" in a]
    return [a for a in addrs if a not in relayed], relayed


#: ``--listen`` of ``p2ptrain peer`` and ``p2ptrain dht`` (the same as p2ptrain.DHT's): every interface
LISTEN_DEFAULT = "/ip4/0.0.0.0/tcp/0"
LISTEN_HELP = ("address to listen on (default: %(default)s: every interface, any free port; others are told "
               "every address of this machine they could dial, loopback excluded; /ip4/127.0.0.1/tcp/0 keeps "
               "the peer to this machine)")
ANNOUNCE_HELP = ("the one host/IP others should dial, e.g. a NAT's public address (default: the listen "
                 "address, or every interface address when listening on 0.0.0.0 or ::)")


def parse_listen(text: str) -> tuple[str, int]:
    addr = Multiaddr.parse(text)
    if addr.host_proto not in ("ip4", "ip6"):
        raise ConfigError(f"--listen {text!r}: listen on an IP address (/ip4/... or /ip6/...), not a DNS name")
    return addr.host, addr.port


def read_bootstrap_file(path: str | os.PathLike[str]) -> list[Multiaddr]:
    """Multiaddrs from a bootstrap file: one per line, '#' starts a comment, blank lines ignored."""
    out = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read bootstrap file {path}: {e.strerror}") from None
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if line:
            try:
                out.append(Multiaddr.parse(line))
            except ConfigError as e:
                raise ConfigError(f"{path}:{number}: {e}") from None
    return out


def bootstrap_addrs(flags: Sequence[str | Multiaddr] | None, bootstrap_file: str | None) -> list[Multiaddr]:
    """The command's bootstrap peers, parsed once here (``p2ptrain peer``'s flags were, by its config
    check): ``--bootstrap`` flags win; else ``--bootstrap-file``, ``$P2PTRAIN_BOOTSTRAP``, then
    ./bootstrap_peers.txt."""
    if flags:
        return parse_multiaddrs(flags, "--bootstrap")
    if bootstrap_file:
        return read_bootstrap_file(bootstrap_file)
    env = env_bootstrap()
    if env:
        return env
    default = Path("bootstrap_peers.txt")
    return read_bootstrap_file(default) if default.exists() else []


@contextlib.contextmanager
def joining(bootstrap: Sequence[Any], timeout: float, quiet_for: float = 1.0) -> Iterator[None]:
    """Around a join through ``bootstrap``: once it has taken ``quiet_for`` seconds, say on stderr that
    the bootstrap peers do not answer yet, with the time spent, in one line rewritten in place on
    a terminal (a single line elsewhere); a prompt join prints nothing."""
    if not bootstrap:
        yield
        return
    through = str(bootstrap[0]) + (f" (and {len(bootstrap) - 1} more)" if len(bootstrap) > 1 else "")
    tty = sys.stderr.isatty()
    done = threading.Event()

    def tick() -> None:
        t0 = time.monotonic()
        shown = False
        while not done.wait(0.2 if shown else quiet_for):
            elapsed = time.monotonic() - t0
            if tty:
                print(f"\rjoining through {through}: no answer yet, retrying ({elapsed:.1f} s of {timeout:g} s)",
                      end="", file=sys.stderr, flush=True)
            elif not shown:
                print(f"joining through {through}: no answer yet, retrying for up to {timeout:g} s", file=sys.stderr,
                      flush=True)
            shown = True
        if shown and tty:
            print(file=sys.stderr, flush=True)

    ticker = threading.Thread(target=tick, name="join-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()


async def until(stop: asyncio.Event, awaitable: Awaitable[Any]) -> Any:
    """Await ``awaitable`` unless ``stop`` is set first (then cancel it and return None)."""
    task = asyncio.ensure_future(awaitable)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        return None
    finally:
        await cancel_all((task, stopper))
