"""The ``p2ptrain`` command line: one small module per subcommand, wired up here."""

from __future__ import annotations

import argparse
import gc
import sys

from .. import __version__
from . import ckpt_cmd, data_cmd, demo, dht_cmd, peer_cmd, status_cmd, swarm_cmd
from .common import EXIT_USAGE, fail, setup_logging
from .parser import CommandParser


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="p2ptrain",
        description="Peer-to-peer decentralized training for PyTorch: peers find each other through a "
        "Kademlia DHT, with no master.",
    )
    parser.add_argument("--version", action="version", version=f"p2ptrain {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    parser.add_argument("--log-json", action="store_true", help="log as JSON lines on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    ckpt_cmd.add_parser(sub)
    data_cmd.add_parser(sub)
    demo.add_parser(sub)
    dht_cmd.add_parser(sub)
    peer_cmd.add_parser(sub)
    status_cmd.add_parser(sub)
    swarm_cmd.add_parser(sub)
    for command in sub.choices.values():
        _add_logging_flags(command, 1)
    return parser


def _add_logging_flags(parser: argparse.ArgumentParser, depth: int) -> None:
    """-v and --log-json also after the command (``p2ptrain peer -v``, ``p2ptrain ckpt ls -v``), where
    its --help shows them; all the -v count, wherever given. One dest per command depth: argparse
    copies a subcommand's whole namespace up over its parent's, so a shared dest would lose what
    the parent counted."""
    parser.add_argument("-v", "--verbose", dest=f"verbose_{depth}", action="count", default=0,
                        help="more logging (-vv for debug)")
    parser.add_argument("--log-json", dest=f"log_json_{depth}", action="store_true",
                        help="log as JSON lines on stderr")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for nested in action.choices.values():
                _add_logging_flags(nested, depth + 1)


def logging_options(args: argparse.Namespace) -> tuple[int, bool]:
    """(-v count, --log-json) from wherever on the command line they were given."""
    flags = vars(args)
    verbose = args.verbose + sum(v for k, v in flags.items() if k.startswith("verbose_"))
    return verbose, args.log_json or any(v for k, v in flags.items() if k.startswith("log_json_"))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # (a --nproc-per-node peer runs it again)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    setup_logging(*logging_options(args))
    from dht import ConfigError

    try:
        if hasattr(args, "config"):  # peer, swarm: flags > $P2PTRAIN_* > --config file > defaults
            from ..config import apply_config

            apply_config(args, build_parser, args.argv)
        gc.freeze()  # what the imports made lives until exit: no full collection walks it (each takes ~0.2 s)
        code = args.func(args)
        gc.freeze()  # ...nor the interpreter's collections at exit, ~1 s of CPU per peer process
        return code
    except ConfigError as e:
        return fail(str(e), EXIT_USAGE)


if __name__ == "__main__":
    sys.exit(main())
